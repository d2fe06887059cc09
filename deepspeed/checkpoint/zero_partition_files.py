# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO optimizer-state files that say whose they are: each rank's ``*_optim_states.pt`` records its
data-parallel rank and world size (``zero_partition_record``, at save), and ``load_zero_partition_file``
checks them at load, so that a file of another rank (renamed, swapped, copied from another run) is refused
instead of loaded as this rank's partition, and a missing or unreadable file is named with its rank.
``DeepSpeedEngine._get_all_zero_checkpoints`` runs the loads under ``rank_agreement.agreed_errors``, so that
every rank raises the same error.
"""

import os

from deepspeed import comm as dist

ZERO_PARTITION_RANK = "zero_partition_rank"
"""Key of a ZeRO optimizer-state file (``*_optim_states.pt``): the data-parallel rank (partition) it holds."""
ZERO_PARTITION_COUNT = "zero_partition_count"
"""Key of the same file: the number of data-parallel partitions of the run that saved it."""


def zero_partition_record(group):
    """``{ZERO_PARTITION_RANK: rank, ZERO_PARTITION_COUNT: world size}`` of this rank in ``group`` (the
    optimizer's data-parallel group), for its ZeRO optimizer-state file."""
    return {ZERO_PARTITION_RANK: dist.get_rank(group=group), ZERO_PARTITION_COUNT: dist.get_world_size(group=group)}


def load_zero_partition_file(checkpoint_engine, path, partition_rank, partition_count):
    """The state dict of the ZeRO optimizer-state file ``path`` of data-parallel rank ``partition_rank`` of
    ``partition_count``, loaded to the CPU with ``checkpoint_engine``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RuntimeError: ``path`` cannot be read (truncated or damaged; the loader's error is named), or
            records another partition rank or count than expected (files renamed, swapped or copied
            from another run). Files saved without ``ZERO_PARTITION_RANK`` are not checked.
    """
    try:
        state = checkpoint_engine.load(path, map_location='cpu')
    except Exception as e:  # noqa: B902 - torch.load's errors (OSError, RuntimeError, pickle's) name no file
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file (the optimizer state of data-parallel rank "
                                    f"{partition_rank})") from e
        raise RuntimeError(f"{path}: cannot be read, truncated or damaged? ({type(e).__name__}: {e})") from e
    recorded = (state.get(ZERO_PARTITION_RANK), state.get(ZERO_PARTITION_COUNT))
    if recorded[0] is not None and recorded != (partition_rank, partition_count):
        raise RuntimeError(f"{path}: holds the optimizer state of data-parallel rank {recorded[0]} of {recorded[1]}, "
                           f"expected rank {partition_rank} of {partition_count} (files renamed, swapped or copied?)")
    return state
