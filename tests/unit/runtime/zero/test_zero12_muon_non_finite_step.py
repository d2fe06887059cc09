# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A step whose gradients are not finite never moves Muon's momentum at ZeRO-1/2.

The Muon binding does not rely on the stage's overflow check: at ZeRO-1/2 it agrees one flag per
group and holds the update back where a gradient is not finite (the momentum stays; the Muon
matrices take no step but their weight decay, never the raw gradient). Here, on W gloo ranks,
fp32: one good step, then a step whose inputs hold a nan; the momentum after it must equal the
momentum before it exactly, and each rank's pieces of the Muon matrices their values before it
where the stage skipped the step (0.19.8 does in every case here) or their weight-decayed values
where it stepped, with and without clipping and offload; the next step trains on.
"""
import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from muon_testing.models import build_model
from unit.runtime.zero.zero3_muon_helpers import ds_config, momentum_tensors, train_one_step


class TestZero12MuonNonFiniteStep(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,offload,clip", [(2, None, 0.0), (2, None, 1.0), (2, "cpu", 1.0), (1, None, 0.0)])
    def test_nan_gradient_leaves_the_momentum(self, stage, offload, clip):
        zero = {"offload_optimizer": {"device": offload}} if offload else {}
        config = ds_config(stage, 1, self.world_size, clip=clip, zero_extra=zero)
        net = build_model("mixed")
        engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))
        train_one_step(engine, 0)
        update = engine.optimizer.muon_update
        groups = engine.optimizer.optimizer.param_groups
        unchanged = [p.flat.narrow(0, s, n).clone() for p in update.partitions.values() for s, n in p.slices]
        decayed = [
            m.clone().mul_(1 - groups[p.group_index]["lr"] * groups[p.group_index]["weight_decay"])
            for p, m in zip((p for p in update.partitions.values() for _ in p.slices), unchanged)
        ]
        skipped = engine.skipped_steps
        before = momentum_tensors(engine)
        assert before and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in before), "a good first step"
        train_one_step(engine, 1, poison=True)
        after = momentum_tensors(engine)
        assert len(after) == len(before)
        for b, a in zip(before, after):
            assert torch.equal(a.to(b.device), b), "the momentum must not take a non-finite gradient in"
        # the stage skipped the step (an overflow it detects) or stepped on the held-back, zero update
        expected = unchanged if engine.skipped_steps > skipped else decayed
        masters = [p.flat.narrow(0, s, n) for p in update.partitions.values() for s, n in p.slices]
        assert expected and all(torch.equal(m, e) for m, e in zip(masters, expected)), "no step but the weight decay"
        train_one_step(engine, 2)
        assert all(torch.isfinite(m).all() for m in momentum_tensors(engine)), "training goes on"
