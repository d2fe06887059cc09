# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Upstream ``muon_update`` split in two, and the two halves run on ZeRO-3 partitions.

Patch 0004 rewrites ``original_muon.muon_update`` as ``muon_momentum_step_`` (elementwise)
followed by ``muon_orthogonalize`` (the whole matrix). Checked here, single process:

- ``muon_update`` is exactly that composition (bit-identical), for every dispatch branch,
  dtypes, finite and non-finite gradients, Nesterov on and off;
- the partitioned path (``momentum.momentum_step`` on each rank's partition into a send
  buffer, the NS input reassembled as the owner does, ``muon_orthogonalize`` on it) gives bit for
  bit what ``muon_update`` gives on the whole (finite) matrix;
- with ``DS_ZERO3MUON_SDIST`` set to the pristine sdist of the installed base (the
  ``deepspeed-<base>.tar.gz`` the build takes, or its unpacked directory), the patched
  ``muon_update`` is bit-identical to the release's own, loaded from the sdist under another
  module name (skipped otherwise).
"""

import importlib.util
import math
import os
import tarfile
from pathlib import Path

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum import MuonSettings, momentum_step, step_is_finite
from deepspeed.runtime.zero.muon.newton_schulz import batches, newton_schulz_problem, orthogonalize
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec
from unit.runtime.zero.zero3_muon_helpers import NSCounter, reference_muon_update

HAS_PER_HEAD = hasattr(original_muon, "_per_head_orthogonalize")

CASES = [
    # (shape, keyword arguments of muon_update / muon_orthogonalize)
    ((33, 21), {}),
    ((17, 33), {}),
    ((24, 24), {}),
    ((17, 33), dict(ns_method="standard")),
    ((33, 17), dict(ns_method="standard")),
    ((8, 3, 3, 3), {}),  # conv weight: flattened to 8x27, scaled by its last two dims
    ((8, 3, 3, 3), dict(ns_method="standard")),
    ((4, 12, 20), dict(is_expert_group=True)),
    ((4, 20, 12), dict(is_expert_group=True, ns_method="standard")),
    ((2, 3, 12, 20), dict(is_expert_group=True)),
    ((3, 12, 20), {}),  # a 3-D tensor that is not an expert group is batched too
]
if HAS_PER_HEAD:
    CASES += [((24, 10), dict(num_heads=4)), ((24, 40), dict(num_heads=3, ns_method="standard"))]
# gradient dtype (momentum the same, as upstream requires), and a non-finite value to plant
DTYPE_BAD = [(torch.float32, None), (torch.float32, float("nan")), (torch.bfloat16, None), (torch.float16, None),
             (torch.float16, float("-inf"))]
DTYPE_BAD_IDS = [f"{str(d).split('.')[1]}-{b}" for d, b in DTYPE_BAD]
CASE_IDS = [f"{'x'.join(map(str, s))}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for s, kw in CASES]


def _same(a, b):
    """Bit-identical, nan included (``torch.equal`` treats nan as unequal to itself)."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _conv(shape, kwargs):
    return len(shape) == 4 and not kwargs.get("is_expert_group", False)


def _inputs(shape, dtype=torch.float32, seed=7, bad=None):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(shape, generator=gen).to(dtype)
    momentum = torch.randn(shape, generator=gen).to(dtype)
    if bad is not None:
        grad.view(-1)[-1] = bad  # in the last partition: the other ranks' partitions look finite
    return grad, momentum


def _composed(grad, momentum, beta, nesterov, grad_is_finite, **kwargs):
    """``muon_update`` written as the composition of the two halves (per head, upstream returns
    the NS output without selecting the gradient for a non-finite matrix)."""
    finite = torch.isfinite(grad).all() if grad_is_finite is None else grad_is_finite
    x = original_muon.muon_momentum_step_(grad, momentum, beta, nesterov, grad_is_finite)
    update = original_muon.muon_orthogonalize(x, **kwargs).to(grad.dtype)
    if kwargs.get("num_heads") is not None:
        return update
    return torch.where(torch.as_tensor(finite), update, grad)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype,bad", DTYPE_BAD, ids=DTYPE_BAD_IDS)
@pytest.mark.parametrize("shape,kwargs", [c for c in CASES if not _conv(*c)],
                         ids=[i for c, i in zip(CASES, CASE_IDS) if not _conv(*c)])
def test_muon_update_is_momentum_step_then_orthogonalize(shape, kwargs, dtype, bad, nesterov):
    grad, momentum = _inputs(shape, dtype, bad=bad)
    expected_momentum = momentum.clone()
    expected = original_muon.muon_update(grad.clone(), expected_momentum, beta=0.9, nesterov=nesterov, **kwargs)
    for grad_is_finite in (None, torch.isfinite(grad).all()):  # on device, or given
        m = momentum.clone()
        ours = _composed(grad.clone(), m, 0.9, nesterov, grad_is_finite, **kwargs)
        assert torch.equal(m, expected_momentum), grad_is_finite
        assert _same(ours, expected), grad_is_finite
    if bad is None:
        assert not torch.equal(expected_momentum, momentum), "the momentum must have moved"
    else:
        assert torch.equal(expected_momentum, momentum), "a non-finite gradient must leave the momentum alone"


def _partitions(tensor, world_size):
    """ZeRO-3 partitions of ``tensor`` for ``world_size`` ranks: ceil(numel / W) each, zero padded."""
    numel = tensor.numel()
    size = math.ceil(numel / world_size)
    flat = torch.zeros(size * world_size, dtype=tensor.dtype)
    flat[:numel] = tensor.reshape(-1)
    return [flat[r * size:(r + 1) * size].clone() for r in range(world_size)]


def _reassemble(partitions, shape):
    return torch.cat([p.reshape(-1) for p in partitions])[:math.prod(shape)].view(shape)


def _partitioned_update(grad, momentum, world_size, beta, nesterov=True, **kwargs):
    """The ZeRO-3 path for one matrix: per-rank momentum step into a send buffer, owner NS."""
    grads, momenta = _partitions(grad, world_size), _partitions(momentum, world_size)
    settings = MuonSettings(momentum=beta, nesterov=nesterov, ns_method="gram", ns_steps=5)
    to_owner = [torch.empty_like(g) for g in grads]
    for g, m, out in zip(grads, momenta, to_owner):
        before = g.clone()
        momentum_step(g, m, settings, out)
        assert torch.equal(g, before), "the gradient is not written"
    x = _reassemble(to_owner, grad.shape)
    update = original_muon.muon_orthogonalize(x, **kwargs).to(grad.dtype)
    return update, _reassemble(momenta, grad.shape)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shape,kwargs", CASES, ids=CASE_IDS)
def test_partitioned_equals_muon_update(shape, kwargs, world_size):
    grad, momentum = _inputs(shape)
    ours, ours_momentum = _partitioned_update(grad, momentum, world_size, beta=0.9, **kwargs)
    upstream_momentum = momentum.clone()
    upstream = reference_muon_update(grad.clone(), upstream_momentum, 0.9, **kwargs)
    assert torch.equal(ours_momentum, upstream_momentum)
    assert torch.equal(ours.reshape(upstream.shape), upstream)
    assert not torch.equal(ours_momentum, momentum), "the momentum must have moved"


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_step_in_place_equals_upstream(nesterov):
    """``out=grad`` (the ZeRO-1/2 whole-matrix path) leaves in the gradient what upstream's
    in-place ``muon_momentum_step_`` leaves there, and the same momentum, bit for bit."""
    grad, momentum = _inputs((17, 33), seed=5)
    settings = MuonSettings(momentum=0.95, nesterov=nesterov, ns_method="gram", ns_steps=5)
    g, m = grad.clone(), momentum.clone()
    momentum_step(g, m, settings, out=g)
    g1, m1 = grad.clone(), momentum.clone()
    x = original_muon.muon_momentum_step_(g1, m1, 0.95, nesterov)
    assert torch.equal(m, m1)
    assert torch.equal(g, x), "the NS input: the blend (Nesterov) or the momentum"


@pytest.mark.parametrize("norms,finite", [(torch.tensor(3.0), True), (torch.tensor(float("nan")), False),
                                          (torch.tensor(float("inf")), False), (torch.tensor(-1.0), False),
                                          ([torch.tensor(1.0), torch.tensor(-1.0)], False),
                                          ([torch.tensor(1.0), torch.tensor(2.0)], True), (0.0, True)])
def test_step_is_finite(norms, finite):
    """ZeRO reports a non-finite group norm as -1; a list of group norms is checked one by one
    (their vector norm would hide a -1)."""
    assert step_is_finite(norms) is finite


# An owner's matrices in one bucket: same-shape groups (2-D both ways round, conv filters, an expert
# group whose problems match the 2-D ones) and matrices alone in their group.
OWNED = [((40, 24), {}), ((40, 24), {}), ((24, 40), {}), ((40, 24), {}), ((2, 40, 24), dict(is_expert_group=True)),
         ((8, 3, 3, 3), {}), ((8, 3, 3, 3), {}), ((24, 40), {}), ((96, 96), {}), ((96, 96), {}), ((17, 5), {})]
if HAS_PER_HEAD:
    OWNED += [((48, 40), dict(num_heads=2)), ((24, 40), {})]  # per head: two 24x40 problems


def _specs(owned):
    specs = []
    for shape, kw in owned:
        expert, heads = kw.get("is_expert_group", False), kw.get("num_heads")
        specs.append(MatrixSpec(shape, is_expert_group=expert, num_heads=heads,
                                ns_problem=newton_schulz_problem(shape, expert, heads)))
    return specs


def _fp64_orthogonalize(matrix, ns_method, kw, monkeypatch):
    """``muon_orthogonalize`` with every step in fp64: the exact result the fp32/bf16 kernels round."""
    with monkeypatch.context() as m:
        m.setattr(original_muon, "ns_compute_dtype", lambda *_: torch.float64)
        return original_muon.muon_orthogonalize(matrix.double(), ns_method=ns_method, **kw)


@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_batched_orthogonalize_equals_one_by_one(ns_method, monkeypatch):
    """The owner's batched Newton-Schulz: a matrix alone in its group is bit-identical to upstream's
    ``muon_orthogonalize``; a batched one is as close to the fp64 result as the one-by-one call
    (measured: bit-identical for some shapes, 1.5e-6 relative in fp32 where the matmul blocking
    changes, a bf16 rounding apart with "standard", both sides equally far from fp64)."""
    gen = torch.Generator().manual_seed(5)
    matrices = [torch.randn(shape, generator=gen) for shape, _ in OWNED]
    specs = _specs(OWNED)
    dtype = original_muon.ns_compute_dtype(ns_method)
    counter = NSCounter()
    with counter:
        batched = orthogonalize(matrices, specs, 5, ns_method, dtype, batch=True)
    assert counter.count == sum(s.ns_problem[0] for s in specs), "every problem orthogonalized once"
    assert counter.calls == len({s.ns_problem[1:] for s in specs}), "one call per problem shape"
    for k, ((shape, kw), matrix, spec, ours) in enumerate(zip(OWNED, matrices, specs, batched)):
        assert ours.dtype == dtype and ours.shape == matrix.shape, k
        alone = original_muon.muon_orthogonalize(matrix, 5, ns_method, dtype=dtype, **kw).reshape(matrix.shape)
        if sum(s.ns_problem[1:] == spec.ns_problem[1:] for s in specs) == 1:
            assert _same(ours, alone), k
            continue
        exact = _fp64_orthogonalize(matrix, ns_method, kw, monkeypatch).reshape(matrix.shape)
        error_batched = ((ours.double() - exact).norm() / exact.norm()).item()
        error_alone = ((alone.double() - exact).norm() / exact.norm()).item()
        # Rounding differs between the two, not accuracy: each within 2x the other's error.
        assert error_batched <= 2 * error_alone + 1e-12, (k, shape, error_batched, error_alone)
    unbatched = orthogonalize(matrices, specs, 5, ns_method, dtype, batch=False)
    for k, (matrix, spec) in enumerate(zip(matrices, specs)):
        kw = OWNED[k][1]
        expected = original_muon.muon_orthogonalize(matrix, 5, ns_method, dtype=dtype, **kw).reshape(matrix.shape)
        assert _same(unbatched[k], expected), k


def test_default_batching_by_device_and_size():
    """By default the CPU batches problems up to CPU_BATCH_MAX_ELEMENTS only; an accelerator all."""
    assert batches(96, 96, torch.device("cpu")) and not batches(97, 96, torch.device("cpu"))
    assert batches(4096, 4096, torch.device("cuda", 0))
    small, large = (16, 24), (100, 96)
    matrices = [torch.randn(s) for s in (small, small, large, large)]
    specs = _specs([(s, {}) for s in (small, small, large, large)])
    with NSCounter() as counter:
        orthogonalize(matrices, specs, 5, "gram", torch.float32)
    assert counter.count == 4 and counter.calls == 3, "the two small ones batched, the large ones one by one"


@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_orthogonalize_returns_the_ns_compute_dtype(ns_method):
    x = torch.randn(6, 10)
    assert original_muon.muon_orthogonalize(x, ns_method=ns_method).dtype == original_muon.ns_compute_dtype(ns_method)


def test_orthogonalize_does_not_modify_its_input():
    x = torch.randn(9, 5)
    before = x.clone()
    original_muon.muon_orthogonalize(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("shape,kwargs,problem", [
    ((64, 32), {}, (1, 64, 32)),
    ((8, 3, 3, 3), {}, (1, 8, 27)),
    ((3, 12, 20), {}, (3, 12, 20)),
    ((4, 16, 32), dict(is_expert_group=True), (4, 16, 32)),
    ((2, 4, 16, 32), dict(is_expert_group=True), (8, 16, 32)),
] + ([((96, 32), dict(num_heads=4), (4, 24, 32))] if HAS_PER_HEAD else []))
def test_ns_problem_is_what_the_kernel_sees(shape, kwargs, problem, monkeypatch):
    assert newton_schulz_problem(shape, kwargs.get("is_expert_group", False), kwargs.get("num_heads")) == problem
    seen = []
    kernel = original_muon.zeropower_via_gram_newtonschulz

    def spy(G, steps):
        seen.append(tuple(G.shape))
        return kernel(G, steps)

    monkeypatch.setattr(original_muon, "zeropower_via_gram_newtonschulz", spy)
    original_muon.muon_orthogonalize(torch.randn(shape), **kwargs)
    batch, rows, cols = problem
    assert len(seen) == 1 and math.prod(seen[0][:-2]) == batch and seen[0][-2:] == (rows, cols)


@pytest.mark.skipif(not HAS_PER_HEAD, reason="this DeepSpeed base has no per-head Muon")
@pytest.mark.parametrize("shape,heads", [((24, 10), 5), ((24, 10), 0), ((2, 24, 10), 2)])
def test_bad_head_count_is_refused_naming_the_key(shape, heads):
    with pytest.raises(ValueError, match=f"muon_num_heads={heads}"):
        newton_schulz_problem(shape, False, heads)


@pytest.mark.skipif(HAS_PER_HEAD, reason="checks the refusal on a base without per-head Muon (0.19.7)")
def test_per_head_refused_on_a_base_without_it():
    with pytest.raises(ValueError, match="per_head_muon"):
        newton_schulz_problem((24, 10), False, 4)


def test_non_matrix_is_refused():
    with pytest.raises(ValueError, match="use_muon"):
        newton_schulz_problem((10, ), False, None)


def _pristine_original_muon():
    """The release's own ``original_muon.py`` from ``DS_ZERO3MUON_SDIST``, as a module of another name."""
    source = os.environ.get("DS_ZERO3MUON_SDIST")
    if not source:
        pytest.skip("set DS_ZERO3MUON_SDIST to the installed base's pristine sdist (tar.gz or unpacked directory)")
    base = deepspeed.__version__.split("+")[0]
    member = "deepspeed/runtime/zero/muon/original_muon.py"
    path = Path(source)
    if path.is_dir():
        if base not in path.name:
            pytest.skip(f"DS_ZERO3MUON_SDIST={source} is not the installed base {base}")
        text = (path / member).read_text()
    else:
        if f"deepspeed-{base}.tar" not in path.name:
            pytest.skip(f"DS_ZERO3MUON_SDIST={source} is not the installed base {base}")
        with tarfile.open(path) as tar:
            text = tar.extractfile(f"deepspeed-{base}/{member}").read().decode()
    spec = importlib.util.spec_from_loader("zero3muon_pristine_original_muon", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(text, f"pristine {base} {member}", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype,bad", DTYPE_BAD, ids=DTYPE_BAD_IDS)
@pytest.mark.parametrize("shape,kwargs", CASES, ids=CASE_IDS)
def test_muon_update_bit_identical_to_the_release(shape, kwargs, dtype, bad, nesterov):
    pristine = _pristine_original_muon()
    grad, momentum = _inputs(shape, dtype, bad=bad)
    results = []
    for module in (pristine, original_muon):
        m = momentum.clone()
        try:
            update = module.muon_update(grad.clone(), m, beta=0.9, nesterov=nesterov, **kwargs)
        except RuntimeError as e:  # the release fails on conv weights in its final torch.where
            update = str(e)
        results.append((update, m))
    (expected, expected_momentum), (ours, ours_momentum) = results
    assert torch.equal(ours_momentum, expected_momentum)
    if isinstance(expected, str):
        assert ours == expected and _conv(shape, kwargs)
    else:
        assert _same(ours, expected)
