# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 with fp16: gradients and their norm are unscaled by the loss scale of the step's backward.

``step()`` first updates the dynamic scaler, then unscales: by the grown scale, twice the one the gradients (and the
norm ``get_global_grad_norm()`` reports) were computed with, on every step where the scale grew.

The same model (``MixedMLP``, DeepSpeed's ``AdamW``: the fix is ZeRO-3's own) is trained with a dynamic scale that
grows on every step (``loss_scale_window: 1``, from 2^8) and with the static scale 2^8. A power-of-two loss scale
multiplies every fp16 gradient exactly (no overflow or underflow at these magnitudes), so once unscaled both runs see
the same gradients bit for bit: norms and weights must be equal (tolerance 0). Without the fix the norms on growth
steps are half the static run's (checked: the norms differ). fp16 on the CPU: ``fp16_allowed_on_cpu``.
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
