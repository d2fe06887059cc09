# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Newton-Schulz on k same-shape matrices: one batched call against k calls, by matrix size.

The measurement behind ``newton_schulz.CPU_BATCH_MAX_ELEMENTS`` (which sizes an owner batches by
default on the CPU). Run under a build's Python, e.g.::

    DS_ACCELERATOR=cpu python bench/ns_batch.py --threads 1

Times upstream's ``muon_orthogonalize`` (``--dtype`` input, fp32 by default, Muon's default
"gram" method, eager) on a stack of ``--batch`` random matrices of each size against a loop of one
call per matrix, on ``--device`` (default: DeepSpeed's accelerator's current device); prints the
median of ``--repeats`` timings after one warm-up (each timing ends with the accelerator
synchronized) and the ratio batched / one by one. ``--shapes llama:H:I`` takes a Llama layer's
three matrix shapes instead (HxH for q, k, v, o; IxH for gate and up; HxI for down); ``--json``
adds a ``JSON {...}`` line per shape with the median, min and max in milliseconds and ``ns_dtype``, the dtype the
iteration computed in (``dev.py gpu-check`` reads them). Upstream's rule ``original_muon.ns_compute_dtype`` runs
"gram" in fp16 wherever the accelerator supports fp16, whatever the input's dtype; ``--ns-dtype fp32`` replaces the
rule in this process by one that returns fp32 (DeepSpeed itself is not changed); ``--variants`` runs several
input / NS dtype pairs in one process (one import of torch and DeepSpeed).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

SIZES = ((64, 64), (96, 96), (128, 128), (128, 344), (192, 192), (256, 256), (256, 688), (512, 512), (1024, 1024))


def timings(fn, repeats, sync=lambda: None):
    """Seconds of ``repeats`` calls of ``fn`` after one warm-up call, each ended by ``sync()``."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn, repeats, sync=lambda: None):
    return statistics.median(timings(fn, repeats, sync))


def parse_shapes(text):
    """``"llama:H:I"`` -> ``((H, H), (I, H), (H, I))``; ``None`` -> ``SIZES``. Raises ValueError."""
    if text is None:
        return SIZES
    kind, _, dims = text.partition(":")
    try:
        hidden, intermediate = (int(d) for d in dims.split(":"))
    except ValueError:
        raise ValueError(f"--shapes {text!r}: expected llama:HIDDEN:INTERMEDIATE, e.g. llama:4096:11008") from None
    if kind != "llama" or hidden <= 0 or intermediate <= 0:
        raise ValueError(f"--shapes {text!r}: expected llama:HIDDEN:INTERMEDIATE with positive sizes")
    return ((hidden, hidden), (intermediate, hidden), (hidden, intermediate))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (a benchmark rank has cpus // W)")
    p.add_argument("--batch", type=int, default=8, help="matrices per shape")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ns-method", default="gram", choices=("gram", "standard"))
    p.add_argument("--device", help="torch device (default: the accelerator's current device)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the matrices' dtype")
    p.add_argument("--shapes", help="llama:HIDDEN:INTERMEDIATE (default: the fixed size list)")
    p.add_argument("--json", action="store_true", help="also a JSON line per shape")
    p.add_argument("--ns-dtype",
                   default="upstream",
                   choices=("upstream", "fp32"),
                   help="the dtype Newton-Schulz computes in: upstream's rule (default) or fp32")
    p.add_argument("--variants",
                   nargs="+",
                   help="DTYPE:NS_DTYPE pairs run one after the other in this process (e.g. fp32:upstream "
                   "bf16:upstream fp32:fp32), instead of --dtype and --ns-dtype")
    args = p.parse_args(argv)
    try:
        sizes = parse_shapes(args.shapes)
        variants = parse_variants(args.variants) if args.variants else [(args.dtype, args.ns_dtype)]
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import original_muon
    accelerator = get_accelerator()
    device = torch.device(args.device or accelerator.current_device_name())
    sync = accelerator.synchronize if device.type != "cpu" else (lambda: None)
    upstream_rule = original_muon.ns_compute_dtype
    for input_dtype, ns_choice in variants:
        original_muon.ns_compute_dtype = (
            lambda ns_method="gram": torch.float32) if ns_choice == "fp32" else upstream_rule
        try:
            run_variant(args, sizes, input_dtype, ns_choice, device, sync, original_muon)
        finally:
            original_muon.ns_compute_dtype = upstream_rule


def parse_variants(texts):
    """``["fp32:upstream", "fp32:fp32"]`` -> ``[("fp32", "upstream"), ("fp32", "fp32")]``. Raises ValueError."""
    out = []
    for text in texts:
        dtype, _, ns = text.partition(":")
        if dtype not in ("fp32", "bf16") or ns not in ("upstream", "fp32"):
            raise ValueError(f"--variants {text!r}: expected DTYPE:NS_DTYPE with DTYPE fp32 or bf16 and NS_DTYPE "
                             "upstream or fp32")
        out.append((dtype, ns))
    return out


def run_variant(args, sizes, input_dtype, ns_choice, device, sync, original_muon):
    """Times each shape with ``input_dtype`` matrices under the current ``ns_compute_dtype`` rule (``ns_choice``)."""
    ns_dtype = str(original_muon.ns_compute_dtype(args.ns_method)).replace("torch.", "")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[input_dtype]
    print(f"{args.batch} matrices per shape, {input_dtype} on {device}, {args.threads} thread(s), ns_method "
          f"{args.ns_method} (computes in {ns_dtype}), median of {args.repeats}")
    print(f"{'shape':>12} {'one by one ms':>14} {'batched ms':>11} {'ratio':>6}")
    gen = torch.Generator().manual_seed(0)
    for rows, cols in sizes:
        stack = torch.randn(args.batch, rows, cols, generator=gen).to(device, dtype)
        one = timings(lambda: [original_muon.muon_orthogonalize(m, 5, args.ns_method) for m in stack], args.repeats,
                      sync)
        batched = timings(lambda: original_muon.muon_orthogonalize(stack, 5, args.ns_method, True), args.repeats, sync)
        one_med, batched_med = statistics.median(one), statistics.median(batched)
        print(f"{f'{rows}x{cols}':>12} {one_med * 1e3:14.2f} {batched_med * 1e3:11.2f} {batched_med / one_med:6.2f}")
        if args.json:
            print("JSON " + json.dumps(
                dict(shape=f"{rows}x{cols}",
                     batch=args.batch,
                     dtype=input_dtype,
                     ns_dtype=ns_dtype,
                     ns_rule=ns_choice,
                     device=str(device),
                     one_ms=one_med * 1e3,
                     one_min_ms=min(one) * 1e3,
                     one_max_ms=max(one) * 1e3,
                     batched_ms=batched_med * 1e3,
                     batched_min_ms=min(batched) * 1e3,
                     batched_max_ms=max(batched) * 1e3,
                     ratio=batched_med / one_med,
                     repeats=args.repeats)),
                  flush=True)


if __name__ == "__main__":
    main()
