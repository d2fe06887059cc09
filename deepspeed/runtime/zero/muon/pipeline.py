# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The per-bucket pipeline of the distributed Muon update: prepare, compute, finalize.

Per bucket of the owner plan, on every rank: **prepare** runs the momentum step on this rank's pieces straight into the
send buffer and starts the forward all-to-all; **compute** rebuilds the owner's whole matrices, runs Newton-Schulz and
a variant's rule (``owner_state``) on each, and starts the back all-to-all; **finalize** copies this rank's pieces of
the update into the gradient. ``depth`` buckets are prepared ahead of the one being computed, so communication overlaps
Newton-Schulz (depth 1: serial); every rank issues the same collectives in the same order, with at most ``2 depth - 1``
buffer slots busy. Beyond the exchange buffers an owner holds one call's tensors: each call's results overwrite the
pieces it read (half-precision results wait for the bucket's calls). A matrix that ``stays_home`` skips the exchange
(docs/design.md, "Where a matrix lives"). After torchtitan's DistributedMuon (prepare/compute/finalize over a reserved
layout) and microsoft/dion (one batch's exchange overlapping another's compute).
"""

from collections import deque
from typing import Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.momentum import StepSettings, momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import orthogonalize_each
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeBuffers, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, OwnerPlan, slots_for_depth
from deepspeed.runtime.zero.muon.owner_state import OwnerState

DEFAULT_DEPTH = 2
"""Buckets prepared ahead of the one being orthogonalized: one exchange in each direction overlaps NS."""

EXCHANGE_DTYPE = torch.float32
"""dtype of the forward exchange: the fp32 gradient and momentum give an fp32 Newton-Schulz input."""


class MuonPipeline:
    """The Muon update of one partition on one rank.

    Args:
        plan, specs: the owner plan and each matrix's ``MatrixSpec``. pieces, slices: as ``binding.MuonPartition``'s.
        exchange: the group's ``OwnerExchange``. device: where Newton-Schulz runs and the buffers are; piece_device:
            where the pieces are. depth: at least 1. batch_ns: for ``orthogonalize_each``. variant: a Muon variant or
            None.
        placements, assemblies: per matrix, None or its tensor-parallel layout (where each holder's piece lies in the
            shards' storage) and the ``tensor_parallel.ShardAssembly`` that makes the whole matrix of it.
        result_itemsize, state_numels: the ``owner_plan.rank_numels`` terms ``plan`` was made with, for its figures:
            bytes per element of the NS result; per matrix the variant's owner-state elements (None: plain Muon).

    Attributes:
        layouts: per bucket with a matrix that travels, the ``BucketLayout`` of those matrices.
        in_place: per bucket with a matrix that stays home and this rank owns, the ``BucketLayout`` of those
            matrices (ZeRO-1/2, W=1).
        owner_state: the variant's ``OwnerState`` of the matrices this rank owns, or None.

    Raises:
        ValueError: ``depth`` below 1.
    """

    def __init__(self,
                 plan: OwnerPlan,
                 specs: Sequence[MatrixSpec],
                 pieces: Sequence[Sequence[int]],
                 slices: Sequence[Tuple[int, int]],
                 exchange: OwnerExchange,
                 device,
                 piece_device,
                 depth: int = DEFAULT_DEPTH,
                 batch_ns=None,
                 variant=None,
                 placements=None,
                 assemblies=None,
                 result_itemsize: int = 4,
                 state_numels: Optional[Sequence[int]] = None):
        if depth < 1:
            raise ValueError(f"the Muon pipeline depth must be at least 1, got {depth}")
        self.plan = plan
        self.specs = list(specs)
        self.pieces = [tuple(p) for p in pieces]
        self.slices = list(slices)
        self.exchange = exchange
        self.piece_device = torch.device(piece_device)
        self.depth = depth
        self.batch_ns = batch_ns
        self.assemblies = list(assemblies or [None] * len(self.specs))
        home = [stays_home(p, self.piece_device, device, a) for p, a in zip(pieces, self.assemblies)]

        def layout(bucket, at_home: bool) -> Optional[BucketLayout]:
            """The bucket's matrices that travel, or (``at_home``) stay home with this rank as owner; None if none."""
            b = [j for j in bucket if home[j] == at_home and (not at_home or plan.owners[j] == exchange.rank)]
            if not b:
                return None
            return BucketLayout(matrices=tuple(b),
                                owners=tuple(plan.owners[j] for j in b),
                                numels=tuple(specs[j].numel for j in b),
                                pieces=tuple(tuple(pieces[j]) for j in b),
                                rank=exchange.rank,
                                placements=tuple(placements[j] for j in b) if placements else ())

        self.layouts = [lay for lay in (layout(b, False) for b in plan.buckets) if lay is not None]
        self.in_place = [lay for lay in (layout(b, True) for b in plan.buckets) if lay is not None]
        self.owner_state = None
        self._variant = None
        self.result_itemsize, self.state_numels = result_itemsize, state_numels
        if variant is not None:
            owned = [j for j, owner in enumerate(plan.owners) if owner == exchange.rank]
            self.owner_state = OwnerState(variant, self.specs, owned, device=device)

    @property
    def buffer_demand(self) -> Tuple[int, int, int, torch.device]:
        """``(slots, outgoing_numel, incoming_numel, piece_device)`` for ``ExchangeBuffers.covering`` (fp32 elements
        of the largest bucket that travels; none where nothing does)."""
        if not self.layouts:
            return (0, 0, 0, self.piece_device)
        return (min(slots_for_depth(self.depth), len(self.layouts)), max(layout.send_numel for layout in self.layouts),
                max(layout.recv_numel for layout in self.layouts), self.piece_device)

    def run(self,
            grad_flat: torch.Tensor,
            momentum_flat: torch.Tensor,
            settings: StepSettings,
            update_dtype: torch.dtype,
            buffers: ExchangeBuffers,
            variant=None) -> None:
        """Replace this rank's pieces of ``grad_flat`` (the flat fp32 gradient partition, unscaled, clipped) with its
        pieces of the Muon update, advancing ``momentum_flat`` (same layout) in place; once per step on every rank of
        the group. ``update_dtype``: the back exchange's (the kernel's compute dtype); ``buffers``: at least
        ``buffer_demand``; ``variant``: None (plain Muon) or the group's settings, as built (else ``RuntimeError``)."""
        if (variant is None) != (self.owner_state is None):
            raise RuntimeError(f"MuonPipeline built {'with' if self.owner_state is not None else 'without'} "
                               f"owner state, run with variant {variant!r}.")
        self._variant = variant
        free = deque(range(self.buffer_demand[0]))
        preparing, returning = deque(), deque()

        def compute_oldest():
            returning.append(self._compute(*preparing.popleft(), settings, update_dtype, buffers))
            if len(returning) == self.depth:
                free.append(self._finalize(*returning.popleft(), grad_flat, update_dtype, buffers))

        for b in range(len(self.layouts)):
            preparing.append(self._prepare(b, free.popleft(), grad_flat, momentum_flat, settings, buffers))
            if b == 0:  # while the first exchange is on its way
                self._run_home(grad_flat, momentum_flat, settings, update_dtype)
            if len(preparing) == self.depth:
                compute_oldest()
        if not self.layouts:
            self._run_home(grad_flat, momentum_flat, settings, update_dtype)
        while preparing:
            compute_oldest()
        while returning:
            self._finalize(*returning.popleft(), grad_flat, update_dtype, buffers)

    def _run_home(self, grad_flat, momentum_flat, settings: StepSettings, update_dtype: torch.dtype) -> None:
        """The matrices that stay home with this rank: NS input and results are written over the gradient in place."""
        for layout in self.in_place:
            slices = [self.slices[layout.matrices[k]] for k in layout.owned]
            specs = [self.specs[layout.matrices[k]] for k in layout.owned]
            for start, numel in slices:
                piece = grad_flat.narrow(0, start, numel)
                momentum_step(piece, momentum_flat.narrow(0, start, numel), settings, out=piece)

            def matrix(p):
                return grad_flat.narrow(0, slices[p][0], specs[p].numel).view(specs[p].shape)

            def write(p, result):
                matrix(p).copy_(result)

            self._orthogonalize(layout, matrix, write, settings, update_dtype, grad_flat.device, in_place=True)

    def _orthogonalize(self, layout: BucketLayout, load, write, settings: StepSettings, update_dtype: torch.dtype,
                       device, in_place: bool) -> None:
        """NS and the variant's rule on each matrix this rank owns in a bucket, then ``write(position,
        result)``: as each call returns where ``in_place``, else after the bucket's calls."""
        specs = [self.specs[layout.matrices[k]] for k in layout.owned]
        held = []
        calls = orthogonalize_each(load, specs, settings.ns_steps, settings.ns_method, update_dtype, device,
                                   self.batch_ns, self.plan.workspace(self.exchange.rank))
        for positions, results in calls:
            self.exchange.stats.ns_calls += len(results)
            for position, result in zip(positions, results):
                if self._variant is not None:
                    result = self.owner_state.apply(layout.matrices[layout.owned[position]], result, self._variant)
                if in_place:
                    write(position, result)
                else:
                    held.append((position, result))
            del results
        for position, result in held:
            write(position, result)

    def _prepare(self, b: int, slot: int, grad_flat, momentum_flat, settings, buffers: ExchangeBuffers):
        layout = self.layouts[b]
        send = buffers.outgoing(slot, layout.send_numel, EXCHANGE_DTYPE)
        staging = buffers.staging(slot, layout.send_numel, self.piece_device)
        target = send if staging is None else staging
        for k, offset, numel in layout.send_pieces:
            start, _ = self.slices[layout.matrices[k]]
            momentum_step(grad_flat.narrow(0, start, numel), momentum_flat.narrow(0, start, numel), settings,
                          target.narrow(0, offset, numel))
        if staging is not None:
            send.copy_(staging, non_blocking=True)
        recv = buffers.incoming(slot, layout.recv_numel, EXCHANGE_DTYPE)
        handle = self.exchange.all_to_all(recv, send, layout.recv_splits, layout.send_splits, async_op=True)
        return b, slot, handle

    def _compute(self, b: int, slot: int, handle, settings: StepSettings, update_dtype: torch.dtype,
                 buffers: ExchangeBuffers):
        layout = self.layouts[b]
        if handle is not None:
            handle.wait()
        recv = buffers.incoming(slot, layout.recv_numel, EXCHANGE_DTYPE)
        back = buffers.incoming(slot, layout.recv_numel, update_dtype)
        shapes = [self.specs[layout.matrices[k]].shape for k in layout.owned]
        assemblies = [self.assemblies[layout.matrices[k]] for k in layout.owned]

        def load(p):
            matrix = layout.owned_matrix(recv, p, shapes[p])
            return matrix if assemblies[p] is None else assemblies[p].to_matrix(matrix)

        def write(p, result):
            layout.write_result(p, result if assemblies[p] is None else assemblies[p].to_storage(result), back)

        in_place = update_dtype.itemsize == EXCHANGE_DTYPE.itemsize
        self._orthogonalize(layout, load, write, settings, update_dtype, recv.device, in_place=in_place)
        returned = buffers.outgoing(slot, layout.send_numel, update_dtype)
        handle = self.exchange.all_to_all(returned, back, layout.send_splits, layout.recv_splits, async_op=True)
        return b, slot, handle

    def _finalize(self, b: int, slot: int, handle, grad_flat: torch.Tensor, update_dtype: torch.dtype,
                  buffers: ExchangeBuffers) -> int:
        layout = self.layouts[b]
        update = buffers.outgoing(slot, layout.send_numel, update_dtype)
        host = buffers.staging(slot, layout.send_numel, self.piece_device, update_dtype)
        if host is not None:  # pieces on the host (optimizer offload): the bucket in one copy, not one per piece
            update = buffers.to_host(update, host, handle)
        elif handle is not None:
            handle.wait()
        for k, offset, numel in layout.send_pieces:
            start, _ = self.slices[layout.matrices[k]]
            grad_flat.narrow(0, start, numel).copy_(update.narrow(0, offset, numel))
        return slot


def stays_home(pieces: Sequence[int], piece_device, device, assembly=None) -> bool:
    """Whether a matrix of ``pieces`` (elements per rank) stays home: one holder, its piece on the NS ``device``, no
    tensor-parallel ``assembly``; its holder then owns it and orthogonalizes it where it lies (no exchange buffer)."""
    return sum(map(bool, pieces)) == 1 and torch.device(piece_device) == torch.device(device) and assembly is None
