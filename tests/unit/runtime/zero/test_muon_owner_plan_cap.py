# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner plan under ``max_step_memory`` (``plan_within_cap``): every owner computes at once within the
cap, the deepest pipeline it allows, a refusal with the least need below it; the heap LPT equals a scan over
the bins; ``Uniform`` pieces give the needs of the lists they stand for; ``plan_figures``."""

import math
import random

import pytest

from deepspeed.runtime.zero.muon.owner_plan import (BUCKET_FACTORS, DEFAULT_MAX_STEP_MEMORY, STRICT, CapBelowFloor,
                                                    MatrixSpec, OwnerPlan, Uniform, critical_path, floor_numel,
                                                    ideal_path, make_cost_buckets, newton_schulz_cost, plan_figures,
                                                    plan_for_depth, plan_owners, plan_partition, plan_partitions,
                                                    plan_within_cap, rank_numels, slots_for_depth)


def llama3(layers, hidden, kv, mlp):
    """Llama-3's Muon matrices (q, k, v, o, gate, up, down per layer) in the optimizer's order: upstream
    ``MuonWithAuxAdam`` sorts a group's parameters by ``size()``, descending."""
    return sorted([(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden),
                   (hidden, mlp)] * layers,
                  reverse=True)


LLAMA3_8B = llama3(32, 4096, 1024, 14336)
LLAMA3_70B = llama3(80, 8192, 1024, 28672)


def _zero3(shapes, world_size, uniform=True):
    specs = [MatrixSpec(tuple(s)) for s in shapes]
    make = (lambda n: Uniform(n, world_size)) if uniform else (lambda n: (n, ) * world_size)
    return specs, [make(math.ceil(s.numel / world_size)) for s in specs]


def _scan_lpt_plan(specs, world_size, buckets, initial_load=None):
    """The LPT of ``plan_owners`` by scans over the W bins and ranks (the least ``(load, index)`` each time)."""
    costs = [newton_schulz_cost(s) for s in specs]
    owners, total = [0] * len(specs), list(initial_load or [0.0] * world_size)
    for bucket in buckets:
        bin_of, bin_load = {}, [0.0] * world_size
        for j in sorted(bucket, key=lambda j: (-costs[j], j)):
            b = min(range(world_size), key=lambda b: (bin_load[b], b))
            bin_of[j] = b
            bin_load[b] += costs[j]
        bins = sorted(range(world_size), key=lambda b: (-bin_load[b], b))
        ranks = sorted(range(world_size), key=lambda r: (total[r], r))
        rank_of_bin = dict(zip(bins, ranks))
        for j in bucket:
            owners[j] = rank_of_bin[bin_of[j]]
        for b, r in rank_of_bin.items():
            total[r] += bin_load[b]
    return tuple(owners)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("seed", range(4))
def test_heap_lpt_equals_a_scan_over_the_bins(world_size, seed):
    rng = random.Random(seed)
    shapes = [(rng.choice([0, 8, 16, 64, 96]), rng.choice([8, 32, 64])) for _ in range(50)]  # ties, zero costs
    specs = [MatrixSpec(s) for s in shapes]
    loads = [None, [float(rng.choice([0, 1e5, 2e5])) for _ in range(world_size)]]  # earlier partitions' NS, tied
    for factor in BUCKET_FACTORS:
        buckets = make_cost_buckets([newton_schulz_cost(s) for s in specs], world_size, factor)
        for load in loads:
            plan = plan_owners(specs, world_size, 0, initial_load=load, buckets=buckets)
            assert plan.buckets == buckets
            assert plan.owners == _scan_lpt_plan(specs, world_size, buckets, load), (factor, load)


def test_cost_buckets_cover_in_order_and_close_at_the_factor():
    costs = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 2.0]
    assert make_cost_buckets(costs, 2, 0.0) == tuple((j, ) for j in range(10))
    assert make_cost_buckets(costs, 2, math.inf) == (tuple(range(10)), )
    # at factor 1, W=2: a bucket closes once its cost reaches twice its largest matrix's
    assert make_cost_buckets(costs, 2, 1.0) == ((0, 1, 2, 3, 4), (5, 6), (7, 8), (9, ))


@pytest.mark.parametrize("world_size", [2, 4, 7])
def test_uniform_pieces_give_the_needs_of_their_lists(world_size):
    shapes = llama3(2, 96, 32, 160)
    specs, uniform = _zero3(shapes, world_size)
    _, lists = _zero3(shapes, world_size, uniform=False)
    for factor in (0.0, 1.0, math.inf):
        plan = plan_owners(specs,
                           world_size,
                           0,
                           buckets=make_cost_buckets([newton_schulz_cost(s) for s in specs], world_size, factor))
        for slots in (1, 3):
            assert rank_numels(plan, uniform, slots, 2,
                               [7] * len(specs)) == rank_numels(plan, lists, slots, 2, [7] * len(specs))
    assert Uniform.of((5, 5, 5)) == Uniform(5, 3) and Uniform.of((5, 4)) == (5, 4)


@pytest.mark.parametrize("shapes,world_size", [(LLAMA3_8B, 8), (LLAMA3_8B, 32), (LLAMA3_8B, 1024), (LLAMA3_70B, 32),
                                               (LLAMA3_70B, 256), (LLAMA3_70B, 4096)],
                         ids=["8b-w8", "8b-w32", "8b-w1024", "70b-w32", "70b-w256", "70b-w4096"])
def test_default_cap_every_owner_computes_at_once(shapes, world_size):
    """Under the default cap (NS in fp16, a GPU's "gram"): every rank within it, NS parallel efficiency at least
    0.75 (the strict rule's plan serializes there: one matrix per bucket or close to it), pipeline depth 2."""
    specs, pieces = _zero3(shapes, world_size)
    plan, depth = plan_within_cap(specs, pieces, world_size, DEFAULT_MAX_STEP_MEMORY // 4, 2, result_itemsize=2)
    need, _ = rank_numels(plan, pieces, slots_for_depth(depth), 2)
    assert max(need) <= DEFAULT_MAX_STEP_MEMORY // 4
    assert depth == 2
    efficiency = ideal_path(plan.costs, world_size) / critical_path(plan)
    assert efficiency >= 0.75, efficiency
    assert plan_figures([(plan, depth, pieces, 2, None)], world_size).ns_efficiency == pytest.approx(efficiency)
    strict, strict_depth = plan_for_depth(specs, pieces, world_size, 500_000_000, 2, result_itemsize=4)
    if world_size >= 32:  # with fp32 NS (CPU) the strict rule sits at its floor from here
        assert ideal_path(strict.costs, world_size) / critical_path(strict) < 0.75


def test_a_cap_below_the_floor_is_refused_with_the_least_need():
    specs, pieces = _zero3(LLAMA3_8B[:7], 8)
    floor = floor_numel(specs, pieces, 8, result_itemsize=2)
    with pytest.raises(CapBelowFloor) as refused:
        plan_within_cap(specs, pieces, 8, floor - 1, 2, result_itemsize=2)
    assert refused.value.needed_numel == floor and str(4 * floor) in str(refused.value)
    plan, depth = plan_within_cap(specs, pieces, 8, floor, 2, result_itemsize=2)
    assert depth == 1 and max(rank_numels(plan, pieces, 1, 2)[0]) <= floor


def test_matrices_that_stay_home_take_no_buffer():
    """A matrix one holder orthogonalizes in place (``travels`` False) adds no exchange buffer, only its working
    set: at W = 1 the plan needs the largest working set alone."""
    specs = [MatrixSpec(s, travels=False) for s in LLAMA3_8B[:7]]
    pieces = [(s.numel, ) for s in specs]
    plan, depth = plan_within_cap(specs, pieces, 1, DEFAULT_MAX_STEP_MEMORY // 4, 2, result_itemsize=2)
    assert max(rank_numels(plan, pieces, slots_for_depth(depth), 2)[0]) == max(s.ns_workspace(2) for s in specs)
    travelling = [MatrixSpec(s) for s in LLAMA3_8B[:7]]
    assert max(rank_numels(plan_owners(travelling, 1, 0, buckets=plan.buckets), pieces, 3,
                           2)[0]) > max(s.ns_workspace(2) for s in specs)


def test_the_cap_lowers_the_depth_before_the_buckets():
    """70B at W=8: depth 2 needs about 7 GiB; under a 4 GiB cap the plan keeps its buckets at depth 1."""
    specs, pieces = _zero3(LLAMA3_70B, 8)
    deep, deep_depth = plan_within_cap(specs, pieces, 8, 8 * 2**30 // 4, 2, result_itemsize=2)
    shallow, shallow_depth = plan_within_cap(specs, pieces, 8, 4 * 2**30 // 4, 2, result_itemsize=2)
    assert (deep_depth, shallow_depth) == (2, 1)
    assert max(rank_numels(shallow, pieces, 1, 2)[0]) <= 4 * 2**30 // 4
    assert critical_path(shallow) <= critical_path(deep) * 1.05


def test_strict_value_is_the_momentum_partition_rule():
    specs, pieces = _zero3(llama3(4, 64, 16, 160), 4)
    assert plan_partition(specs, pieces, 4, STRICT, 10**9, 2) == plan_for_depth(specs, pieces, 4, 10**9, 2)
    assert plan_partition(specs, pieces, 4, 2**30, 10**9, 2) == plan_within_cap(specs, pieces, 4, 2**28, 2)


def test_plan_figures_count_every_rank():
    specs, pieces = _zero3([(64, 64), (32, 64)], 2)
    plan = OwnerPlan(2, (0, 1), ((0, 1), ), tuple(newton_schulz_cost(s) for s in specs),
                     tuple(s.ns_workspace(4) for s in specs))
    figures = plan_figures([(plan, 1, pieces, 4, [10, 20])], 2)
    need, budget = rank_numels(plan, pieces, 1, 4, [10, 20])
    assert figures.peak_bytes == 4 * max(need) and figures.buckets == 1 and figures.depth == 1
    assert figures.kept_bytes == 4 * max(budget[0] + 10, budget[1] + 20)
    assert figures.ns_efficiency == pytest.approx(ideal_path(plan.costs, 2) / max(plan.costs))


@pytest.mark.parametrize("stage,world_size", [(3, 1), (3, 4), (2, 2), (1, 4)])
def test_the_least_need_reported_is_the_refusals(stage, world_size):
    """``plan_partitions``' least need per partition (what the plan report prints) is the figure a cap below it is
    refused with, and that cap fits: ZeRO-3 and the ZeRO-1/2 flat partition, matrices held whole (no buffer) too."""
    specs = [MatrixSpec(s) for s in llama3(2, 96, 32, 160)]
    parts = plan_partitions(specs, world_size, stage, 10**9, 10**9, DEFAULT_MAX_STEP_MEMORY, 2, 2)
    least = max(entry[-1] for entry in parts)
    with pytest.raises(CapBelowFloor) as refused:
        plan_partitions(specs, world_size, stage, 10**9, 10**9, 4 * least - 4, 2, 2)
    assert refused.value.needed_numel == least
    fits = plan_partitions(specs, world_size, stage, 10**9, 10**9, 4 * least, 2, 2)
    assert plan_figures([e[1:6] for e in fits], world_size).peak_bytes <= 4 * least
