# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner plan: every matrix owned exactly once, deterministic, buckets bounded, cost balanced."""

import math
import random

import pytest

from deepspeed.runtime.zero.muon.owner_plan import (MatrixSpec, make_buckets, newton_schulz_cost, plan_owners,
                                                    plan_within_budget, reserved_numel)


def _spec(shape, world_size=4, **kwargs):
    return MatrixSpec(shape=shape, **kwargs)


def _zero3_pieces(specs, world_size):
    return [(math.ceil(s.numel / world_size), ) * world_size for s in specs]


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


def test_large_single_matrices_spread_over_ranks():
    specs = [_spec((512, 512)) for _ in range(8)]
    plan = plan_owners(specs, 4, bucket_numel=512 * 512)  # one matrix per bucket
    assert len(plan.buckets) == 8
    assert sorted(plan.owners) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sub_groups_balance_together():
    """Sub-groups planned one after another, each starting from the load the earlier ones left,
    spread single matrices over the ranks instead of giving each sub-group's first one to rank 0."""
    load = [0.0] * 4
    owners = []
    for _ in range(8):  # eight one-matrix sub-groups, as several Muon parameter groups give
        plan = plan_owners([_spec((64, 64))], 4, bucket_numel=10**9, initial_load=load)
        owners += plan.owners
        load = [a + b for a, b in zip(load, plan.load())]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="initial_load"):
        plan_owners([_spec((4, 4))], 4, 10, initial_load=[0.0])


def test_empty_plan():
    plan = plan_owners([], 4, 100)
    assert plan.owners == () and plan.buckets == () and plan.imbalance() == 0.0


def test_ns_problem_defaults_to_the_matrix_itself():
    # The dispatch (heads, experts, conv) is upstream's muon_ns_problem, tested with the math;
    # the plan only takes its answer.
    assert _spec((64, 32)).ns_problem == (1, 64, 32)
    assert _spec((4, 16, 32), ns_problem=(4, 16, 32)).ns_problem == (4, 16, 32)
    for shape, kwargs in [((4, 16, 32), {}), ((10, ), {}), ((24, 8), dict(num_heads=3))]:
        with pytest.raises(ValueError, match="needs its ns_problem"):
            _spec(shape, **kwargs)


def test_cost_model_is_shape_aware():
    wide = newton_schulz_cost(_spec((64, 1024)))
    assert newton_schulz_cost(_spec((1024, 64))) == wide, "NS runs on the wide orientation either way"
    assert wide < newton_schulz_cost(_spec((64, 1024), ns_method="standard")), "Gram NS saves work on wide"
    assert newton_schulz_cost(_spec((256, 256))) < newton_schulz_cost(_spec((512, 512))) / 4
    heads = _spec((96, 32), num_heads=4, ns_problem=(4, 24, 32))
    assert newton_schulz_cost(heads) == 4 * newton_schulz_cost(_spec((24, 32)))
    experts = _spec((4, 16, 32), is_expert_group=True, ns_problem=(4, 16, 32))
    assert newton_schulz_cost(experts) == 4 * newton_schulz_cost(_spec((16, 32)))


def test_bad_inputs_are_refused_with_the_key():
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        make_buckets([3, 4], 0)
    with pytest.raises(ValueError, match="world_size"):
        plan_owners([_spec((2, 2))], 0, 10)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("slots", [1, 3, 5])
@pytest.mark.parametrize("shapes", [llama_like(), random_shapes(2), [(64, 64)] * 12], ids=["llama", "rand", "same"])
def test_buffers_within_the_momentum_budget(shapes, world_size, slots):
    """``plan_within_budget``: every rank's reserved exchange buffers and its Newton-Schulz working
    set as owner (its largest owned matrix's ``ns_workspace_numel``) fit the elements it holds
    (its momentum partition) whenever one matrix per bucket fits; the bucket size is the largest
    candidate that fits, so one more matrix in the first bucket would not."""
    specs = [_spec(s) for s in shapes]
    pieces = _zero3_pieces(specs, world_size)

    def fits(plan):
        for r, n in enumerate(reserved_numel(plan, pieces, slots)):
            owned = [s.ns_workspace_numel for j, s in enumerate(specs) if plan.owners[j] == r]
            if n + max(owned, default=0) > sum(p[r] for p in pieces):
                return False
        return True

    plan = plan_within_budget(specs, pieces, world_size, 10**9, slots)
    if fits(plan_owners(specs, world_size, 1)):
        assert fits(plan), reserved_numel(plan, pieces, slots)
    first = len(plan.buckets[0])
    if first < len(specs) and len(plan.buckets) > 1:
        assert not fits(plan_owners(specs, world_size, sum(s.numel for s in specs[:first + 1]))), "not the largest"


def test_budget_with_one_large_matrix_falls_back_to_one_matrix_per_bucket():
    specs = [_spec((512, 512))] + [_spec((8, 8))] * 3
    pieces = _zero3_pieces(specs, 2)
    plan = plan_within_budget(specs, pieces, 2, 10**9, 3)
    assert plan.buckets == ((0, ), (1, ), (2, ), (3, ))


def test_holders_restrict_owners():
    """ZeRO-1/2 layout: a matrix one rank holds whole is owned by it (never travels); one that
    straddles a boundary goes to the least loaded of its holders."""
    specs = [_spec((16, 16))] * 5
    holders = [[0], [0], [0, 1], [1], [1]]
    plan = plan_owners(specs, 2, 10**9, holders=holders)
    assert plan.owners[:2] == (0, 0) and plan.owners[3:] == (1, 1) and plan.owners[2] in (0, 1)
    with pytest.raises(ValueError, match="holders"):
        plan_owners(specs, 2, 10**9, holders=[[0]] * 4 + [[]])
