# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Checkpoints of NorMuon runs: the owner-held per-row state travels per parameter.

- ZeRO-3, same W = 2: save at step 3, load into a fresh engine, continue to step 6: bit-identical
  to the run that never stopped.
- Universal checkpoints: W = 2 saves and converts (``ds_to_universal``: a
  ``normuon_second_moment.pt`` per parameter, the parameter's shape), W' = 1 and 4 load: the
  loaded state equals the saved one exactly, and the run continued at W' equals the single-process
  NorMuon reference to the fp32 floor (another W is another owner plan: the state reaches each
  matrix's new owner; at the same W these small models get the same plan whatever
  ``reduce_bucket_size`` is, one matrix per bucket within the momentum budget).
- The same universal checkpoint loaded at ZeRO-1 and ZeRO-2 (W' = 1 and 2; ZeRO-2 with optimizer
  offload, whose owner plan differs again): the per-row state each rank keeps equals the saved
  one exactly, and the continued run equals the reference to the fp32 floor (on 0.19.7 ZeRO-2
  with offload refuses the load, as it does for plain Muon).
- ZeRO-1/2 (stage 2, with and without optimizer offload), same W: bit-identical resume.
- Refused: a plain Muon checkpoint loaded into a NorMuon run, a NorMuon checkpoint whose state was
  removed (regular and universal), a universal file whose rows are not constant, and a ZeRO-2
  NorMuon checkpoint given to ``ds_to_universal`` (naming both of its states).
"""

import glob
import os
import shutil

import numpy as np
import pytest
import torch
from deepspeed.git_version_info import version as deepspeed_version
from packaging import version

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import unequal_states
from unit.runtime.zero.test_zero3_normuon import normuon_reference, normuon_run
from unit.runtime.zero.zero3_muon_helpers import (FLOOR, Zero3MuonRun, check_zero12_conversion_refused,
                                                  relative_difference)

KEY = "normuon_second_moment"
SAVED_AT = 3
UPSTREAM_0197 = version.parse(deepspeed_version).base_version == "0.19.7"
"""DeepSpeed 0.19.7 refuses to load Muon momentum into ZeRO-1/2 with CPU offload (its offload path
kept none before patch 0012), so there a universal NorMuon checkpoint is refused at ZeRO-2 with
offload, naming the key."""


def _drop_state(checkpoint_dir, tag):
    """Remove KEY from every optimizer-state file of ``tag`` (one process)."""
    dropped = []

    def drop(node):
        if isinstance(node, dict):
            if KEY in node:
                del node[KEY]
                dropped.append(KEY)
            for value in node.values():
                drop(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                drop(value)

    for path in glob.glob(os.path.join(checkpoint_dir, tag, "*optim_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        drop(state)
        torch.save(state, path)
    assert dropped, "no NorMuon state in the checkpoint"


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
        if stage == 3:
            saved = restarted.optimizer_state
            assert not any(k[1] == KEY for k in saved), "the state is handed back to the owners after a load"

    def test_checkpoint_without_the_state_is_refused(self, tmp_path):
        from deepspeed import comm as dist
        plain = str(tmp_path / "plain")
        Zero3MuonRun(gas=2, steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=plain)
        with pytest.raises(RuntimeError, match="built with Muon variant 'normuon', but the parameter group now says"):
            normuon_run(gas=2, steps=4, resume_from=SAVED_AT).train(checkpoint_dir=plain)
        dropped = str(tmp_path / "dropped")
        normuon_run(gas=2, steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=dropped)
        dist.barrier()
        if dist.get_rank() == 0:
            _drop_state(dropped, "restart")
        dist.barrier()
        with pytest.raises(RuntimeError, match=f"the loaded optimizer state has no '{KEY}'"):
            normuon_run(gas=2, steps=4, resume_from=SAVED_AT).train(checkpoint_dir=dropped)


UNIVERSAL = normuon_run(gas=2, steps=5, samples=24, universal=True)


class TestNorMuonUniversal(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [[2, 1], [2, 4]], ids=["2to1", "2to4"])
    def test_resume_at_another_world_size(self, world_size, tmp_path):
        import deepspeed.comm as dist
        saved_file = tmp_path / "saved_state.pt"
        if not saved_file.exists():  # first launch: train, save, convert
            saved = UNIVERSAL.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            names = os.listdir(tmp_path / "restart_universal" / "zero" / "fc1.weight")
            assert f"{KEY}.pt" in names, names
            dist.barrier()
            if dist.get_rank() == 0:
                torch.save(saved.optimizer_state, saved_file)
            dist.barrier()
            return
        saved_state = torch.load(saved_file, weights_only=False)
        assert any(k[1] == KEY for k in saved_state)
        resumed = UNIVERSAL.with_(resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        assert unequal_states(saved_state, resumed.loaded_state) == []
        diff = relative_difference(normuon_reference(steps=5, samples=24), resumed.weights)
        print(f"MEASURED normuon universal {world_size[0]}->{world_size[1]}: {diff:.2e} from the reference")
        assert diff <= FLOOR

    @pytest.mark.parametrize("world_size", [[2, 2]])
    def test_refusals(self, world_size, tmp_path):
        import deepspeed.comm as dist
        if not (tmp_path / "restart_universal").exists():
            UNIVERSAL.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            return
        config = dict(UNIVERSAL.config(2), checkpoint={"load_universal": True})
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.copytree(tmp_path / "restart_universal", tmp_path / "missing")
            for path in glob.glob(str(tmp_path / "missing" / "zero" / "*" / f"{KEY}.pt")):
                os.remove(path)
        dist.barrier()
        engine = UNIVERSAL.build_engine(config)
        with pytest.raises(ValueError, match=f"has no {KEY}"):
            engine.load_checkpoint(str(tmp_path), tag="missing")
        engine.destroy()
        # Into a plain Muon run: refused (the state would be dropped).
        plain = Zero3MuonRun(gas=2, steps=5, samples=24, universal=True)
        engine = plain.build_engine(config | {"optimizer": plain.config(2)["optimizer"]})
        with pytest.raises(ValueError, match=f"holds a Muon variant's {KEY}"):
            engine.load_checkpoint(str(tmp_path), tag="restart_universal")
        engine.destroy()
        # At ZeRO-2, a file whose rows are not one value each: refused, naming the file.
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.copytree(tmp_path / "restart_universal", tmp_path / "uneven")
            path = tmp_path / "uneven" / "zero" / "fc1.weight" / f"{KEY}.pt"
            saved = torch.load(path, weights_only=False)
            tensor = saved["param"] if isinstance(saved, dict) else saved
            tensor.view(-1)[1] += 1.0
            torch.save(saved, path)
        dist.barrier()
        zero2 = UNIVERSAL.with_(stage=2)
        engine = zero2.build_engine(dict(zero2.config(2), checkpoint={"load_universal": True}))
        with pytest.raises(ValueError, match=f"fc1.weight.*{KEY}.pt is not normuon's per-row state"):
            engine.load_checkpoint(str(tmp_path), tag="uneven")
        engine.destroy()


@pytest.mark.parametrize("offload", [None, "cpu"])
class TestNorMuonZero12Conversion(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_refused_naming_the_state(self, offload, tmp_path):
        run = normuon_run(stage=2, offload=offload, gas=2)
        check_zero12_conversion_refused(run, tmp_path, f"momentum_buffer, {KEY}")


def _rows_held(engine) -> dict:
    """``{(flat partition index, matrix index): rows}`` of the NorMuon state this ZeRO-1/2 rank holds
    once loaded (``zero12_update``'s layouts), with ``{name: rows}`` of the same matrices."""
    from deepspeed.runtime.zero.muon.newton_schulz import matrix_spec
    from deepspeed.runtime.zero.muon.normuon import NorMuon
    opt = engine.optimizer
    held = {}
    for i, group in enumerate(opt.optimizer.param_groups):
        state = opt.optimizer.state.get(group["params"][0], {})
        if not group.get("use_muon") or KEY not in state:
            continue
        flat = state[KEY].cpu()
        if KEY + "_matrices" in state:  # offload: the owned matrices, in the owner state's order
            owner = opt.zero12_muon.pipelines[i].owner_state
            params = opt.round_robin_bit16_groups[i]
            assert sorted(owner.spans) == state[KEY + "_matrices"].long().tolist()
            for j, (offset, n) in owner.spans.items():
                held[opt.param_names[params[j]]] = flat.narrow(0, offset, n)
        else:
            offset = 0
            for p in opt.params_in_partition[i]:
                n = NorMuon.state_numel(matrix_spec(p, p.shape, group["ns_method"]))
                held[opt.param_names[p]] = flat.narrow(0, offset, n)
                offset += n
            assert offset == flat.numel()
    return held


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
class TestNorMuonUniversalAtZero12(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [[2, 1], [2, 2]], ids=["2to1", "2to2"])
    def test_restores_the_rows_and_continues(self, stage, offload, world_size, tmp_path):
        import deepspeed.comm as dist
        saved_file = tmp_path / "saved_state.pt"
        if not saved_file.exists():
            saved = UNIVERSAL.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            dist.barrier()
            if dist.get_rank() == 0:
                torch.save(saved.optimizer_state, saved_file)
            dist.barrier()
            return
        saved_state = torch.load(saved_file, weights_only=False)
        run = UNIVERSAL.with_(stage=stage, offload=offload)
        engine = run.build_engine(dict(run.config(dist.get_world_size()), checkpoint={"load_universal": True}))
        if offload and UPSTREAM_0197:
            with pytest.raises(ValueError, match="ZeRO stage 2 with zero_optimization.offload_optimizer"):
                engine.load_checkpoint(str(tmp_path), tag="restart_universal")
            engine.destroy()
            return
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
        diff = relative_difference(normuon_reference(steps=5, samples=24), resumed.weights)
        print(f"MEASURED normuon universal 2->ZeRO-{stage} offload={offload} W'={world_size[1]}: {diff:.2e} "
              "from the reference")
        assert diff <= FLOOR
