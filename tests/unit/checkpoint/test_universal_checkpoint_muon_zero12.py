# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of Muon runs and ZeRO stages 1 and 2, in both directions.

ZeRO-3 to ZeRO-1/2: MixedMLP at ZeRO-3 (two Muon groups with own momentum, lr, weight decay, two Adam groups) saved at
W=2; at W' a stage-1/2 engine must hold exactly the saved state, momentum in the partition layout, then follow ZeRO-3.
ZeRO-1/2 to anywhere: a stage 1, 2 and 2 + CPU offload checkpoint (W=2) converts (momentum cut at the fragment offsets
like ``exp_avg``) and resumes at W'=1, 4 and at ZeRO-3 (W'=2). The older whole-parameter layout is refused.
"""

import os
import shutil

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import (GROUP_SETTINGS, SAVE_AFTER, TAG, continue_training, load_at,
                                                     save_convert_and_continue, state_file, train_steps,
                                                     universal_engine, universal_round_trip)
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, convert_to_universal, ds_to_universal_args
from unit.runtime.zero.zero12_muon_helpers import to_older_zero12_layout

RUN = Zero3MuonRun(model="mixed", gas=2, groups="two_muon_groups", clip=0.0)

SETTINGS = GROUP_SETTINGS + ("use_muon", "momentum", "ns_method")  # group settings compared: Adam's and Muon's


def check_momentum_restored(engine, expected):
    """Each of this rank's momentum fragments equals the saved momentum's bit for bit; every Muon matrix's is held."""
    import deepspeed.comm as dist
    opt = engine.optimizer
    names = []
    for i, group in enumerate(opt.optimizer.param_groups):
        momentum = opt.optimizer.state.get(group["params"][0], {}).get("momentum_buffer")
        for lp in (opt.bf16_groups if hasattr(opt, "bf16_groups") else opt.bit16_groups)[i]:
            if momentum is None or getattr(lp, "_hp_mapping", None) is None:
                continue
            name = opt.param_names[lp]
            address = lp._hp_mapping.get_hp_fragment_address()
            got = momentum.narrow(0, address.start, address.numel).float().cpu()
            lp_address = dict(engine.module.named_parameters())[name]._hp_mapping.lp_fragment_address
            saved = expected["state"][name]["momentum_buffer"].reshape(-1)
            assert torch.equal(got, saved.narrow(0, lp_address.start, lp_address.numel)), name
            names.append(name)
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(names))
    muon_names = {n for n, s in expected["state"].items() if "momentum_buffer" in s}
    assert set().union(*map(set, held)) == muon_names


def _round_trip(tmp_path, load):
    """``universal_round_trip`` of ``RUN`` loaded as ``load``, Muon's settings and momentum checked too."""
    phase = universal_round_trip(RUN, tmp_path, load, SETTINGS)
    if phase is not None:
        check_momentum_restored(*phase)
    return phase


class TestZero3MuonUniversalAtZero12(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("stage, offload, load_world_size", [
        pytest.param(s, o, w, marks=pytest.mark.world_size([2, w]), id=f"stage{s}{'-offload' if o else ''}-{w}")
        for s, o, w in [(1, None, 1), (1, None, 2), (2, None, 1), (2, None, 2), (2, "cpu", 2)]
    ])
    def test_restores_exactly_and_continues(self, stage, offload, load_world_size, tmp_path):
        """ZeRO-2 with offload_optimizer cpu keeps the momentum in the partition layout too."""
        load = RUN.with_(stage=stage, offload=offload)
        phase = _round_trip(tmp_path, load)
        if phase is not None:
            continue_training(phase, load, f"stage {stage} offload={offload} W'={load_world_size}")

    @pytest.mark.world_size([2, 2])
    def test_bf16_optimizer(self, tmp_path):
        """Stage 1 bf16 + grad_accum_dtype fp32 (BF16_Optimizer) restores the partition-layout momentum on 0.19.8;
        0.19.7 refuses Muon there at initialize (it would apply no Muon update), naming the stage and the key."""
        run = RUN.with_(stage=1, dtype="bf16", extra=(("data_types", {"grad_accum_dtype": "fp32"}), ))
        if _upstream_0197() and (tmp_path / "expected.pt").exists():
            with pytest.raises(Exception, match="BF16_Optimizer.*grad_accum_dtype fp32 at ZeRO stage 1"):
                load_at(run, tmp_path)
            return
        phase = _round_trip(tmp_path, run)
        if phase is not None:
            assert type(phase[0].optimizer).__name__ == "BF16_Optimizer"
            train_steps(phase[0], run, [SAVE_AFTER])  # the restored state trains (bf16 is not compared with fp32)
            phase[0].destroy()

    @pytest.mark.world_size([2, 1])
    def test_missing_momentum_is_refused(self, tmp_path):
        if save_convert_and_continue(RUN, tmp_path, SETTINGS):
            return
        shutil.copytree(tmp_path / "ckpt" / TAG, tmp_path / "ckpt" / "broken")
        os.remove(state_file(tmp_path / "ckpt" / "broken", "fc2.weight", "momentum_buffer"))
        engine = universal_engine(RUN.with_(stage=2))
        with pytest.raises(ValueError, match="Muon parameter 'fc2.weight' has no momentum_buffer"):
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="broken")
        engine.destroy()


def _upstream_0197():
    from deepspeed.git_version_info import version as deepspeed_version
    from packaging import version
    return version.parse(deepspeed_version).base_version == "0.19.7"


ZERO12_TAG = "zero12"


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
class TestZero12MuonCheckpointConverts(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size, load_stage", [([2, 1], None), ([2, 4], None), ([2, 2], 3)],
                             ids=["2to1", "2to4", "2toZeRO3"])
    def test_resumes_as_the_run_that_never_stopped(self, stage, offload, world_size, load_stage, tmp_path):
        run = RUN.with_(stage=stage, offload=offload)
        if save_convert_and_continue(run, tmp_path):  # tag zero12
            return
        target = run.with_(stage=load_stage, offload=None) if load_stage else run
        continue_training(load_at(target, tmp_path, tag=f"{ZERO12_TAG}_universal"), target,
                          f"ZeRO-{stage} offload={offload} W=2 -> ZeRO-{load_stage or stage} W'={world_size[1]}")


class TestZero12OlderLayoutRefused(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_refused_naming_the_checkpoint(self, tmp_path):
        """An older whole-parameter layout (no ``muon_state_layout``) is refused before anything is written."""
        import deepspeed.comm as dist
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        from muon_testing.models import build_model, is_muon_param
        run = Zero3MuonRun(model="mixed", gas=2, stage=2)
        engine = run.build_engine(run.config(2))
        train_steps(engine, run, range(2))
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag=ZERO12_TAG)
        engine.destroy()
        dist.barrier()
        if dist.get_rank() == 0:
            shapes = [tuple(p.shape) for n, p in build_model("mixed").named_parameters() if is_muon_param(n, p)]
            to_older_zero12_layout(str(tmp_path / "ckpt"), ZERO12_TAG, shapes, 2, None)
            args = ds_to_universal_args(str(tmp_path / "ckpt"), ZERO12_TAG, inject_missing_state=True)
            with pytest.raises(ValueError,
                               match=rf"ds_to_universal: .*{ZERO12_TAG}/\S*optim_states\.pt is of a ZeRO stage 1/2 "
                               "checkpoint of a Muon run saved by stock DeepSpeed or an older build of the Muon "
                               r"patch \(parameter group 0 holds momentum_buffer without the 'muon_state_layout' "
                               "mark; without offload those builds kept the momentum as whole parameters"):
                ds_to_universal(args)
            assert not os.path.exists(os.path.join(args.output_folder, "zero")), "a parameter was written"
        dist.barrier()


class TestZero12BF16OptimizerConverts(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_converts_and_loads_at_zero3(self, tmp_path):
        """BF16_Optimizer (0.19.8) keeps Muon's momentum in the flat partition layout without this build's mark:
        ``ds_to_universal`` converts it bit for bit per Muon matrix, and a ZeRO-3 engine loads it and trains on."""
        from deepspeed.utils import safe_get_full_optimizer_state
        from muon_testing.models import is_muon_param
        if _upstream_0197():
            pytest.skip("0.19.7 refuses Muon with BF16_Optimizer at deepspeed.initialize (test_bf16_optimizer)")
        run = RUN.with_(stage=1, dtype="bf16", extra=(("data_types", {"grad_accum_dtype": "fp32"}), ))
        engine = run.build_engine(run.config(2))
        assert type(engine.optimizer).__name__ == "BF16_Optimizer"
        train_steps(engine, run, range(SAVE_AFTER))
        saved = {
            n: safe_get_full_optimizer_state(p, "momentum_buffer").detach().float().cpu().clone()
            for n, p in engine.module.named_parameters() if is_muon_param(n, p)
        }
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag=ZERO12_TAG)
        engine.destroy()
        out = convert_to_universal(str(tmp_path / "ckpt"), ZERO12_TAG, inject_missing_state=True)
        assert saved
        for name, momentum in saved.items():
            converted = torch.load(os.path.join(out, "zero", name, "momentum_buffer.pt"), weights_only=False)
            assert torch.equal(converted["param"].float().reshape(momentum.shape), momentum), name
        target = run.with_(stage=3, extra=())
        engine = universal_engine(target)
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag=f"{ZERO12_TAG}_universal")
        train_steps(engine, target, [SAVE_AFTER])
        assert all(torch.isfinite(p.detach().float()).all() for p in engine.optimizer.fp32_partitioned_groups_flat)
        engine.destroy()
