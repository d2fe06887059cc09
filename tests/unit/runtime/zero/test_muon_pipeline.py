# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The distributed Muon core (``pipeline.MuonPipeline``), W ranks simulated by threads, on pieces of
ZeRO-3's layout (``ceil(numel / W)`` of each matrix, zero padded) or ZeRO-1/2's (the flat buffer cut
in W). A fake ``all_to_all_single`` routes the ranks' n-th collectives, checks that they agree and
that no rank writes what it sends before waiting. Every rank's pieces must become its pieces of
upstream ``muon_update`` of the whole matrix, update and momentum, bit for bit, at depths 1 and 2.
"""

import math
import threading

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum import MuonSettings
from deepspeed.runtime.zero.muon.newton_schulz import newton_schulz_problem
from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_owners
from deepspeed.runtime.zero.muon.pipeline import MuonPipeline

TIMEOUT = 60  # seconds a simulated rank waits for the others before the test fails
SETTINGS = MuonSettings(momentum=0.9, nesterov=True, ns_method="gram", ns_steps=5)
SHAPES = [(7, 5), (12, 12), (1, 3), (9, 16), (2, 3, 5), (16, 9), (30, 4), (5, 5), (3, 40)]


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
                self.posted.setdefault(n,
                                       {})[rank] = (output, input, list(output_split_sizes), list(input_split_sizes))
                if len(self.posted[n]) == self.world_size:
                    self._route(n)
                    self.cond.notify_all()
            handle = _Handle(self, n, input, input.clone())
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
    """Completes when collective ``n`` is routed; ``wait`` checks the input still holds what it did
    when the collective was issued (a real all-to-all may read it until then)."""

    def __init__(self, fake, n, input, snapshot):
        self.fake, self.n, self.input, self.snapshot = fake, n, input, snapshot

    def wait(self):
        with self.fake.cond:
            if not self.fake.cond.wait_for(lambda: self.n in self.fake.done, timeout=TIMEOUT):
                raise TimeoutError(f"collective {self.n} never completed: the ranks issued different collectives")
        if not torch.equal(self.input, self.snapshot):
            self.fake.errors.append(f"collective {self.n}: its input was written before the collective was waited for")


def _specs(shapes=SHAPES):
    return [MatrixSpec(s, ns_problem=newton_schulz_problem(s, False, None)) for s in shapes]


def _zero3_layout(specs, world_size):
    """Per matrix its pieces, and per rank the ``(offset, numel)`` of each piece in its flat partition."""
    pieces = [(math.ceil(s.numel / world_size), ) * world_size for s in specs]
    offsets = [sum(p[0] for p in pieces[:j]) for j in range(len(pieces))]
    return pieces, [[(o, p[0]) for o, p in zip(offsets, pieces)]] * world_size


def _zero12_layout(specs, world_size):
    """The flat buffer of all matrices cut into W equal partitions (the last one padded)."""
    total = sum(s.numel for s in specs)
    size = math.ceil(total / world_size)
    pieces, slices, start = [], [[] for _ in range(world_size)], 0
    for s in specs:
        end = start + s.numel
        held = [max(0, min(end, (r + 1) * size) - max(start, r * size)) for r in range(world_size)]
        pieces.append(tuple(held))
        for r in range(world_size):
            slices[r].append((max(start, r * size) - r * size if held[r] else 0, held[r]))
        start = end
    return pieces, slices


def _scatter(whole, pieces, slices, rank, numel):
    """Rank ``rank``'s flat tensor (``numel`` elements) holding its pieces of each whole matrix."""
    flat = torch.zeros(numel)
    for matrix, p, (offset, n) in zip(whole, pieces, slices[rank]):
        start = sum(p[:rank])
        real = max(0, min(n, matrix.numel() - start))
        flat[offset:offset + real] = matrix.reshape(-1)[start:start + real]
    return flat


def _run(layout, world_size, bucket_numel, depth, steps=2, specs=None, update_dtype=torch.float32, **options):
    """``steps`` steps of random gradients through W threaded pipelines (``options``: ``batch_ns``,
    ``variant``); what the tests compare, per rank where it is per rank."""
    specs = specs or _specs()
    pieces, slices = layout(specs, world_size)
    holders = [[r for r, n in enumerate(p) if n] for p in pieces] if layout is _zero12_layout else None
    plan = plan_owners(specs, world_size, bucket_numel, holders=holders)
    gen = torch.Generator().manual_seed(world_size * 100 + depth)
    grads = [[torch.randn(s.shape, generator=gen) for s in specs] for _ in range(steps)]
    numel = max(o + n for sl in slices for o, n in sl)
    fake, stats = FakeAllToAll(world_size), [ExchangeStats() for _ in range(world_size)]
    momenta = [torch.zeros(numel) for _ in range(world_size)]
    results = [[None] * steps for _ in range(world_size)]
    exchanges = [OwnerExchange(None, r, world_size, fake.for_rank(r), stats[r]) for r in range(world_size)]
    pipelines = [
        MuonPipeline(plan, specs, pieces, slices[r], x, "cpu", "cpu", depth, **options)
        for r, x in enumerate(exchanges)
    ]
    buffers = [ExchangeBuffers.covering([p.buffer_demand], "cpu") for p in pipelines]
    errors = []

    def rank_main(r):
        try:
            for t in range(steps):
                results[r][t] = _scatter(grads[t], pieces, slices, r, numel)
                pipelines[r].run(results[r][t], momenta[r], SETTINGS, update_dtype, buffers[r], options.get("variant"))
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r, )) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not errors and not fake.errors, (errors, fake.errors)
    return specs, pieces, slices, plan, grads, momenta, results, fake, stats, pipelines, buffers


def _reference(specs, grads):
    """Upstream, one process: ``muon_update`` per whole matrix, step after step."""
    momenta = [torch.zeros(s.shape) for s in specs]
    return [[original_muon.muon_update(g.clone(), m, beta=SETTINGS.momentum) for g, m in zip(step, momenta)]
            for step in grads], momenta


LAYOUTS = {"zero3": _zero3_layout, "zero12": _zero12_layout}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("bucket_numel", [1, 100, 10**9], ids=["one-per-bucket", "buckets", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_gets_its_pieces_of_upstreams_update(layout, world_size, bucket_numel, depth):
    specs, pieces, slices, plan, grads, momenta, results, *_ = _run(LAYOUTS[layout], world_size, bucket_numel, depth)
    updates, reference_momenta = _reference(specs, grads)
    numel = momenta[0].numel()
    for r in range(world_size):
        for t, step_updates in enumerate(updates):
            assert torch.equal(results[r][t], _scatter(step_updates, pieces, slices, r, numel)), (r, t)
        assert torch.equal(momenta[r], _scatter(reference_momenta, pieces, slices, r, numel)), r
