# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of ZeRO-3 runs whose optimizer is Muon (or any other optimizer whose
per-parameter state is not Adam's ``exp_avg``/``exp_avg_sq``), and the way to another world size.

A universal checkpoint (``python -m deepspeed.checkpoint.ds_to_universal``) stores every
parameter in a folder of its own, ``<output>/zero/<parameter name>/``, independent of the number
of ranks that wrote it, so ``"checkpoint": {"load_universal": true}`` can load it at any
data-parallel world size W'. Per parameter:

- ``fp32.pt``: the fp32 master weights;
- one file per optimizer state of the parameter's sub-group: ``momentum_buffer.pt`` for a Muon
  matrix (fp32, also when the checkpoint kept it in bf16 as stock 0.19.8 does),
  ``exp_avg.pt`` and ``exp_avg_sq.pt`` for a parameter of the auxiliary Adam (or of Adam);
- ``step.pt``: the optimizer's step count, where the sub-group's state has one (Adam's).

Each tensor file holds ``{"param": tensor}`` with the parameter's logical shape (``ds_shape``,
no ZeRO padding), the form both the ZeRO-3 and the ZeRO-1/2 universal loaders read.
``<output>/zero/optimizer_state.pt`` keeps the optimizer's ``param_groups`` (per group:
``use_muon``, ``lr``, ``momentum``, ``betas``, ``ns_method``, ``weight_decay``, ...) and the loss
scaler.
"""

import glob
import math
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

FP32 = "fp32"
"""State name of the fp32 master weights in a universal checkpoint."""
STEP = "step"
"""State name of the optimizer's step count (a number, or a 0-d tensor, not partitioned)."""
MOMENTUM = "momentum_buffer"
"""State name of the Muon momentum (upstream ``MuonWithAuxAdam``'s key)."""

State = Union[torch.Tensor, int, float]

# Conversion (python -m deepspeed.checkpoint.ds_to_universal), ZeRO-3 branch


def zero3_sub_group_states(optim_sd: dict, sub_group_id: int) -> Dict[str, State]:
    """The states of one sub-group in one rank's ZeRO-3 optimizer file, for the extractor.

    Args:
        optim_sd: the file's ``optimizer_state_dict`` entry (``DeepSpeedZeroOptimizer_Stage3.
            state_dict()``): its ``fp32_flat_groups[sub_group_id]`` is the rank's flat fp32
            partition of the sub-group, and ``optimizer_state_dict["state"][sub_group_id]`` the
            optimizer's state of that flat tensor.
        sub_group_id: index of the sub-group (the optimizer's state index of its flat tensor).

    Returns:
        ``{"fp32": partition}`` plus every state of the sub-group: each flat tensor of the
        partition's length (``momentum_buffer`` of a Muon sub-group, ``exp_avg`` and ``exp_avg_sq``
        of an Adam one), floating ones in fp32 (stock 0.19.8 keeps the momentum in bf16), and
        ``step`` as stored. A sub-group without state (an optimizer that never stepped) gives
        only ``fp32``.

    Raises:
        ValueError: a state that is neither ``step`` nor a flat tensor of the partition's length,
            which the per-parameter layout of a universal checkpoint cannot hold.
    """
    partition = optim_sd[FP32_FLAT_GROUPS][sub_group_id]
    states: Dict[str, State] = {FP32: partition}
    for key, value in optim_sd[OPTIMIZER_STATE_DICT]["state"].get(sub_group_id, {}).items():
        if key == STEP:
            states[key] = value
        elif torch.is_tensor(value) and value.dim() == 1 and value.numel() == partition.numel():
            states[key] = value.float() if value.is_floating_point() else value
        else:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"ds_to_universal: optimizer state '{key}' of ZeRO-3 sub-group {sub_group_id} is "
                             f"{shape}, not a flat tensor of the partition's {partition.numel()} elements; "
                             "it cannot be split per parameter.")
    return states


def merge_zero3_param_states(fragment_dir: str, output_dir: str, logical_shape: Sequence[int]) -> List[str]:
    """Merge one parameter's per-rank fragments into its universal-checkpoint files.

    Args:
        fragment_dir: ``<tmp>/<parameter name>``, where the extractor wrote
            ``0/<state>.<dp rank>`` (tensor-parallel index 0) for each state of the parameter.
        output_dir: ``<output>/zero/<parameter name>``, created if missing.
        logical_shape: the parameter's shape (``ds_shape``); the fragments hold its elements
            without ZeRO padding, in data-parallel rank order.

    Writes ``<state>.pt`` for every state found: tensors as ``{"param": tensor}`` in the logical
    shape, ``step`` as the value itself (equal on every rank). Returns the state names written.

    Raises:
        ValueError: the fragments of a tensor state do not hold ``prod(logical_shape)`` elements.
    """
    from deepspeed.checkpoint.ds_to_universal import _merge_zero_shards  # upstream's merge of rank fragments
    found = {re.sub(r"\.[0-9]+$", "", os.path.basename(p)) for p in glob.glob(os.path.join(fragment_dir, "0", "*.*"))}
    os.makedirs(output_dir, exist_ok=True)
    numel = math.prod(logical_shape)
    for state in sorted(found):
        merged = _merge_zero_shards(fragment_dir, state, 1)[0]
        if state == STEP:
            torch.save(merged, os.path.join(output_dir, f"{state}.pt"))
            continue
        if merged.numel() != numel:
            raise ValueError(f"ds_to_universal: {os.path.basename(fragment_dir)}: the fragments of '{state}' hold "
                             f"{merged.numel()} elements, the parameter's shape {tuple(logical_shape)} "
                             f"{numel}.")
        torch.save({PARAM: merged.reshape(logical_shape)}, os.path.join(output_dir, f"{state}.pt"))
    return sorted(found)


# Loading (checkpoint.load_universal) into ZeRO-3 at any world size


def check_loaded_state(param: torch.nn.Parameter, folder: str, key: str, loaded: torch.Tensor, stored) -> None:
    """Refuse a universal-checkpoint state that does not fit its parameter.

    Args:
        param: the ZeRO-3 parameter (``ds_numel``, ``ds_shape``) the state is loaded for.
        folder: the parameter's folder in the checkpoint (named in the error).
        key: the state's name (``fp32``, ``momentum_buffer``, ``exp_avg``, ...).
        loaded: the state's elements for this rank's tensor-parallel shard, before ZeRO
            partitions them (any shape; its element count must be ``ds_numel``).
        stored: what the file holds (``{"param": tensor, ...}`` or a tensor). When that tensor
            is the whole ``loaded`` (no tensor-parallel or expert slicing) and has more than
            one dimension, its shape must be ``ds_shape``: a transposed matrix has the right
            element count and is still wrong.

    Raises:
        ValueError: naming the folder, the state and both shapes.
    """
    shape = tuple(param.ds_shape)
    whole = stored.get(PARAM) if isinstance(stored, dict) else stored
    stored_shape = tuple(whole.shape) if torch.is_tensor(whole) else (loaded.numel(), )
    whole_param = torch.is_tensor(whole) and whole.numel() == loaded.numel()
    misshapen = whole_param and whole.dim() > 1 and stored_shape != shape
    if loaded.numel() != param.ds_numel or misshapen:
        raise ValueError(f"Universal checkpoint {folder}: '{key}' has shape {stored_shape}, but the parameter has "
                         f"shape {shape} ({param.ds_numel} elements). The checkpoint does not belong to this model "
                         "(or this parameter's state was written wrong); refusing to load it.")


def _state_files(folder: str) -> Dict[str, str]:
    """``{state name: path}`` of the ``*.pt`` files in a parameter's folder."""
    return {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(folder, "*.pt"))}


def _sub_group_plan(folders: Dict[str, str], is_muon: bool, never_stepped: bool):
    """Which tensor states to load for one sub-group, and its step (None: none saved).

    Raises:
        ValueError: a parameter without a folder or ``fp32.pt``; a Muon matrix without
            ``momentum_buffer`` (once the optimizer has stepped) or an Adam parameter with one;
            parameters of one sub-group with different states or steps.
    """
    per_param = {}
    for name, folder in folders.items():
        files = _state_files(folder)
        if FP32 not in files:
            raise ValueError(f"Universal checkpoint: no fp32 weights for parameter '{name}' (expected {folder}/"
                             "fp32.pt). The checkpoint does not hold this model's parameters.")
        per_param[name] = files
        states = sorted(set(files) - {FP32, STEP})
        if is_muon and MOMENTUM not in files and not never_stepped:
            raise ValueError(f"Universal checkpoint: Muon parameter '{name}' has no {MOMENTUM} in {folder} (it holds "
                             f"{states or 'no optimizer state'}). Loading would restart its momentum from zero; "
                             "refusing. Convert a checkpoint of the same Muon run with ds_to_universal, or set "
                             "use_muon the way the checkpoint was trained.")
        if not is_muon and MOMENTUM in files:
            raise ValueError(f"Universal checkpoint: parameter '{name}' holds Muon's {MOMENTUM} in {folder}, but "
                             "this run optimizes it with Adam (use_muon False). Set use_muon (and the optimizer) as "
                             "the checkpoint was trained; refusing to drop its momentum.")
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
    """Set each parameter group's settings to the saved group's of the same index.

    Raises:
        ValueError: a different number of groups, or a group whose ``use_muon`` differs.
    """
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"Universal checkpoint: it has {len(saved_groups)} optimizer parameter groups, this run "
                         f"{len(param_groups)}; the groups must be the same to restore their settings.")
    for index, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        if "use_muon" in group and "use_muon" in saved and group["use_muon"] != saved["use_muon"]:
            raise ValueError(f"Universal checkpoint: parameter group {index} has use_muon={saved['use_muon']} in the "
                             f"checkpoint and use_muon={group['use_muon']} in this run.")
        for key, value in saved.items():
            if key != "params":
                group[key] = value


def restore_zero3_optimizer_state(optimizer, zero_dir: str, optim_sd: dict) -> None:
    """Load the fp32 partitions, the optimizer states and the group settings of a universal
    checkpoint into a ZeRO-3 optimizer at its own world size.

    Every sub-group's flat fp32 partition and each state its parameters hold in the checkpoint
    (``momentum_buffer`` of Muon sub-groups, ``exp_avg``/``exp_avg_sq`` of Adam ones; copied into
    the state's tensor where it has one of that size, so that it keeps its dtype and device) are
    rebuilt from the parameters' folders, partitioned for this rank by upstream's
    ``load_hp_checkpoint_state``; the step count is set where the checkpoint has one; each
    optimizer parameter group gets the saved settings of the group with the same index.

    Args:
        optimizer: ``DeepSpeedZeroOptimizer_Stage3``.
        zero_dir: the checkpoint's ``zero/`` folder.
        optim_sd: the checkpoint's ``zero/optimizer_state.pt``.

    Raises:
        ValueError: missing or misshapen state (see ``_sub_group_plan``, ``check_loaded_state``),
            or parameter groups that do not match (``_restore_param_groups``).
    """
    saved = optim_sd[OPTIMIZER_STATE_DICT]
    never_stepped = not saved.get("state")
    muon_sub_groups = optimizer.sub_groups_using_muon if getattr(optimizer, "use_muon", False) else None
    for sub_group_id, params in enumerate(optimizer.fp16_groups):
        missing = [p for p in params if p not in optimizer.param_names]
        if missing:
            raise ValueError(f"ZeRO-3 universal checkpoint load: {len(missing)} parameter(s) of sub-group "
                             f"{sub_group_id} have no name in the model.")
        names = [optimizer.param_names[p] for p in params]
        folders = {name: os.path.join(zero_dir, name) for name in names}
        is_muon = bool(muon_sub_groups and muon_sub_groups[sub_group_id])
        keys, step = _sub_group_plan(folders, is_muon, never_stepped)
        fp32_partition = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        for key in (FP32, *keys):
            flat = torch.zeros_like(fp32_partition)
            offset = 0
            for param, name in zip(params, names):
                part = optimizer.load_hp_checkpoint_state(folders[name], key, param=param)
                flat.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
            if key == FP32:
                fp32_partition.data.copy_(flat)
                continue
            state = optimizer.optimizer.state.setdefault(fp32_partition, {})
            current = state.get(key)
            if torch.is_tensor(current) and current.shape == flat.shape:
                # In place: the Muon momentum may also be held elsewhere (the in-memory table of
                # save_muon_momentum_buffer_in_memory) and keeps its dtype and device.
                current.copy_(flat)
            else:
                state[key] = flat
        if step is not None:
            optimizer.optimizer.state.setdefault(fp32_partition, {})[STEP] = step
    _restore_param_groups(optimizer.optimizer.param_groups, saved[PARAM_GROUPS])


# Regular checkpoints at another world size
