# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner exchange where all-to-alls fail in the field (dion #74, #83; prime-rl #3490; nanochat #843), on the
process group's real backend: a rank that holds nothing of a bucket (it still joins the bucket's collectives, with
empty splits), more ranks than matrices (most ranks own nothing), ragged pieces (ZeRO-1/2 cuts, ZeRO-3 padding,
uneven hand-made pieces); the warm-up all-to-all at initialization; and work handles with their tensors held until
``wait``. Every rank's pieces must be upstream ``muon_update``'s of the whole matrix, bit for bit.
"""

import gc
import weakref

import pytest
import torch

from deepspeed.runtime.zero.muon.owner_exchange import ExchangeStats, OwnerExchange
from muon_testing.threaded_exchange import (FakeAllToAll, mismatches, run_pipelines, specs_of, zero3_layout,
                                            zero12_layout)
from unit.common import DistributedTest

TWO_MATRICES = [(6, 10), (9, 4)]
"""Fewer matrices than ranks: at W=4 two ranks own nothing, and under ZeRO-1/2 a rank may hold nothing of either."""


def ragged(specs, world_size):
    """Hand-made uneven pieces of two matrices over 4 ranks: none, one element, most of it; each rank's pieces back
    to back in its flat partition."""
    assert world_size == 4 and [s.numel for s in specs] == [60, 36]
    pieces = [(0, 1, 52, 7), (20, 0, 0, 16)]
    slices = [[(0, pieces[0][r]), (pieces[0][r], pieces[1][r])] for r in range(4)]
    return pieces, slices


CASES = {
    "zero12-nothing-held": (zero12_layout, TWO_MATRICES),
    "zero3-more-ranks-than-matrices": (zero3_layout, TWO_MATRICES),
    "ragged": (ragged, TWO_MATRICES),
}


def _on_ranks(layout, shapes, bucket_numel, depth):
    """``run_pipelines``' steps with this process group's ``all_to_all_single`` instead of the threads'."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers
    from deepspeed.runtime.zero.muon.owner_plan import plan_owners
    from deepspeed.runtime.zero.muon.pipeline import MuonPipeline
    from muon_testing.threaded_exchange import Run, scatter, settings
    rank, world_size = dist.get_rank(), dist.get_world_size()
    specs = specs_of(shapes)
    pieces, slices = layout(specs, world_size)
    holders = [[r for r, n in enumerate(p) if n] for p in pieces]
    plan = plan_owners(specs, world_size, bucket_numel, holders=holders)
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(s.shape, generator=gen) for s in specs] for _ in range(2)]
    numel = max(o + n for sl in slices for o, n in sl)
    stats = ExchangeStats()
    exchange = OwnerExchange(None, rank, world_size, dist.all_to_all_single, stats)
    exchange.warm_up()
    pipeline = MuonPipeline(plan, specs, pieces, slices[rank], exchange, "cpu", "cpu", depth, batch_ns=False)
    buffers = ExchangeBuffers.covering([pipeline.buffer_demand], "cpu")
    momentum, results = torch.zeros(numel), []
    for step in grads:
        results.append(scatter(step, pieces, slices, rank, numel))
        pipeline.run(results[-1], momentum, settings(), torch.float32, buffers)
    # every rank's view, for ``mismatches``: only this rank's entries are filled
    full = [[torch.zeros(numel)] * len(grads) for _ in range(world_size)]
    full[rank] = results
    momenta = [torch.zeros(numel)] * world_size
    momenta[rank] = momentum
    run = Run(specs, pieces, slices, plan, grads, momenta, full, None, [stats], [pipeline], [buffers])
    return run, rank, pipeline


class TestExchangeOnTheBackend(DistributedTest):
    world_size = 4
    reuse_dist_env = True

    @pytest.mark.parametrize("depth", [1, 2])
    @pytest.mark.parametrize("bucket_numel", [1, 10**9], ids=["one-per-bucket", "one-bucket"])
    @pytest.mark.parametrize("case", list(CASES))
    def test_pieces_are_upstreams(self, case, bucket_numel, depth):
        run, rank, pipeline = _on_ranks(*CASES[case], bucket_numel, depth)
        mine = [m for m in mismatches(run) if m[0] == rank]
        assert not mine, mine
        if case != "zero3-more-ranks-than-matrices":
            return
        owned = [j for j, owner in enumerate(run.plan.owners) if owner == rank]
        assert len(set(run.plan.owners)) == 2 and (owned or all(lay.recv_numel == 0 for lay in pipeline.layouts))

    def test_a_rank_holding_nothing_of_a_bucket_joins_its_collectives(self):
        run, rank, pipeline = _on_ranks(ragged, TWO_MATRICES, 1, 2)
        idle = [lay for lay in pipeline.layouts if lay.send_numel == 0 and lay.recv_numel == 0]
        assert idle or rank == 3, "ranks 0-2 each hold nothing of one matrix, and own only a matrix they hold"
        steps = len(run.grads)
        assert run.stats[0].exchanges == 2 * steps * len(
            run.plan.buckets), "every bucket's 2 all-to-alls, empty or not"


def test_warm_up_checks_what_comes_back():
    """The warm-up all-to-all delivers by rank, or initialization stops naming what came back."""
    fake = FakeAllToAll(1)
    exchange = OwnerExchange(None, 0, 1, fake.for_rank(0), ExchangeStats())
    exchange.warm_up()
    assert fake.count == [1] and exchange.stats.exchanges == 0, "one synchronous all-to-all, not counted"

    def swapped(output, input, **kwargs):
        output.copy_(input.flip(0) + 1)

    with pytest.raises(RuntimeError, match="warm-up on rank 0 of 1"):
        OwnerExchange(None, 0, 1, swapped, ExchangeStats()).warm_up()


def test_handles_hold_their_tensors_until_waited_for():
    """An asynchronous all-to-all's input and output stay alive while its handle is pending, however the caller lets
    go of them, and are released by ``wait``."""
    waited = []

    class Handle:

        def wait(self):
            waited.append(True)

    exchange = OwnerExchange(None, 0, 2, lambda *args, **kwargs: Handle(), ExchangeStats())
    output, input = torch.zeros(4), torch.ones(4)
    alive = [weakref.ref(output), weakref.ref(input)]
    pending = exchange.all_to_all(output, input, [2, 2], [2, 2], async_op=True)
    del output, input
    gc.collect()
    assert all(ref() is not None for ref in alive), "released before wait"
    pending.wait()
    gc.collect()
    assert waited and all(ref() is None for ref in alive), "still held after wait"


@pytest.mark.parametrize("world_size", [5, 8])
def test_more_threads_than_matrices_with_offload(world_size):
    """W above the matrices' count through the threads, pieces crossing pinned staging buffers (offload)."""
    run = run_pipelines(zero3_layout, world_size, 10**9, 2, specs=specs_of(TWO_MATRICES), offload=True)
    assert not mismatches(run)
