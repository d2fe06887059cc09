# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""The emulated link's rate, derived from a measured compute ratio rather than guessed.

On a real cluster, Muon's step time is Newton-Schulz (NS) compute plus the exchange's traffic
over the network. This CPU computes NS far slower than a GPU does, so to keep the two terms in
the same proportion as on the reference cluster, the emulated link is slowed down by the same
factor:

1. Measure this machine's NS throughput in GFLOP/s on the benchmark's matrix shapes (1024x1024
   and 768x1024, 5 steps), timing upstream's kernel
   ``deepspeed.runtime.zero.muon.original_muon.zeropower_via_newtonschulz5``, with as many torch
   threads as a benchmark rank has (``max(1, os.cpu_count() // W)``), median of a few repeats.
   The kernel casts to ``ns_compute_dtype("standard")`` (bf16 on the CPU accelerator); the
   benchmark's ranks run Muon's default ``ns_method="gram"``, whose dtype on this CPU is fp32
   (``ns_compute_dtype("gram")``: no fp16 on the CPU accelerator). So the kernel is timed in the
   dtype the benchmark's ranks really compute in (``ns_compute_dtype("gram")``, fp32 here), by
   substituting that rule in the kernel's module for the duration of the timing. (For square
   matrices the "gram" kernel runs exactly this iteration; for 768x1024 it runs its Gram variant,
   which does fewer FLOPs: the rate, a matmul-throughput property, is what is measured here.)

   FLOPs per NS step on an n x m matrix with n <= m (the kernel transposes a tall one), counting
   matmuls only (multiply-add = 2 FLOPs; the elementwise terms are O(nm), negligible)::

       A = X @ X^T      2 n^2 m
       A @ A            2 n^3
       B @ X            2 n^2 m
       total            4 n^2 m + 2 n^3      per step, times the number of steps

2. factor = measured GFLOP/s / the reference GPU's dense bf16 matmul rate.
3. per-rank link = reference link per GPU x factor, for the inter-node link (InfiniBand) and the
   intra-node one (NVLink).
4. All W ranks' sends share the namespace's one shaped loopback queue (see ``bench/netns.py``),
   so the namespace rate for W ranks = W x per-rank link. ``--net auto`` uses the inter-node one.

The timing runs alone; when W x threads exceeds the CPUs, the W ranks computing at once each get
a share ``cpus / (W x threads)`` of that rate, so the factor uses the measured rate times that
share (W=4 on 2 cores: half): the link keeps pace with what a rank really computes.

Run under the patched venv, from the checkout: ``DS_ACCELERATOR=cpu .venv/0.19.8/bin/python
bench/link_rate.py`` prints the derivation for W=2 and W=4.
"""

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the kernel is @compiler.compile()'d; time it eagerly

# Reference cluster.
# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 Tensor Core (1979 with 2:4 sparsity).
REFERENCE_GFLOPS = 989e3
REFERENCE_GPU = "H100 SXM dense BF16"
# One NDR InfiniBand ConnectX-7 adapter per GPU: 400 Gbit/s (NVIDIA ConnectX-7 / DGX H100).
REFERENCE_INTER_NODE_BITS = 400e9
# NVLink 4 on H100 SXM: 900 GB/s total bidirectional = 450 GB/s per direction = 3600 Gbit/s per GPU.
REFERENCE_INTRA_NODE_BITS = 450e9 * 8

NS_STEPS = 5
SHAPES: Tuple[Tuple[int, int], ...] = ((1024, 1024), (768, 1024))  # bench/run_bench.py's sq1024, rect1024


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of ``steps`` standard Newton-Schulz steps on a ``rows x cols`` matrix:
    ``steps * (4 n^2 m + 2 n^3)`` with ``n = min(rows, cols)``, ``m = max(rows, cols)``."""
    n, m = min(rows, cols), max(rows, cols)
    return steps * (4 * n * n * m + 2 * n**3)


def default_threads_per_rank(world_size: int) -> int:
    """The torch threads a benchmark rank has: ``max(1, os.cpu_count() // world_size)``."""
    return max(1, (os.cpu_count() or 1) // world_size)


@contextlib.contextmanager
def _kernel_dtype(dtype):
    """Make ``zeropower_via_newtonschulz5`` compute in ``dtype`` (it looks up the rule at each call)."""
    from deepspeed.runtime.zero.muon import original_muon
    rule = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda ns_method="gram": dtype
    try:
        yield
    finally:
        original_muon.ns_compute_dtype = rule


def benchmark_dtype():
    """The torch dtype the benchmark's ranks run Newton-Schulz in: Muon's default ``ns_method``
    ("gram") under upstream's ``ns_compute_dtype`` on this accelerator."""
    from deepspeed.runtime.zero.muon import original_muon
    return original_muon.ns_compute_dtype("gram")


def time_newton_schulz(shape: Tuple[int, int], threads: int, repeats: int = 3, steps: int = NS_STEPS,
                       dtype=None) -> List[float]:
    """Seconds of each of ``repeats`` calls (after one warm-up) of upstream's
    ``zeropower_via_newtonschulz5`` on a random fp32 ``shape`` matrix, computing in ``dtype``
    (default: ``benchmark_dtype()``), with ``torch.set_num_threads(threads)`` (restored after)."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon
    dtype = dtype or benchmark_dtype()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        with _kernel_dtype(dtype):
            original_muon.zeropower_via_newtonschulz5(g, steps=steps)
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                original_muon.zeropower_via_newtonschulz5(g, steps=steps)
                seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return seconds


def measure_gflops(threads: int, shapes: Sequence[Tuple[int, int]] = SHAPES, repeats: int = 3,
                   timer: Optional[Callable[[Tuple[int, int], int], List[float]]] = None) -> float:
    """NS throughput in GFLOP/s over ``shapes``: total ``ns_flops`` / total median seconds.
    ``timer(shape, threads) -> [seconds...]`` defaults to ``time_newton_schulz``."""
    timer = timer or (lambda shape, t: time_newton_schulz(shape, t, repeats=repeats))
    flops = sum(ns_flops(*s) for s in shapes)
    seconds = sum(statistics.median(timer(s, threads)) for s in shapes)
    return flops / seconds / 1e9


@dataclasses.dataclass
class Derivation:
    """Link rates for W ranks from the measured NS throughput. Rates in bits/s."""
    world_size: int
    threads_per_rank: int
    dtype: str  # the dtype NS was timed in, e.g. "float32"
    measured_gflops: float
    share: float  # of the measured rate a rank gets when all W compute at once: min(1, cpus / (W x threads))
    factor: float  # measured_gflops x share / REFERENCE_GFLOPS
    per_rank_inter_node_bits: float
    per_rank_intra_node_bits: float
    inter_node_rate_bits: float  # namespace rate for W ranks (aggregate) = W x per-rank
    intra_node_rate_bits: float  # the same for NVLink

    def lines(self) -> List[str]:
        from netns import describe_rate  # bench/ is on sys.path when run as a script or from the benchmark
        w = self.world_size
        return [
            f"W={w}: Newton-Schulz on {', '.join(f'{r}x{c}' for r, c in SHAPES)} ({NS_STEPS} steps, "
            f"{self.dtype}, {self.threads_per_rank} thread(s) per rank): {self.measured_gflops:.1f} GFLOP/s "
            f"(FLOPs per step 4n^2m + 2n^3)",
            f"  share of it per rank with {w} ranks x {self.threads_per_rank} thread(s) on {os.cpu_count() or 1} "
            f"CPU(s) computing at once: {self.share:.2g}",
            f"  factor = {self.measured_gflops:.1f} x {self.share:.2g} / {REFERENCE_GFLOPS:.0f} GFLOP/s "
            f"({REFERENCE_GPU}) = {self.factor:.3e}",
            f"  per rank: inter-node {describe_rate(REFERENCE_INTER_NODE_BITS)} x factor = "
            f"{describe_rate(self.per_rank_inter_node_bits)}; intra-node "
            f"{describe_rate(REFERENCE_INTRA_NODE_BITS)} x factor = {describe_rate(self.per_rank_intra_node_bits)}",
            f"  namespace (shared loopback, {w} ranks): inter-node {w} x "
            f"{describe_rate(self.per_rank_inter_node_bits)} = {describe_rate(self.inter_node_rate_bits)}; "
            f"intra-node {describe_rate(self.intra_node_rate_bits)}",
        ]


def derive(world_size: int, threads_per_rank: Optional[int] = None, measured_gflops: Optional[float] = None,
           repeats: int = 3) -> Derivation:
    """The link rates for ``world_size`` ranks. Measures NS GFLOP/s (``measure_gflops``) with
    ``threads_per_rank`` threads (default ``default_threads_per_rank(world_size)``) unless
    ``measured_gflops`` is given. Raises ValueError for world_size < 1 or a non-positive rate."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads_per_rank or default_threads_per_rank(world_size)
    dtype = str(benchmark_dtype()).replace("torch.", "")
    gflops = measured_gflops if measured_gflops is not None else measure_gflops(threads, repeats=repeats)
    if not gflops > 0:
        raise ValueError(f"measured NS throughput must be positive, got {gflops}")
    share = min(1.0, (os.cpu_count() or 1) / (world_size * threads))
    factor = gflops * share / REFERENCE_GFLOPS
    inter, intra = REFERENCE_INTER_NODE_BITS * factor, REFERENCE_INTRA_NODE_BITS * factor
    return Derivation(world_size=world_size, threads_per_rank=threads, dtype=dtype, measured_gflops=gflops,
                      share=share, factor=factor, per_rank_inter_node_bits=inter, per_rank_intra_node_bits=intra,
                      inter_node_rate_bits=world_size * inter, intra_node_rate_bits=world_size * intra)


def main(argv=None) -> int:
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description="Derive the emulated link rate from this machine's measured "
                                     "Newton-Schulz throughput.")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for w in args.world_sizes:
        print("\n".join(derive(w, repeats=args.repeats).lines()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
