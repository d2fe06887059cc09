"""Tests of ``python3 dev.py export`` (build_backend/zero3muon_export.py) on the real pinned sdists.

For each base release whose sdist can be obtained the way the build obtains it (env
DS_ZERO3MUON_SDIST, the sdist cache, or ``pip download``), the exported diff must apply with
``git apply`` to a fresh unpack of that release and give exactly the tree ``pip install .``
builds from (``prepare_tree``), minus the build's two packaging labels; ``patch -p1`` must give
the same files. No torch, no wheel build.

Unpacking a release writes ~3000 files, so it is done only where a whole tree matters (the export
itself, the build's tree, the ``git apply`` target). ``patch`` and the other-base checks run on a
tree holding just the release's files at the paths the diff names (read from the sdist in
memory): both tools read and write nothing else, so they behave there as in the whole tree.
"""

import ast
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "build_backend"))
import zero3muon_build as zb  # noqa: E402
import zero3muon_export as ze  # noqa: E402

CFG = zb.load_config(REPO_ROOT)
BASES = sorted(CFG["sdist-sha256"])
LABELS = {"build.txt", zb.BUILD_INFO_REL.as_posix()}  # written by the build, left out of the export


def _obtain(base):
    """The verified sdist of ``base`` as the build gets it; skips the test if it cannot be had."""
    sha = CFG["sdist-sha256"][base]
    local = os.environ.get(zb.ENV_SDIST)
    saved = None
    if local and (not Path(local).is_file() or zb.sha256_of(local) != sha):
        saved = os.environ.pop(zb.ENV_SDIST)  # points at the other base's sdist: use the cache / pip for this one
    try:
        return zb.obtain_sdist(base, sha)
    except zb.BuildError as e:
        pytest.skip(f"the deepspeed-{base} sdist cannot be obtained here (no {zb.ENV_SDIST}, not in the cache "
                    f"{zb.default_cache_dir()}, pip download failed): {str(e).splitlines()[0]}")
    finally:
        if saved is not None:
            os.environ[zb.ENV_SDIST] = saved


_PRISTINE, _CASES = {}, {}


def _pristine_files(base):
    """{path: (bytes, executable)} of the release ``base``, read from its sdist without unpacking."""
    if base not in _PRISTINE:
        files = {}
        with tarfile.open(_obtain(base)) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    rel = m.name.split("/", 1)[1]
                    files[rel] = (tar.extractfile(m).read(), bool(m.mode & 0o111))
        _PRISTINE[base] = files
    return _PRISTINE[base]


def _sparse_tree(base, paths, tmp_path_factory):
    """A directory holding the release's own files at ``paths`` (those it has) and nothing else."""
    tree = tmp_path_factory.mktemp(f"sparse-{base}")
    pristine = _pristine_files(base)
    for rel in paths:
        if rel in pristine:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(pristine[rel][0])
            os.chmod(tree / rel, 0o755 if pristine[rel][1] else 0o644)
    return tree


class Case:
    """One base: its sdist, the export written from it, and the tree the build prepares."""

    def __init__(self, base, tmp_path_factory):
        self.base, self.factory = base, tmp_path_factory
        self.tmp = tmp_path_factory.mktemp(f"export-{base}")
        self.sha = CFG["sdist-sha256"][base]
        self.sdist = _obtain(base)
        self.result = ze.export(base, self.tmp / "out", REPO_ROOT, self.sdist)
        self.diff_bytes = self.result.diff_path.read_bytes()
        self.paths = [path for _, path in self.result.name_status]
        self.built = zb.prepare_tree(self.sdist, self.sha, base, CFG["version"], tmp_path_factory.mktemp("build"),
                                     REPO_ROOT)
        self.built_files = _files(self.built)


def _case(base, tmp_path_factory):
    if base not in _CASES:
        _CASES[base] = Case(base, tmp_path_factory)
    return _CASES[base]


@pytest.fixture(scope="module", params=BASES)
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


def _run(cmd, cwd, stdin=None):
    with open(stdin, "rb") if stdin else open(os.devnull, "rb") as f:
        return subprocess.run([str(c) for c in cmd], cwd=cwd, env=zb._git_env(cwd), stdin=f,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _files(tree):
    """{relative path: (bytes, executable)} of every file under ``tree``."""
    out = {}
    for p in sorted(tree.rglob("*")):
        if p.is_file():
            out[p.relative_to(tree).as_posix()] = (p.read_bytes(), bool(p.stat().st_mode & 0o111))
    return out


def test_git_apply_gives_the_built_tree(case):
    tree = zb.unpack_sdist(case.sdist, case.factory.mktemp("fresh"))
    check = _run(["git", "apply", "--check", case.result.diff_path], tree)
    assert check.returncode == 0, check.stdout
    res = _run(["git", "apply", case.result.diff_path], tree)
    assert res.returncode == 0, res.stdout

    got, built, pristine = _files(tree), dict(case.built_files), _pristine_files(case.base)
    # the build's labels: present in the build, not produced by the diff (build.txt stays upstream's)
    assert zb.BUILD_INFO_REL.as_posix() in built and zb.BUILD_INFO_REL.as_posix() not in got
    assert got["build.txt"] == pristine["build.txt"] != built["build.txt"]
    for label in LABELS | set(ze.PROJECT_ONLY):
        got.pop(label, None)
        built.pop(label, None)
    assert sorted(got) == sorted(built), "file sets differ: " + repr(set(got) ^ set(built))
    differ = [rel for rel in got if got[rel] != built[rel]]
    assert not differ, f"contents or executable bit differ from the build's tree: {differ}"
    changed = sorted(rel for rel in got if pristine.get(rel) != got[rel])
    assert changed == sorted(case.paths)


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patch_p1_gives_the_built_files(case):
    tree = _sparse_tree(case.base, case.paths, case.factory)
    dry = _run(["patch", "-p1", "--dry-run", "--batch"], tree, stdin=case.result.diff_path)
    assert dry.returncode == 0, dry.stdout
    res = _run(["patch", "-p1", "--batch", "--no-backup-if-mismatch"], tree, stdin=case.result.diff_path)
    assert res.returncode == 0 and "fuzz" not in res.stdout and "offset" not in res.stdout, res.stdout
    got = _files(tree)
    assert sorted(got) == sorted(case.paths)
    assert got == {rel: case.built_files[rel] for rel in got}


def test_diff_is_plain_text_with_repo_relative_paths(case):
    data = case.diff_bytes
    text = data.decode("utf-8")  # raises on binary junk
    assert b"\0" not in data
    assert "GIT binary patch" not in text and "Binary files" not in text
    assert "__pycache__" not in text and ".pyc" not in text
    for secret in (str(REPO_ROOT), str(case.tmp.parent), "/unpack/"):
        assert secret not in text
    headers = [line.split() for line in text.splitlines() if line.startswith("diff --git ")]
    paths = [h[2][2:] for h in headers]
    assert all(h[2] == f"a/{p}" and h[3] == f"b/{p}" for h, p in zip(headers, paths))
    assert not LABELS & set(paths)
    assert len(headers) == len(case.result.name_status)
    # new files: exactly the repository's deepspeed/ files; modified: exactly what the patches touch
    ours = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "deepspeed").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}
    assert set(ze.PROJECT_ONLY) <= ours
    ours -= set(ze.PROJECT_ONLY)  # this project's wheel report, not part of the upstream change
    patched = {line.split()[2][2:] for patch in zb.list_patches(case.base, REPO_ROOT)
               for line in patch.read_text().splitlines() if line.startswith("diff --git ")}
    status = dict((path, st) for st, path in case.result.name_status)
    assert {p for p, st in status.items() if st == "A"} == ours
    assert {p for p, st in status.items() if st == "M"} == patched
    assert text.count("\n--- /dev/null\n") == text.count("\nnew file mode 100644\n") == len(ours)
    # the header before the first `diff --git` is plain text that git apply and patch skip
    header = text[:text.index("diff --git ")]
    assert case.base in header and case.sha in header
    assert not any(line.startswith(("---", "+++", "@@", "diff", "Index:")) for line in header.splitlines())


def test_diff_applies_to_its_own_base_only(case, tmp_path_factory):
    others = [b for b in BASES if b != case.base]
    if not others:
        pytest.skip("only one base is pinned")
    for other in others:
        tree = _sparse_tree(other, case.paths, tmp_path_factory)
        res = _run(["git", "apply", "--check", case.result.diff_path], tree)
        assert res.returncode != 0 and "patch does not apply" in res.stdout, res.stdout
        if shutil.which("patch"):
            # patch(1) would apply most hunks with offsets and fuzz, but some fail: it exits non-zero
            dry = _run(["patch", "-p1", "--dry-run", "--batch"], tree, stdin=case.result.diff_path)
            assert dry.returncode != 0 and "FAILED" in dry.stdout, dry.stdout


def test_pr_description_names_base_files_and_tests(case):
    text = case.result.pr_path.read_text()
    assert text.startswith("# ")
    assert "${" not in text and "$base" not in text
    assert f"v{case.base}" in text and ze.diff_file_name(case.base) in text and case.sha in text
    for status, path in case.result.name_status:
        line = next(line for line in text.splitlines() if line.startswith(f"- `{path}`"))
        if status == "A":  # a new module says what it is in its docstring
            assert line != f"- `{path}` (new): new file", f"{path} has no docstring to describe it"
        else:  # a patched upstream file needs a hand-written line
            assert path in ze.MODIFIED_FILE_NOTES, f"add a line for {path} to MODIFIED_FILE_NOTES"
    assert case.result.diffstat.strip().splitlines()[-1].strip() in text
    for patch in zb.list_patches(case.base, REPO_ROOT):
        assert patch.name in text
    assert ("per_head_muon" in text) == (case.base != "0.19.7")


def _catches_import_error(node):
    names = []
    for handler in node.handlers:
        t = handler.type
        if t is None:
            return True
        names += [e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
    return bool({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} & set(names))


def test_exported_code_copes_without_build_info(case):
    # _build_info.py is a label of this project's wheel and is not exported: any exported module
    # importing it must do so inside a try that catches ImportError.
    for status, path in case.result.name_status:
        if not path.endswith(".py"):
            continue
        tree = ast.parse((case.built / path).read_text())
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and _catches_import_error(node):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.split(".")[-1] == "_build_info" for n in names):
                assert id(node) in guarded, f"{path}:{node.lineno} imports _build_info without an ImportError fallback"


def test_config_without_a_toml_library_matches_tomllib():
    tomllib = pytest.importorskip("tomllib")
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert zb._read_zero3muon_table(text) == tomllib.loads(text)["tool"]["zero3muon"]


def test_dev_py_export_command(tmp_path, tmp_path_factory):
    base = CFG["default-base"]
    case = _case(base, tmp_path_factory)
    env = dict(os.environ, **{zb.ENV_SDIST: str(case.sdist)})
    env.pop(zb.ENV_BASE, None)
    res = subprocess.run([sys.executable, str(REPO_ROOT / "dev.py"), "export", "--out", str(tmp_path)], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert res.returncode == 0, res.stderr
    diff, pr = tmp_path / ze.diff_file_name(base), tmp_path / "PR_DESCRIPTION.md"
    assert f"wrote {diff}" in res.stdout and f"wrote {pr}" in res.stdout
    assert case.result.diffstat in res.stdout
    # deterministic: the same bytes as the export made in-process
    assert diff.read_bytes() == case.diff_bytes
    assert pr.read_text() == case.result.pr_path.read_text()

    bad = subprocess.run([sys.executable, str(REPO_ROOT / "dev.py"), "export", "--base", "0.0.1"], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert bad.returncode != 0 and "unknown base '0.0.1'" in bad.stderr
