# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's momentum from a universal checkpoint at ZeRO stage 1 or 2 (``"checkpoint":
{"load_universal": true}``), in particular one converted from ZeRO-3 (the format is described in
``deepspeed.checkpoint.zero3_universal``).

The stage-1/2 universal loader (``load_hp_checkpoint_state_from_checkpoint_dir``) restores every
optimizer state file of a parameter's folder as this rank's fragment of the fp32 partition, so
each state ends up in the *partition layout*: a flat tensor shaped like the group's fp32
partition. That is right for Adam's ``exp_avg`` / ``exp_avg_sq`` and for Muon's momentum where
the stage keeps it so, but not where ZeRO-1/2 keeps Muon's momentum itself:

- ``DeepSpeedZeroOptimizer`` without optimizer offload keeps, per Muon parameter group,
  ``state[fp32 partition]["momentum_buffer"]``: the *whole* momentum of every parameter that
  overlaps the rank's partition (``params_in_partition[group]``), flattened and concatenated in
  that order, so a matrix split between two ranks has its full momentum on both (both run the
  same update on the all-reduced gradient). The loader puts a partition-sized tensor there
  instead, which the update would then read at the wrong offsets (or past its end).
  ``restore_momentum`` rebuilds the buffer from the checkpoint's per-parameter
  ``momentum_buffer.pt`` files.
- ``DeepSpeedZeroOptimizer`` with ``offload_optimizer`` and ``BF16_Optimizer`` (bf16 with
  ``data_types.grad_accum_dtype`` fp32 at stage 1) keep it in the partition layout, and the
  loader restores it as it is.
- Where the installed release's stage 1/2 with ``offload_optimizer`` has never been tested
  restoring the momentum (``unsupported_reason``), loading refuses, naming the stage and the
  config key.

A Muon variant's owner state (NorMuon's per-row second moment, ``owner_state``) is saved per
parameter in its broadcast form (every element holds its row's value, the parameter's shape).
ZeRO-1/2 keep it per row (``zero12_update``): without offload for every whole matrix of
``params_in_partition``, with offload for the matrices the rank owns in its pipeline's owner
plan. ``restore_momentum`` rebuilds that from the per-parameter files too, for whichever plan
this run has, so a ZeRO-3 NorMuon run resumes at ZeRO-1/2 with its state exact.

In every case a Muon parameter whose folder has no ``momentum_buffer.pt`` (or, in a variant's
group, no variant state file) is refused rather than restarted from zero, and the checkpoint's
parameter groups must pair with the engine's one to one with the same ``use_muon`` (the loader
pairs them by position and copies every setting over): ``universal_state_checks``.
"""

import os
from typing import Dict, List, Optional

import torch

from deepspeed.checkpoint.zero3_universal import FP32, STEP, check_state_fits, state_files
from deepspeed.runtime.zero.muon.momentum import MuonSettings
from deepspeed.runtime.zero.muon.newton_schulz import matrix_spec
from deepspeed.runtime.zero.muon.owner_state import variant_of
from deepspeed.runtime.zero.muon.universal_state_checks import (MOMENTUM as MOMENTUM_KEY, check_muon_groups_pair,
                                                                check_muon_state, check_variant_state)

OPTIMIZER_STATE_FILE = "optimizer_state.pt"
"""The universal checkpoint's global optimizer state, ``<checkpoint>/zero/optimizer_state.pt``."""


def _is_muon(optimizer) -> bool:
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return isinstance(optimizer, MuonWithAuxAdam)


def _stage_name(zero_optimizer) -> str:
    return "ZeRO stage 2" if getattr(zero_optimizer, "partition_gradients", False) else "ZeRO stage 1"


def _muon_group_indices(base_optimizer) -> List[int]:
    return [i for i, group in enumerate(base_optimizer.param_groups) if group.get("use_muon", False)]


OFFLOAD_UNTESTED_RELEASES = ("0.19.7", )
"""Releases whose stage 1/2 with ``offload_optimizer`` is not tested restoring a checkpoint's Muon
momentum: ``unsupported_reason`` refuses there rather than train on an unchecked momentum."""


def _deepspeed_base_version() -> str:
    """The installed DeepSpeed's release without local version labels (``"X.Y.Z"`` for
    ``X.Y.Z+label``). Stage 1/2 under offload keep the momentum in the same layout on every
    release, so only the release tells where restoring it is untested."""
    from packaging import version
    from deepspeed.git_version_info import version as deepspeed_version
    return version.parse(deepspeed_version).base_version


def unsupported_reason(zero_optimizer) -> Optional[str]:
    """Why this optimizer cannot take a checkpoint's Muon momentum, or None if it can.

    Args:
        zero_optimizer: a ``DeepSpeedZeroOptimizer`` (stage 1/2) or a ``BF16_Optimizer``.

    Returns:
        a sentence naming the stage, the config key and the release for stage 1/2 with
        ``offload_optimizer`` on a release of ``OFFLOAD_UNTESTED_RELEASES``; None otherwise (a
        ``BF16_Optimizer`` that runs Muon keeps the momentum in the partition layout, which the
        loader restores).
    """
    base = zero_optimizer.optimizer
    if not _is_muon(base) or not _muon_group_indices(base):
        return None
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    if isinstance(zero_optimizer, BF16_Optimizer):
        return None
    release = _deepspeed_base_version()
    if getattr(zero_optimizer, "cpu_offload", False) and release in OFFLOAD_UNTESTED_RELEASES:
        return (f"{_stage_name(zero_optimizer)} with zero_optimization.offload_optimizer cannot restore a "
                f"checkpoint's Muon momentum in this DeepSpeed version ({release}). Load it without "
                "offload_optimizer, or at ZeRO stage 3.")
    return None


def _momentum_layout_is_whole_params(zero_optimizer) -> bool:
    """True where the momentum is ``params_in_partition``'s whole parameters concatenated
    (``DeepSpeedZeroOptimizer`` without offload); False for the partition layout."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    return not isinstance(zero_optimizer, BF16_Optimizer) and not getattr(zero_optimizer, "cpu_offload", False)


def _lp_groups(zero_optimizer):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    return zero_optimizer.bf16_groups if isinstance(zero_optimizer, BF16_Optimizer) else zero_optimizer.bit16_groups


def _never_stepped(zero_optimizer, zero_folder) -> bool:
    """Whether the checkpoint holds no optimizer state for any of this engine's parameters (saved
    before the first optimizer step): every parameter folder has only ``fp32.pt`` (and ``step.pt``)."""
    for group in _lp_groups(zero_optimizer):
        for lp in group:
            folder = os.path.join(zero_folder, zero_optimizer.param_names[lp])
            if set(state_files(folder)) - {FP32, STEP}:
                return False
    return True


def check_before_load(zero_optimizer, checkpoint_folder) -> None:
    """Refuse, before anything is loaded, a universal checkpoint whose Muon state cannot be restored.

    Args:
        zero_optimizer: a ``DeepSpeedZeroOptimizer`` (stage 1/2) or a ``BF16_Optimizer``.
        checkpoint_folder: the universal checkpoint (holding ``zero/``).

    Raises:
        ValueError: ``unsupported_reason``; the checkpoint's parameter groups do not pair with
            the engine's (``check_muon_groups_pair``: the loader pairs them by position); a Muon
            parameter's folder has no ``momentum_buffer.pt`` although the checkpoint holds
            optimizer state (one saved before the first step has none, and loads as a fresh
            start), or an Adam parameter's has one (``check_muon_state``); a parameter of a
            variant's group without the variant's state file, or one of a plain Muon group with
            it (``check_variant_state``).
    """
    base = zero_optimizer.optimizer
    if not _is_muon(base):
        return
    reason = unsupported_reason(zero_optimizer)
    if reason is not None:
        raise ValueError(f"Cannot load the universal checkpoint {checkpoint_folder}: {reason}")
    zero_folder = os.path.join(checkpoint_folder, "zero")
    saved = torch.load(os.path.join(zero_folder, OPTIMIZER_STATE_FILE), map_location="cpu", weights_only=False)
    check_muon_groups_pair(base.param_groups, saved.get("param_groups", []))
    never_stepped = _never_stepped(zero_optimizer, zero_folder)
    for group, lp_group in zip(base.param_groups, _lp_groups(zero_optimizer)):
        for lp in lp_group:
            name = zero_optimizer.param_names[lp]
            folder = os.path.join(zero_folder, name)
            files = state_files(folder)
            check_muon_state(name, folder, files, bool(group.get("use_muon", False)), never_stepped)
            if not never_stepped:
                check_variant_state(name, folder, files, group)


def _load_state(zero_folder, name, param, key=MOMENTUM_KEY) -> torch.Tensor:
    """``<zero_folder>/<name>/<key>.pt`` as a flat fp32 tensor of ``param.numel()`` elements.

    Raises:
        ValueError: the saved state does not have the parameter's shape (``check_state_fits``).
    """
    folder = os.path.join(zero_folder, name)
    saved = torch.load(os.path.join(folder, f"{key}.pt"), map_location="cpu", weights_only=False)
    tensor = saved["param"] if isinstance(saved, dict) else saved
    check_state_fits(folder, key, param.shape, tensor, saved)
    return tensor.detach().reshape(-1).to(torch.float32)


def _load_rows(zero_folder, name, param, variant, spec) -> torch.Tensor:
    """A parameter's variant state per row (``variant.state_rows(spec)``: 1-D fp32, one value per
    row) from its broadcast form in ``<zero_folder>/<name>/<variant.state_key>.pt``.

    Raises:
        ValueError: the file does not have the parameter's shape, or the values of a row differ
            (not a broadcast per-row state: another variant's, or a damaged file).
    """
    broadcast = _load_state(zero_folder, name, param, variant.state_key)
    rows, cols = variant.state_rows(spec)
    per_row = broadcast.view(rows, cols)
    if not torch.equal(per_row, per_row[:, :1].expand(rows, cols)):
        raise ValueError(f"Universal checkpoint: {os.path.join(zero_folder, name, variant.state_key)}.pt is not "
                         f"{variant.name}'s per-row state of '{name}' ({rows} rows of {cols} equal values).")
    return per_row[:, 0].clone()


def _restore_variant_state(zero_optimizer, zero_folder, group_idx: int, state: dict) -> None:
    """Replace the partition-layout variant state the loader put in ``state`` with the per-row
    state this run's ZeRO-1/2 keeps (``zero12_update``): without offload the rows of every matrix
    of ``params_in_partition`` in order, with offload those of the matrices this rank owns in its
    pipeline, in the owner state's order, with their indices under ``<state_key>_matrices``."""
    group = zero_optimizer.optimizer.param_groups[group_idx]
    variant = variant_of(group)
    if variant is None:
        return
    key = variant.state_key
    for lp in _lp_groups(zero_optimizer)[group_idx]:
        mapping = getattr(lp, "_hp_mapping", None)
        if mapping is not None and mapping.optim_fragment:
            mapping.optim_fragment.pop(key, None)
    state.pop(key, None)
    names = zero_optimizer.param_names
    pipeline = zero_optimizer.zero12_muon.pipelines.get(group_idx)
    if pipeline is None:
        ns_method = MuonSettings.of(group).ns_method
        params = zero_optimizer.params_in_partition[group_idx]
        if params:
            state[key] = torch.cat([
                _load_rows(zero_folder, names[p], p, variant, matrix_spec(p, p.shape, ns_method)) for p in params
            ]).to(group["params"][0].device)
        return
    owner = pipeline.owner_state
    params = zero_optimizer.round_robin_bit16_groups[group_idx]
    rows = torch.zeros(owner.numel, dtype=torch.float32)
    for j, (offset, n) in owner.spans.items():
        rows.narrow(0, offset, n).copy_(_load_rows(zero_folder, names[params[j]], params[j], variant, owner.specs[j]))
    state[key] = rows.to(owner.flat.device)
    state[key + "_matrices"] = torch.tensor(sorted(owner.spans), dtype=torch.float32)


def restore_momentum(zero_optimizer, checkpoint_folder) -> None:
    """After the stage's universal loader: put each Muon group's momentum in the layout the stage reads.

    A Muon variant's state (``_restore_variant_state``) is rebuilt per row in either layout.

    For ``DeepSpeedZeroOptimizer`` without offload, per Muon group with parameters in this rank's
    partition, ``state[fp32 partition]["momentum_buffer"]`` becomes the fp32 concatenation of the
    whole saved momentum of ``params_in_partition[group]`` (``sum(numel)`` elements, on the
    partition's device), and the partition-layout views the loader linked into the
    parameters' ``_hp_mapping.optim_fragment`` are dropped (they pointed at the replaced tensor;
    a fresh engine links none either, its momentum not being partition-shaped). A group with no
    parameter here, or a checkpoint saved before the first step, gets no momentum, as in a fresh
    engine. Elsewhere (partition layout) the loader already restored it; this only checks
    that it is there.

    Raises:
        RuntimeError: a Muon group ended up without momentum where the stage expects one.
    """
    base = zero_optimizer.optimizer
    if not _is_muon(base):
        return
    zero_folder = os.path.join(checkpoint_folder, "zero")
    if _never_stepped(zero_optimizer, zero_folder):
        return
    for i in _muon_group_indices(base):
        flat = base.param_groups[i]["params"][0]
        state = base.state[flat]
        _restore_variant_state(zero_optimizer, zero_folder, i, state)
        if not _momentum_layout_is_whole_params(zero_optimizer):
            got = state.get(MOMENTUM_KEY)
            if got is None or got.shape != flat.shape:
                raise RuntimeError(f"Muon parameter group {i}: the universal loader restored no {MOMENTUM_KEY} of "
                                   f"the partition's shape {tuple(flat.shape)} (got "
                                   f"{'none' if got is None else tuple(got.shape)}).")
            continue
        for lp in _lp_groups(zero_optimizer)[i]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is not None and mapping.optim_fragment:
                mapping.optim_fragment.pop(MOMENTUM_KEY, None)
        params = zero_optimizer.params_in_partition[i]
        if not params:
            state.pop(MOMENTUM_KEY, None)
            continue
        pieces = [_load_state(zero_folder, zero_optimizer.param_names[p], p) for p in params]
        state[MOMENTUM_KEY] = torch.cat(pieces).to(flat.device)


def momentum_by_name(zero_optimizer) -> Dict[str, torch.Tensor]:
    """This rank's Muon momentum per parameter name, as the stage will use it at the next step.

    Whole-parameter layout: every parameter of ``params_in_partition`` of each Muon group, the
    full tensor in the parameter's shape. Partition layout: this rank's fragment of each
    parameter, flat (``_hp_mapping`` addresses). fp32 CPU copies; an empty dict before the
    momentum exists.
    """
    base = zero_optimizer.optimizer
    out = {}
    for i in _muon_group_indices(base) if _is_muon(base) else []:
        flat = base.param_groups[i]["params"][0]
        momentum = base.state.get(flat, {}).get(MOMENTUM_KEY)
        if momentum is None:
            continue
        if _momentum_layout_is_whole_params(zero_optimizer):
            offset = 0
            for p in zero_optimizer.params_in_partition[i]:
                out[zero_optimizer.param_names[p]] = momentum.narrow(0, offset, p.numel()).view(p.shape).float().cpu()
                offset += p.numel()
        else:
            for lp in _lp_groups(zero_optimizer)[i]:
                mapping = getattr(lp, "_hp_mapping", None)
                if mapping is not None:
                    address = mapping.get_hp_fragment_address()
                    out[zero_optimizer.param_names[lp]] = momentum.narrow(0, address.start,
                                                                          address.numel).float().cpu()
    return out
