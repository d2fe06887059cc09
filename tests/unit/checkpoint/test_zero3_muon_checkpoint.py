# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Checkpoints: save at step 3, load into a fresh engine, and continue to step 6 bit-identically to an uninterrupted
run, momentum included, W=2, gas=2, in fp32, bf16 and CPU offload; and late, at step 15 of 16 (fp32). A bf16 momentum,
as stock 0.19.8 writes it, loads upcast and trains on.

Elsewhere auxiliary Adam parameters can differ by an ulp after a late resume: upstream's CPU Adam kernel
(``cpu_adam.h``, ``Adam_Optimizer::IncrementStep``) accumulates beta**step by one fp32 product per step but recomputes
it with ``std::pow`` when the step jumps, as after ``load_checkpoint``. If only 1-D parameters fail, this is the cause.
"""

import numpy as np
import pytest

from unit.common import DistributedTest
from muon_testing.compare import relative_difference
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

FP32 = Zero3MuonRun(gas=2, steps=6)
SETTINGS = dict(fp32=FP32, bf16=FP32.with_(dtype="bf16"), offload=FP32.with_(offload="cpu"), late=FP32.with_(steps=16))
RESTART = {"fp32": 3, "bf16": 3, "offload": 3, "late": 15}


def resume_is_bit_identical(name, tmp_path):
    """``SETTINGS[name]`` restarted at ``RESTART[name]`` ends with bit-identical weights and norms; momentum fp32."""
    run = SETTINGS[name]
    straight = run.train()
    restarted = run.with_(restart_after=RESTART[name]).train(checkpoint_dir=str(tmp_path))
    for key in straight.weights:
        assert np.array_equal(straight.weights[key], restarted.weights[key]), key
    assert straight.norms == restarted.norms
    assert restarted.final_momentum_dtypes == ["torch.float32"]


class TestZero3MuonCheckpoint(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("name",
                             [pytest.param(n, marks=[pytest.mark.core] if n == "fp32" else []) for n in SETTINGS])
    def test_resume_is_bit_identical(self, name, tmp_path):
        resume_is_bit_identical(name, tmp_path)

    def test_bf16_momentum_from_a_stock_checkpoint_is_upcast_and_trains(self, tmp_path):
        run = SETTINGS["bf16"]
        straight = run.train()  # stock allocates the momentum in the communication dtype, bf16 here
        upcast = run.with_(restart_after=RESTART["bf16"], momentum_to_bf16=True).train(checkpoint_dir=str(tmp_path))
        assert upcast.final_momentum_dtypes == ["torch.float32"]
        difference = relative_difference(straight.weights, upcast.weights)
        # The momentum lost its low bits once (bf16 keeps 8 of fp32's 24), so the runs part a little.
        assert 0 < difference < 1e-2


class TestZero3MuonMomentumOfAnotherSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_refused_at_the_next_step(self):
        """A momentum of another partitioning's size stops the step with an error rather than being zeroed."""
        import deepspeed
        from muon_testing.models import build_model
        from unit.runtime.zero.zero3_muon_helpers import ds_config, train_one_step
        net = build_model("mixed")
        engine, *_ = deepspeed.initialize(model=net,
                                          config=ds_config(3, 1, self.world_size),
                                          model_parameters=list(net.parameters()))
        train_one_step(engine, 0)
        state = engine.optimizer.optimizer.state
        held = [s for s in state.values() if "momentum_buffer" in s]
        assert held, "Muon keeps its momentum in the optimizer state"
        held[0]["momentum_buffer"] = held[0]["momentum_buffer"][:-1].clone()
        with pytest.raises(RuntimeError, match="another partitioning.*load_universal"):
            train_one_step(engine, 1)


class TestZero3MuonCheckpointOneRank(DistributedTest):
    """The same at W=1 (on the accelerator where there is one)."""
    world_size = 1

    @pytest.mark.parametrize("name", ["fp32", "bf16"])
    def test_resume_is_bit_identical(self, name, tmp_path):
        resume_is_bit_identical(name, tmp_path)
