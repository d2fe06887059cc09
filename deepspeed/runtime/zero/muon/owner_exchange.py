# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The two all-to-alls of one bucket: NS-input partitions to their owner, results back.

``BucketLayout`` is pure tensor bookkeeping (pack, reassemble, split, unpack) and can be tested
in one process by routing the send buffers of simulated ranks by hand. ``OwnerExchange`` drives
one bucket on a real process group with ``deepspeed.comm.all_to_all_single``.

Layout. Let the bucket's matrices be ``j`` with owner ``o(j)``, ``ds_numel`` ``n(j)`` and
partition size ``p(j) = ceil(n(j) / W)``. Order them by ``(o(j), position in bucket)``.

- Forward, on every rank ``r``: the send buffer is this rank's NS-input partition of every
  matrix in that order, so the chunk for destination ``d`` is the partitions of the matrices
  ``d`` owns (``send_splits[d] = sum of p(j) over o(j) = d``).
- On owner ``r``: the receive buffer is ``W`` chunks of ``S = sum of p(j) over o(j) = r``
  elements, chunk ``s`` holding rank ``s``'s partitions of the owned matrices; viewed as
  ``(W, S)``, matrix ``j`` is the column block ``[:, off(j):off(j) + p(j)]``, which read row by
  row is the flattened matrix plus its zero padding.
- Back: the owner writes each result, padded to ``W * p(j)``, into the same ``(W, S)`` layout;
  row ``s`` goes to rank ``s``. Every rank then receives exactly the forward send layout, so
  unpacking is packing in reverse, and the padding of every partition comes back zero.

Elements received per rank (self excluded): ``(W - 1) * S`` forward and ``T - S`` back, with
``T`` the bucket's total partition size; summed over a balanced plan that is
``2 P (W - 1) / W^2`` for ``P`` Muon elements, the owner-centric lower bound.
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch


@dataclass
class ExchangeStats:
    """Cumulative counters of one rank's Muon boundary work.

    Attributes:
        optimizer_steps: accumulation boundaries at which the Muon update ran.
        ns_calls: Newton-Schulz orthogonalizations this rank ran as owner.
        elements_sent / elements_received: Muon elements that crossed ranks in the two
            all-to-alls (a rank's own partitions are not counted).
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


@dataclass
class BucketLayout:
    """One rank's view of one bucket's exchange.

    Args:
        owners: owner rank of each matrix of the bucket, in bucket order.
        shapes: full shape (``ds_shape``) of each matrix.
        partition_numels: partition size of each matrix (``ceil(ds_numel / W)``).
        rank: this rank within the partition process group.
        world_size: W.
    """
    owners: Sequence[int]
    shapes: Sequence[torch.Size]
    partition_numels: Sequence[int]
    rank: int
    world_size: int
    send_order: List[int] = field(init=False)
    send_splits: List[int] = field(init=False)
    owned: List[int] = field(init=False)
    owned_offsets: List[int] = field(init=False)
    owned_numel: int = field(init=False)

    def __post_init__(self):
        if not len(self.owners) == len(self.shapes) == len(self.partition_numels):
            raise ValueError("owners, shapes and partition_numels must have one entry per matrix")
        for shape, pn in zip(self.shapes, self.partition_numels):
            numel = torch.Size(shape).numel()
            if pn * self.world_size < numel:
                raise ValueError(f"partition of {pn} elements x {self.world_size} ranks cannot hold a "
                                 f"matrix of shape {tuple(shape)}")
        self.send_order = sorted(range(len(self.owners)), key=lambda k: (self.owners[k], k))
        self.send_splits = [0] * self.world_size
        for k in self.send_order:
            self.send_splits[self.owners[k]] += self.partition_numels[k]
        self.owned = [k for k in self.send_order if self.owners[k] == self.rank]
        self.owned_offsets = []
        offset = 0
        for k in self.owned:
            self.owned_offsets.append(offset)
            offset += self.partition_numels[k]
        self.owned_numel = offset

    @property
    def send_numel(self) -> int:
        """Elements this rank sends forward (and receives back), its own chunk included."""
        return sum(self.send_splits)

    @property
    def recv_splits(self) -> List[int]:
        """Forward receive split sizes (= back send split sizes): ``S`` from every rank."""
        return [self.owned_numel] * self.world_size

    def pack(self, partitions: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write this rank's partitions (bucket order, each ``partition_numels[k]`` elements) into
        ``out`` (1-D, ``send_numel`` elements) in send order; returns ``out``."""
        offset = 0
        for k in self.send_order:
            n = self.partition_numels[k]
            out.narrow(0, offset, n).copy_(partitions[k].reshape(-1), non_blocking=True)
            offset += n
        return out

    def unpack(self, buffer: torch.Tensor, partitions: Sequence[torch.Tensor]) -> None:
        """Inverse of ``pack``: copy ``buffer`` (the back receive buffer) into ``partitions``,
        casting to each partition's dtype. Blocking: under optimizer offload the partitions are
        (possibly pinned) host memory that the CPU optimizer reads next."""
        offset = 0
        for k in self.send_order:
            n = self.partition_numels[k]
            partitions[k].view(-1).copy_(buffer.narrow(0, offset, n))
            offset += n

    def owned_matrices(self, recv: torch.Tensor) -> List[torch.Tensor]:
        """Reassemble the matrices this rank owns from the forward receive buffer.

        Args:
            recv: 1-D, ``W * owned_numel`` elements (chunk ``s`` from rank ``s``).

        Returns:
            list of contiguous tensors, one per owned matrix (order of ``owned``), each of its
            full ``shape``, padding dropped: a view of ``recv`` where the matrix's block is
            contiguous there (it is the only matrix this rank owns in the bucket, or W is 1),
            else a copy.
        """
        rows = recv.view(self.world_size, self.owned_numel)
        matrices = []
        for k, offset in zip(self.owned, self.owned_offsets):
            shape = torch.Size(self.shapes[k])
            flat = rows[:, offset:offset + self.partition_numels[k]].reshape(-1)
            matrices.append(flat[:shape.numel()].view(shape))
        return matrices

    def write_results(self, results: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Split the owner's results into per-rank partitions, the layout ``owned_matrices`` reads.

        Args:
            results: one tensor per owned matrix (order of ``owned``) with the matrix's numel.
            out: 1-D, ``W * owned_numel`` elements, the back send buffer; cast on copy.

        Returns:
            ``out``, with each partition's padding zeroed.
        """
        rows = out.view(self.world_size, self.owned_numel)
        for k, offset, result in zip(self.owned, self.owned_offsets, results):
            pn = self.partition_numels[k]
            block = rows[:, offset:offset + pn]
            numel = result.numel()
            full_rows, tail = divmod(numel, pn)
            flat = result.reshape(-1)
            if full_rows:
                block[:full_rows].copy_(flat[:full_rows * pn].view(full_rows, pn))
            if full_rows < self.world_size:
                block[full_rows:].zero_()
                if tail:
                    block[full_rows, :tail].copy_(flat[full_rows * pn:])
        return out

    def received_elements(self) -> int:
        """Elements this rank receives from other ranks, forward plus back."""
        forward = (self.world_size - 1) * self.owned_numel
        back = self.send_numel - self.send_splits[self.rank]
        return forward + back

    def sent_elements(self) -> int:
        """Elements this rank sends to other ranks, forward plus back."""
        forward = self.send_numel - self.send_splits[self.rank]
        back = (self.world_size - 1) * self.owned_numel
        return forward + back


AllToAll = Callable[..., Optional[object]]


class OwnerExchange:
    """Runs the forward and back all-to-all of buckets on one process group.

    Args:
        group: the sub-group's partition process group (``None`` for the world).
        rank, world_size: this rank in ``group`` and its size.
        device: where the communication buffers live (the accelerator; the partitions may be on
            the CPU under optimizer offload and are copied).
        all_to_all_single: ``deepspeed.comm.all_to_all_single`` or a compatible callable
            ``(output, input, output_split_sizes, input_split_sizes, group, async_op)``.
        stats: counters to add to.
    """

    def __init__(self, group, rank: int, world_size: int, device, all_to_all_single: AllToAll,
                 stats: ExchangeStats):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._all_to_all_single = all_to_all_single
        self.stats = stats

    def _all_to_all(self, output, input, output_splits, input_splits, async_op):
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

    def _buffers(self, buffers, slot, send, recv, dtype):
        """The send and receive buffers, each ``(role, numel)``: from ``buffers``' slot, or new."""
        if buffers is None:
            return [torch.empty(numel, dtype=dtype, device=self.device) for _, numel in (send, recv)]
        return [buffers.take(slot, role, numel, dtype) for role, numel in (send, recv)]

    def send_to_owners(self, layout: BucketLayout, partitions: Sequence[torch.Tensor], dtype: torch.dtype,
                       async_op: bool = False, buffers: Optional["ExchangeBuffers"] = None, slot: int = 0):
        """Forward all-to-all of one bucket.

        Args:
            layout: the bucket's layout on this rank.
            partitions: this rank's NS-input partition of each matrix of the bucket (bucket order).
            dtype: the exchange dtype.
            buffers, slot: take the send and receive buffers from ``buffers``' slot ``slot``
                (reused across steps) instead of allocating them.

        Returns:
            ``(recv, handle)``: the forward receive buffer (read it with
            ``layout.owned_matrices`` after ``handle.wait()``; ``handle`` is None when done).
        """
        send, recv = self._buffers(buffers, slot, (OUTGOING, layout.send_numel),
                                   (INCOMING, self.world_size * layout.owned_numel), dtype)
        layout.pack(partitions, send)
        handle = self._all_to_all(recv, send, layout.recv_splits, layout.send_splits, async_op)
        return recv, handle

    def send_to_ranks(self, layout: BucketLayout, results: Sequence[torch.Tensor], dtype: torch.dtype,
                      async_op: bool = False, buffers: Optional["ExchangeBuffers"] = None, slot: int = 0):
        """Back all-to-all of one bucket: each rank gets its partition of every result.

        Args:
            layout: the bucket's layout on this rank.
            results: the owner's results (order of ``layout.owned``).
            dtype: the exchange dtype.
            buffers, slot: as for ``send_to_owners``, with the two buffers' roles swapped: the
                back send buffer is the forward receive buffer (same size), so call this only once
                the owner no longer reads what it received.

        Returns:
            ``(recv, handle)``: the back receive buffer, to pass to ``layout.unpack`` after
            ``handle.wait()``.
        """
        send, recv = self._buffers(buffers, slot, (INCOMING, self.world_size * layout.owned_numel),
                                   (OUTGOING, layout.send_numel), dtype)
        layout.write_results(results, send)
        handle = self._all_to_all(recv, send, layout.send_splits, layout.recv_splits, async_op)
        return recv, handle


OUTGOING, INCOMING = 0, 1
"""``ExchangeBuffers`` roles: this rank's partitions of a bucket (forward send, back receive:
``send_numel`` elements) and the owner's whole matrices (forward receive, back send:
``W * owned_numel`` elements)."""


class ExchangeBuffers:
    """Communication buffers of one sub-group's buckets, allocated once and reused every step.

    Each slot holds one bucket in flight: an OUTGOING and an INCOMING buffer, each used in both
    directions (see ``OwnerExchange.send_to_ranks``), so a bucket needs two buffers, not four. A
    buffer is raw bytes viewed as the dtype asked for, grown when a request is larger than what it
    holds (the first step sizes it to the largest bucket that uses the slot); afterwards no step
    allocates.

    Args:
        slots: buckets in flight at once (``bucket_pipeline``: 3 with overlap, 1 without).
        device: where the buffers live (the accelerator).
    """

    def __init__(self, slots: int, device):
        self.slots = slots
        self.device = device
        self._buffers = {}

    def take(self, slot: int, role: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of slot ``slot``'s ``role`` buffer viewed as ``dtype``
        (1-D; contents undefined)."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} of {self.slots}")
        nbytes = numel * dtype.itemsize
        buffer = self._buffers.get((slot, role))
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[(slot, role)] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes].view(dtype)

    def retained_bytes(self) -> int:
        """Bytes the buffers hold between steps."""
        return sum(b.numel() for b in self._buffers.values())
