# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Upstream ``muon_update`` split in two: ``muon_momentum_step_`` (elementwise) and ``muon_orthogonalize`` (the whole
matrix, on the problems ``muon_ns_problem`` describes). Checked: ``muon_update`` is exactly that composition, bit for
bit, for every dispatch branch, dtype, finite and non-finite gradients, Nesterov on and off (the halves alone:
``test_muon_newton_schulz``); and with ``DS_ZERO3MUON_SDIST`` set to the installed base's pristine sdist (tar.gz or
unpacked; skipped otherwise) the patched ``muon_update`` is bit-identical to the release's own.
"""

import importlib.util
import os
import tarfile
from pathlib import Path

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.muon import original_muon

HAS_PER_HEAD = hasattr(original_muon, "_per_head_orthogonalize")

CASES = [  # (shape, keyword arguments of muon_update / muon_orthogonalize); 4-D: a conv weight, NS on 8x27
    ((33, 21), {}),
    ((17, 33), {}),
    ((24, 24), {}),
    ((17, 33), dict(ns_method="standard")),
    ((33, 17), dict(ns_method="standard")),
    ((8, 3, 3, 3), {}),
    ((8, 3, 3, 3), dict(ns_method="standard")),
    ((4, 12, 20), dict(is_expert_group=True)),
    ((4, 20, 12), dict(is_expert_group=True, ns_method="standard")),
    ((2, 3, 12, 20), dict(is_expert_group=True)),
    ((3, 12, 20), {})  # 3-D, not an expert group: batched too
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
    """``muon_update`` as the composition of the two halves (per head, upstream returns the NS output without
    selecting the gradient for a non-finite matrix)."""
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


def _pristine_original_muon():
    """The release's own ``original_muon.py`` from ``DS_ZERO3MUON_SDIST``, as a module of another name."""
    source = os.environ.get("DS_ZERO3MUON_SDIST")
    if not source:
        pytest.skip("set DS_ZERO3MUON_SDIST to the installed base's pristine sdist (tar.gz or unpacked directory)")
    base, path = deepspeed.__version__.split("+")[0].strip(), Path(source)  # a build may say "0.19.8 "
    member = "deepspeed/runtime/zero/muon/original_muon.py"
    if (base not in path.name) if path.is_dir() else (f"deepspeed-{base}.tar" not in path.name):
        pytest.skip(f"DS_ZERO3MUON_SDIST={source} is not the installed base {base}")
    if path.is_dir():
        text = (path / member).read_text()
    else:
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
