# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon on a matrix whose gradient is tiny or hard-clipped (docs/user-guide.md, "Tiny or hard-clipped gradients").

Newton-Schulz divides its input X (Nesterov mix of gradient and momentum) by ``||X||_F + 1e-7`` (upstream's kernels;
Jordan et al., "Muon", 2024). Once ``||X||_F`` is well below 1e-7, five iterations (each scaling a small singular
value by at most 3.4445) cannot bring the singular values near 1: the update shrinks in proportion to ``||X||_F`` and
stops being orthogonal, on one process as under ZeRO-3. The tests pin both and print the sizes the user guide quotes:

- ``test_update_size_against_input_norm``: a 64x48 Gaussian gradient G, scaled, through upstream ``muon_update``
  (fresh momentum, beta 0.95, fp32 NS): update size relative to G's against ``||X||_F``. Measured 1.003 at 5.4e-6, 1.07
  at 5.4e-8, 0.98 at 1.6e-9, 0.42 at 5.4e-10, 0.043 at 5.4e-11, 0.0043 at 5.4e-12.
- ``test_hard_clip_shrinks_muon_steps_as_on_one_process``: ZeRO-3, W=2, ``gradient_clipping`` 1e-11 on raw norms of
  2.6: the Muon weights' change (weight decay out) equals the single-process reference's (``clip_grad_norm_`` then
  ``muon_update``) to the weights' fp32 rounding (measured: 0), under 1% of the unclipped run's (measured 6.6e-4).
"""

import torch

from unit.common import DistributedTest
from muon_testing.compare import relative_difference
from muon_testing.models import HYPER, build_model, is_muon_param
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

SCALES = (1.0, 1e-6, 1e-8, 3e-10, 1e-10, 1e-11, 1e-12)
BETA = 0.95
HARD_CLIP = 1e-11
"""gradient_clipping of the hard-clipped run: raw norms are 2.6, so each Newton-Schulz input's norm is below 1e-11."""
RUN = Zero3MuonRun(model="mixed", gas=2, steps=2)


def _update(grad):
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    return muon_update(grad.clone(), torch.zeros_like(grad), beta=BETA)


def _ns_input_norm(grad):
    """``||X||_F`` of the first step's Newton-Schulz input (momentum from zero, Nesterov)."""
    momentum = torch.zeros_like(grad).lerp_(grad, 1 - BETA)
    return float(grad.lerp(momentum, BETA).norm())


def test_update_size_against_input_norm():
    grad = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    with fp32_newton_schulz():
        full = _update(grad).norm()
        sizes = {s: (_ns_input_norm(grad * s), float(_update(grad * s).norm() / full)) for s in SCALES}
    for s, (x_norm, ratio) in sizes.items():
        print(f"gradient x {s:.0e}: ||X||_F {x_norm:.2e}, update size / unscaled {ratio:.4f}")
    assert all(abs(ratio - 1.0) < 0.01 for x_norm, ratio in sizes.values() if x_norm >= 1e-6)
    # Below the guard the update shrinks in proportion to ||X||_F (to within a factor 2 here).
    tiny = [(x_norm, ratio) for x_norm, ratio in sizes.values() if x_norm <= 1e-10]
    assert tiny and all(ratio < 0.05 for _, ratio in tiny)
    (x_big, r_big), (x_small, r_small) = tiny[0], tiny[-1]
    assert 0.5 < (r_big / r_small) / (x_big / x_small) < 2.0


def _muon_change(weights, initial):
    """Per Muon matrix, the weights' change by Muon's updates, with decoupled weight decay's share taken out."""
    decayed = (1 - HYPER["muon_lr"] * HYPER["weight_decay"])**RUN.steps
    return {n: torch.as_tensor(weights[n]) - p * decayed for n, p in initial.items()}


class TestZero3MuonTinyGradients(DistributedTest):
    world_size = 2

    def test_hard_clip_shrinks_muon_steps_as_on_one_process(self):
        initial = {n: p.detach().clone() for n, p in build_model(RUN.model).named_parameters() if is_muon_param(n, p)}
        clipped = RUN.with_(clip=HARD_CLIP).train()
        free = RUN.train()
        ref_weights, norms = RUN.with_(clip=HARD_CLIP).reference()
        change = _muon_change(clipped.weights, initial)
        reference_change = _muon_change(ref_weights, initial)
        free_change = _muon_change(free.weights, initial)
        size = sum(float(d.norm()**2) for d in change.values())**0.5
        free_size = sum(float(d.norm()**2) for d in free_change.values())**0.5
        difference = relative_difference(reference_change, change)
        weights_size = sum(float(torch.as_tensor(clipped.weights[n]).norm()**2) for n in initial)**0.5
        # The change is a difference of two fp32 weights: its rounding relative to it is eps * ||w|| / ||change||.
        rounding = torch.finfo(torch.float32).eps * weights_size / size
        report = (f"raw gradient norms {norms}; clipped Muon step / unclipped {size / free_size:.2e}; "
                  f"Muon weight change vs reference {difference:.2e} (fp32 rounding of the weights relative to "
                  f"the change {rounding:.2e})")
        print(report)
        assert size > 0.0, report
        assert size / free_size < 0.01, report
        assert difference <= rounding, report
