# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Newton-Schulz on the owner rank: the whole-matrix half of upstream ``muon_update``.

Upstream ``original_muon.muon_orthogonalize`` (Keller Jordan et al., 2024, "Muon: An optimizer
for hidden layers in neural networks", https://kellerjordan.github.io/posts/muon/) runs
Newton-Schulz on the problems ``original_muon.muon_ns_problem`` describes (per head, per expert,
conv filters flattened) and scales by the aspect ratio. This module describes each Muon
parameter for the owner plan (``matrix_spec``) and orthogonalizes the matrices an owner holds in
one bucket, batching those whose problems have the same shape (``orthogonalize_each``).
"""

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec


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
            per-head Muon.
    """
    try:
        return original_muon.muon_ns_problem(shape, is_expert_group, num_heads)
    except ValueError as e:
        if num_heads is None:
            raise ValueError(f"{e} Only parameters with `use_muon = True` and at least 2 dimensions belong in a "
                             "Muon group.") from e
        raise ValueError(f"muon_num_heads={num_heads} (optimizer params: per_head_muon) on a parameter of shape "
                         f"{tuple(shape)}: {e}") from e


def matrix_spec(param, shape: Sequence[int], ns_method: str) -> MatrixSpec:
    """The Newton-Schulz description of one Muon parameter, for the owner plan and ``orthogonalize_each``.

    Args:
        param: the parameter (its ``is_expert_group`` and ``muon_num_heads`` tags are read).
        shape: its full shape (ZeRO-3: ``ds_shape``).
        ns_method: the parameter group's ``ns_method``.

    Raises:
        ValueError: see ``newton_schulz_problem``.
    """
    shape = tuple(shape)
    is_expert_group = bool(getattr(param, "is_expert_group", False))
    num_heads = getattr(param, "muon_num_heads", None)
    return MatrixSpec(shape=shape,
                      ns_method=ns_method,
                      is_expert_group=is_expert_group,
                      num_heads=num_heads,
                      ns_problem=newton_schulz_problem(shape, is_expert_group, num_heads))


CPU_BATCH_MAX_ELEMENTS = 96 * 96
"""Largest Newton-Schulz problem (rows x cols) that ``orthogonalize_each`` batches on the CPU by
default. With one CPU thread per rank (fp32), 8 problems in one call took 0.62x the time of 8
calls at 64x64 and 0.84x at 96x96, but 1.13x at 256x256 and 1.25x at 1024x1024: once one matrix
keeps a core busy, the batched matmul is the slower kernel. On an accelerator a batch saves
kernel launches and fills the device, so every size is batched there."""


def batches(rows: int, cols: int, device: torch.device) -> bool:
    """Whether ``orthogonalize_each`` batches problems of ``rows x cols`` on ``device`` by default."""
    return torch.device(device).type != "cpu" or rows * cols <= CPU_BATCH_MAX_ELEMENTS


def orthogonalize_each(load: Callable[[int], torch.Tensor],
                       specs: Sequence,
                       ns_steps: int,
                       ns_method: str,
                       dtype: torch.dtype,
                       device,
                       batch: Optional[bool] = None,
                       max_call_numel: Optional[int] = None) -> Iterator[Tuple[List[int], List[torch.Tensor]]]:
    """The owner's half of ``muon_update`` for the matrices it holds in one bucket, one call at a time.

    With ``batch``, matrices whose Newton-Schulz problems have the same ``(rows, cols)``
    (``MatrixSpec.ns_problem``) are orthogonalized in one call on their stack: upstream's kernels
    are batched over leading dimensions (expert groups and per-head Muon use that already), and
    each problem of the batch is normalized and iterated on its own, so the batch changes no
    problem's math; the matmuls may run with another blocking. A matrix alone in its group runs
    upstream's ``muon_orthogonalize`` exactly as ``muon_update`` does. A 4-D convolution filter is
    always alone: upstream scales it by its kernel's last two dimensions, not by its problem's rows
    and columns, which a batch of problems would apply.

    Matrices are loaded when their call runs and results are handed out as each call returns, so
    a caller that writes each result away holds one call's inputs and results at a time, not the
    bucket's. ``max_call_numel`` bounds a batched call's working set
    (``MatrixSpec.ns_workspace_numel`` summed over its matrices): a group that would exceed it is
    split into several calls, so batching never needs more memory than the largest single matrix
    does when the bound is that matrix's working set.

    Args:
        load: ``load(k)`` returns the whole NS input of matrix ``k`` (its parameter's shape), not
            modified.
        specs: per matrix its ``owner_plan.MatrixSpec`` (``ns_problem``, ``is_expert_group``,
            ``num_heads``).
        ns_steps, ns_method: the parameter group's Newton-Schulz settings.
        dtype: dtype of the results (``ns_compute_dtype(ns_method)``: sent back without loss).
        device: where the matrices live (decides the default batching).
        batch: True groups same-shape problems into one call, False makes one call per matrix,
            None (default) groups where ``batches`` says it pays on ``device``.
        max_call_numel: the most working-set elements of one batched call (``None``: no bound);
            a matrix whose own working set exceeds it still gets its call.

    Yields:
        ``(indices, results)`` per call: the matrices' indices and their updates in ``dtype``,
        each of its matrix's shape.
    """
    groups = {}
    for k, spec in enumerate(specs):
        _, rows, cols = spec.ns_problem
        grouped = batches(rows, cols, device) if batch is None else batch
        # A 4-D conv filter alone: upstream scales it by its kernel's (kh, kw), not by its problem's.
        conv = len(spec.shape) == 4 and not spec.is_expert_group
        groups.setdefault((rows, cols) if grouped and not conv else k, []).append(k)
    for members in _bounded_calls(groups.values(), specs, max_call_numel):
        if len(members) == 1:
            spec = specs[members[0]]
            yield members, [
                original_muon.muon_orthogonalize(load(members[0]), ns_steps, ns_method, spec.is_expert_group,
                                                 spec.num_heads, dtype).reshape(spec.shape)
            ]
        else:
            _, rows, cols = specs[members[0]].ns_problem
            stack = torch.cat([load(k).reshape(-1, rows, cols) for k in members])
            results = original_muon.muon_orthogonalize(stack, ns_steps, ns_method, True, None,
                                                       dtype).split([specs[k].ns_problem[0] for k in members])
            del stack
            yield members, [result.reshape(specs[k].shape) for k, result in zip(members, results)]


def _bounded_calls(groups, specs, max_call_numel: Optional[int]) -> Iterator[List[int]]:
    """Each group's members in runs whose working sets sum to at most ``max_call_numel``."""
    for members in groups:
        call, used = [], 0
        for k in members:
            need = specs[k].ns_workspace_numel
            if call and max_call_numel is not None and used + need > max_call_numel:
                yield call
                call, used = [], 0
            call.append(k)
            used += need
        yield call
