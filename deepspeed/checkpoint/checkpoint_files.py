# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which checkpoint files an engine reads at load, and errors every rank agrees on there.

``DeepSpeedEngine`` calls ``model_states_files_to_load`` where it lists the model-states files (a universal checkpoint
another ZeRO stage wrote; a regular ZeRO-3 one of another world size, refused with the way out, ``resize_error``),
``load_zero_partitions`` where it reads the ZeRO optimizer-state files (the same ``resize_error``; each rank's file
checked against the data-parallel rank and world size it records, under ``rank_agreement.agreed_errors`` so every rank
raises the same error), and ``zero_partition_record`` where it saves them (that record).
"""

import glob
import os
import re
import shlex
from typing import List, Optional

import torch

from deepspeed import comm as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.runtime.rank_agreement import agreed_errors
from deepspeed.runtime.zero.utils import ZeRORuntimeException

# Model-states files


def model_states_files(checkpoint_dir: str, mp_placeholder: str = "*", partitioned: bool = False) -> List[str]:
    """The model-states files an engine reads from a universal checkpoint another ZeRO stage wrote.

    The conversion copies the saving run's model-states files (ZeRO-3:
    ``zero_pp_rank_<r>_mp_rank_<m>_model_states.pt``; ZeRO-1/2: ``mp_rank_<m>_model_states.pt``), so an engine of the
    other kind finds none of its own and fails with a bare ``AssertionError`` (``SDLoaderBase.check_ckpt_list``).
    Universal loading takes the weights from ``zero/`` and only metadata (``dp_world_size``, lr scheduler, step
    counters, client state) from these files, which data-parallel rank 0's file holds like every other.

    Returns the files in ``checkpoint_dir`` (``<load_dir>/<tag>``) of model-parallel rank ``mp_placeholder`` (``*``:
    every one), sorted: a ZeRO-1/2 run's if ``partitioned`` (the loading engine is ZeRO-3), else a ZeRO-3 run's
    (data-parallel rank 0's); empty if there are none.
    """
    name = f"mp_rank_{mp_placeholder}_model_states.pt" if partitioned else \
        f"zero_pp_rank_0_mp_rank_{mp_placeholder}_model_states.pt"
    return sorted(glob.glob(os.path.join(checkpoint_dir, name)))


def resize_error(saved_dp_world_size, current_dp_world_size, load_dir, tag):
    """The error for loading a regular ZeRO checkpoint at another data-parallel world size, naming the way out.

    A regular checkpoint keeps each rank's partition of the flat fp32 weights and optimizer states, whose boundaries
    depend on the world size that wrote it. A universal one does not, and ``ds_to_universal`` writes
    ``<load_dir>/latest_universal``, so after the conversion ``load_checkpoint(load_dir)`` with
    ``"checkpoint": {"load_universal": true}`` finds it without a tag.

    Returns a ZeRORuntimeException for the caller to raise: the engine's text (both world sizes), the shell-quoted
    conversion command for ``<load_dir>/<tag>`` (with ``--inject_missing_state`` for a ZeRO-1/2 checkpoint without
    ``universal_checkpoint_info``) and the config setting that loads the result.
    """
    input_folder = os.path.join(os.fspath(load_dir), str(tag))
    output_folder = f"{input_folder}_universal"
    command = (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shlex.quote(input_folder)} "
               f"--output_folder {shlex.quote(output_folder)}")
    if _needs_injected_state(input_folder):
        command += (" --inject_missing_state\n(at ZeRO stage 1/2 the converter needs the model's "
                    "universal_checkpoint_info, which this checkpoint's model did not set; the flag supplies it)")
    return ZeRORuntimeException(
        f"The checkpoint being loaded used a DP world size of {saved_dp_world_size} but the current world size is "
        f"{current_dp_world_size}. Automatic adjustment of ZeRO's optimizer state partitioning with a new world "
        f"size is not currently supported for a regular checkpoint. To resume at DP world size "
        f"{current_dp_world_size}, convert it to a universal checkpoint once:\n    {command}\n"
        f"then load that with \"checkpoint\": {{\"load_universal\": true}} in the DeepSpeed config: "
        f"load_checkpoint({os.fspath(load_dir)!r}) finds it through the latest_universal file the conversion "
        f"writes (or pass tag={os.path.basename(output_folder)!r}).")


def _needs_injected_state(checkpoint_folder) -> bool:
    """Whether ``ds_to_universal`` needs ``--inject_missing_state``: a ZeRO-1/2 checkpoint whose
    ``mp_rank_00_model_states.pt`` lacks ``universal_checkpoint_info`` (Megatron-style clients set it; a plain
    ``nn.Module``, as under the Hugging Face Trainer, does not). Read memory-mapped: no tensor is read."""
    model_states = os.path.join(checkpoint_folder, "mp_rank_00_model_states.pt")
    if saved_zero3_dp_world_size(checkpoint_folder) is not None or not os.path.isfile(model_states):
        return False
    saved = torch.load(model_states, map_location="cpu", weights_only=False, mmap=True)
    return saved.get(UNIVERSAL_CHECKPOINT_INFO) is None


def saved_zero3_dp_world_size(checkpoint_folder):
    """The data-parallel world size that wrote a regular ZeRO-3 checkpoint (``<load_dir>/<tag>``), from its file names.

    The number of distinct r in ``zero_pp_rank_<r>_mp_rank_<m>_model_states.pt``; counting names needs no
    ``torch.load`` of a file that may not be this rank's to read. None where the folder does not exist or holds no
    such file (not ZeRO-3, or universal).
    """
    if not os.path.isdir(checkpoint_folder):
        return None
    pattern = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt")
    ranks = {int(match.group(1)) for match in map(pattern.fullmatch, os.listdir(checkpoint_folder)) if match}
    return len(ranks) or None


def raise_if_saved_at_another_world_size(load_dir, tag, current_dp_world_size):
    """For a ZeRO-3 rank without a model-states file of its own in a regular checkpoint: raise ``resize_error``
    if the checkpoint was written at another data-parallel world size.

    A rank the saving run did not have (the world size grew) would otherwise fail in the state-dict loader on an
    empty file list (``AssertionError``) before the world-size check, while the other ranks get that check's error.
    Otherwise returns None (e.g. a wrong tag, left to the engine's own error).

    Raises:
        ZeRORuntimeException: ``resize_error``'s, where the ZeRO-3 model-states files show another world size.
    """
    saved = saved_zero3_dp_world_size(os.path.join(os.fspath(load_dir), str(tag)))
    if saved is not None and saved != current_dp_world_size:
        raise resize_error(saved, current_dp_world_size, load_dir, tag)


def model_states_files_to_load(found: List[str], load_dir, tag, universal: bool, partitioned: bool,
                               dp_world_size: int) -> List[str]:
    """The model-states files an engine loads: ``found`` (its own kind's, ``DeepSpeedEngine._get_all_ckpt_names``)
    if not empty; else from a universal checkpoint (``universal``) another ZeRO stage wrote, that stage's files
    (``model_states_files``); else at ZeRO-3 (``partitioned``) the conversion error, where the checkpoint was written
    at another data-parallel world size; else the empty list (the state-dict loader's error follows).

    Raises:
        ZeRORuntimeException: ``resize_error``'s, as ``raise_if_saved_at_another_world_size``.
    """
    if found:
        return found
    if universal:
        return model_states_files(os.path.join(os.fspath(load_dir), str(tag)), partitioned=partitioned)
    if partitioned:
        raise_if_saved_at_another_world_size(load_dir, tag, dp_world_size)
    return found


# ZeRO optimizer-state files

ZERO_PARTITION_RANK = "zero_partition_rank"
"""Key of a ZeRO optimizer-state file (``*_optim_states.pt``): the data-parallel rank (partition) it holds."""
ZERO_PARTITION_COUNT = "zero_partition_count"
"""Key of the same file: the number of data-parallel partitions of the run that saved it."""


def zero_partition_record(group):
    """``{ZERO_PARTITION_RANK: rank, ZERO_PARTITION_COUNT: world size}`` of this rank in the optimizer's
    data-parallel ``group``, for its ZeRO optimizer-state file."""
    return {ZERO_PARTITION_RANK: dist.get_rank(group=group), ZERO_PARTITION_COUNT: dist.get_world_size(group=group)}


def load_zero_partition_file(checkpoint_engine, path, partition_rank, partition_count):
    """The state dict of data-parallel rank ``partition_rank``'s (of ``partition_count``) ZeRO optimizer-state file
    ``path``, loaded to the CPU with ``checkpoint_engine``. Files without ``ZERO_PARTITION_RANK`` are not checked.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RuntimeError: ``path`` is unreadable (truncated or damaged; the loader's error is named), or records another
            partition rank or count (files renamed, swapped or copied from another run).
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


_PARTITION_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_?optim_states\.pt")
"""Data-parallel rank ``<r>``'s ZeRO optimizer-state file name (``_get_zero_ckpt_name``; older names without the
``_`` before ``optim_states`` too)."""


def partition_rank_of(path) -> Optional[int]:
    """The data-parallel rank in the name of a ZeRO optimizer-state file, None for another file."""
    match = _PARTITION_FILE.fullmatch(os.path.basename(os.fspath(path)))
    return int(match.group(1)) if match else None


class _CheckedPartitionLoads:
    """A checkpoint engine whose ``load`` of a ZeRO optimizer-state file is ``load_zero_partition_file``'s; everything
    else is ``inner``'s."""

    def __init__(self, inner, partition_count: int):
        self.inner, self.partition_count = inner, partition_count

    def load(self, path, map_location=None):
        rank = partition_rank_of(path)
        if rank is None:
            return self.inner.load(path, map_location=map_location)
        return load_zero_partition_file(self.inner, path, rank, self.partition_count)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def load_zero_partitions(engine, load_dir, tag, load_optimizer_states: bool):
    """The optimizer state dicts of a regular ZeRO checkpoint's ``*_optim_states.pt`` files, read as
    ``engine._get_all_zero_checkpoints`` reads them (one entry per checkpoint rank), each file checked, with errors
    every rank agrees on. ``engine.loaded_checkpoint_dp_world_size`` must be set from the model-states file first.

    While it reads, ``engine.checkpoint_engine`` is wrapped so that loads of these files are
    ``load_zero_partition_file``'s (restored after, also on error), leaving the engine's own reading (file names,
    bf16/fp16 fallback, AutoEP metadata checks) unchanged. Under ``zero_optimization.pipeline_loading_checkpoint`` the
    ranks read one after another, so no agreement is sought (a rank would wait for one not yet reading). Without
    ``load_optimizer_states`` another world size is allowed (only the weights are taken).

    Raises:
        ZeRORuntimeException: ``resize_error``'s, loading the optimizer states at another data-parallel world size.
        RankAgreedError (a RuntimeError): on every rank, where some rank's file is missing, unreadable, another
            rank's, or another error ended its read, naming each failed rank and its error.
    """
    saved = engine.loaded_checkpoint_dp_world_size
    if load_optimizer_states and engine.seq_dp_world_size != saved:
        raise resize_error(saved, engine.seq_dp_world_size, load_dir, tag)
    serial = engine._config.zero_config.pipeline_loading_checkpoint
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _CheckedPartitionLoads(inner, saved)
    try:
        with agreed_errors("loading the ZeRO optimizer states", enabled=not serial):
            return engine._get_all_zero_checkpoints(load_dir, tag)
    finally:
        engine.checkpoint_engine = inner
