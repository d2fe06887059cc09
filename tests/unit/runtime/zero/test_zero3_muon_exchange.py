# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The exchange layout, with W ranks simulated in one process.

Each simulated rank packs its partitions; the test routes the send buffers as all-to-all would
(chunk ``d`` of rank ``s``'s buffer lands as chunk ``s`` of rank ``d``'s receive buffer). The
owners must reassemble exactly the original matrices, and after the way back every rank must hold
exactly its ZeRO-3 partition of each result, padding zero.
"""

import math
import random

import pytest
import torch

from deepspeed.runtime.zero.muon.momentum_math import newton_schulz_problem
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_owners


def _plan(shapes, partition_numels, world_size):
    specs = [
        MatrixSpec(s, p, ns_problem=newton_schulz_problem(s, False, None)) for s, p in zip(shapes, partition_numels)
    ]
    return plan_owners(specs, world_size, bucket_numel=10**9)


def _partition(tensor, world_size, rank):
    size = math.ceil(tensor.numel() / world_size)
    flat = torch.zeros(size * world_size, dtype=tensor.dtype)
    flat[:tensor.numel()] = tensor.reshape(-1)
    return flat[rank * size:(rank + 1) * size].clone()


def _route(send_buffers, send_splits, recv_splits):
    """All-to-all by hand: send_splits[s][d] elements go from rank s to rank d."""
    world_size = len(send_buffers)
    recv = []
    for d in range(world_size):
        chunks = []
        for s in range(world_size):
            start = sum(send_splits[s][:d])
            chunks.append(send_buffers[s][start:start + send_splits[s][d]])
        out = torch.cat(chunks)
        assert out.numel() == sum(recv_splits[d])
        recv.append(out)
    return recv


def _shapes(seed, world_size):
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(9)]
    shapes.append((1, world_size - 1 if world_size > 1 else 1))  # fewer elements than ranks
    shapes.append((2, 3, 5))
    return shapes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip(world_size, seed):
    shapes = _shapes(seed, world_size)
    gen = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(s, generator=gen) for s in shapes]
    pn = [math.ceil(m.numel() / world_size) for m in matrices]
    plan = _plan(shapes, pn, world_size)
    layouts = [BucketLayout(plan.owners, shapes, pn, rank, world_size) for rank in range(world_size)]

    sends = [
        layouts[r].pack([_partition(m, world_size, r) for m in matrices], torch.empty(layouts[r].send_numel))
        for r in range(world_size)
    ]
    recvs = _route(sends, [l.send_splits for l in layouts], [l.recv_splits for l in layouts])
    for r in range(world_size):
        owned = layouts[r].owned_matrices(recvs[r])
        assert [k for k in layouts[r].owned] == plan.owned_by(r)
        for k, matrix in zip(layouts[r].owned, owned):
            assert torch.equal(matrix, matrices[k])

    def result_of(k):
        return matrices[k] * 3 - k  # any function the owner computes

    backs = [
        layouts[r].write_results([result_of(k) for k in layouts[r].owned],
                                 torch.full((world_size * layouts[r].owned_numel, ), float("nan")))
        for r in range(world_size)
    ]
    recv_back = _route(backs, [l.recv_splits for l in layouts], [l.send_splits for l in layouts])
    for r in range(world_size):
        partitions = [torch.full((p, ), float("nan")) for p in pn]
        layouts[r].unpack(recv_back[r], partitions)
        for k, part in enumerate(partitions):
            assert torch.equal(part, _partition(result_of(k), world_size, r)), (r, k)


@pytest.mark.parametrize("world_size", [2, 4])
def test_traffic_meets_owner_centric_bound(world_size):
    # 4 equal matrices per rank: a balanced plan reaches 2 P (W - 1) / W^2 exactly.
    shapes = [(256, 256)] * (4 * world_size)
    pn = [256 * 256 // world_size] * len(shapes)
    plan = _plan(shapes, pn, world_size)
    total = sum(256 * 256 for _ in shapes)
    for rank in range(world_size):
        layout = BucketLayout(plan.owners, shapes, pn, rank, world_size)
        assert layout.received_elements() == 2 * total * (world_size - 1) // world_size**2
        assert layout.sent_elements() == layout.received_elements()


def test_exchange_counts_only_other_ranks():
    stats = ExchangeStats()
    calls = []

    def fake_all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op):
        calls.append((list(output_split_sizes), list(input_split_sizes)))
        output.zero_()

    shapes = [(3, 5), (4, 4), (2, 7)]
    pn = [8, 8, 7]
    layout = BucketLayout([1, 0, 1], shapes, pn, rank=0, world_size=2)
    exchange = OwnerExchange(None, 0, 2, torch.device("cpu"), fake_all_to_all, stats)
    recv, handle = exchange.send_to_owners(layout, [torch.ones(p) for p in pn], torch.float32)
    assert handle is None and recv.numel() == 2 * 8
    assert calls == [([8, 8], [8, 15])]
    assert stats.elements_sent == 15 and stats.elements_received == 8
    assert stats.bytes_sent == 60 and stats.exchanges == 1
    exchange.send_to_ranks(layout, [torch.zeros(4, 4)], torch.float16)
    assert calls[-1] == ([8, 15], [8, 8])
    assert stats.elements_received == 8 + 15 and stats.bytes_received == 8 * 4 + 15 * 2


def test_single_rank_copies_without_collective():
    stats = ExchangeStats()

    def no_collective(*args, **kwargs):
        raise AssertionError("W=1 must not call all-to-all")

    layout = BucketLayout([0, 0], [(2, 3), (3, 1)], [6, 3], rank=0, world_size=1)
    exchange = OwnerExchange(None, 0, 1, torch.device("cpu"), no_collective, stats)
    parts = [torch.arange(6.0), torch.arange(3.0)]
    recv, _ = exchange.send_to_owners(layout, parts, torch.float32)
    owned = layout.owned_matrices(recv)
    assert torch.equal(owned[0], torch.arange(6.0).view(2, 3)) and torch.equal(owned[1], torch.arange(3.0).view(3, 1))
    assert stats.elements_received == 0 and stats.elements_sent == 0 and stats.exchanges == 0


def test_layout_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="cannot hold"):
        BucketLayout([0], [(5, 5)], [12], rank=0, world_size=2)
    with pytest.raises(ValueError, match="one entry per matrix"):
        BucketLayout([0, 1], [(5, 5)], [13], rank=0, world_size=2)
