"""The change as upstream pull requests, for DeepSpeed maintainers (``python3 dev.py export``).

The change is several pull requests plus, on some bases, a backport (``GROUPS``); each file of
the repository that could go upstream (``deepspeed/``, ``tests/``, ``patches/<base>/``) belongs to
exactly one of them by the patterns below, or is never exported (``NEVER_EXPORTED``). A file
matching none, or more than one, stops the export with an ``ExportError`` naming it.

Every pull request's code and patches apply alone to the pristine release. Some are stacked on
another for their tests only: they import its test helpers (e.g. the muon tests'
``tests/unit/runtime/zero/zero3_muon_helpers.py``). A group declares that in ``tests_need``, and
the export checks the declaration against the ``unit.`` imports of the group's tests
(``imported_groups``): an undeclared or stale one stops it. A group whose new modules import
another group's modules (the Muon universal-checkpoint checks import the generic ZeRO-3 universal
module), or whose patches add an import of one, declares it in ``code_needs``, checked against its
``deepspeed.`` imports the same way.

For each pull request the export takes the pristine release (the pinned sdist, verified and
unpacked as ``pip install .`` does, committed to a throw-away git index), adds that pull request's
new files and applies its patches ALONE (``zero3muon_build.apply_patches``: a patch whose context
needs another pull request's patch fails loudly), and diffs with ``git diff``: new files appear
as ``new file mode`` / ``--- /dev/null``, paths are relative to the repository root with ``a/``
and ``b/`` prefixes, so ``git apply`` or ``patch -p1`` applies it to a DeepSpeed checkout of the
tag. The combined diff is the build's own change (``zero3muon_build.apply_changes``: every new
file under ``deepspeed/``, then every patch in order) plus every exported test, i.e. every pull
request and the backports together.

Left out on purpose:

- the build's packaging labels (``write_build_labels``): ``build.txt`` (DeepSpeed's setup.py
  writes its own) and the generated ``deepspeed/runtime/zero/muon/_build_info.py``;
- ``deepspeed/runtime/zero/muon/__main__.py``, the report of this project's wheel (merged
  upstream it would call the merged code "not the zero3muon build");
- ``tests/unit/common.py``, this project's stand-in for DeepSpeed's own ``tests/unit/common.py``
  (``DistributedTest``; the exported tests use DeepSpeed's), ``tests/conftest.py`` and the tests
  of this project's build, examples and benchmark.

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

# This project's wheel report: a new file of ours that is not part of the upstream change.
PROJECT_ONLY = ("deepspeed/runtime/zero/muon/__main__.py", )

# Repository files that are never exported (fnmatch patterns; ``*`` also matches ``/``).
NEVER_EXPORTED = PROJECT_ONLY + (
    "tests/conftest.py",  # puts tests/ on sys.path here; DeepSpeed's tests/conftest.py does more
    "tests/__init__.py",  # package markers of this project's tests/ (DeepSpeed has its own
    "tests/unit/__init__.py",  # tests/unit/__init__.py)
    "tests/unit/common.py",  # stand-in for DeepSpeed's tests/unit/common.py (DistributedTest)
    "tests/unit/test_distributed_standin.py",  # the stand-in's own test
    "tests/unit/build/*",  # this project's build backend and export
    "tests/examples/*",  # this project's examples
    "tests/bench/*",  # this project's benchmark
)

# The directories of the repository whose files are candidates for export.
EXPORT_ROOTS = ("deepspeed", "tests")

STAGE3 = "deepspeed/runtime/zero/stage3.py"


class Group:
    """A set of repository files exported together: a pull request, or a backport that goes into
    the combined diff only (``pull_request=False``), and only on a base where it has a patch.

    ``patterns`` are fnmatch patterns on repository paths (``patches/*/0001-*.patch`` matches
    that patch of every base); ``notes`` has one hand-written line per upstream file the group's
    patches modify (new files describe themselves by their docstring); ``tests_need``: keys of
    the groups whose test files this group's tests import (its code and patches still apply alone;
    the tests run with those groups applied too); ``code_needs``: keys of the groups whose modules
    this group's code imports (it is stacked on them, tests and code); ``texts_if``: {template name: ((pattern, text), ...)},
    the name's value is the texts whose pattern matches one of the group's files on the base (a
    sentence about a patch present on one base only, or still to come), else empty."""

    def __init__(self, key, number, title, patterns, notes, template=None, pull_request=True, why="",
                 tests_need=(), texts_if=None, code_needs=()):
        self.key, self.number, self.title = key, number, title
        self.patterns, self.notes, self.template = tuple(patterns), dict(notes), template
        self.pull_request = pull_request
        self.why = why  # a backport: why it is in the combined diff and in no pull request
        self.tests_need = tuple(tests_need)
        self.code_needs = tuple(code_needs)
        self.texts_if = dict(texts_if or {})

    def optional_texts(self, sources):
        """{template name: text} of ``texts_if`` for the group's files ``sources``."""
        return {
            name: "".join(text for pattern, text in pairs if any(fnmatch.fnmatchcase(p, pattern) for p in sources))
            for name, pairs in self.texts_if.items()
        }

    @property
    def stem(self):
        return f"{self.number}-{self.key}"

    def matches(self, path):
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.patterns)

    def __repr__(self):
        return f"Group({self.key!r})"


SEAM = Group(
    "muon-update-seam", 1, "Muon: muon_update as its elementwise momentum step and its Newton-Schulz half",
    patterns=(
        "patches/*/0004-*.patch",
        "tests/unit/runtime/zero/test_muon_update_split.py",
    ),
    notes={
        "deepspeed/runtime/zero/muon/original_muon.py": {
            "*":
            "new `muon_ns_problem` (the matrix, or batch of matrices, Newton-Schulz runs on), "
            "`muon_momentum_step_` (the elementwise momentum step and Nesterov blend) and `muon_orthogonalize`; "
            "`muon_update` becomes their composition and computes what it did. A ZeRO partition can then run the "
            "elementwise step where its gradient is and the orthogonalization where the whole matrix is.",
            "0.19.7": " Also adds 0.19.8's `ns_compute_dtype` (the dtype each NS method computes in).",
            "0.19.8": " `_per_head_orthogonalize` takes its shape check from `muon_ns_problem`.",
        },
    },
    template="pr_muon_seam.md",
)

PLAN = Group(
    "muon-owner-plan", 2, "Muon: the momentum step on a partition, Newton-Schulz on an owner rank, and the owner plan",
    patterns=(
        "deepspeed/runtime/zero/muon/momentum.py",
        "deepspeed/runtime/zero/muon/newton_schulz.py",
        "deepspeed/runtime/zero/muon/owner_plan.py",
        "tests/unit/runtime/zero/test_muon_owner_plan.py",
        "tests/unit/runtime/zero/test_muon_newton_schulz.py",
        "tests/unit/runtime/zero/newton_schulz_testing.py",
    ),
    notes={},
    template="pr_muon_plan.md",
    code_needs=("muon-update-seam", ),
)

CORE = Group(
    "muon-pipeline", 3, "Muon: the owner exchange and its per-bucket pipeline, Newton-Schulz once per matrix",
    patterns=(
        "deepspeed/runtime/zero/muon/owner_exchange.py",
        "deepspeed/runtime/zero/muon/pipeline.py",
        "deepspeed/runtime/zero/muon/owner_state.py",
        "tests/unit/runtime/zero/test_muon_pipeline.py",
        "tests/unit/runtime/zero/test_muon_owner_state.py",
    ),
    notes={},
    template="pr_muon_core.md",
    code_needs=("muon-owner-plan", ),
)

MUON = Group(
    "zero3-muon", 4, "ZeRO-3 Muon: momentum and Newton-Schulz once per step at the accumulation boundary",
    patterns=(
        "deepspeed/runtime/zero/muon/zero3_update.py",
        "patches/*/0001-*.patch",
        "tests/unit/runtime/zero/test_zero3_muon_*.py",
        "tests/unit/runtime/zero/zero3_muon_*.py",
    ),
    notes={
        STAGE3: {
            "*":
            "creates `Zero3MuonUpdate` (with its configuration check) in `__init__` and calls it in `step()` "
            "right after unscale-and-clip; allocates the Muon momentum in fp32; deletes the refusals of "
            "`reduce_scatter`, of Muon groups with different momenta and of Muon with the all-to-all "
            "(quantized-gradient) reduction, which is now refused only where the accelerator lacks the "
            "quantizer op.",
            "0.19.7":
            " Deletes upstream's Muon path that this replaces: the per-bucket, per-micro-step "
            "`_apply_distributed_muon_update` call in the gradient reduce path and the method with the "
            "all-gather helper only it used. Under optimizer offload, Muon sub-groups are always stepped by "
            "the Muon optimizer (as in 0.19.8).",
            "0.19.8":
            " Deletes upstream's Muon path that this replaces: `_apply_muon_to_accumulated_grads` before the "
            "norm with the methods only it used (`_muon_update_sub_group`, `_apply_muon_updates_cpu_offload`, "
            "the all-gather buffer cache), the loss-scale re-multiplication of Muon updates and its norm "
            "correction in `_get_norm_groups`, and `muon_beta` / `muon_ns_method` (each parameter group's "
            "own `momentum` and `ns_method` are used).",
        },
    },
    template="pr_muon.md",
    tests_need=("muon-owner-plan", ),
    code_needs=("muon-update-seam", "muon-owner-plan", "muon-pipeline"),
)

GRAD_WINDOW = Group(
    "grad-window", 5, "ZeRO-3: a parameter without gradient in part of an accumulation window",
    patterns=(
        "patches/*/0002-*.patch",
        "tests/unit/runtime/zero/test_zero3_grad_partition_window.py",
    ),
    notes={
        STAGE3:
        "`partition_grads` copies a parameter's first gradient of an accumulation window into its "
        "partition whichever micro-step it arrives in (it copied on micro-step 0 only and added "
        "otherwise); the new `_complete_window_gradients`, called first in `_pre_step`, zeroes the "
        "gradient partition of every trainable parameter that got no gradient in the window and, under "
        "optimizer offload, copies the window's sum of a parameter used before the boundary micro-step "
        "but not in it to the fp32 gradient (with its norm).",
    },
    template="pr_grad_window.md",
)

LOSS_SCALE = Group(
    "loss-scale", 6, "ZeRO-3: unscale by the loss scale of the step's backward",
    patterns=(
        "patches/*/0003-*.patch",
        "tests/unit/runtime/zero/test_zero3_backward_loss_scale.py",
    ),
    notes={
        STAGE3:
        "`step()` keeps the loss scale of the step's backward passes before the dynamic loss scaler "
        "updates it, and unscales the gradients and the stashed global norm by it; "
        "`unscale_and_clip_grads` takes it as an optional argument (default: the current scale, as before).",
    },
    template="pr_loss_scale.md",
)

UNIVERSAL = Group(
    "universal-checkpoint", 7, "ZeRO-3 universal checkpoints: every optimizer state, loaded per sub-group at any "
    "world size",
    patterns=(
        "deepspeed/checkpoint/zero3_universal.py",
        "patches/*/0006-*.patch",
        "patches/*/0007-*.patch",
        "patches/*/0008-*.patch",
        "patches/*/0009-*.patch",
        "tests/unit/checkpoint/test_zero3_universal*.py",
        "tests/unit/checkpoint/zero3_universal_helpers.py",
    ),
    notes={
        "deepspeed/checkpoint/ds_to_universal.py":
        "the ZeRO-3 extractor keeps every optimizer state of a sub-group (`zero3_sub_group_states`: Adam's "
        "`exp_avg`/`exp_avg_sq`, a `momentum_buffer`, `step`) instead of reading `exp_avg` and `exp_avg_sq` "
        "by name (a `KeyError` for any other optimizer's state); the ZeRO-3 merge writes each of a parameter's "
        "states in its logical shape (`merge_zero3_param_states`).",
        STAGE3:
        "the universal-checkpoint loader (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`) restores, per "
        "sub-group, the fp32 partition and each state the checkpoint holds for its parameters, the step where the "
        "state has one, and each parameter group's settings from its own group (`restore_zero3_optimizer_state`); "
        "it used to read `step` of sub-group 0 and `exp_avg`/`exp_avg_sq` of every parameter, and apply group 0's "
        "settings to every group. `load_hp_checkpoint_state` refuses a state whose element count or shape does "
        "not fit its parameter, naming the parameter's folder (`check_loaded_state`).",
        "deepspeed/runtime/engine.py":
        "loading a regular ZeRO checkpoint at another data-parallel world size raises "
        "`zero3_universal.resize_error`: the engine's error with both world sizes, plus the `ds_to_universal` "
        "command for this checkpoint and `\"checkpoint\": {\"load_universal\": true}`; under ZeRO-3 also on the "
        "ranks the saving run did not have (they failed on an empty file list in the state-dict loader). A "
        "universal checkpoint converted from ZeRO-3 loads at ZeRO-1/2: the engine reads its per-rank model states "
        "(`zero_pp_rank_*`) where there is no `mp_rank_*` file (`zero3_universal.model_states_files`).",
        "deepspeed/runtime/zero/stage_1_and_2.py":
        "`_load_global_state` accepts the `optimizer_state.pt` of a ZeRO-3 source, which has no `ds_version` "
        "(`zero3_universal.checkpoint_version`).",
    },
    template="pr_universal_checkpoint.md",
    tests_need=("zero3-muon", ),
    texts_if={
        "engine_problem": (("patches/*/0008-*.patch",
                            "\n- A regular checkpoint loaded at another data-parallel world size is refused with a "
                            "bare world-size mismatch that does not say a universal checkpoint is the way to load "
                            "it there."),),
        "engine_fix": (("patches/*/0008-*.patch",
                        "\n- A regular (not universal) checkpoint loaded at another data-parallel world size fails "
                        "with a message that names `ds_to_universal` and `\"checkpoint\": {\"load_universal\": true}`, "
                        "the way to load it there."),),
        "zero12_problem": (("patches/*/0009-*.patch",
                            "\n- A universal checkpoint converted from ZeRO-3 does not load at ZeRO-1/2: the engine "
                            "looks for `mp_rank_*_model_states.pt` (a ZeRO-3 run writes `zero_pp_rank_*`) and fails "
                            "with a bare `AssertionError`, and `_load_global_state` asserts on the `ds_version` its "
                            "`optimizer_state.pt` does not have."),),
        "zero12_fix": (("patches/*/0009-*.patch",
                        "\n- ZeRO-1/2: a universal checkpoint converted from ZeRO-3 loads; the engine reads data-"
                        "parallel rank 0's model states, and the ZeRO-3 source's missing `ds_version` is taken as "
                        "the installed version (its check guards against pre-0.3.17 stage-1 checkpoints)."),),
    },
)

UNIVERSAL_MUON = Group(
    "universal-muon", 8, "Universal checkpoints of Muon runs: the Muon state checked, the ZeRO-1/2 momentum restored",
    patterns=(
        "deepspeed/runtime/zero/muon/universal_state_checks.py",
        "deepspeed/runtime/zero/muon/zero12_universal_momentum.py",
        "patches/*/0013-*.patch",
        "tests/unit/checkpoint/test_universal_checkpoint_muon*.py",
    ),
    notes={
        STAGE3:
        "with Muon, the universal-checkpoint loader first checks the checkpoint's parameter groups and each "
        "parameter's states against the run (`universal_state_checks.check_zero3_universal_state`): a Muon "
        "matrix without `momentum_buffer`, an Adam parameter with one, or groups whose `use_muon` differ are "
        "refused naming the parameter or group, before anything is loaded.",
        "deepspeed/runtime/zero/stage_1_and_2.py":
        "the ZeRO-1/2 universal-checkpoint loader runs the same checks before loading and afterwards rebuilds "
        "each Muon matrix's momentum in the layout ZeRO-1/2 keeps it "
        "(`zero12_universal_momentum.check_before_load`, `restore_momentum`).",
        "deepspeed/runtime/bf16_optimizer.py":
        "the BF16 optimizer's universal-checkpoint loader runs the same checks and momentum restore as ZeRO-1/2.",
        "deepspeed/checkpoint/ds_to_universal.py":
        "the ZeRO-1/2 converter refuses a checkpoint whose parameter groups hold Muon's state "
        "(`universal_state_checks.check_zero12_convertible`), naming the checkpoint, rank and state: ZeRO-1/2 keep "
        "it in another layout than the fp32 partition's the converter cuts, and upstream stops with "
        "`KeyError: 'exp_avg'`.",
    },
    template="pr_universal_muon.md",
    tests_need=("zero3-muon", "universal-checkpoint"),
    code_needs=("muon-owner-plan", "muon-pipeline", "universal-checkpoint"),
)

SELECTION = Group(
    "muon-selection", 9, "Muon: embeddings and tied heads on Adam, client Muon optimizers, the selection reported",
    patterns=(
        "deepspeed/runtime/zero/muon/param_selection.py",
        "patches/*/0010-*.patch",
        "patches/*/0011-*.patch",
        "tests/unit/runtime/zero/test_muon_param_selection.py",
    ),
    notes={
        "deepspeed/__init__.py":
        "`set_optimizer_flags` tags each parameter's `use_muon` with `param_selection.select_muon_parameters`: "
        "matrices go to Muon except those owned by an `nn.Embedding` (or the same tensor as one: tied output "
        "heads) and names with `embed` / `lm_head` (the previous rule, kept); a `use_muon` the user set before "
        "`deepspeed.initialize` is kept.",
        "deepspeed/runtime/engine.py":
        "`_configure_optimizer` calls `param_selection.resolve_optimizer_selection` before ZeRO wraps the "
        "optimizer: a client `MuonWithAuxAdam` has its tensors tagged from its groups' `use_muon`; another "
        "client Muon optimizer is refused at ZeRO stage >= 1 (it cannot run on flat partitions); with "
        "DeepSpeed's Muon, rank 0 reports what went to Muon and to Adam at WARNING, kept as "
        "`engine.muon_selection`.",
    },
    template="pr_selection.md",
    tests_need=("zero3-muon", ),
)

ZERO12_CLIPPING = Group(
    "zero12-muon-clipping", 10, "ZeRO-1/2 Muon: clip the raw gradient before the momentum, as ZeRO-3 and PyTorch do",
    patterns=(
        "deepspeed/runtime/zero/muon/zero12_update.py",
        "patches/*/0012-*.patch",
        "tests/unit/runtime/zero/test_zero12_muon_*.py",
    ),
    notes={
        "deepspeed/runtime/zero/stage_1_and_2.py":
        "creates `Zero12MuonUpdate` in `__init__` (`None` unless the optimizer is Muon); at the accumulation "
        "boundary `get_flat_partition` hands each Muon group's accumulated gradients to it instead of running "
        "`muon_update`, so the partition, the global norm and `get_global_grad_norm()` hold the raw gradient; "
        "`step()` calls `update_group` right after `unscale_and_clip_grads`, which replaces the partition's Muon "
        "slices by the update of the clipped gradient (with `offload_optimizer` through the distributed core); upstream's Muon path there (the update in the reduction "
        "and, with offload, before the norm, with its all-gather helpers and momentum staging) is deleted.",
    },
    template="pr_zero12_clipping.md",
    tests_need=("zero3-muon", ),
    code_needs=("muon-update-seam", "muon-owner-plan", "muon-pipeline"),
)

MUON_CONFIG = Group(
    "muon-config", 11, "Muon: its two learning rates under DeepSpeed's schedulers, the rates logged by group, "
    "every key of its block checked",
    patterns=(
        "deepspeed/runtime/zero/muon/lr_groups.py",
        "deepspeed/runtime/zero/muon/config_keys.py",
        "patches/*/0014-*.patch",
        "patches/*/0015-*.patch",
        "patches/*/0016-*.patch",
        "tests/unit/runtime/zero/test_muon_lr_groups.py",
        "tests/unit/runtime/zero/test_muon_config_keys.py",
    ),
    notes={
        "deepspeed/runtime/engine.py":
        "`_scheduler_from_config` resolves a DeepSpeed scheduler's rate keys per parameter group for an optimizer "
        "with Muon groups (`lr_groups.scheduler_params_for_groups`): an unset rate follows each group's configured "
        "rate, a per-group list is used as given, a scalar that would overwrite differing rates is refused naming "
        "the key and the groups; `_report_progress` logs each rate with its group's name (`lr_groups.rates_by_group`); "
        "the Muon branch of `_configure_basic_optimizer` refuses keys of the Muon block and of its parameter groups "
        "that it would drop (`config_keys.check_muon_keys`).",
    },
    template="pr_muon_config.md",
    tests_need=("zero3-muon", ),
    code_needs=("muon-update-seam", ),
)

MUON_VARIANTS = Group(
    "muon-variants", 12, "Muon variants: Polar Express as an ns_method, and NorMuon with its per-row state on the "
    "owner rank",
    patterns=(
        "deepspeed/runtime/zero/muon/polar_express.py",
        "deepspeed/runtime/zero/muon/normuon.py",
        "patches/*/0017-*.patch",
        "patches/*/0018-*.patch",
        "tests/unit/runtime/zero/test_muon_polar_express.py",
        "tests/unit/runtime/zero/test_muon_normuon.py",
        "tests/unit/runtime/zero/test_zero3_polar_express.py",
        "tests/unit/runtime/zero/test_zero3_normuon*.py",
    ),
    notes={
        "deepspeed/runtime/zero/muon/original_muon.py": {
            "*":
            "\"polar_express\" joins `NS_METHODS`; the Newton-Schulz dispatch of `muon_update` (of "
            "`muon_orthogonalize` once the muon-update-seam pull request has split it out) runs "
            "`polar_express.zeropower_via_polar_express` for it (the aspect-ratio scale stays upstream's).",
            "0.19.8": " So does `_per_head_orthogonalize`'s.",
        },
        "deepspeed/runtime/engine.py":
        "the Muon half of a parameter group keeps `variant`, `normuon_beta2` and `normuon_eps`; the Muon branch of "
        "`_configure_basic_optimizer` checks them (`owner_state.check_variant_config`: values, defaults, and a "
        "refusal where no owner rank runs).",
        "deepspeed/runtime/zero/muon/__init__.py":
        "imports `normuon`, which registers NorMuon with the owner-state extension point "
        "(`owner_state.register_variant`), so `variant: \"normuon\"` resolves wherever Muon runs.",
        STAGE3:
        "`state_dict()` first puts a variant's owner state into the optimizer state, per parameter "
        "(`Zero3MuonUpdate.export_owner_state`).",
    },
    template="pr_muon_variants.md",
    tests_need=("muon-owner-plan", "muon-pipeline", "universal-checkpoint", "zero3-muon"),
    code_needs=("muon-update-seam", "muon-pipeline"),
)

ALLGATHER_BACKPORT = Group(
    "allgather-wait-backport", 13, "ZeRO-3: wait on every handle of a coalesced parameter all-gather (backport)",
    patterns=(
        "patches/*/0005-*.patch",
        "tests/unit/runtime/zero/test_zero3_allgather_coalesced_wait.py",
    ),
    notes={
        "deepspeed/runtime/zero/partition_parameters.py":
        "the handle of a coalesced parameter all-gather waits on every collective it launched, not only "
        "the last (backport of DeepSpeed 0.19.8's fix; with gloo the handles complete independently).",
    },
    pull_request=False,
    why="DeepSpeed 0.19.7 waits only on the last handle of a coalesced parameter all-gather; with gloo the "
    "handles complete independently, so the gathered parameters could be read before they all arrived. "
    "DeepSpeed 0.19.8 already waits on every handle: this backports that fix, so that this project's "
    "0.19.7 build gathers parameters correctly on gloo; it is not proposed upstream.",
)

GROUPS = (SEAM, PLAN, CORE, MUON, GRAD_WINDOW, LOSS_SCALE, UNIVERSAL, UNIVERSAL_MUON, SELECTION, ZERO12_CLIPPING,
          MUON_CONFIG, MUON_VARIANTS, ALLGATHER_BACKPORT)


class ExportError(zb.BuildError):
    """The export could not be made; the message says why."""


class Piece:
    """One exported diff: the tree change of ``group`` (``None``: the combined diff)."""

    def __init__(self, group, sources, diff, name_status, diffstat, diff_path=None, text_path=None):
        self.group, self.sources = group, sources
        self.diff, self.name_status, self.diffstat = diff, name_status, diffstat
        self.diff_path, self.text_path = diff_path, text_path

    @property
    def paths(self):
        return [path for _, path in self.name_status]

    @property
    def stem(self):
        return self.group.stem if self.group else "combined"


class Export:
    """What ``export`` wrote: the pull requests in order, then the combined diff."""

    def __init__(self, base, out_dir, pull_requests, combined, backports):
        self.base, self.out_dir = base, out_dir
        self.pull_requests, self.combined, self.backports = pull_requests, combined, backports

    @property
    def pieces(self):
        return [*self.pull_requests, self.combined]


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
    out += [p.relative_to(repo_root).as_posix() for p in zb.list_patches(base, repo_root)]
    return out


def assign(base, repo_root=zb.REPO_ROOT, groups=GROUPS, never=NEVER_EXPORTED, strict=True):
    """{group key: [repository paths]} for ``base``; groups without a file on ``base`` are left out,
    and so are backports without a patch on ``base`` (with their tests).

    A path matching a ``never`` pattern is left out whatever the groups say. Raises ``ExportError``
    for any other file that no group claims, or that more than one claims, and for a pull request
    without a test or without a change to DeepSpeed. With ``strict=False`` (``dev.py intree``, which
    needs the tests only) it raises nothing: an unclaimed file is left out, a file claimed more than
    once goes to its first group."""
    owners, unclaimed, ambiguous = {g.key: [] for g in groups}, [], []
    for path in candidate_files(base, repo_root):
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in never):
            continue  # an exclusion wins over a group's pattern
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
    for g in groups:
        files = owners[g.key]
        if not g.pull_request or not files:
            continue
        if not any(p.startswith("tests/") for p in files):
            problems.append(f"pull request {g.stem!r} has no test under tests/")
        if not any(p.startswith(("deepspeed/", "patches/")) for p in files):
            problems.append(f"pull request {g.stem!r} changes nothing in DeepSpeed (no new module, no patch)")
    for g in groups:
        if not g.pull_request or not owners[g.key]:
            continue
        needed = imported_groups(g, owners, repo_root)
        if set(needed) != set(g.tests_need):
            problems.append(f"the tests of pull request {g.stem!r} import files of {sorted(needed) or 'no other group'} "
                            f"but its tests_need says {sorted(g.tests_need) or 'none'}: "
                            + (", ".join(f"{path} imports {dep}" for key in sorted(needed) for path, dep in needed[key])
                               or "no import of another group's test file"))
        code_needed = code_imported_groups(g, owners, repo_root)
        if set(code_needed) != set(g.code_needs):
            problems.append(f"the modules of pull request {g.stem!r} import modules of "
                            f"{sorted(code_needed) or 'no other group'} but its code_needs says "
                            f"{sorted(g.code_needs) or 'none'}: "
                            + (", ".join(f"{path} imports {dep}" for key in sorted(code_needed)
                                         for path, dep in code_needed[key]) or "no import of another group's module"))
    if problems:
        raise ExportError(f"export of base {base}: " + "; ".join(problems))
    return result


def _unit_imports(path):
    """Repository paths (``tests/unit/...py``) of the modules that the test file ``path`` imports
    as ``unit.<...>`` (DeepSpeed's tests import each other that way, from ``tests/``)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
    return ["tests/" + m.replace(".", "/") + ".py" for m in modules if m.startswith("unit.")]


def _deepspeed_imports(path):
    """Repository paths (``deepspeed/...py``) of the modules that the module ``path`` imports as
    ``deepspeed.<...>`` (the module itself; a package's ``__init__.py`` is not resolved)."""
    try:
        return _deepspeed_imports_in(Path(path).read_text())
    except (UnicodeDecodeError, ValueError):
        return []


def _patch_deepspeed_imports(patch):
    """The same for the import statements a patch adds (its ``+`` lines that are a whole ``import``
    or ``from ... import`` statement, e.g. an import inside a method of the upstream file)."""
    out = []
    for line in Path(patch).read_text().splitlines():
        code = line[1:].strip()
        if line.startswith("+") and not line.startswith("+++") and code.startswith(("import ", "from ")):
            out += _deepspeed_imports_in(code)
    return out


def _deepspeed_imports_in(source):
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
            modules += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
    return [m.replace(".", "/") + ".py" for m in modules if m.startswith("deepspeed.")]


def code_imported_groups(group, owners, repo_root):
    """{other group key: [(module or patch of ``group``, imported module of that group)]}: the other
    groups whose new modules ``group``'s new modules import or its patches add an import of (an
    upstream method importing a new module of another group), and those whose patches add to an
    upstream module they import (``original_muon.py``'s new functions, e.g.); a module patched by
    several groups counts as the first one's in ``owners`` (``assign`` keeps the groups' order: the
    lowest-numbered)."""
    owner_of = {path: key for key, paths in owners.items() for path in paths}
    patched_by = {}
    for key, paths in owners.items():
        for path in paths:
            if path.startswith("patches/"):
                for target in _patched_files(Path(repo_root) / path):
                    patched_by.setdefault(target, set()).add(key)
    order = {key: i for i, key in enumerate(owners)}
    for target, keys in patched_by.items():
        # Patched by several groups: the later ones patch on top of the first, whose additions
        # (new functions) are what an importer needs.
        owner_of.setdefault(target, min(keys, key=order.__getitem__))
    needed = {}
    for path in owners.get(group.key, []):
        if path.startswith("deepspeed/") and path.endswith(".py"):
            deps = _deepspeed_imports(Path(repo_root) / path)
        elif path.startswith("patches/"):
            deps = _patch_deepspeed_imports(Path(repo_root) / path)
        else:
            continue
        for dep in deps:
            key = owner_of.get(dep)
            if key is not None and key != group.key:
                needed.setdefault(key, []).append((path, dep))
    return needed


def _patched_files(patch):
    """Repository paths of the upstream files a patch modifies (its ``diff --git`` lines)."""
    return [m.group(1) for m in re.finditer(r"^diff --git a/(\S+) b/", Path(patch).read_text(), re.M)]


def imported_groups(group, owners, repo_root):
    """{other group key: [(test file of ``group``, imported file of that group)]}: the other groups
    whose test files ``group``'s tests import. ``owners``: ``assign``'s {group key: paths}."""
    owner_of = {path: key for key, paths in owners.items() for path in paths}
    needed = {}
    for path in owners.get(group.key, []):
        if not path.startswith("tests/"):
            continue
        for dep in _unit_imports(Path(repo_root) / path):
            key = owner_of.get(dep)
            if key is not None and key != group.key:
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
    clashes = [p for p in paths if (tree / p).exists()]
    if clashes:
        raise ExportError("these files of ours already exist in the upstream tree: " + ", ".join(clashes) +
                          ". Changes to upstream files must be patches under patches/<base>/.")
    for rel in paths:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(repo_root) / rel, tree / rel)


def _diff(tree, pristine, changed):
    opts = ["--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", pristine, changed]
    diff = _git(tree, "diff", "--binary", *opts, raw=True)
    name_status = [line.split("\t", 1) for line in _git(tree, "diff", "--name-status", *opts).splitlines()]
    diffstat = _git(tree, "diff", "--stat=100", *opts)
    labels = {"build.txt", zb.BUILD_INFO_REL.as_posix()}
    leaked = [path for _, path in name_status if path in labels or "__pycache__" in path or path.endswith(".pyc")]
    if leaked:  # cannot happen through apply_changes; guards a future change of it
        raise ExportError(f"the diff would contain build artifacts: {', '.join(leaked)}")
    return diff, name_status, diffstat


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
        if g.key not in owners:
            continue
        files = owners[g.key]
        patches = [repo_root / p for p in files if p.startswith("patches/")]
        _restore(tree, pristine)
        _copy_new_files(tree, repo_root, [p for p in files if not p.startswith("patches/")])
        try:
            zb.apply_patches(tree, patches)
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
    added = [p.relative_to(tree).as_posix() for p in (tree / "deepspeed").rglob("*") if p.is_file()]
    unexported = sorted(p for p in added if any(fnmatch.fnmatchcase(p, pattern) for pattern in never))
    if unexported:  # a never-exported file under deepspeed/ that is not PROJECT_ONLY
        raise ExportError(f"never-exported files under deepspeed/ would be in the combined diff: {unexported}")
    _copy_new_files(tree, repo_root, [p for p in exported if p.startswith("tests/")])
    combined = Piece(None, exported, *_diff(tree, pristine, _snapshot(tree)))
    if not combined.diff:
        raise ExportError(f"no difference to deepspeed-{base}: nothing to export")

    union = {p for piece in pieces.values() for p in piece.paths}
    if union != set(combined.paths):
        raise ExportError("the pull requests and backports together do not change the files the combined diff "
                          f"changes: only in theirs {sorted(union - set(combined.paths))}, only in the combined "
                          f"{sorted(set(combined.paths) - union)}")
    prs = [pieces[g.key] for g in groups if g.key in pieces and g.pull_request]
    backports = [pieces[g.key] for g in groups if g.key in pieces and not g.pull_request]
    return prs, combined, backports


# --------------------------------------------------------------------------- descriptions


def _docstring_summary(path):
    try:
        doc = ast.get_docstring(ast.parse(Path(path).read_text()))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    if not doc:
        return None
    return " ".join(doc.split("\n\n", 1)[0].split())


def note_text(note, base):
    """A group's note: a string, or {"*": text for every base, base: text appended on that base}."""
    if isinstance(note, str):
        return note
    return note.get("*", "") + note.get(base, "")


def file_note(path, groups, base):
    """The hand-written line for an upstream file modified by ``groups``; ``ExportError`` if one lacks it."""
    missing = [g.key for g in groups if path not in g.notes]
    if missing:
        raise ExportError(f"{path} is modified by {', '.join(missing)} but has no line in that group's notes "
                          "(build_backend/zero3muon_export.py): say what the change does to it")
    if len(groups) == 1:
        return note_text(groups[0].notes[path], base)
    return " ".join(f"*{g.title}*: {note_text(g.notes[path], base)}" for g in groups)


def describe_files(piece, repo_root, groups_of, base):
    """Markdown list, one line per changed file; ``groups_of(path)``: the groups modifying ``path``."""
    lines = []
    for status, path in piece.name_status:
        if status == "A":
            what = _docstring_summary(Path(repo_root) / path) or "new file"
            lines.append(f"- `{path}` (new): {what}")
        else:
            lines.append(f"- `{path}`: {file_note(path, groups_of(path), base)}")
    return "\n".join(lines)


def _named(groups):
    names = [f"{g.number} ({g.key})" for g in groups]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def relations(group, prs):
    """How pull request ``group`` relates to the other pull requests ``prs`` (Pieces), in words:
    which are independent of it, which it needs for its tests, which need it for theirs."""
    others = [p.group for p in prs if p.group is not group]
    needs = [g for g in others if g.key in group.tests_need]
    code_needs = [g for g in others if g.key in group.code_needs]
    code_needed_by = [g for g in others if group.key in g.code_needs]
    needed_by = [g for g in others if group.key in g.tests_need and g not in code_needed_by]
    independent = [g for g in others if g not in needs + code_needs + needed_by + code_needed_by]
    out = []
    if independent:
        verb = "is" if len(independent) == 1 else "are"
        out.append(f"Pull request{'s' if len(independent) > 1 else ''} {_named(independent)} of this export "
                   f"{verb} independent of this one.")
    tests_only = [g for g in needs if g not in code_needs]

    def named(groups):  # ("pull request 1 (a)", "that one") or ("pull requests 1 (a) and 2 (b)", "those")
        many = len(groups) > 1
        return f"pull request{'s' if many else ''} {_named(groups)}", "those" if many else "that one"

    if code_needs:
        (what, them), many = named(code_needs), len(code_needs) > 1
        helpers = ""
        if all(g in needs for g in code_needs):
            helpers = " and its tests their test helpers" if many else " and its tests that one's test helpers"
        out.append(f"Its code imports modules of {what}{helpers}: it is stacked on {them} and goes in after "
                   f"{'them' if many else 'it'}.")
        if tests_only:
            what, them = named(tests_only)
            out.append(f"Its tests also import test helpers of {what} and run with {them} applied too.")
    elif needs:
        what, them = named(needs)
        out.append(f"Its code and patches apply alone and use nothing of the other pull requests, but its tests "
                   f"import test helpers of {what}: it is stacked on {them} for its tests, which run with "
                   f"{'all' if len(needs) > 1 else 'both'} applied.")
    if needed_by:
        many = len(needed_by) > 1
        out.append(f"Pull request{'s' if many else ''} {_named(needed_by)} appl{'y' if many else 'ies'} without this "
                   f"one, but {'their' if many else 'its'} tests import this one's test helpers (stacked on this one "
                   f"for {'their' if many else 'its'} tests).")
    if code_needed_by:
        many = len(code_needed_by) > 1
        out.append(f"Pull request{'s' if many else ''} {_named(code_needed_by)} import{'' if many else 's'} this "
                   f"one's modules (stacked on this one).")
    return " ".join(out)


def diff_header(piece, base, cfg, sdist, sha256, backports=(), prs=()):
    """Lines before the first ``diff --git``: git apply and patch skip them."""
    summary = piece.diffstat.rstrip("\n").splitlines()[-1].strip()
    if piece.group:
        what = (f"Pull request {piece.group.number}, \"{piece.group.title}\" (zero3muon {cfg['version']}), "
                f"for DeepSpeed {base}: {summary}.\n"
                f"It applies on its own. {relations(piece.group, prs)}").rstrip()
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
    prs, combined, backports = everything
    modifying = {}
    for other in [*prs, *backports]:
        for status, path in other.name_status:
            if status != "A":
                modifying.setdefault(path, []).append(other.group)
    values = dict(
        base=base,
        patch_version=cfg["version"],
        sdist_name=Path(sdist).name,
        sha256=sha256,
        diff_name=f"{piece.stem}.diff",
        patch_names=_patch_names(piece),
        diffstat=piece.diffstat.rstrip("\n"),
        per_head="`per_head_muon`, " if base != "0.19.7" else "",
        tests=", ".join(f"`{p}`" for p in piece.sources if Path(p).name.startswith("test_")) or "none",
    )
    if piece.group:
        values["relations"] = relations(piece.group, prs)
        values.update(piece.group.optional_texts(piece.sources))
        values["files"] = describe_files(piece, repo_root, lambda path: [piece.group], base)
        template = TEMPLATE_DIR / piece.group.template
    else:
        values["files"] = describe_files(piece, repo_root, lambda path: modifying[path], base)
        values["pull_requests"] = "\n".join(
            f"{pr.group.number}. **{pr.group.title}**: `{pr.stem}.diff`, described in `{pr.stem}.md` "
            f"(patches {_patch_names(pr)})." + "".join(
                (f" Its code imports modules of pull request {_named([g])}: stacked on that one."
                 if g.key in pr.group.code_needs else
                 f" Its tests import test helpers of pull request {_named([g])}: stacked on that one for its tests.")
                for g in (other.group for other in prs)
                if g.key in pr.group.tests_need or g.key in pr.group.code_needs) for pr in prs)
        values["backports"] = "".join(
            f"\n\nAlso in this diff and in no pull request: **{bp.group.title}** (patch {_patch_names(bp)}, test "
            + ", ".join(f"`{p}`" for p in bp.sources if p.startswith("tests/")) +
            f"). {bp.group.why}" for bp in backports)
        template = TEMPLATE_DIR / "combined.md"
    return Template(template.read_text()).substitute(values)


# --------------------------------------------------------------------------- export


def _stale_outputs(out_dir, written):
    """Files of an earlier export in ``out_dir`` that this export did not write (e.g. of a
    pull request since renamed, or of the single-diff layout before the split)."""
    names = ("[0-9]-*.diff", "[0-9]-*.md", "[0-9][0-9]-*.diff", "[0-9][0-9]-*.md", "combined.diff", "combined.md",
             "zero3muon-deepspeed-*.diff", "PR_DESCRIPTION.md")
    return [p for name in names for p in out_dir.glob(name) if p not in written]


def export(base=None, out_dir=None, repo_root=zb.REPO_ROOT, sdist=None, groups=GROUPS, never=NEVER_EXPORTED):
    """Write ``<n>-<key>.diff`` and ``.md`` for each pull request and ``combined.diff`` and
    ``.md`` for ``base`` into ``out_dir`` (default ``repo_root/out/export/<base>``); return an ``Export``."""
    repo_root = Path(repo_root)
    cfg = zb.load_config(repo_root)
    base = zb.select_base(cfg, base)
    sha256 = cfg["sdist-sha256"][base]
    sdist = Path(sdist) if sdist else zb.obtain_sdist(base, sha256)
    out_dir = Path(out_dir) if out_dir else repo_root / "out" / "export" / base
    with tempfile.TemporaryDirectory(prefix="zero3muon-export-") as tmp:
        everything = make_pieces(sdist, sha256, base, tmp, repo_root, groups, never)
    prs, combined, backports = everything
    texts = {}
    for piece in [*prs, combined]:
        texts[piece.stem] = describe(piece, base, cfg, sdist, sha256, repo_root, everything)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for piece in [*prs, combined]:
        piece.diff_path, piece.text_path = out_dir / f"{piece.stem}.diff", out_dir / f"{piece.stem}.md"
        piece.diff_path.write_bytes(diff_header(piece, base, cfg, sdist, sha256, backports, prs).encode() + piece.diff)
        piece.text_path.write_text(texts[piece.stem])
        written += [piece.diff_path, piece.text_path]
    for stale in _stale_outputs(out_dir, written):
        stale.unlink()
    return Export(base, out_dir, prs, combined, backports)
