# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 Muon end to end on W ranks: gas=4 equals gas=1 on the same 16 samples per step (Muon matrices 9x13 and 5x9,
which W = 2, 4 do not divide), Newton-Schulz runs once per matrix per step over the ranks, and a rank receives on
average 2P(W-1)/W^2 Muon elements per step (P: the matrices' elements, each padded to W partitions), the owner-centric
bound. At W=1 one step is upstream ``muon_update`` by hand on the whole matrices. Under fp16 a dynamic loss scale
growing every step trains the weights of the static scale it starts from, bit for bit.
"""

import contextlib

import pytest
import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon
from unit.common import DistributedTest

SHAPES = [(9, 13), (5, 9)]
SAMPLES, LR, MOMENTUM = 16, 0.02, 0.95
SCALE_POWER = 8
GROWING = dict(enabled=True, loss_scale=0, initial_scale_power=SCALE_POWER, loss_scale_window=1, hysteresis=2)
STATIC = dict(enabled=True, loss_scale=2.0**SCALE_POWER)
TOLERANCE = 2e-6
"""The fp32 floor (``FLOOR``): gas 4 and 1 differ only in the order of fp32 sums, 1.1e-7 to 1.2e-7 measured after 4
steps at W = 1, 2, 4, the hand-applied step 1.0e-8; stock 0.19.7 is off by 1e-1."""


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 9, bias=False), torch.nn.Tanh(), torch.nn.Linear(9, 5, bias=False))


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(SAMPLES, 13, generator=gen), torch.randn(SAMPLES, 5, generator=gen)


def _train(gas, steps, fp16=None):
    """Full weights after ``steps`` steps at ``gas``, and ``[ns_calls, elements_received, optimizer_steps,
    loss_scale]`` summed over the ranks (the final loss scale; 1 without ``fp16``, the config's section)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    micro = SAMPLES // (world_size * gas)
    zero = dict(stage=3, stage3_param_persistence_threshold=0)  # every matrix partitioned, as a large model's
    muon = dict(type="Muon", params=dict(muon_lr=LR, momentum=MOMENTUM, weight_decay=0.0))
    config = dict(train_batch_size=SAMPLES,
                  train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=gas,
                  gradient_clipping=0.0,
                  optimizer=muon,
                  zero_optimization=zero)
    if fp16 is not None:
        config["fp16"] = fp16
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    for step in range(steps):
        x, y = (t.to(engine.device) for t in _batch(step))
        for m in range(gas):
            lo = (m * world_size + rank) * micro
            out = engine(x[lo:lo + micro].to(next(engine.module.parameters()).dtype)).float()
            engine.backward(torch.nn.functional.mse_loss(out, y[lo:lo + micro]))
            engine.step()
    weights = []
    for param in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights.append(param.detach().float().cpu().clone())
    stats = engine.optimizer.muon_update.stats
    loss_scale = float(getattr(engine.optimizer, "loss_scale", 1.0))
    counts = torch.tensor([stats.ns_calls, stats.elements_received, stats.optimizer_steps, loss_scale],
                          dtype=torch.float64,
                          device=engine.device)
    dist.all_reduce(counts)
    engine.destroy()
    return weights, counts.tolist()


def _relative(a, b):
    """``||a - b|| / ||a||`` over all matrices, in float64."""
    a, b = torch.cat([x.double().flatten() for x in a]), torch.cat([y.double().flatten() for y in b])
    return float((a - b).norm() / a.norm())


@contextlib.contextmanager
def _fp16_supported(supported):
    """Report fp16 as ``supported``. False: upstream's "gram" kernel would compute in fp16, hiding the fp32 floor.
    True: the engine refuses fp16 on the CPU accelerator, although fp16 tensors work there."""
    accelerator = get_accelerator()
    original, accelerator.is_fp16_supported = accelerator.is_fp16_supported, lambda: supported
    try:
        yield
    finally:
        accelerator.is_fp16_supported = original


class TestZero3MuonBoundary(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_gas4_equals_gas1_with_one_newton_schulz_per_matrix_and_owner_traffic(self, world_size):
        steps = 4
        with _fp16_supported(False):
            (gas1, counts1), (gas4, counts4) = _train(1, steps), _train(4, steps)
        assert _relative(gas1, gas4) <= TOLERANCE
        assert _relative(gas1, [p.detach() for p in _model().parameters()]) > 1e-3, "the weights must move"
        padded = sum(world_size * -(-rows * cols // world_size) for rows, cols in SHAPES)  # W ceil(n / W)
        for ns_calls, received, optimizer_steps, _ in (counts1, counts4):
            assert ns_calls == len(SHAPES) * steps and optimizer_steps == world_size * steps
            assert received / world_size / steps == 2 * padded * (world_size - 1) / world_size**2

    @pytest.mark.world_size(1)
    def test_one_step_is_upstreams_muon_update_on_the_whole_matrices(self):
        model = _model()
        torch.nn.functional.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
        with _fp16_supported(False):
            expected = [
                p.detach() - LR * original_muon.muon_update(p.grad.clone(), torch.zeros_like(p), beta=MOMENTUM)
                for p in model.parameters()
            ]
            assert _relative(expected, _train(1, 1)[0]) <= TOLERANCE

    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("gas", [1, 2])
    def test_fp16_growing_loss_scale_equals_static(self, gas):
        """The momentum takes each gradient unscaled by its own backward's scale: a power-of-two scale is exact in
        fp16, so a scale grown every step (from 2^8) and the static 2^8 give the same weights (tolerance 0). Unscaled
        by the grown scale instead, the gradients from the second step on would enter the momentum halved."""
        steps = 4
        with _fp16_supported(True):
            growing, growing_counts = _train(gas, steps, GROWING)
            static, static_counts = _train(gas, steps, STATIC)
        world_size = dist.get_world_size()
        assert growing_counts[3] / world_size >= 4 * 2.0**SCALE_POWER, "the scale must grow, or nothing is checked"
        assert static_counts[3] / world_size == 2.0**SCALE_POWER
        assert _relative(static, [p.detach() for p in _model().parameters()]) > 1e-3, "the weights must move"
        for a, b in zip(growing, static):
            assert torch.equal(a, b)
