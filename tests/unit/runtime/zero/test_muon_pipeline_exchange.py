# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The distributed Muon core's exchange in detail, W ranks simulated by threads (``muon_testing.threaded_exchange``):
collective order; traffic (owner-centric bound at ZeRO-3, only straddling matrices at ZeRO-1/2); buffers reserved and
the depth lowered where they would not fit; the owner's reassembly, in-place views, bf16 back exchange, batched NS.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon.momentum import momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import orthogonalize_each
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeBuffers, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_for_depth, plan_owners, reserved_numel, within_budget
from deepspeed.runtime.zero.muon.pipeline import MuonPipeline, slots_for_depth
from muon_testing.threaded_exchange import (FakeAllToAll, LAYOUTS, reference_updates as _reference, run_pipelines as
                                            _run, scatter as _scatter, settings, specs_of as _specs, zero12_layout as
                                            _zero12_layout, zero3_layout as _zero3_layout)

SETTINGS = settings()


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_the_documented_order(world_size, depth, monkeypatch):
    """2 async all-to-alls per bucket, forward k+depth after back k, within ``2 * depth - 1`` reserved slots."""
    orders = {}  # per pipeline, the collective each stage issued: F<b> (prepare) and B<b> (compute) of bucket b
    for stage, tag in (("_prepare", "F"), ("_compute", "B")):

        def recorded(self, b, *args, _original=getattr(MuonPipeline, stage), _tag=tag):
            orders.setdefault(id(self), []).append(f"{_tag}{b}")
            return _original(self, b, *args)

        monkeypatch.setattr(MuonPipeline, stage, recorded)
    _, _, _, plan, _, _, _, fake, stats, pipelines, buffers = _run(_zero3_layout, world_size, 100, depth, steps=1)
    n = len(plan.buckets)
    assert n > depth
    for r in range(world_size):
        assert fake.async_ops[r] == [True] * 2 * n, r
        assert stats[r].exchanges == 2 * n
        assert buffers[r].slots == pipelines[r].buffer_demand[0] == min(slots_for_depth(depth), n)
    expected = [f"F{b}" for b in range(depth)]
    for b in range(n):
        expected += [f"B{b}"] + ([f"F{b + depth}"] if b + depth < n else [])
    assert all(orders[id(p)] == expected for p in pipelines), [orders[id(p)] for p in pipelines]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero3_traffic_meets_the_owner_centric_bound(world_size):
    """Summed over ranks, each matrix's pieces but the owner's cross twice: ``2 (W - 1) p`` per matrix, i.e.
    ``2 P (W - 1) / W^2`` per rank on average."""
    specs, pieces, _, _, _, _, _, _, stats, *_ = _run(_zero3_layout, world_size, 10**9, 2, steps=1)
    received = sum(s.elements_received for s in stats)
    assert received == sum(2 * (world_size - 1) * p[0] for p in pieces)
    assert sum(s.elements_sent for s in stats) == received
    assert sum(s.ns_calls for s in stats) == len(specs)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero12_only_straddling_matrices_travel(world_size):
    """ZeRO-1/2: whole matrices stay; a rank receives at most twice the straddling elements (to one holder, back)."""
    specs, pieces, _, plan, _, _, _, _, stats, *_ = _run(_zero12_layout, world_size, 10**9, 2, steps=1)
    straddling = [j for j, p in enumerate(pieces) if sum(1 for n in p if n) > 1]
    assert straddling, "the layout must have matrices on partition boundaries"
    expected = sum(2 * (sum(pieces[j]) - pieces[j][plan.owners[j]]) for j in straddling)
    assert sum(s.elements_received for s in stats) == expected
    assert all(s.elements_received <= 2 * sum(sum(pieces[j]) for j in straddling) for s in stats)
    assert sum(s.ns_calls for s in stats) == len(specs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero12_buffers_hold_only_straddling_matrices(world_size):
    """Buffers cover only straddling matrices; no all-to-all where none straddles (whole ones stay in place)."""
    specs, pieces, _, plan, _, _, _, fake, stats, pipelines, buffers = _run(_zero12_layout,
                                                                            world_size,
                                                                            10**9,
                                                                            2,
                                                                            steps=1)
    straddling = [j for j, p in enumerate(pieces) if sum(1 for n in p if n) > 1]
    for r, pipeline in enumerate(pipelines):
        assert sorted(j for lay in pipeline.layouts for j in lay.matrices) == straddling
        assert sorted(j for lay in pipeline.in_place
                      for j in lay.matrices) == [j for j, p in enumerate(pieces) if j not in straddling and p[r]]
        travelling = max(lay.send_numel for lay in pipeline.layouts)
        assert buffers[r].reserved_bytes() < 4 * sum(map(sum, pieces)), "not sized for the whole partition"
        assert stats[r].exchanges == 2 * len(pipeline.layouts) and travelling
    whole = [(4, 0), (0, 6)]  # nothing straddles: no buffers, no collectives
    specs = [MatrixSpec((2, 2)), MatrixSpec((2, 3))]
    slices = [[(0, 4), (4, 0)], [(0, 0), (0, 6)]]
    pipelines = [
        MuonPipeline(plan_owners(specs, 2, 100, holders=[[0], [1]]), specs, whole, slices[r],
                     OwnerExchange(None, r, 2, None, ExchangeStats()), "cpu", "cpu", 2) for r in range(2)
    ]
    assert [p.buffer_demand[:3] for p in pipelines] == [(0, 0, 0)] * 2 and [len(p.in_place)
                                                                            for p in pipelines] == [1, 1]


def test_reserved_buffers_are_what_the_plan_says():
    specs = _specs()
    for world_size in (1, 2, 3):
        pieces, slices = _zero3_layout(specs, world_size)
        plan = plan_owners(specs, world_size, 100)
        fake = FakeAllToAll(world_size)
        for r in range(world_size):
            pipeline = MuonPipeline(plan, specs, pieces, slices[r],
                                    OwnerExchange(None, r, world_size, fake.for_rank(r), ExchangeStats()), "cpu",
                                    "cpu", 2)
            buffers = ExchangeBuffers.covering([pipeline.buffer_demand], "cpu")
            if world_size == 1:
                assert not pipeline.layouts and buffers.reserved_bytes() == 0, "one rank exchanges nothing"
            else:
                assert buffers.reserved_bytes() == 4 * reserved_numel(plan, pieces, 3)[r]
    alone_offloaded = MuonPipeline(plan_owners(specs, 1, 100), specs,
                                   *_zero3_layout(specs, 1)[:1],
                                   _zero3_layout(specs, 1)[1][0], OwnerExchange(None, 0, 1, None, ExchangeStats()),
                                   "meta", "cpu", 2)
    assert alone_offloaded.layouts and not alone_offloaded.in_place, \
        "pieces off the Newton-Schulz device still go through the buffers"


def test_layout_reassembles_and_splits_with_padding():
    """ZeRO-3 pieces with padding: the owner reassembles the matrix; results return as pieces, padding zero."""
    matrix = torch.arange(10.)
    layout = BucketLayout(matrices=(0, ), owners=(0, ), numels=(10, ), pieces=((4, 4, 4), ), rank=0)
    recv = torch.cat([torch.cat([matrix, torch.zeros(2)])])
    assert torch.equal(layout.owned_matrix(recv, 0, (10, )), matrix)
    out = torch.full((12, ), 7.0)
    layout.write_result(0, matrix * 2, out)
    assert torch.equal(out, torch.cat([matrix * 2, torch.zeros(2)]))
    with pytest.raises(ValueError, match="cannot hold"):
        BucketLayout(matrices=(0, ), owners=(0, ), numels=(10, ), pieces=((3, 3, 3), ), rank=0)


def test_depth_below_one_is_refused():
    specs = _specs()
    pieces, slices = _zero3_layout(specs, 1)
    with pytest.raises(ValueError, match="depth"):
        MuonPipeline(plan_owners(specs, 1, 100), specs, pieces, slices[0],
                     OwnerExchange(None, 0, 1, None, ExchangeStats()), "cpu", "cpu", 0)


def test_depth_lowered_where_even_one_matrix_per_bucket_exceeds_the_budget():
    """Twelve 16x256 at W=2: 12 x 2048 momentum less one NS working set (2 x 4096 + 4 x 256) leaves 15360; depth 2
    needs 3 x (2048 + 4096) even with one matrix per bucket, so depth 1 with buckets as large as fit. Where nothing
    fits (W=4, one large matrix), depth 1 reserves least."""
    specs = [MatrixSpec((16, 256))] * 12
    assert specs[0].ns_workspace_numel == 9216
    pieces = [(2048, 2048)] * 12
    plan, depth = plan_for_depth(specs, pieces, 2, 10**9, 2)
    assert depth == 1 and within_budget(plan, pieces, slots_for_depth(1)) and len(plan.buckets[0]) == 3
    assert not within_budget(plan_owners(specs, 2, 1), pieces, slots_for_depth(2))
    plan, depth = plan_for_depth([MatrixSpec((64, 64))], [(1024, ) * 4], 4, 10**9, 3)
    assert depth == 1 and plan.buckets == ((0, ), )
    specs = [MatrixSpec((16, 256))] * 24
    assert plan_for_depth(specs, [(2048, 2048)] * 24, 2, 10**9, 2)[1] == 2, "fits at the asked depth"


def test_one_owned_matrix_is_a_view_of_the_receive_buffer():
    """One owned matrix in a bucket is read in place from the receive buffer; two are interleaved and copied."""
    one = BucketLayout(matrices=(0, 1), owners=(0, 1), numels=(10, 10), pieces=((5, 5), (5, 5)), rank=0)
    recv = torch.arange(10.)
    matrix = one.owned_matrix(recv, 0, (2, 5))
    assert matrix.data_ptr() == recv.data_ptr() and torch.equal(matrix.reshape(-1), recv)
    two = BucketLayout(matrices=(0, 1), owners=(0, 0), numels=(10, 10), pieces=((5, 5), (5, 5)), rank=0)
    recv = torch.arange(20.)
    first, second = two.owned_matrix(recv, 0, (10, )), two.owned_matrix(recv, 1, (10, ))
    assert torch.equal(first, torch.cat([recv[0:5], recv[10:15]]))
    assert torch.equal(second, torch.cat([recv[5:10], recv[15:20]]))


@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
@pytest.mark.parametrize("bucket_numel", [100, 10**9], ids=["buckets", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_results_narrower_than_the_exchange_are_written_after_the_buckets_calls(layout, world_size, bucket_numel,
                                                                                offload):
    """A bf16 back exchange views the receive buffer at other offsets, so results are written after the bucket's NS:
    every rank gets upstream's update rounded to bf16 once (under offload via the staging buffer)."""
    specs, pieces, slices, _, grads, momenta, results, *_ = _run(LAYOUTS[layout],
                                                                 world_size,
                                                                 bucket_numel,
                                                                 2,
                                                                 update_dtype=torch.bfloat16,
                                                                 offload=offload)
    updates, reference_momenta = _reference(specs, grads)
    numel = momenta[0].numel()
    for r in range(world_size):
        for t, step_updates in enumerate(updates):
            rounded = [u.to(torch.bfloat16).float() for u in step_updates]
            assert torch.equal(results[r][t], _scatter(rounded, pieces, slices, r, numel)), (r, t)
        assert torch.equal(momenta[r], _scatter(reference_momenta, pieces, slices, r, numel)), r


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batched_owner_calls_write_their_results_in_place(layout, world_size):
    """Batched NS writes each call's results over its own stacked inputs, leaving later matrices intact; bit-equal to
    ``orthogonalize_each(batch=True)`` over the owned matrices, calls bounded by ``OwnerPlan.workspace``."""
    specs = _specs([(8, 12)] * 5 + [(5, 7)] * 3 + [(8, 12)])
    got = _run(LAYOUTS[layout], world_size, 10**9, 2, steps=1, specs=specs, batch_ns=True)
    _, pieces, slices, plan, grads, momenta, results, *_ = got
    inputs = []
    for j, grad in enumerate(grads[0]):
        momentum, x = torch.zeros_like(grad), torch.empty_like(grad)
        momentum_step(grad, momentum, SETTINGS, x)
        inputs.append(x)
    expected = [None] * len(specs)
    for owner in range(world_size):
        owned = [j for j in range(len(specs)) if plan.owners[j] == owner]
        calls = orthogonalize_each(lambda k: inputs[owned[k]], [specs[j] for j in owned], 5, "gram", torch.float32,
                                   "cpu", True, plan.workspace(owner))
        for positions, outs in calls:
            for k, out in zip(positions, outs):
                expected[owned[k]] = out
    numel = momenta[0].numel()
    for r in range(world_size):
        assert torch.equal(results[r][0], _scatter(expected, pieces, slices, r, numel)), r


def test_one_set_of_buffers_covers_every_sub_group():
    """One ``ExchangeBuffers`` for all sub-groups (they run in turn): the max of their needs, not the sum; host
    staging only for pipelines whose pieces live off the device."""
    buffers = ExchangeBuffers.covering([(3, 10, 40, torch.device("cpu")), (1, 30, 20, torch.device("cpu"))], "cpu")
    assert buffers.slots == 3
    assert buffers.outgoing(2, 30, torch.float32).numel() == 30 and buffers.incoming(2, 40,
                                                                                     torch.float32).numel() == 40
    assert buffers.reserved_bytes() == 4 * 3 * (30 + 40)
    assert buffers.staging(0, 10, "cpu") is None
    assert ExchangeBuffers.covering([], "cpu").reserved_bytes() == 0
