# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The distributed Muon core (``pipeline.MuonPipeline``), with W ranks simulated by threads.

Each simulated rank runs ``MuonPipeline.run`` in its own thread on its pieces of a flat gradient
and momentum, in the ZeRO-3 layout (every rank a ``ceil(numel / W)`` partition of each matrix,
zero padded) and in the ZeRO-1/2 offload layout (the flat buffer cut into W equal partitions, so
most matrices lie on one rank). A fake ``all_to_all_single`` matches the ranks' n-th collectives,
checks that they agree (what rank s sends to rank d is what rank d expects from rank s), routes
the buffers, and checks that no rank writes what it sends before it has waited for the collective. Every rank's gradient pieces must become its pieces of upstream's update of
the whole matrix, and its momentum pieces upstream's momentum, bit for bit (one Newton-Schulz
call per matrix, as upstream), at every pipeline depth; the collectives must be the documented
ones in the same order on every rank; traffic must meet the owner-centric bound (ZeRO-3) or stay
within twice the straddling elements (ZeRO-1/2), with Newton-Schulz once per matrix over the ranks.
"""

import math
import threading

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum import MuonSettings
from deepspeed.runtime.zero.muon.newton_schulz import newton_schulz_problem
from deepspeed.runtime.zero.muon.momentum import momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import orthogonalize_each
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeBuffers, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_for_depth, plan_owners, reserved_numel, within_budget
from deepspeed.runtime.zero.muon.pipeline import MuonPipeline, slots_for_depth

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
    """Completes when collective ``n`` has been routed. ``wait`` also checks that the rank did not
    write the input it sent between issuing the collective and waiting for it (a real all-to-all
    may still be reading it): the input must equal what it held when the collective was issued."""

    def __init__(self, fake, n, input, snapshot):
        self.fake, self.n, self.input, self.snapshot = fake, n, input, snapshot

    def wait(self):
        with self.fake.cond:
            if not self.fake.cond.wait_for(lambda: self.n in self.fake.done, timeout=TIMEOUT):
                raise TimeoutError(f"collective {self.n} never completed: the ranks issued different collectives")
        if not torch.equal(self.input, self.snapshot):
            self.fake.errors.append(f"collective {self.n}: its input was written before the collective was waited for")


def _spec(shape):
    return MatrixSpec(shape, ns_problem=newton_schulz_problem(shape, False, None))


def _specs():
    return [_spec(s) for s in SHAPES]


def _zero3_layout(specs, world_size):
    """Per matrix its pieces, and per rank the ``(offset, numel)`` of each piece in its flat partition."""
    pieces = [(math.ceil(s.numel / world_size), ) * world_size for s in specs]
    slices, offset = [], 0
    for p in pieces:
        slices.append((offset, p[0]))
        offset += p[0]
    return pieces, [slices] * world_size


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


def _record_order(pipeline):
    """Record, in ``pipeline.order``, the collective each stage issues: ``F<b>`` (prepare: the
    forward exchange of bucket b) and ``B<b>`` (compute: its back exchange)."""
    pipeline.order = []
    prepare, compute = pipeline._prepare, pipeline._compute

    def recorded_prepare(b, *args):
        pipeline.order.append(f"F{b}")
        return prepare(b, *args)

    def recorded_compute(b, *args):
        pipeline.order.append(f"B{b}")
        return compute(b, *args)

    pipeline._prepare, pipeline._compute = recorded_prepare, recorded_compute


def _run(layout,
         world_size,
         bucket_numel,
         depth,
         steps=2,
         specs=None,
         batch_ns=False,
         update_dtype=torch.float32,
         variant=None):
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
    pipelines = [
        MuonPipeline(plan,
                     specs,
                     pieces,
                     slices[r],
                     OwnerExchange(None, r, world_size, fake.for_rank(r), stats[r]),
                     "cpu",
                     "cpu",
                     depth,
                     batch_ns=batch_ns,
                     variant=variant) for r in range(world_size)
    ]
    buffers = [ExchangeBuffers.covering([p.buffer_demand], "cpu") for p in pipelines]
    for pipeline in pipelines:
        _record_order(pipeline)
    errors = []

    def rank_main(r):
        try:
            for t in range(steps):
                grad = _scatter(grads[t], pieces, slices, r, numel)
                pipelines[r].run(grad, momenta[r], SETTINGS, update_dtype, buffers[r], variant)
                results[r][t] = grad
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
    updates = []
    for step in grads:
        updates.append([
            original_muon.muon_update(g.clone(), m, beta=SETTINGS.momentum, ns_steps=5, ns_method="gram")
            for g, m in zip(step, momenta)
        ])
    return updates, momenta


LAYOUTS = {"zero3": _zero3_layout, "zero12": _zero12_layout}


@pytest.mark.parametrize("depth", [1, 2, 3])
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


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_the_documented_order(world_size, depth):
    """Every rank issues 2 asynchronous all-to-alls per bucket, forward of bucket k+depth after
    the back exchange of bucket k (``pipeline`` docstring), and its buffers never exceed the
    ``2 * depth - 1`` slots reserved at construction."""
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
    assert all(p.order == expected for p in pipelines), [p.order for p in pipelines]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero3_traffic_meets_the_owner_centric_bound(world_size):
    """Summed over ranks, each matrix's pieces cross ranks twice except the owner's own:
    ``2 (W - 1) p`` per matrix, i.e. ``2 P (W - 1) / W^2`` per rank on average."""
    specs, pieces, _, _, _, _, _, _, stats, *_ = _run(_zero3_layout, world_size, 10**9, 2, steps=1)
    received = sum(s.elements_received for s in stats)
    assert received == sum(2 * (world_size - 1) * p[0] for p in pieces)
    assert sum(s.elements_sent for s in stats) == received
    assert sum(s.ns_calls for s in stats) == len(specs)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero12_only_straddling_matrices_travel(world_size):
    """ZeRO-1/2 layout: a matrix one rank holds whole never leaves it; a straddling one goes to
    one of its holders and back, so a rank receives at most twice the straddling elements."""
    specs, pieces, _, plan, _, _, _, _, stats, *_ = _run(_zero12_layout, world_size, 10**9, 2, steps=1)
    straddling = [j for j, p in enumerate(pieces) if sum(1 for n in p if n) > 1]
    assert straddling, "the layout must have matrices on partition boundaries"
    expected = sum(2 * (sum(pieces[j]) - pieces[j][plan.owners[j]]) for j in straddling)
    assert sum(s.elements_received for s in stats) == expected
    assert all(s.elements_received <= 2 * sum(sum(pieces[j]) for j in straddling) for s in stats)
    assert sum(s.ns_calls for s in stats) == len(specs)


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
                assert pipeline.alone and buffers.reserved_bytes() == 0, "one rank exchanges nothing"
            else:
                assert buffers.reserved_bytes() == 4 * reserved_numel(plan, pieces, 3)[r]
    alone_offloaded = MuonPipeline(plan_owners(specs, 1, 100), specs,
                                   *_zero3_layout(specs, 1)[:1],
                                   _zero3_layout(specs, 1)[1][0], OwnerExchange(None, 0, 1, None, ExchangeStats()),
                                   "meta", "cpu", 2)
    assert not alone_offloaded.alone, "pieces off the Newton-Schulz device still go through the buffers"


def test_layout_reassembles_and_splits_with_padding():
    """One bucket, ZeRO-3 pieces with padding: what the owner reassembles is the matrix, and the
    results it writes come back as each rank's piece with zero padding."""
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
    """Twelve 16x256 matrices at W=2: a rank holds 12 x 2048 elements of momentum, less the owner's
    Newton-Schulz working set (2 x 4096 + 4 x 256 for one matrix) leaves 15360. At depth 2 (three
    slots) one matrix per bucket already reserves 3 x (2048 + 4096) on its owner; depth 1 fits,
    with buckets as large as fit. Where nothing fits (W=4, one large matrix), depth 1 is the least
    reserved."""
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
    """Where a rank owns one matrix of a bucket, its pieces lie back to back in the receive buffer:
    the owner reads them in place (no copy); with two owned matrices they are interleaved and copied."""
    one = BucketLayout(matrices=(0, 1), owners=(0, 1), numels=(10, 10), pieces=((5, 5), (5, 5)), rank=0)
    recv = torch.arange(10.)
    matrix = one.owned_matrix(recv, 0, (2, 5))
    assert matrix.data_ptr() == recv.data_ptr() and torch.equal(matrix.reshape(-1), recv)
    two = BucketLayout(matrices=(0, 1), owners=(0, 0), numels=(10, 10), pieces=((5, 5), (5, 5)), rank=0)
    recv = torch.arange(20.)
    first, second = two.owned_matrix(recv, 0, (10, )), two.owned_matrix(recv, 1, (10, ))
    assert torch.equal(first, torch.cat([recv[0:5], recv[10:15]]))
    assert torch.equal(second, torch.cat([recv[5:10], recv[15:20]]))


@pytest.mark.parametrize("bucket_numel", [100, 10**9], ids=["buckets", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_results_narrower_than_the_exchange_are_written_after_the_buckets_calls(layout, world_size, bucket_numel):
    """A bf16 back exchange views the receive buffer's bytes at other offsets, so the owner writes
    its results once the bucket's Newton-Schulz calls are done: every rank still gets upstream's
    update, rounded to bf16 once."""
    specs, pieces, slices, _, grads, momenta, results, *_ = _run(LAYOUTS[layout],
                                                                 world_size,
                                                                 bucket_numel,
                                                                 2,
                                                                 update_dtype=torch.bfloat16)
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
    """Batched Newton-Schulz on the owner: each call's results go into the receive buffer over
    the inputs it stacked, without disturbing the matrices still to come. The owner's calls equal
    ``orthogonalize_each`` with ``batch=True`` over the matrices it owns, in its order, with calls
    bounded by its largest matrix's working set (``OwnerPlan.workspace``), bit for bit."""
    specs = [_spec((8, 12))] * 5 + [_spec((5, 7))] * 3 + [_spec((8, 12))]
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
    """The stage bindings reserve one ``ExchangeBuffers`` for all their sub-groups (they run one
    after the other): the most slots and the largest buffers any pipeline asks for, not their sum,
    with host staging only for pipelines whose pieces live off the device."""
    buffers = ExchangeBuffers.covering([(3, 10, 40, torch.device("cpu")), (1, 30, 20, torch.device("cpu"))], "cpu")
    assert buffers.slots == 3
    assert buffers.outgoing(2, 30, torch.float32).numel() == 30 and buffers.incoming(2, 40,
                                                                                     torch.float32).numel() == 40
    assert buffers.reserved_bytes() == 4 * 3 * (30 + 40)
    assert buffers.staging(0, 10, "cpu") is None
    assert ExchangeBuffers.covering([], "cpu").reserved_bytes() == 0
