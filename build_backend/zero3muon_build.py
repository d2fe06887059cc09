"""PEP 517 build backend: builds DeepSpeed with the ZeRO-3 Muon patch.

The repository holds only our own code. A wheel is made by
  1. choosing the base release (env DS_ZERO3MUON_BASE, else [tool.zero3muon] default-base),
  2. getting that release's sdist (env DS_ZERO3MUON_SDIST, else ``pip download`` into a cache),
  3. checking its sha256 against the pin in pyproject.toml,
  4. unpacking it and adding the files under the repository's ``deepspeed/`` (new files only),
  5. applying ``patches/<base>/*.patch`` in sorted order with ``git apply -p1``,
  6. writing ``build.txt`` (version label) and ``deepspeed/runtime/zero/muon/_build_info.py``
     (versions, patch names and the sha256 of every package file the patches change),
  7. handing the prepared tree to setuptools' legacy backend (DeepSpeed ships a setup.py).

``prepare_tree`` does steps 3-6 and can be called on its own (the unit tests do). Steps 3-5
without 6 are also what ``build_backend/zero3muon_export.py`` (``python3 dev.py export``) diffs
against the pristine release to give one upstream-style patch.
"""

import contextlib
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

try:
    import tomllib  # Python >= 3.11
except ImportError:  # pragma: no cover - exercised on Python < 3.11 only
    try:
        import tomli as tomllib  # a [build-system] requirement on Python < 3.11
    except ImportError:  # e.g. `python3 dev.py export` on the system Python 3.9/3.10
        tomllib = None

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCAL_LABEL = "+zero3muon"
BUILD_INFO_REL = Path("deepspeed/runtime/zero/muon/_build_info.py")
ENV_BASE = "DS_ZERO3MUON_BASE"
ENV_SDIST = "DS_ZERO3MUON_SDIST"
ENV_CACHE = "DS_ZERO3MUON_CACHE"


class BuildError(Exception):
    """A build step failed; the message says which and why."""


def _log(msg):
    print(f"[zero3muon] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- configuration


def _read_zero3muon_table(text):
    """[tool.zero3muon] of a pyproject.toml without a TOML library: its flat ``key = "string"``
    entries and the [tool.zero3muon.sdist-sha256] sub-table, which is all this file uses."""
    cfg, table = {}, None
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        header = re.fullmatch(r"\[\s*([^\]]+?)\s*\]", line)
        if header:
            table = header.group(1).replace(" ", "")
            if table == "tool.zero3muon.sdist-sha256":
                cfg["sdist-sha256"] = {}
            continue
        entry = re.fullmatch(r'"?([A-Za-z0-9_.+-]+)"?\s*=\s*"([^"]*)"', line)
        if entry and table == "tool.zero3muon":
            cfg[entry.group(1)] = entry.group(2)
        elif entry and table == "tool.zero3muon.sdist-sha256":
            cfg["sdist-sha256"][entry.group(1)] = entry.group(2)
    return cfg or None


def load_config(root=REPO_ROOT):
    """Return the [tool.zero3muon] table of ``root/pyproject.toml``."""
    with open(Path(root) / "pyproject.toml", "rb") as f:
        data = f.read()
    if tomllib is not None:
        cfg = tomllib.loads(data.decode()).get("tool", {}).get("zero3muon")
    else:
        cfg = _read_zero3muon_table(data.decode())
    if not cfg or "sdist-sha256" not in cfg or "default-base" not in cfg or "version" not in cfg:
        raise BuildError("pyproject.toml: [tool.zero3muon] needs 'version', 'default-base' and "
                         "a [tool.zero3muon.sdist-sha256] table")
    return cfg


def select_base(cfg, requested=None):
    """The base version to build on: ``requested``, else env DS_ZERO3MUON_BASE, else the default."""
    base = requested or os.environ.get(ENV_BASE) or cfg["default-base"]
    known = cfg["sdist-sha256"]
    if base not in known:
        raise BuildError(f"unknown DeepSpeed base version {base!r}; known base versions: "
                         f"{', '.join(sorted(known))} (pins are in pyproject.toml [tool.zero3muon.sdist-sha256])")
    return base


# --------------------------------------------------------------------------- getting the sdist


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path, expected):
    actual = sha256_of(path)
    if actual != expected.lower():
        raise BuildError(f"sha256 mismatch for {path}: expected {expected}, actual {actual}")


def default_cache_dir():
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "zero3muon" / "sdists"


def obtain_sdist(base, expected_sha256, cache_dir=None):
    """Path of a verified ``deepspeed-<base>.tar.gz``: env DS_ZERO3MUON_SDIST, the cache, or pip download."""
    local = os.environ.get(ENV_SDIST)
    if local:
        path = Path(local).expanduser().resolve()
        if not path.is_file():
            raise BuildError(f"{ENV_SDIST}={local}: no such file")
        verify_sha256(path, expected_sha256)
        _log(f"using sdist {path}")
        return path

    cache_dir = Path(cache_dir or default_cache_dir())
    cached = cache_dir / f"deepspeed-{base}.tar.gz"
    if cached.is_file():
        if sha256_of(cached) == expected_sha256:
            _log(f"using cached sdist {cached}")
            return cached
        _log(f"cached {cached} has the wrong sha256; downloading again")
        cached.unlink()

    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        found = download_sdist(base, Path(tmp))
        verify_sha256(found, expected_sha256)
        os.replace(found, cached)
    return cached


# What pip needs to prepare an sdist's metadata in the running Python (``--no-build-isolation``):
# DeepSpeed ships a setup.py without pyproject.toml, so pip runs setuptools' legacy backend, whose
# metadata step runs ``bdist_wheel`` (the ``wheel`` package with setuptools < 70.1).
METADATA_MODULES = ("setuptools", "wheel")


def _missing_modules(python, names):
    """The modules of ``names`` that ``python`` cannot import (all of them if it does not run)."""
    code = "import importlib.util, sys; print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
    try:
        res = subprocess.run([str(python), "-c", code, *names], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    except OSError:
        return list(names)
    return res.stdout.split() if res.returncode == 0 else list(names)


def _throwaway_venv(where):
    """A venv with pip (ensurepip) under ``where``, for a Python that has no pip; returns its python."""
    import venv
    target = Path(where) / "venv"
    _log(f"{sys.executable} has no pip: creating a throwaway venv with pip for the download")
    try:
        venv.EnvBuilder(with_pip=True).create(target)
    except Exception as e:  # ensurepip missing (Debian/Ubuntu without python3-venv), or it failed
        raise BuildError(f"{sys.executable} has no pip, and a venv with pip could not be made ({e}). Install "
                         "pip and venv for this Python (Debian/Ubuntu: apt-get install python3-pip python3-venv; "
                         f"elsewhere: {sys.executable} -m ensurepip --user), or download the sdist yourself and set "
                         f"{ENV_SDIST} to it") from e
    return target / "bin" / "python"


def _download_hint(base, output, pip_python=None):
    """What a failed ``pip download`` of the sdist lacks, and the command that fixes it, from its output
    (``pip_python``: the Python that ran pip, if not this one: a throwaway venv's)."""
    missing = re.findall(r"No module named '([A-Za-z0-9_.]+)'", output)
    if "invalid command 'bdist_wheel'" in output and "wheel" not in missing:
        missing.append("wheel")
    if missing:
        names = " ".join(sorted(set(m.split(".")[0] for m in missing) | {"setuptools", "wheel"}))
        fix = f"{sys.executable} -m pip install --user {names}"
        if pip_python is not None and str(pip_python) != sys.executable:
            fix = f"{sys.executable} -m ensurepip --user && {fix}"
        return (f"the Python that prepared the sdist's metadata lacks {', '.join(sorted(set(missing)))}; "
                f"install it ({fix}) and run again")
    if re.search(r"No matching distribution|Could not find a version|NewConnectionError|Max retries exceeded|"
                 r"Temporary failure in name resolution|Network is unreachable|SSLError|ProxyError", output):
        return (f"pip could not get deepspeed=={base} from its package index: check the network, proxy and "
                f"index settings (`{sys.executable} -m pip config list`)")
    return "see pip's output below"


def download_sdist(base, dest):
    """``pip download`` the sdist of ``deepspeed==base`` into ``dest``; return its path (not yet verified).

    Needs only a Python with network: pip always prepares the metadata of an sdist it downloads,
    and where this Python lacks setuptools or wheel it is left to pip's build isolation (pip
    installs them into a throwaway environment of its own, ~20 s); where this Python has no pip, a
    throwaway venv's pip runs it. Raises BuildError naming what is missing and how to get it.
    """
    dest = Path(dest)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".pip-") as scratch:
        python = sys.executable
        if _missing_modules(python, ["pip"]):
            python = _throwaway_venv(scratch)
        cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "download", f"deepspeed=={base}", "--no-deps",
               "--no-binary", ":all:", "-d", str(dest)]
        missing = _missing_modules(python, METADATA_MODULES)
        if missing:
            _log(f"{python} lacks {', '.join(missing)}: pip prepares the sdist's metadata in an isolated build "
                 "environment (it installs setuptools and wheel there first)")
        else:
            cmd.append("--no-build-isolation")  # this Python prepares the metadata: faster, and no extra download
        _log("downloading: " + " ".join(cmd[1:]))
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode != 0:
            raise BuildError(f"pip download of deepspeed=={base} failed (exit {res.returncode}): "
                             f"{_download_hint(base, res.stdout, python)}. To build offline, download "
                             f"deepspeed-{base}.tar.gz (https://pypi.org/project/deepspeed/{base}/#files) and set "
                             f"{ENV_SDIST} to its path.\n{res.stdout[-6000:]}")
    found = sorted(dest.glob("deepspeed-*.tar.gz"))
    if len(found) != 1:
        raise BuildError(f"pip download of deepspeed=={base} gave {sorted(p.name for p in dest.iterdir())}, "
                         f"expected one deepspeed-{base}.tar.gz")
    return found[0]


# --------------------------------------------------------------------------- preparing the tree


def _safe_extract(sdist, dest):
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            try:
                tar.extractall(dest, filter="data")
            except tarfile.FilterError as e:
                raise BuildError(f"{sdist}: unsafe archive member: {e}") from e
            return
        # Python without extraction filters: refuse anything but plain files and directories
        # whose names stay inside dest.
        dest_real = os.path.realpath(dest)
        for m in tar.getmembers():
            target = os.path.realpath(os.path.join(dest, m.name))
            if not (m.isfile() or m.isdir()) or os.path.commonpath([dest_real, target]) != dest_real:
                raise BuildError(f"{sdist}: unsafe archive member {m.name!r}")
        tar.extractall(dest)  # noqa: S202 - members checked above


def _find_git():
    git = shutil.which("git")
    if git is None:
        raise BuildError("git is needed to apply patches/<base>/*.patch (git apply), but no 'git' was found on PATH")
    return git


def _git_env(tree):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # The tree is not a git repository: stop git from finding one in a parent directory,
    # which would make it resolve patch paths relative to that repository.
    env["GIT_CEILING_DIRECTORIES"] = str(Path(tree).parent)
    return env


def apply_patches(tree, patches):
    """Apply ``patches`` (in the given order) to ``tree`` with ``git apply -p1``."""
    git = _find_git()
    env = _git_env(tree)
    for patch in patches:
        for extra in (["--check"], []):
            cmd = [git, "apply", "-p1", "--whitespace=nowarn", *extra, str(patch)]
            res = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if res.returncode != 0:
                raise BuildError(f"patch {patch} does not apply to the upstream tree "
                                 f"(git apply{' --check' if extra else ''} exit {res.returncode}):\n"
                                 f"{res.stderr.strip()}")
        _log(f"applied {patch.name}")


def overlay_files(src_pkg, tree):
    """Copy every file under ``src_pkg`` (the repo's deepspeed/) into ``tree/deepspeed``.

    Only new files are allowed: a change to an upstream file must be a patch.
    """
    src_pkg = Path(src_pkg)
    files = []
    for dirpath, dirnames, filenames in os.walk(src_pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        files += [Path(dirpath, f) for f in sorted(filenames) if not f.endswith((".pyc", ".pyo"))]
    rels = [Path("deepspeed") / f.relative_to(src_pkg) for f in files]
    if BUILD_INFO_REL in rels:
        raise BuildError(f"{BUILD_INFO_REL} is generated at build time and must not be in the repository; delete it")
    clashes = [str(r) for r in rels if (tree / r).exists()]
    if clashes:
        raise BuildError("these repository files already exist in the upstream DeepSpeed tree and would overwrite it: "
                         f"{', '.join(clashes)}. Changes to upstream files must be patches under patches/<base>/.")
    for src, rel in zip(files, rels):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, tree / rel)
    return rels


def list_patches(base, repo_root=REPO_ROOT):
    """``repo_root/patches/<base>/*.patch`` in the order they are applied."""
    patch_dir = Path(repo_root) / "patches" / base
    if not patch_dir.is_dir():
        raise BuildError(f"no patch directory {patch_dir} for base {base}")
    return sorted(patch_dir.glob("*.patch"))


def unpack_sdist(sdist, work_dir):
    """Unpack ``sdist`` into ``work_dir/unpack``; return its single top-level directory (the source tree)."""
    unpack = Path(work_dir) / "unpack"
    unpack.mkdir()
    _safe_extract(sdist, unpack)
    tops = list(unpack.iterdir())
    if len(tops) != 1 or not (tops[0] / "setup.py").is_file():
        raise BuildError(f"{sdist}: expected a single top-level directory holding setup.py, got "
                         f"{sorted(p.name for p in tops)}")
    return tops[0]


def apply_changes(tree, patches, repo_root=REPO_ROOT):
    """Our change to an upstream tree: the new files under ``repo_root/deepspeed/``, then ``patches``.

    This is exactly what ``dev.py export`` turns into one diff; the build adds only the labels
    (``write_build_labels``) on top.
    """
    repo_root = Path(repo_root)
    if (repo_root / "deepspeed").is_dir():
        added = overlay_files(repo_root / "deepspeed", tree)
        _log(f"added {len(added)} new file(s) from deepspeed/")
    apply_patches(tree, patches)


_DIFF_HEADER = re.compile(r"diff --git a/(\S+) b/(\S+)")
PACKAGE = "deepspeed"


def patched_package_files(patches):
    """The files of the ``deepspeed`` package that ``patches`` change, read from their ``diff --git`` headers.

    Args:
        patches: iterable of ``Path``, git-style patches (``patches/<base>/*.patch``).

    Returns:
        list[str]: sorted, each once, relative to the package (``"runtime/zero/stage3.py"``); a renamed or
        copied file under its new name. Files outside ``deepspeed/`` (``setup.py``, ``tests/``) are left out:
        the wheel does not install them, so there is nothing to check them against.

    Raises:
        BuildError: a ``diff --git`` header that does not read as ``a/<path> b/<path>`` (a quoted path or one
            with spaces), since skipping it would leave a patched file unchecked without a word.
    """
    files = set()
    for patch in patches:
        for line in Path(patch).read_text(encoding="utf-8").splitlines():
            if not line.startswith("diff --git "):
                continue
            match = _DIFF_HEADER.fullmatch(line)
            if match is None:
                raise BuildError(f"{patch}: cannot read the file names of the header {line!r} "
                                 "(expected 'diff --git a/<path> b/<path>' without spaces or quotes)")
            path = match.group(2)
            if path.startswith(PACKAGE + "/"):
                files.add(path[len(PACKAGE) + 1:])
            else:
                _log(f"{Path(patch).name} changes {path}, outside the {PACKAGE} package: not recorded")
    return sorted(files)


def patched_file_hashes(tree, patches):
    """``PATCHED_FILES`` of ``_build_info.py``: the sha256 of each file ``patches`` change, as it is in ``tree``.

    Called on the tree after every patch is applied, so each hash is the file's final content whichever
    patches changed it; ``python -m deepspeed.runtime.zero.muon`` compares the installed files with them.

    Args:
        tree (Path): the prepared source tree (holding ``deepspeed/``).
        patches: iterable of ``Path``, the patches applied to ``tree``.

    Returns:
        dict[str, str]: path relative to the package -> lowercase hex sha256 (64 characters), sorted by path.

    Raises:
        BuildError: a file a patch names is not in ``tree`` after patching (a patch that deletes an upstream
            file), since there would be no content to record; or a header ``patched_package_files`` cannot read.
    """
    hashes = {}
    for rel in patched_package_files(patches):
        path = Path(tree) / PACKAGE / rel
        if not path.is_file():
            raise BuildError(f"{PACKAGE}/{rel} is named by a patch but is not a file after patching (a deleted "
                             "file is not supported: the build records the sha256 of every patched file)")
        hashes[rel] = sha256_of(path)
    return hashes


def write_build_labels(tree, base, project_version, sdist_sha256, patches):
    """The packaging labels of this project's wheel: ``build.txt`` and ``_build_info.py``.

    Not part of the change itself, so ``dev.py export`` leaves them out. ``_build_info.py`` holds
    ``BASE_VERSION``, ``PATCH_VERSION``, ``SDIST_SHA256``, ``PATCHES`` (the patch file names, in order) and
    ``PATCHED_FILES`` (``patched_file_hashes``), so the installed package can check itself without this
    repository.

    Raises:
        BuildError: from ``patched_file_hashes``.
    """
    hashes = patched_file_hashes(tree, patches)
    (tree / "build.txt").write_text(LOCAL_LABEL + "\n")
    info = tree / BUILD_INFO_REL
    info.parent.mkdir(parents=True, exist_ok=True)
    entries = "".join(f"    {rel!r}: {digest!r},\n" for rel, digest in hashes.items())
    info.write_text(
        '"""Generated by build_backend/zero3muon_build.py when the wheel was built. Do not edit."""\n'
        f"BASE_VERSION = {base!r}\n"
        f"PATCH_VERSION = {project_version!r}\n"
        f"SDIST_SHA256 = {sdist_sha256.lower()!r}\n"
        f"PATCHES = {tuple(p.name for p in patches)!r}\n"
        "# sha256 of each file of the deepspeed package the patches change, as built (path relative to the package)\n"
        f"PATCHED_FILES = {{\n{entries}}}\n")


def prepare_tree(sdist, expected_sha256, base, project_version, work_dir, repo_root=REPO_ROOT):
    """Verify, unpack, overlay, patch and label ``sdist``; return the prepared source tree.

    The tree is created under ``work_dir`` (which must exist). ``repo_root`` supplies
    ``deepspeed/`` (new files) and ``patches/<base>/``.
    """
    sdist, work_dir, repo_root = Path(sdist), Path(work_dir), Path(repo_root)
    verify_sha256(sdist, expected_sha256)
    patches = list_patches(base, repo_root)
    tree = unpack_sdist(sdist, work_dir)
    apply_changes(tree, patches, repo_root)
    write_build_labels(tree, base, project_version, expected_sha256, patches)
    _log(f"prepared DeepSpeed {base}{LOCAL_LABEL} with {len(patches)} patch(es) in {tree}")
    return tree


@contextlib.contextmanager
def _prepared_tree(config_settings=None):
    cfg = load_config()
    base = select_base(cfg, (config_settings or {}).get("base"))
    sha = cfg["sdist-sha256"][base]
    sdist = obtain_sdist(base, sha)
    with tempfile.TemporaryDirectory(prefix="zero3muon-build-") as tmp:
        tree = prepare_tree(sdist, sha, base, cfg["version"], tmp)
        old = os.getcwd()
        os.chdir(tree)
        try:
            yield tree
        finally:
            os.chdir(old)


def _setuptools():
    from setuptools import build_meta
    return build_meta.__legacy__


# --------------------------------------------------------------------------- PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None):
    return []  # everything needed is in [build-system] requires; DeepSpeed has no setup_requires


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    metadata_directory = os.path.abspath(metadata_directory)
    with _prepared_tree(config_settings):
        return _setuptools().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory = os.path.abspath(wheel_directory)
    with _prepared_tree(config_settings):
        return _setuptools().build_wheel(wheel_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    raise BuildError("editable installs are not supported: the package is upstream DeepSpeed plus patches, "
                     "assembled at build time. Use 'pip install .' (or 'python3 dev.py setup').")


# Our own sdist: the repository inputs of the build (not DeepSpeed's source).
SDIST_INCLUDE = ("pyproject.toml", "build_backend", "deepspeed", "patches", "requirements")


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_sdist(sdist_directory, config_settings=None):
    cfg = load_config()
    base = select_base(cfg, (config_settings or {}).get("base"))
    version = f"{base}{LOCAL_LABEL}"
    stem = f"deepspeed-{version}"
    pkg_info = f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n".encode()
    out = Path(sdist_directory).resolve() / f"{stem}.tar.gz"

    def keep(info):
        if "__pycache__" in info.name or info.name.endswith((".pyc", ".pyo")):
            return None
        if info.name.endswith(BUILD_INFO_REL.name):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in SDIST_INCLUDE:
            if (REPO_ROOT / name).exists():
                tar.add(REPO_ROOT / name, arcname=f"{stem}/{name}", filter=keep)
        info = tarfile.TarInfo(f"{stem}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return out.name
