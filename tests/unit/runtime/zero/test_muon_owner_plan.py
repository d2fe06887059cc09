# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner plan: every matrix owned exactly once, deterministic, buckets bounded, cost balanced;
where even every matrix alone exceeds the momentum budget, buckets chosen against that floor
(``test_muon_owner_plan_configs``: the cost model, the buffer budget, sub-groups, ZeRO-1/2 holders)."""

import math
import random

import pytest

from deepspeed.runtime.zero.muon.owner_plan import (MatrixSpec, make_buckets, plan_for_depth, plan_owners, rank_numels,
                                                    slots_for_depth, within_budget)


def _spec(shape, world_size=4, **kwargs):
    return MatrixSpec(shape=shape, **kwargs)


def llama_like(layers=4, hidden=256, kv=64, ffn=688):
    """Projection shapes of a small Llama-style model: q, k, v, o, gate, up, down per layer."""
    shapes = []
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
                   (hidden, ffn)]
    return shapes


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
    assert all(0 <= owner < world_size for owner in plan.owners) and len(plan.owners) == len(specs)


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


def _zero3(shapes, world_size):
    """Specs and ZeRO-3 pieces (``ceil(numel / W)`` on every rank) of ``shapes``, in the given order."""
    specs = [_spec(s) for s in shapes]
    return specs, [(math.ceil(s.numel / world_size), ) * world_size for s in specs]


def _floor_checks(specs, pieces, world_size, result_itemsize):
    """``plan_for_depth`` at depth 2 where every matrix alone exceeds the budget: depth 1, and no rank
    needs more than ``max(budget, alone)`` (the every-matrix-alone plan's need on it), so the peak is
    the floor's: the largest matrix's piece, whole matrix, NS working set and held narrow result.
    Returns the plan."""
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
    """One 64x64 matrix and twelve 8x64 at W=8: a rank holds 1280 elements, but the 64x64's owner
    needs its piece, the whole matrix and ``6 * 64^2`` of working set even alone, and every other
    rank its outgoing 512 (the 64x64's piece), an 8x64 and its working set. Instead of every matrix
    alone (thirteen buckets, one owner busy at a time), the small ones share buckets of 8 and 4 (up
    to 4096 elements, the large matrix's), one owner each: no rank needs more than that fallback.
    The large one stays alone (with another matrix every rank's outgoing buffer, the floor's owner's
    included, would grow)."""
    specs, pieces = _zero3([(64, 64)] + [(8, 64)] * 12, 8)
    plan = _floor_checks(specs, pieces, 8, result_itemsize)
    assert plan.buckets == ((0, ), tuple(range(1, 9)), tuple(range(9, 13)))
    assert len(set(plan.owners[j] for j in plan.buckets[1])) == 8, "every rank owns in the bucket"


# Llama-3 8B's Muon matrices at ZeRO-3 in the optimizer's order (size descending): per layer gate and
# up 14336x4096, down 4096x14336, q and o 4096x4096, k and v 1024x4096; 32 layers.
LLAMA3_8B = [(14336, 4096)] * 64 + [(4096, 14336)] * 32 + [(4096, 4096)] * 64 + [(1024, 4096)] * 64


@pytest.mark.parametrize("result_itemsize", [4, 2])
def test_llama3_8b_at_w32_keeps_buckets_of_several_matrices_within_the_floor(result_itemsize):
    """At W=32 a rank holds 218.1M elements; the 14336x4096's owner needs 1.8M + 58.7M + 184.5M
    (+ 29.4M of fp16 result) even alone, so no bucket size fits the budget. The plan used to be
    every matrix alone (224 buckets, depth 1); against the floor the 96 matrices of 58.7M stay
    alone but the 4096x4096 share buckets of three and the 1024x4096 of fourteen (122 buckets), at
    the floor's peak. With NS in fp16 (a GPU's "gram") the working set is half as large (92.3M), and
    every matrix alone fits the budget. At W=16 (436M a rank) depth 2 fits the budget, as before."""
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
