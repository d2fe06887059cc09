# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Errors every rank agrees on: a step that can fail on some ranks and not others (each rank reads its own checkpoint
file, checks its own partition) ends on every rank with the same ``RankAgreedError`` (``agreed_errors``), instead of
the failed ranks raising while the others wait in the next collective until the process group's timeout. It costs one
all-reduce of one int32 element; only where some rank failed do the ranks all-gather the failed ranks' messages.
"""

import contextlib

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator


class RankAgreedError(RuntimeError):
    """Raised with the same message on every rank of a group where a step failed on some of its ranks; ``failures``:
    ``[(global rank, message)]`` of the failed ranks, in rank order."""

    def __init__(self, message, failures):
        super().__init__(message)
        self.failures = failures


@contextlib.contextmanager
def agreed_errors(what, detail=None, group=None, enabled=True):
    """Run the ``with`` block on every rank of ``group``, then agree on its outcome.

    Args:
        what: the step, the same on every rank (e.g. "loading the ZeRO optimizer states").
        detail: this rank's part (e.g. its file), put before its error message.
        group: the process group whose ranks all enter the block (default: the world).
        enabled: False skips the agreement, re-raising the block's own error (where the ranks run the step one after
            another, e.g. serial checkpoint loading).

    Raises:
        RankAgreedError: on every rank of ``group`` where the block raised an ``Exception`` on some rank: "<what>
            failed on rank <r> of <W>: <detail>: <type>: <message>" (each failed rank, "; " between); on a failed
            rank, chained to its exception.
    """
    failure = error = None
    try:
        yield
    except Exception as e:  # noqa: B902 - any failure of the step is reported to every rank
        error, failure = e, (f"{detail}: " if detail else "") + f"{type(e).__name__}: {e}"
    if not enabled and error is not None:
        raise error
    world_size = dist.get_world_size(group=group) if dist.is_initialized() else 1
    gathered = [(dist.get_rank() if dist.is_initialized() else 0, failure)]
    if enabled and world_size > 1:
        flag = torch.tensor([failure is not None], dtype=torch.int32, device=get_accelerator().current_device_name())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            gathered = [None] * world_size
            dist.all_gather_object(gathered, (dist.get_rank(), failure), group=group)
    failures = sorted((rank, message) for rank, message in gathered if message is not None)
    if failures:
        ranks = "rank" + ("s " if len(failures) > 1 else " ") + ", ".join(str(rank) for rank, _ in failures)
        text = "; ".join(f"rank {rank}: {message}" if len(failures) > 1 else message for rank, message in failures)
        raise RankAgreedError(f"{what} failed on {ranks} of {world_size}: {text}", failures) from error
