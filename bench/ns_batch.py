# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Newton-Schulz on k same-shape matrices: one batched call against k calls, by matrix size.

The measurement behind ``newton_schulz.CPU_BATCH_MAX_ELEMENTS`` (which sizes an owner batches by
default on the CPU). Run under a build's Python, e.g.::

    DS_ACCELERATOR=cpu python bench/ns_batch.py --threads 1

Times upstream's ``muon_orthogonalize`` (fp32 input, Muon's default "gram" method, eager) on a
stack of ``--batch`` random matrices of each size against a loop of one call per matrix; prints
the median of ``--repeats`` timings after one warm-up and the ratio batched / one by one.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

SIZES = ((64, 64), (96, 96), (128, 128), (128, 344), (192, 192), (256, 256), (256, 688), (512, 512), (1024, 1024))


def median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (a benchmark rank has cpus // W)")
    p.add_argument("--batch", type=int, default=8, help="matrices per shape")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ns-method", default="gram", choices=("gram", "standard"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from deepspeed.runtime.zero.muon import original_muon
    print(f"{args.batch} matrices per shape, {args.threads} thread(s), ns_method {args.ns_method} "
          f"({original_muon.ns_compute_dtype(args.ns_method)}), median of {args.repeats}")
    print(f"{'shape':>12} {'one by one ms':>14} {'batched ms':>11} {'ratio':>6}")
    gen = torch.Generator().manual_seed(0)
    for rows, cols in SIZES:
        stack = torch.randn(args.batch, rows, cols, generator=gen)
        one = median_seconds(lambda: [original_muon.muon_orthogonalize(m, 5, args.ns_method) for m in stack],
                             args.repeats)
        batched = median_seconds(lambda: original_muon.muon_orthogonalize(stack, 5, args.ns_method, True),
                                 args.repeats)
        print(f"{f'{rows}x{cols}':>12} {one * 1e3:14.2f} {batched * 1e3:11.2f} {batched / one:6.2f}")


if __name__ == "__main__":
    main()
