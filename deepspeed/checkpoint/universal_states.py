# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of any optimizer at every ZeRO stage: what one holds per parameter, every
optimizer state converted (ZeRO-1/2 and ZeRO-3), loaded per sub-group at any data-parallel world
size under ZeRO-3 (and a ZeRO-3 one at ZeRO-1/2). Which files a load reads, and the error that points
a regular checkpoint loaded at another world size to the conversion, are ``checkpoint_files``'.

A universal checkpoint (``python -m deepspeed.checkpoint.ds_to_universal``) stores every
parameter in a folder of its own, ``<output>/zero/<parameter name>/``, independent of the number
of ranks that wrote it, so ``"checkpoint": {"load_universal": true}`` can load it at any
data-parallel world size W'. Per parameter, whichever ZeRO stage (1, 2 or 3) saved the checkpoint:

- ``fp32.pt``: the fp32 master weights;
- one file per optimizer state of the flat partition the parameter is optimized in (ZeRO-1/2:
  its parameter group's; ZeRO-3: its sub-group's), named by the state's key in the optimizer:
  ``exp_avg.pt`` and ``exp_avg_sq.pt`` for Adam, ``momentum_buffer.pt`` for SGD with momentum or
  Muon, ``sum.pt`` for Adagrad, and so on; floating-point states are stored in fp32 whatever
  dtype the checkpoint kept them in (a bf16 momentum is upcast; fp32 holds every bf16 value
  exactly);
- ``step.pt``: the optimizer's step count, where the partition's state has one (Adam's).

Each tensor file holds ``{"param": tensor}`` with the parameter's logical shape (no ZeRO padding;
a tensor-parallel parameter merged over its ranks, with the keys such as ``cat_dim`` that the
ZeRO-1/2 loader splits it by again), the form both the ZeRO-3 and the ZeRO-1/2 universal loaders
read. ``<output>/zero/optimizer_state.pt`` keeps the optimizer's ``param_groups`` (each group's
settings: ``lr``, ``betas``, ``momentum``, ``weight_decay``, ...) and the loss scaler.

The converter cuts each state at the parameters' offsets in the flat partition, as it cuts the
fp32 master weights, so it takes every state that is a flat tensor of the partition's length (an
elementwise state, as every state of Adam, SGD and Adagrad is); a state of another layout (a
per-row or factored statistic, whole parameters) cannot be cut there and is refused, naming it.

The loaders pair the checkpoint's parameter groups with the engine's by index and take each
group's settings from its own saved group; they do not know which states an optimizer needs. An
optimizer that does (e.g. Muon, whose matrices must not restart their momentum at zero) checks
the parameters' folders before calling them.
"""

import glob
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, MutableMapping, Optional, Sequence, Union

import torch

from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, DS_VERSION, FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT,
                                            PARAM, PARAM_GROUPS, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS,
                                            ZERO_STAGE)

FP32 = "fp32"
"""State name of the fp32 master weights in a universal checkpoint."""
STEP = "step"
"""State name of the optimizer's step count (a number, or a 0-d tensor, not partitioned)."""

State = Union[torch.Tensor, int, float]

# Conversion (python -m deepspeed.checkpoint.ds_to_universal)


def _partition_states(state: dict, partition: torch.Tensor, lengths: Sequence[int], where: str) -> Dict[str, State]:
    """``{"fp32": partition}`` plus every state of one flat partition's optimizer state ``state``.

    Args:
        state: the optimizer's state of the flat partition (``{key: value}``).
        partition: the flat fp32 master weights of the partition (1-D).
        lengths: the element counts a state may have: it is cut at the same offsets as
            ``partition`` (``lengths[0]`` is named in the error).
        where: what ``state`` belongs to, for the error (the file and the group).

    Returns:
        ``step`` as stored; each other state, a 1-D tensor of one of ``lengths``, floating ones
        in fp32, other dtypes as stored.

    Raises:
        ValueError: a state that is neither ``step`` nor such a tensor, naming it and ``where``.
    """
    states: Dict[str, State] = {FP32: partition}
    for key, value in state.items():
        if key == STEP:
            states[key] = value
        elif torch.is_tensor(value) and value.dim() == 1 and value.numel() in lengths:
            states[key] = value.float() if value.is_floating_point() else value
        else:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"ds_to_universal: optimizer state '{key}' of {where} is {shape}, not a flat tensor "
                             f"of the partition's {lengths[0]} elements; it cannot be split per parameter.")
    return states


def zero3_sub_group_states(optim_sd: dict, sub_group_id: int) -> Dict[str, State]:
    """The states of one sub-group in one rank's ZeRO-3 optimizer file, for the extractor.

    Args:
        optim_sd: the file's ``optimizer_state_dict`` entry (``DeepSpeedZeroOptimizer_Stage3.
            state_dict()``): its ``fp32_flat_groups[sub_group_id]`` is the rank's flat fp32
            partition of the sub-group, and ``optimizer_state_dict["state"][sub_group_id]`` the
            optimizer's state of that flat tensor.
        sub_group_id: index of the sub-group (the optimizer's state index of its flat tensor).

    Returns:
        ``{"fp32": partition}`` plus every state of the sub-group under its own key: each flat
        tensor of the partition's length (``exp_avg`` and ``exp_avg_sq`` of Adam,
        ``momentum_buffer`` of SGD or Muon), floating ones in fp32 (a momentum kept in bf16 is
        upcast), other dtypes as stored, and ``step`` as stored. A sub-group without state (an
        optimizer that never stepped) gives only ``fp32``.

    Raises:
        ValueError: a state that is neither ``step`` nor a flat tensor of the partition's length,
            which the per-parameter layout of a universal checkpoint cannot hold.
    """
    partition = optim_sd[FP32_FLAT_GROUPS][sub_group_id]
    state = optim_sd[OPTIMIZER_STATE_DICT]["state"].get(sub_group_id, {})
    return _partition_states(state, partition, (partition.numel(), ), f"ZeRO-3 sub-group {sub_group_id}")


def merge_zero3_param_states(fragment_dir: str, output_dir: str, logical_shape: Sequence[int],
                             merge_shards: Callable[[str, str, int], List]) -> List[str]:
    """Merge one parameter's per-rank fragments into its universal-checkpoint files.

    Args:
        fragment_dir: ``<tmp>/<parameter name>``, where the extractor wrote
            ``0/<state>.<dp rank>`` (tensor-parallel index 0) for each state of the parameter.
        output_dir: ``<output>/zero/<parameter name>``, created if missing.
        logical_shape: the parameter's shape (``ds_shape``); the fragments hold its elements
            without ZeRO padding, in data-parallel rank order.
        merge_shards: the converter's ``_merge_zero_shards(fragment_dir, state, tp_degree)``, which
            concatenates one state's fragments in rank order (a list with one tensor per
            tensor-parallel rank). Passed in by the converter, which imports this module, so that
            this module does not import the converter back.

    Writes ``<state>.pt`` for every state found: tensors as ``{"param": tensor}`` in the logical
    shape and the fragments' dtype, ``step`` as the value itself (equal on every rank). Returns
    the state names written, sorted.

    Raises:
        ValueError: the fragments of a tensor state do not hold ``prod(logical_shape)`` elements.
    """
    found = {re.sub(r"\.[0-9]+$", "", os.path.basename(p)) for p in glob.glob(os.path.join(fragment_dir, "0", "*.*"))}
    os.makedirs(output_dir, exist_ok=True)
    numel = math.prod(logical_shape)
    for state in sorted(found):
        merged = merge_shards(fragment_dir, state, 1)[0]
        if state == STEP:
            torch.save(merged, os.path.join(output_dir, f"{state}.pt"))
            continue
        if merged.numel() != numel:
            raise ValueError(f"ds_to_universal: {os.path.basename(fragment_dir)}: the fragments of '{state}' hold "
                             f"{merged.numel()} elements, the parameter's shape {tuple(logical_shape)} "
                             f"{numel}.")
        torch.save({PARAM: merged.reshape(logical_shape)}, os.path.join(output_dir, f"{state}.pt"))
    return sorted(found)


def zero12_group_states(optim_sd: dict, group_id: int, source: str) -> Dict[str, State]:
    """The states of one parameter group in one rank's ZeRO-1/2 optimizer file, for the extractor.

    Args:
        optim_sd: the file's ``optimizer_state_dict`` entry as the converter reads it
            (``DeepSpeedCheckpoint.get_zero_checkpoint_state``, which strips the group's padding
            from the optimizer's states): ``single_partition_of_fp32_groups[group_id]`` is the
            rank's flat fp32 partition of the group (1-D), ``base_optimizer_state["state"]
            [group_id]`` the optimizer's state of that flat tensor, and
            ``param_slice_mappings[group_id]`` each parameter's fragment in it (``start``,
            ``numel``).
        group_id: index of the parameter group (the optimizer's state index of its flat partition).
        source: the optimizer-state file(s) of the rank, named in the error.

    Returns:
        ``{"fp32": partition}`` plus every state of the group under its own key: ``step`` as
        stored, and each 1-D tensor as long as the partition (``exp_avg`` and ``exp_avg_sq`` of
        Adam, ``momentum_buffer`` of SGD, ``sum`` of Adagrad), floating ones in fp32 (a state kept
        in bf16 is upcast), other dtypes as stored. "As long as the partition": the fp32 partition
        as saved (ZeRO-1/2 saves it and its states without the group's padding), or up to the end
        of its last parameter fragment (``BF16_Optimizer`` saves its fp32 partition with the
        padding, which the converter strips from the states only). A group without state (an
        optimizer that never stepped; SGD without momentum) gives only ``fp32``.

    Raises:
        ValueError: a state that is neither ``step`` nor a flat tensor of the partition's length
            (e.g. a per-row statistic, or a state holding whole parameters), naming the state, the
            group and ``source``: the converter cuts every state at the parameters' offsets in the
            partition, which would misplace such a state's elements.
    """
    partition = optim_sd[SINGLE_PARTITION_OF_FP32_GROUPS][group_id]
    fragments = optim_sd[PARAM_SLICE_MAPPINGS][group_id].values()
    used = max((fragment.start + fragment.numel for fragment in fragments), default=0)
    state = optim_sd[BASE_OPTIMIZER_STATE]["state"].get(group_id, {})
    return _partition_states(state, partition, (partition.numel(), used),
                             f"ZeRO-1/2 parameter group {group_id} in {source}")


def fragment_states(fragment_dir: str) -> List[str]:
    """The tensor states the extractor wrote fragments of for one parameter, for the merge.

    Args:
        fragment_dir: ``<tmp>/<parameter name>``, where the extractor wrote
            ``<tensor-parallel index>/<state>.<data-parallel rank>`` for each state of the parameter.

    Returns:
        the state names (``fp32`` and each optimizer state), without ``step``, sorted; empty for
        a parameter without fragments.
    """
    found = {re.sub(r"\.[0-9]+$", "", os.path.basename(p)) for p in glob.glob(os.path.join(fragment_dir, "*", "*.*"))}
    return sorted(found - {STEP})


MOMENTUM_BUFFER = "momentum_buffer"
"""The momentum's state name in ``torch.optim.SGD`` and in DeepSpeed's Muon."""


def affine_scale_power(state: str, scale_powers: Dict[str, int], affine_map, param_name: str) -> int:
    """The power of an affine map's piece scale that ``state`` of a parameter carries, for the merge.

    A piece that holds the parameter scaled by ``s`` holds its gradient scaled by ``1 / s``, so a
    state holds ``full * s ** power`` (``ParamAffineMap.rebuild``). ``scale_powers`` is the
    converter's table (``fp32``: 1, ``exp_avg``: -1, ``exp_avg_sq``: -2). ``momentum_buffer`` (SGD's,
    Muon's) is a running sum of gradients, ``buf = mu * buf + (1 - dampening) * grad``, linear in
    the gradient as ``exp_avg`` is: -1. Any other state's power is unknown; where no piece of the
    map is scaled every power leaves the state as stored (``1 ** power == 1``), so it is moved
    unscaled (0 is returned), and where one is it is refused rather than guessed. (``rebuild``
    itself refuses to move any optimizer state through a scaled piece, whose group settings
    would need the scale too.)

    Args:
        state: the state's name.
        scale_powers: the converter's ``{state: power}``.
        affine_map: the parameter's ``ParamAffineMap`` (its ``pieces_by_rank`` and their ``scale``).
        param_name: named in the error.

    Raises:
        ValueError: an unknown state of a parameter whose map has a scaled piece, naming the state,
            the parameter and the scales.
    """
    if state in scale_powers:
        return scale_powers[state]
    if state == MOMENTUM_BUFFER:
        return -1
    scales = sorted({piece.scale for pieces in affine_map.pieces_by_rank.values() for piece in pieces} - {1.0})
    if scales:
        raise ValueError(f"ds_to_universal: {param_name}: its affine map holds pieces scaled by {scales}, and how "
                         f"optimizer state '{state}' scales with the parameter is not known (known: "
                         f"{', '.join(sorted([*scale_powers, MOMENTUM_BUFFER]))}); refusing to convert it.")
    return 0


# Checks shared by the loaders of every stage


def check_state_fits(folder: str, key: str, shape: Sequence[int], loaded: torch.Tensor, stored) -> None:
    """Refuse a universal-checkpoint state that does not fit its parameter, at any ZeRO stage.

    Args:
        folder: the parameter's folder in the checkpoint (named in the error).
        key: the state's name (``fp32``, ``exp_avg``, ``momentum_buffer``, ...).
        shape: the parameter's logical shape (ZeRO-3: ``ds_shape``).
        loaded: the state's elements for this rank's tensor-parallel shard, before ZeRO
            partitions them (any shape; its element count must be ``prod(shape)``).
        stored: what the file holds (``{"param": tensor, ...}`` or a tensor). When that tensor
            is the whole ``loaded`` (no tensor-parallel or expert slicing) and has more than
            one dimension, its shape must be ``shape``: a transposed matrix has the right
            element count and is still wrong.

    Raises:
        ValueError: naming the folder, the state and both shapes.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    whole = stored.get(PARAM) if isinstance(stored, dict) else stored
    stored_shape = tuple(whole.shape) if torch.is_tensor(whole) else (loaded.numel(), )
    whole_param = torch.is_tensor(whole) and whole.numel() == loaded.numel()
    misshapen = whole_param and whole.dim() > 1 and stored_shape != shape
    if loaded.numel() != numel or misshapen:
        raise ValueError(f"Universal checkpoint {folder}: '{key}' has shape {stored_shape}, but the parameter has "
                         f"shape {shape} ({numel} elements). The checkpoint does not belong to this model "
                         "(or this parameter's state was written wrong); refusing to load it.")


def check_loaded_state(param: torch.nn.Parameter, folder: str, key: str, loaded: torch.Tensor, stored) -> None:
    """``check_state_fits`` for a ZeRO-3 parameter (its ``ds_shape``); the stage-3 loader's check.

    Raises:
        ValueError: as ``check_state_fits``.
    """
    check_state_fits(folder, key, param.ds_shape, loaded, stored)


def check_groups_pair(param_groups: List[dict], saved_groups: List[dict]) -> None:
    """Refuse a checkpoint whose optimizer parameter groups cannot pair with the run's by index.

    The loaders pair groups by position (the settings and, at ZeRO-1/2, the flat partitions), so
    with another number of groups some would take settings of a group they are not.

    Raises:
        ValueError: ``len(saved_groups) != len(param_groups)``, naming both counts.
    """
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"Universal checkpoint: it has {len(saved_groups)} optimizer parameter groups, this run "
                         f"{len(param_groups)}; build the engine with the parameter groups the checkpoint was "
                         "trained with.")


def state_files(folder: str) -> Dict[str, str]:
    """``{state name: path}`` of the ``*.pt`` files in a parameter's folder (empty if it has none)."""
    return {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(folder, "*.pt"))}


# Loading (checkpoint.load_universal) into ZeRO-3 at any world size


def _sub_group_plan(folders: Dict[str, str]):
    """Which tensor states to load for one sub-group, and its step (None: none saved).

    Args:
        folders: ``{parameter name: its folder}`` for the parameters of the sub-group.

    Returns:
        ``(keys, step)``: the sorted names of the tensor states every parameter's folder holds
        (without ``fp32`` and ``step``), and the step as ``step.pt`` holds it.

    Raises:
        ValueError: a parameter without a folder or ``fp32.pt``; parameters of the sub-group with
            different states or steps (one flat state tensor covers them all).
    """
    per_param = {}
    for name, folder in folders.items():
        files = state_files(folder)
        if FP32 not in files:
            raise ValueError(f"Universal checkpoint: no fp32 weights for parameter '{name}' (expected {folder}/"
                             "fp32.pt). The checkpoint does not hold this model's parameters.")
        per_param[name] = files
    keys = {name: tuple(sorted(set(files) - {FP32, STEP})) for name, files in per_param.items()}
    if len(set(keys.values())) > 1:
        raise ValueError(f"Universal checkpoint: parameters of one ZeRO-3 sub-group hold different optimizer states: "
                         f"{keys}.")
    steps = {}
    for name, files in per_param.items():
        if STEP in files:
            step = torch.load(files[STEP], map_location="cpu", weights_only=False)
            steps[name] = step.item() if torch.is_tensor(step) else step
    if steps and (len(steps) != len(per_param) or len(set(steps.values())) > 1):
        raise ValueError(f"Universal checkpoint: parameters of one ZeRO-3 sub-group have different step counts: "
                         f"{steps} of {sorted(per_param)}.")
    step = None
    if steps:
        first = next(iter(per_param.values()))[STEP]
        step = torch.load(first, map_location="cpu", weights_only=False)
    return next(iter(keys.values()), ()), step


def _restore_param_groups(param_groups: List[dict], saved_groups: List[dict]) -> None:
    """Set each parameter group's settings (every key but ``params``) to the saved group's of the
    same index.

    Raises:
        ValueError: the groups do not pair (``check_groups_pair``).
    """
    check_groups_pair(param_groups, saved_groups)
    for group, saved in zip(param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = value


@dataclass
class Zero3SubGroup:
    """One ZeRO-3 sub-group as the universal loader needs it, built by the stage.

    Attributes:
        params: the sub-group's parameters, in the order their partitions follow each other in
            ``fp32_partition``.
        names: each parameter's name in the model (its folder under ``zero/``), None for one
            the model does not name.
        fp32_partition: this rank's flat fp32 master weights of the sub-group (1-D); the inner
            optimizer keeps its states under this tensor (``optimizer.state[fp32_partition]``).
    """
    params: Sequence[torch.nn.Parameter]
    names: Sequence[Optional[str]]
    fp32_partition: torch.Tensor


LoadPartition = Callable[..., torch.Tensor]
"""``load_partition(folder, state name, param=parameter)`` -> this rank's partition of that state of the
parameter (1-D), read from the parameter's folder: the stage's ``load_hp_checkpoint_state``."""


def restore_zero3_optimizer_state(sub_groups: Sequence[Zero3SubGroup], optimizer_state: MutableMapping,
                                  param_groups: List[dict], load_partition: LoadPartition, zero_dir: str,
                                  optim_sd: dict) -> None:
    """Load the fp32 partitions, the optimizer states and the group settings of a universal
    checkpoint into a ZeRO-3 optimizer at its own world size.

    Per sub-group, the flat fp32 partition and each state its parameters' folders hold are
    rebuilt from those folders, partitioned for this rank by ``load_partition``, and put in
    ``optimizer_state[fp32_partition]``: copied into the tensor already there where it has the
    flat partition's size, so that it keeps its dtype and device and every other reference to it
    (a momentum buffer the stage keeps in memory) stays valid; else as a new fp32 tensor. The
    step is set where the checkpoint has one. Each optimizer parameter group gets the settings
    of the saved group with the same index.

    A checkpoint without per-parameter ``step.pt`` (converted by a ``ds_to_universal`` that kept
    only ``exp_avg`` and ``exp_avg_sq``) holds the step only in ``optimizer_state.pt``, rank 0's
    optimizer state; a sub-group then gets the step of a saved sub-group that holds the same
    states, so Adam's moments get theirs and a state saved without a step (a momentum) gets none.

    Args:
        sub_groups: the stage's sub-groups (``Zero3SubGroup``), in sub-group order.
        optimizer_state: the inner optimizer's ``state`` (``{fp32 partition: {key: value}}``).
        param_groups: the inner optimizer's ``param_groups``; their settings are replaced.
        load_partition: reads this rank's partition of one state of one parameter (``LoadPartition``).
        zero_dir: the checkpoint's ``zero/`` folder.
        optim_sd: the checkpoint's ``zero/optimizer_state.pt``.

    Raises:
        ValueError: a parameter without a name in the model, missing or misshapen state (see
            ``_sub_group_plan``, ``check_loaded_state``), or parameter groups that do not pair
            (``_restore_param_groups``).
    """
    saved = optim_sd.get(OPTIMIZER_STATE_DICT, {})  # a ZeRO-3 source's optimizer state; a ZeRO-1/2 one's has none
    saved_steps = {}
    for state in saved.get("state", {}).values():
        if STEP in state:
            saved_steps.setdefault(frozenset(state) - {STEP}, state[STEP])
    for sub_group_id, sub_group in enumerate(sub_groups):
        missing = sum(name is None for name in sub_group.names)
        if missing:
            raise ValueError(f"ZeRO-3 universal checkpoint load: {missing} parameter(s) of sub-group "
                             f"{sub_group_id} have no name in the model.")
        folders = {name: os.path.join(zero_dir, name) for name in sub_group.names}
        keys, step = _sub_group_plan(folders)
        fp32_partition = sub_group.fp32_partition
        for key in (FP32, *keys):
            flat = torch.zeros_like(fp32_partition)
            offset = 0
            for param, name in zip(sub_group.params, sub_group.names):
                part = load_partition(folders[name], key, param=param)
                flat.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
            if key == FP32:
                fp32_partition.data.copy_(flat)
                continue
            state = optimizer_state.setdefault(fp32_partition, {})
            current = state.get(key)
            if torch.is_tensor(current) and current.shape == flat.shape:
                current.copy_(flat)
            else:
                state[key] = flat
        if step is None and keys:
            step = saved_steps.get(frozenset(keys))
        if step is not None:
            optimizer_state.setdefault(fp32_partition, {})[STEP] = step
    _restore_param_groups(param_groups, optim_sd[PARAM_GROUPS])


# Loading a universal checkpoint converted from ZeRO-3 at ZeRO stage 1 or 2


def checkpoint_version(state: dict) -> Optional[str]:
    """The DeepSpeed version a stage-1/2 loader checks in a universal ``optimizer_state.pt``.

    A conversion of a stage-1/2 checkpoint carries ``ds_version``; one of a ZeRO-3 checkpoint
    carries the ZeRO-3 optimizer's state, which has none (``zero_stage`` 3). The check guards
    against stage-1 checkpoints older than 0.3.17, which a ZeRO-3 one cannot be, so for it this
    returns the installed version.

    Returns:
        ``ds_version``, or the installed version for a ZeRO-3 source, or None for anything else
        without ``ds_version`` (the caller's assertion then refuses it).
    """
    from deepspeed.git_version_info import version
    if state.get(DS_VERSION):
        return state[DS_VERSION]
    if int(state.get(ZERO_STAGE, 0)) == 3:
        return version
    return None
