# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 checkpoints of Muon runs: the layout mark, and checkpoints saved before it taken apart.

ZeRO-1/2 keep Muon's state in the flat fp32 partition's layout (``binding``), like Adam's ``exp_avg``, and mark their
checkpoints with ``STATE_LAYOUT_KEY``. Unmarked ones come from stock DeepSpeed or older builds of this patch, which
without optimizer offload kept a Muon group's momentum as the whole momentum of every parameter touching the rank's
partition, concatenated in order (a matrix straddling a boundary whole on each rank holding a piece; stock DeepSpeed
in the gradients' dtype), and a variant's per-row state (NorMuon) for those whole matrices too, or with offload for
the matrices the rank owned, their indices under ``<state_key>_matrices``. ``from_older_layout`` rewrites such state
in place into this build's layout before ``MuonUpdate.load_saved_state`` takes it over.
"""

import torch

from deepspeed import comm as dist
from deepspeed.runtime.rank_agreement import agreed_errors
from deepspeed.runtime.zero.muon.momentum import MOMENTUM_KEY

STATE_LAYOUT_KEY = "muon_state_layout"
"""Key of a ZeRO-1/2 checkpoint (the stage's ``state_dict``) whose Muon state is in the partition's layout; its
value is ``PARTITION_LAYOUT``."""
PARTITION_LAYOUT = "partition"


@torch.no_grad()
def from_older_layout(update, cpu_offload: bool) -> None:
    """Rewrite, partition by partition, the Muon state loaded from a ZeRO-1/2 checkpoint without
    ``STATE_LAYOUT_KEY`` into the partition's layout.

    Call on every rank right after the stage loaded such a checkpoint (collective over a variant partition's process
    group), before ``update.load_saved_state()``.

    Args:
        update: the stage's ``binding.MuonUpdate``.
        cpu_offload: the stage uses optimizer offload (then the momentum is in the partition's layout already: older
            builds and stock DeepSpeed kept it so there).

    Raises:
        RankAgreedError (a RuntimeError), on every rank: some rank's momentum has another size than that layout has
            here (another world size or ``offload_optimizer`` setting), or its variant's state was kept for other
            matrices than the ones it owns (another owner plan).
    """
    for key, pipeline in update.pipelines.items():
        part, owner, exchange = update.partitions[key], pipeline.owner_state, pipeline.exchange
        state, rank = update.optimizer.state.get(part.flat, {}), exchange.rank
        held = [(j, sum(p[:rank]), part.slices[j]) for j, p in enumerate(part.pieces) if p[rank]]
        rows = state.pop(owner.variant.state_key, None) if owner is not None else None
        present = owner is not None and _any_rank(rows is not None, owner.flat.device, exchange)
        with agreed_errors(f"loading the Muon state of {part.label}", group=exchange.group):
            momentum = state.get(MOMENTUM_KEY)
            if momentum is not None:
                expected = part.numel if cpu_offload else sum(pipeline.specs[j].numel for j, _, _ in held)
                if momentum.numel() != expected:
                    raise RuntimeError(
                        f"the checkpoint, saved without {STATE_LAYOUT_KEY!r} (stock DeepSpeed or an older build of "
                        f"the Muon patch), holds a momentum of {momentum.numel()} elements where this configuration "
                        f"expects {expected}: it was saved with another data-parallel world size or "
                        "zero_optimization.offload_optimizer setting. Load it with the configuration that saved it.")
                if not cpu_offload:
                    state[MOMENTUM_KEY] = _take_apart(part, pipeline, held, momentum)
            matrices = state.pop(owner.variant.state_key + "_matrices", None) if present else None
            listed = [] if rows is None else [j for j, _, _ in held] if matrices is None else matrices.tolist()
            if present and not _load_rows(owner, torch.zeros(0) if rows is None else rows, [int(j) for j in listed]):
                raise RuntimeError(f"the loaded '{owner.variant.state_key}' belongs to another owner plan (world "
                                   "size, zero_optimization.reduce_bucket_size or parameters differ); load the "
                                   "checkpoint with the configuration it was saved with.")
        if present:
            state[owner.variant.state_key] = owner.to_partition(part.pieces, part.slices, rank, part.numel,
                                                                exchange.group, exchange.world_size)


def _any_rank(value: bool, device, exchange) -> bool:
    """Whether ``value`` is true on some rank of ``exchange.group``: one MAX all-reduce on ``device`` (collective,
    skipped at one rank)."""
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    if exchange.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=exchange.group)
    return bool(flag.item())


def _take_apart(part, pipeline, held, whole: torch.Tensor) -> torch.Tensor:
    """This rank's pieces of the whole matrices' momentum ``whole``, in the partition's layout (fp32)."""
    out = torch.zeros(part.numel, dtype=torch.float32, device=whole.device)
    source = 0
    for j, first, (offset, count) in held:
        out.narrow(0, offset, count).copy_(whole.reshape(-1).narrow(0, source + first, count))
        source += pipeline.specs[j].numel
    return out


def _load_rows(owner, rows: torch.Tensor, matrices) -> bool:
    """Take ``owner``'s matrices' state from per-row state saved for ``matrices`` (their states back to
    back, in that order); False, changing nothing, where it owns a matrix not among them."""
    if not set(owner.spans) <= set(matrices):
        return False
    rows = rows.reshape(-1).to(device=owner.flat.device, dtype=torch.float32)
    offset = 0
    for j in matrices:
        n = owner.variant.state_numel(owner.specs[j])
        if j in owner.spans:
            owner.view(j).copy_(rows.narrow(0, offset, n))
        offset += n
    return True
