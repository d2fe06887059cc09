# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Analytical model of Muon's per-step cost: traffic, Newton-Schulz work and exchange buffers per rank.

Pure Python (no torch): the owner plan comes from the patch's own ``owner_plan.py``, loaded by
path, so the model is the code, not a re-derivation of it. The plan is the one the patch builds:
``owner_plan.plan_partition`` under the Muon key ``max_step_memory`` (default: buckets cut by
Newton-Schulz cost so every owner computes at once, within the cap; ``"momentum_partition"``: the
largest bucket size up to ``reduce_bucket_size`` whose buffers fit the rank's momentum partition).

Traffic is counted as elements received by one rank per optimizer step, the convention of
``bench/worker.py`` (ring algorithms; a rank's own split is not received):

- patched ZeRO-3 (owner-centric): every rank holds ``ceil(numel / W)`` elements of every matrix;
  per bucket, the owner of a matrix receives every other rank's piece of it and each rank gets
  its piece of the update back. Averaged over ranks that is ``2 P (W - 1) / W^2``, the lower bound
  (no flags travel: a non-finite step is skipped before the update).
- patched ZeRO-1/2, with or without optimizer offload: each rank holds the part of the flat
  buffer its partition covers; a matrix's owner is one of its holders, so only a matrix that
  straddles a partition boundary travels (its other pieces to the owner, the update's pieces
  back), plus one flag all-reduced per Muon group (``MuonPartition.agree_finite``: the binding
  does not rely on the stage skipping a non-finite step).
- stock 0.19.8 ZeRO-3 (``_apply_muon_to_accumulated_grads`` then ``_muon_update_sub_group``, no
  offload): the gradients are all-gathered, then the momenta; then, in rounds of W matrices, the
  updates and the momenta are all-gathered again (padded to the round's largest matrix when the
  round is ragged): ``4 P (W-1) / W`` plus the padding of ragged rounds. With optimizer offload
  every rank runs NS on every matrix.
- stock 0.19.8 ZeRO-1/2 with offload (``_apply_muon_updates_cpu_offload``): per batch of matrices,
  each rank packs its partition's pieces of the gradients and the momenta and all-gathers them
  (``2 (W - 1)`` times the largest rank's Muon elements), so every rank orthogonalizes every matrix.
- stock 0.19.7: the same per-round exchange inside the reduce path, on every micro-step.

NS work is the plan's cost model (``newton_schulz_cost``, multiply-adds of one NS run), summed per
rank: the patched owner plan, 0.19.8's round-robin (rank r takes matrices r, r+W, ...), or every
matrix on every rank under 0.19.8's CPU offload.
"""

import importlib.util
import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


def _load_owner_plan():
    path = ROOT / "deepspeed" / "runtime" / "zero" / "muon" / "owner_plan.py"
    spec = importlib.util.spec_from_file_location("zero3muon_owner_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


owner_plan = _load_owner_plan()

DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size

# Llama-2 7B: 32 decoder layers, hidden 4096, MLP 11008; q, k, v, o are 4096x4096, gate and up
# 11008x4096, down 4096x11008 (embedding and head go to AdamW under DeepSpeed's Muon).
LLAMA_7B = [(4096, 4096)] * 4 * 32 + [(11008, 4096), (11008, 4096), (4096, 11008)] * 32


DEFAULT_DEPTH = 2  # pipeline.DEFAULT_DEPTH: the patch's default pipeline_depth


def muon_order(shapes) -> List[Tuple[int, ...]]:
    """The order the optimizer keeps a Muon group's matrices in, which the flat buffers (ZeRO-1/2),
    the sub-groups and the owner plan's buckets (ZeRO-3) follow: upstream ``MuonWithAuxAdam`` sorts
    them by ``param.size()`` descending (stable), as tuples compare. Every function below takes
    shapes in any order and uses this one."""
    return sorted((tuple(s) for s in shapes), reverse=True)


slots_for_depth = owner_plan.slots_for_depth


DEFAULT_MAX_STEP_MEMORY = owner_plan.DEFAULT_MAX_STEP_MEMORY  # the Muon key max_step_memory's default


def zero3_depth(shapes,
                world_size,
                bucket_numel=DEFAULT_BUCKET,
                depth=DEFAULT_DEPTH,
                max_step_memory=DEFAULT_MAX_STEP_MEMORY) -> int:
    """The pipeline depth ``MuonUpdate`` runs at at ZeRO-3 (``owner_plan.plan_partition``: lowered where the cap
    does not allow it)."""
    return owner_plan.plan_partition(specs_for(muon_order(shapes)), zero3_pieces(shapes, world_size), world_size,
                                     max_step_memory, bucket_numel, depth)[1]


def zero3_owner_floor_numel(shapes, world_size) -> int:
    """The least the Muon update can add to a rank's memory at ZeRO-3, in fp32 elements (``owner_plan.floor_numel``,
    the figure of the patch's ``CapBelowFloor``): every matrix alone at depth 1, so the owner of the largest matrix
    keeps its own piece and the whole matrix (the exchange buffers, padding included) plus the matrix's Newton-Schulz
    working set (``MatrixSpec.ns_workspace_numel``). Where this exceeds the rank's momentum partition, Muon's peak in
    ``step()`` cannot stay at AdamW's on this model at this W."""
    return owner_plan.floor_numel(specs_for(muon_order(shapes)), zero3_pieces(shapes, world_size), world_size)


def specs_for(shapes: Sequence[Tuple[int, ...]], ns_method: str = "gram") -> List:
    """The owner plan's ``MatrixSpec`` of each 2-D shape (one Newton-Schulz problem of its own shape)."""
    return [owner_plan.MatrixSpec(tuple(s), ns_method) for s in shapes]


def zero3_pieces(shapes, world_size) -> List[Tuple[int, ...]]:
    """ZeRO-3: every rank holds ``ceil(numel / W)`` elements of every matrix (zero-padded); in
    ``muon_order``."""
    return [(math.ceil(math.prod(s) / world_size), ) * world_size for s in muon_order(shapes)]


def zero3_plan(shapes, world_size, bucket_numel=DEFAULT_BUCKET, depth=DEFAULT_DEPTH,
               max_step_memory=DEFAULT_MAX_STEP_MEMORY):
    """The owner plan ``MuonUpdate`` builds at ZeRO-3 for one sub-group of these matrices (NS in fp32, as on the
    CPU; ``bucket_numel`` bounds the buckets only under ``owner_plan.STRICT``)."""
    return owner_plan.plan_partition(specs_for(muon_order(shapes)), zero3_pieces(shapes, world_size), world_size,
                                     max_step_memory, bucket_numel, depth)[0]


def zero12_layout(shapes, world_size) -> Tuple[int, List[Tuple[int, ...]]]:
    """ZeRO-1/2's flat buffer of one parameter group: the matrices concatenated in order, padded
    at the end to a multiple of ``2 W`` (``nccl_start_alignment_factor`` x W; no
    ``parameter_alignment``), rank ``r`` holding ``[r * size, (r + 1) * size)``.

    Returns:
        ``(partition_size, pieces)``: per matrix (``muon_order``) the elements each rank holds of it.
    """
    shapes = muon_order(shapes)
    total = sum(math.prod(s) for s in shapes)
    alignment = 2 * world_size
    size = math.ceil(total / alignment) * alignment // world_size
    pieces, start = [], 0
    for s in shapes:
        end = start + math.prod(s)
        pieces.append(tuple(max(0, min(end, (r + 1) * size) - max(start, r * size)) for r in range(world_size)))
        start = end
    return size, pieces


def straddling(shapes, world_size) -> Tuple[int, int]:
    """``(matrices, elements)`` of the matrices that straddle a ZeRO-1/2 partition boundary."""
    _, pieces = zero12_layout(shapes, world_size)
    split = [math.prod(s) for s, p in zip(muon_order(shapes), pieces) if sum(1 for n in p if n) > 1]
    return len(split), sum(split)


def zero12_plan(shapes, world_size, bucket_numel=DEFAULT_BUCKET, depth=DEFAULT_DEPTH,
                max_step_memory=DEFAULT_MAX_STEP_MEMORY):
    """The owner plan the patch builds at ZeRO-1/2 (owners among each matrix's holders)."""
    _, pieces = zero12_layout(shapes, world_size)
    holders = [[r for r, n in enumerate(p) if n] for p in pieces]
    return owner_plan.plan_partition(specs_for(muon_order(shapes)), pieces, world_size, max_step_memory,
                                     bucket_numel, depth, holders=holders)[0]


def exchange_traffic(plan, pieces) -> List[float]:
    """Elements each rank receives per step in the owner exchange of ``plan`` (own pieces excluded):
    as owner every other rank's piece of the matrices it owns, and back its piece of every matrix
    another rank owns."""
    w = plan.world_size
    received = [0.0] * w
    for bucket in plan.buckets:
        for j in bucket:
            owner = plan.owners[j]
            received[owner] += sum(pieces[j]) - pieces[j][owner]
            for r in range(w):
                if r != owner:
                    received[r] += pieces[j][r]
    return received


def patched_traffic(shapes, world_size, bucket_numel=DEFAULT_BUCKET, depth=DEFAULT_DEPTH) -> List[float]:
    """ZeRO-3: elements received per rank per optimizer step by the owner-centric exchange (one
    entry per rank)."""
    if world_size == 1:
        return [0.0]
    return exchange_traffic(zero3_plan(shapes, world_size, bucket_numel, depth), zero3_pieces(shapes, world_size))


def zero12_traffic(shapes, world_size, groups=1, bucket_numel=DEFAULT_BUCKET, depth=DEFAULT_DEPTH) -> List[float]:
    """Patched ZeRO-1/2, with or without optimizer offload: Muon elements received per rank per
    optimizer step, the owner exchange of the straddling matrices plus one int32 flag all-reduced
    per Muon group (``groups``; ZeRO-1/2 may step on a non-finite gradient, so the ranks agree)."""
    if world_size == 1:
        return [0.0]
    flags = [2 * (world_size - 1) / world_size * groups] * world_size
    _, pieces = zero12_layout(shapes, world_size)
    moved = exchange_traffic(zero12_plan(shapes, world_size, bucket_numel, depth), pieces)
    return [a + b for a, b in zip(moved, flags)]


def reserved_numel(plan, pieces, depth=DEFAULT_DEPTH) -> List[int]:
    """Exchange-buffer elements each rank reserves for ``plan`` (``owner_plan.reserved_numel``)."""
    return owner_plan.reserved_numel(plan, pieces, slots_for_depth(depth))


def zero3_reserved_numel(shapes, world_size, bucket_numel=DEFAULT_BUCKET, depth=DEFAULT_DEPTH) -> List[int]:
    """ZeRO-3: exchange-buffer elements each rank reserves (fp32: 4 bytes each), next to its
    momentum partition of ``sum(zero3_pieces)`` elements."""
    return reserved_numel(zero3_plan(shapes, world_size, bucket_numel, depth), zero3_pieces(shapes, world_size),
                          zero3_depth(shapes, world_size, bucket_numel, depth))


def stock_zero12_offload_traffic(shapes, world_size, momentum=True) -> float:
    """Stock 0.19.8 ZeRO-1/2 with offload: Muon elements received per rank per step. One batch of
    at most 64 MiB / (2 x 4 bytes) matrix elements at a time (fp32), each rank's pieces of the
    gradients and (``momentum``: once it exists) the momenta packed into chunks of the largest
    rank's share and all-gathered, ``(W - 1) / W`` of the gathered output received."""
    w = world_size
    if w == 1:
        return 0.0
    buffers = 2 if momentum else 1
    max_buffer_bytes = 64 * 1024 * 1024
    _, pieces = zero12_layout(shapes, w)
    numels = [math.prod(s) for s in muon_order(shapes)]
    batches, batch, batch_numel = [], [], 0
    for j, n in enumerate(numels):  # _muon_param_batches
        if batch and batch_numel + n > max_buffer_bytes // (2 * 4):
            batches.append(batch)
            batch, batch_numel = [], 0
        batch.append(j)
        batch_numel += n
    if batch:
        batches.append(batch)
    received = 0.0
    for batch in batches:
        max_rank = max(sum(pieces[j][r] for j in batch) for r in range(w))
        chunk = min(max_rank, max(1, max_buffer_bytes // ((w + 1) * buffers * 4)))
        rounds = math.ceil(max_rank / chunk)
        received += rounds * chunk * buffers * w * (w - 1) / w
    return received


def zero12_ns_calls(shapes, world_size, offload, build="patched") -> int:
    """Newton-Schulz calls per optimizer step summed over ranks at ZeRO-1/2: the patch once per
    matrix (on its owner) with or without offload; stock 0.19.8 without offload each matrix on
    every rank holding a piece of it, with offload every matrix on every rank."""
    if build == "patched":
        return len(shapes)
    if offload:
        return len(shapes) * world_size
    _, pieces = zero12_layout(shapes, world_size)
    return sum(sum(1 for n in p if n) for p in pieces)


def stock_0198_traffic(shapes, world_size, bucket_numel=DEFAULT_BUCKET) -> float:
    """Elements received per rank per optimizer step by stock 0.19.8 without offload (all ranks
    receive the same amount)."""
    w = world_size
    if w == 1:
        return 0.0
    numels = [math.prod(s) for s in muon_order(shapes)]
    received = 0.0
    for bucket in owner_plan.make_buckets(numels, bucket_numel):
        sizes = [numels[j] for j in bucket]
        padded = [math.ceil(n / w) * w for n in sizes]
        received += 2 * sum(padded) * (w - 1) / w  # gradients, then momenta, all-gathered
        for start in range(0, len(sizes), w):  # updates and momenta, a round at a time
            rnd = sizes[start:start + w]
            if len(rnd) == w and len(set(rnd)) == 1:
                received += 2 * sum(rnd) * (w - 1) / w
            else:
                received += 2 * (w - 1) * max(rnd)
    return received


def lower_bound(shapes, world_size) -> float:
    p = sum(math.prod(s) for s in shapes)
    return 2 * p * (world_size - 1) / world_size**2


def ns_work(shapes, world_size, mode: str, bucket_numel=DEFAULT_BUCKET) -> List[float]:
    """NS cost (multiply-adds) per rank per optimizer step. ``mode``: ``patched``,
    ``stock`` (0.19.8 round-robin) or ``stock-offload`` (every matrix on every rank)."""
    specs = specs_for(muon_order(shapes))
    costs = [owner_plan.newton_schulz_cost(s) for s in specs]
    if mode == "patched":
        return list(zero3_plan(shapes, world_size, bucket_numel).load())
    if mode == "stock-offload":
        return [sum(costs)] * world_size
    per_rank = [0.0] * world_size
    numels = [s.numel for s in specs]
    for bucket in owner_plan.make_buckets(numels, bucket_numel):
        for k, j in enumerate(bucket):
            per_rank[k % world_size] += costs[j]
    return per_rank


def summary(shapes, world_sizes: Sequence[int]) -> List[Dict]:
    """One row per W: traffic / P (patched mean and max, bound, stock 0.19.8), NS work per
    rank relative to one NS of everything (patched max, stock max, stock offload), and the
    patch's ZeRO-3 memory kept between steps over AdamW's two moments on the same partition
    (``kept_over_adamw_max``: ``(momentum + reserved buffers) / (2 x momentum)`` on the rank where
    it is largest; at most 1 where the buffers fit the budget)."""
    p = sum(math.prod(s) for s in shapes)
    total_cost = sum(owner_plan.newton_schulz_cost(s) for s in specs_for(shapes))
    rows = []
    for w in world_sizes:
        traffic = patched_traffic(shapes, w)
        momentum = [sum(p[r] for p in zero3_pieces(shapes, w)) for r in range(w)]
        reserved = zero3_reserved_numel(shapes, w)
        rows.append(
            dict(world_size=w,
                 patched_mean=sum(traffic) / w / p,
                 patched_max=max(traffic) / p,
                 bound=lower_bound(shapes, w) / p,
                 stock_0198=stock_0198_traffic(shapes, w) / p,
                 ns_patched_max=max(ns_work(shapes, w, "patched")) / total_cost,
                 ns_stock_max=max(ns_work(shapes, w, "stock")) / total_cost,
                 ns_stock_offload=1.0,
                 kept_over_adamw_max=max((m + b) / (2 * m) for m, b in zip(momentum, reserved))))
    return rows
