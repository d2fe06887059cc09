# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The offline wheelhouse of ``python3 dev.py wheelhouse`` (stdlib only, like dev.py).

A GPU node without network but with torch installed needs, to run ``dev.py gpu-check``:

- the patched DeepSpeed wheel of every base (``deepspeed-<base>+zero3muon-py3-none-any.whl``),
  built with ``pip wheel`` from this checkout and the sha256-pinned release sdist;
- the stock wheels of the same releases (``deepspeed-<base>-py3-none-any.whl``), built from the
  same sdists, for the side-by-side figures;
- the tests' shared package ``muon_testing`` (``testing/``: models, comparisons, the single-process
  reference; ``muon_testing-<version>-py3-none-any.whl``), which the tests, ``bench/worker.py`` and
  gpu-check's own comparison import;
- DeepSpeed's runtime requirements, read from the sdists' ``requirements/requirements.txt``
  (torch excluded: the node's own CUDA torch stays), plus ``nvidia-ml-py`` (DeepSpeed's setup.py
  adds it where it is built with a CUDA torch), with their dependencies, one version each, as
  binary wheels for the target interpreter (``--python-version``, CPython, manylinux x86-64):
  ``pip download --only-binary=:all:`` resolves them together.

It writes ``manifest.json`` (every file: kind, name, version, size, sha256; the bases; the target
tags) and ``SHA256SUMS`` (``sha256sum -c`` format), and fails (``WheelhouseError``) when the
directory holds more than ``MAX_BYTES`` (the device machine's carry limit), or a dependency
resolves to two versions.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import zero3muon_build as zb

MAX_BYTES = 64 * 1024 * 1024
"""The wheelhouse's size limit in bytes: what a device run can carry with it (64 MiB)."""

EXCLUDED = {"torch"}
"""Requirements left out: the node's torch (built for its CUDA) must not be replaced."""

EXTRA_REQUIREMENTS = ("nvidia-ml-py", )
"""Requirements DeepSpeed's setup.py adds on a CUDA build (``install_requires``), not listed in
its requirements.txt."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
"""``pip download --platform`` tags accepted for compiled wheels (glibc 2.17 to 2.28)."""

MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"


class WheelhouseError(Exception):
    """The wheelhouse could not be made, or breaks a limit; the message says which and why."""


def log(msg):
    print(f"[wheelhouse] {msg}", flush=True)


def _run(cmd, env=None):
    log("$ " + " ".join(str(c) for c in cmd))
    res = subprocess.run([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise WheelhouseError(f"{' '.join(str(c) for c in cmd[:5])} ... failed (exit {res.returncode}):\n"
                              f"{res.stdout[-4000:]}")
    return res.stdout


def requirement_name(line):
    """The normalized project name of a requirements.txt line, or None for comments/blank lines.

    >>> requirement_name("pydantic>=2.0.0")
    'pydantic'
    """
    line = line.split("#", 1)[0].strip()
    if not line:
        return None
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
    if match is None:
        raise WheelhouseError(f"cannot read the requirement {line!r}")
    return normalize(match.group(0))


def normalize(name):
    """PEP 503 normalized project name (``Py_CPUInfo`` -> ``py-cpuinfo``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sdist_requirements(sdist, base):
    """The requirement lines of ``requirements/requirements.txt`` in DeepSpeed's sdist ``sdist``
    (a ``deepspeed-<base>.tar.gz``), as written there (specifiers kept), torch excluded."""
    member = f"deepspeed-{base}/requirements/requirements.txt"
    with tarfile.open(sdist) as tar:
        try:
            text = tar.extractfile(member).read().decode()
        except KeyError:
            raise WheelhouseError(f"{sdist}: no {member}") from None
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    return [ln for ln in lines if ln and requirement_name(ln) not in EXCLUDED]


def wheel_name_version(filename):
    """``(normalized name, version)`` of a wheel file name (PEP 427)."""
    parts = Path(filename).name[:-len(".whl")].split("-")
    if len(parts) < 5:
        raise WheelhouseError(f"{filename}: not a wheel file name")
    return normalize(parts[0]), parts[1]


def build_wheels(bases, out, project_root, python=sys.executable):
    """Build the patched and stock DeepSpeed wheels of ``bases`` into ``out``; return
    ``[(kind, base, path)]`` (kind ``patched`` or ``stock``) and the sdists by base."""
    cfg = zb.load_config(project_root)
    built, sdists = [], {}
    for base in bases:
        if base not in cfg["sdist-sha256"]:
            raise WheelhouseError(f"unknown base {base!r}; known: {', '.join(sorted(cfg['sdist-sha256']))}")
        sdist = zb.obtain_sdist(base, cfg["sdist-sha256"][base])
        sdists[base] = sdist
        for kind in ("patched", "stock"):
            with tempfile.TemporaryDirectory(prefix=f"wheelhouse-{kind}-{base}-") as tmp:
                env = dict(os.environ, DS_ZERO3MUON_BASE=base, DS_ZERO3MUON_SDIST=str(sdist))
                env.pop("DS_BUILD_OPS", None)  # no op is pre-compiled: the node JIT-builds what it uses
                source = project_root if kind == "patched" else sdist
                _run([python, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "-w", tmp, source],
                     env=env)
                found = sorted(Path(tmp).glob("deepspeed-*.whl"))
                if len(found) != 1:
                    raise WheelhouseError(f"pip wheel of {kind} {base} gave {[p.name for p in found]}")
                _, version = wheel_name_version(found[0].name)
                expected = f"{base}+zero3muon" if kind == "patched" else base
                if version != expected:
                    raise WheelhouseError(f"{found[0].name}: version {version}, expected {expected}")
                dest = Path(out) / found[0].name
                shutil.move(str(found[0]), dest)
                built.append((kind, base, dest))
                log(f"{kind} {base}: {dest.name}")
    return built, sdists


def build_testing_wheel(out, project_root, python=sys.executable):
    """Build ``testing/`` (the package ``muon_testing``) as a wheel into ``out``; return its path."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-testing-") as tmp:
        _run([
            python, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "-w", tmp,
            Path(project_root) / "testing"
        ])
        found = sorted(Path(tmp).glob("muon_testing-*.whl"))
        if len(found) != 1:
            raise WheelhouseError(f"pip wheel of testing/ gave {[p.name for p in found]}")
        dest = Path(out) / found[0].name
        shutil.move(str(found[0]), dest)
    log(f"testing: {dest.name}")
    return dest


def download_dependencies(requirements, out, python_version, python=sys.executable):
    """``pip download`` the binary wheels of ``requirements`` and their dependencies for CPython
    ``python_version`` (e.g. "3.12") on manylinux x86-64 into ``out``; return their paths."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-deps-") as tmp:
        cmd = [
            python, "-m", "pip", "--disable-pip-version-check", "download", "--only-binary=:all:", "-d", tmp,
            "--python-version", python_version, "--implementation", "cp"
        ]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        _run(cmd + sorted(requirements))
        paths = []
        for found in sorted(Path(tmp).iterdir()):
            if not found.name.endswith(".whl"):
                raise WheelhouseError(f"pip download gave {found.name}, not a wheel")
            if wheel_name_version(found.name)[0] == "torch":
                raise WheelhouseError(f"a dependency pulled in torch ({found.name}); the wheelhouse must not hold it")
            dest = Path(out) / found.name
            shutil.move(str(found), dest)
            paths.append(dest)
    return paths


def wheel_import_names(path):
    """Top-level import names a wheel installs (its ``top_level.txt``, else its top directories)."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        top = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if top:
            return sorted({ln.strip() for ln in zf.read(top[0]).decode().splitlines() if ln.strip()})
    tops = {n.split("/", 1)[0] for n in names if "/" in n and ".dist-info/" not in n and ".data/" not in n}
    tops |= {n[:-3] for n in names if "/" not in n and n.endswith(".py")}
    return sorted(t for t in tops if t.isidentifier())


def make(out, bases, python_version="3.12", project_root=zb.REPO_ROOT, max_bytes=MAX_BYTES):
    """Write the wheelhouse into ``out`` (created; an existing one is replaced); return the manifest.

    Raises:
        WheelhouseError: a build or download failed, a dependency resolved to two versions, or the
            files exceed ``max_bytes`` (the directory is left in place, for a look).
    """
    out = Path(out)
    if out.exists():
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise WheelhouseError(f"{out} exists and is not a wheelhouse (no {MANIFEST}): not replacing it")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    built, sdists = build_wheels(bases, out, Path(project_root))
    testing = build_testing_wheel(out, Path(project_root))
    requirements = sorted({r
                           for base in bases
                           for r in sdist_requirements(sdists[base], base)} | set(EXTRA_REQUIREMENTS))
    log(f"DeepSpeed's requirements (torch excluded): {', '.join(requirements)}")
    deps = download_dependencies(requirements, out, python_version)
    versions = {}
    for path in deps:
        name, version = wheel_name_version(path.name)
        versions.setdefault(name, set()).add(version)
    twice = {n: sorted(v) for n, v in versions.items() if len(v) > 1}
    if twice:
        raise WheelhouseError(f"dependencies in more than one version: {twice}")
    files = []
    for kind, base, path in built:
        files.append(
            dict(kind=kind, base=base, file=path.name, name="deepspeed", version=wheel_name_version(path.name)[1]))
    name, version = wheel_name_version(testing.name)
    files.append(dict(kind="testing", file=testing.name, name=name, version=version))
    for path in deps:
        name, version = wheel_name_version(path.name)
        files.append(
            dict(kind="dependency", file=path.name, name=name, version=version, imports=wheel_import_names(path)))
    for entry in files:
        path = out / entry["file"]
        entry.update(bytes=path.stat().st_size, sha256=zb.sha256_of(path))
    total = sum(e["bytes"] for e in files)
    manifest = dict(bases=list(bases),
                    python_version=python_version,
                    implementation="cp",
                    platforms=list(PLATFORMS),
                    requirements=requirements,
                    excluded=sorted(EXCLUDED),
                    total_bytes=total,
                    files=files)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / SUMS).write_text("".join(f"{e['sha256']}  {e['file']}\n" for e in files))
    log(f"{len(files)} wheels, {total / 2**20:.1f} MiB in {out}")
    if total > max_bytes:
        raise WheelhouseError(f"the wheelhouse holds {total / 2**20:.1f} MiB, over the limit of "
                              f"{max_bytes / 2**20:.0f} MiB (a device run carries at most that much)")
    return manifest


def verify(wheels):
    """Check ``wheels`` against its manifest (every file present with its sha256); return the
    manifest. Raises WheelhouseError naming the first missing or altered file."""
    wheels = Path(wheels)
    if not (wheels / MANIFEST).is_file():
        raise WheelhouseError(f"{wheels}: no {MANIFEST}; make one with `python3 dev.py wheelhouse --out {wheels}`")
    manifest = json.loads((wheels / MANIFEST).read_text())
    for entry in manifest["files"]:
        path = wheels / entry["file"]
        if not path.is_file():
            raise WheelhouseError(f"{path}: listed in {MANIFEST} but missing")
        if zb.sha256_of(path) != entry["sha256"]:
            raise WheelhouseError(f"{path}: sha256 differs from {MANIFEST}")
    return manifest
