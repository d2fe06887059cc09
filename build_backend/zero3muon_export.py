"""The change as upstream pull requests, for DeepSpeed maintainers (``python3 dev.py export``).

A maintainer reviews and merges pull requests, not this project: the export cuts the change into
the few pull requests of ``GROUPS``, each with one purpose, and writes for each a diff against the
pristine release and a description, plus the combined diff of all of them.

- Membership: every file that could go upstream (``deepspeed/``, ``tests/``, ``patches/<base>/``, and
  the tests' package ``testing/muon_testing/``, exported as ``tests/muon_testing/``: ``EXPORTED_AS``)
  belongs to exactly one group by its patterns, or is never exported (``NEVER_EXPORTED``). A file
  that none or two claim stops the export (``ExportError`` naming it): a new file must be placed
  on purpose, not land in whichever pull request a broad pattern happens to give it.
- Dependencies: a group declares ``needs``, the earlier groups whose files its code or tests
  import. The export checks the declaration against the imports (``needed_groups``) so that the
  order the maintainer is told to merge in cannot go stale, and refuses a need of a later group.
- Each pull request applies ALONE to the pristine release: the export takes the verified sdist,
  adds the group's new files, applies its patches alone (``zero3muon_build.apply_patches``; a patch
  whose context needs another group's patch fails loudly) and diffs with ``git diff``, so ``git
  apply`` / ``patch -p1`` at the root of a DeepSpeed checkout of the tag takes it. The combined
  diff is the build's own tree (``zero3muon_build.apply_changes``) plus every exported test.
- Size: each pull request's changed lines are counted (``changed_lines``); a pull request over
  ``MAX_CHANGED_LINES`` stops the export where ``ENFORCE_MAX_CHANGED_LINES`` is set.

A description is ``export_templates/<key>.md``: the hand-written problem, fix, behaviour changes,
compatibility and testing, and a line per upstream file the group's patches change (the export
refuses a template that does not name one); the export adds the title, how to apply it, what it
needs, the new files (each described by its docstring's first paragraph) and the diffstat.

Never exported: the build's packaging labels (``build.txt``, ``_build_info.py``), the wheel
report ``deepspeed/runtime/zero/muon/__main__.py`` (merged upstream it would call the merged code
"not the zero3muon build"), ``tests/unit/common.py`` (a stand-in for DeepSpeed's own), and the
tests of this project's build, examples and benchmark.

Stdlib only, like the backend: ``dev.py`` imports this with the system Python, without torch.
"""

import ast
import fnmatch
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from string import Template

import zero3muon_build as zb

TEMPLATE_DIR = Path(__file__).resolve().parent / "export_templates"

# The most changed lines (tests included) one pull request may have: a reviewer reads it in one sitting. Not
# enforced while pull requests exceed it: `dev.py export` prints each one over it as MISSED.
MAX_CHANGED_LINES = 2500
ENFORCE_MAX_CHANGED_LINES = False

PROJECT_ONLY = (  # this project's commands: `python -m deepspeed.runtime.zero.muon [plan]`, the wheel and plan reports
    "deepspeed/runtime/zero/muon/__main__.py",
    "deepspeed/runtime/zero/muon/plan_report.py",
    "tests/unit/runtime/zero/test_muon_plan_report.py",
)
NEVER_EXPORTED = PROJECT_ONLY + (  # fnmatch patterns; ``*`` also matches ``/``
    "tests/conftest.py",  # puts tests/ on sys.path here; DeepSpeed's tests/conftest.py does more
    "tests/__init__.py",
    "tests/unit/__init__.py",  # DeepSpeed has its own
    "tests/unit/common.py",  # stand-in for DeepSpeed's tests/unit/common.py (DistributedTest)
    "tests/unit/test_distributed_standin.py",  # the stand-in's own test
    "tests/unit/build/*",  # this project's build backend and export
    "tests/examples/*",
    "tests/bench/*",
)
EXPORT_ROOTS = ("deepspeed", "tests", "testing/muon_testing")
EXPORTED_AS = {"testing/muon_testing/": "tests/muon_testing/"}
"""Repository folders exported under another path. The tests' shared package ``muon_testing``
(``testing/``, installed into the project's venvs) goes upstream as ``tests/muon_testing/``:
DeepSpeed's pytest puts ``tests/`` on sys.path, so ``import muon_testing`` resolves there unchanged."""

MUON = "deepspeed/runtime/zero/muon"
ZERO_TESTS = "tests/unit/runtime/zero"
TESTING = "testing/muon_testing"  # exported as tests/muon_testing (EXPORTED_AS)


def exported_path(path):
    """Where repository path ``path`` lies in the exported tree (``EXPORTED_AS``; most paths are unchanged)."""
    for folder, upstream in EXPORTED_AS.items():
        if path.startswith(folder):
            return upstream + path[len(folder):]
    return path


def _in(folder, *names):
    return tuple(f"{folder}/{name}" for name in names)


def _patches(*numbers):
    return tuple(f"patches/*/{n:04d}-*.patch" for n in numbers)


class Group:
    """Files exported together: a pull request, or a backport that goes into the combined diff
    only (``why`` says why) and only on a base where it has a patch.

    ``patterns``: fnmatch patterns on repository paths (``patches/*/0001-*.patch`` matches that
    patch of every base); one starting with ``!`` takes paths back out of the group's claim.
    ``needs``: keys of the earlier groups whose files this group's code or tests import."""

    def __init__(self, key, title, patterns, needs=(), why=None):
        self.key, self.title, self.patterns, self.needs, self.why = key, title, tuple(patterns), tuple(needs), why
        self.number = None  # its position in GROUPS

    @property
    def pull_request(self):
        return self.why is None

    @property
    def stem(self):
        return f"{self.number}-{self.key}"

    def matches(self, path):
        hit = [p for p in self.patterns if not p.startswith("!") and fnmatch.fnmatchcase(path, p)]
        return bool(hit) and not any(fnmatch.fnmatchcase(path, p[1:]) for p in self.patterns if p.startswith("!"))

    def __repr__(self):
        return f"Group({self.key!r})"


def numbered(*groups):
    for n, g in enumerate(groups, 1):
        g.number = n
    return groups


GROUPS = numbered(
    Group(
        "zero3-muon",
        "Muon under ZeRO-3: momentum and Newton-Schulz once per optimizer step, on one owner rank per matrix",
        # config.py: the typed Muon configuration every module reads its key names from (support.py beside it);
        # param_record.py: what DeepSpeed records per parameter, which the binding reads (AutoTP's layout)
        # rank_agreement: errors every rank agrees on, general (the checkpoints pull request's engine patch uses it)
        # 0016: stage3.py refuses the configurations the update cannot serve (support.refuse_unsupported_zero3)
        # 0003: the gradients unscaled by their own loss scale, which the momentum accumulates
        _patches(4, 1, 3, 16) + ("deepspeed/runtime/rank_agreement.py", ) +
        _in(MUON, "momentum.py", "newton_schulz.py", "owner_plan.py", "owner_exchange.py", "pipeline.py",
            "owner_state.py", "binding.py", "config.py", "support.py", "param_record.py") +
        # The core's tests, lean: the seam bit for bit, one ZeRO-3 run.
        _in(ZERO_TESTS, "test_muon_update_split.py", "test_zero3_muon_boundary.py")),
    Group(
        "zero3-configurations",
        "ZeRO-3 Muon in every configuration: gradients right across accumulation windows, "
        "tested with offload, fp16/bf16, clipping, checkpoints; the owner plan within Muon's memory cap",
        _patches(2) +
        _in(ZERO_TESTS, "test_zero3_muon_*.py", "test_zero3_grad_partition_window.py",
            "test_zero3_backward_loss_scale.py", "zero3_muon_helpers.py", "test_muon_owner_plan.py",
            "test_muon_config_zero3.py") +
        (f"!{ZERO_TESTS}/test_zero3_muon_boundary.py", ) +
        # the tests' shared package: these tests are the first to import it
        _in(TESTING, "__init__.py", "compare.py", "counting.py", "models.py", "reference.py"),
        needs=("zero3-muon", )),
    Group("zero12-muon",
          "ZeRO-1/2 and AutoTP Muon on the same owner core: whole matrices wherever their pieces lie, the core's "
          "plans and exchange tested at every layout",
          _patches(12) + _in(MUON, "zero12_checkpoints.py", "tensor_parallel.py") +
          _in(ZERO_TESTS, "test_zero12_*.py", "zero12_muon_helpers.py", "test_muon_owner_plan_configs.py",
              "test_muon_pipeline*.py", "test_muon_tensor_parallel.py",
              "test_muon_non_finite_step.py") +
          _in(TESTING, "causal_lm.py", "threaded_exchange.py"),
          needs=("zero3-muon", "zero3-configurations")),
    Group("universal-checkpoints",
          "Checkpoints of Muon runs: every optimizer state in universal checkpoints at every stage, Muon's checked",
          _patches(6, 7, 8, 9, 13) + ("deepspeed/checkpoint/*.py", "tests/unit/checkpoint/*"),
          needs=("zero3-muon", "zero3-configurations", "zero12-muon")),
    Group("muon-config",
          "Muon's configuration: parameter selection with fused projections split, its two learning rates under "
          "schedulers, every key checked",
          # integration.py: the engine's one entry (patch 0011), which the AutoTP tests run through
          _patches(10, 11) + _in(MUON, "integration.py", "param_selection.py", "lr_groups.py") +
          _in(ZERO_TESTS, "test_muon_param_selection.py", "test_muon_lr_groups.py", "test_muon_config_keys.py",
              "test_muon_fused_projections.py", "test_muon_autotp.py"),
          needs=("zero3-muon", "zero3-configurations", "zero12-muon")),
    Group("muon-variants",
          "Newton-Schulz in depth and Muon's variants: batched problems, Polar Express, NorMuon's state on the owner, "
          "MuonClip's QK-clip",
          _patches(17, 18) + _in(MUON, "polar_express.py", "normuon.py", "qk_clip.py", "hf_attention.py") +
          _in(ZERO_TESTS, "test_*polar_express*.py", "test_*normuon*.py", "test_muon_owner_state.py",
              "test_muon_newton_schulz.py", "test_muon_qk_clip.py") +
          # QK-clip on whole matrices, the reference of the MuonClip tests (their only importer)
          _in(TESTING, "attention.py"),
          needs=("zero3-muon", "zero3-configurations", "zero12-muon", "universal-checkpoints", "muon-config")),
    Group("allgather-wait-backport",
          "ZeRO-3: wait on every handle of a coalesced parameter all-gather (backport)",
          _patches(5) + _in(ZERO_TESTS, "test_zero3_allgather_coalesced_wait.py"),
          why="DeepSpeed 0.19.7 waits only on the last handle of a coalesced parameter all-gather; with gloo the "
          "handles complete independently, so the gathered parameters could be read before they all arrived. "
          "DeepSpeed 0.19.8 already waits on every handle: this backports that fix, so that this project's "
          "0.19.7 build gathers parameters correctly on gloo; it is not proposed upstream."),
)


class ExportError(zb.BuildError):
    """The export could not be made; the message says why."""


class Piece:
    """One exported diff: the tree change of ``group`` (``None``: the combined diff)."""

    def __init__(self, group, sources, diff, name_status, diffstat):
        self.group, self.sources = group, sources
        self.diff, self.name_status, self.diffstat = diff, name_status, diffstat
        self.diff_path = self.text_path = None

    @property
    def paths(self):
        return [path for _, path in self.name_status]

    @property
    def stem(self):
        return self.group.stem if self.group else "combined"

    @property
    def changed_lines(self):
        return changed_lines(self.diff)


class Export:
    """What ``export`` wrote: the pull requests in order, the combined diff, the backports in it."""

    def __init__(self, base, out_dir, pull_requests, combined, backports):
        self.base, self.out_dir = base, out_dir
        self.pull_requests, self.combined, self.backports = pull_requests, combined, backports

    @property
    def pieces(self):
        return [*self.pull_requests, self.combined]


def changed_lines(diff):
    """Lines a diff adds or removes: those starting with ``+`` or ``-`` inside its hunks (not the
    ``---`` / ``+++`` file headers, which come before a file's first ``@@``)."""
    n, in_hunk = 0, False
    for line in diff.splitlines():
        if line.startswith(b"diff --git "):
            in_hunk = False
        elif line.startswith(b"@@"):
            in_hunk = True
        elif in_hunk and line[:1] in (b"+", b"-"):
            n += 1
    return n


def graph_line(groups=GROUPS):
    """The dependency graph in one line, the order to merge in: each pull request and what it needs."""
    number = {g.key: g.number for g in groups}
    return "; ".join(f"{g.number} {g.key}" +
                     (f" needs {', '.join(str(number.get(k, k)) for k in g.needs)}" if g.needs else "") for g in groups
                     if g.pull_request)


# --------------------------------------------------------------------------- membership


def candidate_files(base, repo_root=zb.REPO_ROOT):
    """Repository paths that could be exported for ``base``: every file under ``deepspeed/`` and
    ``tests/`` (caches skipped) and ``patches/<base>/*.patch``."""
    repo_root = Path(repo_root)
    out = []
    for top in EXPORT_ROOTS:
        for path in sorted((repo_root / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                out.append(path.relative_to(repo_root).as_posix())
    return out + [p.relative_to(repo_root).as_posix() for p in zb.list_patches(base, repo_root)]


def assign(base, repo_root=zb.REPO_ROOT, groups=GROUPS, never=NEVER_EXPORTED, strict=True):
    """{group key: [repository paths]} for ``base``, in the groups' order; groups without a file on
    ``base`` are left out, and so are backports without a patch on ``base`` (with their tests).

    Raises ``ExportError`` for a file that no group claims or that two claim, a pull request
    without a test or without a change to DeepSpeed, and ``needs`` that differ from the imports or
    name a later group. With ``strict=False`` (``dev.py intree`` and ``lint``, which take the files
    as far as the groups place them) it raises nothing: an unclaimed file is left out, a file
    claimed twice goes to its first group."""
    owners, unclaimed, ambiguous = {g.key: [] for g in groups}, [], []
    for path in candidate_files(base, repo_root):
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in never):
            continue
        claims = [g.key for g in groups if g.matches(path)]
        if not claims:
            unclaimed.append(path)
            continue
        owners[claims[0]].append(path)
        if len(claims) > 1:
            ambiguous.append(f"{path} ({' and '.join(claims)})")
    for g in groups:  # a backport without its patch on this base backports nothing: its test goes too
        if not g.pull_request and not any(p.startswith("patches/") for p in owners[g.key]):
            owners[g.key] = []
    result = {key: sorted(files) for key, files in owners.items() if files}
    if not strict:
        return result
    problems = []
    if unclaimed:
        problems.append("no pull request claims these files: " + ", ".join(unclaimed) +
                        " (add a pattern to a Group of build_backend/zero3muon_export.py, or to NEVER_EXPORTED)")
    if ambiguous:
        problems.append("these files are claimed more than once: " + ", ".join(ambiguous))
    order = [g.key for g in groups]
    for g in groups:
        files = result.get(g.key)
        if not g.pull_request or not files:
            continue
        if not any(exported_path(p).startswith("tests/") for p in files):
            problems.append(f"pull request {g.stem!r} has no test under tests/")
        if not any(p.startswith(("deepspeed/", "patches/")) for p in files):
            problems.append(f"pull request {g.stem!r} changes nothing in DeepSpeed (no new module, no patch)")
        found = needed_groups(g, result, repo_root, groups)
        if set(found) != set(g.needs):
            evidence = "".join(f"; {path} imports {dep}" for key in sorted(found) for path, dep in found[key])
            problems.append(f"pull request {g.stem!r} imports files of {sorted(found) or 'no other pull request'} "
                            f"but its needs say {sorted(g.needs) or 'none'}{evidence}")
        later = [k for k in g.needs if k not in order[:order.index(g.key)]]
        if later:
            problems.append(f"pull request {g.stem!r} needs {later}, which do not come before it")
    if problems:
        raise ExportError(f"export of base {base}: " + "; ".join(problems))
    return result


def _imports(source, prefixes=("deepspeed.", "unit.", "muon_testing.")):
    """Repository paths of the modules ``source`` imports by absolute name: ``deepspeed.a.b`` is
    ``deepspeed/a/b.py``, DeepSpeed's tests' ``unit.a`` is ``tests/unit/a.py`` and the tests'
    package ``muon_testing.a`` is ``testing/muon_testing/a.py`` (``from P import name`` counts
    ``P.name`` too; a package's ``__init__.py`` is not resolved)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
    folder = {"unit": "tests/", "muon_testing": "testing/"}
    return [folder.get(m.split(".")[0], "") + m.replace(".", "/") + ".py" for m in modules if m.startswith(prefixes)]


def _added_imports(patch):
    """The imports a patch adds (its ``+`` lines that are a whole import statement, e.g. one inside
    a method of the upstream file)."""
    out = []
    for line in Path(patch).read_text().splitlines():
        code = line[1:].strip()
        if line.startswith("+") and not line.startswith("+++") and code.startswith(("import ", "from ")):
            out += _imports(code, ("deepspeed.", ))
    return out


def _patched_files(patch):
    """Repository paths of the upstream files a patch modifies (its ``diff --git`` lines)."""
    return re.findall(r"^diff --git a/(\S+) b/", Path(patch).read_text(), re.M)


def needed_groups(group, owners, repo_root, groups=GROUPS):
    """{other pull request's key: [(file of ``group``, file it imports)]}: the pull requests whose
    new files ``group``'s modules, tests or patches import.

    Code (a module under ``deepspeed/``, an import a patch adds) also needs the group whose patch
    changes an upstream module it imports (the first such group in the export's order: later ones
    patch on top of its additions, e.g. ``original_muon.py``'s new functions). A test importing
    an upstream module does not: the tests read what is installed (e.g. whether a stage has a
    fix) and run on the release. ``owners``: ``assign``'s {key: paths}."""
    root = Path(repo_root)
    prs = {g.key for g in groups if g.pull_request}
    owner_of, patched_by = {}, {}
    for key, paths in owners.items():
        if key not in prs:
            continue
        for path in paths:
            if path.startswith("patches/"):
                for target in _patched_files(root / path):
                    patched_by.setdefault(target, key)
            else:
                owner_of[path] = key
    needed = {}
    for path in owners.get(group.key, []):
        if path.startswith("patches/"):
            deps, code = _added_imports(root / path), True
        elif path.endswith(".py"):
            deps, code = _imports((root / path).read_text(errors="replace")), path.startswith("deepspeed/")
        else:
            continue
        for dep in deps:
            key = owner_of.get(dep) or (patched_by.get(dep) if code else None)
            if key and key != group.key and (path, dep) not in needed.get(key, []):
                needed.setdefault(key, []).append((path, dep))
    return needed


# --------------------------------------------------------------------------- diffs


def _git(tree, *args, raw=False):
    """Run git in ``tree`` (its own repository) with no user or system configuration; its stdout
    as bytes if ``raw`` (a diff, byte for byte), else as text."""
    env = zb._git_env(tree)
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C")
    res = subprocess.run([zb._find_git(), *args], cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if res.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {tree} (exit {res.returncode}):\n"
                          f"{res.stderr.decode(errors='replace').strip()}")
    return res.stdout if raw else res.stdout.decode()


def _snapshot(tree):
    """Stage every file of ``tree`` (ignore rules off) and return the git tree id."""
    _git(tree, "add", "--all", "--force", ".")
    return _git(tree, "write-tree").strip()


def _restore(tree, pristine):
    """Put ``tree`` back to the git tree ``pristine``: files added since are deleted, changed ones restored."""
    _git(tree, "read-tree", "--reset", "-u", pristine)
    _git(tree, "clean", "-fdxq")


def _copy_new_files(tree, repo_root, paths):
    clashes = [exported_path(p) for p in paths if (tree / exported_path(p)).exists()]
    if clashes:
        raise ExportError("these files of ours already exist in the upstream tree: " + ", ".join(clashes) +
                          ". Changes to upstream files must be patches under patches/<base>/.")
    for rel in paths:
        dest = tree / exported_path(rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(repo_root) / rel, dest)


def _diff(tree, pristine, changed):
    opts = ["--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", pristine, changed]
    diff = _git(tree, "diff", "--binary", *opts, raw=True)
    name_status = [line.split("\t", 1) for line in _git(tree, "diff", "--name-status", *opts).splitlines()]
    return diff, name_status, _git(tree, "diff", "--stat=100", *opts)


def make_pieces(sdist, sha256, base, work_dir, repo_root=zb.REPO_ROOT, groups=GROUPS, never=NEVER_EXPORTED):
    """(pull requests, combined, backports): a ``Piece`` each, made against the pristine ``sdist``
    under ``work_dir``. Every pull request is its own files and patches on the pristine release."""
    zb.verify_sha256(sdist, sha256)
    repo_root = Path(repo_root)
    owners = assign(base, repo_root, groups, never)
    tree = zb.unpack_sdist(sdist, work_dir)
    _git(tree, "init", "-q")
    pristine = _snapshot(tree)
    pieces = {}
    for g in groups:
        files = owners.get(g.key)
        if not files:
            continue
        _restore(tree, pristine)
        _copy_new_files(tree, repo_root, [p for p in files if not p.startswith("patches/")])
        try:
            zb.apply_patches(tree, [repo_root / p for p in files if p.startswith("patches/")])
        except zb.BuildError as e:
            what = f"pull request {g.stem!r}" if g.pull_request else f"backport {g.key!r}"
            raise ExportError(f"{what} does not apply to the pristine deepspeed-{base} on its own "
                              f"(each pull request's patches must not depend on another's): {e}") from e
        pieces[g.key] = Piece(g, files, *_diff(tree, pristine, _snapshot(tree)))

    # The combined diff: the build's change (every new file, every patch in order), our tests.
    _restore(tree, pristine)
    try:
        zb.apply_changes(tree, zb.list_patches(base, repo_root), repo_root)
    except zb.BuildError as e:
        raise ExportError(f"the patches of base {base} do not apply in order (the combined diff, the build): "
                          f"{e}") from e
    for rel in PROJECT_ONLY:
        (tree / rel).unlink(missing_ok=True)
    exported = sorted(p for files in owners.values() for p in files)
    _copy_new_files(tree, repo_root, [p for p in exported if exported_path(p).startswith("tests/")])
    combined = Piece(None, exported, *_diff(tree, pristine, _snapshot(tree)))
    union = {p for piece in pieces.values() for p in piece.paths}
    if not combined.diff or union != set(combined.paths):
        raise ExportError("the pull requests and backports together do not change the files the combined diff "
                          f"changes: only in theirs {sorted(union - set(combined.paths))}, only in the combined "
                          f"{sorted(set(combined.paths) - union)}")
    prs = [pieces[g.key] for g in groups if g.key in pieces and g.pull_request]
    return prs, combined, [pieces[g.key] for g in groups if g.key in pieces and not g.pull_request]


# --------------------------------------------------------------------------- descriptions


def _docstring_summary(path):
    try:
        doc = ast.get_docstring(ast.parse(Path(path).read_text()))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return " ".join(doc.split("\n\n", 1)[0].split()) if doc else None


def _named(groups, many="pull requests"):
    names = [f"{g.number} ({g.key})" for g in groups]
    if len(names) == 1:
        return f"{many[:-1]} {names[0]}"
    return f"{many} " + ", ".join(names[:-1]) + " and " + names[-1]


def relations(group, groups):
    """Where pull request ``group`` stands among ``groups`` in the merge order, in words."""
    needs = [g for g in groups if g.key in group.needs]
    needed_by = [g for g in groups if group.key in g.needs]
    them = "that one" if len(needs) == 1 else "those"
    out = [
        f"It needs {_named(needs)} of this export (its code or tests import files of {them}): merge {them} "
        "first." if needs else "It needs no other pull request of this export: it merges on its own."
    ]
    if needed_by:
        out.append(f"{_named(needed_by, 'Pull requests')} need{'s' if len(needed_by) == 1 else ''} this one.")
    return " ".join(out)


def diff_header(piece, base, cfg, sdist, sha256, groups, backports=()):
    """Lines before the first ``diff --git``: git apply and patch skip them."""
    summary = piece.diffstat.rstrip("\n").splitlines()[-1].strip()
    if piece.group:
        what = (f"Pull request {piece.group.number}, \"{piece.group.title}\" (zero3muon {cfg['version']}), "
                f"for DeepSpeed {base}: {summary}.\nIt applies to the release on its own. "
                f"{relations(piece.group, groups)}")
    else:
        extra = "".join(f" and the backport \"{bp.group.title}\"" for bp in backports)
        what = (f"All of the zero3muon {cfg['version']} change for DeepSpeed {base} in one diff: the pull requests "
                f"of this directory together{extra}: {summary}.")
    return (f"{what}\nMade against {Path(sdist).name}, sha256 {sha256}.\n"
            f"Apply at the root of a DeepSpeed checkout of v{base} with `git apply` or `patch -p1`.\n\n")


def _patch_names(piece):
    return ", ".join(f"`{Path(p).name}`" for p in piece.sources if p.startswith("patches/")) or "none"


def describe(piece, base, cfg, sdist, sha256, repo_root, everything):
    """The Markdown description of ``piece``; ``everything``: (pull requests, combined, backports)."""
    prs, _, backports = everything
    groups = [pr.group for pr in prs]
    values = dict(diffstat=piece.diffstat.rstrip("\n"),
                  tests=", ".join(f"`{p}`" for p in piece.sources if Path(p).name.startswith("test_")) or "none")
    source = {exported_path(p): p for p in piece.sources}  # exported path -> repository path
    new = [
        f"- `{p}` (new): {_docstring_summary(Path(repo_root) / source.get(p, p)) or 'new file'}"
        for s, p in piece.name_status if s == "A"
    ]
    if piece.group:
        template = (TEMPLATE_DIR / f"{piece.group.key}.md").read_text()
        unnamed = [p for s, p in piece.name_status if s != "A" and f"`{p}`" not in template]
        if unnamed:
            raise ExportError(f"pull request {piece.stem!r} changes {', '.join(unnamed)}, which its description "
                              f"(export_templates/{piece.group.key}.md) does not name: say what the change does")
        title, values["new_files"] = piece.group.title, "\n".join(new) or "(none)"
    else:
        template, title = (TEMPLATE_DIR / "combined.md").read_text(), "All of the change: the combined diff"
        changed_by = {p: [pr.group for pr in [*prs, *backports] if p in pr.paths] for s, p in piece.name_status}
        values["files"] = "\n".join(
            new + [f"- `{p}`: changed by {_named(changed_by[p])}" for s, p in piece.name_status if s != "A"])
        values["pull_requests"] = "\n".join(f"{pr.group.number}. **{pr.group.title}**: `{pr.stem}.diff`, "
                                            f"`{pr.stem}.md` ({pr.changed_lines} changed lines)." for pr in prs)
        values["graph"] = graph_line(groups)
        values["backports"] = "".join(
            f"\n\nAlso in this diff and in no pull request: **{bp.group.title}** (patch {_patch_names(bp)}, test " +
            ", ".join(f"`{p}`" for p in bp.sources if p.startswith("tests/")) + f"). {bp.group.why}"
            for bp in backports)
    header = (f"# {title}\n\n<!-- Generated by `python3 dev.py export --base {base}` (zero3muon {cfg['version']}). "
              f"The change: `{piece.stem}.diff`, made against {Path(sdist).name} (sha256 {sha256}). Apply it at the "
              f"root of a DeepSpeed checkout of v{base}: `git apply {piece.stem}.diff` or `patch -p1 < "
              f"{piece.stem}.diff`. The zero3muon project's patches in it: {_patch_names(piece)}. -->\n\n")
    if piece.group:
        header += f"It applies to the release on its own. {relations(piece.group, groups)}\n\n"
    return header + Template(template).substitute(values)


# --------------------------------------------------------------------------- export


def _stale_outputs(out_dir, written):
    """Files of an earlier export in ``out_dir`` that this export did not write (e.g. of a pull
    request since renamed or merged into another, or of the single-diff layout before the split)."""
    names = ("[0-9]-*.diff", "[0-9]-*.md", "[0-9][0-9]-*.diff", "[0-9][0-9]-*.md", "combined.diff", "combined.md",
             "zero3muon-deepspeed-*.diff", "PR_DESCRIPTION.md")
    return [p for name in names for p in out_dir.glob(name) if p not in written]


def export(base=None,
           out_dir=None,
           repo_root=zb.REPO_ROOT,
           sdist=None,
           groups=GROUPS,
           never=NEVER_EXPORTED,
           max_changed_lines=None):
    """Write ``<n>-<key>.diff`` and ``.md`` for each pull request and ``combined.diff`` and ``.md``
    for ``base`` into ``out_dir`` (default ``repo_root/out/export/<base>``); return an ``Export``.
    A pull request over ``max_changed_lines`` (default: ``MAX_CHANGED_LINES`` where
    ``ENFORCE_MAX_CHANGED_LINES``, else no limit) raises ``ExportError`` before anything is written."""
    repo_root = Path(repo_root)
    cfg = zb.load_config(repo_root)
    base = zb.select_base(cfg, base)
    sha256 = cfg["sdist-sha256"][base]
    sdist = Path(sdist) if sdist else zb.obtain_sdist(base, sha256)
    out_dir = Path(out_dir) if out_dir else repo_root / "out" / "export" / base
    if max_changed_lines is None and ENFORCE_MAX_CHANGED_LINES:
        max_changed_lines = MAX_CHANGED_LINES
    with tempfile.TemporaryDirectory(prefix="zero3muon-export-") as tmp:
        everything = make_pieces(sdist, sha256, base, tmp, repo_root, groups, never)
    prs, combined, backports = everything
    over = [
        f"{pr.stem} has {pr.changed_lines}" for pr in prs if max_changed_lines and pr.changed_lines > max_changed_lines
    ]
    if over:
        raise ExportError(f"export of base {base}: pull requests over {max_changed_lines} changed lines: " +
                          ", ".join(over) + " (sizes: " + ", ".join(f"{pr.stem} {pr.changed_lines}"
                                                                    for pr in prs) + ")")
    texts = {
        piece.stem: describe(piece, base, cfg, sdist, sha256, repo_root, everything)
        for piece in [*prs, combined]
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for piece in [*prs, combined]:
        piece.diff_path, piece.text_path = out_dir / f"{piece.stem}.diff", out_dir / f"{piece.stem}.md"
        header = diff_header(piece, base, cfg, sdist, sha256, [pr.group for pr in prs], backports)
        piece.diff_path.write_bytes(header.encode() + piece.diff)
        piece.text_path.write_text(texts[piece.stem])
        written += [piece.diff_path, piece.text_path]
    for stale in _stale_outputs(out_dir, written):
        stale.unlink()
    return Export(base, out_dir, prs, combined, backports)
