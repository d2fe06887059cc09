# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The per-bucket pipeline of the distributed Muon update: prepare, compute, finalize.

For each bucket of the owner plan (``owner_plan``), on every rank:

- **prepare**: the momentum step (``momentum.momentum_step``) on this rank's piece of each of
  the bucket's matrices, writing the Newton-Schulz input straight into the bucket's send buffer;
  then the forward all-to-all to the owners starts. The gradient is not written.
- **compute**: once the forward exchange is complete, the owner reassembles its whole matrices,
  runs Newton-Schulz on them (``newton_schulz.orthogonalize``), writes the results into the
  back send buffer, and the back all-to-all starts.
- **finalize**: once the results are back, each rank copies its piece of every update into the
  gradient.

``depth`` buckets are prepared ahead of the one being computed, and the back exchange of up to
``depth - 1`` buckets is in flight meanwhile, so communication overlaps Newton-Schulz; depth 1 is
the serial order. With depth ``d`` the collectives on every rank are, for ``n`` buckets, the
forward exchanges of buckets ``0 .. d-1``, then for each bucket ``k`` its back exchange followed
by the forward exchange of bucket ``k + d``; every rank issues the same collectives in the same
order whatever it owns. A bucket holds one slot of ``ExchangeBuffers`` from prepare to finalize:
``2 d - 1`` slots are in use at most (``owner_plan.slots_for_depth``), reserved at construction.

The schedule follows torchtitan's DistributedMuon (prepare/compute/finalize over a reserved
transfer layout) and microsoft/dion's overlap of one batch's exchange with another's compute.
"""

from collections import deque
from typing import Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.momentum import MuonSettings, momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import orthogonalize
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeBuffers, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, OwnerPlan, slots_for_depth

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
        device: where the exchange buffers live (the accelerator).
        piece_device: where the gradient and momentum pieces live (the host under optimizer
            offload).
        depth: see the module docstring; at least 1.
        batch_ns: passed to ``orthogonalize`` (None: batch same-shape problems where it pays).

    Raises:
        ValueError: ``depth`` below 1.
        torch.OutOfMemoryError: the exchange buffers do not fit (at construction).
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
                 batch_ns=None):
        if depth < 1:
            raise ValueError(f"the Muon pipeline depth must be at least 1, got {depth}")
        self.plan = plan
        self.specs = list(specs)
        self.slices = list(slices)
        self.exchange = exchange
        self.depth = depth
        self.batch_ns = batch_ns
        self.layouts = [
            BucketLayout(matrices=bucket,
                         owners=tuple(plan.owners[j] for j in bucket),
                         numels=tuple(specs[j].numel for j in bucket),
                         pieces=tuple(tuple(pieces[j]) for j in bucket),
                         rank=exchange.rank) for bucket in plan.buckets
        ]
        slots = min(slots_for_depth(depth), max(1, len(self.layouts)))
        self.buffers = ExchangeBuffers(slots, max((l.send_numel for l in self.layouts), default=0),
                                       max((l.recv_numel for l in self.layouts), default=0), device, piece_device)

    def reserved_bytes(self) -> int:
        """Bytes of exchange buffer this rank keeps for the sub-group (on the device)."""
        return self.buffers.reserved_bytes()

    def run(self, grad_flat: torch.Tensor, momentum_flat: torch.Tensor, settings: MuonSettings,
            update_dtype: torch.dtype) -> None:
        """Replace this rank's pieces of the gradient with its pieces of the Muon update.

        Call on every rank of the process group, once per optimizer step.

        Args:
            grad_flat: the sub-group's flat gradient (1-D, fp32), unscaled and clipped; each
                piece is overwritten with the update once that bucket's results are back.
            momentum_flat: the momentum, same layout (fp32); advanced in place.
            settings: the parameter group's ``MuonSettings``.
            update_dtype: dtype of the back exchange (the kernel's compute dtype: no loss).
        """
        free = deque(range(self.buffers.slots))
        preparing, returning = deque(), deque()

        def compute_oldest():
            returning.append(self._compute(*preparing.popleft(), settings, update_dtype))
            if len(returning) == self.depth:
                free.append(self._finalize(*returning.popleft(), grad_flat, update_dtype))

        for b in range(len(self.layouts)):
            preparing.append(self._prepare(b, free.popleft(), grad_flat, momentum_flat, settings))
            if len(preparing) == self.depth:
                compute_oldest()
        while preparing:
            compute_oldest()
        while returning:
            self._finalize(*returning.popleft(), grad_flat, update_dtype)

    def _prepare(self, b: int, slot: int, grad_flat, momentum_flat, settings):
        layout, buffers = self.layouts[b], self.buffers
        send = buffers.outgoing(slot, layout.send_numel, EXCHANGE_DTYPE)
        staging = buffers.staging(slot, layout.send_numel)
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

    def _compute(self, b: int, slot: int, handle, settings: MuonSettings, update_dtype: torch.dtype):
        layout, buffers = self.layouts[b], self.buffers
        _wait(handle)
        specs = [self.specs[j] for j in layout.matrices]
        owned = layout.owned_matrices(buffers.incoming(slot, layout.recv_numel, EXCHANGE_DTYPE),
                                      [spec.shape for spec in specs])
        updates = orthogonalize(owned, [specs[k] for k in layout.owned], settings.ns_steps, settings.ns_method,
                                update_dtype, self.batch_ns)
        self.exchange.stats.ns_calls += len(updates)
        del owned
        back = layout.write_results(updates, buffers.incoming(slot, layout.recv_numel, update_dtype))
        del updates
        recv = buffers.outgoing(slot, layout.send_numel, update_dtype)
        handle = self.exchange.all_to_all(recv, back, layout.send_splits, layout.recv_splits, async_op=True)
        return b, slot, handle

    def _finalize(self, b: int, slot: int, handle, grad_flat: torch.Tensor, update_dtype: torch.dtype) -> int:
        layout = self.layouts[b]
        _wait(handle)
        update = self.buffers.outgoing(slot, layout.send_numel, update_dtype)
        for k, offset, numel in layout.send_pieces:
            start, _ = self.slices[layout.matrices[k]]
            grad_flat.narrow(0, start, numel).copy_(update.narrow(0, offset, numel))
        return slot


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()
