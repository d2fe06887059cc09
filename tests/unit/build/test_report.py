# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon``: the one-line report that the installed DeepSpeed is the patched build.

Run on the installed build (the venv ``dev.py`` makes), it must name ``deepspeed.__version__``,
the base and patch versions of ``_build_info`` and the patches of this repository's
``patches/<base>/``, and exit 0. Without ``_build_info``, or with a ``stage3.py`` that lacks a
patch, or a version that does not match the build info, it says so on one line and exits 1.
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
        monkeypatch.setattr(report_module, "PATCH_MARKERS", (("0001", "a marker no stage3.py contains"), ))
        expected = "lacks patch(es) 0001"
    status, line = report_module.report()
    assert status == 1
    assert "NOT the patched one" in line and expected in line and "\n" not in line
