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


def test_gpu_plans_are_the_patch_plans_per_sub_group():
    """``gpu_plans`` is ``owner_plan.plan_partitions`` at ZeRO-3 with NS in fp16: one pipeline per sub-group of
    ``sub_group_size`` partition elements, the NS cost carried over; 70B at W=8 has nine."""
    shapes = scale.LLAMA3_70B.muon_shapes
    specs = model.specs_for(model.muon_order(shapes))
    for w in (8, 256):
        plans = scale.gpu_plans(shapes, w)
        # the sub-groups built here: consecutive matrices until a rank's partition reaches sub_group_size
        groups, current, held = [], [], 0
        for j, s in enumerate(specs):
            current.append(j)
            held += math.ceil(s.numel / w)
            if held >= scale.SUB_GROUP_SIZE:
                groups, current, held = groups + [current], [], 0
        groups += [current] if current else []
        load, expected = [0.0] * w, []
        for g in groups:
            plan, d = op.plan_partition([specs[j] for j in g], [op.Uniform(math.ceil(specs[j].numel / w), w) for j in g],
                                        w, model.DEFAULT_MAX_STEP_MEMORY, model.DEFAULT_BUCKET, 2, initial_load=load,
                                        result_itemsize=2)
            load = [a + b for a, b in zip(load, plan.load())]
            expected.append((plan.owners, plan.buckets, d))
        assert [(p.owners, p.buckets, d) for p, d, _ in plans] == expected
        assert len(plans) == math.ceil(sum(math.ceil(s.numel / w) for s in specs) / scale.SUB_GROUP_SIZE)
    with pytest.raises(ValueError, match="sub-groups"):
        scale.gpu_plan(shapes, 8)


def test_default_plan_against_the_strict_rule():
    """8B at W=64: the strict rule (within the momentum partition) sits at its floor, every owner of a bucket but one
    idle; the default keeps every owner busy within its cap, at depth 2."""
    shapes = scale.LLAMA3_8B.muon_shapes
    plan, depth, pieces = scale.gpu_plan(shapes, 64)
    strict, strict_depth, _ = scale.gpu_plan(shapes, 64, max_step_memory=scale.STRICT)
    efficiency = lambda p: op.ideal_path(p.costs, 64) / op.critical_path(p)  # noqa: E731
    assert depth == 2 and efficiency(plan) >= 0.75
    assert strict_depth == 1 and efficiency(strict) < 0.1
    assert 4 * max(op.rank_numels(plan, pieces, op.slots_for_depth(depth), 2)[0]) <= model.DEFAULT_MAX_STEP_MEMORY


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


def test_targets_are_printed_met_or_missed():
    """Every target line says MET or MISSED, from the rows' own figures (a missed one stays printed)."""
    arch = scale.LLAMA3_8B
    rows = scale.scale_rows(arch, [32, 256])
    lines = scale.target_lines(arch, rows)
    assert len(lines) == 4 and all(line.endswith((": MET", ": MISSED")) for line in lines)
    worse = [scale.Row(**{**vars(r), "patched": r.fwd_bwd}) for r in rows]
    assert scale.target_lines(arch, worse)[0].endswith("MISSED")
