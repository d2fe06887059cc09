# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A step whose gradients are not finite never moves Muon's momentum, at every ZeRO stage.

The distributed core carries no per-matrix finite flag. ZeRO-3 skips such a step before the
sub-group loop (0.19.8 counts an invalid norm as an overflow; the patch gives 0.19.7's ZeRO-3
the same rule for Muon), so the update is never reached; ZeRO-1/2 do not always skip (e.g. bf16
without an overflow check, or no norm when nothing is clipped), so their binding agrees one flag
per group. Here, on W gloo ranks, fp32: one good step, then a step whose inputs hold a nan.
The momentum after it must equal the momentum before it exactly and be finite; at ZeRO-3 the
weights must be unchanged too and the step counted as skipped.
"""

import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import build_model, ds_config, loss_fn, step_batch


def _momenta(engine):
    """Every Muon momentum tensor in the optimizer state, cloned, in state order."""
    return [
        s["momentum_buffer"].detach().clone() for s in engine.optimizer.optimizer.state.values()
        if "momentum_buffer" in s
    ]


def _step(engine, step, poison=False):
    x, y = step_batch("mixed", step)
    mb = engine.train_micro_batch_size_per_gpu()
    rank = engine.global_rank
    x, y = x[rank * mb:(rank + 1) * mb].clone(), y[rank * mb:(rank + 1) * mb]
    if poison:
        x[0, 0] = float("nan")
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()


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
        _step(engine, 0)
        before = _momenta(engine)
        assert before and all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in before), "a good first step"
        weights = [p.detach().clone() for p in engine.optimizer.fp32_partitioned_groups_flat] if stage == 3 else None
        _step(engine, 1, poison=True)
        after = _momenta(engine)
        assert len(after) == len(before)
        for b, a in zip(before, after):
            assert torch.equal(a.to(b.device), b), "the momentum must not take a non-finite gradient in"
        if stage == 3:
            assert engine.skipped_steps == 1
            for w, p in zip(weights, engine.optimizer.fp32_partitioned_groups_flat):
                assert torch.equal(w, p.detach()), "ZeRO-3 skips the step"
        _step(engine, 2)
        assert all(torch.isfinite(m).all() for m in _momenta(engine)), "training goes on"
