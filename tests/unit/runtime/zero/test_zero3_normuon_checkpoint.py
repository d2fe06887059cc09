# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Checkpoints of NorMuon runs: the owner-held per-row state travels per parameter.

- ZeRO-3, W = 2: save at step 3, resume to step 6 bit-identically to the run that never stopped.
- Universal (``CONVERSIONS``): ZeRO-3 at W = 2 converts (``normuon_second_moment.pt`` per parameter, its shape);
  ZeRO-3 at W' = 1, 4 and ZeRO-1/2 at W' = 1, 2 (ZeRO-2 also offloaded) load the state exactly; ZeRO-2 at W = 2 (with
  and without offload) loads at ZeRO-2 W' = 1 and ZeRO-3 W' = 2. Each continued run matches the single-process NorMuon
  reference to the fp32 floor (another W is another owner plan: the state reaches each new owner).
- ZeRO-2 (with and without offload), same W: bit-identical resume, also from an older build (no layout mark).
- Refused: a plain Muon checkpoint into a NorMuon run, a NorMuon checkpoint without its state (regular and universal;
  missing from one rank's file: the same error on every rank), a universal file whose rows are not constant.
"""

import glob
import os
import shutil

import numpy as np
import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import unequal_states, universal_engine
from unit.runtime.zero.test_zero3_normuon import check_normuon, normuon_reference, normuon_run
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

KEY = "normuon_second_moment"
SAVED_AT = 3


def _drop_state(checkpoint_dir, tag, rank="*"):
    """Remove KEY from every optimizer-state file of ``tag`` (or of data-parallel ``rank``; one process)."""
    dropped = []

    def drop(node):
        if isinstance(node, dict):
            if KEY in node:
                dropped.append(node.pop(KEY))
            node = list(node.values())
        for value in node if isinstance(node, (list, tuple)) else ():
            drop(value)

    for path in glob.glob(os.path.join(checkpoint_dir, tag, f"*zero_pp_rank_{rank}_*optim_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        drop(state)
        torch.save(state, path)
    assert dropped, "no NorMuon state in the checkpoint"


def _on_rank_0(action):
    """``action()`` on rank 0 alone, every rank waiting for it."""
    from deepspeed import comm as dist
    dist.barrier()
    if dist.get_rank() == 0:
        action()
    dist.barrier()


class TestNorMuonCheckpoint(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage, offload", [(3, None), (2, None), (2, "cpu")])
    def test_resume_is_bit_identical(self, stage, offload, tmp_path):
        run = normuon_run(stage=stage, offload=offload, gas=2, steps=6)
        straight = run.train()
        restarted = run.with_(restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        for key in straight.weights:
            assert np.array_equal(straight.weights[key], restarted.weights[key]), key
        assert straight.norms == restarted.norms
        if stage == 3:  # every optimizer state, the NorMuon state in its checkpoint form included
            assert any(k[1] == KEY for k in straight.optimizer_state)
            assert unequal_states(straight.optimizer_state, restarted.optimizer_state) == []

    def test_checkpoint_without_the_state_is_refused(self, tmp_path):
        from deepspeed import comm as dist
        plain = str(tmp_path / "plain")
        Zero3MuonRun(gas=2, steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=plain)
        with pytest.raises(RuntimeError, match="built with Muon variant 'normuon', but the parameter group now says"):
            normuon_run(gas=2, steps=4, resume_from=SAVED_AT).train(checkpoint_dir=plain)
        dropped = str(tmp_path / "dropped")
        normuon_run(gas=2, steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=dropped)

        def damage():  # "dropped" loses the state in every rank's file, its copy "one" in rank 1's only
            shutil.copytree(dropped, str(tmp_path / "one"))
            _drop_state(dropped, "restart")
            _drop_state(str(tmp_path / "one"), "restart", rank=1)

        _on_rank_0(damage)
        with pytest.raises(RuntimeError, match=f"the loaded optimizer state has no '{KEY}'"):
            normuon_run(gas=2, steps=4, resume_from=SAVED_AT).train(checkpoint_dir=dropped)
        # Dropped from rank 1's file only: every rank raises the same error (rank 0 would else hang in the all-reduce).
        from deepspeed.runtime.rank_agreement import RankAgreedError
        with pytest.raises(RankAgreedError, match=f"failed on rank 1 of 2: RuntimeError: .* has no '{KEY}'") as e:
            normuon_run(gas=2, steps=4, resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path / "one"))
        messages = [None] * 2
        dist.all_gather_object(messages, str(e.value))
        assert messages[0] == messages[1]


UNIVERSAL = normuon_run(gas=2, steps=5, samples=24, universal=True)


def _rows_held(engine) -> dict:
    """``{name: rows}`` of the NorMuon state this rank holds as owner once loaded (``MuonUpdate.pipelines``)."""
    opt = engine.optimizer
    held = {}
    for key, pipeline in opt.muon_update.pipelines.items():
        params = opt.muon_update.partitions[key].params
        for j in pipeline.owner_state.spans:
            held[opt.param_names[params[j]]] = pipeline.owner_state.view(j).cpu()
    return held


# (saved, stage, offload, world_size): saved at ZeRO-``saved``, W=2; loaded at ZeRO-``stage``, W'; ZeRO-1/2's offload
CONVERSIONS = [(3, 3, None, [2, 1]), (3, 3, None, [2, 4]), (3, 1, None, [2, 1]), (3, 1, None, [2, 2]),
               (3, 2, None, [2, 1]), (3, 2, None, [2, 2]), (3, 2, "cpu", [2, 1]), (3, 2, "cpu", [2, 2]),
               (2, 2, None, [2, 1]), (2, 2, "cpu", [2, 1]), (2, 3, None, [2, 2]), (2, 3, "cpu", [2, 2])]


class TestNorMuonUniversal(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("saved, stage, offload, world_size",
                             CONVERSIONS,
                             ids=[f"z{s}-z{z}{'-offload' if o else ''}-{w[0]}to{w[1]}" for s, z, o, w in CONVERSIONS])
    def test_resume_at_another_world_size(self, saved, stage, offload, world_size, tmp_path):
        import deepspeed.comm as dist
        origin = UNIVERSAL.with_(stage=saved, offload=offload if saved < 3 else None)
        if not (tmp_path / "restart_universal").exists():  # first launch: train, save, convert
            result = origin.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            names = os.listdir(tmp_path / "restart_universal" / "zero" / "fc1.weight")
            assert f"{KEY}.pt" in names and "momentum_buffer.pt" in names, names
            _on_rank_0(lambda: torch.save(result.optimizer_state, tmp_path / "saved_state.pt"))
            return
        saved_state = torch.load(tmp_path / "saved_state.pt", weights_only=False)
        if saved == 3:  # ZeRO-3's every optimizer state, the NorMuon state in its checkpoint form included
            assert any(k[1] == KEY for k in saved_state), list(saved_state)[:4]
        run = UNIVERSAL.with_(stage=stage, offload=offload if stage < 3 else None)
        if saved == 3 and stage < 3:
            engine = universal_engine(run)
            engine.load_checkpoint(str(tmp_path), tag="restart_universal")
            held = _rows_held(engine)
            engine.destroy()
            assert held, "this rank holds no NorMuon state after the load"
            for name, rows in held.items():
                broadcast = torch.as_tensor(saved_state[(name, KEY)]).reshape(rows.numel(), -1)
                assert torch.equal(rows, broadcast[:, 0]), name
            names = [None] * dist.get_world_size()
            dist.all_gather_object(names, sorted(held))
            assert set().union(*map(set, names)) == {n for n, k in saved_state if k == KEY}
        resumed = run.with_(resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        if saved == stage == 3:
            assert unequal_states(saved_state, resumed.loaded_state) == []
        check_normuon(f"universal ZeRO-{saved} W=2 -> ZeRO-{stage} offload={offload} W'={world_size[1]}",
                      resumed.weights, normuon_reference(steps=5, samples=24))

    @pytest.mark.parametrize("stage", [3, 2])
    def test_saved_before_the_first_step(self, stage, tmp_path):
        """A universal checkpoint saved before the first step (NorMuon's per-row state all zeros; at ZeRO-1/2 no
        momentum) loads as a fresh start instead of being refused."""
        resumed = UNIVERSAL.with_(stage=stage, restart_after=0).train(checkpoint_dir=str(tmp_path))
        names = os.listdir(tmp_path / "restart_universal" / "zero" / "fc1.weight")
        assert f"{KEY}.pt" in names and ("momentum_buffer.pt" in names) == (stage == 3), names
        expected = normuon_reference(steps=5, samples=24)
        check_normuon(f"universal ZeRO-{stage} saved at step 0", resumed.weights, expected)

    @pytest.mark.parametrize("world_size", [[2, 2]])
    def test_refusals(self, world_size, tmp_path):
        if not (tmp_path / "restart_universal").exists():
            UNIVERSAL.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            return
        config = dict(UNIVERSAL.config(2), checkpoint={"load_universal": True})

        def damage():  # a copy without the state; one whose rows are not one value each; one with only the state
            for tag in ("missing", "uneven", "only_state"):
                shutil.copytree(tmp_path / "restart_universal", tmp_path / tag)
            for path in glob.glob(str(tmp_path / "missing" / "zero" / "*" / f"{KEY}.pt")):
                os.remove(path)
            for path in glob.glob(str(tmp_path / "only_state" / "zero" / "*" / "*.pt")):
                if os.path.basename(path) not in ("fp32.pt", "step.pt", f"{KEY}.pt"):
                    os.remove(path)
            path = tmp_path / "uneven" / "zero" / "fc1.weight" / f"{KEY}.pt"
            saved = torch.load(path, weights_only=False)
            tensor = saved["param"] if isinstance(saved, dict) else saved
            tensor.view(-1)[1] += 1.0
            torch.save(saved, path)

        _on_rank_0(damage)
        engine = universal_engine(UNIVERSAL)
        with pytest.raises(ValueError, match=f"has no {KEY}"):
            engine.load_checkpoint(str(tmp_path), tag="missing")
        engine.destroy()
        # Every other optimizer state gone: the stepped (non-zero) variant state is not a fresh start.
        engine = universal_engine(UNIVERSAL)
        with pytest.raises(ValueError, match="has no momentum_buffer"):
            engine.load_checkpoint(str(tmp_path), tag="only_state")
        engine.destroy()
        # Into a plain Muon run: refused (the state would be dropped).
        plain = Zero3MuonRun(gas=2, steps=5, samples=24, universal=True)
        engine = plain.build_engine(config | {"optimizer": plain.config(2)["optimizer"]})
        with pytest.raises(ValueError, match=f"holds a Muon variant's {KEY}"):
            engine.load_checkpoint(str(tmp_path), tag="restart_universal")
        engine.destroy()
        # At ZeRO-2, a file whose rows are not one value each: refused, naming the file.
        engine = universal_engine(UNIVERSAL.with_(stage=2))
        with pytest.raises(ValueError,
                           match=f"ZeRO-2 Muon, parameter group 0: '{KEY}' of the checkpoint: matrix 0 "
                           r"\(shape \(33, 21\)\) is not normuon's per-row state"):
            engine.load_checkpoint(str(tmp_path), tag="uneven")
        engine.destroy()


@pytest.mark.parametrize("offload", [None, "cpu"])
class TestNorMuonOlderZero12Checkpoints(DistributedTest):
    """An older build's ZeRO-2 NorMuon checkpoint (``to_older_zero12_layout``) resumes bit-identically (W=3: two
    matrices straddle)."""
    world_size = 3
    reuse_dist_env = True

    def test_resume_equals_the_uninterrupted_run(self, offload, tmp_path):
        from muon_testing.models import build_model, is_muon_param
        from unit.runtime.zero.zero12_muon_helpers import to_older_zero12_layout
        run = normuon_run(stage=2, offload=offload, gas=2, steps=5, samples=24)
        engine = run.build_engine(run.config(self.world_size))
        (pipeline, ) = engine.optimizer.muon_update.pipelines.values()
        owners = pipeline.plan.owners
        engine.destroy()
        straight = run.train()
        run.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        shapes = [tuple(p.shape) for n, p in build_model("mixed").named_parameters() if is_muon_param(n, p)]
        _on_rank_0(lambda: to_older_zero12_layout(str(tmp_path), "restart", shapes, self.world_size, offload, owners))
        resumed = run.with_(resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        for name in straight.weights:
            assert np.array_equal(straight.weights[name], resumed.weights[name]), name
