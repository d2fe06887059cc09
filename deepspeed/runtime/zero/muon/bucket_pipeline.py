# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One sub-group's buckets through the owner exchange: send, orthogonalize, return, overlapped.

For each bucket (``owner_plan``), every rank sends its partitions to the matrices' owners (the
forward all-to-all), each owner computes the update of the whole matrices it owns, and a second
all-to-all returns every rank its partition of each update (``owner_exchange``).

With ``overlap`` the buckets run as a two-stage pipeline: while the owners compute bucket k,
the forward all-to-all of bucket k+1 and the back all-to-all of bucket k-1 are in flight, so
the exchange buffers of three buckets are in use at once (k's received matrices, k+1's and
k-1's in flight). Without ``overlap`` the buckets run one after the other with blocking
collectives (one bucket's buffers). The buffers are ``owner_exchange.ExchangeBuffers`` slots,
bucket k in slot ``k % slots``, allocated at the first step and reused at every later one.

Every rank issues the same collectives in the same order, whatever it owns (a rank that owns
nothing in a bucket still takes part in both all-to-alls):

- overlap: ``F0 F1 B0 F2 B1 ... F(n-1) B(n-2) B(n-1)``;
- serial:  ``F0 B0 F1 B1 ... F(n-1) B(n-1)``;

with ``Fk`` / ``Bk`` the forward / back all-to-all of bucket k.
"""

from typing import Callable, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeBuffers, OwnerExchange

OwnerUpdate = Callable[[Sequence[int], Sequence[torch.Tensor]], Sequence[torch.Tensor]]
"""``owner_update(indices, matrices) -> updates``: run on the owner once per bucket with the
matrices it owns there (``indices`` in sub-group order, each matrix reassembled whole, shape
``ds_shape``, possibly a view of the receive buffer); returns one tensor per matrix with its
number of elements."""


class BucketPipeline:
    """The buckets of one Muon sub-group on one rank.

    Args:
        exchange: the sub-group's ``OwnerExchange`` (process group, this rank, counters).
        buckets: the plan's buckets, each a tuple of matrix indices in sub-group order.
        layouts: this rank's ``BucketLayout`` of each bucket.
    """

    def __init__(self, exchange: OwnerExchange, buckets: Sequence[Tuple[int, ...]], layouts: Sequence[BucketLayout]):
        if len(buckets) != len(layouts):
            raise ValueError(f"{len(buckets)} buckets but {len(layouts)} layouts")
        self.exchange = exchange
        self.buckets = list(buckets)
        self.layouts = list(layouts)
        self.buffers = {overlap: ExchangeBuffers(min(3 if overlap else 1, max(1, len(self.buckets))), exchange.device)
                        for overlap in (True, False)}

    def run(self, to_owner: Sequence[torch.Tensor], into: Sequence[torch.Tensor], owner_update: OwnerUpdate,
            send_dtype: torch.dtype, return_dtype: torch.dtype, overlap: bool) -> None:
        """Send every matrix to its owner, apply ``owner_update`` there, write the results back.

        Args:
            to_owner: per matrix (sub-group order), this rank's partition to send (1-D).
            into: per matrix, the partition that receives this rank's part of the update (1-D,
                same sizes; may alias ``to_owner``: a bucket is sent before it is written).
            owner_update: see ``OwnerUpdate``.
            send_dtype: dtype of the forward exchange.
            return_dtype: dtype of the back exchange (the update's precision).
            overlap: run the two stages asynchronously (see the module docstring).
        """
        buffers = self.buffers[overlap]
        forward = self._send(0, to_owner, send_dtype, overlap, buffers) if self.buckets else None
        returning: Optional[Tuple[int, torch.Tensor, object]] = None
        for b, layout in enumerate(self.layouts):
            received, handle = forward
            _wait(handle)
            if overlap and b + 1 < len(self.buckets):
                forward = self._send(b + 1, to_owner, send_dtype, overlap, buffers)
            updates = owner_update([self.buckets[b][k] for k in layout.owned], layout.owned_matrices(received))
            del received
            if returning is not None:
                self._receive(*returning, into)
            returning = (b, *self.exchange.send_to_ranks(layout, updates, return_dtype, overlap, buffers,
                                                         b % buffers.slots))
            del updates
            if not overlap:
                self._receive(*returning, into)
                returning = None
                if b + 1 < len(self.buckets):
                    forward = self._send(b + 1, to_owner, send_dtype, overlap, buffers)
        if returning is not None:
            self._receive(*returning, into)

    def retained_bytes(self) -> int:
        """Bytes of exchange buffers kept between steps."""
        return sum(buffers.retained_bytes() for buffers in self.buffers.values())

    def _send(self, b: int, to_owner, dtype, async_op, buffers):
        partitions = [to_owner[j] for j in self.buckets[b]]
        return self.exchange.send_to_owners(self.layouts[b], partitions, dtype, async_op, buffers, b % buffers.slots)

    def _receive(self, b: int, buffer: torch.Tensor, handle, into) -> None:
        _wait(handle)
        self.layouts[b].unpack(buffer, [into[j] for j in self.buckets[b]])


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()
