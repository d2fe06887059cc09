# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The bucket pipeline, with W ranks simulated by threads of one process.

Each simulated rank runs ``BucketPipeline.run`` in its own thread on its ZeRO-3 partitions. A
fake ``all_to_all_single`` matches the ranks' n-th collectives, checks that they agree (what
rank s sends to rank d is what rank d expects from rank s), routes the buffers, and completes
the handles. The result on every rank must be its partition of the owner function applied to
each whole matrix, bit for bit, with and without overlap; the collectives must be issued in the
documented order on every rank, asynchronously with overlap and blocking without.
"""

import math
import threading

import pytest
import torch

from deepspeed.runtime.zero.muon.bucket_pipeline import BucketPipeline
from deepspeed.runtime.zero.muon.momentum_math import newton_schulz_problem
from deepspeed.runtime.zero.muon.owner_exchange import (INCOMING, OUTGOING, BucketLayout, ExchangeBuffers,
                                                        ExchangeStats, OwnerExchange)
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_owners

TIMEOUT = 60  # seconds a simulated rank waits for the others before the test fails


class FakeAllToAll:
    """``all_to_all_single`` for W simulated ranks; collective n completes once all ranks posted it."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.cond = threading.Condition()
        self.posted = {}  # collective number -> {rank: (output, input, output_splits, input_splits)}
        self.done = set()
        self.count = [0] * world_size
        self.async_ops = [[] for _ in range(world_size)]
        self.errors = []

    def for_rank(self, rank):

        def all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op):
            with self.cond:
                n = self.count[rank]
                self.count[rank] += 1
                self.async_ops[rank].append(async_op)
                self.posted.setdefault(n, {})[rank] = (output, input, list(output_split_sizes),
                                                       list(input_split_sizes))
                if len(self.posted[n]) == self.world_size:
                    self._route(n)
                    self.cond.notify_all()
            handle = _Handle(self, n)
            if async_op:
                return handle
            handle.wait()
            return None

        return all_to_all_single

    def _route(self, n):
        ranks = self.posted.pop(n)
        for d, (output, _, output_splits, _) in ranks.items():
            offset = 0
            for s in range(self.world_size):
                _, input, _, input_splits = ranks[s]
                if input_splits[d] != output_splits[s]:
                    self.errors.append(f"collective {n}: rank {s} sends {input_splits[d]} elements to rank {d}, "
                                       f"which expects {output_splits[s]}")
                    continue
                start = sum(input_splits[:d])
                output[offset:offset + output_splits[s]].copy_(input[start:start + input_splits[d]])
                offset += output_splits[s]
        self.done.add(n)


class _Handle:

    def __init__(self, fake, n):
        self.fake, self.n = fake, n

    def wait(self):
        with self.fake.cond:
            if not self.fake.cond.wait_for(lambda: self.n in self.fake.done, timeout=TIMEOUT):
                raise TimeoutError(f"collective {self.n} never completed: the ranks issued different collectives")


class RecordingExchange(OwnerExchange):
    """Records which bucket each collective belongs to: ``("F", b)`` forward, ``("B", b)`` back."""

    def __init__(self, layouts, *args):
        super().__init__(*args)
        self.layouts, self.order = layouts, []

    def send_to_owners(self, layout, *args):
        self.order.append(f"F{self.layouts.index(layout)}")
        return super().send_to_owners(layout, *args)

    def send_to_ranks(self, layout, *args):
        self.order.append(f"B{self.layouts.index(layout)}")
        return super().send_to_ranks(layout, *args)


SHAPES = [(7, 5), (12, 12), (1, 3), (9, 16), (2, 3, 5), (16, 9), (30, 4), (5, 5), (3, 40)]


def _partition(tensor, world_size, rank):
    size = math.ceil(tensor.numel() / world_size)
    flat = torch.zeros(size * world_size, dtype=tensor.dtype)
    flat[:tensor.numel()] = tensor.reshape(-1)
    return flat[rank * size:(rank + 1) * size].clone()


def owner_function(j, matrix):
    """Any function of the whole matrix (it must be reassembled right for the result to be)."""
    return matrix.flip(0) * (j + 1) + matrix.sum()


def _run_ranks(world_size, bucket_numel, overlap, alias, steps=1):
    """Run the pipeline of every simulated rank ``steps`` times (one ``BucketPipeline`` per rank,
    new matrices each step; returns the last step's). ``buffers[rank]`` lists, per step, the
    pipeline's retained bytes and the addresses of its buffers after that step."""
    gen = torch.Generator().manual_seed(world_size * 100 + bucket_numel)
    steps_matrices = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]
    matrices = steps_matrices[-1]
    pn = [math.ceil(m.numel() / world_size) for m in matrices]
    specs = [MatrixSpec(s, p, ns_problem=newton_schulz_problem(s, False, None)) for s, p in zip(SHAPES, pn)]
    plan = plan_owners(specs, world_size, bucket_numel)
    fake = FakeAllToAll(world_size)
    results, exchanges, calls, failures, buffers = {}, {}, [], [], {}

    def rank_main(rank):
        try:
            layouts = [
                BucketLayout([plan.owners[j] for j in bucket], [SHAPES[j] for j in bucket], [pn[j] for j in bucket],
                             rank, world_size) for bucket in plan.buckets
            ]
            exchange = RecordingExchange(layouts, None, rank, world_size, torch.device("cpu"), fake.for_rank(rank),
                                         ExchangeStats())
            pipeline = BucketPipeline(exchange, plan.buckets, layouts)

            def owner_update(indices, owned):
                calls.extend((rank, j) for j in indices)
                return [owner_function(j, matrix) for j, matrix in zip(indices, owned)]

            for step_matrices in steps_matrices:
                to_owner = [_partition(m, world_size, rank) for m in step_matrices]
                into = to_owner if alias else [torch.full((p, ), float("nan")) for p in pn]
                pipeline.run(to_owner, into, owner_update, torch.float32, torch.float64, overlap)
                held = pipeline.buffers[overlap]._buffers
                buffers.setdefault(rank, []).append(
                    (pipeline.retained_bytes(), sorted((k, b.data_ptr()) for k, b in held.items())))
            results[rank], exchanges[rank] = into, exchange
        except Exception as e:  # reported by the main thread
            failures.append(f"rank {rank}: {e!r}")

    threads = [threading.Thread(target=rank_main, args=(r, )) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not failures and not fake.errors, failures + fake.errors
    return plan, matrices, results, exchanges, fake, sorted(calls), buffers


@pytest.mark.parametrize("alias", [False, True], ids=["separate", "in_place"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("bucket_numel", [1, 100, 10**9])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_gets_its_partition_of_the_owner_result(world_size, bucket_numel, overlap, alias):
    plan, matrices, results, _, _, calls, _ = _run_ranks(world_size, bucket_numel, overlap, alias)
    assert calls == sorted((plan.owners[j], j) for j in range(len(SHAPES))), "once per matrix, on its owner"
    for rank in range(world_size):
        for j, matrix in enumerate(matrices):
            expected = _partition(owner_function(j, matrix), world_size, rank)
            assert torch.equal(results[rank][j], expected), (rank, j)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_in_the_same_documented_order_on_every_rank(world_size, overlap):
    plan, _, _, exchanges, fake, _, _ = _run_ranks(world_size, 100, overlap, alias=True)
    n = len(plan.buckets)
    assert n >= 3, "the test needs several buckets"
    if overlap:  # bucket k+1's forward is issued before bucket k is computed and returned
        expected = ["F0"] + [x for b in range(n) for x in ([f"F{b + 1}"] if b + 1 < n else []) + [f"B{b}"]]
    else:
        expected = [x for b in range(n) for x in (f"F{b}", f"B{b}")]
    for rank in range(world_size):
        assert exchanges[rank].order == expected, rank
        assert fake.async_ops[rank] == [overlap] * 2 * n, rank
        assert exchanges[rank].stats.exchanges == 2 * n


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_buffers_are_allocated_once_and_reused(world_size, overlap):
    """Later steps allocate no exchange buffer: the same buffers (addresses) and bytes as after
    the first step, with 3 slots under overlap and 1 without, however many buckets there are; and
    the results of the last step are still right."""
    plan, matrices, results, _, _, _, buffers = _run_ranks(world_size, 100, overlap, alias=False, steps=3)
    assert len(plan.buckets) > 3
    for rank in range(world_size):
        first = buffers[rank][0]
        assert first[0] > 0 and all(step == first for step in buffers[rank][1:]), rank
        assert {slot for (slot, _), _ in first[1]} == set(range(3 if overlap else 1))
        for j, matrix in enumerate(matrices):
            assert torch.equal(results[rank][j], _partition(owner_function(j, matrix), world_size, rank)), (rank, j)


def test_exchange_buffers_view_one_storage_as_each_dtype():
    buffers = ExchangeBuffers(2, torch.device("cpu"))
    a = buffers.take(1, OUTGOING, 6, torch.float32)
    b = buffers.take(1, OUTGOING, 12, torch.bfloat16)
    assert a.dtype == torch.float32 and a.numel() == 6 and b.numel() == 12
    assert a.data_ptr() == b.data_ptr() and buffers.retained_bytes() == 24
    assert buffers.take(1, OUTGOING, 4, torch.float64).data_ptr() != a.data_ptr(), "grown for a larger request"
    assert buffers.retained_bytes() == 32
    with pytest.raises(IndexError):
        buffers.take(2, INCOMING, 1, torch.float32)


def test_no_buckets_no_collectives():
    fake = FakeAllToAll(2)
    exchange = OwnerExchange(None, 0, 2, torch.device("cpu"), fake.for_rank(0), ExchangeStats())
    BucketPipeline(exchange, [], []).run([], [], owner_function, torch.float32, torch.float32, True)
    assert fake.count == [0, 0]


def test_buckets_and_layouts_must_match():
    exchange = OwnerExchange(None, 0, 1, torch.device("cpu"), None, ExchangeStats())
    with pytest.raises(ValueError, match="1 buckets but 0 layouts"):
        BucketPipeline(exchange, [(0, )], [])
