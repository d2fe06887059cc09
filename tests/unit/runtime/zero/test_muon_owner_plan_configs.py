# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner plan under surrounding configurations: NS cost per method, head and expert layout; exchange buffers within
the momentum's memory at every depth (``plan_within_budget``); sub-groups balanced together; ZeRO-1/2 partitions
(owners among a matrix's holders); large matrices; the problem a spec defaults to."""

import math

import pytest

from deepspeed.runtime.zero.muon.owner_plan import (newton_schulz_cost, plan_owners, plan_within_budget, rank_numels,
                                                    reserved_numel)
from unit.runtime.zero.test_muon_owner_plan import _spec, llama_like, random_shapes


def _zero3_pieces(specs, world_size):
    return [(math.ceil(s.numel / world_size), ) * world_size for s in specs]


def test_large_single_matrices_spread_over_ranks():
    specs = [_spec((512, 512)) for _ in range(8)]
    plan = plan_owners(specs, 4, bucket_numel=512 * 512)  # one matrix per bucket
    assert len(plan.buckets) == 8
    assert sorted(plan.owners) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sub_groups_balance_together():
    """Sub-groups planned in turn from the load the earlier left spread single matrices over the ranks."""
    load = [0.0] * 4
    owners = []
    for _ in range(8):  # eight one-matrix sub-groups, as several Muon parameter groups give
        plan = plan_owners([_spec((64, 64))], 4, bucket_numel=10**9, initial_load=load)
        owners += plan.owners
        load = [a + b for a, b in zip(load, plan.load())]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="initial_load"):
        plan_owners([_spec((4, 4))], 4, 10, initial_load=[0.0])


def test_ns_problem_defaults_to_the_matrix_itself():
    # The dispatch (heads, experts, conv) is upstream's muon_ns_problem; the plan only takes its answer.
    assert _spec((64, 32)).ns_problem == (1, 64, 32)
    assert _spec((4, 16, 32), ns_problem=(4, 16, 32)).ns_problem == (4, 16, 32)
    for shape, kwargs in [((4, 16, 32), {}), ((10, ), {}), ((24, 8), dict(num_heads=3))]:
        with pytest.raises(ValueError, match="needs its ns_problem"):
            _spec(shape, **kwargs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("slots", [1, 3, 5])
@pytest.mark.parametrize("shapes", [llama_like(), random_shapes(2), [(64, 64)] * 12], ids=["llama", "rand", "same"])
def test_buffers_within_the_momentum_budget(shapes, world_size, slots):
    """``plan_within_budget``: each rank's exchange buffers plus its largest owned ``ns_workspace_numel`` fit its
    momentum partition whenever one matrix per bucket fits; the bucket size is the largest candidate that fits."""
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


def test_budget_with_one_large_matrix_chooses_against_the_floor():
    """Nothing fits (the 512x512's owner holds it whole plus working set): against the every-matrix-alone floor, one
    bucket of all four fills one slot of three, needing less on every rank than four buckets of one."""
    specs = [_spec((512, 512))] + [_spec((8, 8))] * 3
    pieces = _zero3_pieces(specs, 2)
    plan = plan_within_budget(specs, pieces, 2, 10**9, 3)
    assert plan.buckets == ((0, 1, 2, 3), )
    need, budget = rank_numels(plan, pieces, 3)
    alone, _ = rank_numels(plan_owners(specs, 2, 1), pieces, 3)
    assert all(n <= a and a > b for n, a, b in zip(need, alone, budget))


def test_holders_restrict_owners():
    """ZeRO-1/2: a matrix held whole is owned by its rank; a straddling one by its least loaded holder."""
    specs = [_spec((16, 16))] * 5
    holders = [[0], [0], [0, 1], [1], [1]]
    plan = plan_owners(specs, 2, 10**9, holders=holders)
    assert plan.owners[:2] == (0, 0) and plan.owners[3:] == (1, 1) and plan.owners[2] in (0, 1)
    with pytest.raises(ValueError, match="holders"):
        plan_owners(specs, 2, 10**9, holders=[[0]] * 4 + [[]])


def test_cost_model_is_shape_aware():
    wide = newton_schulz_cost(_spec((64, 1024)))
    assert newton_schulz_cost(_spec((1024, 64))) == wide, "NS runs on the wide orientation either way"
    assert wide < newton_schulz_cost(_spec((64, 1024), ns_method="standard")), "Gram NS saves work on wide"
    assert newton_schulz_cost(_spec((256, 256))) < newton_schulz_cost(_spec((512, 512))) / 4
    heads = _spec((96, 32), num_heads=4, ns_problem=(4, 24, 32))
    assert newton_schulz_cost(heads) == 4 * newton_schulz_cost(_spec((24, 32)))
    experts = _spec((4, 16, 32), is_expert_group=True, ns_problem=(4, 16, 32))
    assert newton_schulz_cost(experts) == 4 * newton_schulz_cost(_spec((16, 32)))
