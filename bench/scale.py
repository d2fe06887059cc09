# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's share of step time at scale, on paper: ``bench/model.py``'s elements turned into seconds.

A model, not a measurement: no GPU figure here was measured. Every rate below is a named
constant with its source or marked an assumption; ``python3 bench/scale.py --out docs/performance``
prints the tables (``scale-output.txt``) and draws ``muon_share_vs_w.png``.

Per rank and optimizer step (ZeRO-3, data parallel over W GPUs, 8 per node):

- **Muon, patched** (the owner plan ``owner_plan.plan_for_depth`` builds, loaded by ``model.py``
  from the patch, with ``result_itemsize`` 2: on a GPU the default ``ns_method`` "gram" computes in
  fp16, ``original_muon.ns_compute_dtype``; where even every matrix alone exceeds the momentum
  budget, depth 1 with buckets chosen against that floor; ``old_plan_for_depth``, the planner before
  that rule, is printed as a what-if): per bucket, the forward exchange (fp32 NS input,
  ``pipeline.EXCHANGE_DTYPE``: 4 bytes an element), Newton-Schulz on the bucket's slowest owner,
  the back exchange (the compute dtype: 2 bytes). A collective's time is its busiest rank's
  ``max(bytes sent, bytes received)`` over the link (``link_seconds``). The buckets run through
  ``pipeline_seconds``, a replay of ``MuonPipeline.run``'s order with one link and one compute
  stream: at depth 1 it is the plain sum; at depth 2 a bucket's exchange overlaps the previous
  one's NS. Plus the elementwise passes (momentum, NS input, update applied) over the rank's
  partition at HBM bandwidth, and AdamW on what DeepSpeed's Muon leaves to Adam (embedding, head,
  norms).
- **Muon, stock 0.19.8**: ``model.stock_0198_traffic`` elements all-gathered in bf16 (its
  communication dtype) at all-gather efficiency, then NS round by round (rounds of W matrices,
  each ending in an all-gather: the round's largest matrix sets its time), serial; the same
  elementwise passes.
- **AdamW**: its elementwise step over the rank's partition of every parameter at HBM bandwidth.
- **Forward and backward**: ``6 x active parameters x tokens per GPU / (dense bf16 x MFU)``
  (matmul parameters: Muon matrices and the head; attention's own flops left out; ZeRO-3's
  parameter gathers and gradient reduction assumed hidden under compute at that MFU).

Not modelled: ``sub_group_size`` (one partition, as ``model.py``), kernel launch latency, NCCL's
start-up per collective, the gradient norm and clipping (common to both optimizers).
"""

import argparse
import contextlib
import heapq
import math
import re
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model  # noqa: E402

owner_plan = model.owner_plan
ROOT = model.ROOT

# --- stated rates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    name: str
    matmul_flops: float  # dense bf16/fp16 tensor-core FLOP/s (no sparsity)
    hbm_bytes: float  # HBM bandwidth, bytes/s


# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (and FP16) Tensor Core, 3.35 TB/s HBM3.
H100 = Gpu("H100 SXM", 989e12, 3.35e12)
# NVIDIA H200 SXM datasheet: the same tensor cores (989 TFLOP/s dense), 4.8 TB/s HBM3e.
H200 = Gpu("H200 SXM", 989e12, 4.8e12)
GPUS = (H100, H200)

# NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU = 450 GB/s each way.
NVLINK_BYTES = 450e9
# One NDR InfiniBand ConnectX-7 adapter per GPU (DGX H100/H200): 400 Gbit/s each way.
IB_BYTES = 400e9 / 8
GPUS_PER_NODE = 8

# Assumptions (not measured anywhere in this repository):
A2A_EFFICIENCY = 0.6  # all-to-all: share of the link's rate reached (NCCL at many peers reaches less than rings)
ALLGATHER_EFFICIENCY = 0.8  # ring all-gather (stock 0.19.8's collective)
NS_EFFICIENCY = 0.6  # Newton-Schulz matmuls: share of dense peak (square-ish fp16 GEMMs of 1k-28k)
ELEMENTWISE_EFFICIENCY = 0.8  # optimizer elementwise kernels: share of HBM bandwidth
MFU = 0.40  # forward + backward model FLOPs utilization
TOKENS_PER_GPU = 16384  # tokens per GPU per optimizer step (e.g. 2 sequences of 8192, all micro-steps)

# Bytes moved through HBM per element in the optimizer's elementwise passes (fp32 state, bf16 weights):
# AdamW: gradient read 4, exp_avg read+write 8, exp_avg_sq read+write 8, fp32 master read+write 8, bf16 copy 2.
ADAMW_BYTES = 30
# Muon: gradient read 4, momentum read+write 8, NS input written 4, update written back 4, master read+write 8,
# update read 4, bf16 copy 2.
MUON_BYTES = 34
# Exchange dtypes (itemsize): the patch sends the fp32 NS input, returns the kernel's dtype (fp16 for "gram" on a
# GPU); stock 0.19.8 all-gathers in the communication dtype (bf16).
FORWARD_ITEMSIZE, BACK_ITEMSIZE, STOCK_ITEMSIZE = 4, 2, 2

WORLD_SIZES = tuple(2**k for k in range(3, 13))  # 8 .. 4096

# --- models ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    name: str
    muon_shapes: Tuple[Tuple[int, int], ...]  # every Muon matrix (experts as separate matrices)
    adam_numel: int  # parameters DeepSpeed's Muon leaves to Adam: embedding, head, norms
    flop_params: int  # matmul parameters one token passes through (active experts only), head included
    note: str


def llama3(name, layers, hidden, kv, mlp, vocab=128256):
    """Llama-3: per layer q, o hidden x hidden; k, v kv x hidden (8 KV heads of 128); gate, up mlp x hidden;
    down hidden x mlp; embedding and untied head vocab x hidden to Adam, RMSNorm weights too."""
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden),
             (hidden, mlp)]
    shapes = tuple(layer * layers)
    muon = sum(math.prod(s) for s in shapes)
    return Arch(name, shapes, 2 * vocab * hidden + (2 * layers + 1) * hidden, muon + vocab * hidden,
                f"{layers} layers, hidden {hidden}, k/v {kv}x{hidden}, MLP {mlp}, vocab {vocab}")


def qwen3_moe(layers=48, hidden=2048, q=4096, kv=512, experts=128, active=8, expert_mlp=768, vocab=151936):
    """Qwen3-30B-A3B (its config.json): per layer q 4096x2048 (32 heads of 128), k, v 512x2048 (4 KV heads),
    o 2048x4096, router 128x2048 (a matrix: DeepSpeed's name rule sends it to Muon), 128 experts each gate and up
    768x2048 and down 2048x768, 8 active per token; embedding and untied head 151936x2048, norms to Adam."""
    attention = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (experts, hidden)]
    expert = [(expert_mlp, hidden), (expert_mlp, hidden), (hidden, expert_mlp)]
    shapes = tuple((attention + expert * experts) * layers)
    per_layer_active = sum(math.prod(s) for s in attention) + active * sum(math.prod(s) for s in expert)
    norms = layers * (2 * hidden + 2 * 128) + hidden
    return Arch(
        "Qwen3-30B-A3B (MoE)", shapes, 2 * vocab * hidden + norms, layers * per_layer_active + vocab * hidden,
        f"{layers} layers, hidden {hidden}, q {q}x{hidden}, k/v {kv}x{hidden}, {experts} experts "
        f"({active} active) of {expert_mlp}, vocab {vocab}")


LLAMA3_8B = llama3("Llama-3 8B", 32, 4096, 1024, 14336)
LLAMA3_70B = llama3("Llama-3 70B", 80, 8192, 1024, 28672)
QWEN3_30B_A3B = qwen3_moe()
ARCHS = (LLAMA3_8B, LLAMA3_70B, QWEN3_30B_A3B)

# --- a fast plan, equal to the patch's ------------------------------------------------------------


class Uniform(Sequence):
    """ZeRO-3's pieces of one matrix: ``value`` on each of ``n`` ranks, without a list of ``n`` entries."""

    def __init__(self, value: int, n: int):
        self.value, self.n = value, n

    def __len__(self):
        return self.n

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self.value] * len(range(*r.indices(self.n)))
        if not -self.n <= r < self.n:
            raise IndexError(r)
        return self.value

    def __eq__(self, other):
        return list(self) == list(other)


def _uniform(pieces) -> bool:
    return all(isinstance(p, Uniform) for p in pieces)


def _fast_plan_owners(specs,
                      world_size,
                      bucket_numel,
                      ns_steps=owner_plan.NS_STEPS_DEFAULT,
                      initial_load=None,
                      holders=None,
                      _original=owner_plan.plan_owners):
    """``owner_plan.plan_owners`` for every rank holding every matrix, with heaps instead of scans over W
    (the same choices, ties included: the least ``(load, index)`` bin or rank); the original otherwise."""
    costs = tuple(owner_plan.newton_schulz_cost(spec, ns_steps) for spec in specs)
    if holders is not None or world_size < 1 or any(c <= 0 for c in costs) or (initial_load is not None
                                                                               and len(initial_load) != world_size):
        return _original(specs, world_size, bucket_numel, ns_steps, initial_load, holders)
    workspaces = tuple(spec.ns_workspace_numel for spec in specs)
    buckets = owner_plan.make_buckets([spec.numel for spec in specs], bucket_numel) if specs else ()
    owners = [0] * len(specs)
    total = list(initial_load) if initial_load is not None else [0.0] * world_size
    ranks = [(load, r) for r, load in enumerate(total)]
    heapq.heapify(ranks)
    for bucket in buckets:
        # LPT into W bins; an unused bin (load 0, the lowest unused index) beats every used one (load > 0)
        used, next_empty, bin_of, bin_load = [], 0, {}, {}
        for j in sorted(bucket, key=lambda j: (-costs[j], j)):
            if next_empty < world_size:
                b = next_empty
                next_empty += 1
            else:
                _, b = heapq.heappop(used)
            bin_of[j] = b
            bin_load[b] = bin_load.get(b, 0.0) + costs[j]
            heapq.heappush(used, (bin_load[b], b))
        # heaviest bin to the least loaded rank (empty bins add nothing to the ranks they get)
        bins = sorted(bin_load, key=lambda b: (-bin_load[b], b))
        least = [heapq.heappop(ranks) for _ in bins]
        rank_of_bin = {b: r for b, (_, r) in zip(bins, least)}
        for b, (load, r) in zip(bins, least):
            heapq.heappush(ranks, (load + bin_load[b], r))
        for j in bucket:
            owners[j] = rank_of_bin[bin_of[j]]
    return owner_plan.OwnerPlan(world_size, tuple(owners), buckets, costs, workspaces)


def _fast_largest_buffers(plan, pieces, _original=owner_plan._largest_buffers):
    if not _uniform(pieces):
        return _original(plan, pieces)
    w = plan.world_size
    most_out, most_in = [0] * w, {}
    top_out = 0
    for bucket in plan.buckets:
        top_out = max(top_out, sum(pieces[j].value for j in bucket))
        incoming = {}
        for j in bucket:
            incoming[plan.owners[j]] = incoming.get(plan.owners[j], 0) + w * pieces[j].value
        for r, n in incoming.items():
            most_in[r] = max(most_in.get(r, 0), n)
    return [top_out if plan.buckets else 0] * w, [most_in.get(r, 0) for r in range(w)]


def _fast_rank_numels(plan, pieces, slots, result_itemsize=4, state_numels=None, _original=owner_plan.rank_numels):
    if not _uniform(pieces):
        return _original(plan, pieces, slots, result_itemsize, state_numels)
    w = plan.world_size
    most_out, most_in = _fast_largest_buffers(plan, pieces)
    held = [-(-n * result_itemsize // 4) if result_itemsize < 4 else 0 for n in most_in]
    state, workspace = [0] * w, [0] * w
    for j, owner in enumerate(plan.owners):
        workspace[owner] = max(workspace[owner], plan.workspaces[j])
    for owner, n in zip(plan.owners, state_numels or ()):
        state[owner] += n
    held_by_each = sum(p.value for p in pieces)
    busy = min(slots, max(1, len(plan.buckets)))
    need = [busy * (a + b) + workspace[r] + held[r] + state[r] for r, (a, b) in enumerate(zip(most_out, most_in))]
    return need, [held_by_each] * w


def old_plan_for_depth(specs, pieces, world_size, max_bucket_numel, depth, result_itemsize=4):
    """What-if, NOT what the patch does now: the planner before its floor rule (``plan_within_budget`` then fell
    back to every matrix alone wherever no bucket size fit the budget, so at depth 1 every bucket's NS ran on one
    owner while the other ranks waited). The same bisection over the same candidates, against the budget only."""

    for d in range(depth, 0, -1):
        slots = owner_plan.slots_for_depth(d)

        def fits(candidate):
            return owner_plan.within_budget(candidate, pieces, slots, result_itemsize)  # noqa: B023

        best = _largest_fitting(specs, world_size, max_bucket_numel, fits)
        if fits(best):
            return best, d
    return best, 1


def _largest_fitting(specs, world_size, max_bucket_numel, fits):
    """``plan_within_budget``'s search with another ``fits``: the whole plan, else the largest of the first k
    matrices' totals that fits by bisection, else every matrix alone."""
    candidates, total = [], 0
    for spec in specs:
        total += spec.numel
        if total > max_bucket_numel:
            break
        candidates.append(total)
    if max_bucket_numel > total:
        whole = owner_plan.plan_owners(specs, world_size, max_bucket_numel)
        if fits(whole):
            return whole
    best = owner_plan.plan_owners(specs, world_size, 1)
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = owner_plan.plan_owners(specs, world_size, candidates[mid])
        if fits(candidate):
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best


FLOOR_SLACK = 0.01  # what-if: the peak may exceed the every-matrix-alone floor by this share


def slack_plan(specs, pieces, world_size, max_bucket_numel, depth, result_itemsize=4, slack=FLOOR_SLACK):
    """What-if, NOT what the patch does: where every matrix alone exceeds the budget, depth 1 with the largest
    bucket size (the patch's candidates) whose every rank needs at most ``max(budget, (1 + slack) x floor)``,
    the floor being the every-matrix-alone plan's largest need on any rank; otherwise the patch's plan. At the
    floor itself (the patch) a bucket can hold no more elements than the largest matrix, since every rank's
    outgoing buffer, the floor's owner's included, holds its pieces of the whole bucket."""
    alone = owner_plan.plan_owners(specs, world_size, 1)
    if owner_plan.within_budget(alone, pieces, 1, result_itemsize):
        return owner_plan.plan_for_depth(specs,
                                         pieces,
                                         world_size,
                                         max_bucket_numel,
                                         depth,
                                         result_itemsize=result_itemsize)
    need, budget = owner_plan.rank_numels(alone, pieces, 1, result_itemsize)
    limit = [max(b, (1 + slack) * max(need)) for b in budget]

    def fits(candidate):
        return all(n <= m for n, m in zip(owner_plan.rank_numels(candidate, pieces, 1, result_itemsize)[0], limit))

    return _largest_fitting(specs, world_size, max_bucket_numel, fits), 1


@contextlib.contextmanager
def fast_plan():
    """Within: the patch's ``plan_for_depth`` runs with ``_fast_plan_owners``, ``_fast_largest_buffers`` and
    ``_fast_rank_numels`` in place of its three loops over W (``within_budget`` calls ``rank_numels``;
    ``tests/bench/test_scale.py`` checks the plans and needs equal the original's); W = 4096 with Qwen3's 18,672
    matrices takes seconds instead of hours."""
    saved = owner_plan.plan_owners, owner_plan._largest_buffers, owner_plan.rank_numels
    owner_plan.plan_owners, owner_plan._largest_buffers, owner_plan.rank_numels = (_fast_plan_owners,
                                                                                   _fast_largest_buffers,
                                                                                   _fast_rank_numels)
    try:
        yield
    finally:
        owner_plan.plan_owners, owner_plan._largest_buffers, owner_plan.rank_numels = saved


def zero3_pieces(shapes, world_size) -> List[Uniform]:
    """``model.zero3_pieces`` as ``Uniform`` sequences."""
    return [Uniform(math.ceil(math.prod(s) / world_size), world_size) for s in model.muon_order(shapes)]


def gpu_plan(shapes,
             world_size,
             bucket_numel=model.DEFAULT_BUCKET,
             depth=model.DEFAULT_DEPTH,
             budget=True,
             old_rule=False,
             slack=None):
    """``(plan, depth, pieces)``: the patch's ZeRO-3 plan on a GPU (results in fp16: ``result_itemsize`` 2).
    ``budget=False``: a what-if, ``plan_owners`` at ``reduce_bucket_size`` and depth kept (no memory budget);
    ``old_rule=True``: a what-if, ``old_plan_for_depth`` (the planner before its floor rule); ``slack``: a what-if,
    ``slack_plan`` (the peak allowed ``slack`` above the floor)."""
    specs = model.specs_for(model.muon_order(shapes))
    pieces = zero3_pieces(shapes, world_size)
    with fast_plan():
        if not budget:
            return owner_plan.plan_owners(specs, world_size, bucket_numel), depth, pieces
        if old_rule:
            plan, d = old_plan_for_depth(specs, pieces, world_size, bucket_numel, depth, result_itemsize=BACK_ITEMSIZE)
            return plan, d, pieces
        if slack is not None:
            plan, d = slack_plan(specs, pieces, world_size, bucket_numel, depth, BACK_ITEMSIZE, slack)
            return plan, d, pieces
        plan, d = owner_plan.plan_for_depth(specs,
                                            pieces,
                                            world_size,
                                            bucket_numel,
                                            depth,
                                            result_itemsize=BACK_ITEMSIZE)
    return plan, d, pieces


# --- time --------------------------------------------------------------------------------------


def link_seconds(nbytes: float, world_size: int, efficiency: float) -> float:
    """One collective whose busiest rank moves ``nbytes`` each way, spread evenly over its W - 1 peers: the
    share to peers on other nodes (``max(0, W - 8) / (W - 1)``) over InfiniBand, the rest over NVLink, at once;
    the slower sets the time. W <= 8: NVLink only."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    off = max(0, world_size - GPUS_PER_NODE) / (world_size - 1)
    return max(nbytes * off / (IB_BYTES * efficiency), nbytes * (1 - off) / (NVLINK_BYTES * efficiency))


def pipeline_seconds(forward: Sequence[float], compute: Sequence[float], back: Sequence[float], depth: int) -> float:
    """``MuonPipeline.run``'s order replayed with one link (collectives in issue order, one at a time) and one
    compute stream per bucket (its slowest owner): bucket b's exchange is issued, then once ``depth`` are in
    flight the oldest is computed (after its exchange arrived) and its result sent back; once ``depth`` results
    are in flight the oldest is waited for. Depth 1: the sum of every term."""
    now, link_free = 0.0, 0.0
    preparing, returning = deque(), deque()

    def issue(seconds):
        nonlocal link_free
        link_free = max(now, link_free) + seconds
        return link_free

    def compute_oldest():
        nonlocal now
        b, arrived = preparing.popleft()
        now = max(now, arrived) + compute[b]
        returning.append(issue(back[b]))
        if len(returning) == depth:
            now = max(now, returning.popleft())

    for b in range(len(forward)):
        preparing.append((b, issue(forward[b])))
        if len(preparing) == depth:
            compute_oldest()
    while preparing:
        compute_oldest()
    while returning:
        now = max(now, returning.popleft())
    return now


def bucket_terms(plan, pieces, costs=None):
    """Per bucket ``(forward_elems, back_elems, ns_cost)``: the busiest rank's elements each way (max of sent and
    received) in the forward and back exchange, and the bucket's slowest owner's NS cost (``costs``: per matrix,
    default the plan's)."""
    w = plan.world_size
    costs = plan.costs if costs is None else costs
    terms = []
    for bucket in plan.buckets:
        total = sum(pieces[j][0] for j in bucket)
        own, load = {}, {}
        for j in bucket:
            own[plan.owners[j]] = own.get(plan.owners[j], 0) + pieces[j][0]
            load[plan.owners[j]] = load.get(plan.owners[j], 0.0) + costs[j]
        busiest = max(max((w - 1) * n, total - n) for n in own.values())
        if len(own) < w:  # a rank owning nothing here sends (and gets back) all its pieces
            busiest = max(busiest, total)
        terms.append((busiest, busiest, max(load.values())))
    return terms


def ns_seconds(flops: float, gpu: Gpu) -> float:
    return flops / (gpu.matmul_flops * NS_EFFICIENCY)


def elementwise_seconds(numel: float, nbytes: int, gpu: Gpu) -> float:
    return numel * nbytes / (gpu.hbm_bytes * ELEMENTWISE_EFFICIENCY)


def fwd_bwd_seconds(arch: Arch, gpu: Gpu, tokens=TOKENS_PER_GPU, mfu=MFU) -> float:
    return 6.0 * arch.flop_params * tokens / (gpu.matmul_flops * mfu)


def adamw_seconds(arch: Arch, world_size: int, gpu: Gpu) -> float:
    numel = sum(math.prod(s) for s in arch.muon_shapes) + arch.adam_numel
    return elementwise_seconds(numel / world_size, ADAMW_BYTES, gpu)


def muon_elementwise_seconds(arch: Arch, world_size: int, gpu: Gpu) -> float:
    muon = sum(math.prod(s) for s in arch.muon_shapes)
    return (elementwise_seconds(muon / world_size, MUON_BYTES, gpu) +
            elementwise_seconds(arch.adam_numel / world_size, ADAMW_BYTES, gpu))


def patched_seconds(plan, depth, pieces, gpu: Gpu, costs=None, bandwidth=None) -> Dict[str, float]:
    """The patched exchange + NS pipeline: ``{"exchange", "ns", "pipeline"}`` seconds (exchange and NS summed
    over buckets; pipeline: both through ``pipeline_seconds``). ``bandwidth``: None for ``link_seconds`` at
    all-to-all efficiency, else bytes/s (infinite: ``math.inf``)."""
    w = plan.world_size

    def link(nbytes):
        if bandwidth is None:
            return link_seconds(nbytes, w, A2A_EFFICIENCY)
        return nbytes / bandwidth

    terms = bucket_terms(plan, pieces, costs)
    forward = [link(f * FORWARD_ITEMSIZE) for f, _, _ in terms]
    back = [link(b * BACK_ITEMSIZE) for _, b, _ in terms]
    compute = [ns_seconds(c, gpu) for _, _, c in terms]
    return dict(exchange=sum(forward) + sum(back),
                ns=sum(compute),
                pipeline=pipeline_seconds(forward, compute, back, depth))


def stock_round_costs(shapes, world_size, bucket_numel=model.DEFAULT_BUCKET) -> float:
    """Stock 0.19.8's NS per step in FLOPs as time sees it: per bucket, rounds of W matrices (round-robin), each
    ending in an all-gather, so each round costs its largest matrix's NS."""
    specs = model.specs_for(model.muon_order(shapes))
    costs = [owner_plan.newton_schulz_cost(s) for s in specs]
    total = 0.0
    for bucket in owner_plan.make_buckets([s.numel for s in specs], bucket_numel):
        for start in range(0, len(bucket), world_size):
            total += max(costs[j] for j in bucket[start:start + world_size])
    return total


def stock_seconds(arch: Arch, world_size: int, gpu: Gpu) -> Dict[str, float]:
    exchange = link_seconds(
        model.stock_0198_traffic(arch.muon_shapes, world_size) * STOCK_ITEMSIZE, world_size, ALLGATHER_EFFICIENCY)
    ns = ns_seconds(stock_round_costs(arch.muon_shapes, world_size), gpu)
    return dict(exchange=exchange, ns=ns, total=exchange + ns + muon_elementwise_seconds(arch, world_size, gpu))


def split_costs(costs: Sequence[float], world_size: int, ways: int) -> List[float]:
    """What-if: every matrix whose NS costs more than the mean share ``sum / W`` is split over ``ways`` ranks
    (ideal: no communication inside NS), as pieces of ``cost / ways``."""
    share = sum(costs) / world_size
    out = []
    for c in costs:
        out.extend([c / ways] * ways if c > share else [c])
    return out


def lpt_max(costs: Sequence[float], world_size: int) -> float:
    """The busiest of W bins after longest-processing-time-first (the plan's rule within a bucket)."""
    bins = [0.0] * min(world_size, len(costs))
    heapq.heapify(bins)
    for c in sorted(costs, reverse=True):
        heapq.heapreplace(bins, bins[0] + c)
    return max(bins, default=0.0)


@dataclass
class Row:
    arch: str
    gpu: str
    world_size: int
    depth: int
    buckets: int
    exchange: float
    ns: float
    ns_busiest: float  # the busiest owner's NS over the whole step (perfect overlap across buckets: a lower bound)
    patched: float  # Muon optimizer step, patched: pipeline + elementwise
    stock: float
    adamw: float
    fwd_bwd: float
    ns_largest: float  # NS seconds of the largest matrix alone
    nobudget: float  # what-if: no memory budget (depth 2, reduce_bucket_size buckets)
    split8: float  # what-if: no budget and the costliest matrices' NS split over 8 ranks
    peak_numel: int  # the plan's largest need on any rank (owner_plan.rank_numels), fp32 elements
    partition_numel: int  # a rank's momentum partition (the budget), elements
    floor_numel: int  # the every-matrix-alone plan's largest need at depth 1 (the floor), elements
    old_depth: int  # what-if: the planner before its floor rule (old_plan_for_depth)
    old_buckets: int
    old_patched: float
    slack_buckets: int  # what-if: peak allowed FLOOR_SLACK above the floor (slack_plan)
    slack_peak: float  # its largest need over the floor's (at most 1 + FLOOR_SLACK where over budget)
    slack_patched: float


def scale_rows(arch: Arch, world_sizes=WORLD_SIZES, gpus=GPUS) -> List[Row]:
    rows = []
    specs = model.specs_for(model.muon_order(arch.muon_shapes))
    largest = max(owner_plan.newton_schulz_cost(s) for s in specs)
    for w in world_sizes:
        plan, depth, pieces = gpu_plan(arch.muon_shapes, w)
        free, free_depth, _ = gpu_plan(arch.muon_shapes, w, budget=False)
        old, old_depth, _ = gpu_plan(arch.muon_shapes, w, old_rule=True)
        loose, loose_depth, _ = gpu_plan(arch.muon_shapes, w, slack=FLOOR_SLACK)
        with fast_plan():
            loose_need, _ = owner_plan.rank_numels(loose, pieces, owner_plan.slots_for_depth(loose_depth),
                                                   BACK_ITEMSIZE)
            need, budget = owner_plan.rank_numels(plan, pieces, owner_plan.slots_for_depth(depth), BACK_ITEMSIZE)
            alone, _ = owner_plan.rank_numels(owner_plan.plan_owners(specs, w, 1), pieces, 1, BACK_ITEMSIZE)
        for gpu in gpus:
            elementwise = muon_elementwise_seconds(arch, w, gpu)
            patched = patched_seconds(plan, depth, pieces, gpu)
            nobudget = patched_seconds(free, free_depth, pieces, gpu)
            # split: each bucket's slowest owner replaced by LPT over its split costs
            terms = bucket_terms(free, pieces)
            forward = [link_seconds(f * FORWARD_ITEMSIZE, w, A2A_EFFICIENCY) for f, _, _ in terms]
            back = [link_seconds(b * BACK_ITEMSIZE, w, A2A_EFFICIENCY) for _, b, _ in terms]
            compute = [
                ns_seconds(lpt_max(split_costs([free.costs[j] for j in bucket], w, 8), w), gpu)
                for bucket in free.buckets
            ]
            split = pipeline_seconds(forward, compute, back, free_depth)
            rows.append(
                Row(arch.name, gpu.name, w, depth, len(plan.buckets), patched["exchange"], patched["ns"],
                    ns_seconds(max(plan.load()), gpu), patched["pipeline"] + elementwise,
                    stock_seconds(arch, w, gpu)["total"], adamw_seconds(arch, w, gpu), fwd_bwd_seconds(arch, gpu),
                    ns_seconds(largest, gpu), nobudget["pipeline"] + elementwise, split + elementwise, max(need),
                    budget[0], max(alone), old_depth, len(old.buckets),
                    patched_seconds(old, old_depth, pieces, gpu)["pipeline"] + elementwise, len(loose.buckets),
                    max(loose_need) / max(alone),
                    patched_seconds(loose, loose_depth, pieces, gpu)["pipeline"] + elementwise))
    return rows


def saturation(arch: Arch, world_sizes=WORLD_SIZES) -> Dict[str, Optional[int]]:
    """Where the owner plan stops scaling: ``analytic`` = total NS / largest matrix's NS (beyond it the largest
    matrix exceeds the mean share); ``plan``: the first W whose busiest owner (by the plan's loads) holds only the
    largest matrix's cost; ``floor``: the first W where even every matrix alone exceeds the memory budget (the plan
    is then chosen against that floor, at depth 1); ``serial``: the first W where the planner before its floor rule
    (``old_plan_for_depth``) dropped to depth 1 with one matrix per bucket (every bucket's NS then ran while the
    other ranks waited); ``matrices``: how many there are."""
    specs = model.specs_for(model.muon_order(arch.muon_shapes))
    costs = [owner_plan.newton_schulz_cost(s) for s in specs]
    out = dict(matrices=len(costs), analytic=sum(costs) / max(costs), plan=None, floor=None, serial=None)
    for w in world_sizes:
        plan, depth, pieces = gpu_plan(arch.muon_shapes, w)
        if out["plan"] is None and max(plan.load()) <= max(costs) * (1 + 1e-12):
            out["plan"] = w
        if out["floor"] is None:
            with fast_plan():
                if not owner_plan.within_budget(owner_plan.plan_owners(specs, w, 1), pieces, 1, BACK_ITEMSIZE):
                    out["floor"] = w
        if out["serial"] is None:
            old, old_depth, _ = gpu_plan(arch.muon_shapes, w, old_rule=True)
            if old_depth == 1 and len(old.buckets) == len(costs):
                out["serial"] = w
    return out


# --- the check against the emulated-link runs ---------------------------------------------------

NET_OUTPUT = Path("docs") / "performance" / "bench-net-output.txt"
CHECK_WORKLOADS = {  # bench/worker.py WORKLOADS: chains of bias-free Linear layers, weight (out, in)
    "sq1024-gas1-fp32": [1024] * 5,
    "rect1024-gas1-fp32": [1024, 768, 1024, 768, 1024],
}


def chain_shapes(dims: Sequence[int]) -> List[Tuple[int, int]]:
    return [(dims[i + 1], dims[i]) for i in range(len(dims) - 1)]


@dataclass
class Measured:
    world_size: int
    gflops: float  # the CPU's NS throughput, one rank alone
    share: float  # of it per rank with all ranks computing
    link_mbit: float  # the namespace's shaped (aggregate) rate
    step_ms: Dict[Tuple[str, str], float]  # (workload, build) -> step() at the boundary, median
    bucket_mib: Dict[str, float]  # workload -> patched largest bucket's two exchange buffers
    ratio: Dict[str, float]  # workload -> patched/stock step() at the boundary, median of paired repeats


_SPREAD = r"([\d.]+) \[[\d.]+-[\d.]+\]"


def parse_net_output(text: str) -> List[Measured]:
    """The per-W sections of ``bench-net-output.txt`` (``dev.py bench --net auto``)."""
    out = []
    sections = re.split(r"^=== W=(\d+), link ([\d.]+) Mbit/s.*$", text, flags=re.M)
    for k in range(1, len(sections) - 2, 3):
        w, link, body = int(sections[k]), float(sections[k + 1]), sections[k + 2]
        gflops = float(re.search(r"Newton-Schulz on .*?: ([\d.]+) GFLOP/s", body).group(1))
        share = float(re.search(r"computing at once: ([\d.]+)", body).group(1))
        m = Measured(w, gflops, share, link, {}, {}, {})
        for line in body.splitlines():
            fields = line.split()
            if len(fields) < 2 or fields[0] not in CHECK_WORKLOADS:
                continue
            spreads = re.findall(_SPREAD, line)
            if fields[1] in ("stock-0.19.8", "patched-0.19.8") and "P" in fields:
                m.step_ms[(fields[0], fields[1])] = float(spreads[1])
                if fields[1] == "patched-0.19.8":
                    m.bucket_mib[fields[0]] = float(fields[-1])
            elif fields[1] == "patched-0.19.8":  # the ratio table: boundary, step() at boundary, ...
                m.ratio[fields[0]] = float(spreads[1])
        out.append(m)
    return out


def emulated_prediction(workload: str, m: Measured) -> Dict[str, float]:
    """The model on the run's own terms: fp32 both ways (the CPU's "gram" runs in fp32), one shaped queue that
    every rank's sends share (seconds = bytes summed over ranks / the namespace rate), NS at the measured GFLOP/s
    times the share, the plan the run had (one bucket: ``plan_owners`` at DeepSpeed's default bucket, the patch
    before its memory budget; ``bucket_mib`` checks it) and stock's gathers and rounds, each step() serial."""
    shapes = chain_shapes(CHECK_WORKLOADS[workload])
    w = m.world_size
    rate = m.link_mbit * 1e6 / 8  # bytes/s
    flops = m.gflops * 1e9 * m.share
    specs = model.specs_for(model.muon_order(shapes))
    plan = owner_plan.plan_owners(specs, w, model.DEFAULT_BUCKET)
    pieces = model.zero3_pieces(shapes, w)
    forward, compute = [], []
    for b, bucket in enumerate(plan.buckets):
        one = owner_plan.OwnerPlan(w, plan.owners, (bucket, ), plan.costs)
        forward.append(sum(model.exchange_traffic(one, pieces)) / 2 * 4 / rate)  # half goes out, half back; fp32
        compute.append(max(_bucket_loads(plan, b)) / flops)
    patched = pipeline_seconds(forward, compute, forward, model.DEFAULT_DEPTH)
    bucket_bytes = max(
        max(sum(pieces[j][r] for j in bucket)
            for r in range(w)) + max(sum(sum(pieces[j]) for j in bucket if plan.owners[j] == r) for r in range(w))
        for bucket in plan.buckets) * 4
    stock = (model.stock_0198_traffic(shapes, w) * w * 4 / rate + stock_round_costs(shapes, w) / flops)
    return dict(patched=patched,
                stock=stock,
                ratio=patched / stock,
                buckets=len(plan.buckets),
                bucket_mib=bucket_bytes / 2**20)


def _bucket_loads(plan, b):
    loads = [0.0] * plan.world_size
    for j in plan.buckets[b]:
        loads[plan.owners[j]] += plan.costs[j]
    return loads


def check_rows(text: str) -> List[Dict]:
    rows = []
    for m in parse_net_output(text):
        for workload in CHECK_WORKLOADS:
            p = emulated_prediction(workload, m)
            measured = m.ratio[workload]
            rows.append(
                dict(world_size=m.world_size,
                     workload=workload,
                     link_mbit=m.link_mbit,
                     gflops=m.gflops * m.share,
                     predicted_patched_ms=1e3 * p["patched"],
                     measured_patched_ms=m.step_ms[(workload, "patched-0.19.8")],
                     predicted_stock_ms=1e3 * p["stock"],
                     measured_stock_ms=m.step_ms[(workload, "stock-0.19.8")],
                     predicted=p["ratio"],
                     measured=measured,
                     bucket_mib_model=p["bucket_mib"],
                     bucket_mib_run=m.bucket_mib[workload]))
    return rows


# --- output ------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{1e3 * s:.3g}" if s < 10 else f"{s * 1e3:.0f}"


def _pct(x: float) -> str:
    return f"{100 * x:.2g}%" if x < 0.1 else f"{100 * x:.0f}%"


def report(world_sizes=WORLD_SIZES, net_output: Optional[Path] = None) -> Tuple[List[str], List[Row]]:
    lines = [
        "Muon's share of step time at scale: a MODEL (bench/scale.py), not a measurement; no GPU figure was "
        "measured.", "", f"Rates: {H100.name} {H100.matmul_flops / 1e12:.0f} TFLOP/s dense bf16/fp16, HBM "
        f"{H100.hbm_bytes / 1e12:.2f} TB/s; {H200.name} {H200.matmul_flops / 1e12:.0f} TFLOP/s, HBM "
        f"{H200.hbm_bytes / 1e12:.1f} TB/s; NVLink {NVLINK_BYTES / 1e9:.0f} GB/s per GPU each way, "
        f"InfiniBand NDR {IB_BYTES * 8 / 1e9:.0f} Gbit/s per GPU, {GPUS_PER_NODE} GPUs per node.",
        f"Assumed: all-to-all efficiency {A2A_EFFICIENCY}, all-gather {ALLGATHER_EFFICIENCY}, NS at "
        f"{NS_EFFICIENCY} of dense peak, elementwise at {ELEMENTWISE_EFFICIENCY} of HBM, MFU {MFU}, "
        f"{TOKENS_PER_GPU} tokens per GPU per optimizer step.",
        f"Exchange: patched fp32 out ({FORWARD_ITEMSIZE} B), fp16 back ({BACK_ITEMSIZE} B); stock 0.19.8 bf16 "
        f"all-gathers ({STOCK_ITEMSIZE} B). Elementwise bytes per element: AdamW {ADAMW_BYTES}, Muon {MUON_BYTES}.", ""
    ]
    rows = []
    for arch in ARCHS:
        muon = sum(math.prod(s) for s in arch.muon_shapes)
        lines.append(f"== {arch.name}: {arch.note}; {len(arch.muon_shapes)} Muon matrices, {muon / 1e9:.2f}e9 "
                     f"Muon elements, {arch.adam_numel / 1e9:.3f}e9 to Adam, {arch.flop_params / 1e9:.2f}e9 "
                     "matmul parameters per token ==")
        arch_rows = scale_rows(arch, world_sizes)
        rows.extend(arch_rows)
        header = ("W", "GPU", "depth", "buckets", "exchange ms", "NS ms", "NS busiest ms", "Muon ms", "stock ms",
                  "AdamW ms", "fwd+bwd ms", "Muon/fwd+bwd", "stock/fwd+bwd", "AdamW/fwd+bwd", "largest NS ms",
                  "peak/partition", "what-if no budget ms", "what-if +split8 ms", "before: depth, buckets",
                  "before: Muon ms", "before: Muon/fwd+bwd", f"what-if floor+{FLOOR_SLACK:.0%}: buckets, peak/floor",
                  f"what-if floor+{FLOOR_SLACK:.0%}: Muon/fwd+bwd")
        table = [header]
        for r in arch_rows:
            table.append(
                (str(r.world_size), r.gpu.split()[0], str(r.depth), str(r.buckets), _ms(r.exchange), _ms(r.ns),
                 _ms(r.ns_busiest), _ms(r.patched), _ms(r.stock), _ms(r.adamw), _ms(r.fwd_bwd),
                 _pct(r.patched / r.fwd_bwd), _pct(r.stock / r.fwd_bwd), _pct(r.adamw / r.fwd_bwd), _ms(r.ns_largest),
                 f"{r.peak_numel / r.partition_numel:.2f}", _ms(r.nobudget), _ms(r.split8),
                 f"{r.old_depth}, {r.old_buckets}", _ms(r.old_patched), _pct(r.old_patched / r.fwd_bwd),
                 f"{r.slack_buckets}, {r.slack_peak:.4f}" if r.floor_numel > r.partition_numel else "as patched",
                 _pct(r.slack_patched / r.fwd_bwd)))
        widths = [max(len(t[i]) for t in table) for i in range(len(header))]
        for k, t in enumerate(table):
            lines.append("  ".join(c.rjust(n) for c, n in zip(t, widths)))
            if k == 0:
                lines.append("  ".join("-" * n for n in widths))
        s = saturation(arch, world_sizes)
        lines.append(f"saturation: {s['matrices']} matrices; total NS / largest matrix's NS = W {s['analytic']:.0f}; "
                     f"busiest owner holds only the largest matrix's NS from W = {s['plan']}; even every matrix "
                     f"alone exceeds the memory budget (plan chosen against that floor, depth 1) from W = "
                     f"{s['floor']}; before the floor rule the budget serialized NS (depth 1, one matrix per "
                     f"bucket) from W = {s['serial']}")
        lines.append("")
    lines += [
        "Columns (per rank, per optimizer step): exchange = forward + back all-to-all, summed over buckets; NS = the "
        "slowest owner of each bucket, summed (the pipeline's rule); NS busiest = the busiest owner's NS over the step (a lower bound: a rank can run one bucket ahead at depth 2); Muon = the pipeline replayed (depth as planned) + elementwise "
        "(momentum, update, Adam on embedding/head/norms); stock = stock 0.19.8 (all-gathers, NS round by round, "
        "serial); peak/partition = the plan's largest need on a rank (buffers, owner's NS working set, held fp16 "
        "results: owner_plan.rank_numels) over its momentum partition (above 1: the every-matrix-alone floor, "
        "which the plan never exceeds); what-if columns are NOT what the patch does: 'no budget' plans buckets of reduce_bucket_size at "
        "depth 2 whatever the memory; '+split8' also splits every matrix whose NS exceeds the mean share over 8 "
        "ranks (ideal, no communication inside NS); 'before' is the planner before its floor rule (every matrix alone "
        "at depth 1 wherever that alone exceeded the budget); 'floor+1%' lets every rank need up to 1.01 x the floor "
        "(the every-matrix-alone plan's largest need) where that floor exceeds the budget, at depth 1 (peak/floor: "
        "its largest need over the floor's; 'as patched' where the budget is met).", ""
    ]
    if net_output is not None and net_output.exists():
        lines.append(f"== check: patched/stock 0.19.8 step() at the boundary, model vs {NET_OUTPUT.as_posix()} ==")
        lines.append("model on the run's terms: fp32 exchange both ways, the namespace's aggregate rate shared by "
                     "every rank's sends, NS at the run's GFLOP/s x share, one bucket (as the run's 'bucket MiB' "
                     "column says), each step() serial; elementwise work and gloo's latency not modelled")
        header = ("W", "workload", "link Mbit/s", "NS GFLOP/s", "bucket MiB model/run", "patched ms model/run",
                  "stock ms model/run", "ratio model", "ratio measured", "model - measured")
        table = [header]
        for c in check_rows(net_output.read_text()):
            table.append((str(c["world_size"]), c["workload"], f"{c['link_mbit']:.1f}", f"{c['gflops']:.1f}",
                          f"{c['bucket_mib_model']:.1f}/{c['bucket_mib_run']:.1f}",
                          f"{c['predicted_patched_ms']:.0f}/{c['measured_patched_ms']:.0f}",
                          f"{c['predicted_stock_ms']:.0f}/{c['measured_stock_ms']:.0f}", f"{c['predicted']:.3f}",
                          f"{c['measured']:.2f}", f"{c['predicted'] - c['measured']:+.3f}"))
        widths = [max(len(t[i]) for t in table) for i in range(len(header))]
        for k, t in enumerate(table):
            lines.append("  ".join(c.rjust(n) for c, n in zip(t, widths)))
            if k == 0:
                lines.append("  ".join("-" * n for n in widths))
    return lines, rows


def plot(rows: Sequence[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ARCHS), figsize=(5 * len(ARCHS), 4.8), sharey=True)
    for ax, arch in zip(axes, ARCHS):
        for gpu, ls in ((H100, "-"), (H200, "--")):
            sel = [r for r in rows if r.arch == arch.name and r.gpu == gpu.name]
            ws = [r.world_size for r in sel]
            tag = gpu.name.split()[0]
            ax.plot(ws, [r.patched / r.fwd_bwd for r in sel],
                    ls,
                    color="tab:blue",
                    marker="o",
                    ms=3,
                    label=f"Muon, patched ({tag})")
            ax.plot(ws, [r.stock / r.fwd_bwd for r in sel],
                    ls,
                    color="tab:orange",
                    label=f"Muon, stock 0.19.8 ({tag})")
            ax.plot(ws, [r.adamw / r.fwd_bwd for r in sel], ls, color="k", label=f"AdamW ({tag})")
            if gpu is H100:
                ax.plot(ws, [r.old_patched / r.fwd_bwd for r in sel],
                        ":",
                        color="tab:blue",
                        marker="x",
                        ms=3,
                        label="Muon, patched before the floor rule (H100)")
                ax.plot(ws, [r.slack_patched / r.fwd_bwd for r in sel],
                        "-.",
                        color="tab:purple",
                        label=f"what-if: peak up to floor+{FLOOR_SLACK:.0%} (H100)")
                ax.plot(ws, [r.split8 / r.fwd_bwd for r in sel],
                        ":",
                        color="tab:green",
                        label="what-if: no budget + NS split over 8 (H100)")
        ax.set(xscale="log", yscale="log", xlabel="ranks W (8 GPUs per node)", title=arch.name)
        ax.set_xticks(WORLD_SIZES)
        ax.set_xticklabels([str(w) for w in WORLD_SIZES], fontsize=7)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(f"optimizer step / forward+backward\n({TOKENS_PER_GPU} tokens per GPU, MFU {MFU:.0%})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7)
    fig.suptitle("Model (not measured): optimizer step time as a share of forward+backward", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        type=Path,
                        default=None,
                        help="directory for scale-output.txt and muon_share_vs_w.png (default: print only)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--net-output",
                        type=Path,
                        default=ROOT / NET_OUTPUT,
                        help="the emulated-link run to check the model's ratios against")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    lines, rows = report(args.world_sizes, args.net_output)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale-output.txt").write_text(text)
        if not args.no_plot:
            plot(rows, args.out / "muon_share_vs_w.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
