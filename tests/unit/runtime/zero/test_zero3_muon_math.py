# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The partitioned elementwise step plus the owner's Newton-Schulz equals upstream ``muon_update``.

Single process: a matrix's gradient and momentum are cut into ZeRO-3 partitions for W ranks,
``momentum_and_ns_input_`` runs on each partition, the NS input is reassembled as the owner does,
and ``orthogonalize`` runs on it. Upstream ``muon_update`` runs on the whole matrix. Both are
elementwise-identical operations followed by the same NS kernel, so update and momentum must be
bit-identical, for finite and non-finite gradients.
"""

import math

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum_math import (all_finite_flags, momentum_and_ns_input_, ns_output_dtype,
                                                       orthogonalize)
from unit.runtime.zero.zero3_muon_helpers import reference_muon_update

HAS_PER_HEAD = hasattr(original_muon, "_per_head_orthogonalize")

CASES = [
    # (shape, kwargs for muon_update / orthogonalize)
    ((33, 21), {}),
    ((17, 33), {}),
    ((24, 24), {}),
    ((17, 33), dict(ns_method="standard")),
    ((8, 3, 3, 3), {}),  # conv weight: flattened to 8x27, scaled by its last two dims
    ((4, 12, 20), dict(is_expert_group=True)),
    ((4, 20, 12), dict(is_expert_group=True, ns_method="standard")),
]
if HAS_PER_HEAD:
    CASES.append(((24, 10), dict(num_heads=4)))


def _partitions(tensor, world_size):
    """ZeRO-3 partitions of ``tensor`` for ``world_size`` ranks: ceil(numel / W) each, zero padded."""
    numel = tensor.numel()
    size = math.ceil(numel / world_size)
    flat = torch.zeros(size * world_size, dtype=tensor.dtype)
    flat[:numel] = tensor.reshape(-1)
    return [flat[r * size:(r + 1) * size].clone() for r in range(world_size)]


def _reassemble(partitions, shape):
    return torch.cat(partitions)[:math.prod(shape)].view(shape)


def _partitioned_update(grad, momentum, world_size, beta, **kwargs):
    grads, momenta = _partitions(grad, world_size), _partitions(momentum, world_size)
    finite = bool(all_finite_flags(grads).min())
    for g, m in zip(grads, momenta):
        momentum_and_ns_input_(g, m, beta, nesterov=True, finite=finite)
    x = _reassemble(grads, grad.shape)
    update = orthogonalize(x, **kwargs).to(grad.dtype) if finite else x
    return update, _reassemble(momenta, grad.shape)


def _upstream_update(grad, momentum, beta, ns_method="gram", is_expert_group=False, num_heads=None):
    momentum = momentum.clone()
    if num_heads is not None:
        return original_muon.muon_update(grad.clone(), momentum, beta=beta, ns_method=ns_method,
                                         num_heads=num_heads), momentum
    return reference_muon_update(grad.clone(), momentum, beta, ns_method, is_expert_group), momentum


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shape,kwargs", CASES, ids=[f"{'x'.join(map(str, s))}-{k}" for s, k in CASES])
def test_partitioned_equals_muon_update(shape, kwargs, world_size):
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(shape, generator=gen)
    momentum = torch.randn(shape, generator=gen)
    ours, ours_momentum = _partitioned_update(grad, momentum, world_size, beta=0.9, **kwargs)
    upstream, upstream_momentum = _upstream_update(grad, momentum, beta=0.9, **kwargs)
    assert torch.equal(ours_momentum, upstream_momentum)
    assert torch.equal(ours.reshape(upstream.shape), upstream)
    assert not torch.equal(ours_momentum, momentum), "the momentum must have moved"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_matrix_keeps_momentum(bad, world_size):
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(17, 33, generator=gen)
    grad[16, 32] = bad  # in the last partition, so the other ranks' partitions look finite
    momentum = torch.randn(17, 33, generator=gen)
    ours, ours_momentum = _partitioned_update(grad, momentum, world_size, beta=0.95)
    upstream, upstream_momentum = _upstream_update(grad, momentum, beta=0.95)
    assert torch.equal(upstream_momentum, momentum)
    assert torch.equal(ours_momentum, momentum)
    assert torch.equal(ours.isnan(), upstream.isnan())
    assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(upstream))


def test_non_nesterov_matches_muon_update():
    gen = torch.Generator().manual_seed(5)
    grad, momentum = torch.randn(12, 20, generator=gen), torch.randn(12, 20, generator=gen)
    g, m = grad.clone().view(-1), momentum.clone().view(-1)
    momentum_and_ns_input_(g, m, 0.8, nesterov=False, finite=True)
    ours = orthogonalize(g.view(12, 20)).to(grad.dtype)
    upstream_momentum = momentum.clone()
    upstream = original_muon.muon_update(grad.clone(), upstream_momentum, beta=0.8, nesterov=False)
    assert torch.equal(ours, upstream)
    assert torch.equal(m.view(12, 20), upstream_momentum)


@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_ns_output_dtype_is_what_the_kernel_returns(ns_method):
    x = torch.randn(6, 10)
    assert orthogonalize(x, ns_method=ns_method).dtype == ns_output_dtype(ns_method)


def test_orthogonalize_does_not_modify_its_input():
    x = torch.randn(9, 5)
    before = x.clone()
    orthogonalize(x)
    assert torch.equal(x, before)


@pytest.mark.skipif(not HAS_PER_HEAD, reason="this DeepSpeed base has no per-head Muon")
def test_bad_head_count_is_refused():
    with pytest.raises(ValueError, match="muon_num_heads=5"):
        orthogonalize(torch.randn(24, 10), num_heads=5)


@pytest.mark.skipif(HAS_PER_HEAD, reason="checks the refusal on a base without per-head Muon (0.19.7); this base has it")
def test_per_head_refused_on_a_base_without_it():
    with pytest.raises(ValueError, match="per_head_muon"):
        orthogonalize(torch.randn(24, 10), num_heads=4)


def test_all_finite_flags():
    parts = [torch.ones(3), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")]), torch.zeros(0)]
    assert all_finite_flags(parts).tolist() == [1, 0, 0, 1]
