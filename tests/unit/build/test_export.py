"""Tests of ``python3 dev.py export`` (build_backend/zero3muon_export.py). No torch, no wheel build.

- On this repository and the real pinned sdists (each base whose sdist can be had as the build
  gets it: env DS_ZERO3MUON_SDIST, the sdist cache, or ``pip download``; else skipped): the six
  pull requests hold the files their purpose says, every file once; each diff applies ALONE to a
  fresh unpack of the release and gives exactly its files; the combined diff gives the tree
  ``pip install .`` builds plus the tests; the declared needs are the imports' (the export checks
  them) and docs/maintainers.md shows the graph; descriptions name every file; ``dev.py export`` prints
  each pull request's changed lines and removes an earlier export's stale files. Set
  DS_ZERO3MUON_EXPORT_REPO to a checkout to run this part on it instead (e.g. a merge candidate).
- On a small fake release and project with groups of its own (tmp_path): the rules that must stop
  the export, each once.
"""

import ast
import difflib
import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "build_backend"))
import zero3muon_build as zb  # noqa: E402
import zero3muon_export as ze  # noqa: E402

REPO = Path(os.environ.get("DS_ZERO3MUON_EXPORT_REPO") or REPO_ROOT).resolve()
CFG = zb.load_config(REPO)
BASES = sorted(CFG["sdist-sha256"])
LABELS = {"build.txt", zb.BUILD_INFO_REL.as_posix()}  # written by the build, left out of the export


def _obtain(base):
    """The verified sdist of ``base`` as the build gets it; skips the test if it cannot be had."""
    sha = CFG["sdist-sha256"][base]
    local = os.environ.get(zb.ENV_SDIST)
    saved = None
    if local and (not Path(local).is_file() or zb.sha256_of(local) != sha):
        saved = os.environ.pop(zb.ENV_SDIST)  # the other base's sdist: use the cache / pip for this one
    try:
        return zb.obtain_sdist(base, sha)
    except zb.BuildError as e:
        pytest.skip(f"the deepspeed-{base} sdist cannot be obtained here: {str(e).splitlines()[0]}")
    finally:
        if saved is not None:
            os.environ[zb.ENV_SDIST] = saved


def _run(cmd, cwd):
    return subprocess.run([str(c) for c in cmd],
                          cwd=cwd,
                          env=zb._git_env(cwd),
                          stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)


def _files(tree):
    """{relative path: (bytes, executable)} of every file under ``tree``."""
    return {
        p.relative_to(tree).as_posix(): (p.read_bytes(), bool(p.stat().st_mode & 0o111))
        for p in sorted(Path(tree).rglob("*")) if p.is_file()
    }


class Case:
    """One base: its sdist, the export written from it, the pristine and the built trees."""

    def __init__(self, base, factory):
        self.base, self.factory, self.sdist = base, factory, _obtain(base)
        self.result = ze.export(base, factory.mktemp(f"export-{base}") / "out", REPO, self.sdist)
        self.pristine = _files(zb.unpack_sdist(self.sdist, factory.mktemp("pristine")))
        self.built = _files(
            zb.prepare_tree(self.sdist, CFG["sdist-sha256"][base], base, CFG["version"], factory.mktemp("build"),
                            REPO))
        self.applied = {}

    def apply(self, piece):
        """The files of a fresh unpack of the release after ``git apply`` of ``piece``'s diff alone."""
        if piece.stem not in self.applied:
            tree = zb.unpack_sdist(self.sdist, self.factory.mktemp(f"fresh-{piece.stem}"))
            res = _run(["git", "apply", piece.diff_path], tree)
            assert res.returncode == 0, f"{piece.diff_path.name} does not apply alone:\n{res.stdout}"
            self.applied[piece.stem] = _files(tree)
        return self.applied[piece.stem]


_CASES = {}


@pytest.fixture(scope="module", params=BASES)
def case(request, tmp_path_factory):
    if request.param not in _CASES:
        _CASES[request.param] = Case(request.param, tmp_path_factory)
    return _CASES[request.param]


# --------------------------------------------------------------------------- the real export

ZERO_TESTS = "tests/unit/runtime/zero"


def test_six_pull_requests_each_file_once(case):
    result = case.result
    by_key = {pr.group.key: pr for pr in result.pull_requests}
    assert list(by_key) == [
        "zero3-muon", "zero3-configurations", "zero12-muon", "universal-checkpoints", "muon-config", "muon-variants"
    ]
    assert sorted(p.name for p in result.out_dir.iterdir()) == sorted(f"{p.stem}.{ext}" for p in result.pieces
                                                                      for ext in ("diff", "md"))
    sources = [p for piece in [*result.pull_requests, *result.backports] for p in piece.sources]
    assert len(sources) == len(set(sources))
    for path in set(ze.candidate_files(case.base, REPO)) - set(sources):  # excluded, or a patchless backport's
        assert any(ze.fnmatch.fnmatchcase(path, p) for p in ze.NEVER_EXPORTED) or "allgather" in path, path

    def numbers(key):
        return [Path(p).name[:4] for p in by_key[key].sources if p.startswith("patches/")]

    assert [numbers(k) for k in by_key] == [["0001", "0003", "0004", "0016"], ["0002"], ["0012"],
                                            ["0006", "0007", "0008", "0009", "0013"], ["0010", "0011"], ["0017", "0018"]]
    assert [Path(p).name[:4] for b in result.backports for p in b.sources
            if p.startswith("patches/")] == (["0005"] if case.base == "0.19.7" else [])
    seed = by_key["zero3-muon"].sources
    assert [Path(p).stem for p in seed if p.startswith("deepspeed/")
            ] == ["rank_agreement", "binding", "config", "momentum", "newton_schulz", "owner_exchange",
                  "owner_plan", "owner_state", "param_record", "pipeline", "support"]
    # the first pull request's tests are lean and import no helper module: the seam, one end-to-end
    # ZeRO-3 run (the plan's own tests go with zero3-configurations, the threaded pipeline's with zero12-muon)
    assert [Path(p).name for p in seed if p.startswith("tests/")] == [
        "test_muon_update_split.py", "test_zero3_muon_boundary.py"
    ]
    universal = by_key["universal-checkpoints"].sources
    assert {p for p in sources if p.startswith(("deepspeed/checkpoint/", "tests/unit/checkpoint/"))} <= set(universal)
    configurations = by_key["zero3-configurations"].sources
    assert {
        f"{ZERO_TESTS}/test_zero3_muon_gas.py", f"{ZERO_TESTS}/zero3_muon_helpers.py",
        f"{ZERO_TESTS}/test_zero3_muon_configs.py"
    } <= set(configurations)
    # the tests' package goes with the first pull request whose tests import it, as tests/muon_testing/ (the
    # causal language models with the tensor-parallel tests of zero12-muon, the threaded ranks with the pipeline's
    # tests there, the attention reference with the MuonClip tests of muon-variants)
    later = ("causal_lm.py", "threaded_exchange.py")
    package = sorted(p for p in sources if p.startswith("testing/") and not p.endswith(later + ("attention.py", )))
    assert package and set(package) <= set(configurations)
    assert {f"testing/muon_testing/{name}" for name in later} <= set(by_key["zero12-muon"].sources)
    assert "testing/muon_testing/attention.py" in by_key["muon-variants"].sources
    assert {ze.exported_path(p) for p in package} <= set(by_key["zero3-configurations"].paths)
    assert all(ze.exported_path(p).startswith("tests/muon_testing/") for p in package)


def test_needs_are_the_imports_and_the_readme_shows_them(case):
    owners = ze.assign(case.base, REPO)  # strict: raises where a declaration differs from the imports
    for g in ze.GROUPS:
        if g.pull_request:
            assert sorted(ze.needed_groups(g, owners, REPO)) == sorted(g.needs), g.key
    graph = ze.graph_line()
    assert graph.startswith("1 zero3-muon; 2 zero3-configurations needs 1;")  # the seed fix merges alone
    assert graph in " ".join((REPO / "docs" / "maintainers.md").read_text().split())
    # the ZeRO-1/2 binding's patch imports the seed's binding.py
    zero12 = ze.needed_groups(ze.GROUPS[2], owners, REPO)["zero3-muon"]
    assert any(p.startswith("patches/") and dep.endswith("/binding.py") for p, dep in zero12)


def test_each_pull_request_applies_alone_and_gives_its_files(case):
    for pr in case.result.pull_requests:
        got = case.apply(pr)
        assert sorted(r for r in got if case.pristine.get(r) != got[r]) == sorted(pr.paths), pr.stem
        assert set(case.pristine) <= set(got), f"{pr.stem} deletes files"
        for rel in pr.sources:
            if not rel.startswith("patches/"):  # its new modules and tests, byte for byte
                assert got[ze.exported_path(rel)][0] == (REPO / rel).read_bytes(), (pr.stem, rel)
        status = dict((path, st) for st, path in pr.name_status)
        patched = {t for p in pr.sources if p.startswith("patches/") for t in ze._patched_files(REPO / p)}
        assert {p for p, st in status.items() if st == "M"} == patched, pr.stem


def test_combined_is_the_build_plus_the_tests(case):
    got, built = dict(case.apply(case.result.combined)), dict(case.built)
    assert got["build.txt"] == case.pristine["build.txt"] != built["build.txt"]
    for label in LABELS | set(ze.PROJECT_ONLY):
        got.pop(label, None)
        built.pop(label, None)
    tests = {rel: got.pop(rel) for rel in list(got) if rel.startswith("tests/")}
    assert got == built
    assert sorted(tests) == sorted(
        ze.exported_path(p) for piece in [*case.result.pull_requests, *case.result.backports] for p in piece.sources
        if ze.exported_path(p).startswith("tests/"))
    pieces = [*case.result.pull_requests, *case.result.backports]
    assert set().union(*(p.paths for p in pieces)) == set(case.result.combined.paths)


def test_diffs_and_sizes(case):
    for piece in case.result.pieces:
        text = piece.diff_path.read_text()
        header = text[:text.index("diff --git ")]  # plain text that git apply and patch skip
        assert case.base in header and CFG["sdist-sha256"][case.base] in header
        assert not any(line.startswith(("---", "+++", "@@", "diff", "Index:")) for line in header.splitlines())
        assert str(REPO) not in text and "/unpack/" not in text and "GIT binary patch" not in text
        assert not LABELS & set(piece.paths)
        numstat = _run(["git", "apply", "--numstat", piece.diff_path], piece.diff_path.parent).stdout
        assert piece.changed_lines == sum(
            int(a) + int(d) for a, d, _ in (line.split("\t") for line in numstat.splitlines()))
    assert ze.changed_lines(b"diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n--- old\n+++ new\n same\n") == 2


def test_descriptions_name_every_file(case):
    for piece in case.result.pieces:
        text = piece.text_path.read_text()
        assert "${" not in text and f"v{case.base}" in text and f"{piece.stem}.diff" in text
        for path in piece.paths:
            assert f"`{path}`" in text, (piece.stem, path)
        for st, path in piece.name_status:  # a new file says what it is in its docstring
            assert st != "A" or f"- `{path}` (new): new file" not in text, path
        if piece.group:
            for section in ("## Problem", "## Fix", "## Behaviour changes", "## Compatibility", "## Files",
                            "## Testing"):
                assert section in text, (piece.stem, section)
            assert ze.relations(piece.group, [pr.group for pr in case.result.pull_requests]) in " ".join(text.split())
    texts = {pr.group.key: " ".join(pr.text_path.read_text().split()) for pr in case.result.pull_requests}
    assert "It needs no other pull request of this export: it merges on its own." in texts["zero3-muon"]
    assert ("It needs pull requests 1 (zero3-muon) and 2 (zero3-configurations) of this export (its code or tests "
            "import files of those): merge those first.") in texts["zero12-muon"]
    combined = " ".join(case.result.combined.text_path.read_text().split())
    assert ze.graph_line() in combined
    for pr in case.result.pull_requests:
        assert f"`{pr.stem}.diff`, `{pr.stem}.md` ({pr.changed_lines} changed lines)" in combined


def test_exported_code_copes_without_build_info(case):
    """_build_info.py is a label of this project's wheel and is not exported: a module importing it
    must do so inside a try that catches ImportError."""
    files = case.apply(case.result.combined)
    for path in case.result.combined.paths:
        if not path.endswith(".py"):
            continue
        tree = ast.parse(files[path][0].decode())
        guarded = {
            id(n)
            for node in ast.walk(tree) if isinstance(node, ast.Try) and any(
                h.type is None or "ImportError" in ast.dump(h.type) or "Exception" in ast.dump(h.type)
                for h in node.handlers) for stmt in node.body for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "_build_info" in ast.dump(node):
                assert id(node) in guarded, f"{path}:{node.lineno} imports _build_info without an ImportError fallback"


def test_config_without_a_toml_library_matches_tomllib():
    tomllib = pytest.importorskip("tomllib")
    text = (REPO_ROOT / "pyproject.toml").read_text()
    assert zb._read_zero3muon_table(text) == tomllib.loads(text)["tool"]["zero3muon"]


def test_dev_py_export_command(tmp_path, tmp_path_factory):
    base = CFG["default-base"]
    if base not in _CASES:
        _CASES[base] = Case(base, tmp_path_factory)
    case = _CASES[base]
    env = dict(os.environ, **{zb.ENV_SDIST: str(case.sdist)})
    env.pop(zb.ENV_BASE, None)
    (tmp_path / "7-merged-since.diff").write_text("a pull request of the twelve-PR layout")
    (tmp_path / "12-muon-variants.md").write_text("two-digit numbers too")
    (tmp_path / "notes.txt").write_text("not ours")
    res = subprocess.run([sys.executable, str(REPO / "dev.py"), "export", "--out",
                          str(tmp_path)],
                         cwd=tmp_path,
                         env=env,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT,
                         text=True)
    assert res.returncode == 0, res.stdout
    for piece in case.result.pieces:
        assert f"wrote {tmp_path / piece.stem}.diff" in res.stdout
        assert f"{piece.stem}: " in res.stdout and f"  {piece.changed_lines} changed lines" in res.stdout
        assert (tmp_path / f"{piece.stem}.diff").read_bytes() == piece.diff_path.read_bytes()  # deterministic
        assert (tmp_path / f"{piece.stem}.md").read_text() == piece.text_path.read_text()
    assert f"merge order: {ze.graph_line()}" in res.stdout
    assert not (tmp_path / "7-merged-since.diff").exists() and not (tmp_path / "12-muon-variants.md").exists()
    assert (tmp_path / "notes.txt").exists()


# --------------------------------------------------------------------------- a fake release and project

FAKE_BASE = "9.9.9"
CORE = "deepspeed/core.py"
CORE_TEXT = "".join(f"line {i} of core\n" for i in range(1, 21))
UPSTREAM = {"setup.py": "from setuptools import setup\nsetup()\n", "deepspeed/__init__.py": "", CORE: CORE_TEXT}


def _diff(rel, old, new):
    return f"diff --git a/{rel} b/{rel}\n" + "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}", n=1))


def _core_patch(line, text, base_text=CORE_TEXT):
    lines = base_text.splitlines(True)
    lines[line - 1] = text + "\n"
    return _diff(CORE, base_text, "".join(lines))


def _groups(beta_needs=("alpha", ), extra=()):
    """alpha: a module, patch 0001 and its tests; beta (needs alpha): a module importing alpha's, patch
    0002 and every other test; a backport: patch 0003 and its test."""
    return ze.numbered(
        ze.Group("alpha", "Alpha", ("deepspeed/alpha.py", "patches/*/0001-*.patch", "tests/unit/test_alpha*.py")),
        ze.Group("beta",
                 "Beta", ("deepspeed/beta.py", "patches/*/0002-*.patch", "tests/unit/test_*.py",
                          "!tests/unit/test_alpha*.py", "!tests/unit/test_backport.py"),
                 needs=beta_needs), *extra,
        ze.Group("bp", "Backport", ("patches/*/0003-*.patch", "tests/unit/test_backport.py"), why="Not upstream."))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """export(extra={path: text or None}, groups=...): the fake project with ``extra`` (None: left out),
    exported with the fake groups and templates; returns the ``Export``."""
    templates = tmp_path / "templates"
    templates.mkdir()
    for key in ("alpha", "beta", "gamma"):
        (templates / f"{key}.md").write_text(f"## Problem\n\n## Fix\n\n`{CORE}`: changed.\n\n${{new_files}}\n"
                                             "${diffstat}\n\n## Testing\n\n${tests}\n")
    (templates / "combined.md").write_text("${graph}\n${pull_requests}${backports}\n${files}\n${diffstat}\n")
    monkeypatch.setattr(ze, "TEMPLATE_DIR", templates)
    sdist = tmp_path / f"deepspeed-{FAKE_BASE}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in UPSTREAM.items():
            info = tarfile.TarInfo(f"deepspeed-{FAKE_BASE}/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    patches = f"patches/{FAKE_BASE}"

    def export(extra=None, groups=None, **kwargs):
        files = {
            "pyproject.toml": (f'[tool.zero3muon]\nversion = "0.0.1"\ndefault-base = "{FAKE_BASE}"\n\n'
                               f'[tool.zero3muon.sdist-sha256]\n"{FAKE_BASE}" = "{sha}"\n'),
            "deepspeed/alpha.py":
            '"""Alpha."""\n',
            "deepspeed/beta.py":
            '"""Beta."""\nfrom deepspeed.alpha import a\n',
            "deepspeed/runtime/zero/muon/__main__.py":
            '"""The wheel report."""\n',
            f"{patches}/0001-alpha.patch":
            _core_patch(3, "alpha"),
            f"{patches}/0002-beta.patch":
            _core_patch(12, "beta"),
            f"{patches}/0003-backport.patch":
            _core_patch(18, "backport"),
            "tests/unit/test_alpha.py":
            '"""Alpha\'s test."""\n',
            "tests/unit/test_beta.py":
            '"""Beta\'s test."""\nfrom unit.test_alpha import helper\n',
            "tests/unit/test_backport.py":
            '"""The backport\'s test."""\n',
            "tests/unit/common.py":
            "",
            "tests/unit/build/test_export.py":
            "",
        }
        files.update(extra or {})
        repo = tmp_path / f"repo{len(list(tmp_path.glob('repo*')))}"
        for rel, text in files.items():
            if text is not None:
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                (repo / rel).write_text(text)
        return ze.export(FAKE_BASE, repo / "out", repo, sdist, groups=groups or _groups(), **kwargs)

    return export


def test_fake_export(fake):
    result = fake()
    assert [pr.stem for pr in result.pull_requests] == ["1-alpha", "2-beta"] and len(result.backports) == 1
    beta = result.pull_requests[1]
    assert beta.sources == ["deepspeed/beta.py", f"patches/{FAKE_BASE}/0002-beta.patch", "tests/unit/test_beta.py"]
    assert beta.changed_lines == 2 + 2 + 2  # beta.py, test_beta.py, one line of core.py replaced
    text = " ".join(beta.text_path.read_text().split())
    assert "It needs pull request 1 (alpha) of this export" in text and "`deepspeed/beta.py` (new): Beta." in text
    assert "Pull request 2 (beta) needs this one." in result.pull_requests[0].text_path.read_text()
    combined = result.combined.text_path.read_text()
    assert "1 alpha; 2 beta needs 1" in combined and "Not upstream." in combined
    assert "tests/unit/common.py" not in combined and "__main__.py" not in combined
    # a base without the backport's patch exports neither it nor its test
    result = fake(extra={f"patches/{FAKE_BASE}/0003-backport.patch": None})
    assert result.backports == [] and "tests/unit/test_backport.py" not in result.combined.paths


@pytest.mark.parametrize("extra, groups, message", [
    ({
        "deepspeed/gamma.py": ""
    }, None, "no pull request claims these files: deepspeed/gamma.py"),
    (None, _groups(extra=(ze.Group("gamma", "Gamma", ("tests/unit/*", )), )),
     "tests/unit/test_beta.py (beta and gamma)"),
    ({
        "tests/unit/test_alpha.py": None
    }, None, "pull request '1-alpha' has no test under tests/"),
    ({
        f"patches/{FAKE_BASE}/0002-beta.patch": _core_patch(4, "beta", CORE_TEXT.replace("line 3 of", "alpha"))
    }, None, "pull request '2-beta' does not apply to the pristine deepspeed-9.9.9 on its own"),
    (None, _groups(beta_needs=()), "'2-beta' imports files of ['alpha'] but its needs say none; "
     "deepspeed/beta.py imports deepspeed/alpha.py; tests/unit/test_beta.py imports tests/unit/test_alpha.py"),
    ({
        "deepspeed/beta.py": "",
        "tests/unit/test_beta.py": "from deepspeed.core import x\n"
    }, None, "'2-beta' imports files of no other pull request but its needs say ['alpha']"),
    (None, ze.numbered(*reversed(_groups()[:2]),
                       _groups()[2]), "'1-beta' needs ['alpha'], which do not come before"),
    ({
        f"patches/{FAKE_BASE}/0002-beta.patch": _diff("deepspeed/__init__.py", "", "x = 1\n")
    }, None, "pull request '2-beta' changes deepspeed/__init__.py, which its description"),
])
def test_fake_export_refuses(fake, extra, groups, message):
    with pytest.raises(ze.ExportError) as err:
        fake(extra=extra, groups=groups)
    assert message in str(err.value)


def test_fake_needs_from_patched_modules_and_added_imports(fake):
    # beta's code importing the upstream module alpha's patch changes needs alpha (a test's import would not)
    fake(extra={"deepspeed/beta.py": "from deepspeed.core import x\n", "tests/unit/test_beta.py": ""})
    # so does an import that beta's patch adds to an upstream file
    added = _core_patch(12, "    from deepspeed.alpha import a")
    fake(extra={"deepspeed/beta.py": "", "tests/unit/test_beta.py": "", f"patches/{FAKE_BASE}/0002-beta.patch": added})


def test_fake_testing_package_is_exported_under_tests(fake):
    """testing/muon_testing/ (the tests' package, installed into the project's venvs) is exported as
    tests/muon_testing/, described by its docstrings; a test importing it needs its pull request."""
    alpha = ze.Group(
        "alpha", "Alpha",
        ("deepspeed/alpha.py", "patches/*/0001-*.patch", "tests/unit/test_alpha*.py", "testing/muon_testing/*"))
    extra = {
        "testing/muon_testing/__init__.py": '"""The package."""\n',
        "testing/muon_testing/shared.py": '"""Shared."""\n',
        "deepspeed/beta.py": "",  # beta's test importing the package is all that ties beta to alpha
        "tests/unit/test_beta.py": "from muon_testing.shared import x\n",
    }
    result = fake(extra=extra, groups=ze.numbered(alpha, *_groups()[1:]))
    first = result.pull_requests[0]
    assert [p for p in first.sources if p.startswith("testing/")] == sorted(p for p in extra if "muon_testing" in p)
    assert {"tests/muon_testing/__init__.py", "tests/muon_testing/shared.py"} <= set(first.paths)
    assert "`tests/muon_testing/shared.py` (new): Shared." in " ".join(first.text_path.read_text().split())
    assert "tests/muon_testing/shared.py" in result.combined.paths
    with pytest.raises(ze.ExportError, match="tests/unit/test_beta.py imports testing/muon_testing/shared.py"):
        fake(extra=extra, groups=ze.numbered(alpha, *_groups(beta_needs=())[1:]))


def test_fake_size_limit(fake):
    with pytest.raises(ze.ExportError, match=r"over 3 changed lines: 1-alpha has 4, 2-beta has 6 \(sizes"):
        fake(max_changed_lines=3)
    assert len(fake(max_changed_lines=6).pull_requests) == 2
