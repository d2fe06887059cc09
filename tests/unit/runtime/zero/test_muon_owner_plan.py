# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner plan: every matrix owned exactly once, deterministic, buckets bounded, cost balanced
(``test_muon_owner_plan_configs``: the cost model, the buffer budget, sub-groups, ZeRO-1/2 holders)."""

import random

import pytest

from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, make_buckets, plan_owners


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
