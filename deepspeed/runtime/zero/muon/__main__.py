# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon``: one line saying whether this DeepSpeed has the ZeRO-3 Muon patch.

On the patched build, for example::

    deepspeed 0.19.8+zero3muon: upstream 0.19.8, zero3muon 0.1.0, ZeRO-3 Muon update: owner-centric at the
    accumulation boundary (patches 0001-zero3-muon-boundary-update, 0002-zero3-grad-partition-first-use-in-window,
    0003-zero3-unscale-by-backward-loss-scale, 0004-muon-update-split)

(one line), exit status 0. The versions come from ``_build_info.py``, which the build backend
(``build_backend/zero3muon_build.py``) writes into this package, and the check that the installed
files really carry every patch of the base reads them (``stage3.py``; on 0.19.7 also
``partition_parameters.py``). Anything else (a stock DeepSpeed, a build whose files lack a patch,
a version that does not match the build info) is reported on the same one line, with exit status 1. (Importing DeepSpeed may log a line of its own
before it, e.g. the accelerator auto-detection warning when ``DS_ACCELERATOR`` is not set.)
"""

import sys
from pathlib import Path

LOCAL_LABEL = "+zero3muon"

# Something each patch adds, to check that the installed files are the patched ones:
# (patch number, file under the deepspeed package, text the patch adds, bases it exists for or None for all).
PATCH_MARKERS = (
    ("0001", "runtime/zero/stage3.py", "Zero3MuonUpdate", None),  # the boundary update's call in step()
    ("0002", "runtime/zero/stage3.py", "_complete_window_gradients", None),  # first use in a window, window sums
    ("0003", "runtime/zero/stage3.py", "backward_loss_scale", None),  # unscale by the step's backward loss scale
    ("0004", "runtime/zero/muon/original_muon.py", "def muon_momentum_step_", None),  # muon_update split
    # 0.19.8's fix, backported: the coalesced parameter all-gather waits on every handle
    ("0005", "runtime/zero/partition_parameters.py", "for handle in launch_handles:", ("0.19.7", )),
    # universal checkpoints: every ZeRO-3 optimizer state converted, loaded per sub-group
    ("0006", "checkpoint/ds_to_universal.py", "zero3_sub_group_states", None),
    ("0007", "runtime/zero/stage3.py", "restore_zero3_optimizer_state", None),
    # a regular checkpoint at another world size: the error names the universal checkpoint
    ("0008", "runtime/engine.py", "import raise_if_saved_at_another_world_size", None),
    # a ZeRO-3 universal checkpoint loads at ZeRO-1/2 (its model-states files, no ds_version)
    ("0009", "runtime/zero/stage_1_and_2.py", "zero3_universal import checkpoint_version", None),
    # Muon's parameter selection: embeddings and tied heads on Adam, user flags kept
    ("0010", "__init__.py", "import select_muon_parameters", None),
    # a client Muon optimizer: tagged from its groups or refused on flat partitions; the selection report
    ("0011", "runtime/engine.py", "import resolve_optimizer_selection", None),
    # ZeRO-1/2 Muon runs in step(), after the norm and the clip of the raw gradient
    ("0012", "runtime/zero/stage_1_and_2.py", "Zero12MuonUpdate", None),
    # universal checkpoints of Muon runs: the Muon state checked (ZeRO-3), the momentum restored (ZeRO-1/2)
    ("0013", "runtime/zero/stage3.py", "check_zero3_universal_state", None),
    # Muon's two learning rates under DeepSpeed's schedulers, named in the progress log; keys checked
    ("0014", "runtime/engine.py", "import scheduler_params_for_groups", None),
    ("0015", "runtime/engine.py", "import momenta_by_group, rates_by_group", None),
    ("0016", "runtime/engine.py", "import check_muon_keys", None),
    # Polar Express as an ns_method of upstream's Muon (muon_orthogonalize's dispatch, NS_METHODS)
    ("0017", "runtime/zero/muon/original_muon.py", "import zeropower_via_polar_express", None),
    # Muon variants: NorMuon's keys reach the Muon groups (checked); its owner state saved per parameter
    ("0018", "runtime/engine.py", "import check_variant_config", None),
)
MODE = "owner-centric at the accumulation boundary"


def _patch_name(filename):
    return filename[:-len(".patch")] if filename.endswith(".patch") else filename


def report():
    """``(exit_status, line)`` describing the installed DeepSpeed."""
    import deepspeed
    version = deepspeed.__version__
    try:
        from deepspeed.runtime.zero.muon import _build_info as info
    except ImportError:
        return 1, (f"deepspeed {version}: not the zero3muon build (no deepspeed/runtime/zero/muon/_build_info.py); "
                   "ZeRO-3 Muon runs upstream's update. Install it with `pip install .` from the zero3muon "
                   "repository.")

    head = f"deepspeed {version}: upstream {info.BASE_VERSION}, zero3muon {info.PATCH_VERSION}"
    problems = []
    if version != f"{info.BASE_VERSION}{LOCAL_LABEL}":
        problems.append(f"the version is not {info.BASE_VERSION}{LOCAL_LABEL} "
                        "(another DeepSpeed installed over the build?)")
    package = Path(deepspeed.__file__).parent
    missing, sources = [], {}
    for num, rel, marker, bases in PATCH_MARKERS:
        if bases is not None and info.BASE_VERSION not in bases:
            continue
        if rel not in sources:
            path = package / rel
            sources[rel] = path.read_text(encoding="utf-8") if path.is_file() else ""
        if marker not in sources[rel]:
            missing.append(f"{num} ({package / rel})")
    if missing:
        problems.append(f"lacks patch(es) {', '.join(missing)}")
    if problems:
        return 1, f"{head}, ZeRO-3 Muon update: NOT the patched one: {'; '.join(problems)}"
    patches = ", ".join(_patch_name(p) for p in info.PATCHES)
    return 0, f"{head}, ZeRO-3 Muon update: {MODE} (patches {patches})"


def main():
    status, line = report()
    print(line, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
