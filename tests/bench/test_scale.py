# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The time model at scale (``bench/scale.py``) against the element model (``bench/model.py``) and the patch's
own owner plan: its fast plan equals the patch's, its exchange time scales with the bytes, infinite bandwidth
leaves Newton-Schulz alone, the pipeline replay lies between overlap and sum, saturation is found where the ranks
outnumber the matrices, and its check against the committed emulated-link run parses and agrees.
"""

import math
import pathlib
import random
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import model  # noqa: E402
import scale  # noqa: E402

op = model.owner_plan


def _original_plan(shapes, w, bucket=model.DEFAULT_BUCKET, depth=model.DEFAULT_DEPTH):
    specs = model.specs_for(model.muon_order(shapes))
    return op.plan_for_depth(specs, model.zero3_pieces(shapes, w), w, bucket, depth, result_itemsize=2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("w", [1, 3, 8, 16])
def test_fast_plan_equals_the_patch_plan(seed, w):
    """Owners, buckets and depth of ``gpu_plan`` (heaps, ``Uniform`` pieces) equal ``plan_for_depth``'s own,
    across bucket sizes that force the budget's bisection and its every-matrix-alone fallback."""
    rng = random.Random(seed)
    shapes = [(rng.choice([16, 48, 64, 96]), rng.choice([16, 32, 64, 128])) for _ in range(rng.randint(3, 40))]
    for bucket in (64, 5000, 40000, model.DEFAULT_BUCKET):
        plan, depth = _original_plan(shapes, w, bucket)
        fast, fast_depth, _ = scale.gpu_plan(shapes, w, bucket)
        assert (fast.owners, fast.buckets, fast_depth) == (plan.owners, plan.buckets, depth)
        assert fast.load() == plan.load()
    # the patch's functions are back in place
    assert op.plan_owners.__module__ == op.__name__ and op.rank_numels.__module__ == op.__name__


def test_fast_plan_equals_on_llama3_8b_where_even_one_matrix_exceeds_the_budget():
    """At W=32 every matrix alone exceeds the budget: the patch's plan (chosen against that floor) and the fast
    one agree, as do their needs; the what-if of the planner before its floor rule is every matrix alone."""
    shapes = scale.LLAMA3_8B.muon_shapes
    for w in (16, 32):
        plan, depth = _original_plan(shapes, w)
        fast, fast_depth, pieces = scale.gpu_plan(shapes, w)
        assert (fast.owners, fast.buckets, fast_depth) == (plan.owners, plan.buckets, depth)
        slots = op.slots_for_depth(depth)
        with scale.fast_plan():
            fast_needs = op.rank_numels(fast, pieces, slots, 2)
        assert fast_needs == op.rank_numels(plan, model.zero3_pieces(shapes, w), slots, 2)
    assert fast_depth == 1 and 1 < max(len(b) for b in fast.buckets) and len(fast.buckets) < len(shapes)
    old, old_depth, _ = scale.gpu_plan(shapes, 32, old_rule=True)
    assert old_depth == 1 and len(old.buckets) == len(shapes)
    assert op.rank_numels.__module__ == op.__name__


def test_old_rule_equals_the_patch_where_every_matrix_alone_fits():
    """The 'before' what-if differs from the patch only where every matrix alone exceeds the budget."""
    for w in (8, 16):
        plan, depth, _ = scale.gpu_plan(scale.LLAMA3_8B.muon_shapes, w)
        old, old_depth, _ = scale.gpu_plan(scale.LLAMA3_8B.muon_shapes, w, old_rule=True)
        assert (old.owners, old.buckets, old_depth) == (plan.owners, plan.buckets, depth)


def test_exchange_elements_are_the_element_model():
    """The busiest rank's elements per bucket, summed, equal ``model.exchange_traffic``'s busiest rank where every
    bucket has one owner per rank pattern; their mean over ranks is the lower bound 2P(W-1)/W^2."""
    shapes = [(64, 64)] * 8
    for w in (2, 4, 8):
        plan, _, pieces = scale.gpu_plan(shapes, w, depth=1)
        received = model.exchange_traffic(plan, model.zero3_pieces(shapes, w))
        terms = scale.bucket_terms(plan, pieces)
        assert sum(f + b for f, b, _ in terms) >= max(received)
        assert sum(received) / w == pytest.approx(model.lower_bound(shapes, w))


def test_infinite_bandwidth_leaves_newton_schulz():
    plan, depth, pieces = scale.gpu_plan(scale.LLAMA3_8B.muon_shapes, 16)
    t = scale.patched_seconds(plan, depth, pieces, scale.H100, bandwidth=math.inf)
    assert t["exchange"] == 0
    assert t["pipeline"] == pytest.approx(t["ns"])
    assert t["ns"] == pytest.approx(
        sum(max(scale._bucket_loads(plan, b))
            for b in range(len(plan.buckets))) / (scale.H100.matmul_flops * scale.NS_EFFICIENCY))


def test_exchange_time_scales_with_bytes():
    plan, depth, pieces = scale.gpu_plan(scale.LLAMA3_8B.muon_shapes, 16)
    one = scale.patched_seconds(plan, depth, pieces, scale.H100, bandwidth=1e11)
    half = scale.patched_seconds(plan, depth, pieces, scale.H100, bandwidth=5e10)
    assert half["exchange"] == pytest.approx(2 * one["exchange"])
    assert half["ns"] == one["ns"]
    for w in (4, 8, 64, 4096):
        assert scale.link_seconds(2e9, w, 0.5) == pytest.approx(2 * scale.link_seconds(1e9, w, 0.5))
    assert scale.link_seconds(1e9, 8, 1.0) == pytest.approx(1e9 / scale.NVLINK_BYTES)  # one node: NVLink
    assert scale.link_seconds(1e9, 4096, 1.0) > 0.99 * 1e9 / scale.IB_BYTES  # nearly every peer off the node


def test_pipeline_lies_between_overlap_and_sum():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 12)
        c, x, d = ([rng.random() for _ in range(n)] for _ in range(3))
        total = sum(c) + sum(x) + sum(d)
        assert scale.pipeline_seconds(c, x, d, 1) == pytest.approx(total)
        two = scale.pipeline_seconds(c, x, d, 2)
        assert max(sum(c) + sum(d), sum(x)) - 1e-12 <= two <= total + 1e-12
    assert scale.pipeline_seconds([1.0] * 4, [1.0] * 4, [0.0] * 4, 2) < 8.0  # exchange overlaps NS


def test_saturation_where_ranks_outnumber_matrices():
    arch = scale.Arch("equal", ((64, 64), ) * 16, 0, 0, "16 equal matrices")
    s = scale.saturation(arch, [4, 8, 16, 32])
    assert s["matrices"] == 16 and s["analytic"] == pytest.approx(16)
    assert s["plan"] == 16
    costs = [op.newton_schulz_cost(spec) for spec in model.specs_for(arch.muon_shapes)]
    for w in (8, 16, 32):
        assert scale.lpt_max(costs, w) == pytest.approx(max(costs) * max(1, math.ceil(16 / w)))
        # the what-if split halves the busiest owner once the largest matrix exceeds the mean share
    assert scale.lpt_max(scale.split_costs(costs, 32, 2), 32) == pytest.approx(max(costs) / 2)


def test_check_against_the_emulated_run_parses_and_agrees():
    text = (ROOT / scale.NET_OUTPUT).read_text()
    measured = scale.parse_net_output(text)
    assert [m.world_size for m in measured] == [2, 4]
    for m in measured:
        assert set(m.ratio) == set(scale.CHECK_WORKLOADS)
        assert m.gflops > 0 and 0 < m.share <= 1 and m.link_mbit > 0
    rows = scale.check_rows(text)
    assert len(rows) == 4
    for r in rows:
        assert r["bucket_mib_model"] == pytest.approx(r["bucket_mib_run"], abs=0.05)  # the run's plan: one bucket
        assert abs(r["predicted"] - r["measured"]) < 0.05, r


def test_floor_slack_what_if_stays_within_its_slack():
    """The 'floor+1%' what-if at W=32 (8B): no rank needs more than 1.01 x the every-matrix-alone floor, with fewer
    buckets than the patch's plan (which stays at the floor: a bucket no larger than the largest matrix)."""
    shapes = scale.LLAMA3_8B.muon_shapes
    plan, _, pieces = scale.gpu_plan(shapes, 32)
    loose, depth, _ = scale.gpu_plan(shapes, 32, slack=0.01)
    specs = model.specs_for(model.muon_order(shapes))
    with scale.fast_plan():
        floor = max(op.rank_numels(op.plan_owners(specs, 32, 1), pieces, 1, 2)[0])
        assert max(op.rank_numels(plan, pieces, 1, 2)[0]) == floor
        assert floor < max(op.rank_numels(loose, pieces, 1, 2)[0]) <= 1.01 * floor
    assert depth == 1 and len(loose.buckets) < len(plan.buckets)
