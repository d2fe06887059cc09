# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of ZeRO-3 runs whose optimizer is Muon (or any other optimizer whose
per-parameter state is not Adam's ``exp_avg``/``exp_avg_sq``), and the way to another world size.

A universal checkpoint (``python -m deepspeed.checkpoint.ds_to_universal``) stores every
parameter in a folder of its own, ``<output>/zero/<parameter name>/``, independent of the number
of ranks that wrote it, so ``"checkpoint": {"load_universal": true}`` can load it at any
data-parallel world size W'. Per parameter:

- ``fp32.pt``: the fp32 master weights;
- one file per optimizer state of the parameter's sub-group: ``momentum_buffer.pt`` for a Muon
  matrix (fp32, also when the checkpoint kept it in bf16 as stock 0.19.8 does),
  ``exp_avg.pt`` and ``exp_avg_sq.pt`` for a parameter of the auxiliary Adam (or of Adam);
- ``step.pt``: the optimizer's step count, where the sub-group's state has one (Adam's).

Each tensor file holds ``{"param": tensor}`` with the parameter's logical shape (``ds_shape``,
no ZeRO padding), the form both the ZeRO-3 and the ZeRO-1/2 universal loaders read.
``<output>/zero/optimizer_state.pt`` keeps the optimizer's ``param_groups`` (per group:
``use_muon``, ``lr``, ``momentum``, ``betas``, ``ns_method``, ``weight_decay``, ...) and the loss
scaler.
"""

# Regular checkpoints at another world size
# (each function imports what it uses: the module's top belongs to the universal-checkpoint part above)


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
        ZeRORuntimeException: for the caller to raise. Its message keeps upstream's text (both
        world sizes) and adds the conversion command with this checkpoint's folders (shell-quoted)
        and the config setting that loads the result.
    """
    import os
    import shlex
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    input_folder = os.path.join(os.fspath(load_dir), str(tag))
    output_folder = f"{input_folder}_universal"
    command = (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shlex.quote(input_folder)} "
               f"--output_folder {shlex.quote(output_folder)}")
    return ZeRORuntimeException(
        f"The checkpoint being loaded used a DP world size of {saved_dp_world_size} but the current world size is "
        f"{current_dp_world_size}. Automatic adjustment of ZeRO's optimizer state partitioning with a new world "
        f"size is not currently supported for a regular checkpoint. To resume at DP world size "
        f"{current_dp_world_size}, convert it to a universal checkpoint once:\n    {command}\n"
        f"then load that with \"checkpoint\": {{\"load_universal\": true}} in the DeepSpeed config: "
        f"load_checkpoint({os.fspath(load_dir)!r}) finds it through the latest_universal file the conversion "
        f"writes (or pass tag={os.path.basename(output_folder)!r}).")


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
    import os
    import re
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
            show another world size. Otherwise returns None (e.g. a wrong tag, left to upstream's
            error).
    """
    import os
    saved = saved_zero3_dp_world_size(os.path.join(os.fspath(load_dir), str(tag)))
    if saved is not None and saved != current_dp_world_size:
        raise resize_error(saved, current_dp_world_size, load_dir, tag)
