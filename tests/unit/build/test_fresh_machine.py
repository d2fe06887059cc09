"""The download and build paths of a machine that has never seen the project (issue 39, item 1).

Each test points the project's sdist cache (``DS_ZERO3MUON_CACHE``) to an empty temporary folder,
so no cached sdist can hide a missing step, as ``~/.cache/zero3muon`` once hid that the system
Python could not download the 0.19.7 sdist (``invalid command 'bdist_wheel'``: no ``wheel``).
pip's own download cache may be warm: it saves the network, not a step.

- ``dev.py wheelhouse`` (and ``export``, ``lint``) get the sdist with the Python that runs dev.py:
  here a bare Python (a venv made ``--without-pip``: no pip, setuptools or wheel) stands in for
  the least a fresh machine may have.
- ``dev.py setup`` builds the patched DeepSpeed with ``pip install .``: its PEP 517 path (the
  isolated build environment from pyproject.toml's [build-system], the sdist download inside it,
  the patches, the metadata) runs here up to the metadata, through the venv's own pip, with
  ``--dry-run``: the wheel build after it is setuptools copying files, which every setup of a
  clean clone (CI's) runs anyway. That keeps the test to about half a minute.

Both use the base of the build this suite runs on (``dev.py test --base X``), so CI, which runs the
suite once per base, covers every base once. They need the package index (as setup does).
"""

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "build_backend"))
import zero3muon_build as zb  # noqa: E402

CFG = zb.load_config(REPO_ROOT)


def _suite_base():
    """The base of the installed build (``0.19.7`` of ``0.19.7+zero3muon``), else the default base."""
    try:
        version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return CFG["default-base"]
    base = version.split("+")[0]
    return base if base in CFG["sdist-sha256"] else CFG["default-base"]


BASE = _suite_base()


def _clean_env(cache):
    """The environment of a fresh machine's run: an empty project cache, no local sdist, no base."""
    env = {k: v for k, v in os.environ.items() if k not in (zb.ENV_SDIST, zb.ENV_BASE, "PYTHONPATH")}
    env[zb.ENV_CACHE] = str(cache)
    return env


def _bare_python(tmp_path):
    """A Python with nothing but the standard library: a venv of this interpreter made without pip."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = bare / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import pip"], stderr=subprocess.DEVNULL)
    assert probe.returncode != 0, "the bare venv has pip: it would not stand in for a fresh machine"
    return python


def test_sdist_download_needs_nothing_but_python(tmp_path):
    """``obtain_sdist`` with an empty cache in a Python without pip, setuptools or wheel (what dev.py
    wheelhouse/export/lint run on the system Python): the sha256-checked sdist lands in the cache."""
    python = _bare_python(tmp_path)
    cache = tmp_path / "cache"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import zero3muon_build as zb; "
            "print('SDIST', zb.obtain_sdist(sys.argv[2], sys.argv[3]))")
    res = subprocess.run([str(python), "-c", code, str(REPO_ROOT / "build_backend"), BASE, CFG["sdist-sha256"][BASE]],
                         env=_clean_env(cache), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:]
    got = Path(re.search(r"^SDIST (.+)$", res.stdout, re.M).group(1))
    assert got == cache / f"deepspeed-{BASE}.tar.gz"
    assert zb.sha256_of(got) == CFG["sdist-sha256"][BASE]
    assert "has no pip" in res.stdout, res.stdout  # the throwaway venv's pip ran it
    assert sorted(p.name for p in cache.iterdir()) == [got.name]  # no scratch left behind


def test_setup_build_path_from_an_empty_cache(tmp_path):
    """``pip install .`` as dev.py setup runs it (the venv's pip, build isolation), with an empty
    project cache, up to the wheel's metadata: the backend downloads the sdist in the build
    environment, checks its sha256, applies the patches and reports ``<base>+zero3muon``."""
    cache = tmp_path / "cache"
    report = tmp_path / "report.json"
    env = _clean_env(cache)
    env[zb.ENV_BASE] = BASE
    cmd = [
        sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--dry-run", "--no-deps",
        "--ignore-installed", "--report", str(report), "-c",
        str(REPO_ROOT / "requirements" / "torch.txt"),
        str(REPO_ROOT)
    ]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-6000:]
    installs = json.loads(report.read_text())["install"]
    versions = {item["metadata"]["name"]: item["metadata"]["version"] for item in installs}
    assert versions == {"deepspeed": f"{BASE}{zb.LOCAL_LABEL}"}, versions
    sdist = cache / f"deepspeed-{BASE}.tar.gz"
    assert sdist.is_file(), f"the build did not cache the sdist in {cache}: {sorted(cache.iterdir())}"
    assert zb.sha256_of(sdist) == CFG["sdist-sha256"][BASE]


@pytest.mark.parametrize("output, names", [
    ("error: invalid command 'bdist_wheel'\nerror: metadata-generation-failed", ["wheel"]),
    ("ModuleNotFoundError: No module named 'setuptools'", ["setuptools"]),
])
def test_a_failed_download_names_what_is_missing_and_the_fix(output, names):
    hint = zb._download_hint("0.19.7", output)
    for name in names:
        assert name in hint
    assert "pip install" in hint and sys.executable in hint


def test_a_download_without_index_says_so():
    hint = zb._download_hint("0.19.7", "ERROR: No matching distribution found for deepspeed==0.19.7")
    assert "package index" in hint and "pip config list" in hint


def test_download_failure_is_a_build_error_naming_the_offline_route(tmp_path, monkeypatch):
    """A pip that fails: BuildError with the hint, the variable for a local sdist, and pip's output."""

    def failing_run(cmd, **kwargs):
        if "download" in cmd:
            return subprocess.CompletedProcess(cmd, 1, stdout="error: invalid command 'bdist_wheel'\n")
        return subprocess.CompletedProcess(cmd, 0, stdout="")  # the module probes: nothing missing

    monkeypatch.setattr(zb.subprocess, "run", failing_run)
    with pytest.raises(zb.BuildError) as err:
        zb.download_sdist("0.19.7", tmp_path)
    text = str(err.value)
    assert "lacks wheel" in text and zb.ENV_SDIST in text and "bdist_wheel" in text
