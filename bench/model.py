# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Analytical model of Muon's per-step cost under ZeRO-3: traffic and Newton-Schulz work per rank.

Pure Python (no torch): the owner plan comes from the patch's own ``owner_plan.py``, loaded by
path, so the model is the code, not a re-derivation of it.

Traffic is counted as elements received by one rank per optimizer step, the convention of
``bench/worker.py`` (ring algorithms; a rank's own chunk is not received):

- patched (owner-centric): per bucket, rank r owning partitions of total size ``S_r`` out of the
  bucket's ``T`` receives ``(W-1) S_r`` forward and ``T - S_r`` back; plus one all-reduce of one
  flag per matrix. Averaged over ranks that is ``2 P (W-1) / W^2`` (+ flags), the lower bound.
- stock 0.19.8 (``_apply_muon_to_accumulated_grads`` then ``_muon_update_sub_group``, no
  offload): the gradients are all-gathered, then the momenta; then, in rounds of W matrices, the
  updates and the momenta are all-gathered again (padded to the round's largest matrix when the
  round is ragged): ``4 P (W-1) / W`` plus the padding of ragged rounds. With optimizer offload
  every rank runs NS on every matrix.
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


def specs_for(shapes: Sequence[Tuple[int, ...]], world_size: int) -> List:
    return [owner_plan.MatrixSpec(tuple(s), math.ceil(math.prod(s) / world_size)) for s in shapes]


def patched_traffic(shapes, world_size, bucket_numel=DEFAULT_BUCKET) -> List[float]:
    """Elements received per rank per optimizer step by the owner-centric exchange (one entry per
    rank), flag all-reduce included."""
    specs = specs_for(shapes, world_size)
    if world_size == 1:
        return [0.0]
    plan = owner_plan.plan_owners(specs, world_size, bucket_numel)
    received = [2 * (world_size - 1) * len(specs) / world_size] * world_size  # finite flags
    for bucket in plan.buckets:
        total = sum(specs[j].partition_numel for j in bucket)
        for r in range(world_size):
            owned = sum(specs[j].partition_numel for j in bucket if plan.owners[j] == r)
            received[r] += (world_size - 1) * owned + total - owned
    return received


def stock_0198_traffic(shapes, world_size, bucket_numel=DEFAULT_BUCKET) -> float:
    """Elements received per rank per optimizer step by stock 0.19.8 without offload (all ranks
    receive the same amount)."""
    w = world_size
    if w == 1:
        return 0.0
    numels = [math.prod(s) for s in shapes]
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
    specs = specs_for(shapes, world_size)
    costs = [owner_plan.newton_schulz_cost(s) for s in specs]
    if mode == "patched":
        plan = owner_plan.plan_owners(specs, world_size, bucket_numel)
        return list(plan.load())
    if mode == "stock-offload":
        return [sum(costs)] * world_size
    per_rank = [0.0] * world_size
    numels = [s.numel for s in specs]
    for bucket in owner_plan.make_buckets(numels, bucket_numel):
        for k, j in enumerate(bucket):
            per_rank[k % world_size] += costs[j]
    return per_rank


def summary(shapes, world_sizes: Sequence[int]) -> List[Dict]:
    """One row per W: traffic / P (patched mean and max, bound, stock 0.19.8) and NS work per
    rank relative to one NS of everything (patched max, stock max, stock offload)."""
    p = sum(math.prod(s) for s in shapes)
    total_cost = sum(owner_plan.newton_schulz_cost(s) for s in specs_for(shapes, 1))
    rows = []
    for w in world_sizes:
        traffic = patched_traffic(shapes, w)
        rows.append(
            dict(world_size=w,
                 patched_mean=sum(traffic) / w / p,
                 patched_max=max(traffic) / p,
                 bound=lower_bound(shapes, w) / p,
                 stock_0198=stock_0198_traffic(shapes, w) / p,
                 ns_patched_max=max(ns_work(shapes, w, "patched")) / total_cost,
                 ns_stock_max=max(ns_work(shapes, w, "stock")) / total_cost,
                 ns_stock_offload=1.0))
    return rows
