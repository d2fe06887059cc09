# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What a universal checkpoint must hold for a Muon run, checked before anything is loaded.

The universal format and loaders (``deepspeed.checkpoint.zero3_universal``) restore whatever
states a parameter's folder holds. For ``MuonWithAuxAdam`` that is not enough: a Muon matrix
(``use_muon``) whose folder lacks ``momentum_buffer.pt`` would silently restart its momentum at
zero, an Adam parameter with one would drop it, and the two kinds of parameter groups are told
apart only by ``use_muon``, so a checkpoint whose groups pair with the run's by count but not by
kind would hand Muon settings to Adam groups. These checks refuse such checkpoints, naming the
parameter or group; the ZeRO-3 loader calls ``check_zero3_universal_state`` first, the ZeRO-1/2
one ``zero12_universal_momentum.check_before_load``.

A Muon variant with owner state (``owner_state``; NorMuon's file is ``normuon_second_moment.pt``)
saves it per parameter too; ``check_variant_state`` requires it where the run's group uses the
variant and refuses a variant's state where the group does not use that variant.

``ds_to_universal`` calls ``check_zero12_convertible`` first for a ZeRO-1/2 checkpoint: Muon's
ZeRO-1/2 state is not in the fp32 partition's layout, so such a checkpoint is refused, not cut.
"""

import os
from typing import Iterable, List

from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_GROUPS
from deepspeed.checkpoint.zero3_universal import FP32, STEP, check_groups_pair, state_files
from deepspeed.runtime.zero.muon.owner_state import VARIANT_KEY, state_keys, variant_of

MOMENTUM = "momentum_buffer"
"""State name of the Muon momentum (``MuonWithAuxAdam``'s key, and the file name in a universal
checkpoint)."""


def check_muon_state(name: str, folder: str, states: Iterable[str], is_muon: bool, never_stepped: bool) -> None:
    """Refuse a parameter whose optimizer states do not belong to the optimizer that will run it.

    Args:
        name: the parameter's name (named in the error).
        folder: its folder in the checkpoint.
        states: the state names its folder holds (``fp32``, ``momentum_buffer``, ``exp_avg``, ...).
        is_muon: the loading run optimizes it with Muon (``use_muon``).
        never_stepped: the checkpoint was saved before the first optimizer step (no state at all).

    Raises:
        ValueError: a Muon parameter without ``momentum_buffer`` once the optimizer has stepped
            (its momentum would restart at zero), or an Adam parameter with one (it would be
            dropped).
    """
    states = set(states)
    if is_muon and MOMENTUM not in states and not never_stepped:
        held = sorted(states - {FP32, STEP})
        raise ValueError(f"Universal checkpoint: Muon parameter '{name}' has no {MOMENTUM} in {folder} (it holds "
                         f"{held or 'no optimizer state'}). Loading would restart its momentum from zero; "
                         "refusing. Convert a checkpoint of the same Muon run with ds_to_universal, or set "
                         "use_muon the way the checkpoint was trained.")
    if not is_muon and MOMENTUM in states:
        raise ValueError(f"Universal checkpoint: parameter '{name}' holds Muon's {MOMENTUM} in {folder}, but "
                         "this run optimizes it with Adam (use_muon False). Set use_muon (and the optimizer) as "
                         "the checkpoint was trained; refusing to drop its momentum.")


def check_variant_state(name: str, folder: str, states: Iterable[str], param_group: dict) -> None:
    """Refuse a Muon parameter whose folder lacks its variant's state, or holds one its group does not use.

    Args:
        name, folder, states: as for ``check_muon_state``.
        param_group: the loading run's parameter group of the parameter (its ``variant``).

    Raises:
        ValueError: a variant's parameter without its state (e.g. ``normuon_second_moment``: it
            would restart at zero), or a parameter with the state of a variant its group does not
            use (it would be dropped).
    """
    states = set(states)
    variant = variant_of(param_group) if param_group.get("use_muon") else None
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

    Besides the same number of groups (``check_groups_pair``), each group's ``use_muon`` must be
    the saved group's of the same index: the loaders copy the saved group's settings over, and a
    Muon group's (``momentum``, ``ns_method``) mean nothing to Adam and the other way round.

    Raises:
        ValueError: a different number of groups, or a group whose ``use_muon`` differs.
    """
    check_groups_pair(param_groups, saved_groups)
    for index, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        ours, theirs = bool(group.get("use_muon", False)), bool(saved.get("use_muon", False))
        if ours != theirs:
            raise ValueError(f"Universal checkpoint: optimizer parameter group {index} has use_muon={theirs} in "
                             f"the checkpoint and use_muon={ours} in this run; build the engine with the parameter "
                             "groups the checkpoint was trained with.")


def check_zero3_universal_state(optimizer, zero_dir: str, optim_sd: dict) -> None:
    """Refuse, before the ZeRO-3 universal loader reads anything, a checkpoint whose state does not
    fit this Muon run.

    Args:
        optimizer: ``DeepSpeedZeroOptimizer_Stage3`` with ``use_muon`` (its ``sub_groups_using_muon``
            says which sub-groups Muon runs).
        zero_dir: the checkpoint's ``zero/`` folder.
        optim_sd: the checkpoint's ``zero/optimizer_state.pt`` (its ``optimizer_state_dict`` has
            no ``state`` when the checkpoint was saved before the first step).

    Raises:
        ValueError: the parameter groups do not pair (``check_muon_groups_pair``); a parameter's
            folder holds the other optimizer's state (``check_muon_state``). A parameter without a
            name in the model is left to the loader's own error.
    """
    saved = optim_sd[OPTIMIZER_STATE_DICT]
    check_muon_groups_pair(optimizer.optimizer.param_groups, saved[PARAM_GROUPS])
    never_stepped = not saved.get("state")
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


def check_zero12_convertible(optim_file: str) -> None:
    """Refuse, in ``ds_to_universal``, to convert a ZeRO-1/2 checkpoint of a Muon run.

    ZeRO-1/2's converter cuts every state of a parameter group at the fp32 partition's fragment
    offsets (``param_slice_mappings``). Muon's state does not share that layout at ZeRO-1/2: without
    ``offload_optimizer`` the momentum holds the whole parameters that touch the rank's partition
    (``zero12_update``), and a variant's rows follow the parameters or the owner plan, so cutting
    it there would write wrong momentum; upstream's converter stops with a bare ``KeyError:
    'exp_avg'`` (or first asks for ``universal_checkpoint_info``, which a Muon run could not use).
    Every parameter group is partitioned over every data-parallel rank, so one rank's file shows
    whether the groups hold Muon's state; it is read memory-mapped (``torch.load(mmap=True)``), so
    the check costs no tensor reads.

    Args:
        optim_file: one rank's ``*_optim_states.pt`` of the checkpoint (named in the error).

    Raises:
        ValueError: a parameter group holds Muon's ``momentum_buffer`` or a variant's state.
    """
    import torch
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE
    saved = torch.load(optim_file, map_location="cpu", weights_only=False, mmap=True)
    state_groups = saved[OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE].get("state", {})
    muon_keys = (MOMENTUM, ) + state_keys()
    for index, state in sorted(state_groups.items()):
        held = [key for key in muon_keys if key in state]
        if held:
            raise ValueError(f"ds_to_universal: {optim_file} is of a ZeRO stage 1/2 checkpoint of a Muon run "
                             f"(parameter group {index} holds {', '.join(held)}); converting Muon's state of a "
                             "ZeRO-1/2 checkpoint is not supported. Resume it at the world size and "
                             "zero_optimization.offload_optimizer setting that saved it; a checkpoint saved at "
                             "ZeRO stage 3 converts, and its universal checkpoint loads at any world size and "
                             "at ZeRO stage 1, 2 or 3.")
