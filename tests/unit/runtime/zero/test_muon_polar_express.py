# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Polar Express (``ns_method: "polar_express"``, ``deepspeed.runtime.zero.muon.polar_express``), single process.

- The schedule is the published one (Amsel et al. 2025, arXiv:2505.16932, Algorithm 1; the authors'
  ``polar_express/basic.py``), restated digit for digit: the safety factor on all tuples but the last, the last
  repeated beyond 8 iterations.
- The kernel equals a plain fp64 implementation of the published iteration (``published``): in fp64 to the last bits,
  in fp32 to the measured floor, in bf16 (what the CPU accelerator runs) to bf16's; upstream's ``muon_orthogonalize``
  dispatches every branch to it (2-D both ways round, per head where the base has it, expert groups, conv filters)
  with upstream's aspect-ratio scale, and the owner's batched calls give what one-by-one calls give.
- At equal iteration counts its result is closer to orthogonal than upstream's quintic.
- The owner plan's working-set estimate covers it (``test_muon_newton_schulz.py`` measures every method's peak).
"""

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon, polar_express
from muon_testing.counting import NSCounter
from unit.runtime.zero.test_muon_newton_schulz import matrix_specs, orthogonalize_all

HAS_PER_HEAD = hasattr(original_muon, "_per_head_orthogonalize")

# The paper's listing (arXiv:2505.16932 v2, Algorithm 1) = NoahAmsel/PolarExpress polar_express/basic.py.
PUBLISHED = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
PUBLISHED_SCHEDULE = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PUBLISHED[:-1]] + [PUBLISHED[-1]]

FP64_FLOOR = 1e-12
"""fp64 kernel vs fp64 reference: measured 0.0 (same operations, same order); room for another BLAS's blocking."""

FP32_FLOOR = 1e-5
"""fp32 kernel vs fp64 reference, relative Frobenius: measured 6.6e-8 (1 step) to 3.2e-6 (5 steps, 200x100) over the
shapes and step counts below; the first polynomials' large coefficients (slope 8.2 at 0) amplify each step's
rounding, so the floor is ~10x the quintic's."""

BF16_FLOOR = 0.1
"""bf16 kernel vs fp64 reference: measured 3.5e-3 (1 step) to 5.6e-2 (5 steps); 2^-8 rounding amplified as above."""


def published(G, steps):
    """The published iteration in fp64: tall matrices transposed, normalized by ``||G||_F * 1.01 + 1e-7``, then
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``."""
    tall = G.size(-2) > G.size(-1)
    X = G.double().mT if tall else G.double()
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) * 1.01 + 1e-7)
    for a, b, c in (PUBLISHED_SCHEDULE + [PUBLISHED_SCHEDULE[-1]] * steps)[:steps]:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _relative(ours, reference):
    return ((ours.double() - reference).norm() / reference.norm()).item()


@pytest.fixture
def compute_in(monkeypatch):
    """``compute_in(dtype)``: the iteration (and every other NS kernel) computes in ``dtype``."""
    return lambda dtype: monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda *_: dtype)


def test_schedule_is_the_published_one():
    assert polar_express.PUBLISHED_COEFFICIENTS == tuple(PUBLISHED)
    assert polar_express.coefficients(0) == []
    assert polar_express.coefficients(5) == PUBLISHED_SCHEDULE[:5]
    assert polar_express.coefficients(8) == PUBLISHED_SCHEDULE
    assert polar_express.coefficients(11) == PUBLISHED_SCHEDULE + [PUBLISHED[-1]] * 3
    # the safety factor divides x by 1.01 inside each scheduled polynomial but the last
    a, b, c = polar_express.coefficients(1)[0]
    x = 0.3
    assert a * x + b * x**3 + c * x**5 == pytest.approx(sum(k * (x / 1.01)**p
                                                            for k, p in zip(PUBLISHED[0], (1, 3, 5))))
    for bad in (-1, 2.0, True, "5"):
        with pytest.raises(ValueError, match="non-negative integer number of steps"):
            polar_express.coefficients(bad)


def test_schedule_maps_the_design_interval_to_one():
    """The composed scheduled polynomials take every singular value in the design interval [1e-3, 1/1.01] to 1: within
    1e-12 after 8 iterations (measured 3.1e-15), 1e-4 after 7 (1.1e-5), 0.2 after Muon's 5 (0.160); the quintic's 8
    iterations leave 0.318."""
    x = torch.logspace(-3, 0, 2001, dtype=torch.float64) / 1.01
    for steps, bound in ((8, 1e-12), (7, 1e-4), (5, 0.2)):
        y = x.clone()
        for a, b, c in polar_express.coefficients(steps):
            y = a * y + b * y**3 + c * y**5
        assert (y - 1).abs().max().item() <= bound, steps
    q = x.clone()
    for _ in range(8):
        q = 3.4445 * q - 4.7750 * q**3 + 2.0315 * q**5
    assert (q - 1).abs().max().item() > 0.3


SHAPES = [(33, 21), (17, 33), (24, 24), (3, 12, 20), (64, 172), (200, 100)]


@pytest.mark.parametrize("steps", [1, 2, 5, 8, 10])
def test_kernel_equals_the_published_iteration(steps, compute_in):
    """fp64 to the last bits, fp32 to FP32_FLOOR; shape, dtype kept; past the schedule (10) its last tuple repeats."""
    gen = torch.Generator().manual_seed(steps)
    for dtype, floor in ((torch.float64, FP64_FLOOR), (torch.float32, FP32_FLOOR)):
        compute_in(dtype)
        for shape in SHAPES:
            G = torch.randn(shape, generator=gen)
            ours = polar_express.zeropower_via_polar_express(G, steps)
            assert ours.dtype == dtype and ours.shape == G.shape
            assert _relative(ours, published(G, steps)) <= floor, (dtype, shape)


def test_kernel_in_the_dtype_of_standard():
    """Unpatched, the kernel computes in ``ns_compute_dtype("polar_express")``, the dtype of "standard" (bf16 on
    DeepSpeed's CPU accelerator), within its floor."""
    dtype = original_muon.ns_compute_dtype("polar_express")
    assert dtype == original_muon.ns_compute_dtype("standard")
    gen = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        G = torch.randn(shape, generator=gen)
        ours = polar_express.zeropower_via_polar_express(G, 5)
        assert ours.dtype == dtype
        floor = BF16_FLOOR if dtype == torch.bfloat16 else FP32_FLOOR
        assert _relative(ours, published(G, 5)) <= floor, shape


def test_zero_stays_zero_and_bad_input_is_refused():
    assert torch.equal(polar_express.zeropower_via_polar_express(torch.zeros(4, 6), 5).float(), torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"orthogonalizes matrices, got a tensor of shape \(6,\)"):
        polar_express.zeropower_via_polar_express(torch.zeros(6), 5)
    with pytest.raises(ValueError, match="non-negative integer"):
        polar_express.zeropower_via_polar_express(torch.zeros(4, 6), -1)


CASES = [
    # (shape, keyword arguments of muon_orthogonalize), how upstream views the NS input, the scale
    ((33, 21), {}),
    ((17, 33), {}),
    ((4, 12, 20), dict(is_expert_group=True)),
    ((3, 20, 12), dict(is_expert_group=True)),
    ((8, 3, 3, 3), {}),  # conv: NS on 8x27, scaled by its last two dims (3x3: 1)
    ((16, 4, 3, 1), {}),  # conv: NS on 16x12, scaled by sqrt(3 / 1)
]
if HAS_PER_HEAD:
    CASES += [((24, 10), dict(num_heads=4)), ((24, 40), dict(num_heads=3))]


def _expected(G, kwargs):
    """The published iteration on upstream's NS problems of ``G``, times upstream's scale."""
    batch, rows, cols = original_muon.muon_ns_problem(G.shape, kwargs.get("is_expert_group", False),
                                                      kwargs.get("num_heads"))
    scale_rows, scale_cols = (rows, cols) if kwargs.get("num_heads") else G.shape[-2:]
    scale = max(1.0, scale_rows / scale_cols)**0.5
    out = published(G.reshape(batch, rows, cols), 5) * scale
    return out.reshape(G.shape) if G.ndim != 4 or kwargs.get("is_expert_group") else out.reshape(rows, cols)


@pytest.mark.parametrize("shape,kwargs", CASES, ids=[f"{'x'.join(map(str, s))}-{k}" for s, k in CASES])
def test_muon_orthogonalize_dispatches_to_it(shape, kwargs, compute_in):
    """``muon_orthogonalize`` runs only Polar Express on every branch, with upstream's scale, in fp64 to FP64_FLOOR."""
    compute_in(torch.float64)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with NSCounter() as counter:
        ours = original_muon.muon_orthogonalize(G.double(), 5, "polar_express", **kwargs)
    batch = original_muon.muon_ns_problem(shape, kwargs.get("is_expert_group", False), kwargs.get("num_heads"))[0]
    assert counter.by_kernel == dict(zeropower_via_polar_express=batch,
                                     zeropower_via_gram_newtonschulz=0,
                                     zeropower_via_newtonschulz5=0)
    expected = _expected(G, kwargs)
    assert ours.shape == expected.shape
    assert _relative(ours, expected) <= FP64_FLOOR


def test_muon_update_and_the_optimizers_accept_it():
    """``muon_update`` (stage 0 and the bf16 optimizer call it) and upstream's optimizers take "polar_express"."""
    assert "polar_express" in original_muon.NS_METHODS
    grad, momentum = torch.randn(17, 33), torch.zeros(17, 33)
    with NSCounter() as counter:
        update = original_muon.muon_update(grad.clone(), momentum, beta=0.9, ns_method="polar_express")
    assert counter.by_kernel["zeropower_via_polar_express"] == 1 and update.dtype == grad.dtype
    p = torch.nn.Parameter(torch.randn(5, 7))
    opt = original_muon.SingleDeviceMuonWithAuxAdam([dict(params=[p], use_muon=True, ns_method="polar_express")])
    p.grad = torch.randn(5, 7)
    with NSCounter() as counter:
        opt.step()
    assert counter.by_kernel["zeropower_via_polar_express"] == 1


def _orthogonality(result):
    """``(max|1-s|, ||U U^T - I||_F / sqrt(m))`` of each matrix's wide orientation ``U``, worst over a batch, fp64."""
    u = result.double().mT if result.size(-2) > result.size(-1) else result.double()
    s = torch.linalg.svdvals(u)
    rms = torch.linalg.matrix_norm(u @ u.mT - torch.eye(u.size(-2), dtype=u.dtype)) / u.size(-2)**0.5
    return (1 - s).abs().max().item(), rms.max().item()


@pytest.mark.parametrize("steps", [5, 6, 8])
def test_more_orthogonal_than_the_quintic(steps, compute_in):
    """Gaussian matrices, fp32, 5 steps and beyond: Polar Express's rows are closer to orthonormal than the quintic's
    (``||UU^T-I||/sqrt(m)``: measured 0.43-0.56x at 5 steps, 1e-2x at 6, 1e-6x at 8, over 6 seeds; required < 0.7x),
    and on rectangular matrices (all singular values in the design interval) so is the worst singular value
    (``max|1-s|``: 0.13 vs 0.32 at 5 steps, 2.6e-3 at 6; required < 0.5x). A square Gaussian matrix can have singular
    values below the interval, where the quintic's slope at 0 lifts them faster: only the first holds there."""
    compute_in(torch.float32)
    gen = torch.Generator().manual_seed(0)
    for shape, rectangular in (((48, 48), False), ((96, 40), True), ((40, 96), True), ((3, 24, 60), True)):
        G = torch.randn(shape, generator=gen)
        ours = _orthogonality(polar_express.zeropower_via_polar_express(G, steps))
        quintic = _orthogonality(original_muon.zeropower_via_newtonschulz5(G, steps))
        assert ours[1] < 0.7 * quintic[1], (shape, ours, quintic)
        if rectangular:
            assert ours[0] < 0.5 * quintic[0], (shape, ours, quintic)


def test_owner_batches_it_like_one_by_one(compute_in):
    """``orthogonalize_each``: a batched call is as close to fp64 as one-by-one calls (each problem normalized on its
    own); one-by-one calls are upstream's ``muon_orthogonalize`` bit for bit."""
    owned = [((40, 24), {}), ((40, 24), {}), ((24, 40), {}), ((2, 40, 24), dict(is_expert_group=True)),
             ((8, 3, 3, 3), {}), ((17, 5), {})]
    specs = matrix_specs(owned, "polar_express")
    gen = torch.Generator().manual_seed(4)
    matrices = [torch.randn(s, generator=gen) for s, _ in owned]
    compute_in(torch.float32)
    with NSCounter() as counter:
        batched = orthogonalize_all(matrices, specs, 5, "polar_express", torch.float32, batch=True)
    assert counter.by_kernel["zeropower_via_polar_express"] == sum(s.ns_problem[0] for s in specs)
    # the 40x24 matrices and the expert group's 40x24 problems in one call; 24x40, the conv filter and 17x5 alone
    assert counter.calls == 4
    single = orthogonalize_all(matrices, specs, 5, "polar_express", torch.float32, batch=False)
    alone = [
        original_muon.muon_orthogonalize(m, 5, "polar_express", dtype=torch.float32, **kw)
        for m, (_, kw) in zip(matrices, owned)
    ]
    compute_in(torch.float64)
    for k, ((shape, kw), matrix) in enumerate(zip(owned, matrices)):
        exact = original_muon.muon_orthogonalize(matrix.double(), 5, "polar_express", **kw)
        assert torch.equal(single[k], alone[k].reshape(single[k].shape)), k
        error_batched = _relative(batched[k].reshape(exact.shape), exact)
        error_alone = _relative(single[k].reshape(exact.shape), exact)
        assert error_batched <= 2 * error_alone + 1e-12, (k, error_batched, error_alone)
        assert error_alone <= FP32_FLOOR, k
