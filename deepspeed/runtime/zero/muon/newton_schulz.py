# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Newton-Schulz on the owner rank: the whole-matrix half of upstream ``muon_update``.

Upstream ``original_muon.muon_orthogonalize`` (Keller Jordan et al., 2024, "Muon: An optimizer for hidden layers in
neural networks", https://kellerjordan.github.io/posts/muon/) runs Newton-Schulz on the problems
``original_muon.muon_ns_problem`` describes (per head, per expert, conv filters flattened).
"""

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.config import SPLIT_KEY
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec
from deepspeed.runtime.zero.muon.param_record import recorded

SPLIT_ATTR = "muon_split"
"""Parameter attribute (public, the user guide's): ``(dim, sizes)``, the matrices a fused parameter holds."""

Split = Tuple[int, Tuple[int, ...]]


def split_of(param, group: dict) -> Optional[Split]:
    """The split the update applies to ``param`` in Muon group ``group``: the user's ``muon_split``, or the
    recognized one unless the group's ``split_fused_muon`` is false."""
    kept_whole = recorded(param).recognized_split is not None and group.get(SPLIT_KEY) is False
    return None if kept_whole else getattr(param, SPLIT_ATTR, None)


def part_problems(shape: Sequence[int], split: Split) -> Tuple[Tuple[int, int, int], ...]:
    """``(batch, rows, cols)`` of the Newton-Schulz problems of each distinct part shape, in order of first
    appearance (batch: the parts of that shape, times the experts of a 3-D tensor)."""
    problems = {}
    for size in split[1]:
        part = (size, shape[-1]) if split[0] == -2 else (shape[-2], size)
        problems[part] = problems.get(part, 0) + (shape[0] if len(shape) == 3 else 1)
    return tuple((n, r, c) for (r, c), n in problems.items())


def newton_schulz_problem(shape: Sequence[int], is_expert_group: bool, num_heads) -> Tuple[int, int, int]:
    """``(batch, rows, cols)`` of the NS problems of a parameter of full ``shape`` and ``muon_num_heads`` (or None):
    upstream ``original_muon.muon_ns_problem``, with errors that name the config keys.

    Raises:
        ValueError: fewer than 2 dimensions, or ``muon_num_heads`` on a tensor that is not 2-D, on rows it does not
            divide, or on a DeepSpeed release without per-head Muon.
    """
    try:
        return original_muon.muon_ns_problem(shape, is_expert_group, num_heads)
    except ValueError as e:
        if num_heads is None:
            raise ValueError(f"{e} Only parameters with `use_muon = True` and at least 2 dimensions belong in a "
                             "Muon group.") from e
        raise ValueError(f"muon_num_heads={num_heads} (optimizer params: per_head_muon) on a parameter of shape "
                         f"{tuple(shape)}: {e}") from e


def matrix_spec(param,
                shape: Sequence[int],
                ns_method: str,
                num_heads: Optional[int] = None,
                split: Optional[Split] = None) -> MatrixSpec:
    """The ``MatrixSpec`` of ``param`` of full ``shape`` (ZeRO-3: ``ds_shape``; a tensor-parallel matrix's whole) under
    the group's ``ns_method``, with its ``muon_num_heads`` for that shape and ``split`` (``split_of``, checked by
    ``param_selection.check_split``).

    Raises:
        ValueError: see ``newton_schulz_problem``."""
    shape, experts = tuple(shape), bool(getattr(param, "is_expert_group", False))
    if split is not None:
        parts = part_problems(shape, split)
        return MatrixSpec(shape, ns_method, experts, None, parts[0], split, parts)
    return MatrixSpec(shape, ns_method, experts, num_heads, newton_schulz_problem(shape, experts, num_heads))


CPU_BATCH_MAX_ELEMENTS = 96 * 96
"""Largest problem (rows x cols) batched on the CPU by default: one thread per rank, fp32, 8
problems in one call took 0.62x the time of 8 calls at 64x64, 0.84x at 96x96, 1.13x at 256x256
(once one matrix keeps a core busy, the batched matmul is slower). Accelerators batch every size."""


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
    """Orthogonalize an owner's matrices of one bucket (``load(k)``: matrix ``k``'s NS input, not modified), yielding
    ``(indices, results)`` per call, each result in ``dtype`` and its matrix's shape.

    With ``batch`` (None: where ``batches`` says it pays on ``device``), same-``(rows, cols)`` problems run as one call
    on their stack: upstream's kernels normalize and iterate each problem of a batch on its own, so no math changes. A
    lone matrix runs upstream's ``muon_orthogonalize`` as ``muon_update`` does; a 4-D conv filter always runs alone
    (upstream scales it by its kernel's shape), and so does a fused parameter (``orthogonalize_parts``). Inputs load
    when their call runs, so a caller holds one call's tensors at a time; ``max_call_numel`` bounds a batched call's
    working set (``ns_workspace_numel`` summed)."""
    groups = {}
    for k, spec in enumerate(specs):
        _, rows, cols = spec.ns_problem
        grouped = batches(rows, cols, device) if batch is None else batch
        alone = (len(spec.shape) == 4 and not spec.is_expert_group) or spec.split is not None
        groups.setdefault((rows, cols) if grouped and not alone else k, []).append(k)
    for members in _bounded_calls(groups.values(), specs, max_call_numel):
        spec = specs[members[0]]
        if len(members) == 1 and spec.split is not None:
            yield members, [orthogonalize_parts(load(members[0]), spec.split, ns_steps, ns_method, dtype)]
        elif len(members) == 1:
            yield members, [
                original_muon.muon_orthogonalize(load(members[0]), ns_steps, ns_method, spec.is_expert_group,
                                                 spec.num_heads, dtype).reshape(spec.shape)
            ]
        else:
            _, rows, cols = spec.ns_problem
            stack = torch.cat([load(k).reshape(-1, rows, cols) for k in members])
            results = original_muon.muon_orthogonalize(stack, ns_steps, ns_method, True, None,
                                                       dtype).split([specs[k].ns_problem[0] for k in members])
            del stack
            yield members, [result.reshape(specs[k].shape) for k, result in zip(members, results)]


def orthogonalize_parts(update: torch.Tensor, split: Split, ns_steps: int, ns_method: str,
                        dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Upstream's ``muon_orthogonalize`` on each part of a fused ``update`` (2-D, or 3-D: a batch of experts) along
    ``split = (dim, sizes)``, each part with its own aspect-ratio scale, the parts of one shape in one batched call;
    the result in ``dtype`` (None: the kernel's) and ``update``'s shape, each part where it lies."""
    dim, sizes = split
    parts = update.split(list(sizes), dim=dim)
    shapes = {}
    for i, part in enumerate(parts):
        shapes.setdefault(tuple(part.shape), []).append(i)
    out = None
    for shape, members in shapes.items():
        stack = torch.stack([parts[i] for i in members]).reshape(-1, shape[-2], shape[-1])
        results = original_muon.muon_orthogonalize(stack, ns_steps, ns_method, True, None, dtype)
        if out is None:
            out = torch.empty(update.shape, dtype=results.dtype, device=results.device)
            targets = out.split(list(sizes), dim=dim)
        for i, result in zip(members, results.reshape(len(members), *shape)):
            targets[i].copy_(result)
    return out


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
