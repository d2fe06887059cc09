# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of any optimizer at every ZeRO stage: per-parameter states, conversion, any-world-size load.

``ds_to_universal`` stores each parameter in ``<output>/zero/<parameter name>/``, independent of the world size that
wrote it, so ``"checkpoint": {"load_universal": true}`` loads it at any data-parallel world size (ZeRO-3 per sub-group;
ZeRO-1/2 also from a ZeRO-3 source). Per parameter, whichever stage saved: ``fp32.pt`` (fp32 master weights),
``step.pt`` (the step count, where the partition's state has one), and one file per optimizer state of the flat
partition the parameter is optimized in (ZeRO-1/2: its group's; ZeRO-3: its sub-group's), named by the state's key
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``sum``, ...), floating ones in fp32 (bf16 is upcast exactly). Each
tensor file holds ``{"param": tensor}`` in the logical shape (no ZeRO padding; tensor-parallel shards merged, with keys
such as ``cat_dim`` the ZeRO-1/2 loader splits by). ``zero/optimizer_state.pt`` keeps ``param_groups`` and the loss
scaler.

The converter cuts each state at the parameters' offsets in the flat partition, as it cuts the fp32 weights, so it
takes only elementwise states (flat, of the partition's length: all of Adam's, SGD's, Adagrad's); others (per-row or
factored statistics, whole parameters) are refused, naming them. The loaders pair groups by index and do not know which
states an optimizer needs: one that does (Muon, whose momentum must not restart at zero) checks the folders first
(``muon_universal``). Which files a load reads, and the error for a regular checkpoint at another world size, are in
``checkpoint_files``.
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
"""State name of the fp32 master weights."""
STEP = "step"
"""State name of the optimizer's step count (a number or 0-d tensor, not partitioned)."""

State = Union[torch.Tensor, int, float]

# Conversion (python -m deepspeed.checkpoint.ds_to_universal)


def _partition_states(state: dict, partition: torch.Tensor, lengths: Sequence[int], where: str) -> Dict[str, State]:
    """``{"fp32": partition}`` plus every state of one flat partition's optimizer ``state``: ``step`` as stored, each
    other a 1-D tensor with one of ``lengths`` elements (floating ones in fp32).

    Raises:
        ValueError: another state, naming it, ``where`` (file, group) and ``lengths[0]``.
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
    """``_partition_states`` of one sub-group in one rank's ZeRO-3 optimizer file, for the extractor.

    ``optim_sd`` is the file's ``optimizer_state_dict``: ``fp32_flat_groups[sub_group_id]`` is the rank's flat fp32
    partition, ``optimizer_state_dict["state"][sub_group_id]`` its optimizer state (absent if never stepped: only
    ``fp32`` is returned).

    Raises:
        ValueError: a state that is neither ``step`` nor a flat tensor of the partition's length.
    """
    partition = optim_sd[FP32_FLAT_GROUPS][sub_group_id]
    state = optim_sd[OPTIMIZER_STATE_DICT]["state"].get(sub_group_id, {})
    return _partition_states(state, partition, (partition.numel(), ), f"ZeRO-3 sub-group {sub_group_id}")


def merge_zero3_param_states(fragment_dir: str, output_dir: str, logical_shape: Sequence[int],
                             merge_shards: Callable[[str, str, int], List]) -> List[str]:
    """Merge one parameter's per-rank fragments into its universal-checkpoint files; returns the states, sorted.

    Writes ``<state>.pt`` for every state under ``fragment_dir/0/<state>.<dp rank>``: tensors as ``{"param": tensor}``
    in ``logical_shape`` (``ds_shape``; fragments are unpadded, in rank order) and the fragments' dtype, ``step`` as
    the value itself (equal on every rank). ``merge_shards`` is the converter's ``_merge_zero_shards``, passed in so
    that this module does not import the converter back.

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
    """``_partition_states`` of one parameter group in one rank's ZeRO-1/2 optimizer file, for the extractor.

    ``optim_sd`` is the file's ``optimizer_state_dict`` as ``DeepSpeedCheckpoint.get_zero_checkpoint_state`` returns
    it (padding stripped from the states): ``single_partition_of_fp32_groups[group_id]`` is the rank's flat fp32
    partition, ``base_optimizer_state["state"][group_id]`` its optimizer state (absent if never stepped or SGD without
    momentum: only ``fp32``), ``param_slice_mappings[group_id]`` each parameter's fragment. A state may be as long as
    the partition or end at the last fragment: ``BF16_Optimizer`` saves its fp32 partition padded.

    Raises:
        ValueError: a state that is neither ``step`` nor a flat tensor of the partition's length (per-row statistic,
            whole parameters), which cutting at the fragment offsets would misplace; names it, group and ``source``.
    """
    partition = optim_sd[SINGLE_PARTITION_OF_FP32_GROUPS][group_id]
    fragments = optim_sd[PARAM_SLICE_MAPPINGS][group_id].values()
    used = max((fragment.start + fragment.numel for fragment in fragments), default=0)
    state = optim_sd[BASE_OPTIMIZER_STATE]["state"].get(group_id, {})
    return _partition_states(state, partition, (partition.numel(), used),
                             f"ZeRO-1/2 parameter group {group_id} in {source}")


def fragment_states(fragment_dir: str) -> List[str]:
    """The tensor states (``fp32`` and the optimizer's, without ``step``), sorted, that the extractor wrote
    fragments of under ``fragment_dir`` (``<tmp>/<parameter name>/<tp index>/<state>.<dp rank>``); may be empty."""
    found = {re.sub(r"\.[0-9]+$", "", os.path.basename(p)) for p in glob.glob(os.path.join(fragment_dir, "*", "*.*"))}
    return sorted(found - {STEP})


MOMENTUM_BUFFER = "momentum_buffer"
"""The momentum's state name in ``torch.optim.SGD`` and in DeepSpeed's Muon."""


def affine_scale_power(state: str, scale_powers: Dict[str, int], affine_map, param_name: str) -> int:
    """The power of an affine map's piece scale that ``state`` of ``param_name`` carries, for the merge.

    A piece holding the parameter scaled by ``s`` holds its gradient scaled by ``1 / s``, so a state holds
    ``full * s ** power`` (``ParamAffineMap.rebuild``). ``scale_powers`` is the converter's table (``fp32``: 1,
    ``exp_avg``: -1, ``exp_avg_sq``: -2). ``momentum_buffer`` (``buf = mu * buf + (1 - dampening) * grad``) is linear
    in the gradient like ``exp_avg``: -1. Any other state's power is unknown: with no scaled piece it moves unscaled
    (0), else it is refused rather than guessed (``rebuild`` refuses optimizer state through a scaled piece anyway).

    Raises:
        ValueError: an unknown state of a parameter whose map has a scaled piece, naming state, parameter, scales.
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

    ``loaded`` (the state's elements for this rank's tensor-parallel shard, before ZeRO partitions them) must have
    ``prod(shape)`` elements (``shape``: the logical shape, ZeRO-3's ``ds_shape``). Where the tensor ``stored`` (the
    file's content, ``{"param": tensor, ...}`` or a tensor) is the whole ``loaded`` (no tensor-parallel or expert
    slicing) and has more than one dimension, its shape must be ``shape``: a transposed matrix is still wrong.

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
    """``check_state_fits`` for a ZeRO-3 parameter (its ``ds_shape``); raises its ``ValueError``."""
    check_state_fits(folder, key, param.ds_shape, loaded, stored)


def check_groups_pair(param_groups: List[dict], saved_groups: List[dict]) -> None:
    """Refuse a checkpoint whose optimizer parameter groups cannot pair with the run's by index.

    The loaders pair groups by position (settings and, at ZeRO-1/2, flat partitions), so with another number of
    groups some would take another group's settings.

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
    """``(keys, step)`` of one sub-group (``folders``: ``{parameter name: folder}``): the sorted tensor states every
    folder holds (without ``fp32`` and ``step``), and the step as ``step.pt`` holds it (None: none saved).

    Raises:
        ValueError: a parameter without a folder or ``fp32.pt``; parameters with different states or steps (one flat
            state tensor covers them all).
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
    """Set each group's settings (every key but ``params``) to the saved group's of the same index; raises
    ``check_groups_pair``'s ``ValueError``."""
    check_groups_pair(param_groups, saved_groups)
    for group, saved in zip(param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = value


@dataclass
class Zero3SubGroup:
    """One ZeRO-3 sub-group as the universal loader needs it, built by the stage.

    Attributes:
        params: the sub-group's parameters, in the order of their partitions in ``fp32_partition``.
        names: each parameter's name in the model (its folder under ``zero/``), None if the model does not name it.
        fp32_partition: this rank's flat fp32 master weights of the sub-group (1-D); the inner optimizer keeps its
            states under this tensor (``optimizer.state[fp32_partition]``).
    """
    params: Sequence[torch.nn.Parameter]
    names: Sequence[Optional[str]]
    fp32_partition: torch.Tensor


LoadPartition = Callable[..., torch.Tensor]
"""``load_partition(folder, state name, param=parameter)`` -> this rank's 1-D partition of that state of the
parameter: the stage's ``load_hp_checkpoint_state``."""


def restore_zero3_optimizer_state(sub_groups: Sequence[Zero3SubGroup], optimizer_state: MutableMapping,
                                  param_groups: List[dict], load_partition: LoadPartition, zero_dir: str,
                                  optim_sd: dict) -> None:
    """Load a universal checkpoint's fp32 partitions, optimizer states and group settings into a ZeRO-3 optimizer
    at its own world size.

    Per sub-group, the flat fp32 partition and each state its parameters' folders hold are rebuilt, partitioned for
    this rank by ``load_partition`` and put in ``optimizer_state`` (``{fp32 partition: {key: value}}``): copied into
    the tensor already there if it has the flat size, so that its dtype, device and other references to it (a
    momentum buffer the stage holds) stay valid; else as a new tensor. ``param_groups`` get the saved groups' settings.

    A checkpoint without per-parameter ``step.pt`` (from a ``ds_to_universal`` that kept only ``exp_avg`` and
    ``exp_avg_sq``) holds the step only in ``optimizer_state.pt`` (``optim_sd``, rank 0's); a sub-group then takes
    the step of a saved sub-group with the same states, so Adam's moments get theirs and a step-less momentum none.

    Raises:
        ValueError: a parameter without a name in the model, missing or misshapen state (``_sub_group_plan``,
            ``check_loaded_state``), or parameter groups that do not pair.
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

    A stage-1/2 source carries ``ds_version``; a ZeRO-3 source's (``zero_stage`` 3) has none. The check guards
    against stage-1 checkpoints older than 0.3.17, which a ZeRO-3 one cannot be, so for it the installed version is
    returned. None for anything else without ``ds_version`` (the caller's assertion then refuses it).
    """
    from deepspeed.git_version_info import version
    if state.get(DS_VERSION):
        return state[DS_VERSION]
    if int(state.get(ZERO_STAGE, 0)) == 3:
        return version
    return None
