# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A step whose gradients are not finite never moves Muon's momentum at ZeRO-1/2.

ZeRO-1/2 do not always skip such a step (bf16 without an overflow check, or no norm at all when
nothing is clipped and nothing offloaded), so their Muon binding agrees one flag per group and
leaves the gradient and the momentum alone where it is not finite. Here, on W gloo ranks, fp32:
one good step, then a step whose inputs hold a nan; the momentum after it must equal the momentum
before it exactly and be finite, with and without clipping and offload; the next step trains on.
"""
import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import build_model, ds_config, momentum_tensors, train_one_step


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
        before = momentum_tensors(engine)
        assert before and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in before), "a good first step"
        train_one_step(engine, 1, poison=True)
        after = momentum_tensors(engine)
        assert len(after) == len(before)
        for b, a in zip(before, after):
            assert torch.equal(a.to(b.device), b), "the momentum must not take a non-finite gradient in"
        train_one_step(engine, 2)
        assert all(torch.isfinite(m).all() for m in momentum_tensors(engine)), "training goes on"
