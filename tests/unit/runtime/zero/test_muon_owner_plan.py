# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner plan: every matrix owned exactly once, deterministic, buckets bounded, cost balanced (heap LPT equals a
scan over the bins); buckets chosen against the floor where every matrix alone exceeds the momentum budget; under
``max_step_memory`` every owner computes at once within the cap at the deepest pipeline it allows, a cap below the
least need refused; ``Uniform`` pieces give the needs of the lists they stand for."""

import math
import random

import pytest

from deepspeed.runtime.zero.muon.owner_plan import (BUCKET_FACTORS, DEFAULT_MAX_STEP_MEMORY, STRICT, CapBelowFloor,
                                                    MatrixSpec, OwnerPlan, Uniform, critical_path, floor_numel,
                                                    ideal_path, make_buckets, make_cost_buckets, newton_schulz_cost,
                                                    plan_figures, plan_for_depth, plan_owners, plan_partition,
                                                    plan_partitions, plan_within_cap, rank_numels, slots_for_depth,
                                                    within_budget)


def _spec(shape, world_size=4, **kwargs):
    return MatrixSpec(shape=shape, **kwargs)


def llama_like(layers=4, hidden=256, kv=64, ffn=688):
    """Projection shapes of a small Llama-style model: q, k, v, o, gate, up, down per layer."""
    shapes = []
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
                   (hidden, ffn)]
    return shapes


def llama3(layers, hidden, kv, mlp):
    """Llama-3's Muon matrices, sorted by ``size()`` descending as upstream ``MuonWithAuxAdam`` orders a group."""
    return sorted(llama_like(layers, hidden, kv, mlp), reverse=True)


# 8B, 32 layers: per layer gate, up 14336x4096, down 4096x14336, q, o 4096x4096, k, v 1024x4096.
LLAMA3_8B = llama3(32, 4096, 1024, 14336)
LLAMA3_70B = llama3(80, 8192, 1024, 28672)


def random_shapes(seed, count=40):
    rng = random.Random(seed)
    return [(rng.randint(1, 300), rng.randint(1, 300)) for _ in range(count)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_numel", [1, 5000, 60000, 10**9])
@pytest.mark.parametrize("shapes", [llama_like(), random_shapes(0), random_shapes(1, 3)], ids=["llama", "rand", "few"])
def test_every_matrix_owned_once_and_buckets_bounded(shapes, world_size, bucket_numel):
    specs = [_spec(s, world_size) for s in shapes]
    plan = plan_owners(specs, world_size, bucket_numel)
    assert len(plan.owners) == len(specs)
    assert all(0 <= owner < world_size for owner in plan.owners)
    flat = [j for bucket in plan.buckets for j in bucket]
    assert flat == list(range(len(specs))), "buckets must cover every matrix once, in order"
    for bucket in plan.buckets:
        numel = sum(specs[j].numel for j in bucket)
        assert numel <= bucket_numel or len(bucket) == 1


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_lpt_bounds(world_size, seed):
    specs = [_spec(s, world_size) for s in random_shapes(seed, 60)]
    plan = plan_owners(specs, world_size, bucket_numel=80000)
    spreads = []
    for bucket in plan.buckets:
        bins = [0.0] * world_size
        for j in bucket:
            bins[plan.owners[j]] += plan.costs[j]
        total, largest = sum(plan.costs[j] for j in bucket), max(plan.costs[j] for j in bucket)
        # Graham's list-scheduling bound for the bucket.
        assert max(bins) <= total / world_size + largest + 1e-6
        spreads.append(max(bins) - min(bins))
    load = plan.load()
    assert max(load) - min(load) <= max(spreads) + 1e-6


def test_balance_on_llama_shapes_beats_round_robin():
    specs = [_spec(s, 4) for s in llama_like(layers=8)]
    plan = plan_owners(specs, 4, bucket_numel=10**9)
    round_robin = [0.0] * 4
    for j, cost in enumerate(plan.costs):
        round_robin[j % 4] += cost
    assert plan.imbalance() < 1.02
    assert plan.imbalance() <= max(round_robin) * 4 / sum(round_robin)


def test_deterministic_and_input_sensitive():
    specs = [_spec(s) for s in random_shapes(3)]
    assert plan_owners(specs, 4, 50000) == plan_owners(list(specs), 4, 50000)
    assert plan_owners(specs, 4, 50000).signature() == plan_owners(specs, 4, 50000).signature()
    assert plan_owners(specs, 4, 50000).signature() != plan_owners(specs, 4, 20000).signature()


def test_empty_plan():
    plan = plan_owners([], 4, 100)
    assert plan.owners == () and plan.buckets == () and plan.imbalance() == 0.0


def test_bad_inputs_are_refused_with_the_key():
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        make_buckets([3, 4], 0)
    with pytest.raises(ValueError, match="world_size"):
        plan_owners([_spec((2, 2))], 0, 10)


def _zero3(shapes, world_size, uniform=False):
    """Specs and ZeRO-3 pieces (``ceil(numel / W)`` per rank, as ``Uniform`` or tuples) of ``shapes``, in order."""
    specs = [_spec(s) for s in shapes]
    make = (lambda n: Uniform(n, world_size)) if uniform else (lambda n: (n, ) * world_size)
    return specs, [make(math.ceil(s.numel / world_size)) for s in specs]


def _floor_checks(specs, pieces, world_size, result_itemsize):
    """``plan_for_depth`` at depth 2 where every matrix alone exceeds the budget: depth 1, no rank above
    ``max(budget, alone)``: the floor's peak (largest matrix's piece, whole, NS working set, narrow result)."""
    plan, depth = plan_for_depth(specs, pieces, world_size, 10**9, 2, result_itemsize=result_itemsize)
    alone_plan = plan_owners(specs, world_size, 1, ns_itemsize=result_itemsize)
    alone, budget = rank_numels(alone_plan, pieces, 1, result_itemsize)
    assert not within_budget(alone_plan, pieces, 1, result_itemsize), "the case is over budget"
    assert depth == 1 and not within_budget(plan, pieces, 1, result_itemsize)
    need, _ = rank_numels(plan, pieces, slots_for_depth(depth), result_itemsize)
    assert all(n <= max(b, a) for n, b, a in zip(need, budget, alone)), (need, budget, alone)
    floor = max(p[0] + s.numel + s.ns_workspace(result_itemsize) +
                (-(-s.numel * result_itemsize // 4) if result_itemsize < 4 else 0) for s, p in zip(specs, pieces))
    assert max(need) == max(alone) == floor
    return plan


@pytest.mark.parametrize("result_itemsize", [4, 2])
def test_over_budget_buckets_are_chosen_against_the_floor(result_itemsize):
    """One 64x64 and twelve 8x64 at W=8 (1280 elements a rank): the 64x64's owner exceeds the budget even alone. Rather
    than thirteen single buckets, the small ones share buckets of 8 and 4 (up to the large one's 4096 elements) within
    that floor; the large one stays alone (a companion would grow every rank's outgoing buffer)."""
    specs, pieces = _zero3([(64, 64)] + [(8, 64)] * 12, 8)
    plan = _floor_checks(specs, pieces, 8, result_itemsize)
    assert plan.buckets == ((0, ), tuple(range(1, 9)), tuple(range(9, 13)))
    assert len(set(plan.owners[j] for j in plan.buckets[1])) == 8, "every rank owns in the bucket"


@pytest.mark.parametrize("result_itemsize", [4, 2])
def test_llama3_8b_at_w32_keeps_buckets_of_several_matrices_within_the_floor(result_itemsize):
    """W=32 (218.1M a rank): the 14336x4096's owner needs 1.8M + 58.7M + 184.5M (+ 29.4M fp16 result) even alone.
    Against that floor the 96 of 58.7M stay alone, 4096x4096 share buckets of three, 1024x4096 of fourteen (122
    buckets). With fp16 NS ("gram") the working set halves and every matrix alone fits; W=16 fits at depth 2."""
    specs, pieces = _zero3(LLAMA3_8B, 32)
    if result_itemsize == 4:
        plan = _floor_checks(specs, pieces, 32, result_itemsize)
        assert len(plan.buckets) == 122 and max(len(b) for b in plan.buckets) == 14
        assert all(len(b) == 1 for b in plan.buckets[:96]), "the floor's matrices stay alone"
    else:
        alone = plan_owners(specs, 32, 1, ns_itemsize=result_itemsize)
        assert max(rank_numels(alone, pieces, 1, result_itemsize)[0]) == 1835008 + 58720256 + 92274688 + 29360128
        plan, depth = plan_for_depth(specs, pieces, 32, 500_000_000, 2, result_itemsize=result_itemsize)
        assert within_budget(plan, pieces, slots_for_depth(depth), result_itemsize)
    specs, pieces = _zero3(LLAMA3_8B, 16)
    plan, depth = plan_for_depth(specs, pieces, 16, 500_000_000, 2, result_itemsize=result_itemsize)
    assert depth == 2 and within_budget(plan, pieces, slots_for_depth(2), result_itemsize)
    assert min(len(b) for b in plan.buckets) > 1


def _scan_lpt_plan(specs, world_size, buckets, initial_load=None):
    """``plan_owners``' LPT by scanning the W bins for the least ``(load, index)`` each time."""
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
    specs, uniform = _zero3(shapes, world_size, uniform=True)
    _, lists = _zero3(shapes, world_size, uniform=False)
    for factor in (0.0, 1.0, math.inf):
        buckets = make_cost_buckets([newton_schulz_cost(s) for s in specs], world_size, factor)
        plan, held = plan_owners(specs, world_size, 0, buckets=buckets), [7] * len(specs)
        for slots in (1, 3):
            assert rank_numels(plan, uniform, slots, 2, held) == rank_numels(plan, lists, slots, 2, held)
    assert Uniform.of((5, 5, 5)) == Uniform(5, 3) and Uniform.of((5, 4)) == (5, 4)


@pytest.mark.parametrize("shapes,world_size", [(LLAMA3_8B, 8), (LLAMA3_8B, 32), (LLAMA3_8B, 1024), (LLAMA3_70B, 32),
                                               (LLAMA3_70B, 256), (LLAMA3_70B, 4096)],
                         ids=["8b-w8", "8b-w32", "8b-w1024", "70b-w32", "70b-w256", "70b-w4096"])
def test_default_cap_every_owner_computes_at_once(shapes, world_size):
    """Default cap, fp16 NS: every rank within it, NS parallel efficiency >= 0.75 (strict rule: serial), depth 2."""
    specs, pieces = _zero3(shapes, world_size, uniform=True)
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
    specs, pieces = _zero3(LLAMA3_8B[:7], 8, uniform=True)
    floor = floor_numel(specs, pieces, 8, result_itemsize=2)
    with pytest.raises(CapBelowFloor) as refused:
        plan_within_cap(specs, pieces, 8, floor - 1, 2, result_itemsize=2)
    assert refused.value.needed_numel == floor and str(4 * floor) in str(refused.value)
    plan, depth = plan_within_cap(specs, pieces, 8, floor, 2, result_itemsize=2)
    assert depth == 1 and max(rank_numels(plan, pieces, 1, 2)[0]) <= floor


def test_matrices_that_stay_home_take_no_buffer():
    """A matrix orthogonalized in place (``travels`` False) adds only its working set: at W = 1 the largest one."""
    specs = [MatrixSpec(s, travels=False) for s in LLAMA3_8B[:7]]
    pieces = [(s.numel, ) for s in specs]
    plan, depth = plan_within_cap(specs, pieces, 1, DEFAULT_MAX_STEP_MEMORY // 4, 2, result_itemsize=2)
    assert max(rank_numels(plan, pieces, slots_for_depth(depth), 2)[0]) == max(s.ns_workspace(2) for s in specs)
    travelling = [MatrixSpec(s) for s in LLAMA3_8B[:7]]
    assert max(rank_numels(plan_owners(travelling, 1, 0, buckets=plan.buckets), pieces, 3,
                           2)[0]) > max(s.ns_workspace(2) for s in specs)


def test_the_cap_lowers_the_depth_before_the_buckets():
    """70B at W=8: depth 2 needs about 7 GiB; under a 4 GiB cap the plan keeps its buckets at depth 1."""
    specs, pieces = _zero3(LLAMA3_70B, 8, uniform=True)
    deep, deep_depth = plan_within_cap(specs, pieces, 8, 8 * 2**30 // 4, 2, result_itemsize=2)
    shallow, shallow_depth = plan_within_cap(specs, pieces, 8, 4 * 2**30 // 4, 2, result_itemsize=2)
    assert (deep_depth, shallow_depth) == (2, 1)
    assert max(rank_numels(shallow, pieces, 1, 2)[0]) <= 4 * 2**30 // 4
    assert critical_path(shallow) <= critical_path(deep) * 1.05


def test_strict_value_is_the_momentum_partition_rule():
    specs, pieces = _zero3(llama3(4, 64, 16, 160), 4, uniform=True)
    assert plan_partition(specs, pieces, 4, STRICT, 10**9, 2) == plan_for_depth(specs, pieces, 4, 10**9, 2)
    assert plan_partition(specs, pieces, 4, 2**30, 10**9, 2) == plan_within_cap(specs, pieces, 4, 2**28, 2)


def test_plan_figures_count_every_rank():
    specs, pieces = _zero3([(64, 64), (32, 64)], 2, uniform=True)
    plan = OwnerPlan(2, (0, 1), ((0, 1), ), tuple(newton_schulz_cost(s) for s in specs),
                     tuple(s.ns_workspace(4) for s in specs))
    figures = plan_figures([(plan, 1, pieces, 4, [10, 20])], 2)
    need, budget = rank_numels(plan, pieces, 1, 4, [10, 20])
    assert figures.peak_bytes == 4 * max(need) and figures.buckets == 1 and figures.depth == 1
    assert figures.kept_bytes == 4 * max(budget[0] + 10, budget[1] + 20)
    assert figures.ns_efficiency == pytest.approx(ideal_path(plan.costs, 2) / max(plan.costs))


@pytest.mark.parametrize("stage,world_size", [(3, 1), (3, 4), (2, 2), (1, 4)])
def test_the_least_need_reported_is_the_refusals(stage, world_size):
    """``plan_partitions``' least need per partition is what a lower cap is refused with, and it fits: ZeRO-3, the
    ZeRO-1/2 flat partition, and matrices held whole."""
    specs = [MatrixSpec(s) for s in llama3(2, 96, 32, 160)]
    parts = plan_partitions(specs, world_size, stage, 10**9, 10**9, DEFAULT_MAX_STEP_MEMORY, 2, 2)
    least = max(entry[-1] for entry in parts)
    with pytest.raises(CapBelowFloor) as refused:
        plan_partitions(specs, world_size, stage, 10**9, 10**9, 4 * least - 4, 2, 2)
    assert refused.value.needed_numel == least
    fits = plan_partitions(specs, world_size, stage, 10**9, 10**9, 4 * least, 2, 2)
    assert plan_figures([e[1:6] for e in fits], world_size).peak_bytes <= 4 * least
