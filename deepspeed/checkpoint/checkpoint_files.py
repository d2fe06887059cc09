# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which checkpoint files an engine reads at load, and errors every rank agrees on there.

``DeepSpeedEngine`` calls three functions of this module: ``model_states_files_to_load`` where it lists
the model-states files (a universal checkpoint another ZeRO stage wrote; a regular ZeRO-3 checkpoint of
another world size, whose missing files are named with the way out, ``resize_error``),
``load_zero_partitions`` where it reads the ZeRO optimizer-state files (the same ``resize_error`` for a
regular checkpoint of another world size; each rank's file checked against the data-parallel rank and
world size it records, under ``rank_agreement.agreed_errors`` so that every rank raises the same error),
and ``zero_partition_record`` where it saves them (that record).
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

    The conversion copies the saving run's model-states files: a ZeRO-3 run's
    ``zero_pp_rank_<r>_mp_rank_<m>_model_states.pt``, a ZeRO-1/2 run's
    ``mp_rank_<m>_model_states.pt``. An engine of the other kind finds none of its own and fails
    with a bare ``AssertionError`` (``SDLoaderBase.check_ckpt_list``). Universal loading takes the
    weights from ``zero/`` and only metadata (``dp_world_size``, lr scheduler, step counters,
    client state) from these files, which data-parallel rank 0's file holds like every other.

    Args:
        checkpoint_dir: ``<load_dir>/<tag>``.
        mp_placeholder: the model-parallel rank, or ``*`` for every one.
        partitioned: the loading engine partitions its weights (ZeRO-3): it reads a ZeRO-1/2 run's
            files; else a ZeRO-3 run's (data-parallel rank 0's).

    Returns:
        the files, one per model-parallel rank, sorted; empty if the folder has none.
    """
    name = f"mp_rank_{mp_placeholder}_model_states.pt" if partitioned else \
        f"zero_pp_rank_0_mp_rank_{mp_placeholder}_model_states.pt"
    return sorted(glob.glob(os.path.join(checkpoint_dir, name)))


def resize_error(saved_dp_world_size, current_dp_world_size, load_dir, tag):
    """The error for loading a regular ZeRO checkpoint at another data-parallel world size, naming
    the way out: convert the checkpoint to a universal one and load that.

    A regular checkpoint keeps each rank's partition of the flat fp32 master weights and optimizer
    states (``*_optim_states.pt``, one file per rank; under ZeRO-3 also one model-states file per
    rank); the partition boundaries depend on the world size that wrote it, so an engine cannot
    take the states over at another one. A universal checkpoint does not depend on the world size,
    and ``ds_to_universal`` writes ``<load_dir>/latest_universal``, so after the conversion
    ``load_checkpoint(load_dir)`` with ``"checkpoint": {"load_universal": true}`` finds it without
    a tag.

    Args:
        saved_dp_world_size (int): the data-parallel world size that saved the checkpoint.
        current_dp_world_size (int): the data-parallel world size of the loading engine.
        load_dir (str or os.PathLike): the ``load_dir`` passed to ``load_checkpoint``.
        tag (str): the checkpoint's tag (its folder under ``load_dir``).

    Returns:
        ZeRORuntimeException: for the caller to raise. Its message keeps the engine's text (both
        world sizes) and adds the conversion command with this checkpoint's folders (shell-quoted;
        with ``--inject_missing_state`` for a ZeRO-1/2 checkpoint without
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
    """Whether ``ds_to_universal`` needs ``--inject_missing_state`` for this regular checkpoint: a
    ZeRO-1/2 one (no per-rank ``zero_pp_rank_*_model_states.pt``) whose
    ``mp_rank_00_model_states.pt`` has no ``universal_checkpoint_info`` (Megatron-style clients set
    it; a plain ``nn.Module``, as under the Hugging Face Trainer, does not). The file is read
    memory-mapped, so no tensor is read."""
    model_states = os.path.join(checkpoint_folder, "mp_rank_00_model_states.pt")
    if saved_zero3_dp_world_size(checkpoint_folder) is not None or not os.path.isfile(model_states):
        return False
    saved = torch.load(model_states, map_location="cpu", weights_only=False, mmap=True)
    return saved.get(UNIVERSAL_CHECKPOINT_INFO) is None


def saved_zero3_dp_world_size(checkpoint_folder):
    """The data-parallel world size that wrote a regular ZeRO-3 checkpoint, from its file names.

    ZeRO-3 writes one model-states file per data-parallel rank r (and model-parallel rank m),
    ``zero_pp_rank_<r>_mp_rank_<m>_model_states.pt``; the world size is the number of distinct r.
    Counting names needs no ``torch.load`` of a file that may not be this rank's to read.

    Args:
        checkpoint_folder (str or os.PathLike): ``<load_dir>/<tag>``.

    Returns:
        int, or None where the folder does not exist or holds no such file (not a ZeRO-3
        checkpoint, or a universal one).
    """
    if not os.path.isdir(checkpoint_folder):
        return None
    pattern = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt")
    ranks = {int(match.group(1)) for match in map(pattern.fullmatch, os.listdir(checkpoint_folder)) if match}
    return len(ranks) or None


def raise_if_saved_at_another_world_size(load_dir, tag, current_dp_world_size):
    """For a ZeRO-3 rank that finds no model-states file of its own in a regular checkpoint: raise
    ``resize_error`` if the checkpoint was written at another data-parallel world size.

    A rank whose data-parallel rank the saving run did not have (the world size grew) has no
    ``zero_pp_rank_<r>_*_model_states.pt`` to read, and would otherwise fail in the state-dict
    loader on an empty file list (``AssertionError``) before reaching the world-size check that
    names the way out, while the other ranks get that check's error.

    Args:
        load_dir (str or os.PathLike), tag (str): as given to (or resolved by) ``load_checkpoint``.
        current_dp_world_size (int): the loading engine's data-parallel world size.

    Raises:
        ZeRORuntimeException: ``resize_error``'s, where the checkpoint's ZeRO-3 model-states files
            show another world size. Otherwise returns None (e.g. a wrong tag, left to the
            engine's own error).
    """
    saved = saved_zero3_dp_world_size(os.path.join(os.fspath(load_dir), str(tag)))
    if saved is not None and saved != current_dp_world_size:
        raise resize_error(saved, current_dp_world_size, load_dir, tag)


def model_states_files_to_load(found: List[str], load_dir, tag, universal: bool, partitioned: bool,
                               dp_world_size: int) -> List[str]:
    """The model-states files an engine loads, from those it found of its own kind (``found``,
    ``DeepSpeedEngine._get_all_ckpt_names``).

    Where it found none: from a universal checkpoint (``universal``) another ZeRO stage wrote, that
    stage's files (``model_states_files``); from a regular checkpoint, at ZeRO-3 (``partitioned``), the
    error naming the conversion where the checkpoint was written at another data-parallel world size
    (``raise_if_saved_at_another_world_size``).

    Args:
        found: the files found, sorted.
        load_dir (str or os.PathLike), tag (str): as ``load_checkpoint`` resolved them.
        universal: ``checkpoint.load_universal`` is set.
        partitioned: the engine partitions its weights (ZeRO-3).
        dp_world_size (int): the engine's data-parallel world size.

    Returns:
        ``found`` where it is not empty, else the files above (empty where there are none: the
        state-dict loader's error follows).

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


_PARTITION_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_?optim_states\.pt")
"""The name DeepSpeed gives data-parallel rank ``<r>``'s ZeRO optimizer-state file (``_get_zero_ckpt_name``;
the older names without the ``_`` before ``optim_states`` too)."""


def partition_rank_of(path) -> Optional[int]:
    """The data-parallel rank in the name of a ZeRO optimizer-state file, None for another file."""
    match = _PARTITION_FILE.fullmatch(os.path.basename(os.fspath(path)))
    return int(match.group(1)) if match else None


class _CheckedPartitionLoads:
    """A checkpoint engine whose ``load`` of a ZeRO optimizer-state file is ``load_zero_partition_file``'s
    (the file named with its rank if missing or unreadable, refused if it records another rank or count);
    everything else is ``inner``'s."""

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
    ``engine._get_all_zero_checkpoints`` reads them (each rank its own file, or every file under
    ``zero_optimization.elastic_checkpoint``), with each file checked and errors every rank agrees on.

    While it reads, the engine's ``checkpoint_engine`` is replaced by one whose loads of these files are
    ``load_zero_partition_file``'s (put back after, also on error), so the engine's own reading (its file
    names, the bf16/fp16 fallback, the AutoEP metadata checks) is unchanged. With
    ``zero_optimization.pipeline_loading_checkpoint`` the ranks read one after another, so no agreement
    is sought (a rank would wait for one not yet reading): the rank's own error is raised.

    Args:
        engine: the loading ``DeepSpeedEngine`` (its ``loaded_checkpoint_dp_world_size`` set from the
            model-states file).
        load_dir (str or os.PathLike), tag (str): as ``load_checkpoint`` resolved them.
        load_optimizer_states: the optimizer states are loaded (else another world size is allowed:
            only the weights are taken).

    Returns:
        ``engine._get_all_zero_checkpoints``'s list (one entry per data-parallel rank of the checkpoint).

    Raises:
        ZeRORuntimeException: ``resize_error``'s, where the optimizer states are loaded at another
            data-parallel world size than the checkpoint's.
        RankAgreedError (a RuntimeError): on every rank, where some rank's file is missing, unreadable,
            another rank's, or another error ended its read, naming each failed rank and its error.
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
