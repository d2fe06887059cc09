# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 with fp16: gradients and their norm are unscaled by the loss scale of the step's backward.

Unfixed, ``step()`` updates the dynamic scaler first and unscales by the grown scale, halving gradients and
``get_global_grad_norm()`` on every growth step. ``MixedMLP`` with DeepSpeed's ``AdamW`` (the fix is ZeRO-3's own)
trains with a scale growing every step (``loss_scale_window: 1``, from 2^8) and with static 2^8: a power-of-two scale
is exact in fp16, so norms and weights must be equal (tolerance 0). fp16 on CPU via ``fp16_allowed_on_cpu``.
"""

import pytest
import torch

from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(optimizer="AdamW", dtype="fp16", steps=5)
DYNAMIC = dict(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=1, hysteresis=2, min_loss_scale=1)
INITIAL_SCALE_POWER = DYNAMIC["initial_scale_power"]
STATIC = dict(enabled=True, loss_scale=2.0**INITIAL_SCALE_POWER)


class TestZero3BackwardLossScale(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("gas", [1, 2])
    def test_growing_scale_equals_static_scale(self, gas):
        dynamic = RUN.with_(gas=gas, extra=(("fp16", DYNAMIC), )).train()
        static = RUN.with_(gas=gas, extra=(("fp16", STATIC), )).train()
        # The dynamic scale must really grow during the run, or the test checks nothing.
        assert dynamic.loss_scales[-1] >= 4 * 2.0**INITIAL_SCALE_POWER, dynamic.loss_scales
        assert set(static.loss_scales) == {2.0**INITIAL_SCALE_POWER}
        assert all(n > 0 for n in static.norms)
        assert dynamic.norms == static.norms
        for name in static.weights:
            assert torch.equal(dynamic.weights[name], static.weights[name]), name
