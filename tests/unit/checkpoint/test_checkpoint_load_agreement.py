# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A regular ZeRO checkpoint with one rank's optimizer-state file damaged ends every rank with the same error.

A rank whose ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` is missing, truncated or another rank's must not raise
alone while the others wait in their next collective until the process-group timeout: every rank must raise, within
seconds, one ``RankAgreedError`` with the same message naming the damaged file and rank, at ZeRO-1, 2 and 3, with Muon
and AdamW (W=2). The intact checkpoint loads the saved state bit for bit.
"""

import glob
import os
import shutil
import time

import pytest
import torch

from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, train_one_step

FILE = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
DAMAGES = {  # what rank 0 does to a copy of the checkpoint: (the ranks that must fail, the text naming why)
    "deleted": ([1], "no such file"),
    "truncated": ([1], "cannot be read, truncated or damaged?"),
    "copied": ([1], "holds the optimizer state of data-parallel rank 0 of 2, expected rank 1 of 2"),
    "swapped": ([0, 1], "expected rank 0 of 2"),
}
SECONDS = 30.0
"""Every rank's ``load_checkpoint`` must end by then; a rank left waiting for a failed one would wait 600 s."""


def _damage(folder, how):
    """Rank 0 damages the copy ``folder`` of the checkpoint as ``DAMAGES`` says."""
    one, zero = os.path.join(folder, FILE.format(1)), os.path.join(folder, FILE.format(0))
    if how == "deleted":
        os.remove(one)
    elif how == "truncated":
        os.truncate(one, os.path.getsize(one) // 2)
    elif how == "copied":
        shutil.copyfile(zero, one)
    else:
        os.replace(one, one + ".tmp")
        os.replace(zero, one)
        os.replace(one + ".tmp", zero)


def _tensors(obj, path=""):
    """``[(path, value)]`` of every tensor and plain value in a (nested) state dict."""
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _tensors(obj[k], f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _tensors(v, f"{path}/{i}")]
    if isinstance(obj, torch.Tensor):
        return [(path, obj.detach().cpu().clone())]
    return [(path, obj)] if isinstance(obj, (int, float, str, bool, type(None))) else []


def _state(engine):
    """The engine's optimizer state dict and its parameters (ZeRO-3: this rank's partitions), flattened."""
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    return _tensors(engine.optimizer.state_dict()) + _tensors(params, "params")


def _equal(a, b):
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and torch.equal(a, b)) or (not isinstance(a, torch.Tensor) and a == b)


class TestCheckpointLoadAgreement(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("optimizer", ["Muon", "AdamW"])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_damaged_file_fails_every_rank_alike(self, stage, optimizer, tmp_path):
        from deepspeed import comm as dist
        from deepspeed.runtime.rank_agreement import RankAgreedError
        run = Zero3MuonRun(stage=stage, gas=1, optimizer=optimizer)
        saver = run.build_engine(run.config(2))
        for step in range(2):
            train_one_step(saver, step)
        saver.save_checkpoint(str(tmp_path), tag="intact")
        saved = _state(saver)
        dist.barrier()
        if dist.get_rank() == 0:
            for how in DAMAGES:
                shutil.copytree(tmp_path / "intact", tmp_path / how)
                _damage(str(tmp_path / how), how)
        dist.barrier()
        loader = run.build_engine(run.config(2))
        for how, (failing, why) in DAMAGES.items():
            start = time.monotonic()
            with pytest.raises(RankAgreedError) as raised:
                loader.load_checkpoint(str(tmp_path), tag=how)
            seconds = time.monotonic() - start
            message = str(raised.value)
            messages = [None] * 2
            dist.all_gather_object(messages, (message, seconds))
            assert messages[0][0] == messages[1][0], messages
            assert max(s for _, s in messages) < SECONDS, messages
            assert [rank for rank, _ in raised.value.failures] == failing, message
            for rank in failing:
                assert f"rank {rank}" in message and os.path.join(str(tmp_path), how, FILE.format(rank)) in message
            assert why in message, message
            if dist.get_rank() == 0:
                print(f"MEASURED stage {stage} {optimizer} {how}: {max(s for _, s in messages):.2f} s: {message}")
        assert not glob.glob(str(tmp_path / "intact" / "*.tmp"))
        loaded = run.build_engine(run.config(2))
        loaded.load_checkpoint(str(tmp_path), tag="intact")
        after = _state(loaded)
        assert [path for path, _ in after] == [path for path, _ in saved]
        assert [path for (path, a), (_, b) in zip(saved, after) if not _equal(a, b)] == []
        for engine in (saver, loader, loaded):
            engine.destroy()
