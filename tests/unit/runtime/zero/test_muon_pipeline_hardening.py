# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner exchange where all-to-alls failed in the field (dion #74, #83; prime-rl #3490; nanochat #843), on the
real backend: a rank holding nothing of a bucket, more ranks than matrices, ragged pieces; the warm-up all-to-all;
handles keeping tensors alive until ``wait``. Pieces must be upstream ``muon_update``'s (bit for bit on the CPU)."""

import gc
import weakref

import pytest
import torch

from deepspeed.runtime.zero.muon.owner_exchange import ExchangeStats, OwnerExchange
from muon_testing.threaded_exchange import FakeAllToAll, mismatches, specs_of, zero3_layout, zero12_layout
from unit.common import DistributedTest

TWO_MATRICES = [(6, 10), (9, 4)]
"""Fewer matrices than ranks: at W=4 two ranks own nothing, and under ZeRO-1/2 a rank may hold nothing of either."""


def ragged(specs, world_size):
    """Uneven pieces of two matrices over 4 ranks (none, one element, most), back to back in each flat partition."""
    assert world_size == 4 and [s.numel for s in specs] == [60, 36]
    pieces = [(0, 1, 52, 7), (20, 0, 0, 16)]
    slices = [[(0, pieces[0][r]), (pieces[0][r], pieces[1][r])] for r in range(4)]
    return pieces, slices


def _eps():
    """Off the CPU: one ulp of the NS compute dtype, as ``test_muon_pipeline``'s accelerator test."""
    from deepspeed.runtime.zero.muon import original_muon
    return torch.finfo(original_muon.ns_compute_dtype("gram")).eps


CASES = {
    "zero12-nothing-held": (zero12_layout, TWO_MATRICES),
    "zero3-more-ranks-than-matrices": (zero3_layout, TWO_MATRICES),
    "ragged": (ragged, TWO_MATRICES),
}


def _on_ranks(layout, shapes, bucket_numel, depth):
    """``run_pipelines``' steps with the process group's ``all_to_all_single`` (NCCL on GPUs, gloo on the CPU)."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers
    from deepspeed.runtime.zero.muon.owner_plan import plan_owners
    from deepspeed.runtime.zero.muon.pipeline import MuonPipeline
    from muon_testing.threaded_exchange import Run, scatter, settings
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = get_accelerator().current_device_name()
    specs = specs_of(shapes)
    pieces, slices = layout(specs, world_size)
    holders = [[r for r, n in enumerate(p) if n] for p in pieces]
    plan = plan_owners(specs, world_size, bucket_numel, holders=holders)
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(s.shape, generator=gen).to(device) for s in specs] for _ in range(2)]
    numel = max(o + n for sl in slices for o, n in sl)
    stats = ExchangeStats()
    exchange = OwnerExchange(None, rank, world_size, dist.all_to_all_single, stats)
    exchange.warm_up(device)
    pipeline = MuonPipeline(plan, specs, pieces, slices[rank], exchange, device, device, depth, batch_ns=False)
    buffers = ExchangeBuffers.covering([pipeline.buffer_demand], device)
    momentum, results = torch.zeros(numel, device=device), []
    for step in grads:
        results.append(scatter(step, pieces, slices, rank, numel, device))
        pipeline.run(results[-1], momentum, settings(), torch.float32, buffers)
    # every rank's view, for ``mismatches``: only this rank's entries are filled
    full = [[torch.zeros(numel, device=device)] * len(grads) for _ in range(world_size)]
    full[rank] = results
    momenta = [torch.zeros(numel, device=device)] * world_size
    momenta[rank] = momentum
    run = Run(specs, pieces, slices, plan, grads, momenta, full, None, [stats], [pipeline], [buffers])
    return run, rank, pipeline, device


class TestExchangeOnTheBackend(DistributedTest):
    world_size = 4
    reuse_dist_env = True

    @pytest.mark.parametrize("depth", [1, 2])
    @pytest.mark.parametrize("bucket_numel", [1, 10**9], ids=["one-per-bucket", "one-bucket"])
    @pytest.mark.parametrize("case", list(CASES))
    def test_pieces_are_upstreams(self, case, bucket_numel, depth):
        run, rank, pipeline, device = _on_ranks(*CASES[case], bucket_numel, depth)
        mine = [m for m in mismatches(run, device) if m[0] == rank]
        assert not mine or torch.device(device).type != "cpu" and max(m[2] for m in mine) <= _eps(), mine
        if case != "zero3-more-ranks-than-matrices":
            return
        owned = [j for j, owner in enumerate(run.plan.owners) if owner == rank]
        assert len(set(run.plan.owners)) == 2 and (owned or all(lay.recv_numel == 0 for lay in pipeline.layouts))

    def test_a_rank_holding_nothing_of_a_bucket_joins_its_collectives(self):
        run, rank, pipeline, _ = _on_ranks(ragged, TWO_MATRICES, 1, 2)
        idle = [lay for lay in pipeline.layouts if lay.send_numel == 0 and lay.recv_numel == 0]
        assert idle or rank == 3, "ranks 0-2 each hold nothing of one matrix, and own only a matrix they hold"
        steps = len(run.grads)
        assert run.stats[0].exchanges == 2 * steps * len(
            run.plan.buckets), "every bucket's 2 all-to-alls, empty or not"


def test_warm_up_checks_what_comes_back():
    """The warm-up all-to-all delivers by rank, or initialization stops naming what came back."""
    fake = FakeAllToAll(1)
    exchange = OwnerExchange(None, 0, 1, fake.for_rank(0), ExchangeStats())
    exchange.warm_up("cpu")
    assert fake.count == [1] and exchange.stats.exchanges == 0, "one synchronous all-to-all, not counted"

    def swapped(output, input, **kwargs):
        output.copy_(input.flip(0) + 1)

    with pytest.raises(RuntimeError, match="warm-up on rank 0 of 1"):
        OwnerExchange(None, 0, 1, swapped, ExchangeStats()).warm_up("cpu")


def test_handles_hold_their_tensors_until_waited_for():
    """An async all-to-all's tensors stay alive while its handle is pending, whatever the caller drops, to ``wait``."""
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
