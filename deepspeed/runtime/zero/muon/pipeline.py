# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The per-bucket pipeline of the distributed Muon update: prepare, compute, finalize.

For each bucket of the owner plan (``owner_plan``), on every rank:

- **prepare**: the momentum step (``momentum.momentum_step``) on this rank's piece of each of
  the bucket's matrices, writing the Newton-Schulz input straight into the bucket's send buffer;
  then the forward all-to-all to the owners starts. The gradient is not written.
- **compute**: once the forward exchange is complete, the owner reassembles its whole matrices,
  runs Newton-Schulz on them (``newton_schulz.orthogonalize_each``), writes the results into the
  back send buffer, and the back all-to-all starts.
- **finalize**: once the results are back, each rank copies its piece of every update into the
  gradient.

``depth`` buckets are prepared ahead of the one being computed, and the back exchange of up to
``depth - 1`` buckets is in flight meanwhile, so communication overlaps Newton-Schulz; depth 1 is
the serial order. With depth ``d`` the collectives on every rank are, for ``n`` buckets, the
forward exchanges of buckets ``0 .. d-1``, then for each bucket ``k`` its back exchange followed
by the forward exchange of bucket ``k + d``; every rank issues the same collectives in the same
order whatever it owns. A bucket holds one slot of ``ExchangeBuffers`` from prepare to finalize:
``2 d - 1`` slots are in use at most (``owner_plan.slots_for_depth``). The stage binding reserves
the buffers at construction (``buffer_demand``), one set for all its sub-groups, which run one
after the other.

Memory on the owner: compute reads each matrix from the receive buffer (in place where its pieces
lie back to back, else one copy at a time), and, where the results have the exchange's dtype,
writes each result into the back send buffer as soon as its Newton-Schulz call returns, over the
pieces that call has read. So beyond the reserved buffers a bucket costs one call's inputs,
working set and results, not the bucket's. A narrower result dtype (fp16/bf16 Newton-Schulz on
an accelerator) views the same bytes at other offsets, so those results are written once the
bucket's calls are done.

A Muon variant with owner state (``owner_state``, e.g. NorMuon) is applied in compute, to each
Newton-Schulz result with the whole matrix in hand, before it is written back; its state lives in
``MuonPipeline.owner_state`` on the owner. Plain Muon (``variant=None``) allocates and runs
nothing of it.

The schedule follows torchtitan's DistributedMuon (prepare/compute/finalize over a reserved
transfer layout) and microsoft/dion's overlap of one batch's exchange with another's compute.
"""

from collections import deque
from typing import Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.momentum import MuonSettings, momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import orthogonalize_each
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeBuffers, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, OwnerPlan, plan_for_depth, slots_for_depth
from deepspeed.runtime.zero.muon.owner_state import OwnerState

DEFAULT_DEPTH = 2
"""Buckets prepared ahead of the one being orthogonalized: one exchange in each direction overlaps NS."""

EXCHANGE_DTYPE = torch.float32
"""dtype of the forward exchange: the fp32 gradient and momentum give an fp32 Newton-Schulz input."""


class MuonPipeline:
    """The Muon update of one sub-group on one rank.

    Args:
        plan: the sub-group's owner plan.
        specs: per matrix (sub-group order) its ``MatrixSpec`` (shape, Newton-Schulz problem).
        pieces: per matrix, the elements every rank holds of it (rank order).
        slices: per matrix, ``(offset, numel)`` of this rank's piece in the sub-group's flat
            gradient and momentum (``numel`` 0 where it holds none).
        exchange: the ``OwnerExchange`` of the sub-group's process group.
        device: where Newton-Schulz runs and the exchange buffers live (the accelerator).
        piece_device: where the gradient and momentum pieces live (the host under optimizer
            offload).
        depth: see the module docstring; at least 1.
        batch_ns: passed to ``orthogonalize_each`` (None: batch same-shape problems where it pays).
        variant: a Muon variant with owner state (``owner_state``; e.g. ``normuon.NorMuon``), or None
            for plain Muon.
        state_flat: storage for the owner state (``OwnerState``'s ``flat``; None: allocated on
            ``device``).

    Attributes:
        owner_state: the variant's ``OwnerState`` of the matrices this rank owns (None for plain
            Muon).

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
                 state_flat=None):
        if depth < 1:
            raise ValueError(f"the Muon pipeline depth must be at least 1, got {depth}")
        self.plan = plan
        self.specs = list(specs)
        self.slices = list(slices)
        self.exchange = exchange
        self.piece_device = torch.device(piece_device)
        # One rank with its pieces where Newton-Schulz runs holds every matrix whole in place:
        # nothing to exchange, so no buffers and no copies.
        self.alone = exchange.world_size == 1 and self.piece_device == torch.device(device)
        self.depth = depth
        self.batch_ns = batch_ns
        self.layouts = [
            BucketLayout(matrices=bucket,
                         owners=tuple(plan.owners[j] for j in bucket),
                         numels=tuple(specs[j].numel for j in bucket),
                         pieces=tuple(tuple(pieces[j]) for j in bucket),
                         rank=exchange.rank) for bucket in plan.buckets
        ]
        self.owner_state = None
        self._variant = None
        if variant is not None:
            owned = [j for j, owner in enumerate(plan.owners) if owner == exchange.rank]
            self.owner_state = OwnerState(variant, self.specs, owned, device=device, flat=state_flat)

    @classmethod
    def for_process_group(cls,
                          specs: Sequence[MatrixSpec],
                          pieces: Sequence[Sequence[int]],
                          slices: Sequence[Tuple[int, int]],
                          group,
                          stats: ExchangeStats,
                          device,
                          piece_device,
                          max_bucket_numel: int,
                          depth: int,
                          batch_ns=None,
                          variant=None,
                          **plan_args) -> "MuonPipeline":
        """The pipeline of one sub-group on this rank of ``group``, with its owner plan.

        The plan is ``owner_plan.plan_for_depth`` (buckets up to ``max_bucket_numel``, the
        stage's ``reduce_bucket_size``, within the momentum budget; the depth lowered where
        even one matrix per bucket does not fit). The collectives are ``deepspeed.comm.all_to_all_single``
        on ``group``, counted into ``stats``.

        Args:
            specs, pieces, slices, device, piece_device, depth, batch_ns, variant: as for the
                constructor (the plan's budget counts the variant's owner state).
            group: the sub-group's process group.
            stats: the binding's ``ExchangeStats``.
            max_bucket_numel: the largest bucket (elements of whole matrices).
            plan_args: ``initial_load`` or ``holders``, and ``result_itemsize`` (bytes per
                element of the Newton-Schulz results, ``ns_compute_dtype(ns_method)``), of
                ``plan_for_depth``.
        """
        from deepspeed import comm as dist
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        if variant is not None:
            plan_args["state_numels"] = [variant.state_numel(spec) for spec in specs]
        plan, depth = plan_for_depth(specs, pieces, world_size, max_bucket_numel, depth, **plan_args)
        exchange = OwnerExchange(group, rank, world_size, dist.all_to_all_single, stats)
        return cls(plan, specs, pieces, slices, exchange, device, piece_device, depth, batch_ns, variant)

    @property
    def buffer_demand(self) -> Tuple[int, int, int, torch.device]:
        """``(slots, outgoing_numel, incoming_numel, piece_device)`` for ``ExchangeBuffers.covering``:
        the slots this pipeline uses at its depth and its largest bucket's buffers (fp32 elements);
        none for a rank alone (``alone``)."""
        if self.alone:
            return (0, 0, 0, self.piece_device)
        return (min(slots_for_depth(self.depth),
                    max(1, len(self.layouts))), max((layout.send_numel for layout in self.layouts), default=0),
                max((layout.recv_numel for layout in self.layouts), default=0), self.piece_device)

    def run(self,
            grad_flat: torch.Tensor,
            momentum_flat: torch.Tensor,
            settings: MuonSettings,
            update_dtype: torch.dtype,
            buffers: ExchangeBuffers,
            variant=None) -> None:
        """Replace this rank's pieces of the gradient with its pieces of the Muon update.

        Call on every rank of the process group, once per optimizer step.

        Args:
            grad_flat: the sub-group's flat gradient (1-D, fp32), unscaled and clipped; each
                piece is overwritten with the update once that bucket's results are back.
            momentum_flat: the momentum, same layout (fp32); advanced in place.
            settings: the parameter group's ``MuonSettings``.
            update_dtype: dtype of the back exchange (the kernel's compute dtype: no loss).
            buffers: at least ``buffer_demand``; nothing else may use them during the call.
            variant: the step's variant settings (the parameter group's), of the kind the
                pipeline was built with; None for plain Muon.

        Raises:
            RuntimeError: ``variant`` of another kind than the one the pipeline was built with.
        """
        if (variant is None) != (self.owner_state is None):
            raise RuntimeError(f"MuonPipeline built {'with' if self.owner_state is not None else 'without'} "
                               f"owner state, run with variant {variant!r}.")
        self._variant = variant
        if self.alone:
            self._run_alone(grad_flat, momentum_flat, settings, update_dtype)
            return
        free = deque(range(self.buffer_demand[0]))
        preparing, returning = deque(), deque()

        def compute_oldest():
            returning.append(self._compute(*preparing.popleft(), settings, update_dtype, buffers))
            if len(returning) == self.depth:
                free.append(self._finalize(*returning.popleft(), grad_flat, update_dtype, buffers))

        for b in range(len(self.layouts)):
            preparing.append(self._prepare(b, free.popleft(), grad_flat, momentum_flat, settings, buffers))
            if len(preparing) == self.depth:
                compute_oldest()
        while preparing:
            compute_oldest()
        while returning:
            self._finalize(*returning.popleft(), grad_flat, update_dtype, buffers)

    def _run_alone(self, grad_flat, momentum_flat, settings: MuonSettings, update_dtype: torch.dtype) -> None:
        """World size 1, pieces on the Newton-Schulz device: every piece is its whole matrix. The
        momentum step writes the NS input over the gradient, and each call's results overwrite
        the inputs it has read (in a batched call, a stacked copy)."""
        for layout in self.layouts:
            specs = [self.specs[layout.matrices[k]] for k in layout.owned]
            starts = []
            for k in layout.owned:
                start, numel = self.slices[layout.matrices[k]]
                piece = grad_flat.narrow(0, start, numel)
                momentum_step(piece, momentum_flat.narrow(0, start, numel), settings, out=piece)
                starts.append(start)

            def matrix(p):
                return grad_flat.narrow(0, starts[p], specs[p].numel).view(specs[p].shape)

            for positions, results in orthogonalize_each(matrix, specs, settings.ns_steps, settings.ns_method,
                                                         update_dtype, grad_flat.device, self.batch_ns,
                                                         self.plan.workspace(0)):
                self.exchange.stats.ns_calls += len(results)
                for position, result in zip(positions, results):
                    if self._variant is not None:
                        result = self.owner_state.apply(layout.matrices[layout.owned[position]], result, self._variant)
                    matrix(position).copy_(result)

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

    def _compute(self, b: int, slot: int, handle, settings: MuonSettings, update_dtype: torch.dtype,
                 buffers: ExchangeBuffers):
        layout = self.layouts[b]
        _wait(handle)
        specs = [self.specs[layout.matrices[k]] for k in layout.owned]
        recv = buffers.incoming(slot, layout.recv_numel, EXCHANGE_DTYPE)
        back = buffers.incoming(slot, layout.recv_numel, update_dtype)
        in_place = update_dtype.itemsize == EXCHANGE_DTYPE.itemsize
        held = []
        calls = orthogonalize_each(lambda p: layout.owned_matrix(recv, p, specs[p].shape), specs, settings.ns_steps,
                                   settings.ns_method, update_dtype, recv.device, self.batch_ns,
                                   self.plan.workspace(self.exchange.rank))
        for positions, results in calls:
            self.exchange.stats.ns_calls += len(results)
            for position, result in zip(positions, results):
                if self._variant is not None:
                    result = self.owner_state.apply(layout.matrices[layout.owned[position]], result, self._variant)
                if in_place:
                    layout.write_result(position, result, back)
                else:
                    held.append((position, result))
            del results
        for position, result in held:
            layout.write_result(position, result, back)
        del held
        returned = buffers.outgoing(slot, layout.send_numel, update_dtype)
        handle = self.exchange.all_to_all(returned, back, layout.send_splits, layout.recv_splits, async_op=True)
        return b, slot, handle

    def _finalize(self, b: int, slot: int, handle, grad_flat: torch.Tensor, update_dtype: torch.dtype,
                  buffers: ExchangeBuffers) -> int:
        layout = self.layouts[b]
        _wait(handle)
        update = buffers.outgoing(slot, layout.send_numel, update_dtype)
        for k, offset, numel in layout.send_pieces:
            start, _ = self.slices[layout.matrices[k]]
            grad_flat.narrow(0, start, numel).copy_(update.narrow(0, offset, numel))
        return slot


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()
