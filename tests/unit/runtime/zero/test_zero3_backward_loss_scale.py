# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 with fp16: gradients and their norm are unscaled by the loss scale of the step's backward.

With a dynamic loss scale, ``step()`` first updates the scaler (which grows the scale after
``loss_scale_window`` steps without overflow) and then unscales. Unscaling by the grown scale
divided the gradients, and the norm ``get_global_grad_norm()`` reports, by twice the scale they
were computed with, on every step where the scale grew.

The test trains the same model (``MixedMLP``, DeepSpeed's ``AdamW``: the fix is ZeRO-3's own)
twice: with a dynamic scale that grows on every step (``loss_scale_window: 1``, from 2^8) and with
the static scale 2^8. Multiplying the loss by a
power of two multiplies every fp16 gradient by that power exactly (no overflow or underflow at
these magnitudes), so once the gradients are divided by the scale they were computed with, both
runs see the same gradients bit for bit: the reported norms and the weights must be equal
(tolerance 0). Without the fix, the norms on growth steps are half the static run's and the
weights drift apart (checked: the norms differ).

fp16 on the CPU accelerator: DeepSpeed refuses fp16 where ``is_fp16_supported()`` is false,
although fp16 tensors work on the CPU; the test claims support while the engine is built
(``fp16_allowed_on_cpu``; other accelerators have it).
"""

import pytest
import torch

from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

INITIAL_SCALE_POWER = 8
RUN = Zero3MuonRun(optimizer="AdamW", dtype="fp16", steps=5)
DYNAMIC = dict(enabled=True,
               loss_scale=0,
               initial_scale_power=INITIAL_SCALE_POWER,
               loss_scale_window=1,
               hysteresis=2,
               min_loss_scale=1)
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
