# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The link-rate derivation (``bench/link_rate.py``): its Newton-Schulz FLOP formula equals what
torch's FLOP counter counts in upstream's kernel, and ``derive`` turns a throughput into positive
rates, NVLink's above InfiniBand's, linear in the number of ranks sharing the emulated link.
"""

import pathlib
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import link_rate  # noqa: E402


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (5, 5)])
@pytest.mark.parametrize("steps", [1, 3])
def test_ns_flops_equals_counted_matmuls(shape, steps):
    """4 n^2 m + 2 n^3 per step, n <= m: a tall matrix is transposed by the kernel."""
    from deepspeed.runtime.zero.muon import original_muon
    counter = FlopCounterMode(display=False)
    with link_rate._kernel_dtype(torch.float32), counter:
        original_muon.zeropower_via_newtonschulz5(torch.randn(*shape), steps=steps)
    n, m = min(shape), max(shape)
    assert link_rate.ns_flops(*shape, steps=steps) == steps * (4 * n * n * m + 2 * n**3)
    assert counter.get_total_flops() == link_rate.ns_flops(*shape, steps=steps)


def test_kernel_dtype_is_forced_and_restored():
    from deepspeed.runtime.zero.muon import original_muon
    rule = original_muon.ns_compute_dtype
    with link_rate._kernel_dtype(torch.float64):
        assert original_muon.zeropower_via_newtonschulz5(torch.randn(3, 4), steps=1).dtype == torch.float64
    assert original_muon.ns_compute_dtype is rule


def test_time_newton_schulz_restores_threads():
    before = torch.get_num_threads()
    seconds = link_rate.time_newton_schulz((32, 48), threads=1, repeats=2, steps=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert torch.get_num_threads() == before


def test_measure_gflops_uses_the_median_per_shape():
    times = {(1024, 1024): [3.0, 1.0, 2.0], (768, 1024): [0.5, 9.0, 1.0]}
    seen = []

    def timer(shape, threads):
        seen.append(threads)
        return times[shape]

    gflops = link_rate.measure_gflops(threads=3, timer=timer)
    flops = link_rate.ns_flops(1024, 1024) + link_rate.ns_flops(768, 1024)
    assert gflops == pytest.approx(flops / (2.0 + 1.0) / 1e9, rel=1e-12)
    assert seen == [3, 3]


@pytest.mark.parametrize("gflops", [50.0, 114.0])
def test_derive_rates(gflops, monkeypatch):
    monkeypatch.setattr(link_rate.os, "cpu_count", lambda: 8)  # W=2 and 4 ranks of 1 thread fit
    d2 = link_rate.derive(2, threads_per_rank=1, measured_gflops=gflops)
    d4 = link_rate.derive(4, threads_per_rank=1, measured_gflops=gflops)
    for d in (d2, d4):
        assert 0 < d.per_rank_inter_node_bits < d.per_rank_intra_node_bits
        assert 0 < d.inter_node_rate_bits < d.intra_node_rate_bits
        assert d.share == 1.0 and d.factor == pytest.approx(gflops / link_rate.REFERENCE_GFLOPS)
        assert d.per_rank_inter_node_bits == pytest.approx(link_rate.REFERENCE_INTER_NODE_BITS * d.factor)
        assert any(f"{gflops:.1f} GFLOP/s" in line for line in d.lines())
    assert d4.inter_node_rate_bits == pytest.approx(2 * d2.inter_node_rate_bits, rel=1e-12)
    assert d4.intra_node_rate_bits == pytest.approx(2 * d2.intra_node_rate_bits, rel=1e-12)
    assert d4.per_rank_inter_node_bits == pytest.approx(d2.per_rank_inter_node_bits, rel=1e-12)


def test_derive_scales_by_the_share_of_cpus_a_rank_gets(monkeypatch):
    """4 ranks of 1 thread on 2 CPUs compute at half the rate measured alone: half the link."""
    monkeypatch.setattr(link_rate.os, "cpu_count", lambda: 2)
    d2 = link_rate.derive(2, threads_per_rank=1, measured_gflops=100.0)
    d4 = link_rate.derive(4, threads_per_rank=1, measured_gflops=100.0)
    assert (d2.share, d4.share) == (1.0, 0.5)
    assert d4.per_rank_inter_node_bits == pytest.approx(d2.per_rank_inter_node_bits / 2, rel=1e-12)
    assert d4.inter_node_rate_bits == pytest.approx(d2.inter_node_rate_bits, rel=1e-12)
    assert any("0.5" in line for line in d4.lines())


def test_derive_measures_when_not_given(monkeypatch):
    calls = []

    def fake(threads, repeats=3):
        calls.append(threads)
        return 80.0

    monkeypatch.setattr(link_rate, "measure_gflops", fake)
    d = link_rate.derive(2, threads_per_rank=None)
    assert calls == [link_rate.default_threads_per_rank(2)] and d.measured_gflops == 80.0
    assert d.dtype == str(link_rate.benchmark_dtype()).replace("torch.", "")


def test_derive_rejects():
    with pytest.raises(ValueError, match="world_size"):
        link_rate.derive(0, measured_gflops=1.0)
    with pytest.raises(ValueError, match="positive"):
        link_rate.derive(2, measured_gflops=0.0)


def test_reference_links_in_bits_per_second():
    """NVLink 4's 450 GB/s per direction is 3600 Gbit/s; NDR InfiniBand is 400 Gbit/s."""
    assert link_rate.REFERENCE_INTRA_NODE_BITS == 3600e9 and link_rate.REFERENCE_INTER_NODE_BITS == 400e9
