# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 fp16: Muon's momentum gets the gradient divided by its backward's loss scale, also when the scale grows.

A power-of-two scale is exact in fp16, so a dynamic scale doubling every step (``loss_scale_window`` 1, from 2^8) and
static 2^8 must give bit-identical momenta and weights. Dividing after ``_update_scale`` (as upstream
``stage_1_and_2.py`` does) halves the gradient of every growth step.
"""

import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from muon_testing.models import build_model
from unit.runtime.zero.zero3_muon_helpers import ds_config, fp16_allowed_on_cpu, momentum_tensors, train_one_step

STEPS = 4
INITIAL_SCALE_POWER = 8


def _train(stage, fp16, world_size):
    config = ds_config(stage, 1, world_size)
    config["fp16"] = dict(enabled=True, **fp16)
    net = build_model("mixed")
    with fp16_allowed_on_cpu():  # the CPU accelerator reports fp16 only where oneDNN has it
        engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))
    scales = []
    for step in range(STEPS):
        train_one_step(engine, step)
        scales.append(engine.optimizer.loss_scale)
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    momenta = momentum_tensors(engine)
    engine.destroy()
    return scales, weights, momenta


class TestZero12MuonLossScale(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2])
    def test_growing_scale_equals_static_scale(self, stage):
        grown_scales, grown, grown_momenta = _train(
            stage, dict(loss_scale=0, initial_scale_power=INITIAL_SCALE_POWER, loss_scale_window=1, hysteresis=1),
            self.world_size)
        static_scales, static, static_momenta = _train(stage, dict(loss_scale=2**INITIAL_SCALE_POWER), self.world_size)
        assert grown_scales[-1] > grown_scales[0] and set(static_scales) == {2**INITIAL_SCALE_POWER}, grown_scales
        assert len(grown_momenta) == len(static_momenta) > 0
        for a, b in zip(grown_momenta, static_momenta):
            assert torch.equal(a, b), "the momentum took a gradient unscaled by another loss scale"
        for name in static:
            assert torch.equal(grown[name], static[name]), name
