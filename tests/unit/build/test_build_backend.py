"""Tests of the build backend's tree preparation (build_backend/zero3muon_build.py).

They use tiny fake sdists made in tmp_path: no network, no torch, no wheel build.
"""

import hashlib
import importlib.util
import io
import re
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def _load_backend():
    path = REPO_ROOT / "build_backend" / "zero3muon_build.py"
    spec = importlib.util.spec_from_file_location("zero3muon_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["zero3muon_build"] = module
    spec.loader.exec_module(module)
    return module


zb = _load_backend()

BASE = "9.9.9"
STAGE3 = "# Copyright\n# upstream stage3\n\nclass DeepSpeedZeroOptimizer_Stage3:\n    pass\n"


def make_sdist(tmp_path, extra_members=()):
    """A fake deepspeed-9.9.9.tar.gz; returns (path, sha256)."""
    files = {
        "setup.py": "from setuptools import setup\nsetup()\n",
        "version.txt": BASE + "\n",
        "deepspeed/__init__.py": "",
        "deepspeed/runtime/zero/stage3.py": STAGE3,
        "deepspeed/runtime/zero/muon/__init__.py": "",
    }
    path = tmp_path / f"deepspeed-{BASE}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"deepspeed-{BASE}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra_members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def stage3_patch(old_line, new_line):
    """A git-style diff replacing line 2 of the fake stage3.py."""
    return ("diff --git a/deepspeed/runtime/zero/stage3.py b/deepspeed/runtime/zero/stage3.py\n"
            "--- a/deepspeed/runtime/zero/stage3.py\n"
            "+++ b/deepspeed/runtime/zero/stage3.py\n"
            "@@ -1,3 +1,3 @@\n"
            " # Copyright\n"
            f"-{old_line}\n"
            f"+{new_line}\n"
            " \n")


def make_repo(tmp_path, patches=None, new_files=None):
    """A fake project checkout with deepspeed/ (new files) and patches/9.9.9/."""
    repo = tmp_path / "repo"
    if new_files is None:
        new_files = {"deepspeed/runtime/zero/muon/owner_plan.py": "PLAN = 1\n"}
    if patches is None:
        patches = {"0001-stage3.patch": stage3_patch("# upstream stage3", "# patched stage3")}
    for rel, text in new_files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    (repo / "patches" / BASE).mkdir(parents=True)
    for name, text in patches.items():
        (repo / "patches" / BASE / name).write_text(text)
    return repo


def prepare(tmp_path, repo, sdist, sha):
    work = tmp_path / "work"
    work.mkdir()
    return zb.prepare_tree(sdist, sha, BASE, "0.1.0", work, repo_root=repo)


def test_prepare_tree_overlays_patches_and_labels(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    repo = make_repo(tmp_path)
    pycache = repo / "deepspeed/runtime/zero/muon/__pycache__"
    pycache.mkdir()
    (pycache / "owner_plan.cpython-311.pyc").write_bytes(b"junk")

    tree = prepare(tmp_path, repo, sdist, sha)

    assert (tree / "deepspeed/runtime/zero/muon/owner_plan.py").read_text() == "PLAN = 1\n"
    assert not (tree / "deepspeed/runtime/zero/muon/__pycache__").exists()
    assert "# patched stage3" in (tree / "deepspeed/runtime/zero/stage3.py").read_text()
    assert "# upstream stage3" not in (tree / "deepspeed/runtime/zero/stage3.py").read_text()
    assert (tree / "build.txt").read_text().strip() == "+zero3muon"
    # what DeepSpeed's setup.py makes of it
    version = (tree / "version.txt").read_text().strip() + (tree / "build.txt").read_text().strip()
    assert version == "9.9.9+zero3muon"

    info = {}
    exec((tree / "deepspeed/runtime/zero/muon/_build_info.py").read_text(), info)
    assert info["BASE_VERSION"] == BASE
    assert info["PATCH_VERSION"] == "0.1.0"
    assert info["SDIST_SHA256"] == sha
    assert info["PATCHES"] == ("0001-stage3.patch",)
    stage3_sha = hashlib.sha256((tree / "deepspeed/runtime/zero/stage3.py").read_bytes()).hexdigest()
    assert info["PATCHED_FILES"] == {"runtime/zero/stage3.py": stage3_sha}
    # nothing generated in the repository
    assert not (repo / "deepspeed/runtime/zero/muon/_build_info.py").exists()
    assert not (repo / "build.txt").exists()


def test_hash_mismatch_names_file_and_both_hashes(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    wrong = "0" * 64
    with pytest.raises(zb.BuildError) as exc:
        prepare(tmp_path, make_repo(tmp_path), sdist, wrong)
    msg = str(exc.value)
    assert str(sdist) in msg
    assert wrong in msg and sha in msg


def test_patch_that_does_not_apply_names_the_patch(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    bad = stage3_patch("# a line that is not upstream", "# patched")
    repo = make_repo(tmp_path, patches={"0001-good.patch": stage3_patch("# upstream stage3", "# patched stage3"),
                                        "0002-bad.patch": bad})
    with pytest.raises(zb.BuildError) as exc:
        prepare(tmp_path, repo, sdist, sha)
    msg = str(exc.value)
    assert "0002-bad.patch" in msg
    assert "0001-good.patch" not in msg
    assert "error:" in msg  # git's own stderr is included


def test_patches_are_applied_in_sorted_order(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    # a chain: each patch only applies on top of the previous one; written in reverse order
    steps = ["# upstream stage3", "# step 1", "# step 2", "# step 3", "# step 4"]
    names = [f"000{i}-step.patch" for i in range(1, 5)]
    patches = {names[i]: stage3_patch(steps[i], steps[i + 1]) for i in reversed(range(4))}
    tree = prepare(tmp_path, make_repo(tmp_path, patches=patches), sdist, sha)
    assert "# step 4" in (tree / "deepspeed/runtime/zero/stage3.py").read_text()
    info = {}
    exec((tree / "deepspeed/runtime/zero/muon/_build_info.py").read_text(), info)
    assert info["PATCHES"] == tuple(names)
    # the file as it stands after the whole series, not after the first patch that changes it
    final = hashlib.sha256((tree / "deepspeed/runtime/zero/stage3.py").read_bytes()).hexdigest()
    assert info["PATCHED_FILES"] == {"runtime/zero/stage3.py": final}


def _load_report():
    path = REPO_ROOT / "deepspeed" / "runtime" / "zero" / "muon" / "__main__.py"
    spec = importlib.util.spec_from_file_location("zero3muon_report_for_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def header(old, new):
    return f"diff --git a/{old} b/{new}\n"


def new_file_patch(rel, text):
    return (header(rel, rel) + "new file mode 100644\n--- /dev/null\n" + f"+++ b/{rel}\n@@ -0,0 +1 @@\n+{text}\n")


def test_patched_files_cover_new_files_and_leave_out_files_outside_the_package(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    patches = {
        "0001-stage3.patch": stage3_patch("# upstream stage3", "# patched stage3"),
        "0002-new.patch": new_file_patch("deepspeed/runtime/zero/extra.py", "EXTRA = 1"),
        "0003-outside.patch": new_file_patch("tests/unit/test_extra.py", "def test_extra(): pass"),
    }
    tree = prepare(tmp_path, make_repo(tmp_path, patches=patches), sdist, sha)
    assert (tree / "tests/unit/test_extra.py").is_file()
    info = {}
    exec((tree / "deepspeed/runtime/zero/muon/_build_info.py").read_text(), info)
    assert info["PATCHED_FILES"] == {
        rel: hashlib.sha256((tree / "deepspeed" / rel).read_bytes()).hexdigest()
        for rel in ("runtime/zero/extra.py", "runtime/zero/stage3.py")
    }
    assert list(info["PATCHED_FILES"]) == sorted(info["PATCHED_FILES"])


def test_patched_files_refuse_an_unreadable_header(tmp_path):
    patch = tmp_path / "0001-spaces.patch"
    patch.write_text(header("deepspeed/my file.py", "deepspeed/my file.py") + "--- a/x\n+++ b/x\n")
    with pytest.raises(zb.BuildError, match="0001-spaces.patch") as exc:
        zb.patched_package_files([patch])
    assert "cannot read the file names" in str(exc.value)


def test_patch_that_deletes_a_file_is_refused(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    rel = "deepspeed/runtime/zero/stage3.py"
    deletion = (header(rel, rel) + "deleted file mode 100644\n" + f"--- a/{rel}\n+++ /dev/null\n" +
                "@@ -1,5 +0,0 @@\n" + "".join(f"-{line}\n" for line in STAGE3.splitlines()))
    with pytest.raises(zb.BuildError, match="deleted file is not supported") as exc:
        prepare(tmp_path, make_repo(tmp_path, patches={"0001-delete.patch": deletion}), sdist, sha)
    assert rel in str(exc.value)


def test_report_checks_the_prepared_package_against_its_build_info(tmp_path):
    """The hashes the build records are those of the files it packages: the report passes on the prepared
    ``deepspeed/`` and names a patched file edited afterwards (what an installed copy would show)."""
    report = _load_report()
    sdist, sha = make_sdist(tmp_path)
    tree = prepare(tmp_path, make_repo(tmp_path), sdist, sha)
    info = types.SimpleNamespace()
    exec((tree / "deepspeed/runtime/zero/muon/_build_info.py").read_text(), vars(info))
    status, line = report.report_for("9.9.9+zero3muon", tree / "deepspeed", info)
    assert status == 0 and line.endswith("(patches 0001-stage3)"), line
    stage3 = tree / "deepspeed/runtime/zero/stage3.py"
    stage3.write_text(STAGE3)  # the stock file back in place
    status, line = report.report_for("9.9.9+zero3muon", tree / "deepspeed", info)
    assert status == 1 and line.endswith(f"NOT the patched one: file(s) not as the build patched them: {stage3} "
                                         "(sha256 differs)"), line


def test_refuses_to_overwrite_upstream_file(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    repo = make_repo(tmp_path, new_files={"deepspeed/runtime/zero/muon/owner_plan.py": "x = 1\n",
                                          "deepspeed/runtime/zero/stage3.py": "# my own stage3\n"},
                     patches={})
    with pytest.raises(zb.BuildError) as exc:
        prepare(tmp_path, repo, sdist, sha)
    msg = str(exc.value)
    assert "deepspeed/runtime/zero/stage3.py" in msg
    assert "owner_plan.py" not in msg
    assert "must be patches under patches/" in msg


def test_refuses_generated_build_info_in_repo(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    repo = make_repo(tmp_path, new_files={"deepspeed/runtime/zero/muon/_build_info.py": "BASE_VERSION = 'x'\n"})
    with pytest.raises(zb.BuildError, match="_build_info.py"):
        prepare(tmp_path, repo, sdist, sha)


def test_missing_patch_dir_is_an_error(tmp_path):
    sdist, sha = make_sdist(tmp_path)
    repo = make_repo(tmp_path)
    (repo / "patches" / BASE).rename(repo / "patches" / "0.0.1")
    with pytest.raises(zb.BuildError, match=re.escape(str(repo / "patches" / BASE))):
        prepare(tmp_path, repo, sdist, sha)


def test_patches_apply_when_work_dir_is_inside_a_git_repo(tmp_path):
    # git apply inside a repository resolves paths against that repository's root;
    # the backend must treat the unpacked tree as a plain directory.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    sdist, sha = make_sdist(tmp_path)
    tree = prepare(tmp_path, make_repo(tmp_path), sdist, sha)
    assert "# patched stage3" in (tree / "deepspeed/runtime/zero/stage3.py").read_text()


def test_unsafe_archive_member_is_refused(tmp_path):
    evil = tarfile.TarInfo("../evil.txt")
    evil.size = 4
    sdist, sha = make_sdist(tmp_path, extra_members=[(evil, b"evil")])
    with pytest.raises(zb.BuildError, match="unsafe"):
        prepare(tmp_path, make_repo(tmp_path), sdist, sha)
    assert not (tmp_path / "evil.txt").exists()


def test_git_missing_is_a_clear_error(tmp_path, monkeypatch):
    sdist, sha = make_sdist(tmp_path)
    monkeypatch.setattr(zb.shutil, "which", lambda name: None)
    with pytest.raises(zb.BuildError, match="git"):
        prepare(tmp_path, make_repo(tmp_path), sdist, sha)


def test_unknown_base_lists_known_ones(monkeypatch):
    monkeypatch.delenv(zb.ENV_BASE, raising=False)
    cfg = {"version": "0.1.0", "default-base": "1.0.0", "sdist-sha256": {"1.0.0": "a" * 64, "1.0.1": "b" * 64}}
    assert zb.select_base(cfg) == "1.0.0"
    monkeypatch.setenv(zb.ENV_BASE, "1.0.1")
    assert zb.select_base(cfg) == "1.0.1"
    with pytest.raises(zb.BuildError) as exc:
        zb.select_base(cfg, "0.5")
    assert "'0.5'" in str(exc.value) and "1.0.0, 1.0.1" in str(exc.value)


def test_obtain_sdist_uses_local_file_or_cache_without_pip(tmp_path, monkeypatch):
    sdist, sha = make_sdist(tmp_path)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run")

    monkeypatch.setattr(zb.subprocess, "run", no_pip)
    monkeypatch.setenv(zb.ENV_SDIST, str(sdist))
    assert zb.obtain_sdist(BASE, sha) == sdist.resolve()
    with pytest.raises(zb.BuildError, match="sha256 mismatch"):
        zb.obtain_sdist(BASE, "f" * 64)

    monkeypatch.delenv(zb.ENV_SDIST)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / sdist.name).write_bytes(sdist.read_bytes())
    assert zb.obtain_sdist(BASE, sha, cache_dir=cache) == cache / sdist.name


def test_project_config_pins():
    cfg = zb.load_config(REPO_ROOT)
    assert cfg["default-base"] in cfg["sdist-sha256"]
    for base, sha in cfg["sdist-sha256"].items():
        assert re.fullmatch(r"[0-9a-f]{64}", sha), base
        assert (REPO_ROOT / "patches" / base).is_dir(), f"no patches/{base}/ for pinned base {base}"
    assert not (REPO_ROOT / zb.BUILD_INFO_REL).exists(), "the generated _build_info.py must not be in the repo"


def test_build_sdist_holds_the_build_inputs_only(tmp_path, monkeypatch):
    monkeypatch.delenv(zb.ENV_BASE, raising=False)
    name = zb.build_sdist(str(tmp_path))
    cfg = zb.load_config(REPO_ROOT)
    stem = f"deepspeed-{cfg['default-base']}+zero3muon"
    assert name == f"{stem}.tar.gz"
    with tarfile.open(tmp_path / name) as tar:
        names = set(tar.getnames())
    assert {f"{stem}/pyproject.toml", f"{stem}/build_backend/zero3muon_build.py", f"{stem}/PKG-INFO"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if not n.startswith(f"{stem}/")]
