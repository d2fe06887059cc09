"""The whole change as one upstream-style diff, for DeepSpeed maintainers (``python3 dev.py export``).

The diff is made with the build's own steps (``zero3muon_build``): the pinned sdist is obtained
and verified as ``pip install .`` does, unpacked, committed to a throw-away git index as the
pristine release, changed by ``apply_changes`` (our new files under ``deepspeed/``, then
``patches/<base>/*.patch``), and diffed with ``git diff --cached``: new files appear as
``new file mode`` / ``--- /dev/null``, paths are relative to the repository root with ``a/`` and
``b/`` prefixes, so ``git apply`` or ``patch -p1`` applies it to a DeepSpeed checkout of the tag.

Left out on purpose: the build's packaging labels (``write_build_labels``), i.e. ``build.txt``
(DeepSpeed's setup.py writes its own) and the generated ``deepspeed/runtime/zero/muon/_build_info.py``,
and ``PROJECT_ONLY``: ``python -m deepspeed.runtime.zero.muon``, the report of this project's
wheel (merged upstream it would call the merged code "not the zero3muon build"). They describe
this project's wheel, not the change. The tests under ``tests/`` stay in this project (see the PR
description).

Stdlib only, like the backend: ``dev.py`` imports this with the system Python, without torch.
"""

import ast
import os
import subprocess
import tempfile
from pathlib import Path
from string import Template

import zero3muon_build as zb

PR_TEMPLATE = Path(__file__).resolve().parent / "export_pr_template.md"

# New files of ours that belong to this project's wheel, not to the upstream change.
PROJECT_ONLY = ("deepspeed/runtime/zero/muon/__main__.py", )

# One line for each upstream file our patches change (new files describe themselves: their docstring).
MODIFIED_FILE_NOTES = {
    "deepspeed/runtime/zero/stage3.py":
    "creates `Zero3MuonBoundary` (with its configuration check) in `__init__` and calls it in `step()` "
    "right after unscale-and-clip, instead of upstream's Muon call (0.19.7: in the gradient reduce path, "
    "per micro-batch; 0.19.8: before the norm); fp32 Muon momentum; lifts the refusals of `reduce_scatter` "
    "and of Muon groups with different momenta, and upstream's refusal of Muon with the all-to-all "
    "(quantized-gradient) reduction, which is now refused only where the accelerator lacks the "
    "quantizer op (patch 0001). A parameter's first gradient in an accumulation window replaces its "
    "partition, and a parameter without gradient in the window gets a zero gradient (patch 0002). "
    "Gradients and their norm are unscaled by the loss scale of the step's backward, not by the scale "
    "the dynamic loss scaler has just grown (patch 0003).",
}


class ExportError(zb.BuildError):
    """The export could not be made; the message says why."""


class Export:
    """What ``export`` wrote: paths, the diff (bytes, without the header) and its per-file summary."""

    def __init__(self, base, diff_path, pr_path, diff, name_status, diffstat):
        self.base, self.diff_path, self.pr_path = base, diff_path, pr_path
        self.diff, self.name_status, self.diffstat = diff, name_status, diffstat


def diff_file_name(base):
    return f"zero3muon-deepspeed-{base}.diff"


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


def make_diff(sdist, sha256, base, work_dir, repo_root=zb.REPO_ROOT):
    """(diff, name-status, diffstat) of our change against the pristine ``sdist``, made under ``work_dir``."""
    zb.verify_sha256(sdist, sha256)
    patches = zb.list_patches(base, repo_root)
    tree = zb.unpack_sdist(sdist, work_dir)
    _git(tree, "init", "-q")
    pristine = _snapshot(tree)
    zb.apply_changes(tree, patches, repo_root)
    for rel in PROJECT_ONLY:
        (tree / rel).unlink(missing_ok=True)
    changed = _snapshot(tree)
    opts = ["--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", pristine, changed]
    diff = _git(tree, "diff", "--binary", *opts, raw=True)
    name_status = [line.split("\t", 1) for line in _git(tree, "diff", "--name-status", *opts).splitlines()]
    diffstat = _git(tree, "diff", "--stat=100", *opts)
    labels = {"build.txt", zb.BUILD_INFO_REL.as_posix()}
    leaked = [path for _, path in name_status if path in labels or "__pycache__" in path or path.endswith(".pyc")]
    if leaked:  # cannot happen through apply_changes; guards a future change of it
        raise ExportError(f"the diff would contain build artifacts: {', '.join(leaked)}")
    if not diff:
        raise ExportError(f"no difference to deepspeed-{base}: nothing to export")
    return diff, name_status, diffstat


def _docstring_summary(path):
    try:
        doc = ast.get_docstring(ast.parse(Path(path).read_text()))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    if not doc:
        return None
    return " ".join(doc.split("\n\n", 1)[0].split())


def describe_files(name_status, repo_root, patches):
    """Markdown list: one line per changed file."""
    lines = []
    for status, path in name_status:
        if status == "A":
            what = _docstring_summary(Path(repo_root) / path) or "new file"
            lines.append(f"- `{path}` (new): {what}")
        else:
            touching = [p.name for p in patches if f"diff --git a/{path} b/{path}\n" in p.read_text()]
            what = MODIFIED_FILE_NOTES.get(path) or f"changed by {', '.join(touching) or 'the patches'}"
            lines.append(f"- `{path}`: {what}")
    return "\n".join(lines)


def pr_description(base, cfg, sdist, sha256, name_status, diffstat, repo_root=zb.REPO_ROOT):
    patches = zb.list_patches(base, repo_root)
    values = dict(
        base=base,
        patch_version=cfg["version"],
        sdist_name=Path(sdist).name,
        sha256=sha256,
        diff_name=diff_file_name(base),
        patch_names=", ".join(f"`{p.name}`" for p in patches),
        files=describe_files(name_status, repo_root, patches),
        diffstat=diffstat.rstrip("\n"),
        per_head="`per_head_muon`, " if base != "0.19.7" else "",
    )
    return Template(PR_TEMPLATE.read_text()).substitute(values)


def diff_header(base, cfg, sdist, sha256, diffstat):
    """Lines before the first ``diff --git``: git apply and patch skip them."""
    summary = diffstat.rstrip("\n").splitlines()[-1].strip()
    return (f"ZeRO-3 Muon boundary update (zero3muon {cfg['version']}) for DeepSpeed {base}: {summary}.\n"
            f"Made against {Path(sdist).name}, sha256 {sha256}.\n"
            f"Apply at the root of a DeepSpeed checkout of v{base} with `git apply` or `patch -p1`.\n\n")


def export(base=None, out_dir=None, repo_root=zb.REPO_ROOT, sdist=None):
    """Write the diff and PR_DESCRIPTION.md for ``base`` into ``out_dir`` (default
    ``repo_root/out/export/<base>``); return an ``Export``."""
    repo_root = Path(repo_root)
    cfg = zb.load_config(repo_root)
    base = zb.select_base(cfg, base)
    sha256 = cfg["sdist-sha256"][base]
    sdist = Path(sdist) if sdist else zb.obtain_sdist(base, sha256)
    out_dir = Path(out_dir) if out_dir else repo_root / "out" / "export" / base
    with tempfile.TemporaryDirectory(prefix="zero3muon-export-") as tmp:
        diff, name_status, diffstat = make_diff(sdist, sha256, base, tmp, repo_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    diff_path = out_dir / diff_file_name(base)
    pr_path = out_dir / "PR_DESCRIPTION.md"
    diff_path.write_bytes(diff_header(base, cfg, sdist, sha256, diffstat).encode() + diff)
    pr_path.write_text(pr_description(base, cfg, sdist, sha256, name_status, diffstat, repo_root))
    return Export(base, diff_path, pr_path, diff, name_status, diffstat)
