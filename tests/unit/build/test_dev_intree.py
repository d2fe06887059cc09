"""Tests of ``python3 dev.py intree``'s copy of DeepSpeed's tests/ (``deepspeed_tests``) and of its
membership of the exported tests; no venv, no pytest run inside DeepSpeed's tree (that is the
command itself, see docs/maintainers.md)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def _load_dev():
    spec = importlib.util.spec_from_file_location("zero3muon_dev", REPO_ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dev = _load_dev()


def _git(cwd, *args):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, stdout=subprocess.PIPE, text=True)
    return res.stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A fake DeepSpeed checkout: tests/unit/common.py, a test, version.txt; one commit."""
    repo = tmp_path / "DeepSpeed"
    (repo / "tests" / "unit" / "ops" / "muon").mkdir(parents=True)
    (repo / "tests" / "unit" / "common.py").write_text("class DistributedTest:\n    pass\n")
    (repo / "tests" / "unit" / "ops" / "muon" / "test_muon.py").write_text("def test_x():\n    pass\n")
    (repo / "version.txt").write_text("0.19.6\n")
    (repo / "setup.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "upstream")
    return repo


def test_copies_a_checkouts_tests_and_names_its_commit(checkout, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    line = dev.deepspeed_tests(checkout, "HEAD", dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "tests/unit/common.py", "tests/unit/ops/muon/test_muon.py"]
    sha = _git(checkout, "rev-parse", "HEAD")
    assert f"checkout {checkout}" in line and sha in line and "version.txt 0.19.6" in line
    assert "local changes" not in line
    (checkout / "tests" / "unit" / "common.py").write_text("changed\n")
    dest2 = tmp_path / "dest2"
    dest2.mkdir()
    assert "tests/ with local changes" in dev.deepspeed_tests(checkout, "HEAD", dest2)
    assert (dest2 / "tests" / "unit" / "common.py").read_text() == "changed\n"  # the working tree, as it is


def test_copies_a_bare_git_directorys_tests_at_a_ref(checkout, tmp_path):
    first = _git(checkout, "rev-parse", "HEAD")
    (checkout / "tests" / "unit" / "later.py").write_text("")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-qm", "later")
    bare = tmp_path / "mirror.git"
    _git(tmp_path, "clone", "-q", "--bare", str(checkout), str(bare))
    for ref, expect_later in (("HEAD", True), (first, False)):
        dest = tmp_path / f"dest-{expect_later}"
        dest.mkdir()
        line = dev.deepspeed_tests(bare, ref, dest)
        assert (dest / "tests" / "unit" / "common.py").is_file() and not (dest / "setup.py").exists()
        assert (dest / "tests" / "unit" / "later.py").exists() == expect_later
        assert f"git directory {bare}" in line and _git(bare, "rev-parse", ref) in line and "version.txt 0.19.6" in line


def test_refuses_a_directory_that_is_not_deepspeed(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(SystemExit, match="neither a DeepSpeed checkout"):
        dev.deepspeed_tests(tmp_path / "x", "HEAD", tmp_path)


def test_cpu_fp16_plugin_is_valid_python_and_preloads_itself():
    compile(dev.CPU_FP16_PLUGIN, dev.CPU_FP16_PLUGIN_NAME, "exec")
    assert "set_forkserver_preload([__name__])" in dev.CPU_FP16_PLUGIN


def test_intree_exports_the_tests_of_every_pull_request(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "build_backend"))
    import zero3muon_export as ze
    owners = ze.assign("0.19.8", REPO_ROOT, strict=False)
    tests = {p for files in owners.values() for p in files if p.startswith("tests/")}
    assert tests and all(p.startswith(("tests/unit/runtime/zero/", "tests/unit/checkpoint/")) for p in tests)
    assert "tests/unit/common.py" not in tests and "tests/conftest.py" not in tests
