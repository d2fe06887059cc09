# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The two all-to-alls of one bucket: Newton-Schulz-input pieces to their owner, results back.

Every rank's send buffer holds its piece of each of the bucket's matrices, ordered by ``(owner, position)``, so its
split for rank ``d`` is its pieces of the matrices ``d`` owns; the owner rebuilds each matrix from one split per source
rank, its pieces in rank order cut to its numel (ZeRO-3 pads). Results return in the same layout, unpacked in reverse.
Under ZeRO-3 with a balanced plan a rank receives on average ``2 P (W - 1) / W^2`` elements for ``P`` Muon elements,
the owner-centric lower bound.
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import torch

from deepspeed.accelerator import get_accelerator


@dataclass
class ExchangeStats:
    """One rank's cumulative counters: ``optimizer_steps``, ``ns_calls`` (matrices orthogonalized as owner), elements
    and bytes sent and received in the all-to-alls (own pieces excluded), ``exchanges`` (none with one rank)."""
    optimizer_steps: int = 0
    ns_calls: int = 0
    elements_sent: int = 0
    elements_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0


@dataclass(frozen=True)
class BucketLayout:
    """One rank's view of one bucket's exchange: ``matrices`` (the bucket's matrix indices, partition order) with their
    ``owners``, ``numels`` and ``pieces`` (elements every rank holds), seen from ``rank``; ``placements``: per matrix,
    None (its pieces in rank order are the matrix flattened) or its tensor-parallel layout, per holder ``(offset,
    numel)`` of its piece's elements in the shards' storage (the rest is padding).

    Derived: ``send_order`` (bucket positions by (owner, position): the send buffer's order), ``send_splits`` /
    ``recv_splits`` (elements sent to / received from each rank, forward), ``owned`` (positions of the matrices this
    rank owns, in send order), ``send_pieces`` (``(k, offset, numel)`` of each piece this rank holds, in the send
    buffer), ``owned_spans`` (per owned matrix, ``(start, numel)`` of its nonzero pieces in the receive buffer, in rank
    order).

    Raises:
        ValueError: entries of different lengths, or pieces that cannot hold their matrix.
    """
    matrices: Tuple[int, ...]
    owners: Tuple[int, ...]
    numels: Tuple[int, ...]
    pieces: Tuple[Tuple[int, ...], ...]
    rank: int
    placements: Tuple[Optional[Tuple[Tuple[int, int], ...]], ...] = ()
    send_order: Tuple[int, ...] = field(init=False)
    send_splits: Tuple[int, ...] = field(init=False)
    owned: Tuple[int, ...] = field(init=False)
    recv_splits: Tuple[int, ...] = field(init=False)
    send_pieces: Tuple[Tuple[int, int, int], ...] = field(init=False)
    owned_spans: Tuple[Tuple[Tuple[int, int], ...], ...] = field(init=False)

    def __post_init__(self):  # the derived fields, computed once
        if not len(self.matrices) == len(self.owners) == len(self.numels) == len(self.pieces):
            raise ValueError("matrices, owners, numels and pieces need one entry per matrix")
        for numel, pieces in zip(self.numels, self.pieces):
            if sum(pieces) < numel:
                raise ValueError(f"pieces {tuple(pieces)} cannot hold a matrix of {numel} elements")
        world_size = len(self.pieces[0]) if self.pieces else 1
        order = tuple(sorted(range(len(self.owners)), key=lambda k: (self.owners[k], k)))
        owned = tuple(k for k in order if self.owners[k] == self.rank)
        send_splits, send_pieces, offset = [0] * world_size, [], 0
        for k in order:
            n = self.pieces[k][self.rank]
            send_splits[self.owners[k]] += n
            if n:
                send_pieces.append((k, offset, n))
            offset += n
        recv_splits = tuple(sum(self.pieces[k][s] for k in owned) for s in range(world_size))
        starts, spans = [sum(recv_splits[:s]) for s in range(world_size)], []  # where each source's next piece lies
        for k in owned:
            spans.append(tuple((starts[s], n) for s, n in enumerate(self.pieces[k]) if n))
            starts = [a + n for a, n in zip(starts, self.pieces[k])]
        set_ = object.__setattr__
        set_(self, "send_order", order)
        set_(self, "send_splits", tuple(send_splits))
        set_(self, "owned", owned)
        set_(self, "recv_splits", recv_splits)
        set_(self, "send_pieces", tuple(send_pieces))
        set_(self, "owned_spans", tuple(spans))

    @property
    def send_numel(self) -> int:
        """Elements this rank sends forward (and receives back), its own split included."""
        return sum(self.send_splits)

    @property
    def recv_numel(self) -> int:
        """Elements this rank receives forward as owner (and sends back)."""
        return sum(self.recv_splits)

    def _tensor_parallel_spans(self, position: int):
        return self.placements[self.owned[position]] if self.placements else None

    def owned_matrix(self, recv: torch.Tensor, position: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """Owned matrix ``position`` (index in ``owned``) of ``shape``, rebuilt from the receive buffer ``recv`` (1-D,
        ``recv_numel``): a view where its pieces lie back to back, else a copy; with ``placements``, its storage (1-D,
        a copy) instead."""
        spans = self.owned_spans[position]
        placed = self._tensor_parallel_spans(position)
        if placed:
            storage = recv.new_empty(self.numels[self.owned[position]])
            for (a, _), (offset, numel) in zip(spans, placed):
                storage.narrow(0, offset, numel).copy_(recv.narrow(0, a, numel))
            return storage
        if all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])):
            flat = recv.narrow(0, spans[0][0], sum(n for _, n in spans))
        else:
            flat = torch.cat([recv.narrow(0, a, n) for a, n in spans])
        return flat[:self.numels[self.owned[position]]].view(shape)

    def write_result(self, position: int, result: torch.Tensor, out: torch.Tensor) -> None:
        """Write owned matrix ``position``'s ``result`` (its numel, any shape; cast on copy) into the back send buffer
        ``out`` (1-D, ``recv_numel``) in the layout ``owned_matrix`` reads (with ``placements``: ``result`` is the
        storage), padding zero."""
        flat, start, numel = result.reshape(-1), 0, self.numels[self.owned[position]]
        placed = self._tensor_parallel_spans(position) or [None] * len(self.owned_spans[position])
        for (a, n), where in zip(self.owned_spans[position], placed):
            dest = out.narrow(0, a, n)
            if where is not None:
                start, real = where
            else:
                real = max(0, min(n, numel - start))
            if real:
                dest.narrow(0, 0, real).copy_(flat.narrow(0, start, real))
            if real < n:
                dest.narrow(0, real, n - real).zero_()
            start += n


class OwnerExchange:
    """The all-to-alls of one process group (``group``; this ``rank`` of ``world_size``), through
    ``all_to_all_single`` (``deepspeed.comm``'s or a compatible callable), counted into ``stats``."""

    def __init__(self, group, rank: int, world_size: int, all_to_all_single, stats: ExchangeStats):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._all_to_all_single = all_to_all_single
        self.stats = stats

    def warm_up(self, device) -> None:
        """A synchronous all-to-all of one int32 per peer at initialization, checked, not counted: NCCL connects a pair
        of ranks at their first exchange, so this connects them all before the first step's asynchronous all-to-alls.

        Raises:
            RuntimeError: an element came back from another rank than the one that sent it."""
        w, r = self.world_size, self.rank
        sent = torch.arange(r * w, (r + 1) * w, dtype=torch.int32, device=device)
        received = torch.empty_like(sent)
        self._all_to_all_single(received,
                                sent,
                                output_split_sizes=[1] * w,
                                input_split_sizes=[1] * w,
                                group=self.group,
                                async_op=False)
        expected = torch.arange(r, w * w, w, dtype=torch.int32, device=device)
        if not torch.equal(received, expected):
            raise RuntimeError(f"Muon exchange warm-up on rank {r} of {w}: received {received.tolist()}, expected "
                               f"{expected.tolist()}: the process group's all-to-all does not deliver by rank.")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                   input_splits: Sequence[int], async_op: bool):
        """One all-to-all; returns an ``InFlight`` to wait on, or ``None`` when it is complete (one rank: a copy)."""
        sent = sum(input_splits) - input_splits[self.rank]
        received = sum(output_splits) - output_splits[self.rank]
        self.stats.elements_sent += sent
        self.stats.elements_received += received
        self.stats.bytes_sent += sent * input.element_size()
        self.stats.bytes_received += received * input.element_size()
        if self.world_size == 1:
            output.copy_(input)
            return None
        self.stats.exchanges += 1
        handle = self._all_to_all_single(output,
                                         input,
                                         output_split_sizes=list(output_splits),
                                         input_split_sizes=list(input_splits),
                                         group=self.group,
                                         async_op=async_op)
        return InFlight(handle, (output, input)) if handle is not None else None


class InFlight:
    """An asynchronous all-to-all's work handle and its tensors, held until ``wait``: a backend may read the input
    and write the output until then, whatever the caller drops. Defensive: NCCL's work keeps its tensors too."""

    def __init__(self, handle, tensors: Tuple[torch.Tensor, ...]):
        self.handle, self.tensors = handle, tensors

    def wait(self) -> None:
        """Waits for the all-to-all (on an accelerator: the current stream waits for it), then lets go of it; once."""
        if self.handle is not None:
            self.handle.wait()
        self.handle = self.tensors = None


class ExchangeBuffers:
    """One pipeline run's exchange buffers (``MuonUpdate.update`` makes a set per pipeline in turn, each sized by its
    own plan), allocated before the run's first all-to-all: an out-of-memory error comes there, not mid-exchange.

    Each of ``slots`` holds one bucket in flight: an outgoing (this rank's pieces) and an incoming buffer (the owner's
    matrices) of ``outgoing_numel`` / ``incoming_numel`` fp32 elements on ``device``, raw bytes viewed as each step's
    dtype. Pieces on ``staging_device`` (optimizer offload) cross through a pinned host buffer per slot, in one
    non-blocking copy per bucket each way (back: ``to_host``). ``host``: an ``ExchangeBuffers`` whose pinned staging
    and copy stream to reuse (``ValueError`` unless it covers these slots and sizes); ``device_buffers=False``: only
    the staging (``MuonUpdate`` keeps it across steps).
    """

    def __init__(self,
                 slots: int,
                 outgoing_numel: int,
                 incoming_numel: int,
                 device,
                 staging_device=None,
                 host: Optional["ExchangeBuffers"] = None,
                 device_buffers: bool = True):
        nbytes = torch.float32.itemsize
        self.slots = slots
        self.device = torch.device(device)
        count = slots if device_buffers else 0
        self._outgoing = [torch.empty(outgoing_numel * nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self._incoming = [torch.empty(incoming_numel * nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self._staging = self.staging_device = self._copy_stream = None
        if staging_device is not None and host is not None and host._staging is not None:
            if len(host._staging) < slots or host._staging[0].numel() < outgoing_numel * nbytes:
                raise ValueError("the host staging does not cover these exchange buffers")
            self.staging_device, self._staging, self._copy_stream = host.staging_device, host._staging, \
                host._copy_stream
        elif staging_device is not None:
            self.staging_device = torch.device(staging_device)
            self._staging = [
                get_accelerator().pin_memory(
                    torch.empty(outgoing_numel * nbytes, dtype=torch.uint8, device=staging_device))
                for _ in range(slots)
            ]
            streams = self.device.type != "cpu" and get_accelerator().Stream is not None
            self._copy_stream = get_accelerator().Stream() if streams else None

    @classmethod
    def covering(cls,
                 demands: Sequence[Tuple[int, int, int, torch.device]],
                 device,
                 host: Optional["ExchangeBuffers"] = None,
                 device_buffers: bool = True) -> "ExchangeBuffers":
        """One set on ``device`` covering every pipeline's ``buffer_demand`` ``(slots, outgoing_numel, incoming_numel,
        piece_device)``, with host staging where pieces live off ``device`` (``host``'s, if given)."""
        slots, outgoing, incoming = (max((d[i] for d in demands), default=0) for i in range(3))
        staging = next((d[3] for d in demands if torch.device(d[3]) != torch.device(device)), None)
        return cls(slots, outgoing, incoming, device, staging, host, device_buffers)

    @staticmethod
    def _view(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return buffer[:numel * dtype.itemsize].view(dtype)

    def outgoing(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of slot ``slot``'s outgoing buffer as ``dtype`` (1-D)."""
        return self._view(self._outgoing[slot], numel, dtype)

    def incoming(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of slot ``slot``'s incoming buffer as ``dtype`` (1-D)."""
        return self._view(self._incoming[slot], numel, dtype)

    def staging(self, slot: int, numel: int, piece_device, dtype: torch.dtype = torch.float32):
        """The first ``numel`` elements of the slot's pinned host buffer as ``dtype`` (1-D) for pieces on
        ``piece_device``, or ``None`` where they do not go through it (pieces on the buffers' device)."""
        if self._staging is None or torch.device(piece_device) != self.staging_device:
            return None
        return self._view(self._staging[slot], numel, dtype)

    def to_host(self, source: torch.Tensor, host: torch.Tensor, pending) -> torch.Tensor:
        """``host`` (a ``staging`` view) holding ``source`` (the slot's returned update) once ``pending`` (an
        ``InFlight`` or None) completed: one non-blocking copy on the copy stream, waited for by its event, so the copy
        waits for the exchange and not for Newton-Schulz queued on the current stream."""
        if self._copy_stream is None:
            if pending is not None:
                pending.wait()
            return host.copy_(source)
        if pending is None:  # a local copy on the current stream (one rank): the copy waits for that stream
            self._copy_stream.wait_stream(get_accelerator().current_stream())
        with get_accelerator().stream(self._copy_stream):
            if pending is not None:
                pending.wait()
            host.copy_(source, non_blocking=True)
            copied = get_accelerator().Event()
            copied.record(self._copy_stream)
        copied.synchronize()
        return host

    def reserved_bytes(self) -> int:
        """Bytes the buffers hold on the device (staging excluded: host memory)."""
        return sum(b.numel() for b in self._outgoing + self._incoming)
