# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The distributed Muon core's halves, single process: the momentum step on partitions and Newton-Schulz on the owner.

- ``momentum.momentum_step`` on each rank's partition of a matrix (into a send buffer, the gradient untouched), the NS
  input reassembled as the owner does and ``muon_orthogonalize`` on it, give bit for bit what upstream ``muon_update``
  gives on the whole matrix, for W up to 4; in place it leaves what upstream's in-place step leaves;
- upstream's ``muon_ns_problem`` is the problem its kernel sees;
- ``newton_schulz.orthogonalize_each`` batches same-shape problems (as accurate as one by one) where it pays, and
  ``newton_schulz_problem`` refuses what Muon cannot orthogonalize, naming the key.
"""

import math

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum import StepSettings, momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import batches, newton_schulz_problem, orthogonalize_each
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec
from muon_testing.counting import NSCounter
from muon_testing.reference import reference_muon_update
from unit.runtime.zero.test_muon_update_split import CASE_IDS, CASES, _inputs, _same  # the seam's cases

HAS_PER_HEAD = hasattr(original_muon, "_per_head_orthogonalize")


def orthogonalize_all(matrices, specs, ns_steps, ns_method, dtype, batch=None, max_call_numel=None):
    """``orthogonalize_each`` over matrices in hand: their updates in order (``test_muon_polar_express`` too)."""
    updates = [None] * len(matrices)
    device = matrices[0].device if matrices else "cpu"
    for members, results in orthogonalize_each(matrices.__getitem__, specs, ns_steps, ns_method, dtype, device, batch,
                                               max_call_numel):
        for k, result in zip(members, results):
            updates[k] = result
    return updates


def _partitions(tensor, world_size):
    """ZeRO-3 partitions of ``tensor`` for ``world_size`` ranks: ceil(numel / W) each, zero padded."""
    size = math.ceil(tensor.numel() / world_size)
    flat = torch.nn.functional.pad(tensor.reshape(-1), (0, size * world_size - tensor.numel()))
    return [piece.clone() for piece in flat.split(size)]


def _reassemble(partitions, shape):
    return torch.cat([p.reshape(-1) for p in partitions])[:math.prod(shape)].view(shape)


def _partitioned_update(grad, momentum, world_size, beta, nesterov=True, **kwargs):
    """The ZeRO-3 path for one matrix: per-rank momentum step into a send buffer, owner NS."""
    grads, momenta = _partitions(grad, world_size), _partitions(momentum, world_size)
    settings = StepSettings(momentum=beta, nesterov=nesterov, ns_method="gram", ns_steps=5)
    to_owner = [torch.empty_like(g) for g in grads]
    for g, m, out in zip(grads, momenta, to_owner):
        before = g.clone()
        momentum_step(g, m, settings, out)
        assert torch.equal(g, before), "the gradient is not written"
    update = original_muon.muon_orthogonalize(_reassemble(to_owner, grad.shape), **kwargs).to(grad.dtype)
    return update, _reassemble(momenta, grad.shape)


EXPERTS = dict(is_expert_group=True)
PROBLEMS = [((64, 32), {}, (1, 64, 32)), ((8, 3, 3, 3), {}, (1, 8, 27)), ((3, 12, 20), {}, (3, 12, 20)),
            ((4, 16, 32), EXPERTS, (4, 16, 32)), ((2, 4, 16, 32), EXPERTS, (8, 16, 32))]
PROBLEMS += [((96, 32), dict(num_heads=4), (4, 24, 32))] if HAS_PER_HEAD else []


@pytest.mark.parametrize("shape,kwargs,problem", PROBLEMS)
def test_ns_problem_is_what_the_kernel_sees(shape, kwargs, problem, monkeypatch):
    assert original_muon.muon_ns_problem(shape, kwargs.get("is_expert_group", False),
                                         kwargs.get("num_heads")) == problem
    seen = []
    kernel = original_muon.zeropower_via_gram_newtonschulz

    def spy(G, steps):
        seen.append(tuple(G.shape))
        return kernel(G, steps)

    monkeypatch.setattr(original_muon, "zeropower_via_gram_newtonschulz", spy)
    original_muon.muon_orthogonalize(torch.randn(shape), **kwargs)
    batch, rows, cols = problem
    assert len(seen) == 1 and math.prod(seen[0][:-2]) == batch and seen[0][-2:] == (rows, cols)


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
    """``out=grad`` (the ZeRO-1/2 whole-matrix path) leaves in the gradient what upstream's in-place
    ``muon_momentum_step_`` leaves there, and the same momentum, bit for bit."""
    grad, momentum = _inputs((17, 33), seed=5)
    settings = StepSettings(momentum=0.95, nesterov=nesterov, ns_method="gram", ns_steps=5)
    g, m = grad.clone(), momentum.clone()
    momentum_step(g, m, settings, out=g)
    g1, m1 = grad.clone(), momentum.clone()
    x = original_muon.muon_momentum_step_(g1, m1, 0.95, nesterov)
    assert torch.equal(m, m1)
    assert torch.equal(g, x), "the NS input: the blend (Nesterov) or the momentum"


# An owner's matrices in one bucket: same-shape groups (2-D both ways round, conv filters, an expert group whose
# problems match the 2-D ones) and matrices alone in their group.
OWNED = [((40, 24), {}), ((40, 24), {}), ((24, 40), {}), ((40, 24), {}), ((2, 40, 24), dict(is_expert_group=True)),
         ((8, 3, 3, 3), {}), ((8, 3, 3, 3), {}), ((16, 4, 1, 1), {}), ((16, 4, 1, 1), {}), ((16, 4), {}),
         ((24, 40), {}), ((96, 96), {}), ((96, 96), {}), ((17, 5), {})]
if HAS_PER_HEAD:
    OWNED += [((48, 40), dict(num_heads=2)), ((24, 40), {})]  # per head: two 24x40 problems


def matrix_specs(owned, ns_method="gram"):
    """The owner's ``MatrixSpec`` of each ``(shape, muon_orthogonalize keywords)`` (``test_muon_polar_express``)."""
    problems = [(shape, kw.get("is_expert_group", False), kw.get("num_heads")) for shape, kw in owned]
    return [MatrixSpec(s, ns_method, e, h, newton_schulz_problem(s, e, h)) for s, e, h in problems]


def _fp64_orthogonalize(matrix, ns_method, kw, monkeypatch):
    """``muon_orthogonalize`` with every step in fp64: the exact result the fp32/bf16 kernels round."""
    with monkeypatch.context() as m:
        m.setattr(original_muon, "ns_compute_dtype", lambda *_: torch.float64)
        return original_muon.muon_orthogonalize(matrix.double(), ns_method=ns_method, **kw)


@pytest.mark.parametrize("ns_method", ["gram", "standard", "polar_express"])
def test_batched_orthogonalize_equals_one_by_one(ns_method, monkeypatch):
    """The owner's batched Newton-Schulz: a matrix alone in its group is bit-identical to upstream's
    ``muon_orthogonalize``; a batched one is as close to fp64 as the one-by-one call (measured: bit-identical for some
    shapes, 1.5e-6 relative in fp32 where the matmul blocking changes, a bf16 rounding apart with "standard" and
    "polar_express", both equally far from fp64). A 4-D conv filter is never batched, not even with a 2-D matrix of its
    problem's shape: upstream scales it by its kernel's (kh, kw) (a (16, 4, 1, 1) filter by 1; 16x4 would take 2)."""
    if ns_method not in original_muon.NS_METHODS:
        pytest.skip(f"this DeepSpeed's Muon has no {ns_method}")
    gen = torch.Generator().manual_seed(5)
    matrices = [torch.randn(shape, generator=gen) for shape, _ in OWNED]
    specs = matrix_specs(OWNED)
    dtype = original_muon.ns_compute_dtype(ns_method)
    counter = NSCounter()
    with counter:
        batched = orthogonalize_all(matrices, specs, 5, ns_method, dtype, batch=True)
    assert counter.count == sum(s.ns_problem[0] for s in specs), "every problem orthogonalized once"
    conv = [len(s.shape) == 4 and not s.is_expert_group for s in specs]
    batchable = [s.ns_problem[1:] for s, c in zip(specs, conv) if not c]
    assert counter.calls == len(set(batchable)) + sum(conv), "one call per problem shape, one per conv filter"
    for k, ((shape, kw), matrix, spec, ours) in enumerate(zip(OWNED, matrices, specs, batched)):
        assert ours.dtype == dtype and ours.shape == matrix.shape, k
        alone = original_muon.muon_orthogonalize(matrix, 5, ns_method, dtype=dtype, **kw).reshape(matrix.shape)
        if conv[k] or batchable.count(spec.ns_problem[1:]) == 1:
            assert _same(ours, alone), k
            continue
        exact = _fp64_orthogonalize(matrix, ns_method, kw, monkeypatch).reshape(matrix.shape)
        error_batched = ((ours.double() - exact).norm() / exact.norm()).item()
        error_alone = ((alone.double() - exact).norm() / exact.norm()).item()
        # Rounding differs between the two, not accuracy: each within 2x the other's error.
        assert error_batched <= 2 * error_alone + 1e-12, (k, shape, error_batched, error_alone)
    unbatched = orthogonalize_all(matrices, specs, 5, ns_method, dtype, batch=False)
    for k, (matrix, (_, kw)) in enumerate(zip(matrices, OWNED)):
        expected = original_muon.muon_orthogonalize(matrix, 5, ns_method, dtype=dtype, **kw).reshape(matrix.shape)
        assert _same(unbatched[k], expected), k


def test_default_batching_by_device_and_size():
    """By default the CPU batches problems up to CPU_BATCH_MAX_ELEMENTS only; an accelerator all."""
    assert batches(96, 96, torch.device("cpu")) and not batches(97, 96, torch.device("cpu"))
    assert batches(4096, 4096, torch.device("cuda", 0))
    small, large = (16, 24), (100, 96)
    matrices = [torch.randn(s) for s in (small, small, large, large)]
    specs = matrix_specs([(s, {}) for s in (small, small, large, large)])
    with NSCounter() as counter:
        orthogonalize_all(matrices, specs, 5, "gram", torch.float32)
    assert counter.count == 4 and counter.calls == 3, "the two small ones batched, the large ones one by one"


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


def test_batched_calls_stay_within_the_working_set_bound():
    """``max_call_numel`` splits a same-shape group into calls whose working sets (``MatrixSpec.ns_workspace_numel``)
    fit it, one matrix at least; the results do not change (one-by-one calls of a 2-D matrix are upstream's call)."""
    matrices = [torch.randn(16, 24) for _ in range(5)]
    specs = matrix_specs([((16, 24), {})] * 5)
    one = specs[0].ns_workspace_numel
    assert one == 2 * 16 * 24 + 4 * 16 * 16
    for bound, calls in ((None, 1), (5 * one, 1), (2 * one, 3), (one, 5), (1, 5)):
        with NSCounter() as counter:
            results = orthogonalize_all(matrices, specs, 5, "gram", torch.float32, batch=True, max_call_numel=bound)
        assert counter.calls == calls and counter.count == 5, bound
        if calls == 5:
            for matrix, result in zip(matrices, results):
                assert _same(result, original_muon.muon_orthogonalize(matrix, 5, "gram", dtype=torch.float32)), bound


@pytest.mark.parametrize("fp32", [False, True], ids=["as-run", "fp32"])
def test_working_set_estimate_covers_upstreams_kernels(fp32, monkeypatch):
    """``MatrixSpec.ns_workspace_numel`` against the CPU allocator's peak above the eager kernels' input: an upper
    bound in the dtypes they run in here (``as-run``: ``ns_compute_dtype``; "standard" and "polar_express" in bf16,
    "gram" in fp16 where DeepSpeed's CPU accelerator reports them supported), exact in fp32 (on an accelerator without
    them; the largest): "gram" ``2 m n + 4 m^2``, "standard" and "polar_express" ``4 m n + 2 m^2`` (``2 m n + 4 m^2``
    fell short of it for rectangular matrices: 1.4e5 elements measured vs 1.0e5 at 300x100). Shapes large enough that
    the matrices, not the allocator's small blocks, make the peak."""
    from torch.profiler import ProfilerActivity, profile
    if fp32:
        monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda *_: torch.float32)
    # one thread: with more, the CPU matmul allocates scratch per thread (measured: +17,584 elements at 300x100 "gram"
    # in fp32 on 2 threads), which an accelerator's kernels do not
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for ns_method in sorted(original_muon.NS_METHODS):
            for shape in ((300, 100), (100, 300), (171, 171)):
                x, (spec, ) = torch.randn(shape), matrix_specs([(shape, {})], ns_method)
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    original_muon.muon_orthogonalize(x, 5, ns_method, dtype=torch.float32)
                peak = _profiled_peak(prof)
                assert peak <= 4 * spec.ns_workspace_numel, (ns_method, shape, peak)
                if fp32 or original_muon.ns_compute_dtype(ns_method) == torch.float32:
                    assert peak == 4 * spec.ns_workspace_numel, (ns_method, shape, peak)
    finally:
        torch.set_num_threads(threads)


def _profiled_peak(prof):
    """Peak live bytes of the CPU blocks allocated while ``prof`` ran (allocation events in order)."""
    from torch._C._profiler import _EventType
    events, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    live, known, peak = 0, {}, 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            known[ptr] = size
            live += size
            peak = max(peak, live)
        elif ptr in known:
            live -= known.pop(ptr)
    return peak


@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_orthogonalize_returns_the_ns_compute_dtype_and_leaves_its_input(ns_method):
    x = torch.randn(6, 10)
    before = x.clone()
    assert original_muon.muon_orthogonalize(x, ns_method=ns_method).dtype == original_muon.ns_compute_dtype(ns_method)
    assert torch.equal(x, before)
