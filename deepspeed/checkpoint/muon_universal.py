# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What a universal checkpoint must hold for a Muon run, checked before anything is loaded.

The universal loaders (``universal_states`` for ZeRO-3, DeepSpeed's own for ZeRO-1/2) restore whatever states a
parameter's folder holds, in the flat partition's layout, where every ZeRO stage keeps Muon's momentum and a variant's
state (``deepspeed.runtime.zero.muon.binding``). For ``MuonWithAuxAdam`` that is not enough: a Muon matrix
(``use_muon``) whose folder lacks ``momentum_buffer.pt`` would silently restart its momentum at zero, an Adam parameter
with one would drop it, and groups are told apart only by ``use_muon``, so groups pairing by count but not by kind
would hand Muon settings to Adam groups. ``check_zero3_universal_state`` (before the ZeRO-3 loader) and
``check_zero12_universal_state`` (before ``DeepSpeedZeroOptimizer``'s and ``BF16_Optimizer``'s) refuse such
checkpoints, naming the parameter or group; ``check_variant_state`` does the same for a Muon variant's owner state
(``owner_state``; NorMuon's ``normuon_second_moment.pt``).

``ds_to_universal`` calls ``check_zero12_convertible`` first for a ZeRO-1/2 checkpoint: one saved by stock DeepSpeed
or an older build of this patch keeps Muon's momentum as whole parameters, which the converter would cut wrong.
"""

import os
from typing import Iterable, List

import torch

from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS
from deepspeed.checkpoint.universal_states import FP32, STEP, check_groups_pair, state_files
from deepspeed.runtime.zero.muon.momentum import MOMENTUM_KEY, is_muon_group, is_muon_optimizer
from deepspeed.runtime.zero.muon.owner_state import VARIANT_KEY, state_keys, variant_of

OPTIMIZER_STATE_FILE = "optimizer_state.pt"
"""The universal checkpoint's global optimizer state, ``<checkpoint>/zero/optimizer_state.pt``."""


def check_muon_state(name: str, folder: str, states: Iterable[str], is_muon: bool, never_stepped: bool) -> None:
    """Refuse a parameter whose optimizer states do not belong to the optimizer that will run it.

    Args:
        name, folder: the parameter's name and its folder in the checkpoint.
        states: the state names its folder holds (``fp32``, ``momentum_buffer``, ``exp_avg``, ...).
        is_muon: the loading run optimizes it with Muon (``use_muon``).
        never_stepped: the checkpoint was saved before the first optimizer step (no momentum; a variant's state, if
            any, all zeros).

    Raises:
        ValueError: a Muon parameter without ``momentum_buffer`` once the optimizer has stepped (its momentum would
            restart at zero), or an Adam parameter with one (it would be dropped).
    """
    states = set(states)
    if is_muon and MOMENTUM_KEY not in states and not never_stepped:
        held = sorted(states - {FP32, STEP})
        raise ValueError(f"Universal checkpoint: Muon parameter '{name}' has no {MOMENTUM_KEY} in {folder} (it holds "
                         f"{held or 'no optimizer state'}). Loading would restart its momentum from zero; "
                         "refusing. Convert a checkpoint of the same Muon run with ds_to_universal, or set "
                         "use_muon the way the checkpoint was trained.")
    if not is_muon and MOMENTUM_KEY in states:
        raise ValueError(f"Universal checkpoint: parameter '{name}' holds Muon's {MOMENTUM_KEY} in {folder}, but "
                         "this run optimizes it with Adam (use_muon False). Set use_muon (and the optimizer) as "
                         "the checkpoint was trained; refusing to drop its momentum.")


def check_variant_state(name: str, folder: str, states: Iterable[str], param_group: dict) -> None:
    """Refuse a Muon parameter whose folder lacks its variant's state, or holds one its group does not use.

    ``name``, ``folder``, ``states`` as for ``check_muon_state``; ``param_group``: the run's group of the parameter.

    Raises:
        ValueError: a variant's parameter without its state (e.g. ``normuon_second_moment``: it would restart at
            zero), or a parameter with the state of a variant its group does not use (it would be dropped).
    """
    states = set(states)
    variant = variant_of(param_group) if is_muon_group(param_group) else None
    if variant is not None and variant.state_key not in states:
        raise ValueError(f"Universal checkpoint: Muon parameter '{name}' has no {variant.state_key} in {folder}, "
                         f"which its {VARIANT_KEY} '{variant.name}' needs (a checkpoint of a plain Muon run?). "
                         "Loading would restart it from zero; refusing.")
    for key in state_keys():
        if key in states and (variant is None or variant.state_key != key):
            raise ValueError(f"Universal checkpoint: parameter '{name}' holds a Muon variant's {key} in {folder}, "
                             f"but this run's group does not use that variant ({VARIANT_KEY} "
                             f"{param_group.get(VARIANT_KEY, 'muon')!r}); set the {VARIANT_KEY} the checkpoint was "
                             "trained with (refusing to drop the state).")


def check_muon_groups_pair(param_groups: List[dict], saved_groups: List[dict]) -> None:
    """Refuse a checkpoint whose parameter groups do not pair with the run's by index and kind.

    Besides the count (``check_groups_pair``), each group's ``use_muon`` must be the saved group's of the same index:
    the loaders copy the saved settings over, and a Muon group's (``momentum``, ``ns_method``) mean nothing to Adam.

    Raises:
        ValueError: a different number of groups, or a group whose ``use_muon`` differs.
    """
    check_groups_pair(param_groups, saved_groups)
    for index, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        ours, theirs = is_muon_group(group), is_muon_group(saved)
        if ours != theirs:
            raise ValueError(f"Universal checkpoint: optimizer parameter group {index} has use_muon={theirs} in "
                             f"the checkpoint and use_muon={ours} in this run; build the engine with the parameter "
                             "groups the checkpoint was trained with.")


def check_zero3_universal_state(optimizer, zero_dir: str, optim_sd: dict) -> None:
    """Refuse, before the ZeRO-3 universal loader reads anything, a checkpoint whose state does not fit this Muon run.

    ``optimizer`` is a ``DeepSpeedZeroOptimizer_Stage3`` with ``use_muon``; ``zero_dir`` the checkpoint's ``zero/``,
    ``optim_sd`` its ``optimizer_state.pt`` (of a ZeRO-3 or a ZeRO-1/2 source).

    Raises:
        ValueError: from ``check_muon_groups_pair``, ``check_muon_state`` or ``check_variant_state``. A parameter
            without a name in the model is left to the loader's own error.
    """
    check_muon_groups_pair(optimizer.optimizer.param_groups, optim_sd[PARAM_GROUPS])
    never_stepped = _never_stepped(
        zero_dir, [optimizer.param_names[p] for g in optimizer.fp16_groups for p in g if p in optimizer.param_names])
    for sub_group_id, params in enumerate(optimizer.fp16_groups):
        is_muon = bool(optimizer.sub_groups_using_muon[sub_group_id])
        for param in params:
            name = optimizer.param_names.get(param)
            if name is None:
                continue
            folder = os.path.join(zero_dir, name)
            files = state_files(folder)
            check_muon_state(name, folder, files, is_muon, never_stepped)
            check_variant_state(name, folder, files,
                                optimizer.optimizer.param_groups[optimizer.sub_group_to_group_id[sub_group_id]])


def _lp_groups(zero_optimizer):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    return zero_optimizer.bf16_groups if isinstance(zero_optimizer, BF16_Optimizer) else zero_optimizer.bit16_groups


def _never_stepped(zero_folder, names) -> bool:
    """Whether every parameter of ``names`` has only ``fp32.pt``, ``step.pt`` and a Muon variant's state still all
    zeros (every stage saves a variant's owner state from initialization on): saved before the first step."""
    for name in names:
        files = state_files(os.path.join(zero_folder, name))
        others = set(files) - {FP32, STEP}
        if others - set(state_keys()) or any(_nonzero(files[key]) for key in others):
            return False
    return True


def _nonzero(path: str) -> bool:
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return bool(torch.count_nonzero(saved[PARAM] if isinstance(saved, dict) else saved))


def check_zero12_universal_state(zero_optimizer, checkpoint_folder) -> None:
    """Refuse, before the ZeRO-1/2 universal loader reads anything, a checkpoint whose state does not fit this Muon
    run (nothing for another optimizer). ``zero_optimizer``: a ``DeepSpeedZeroOptimizer`` or ``BF16_Optimizer``.

    Raises:
        ValueError: from ``check_muon_groups_pair`` (the loader pairs groups by position), ``check_muon_state`` (a
            checkpoint saved before the first step has no momentum and loads as a fresh start) or
            ``check_variant_state`` (skipped for such a checkpoint).
    """
    base = zero_optimizer.optimizer
    if not is_muon_optimizer(base):
        return
    zero_folder = os.path.join(checkpoint_folder, "zero")
    saved = torch.load(os.path.join(zero_folder, OPTIMIZER_STATE_FILE), map_location="cpu", weights_only=False)
    check_muon_groups_pair(base.param_groups, saved.get(PARAM_GROUPS, []))
    never_stepped = _never_stepped(zero_folder,
                                   [zero_optimizer.param_names[lp] for g in _lp_groups(zero_optimizer) for lp in g])
    for group, lp_group in zip(base.param_groups, _lp_groups(zero_optimizer)):
        for lp in lp_group:
            name = zero_optimizer.param_names[lp]
            folder = os.path.join(zero_folder, name)
            files = state_files(folder)
            check_muon_state(name, folder, files, is_muon_group(group), never_stepped)
            if not never_stepped:
                check_variant_state(name, folder, files, group)


def check_zero12_convertible(optim_file: str) -> None:
    """Refuse, in ``ds_to_universal``, a ZeRO-1/2 checkpoint of a Muon run whose momentum is not in the partition's
    layout.

    The converter cuts every state of a group at the fragment offsets of the fp32 partition (``param_slice_mappings``).
    This build keeps Muon's state in that layout and marks its checkpoints (``zero12_checkpoints.STATE_LAYOUT_KEY``);
    stock DeepSpeed and older builds of this patch kept the whole parameters touching the rank's partition, which cut
    there would give wrong momentum. Every group is partitioned over every rank, so one rank's file (``optim_file``,
    read memory-mapped: no tensor is read) shows it.

    Raises:
        ValueError: a Muon group (``use_muon``) holds ``momentum_buffer``, or a group a variant's state, and the file
            of ``DeepSpeedZeroOptimizer`` has no ``STATE_LAYOUT_KEY``.
    """
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, LOSS_SCALER
    from deepspeed.runtime.zero.muon.zero12_checkpoints import STATE_LAYOUT_KEY
    saved = torch.load(optim_file, map_location="cpu", weights_only=False, mmap=True)
    optim_sd = saved[OPTIMIZER_STATE_DICT]
    # BF16_Optimizer's files (no loss scaler): its base optimizer steps the flat fp32 partitions, so every state is.
    if optim_sd.get(STATE_LAYOUT_KEY) is not None or LOSS_SCALER not in optim_sd:
        return
    base_state = optim_sd[BASE_OPTIMIZER_STATE]
    groups = base_state.get(PARAM_GROUPS, []) if isinstance(base_state, dict) else []
    state_groups = base_state.get("state", {}) if isinstance(base_state, dict) else dict(enumerate(base_state))
    for index, state in sorted(state_groups.items()):
        muon_group = index < len(groups) and is_muon_group(groups[index])
        held = [key for key in ((MOMENTUM_KEY, ) if muon_group else ()) + state_keys() if key in state]
        if held:
            raise ValueError(f"ds_to_universal: {optim_file} is of a ZeRO stage 1/2 checkpoint of a Muon run saved by "
                             f"stock DeepSpeed or an older build of the Muon patch (parameter group {index} holds "
                             f"{', '.join(held)} without the {STATE_LAYOUT_KEY!r} mark; without offload those "
                             "builds kept the momentum as whole parameters, not in the partition's layout). Resume it "
                             "with "
                             "this build at the world size and zero_optimization.offload_optimizer setting that "
                             "saved it, save a checkpoint, and convert that one.")
