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

from typing import List, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon import original_muon


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


def momentum_step_(grad_flat: torch.Tensor, momentum_flat: torch.Tensor, slices: Sequence[Tuple[int, int]],
                   beta: float, nesterov: bool, finite: Sequence[bool]) -> List[torch.Tensor]:
    """``muon_momentum_step_`` on this rank's partition of each matrix of a sub-group, in place.

    Args:
        grad_flat: the sub-group's flat gradient partition (1-D, fp32), already unscaled (loss
            scale) and clipped. With Nesterov overwritten with the NS input.
        momentum_flat: the sub-group's momentum partition, same layout; advanced in place where
            the matrix is finite.
        slices: per matrix, ``(offset, numel)`` of its partition in the flat partitions.
        beta: the Muon momentum coefficient (the parameter group's ``momentum``).
        nesterov: the group's ``nesterov`` (DeepSpeed's Muon always uses the default, True).
        finite: per matrix, whether the WHOLE matrix's gradient is finite, agreed over ranks.

    Returns:
        list of 1-D tensors, per matrix what this rank sends its owner: the NS-input partition for
        a finite matrix, the gradient partition (what ``muon_update`` returns) for a non-finite
        one. They are views of ``grad_flat`` or ``momentum_flat``; nothing is copied.
    """
    if all(finite):  # one elementwise pass over the whole flat partition
        ns_input = original_muon.muon_momentum_step_(grad_flat, momentum_flat, beta, nesterov, True)
        return [ns_input.narrow(0, offset, numel) for offset, numel in slices]
    to_owner = []
    for (offset, numel), matrix_finite in zip(slices, finite):
        grad = grad_flat.narrow(0, offset, numel)
        ns_input = original_muon.muon_momentum_step_(grad, momentum_flat.narrow(0, offset, numel), beta, nesterov,
                                                     bool(matrix_finite))
        to_owner.append(ns_input if matrix_finite else grad)
    return to_owner


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
