# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The two all-to-alls of one bucket: Newton-Schulz-input pieces to their owner, results back.

``BucketLayout`` is tensor bookkeeping for one rank (where each piece goes in the send buffer,
how the owner reassembles whole matrices, how it splits the results) and can be tested in one
process. ``OwnerExchange`` issues the collectives on a process group with
``deepspeed.comm.all_to_all_single`` and counts what crossed ranks. ``ExchangeBuffers`` holds the
buffers, reserved once from the plan.

Layout. Let the bucket's matrices be ``j`` with owner ``o(j)``, ``numel(j)`` elements and
``pieces(j)[s]`` elements held by rank ``s`` (rank order; their sum may exceed ``numel(j)`` by
ZeRO-3's zero padding at the end). Order the matrices by ``(o(j), position in bucket)``.

- Forward, on every rank ``r``: the send buffer holds this rank's piece of every matrix in that
  order, so the chunk for destination ``d`` is the pieces of the matrices ``d`` owns.
- On owner ``r``: the receive buffer is one chunk per source rank ``s``, holding ``s``'s pieces of
  the matrices ``r`` owns, in order. Matrix ``j`` is the concatenation over ``s`` of its piece in
  chunk ``s``, cut to ``numel(j)``.
- Back: the owner writes each result, split into the same pieces (padding zero), into the same
  layout, and chunk ``s`` goes to rank ``s``. Every rank then receives exactly its forward send
  layout, so unpacking is packing in reverse.

Under ZeRO-3 with a balanced plan the elements received per rank (own pieces excluded) average
``2 P (W - 1) / W^2`` over the ranks for ``P`` Muon elements, the owner-centric lower bound.
"""

from dataclasses import dataclass, field
from typing import Sequence, Tuple

import torch


@dataclass
class ExchangeStats:
    """Cumulative counters of one rank's Muon work at the accumulation boundary.

    Attributes:
        optimizer_steps: accumulation boundaries at which the Muon update ran.
        ns_calls: matrices this rank orthogonalized (as owner).
        elements_sent / elements_received: Muon elements that crossed ranks in the two
            all-to-alls (a rank's own pieces are not counted).
        bytes_sent / bytes_received: the same in bytes.
        exchanges: all-to-all collectives issued (none with one rank).
    """
    optimizer_steps: int = 0
    ns_calls: int = 0
    elements_sent: int = 0
    elements_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0


@dataclass(frozen=True)
class BucketLayout:
    """One rank's view of one bucket's exchange.

    Args:
        matrices: indices of the bucket's matrices in sub-group order.
        owners: owner rank of each of them (bucket order).
        numels: elements of each whole matrix.
        pieces: per matrix, the elements every rank holds of it (length ``world_size``).
        rank: this rank within the process group.

    Attributes:
        send_order: bucket positions ordered by (owner, position): the send buffer's order.
        send_splits / recv_splits: elements sent to / received from each rank, forward.
        owned: bucket positions of the matrices this rank owns, in send order.
        send_pieces: ``(k, offset, numel)`` for every matrix this rank holds a piece of: where
            its piece sits in the send buffer (``k``: position in the bucket).
        owned_spans: per owned matrix (order of ``owned``), ``(start, numel)`` in the forward
            receive buffer of each of its nonzero pieces, in rank order.

    Raises:
        ValueError: entries of different lengths, or pieces that cannot hold their matrix.
    """
    matrices: Tuple[int, ...]
    owners: Tuple[int, ...]
    numels: Tuple[int, ...]
    pieces: Tuple[Tuple[int, ...], ...]
    rank: int
    send_order: Tuple[int, ...] = field(init=False)
    send_splits: Tuple[int, ...] = field(init=False)
    owned: Tuple[int, ...] = field(init=False)
    recv_splits: Tuple[int, ...] = field(init=False)
    send_pieces: Tuple[Tuple[int, int, int], ...] = field(init=False)
    owned_spans: Tuple[Tuple[Tuple[int, int], ...], ...] = field(init=False)

    def __post_init__(self):
        if not len(self.matrices) == len(self.owners) == len(self.numels) == len(self.pieces):
            raise ValueError("matrices, owners, numels and pieces need one entry per matrix")
        for numel, pieces in zip(self.numels, self.pieces):
            if sum(pieces) < numel:
                raise ValueError(f"pieces {tuple(pieces)} cannot hold a matrix of {numel} elements")
        world_size = len(self.pieces[0]) if self.pieces else 1
        order = tuple(sorted(range(len(self.owners)), key=lambda k: (self.owners[k], k)))
        send_splits, recv_splits = [0] * world_size, [0] * world_size
        for k in order:
            send_splits[self.owners[k]] += self.pieces[k][self.rank]
            if self.owners[k] == self.rank:
                for s in range(world_size):
                    recv_splits[s] += self.pieces[k][s]
        set_ = object.__setattr__
        set_(self, "send_order", order)
        set_(self, "send_splits", tuple(send_splits))
        set_(self, "owned", tuple(k for k in order if self.owners[k] == self.rank))
        set_(self, "recv_splits", tuple(recv_splits))
        pieces, offset = [], 0
        for k in order:
            n = self.pieces[k][self.rank]
            if n:
                pieces.append((k, offset, n))
            offset += n
        set_(self, "send_pieces", tuple(pieces))
        chunk_starts = [sum(recv_splits[:s]) for s in range(world_size)]
        filled, spans = [0] * world_size, []
        for k in self.owned:
            spans.append(tuple((chunk_starts[s] + filled[s], n) for s, n in enumerate(self.pieces[k]) if n))
            filled = [f + n for f, n in zip(filled, self.pieces[k])]
        set_(self, "owned_spans", tuple(spans))

    @property
    def send_numel(self) -> int:
        """Elements this rank sends forward (and receives back), its own chunk included."""
        return sum(self.send_splits)

    @property
    def recv_numel(self) -> int:
        """Elements this rank receives forward as owner (and sends back)."""
        return sum(self.recv_splits)

    def owned_matrix(self, recv: torch.Tensor, position: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """One matrix this rank owns, reassembled from the forward receive buffer.

        Args:
            recv: 1-D, ``recv_numel`` elements (chunk ``s`` from rank ``s``).
            position: index of the matrix in ``owned``.
            shape: its full shape.

        Returns:
            a contiguous tensor of ``shape``, padding dropped: a view of ``recv`` where its pieces lie
            back to back there (the only matrix this rank owns in the bucket, or one rank
            contributes), else a copy.
        """
        spans = self.owned_spans[position]
        if all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])):
            flat = recv.narrow(0, spans[0][0], sum(n for _, n in spans))
        else:
            flat = torch.cat([recv.narrow(0, a, n) for a, n in spans])
        return flat[:self.numels[self.owned[position]]].view(shape)

    def write_result(self, position: int, result: torch.Tensor, out: torch.Tensor) -> None:
        """Split the result of owned matrix ``position`` into per-rank pieces, in the layout
        ``owned_matrix`` reads, zeroing each piece's padding.

        Args:
            position: index of the matrix in ``owned``.
            result: the matrix's update (its numel, any shape); cast on copy.
            out: 1-D, ``recv_numel`` elements, the back send buffer.
        """
        flat, start, numel = result.reshape(-1), 0, self.numels[self.owned[position]]
        for a, n in self.owned_spans[position]:
            dest = out.narrow(0, a, n)
            real = max(0, min(n, numel - start))
            if real:
                dest.narrow(0, 0, real).copy_(flat.narrow(0, start, real))
            if real < n:
                dest.narrow(0, real, n - real).zero_()
            start += n


class OwnerExchange:
    """Issues the forward and back all-to-all of buckets on one process group.

    Args:
        group: the process group (``None`` for the world).
        rank, world_size: this rank in ``group`` and its size.
        all_to_all_single: ``deepspeed.comm.all_to_all_single`` or a compatible callable
            ``(output, input, output_split_sizes, input_split_sizes, group, async_op)``.
        stats: counters to add to.
    """

    def __init__(self, group, rank: int, world_size: int, all_to_all_single, stats: ExchangeStats):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._all_to_all_single = all_to_all_single
        self.stats = stats

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                   input_splits: Sequence[int], async_op: bool):
        """One all-to-all; returns its handle, or ``None`` when it is complete (one rank: a copy)."""
        itemsize = input.element_size()
        sent = sum(input_splits) - input_splits[self.rank]
        received = sum(output_splits) - output_splits[self.rank]
        self.stats.elements_sent += sent
        self.stats.elements_received += received
        self.stats.bytes_sent += sent * itemsize
        self.stats.bytes_received += received * itemsize
        if self.world_size == 1:
            output.copy_(input)
            return None
        self.stats.exchanges += 1
        return self._all_to_all_single(output,
                                       input,
                                       output_split_sizes=list(output_splits),
                                       input_split_sizes=list(input_splits),
                                       group=self.group,
                                       async_op=async_op)


class ExchangeBuffers:
    """The exchange buffers of a stage's Muon pipelines, reserved once and reused at every step.

    Each slot holds one bucket in flight: an outgoing buffer (this rank's pieces: forward send,
    back receive) and an incoming one (the owner's whole matrices: forward receive, back send).
    Each is raw bytes viewed as the dtype a step asks for. The pipelines of a stage's sub-groups
    run one after the other inside ``step()``, so they share one set, sized to the largest
    demand (``pipeline.MuonPipeline.buffer_demand``).

    Args:
        slots: buckets in flight at once.
        outgoing_numel, incoming_numel: elements of the largest bucket's buffers (fp32).
        device: where the buffers live (the accelerator).
        staging_device: where the pieces live, when that is another device (optimizer offload):
            the momentum step writes there first, into a pinned staging buffer per slot.

    Raises:
        torch.OutOfMemoryError: at construction, not at the first step.
    """

    def __init__(self, slots: int, outgoing_numel: int, incoming_numel: int, device, staging_device=None):
        nbytes = torch.float32.itemsize
        self.slots = slots
        self.device = torch.device(device)
        self._outgoing = [torch.empty(outgoing_numel * nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._incoming = [torch.empty(incoming_numel * nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._staging = None
        if staging_device is not None and torch.device(staging_device) != self.device:
            from deepspeed.accelerator import get_accelerator
            self._staging = [
                get_accelerator().pin_memory(torch.empty(outgoing_numel, dtype=torch.float32, device=staging_device))
                for _ in range(slots)
            ]

    @classmethod
    def covering(cls, demands: Sequence[Tuple[int, int, int, torch.device]], device) -> "ExchangeBuffers":
        """One set for several pipelines that never run at the same time.

        Args:
            demands: per pipeline ``(slots, outgoing_numel, incoming_numel, piece_device)``.
            device: where the buffers live.

        Returns:
            buffers with the most slots and the largest buffers any demand asks for, with host
            staging where some pipeline's pieces live off ``device``.
        """
        slots = max((d[0] for d in demands), default=0)
        outgoing = max((d[1] for d in demands), default=0)
        incoming = max((d[2] for d in demands), default=0)
        staging = next((d[3] for d in demands if torch.device(d[3]) != torch.device(device)), None)
        return cls(slots, outgoing, incoming, device, staging)

    @staticmethod
    def _view(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return buffer[:numel * dtype.itemsize].view(dtype)

    def outgoing(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of slot ``slot``'s outgoing buffer as ``dtype`` (1-D)."""
        return self._view(self._outgoing[slot], numel, dtype)

    def incoming(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of slot ``slot``'s incoming buffer as ``dtype`` (1-D)."""
        return self._view(self._incoming[slot], numel, dtype)

    def staging(self, slot: int, numel: int, piece_device):
        """The slot's fp32 host staging buffer (``numel`` elements) for pieces on ``piece_device``,
        or ``None`` where the pieces live on the buffers' device."""
        if self._staging is None or torch.device(piece_device) == self.device:
            return None
        return self._staging[slot][:numel]

    def reserved_bytes(self) -> int:
        """Bytes the buffers hold on the device (staging excluded: host memory)."""
        return sum(b.numel() for b in self._outgoing + self._incoming)
