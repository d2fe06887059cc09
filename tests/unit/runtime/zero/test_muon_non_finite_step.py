# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A step whose gradients are not finite never moves Muon's momentum, at ZeRO-3 and at ZeRO-1/2.

ZeRO-3: the stage skips the step before the sub-group loop (an invalid norm counts as an overflow, on 0.19.7 too for
Muon): the weights stay and the step counts as skipped. ZeRO-1/2: the Muon binding agrees one finite flag per group
and holds the update back (momentum stays, matrices take only weight decay, never the raw gradient), so pieces keep
their values where the stage skipped (0.19.8 always here) or take weight-decayed values where it stepped.

W gloo ranks, fp32, with and without clipping and offload: a good step, then one with a nan input; the momentum must
stay exactly, the weights as above; the next step trains on.
"""
import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from muon_testing.models import build_model
from unit.runtime.zero.zero3_muon_helpers import ds_config, momentum_tensors, train_one_step


def _muon_pieces(update):
    """ZeRO-1/2: each rank's pieces of the Muon matrices in its fp32 partitions, with their groups."""
    return [(p.flat.narrow(0, s, n), p.group_index) for p in update.partitions.values() for s, n in p.slices]


class TestMuonNonFiniteStep(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,offload,clip", [(3, None, 0.0), (3, "cpu", 1.0), (2, None, 0.0), (2, None, 1.0),
                                                    (2, "cpu", 1.0), (1, None, 0.0)])
    def test_nan_gradient_leaves_the_momentum(self, stage, offload, clip):
        zero = {"offload_optimizer": {"device": offload}} if offload else {}
        config = ds_config(stage, 1, self.world_size, clip=clip, zero_extra=zero)
        net = build_model("mixed")
        engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))
        train_one_step(engine, 0)
        if stage == 3:
            unchanged = [p.detach().clone() for p in engine.optimizer.fp32_partitioned_groups_flat]
        else:
            groups = engine.optimizer.optimizer.param_groups
            pieces = _muon_pieces(engine.optimizer.muon_update)
            unchanged = [m.clone() for m, _ in pieces]
            decayed = [m.clone().mul_(1 - groups[g]["lr"] * groups[g]["weight_decay"]) for m, g in pieces]
        skipped = engine.skipped_steps
        before = momentum_tensors(engine)
        assert before and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in before), "a good first step"
        train_one_step(engine, 1, poison=True)
        after = momentum_tensors(engine)
        assert len(after) == len(before)
        for b, a in zip(before, after):
            assert torch.equal(a.to(b.device), b), "the momentum must not take a non-finite gradient in"
        if stage == 3:
            assert engine.skipped_steps == 1
            for w, p in zip(unchanged, engine.optimizer.fp32_partitioned_groups_flat):
                assert torch.equal(w, p.detach()), "ZeRO-3 skips the step"
        else:
            # the stage skipped the step (an overflow it detects) or stepped on the held-back, zero update
            expected = unchanged if engine.skipped_steps > skipped else decayed
            masters = [m for m, _ in _muon_pieces(engine.optimizer.muon_update)]
            assert expected and all(torch.equal(m, e)
                                    for m, e in zip(masters, expected)), "no step but the weight decay"
        train_one_step(engine, 2)
        assert all(torch.isfinite(m).all() for m in momentum_tensors(engine)), "training goes on"
