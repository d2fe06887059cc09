# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint of a ZeRO-3 AdamW run loaded at ZeRO stage 1 or 2.

At W=2 a ZeRO-3 run of MixedMLP with DeepSpeed's AdamW (two parameter groups with their own
learning rate and weight decay) saves after ``SAVE_AFTER`` steps, the checkpoint is converted
with ``ds_to_universal``, and the run trains on for ``MORE`` steps (``zero3_universal_helpers``).
At W' = 1 or 2 a stage-1/2 engine finds the ZeRO-3 run's model-states files
(``zero_pp_rank_0_*``) and accepts its ``optimizer_state.pt`` without ``ds_version``; it must hold
exactly the saved fp32 weights, Adam moments, step and group settings, and the next ``MORE``
steps must follow the ZeRO-3 run to ``CONTINUE_FLOOR``.
"""

import pytest

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import continue_training, universal_round_trip
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(model="mixed", gas=2, groups="two_muon_groups", clip=0.0, optimizer="AdamW")
"""``two_muon_groups`` puts fc1 in a group of its own (lr 0.01, no weight decay); AdamW keeps its
``momentum`` key and does not use it."""

CONTINUE_FLOOR = 1e-6
"""Relative weight difference allowed after each of the ``MORE`` steps between the stage-1/2 run
resumed from the universal checkpoint and the ZeRO-3 run that never stopped: the same math from
bit-identical state, fp32 sums in another order (gradients reduced over another number of ranks
and buckets). A step or a group setting not restored moves the weights by orders of magnitude more."""


class TestZero3UniversalAtZero12(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("stage, load_world_size", [
        pytest.param(2, 1, marks=pytest.mark.world_size([2, 1]), id="stage2-1"),
        pytest.param(1, 2, marks=pytest.mark.world_size([2, 2]), id="stage1-2")
    ])
    def test_restores_exactly_and_continues(self, stage, load_world_size, tmp_path):
        phase = universal_round_trip(RUN, tmp_path, stage)
        if phase is None:
            return
        engine, expected = phase
        differences = continue_training(engine, RUN, expected)
        print(f"AdamW stage {stage} W'={load_world_size}: relative weight differences per step {differences}")
        assert max(differences) < CONTINUE_FLOOR, differences
