# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint of a ZeRO-3 Muon run loaded at ZeRO stage 1 or 2.

Each test runs twice, with the same ``tmp_path`` (``zero3_universal_helpers``): at W=2 it trains
MixedMLP at ZeRO-3 (two Muon groups with their own momentum, lr and weight decay, and their two
Adam groups), saves after ``SAVE_AFTER`` steps, converts the checkpoint with ``ds_to_universal``,
records the saved state (fp32 masters, momentum, Adam moments and step, group settings) and
trains on without stopping for ``MORE`` steps. At W' (1 or 2) a stage-1/2 engine loads the
universal checkpoint and must hold exactly the saved state, Muon's momentum in the layout stage
1/2 keeps it (``zero12_universal_momentum``), then train the same ``MORE`` steps to the
uninterrupted ZeRO-3 weights within ``CONTINUE_FLOOR``. What does not depend on Muon (the
model-states files and ``optimizer_state.pt`` of a ZeRO-3 source) is tested with AdamW in
``test_zero3_universal_zero12.py``.

The other direction, a checkpoint saved at ZeRO-1/2 converted with ``ds_to_universal``, is refused
for Muon runs, naming the checkpoint and the state (``TestZero12MuonCheckpointConversion``): Muon's
ZeRO-1/2 state is not in the fp32 partition's layout the converter cuts.
"""

import os
import shutil

import inspect

import pytest
import torch
from deepspeed.runtime.zero import stage_1_and_2
from deepspeed.git_version_info import version as deepspeed_version
from packaging import version

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import (GROUP_SETTINGS, SAVE_AFTER, TAG, check_restored_exactly,
                                                     continue_training, load_at, save_convert_and_continue,
                                                     train_steps, universal_round_trip)
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, check_zero12_conversion_refused

UPSTREAM_0197 = version.parse(deepspeed_version).base_version == "0.19.7"
"""DeepSpeed 0.19.7's ZeRO-1/2 Muon advances, per step, only the momentum of the last Muon matrix
of each rank's partition (``_muon_staging_momentum`` copies the committed momentum over the
staging buffer once per matrix), so from the second step after loading it departs from ZeRO-3
(measured 1e-2), as it does without any checkpoint; there, without patch 0012
(``ZERO12_MUON_IN_STEP``), only the first step is held to ``CONTINUE_FLOOR``. It refuses Muon with
its BF16_Optimizer, and refuses to load Muon momentum into ZeRO-1/2 with CPU offload (which kept
none before patch 0012)."""

RUN = Zero3MuonRun(model="mixed", gas=2, groups="two_muon_groups", clip=0.0)
ZERO12_MUON_IN_STEP = "Zero12MuonUpdate" in inspect.getsource(stage_1_and_2)
"""Patch 0012 (``zero12_update``) is installed: ZeRO-1/2 run Muon in ``step()`` and advance every
matrix's momentum, on 0.19.7 too."""

SETTINGS = GROUP_SETTINGS + ("use_muon", "momentum", "ns_method")
"""Parameter-group settings compared after loading: Adam's and Muon's."""

CONTINUE_FLOOR = 1e-6
"""Relative weight difference (``relative_difference``, all parameters) allowed after each of the
``MORE`` steps between the ZeRO-1/2 run resumed from the universal checkpoint and the ZeRO-3 run
that never stopped. Both start from bit-identical state and compute the same math; they differ
only in the order of fp32 sums (gradients reduced over another number of ranks and buckets,
Newton-Schulz on every rank holding part of a matrix instead of once on its owner). Measured on
0.19.8: 1.2e-7 after the first step and 1.74e-7 after the second (stage 1 or 2 at W'=1, stage 1
at W'=2), 0.0 and 9.0e-11 at stage 2, W'=2; the bound is about 6x the largest. A momentum
restarted at zero or read at wrong offsets moves the weights by orders of magnitude more (0.19.7's
stale momentum of all but one matrix per partition: 1e-2 after the second step)."""


def check_momentum_restored(engine, expected):
    """Muon's momentum as the stage will use it (``momentum_by_name``): bit-identical to the saved
    one, every Muon matrix's held by some rank."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.muon.zero12_universal_momentum import momentum_by_name
    momentum = momentum_by_name(engine.optimizer)
    for name, value in momentum.items():
        saved = expected["state"][name]["momentum_buffer"]
        assert torch.equal(value, saved if value.shape == saved.shape else _fragment(engine, name, saved)), name
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(momentum))
    muon_names = {n for n, s in expected["state"].items() if "momentum_buffer" in s}
    assert set().union(*map(set, held)) == muon_names


def _fragment(engine, name, full):
    """This rank's partition-layout fragment of parameter ``name``'s ``full`` tensor, flat."""
    param = dict(engine.module.named_parameters())[name]
    address = param._hp_mapping.lp_fragment_address
    return full.reshape(-1).narrow(0, address.start, address.numel)


def _round_trip(run, tmp_path, stage):
    """``universal_round_trip`` with Muon's settings and momentum checked too."""
    phase = universal_round_trip(run, tmp_path, stage, SETTINGS)
    if phase is not None:
        check_momentum_restored(*phase)
    return phase


def _load_and_check(run, tmp_path):
    engine, expected = load_at(run, tmp_path)
    check_restored_exactly(engine, expected, SETTINGS)
    check_momentum_restored(engine, expected)
    return engine, expected


class TestZero3MuonUniversalAtZero12(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2])
    @pytest.mark.parametrize("load_world_size",
                             [pytest.param(w, marks=pytest.mark.world_size([2, w])) for w in (1, 2)])
    def test_restores_exactly_and_continues(self, stage, load_world_size, tmp_path):
        phase = _round_trip(RUN, tmp_path, stage)
        if phase is None:
            return
        engine, expected = phase
        differences = continue_training(engine, RUN, expected)
        print(f"stage {stage} W'={load_world_size}: relative weight differences per step {differences}")
        held = differences[:1] if UPSTREAM_0197 and not ZERO12_MUON_IN_STEP else differences
        assert max(held) < CONTINUE_FLOOR, differences

    @pytest.mark.world_size([2, 2])
    def test_bf16_optimizer(self, tmp_path):
        """bf16 with data_types.grad_accum_dtype fp32 at stage 1 is DeepSpeed's BF16_Optimizer. On
        0.19.8 it keeps Muon's momentum in the partition layout, which upstream's loader restores;
        0.19.7 refuses Muon with BF16_Optimizer at deepspeed.initialize (it would apply no Muon
        update), naming the stage and the key."""
        run = RUN.with_(stage=1, dtype="bf16", extra=(("data_types", {"grad_accum_dtype": "fp32"}), ))
        if not (tmp_path / "expected.pt").exists():
            save_convert_and_continue(RUN, tmp_path, SETTINGS)
            return
        if UPSTREAM_0197:
            with pytest.raises(Exception, match="BF16_Optimizer.*grad_accum_dtype fp32 at ZeRO stage 1"):
                load_at(run, tmp_path)
            return
        engine, expected = _load_and_check(run, tmp_path)
        assert type(engine.optimizer).__name__ == "BF16_Optimizer"
        train_steps(engine, run, [SAVE_AFTER])  # the restored state trains (bf16 is not compared with fp32)
        engine.destroy()

    @pytest.mark.world_size([2, 2])
    def test_cpu_offload(self, tmp_path):
        """ZeRO-2 with offload_optimizer cpu (reduce_scatter off, which stock 0.19.7 needs for Muon with
        offload). On 0.19.8 it keeps the momentum in the partition layout: restored exactly, and
        the next steps continue the ZeRO-3 run; on 0.19.7 it keeps none, and loading is refused."""
        run = RUN.with_(stage=2, offload="cpu", zero=(("reduce_scatter", False), ))
        if not (tmp_path / "expected.pt").exists():
            save_convert_and_continue(RUN, tmp_path, SETTINGS)
            return
        if UPSTREAM_0197:
            with pytest.raises(ValueError, match="ZeRO stage 2 with zero_optimization.offload_optimizer"):
                load_at(run, tmp_path)
            return
        engine, expected = _load_and_check(run, tmp_path)
        differences = continue_training(engine, run, expected)
        print(f"offload: relative weight differences per step {differences}")
        assert max(differences) < CONTINUE_FLOOR, differences

    @pytest.mark.world_size([2, 1])
    def test_missing_momentum_is_refused(self, tmp_path):
        import deepspeed.comm as dist
        if not (tmp_path / "expected.pt").exists():
            save_convert_and_continue(RUN, tmp_path, SETTINGS)
            return
        broken = tmp_path / "ckpt" / "broken"
        shutil.copytree(tmp_path / "ckpt" / TAG, broken)
        os.remove(broken / "zero" / "fc2.weight" / "momentum_buffer.pt")
        dist.barrier()
        config = RUN.with_(stage=2).config(dist.get_world_size())
        config["checkpoint"] = {"load_universal": True}
        engine = RUN.with_(stage=2).build_engine(config)
        with pytest.raises(ValueError, match="Muon parameter 'fc2.weight' has no momentum_buffer"):
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="broken")
        engine.destroy()


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
class TestZero12MuonCheckpointConversion(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_refused_naming_the_state(self, stage, offload, tmp_path):
        """A ZeRO-1/2 Muon checkpoint (momentum in whole parameters of the partition, or with
        offload in the partition) is refused by ``ds_to_universal`` with a ``ValueError`` naming the
        checkpoint, the rank and the Muon state, before it writes any parameter, instead of
        upstream's ``KeyError: 'exp_avg'``."""
        run = RUN.with_(stage=stage, offload=offload, zero=(("reduce_scatter", False), ) if offload else ())
        check_zero12_conversion_refused(run, tmp_path, "momentum_buffer")
