# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Upstream ``muon_update`` taken apart at the point where it needs the whole matrix.

Upstream ``deepspeed.runtime.zero.muon.original_muon.muon_update(grad, momentum, beta, ns_steps,
nesterov, ns_method, is_expert_group, num_heads)`` (Keller Jordan's Muon,
https://kellerjordan.github.io/posts/muon/) does, for one whole matrix:

1. ``finite = isfinite(grad).all()``;
2. ``momentum = where(finite, momentum.lerp(grad, 1 - beta), momentum)``;
3. ``x = grad.lerp_(momentum, beta)`` with Nesterov, else ``x = momentum``;
4. ``update = NS(x) * aspect_ratio_scale`` (per head, batched for expert groups, conv weights
   flattened), cast to ``grad.dtype``;
5. returns ``where(finite, update, grad)``.

Steps 2 and 3 are elementwise, so under ZeRO-3 each rank runs them on its own partition of the
gradient and of the momentum (``momentum_and_ns_input_``): the momentum never has to travel.
Only step 4 needs the whole matrix; the owner rank runs it (``orthogonalize``) on the NS input it
reassembles from every rank's partition. Step 1 needs one flag per matrix that every rank agrees
on (the binding reduces the flags over ranks). Step 5: for a non-finite matrix the result is
``x`` itself, which is exactly what the owner returns when it skips NS.

``tests/unit/runtime/zero/test_zero3_muon_math.py`` checks that these pieces, run on partitions,
give what ``muon_update`` gives on the whole matrix, finite and non-finite.
"""

import math
from typing import Optional, Sequence

import torch

from deepspeed.runtime.zero.muon import original_muon


def momentum_and_ns_input_(grad: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool,
                           finite: bool) -> torch.Tensor:
    """Steps 2-3 of ``muon_update`` on a partition, in place: advance the momentum, form the NS input.

    Args:
        grad: this rank's partition of the accumulated gradient, already unscaled (loss scale)
            and clipped; any shape, usually 1-D, fp32. Overwritten with the NS input.
        momentum: the matching partition of the momentum buffer, same shape, fp32. Advanced in
            place by ``lerp(grad, 1 - beta)`` if ``finite``, left alone otherwise.
        beta: the Muon momentum coefficient (the parameter group's ``momentum``).
        nesterov: use the Nesterov blend ``lerp(grad, momentum, beta)`` as NS input (upstream's
            default and the only mode DeepSpeed uses); else the momentum itself.
        finite: whether the WHOLE matrix's gradient is finite, agreed over all ranks.

    Returns:
        torch.Tensor: ``grad``, now holding this partition of the NS input (for a non-finite
        matrix: what ``muon_update`` returns for it).
    """
    if finite:
        momentum.lerp_(grad, 1 - beta)
    if nesterov:
        grad.lerp_(momentum, beta)
    elif finite:
        grad.copy_(momentum)
    return grad


def aspect_ratio_scale(rows: int, cols: int) -> float:
    """``sqrt(max(1, rows / cols))``, the factor Muon multiplies the orthogonalized update by.

    Uses the base's own helper (``_aspect_ratio_scale`` in DeepSpeed 0.19.8), or the expression
    0.19.7 writes inline, so the result is bit-identical to ``muon_update`` on either base.
    """
    upstream = getattr(original_muon, "_aspect_ratio_scale", None)
    if upstream is not None:
        return upstream(rows, cols)
    return max(1, rows / cols)**0.5


def _ns_kernel(ns_method: str):
    # Looked up on every call, as muon_update does, so wrappers installed on the module (e.g.
    # counters in tests and benchmarks) see the calls.
    if ns_method == "gram":
        return original_muon.zeropower_via_gram_newtonschulz
    return original_muon.zeropower_via_newtonschulz5


def ns_output_dtype(ns_method: str) -> torch.dtype:
    """The dtype upstream's Newton-Schulz kernels return for ``ns_method`` on this accelerator.

    ``gram`` computes in fp16 where the accelerator supports fp16, ``standard`` in bf16 where it
    supports bf16, else fp32 (upstream ``ns_compute_dtype``; 0.19.7 has the same rule inline).
    The owner sends the orthogonalized update back in this dtype: that is the precision the
    update has before ``muon_update`` casts it to the gradient dtype, so nothing is lost.
    """
    upstream = getattr(original_muon, "ns_compute_dtype", None)
    if upstream is not None:
        return upstream(ns_method)
    from deepspeed.accelerator import get_accelerator
    if ns_method == "gram":
        return torch.float16 if get_accelerator().is_fp16_supported() else torch.float32
    return torch.bfloat16 if get_accelerator().is_bf16_supported() else torch.float32


def check_per_head_available() -> None:
    """Raise ``ValueError`` if this DeepSpeed base has no per-head Muon (0.19.7 has none; 0.19.8's
    is ``original_muon._per_head_orthogonalize``)."""
    if getattr(original_muon, "_per_head_orthogonalize", None) is None:
        raise ValueError("muon_num_heads is set on a parameter, but this DeepSpeed base has no per-head "
                         "Muon; unset per_head_muon in the optimizer params.")


def orthogonalize(x: torch.Tensor,
                  ns_method: str = "gram",
                  ns_steps: int = 5,
                  is_expert_group: bool = False,
                  num_heads: Optional[int] = None) -> torch.Tensor:
    """Step 4 of ``muon_update``: Newton-Schulz on the whole NS input, times the aspect-ratio scale.

    Same dispatch as upstream ``muon_update``: with ``num_heads`` the rows are split into heads
    and each head is orthogonalized on its own (0.19.8's ``_per_head_orthogonalize``); an expert
    group is batched over its leading dimensions; a 4-D convolution weight is flattened to
    ``(out_channels, -1)`` and scaled by its last two dimensions, as upstream does.

    Args:
        x: the whole NS input, shape ``param.ds_shape`` (at least 2-D), fp32 (or the gradient
            dtype). Not modified.
        ns_method: ``"gram"`` (upstream ``zeropower_via_gram_newtonschulz``) or ``"standard"``
            (``zeropower_via_newtonschulz5``).
        ns_steps: Newton-Schulz iterations.
        is_expert_group: batch NS over the leading dimensions.
        num_heads: orthogonalize each of ``num_heads`` row blocks separately.

    Returns:
        torch.Tensor: the update with ``x.numel()`` elements (2-D for conv weights, else
        ``x``'s shape), in ``ns_output_dtype(ns_method)``; the caller casts.

    Raises:
        ValueError: ``num_heads`` given for a tensor that is not 2-D, or that does not divide
            the rows; or ``num_heads`` on a base without per-head Muon (0.19.7).
    """
    ns_fn = _ns_kernel(ns_method)
    if num_heads is not None:
        check_per_head_available()
        if x.ndim != 2 or num_heads < 1 or x.shape[0] % num_heads:
            raise ValueError(f"per-head Muon needs a 2-D projection whose rows divide into muon_num_heads="
                             f"{num_heads}; got shape {tuple(x.shape)}.")
        rows, cols = x.shape
        head_dim = rows // num_heads
        update = ns_fn(x.view(num_heads, head_dim, cols), steps=ns_steps) * aspect_ratio_scale(head_dim, cols)
        return update.reshape(rows, cols)
    if is_expert_group:
        return ns_fn(x, steps=ns_steps) * aspect_ratio_scale(x.size(-2), x.size(-1))
    rows, cols = x.size(-2), x.size(-1)
    if x.ndim == 4:
        x = x.view(len(x), -1)
    update = ns_fn(x, steps=ns_steps)
    update *= aspect_ratio_scale(rows, cols)
    return update


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


def pad_numel(numel: int, world_size: int) -> int:
    """``ceil(numel / world_size)``: the ZeRO-3 partition size of a tensor of ``numel`` elements."""
    return math.ceil(numel / world_size)
