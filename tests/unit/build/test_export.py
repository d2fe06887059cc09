"""Tests of ``python3 dev.py export`` (build_backend/zero3muon_export.py). No torch, no wheel build.

Two parts:

- On this repository and the real pinned sdists (for each base whose sdist can be obtained the way
  the build obtains it: env DS_ZERO3MUON_SDIST, the sdist cache, or ``pip download``): each pull
  request's diff applies ALONE to a fresh unpack of the release with ``git apply`` and ``patch
  -p1`` and gives exactly its own new files and tests; the combined diff gives exactly the tree
  ``pip install .`` builds (``prepare_tree``, minus the build's two packaging labels and the wheel
  report) plus the exported tests; the pull requests together touch exactly the combined diff's
  files; every description covers every file of its diff. Set DS_ZERO3MUON_EXPORT_REPO to a
  checkout to run this part on it instead (e.g. a merge candidate).
- On a small fake release and project built in tmp_path (a file or two for every pull request of
  the split Muon change: seam, plan, pipeline, ZeRO-3 binding): the membership rules, and inputs that
  must stop the export (a file no pull request claims, a file two claim, a pull request whose
  patch needs another's context, one without a test, a modified file without a note, tests
  importing another pull request's test file undeclared in ``tests_need``, or a stale declaration;
  the same for modules and ``code_needs``, where importing an upstream module that a group's patches
  modify depends on that group (on the first, lowest-numbered, of several), and an import a patch adds
  counts as one of the group's code).

Unpacking a release writes ~3000 files, so the real part does it only where a whole tree matters
(the export itself, the build's tree, the ``git apply`` targets). ``patch`` runs on a tree holding
just the release's files at the paths a diff names (read from the sdist in memory): it reads and
writes nothing else, so it behaves there as in the whole tree.
"""

import ast
import difflib
import hashlib
import io
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
        self.result = ze.export(base, self.tmp / "out", REPO, self.sdist)
        self.built = zb.prepare_tree(self.sdist, self.sha, base, CFG["version"], tmp_path_factory.mktemp("build"),
                                     REPO)
        self.built_files = _files(self.built)
        self.applied = {}  # piece stem -> {path: (bytes, executable)} after git apply on a fresh unpack

    def apply(self, piece):
        """The files of a fresh unpack of the release after ``git apply`` of ``piece``'s diff."""
        if piece.stem not in self.applied:
            tree = zb.unpack_sdist(self.sdist, self.factory.mktemp(f"fresh-{piece.stem}"))
            check = _run(["git", "apply", "--check", piece.diff_path], tree)
            assert check.returncode == 0, f"{piece.diff_path.name} does not apply alone:\n{check.stdout}"
            res = _run(["git", "apply", piece.diff_path], tree)
            assert res.returncode == 0, res.stdout
            self.applied[piece.stem] = _files(tree)
        return self.applied[piece.stem]


def _case(base, tmp_path_factory):
    if base not in _CASES:
        _CASES[base] = Case(base, tmp_path_factory)
    return _CASES[base]


@pytest.fixture(scope="module", params=BASES)
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


def _run(cmd, cwd, stdin=None):
    with open(stdin, "rb") if stdin else open(os.devnull, "rb") as f:
        return subprocess.run([str(c) for c in cmd],
                              cwd=cwd,
                              env=zb._git_env(cwd),
                              stdin=f,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True)


def _files(tree):
    """{relative path: (bytes, executable)} of every file under ``tree``."""
    out = {}
    for p in sorted(Path(tree).rglob("*")):
        if p.is_file():
            out[p.relative_to(tree).as_posix()] = (p.read_bytes(), bool(p.stat().st_mode & 0o111))
    return out


def _repo_file(root, rel):
    p = Path(root) / rel
    return (p.read_bytes(), bool(p.stat().st_mode & 0o111))


# --------------------------------------------------------------------------- the real export

MUON_DIR = "deepspeed/runtime/zero/muon"
ZERO_TESTS = "tests/unit/runtime/zero"
SEAM_KEYS = ("muon-update-seam", "muon-owner-plan", "muon-pipeline")  # the core the bindings' code imports


def test_layout_and_membership(case):
    result = case.result
    assert [p.stem for p in result.pull_requests] == [
        "1-muon-update-seam", "2-muon-owner-plan", "3-muon-pipeline", "4-zero3-muon", "5-grad-window", "6-loss-scale",
        "7-universal-checkpoint", "8-universal-muon", "9-muon-selection", "10-zero12-muon-clipping",
        "11-muon-config", "12-muon-variants"
    ]
    assert sorted(p.name for p in result.out_dir.iterdir()) == sorted(f"{p.stem}.{ext}" for p in result.pieces
                                                                      for ext in ("diff", "md"))
    # every file that could go upstream is in exactly one pull request or backport, or never exported
    sources = [p for piece in [*result.pull_requests, *result.backports] for p in piece.sources]
    assert len(sources) == len(set(sources))
    never = [p for p in ze.candidate_files(case.base, REPO) if p not in sources]
    unpatched_backports = [
        g for g in ze.GROUPS if not g.pull_request and g.key not in {b.group.key
                                                                     for b in result.backports}
    ]
    for path in never:  # excluded, or a backport's test on a base where it has no patch
        assert (any(ze.fnmatch.fnmatchcase(path, pat) for pat in ze.NEVER_EXPORTED)
                or any(g.matches(path) for g in unpatched_backports)), path
    assert set(sources) | set(never) == set(ze.candidate_files(case.base, REPO))
    for path in ("tests/unit/common.py", "tests/conftest.py", *ze.PROJECT_ONLY):
        assert path not in case.result.combined.paths
    assert not [
        p for p in result.combined.paths if p.startswith(("tests/unit/build/", "tests/examples/", "tests/bench/"))
    ]
    by_key = {p.group.key: p for p in result.pull_requests}

    def patches(*numbers):  # repository paths of this base's patches with these numbers
        return [f"patches/{case.base}/{p.name}" for p in zb.list_patches(case.base, REPO) if p.name[:4] in numbers]

    # the split Muon pull request: the seam (0004 and its test), the plan's and the pipeline's modules
    # and tests (the pipeline's with the owner-state extension point and NorMuon), and the ZeRO-3 binding (zero3_update, 0001, the ZeRO-3 Muon tests and their helpers)
    assert by_key["muon-update-seam"].sources == [*patches("0004"), f"{ZERO_TESTS}/test_muon_update_split.py"]
    assert by_key["muon-owner-plan"].sources == [
        f"{MUON_DIR}/momentum.py", f"{MUON_DIR}/newton_schulz.py", f"{MUON_DIR}/owner_plan.py",
        f"{ZERO_TESTS}/newton_schulz_testing.py", f"{ZERO_TESTS}/test_muon_newton_schulz.py",
        f"{ZERO_TESTS}/test_muon_owner_plan.py"
    ]
    assert by_key["muon-pipeline"].sources == [
        f"{MUON_DIR}/owner_exchange.py", f"{MUON_DIR}/owner_state.py", f"{MUON_DIR}/pipeline.py",
        f"{ZERO_TESTS}/test_muon_owner_state.py", f"{ZERO_TESTS}/test_muon_pipeline.py"
    ]
    zero3_muon = by_key["zero3-muon"].sources
    assert [p for p in zero3_muon if not p.startswith("tests/")] == [f"{MUON_DIR}/zero3_update.py", *patches("0001")]
    muon_tests = [p for p in zero3_muon if p.startswith("tests/")]
    assert muon_tests and all(Path(p).name.startswith(("test_zero3_muon_", "zero3_muon_")) for p in muon_tests)
    assert muon_tests == sorted(
        p.relative_to(REPO).as_posix() for pattern in ("test_zero3_muon_*.py", "zero3_muon_*.py")
        for p in (REPO / ZERO_TESTS).glob(pattern))
    assert [p for p in by_key["grad-window"].sources
            if p.startswith("tests/")] == ["tests/unit/runtime/zero/test_zero3_grad_partition_window.py"]
    assert [p for p in by_key["loss-scale"].sources
            if p.startswith("tests/")] == ["tests/unit/runtime/zero/test_zero3_backward_loss_scale.py"]
    patch_numbers = {
        key: sorted(Path(p).name[:4] for p in piece.sources if p.startswith("patches/"))
        for key, piece in by_key.items()
    }
    assert patch_numbers["muon-update-seam"] == ["0004"] and patch_numbers["zero3-muon"] == ["0001"]
    assert patch_numbers["muon-owner-plan"] == patch_numbers["muon-pipeline"] == []
    assert patch_numbers["grad-window"] == ["0002"] and patch_numbers["loss-scale"] == ["0003"]
    assert patch_numbers["muon-selection"] == ["0010", "0011"] and patch_numbers["zero12-muon-clipping"] == ["0012"]
    # 0014 (scheduler rates per group), 0015 (the progress log's rates by group), 0016 (Muon keys checked)
    assert patch_numbers["muon-config"] == ["0014", "0015", "0016"]
    # 0017 (Polar Express as an ns_method), 0018 (NorMuon's keys in the engine, its state in state_dict())
    assert patch_numbers["muon-variants"] == ["0017", "0018"]
    # generic: 0006 (ds_to_universal), 0007 (stage3's universal loader), 0008 (the resize error), 0009
    # (ZeRO-3 sources at ZeRO-1/2); Muon's: 0013 (its state checks, its ZeRO-1/2 momentum)
    assert patch_numbers["universal-checkpoint"] == ["0006", "0007", "0008", "0009"]
    assert patch_numbers["universal-muon"] == ["0013"]
    checkpoint_tests = REPO / "tests/unit/checkpoint"
    universal = by_key["universal-checkpoint"].sources
    assert [p for p in universal if p.startswith("deepspeed/")] == ["deepspeed/checkpoint/zero3_universal.py"]
    assert [p for p in universal if p.startswith("tests/")] == sorted(
        p.relative_to(REPO).as_posix()
        for p in [*checkpoint_tests.glob("test_zero3_universal*.py"), checkpoint_tests / "zero3_universal_helpers.py"])
    universal_muon = by_key["universal-muon"].sources
    assert [p for p in universal_muon if p.startswith("deepspeed/")] == [
        "deepspeed/runtime/zero/muon/universal_state_checks.py",
        "deepspeed/runtime/zero/muon/zero12_universal_momentum.py"
    ]
    assert [p for p in universal_muon if p.startswith("tests/")] == sorted(
        p.relative_to(REPO).as_posix() for p in checkpoint_tests.glob("test_universal_checkpoint_muon*.py"))
    split = ("muon-update-seam", "muon-owner-plan", "muon-pipeline", "zero3-muon")
    assert not [p for key in split for p in by_key[key].sources if "universal" in p]
    # the four split pull requests' modules: every module of ours under muon/ but the wheel report and the
    # other pull requests' (universal_state_checks, zero12_universal_momentum, param_selection, zero12_update,
    # lr_groups, config_keys, polar_express, normuon)
    muon_dir = REPO / MUON_DIR
    assert sorted(p for key in split for p in by_key[key].sources if p.startswith("deepspeed/")) == sorted(
        p.relative_to(REPO).as_posix() for p in muon_dir.glob("*.py")
        if p.name not in ("__main__.py", "param_selection.py", "zero12_update.py", "universal_state_checks.py",
                          "zero12_universal_momentum.py", "lr_groups.py", "config_keys.py", "polar_express.py",
                          "normuon.py")
        and not p.name.startswith("_build_info"))
    assert sorted(by_key["muon-selection"].sources) == sorted([
        "deepspeed/runtime/zero/muon/param_selection.py", *patches("0010", "0011"),
        "tests/unit/runtime/zero/test_muon_param_selection.py"
    ])
    assert [p for p in by_key["zero12-muon-clipping"].sources
            if not p.startswith("tests/")] == [f"{MUON_DIR}/zero12_update.py", *patches("0012")]
    assert sorted(by_key["muon-config"].sources) == sorted([
        f"{MUON_DIR}/config_keys.py", f"{MUON_DIR}/lr_groups.py", *patches("0014", "0015", "0016"),
        f"{ZERO_TESTS}/test_muon_config_keys.py", f"{ZERO_TESTS}/test_muon_lr_groups.py"
    ])
    assert [p for p in by_key["zero12-muon-clipping"].sources if p.startswith("tests/")
            ] == sorted(p.relative_to(REPO).as_posix() for p in (REPO / ZERO_TESTS).glob("test_zero12_muon_*.py"))
    # the variants: Polar Express (its kernel, 0017, its tests) and NorMuon (its module, registered with the
    # pipeline's owner_state.py, its keys and checkpoint state: 0018, its tests)
    variants = by_key["muon-variants"].sources
    assert [p for p in variants if not p.startswith("tests/")] == [f"{MUON_DIR}/normuon.py", f"{MUON_DIR}/polar_express.py",
                                                                   *patches("0017", "0018")]
    variant_tests = [p for p in variants if p.startswith("tests/")]
    assert variant_tests == sorted([
        f"{ZERO_TESTS}/test_muon_normuon.py", f"{ZERO_TESTS}/test_muon_polar_express.py",
        f"{ZERO_TESTS}/test_zero3_polar_express.py",
        *(p.relative_to(REPO).as_posix() for p in (REPO / ZERO_TESTS).glob("test_zero3_normuon*.py"))
    ])
    assert f"{ZERO_TESTS}/test_zero3_normuon.py" in variant_tests
    # stacking: the plan's, muon-config's and the variants' code import original_muon.py as the seam patches it
    # (the lower-numbered of the two groups patching it), the pipeline's the plan's modules, the two bindings all
    # three; universal-muon's code imports the pipeline's owner_state.py and the universal module, the variants'
    # patch 0018 owner_state.py; the ZeRO-3 binding's tests import the plan's NS test helpers, the universal,
    # universal-muon, selection, ZeRO-1/2, config and variants pull requests' tests the ZeRO-3 Muon tests'
    # helpers; universal-muon's and the variants' also the universal one's, the variants' the plan's too
    assert {
        g.key: g.code_needs
        for g in ze.GROUPS if g.pull_request and g.code_needs
    } == {
        "muon-owner-plan": ("muon-update-seam", ),
        "muon-pipeline": ("muon-owner-plan", ),
        "zero3-muon": SEAM_KEYS,
        "universal-muon": ("muon-owner-plan", "muon-pipeline", "universal-checkpoint"),
        "zero12-muon-clipping": SEAM_KEYS,
        "muon-config": ("muon-update-seam", ),
        "muon-variants": ("muon-update-seam", "muon-pipeline")
    }
    assert {
        g.key: g.tests_need
        for g in ze.GROUPS if g.pull_request
    } == {
        "muon-update-seam": (),
        "muon-owner-plan": (),
        "muon-pipeline": (),
        "zero3-muon": ("muon-owner-plan", ),
        "grad-window": (),
        "loss-scale": (),
        "universal-checkpoint": ("zero3-muon", ),
        "universal-muon": ("zero3-muon", "universal-checkpoint"),
        "muon-selection": ("zero3-muon", ),
        "zero12-muon-clipping": ("zero3-muon", ),
        "muon-config": ("zero3-muon", ),
        "muon-variants": ("muon-owner-plan", "muon-pipeline", "universal-checkpoint", "zero3-muon")
    }
    owners = {p.group.key: p.sources for p in result.pull_requests}
    assert {dep
            for _, dep in ze.imported_groups(ze.MUON, owners, REPO)["muon-owner-plan"]
            } == {"tests/unit/runtime/zero/newton_schulz_testing.py"}
    assert "tests/unit/runtime/zero/zero3_muon_helpers.py" in {
        dep
        for _, dep in ze.imported_groups(ze.UNIVERSAL, owners, REPO)["zero3-muon"]
    }
    assert "tests/unit/checkpoint/zero3_universal_helpers.py" in {
        dep
        for _, dep in ze.imported_groups(ze.UNIVERSAL_MUON, owners, REPO)["universal-checkpoint"]
    }
    assert "deepspeed/checkpoint/zero3_universal.py" in {
        dep
        for _, dep in ze.code_imported_groups(ze.UNIVERSAL_MUON, owners, REPO)["universal-checkpoint"]
    }
    assert {dep
            for _, dep in ze.code_imported_groups(ze.UNIVERSAL_MUON, owners, REPO)["muon-pipeline"]
            } == {f"{MUON_DIR}/owner_state.py"}
    assert {key: {dep
                  for _, dep in deps}
            for key, deps in ze.imported_groups(ze.MUON_VARIANTS, owners, REPO).items()} == {
                "muon-owner-plan": {f"{ZERO_TESTS}/newton_schulz_testing.py"},
                "muon-pipeline": {f"{ZERO_TESTS}/test_muon_pipeline.py"},
                "zero3-muon": {f"{ZERO_TESTS}/zero3_muon_helpers.py"},
                "universal-checkpoint": {"tests/unit/checkpoint/zero3_universal_helpers.py"},
            }
    # original_muon.py is upstream's; the seam's patch and the variants' 0017 change it, and it counts as the
    # seam's (the lower-numbered group: 0017 patches on top of the seam's functions), so importing it needs the
    # seam, except in the variants' own code
    original = f"{MUON_DIR}/original_muon.py"
    assert ze.code_imported_groups(ze.PLAN, owners, REPO) == {
        "muon-update-seam": [(f"{MUON_DIR}/newton_schulz.py", original)]
    }
    assert ze.code_imported_groups(ze.MUON_CONFIG, owners, REPO) == {
        "muon-update-seam": [(f"{MUON_DIR}/config_keys.py", original)]
    }
    # the variants: polar_express.py imports original_muon.py; normuon.py registers with the pipeline's
    # owner_state.py, and patch 0018 adds an import of it to the engine (check_variant_config)
    assert ze.code_imported_groups(ze.MUON_VARIANTS, owners, REPO) == {
        "muon-update-seam": [(f"{MUON_DIR}/polar_express.py", original)],
        "muon-pipeline": [(f"{MUON_DIR}/normuon.py", f"{MUON_DIR}/owner_state.py"),
                          (patches("0018")[0], f"{MUON_DIR}/owner_state.py")],
    }
    assert {dep
            for _, dep in ze.code_imported_groups(ze.CORE, owners, REPO)["muon-owner-plan"]
            } == {f"{MUON_DIR}/momentum.py", f"{MUON_DIR}/newton_schulz.py", f"{MUON_DIR}/owner_plan.py"}
    for binding in (ze.MUON, ze.ZERO12_CLIPPING):
        imported = ze.code_imported_groups(binding, owners, REPO)
        assert sorted(imported) == sorted(SEAM_KEYS), binding
        assert {dep for _, dep in imported["muon-update-seam"]} == {original}, binding
        assert {dep
                for _, dep in imported["muon-pipeline"]
                } == {f"{MUON_DIR}/owner_exchange.py", f"{MUON_DIR}/owner_state.py", f"{MUON_DIR}/pipeline.py"}, binding
    backport_patches = [Path(p).name[:4] for b in result.backports for p in b.sources if p.startswith("patches/")]
    assert backport_patches == (["0005"] if any(p.name.startswith("0005-")
                                                for p in zb.list_patches(case.base, REPO)) else [])


def test_each_pull_request_applies_alone_and_gives_its_files(case):
    pristine = _pristine_files(case.base)
    for pr in case.result.pull_requests:
        got = case.apply(pr)
        changed = sorted(rel for rel in got if pristine.get(rel) != got[rel])
        assert changed == sorted(pr.paths), pr.stem
        assert not set(pristine) - set(got), f"{pr.stem} deletes files"
        for rel in pr.sources:  # its new modules and tests, byte for byte
            if not rel.startswith("patches/"):
                assert got[rel] == _repo_file(REPO, rel), (pr.stem, rel)
        for patch in (REPO / rel for rel in pr.sources if rel.startswith("patches/")):
            touched = {
                line.split()[2][2:]
                for line in patch.read_text().splitlines() if line.startswith("diff --git ")
            }
            assert touched <= set(pr.paths), (pr.stem, patch.name)


def test_combined_gives_the_built_tree_plus_the_tests(case):
    got, built, pristine = dict(case.apply(case.result.combined)), dict(case.built_files), _pristine_files(case.base)
    # the build's labels: present in the build, not produced by the diff (build.txt stays upstream's)
    assert zb.BUILD_INFO_REL.as_posix() in built and zb.BUILD_INFO_REL.as_posix() not in got
    assert got["build.txt"] == pristine["build.txt"] != built["build.txt"]
    for label in LABELS | set(ze.PROJECT_ONLY):
        got.pop(label, None)
        built.pop(label, None)
    tests = {rel: got.pop(rel) for rel in list(got) if rel.startswith("tests/")}
    assert sorted(got) == sorted(built), "file sets differ: " + repr(set(got) ^ set(built))
    differ = [rel for rel in got if got[rel] != built[rel]]
    assert not differ, f"contents or executable bit differ from the build's tree: {differ}"
    exported_tests = sorted(p for piece in [*case.result.pull_requests, *case.result.backports] for p in piece.sources
                            if p.startswith("tests/"))
    assert sorted(tests) == exported_tests
    assert all(tests[rel] == _repo_file(REPO, rel) for rel in tests)
    changed = sorted(rel for rel in {**got, **tests} if pristine.get(rel) != {**got, **tests}[rel])
    assert changed == sorted(case.result.combined.paths)


def test_pull_requests_together_touch_the_combined_files(case):
    pieces = [*case.result.pull_requests, *case.result.backports]
    assert set().union(*(p.paths for p in pieces)) == set(case.result.combined.paths)
    combined = case.apply(case.result.combined)
    owners = {}
    for piece in case.result.pull_requests:
        for path in piece.paths:
            owners.setdefault(path, []).append(piece)
    for path, [*prs] in owners.items():
        backported = any(path in b.paths for b in case.result.backports)
        if len(prs) == 1 and not backported:  # a file of one pull request only: the same there as in the combined
            assert case.apply(prs[0])[path] == combined[path], (prs[0].stem, path)


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patch_p1_gives_the_same_files(case):
    for piece in case.result.pieces:
        tree = _sparse_tree(case.base, piece.paths, case.factory)
        dry = _run(["patch", "-p1", "--dry-run", "--batch"], tree, stdin=piece.diff_path)
        assert dry.returncode == 0, (piece.stem, dry.stdout)
        res = _run(["patch", "-p1", "--batch", "--no-backup-if-mismatch"], tree, stdin=piece.diff_path)
        assert res.returncode == 0 and "fuzz" not in res.stdout and "offset" not in res.stdout, (piece.stem,
                                                                                                 res.stdout)
        got = _files(tree)
        assert sorted(got) == sorted(piece.paths)
        applied = case.apply(piece)
        assert got == {rel: applied[rel] for rel in got}, piece.stem


def test_diffs_are_plain_text_with_repo_relative_paths(case):
    ours = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "deepspeed").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }
    assert set(ze.PROJECT_ONLY) <= ours
    for piece in case.result.pieces:
        data = piece.diff_path.read_bytes()
        text = data.decode("utf-8")  # raises on binary junk
        assert b"\0" not in data and data.endswith(piece.diff)
        assert "GIT binary patch" not in text and "Binary files" not in text
        assert "__pycache__" not in text and ".pyc" not in text
        for secret in (str(REPO), str(case.tmp.parent), "/unpack/"):
            assert secret not in text
        headers = [line.split() for line in text.splitlines() if line.startswith("diff --git ")]
        paths = [h[2][2:] for h in headers]
        assert all(h[2] == f"a/{p}" and h[3] == f"b/{p}" for h, p in zip(headers, paths))
        assert not LABELS & set(paths)
        assert len(headers) == len(piece.name_status)
        # new files: exactly the piece's new modules and tests; modified: exactly what its patches touch
        patches = [REPO / rel for rel in piece.sources if rel.startswith("patches/")]
        patched = {
            line.split()[2][2:]
            for patch in patches
            for line in patch.read_text().splitlines() if line.startswith("diff --git ")
        }
        status = dict((path, st) for st, path in piece.name_status)
        new = {p for p in piece.sources if not p.startswith("patches/")}
        assert {p for p, st in status.items() if st == "A"} == new
        assert {p for p, st in status.items() if st == "M"} == patched
        assert new & ours == new - {p for p in new if p.startswith("tests/")}
        assert text.count("\n--- /dev/null\n") == text.count("\nnew file mode 100644\n") == len(new)
        # the header before the first `diff --git` is plain text that git apply and patch skip
        header = text[:text.index("diff --git ")]
        assert case.base in header and case.sha in header
        assert not any(line.startswith(("---", "+++", "@@", "diff", "Index:")) for line in header.splitlines())
    combined_new = {p for st, p in case.result.combined.name_status if st == "A" and p.startswith("deepspeed/")}
    assert combined_new == ours - set(ze.PROJECT_ONLY)


def test_combined_diff_applies_to_its_own_base_only(case, tmp_path_factory):
    others = [b for b in BASES if b != case.base]
    if not others:
        pytest.skip("only one base is pinned")
    diff = case.result.combined
    for other in others:
        tree = _sparse_tree(other, diff.paths, tmp_path_factory)
        res = _run(["git", "apply", "--check", diff.diff_path], tree)
        assert res.returncode != 0 and "patch does not apply" in res.stdout, res.stdout
        if shutil.which("patch"):
            # patch(1) would apply most hunks with offsets and fuzz, but some fail: it exits non-zero
            dry = _run(["patch", "-p1", "--dry-run", "--batch"], tree, stdin=diff.diff_path)
            assert dry.returncode != 0 and "FAILED" in dry.stdout, dry.stdout


def test_descriptions_cover_every_file(case):
    for piece in case.result.pieces:
        text = piece.text_path.read_text()
        title = piece.group.title if piece.group else None
        assert text.startswith(f"# {title}\n" if title else "# ")
        assert "${" not in text and "$base" not in text
        assert f"v{case.base}" in text and f"{piece.stem}.diff" in text and case.sha in text
        for section in ("## Files changed", "## Testing") + (
            ("## Problem", "## Fix", "## Behaviour changes", "## Compatibility") if piece.group else ()):
            assert section in text, (piece.stem, section)
        for status, path in piece.name_status:
            line = next((line for line in text.splitlines() if line.startswith(f"- `{path}`")), None)
            assert line, f"{piece.text_path.name} does not describe {path}"
            if status == "A":  # a new module or test says what it is in its docstring
                assert line != f"- `{path}` (new): new file", f"{path} has no docstring to describe it"
        assert piece.diffstat.strip().splitlines()[-1].strip() in text
        for rel in piece.sources:
            if rel.startswith("patches/"):
                assert Path(rel).name in text
            if Path(rel).name.startswith("test_") and piece.group:
                assert text.count(f"`{rel}`") >= 2, f"{piece.text_path.name}: {rel} not in its Testing section"
    texts = {pr.group.key: " ".join(pr.text_path.read_text().split()) for pr in case.result.pull_requests}
    heads = {
        pr.group.key: " ".join(pr.diff_path.read_text().split("diff --git ")[0].split())
        for pr in case.result.pull_requests
    }
    assert ("per_head_muon" in texts["zero3-muon"]) == (case.base != "0.19.7")
    # the seam's note on original_muon.py, per base: 0.19.8's NS compute dtype backported to 0.19.7, the
    # per-head shape check of 0.19.8
    assert ("`ns_compute_dtype`" in texts["muon-update-seam"]) == (case.base == "0.19.7")
    assert ("`_per_head_orthogonalize`" in texts["muon-update-seam"]) == (case.base != "0.19.7")
    numbered = {g.key: f"{g.number} ({g.key})" for g in ze.GROUPS}

    def prs(*keys, start=False):  # "pull request 1 (a)", "pull requests 1 (a), 2 (b) and 3 (c)"
        names = [numbered[k] for k in keys]
        text = ("pull request " if len(names) == 1 else
                "pull requests ") + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1])
        return text[0].upper() + text[1:] if start else text

    stacked = f"tests import test helpers of {prs('zero3-muon')}: it is stacked on that one for its tests"
    dependents = ('universal-checkpoint', 'universal-muon', 'muon-selection', 'zero12-muon-clipping', 'muon-config',
                  'muon-variants')
    needed = (f"{prs(*dependents, start=True)} "
              "apply without this one, but their tests import this one's test helpers")
    # the variants' tests import the plan's and the universal pull request's test helpers, not their code
    variants_needed = (f"{prs('muon-variants', start=True)} applies without this one, but its tests import this one's "
                       "test helpers (stacked on this one for its tests).")
    core_stacked = f"Its code imports modules of {prs(*SEAM_KEYS)}: it is stacked on those and goes in after them."
    plan_stacked = f"Its code imports modules of {prs('muon-update-seam')}: it is stacked on that one and goes in after it."
    pipeline_stacked = (f"Its code imports modules of {prs('muon-owner-plan')}: it is stacked on that one and goes in "
                        "after it.")
    zero12_tests = f"Its tests also import test helpers of {prs('zero3-muon')} and run with that one applied too."
    universal_stacked = (f"Its code imports modules of {prs('muon-owner-plan', 'muon-pipeline', 'universal-checkpoint')}: "
                         "it is stacked "
                         "on those and goes in after them. Its tests also import test helpers of "
                         f"{prs('zero3-muon')} and run with that one applied too.")
    variants_stacked = (f"Its code imports modules of {prs('muon-update-seam', 'muon-pipeline')}: it is stacked on "
                        "those and goes in after them. Its tests also import test helpers of "
                        f"{prs('muon-owner-plan', 'zero3-muon', 'universal-checkpoint')} and run with those applied "
                        "too.")
    imported_by = {
        "muon-update-seam":
        prs("muon-owner-plan", "zero3-muon", "zero12-muon-clipping", "muon-config", "muon-variants", start=True),
        "muon-owner-plan": prs("muon-pipeline", "zero3-muon", "universal-muon", "zero12-muon-clipping", start=True),
        "muon-pipeline": prs("zero3-muon", "universal-muon", "zero12-muon-clipping", "muon-variants", start=True),
        "universal-checkpoint": prs("universal-muon", start=True),
    }
    for key, who in imported_by.items():
        verb = "import" if who.startswith("Pull requests") else "imports"
        sentence = f"{who} {verb} this one's modules (stacked on this one)."
        assert sentence in texts[key] and sentence in heads[key], (key, sentence)
    for key, text in [*texts.items(), *heads.items()]:
        assert (stacked in text) == (key in ("universal-checkpoint", "muon-selection")), key
        assert (core_stacked in text) == (key in ("zero3-muon", "zero12-muon-clipping")), key
        assert (plan_stacked in text) == (key in ("muon-owner-plan", "muon-config")), key
        assert (pipeline_stacked in text) == (key == "muon-pipeline"), key
        assert (zero12_tests in text) == (key in ("zero12-muon-clipping", "universal-muon", "muon-config")), key
        assert (universal_stacked in text) == (key == "universal-muon"), key
        assert (variants_stacked in text) == (key == "muon-variants"), key
        assert (needed in text) == (key == "zero3-muon"), key
        assert (variants_needed in text) == (key in ("muon-owner-plan", "universal-checkpoint")), key
        assert ("apply without this one" in text
                or "applies without this one" in text) == (key in ("zero3-muon", "muon-owner-plan",
                                                                   "universal-checkpoint")), key
        assert ("import this one's modules" in text or "imports this one's modules" in text) == (key
                                                                                                 in imported_by), key
        assert "two other pull requests" not in text
    # which pull requests each says are independent of it: those it needs nothing of, for code or tests,
    # and that need nothing of it
    independent = {
        "muon-update-seam":
        ("muon-pipeline", "grad-window", "loss-scale", "universal-checkpoint", "universal-muon", "muon-selection"),
        "muon-owner-plan": ("grad-window", "loss-scale", "universal-checkpoint", "muon-selection", "muon-config"),
        "muon-pipeline":
        ("muon-update-seam", "grad-window", "loss-scale", "universal-checkpoint", "muon-selection", "muon-config"),
        "zero3-muon": ("grad-window", "loss-scale"),
        "grad-window":
        tuple(k for k in numbered if k not in ("grad-window", "allgather-wait-backport")),
        "loss-scale":
        tuple(k for k in numbered if k not in ("loss-scale", "allgather-wait-backport")),
        "universal-checkpoint":
        (*SEAM_KEYS, "grad-window", "loss-scale", "muon-selection", "zero12-muon-clipping", "muon-config"),
        "universal-muon": ("muon-update-seam", "grad-window", "loss-scale", "muon-selection", "zero12-muon-clipping",
                           "muon-config", "muon-variants"),
        "muon-selection": (*SEAM_KEYS, "grad-window", "loss-scale", "universal-checkpoint", "universal-muon",
                           "zero12-muon-clipping", "muon-config", "muon-variants"),
        "zero12-muon-clipping": ("grad-window", "loss-scale", "universal-checkpoint", "universal-muon",
                                 "muon-selection", "muon-config", "muon-variants"),
        "muon-config": ("muon-owner-plan", "muon-pipeline", "grad-window", "loss-scale", "universal-checkpoint",
                        "universal-muon", "muon-selection", "zero12-muon-clipping", "muon-variants"),
        "muon-variants": ("grad-window", "loss-scale", "universal-muon", "muon-selection", "zero12-muon-clipping",
                          "muon-config"),
    }
    assert sorted(independent) == sorted(texts)
    for key, others in independent.items():
        sentence = f"{prs(*others, start=True)} of this export are independent of this one."
        for text in (texts[key], heads[key]):
            assert sentence in text, (key, sentence)
            assert text.count("of this export are independent of this one") == 1, key
    assert "KeyError: 'exp_avg'" in texts["universal-checkpoint"] and "#8608" in texts["universal-checkpoint"]
    combined = case.result.combined.text_path.read_text()
    for pr in case.result.pull_requests:
        assert f"**{pr.group.title}**: `{pr.stem}.diff`" in combined
    flat = " ".join(combined.split())
    for g in ze.GROUPS:
        if not g.pull_request:
            continue
        code = [o for o in ze.GROUPS if o.pull_request and g.key in o.code_needs]
        tests_only = [o for o in ze.GROUPS if o.pull_request and g.key in o.tests_need and g.key not in o.code_needs]
        assert flat.count(f"Its code imports modules of pull request {numbered[g.key]}: stacked on that one.") == len(
            code), g.key
        assert flat.count(f"Its tests import test helpers of pull request {numbered[g.key]}: stacked on that one for "
                          "its tests.") == len(tests_only), g.key
    # code: the seam's by 2, 4, 10, 11 and 12; the plan's by 3, 4, 8 and 10; the pipeline's by 4, 8, 10 and 12;
    # the universal one's by 8. Tests only: the plan's helpers by 12, the ZeRO-3 Muon ones by 7 to 12, the
    # universal ones by 12
    assert flat.count("Its code imports modules of pull request 1 (muon-update-seam)") == 5
    assert flat.count("Its code imports modules of pull request 2 (muon-owner-plan)") == 4
    assert flat.count("Its code imports modules of pull request 3 (muon-pipeline)") == 4
    assert flat.count("Its tests import test helpers of pull request 2 (muon-owner-plan)") == 1
    assert flat.count("Its tests import test helpers of pull request 4 (zero3-muon)") == 6
    assert flat.count("Its code imports modules of pull request 7 (universal-checkpoint)") == 1
    assert flat.count("Its tests import test helpers of pull request 7 (universal-checkpoint)") == 1
    assert flat.count("Its code imports modules of pull request 12 (muon-variants)") == 0
    for bp in case.result.backports:
        assert bp.group.title in combined and "0.19.8 already" in combined


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
    tree_files = case.apply(case.result.combined)
    for status, path in case.result.combined.name_status:
        if not path.endswith(".py"):
            continue
        tree = ast.parse(tree_files[path][0].decode())
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
    (tmp_path / "PR_DESCRIPTION.md").write_text("from the single-diff layout")  # an earlier export's
    (tmp_path / "99-renamed-since.diff").write_text("a pull request of an earlier layout")  # two-digit numbers too
    (tmp_path / "notes.txt").write_text("not ours")
    res = subprocess.run([sys.executable, str(REPO / "dev.py"), "export", "--out",
                          str(tmp_path)],
                         cwd=tmp_path,
                         env=env,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         text=True)
    assert res.returncode == 0, res.stderr
    for piece in case.result.pieces:
        diff, text = tmp_path / f"{piece.stem}.diff", tmp_path / f"{piece.stem}.md"
        assert f"wrote {diff}" in res.stdout and f"wrote {text}" in res.stdout
        assert piece.diffstat in res.stdout
        # deterministic: the same bytes as the export made in-process
        assert diff.read_bytes() == piece.diff_path.read_bytes()
        assert text.read_text() == piece.text_path.read_text()
    assert not (tmp_path / "PR_DESCRIPTION.md").exists() and (tmp_path / "notes.txt").exists()
    assert not (tmp_path / "99-renamed-since.diff").exists()

    bad = subprocess.run([sys.executable, str(REPO / "dev.py"), "export", "--base", "0.0.1"],
                         cwd=tmp_path,
                         env=env,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         text=True)
    assert bad.returncode != 0 and "unknown base '0.0.1'" in bad.stderr


# --------------------------------------------------------------------------- a fake release and project

FAKE_BASE = "9.9.9"
STAGE3_LINES = [f"line {i} of stage3" for i in range(1, 31)]
UPSTREAM = {
    "setup.py": "from setuptools import setup\nsetup()\n",
    "deepspeed/__init__.py": "",
    "deepspeed/runtime/zero/stage3.py": "\n".join(STAGE3_LINES) + "\n",
    "deepspeed/runtime/zero/partition_parameters.py": "handle.wait()\n",
    "deepspeed/runtime/zero/muon/__init__.py": "",
    "deepspeed/runtime/zero/muon/original_muon.py": "def muon_update():\n    pass\n",
    "deepspeed/checkpoint/ds_to_universal.py": "exp_avg = state['exp_avg']\n",
}
UNIVERSAL_TEST = "tests/unit/checkpoint/test_zero3_universal.py"
# the new modules of each split Muon pull request in the fake project
FAKE_MODULES = {
    "muon-update-seam": [],
    "muon-owner-plan": ["deepspeed/runtime/zero/muon/newton_schulz.py", "deepspeed/runtime/zero/muon/owner_plan.py"],
    "muon-pipeline": ["deepspeed/runtime/zero/muon/pipeline.py"],
    "zero3-muon": ["deepspeed/runtime/zero/muon/zero3_update.py"],
}


def _make_diff(rel, old, new, context=1):
    lines = difflib.unified_diff(old.splitlines(keepends=True),
                                 new.splitlines(keepends=True),
                                 f"a/{rel}",
                                 f"b/{rel}",
                                 n=context)
    return f"diff --git a/{rel} b/{rel}\n" + "".join(lines)


def _stage3_patch(*changes, base_text=None):
    """A diff of the fake stage3.py replacing line i (1-based) by text for each (i, text)."""
    old = base_text or UPSTREAM["deepspeed/runtime/zero/stage3.py"]
    lines = old.splitlines()
    for i, text in changes:
        lines[i - 1] = text
    return _make_diff("deepspeed/runtime/zero/stage3.py", old, "\n".join(lines) + "\n")


def _doc_module(doc):
    return f'"""{doc}"""\n'


def fake_project(tmp_path, extra=None, drop=()):
    """A fake release (sdist) and a fake project checkout with one file of every kind the export
    sorts; ``extra``: more repository files {path: text}, ``drop``: paths to leave out.
    Returns (repo, sdist)."""
    sdist = tmp_path / f"deepspeed-{FAKE_BASE}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in UPSTREAM.items():
            data = text.encode()
            info = tarfile.TarInfo(f"deepspeed-{FAKE_BASE}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    patches = f"patches/{FAKE_BASE}"
    files = {
        "pyproject.toml": (f'[tool.zero3muon]\nversion = "0.0.1"\ndefault-base = "{FAKE_BASE}"\n\n'
                           f'[tool.zero3muon.sdist-sha256]\n"{FAKE_BASE}" = "{sha}"\n'),
        # the split Muon change: the seam (0004 and its test), the plan (its modules, importing original_muon.py
        # as the seam patches it; its tests and NS test helpers), the pipeline (importing the plan's module),
        # the ZeRO-3 binding (importing all three; 0001; its tests and helpers, importing the plan's helpers)
        "deepspeed/runtime/zero/muon/owner_plan.py":
        _doc_module("The owner plan."),
        "deepspeed/runtime/zero/muon/newton_schulz.py":
        _doc_module("Newton-Schulz on the owner.") + "from deepspeed.runtime.zero.muon import original_muon\n",
        "deepspeed/runtime/zero/muon/pipeline.py":
        _doc_module("The per-bucket pipeline.") + "from deepspeed.runtime.zero.muon.owner_plan import OwnerPlan\n",
        "deepspeed/runtime/zero/muon/zero3_update.py":
        _doc_module("ZeRO-3's binding.") + "from deepspeed.runtime.zero.muon import original_muon\n"
        "from deepspeed.runtime.zero.muon.owner_plan import OwnerPlan\n"
        "from deepspeed.runtime.zero.muon.pipeline import MuonPipeline\n",
        "deepspeed/runtime/zero/muon/__main__.py":
        _doc_module("This project's wheel report."),
        f"{patches}/0001-zero3-muon-boundary-update.patch":
        _stage3_patch((3, "muon wiring")),
        f"{patches}/0002-zero3-grad-partition-first-use-in-window.patch":
        _stage3_patch((10, "first use")),
        f"{patches}/0003-zero3-unscale-by-backward-loss-scale.patch":
        _stage3_patch((17, "backward scale")),
        f"{patches}/0004-muon-update-split.patch":
        _make_diff("deepspeed/runtime/zero/muon/original_muon.py",
                   UPSTREAM["deepspeed/runtime/zero/muon/original_muon.py"],
                   "def muon_update():\n    return elementwise()\n"),
        f"{patches}/0005-zero3-allgather-coalesced-wait-every-handle.patch":
        _make_diff("deepspeed/runtime/zero/partition_parameters.py", "handle.wait()\n",
                   "for h in handles:\n    h.wait()\n"),
        f"{patches}/0006-checkpoint-universal-zero3-every-optimizer-state.patch":
        _make_diff("deepspeed/checkpoint/ds_to_universal.py", UPSTREAM["deepspeed/checkpoint/ds_to_universal.py"],
                   "states = every_state()\n"),
        f"{patches}/0007-zero3-universal-load-optimizer-state-per-sub-group.patch":
        _stage3_patch((24, "per sub-group")),
        "deepspeed/checkpoint/zero3_universal.py":
        _doc_module("ZeRO-3 universal checkpoints of any optimizer."),
        UNIVERSAL_TEST:
        _doc_module("Convert, then resume at another world size.") +
        "from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun\n",
        "tests/conftest.py":
        "",
        "tests/unit/common.py":
        _doc_module("Local stand-in of DeepSpeed's unit.common."),
        "tests/unit/build/test_export.py":
        "",
        "tests/examples/test_demo.py":
        "",
        "tests/bench/test_bench_counting.py":
        "",
        "tests/unit/runtime/zero/test_muon_update_split.py":
        _doc_module("muon_update as its two halves."),
        "tests/unit/runtime/zero/test_muon_owner_plan.py":
        _doc_module("The owner plan."),
        "tests/unit/runtime/zero/newton_schulz_testing.py":
        _doc_module("Newton-Schulz test helpers."),
        "tests/unit/runtime/zero/test_muon_pipeline.py":
        _doc_module("The pipeline, bucket by bucket."),
        "tests/unit/runtime/zero/test_zero3_muon_gas.py":
        _doc_module("Muon under accumulation."),
        "tests/unit/runtime/zero/zero3_muon_helpers.py":
        _doc_module("Helpers of the Muon tests.") + "from unit.runtime.zero.newton_schulz_testing import NSCounter\n",
        "tests/unit/runtime/zero/test_zero3_grad_partition_window.py":
        _doc_module("Partitions in a window."),
        "tests/unit/runtime/zero/test_zero3_backward_loss_scale.py":
        _doc_module("The backward's loss scale."),
        "tests/unit/runtime/zero/test_zero3_allgather_coalesced_wait.py":
        _doc_module("Every handle waited on."),
    }
    files.update(extra or {})
    repo = tmp_path / "repo"
    for rel, text in files.items():
        if rel not in drop:
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
    return repo, sdist


def _fake_export(tmp_path, **kwargs):
    repo, sdist = fake_project(tmp_path, kwargs.pop("extra", None), kwargs.pop("drop", ()))
    return ze.export(FAKE_BASE, tmp_path / "out", repo, sdist, **kwargs), repo, sdist


def test_fake_membership_and_independent_pull_requests(tmp_path):
    result, repo, sdist = _fake_export(tmp_path)
    sources = {p.stem: p.sources for p in result.pull_requests}
    zero = "tests/unit/runtime/zero"
    assert sources == {
        "1-muon-update-seam":
        [f"patches/{FAKE_BASE}/0004-muon-update-split.patch", f"{zero}/test_muon_update_split.py"],
        "2-muon-owner-plan":
        [*FAKE_MODULES["muon-owner-plan"], f"{zero}/newton_schulz_testing.py", f"{zero}/test_muon_owner_plan.py"],
        "3-muon-pipeline": [*FAKE_MODULES["muon-pipeline"], f"{zero}/test_muon_pipeline.py"],
        "4-zero3-muon": [
            *FAKE_MODULES["zero3-muon"], f"patches/{FAKE_BASE}/0001-zero3-muon-boundary-update.patch",
            f"{zero}/test_zero3_muon_gas.py", f"{zero}/zero3_muon_helpers.py"
        ],
        "5-grad-window": [
            f"patches/{FAKE_BASE}/0002-zero3-grad-partition-first-use-in-window.patch",
            "tests/unit/runtime/zero/test_zero3_grad_partition_window.py"
        ],
        "6-loss-scale": [
            f"patches/{FAKE_BASE}/0003-zero3-unscale-by-backward-loss-scale.patch",
            "tests/unit/runtime/zero/test_zero3_backward_loss_scale.py"
        ],
        "7-universal-checkpoint": [
            "deepspeed/checkpoint/zero3_universal.py",
            f"patches/{FAKE_BASE}/0006-checkpoint-universal-zero3-every-optimizer-state.patch",
            f"patches/{FAKE_BASE}/0007-zero3-universal-load-optimizer-state-per-sub-group.patch", UNIVERSAL_TEST
        ],
    }
    [backport] = result.backports
    assert backport.paths == [
        "deepspeed/runtime/zero/partition_parameters.py",
        "tests/unit/runtime/zero/test_zero3_allgather_coalesced_wait.py"
    ]
    combined = result.combined.paths
    assert set(combined) == {p for piece in [*result.pull_requests, backport] for p in piece.paths}
    assert "deepspeed/runtime/zero/partition_parameters.py" in combined
    for never in ("tests/unit/common.py", "tests/conftest.py", "tests/unit/build/test_export.py",
                  "deepspeed/runtime/zero/muon/__main__.py"):
        assert all(never not in piece.paths for piece in result.pieces)
    # each pull request applies alone to the pristine release and changes only its own lines and modules
    stage3_lines = {
        "4-zero3-muon": ["muon wiring"],
        "5-grad-window": ["first use"],
        "6-loss-scale": ["backward scale"],
        "7-universal-checkpoint": ["per sub-group"]
    }
    ours = sorted(p for modules in FAKE_MODULES.values() for p in modules)
    upstream_original = UPSTREAM["deepspeed/runtime/zero/muon/original_muon.py"]
    for pr in result.pull_requests:
        (tmp_path / pr.stem).mkdir()
        tree = zb.unpack_sdist(sdist, tmp_path / pr.stem)
        res = _run(["git", "apply", pr.diff_path], tree)
        assert res.returncode == 0, res.stdout
        stage3 = (tree / "deepspeed/runtime/zero/stage3.py").read_text().splitlines()
        assert [x for x in stage3 if not x.startswith("line ")] == stage3_lines.get(pr.stem, []), pr.stem
        assert (tree / "tests/unit/common.py").exists() is False
        universal = (tree / "deepspeed/checkpoint/ds_to_universal.py").read_text()
        assert (universal == "states = every_state()\n") == (pr.stem == "7-universal-checkpoint")
        original = (tree / "deepspeed/runtime/zero/muon/original_muon.py").read_text()
        assert (original != upstream_original) == (pr.stem == "1-muon-update-seam"), pr.stem
        assert [p for p in ours if (tree / p).exists()] == FAKE_MODULES.get(pr.group.key, []), pr.stem
    text = result.combined.text_path.read_text()
    assert backport.group.title in text and "not proposed upstream" in text
    assert "partition_parameters.py" not in "".join(p.text_path.read_text() for p in result.pull_requests)
    # the stacking the fake's imports give: plan on the seam (original_muon.py as 0004 patches it), pipeline
    # on the plan, the binding on all three, its tests on the plan's helpers; universal's tests on the binding's
    texts = {pr.group.key: " ".join(pr.text_path.read_text().split()) for pr in result.pull_requests}
    assert ("Its code imports modules of pull request 1 (muon-update-seam): it is stacked on that one"
            in texts["muon-owner-plan"])
    assert ("Its code imports modules of pull request 2 (muon-owner-plan): it is stacked on that one"
            in texts["muon-pipeline"])
    assert ("Its code imports modules of pull requests 1 (muon-update-seam), 2 (muon-owner-plan) and 3 "
            "(muon-pipeline): it is stacked on those and goes in after them." in texts["zero3-muon"])
    assert ("Pull request 7 (universal-checkpoint) applies without this one, but its tests import this one's test "
            "helpers (stacked on this one for its tests)." in texts["zero3-muon"])
    assert ("Pull requests 5 (grad-window) and 6 (loss-scale) of this export are independent of this one."
            in texts["zero3-muon"])


def test_fake_release_without_backport_or_optional_patch(tmp_path):
    # a base without 0005 (0.19.8): the backport's test is not exported either
    (tmp_path / "no-backport").mkdir()
    (tmp_path / "no-seam").mkdir()
    drop = (f"patches/{FAKE_BASE}/0005-zero3-allgather-coalesced-wait-every-handle.patch", )
    result, _, _ = _fake_export(tmp_path / "no-backport", drop=drop)
    assert result.backports == [] and len(result.pull_requests) == 7
    assert "backport" not in result.combined.text_path.read_text().lower()
    assert not [p for p in result.combined.paths if "allgather" in p or "partition_parameters" in p]
    # 0004 is no longer optional: without it the seam changes nothing, and the modules importing
    # original_muon.py (the plan's, the binding's) import upstream's file, of no group
    with pytest.raises(ze.ExportError) as err:
        _fake_export(tmp_path / "no-seam", drop=(f"patches/{FAKE_BASE}/0004-muon-update-split.patch", ))
    message = str(err.value)
    assert "pull request '1-muon-update-seam' changes nothing in DeepSpeed" in message
    assert ("the modules of pull request '2-muon-owner-plan' import modules of no other group but its code_needs "
            "says ['muon-update-seam']") in message
    assert ("the modules of pull request '4-zero3-muon' import modules of ['muon-owner-plan', 'muon-pipeline'] but "
            "its code_needs says ['muon-owner-plan', 'muon-pipeline', 'muon-update-seam']") in message
    assert "'3-muon-pipeline'" not in message
    assert not (tmp_path / "no-seam" / "out").exists()


@pytest.mark.parametrize("extra, message", [
    ({
        "tests/unit/runtime/zero/test_something_else.py": ""
    }, "no pull request claims these files: "
     "tests/unit/runtime/zero/test_something_else.py"),
    ({
        f"patches/{FAKE_BASE}/0099-more.patch": ""
    }, f"no pull request claims these files: patches/{FAKE_BASE}/0099-more.patch"),
    ({
        "tests/unit/checkpoint/test_universal_checkpoint.py": ""
    }, "no pull request claims these files: "
     "tests/unit/checkpoint/test_universal_checkpoint.py"),
    ({
        "deepspeed/runtime/zero/muon/new_module.py": ""
    }, "no pull request claims these files: "
     "deepspeed/runtime/zero/muon/new_module.py"),
    ({
        "deepspeed/runtime/zero/stage3_helper.py": ""
    }, "no pull request claims these files: "
     "deepspeed/runtime/zero/stage3_helper.py"),
])
def test_fake_unclaimed_file_stops_the_export(tmp_path, extra, message):
    with pytest.raises(ze.ExportError, match="no pull request claims") as err:
        _fake_export(tmp_path, extra=extra)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_fake_overlapping_rules_stop_the_export(tmp_path):
    greedy = ze.Group("greedy",
                      6,
                      ze.LOSS_SCALE.title, ("tests/unit/runtime/zero/test_*.py", ), {},
                      template=ze.LOSS_SCALE.template)
    with pytest.raises(ze.ExportError, match="claimed more than once") as err:
        _fake_export(tmp_path, groups=(*ze.GROUPS, greedy))
    for path, key in (("test_muon_update_split.py", "muon-update-seam"), ("test_muon_owner_plan.py",
                                                                          "muon-owner-plan"),
                      ("test_muon_pipeline.py", "muon-pipeline"), ("test_zero3_muon_gas.py", "zero3-muon")):
        assert f"tests/unit/runtime/zero/{path} ({key} and greedy)" in str(err.value)


def test_fake_patch_needing_another_pull_requests_context_stops_the_export(tmp_path):
    # 0003 made on top of 0002 with a context line 0002 changed: applies in the series, not alone
    stage3 = UPSTREAM["deepspeed/runtime/zero/stage3.py"].replace("line 10 of stage3", "first use")
    dependent = _stage3_patch((11, "backward scale"), base_text=stage3)
    assert "\n first use\n" in dependent
    with pytest.raises(ze.ExportError, match="pull request '6-loss-scale' does not apply to the pristine") as err:
        _fake_export(tmp_path,
                     extra={f"patches/{FAKE_BASE}/0003-zero3-unscale-by-backward-loss-scale.patch": dependent})
    assert "0003-zero3-unscale-by-backward-loss-scale.patch" in str(err.value)


def test_fake_pull_request_without_test_stops_the_export(tmp_path):
    with pytest.raises(ze.ExportError, match="pull request '5-grad-window' has no test under tests/"):
        _fake_export(tmp_path, drop=("tests/unit/runtime/zero/test_zero3_grad_partition_window.py", ))
    # the seam's only test gone: its patch is no pull request's without a test either
    (tmp_path / "seam").mkdir()
    with pytest.raises(ze.ExportError, match="pull request '1-muon-update-seam' has no test under tests/"):
        _fake_export(tmp_path / "seam", drop=("tests/unit/runtime/zero/test_muon_update_split.py", ))


def test_fake_modified_file_without_a_note_stops_the_export(tmp_path):
    # the seam's patch also changing muon/__init__.py, for which SEAM has no note (still changing
    # original_muon.py, which the plan's and the binding's modules import)
    seam = f"patches/{FAKE_BASE}/0004-muon-update-split.patch"
    original = "deepspeed/runtime/zero/muon/original_muon.py"
    other = _make_diff(original, UPSTREAM[original], "def muon_update():\n    return elementwise()\n") + _make_diff(
        "deepspeed/runtime/zero/muon/__init__.py", "", "from .original_muon import muon_update\n")
    with pytest.raises(ze.ExportError,
                       match="deepspeed/runtime/zero/muon/__init__.py is modified by muon-update-seam "
                       "but has no"):
        _fake_export(tmp_path, extra={seam: other})


def test_fake_new_file_clashing_with_upstream_stops_the_export(tmp_path):
    # a group claiming a new file of ours at the path of an upstream file (the groups name their modules one
    # by one): the seam with its own original_muon.py instead of the patch's change
    original = "deepspeed/runtime/zero/muon/original_muon.py"
    seam = ze.Group(ze.SEAM.key,
                    ze.SEAM.number,
                    ze.SEAM.title, (*ze.SEAM.patterns, original),
                    ze.SEAM.notes,
                    template=ze.SEAM.template)
    assert ze.GROUPS[0] is ze.SEAM
    with pytest.raises(zb.BuildError, match="already exist in the upstream") as err:
        _fake_export(tmp_path, extra={original: "# ours\n"}, groups=(seam, *ze.GROUPS[1:]))
    assert original in str(err.value)


def test_fake_universal_groups_claim_their_files(tmp_path):
    # the generic group: patches 0008/0009, its ZeRO-1/2 test and test helpers; the Muon one: its modules
    # (importing the generic module, the plan's newton_schulz.py and the pipeline's owner_state.py), patch 0013 and its tests (importing both
    # groups' test helpers)
    patches = f"patches/{FAKE_BASE}"
    generic = {
        f"{patches}/0008-engine-resize-names-universal-checkpoint.patch": _stage3_patch((28, "names load_universal")),
        UNIVERSAL_TEST.replace(".py", "_zero12.py"):
        _doc_module("ZeRO-1/2.") + "from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun\n",
        "tests/unit/checkpoint/zero3_universal_helpers.py": _doc_module("Helpers of the universal tests."),
    }
    core = {"deepspeed/runtime/zero/muon/owner_state.py": _doc_module("A Muon variant's state on the owner.")}
    muon = {
        "deepspeed/runtime/zero/muon/universal_state_checks.py":
        _doc_module("Muon state in universal checkpoints.") +
        "from deepspeed.checkpoint.zero3_universal import FP32\n"
        "from deepspeed.runtime.zero.muon.owner_state import variant_of\n",
        "deepspeed/runtime/zero/muon/zero12_universal_momentum.py":
        _doc_module("ZeRO-1/2 Muon momentum.") + "from deepspeed.runtime.zero.muon.newton_schulz import matrix_spec\n",
        f"{patches}/0013-universal-muon-state.patch":
        _stage3_patch((30, "muon checks")),
        "tests/unit/checkpoint/test_universal_checkpoint_muon.py":
        _doc_module("Muon runs resume elsewhere.") + "from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun\n"
        "from unit.checkpoint.zero3_universal_helpers import unequal_states\n",
    }
    result, _, _ = _fake_export(tmp_path, extra={**generic, **core, **muon})
    (tmp_path / "plain").mkdir()
    universal, universal_muon = result.pull_requests[6:8]
    assert (universal.stem, universal_muon.stem) == ("7-universal-checkpoint", "8-universal-muon")
    assert set(generic) <= set(universal.sources) and set(muon) == set(universal_muon.sources)
    assert set(core) <= set(result.pull_requests[2].sources)
    split = result.pull_requests[:4]
    assert [pr.stem for pr in split] == ["1-muon-update-seam", "2-muon-owner-plan", "3-muon-pipeline", "4-zero3-muon"]
    assert not [p for pr in split for p in pr.sources if "universal" in p]
    assert ("Pull requests 7 (universal-checkpoint) and 8 (universal-muon) apply without this one, but their tests "
            "import this one's test helpers (stacked on this one for their tests)."
            in " ".join(split[3].text_path.read_text().split()))
    # the engine's sentences come with 0008; the ZeRO-1/2 ones only with 0009
    text = " ".join(universal.text_path.read_text().split())
    assert "bare world-size mismatch" in text and "names `ds_to_universal`" in text and "ZeRO-1/2: a universal" not in text
    assert "Pull request 8 (universal-muon) imports this one's modules (stacked on this one)." in text
    muon_text = " ".join(universal_muon.text_path.read_text().split())
    assert ("Its code imports modules of pull requests 2 (muon-owner-plan), 3 (muon-pipeline) and 7 "
            "(universal-checkpoint): it is stacked "
            "on those and goes in after them. Its tests also import test helpers of pull request 4 (zero3-muon) and run "
            "with that one applied too." in muon_text)
    pipeline_text = " ".join(result.pull_requests[2].text_path.read_text().split())
    assert ("Pull requests 4 (zero3-muon) and 8 (universal-muon) import this one's modules (stacked on this one)."
            in pipeline_text)
    plain = _fake_export(tmp_path / "plain")[0].pull_requests[6].text_path.read_text()
    assert "bare world-size mismatch" not in plain and "names `ds_to_universal`" not in plain
    # the Muon module no longer importing the generic one: its code_needs is stale
    (tmp_path / "stale").mkdir()
    with pytest.raises(ze.ExportError, match=r"'8-universal-muon' import modules of \['muon-owner-plan'\] but its code_needs"):
        standalone = {"deepspeed/runtime/zero/muon/universal_state_checks.py": _doc_module("Standalone.")}
        _fake_export(tmp_path / "stale", extra={**generic, **core, **muon, **standalone})


def test_fake_undeclared_or_stale_test_dependency_stops_the_export(tmp_path):
    # a grad-window test importing the muon helpers: its group does not declare that
    window = "tests/unit/runtime/zero/test_zero3_grad_partition_window.py"
    (tmp_path / "undeclared").mkdir()
    (tmp_path / "stale").mkdir()
    with pytest.raises(ze.ExportError,
                       match="pull request '5-grad-window' import files of \\['zero3-muon'\\] but its "
                       "tests_need says none") as err:
        _fake_export(tmp_path / "undeclared", extra={window: "from unit.runtime.zero.zero3_muon_helpers import X\n"})
    assert f"{window} imports tests/unit/runtime/zero/zero3_muon_helpers.py" in str(err.value)
    # the universal test no longer importing them: the declaration is stale
    with pytest.raises(ze.ExportError,
                       match="'7-universal-checkpoint' import files of no other group but its "
                       "tests_need says \\['zero3-muon'\\]"):
        _fake_export(tmp_path / "stale", extra={UNIVERSAL_TEST: _doc_module("Standalone.")})
    # the ZeRO-3 Muon helpers no longer importing the plan's NS test helpers: its tests_need is stale
    (tmp_path / "stale-binding").mkdir()
    with pytest.raises(ze.ExportError,
                       match="'4-zero3-muon' import files of no other group but its tests_need says "
                       "\\['muon-owner-plan'\\]"):
        _fake_export(tmp_path / "stale-binding",
                     extra={"tests/unit/runtime/zero/zero3_muon_helpers.py": _doc_module("Standalone helpers.")})


def test_code_needs_an_upstream_module_a_groups_patch_modifies(tmp_path):
    # code_imported_groups: a module importing an upstream module that one group's patches modify depends on
    # that group (as on another group's new module); one that several groups' patches modify on the first of
    # them (the later ones patch on top of its additions); one only its own group's patches modify is no
    # dependency
    original, stage3, engine, config = (f"deepspeed/runtime/{p}.py"
                                        for p in ("zero/muon/original_muon", "zero/stage3", "engine", "zero/config"))
    patched = {"seam": [original], "stage3-a": [stage3], "stage3-b": [stage3, engine], "user": [config]}
    patches = tmp_path / "patches" / FAKE_BASE
    patches.mkdir(parents=True)
    owners = {}
    for n, (key, targets) in enumerate(patched.items(), 1):
        name = f"{n:04d}-{key}.patch"
        (patches / name).write_text("".join(_make_diff(t, "old\n", "new\n") for t in targets))
        owners[key] = [f"patches/{FAKE_BASE}/{name}"]
    module, helper = "deepspeed/runtime/zero/muon/user.py", "deepspeed/runtime/zero/muon/helper.py"
    (tmp_path / module).parent.mkdir(parents=True)
    (tmp_path / module).write_text("from deepspeed.runtime.zero.muon import original_muon\n"
                                   "import deepspeed.runtime.zero.stage3\n"
                                   "from deepspeed.runtime.engine import DeepSpeedEngine\n"
                                   "from deepspeed.runtime.zero.config import ZeroConfig\n"
                                   "from deepspeed.runtime.zero.muon.helper import f\n")
    (tmp_path / helper).write_text("from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3\n")
    owners["user"] += [module, "tests/unit/test_user.py"]
    owners["helper"] = [helper]
    user, helper_group = ze.Group("user", 1, "user", (), {}), ze.Group("helper", 2, "helper", (), {})
    # stage3.py: stage3-a's and stage3-b's patches modify it, it counts as stage3-a's (the first)
    assert ze.code_imported_groups(user, owners, tmp_path) == {
        "seam": [(module, original)],
        "stage3-a": [(module, stage3)],
        "stage3-b": [(module, engine)],
        "helper": [(module, helper)]
    }
    assert ze.code_imported_groups(helper_group, owners, tmp_path) == {"stage3-a": [(helper, stage3)]}
    # a later group's patch modifying original_muon.py too: it is still the seam's
    (patches /
     "0002-stage3-a.patch").write_text(_make_diff(stage3, "old\n", "new\n") + _make_diff(original, "old\n", "new\n"))
    assert ze.code_imported_groups(user, owners, tmp_path)["seam"] == [(module, original)]
    # the first group in the export's order wins, not the first in the patch's file name
    reordered = {key: owners[key] for key in ("stage3-b", "seam", "stage3-a", "user", "helper")}
    assert ze.code_imported_groups(helper_group, reordered, tmp_path) == {"stage3-b": [(helper, stage3)]}
    # stage3-a's patch left out of the export: stage3.py is stage3-b's alone, original_muon.py the seam's
    del owners["stage3-a"]
    assert ze.code_imported_groups(user, owners, tmp_path) == {
        "seam": [(module, original)],
        "stage3-b": [(module, stage3), (module, engine)],
        "helper": [(module, helper)]
    }
    assert ze.code_imported_groups(helper_group, owners, tmp_path) == {"stage3-b": [(helper, stage3)]}


def test_fake_upstream_module_patched_by_two_groups_counts_as_the_first(tmp_path):
    # the ZeRO-3 binding's 0001 also changing original_muon.py (on top of the seam's 0004, as the variants'
    # 0017 does): importing it still needs the seam, the lower-numbered group, for the plan and the binding
    original = "deepspeed/runtime/zero/muon/original_muon.py"
    newer = "def muon_update():\n    return elementwise() + 0\n"
    both = _stage3_patch((3, "muon wiring")) + _make_diff(original, UPSTREAM[original], newer)
    repo, _ = fake_project(tmp_path, extra={f"patches/{FAKE_BASE}/0001-zero3-muon-boundary-update.patch": both})
    owners = ze.assign(FAKE_BASE, repo)  # the groups' declarations hold: no ExportError
    assert ze.code_imported_groups(ze.PLAN, owners, repo) == {
        "muon-update-seam": [("deepspeed/runtime/zero/muon/newton_schulz.py", original)]
    }
    assert ze.code_imported_groups(ze.MUON, owners, repo)["muon-update-seam"] == [
        ("deepspeed/runtime/zero/muon/zero3_update.py", original)
    ]
    # without the seam's patch, the binding's 0001 is the only one modifying it: the plan's import needs that one
    assert ze.code_imported_groups(ze.PLAN, {**owners, "muon-update-seam": []}, repo) == {
        "zero3-muon": [("deepspeed/runtime/zero/muon/newton_schulz.py", original)]
    }


def test_fake_import_a_patch_adds_is_code_needed(tmp_path):
    # a patch adding an import of another group's module to an upstream file (0018's engine.py importing the
    # pipeline's owner_state.py): its group's code depends on that group, and must say so in code_needs
    patch = f"patches/{FAKE_BASE}/0003-zero3-unscale-by-backward-loss-scale.patch"
    importing = _stage3_patch((17, "        from deepspeed.runtime.zero.muon.pipeline import MuonPipeline"))
    with pytest.raises(ze.ExportError) as err:
        _fake_export(tmp_path, extra={patch: importing})
    message = str(err.value)
    assert ("the modules of pull request '6-loss-scale' import modules of ['muon-pipeline'] but its code_needs says "
            f"none: {patch} imports deepspeed/runtime/zero/muon/pipeline.py") in message
    # declared, it goes through and the description says it is stacked on that one
    loss_scale = ze.Group(ze.LOSS_SCALE.key, ze.LOSS_SCALE.number, ze.LOSS_SCALE.title, ze.LOSS_SCALE.patterns,
                          ze.LOSS_SCALE.notes, ze.LOSS_SCALE.template, code_needs=("muon-pipeline", ))
    groups = tuple(loss_scale if g is ze.LOSS_SCALE else g for g in ze.GROUPS)
    (tmp_path / "declared").mkdir()
    result, _, _ = _fake_export(tmp_path / "declared", extra={patch: importing}, groups=groups)
    [pr] = [p for p in result.pull_requests if p.group.key == "loss-scale"]
    assert ("Its code imports modules of pull request 3 (muon-pipeline): it is stacked on that one and goes in "
            "after it.") in " ".join(pr.text_path.read_text().split())
    # an import the patch removes ("-") or leaves (context) is not one it adds
    other = tmp_path / "other.patch"
    other.write_text("+++ b/deepspeed/runtime/zero/stage3.py\n-from deepspeed.runtime.zero.muon.pipeline import A\n"
                     " from deepspeed.runtime.zero.muon.owner_plan import B\n+x = 1  # from deepspeed.runtime import C\n")
    assert ze._patch_deepspeed_imports(other) == []
