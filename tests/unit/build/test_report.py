# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon``: the one-line report that the installed DeepSpeed is the patched build.

Run on the installed build (the venv ``dev.py`` makes), it must name ``deepspeed.__version__``,
the base and patch versions of ``_build_info`` and the patches of this repository's
``patches/<base>/``, and exit 0. Without ``_build_info``, or with an installed file that lacks a
patch of its base (``PATCH_MARKERS``), or a version that does not match the build info, it says so
on one line and exits 1.
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
MODULE = "deepspeed.runtime.zero.muon"


def run_python(*args):
    return subprocess.run([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=300)


def test_report_on_installed_build():
    import deepspeed
    from deepspeed.runtime.zero.muon import _build_info as info
    proc = run_python("-m", MODULE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert deepspeed.__version__ == f"{info.BASE_VERSION}+zero3muon"
    repo_patches = tuple(p.name for p in sorted((REPO_ROOT / "patches" / info.BASE_VERSION).glob("*.patch")))
    assert info.PATCHES == repo_patches, "the installed build is not built from this repository's patches"
    patches = ", ".join(name[:-len(".patch")] for name in info.PATCHES)
    expected = (f"deepspeed {deepspeed.__version__}: upstream {info.BASE_VERSION}, zero3muon {info.PATCH_VERSION}, "
                "ZeRO-3 Muon update: owner-centric at the accumulation boundary "
                f"(patches {patches})")
    assert proc.stdout.splitlines() == [expected], proc.stdout


def test_report_without_build_info():
    # `None` in sys.modules makes `import ..._build_info` raise ImportError, as on a stock install.
    code = ("import runpy, sys\n"
            f"sys.modules['{MODULE}._build_info'] = None\n"
            f"runpy.run_module('{MODULE}', run_name='__main__', alter_sys=True)\n")
    proc = run_python("-c", code)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "not the zero3muon build" in lines[0] and "_build_info.py" in lines[0], proc.stdout


@pytest.mark.parametrize("case", ["stage3 without patch 0001", "version mismatch"])
def test_report_on_inconsistent_build(case, monkeypatch):
    import deepspeed
    from deepspeed.runtime.zero.muon import __main__ as report_module
    if case == "version mismatch":
        monkeypatch.setattr(deepspeed, "__version__", "9.9.9")
        expected = "the version is not"
    else:
        monkeypatch.setattr(report_module, "PATCH_MARKERS",
                            (("0001", "runtime/zero/stage3.py", "a marker no stage3.py contains", None), ))
        expected = "lacks patch(es) 0001 ("
    status, line = report_module.report()
    assert status == 1
    assert "NOT the patched one" in line and expected in line and "\n" not in line


def test_markers_cover_the_patches_of_each_base():
    """Every patch of every base has a marker for that base, and no marker names a patch the base lacks."""
    from deepspeed.runtime.zero.muon import __main__ as report_module
    for base_dir in sorted((REPO_ROOT / "patches").iterdir()):
        numbers = {p.name[:4] for p in base_dir.glob("*.patch")}
        marked = {num for num, _, _, bases in report_module.PATCH_MARKERS if bases is None or base_dir.name in bases}
        assert marked <= numbers, (base_dir.name, sorted(marked - numbers))
        assert numbers <= marked, (base_dir.name, sorted(numbers - marked))


def test_marker_of_another_base_is_not_checked(monkeypatch):
    """A marker listed for other bases only (like 0005, 0.19.7's backport) does not fail the report elsewhere."""
    from deepspeed.runtime.zero.muon import __main__ as report_module
    from deepspeed.runtime.zero.muon import _build_info as info
    markers = report_module.PATCH_MARKERS
    absent = ("0009", "runtime/zero/stage3.py", "a marker no stage3.py contains")
    monkeypatch.setattr(report_module, "PATCH_MARKERS", markers + (absent + (("0.0.1", ), ), ))
    assert report_module.report()[0] == 0
    monkeypatch.setattr(report_module, "PATCH_MARKERS", markers + (absent + ((info.BASE_VERSION, ), ), ))
    status, line = report_module.report()
    assert status == 1 and "lacks patch(es) 0009" in line
