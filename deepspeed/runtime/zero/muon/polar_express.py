# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Polar Express: Muon's orthogonalization with a new quintic polynomial at every iteration.

Source: Amsel, Persson, Musco, Gower, 2025, "The Polar Express: Optimal Matrix Sign Methods and Their Application to
the Muon Algorithm", arXiv:2505.16932, Algorithm 1. Coefficients, safety factor and normalization are the authors'
code's (NoahAmsel/PolarExpress ``polar_express/basic.py``, commit 7f0fb5730e3d5946f96b07404bbe476515f2caec):
``optimal_composition(l=1e-3, num_iters=8, safety_factor_eps=1e-2, cushion=0.02)``, each polynomial the minimax-optimal
odd quintic approximation of ``sign`` on the interval the previous ones leave, for singular values down to 1e-3 of the
normalized matrix's largest. (modded-nanogpt and nanochat ship a different 5-tuple schedule, first tuple
``(8.156554524902461, -22.48329292557795, 15.878769915207462)``, not used here.)

Like upstream's ``zeropower_via_newtonschulz5``, iteration ``t`` maps ``X <- a_t X + b_t (X X^T) X + c_t (X X^T)^2 X``
on the wide orientation, but where upstream repeats one ``(a, b, c)`` that stops short of 1 (singular values in about
[0.7, 1.2]), this schedule changes per iteration, so they converge to 1. Products, compute dtype (``ns_compute_dtype``:
bf16 where supported, as the authors run it) and the aspect-ratio scale (``muon_orthogonalize``) are as "standard".
"""

from typing import List, Tuple

import torch

from deepspeed.runtime import compiler

NS_METHOD = "polar_express"
"""The ``ns_method`` of a Muon parameter group that selects this iteration."""

PUBLISHED_COEFFICIENTS: Tuple[Tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
"""``(a, b, c)`` of iterations 1 to 8 before the safety factor, as published. The last is the schedule's limit (the
optimal quintic on an interval shrunk to 1), which every later iteration repeats."""

SAFETY_FACTOR = 1.01
"""All but the last published iteration use ``(a / f, b / f^3, c / f^5)``, i.e. ``p(x / f)``: a singular value that
rounding pushed up to ``f`` times the interval's top still maps into it (``safety_factor_eps``, for bf16)."""

NORMALIZATION_MARGIN = 1.01
NORMALIZATION_EPS = 1e-7
"""The input is divided by ``||G||_F * NORMALIZATION_MARGIN + NORMALIZATION_EPS`` (per matrix of a batch), as in the
authors' code: spectral norm at most 1/1.01, room for the norm's own rounding; an all-zero matrix stays zero."""


def coefficients(steps: int) -> List[Tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations.

    All but the last published tuple with the safety factor, then the last (without it) for every further iteration, as
    the authors' code repeats it: the fixed quintic ``(15/8, -10/8, 3/8)`` with ``p(1) = 1``, ``p'(1) = p''(1) = 0``,
    cubically convergent near 1. Fewer steps take a prefix: the schedule is greedy (each tuple optimal given the ones
    before), so a prefix is the authors' method at that step count (Muon runs 5).

    Raises:
        ValueError: ``steps`` is negative or not an integer.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"Polar Express needs a non-negative integer number of steps, got {steps!r}.")
    f = SAFETY_FACTOR
    scheduled = [(a / f, b / f**3, c / f**5) for a, b, c in PUBLISHED_COEFFICIENTS[:-1]]
    scheduled.append(PUBLISHED_COEFFICIENTS[-1])
    return scheduled[:steps] + [scheduled[-1]] * max(0, steps - len(scheduled))


def zeropower_via_polar_express(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Polar Express orthogonalization of ``G`` (each matrix of a batch on its own).

    Args:
        G: ``(..., rows, cols)``, any float dtype; not modified; a tall one is iterated transposed (``min x min``).
        steps: iterations (Muon's ``ns_steps``, 5).

    Returns:
        torch.Tensor: ``G``'s shape, in ``ns_compute_dtype("polar_express")``: about ``U V^T`` for ``G = U S V^T``
        (singular values of ``G`` below 1e-3 of ``||G||_F`` converge more slowly); zero where ``G`` is zero. Without
        the aspect-ratio scale (``muon_orthogonalize`` applies it).

    Raises:
        ValueError: ``G`` has fewer than 2 dimensions, or ``steps`` is not a non-negative integer.
    """
    if G.ndim < 2:
        raise ValueError(f"Polar Express orthogonalizes matrices, got a tensor of shape {tuple(G.shape)}.")
    # Read at call time: original_muon imports this module, and tests or callers may replace it.
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
    return _iterate(G, tuple(coefficients(steps)), ns_compute_dtype(NS_METHOD))


@compiler.compile()
def _iterate(G, schedule, compute_dtype):
    X = G.to(compute_dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * NORMALIZATION_MARGIN + NORMALIZATION_EPS)
    for a, b, c in schedule:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X
