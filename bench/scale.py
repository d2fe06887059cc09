# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's share of step time at scale, on paper: ``bench/model.py``'s elements turned into seconds.

A model, not a measurement: no GPU figure here was measured. Every rate below is a named
constant with its source or marked an assumption; ``python3 bench/scale.py --out docs/performance``
prints the tables (``scale-output.txt``) and draws ``muon_share_vs_w.png``.

Per rank and optimizer step (ZeRO-3, data parallel over W GPUs, 8 per node):

- **Muon, patched** (the owner plans ``owner_plan.plan_partitions`` builds per ZeRO-3 sub-group, loaded by
  ``model.py`` from the patch, with ``result_itemsize`` 2: on a GPU the default ``ns_method`` "gram" computes in
  fp16, ``original_muon.ns_compute_dtype``; under the default ``max_step_memory`` and, printed beside it, under
  ``"momentum_partition"``, within each rank's momentum partition): per bucket, the forward exchange (fp32 NS input,
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

Sub-groups (``sub_group_size``'s default) are planned and run one after another, as ``MuonUpdate`` runs them; an
all-to-all's start-up is an assumption (``A2A_LATENCY_S``). Not modelled: kernel launch latency, the gradient norm
and clipping (common to both optimizers).
"""

import argparse
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
# all-to-all start-up: a fixed part plus one per peer (NCCL's all-to-all posts a send and a receive per peer)
A2A_LATENCY_S, A2A_PEER_LATENCY_S = 20e-6, 1e-6
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

# --- the plan: the patch's own ---------------------------------------------------------------------

SUB_GROUP_SIZE = owner_plan.DEFAULT_SUB_GROUP_SIZE  # zero_optimization.sub_group_size's default
STRICT = owner_plan.STRICT  # max_step_memory's strict value: within each rank's momentum partition


def zero3_pieces(shapes, world_size) -> List["owner_plan.Uniform"]:
    """``model.zero3_pieces`` as ``Uniform`` sequences (``ceil(numel / W)`` on every rank)."""
    return [owner_plan.Uniform(math.ceil(math.prod(s) / world_size), world_size) for s in model.muon_order(shapes)]


def gpu_plans(shapes,
              world_size,
              max_step_memory=model.DEFAULT_MAX_STEP_MEMORY,
              bucket_numel=model.DEFAULT_BUCKET,
              depth=model.DEFAULT_DEPTH,
              budget=True):
    """Per ZeRO-3 sub-group ``(plan, depth, pieces)``: the patch's plan on a GPU (``owner_plan.plan_partitions``
    with NS in fp16, ``result_itemsize`` 2, as ``MuonUpdate`` plans them) under ``max_step_memory`` (``STRICT``: within
    each rank's momentum partition). ``budget=False``: a what-if, ``plan_owners`` at ``reduce_bucket_size`` and depth
    kept, whatever the memory."""
    specs = model.specs_for(model.muon_order(shapes))
    if not budget:
        pieces = zero3_pieces(shapes, world_size)
        return [(owner_plan.plan_owners(specs, world_size, bucket_numel), depth, pieces)]
    parts = owner_plan.plan_partitions(specs, world_size, 3, SUB_GROUP_SIZE, bucket_numel, max_step_memory, depth,
                                       BACK_ITEMSIZE)
    return [(plan, d, pieces) for _, plan, d, pieces, *_ in parts]


def gpu_plan(shapes, world_size, **kwargs):
    """``gpu_plans``' one sub-group (a model whose rank's partition fits ``sub_group_size``): ``(plan, depth,
    pieces)``.

    Raises:
        ValueError: there are several."""
    plans = gpu_plans(shapes, world_size, **kwargs)
    if len(plans) != 1:
        raise ValueError(f"{len(plans)} sub-groups at W={world_size}; use gpu_plans")
    return plans[0]


# --- time --------------------------------------------------------------------------------------


def link_seconds(nbytes: float, world_size: int, efficiency: float) -> float:
    """One collective whose busiest rank moves ``nbytes`` each way, spread evenly over its W - 1 peers: the
    share to peers on other nodes (``max(0, W - 8) / (W - 1)``) over InfiniBand, the rest over NVLink, at once;
    the slower sets the time. W <= 8: NVLink only."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    off = max(0, world_size - GPUS_PER_NODE) / (world_size - 1)
    return max(nbytes * off / (IB_BYTES * efficiency), nbytes * (1 - off) / (NVLINK_BYTES * efficiency))


def a2a_latency(world_size: int) -> float:
    """Seconds an all-to-all over W ranks costs besides its bytes (assumed: ``A2A_LATENCY_S`` + a peer's share)."""
    return 0.0 if world_size <= 1 else A2A_LATENCY_S + A2A_PEER_LATENCY_S * (world_size - 1)


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
            return a2a_latency(w) + link_seconds(nbytes, w, A2A_EFFICIENCY)
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
    depth: int  # the least over sub-groups
    buckets: int  # over every sub-group
    sub_groups: int
    exchange: float
    ns: float
    ns_busiest: float  # the busiest owner's NS over the whole step (perfect overlap across buckets: a lower bound)
    patched: float  # Muon optimizer step, patched: pipelines of every sub-group + elementwise
    stock: float
    adamw: float
    fwd_bwd: float
    ns_largest: float  # NS seconds of the largest matrix alone
    ns_efficiency: float  # owner_plan.PlanFigures.ns_efficiency of the default plan
    peak_bytes: int  # the default plan's largest need on any rank (owner_plan.PlanFigures)
    floor_bytes: int  # the least any plan needs on a rank (every matrix alone, depth 1)
    partition_bytes: int  # a rank's fp32 momentum partition (the strict rule's budget)
    nobudget: float  # what-if: no memory limit (depth 2, reduce_bucket_size buckets)
    split8: float  # what-if: no limit and the costliest matrices' NS split over 8 ranks
    strict_depth: int  # max_step_memory "momentum_partition": within each rank's momentum partition
    strict_buckets: int
    strict_patched: float
    strict_efficiency: float
    strict_peak_bytes: int


def _step(plans, w, gpu: Gpu) -> Dict[str, float]:
    """``patched_seconds`` summed over the sub-groups' pipelines (one after the other, as ``step()`` runs them)."""
    out = dict(exchange=0.0, ns=0.0, pipeline=0.0)
    for plan, depth, pieces in plans:
        for k, v in patched_seconds(plan, depth, pieces, gpu).items():
            out[k] += v
    return out


def _figures(plans, w):
    return owner_plan.plan_figures([(plan, d, pieces, BACK_ITEMSIZE, None) for plan, d, pieces in plans], w)


def scale_rows(arch: Arch, world_sizes=WORLD_SIZES, gpus=GPUS) -> List[Row]:
    rows = []
    specs = model.specs_for(model.muon_order(arch.muon_shapes))
    largest = max(owner_plan.newton_schulz_cost(s) for s in specs)
    for w in world_sizes:
        plans = gpu_plans(arch.muon_shapes, w)
        strict = gpu_plans(arch.muon_shapes, w, max_step_memory=STRICT)
        free, free_depth, free_pieces = gpu_plans(arch.muon_shapes, w, budget=False)[0]
        figures, strict_figures = _figures(plans, w), _figures(strict, w)
        load = [sum(col) for col in zip(*(plan.load() for plan, _, _ in plans))]
        floor = 4 * owner_plan.floor_numel(specs, zero3_pieces(arch.muon_shapes, w), w, result_itemsize=BACK_ITEMSIZE)
        partition = 4 * sum(math.ceil(s.numel / w) for s in specs)
        for gpu in gpus:
            elementwise = muon_elementwise_seconds(arch, w, gpu)
            patched = _step(plans, w, gpu)
            nobudget = patched_seconds(free, free_depth, free_pieces, gpu)
            # split: each bucket's slowest owner replaced by LPT over its split costs
            terms = bucket_terms(free, free_pieces)
            forward = [a2a_latency(w) + link_seconds(f * FORWARD_ITEMSIZE, w, A2A_EFFICIENCY) for f, _, _ in terms]
            back = [a2a_latency(w) + link_seconds(b * BACK_ITEMSIZE, w, A2A_EFFICIENCY) for _, b, _ in terms]
            compute = [
                ns_seconds(lpt_max(split_costs([free.costs[j] for j in bucket], w, 8), w), gpu)
                for bucket in free.buckets
            ]
            split = pipeline_seconds(forward, compute, back, free_depth)
            rows.append(
                Row(arch.name, gpu.name, w, figures.depth, figures.buckets, len(plans), patched["exchange"],
                    patched["ns"], ns_seconds(max(load), gpu), patched["pipeline"] + elementwise,
                    stock_seconds(arch, w, gpu)["total"], adamw_seconds(arch, w, gpu), fwd_bwd_seconds(arch, gpu),
                    ns_seconds(largest, gpu), figures.ns_efficiency, figures.peak_bytes, floor, partition,
                    nobudget["pipeline"] + elementwise, split + elementwise, strict_figures.depth,
                    strict_figures.buckets,
                    _step(strict, w, gpu)["pipeline"] + elementwise, strict_figures.ns_efficiency,
                    strict_figures.peak_bytes))
    return rows


def saturation(arch: Arch, world_sizes=WORLD_SIZES) -> Dict[str, Optional[int]]:
    """Where the owner plan stops scaling: ``analytic`` = total NS / largest matrix's NS (beyond it the largest
    matrix exceeds the mean share); ``plan``: the first W whose busiest owner (by the default plan's loads) holds
    only the largest matrix's cost; ``floor``: the first W where even every matrix alone exceeds the momentum
    partition (from there the strict rule sits at that floor, depth 1); ``matrices``: how many there are."""
    specs = model.specs_for(model.muon_order(arch.muon_shapes))
    costs = [owner_plan.newton_schulz_cost(s) for s in specs]
    out = dict(matrices=len(costs), analytic=sum(costs) / max(costs), plan=None, floor=None)
    for w in world_sizes:
        plans = gpu_plans(arch.muon_shapes, w)
        load = [sum(col) for col in zip(*(plan.load() for plan, _, _ in plans))]
        if out["plan"] is None and max(load) <= max(costs) * (1 + 1e-12):
            out["plan"] = w
        if out["floor"] is None:
            pieces = zero3_pieces(arch.muon_shapes, w)
            if owner_plan.floor_numel(specs, pieces, w, result_itemsize=BACK_ITEMSIZE) > sum(p.value for p in pieces):
                out["floor"] = w
    return out


# Targets of max_step_memory's default (H100 rates, 16,384 tokens per GPU): Muon's step over fwd+bwd at most
# the share, from the first W on; NS parallel efficiency at least EFFICIENCY_TARGET at TARGET_WORLD_SIZES; the peak
# of Muon's step at most PEAK_TARGETS.
SHARE_TARGETS = {
    "Llama-3 8B": ((32, 32, 0.04), (256, 4096, 0.02)),
    "Llama-3 70B": ((32, 32, 0.06), (64, 64, 0.04), (256, 4096, 0.02)),
    "Qwen3-30B-A3B (MoE)": ((64, 4096, 0.05), ),
}
EFFICIENCY_TARGET, TARGET_WORLD_SIZES = 0.75, (8, 32, 256, 1024, 4096)
PEAK_TARGETS = {"Llama-3 8B": 4 * 2**30, "Llama-3 70B": 8 * 2**30}


def target_lines(arch: Arch, rows: Sequence[Row]) -> List[str]:
    """One line per target of ``arch``: the figure, and MET or MISSED."""
    h100 = [r for r in rows if r.gpu == H100.name]
    lines = []
    for low, high, share in SHARE_TARGETS.get(arch.name, ()):
        sel = [r for r in h100 if low <= r.world_size <= high]
        if sel:
            worst = max(sel, key=lambda r: r.patched / r.fwd_bwd)
            verdict = "MET" if worst.patched / worst.fwd_bwd <= share else "MISSED"
            worst_share = _pct(worst.patched / worst.fwd_bwd)
            lines.append(f"target: Muon/fwd+bwd <= {share:.0%} at W={low}..{high}: worst {worst_share} at "
                         f"W={worst.world_size}: {verdict}")
    sel = [r for r in h100 if r.world_size in TARGET_WORLD_SIZES]
    if sel:
        worst = min(sel, key=lambda r: r.ns_efficiency)
        verdict = "MET" if worst.ns_efficiency >= EFFICIENCY_TARGET else "MISSED"
        lines.append(f"target: NS parallel efficiency >= {EFFICIENCY_TARGET} at W in {TARGET_WORLD_SIZES}: worst "
                     f"{worst.ns_efficiency:.3f} at W={worst.world_size}: {verdict}")
    if arch.name in PEAK_TARGETS and h100:
        worst = max(h100, key=lambda r: r.peak_bytes)
        verdict = "MET" if worst.peak_bytes <= PEAK_TARGETS[arch.name] else "MISSED"
        lines.append(f"target: peak of Muon's step <= {PEAK_TARGETS[arch.name] / 2**30:g} GiB: largest "
                     f"{worst.peak_bytes / 2**30:.2f} GiB at W={worst.world_size}: {verdict}")
    return lines


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
    forward, compute, bucket_numels = [], [], []
    for b, bucket in enumerate(plan.buckets):
        one = owner_plan.OwnerPlan(w, plan.owners, (bucket, ), plan.costs)
        forward.append(sum(model.exchange_traffic(one, pieces)) / 2 * 4 / rate)  # half goes out, half back; fp32
        compute.append(max(_bucket_loads(plan, b)) / flops)
        bucket_numels.append(max(owner_plan.reserved_numel(one, pieces, 1)))  # one slot: its send and receive buffers
    patched = pipeline_seconds(forward, compute, forward, model.DEFAULT_DEPTH)
    bucket_bytes = max(bucket_numels) * 4
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
        f"Assumed: all-to-all efficiency {A2A_EFFICIENCY} and start-up {A2A_LATENCY_S * 1e6:g} us + "
        f"{A2A_PEER_LATENCY_S * 1e6:g} us per peer, all-gather {ALLGATHER_EFFICIENCY}, NS at "
        f"{NS_EFFICIENCY} of dense peak, elementwise at {ELEMENTWISE_EFFICIENCY} of HBM, MFU {MFU}, "
        f"{TOKENS_PER_GPU} tokens per GPU per optimizer step.",
        f"Exchange: patched fp32 out ({FORWARD_ITEMSIZE} B), fp16 back ({BACK_ITEMSIZE} B); stock 0.19.8 bf16 "
        f"all-gathers ({STOCK_ITEMSIZE} B). Elementwise bytes per element: AdamW {ADAMW_BYTES}, Muon {MUON_BYTES}.",
        f"Patched: the default max_step_memory ({model.DEFAULT_MAX_STEP_MEMORY / 2**30:g} GiB); strict: "
        f"max_step_memory \"{STRICT}\" (the rule before: within the momentum partition); ZeRO-3 sub-groups of "
        f"sub_group_size {SUB_GROUP_SIZE:.0e} partition elements, each its own pipeline.", ""
    ]
    rows = []
    for arch in ARCHS:
        muon = sum(math.prod(s) for s in arch.muon_shapes)
        lines.append(f"== {arch.name}: {arch.note}; {len(arch.muon_shapes)} Muon matrices, {muon / 1e9:.2f}e9 "
                     f"Muon elements, {arch.adam_numel / 1e9:.3f}e9 to Adam, {arch.flop_params / 1e9:.2f}e9 "
                     "matmul parameters per token ==")
        arch_rows = scale_rows(arch, world_sizes)
        rows.extend(arch_rows)
        header = ("W", "GPU", "sub-groups", "depth", "buckets", "exchange ms", "NS ms", "NS busiest ms", "Muon ms",
                  "stock ms", "AdamW ms", "fwd+bwd ms", "Muon/fwd+bwd", "stock/fwd+bwd", "AdamW/fwd+bwd",
                  "largest NS ms", "NS eff.", "peak GiB", "floor GiB", "momentum GiB", "what-if no limit ms",
                  "what-if +split8 ms", "strict: depth, buckets", "strict: NS eff.", "strict: peak GiB",
                  "strict: Muon ms", "strict: Muon/fwd+bwd")
        table = [header]
        for r in arch_rows:
            table.append(
                (str(r.world_size), r.gpu.split()[0], str(r.sub_groups), str(r.depth), str(r.buckets),
                 _ms(r.exchange), _ms(r.ns), _ms(r.ns_busiest), _ms(r.patched), _ms(r.stock), _ms(r.adamw),
                 _ms(r.fwd_bwd), _pct(r.patched / r.fwd_bwd), _pct(r.stock / r.fwd_bwd), _pct(r.adamw / r.fwd_bwd),
                 _ms(r.ns_largest), f"{r.ns_efficiency:.2f}", f"{r.peak_bytes / 2**30:.2f}",
                 f"{r.floor_bytes / 2**30:.2f}", f"{r.partition_bytes / 2**30:.2f}", _ms(r.nobudget), _ms(r.split8),
                 f"{r.strict_depth}, {r.strict_buckets}", f"{r.strict_efficiency:.2f}",
                 f"{r.strict_peak_bytes / 2**30:.2f}", _ms(r.strict_patched), _pct(r.strict_patched / r.fwd_bwd)))
        widths = [max(len(t[i]) for t in table) for i in range(len(header))]
        for k, t in enumerate(table):
            lines.append("  ".join(c.rjust(n) for c, n in zip(t, widths)))
            if k == 0:
                lines.append("  ".join("-" * n for n in widths))
        s = saturation(arch, world_sizes)
        lines.append(f"saturation: {s['matrices']} matrices; total NS / largest matrix's NS = W {s['analytic']:.0f}; "
                     f"busiest owner holds only the largest matrix's NS from W = {s['plan']}; even every matrix "
                     f"alone exceeds the momentum partition (the strict rule's floor, depth 1) from W = {s['floor']}")
        lines += target_lines(arch, arch_rows)
        lines.append("")
    lines += [
        "Columns (per rank, per optimizer step): exchange = forward + back all-to-all, summed over buckets; NS = the "
        "slowest owner of each bucket, summed (the pipeline's rule); NS busiest = the busiest owner's NS over the "
        "step (a lower bound); Muon = each sub-group's pipeline replayed (depth as planned), summed, + elementwise "
        "(momentum, update, Adam on embedding/head/norms); stock = stock 0.19.8 (all-gathers, NS round by round, "
        "serial); NS eff. = max(total NS / W, largest matrix's) over the NS column's cost (owner_plan.PlanFigures); "
        "peak = the plan's largest need on a rank (buffers, owner's NS working set in fp16, held fp16 results: "
        "owner_plan.rank_numels); floor = the least any plan needs (every matrix alone, depth 1); momentum = a "
        "rank's fp32 momentum partition, what the strict rule stays within where the floor allows; what-if columns "
        "are NOT what the patch does: 'no limit' plans buckets of reduce_bucket_size at depth 2 whatever the "
        "memory; '+split8' also splits every matrix whose NS exceeds the mean share over 8 ranks (ideal, no "
        "communication inside NS); 'strict' is max_step_memory \"momentum_partition\", the rule before this "
        "default.", ""
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
                    label=f"Muon, patched, default max_step_memory ({tag})")
            ax.plot(ws, [r.stock / r.fwd_bwd for r in sel],
                    ls,
                    color="tab:orange",
                    label=f"Muon, stock 0.19.8 ({tag})")
            ax.plot(ws, [r.adamw / r.fwd_bwd for r in sel], ls, color="k", label=f"AdamW ({tag})")
            if gpu is H100:
                ax.plot(ws, [r.strict_patched / r.fwd_bwd for r in sel],
                        ":",
                        color="tab:blue",
                        marker="x",
                        ms=3,
                        label=f"Muon, patched, max_step_memory \"{STRICT}\" (the rule before; H100)")
                ax.plot(ws, [r.split8 / r.fwd_bwd for r in sel],
                        ":",
                        color="tab:green",
                        label="what-if: no limit + NS split over 8 (H100)")
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
