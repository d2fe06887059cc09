# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A step whose gradients are not finite never moves Muon's momentum or the weights at ZeRO-3.

The distributed core carries no per-matrix finite flag: ZeRO-3 skips such a step before the
sub-group loop (0.19.8 counts an invalid norm as an overflow; the patch gives 0.19.7's ZeRO-3 the
same rule for Muon), so the update is never reached. Here, on W gloo ranks, fp32: one good step,
then a step whose inputs hold a nan. The momentum and the weights after it must equal those
before it exactly, and the step counts as skipped; the next step trains on.
"""
import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from muon_testing.models import build_model
from unit.runtime.zero.zero3_muon_helpers import ds_config, momentum_tensors, train_one_step


class TestZero3MuonNonFiniteStep(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,offload,clip", [(3, None, 0.0), (3, "cpu", 1.0)])
    def test_nan_gradient_leaves_the_momentum(self, stage, offload, clip):
        zero = {"offload_optimizer": {"device": offload}} if offload else {}
        config = ds_config(stage, 1, self.world_size, clip=clip, zero_extra=zero)
        net = build_model("mixed")
        engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))
        train_one_step(engine, 0)
        before = momentum_tensors(engine)
        assert before and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in before), "a good first step"
        weights = [p.detach().clone() for p in engine.optimizer.fp32_partitioned_groups_flat]
        train_one_step(engine, 1, poison=True)
        after = momentum_tensors(engine)
        assert len(after) == len(before)
        for b, a in zip(before, after):
            assert torch.equal(a.to(b.device), b), "the momentum must not take a non-finite gradient in"
        assert engine.skipped_steps == 1
        for w, p in zip(weights, engine.optimizer.fp32_partitioned_groups_flat):
            assert torch.equal(w, p.detach()), "ZeRO-3 skips the step"
        train_one_step(engine, 2)
        assert all(torch.isfinite(m).all() for m in momentum_tensors(engine)), "training goes on"
