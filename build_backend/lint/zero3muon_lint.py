"""DeepSpeed's own pre-commit hooks on the Python files of every exported pull request
(``python3 dev.py lint``).

Which files: for each group of ``zero3muon_export`` (each pull request, and a backport where the
base has one), the Python files its diff adds or changes:

- our new files under ``deepspeed/`` and ``tests/``, as they are in the project's working tree;
- every upstream file its patches change, taken from the pinned release sdist (sha256-checked, as
  the build gets it) with that group's patches ALONE applied, as ``dev.py export`` makes its diff.

Python files under ``deepspeed/`` and ``tests/`` that no group claims (and that are not of the
never-exported kind) are linted too, as "(no pull request)", with a warning: the export would refuse
them, but they are still code on its way upstream.

A patched upstream file is linted whole, and so is the release's own version of it; a finding the
release's file has too (the same hook and message, line numbers aside) is upstream's and is listed
apart, not counted. yapf is judged on the whole patched file where the release's file passes yapf
(then every reformatting is the patch's, including one of an unchanged line next to a change);
where it does not, only on the lines the patch adds or changes (``yapf --lines``, with the lines
around a deletion).

Which hooks, at which versions:

- with ``--deepspeed-repo`` (a checkout, or a git directory such as a bare mirror, at ``--ref``),
  the hooks of its ``.pre-commit-config.yaml``, with their ``args``, ``files`` and ``exclude``,
  its root config files (``.style.yapf``, ``.flake8``, ``setup.cfg``, ...) and its own
  ``scripts/`` for the local hooks, run as pre-commit runs them: from the root of a tree holding
  the files at their repository paths, a git repository with the files added (``check-license``
  runs ``git grep`` on the index). yapf, flake8, codespell and pre-commit-hooks come from
  ``.venv/lint/`` (``requirements/lint.txt``); a config that pins another version is warned about.
  Hooks that run on no Python file (clang-format, check-json, ...) or on the repository as a whole
  (check-case-conflict, meta hooks) are named as not run;
- without it, the fallback: the same linters with this project's statement of DeepSpeed's settings
  (``style.yapf``, ``flake8.cfg``, ``codespell.cfg`` beside this file), pre-commit-hooks' fixers
  with DeepSpeed's arguments, and ``hook_checks`` (this project's own code for the torchdist,
  torchcuda and license rules) instead of DeepSpeed's scripts.

yapf runs in diff mode (``yapf --diff``); the fixing hooks (trailing-whitespace, end-of-file-fixer,
...) run on a copy and report the lines they would change. ``--fix`` runs yapf in place on our own
files only (never on a patched upstream file, which is a patch's business).

Stdlib only; ``dev.py`` imports this with the Python that runs it and passes ``.venv/lint/``.
"""

import contextlib
import difflib
import fnmatch
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

LINT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(LINT_DIR.parent))
sys.path.insert(0, str(LINT_DIR))
import hook_checks  # noqa: E402
import zero3muon_build as zb  # noqa: E402
import zero3muon_export as ze  # noqa: E402

NO_GROUP = "(no pull request)"

# Config files a hook may read from the repository root (the working directory pre-commit runs
# hooks in): copied from the DeepSpeed checkout to the root of every tree that is linted.
ROOT_CONFIGS = (".style.yapf", ".flake8", "setup.cfg", "tox.ini", ".codespellrc", "pyproject.toml", ".yapfignore")

# Hook repositories whose hooks this command runs from .venv/lint/: repository -> package in
# requirements/lint.txt.
PACKAGES = {
    "google/yapf": "yapf",
    "pycqa/flake8": "flake8",
    "codespell-project/codespell": "codespell",
    "pre-commit/pre-commit-hooks": "pre-commit-hooks",
}

# pre-commit-hooks' hooks that apply to Python files: id -> (console script, fixes files).
# Their own file types are text or python, so every .py file is theirs.
PRE_COMMIT_HOOKS = {
    "trailing-whitespace": ("trailing-whitespace-fixer", True),
    "end-of-file-fixer": ("end-of-file-fixer", True),
    "mixed-line-ending": ("mixed-line-ending", True),
    "fix-byte-order-marker": ("fix-byte-order-marker", True),
    "fix-encoding-pragma": ("fix-encoding-pragma", True),
    "double-quote-string-fixer": ("double-quote-string-fixer", True),
    "check-ast": ("check-ast", False),
    "check-builtin-literals": ("check-builtin-literals", False),
    "check-docstring-first": ("check-docstring-first", False),
    "check-merge-conflict": ("check-merge-conflict", False),
    "debug-statements": ("debug-statement-hook", False),
    "check-byte-order-marker": ("check-byte-order-marker", False),
}
# ... and those that never see a Python file, or look at the repository rather than at a file.
NOT_FOR_PYTHON = {
    "check-json": "JSON files only",
    "check-yaml": "YAML files only",
    "check-toml": "TOML files only",
    "check-xml": "XML files only",
    "check-symlinks": "symlinks only",
    "destroyed-symlinks": "symlinks only",
    "requirements-txt-fixer": "requirements files only",
    "pretty-format-json": "JSON files only",
    "check-case-conflict": "the repository's file names as a whole, not a file's contents",
    "check-added-large-files": "file sizes in git, not Python style",
    "check-executables-have-shebangs": "file modes, not Python style",
    "check-shebang-scripts-are-executable": "file modes, not Python style",
    "forbid-new-submodules": "git submodules",
    "no-commit-to-branch": "the git branch",
    "clang-format": "C/C++ files only",
}

# The fallback: DeepSpeed's hooks as this project states them (see the module docstring).
# Paths DeepSpeed's config exempts from its torchdist and torchcuda hooks (upstream files that
# wrap the backend themselves, docs, benchmarks); every other file must pass.
FALLBACK_TORCHDIST_EXEMPT = ("deepspeed/comm/", "docs/", "benchmarks/", "scripts/check-torchdist.py",
                             "deepspeed/moe/sharded_moe.py", "deepspeed/runtime/comm/coalesced_collectives.py",
                             "deepspeed/elasticity/elastic_agent.py", "deepspeed/launcher/launch.py",
                             "tests/unit/comm/test_dist.py")
FALLBACK_TORCHCUDA_EXEMPT = (".github/workflows/", "scripts/check-torchcuda.py", "accelerator/cuda_accelerator.py",
                             "deepspeed/inference/engine.py",
                             "deepspeed/model_implementations/transformers/clip_encoder.py",
                             "deepspeed/model_implementations/diffusers/vae.py",
                             "deepspeed/model_implementations/diffusers/unet.py",
                             "op_builder/spatial_inference.py", "op_builder/transformer_inference.py",
                             "op_builder/builder.py", "setup.py", "tests/unit/ops/sparse_attention/test_sparse_attention.py")


def _exempt(paths):
    return "^(" + "|".join(re.escape(p) for p in paths) + ")"


class LintError(Exception):
    """The lint could not run (not: a file has findings); the message says why."""


def log(msg=""):
    print(f"[lint] {msg}".rstrip(), flush=True)


# --------------------------------------------------------------------------- hooks


class Hook:
    """One pre-commit hook as this command runs it.

    ``kind``: ``yapf``, ``flake8``, ``codespell`` (the linters of .venv/lint/), ``fixer`` or
    ``checker`` (a pre-commit-hooks console script), ``script`` (a local hook's script of the
    DeepSpeed checkout, run with .venv/lint/'s Python) or ``builtin`` (``hook_checks``).
    ``argv``: the command before the file names. ``files`` / ``exclude``: pre-commit's regexes on
    the repository path (``re.search``)."""

    def __init__(self, hook_id, kind, argv=(), files="", exclude=None):
        self.id, self.kind, self.argv = hook_id, kind, list(argv)
        self.files, self.exclude = files or "", exclude

    def selects(self, path):
        return bool(re.search(self.files, path)) and not (self.exclude and re.search(self.exclude, path))

    def __repr__(self):
        return f"Hook({self.id!r}, {self.kind!r})"


class Settings:
    """The hooks of one run and where they come from."""

    def __init__(self, label, hooks, skipped=(), warnings=(), root_files=None, yapf_style=None):
        self.label, self.hooks = label, list(hooks)
        self.skipped, self.warnings = list(skipped), list(warnings)
        self.root_files = dict(root_files or {})  # {name: bytes} put at the root of every linted tree
        self.yapf_style = yapf_style  # the style file --fix formats our files with


def pinned_versions(requirements):
    """{package: version} of the ``name==version`` lines of ``requirements`` (lowercase names)."""
    out = {}
    for line in Path(requirements).read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def fallback_settings(bin_dir):
    """DeepSpeed's hooks as this project states them (no DeepSpeed checkout needed)."""
    b = Path(bin_dir)
    hooks = [
        Hook("yapf", "yapf", [b / "yapf", f"--style={LINT_DIR / 'style.yapf'}"], files=r"\.py$"),
        Hook("flake8", "flake8", [b / "flake8", f"--config={LINT_DIR / 'flake8.cfg'}"], files=r"\.py$"),
        Hook("codespell", "codespell", [b / "codespell", f"--config={LINT_DIR / 'codespell.cfg'}"]),
        Hook("check-torchdist", "builtin", exclude=_exempt(FALLBACK_TORCHDIST_EXEMPT)),
        Hook("check-license", "builtin", files=r"\.(py|c|cpp|cu|cc|h|hpp|cuh|hip|tr)$"),
        Hook("check-torchcuda", "builtin", exclude=_exempt(FALLBACK_TORCHCUDA_EXEMPT)),
        Hook("trailing-whitespace", "fixer", [b / "trailing-whitespace-fixer"]),
        Hook("end-of-file-fixer", "fixer", [b / "end-of-file-fixer"]),
        Hook("mixed-line-ending", "fixer", [b / "mixed-line-ending", "--fix=lf"]),
        Hook("fix-byte-order-marker", "fixer", [b / "fix-byte-order-marker"]),
        Hook("fix-encoding-pragma", "fixer", [b / "fix-encoding-pragma", "--remove"], files=r"\.py$"),
    ]
    label = (f"the fallback: {LINT_DIR.name}/style.yapf, flake8.cfg, codespell.cfg and hook_checks.py of "
             f"{LINT_DIR.parent.name}/ (DeepSpeed's settings as this project states them; pass "
             "--deepspeed-repo for DeepSpeed's own config and scripts)")
    return Settings(label, hooks, yapf_style=LINT_DIR / "style.yapf")


def _git_out(args, **kw):
    res = subprocess.run(["git", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    if res.returncode != 0:
        raise LintError(f"git {' '.join(args)} failed: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def deepspeed_files(repo, ref, dest):
    """Put DeepSpeed's ``.pre-commit-config.yaml``, root configs and ``scripts/`` from ``repo`` into
    ``dest``; return a line naming what was used. ``repo``: a checkout (its working tree as it is)
    or a git directory without work tree (``ref`` of it)."""
    repo = Path(repo).expanduser().resolve()
    wanted = [".pre-commit-config.yaml", *ROOT_CONFIGS]
    if (repo / ".pre-commit-config.yaml").is_file():
        for name in wanted:
            if (repo / name).is_file():
                shutil.copy2(repo / name, dest / name)
        if (repo / "scripts").is_dir():
            shutil.copytree(repo / "scripts", dest / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
        try:
            commit = _git_out(["-C", str(repo), "log", "-1", "--format=%H (%cd)", "--date=short"]).decode().strip()
            dirty = _git_out(["-C", str(repo), "status", "--porcelain", "--", *wanted, "scripts"]).decode().strip()
            state = f"commit {commit}" + (", with local changes" if dirty else "")
        except LintError:
            state = "not a git checkout"
        return f"the checkout {repo}, {state}"
    try:
        commit = _git_out(["--git-dir", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"]).decode().strip()
    except LintError:
        raise LintError(f"{repo}: neither a DeepSpeed checkout (no .pre-commit-config.yaml) nor a git directory "
                        f"with a commit {ref!r}") from None
    present = _git_out(["--git-dir", str(repo), "ls-tree", "--name-only", commit, "--", *wanted, "scripts"])
    names = present.decode().split()
    if ".pre-commit-config.yaml" not in names:
        raise LintError(f"{repo} at {commit}: no .pre-commit-config.yaml; is it DeepSpeed's repository?")
    archive = _git_out(["--git-dir", str(repo), "archive", "--format=tar", commit, *names])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # noqa: S202 - git archive of a local repository
    date = _git_out(["--git-dir", str(repo), "log", "-1", "--format=%cd", "--date=short", commit]).decode().strip()
    return f"the git directory {repo}, {ref} = commit {commit} ({date})"


def _load_yaml(path, python):
    """The YAML file ``path`` as Python data, parsed by ``python`` (.venv/lint/'s, which has PyYAML)."""
    code = "import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)"
    res = subprocess.run([str(python), "-c", code, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if res.returncode != 0:
        raise LintError(f"cannot read {path}: {res.stderr.strip()}")
    return json.loads(res.stdout)


def deepspeed_settings(repo, ref, bin_dir, work, requirements):
    """The hooks of the DeepSpeed checkout ``repo``'s ``.pre-commit-config.yaml``; its files are
    put under ``work/deepspeed``."""
    b = Path(bin_dir)
    dest = Path(work) / "deepspeed"
    dest.mkdir()
    used = deepspeed_files(repo, ref, dest)
    config = _load_yaml(dest / ".pre-commit-config.yaml", b / "python")
    pins = pinned_versions(requirements)
    hooks, skipped, warnings = [], [], []
    top_exclude = config.get("exclude")
    for entry in config.get("repos") or []:
        url = str(entry.get("repo", ""))
        name = re.sub(r"(\.git)?/?$", "", url.split("://", 1)[-1]).split("/", 1)[-1].lower()
        package = PACKAGES.get(name)
        if package and entry.get("rev") and entry["rev"].lstrip("v") != pins.get(package):
            warnings.append(f"DeepSpeed's config pins {url} at {entry['rev']}, but .venv/lint/ has {package}=="
                            f"{pins.get(package)} (requirements/lint.txt): results may differ from its CI's")
        for h in entry.get("hooks") or []:
            hid = h.get("id", "?")
            args = [str(a) for a in h.get("args") or []]
            files, exclude = h.get("files", ""), h.get("exclude")
            if top_exclude:
                exclude = f"(?:{top_exclude})|(?:{exclude})" if exclude else top_exclude
            stages = set(h.get("stages") or []) | set(config.get("default_stages") or [])
            if stages and not stages & {"pre-commit", "commit"}:
                skipped.append((hid, f"stages {sorted(stages)}: not run at commit"))
                continue
            if h.get("pass_filenames") is False:
                skipped.append((hid, "takes no file names (pass_filenames: false)"))
                continue
            types = set(h.get("types") or []) | set(h.get("types_or") or [])
            if types and not types & {"python", "text", "file"}:
                skipped.append((hid, f"types {sorted(types)}: no Python file"))
                continue
            if url == "meta":
                skipped.append((hid, "a check of the config itself"))
            elif url == "local":
                argv = shlex.split(str(h.get("entry", "")))
                script = (dest / argv[0]).resolve() if argv else None
                if h.get("language") in ("python", "script", "system") and script and script.is_file() \
                        and script.suffix == ".py":
                    hooks.append(Hook(hid, "script", [b / "python", script, *argv[1:], *args], files, exclude))
                else:
                    skipped.append((hid, f"local hook with entry {h.get('entry')!r}: not a Python script here"))
            elif name == "google/yapf" and hid == "yapf":
                # the hook's own args are [-i] (in place); --diff reports instead. Style: the
                # .style.yapf at the tree's root, found by yapf as in DeepSpeed's repository.
                hooks.append(Hook(hid, "yapf", [b / "yapf", *[a for a in args if a not in ("-i", "--in-place")]],
                                  files or r"\.py$", exclude))
            elif name == "pycqa/flake8" and hid == "flake8":
                hooks.append(Hook(hid, "flake8", [b / "flake8", *args], files or r"\.py$", exclude))
            elif name == "codespell-project/codespell" and hid == "codespell":
                hooks.append(Hook(hid, "codespell", [b / "codespell", *args], files, exclude))
            elif name == "pre-commit/pre-commit-hooks" and hid in PRE_COMMIT_HOOKS:
                script, fixes = PRE_COMMIT_HOOKS[hid]
                if hid in ("fix-encoding-pragma", "check-ast", "check-builtin-literals", "check-docstring-first",
                           "debug-statements", "double-quote-string-fixer"):
                    files = files or r"\.py$"
                hooks.append(Hook(hid, "fixer" if fixes else "checker", [b / script, *args], files, exclude))
            elif hid in NOT_FOR_PYTHON:
                skipped.append((hid, NOT_FOR_PYTHON[hid]))
            else:
                skipped.append((hid, f"of {url}: not known to this command"))
    root_files = {n: (dest / n).read_bytes() for n in ROOT_CONFIGS if (dest / n).is_file()}
    style = dest / ".style.yapf" if (dest / ".style.yapf").is_file() else None
    label = f"DeepSpeed's .pre-commit-config.yaml, root configs and scripts/ of {used}"
    return Settings(label, hooks, skipped, warnings, root_files, style)


# --------------------------------------------------------------------------- running hooks


class Finding:
    """One complaint of ``hook`` about ``path`` (a repository path), at ``line`` (None: the file)."""

    def __init__(self, hook, path, line, text, detail="", error=False):
        self.hook, self.path, self.line, self.text = hook, path, line, text
        self.detail = detail  # e.g. yapf's hunk
        self.error = error  # the hook could not check the file (crashed, syntax error)

    @property
    def signature(self):
        """What identifies the finding apart from its line: compared with the release's file."""
        return (self.hook, self.text)

    def where(self):
        return f"{self.path}:{self.line}" if self.line else self.path

    def __repr__(self):
        return f"Finding({self.hook!r}, {self.where()!r}, {self.text!r})"


def _run(argv, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "PYTHON"))}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C.UTF-8", NO_COLOR="1")
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace")


def _tail(res):
    text = (res.stderr.strip() or res.stdout.strip()).splitlines()
    return text[-1] if text else f"exit {res.returncode}"


def _yapf_hunks(diff):
    """[(first line, last line of the original that yapf would change, hunk text)] of a ``yapf --diff``."""
    hunks, cur = [], None
    for line in diff.splitlines():
        m = re.match(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
        if m:
            cur = [int(m.group(1)), [], []]
            hunks.append(cur)
            continue
        if cur is None or line.startswith(("--- ", "+++ ")):
            continue
        cur[2].append(line)
    out = []
    for start, _, body in hunks:
        n, changed = start, []
        for line in body:
            if line.startswith("-"):
                changed.append(n)
                n += 1
            elif line.startswith("+"):
                changed.append(n)  # inserted before original line n
            else:
                n += 1
        changed = [min(c, max(n - 1, start)) for c in changed]  # an insertion after the last line: that line
        first, last = (min(changed), max(changed)) if changed else (start, start)
        out.append((first, last, "\n".join(body)))
    return out


def _yapf_findings(hook, path, diff):
    return [Finding(hook.id, path, a, f"lines {a}-{b} would be reformatted" if b > a else "line would be reformatted",
                    detail=body) for a, b, body in _yapf_hunks(diff)]


def run_yapf(hook, tree, path, lines=None):
    """``yapf --diff`` on one file (on ``lines`` [(first, last)] of it only, if given)."""
    argv = [*hook.argv, "--diff", *[f"--lines={a}-{b}" for a, b in lines or []]]
    res = _run([*argv, path], tree)
    if res.returncode == 0:
        return []
    if res.returncode == 1 and res.stdout.strip() and not res.stderr.strip():
        return _yapf_findings(hook, path, res.stdout)
    return [Finding(hook.id, path, None, f"yapf could not format the file: {_tail(res)}", error=True)]


def run_yapf_batch(hook, tree, paths):
    """``yapf --diff`` on whole files, one process; file by file where it cannot format one."""
    res = _run([*hook.argv, "--diff", *paths], tree)
    if res.returncode not in (0, 1) or res.stderr.strip() or (res.returncode == 1 and not res.stdout.strip()):
        return [f for p in paths for f in run_yapf(hook, tree, p)]
    chunks, cur = {}, None
    for line in res.stdout.splitlines(keepends=True):
        m = re.match(r"^--- (.+?)\t\(original\)$", line.rstrip("\n"))
        if m:
            cur = m.group(1)
            chunks[cur] = []
        elif cur is not None:
            chunks[cur].append(line)
    unknown = sorted(set(chunks) - set(paths))
    if unknown:
        raise LintError(f"yapf --diff named files it was not given: {unknown}")
    return [f for p in paths if p in chunks for f in _yapf_findings(hook, p, "".join(chunks[p]))]


def _parse_locations(text, paths):
    """{path: [(line or None, message)]} of ``path:line:[col:] message`` / ``path: message`` lines."""
    out = {}
    by_len = sorted(paths, key=len, reverse=True)
    for raw in text.splitlines():
        for p in by_len:
            if raw.startswith(p + ":"):
                rest = raw[len(p) + 1:]
                m = re.match(r"^(\d+):(?:(\d+):)? ?(.*)$", rest)
                if m:
                    out.setdefault(p, []).append((int(m.group(1)), m.group(3).strip()))
                else:
                    out.setdefault(p, []).append((None, rest.strip()))
                break
    return out


def run_batch_linter(hook, tree, paths, ok_codes):
    res = _run([*hook.argv, *paths], tree)
    found = _parse_locations(res.stdout, paths)
    findings = [Finding(hook.id, p, line, msg) for p in paths for line, msg in found.get(p, [])]
    if res.returncode not in ok_codes or (res.returncode != 0 and not findings):
        raise LintError(f"{hook.id} failed (exit {res.returncode}) in {tree}: {_tail(res)}")
    return findings


def run_per_file(hook, tree, paths):
    """A script or pre-commit-hooks checker, once per file: exit 0 passes; else the lines it names
    (``path:line:...``, e.g. git grep's), or its last line of output."""
    findings = []
    for p in paths:
        res = _run([*hook.argv, p], tree)
        if res.returncode == 0:
            continue
        named = _parse_locations(res.stdout + "\n" + res.stderr, [p]).get(p, [])
        located = [(line, msg) for line, msg in named if line]
        if located:
            findings += [Finding(hook.id, p, line, msg) for line, msg in located]
        else:
            findings.append(Finding(hook.id, p, None, _tail(res), error=res.returncode not in (1, )))
    return findings


def run_fixer(hook, tree, paths):
    """A fixing hook on the files (in place), then each file put back: a finding per line it changed."""
    before = {p: (Path(tree) / p).read_bytes() for p in paths}
    res = _run([*hook.argv, *paths], tree)
    findings = []
    try:
        for p in paths:
            after = (Path(tree) / p).read_bytes()
            if after == before[p]:
                continue
            old = before[p].decode("utf-8", "replace").splitlines(keepends=True)
            new = after.decode("utf-8", "replace").splitlines(keepends=True)
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
                if tag == "equal":
                    continue
                # a line changed in place is a finding of its own (trailing whitespace); lines
                # removed or added are one (the blank lines at the end of a file)
                starts = range(i1, i2) if tag == "replace" and i2 - i1 == j2 - j1 else [i1]
                for i in starts:
                    line = min(i, len(old) - 1) if old else 0
                    text = old[line].rstrip("\r\n").lstrip() if old else ""
                    many = f" (and {i2 - i1 - 1} line(s) after it)" if len(starts) == 1 and i2 - i1 > 1 else ""
                    findings.append(Finding(hook.id, p, line + 1, f"would change {text[:100]!r}{many}"))
    finally:
        for p, data in before.items():
            (Path(tree) / p).write_bytes(data)
    if res.returncode not in (0, 1) or (res.returncode == 1 and not findings):
        raise LintError(f"{hook.id} failed (exit {res.returncode}) in {tree}: {_tail(res)}")
    return findings


def run_hooks(settings, tree, paths, yapf_lines=None):
    """Every hook of ``settings`` on ``paths`` (repository paths under ``tree``): [Finding].
    ``yapf_lines``: {path: [(first, last)]} for files yapf judges on those lines only."""
    findings = []
    for hook in sorted(settings.hooks, key=lambda h: h.kind == "fixer"):  # fixers last
        sel = [p for p in paths if hook.selects(p)]
        if not sel:
            continue
        if hook.kind == "yapf":
            ranged = [p for p in sel if (yapf_lines or {}).get(p)]
            findings += run_yapf_batch(hook, tree, [p for p in sel if p not in ranged])
            for p in ranged:
                findings += run_yapf(hook, tree, p, yapf_lines[p])
        elif hook.kind == "flake8":
            findings += run_batch_linter(hook, tree, sel, (0, 1))
        elif hook.kind == "codespell":
            findings += run_batch_linter(hook, tree, sel, (0, 65))
        elif hook.kind in ("script", "checker"):
            findings += run_per_file(hook, tree, sel)
        elif hook.kind == "fixer":
            findings += run_fixer(hook, tree, sel)
        elif hook.kind == "builtin":
            for p in sel:
                findings += [Finding(hook.id, p, line, msg) for line, msg in hook_checks.CHECKS[hook.id](tree / p)]
        else:
            raise LintError(f"unknown hook kind {hook.kind!r}")
    return findings


# --------------------------------------------------------------------------- what is linted


class Target:
    """The Python files of one pull request (or backport, or of no pull request)."""

    def __init__(self, stem, title, ours, patched, patches=()):
        self.stem, self.title = stem, title
        self.ours = sorted(ours)  # repository paths of our files, linted as they are in the project
        self.patched = dict(patched)  # {upstream path: (release's text or None if a patch adds it, patched text)}
        self.patches = list(patches)
        self.findings, self.upstream_own, self.notes = [], [], []

    @property
    def paths(self):
        return sorted(set(self.ours) | set(self.patched))


def _patched_paths(patch):
    """Paths a git-format patch touches (from its ``diff --git a/X b/Y`` lines: Y)."""
    out = []
    for line in Path(patch).read_text(errors="replace").splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if m:
            out.append(m.group(2))
    return out


class Release:
    """Read access to the pristine release sdist's files by repository path."""

    def __init__(self, sdist):
        self.sdist = Path(sdist)
        self._tar = tarfile.open(self.sdist)
        names = self._tar.getnames()
        self.top = names[0].split("/", 1)[0]

    def read(self, rel):
        try:
            member = self._tar.getmember(f"{self.top}/{rel}")
        except KeyError:
            return None
        f = self._tar.extractfile(member)
        return f.read() if f else None

    def close(self):
        self._tar.close()


def apply_group_patches(release, patches, work):
    """{upstream path: (release's bytes or None, patched bytes)} of the files ``patches`` (one
    group's, alone, in order) change, made in a tree under ``work`` holding only those files."""
    tree = Path(tempfile.mkdtemp(prefix="patched-", dir=work)) / "tree"
    tree.mkdir()
    paths = sorted({p for patch in patches for p in _patched_paths(patch)})
    originals = {}
    for rel in paths:
        data = release.read(rel)
        originals[rel] = data
        if data is not None:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(data)
    with contextlib.redirect_stderr(io.StringIO()):  # the build's "applied X" lines
        zb.apply_patches(tree, patches)
    out = {}
    for rel in paths:
        if (tree / rel).is_file():
            out[rel] = (originals[rel], (tree / rel).read_bytes())
    return out


def targets(base, project, release, work):
    """The ``Target`` of every group with files on ``base`` (pull requests in order, then
    backports), plus one of the Python files no group claims; warnings as a list of lines."""
    warnings = []
    try:
        owners = ze.assign(base, project)
    except ze.ExportError as e:
        warnings.append(f"the export would refuse this tree ({e}); linting each pull request's files as far as "
                        "the groups claim them")
        owners = ze.assign(base, project, strict=False)
    out = []
    for g in ze.GROUPS:
        files = owners.get(g.key)
        if not files:
            continue
        patches = [Path(project) / p for p in files if p.startswith("patches/")]
        patched = apply_group_patches(release, patches, work) if patches else {}
        patched = {p: v for p, v in patched.items() if p.endswith(".py")}
        ours = [p for p in files if p.endswith(".py") and not p.startswith("patches/")]
        title = g.title if g.pull_request else f"{g.title} [backport: combined diff only]"
        out.append(Target(g.stem, title, ours, patched, [p.name for p in patches]))
    claimed = {p for files in owners.values() for p in files}
    # claimed by no group's pattern (a backport's test on a base without its patch is not loose)
    loose = [p for p in ze.candidate_files(base, project) if p.endswith(".py") and p not in claimed
             and not any(g.matches(p) for g in ze.GROUPS)
             and not any(fnmatch.fnmatchcase(p, pattern) for pattern in ze.NEVER_EXPORTED)]
    if loose:
        warnings.append(f"{len(loose)} Python file(s) under deepspeed/ and tests/ belong to no pull request "
                        f"(zero3muon_export's groups): linted as {NO_GROUP!r}: {', '.join(loose)}")
        out.append(Target(NO_GROUP, "files the export's groups do not claim", loose, {}))
    return out, warnings


# --------------------------------------------------------------------------- linting


def _tree(work, name, settings):
    tree = Path(work) / name
    tree.mkdir(parents=True)
    for fname, data in settings.root_files.items():
        (tree / fname).write_bytes(data)
    return tree


def _git_add(tree):
    """Make ``tree`` a git repository with every file added (pre-commit lints staged files; DeepSpeed's
    check-license runs ``git grep`` without --no-index, which outside a repository finds nothing)."""
    _git_out(["init", "-q"], cwd=tree)
    _git_out(["add", "-A", "--force", "."], cwd=tree)


def _changed_ranges(old, new):
    """Line ranges (1-based, inclusive) of ``new`` that differ from ``old`` (bytes); around a deletion
    the lines on either side."""
    a = old.decode("utf-8", "replace").splitlines()
    b = new.decode("utf-8", "replace").splitlines()
    ranges = []
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        first, last = (j1 + 1, j2) if j2 > j1 else (max(1, j1), min(max(len(b), 1), j1 + 1))
        ranges.append((first, last))
    return ranges


def lint_release(targets_, settings, work):
    """The hooks on the release's own version of every upstream file the targets' patches change
    (one tree: the release's files are the same for every pull request): [Finding]."""
    files = {}
    for t in targets_:
        for rel, (old, _) in t.patched.items():
            if old is not None:
                files[rel] = old
    if not files:
        return []
    tree = _tree(work, "release", settings)
    for rel, data in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    _git_add(tree)
    return run_hooks(settings, tree, sorted(files))


def lint_target(target, settings, project, work, release_findings=()):
    """Run the hooks on ``target``'s files; sets ``target.findings``, ``upstream_own`` and ``notes``.
    ``release_findings``: ``lint_release``'s, for the release's versions of the patched files."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", target.stem)
    tree = _tree(work, safe, settings)
    for rel in target.ours:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(project) / rel, tree / rel)
    for rel, (_, patched) in target.patched.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(patched)
    _git_add(tree)

    upstream_paths = [rel for rel, (old, _) in target.patched.items() if old is not None]
    upstream = [f for f in release_findings if f.path in upstream_paths]
    yapf_lines = {}
    for rel in upstream_paths:
        yapf_own = [f for f in upstream if f.path == rel and f.hook == "yapf"]
        if yapf_own:
            yapf_lines[rel] = _changed_ranges(*target.patched[rel]) or [(1, 1)]
            target.notes.append(f"{rel}: the release's file does not pass yapf ({len(yapf_own)} hunk(s)): yapf "
                                f"judged on the {len(yapf_lines[rel])} line range(s) the patches change")
        else:
            target.notes.append(f"{rel}: the release's file passes yapf: yapf judged on the whole patched file")
    for rel, (old, _) in target.patched.items():
        if old is None:
            target.notes.append(f"{rel}: added by the patches: linted whole")
    found = run_hooks(settings, tree, target.paths, yapf_lines)

    own = {rel: Counter(f.signature for f in upstream if f.path == rel and f.hook != "yapf") for rel in upstream_paths}
    for f in found:
        c = own.get(f.path)
        if c and c[f.signature] > 0:
            c[f.signature] -= 1
            target.upstream_own.append(f)
        else:
            target.findings.append(f)
    target.upstream_own += [f for f in upstream if f.hook == "yapf"]  # the release's own, for the record
    return target


def fix_files(settings, files):
    """``yapf -i`` on ``files`` (absolute paths of our own files); returns those it changed."""
    yapf = next((h for h in settings.hooks if h.kind == "yapf"), None)
    if yapf is None:
        raise LintError("no yapf hook in the config: nothing to fix with")
    if settings.yapf_style is None:
        raise LintError("the DeepSpeed checkout has no .style.yapf: no style to fix with")
    argv = [yapf.argv[0], f"--style={settings.yapf_style}", "-i"]
    changed = []
    for f in files:
        before = Path(f).read_bytes()
        res = _run([*argv, f], Path(f).parent)
        if res.returncode not in (0, 1):
            raise LintError(f"yapf -i {f} failed (exit {res.returncode}): {_tail(res)}")
        if Path(f).read_bytes() != before:
            changed.append(f)
    return changed


def _counts(findings):
    c = Counter(f.hook for f in findings)
    return ", ".join(f"{hook} {n}" for hook, n in sorted(c.items()))


def report(target, verbose=False):
    """Print ``target``'s findings per file; return the number of findings."""
    paths = target.paths
    log()
    kinds = f"{len(target.ours)} ours" + (f", {len(target.patched)} patched upstream" if target.patched else "")
    log(f"{target.stem}: {target.title}")
    log(f"  {len(paths)} Python file(s): {kinds}" + (f" (patches {', '.join(target.patches)})" if target.patches
                                                      else ""))
    by_path = {}
    for f in target.findings:
        by_path.setdefault(f.path, []).append(f)
    for p in paths:
        fs = by_path.get(p)
        if not fs:
            continue
        mark = " (patched)" if p in target.patched else ""
        log(f"  FAIL {p}{mark}: {_counts(fs)}")
        for f in sorted(fs, key=lambda f: (f.hook, f.line or 0)):
            log(f"       {f.hook}: {(str(f.line) + ': ') if f.line else ''}{f.text}")
            if verbose and f.detail:
                for line in f.detail.splitlines():
                    print(f"           | {line}")
    clean = [p for p in paths if p not in by_path]
    if clean:
        log(f"  ok   {len(clean)} file(s): " + ", ".join(Path(p).name for p in clean))
    for note in target.notes:
        log(f"  note {note}")
    if target.upstream_own:
        own = {}
        for f in target.upstream_own:
            own.setdefault(f.path, []).append(f)
        for p, fs in sorted(own.items()):
            log(f"  upstream's own, not counted: {p}: {_counts(fs)}")
            if verbose:
                for f in fs:
                    log(f"       {f.hook}: {(str(f.line) + ': ') if f.line else ''}{f.text}")
    return len(target.findings)


def summary(base, results, settings_kind):
    log()
    total = [f for t in results for f in t.findings]
    log(f"summary (DeepSpeed {base}, {settings_kind}):")
    for t in results:
        bad = {f.path for f in t.findings}
        state = f"{len(t.findings)} finding(s) in {len(bad)} of {len(t.paths)} file(s) ({_counts(t.findings)})" \
            if t.findings else f"clean ({len(t.paths)} file(s))"
        log(f"  {t.stem}: {state}")
    per_hook = Counter(f.hook for f in total)
    files = {(f.path) for f in total}
    if total:
        log(f"total: {len(total)} finding(s) in {len(files)} file(s): "
            + ", ".join(f"{h} {n} in {len({f.path for f in total if f.hook == h})} file(s)"
                        for h, n in sorted(per_hook.items())))
    else:
        log("total: no findings")
    return len(total)


def main(base, bin_dir, project, deepspeed_repo=None, ref="HEAD", fix=False, paths=None, verbose=False,
         requirements=None):
    """``python3 dev.py lint``: 0 if every file passes every hook, 1 on findings, 2 if it cannot run."""
    project = Path(project).resolve()
    requirements = Path(requirements or project / "requirements" / "lint.txt")
    with tempfile.TemporaryDirectory(prefix="zero3muon-lint-") as work:
        work = Path(work)
        try:
            if deepspeed_repo:
                settings = deepspeed_settings(deepspeed_repo, ref, bin_dir, work, requirements)
                kind = "DeepSpeed's config"
            else:
                settings = fallback_settings(bin_dir)
                kind = "fallback"
            log(f"hooks: {settings.label}")
            log(f"  run: {', '.join(h.id for h in settings.hooks)}")
            for hid, why in settings.skipped:
                log(f"  not run: {hid} ({why})")
            for w in settings.warnings:
                log(f"warning: {w}")

            if paths:
                files = [Path(p).resolve() for p in paths]
                missing = [str(f) for f in files if not f.is_file()]
                if missing:
                    raise LintError(f"no such file: {', '.join(missing)}")
                if fix:
                    for f in fix_files(settings, files):
                        log(f"fixed (yapf -i): {f}")
                return _lint_paths(files, project, settings, work, base, kind, verbose)

            cfg = zb.load_config(project)
            base = zb.select_base(cfg, base)
            sdist = zb.obtain_sdist(base, cfg["sdist-sha256"][base])
            log(f"release: {sdist} (sha256-checked); project: {project}")
            release = Release(sdist)
            try:
                found, warnings = targets(base, project, release, work)
            finally:
                release.close()
            for w in warnings:
                log(f"warning: {w}")
            if fix:
                ours = sorted({project / p for t in found for p in t.ours})
                changed = fix_files(settings, ours)
                log(f"--fix: yapf -i on our {len(ours)} file(s) (patched upstream files are left to the patches): "
                    f"{len(changed)} changed" + "".join(f"\n[lint]   fixed {Path(c).relative_to(project)}"
                                                         for c in changed))
            release_findings = lint_release(found, settings, work)
            for t in found:
                lint_target(t, settings, project, work, release_findings)
                report(t, verbose)
            n = summary(base, found, kind)
        except (LintError, zb.BuildError) as e:
            log(f"could not lint: {e}")
            return 2
    return 1 if n else 0


def _lint_paths(files, project, settings, work, base, kind, verbose):
    rels = []
    for f in files:
        try:
            rels.append(f.relative_to(project).as_posix())
        except ValueError:
            rels.append(f.name)
    if len(set(rels)) != len(rels):
        raise LintError(f"two of the files would lint under the same name: {rels}")
    t = Target("files", "the files given with --paths", rels, {})
    tree = _tree(work, "files", settings)
    for f, rel in zip(files, rels):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, tree / rel)
    _git_add(tree)
    t.findings = run_hooks(settings, tree, rels)
    report(t, verbose)
    return 1 if summary(base, [t], kind) else 0
