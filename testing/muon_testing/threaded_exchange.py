# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""W ranks of the distributed Muon core (``pipeline.MuonPipeline``) simulated by threads in one process, on any device.

The tests run it on the CPU accelerator, the GPU check on one GPU (CUDA buffers, views and copies at W > 1, which a
one-GPU DeepSpeed run never reaches). ``FakeAllToAll`` stands in for ``all_to_all_single``; ``run_pipelines`` runs
random gradients on ZeRO-3's layout (``ceil(numel / W)`` of each matrix, zero padded) or ZeRO-1/2's (the flat buffer
cut in W); ``scatter`` of ``reference_updates`` (upstream ``muon_update`` per whole matrix) compares bit for bit.
"""

import math
import threading
from typing import List, NamedTuple

import torch

TIMEOUT = 60
"""Seconds a simulated rank waits for the others before ``wait`` raises ``TimeoutError``."""

SHAPES = [(7, 5), (12, 12), (1, 3), (9, 16), (2, 3, 5), (16, 9), (30, 4), (5, 5), (3, 40)]
"""The default matrices: tall, wide, square, one row, 3-D, odd numels (ZeRO-3 pads every W > 1)."""


def settings():
    from deepspeed.runtime.zero.muon.momentum import StepSettings
    return StepSettings(momentum=0.9, nesterov=True, ns_method="gram", ns_steps=5)


class FakeAllToAll:
    """``all_to_all_single`` for ``world_size`` simulated ranks (``for_rank(r)``: rank r's callable): the n-th
    collectives complete together once all ranks posted them. ``async_ops``: per rank, each collective's
    ``async_op``; ``errors``: splits that disagree, inputs written before their handle's ``wait`` (asserted empty)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.cond = threading.Condition()
        self.posted = {}  # collective number -> {rank: (output, input, output_splits, input_splits)}
        self.done = set()
        self.routed = {}  # collective number -> the accelerator event recorded after its copies
        self.count = [0] * world_size
        self.async_ops = [[] for _ in range(world_size)]
        self.errors = []

    def for_rank(self, rank: int):

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
        from deepspeed.accelerator import get_accelerator
        accelerator = get_accelerator()  # as NCCL's work: an event its waiters' streams wait on
        if accelerator.Event is not None and any(accelerator.on_accelerator(out) for out, *_ in ranks.values()):
            self.routed[n] = accelerator.Event()
            self.routed[n].record()
        self.done.add(n)


class _Handle:
    """Completes when collective ``n`` is routed; ``wait`` checks the input is unchanged since the collective was
    issued (a real all-to-all may read it until then)."""

    def __init__(self, fake, n, input, snapshot):
        self.fake, self.n, self.input, self.snapshot = fake, n, input, snapshot

    def wait(self):
        with self.fake.cond:
            if not self.fake.cond.wait_for(lambda: self.n in self.fake.done, timeout=TIMEOUT):
                raise TimeoutError(f"collective {self.n} never completed: the ranks issued different collectives")
        if self.n in self.fake.routed:  # the caller's current stream waits for the copies, as NCCL's Work.wait()
            from deepspeed.accelerator import get_accelerator
            get_accelerator().current_stream().wait_event(self.fake.routed[self.n])
        if not torch.equal(self.input, self.snapshot):
            self.fake.errors.append(f"collective {self.n}: its input was written before the collective was waited for")


def specs_of(shapes=SHAPES):
    """The owner plan's ``MatrixSpec`` of each shape, with upstream's Newton-Schulz problem."""
    from deepspeed.runtime.zero.muon.newton_schulz import newton_schulz_problem
    from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec
    return [MatrixSpec(s, ns_problem=newton_schulz_problem(s, False, None)) for s in shapes]


def zero3_layout(specs, world_size):
    """Per matrix its pieces, and per rank the ``(offset, numel)`` of each piece in its flat partition."""
    pieces = [(math.ceil(s.numel / world_size), ) * world_size for s in specs]
    offsets = [sum(p[0] for p in pieces[:j]) for j in range(len(pieces))]
    return pieces, [[(o, p[0]) for o, p in zip(offsets, pieces)]] * world_size


def zero12_layout(specs, world_size):
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


LAYOUTS = {"zero3": zero3_layout, "zero12": zero12_layout}


def scatter(whole, pieces, slices, rank, numel, device="cpu"):
    """Rank ``rank``'s flat fp32 tensor (``numel`` elements, on ``device``) holding its pieces of each whole matrix."""
    flat = torch.zeros(numel, device=device)
    for matrix, p, (offset, n) in zip(whole, pieces, slices[rank]):
        start = sum(p[:rank])
        real = max(0, min(n, matrix.numel() - start))
        flat[offset:offset + real] = matrix.reshape(-1)[start:start + real]
    return flat


class Run(NamedTuple):
    """What ``run_pipelines`` returns (unpacks in this order); per rank where it is a list of W."""
    specs: list
    pieces: list
    slices: list
    plan: object
    grads: List[List[torch.Tensor]]  # per step, per matrix: the whole gradient, on the Newton-Schulz device
    momenta: List[torch.Tensor]  # per rank: its flat momentum after the steps, on the pieces' device
    results: List[List[torch.Tensor]]  # per rank, per step: its flat update, on the pieces' device
    fake: FakeAllToAll
    stats: list
    pipelines: list
    buffers: list


def run_pipelines(layout,
                  world_size: int,
                  bucket_numel: int,
                  depth: int,
                  steps: int = 2,
                  specs=None,
                  update_dtype=torch.float32,
                  device="cpu",
                  pieces=None,
                  offload=False,
                  **options) -> Run:
    """``steps`` steps of random gradients through ``world_size`` threaded pipelines on ``device``.

    Args:
        layout: ``zero3_layout``, ``zero12_layout`` or alike. pieces: ``(pieces, slices)`` instead of ``layout``'s.
        bucket_numel, depth: the owner plan's bucket size and the pipeline depth. specs: default ``specs_of()``.
        device: where Newton-Schulz runs and the buffers live. options: ``MuonPipeline``'s ``batch_ns``, ``variant``.
        offload: the pieces (gradient, momentum) on the CPU, through pinned staging buffers as under optimizer
            offload (``ExchangeBuffers``' ``staging_device``; on the CPU the staging copies run too).

    Raises:
        AssertionError: a rank raised (its exception in the message) or the collectives disagreed.
    """
    from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers, ExchangeStats, OwnerExchange
    from deepspeed.runtime.zero.muon.owner_plan import plan_owners
    from deepspeed.runtime.zero.muon.pipeline import MuonPipeline
    specs = specs or specs_of()
    pieces, slices = pieces or layout(specs, world_size)
    holders = [[r for r, n in enumerate(p) if n] for p in pieces] if layout is zero12_layout else None
    plan = plan_owners(specs, world_size, bucket_numel, holders=holders)
    gen = torch.Generator().manual_seed(world_size * 100 + depth)
    grads = [[torch.randn(s.shape, generator=gen).to(device) for s in specs] for _ in range(steps)]
    numel = max(o + n for sl in slices for o, n in sl)
    piece_device = "cpu" if offload else device
    fake, stats = FakeAllToAll(world_size), [ExchangeStats() for _ in range(world_size)]
    momenta = [torch.zeros(numel, device=piece_device) for _ in range(world_size)]
    results = [[None] * steps for _ in range(world_size)]
    exchanges = [OwnerExchange(None, r, world_size, fake.for_rank(r), stats[r]) for r in range(world_size)]
    pipelines = [
        MuonPipeline(plan, specs, pieces, slices[r], x, device, piece_device, depth, **options)
        for r, x in enumerate(exchanges)
    ]
    buffers = [ExchangeBuffers(*p.buffer_demand[:3], device, piece_device if offload else None) for p in pipelines]
    errors = []

    def rank_main(r):
        try:
            for t in range(steps):
                results[r][t] = scatter(grads[t], pieces, slices, r, numel, piece_device)
                pipelines[r].run(results[r][t], momenta[r], settings(), update_dtype, buffers[r],
                                 options.get("variant"))
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r, )) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not errors and not fake.errors, (errors, fake.errors)
    return Run(specs, pieces, slices, plan, grads, momenta, results, fake, stats, pipelines, buffers)


def reference_updates(specs, grads):
    """Upstream ``muon_update`` per whole matrix, step after step, on the gradients' device: ``(updates, momenta)``,
    per step each matrix's update, and each matrix's final momentum."""
    from deepspeed.runtime.zero.muon import original_muon
    momenta = [torch.zeros_like(g) for g in grads[0]]
    return [[original_muon.muon_update(g.clone(), m, beta=settings().momentum) for g, m in zip(step, momenta)]
            for step in grads], momenta


def mismatches(run: Run, device="cpu"):
    """``(rank, step or "momentum", max absolute difference / the reference's largest element)`` wherever a rank's
    update or final momentum is not its pieces of ``reference_updates``; empty where all are upstream's bit for bit."""
    updates, reference_momenta = reference_updates(run.specs, run.grads)
    numel = run.momenta[0].numel()
    out = []
    for r in range(len(run.momenta)):
        expected = [(t, scatter(u, run.pieces, run.slices, r, numel, device), run.results[r][t].to(device))
                    for t, u in enumerate(updates)]
        expected.append(("momentum", scatter(reference_momenta, run.pieces, run.slices, r, numel,
                                             device), run.momenta[r].to(device)))
        out += [(r, t, float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))) for t, a, b in expected
                if not torch.equal(a, b)]
    return out


def device_check(device, world_sizes=range(2, 9), depths=(1, 2), bucket_numels=(1, 300, 10**9),
                 offloads=(False, True)):
    """The exchange's device code at every world size x layout x depth x bucket size x offload on ``device``, each run
    against upstream's update on the same device, Newton-Schulz unbatched (``batch_ns=False``: upstream's calls).
    Returns one dict per run: ``layout``, ``world_size``, ``depth``, ``bucket_numel``, ``offload``, ``ns_dtype``
    (``original_muon.ns_compute_dtype``), ``exchanges`` (all-to-alls, summed over ranks), ``bit_equal``,
    ``max_relative_difference`` (0 where bit-equal) and ``seconds``."""
    import time
    from deepspeed.runtime.zero.muon import original_muon
    rows = []
    ns_dtype = original_muon.ns_compute_dtype(settings().ns_method)  # the back exchange's, as ``MuonUpdate`` runs it
    options = dict(device=device, batch_ns=False, update_dtype=ns_dtype)
    runs = [(layout, w, depth, bucket, offload) for layout in LAYOUTS for w in world_sizes for depth in depths
            for bucket in bucket_numels for offload in offloads]
    for layout, world_size, depth, bucket_numel, offload in runs:
        start = time.perf_counter()
        run = run_pipelines(LAYOUTS[layout], world_size, bucket_numel, depth, offload=offload, **options)
        worst = mismatches(run, device)
        rows.append(
            dict(layout=layout,
                 world_size=world_size,
                 depth=depth,
                 bucket_numel=bucket_numel,
                 offload=offload,
                 ns_dtype=str(ns_dtype).replace("torch.", ""),
                 exchanges=sum(s.exchanges for s in run.stats),
                 bit_equal=not worst,
                 max_relative_difference=max((w for *_, w in worst), default=0.0),
                 seconds=time.perf_counter() - start))
    return rows
