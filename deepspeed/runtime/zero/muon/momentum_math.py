# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Upstream ``muon_update`` run on ZeRO-3 partitions: its two halves, and where each one runs.

Upstream ``deepspeed.runtime.zero.muon.original_muon.muon_update`` (Keller Jordan's Muon,
https://kellerjordan.github.io/posts/muon/) is the composition of

1. ``muon_momentum_step_``: elementwise; advances the momentum where the gradient is finite and
   returns the Newton-Schulz (NS) input (the Nesterov blend, or the momentum);
2. ``muon_orthogonalize``: NS on the whole matrix, times the aspect-ratio scale, on the problems
   ``muon_ns_problem`` describes;

then a cast to the gradient dtype, and ``where(finite, update, grad)``.

Under ZeRO-3 each rank runs step 1 on its own partition of the gradient and of the momentum
(``momentum_step_``), so the momentum never travels; only step 2 needs the whole matrix, and
the owner rank runs it on the NS input reassembled from every rank's partition. The finite flag
is one per matrix, agreed over the ranks (``all_finite_flags`` reduced with MIN). For a
non-finite matrix the owner sends back what it received, which is the (in-place blended)
gradient ``muon_update`` returns for it.

``tests/unit/runtime/zero/test_zero3_muon_math.py`` checks that these pieces, run on partitions,
give bit for bit what ``muon_update`` gives on the whole matrix, finite and non-finite.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec

MOMENTUM_KEY = "momentum_buffer"
"""Optimizer-state key of the Muon momentum, as upstream ``MuonWithAuxAdam`` stores it (checkpoints keep it)."""


@dataclass(frozen=True)
class MuonSettings:
    """A Muon parameter group's settings, with upstream ``muon_update``'s defaults.

    Attributes:
        momentum: beta of the momentum (the group's ``momentum``; required).
        nesterov: Nesterov blend of gradient and momentum (default True).
        ns_method: Newton-Schulz kernel, "gram" or "standard" (default "gram").
        ns_steps: Newton-Schulz iterations (default 5).
    """
    momentum: float
    nesterov: bool
    ns_method: str
    ns_steps: int

    @classmethod
    def of(cls, param_group: dict) -> "MuonSettings":
        """Raises: KeyError: the group has no ``momentum``."""
        return cls(momentum=param_group["momentum"],
                   nesterov=param_group.get("nesterov", True),
                   ns_method=param_group.get("ns_method", "gram"),
                   ns_steps=param_group.get("ns_steps", 5))


def newton_schulz_problem(shape: Sequence[int], is_expert_group: bool, num_heads) -> Tuple[int, int, int]:
    """``original_muon.muon_ns_problem`` for a Muon parameter, with errors that name its config keys.

    Args:
        shape: the parameter's full shape (``param.ds_shape``).
        is_expert_group: ``param.is_expert_group``.
        num_heads: ``param.muon_num_heads`` (set by ``per_head_muon``), or ``None``.

    Returns:
        ``(batch, rows, cols)``: the NS problems the owner will run for this parameter.

    Raises:
        ValueError: for a parameter with fewer than 2 dimensions, or ``muon_num_heads`` on a
            tensor that is not 2-D, on rows it does not divide, or on a DeepSpeed release without
            per-head Muon (0.19.7).
    """
    try:
        return original_muon.muon_ns_problem(shape, is_expert_group, num_heads)
    except ValueError as e:
        if num_heads is None:
            raise ValueError(f"{e} Only parameters with `use_muon = True` and at least 2 dimensions belong in a "
                             "Muon group.") from e
        raise ValueError(f"muon_num_heads={num_heads} (optimizer params: per_head_muon) on a parameter of shape "
                         f"{tuple(shape)}: {e}") from e


def matrix_spec(param, shape: Sequence[int], partition_numel: int, ns_method: str) -> MatrixSpec:
    """The Newton-Schulz description of one Muon parameter, for the owner plan and ``orthogonalize``.

    Args:
        param: the parameter (its ``is_expert_group`` and ``muon_num_heads`` tags are read).
        shape: its full shape (ZeRO-3: ``ds_shape``).
        partition_numel: elements of it that each rank holds (the whole ``numel`` where a rank
            orthogonalizes the whole parameter).
        ns_method: the parameter group's ``ns_method``.

    Raises:
        ValueError: see ``newton_schulz_problem``.
    """
    shape = tuple(shape)
    is_expert_group = bool(getattr(param, "is_expert_group", False))
    num_heads = getattr(param, "muon_num_heads", None)
    return MatrixSpec(shape=shape,
                      partition_numel=partition_numel,
                      ns_method=ns_method,
                      is_expert_group=is_expert_group,
                      num_heads=num_heads,
                      ns_problem=newton_schulz_problem(shape, is_expert_group, num_heads))


def momentum_step_(grad_flat: torch.Tensor, momentum_flat: torch.Tensor, slices: Sequence[Tuple[int, int]],
                   beta: float, nesterov: bool, finite: torch.Tensor) -> List[torch.Tensor]:
    """``muon_momentum_step_`` on this rank's partition of each matrix of a sub-group, in place,
    without reading ``finite`` on the host.

    The momentum of a matrix whose whole gradient is finite advances by ``lerp(grad, 1 - beta)``,
    bit for bit as upstream's; where it is not, ``lerp`` toward the momentum itself leaves it
    exactly unchanged, which is what upstream's ``where(finite, lerp, momentum)`` gives. One
    matrix at a time, so the temporary this needs is one partition, not the whole flat partition
    (a mask and a blend over all of it would cost 5 bytes per element of the partition at once).

    Args:
        grad_flat: the sub-group's flat gradient partition (1-D, fp32), already unscaled (loss
            scale) and clipped. With Nesterov overwritten with the NS input.
        momentum_flat: the sub-group's momentum partition, same layout; advanced in place where
            the matrix is finite.
        slices: per matrix, ``(offset, numel)`` of its partition in the flat partitions.
        beta: the Muon momentum coefficient (the parameter group's ``momentum``).
        nesterov: the group's ``nesterov`` (DeepSpeed's Muon always uses the default, True).
        finite: per matrix, whether the WHOLE matrix's gradient is finite, agreed over ranks
            (bool or int tensor of shape ``(len(slices),)`` on the partitions' device).

    Returns:
        list of 1-D tensors, per matrix what this rank sends its owner: the NS input, from which
        the owner selects the gradient for a non-finite matrix (``muon_update`` returns the
        gradient for it). With Nesterov they are views of ``grad_flat``, which then holds the
        blend for every matrix as upstream's in-place ``lerp_`` leaves it; without, new tensors
        holding the momentum of a finite matrix and the gradient of another.
    """
    sent, finite = [], finite.to(torch.bool)
    for j, (offset, numel) in enumerate(slices):
        grad, momentum, flag = grad_flat.narrow(0, offset, numel), momentum_flat.narrow(0, offset, numel), finite[j]
        momentum.lerp_(torch.where(flag, grad, momentum), 1 - beta)
        sent.append(grad.lerp_(momentum, beta) if nesterov else torch.where(flag, momentum, grad))
    return sent


def all_finite_flags(partitions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per partition, whether it is free of inf and nan.

    Args:
        partitions: this rank's gradient partitions, one per matrix (any shapes, one device).

    Returns:
        torch.Tensor: int32 tensor of shape ``(len(partitions),)``, 1 where finite, 0 otherwise,
        on the partitions' device. Reduce it over ranks with MIN to get the whole-matrix flags.
    """
    if not partitions:
        return torch.ones(0, dtype=torch.int32)
    return torch.stack([torch.isfinite(p).all() for p in partitions]).to(torch.int32)


CPU_BATCH_MAX_ELEMENTS = 96 * 96
"""Largest Newton-Schulz problem (rows x cols) that ``orthogonalize`` batches on the CPU by
default. Measured with one thread (a benchmark rank's share of this 2-core host; torch 2.13, fp32,
``bench/ns_batch.py``): 8 problems in one call take 0.62x the time of 8 calls at 64x64 and 0.84x
at 96x96, but 0.93x to 1.20x at 128x128 (noisy), 1.13x at 256x256 and 1.25x at 1024x1024: once one
matrix keeps the core busy, the batched matmul is the slower kernel here. On an accelerator a batch
saves kernel launches and fills the device, so every size is batched there."""


def batches(rows: int, cols: int, device: torch.device) -> bool:
    """Whether ``orthogonalize`` batches problems of ``rows x cols`` on ``device`` by default."""
    return torch.device(device).type != "cpu" or rows * cols <= CPU_BATCH_MAX_ELEMENTS


def orthogonalize(matrices: Sequence[torch.Tensor], specs: Sequence, ns_steps: int, ns_method: str, dtype: torch.dtype,
                  finite: Sequence[torch.Tensor], batch: Optional[bool] = None) -> List[torch.Tensor]:
    """The owner's half of ``muon_update`` for the matrices it holds in one bucket.

    With ``batch``, matrices whose Newton-Schulz problems have the same ``(rows, cols)``
    (``MatrixSpec.ns_problem``) are orthogonalized in one call on their stack: upstream's kernels
    are batched over leading dimensions (expert groups and per-head Muon use that already), and
    each problem of the batch is normalized and iterated on its own, so the batch changes no
    problem's math; the matmuls may run with another blocking. A matrix alone in its group runs
    upstream's ``muon_orthogonalize`` exactly as ``muon_update`` does.

    Args:
        matrices: the whole NS inputs (each of its parameter's ``ds_shape``), not modified.
        specs: per matrix its ``owner_plan.MatrixSpec`` (``ns_problem``, ``is_expert_group``,
            ``num_heads``).
        ns_steps, ns_method: the parameter group's Newton-Schulz settings.
        dtype: dtype of the results (``ns_compute_dtype(ns_method)``: sent back without loss).
        finite: per matrix, a 0-d bool tensor on the device: whether its whole gradient is
            finite; where not, the result is the input itself (what ``muon_update`` returns), cast
            to ``dtype``.
        batch: True groups same-shape problems into one call, False makes one call per matrix,
            None (default) groups where ``batches`` says it pays on the matrices' device.

    Returns:
        list of tensors in ``dtype``, one per matrix, each with its matrix's shape.
    """
    groups = {}
    for k, (spec, matrix) in enumerate(zip(specs, matrices)):
        _, rows, cols = spec.ns_problem
        grouped = batches(rows, cols, matrix.device) if batch is None else batch
        groups.setdefault((rows, cols) if grouped else k, []).append(k)
    updates: List[torch.Tensor] = [None] * len(matrices)
    for members in groups.values():
        if len(members) == 1:
            spec = specs[members[0]]
            results = [
                original_muon.muon_orthogonalize(matrices[members[0]], ns_steps, ns_method, spec.is_expert_group,
                                                 spec.num_heads, dtype)
            ]
        else:
            _, rows, cols = specs[members[0]].ns_problem
            stack = torch.cat([matrices[k].reshape(-1, rows, cols) for k in members])
            results = original_muon.muon_orthogonalize(stack, ns_steps, ns_method, True, None, dtype).split(
                [specs[k].ns_problem[0] for k in members])
        for k, result in zip(members, results):
            matrix, update = matrices[k], result.reshape(matrices[k].shape)
            updates[k] = torch.where(finite[k], update, matrix.to(dtype), out=update)  # in place: no copy
    return updates
