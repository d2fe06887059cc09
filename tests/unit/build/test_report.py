# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon``: the one-line report that the installed DeepSpeed is the patched build.

Run on the installed build (the venv ``dev.py`` makes), it must name ``deepspeed.__version__``,
the base and patch versions of ``_build_info`` and the patches of this repository's
``patches/<base>/``, and exit 0. Without ``_build_info``, with an installed file whose sha256 is not
the one the build recorded in ``_build_info.PATCHED_FILES`` (or that is missing), or with a version
that does not match the build info, it says so on one line and exits 1.

The tests of the report's logic run this repository's ``__main__.py`` (loaded by path) on fake
packages and build infos in temporary directories, so they hold whichever build is installed; only
``test_report_on_installed_build`` runs the installed module.
"""

import hashlib
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
MODULE = "deepspeed.runtime.zero.muon"
REPORT_PATH = REPO_ROOT / "deepspeed" / "runtime" / "zero" / "muon" / "__main__.py"
SUCCESS_MODE = "ZeRO-3 Muon update: owner-centric at the accumulation boundary"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rm = _load("zero3muon_report_under_test", REPORT_PATH)
zb = _load("zero3muon_build_for_report", REPO_ROOT / "build_backend" / "zero3muon_build.py")


def run_python(*args):
    return subprocess.run([sys.executable, *args],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE,
                          text=True,
                          timeout=300)


def test_report_on_installed_build():
    import deepspeed
    from deepspeed.runtime.zero.muon import _build_info as info
    if not hasattr(info, "PATCHED_FILES"):
        pytest.skip(f"the installed build's _build_info ({info.__file__}) predates PATCHED_FILES (built by an "
                    "older zero3muon build backend): rebuild the venv to check the installed build")
    proc = run_python("-m", MODULE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert deepspeed.__version__ == f"{info.BASE_VERSION}+zero3muon"
    repo_patches = sorted((REPO_ROOT / "patches" / info.BASE_VERSION).glob("*.patch"))
    assert info.PATCHES == tuple(p.name for p in repo_patches), \
        "the installed build is not built from this repository's patches"
    assert sorted(info.PATCHED_FILES) == zb.patched_package_files(repo_patches), \
        "the installed build did not record the files this repository's patches change"
    patches = ", ".join(name[:-len(".patch")] for name in info.PATCHES)
    expected = (f"deepspeed {deepspeed.__version__}: upstream {info.BASE_VERSION}, zero3muon {info.PATCH_VERSION}, "
                "ZeRO-3 Muon update: owner-centric at the accumulation boundary "
                f"(patches {patches})")
    assert proc.stdout.splitlines() == [expected], proc.stdout


def test_report_without_build_info():
    # `None` in sys.modules makes `import ..._build_info` raise ImportError, as on a stock install.
    code = ("import runpy, sys\n"
            f"sys.modules['{MODULE}._build_info'] = None\n"
            f"runpy.run_path({str(REPORT_PATH)!r}, run_name='__main__')\n")
    proc = run_python("-c", code)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "not the zero3muon build" in lines[0] and "_build_info.py" in lines[0], proc.stdout


def fake_build(tmp_path, files=None, **overrides):
    """A fake installed package under tmp_path and the build info that matches it: (package, info)."""
    package = tmp_path / "site" / "deepspeed"
    files = files if files is not None else {
        "runtime/zero/stage3.py": "# patched stage3\n",
        "runtime/engine.py": "# patched engine\n"
    }
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    info = types.SimpleNamespace(
        BASE_VERSION="9.9.9",
        PATCH_VERSION="0.1.0",
        PATCHES=("0001-stage3.patch", "0002-engine.patch"),
        PATCHED_FILES={rel: hashlib.sha256((package / rel).read_bytes()).hexdigest()
                       for rel in sorted(files)})
    for key, value in overrides.items():
        setattr(info, key, value)
    return package, info


def test_report_on_consistent_fake_build(tmp_path):
    package, info = fake_build(tmp_path)
    status, line = rm.report_for("9.9.9+zero3muon", package, info)
    assert status == 0, line
    assert line == f"deepspeed 9.9.9+zero3muon: upstream 9.9.9, zero3muon 0.1.0, {SUCCESS_MODE} " \
        "(patches 0001-stage3, 0002-engine)"


@pytest.mark.parametrize("case", ["changed file", "missing file", "directory in its place", "version mismatch"])
def test_report_on_inconsistent_build(case, tmp_path):
    package, info = fake_build(tmp_path)
    version = "9.9.9+zero3muon"
    stage3 = package / "runtime" / "zero" / "stage3.py"
    if case == "changed file":
        stage3.write_text("# patched stage3\n# edited after the build\n")
        expected = f"{stage3} (sha256 differs)"
    elif case == "missing file":
        stage3.unlink()
        expected = f"{stage3} (missing)"
    elif case == "directory in its place":
        stage3.unlink()
        stage3.mkdir()
        expected = f"{stage3} (missing)"
    else:
        version = "9.9.9"
        expected = "the version is not 9.9.9+zero3muon"
    status, line = rm.report_for(version, package, info)
    assert status == 1
    assert "NOT the patched one" in line and expected in line and "\n" not in line, line
    assert str(package / "runtime" / "engine.py") not in line, line  # the file that matches is not named


def test_report_names_every_file_that_does_not_match(tmp_path):
    package, info = fake_build(tmp_path)
    (package / "runtime" / "engine.py").write_text("# stock engine\n")
    (package / "runtime" / "zero" / "stage3.py").unlink()
    status, line = rm.report_for("9.9.9+zero3muon", package, info)
    assert status == 1 and "\n" not in line
    assert line.endswith("NOT the patched one: file(s) not as the build patched them: "
                         f"{package / 'runtime/engine.py'} (sha256 differs), "
                         f"{package / 'runtime/zero/stage3.py'} (missing)"), line


def test_unreadable_file_is_reported_not_raised(tmp_path, monkeypatch):
    package, info = fake_build(tmp_path)

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(rm, "_sha256", refuse)
    problems = rm.unpatched_files(package, info.PATCHED_FILES)
    assert problems == [f"{package / rel} (unreadable: Permission denied)" for rel in info.PATCHED_FILES]


def test_build_info_without_patched_files_is_not_the_patched_one(tmp_path):
    """A build info written by an older build backend: the files cannot be checked, so the report says so."""
    package, info = fake_build(tmp_path)
    del info.PATCHED_FILES
    status, line = rm.report_for("9.9.9+zero3muon", package, info)
    assert status == 1 and "NOT the patched one" in line and "no PATCHED_FILES" in line and "\n" not in line


def test_report_runs_on_a_package_copy_without_the_repository(tmp_path):
    """The hash check reads only the installed package: a copy of it with its build info, outside the repo,
    run as ``python -m`` in a fresh interpreter whose ``deepspeed`` is a stand-in package in tmp_path."""
    package, info = fake_build(tmp_path, files={"runtime/zero/stage3.py": "# patched stage3\n"})
    muon = package / "runtime" / "zero" / "muon"
    muon.mkdir(parents=True)
    for init in (package, package / "runtime", package / "runtime" / "zero", muon):
        if not (init / "__init__.py").exists():
            (init / "__init__.py").write_text("")
    (package / "__init__.py").write_text("__version__ = '9.9.9+zero3muon'\n")
    (muon / "__main__.py").write_bytes(REPORT_PATH.read_bytes())
    (muon / "_build_info.py").write_text(f"BASE_VERSION = '9.9.9'\nPATCH_VERSION = '0.1.0'\n"
                                         f"PATCHES = ('0001-stage3.patch', )\n"
                                         f"PATCHED_FILES = {info.PATCHED_FILES!r}\n")
    # -I: no PYTHONPATH, no current directory on sys.path; only the copy's parent is put first
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import runpy; "
            f"runpy.run_module('{MODULE}', run_name='__main__', alter_sys=True)")
    proc = run_python("-I", "-c", code, str(package.parent))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.endswith(f"{SUCCESS_MODE} (patches 0001-stage3)\n"), proc.stdout
    (package / "runtime" / "zero" / "stage3.py").write_text("# stock stage3\n")
    proc = run_python("-I", "-c", code, str(package.parent))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "deepspeed 9.9.9+zero3muon: upstream 9.9.9, zero3muon 0.1.0, ZeRO-3 Muon update: NOT the patched one: "
        f"file(s) not as the build patched them: {package / 'runtime/zero/stage3.py'} (sha256 differs)"
    ], proc.stdout


@pytest.mark.parametrize("base", sorted(p.name for p in (REPO_ROOT / "patches").iterdir() if p.is_dir()))
def test_every_patch_of_each_base_changes_a_checked_file(base):
    """Each patch changes a file of the package, so the build's PATCHED_FILES covers every patch of the base;
    a base's own patch (0.19.7's backport 0005) brings its file in on that base only."""
    patches = zb.list_patches(base, REPO_ROOT)
    assert patches
    unchecked = [p.name for p in patches if not zb.patched_package_files([p])]
    assert not unchecked, unchecked
    files = zb.patched_package_files(patches)
    assert "runtime/zero/stage3.py" in files
    assert ("runtime/zero/partition_parameters.py" in files) == any(p.name.startswith("0005-") for p in patches)
