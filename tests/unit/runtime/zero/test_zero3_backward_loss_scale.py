# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 with fp16: gradients and their norm are unscaled by the loss scale of the step's backward.

With a dynamic loss scale, ``step()`` first updates the scaler (which grows the scale after
``loss_scale_window`` steps without overflow) and then unscales. Unscaling by the grown scale
divided the gradients, and the norm ``get_global_grad_norm()`` reports, by twice the scale they
were computed with, on every step where the scale grew.

The test trains the same model twice: with a dynamic scale that grows on every step
(``loss_scale_window: 1``, from 2^8) and with the static scale 2^8. Multiplying the loss by a
power of two multiplies every fp16 gradient by that power exactly (no overflow or underflow at
these magnitudes), so once the gradients are divided by the scale they were computed with, both
runs see the same gradients bit for bit: the reported norms and the weights must be equal
(tolerance 0). Without the fix, the norms on growth steps are half the static run's and the
weights drift apart.

fp16 on the CPU accelerator: DeepSpeed refuses fp16 where ``is_fp16_supported()`` is false,
although fp16 tensors work on the CPU; the test claims support while the engine is built
(``fp16_allowed_on_cpu``; other accelerators have it).
"""

import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import fp16_allowed_on_cpu

STEPS = 5
SAMPLES = 16
INITIAL_SCALE_POWER = 8


def new_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6))


def step_batch(step):
    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randn(SAMPLES, 12, generator=generator), torch.randn(SAMPLES, 6, generator=generator)


def train(fp16_section, gas):
    """Train STEPS steps; returns (loss scale of each step's backward, reported norms, weights)."""
    world_size, rank = deepspeed.comm.get_world_size(), deepspeed.comm.get_rank()
    micro = SAMPLES // (world_size * gas)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 0.01
            }
        },
        "gradient_clipping": 0.0,
        "fp16": dict(enabled=True, **fp16_section),
        "zero_optimization": {
            "stage": 3
        },
    }
    model = new_model()
    with fp16_allowed_on_cpu():
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = engine.device
    scales, norms = [], []
    for step in range(STEPS):
        x, y = step_batch(step)
        scales.append(float(engine.optimizer.loss_scale))
        for m in range(gas):
            start = (m * world_size + rank) * micro
            out = engine(x[start:start + micro].to(device, torch.float16))
            loss = torch.nn.functional.mse_loss(out.float(), y[start:start + micro].to(device))
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights[name] = param.detach().float().cpu().clone()
    return scales, norms, weights


class TestZero3BackwardLossScale(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("gas", [1, 2])
    def test_growing_scale_equals_static_scale(self, gas):
        dynamic = train(
            dict(loss_scale=0,
                 initial_scale_power=INITIAL_SCALE_POWER,
                 loss_scale_window=1,
                 hysteresis=2,
                 min_loss_scale=1), gas)
        static = train(dict(loss_scale=2.0**INITIAL_SCALE_POWER), gas)
        dynamic_scales, dynamic_norms, dynamic_weights = dynamic
        static_scales, static_norms, static_weights = static
        # The dynamic scale must really grow during the run, or the test checks nothing.
        assert dynamic_scales[-1] >= 4 * dynamic_scales[0], dynamic_scales
        assert set(static_scales) == {2.0**INITIAL_SCALE_POWER}
        assert all(n > 0 for n in static_norms)
        assert dynamic_norms == static_norms
        for name in static_weights:
            assert torch.equal(dynamic_weights[name], static_weights[name]), name
