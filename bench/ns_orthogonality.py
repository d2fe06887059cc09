# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How orthogonal Muon's update is after 1 to 8 iterations: "gram", "standard", "polar_express".

The measurement behind the user guide's advice on ``ns_method`` (docs/performance.md). Run under a
build's Python, e.g.::

    DS_ACCELERATOR=cpu python bench/ns_orthogonality.py --threads 2

For Llama-shaped matrices (``--hidden`` d, ``--intermediate`` f: q/k/v/o d x d, gate/up f x d,
down d x f; the default 512 / 1376 is Llama-2's 4096 / 11008 scaled by 1/8, the proportions of
``bench/worker.py``'s ``llama`` workload), each of two inputs, a Gaussian random matrix and one
with singular values ``1, 1/2, ..., 1/m`` (a gradient's low stable rank), goes through upstream's
kernels (``original_muon.zeropower_via_gram_newtonschulz``, ``zeropower_via_newtonschulz5``) and
``polar_express.zeropower_via_polar_express`` at each iteration count. Printed per input, per
shape class (``square``: d x d; ``rectangular``: the worse of f x d and d x f, which the kernels
both iterate as d x f) and per iteration count:

- ``max|1-s|``: the largest distance of a singular value of the result from 1 (0 for an exactly
  orthogonal result; the quintic's fixed point leaves about 0.3), and
- ``||UU^T-I||/sqrt(m)``: the Frobenius distance of the wide orientation ``U`` (m x n, m <= n)
  from orthonormal rows, per row (the RMS of ``s^2 - 1``),

each computed in fp64 from the kernel's output. Each table twice: the kernels in the dtypes they
run in on this accelerator (``ns_compute_dtype``), and all of them in fp32 (the accelerator reports
neither fp16 nor bf16 while they run), which separates the method from its rounding. A square
Gaussian matrix has singular values far below 1e-3 of its Frobenius norm (the bottom of the
interval Polar Express's schedule is designed for), where the quintic's slope at 0 (3.4 per
iteration) lifts them faster: its ``max|1-s|`` shows that, the per-row distance the bulk.
Deterministic (seeded); times are not measured.
"""

import argparse
import contextlib
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

METHODS = ("gram", "standard", "polar_express")


def llama_shapes(hidden, intermediate):
    """The Muon matrices of a Llama decoder layer, one per distinct shape, by shape class:
    ``{"square": [(d, d)], "rectangular": [(f, d), (d, f)]}``."""
    return {"square": [(hidden, hidden)], "rectangular": [(intermediate, hidden), (hidden, intermediate)]}


def inputs(shape, seed):
    """``{"gaussian": ..., "decaying": ...}``: fp32 matrices of ``shape``, seeded."""
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(shape, generator=gen)
    m = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], m, generator=gen, dtype=torch.float64))
    decaying = (u * (1.0 / torch.arange(1, m + 1, dtype=torch.float64))) @ v.T
    return {"gaussian": gaussian, "decaying": decaying.float()}


def kernel(ns_method):
    """The kernel ``muon_orthogonalize`` runs for ``ns_method`` (looked up on upstream's module)."""
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed.runtime.zero.muon import polar_express
    if ns_method == "gram":
        return original_muon.zeropower_via_gram_newtonschulz
    if ns_method == "standard":
        return original_muon.zeropower_via_newtonschulz5
    return getattr(original_muon, "zeropower_via_polar_express", polar_express.zeropower_via_polar_express)


def errors(result):
    """``(max|1-s|, ||UU^T-I||_F / sqrt(m))`` of one result, in fp64 (see the module docstring)."""
    u = result.double()
    if u.size(-2) > u.size(-1):
        u = u.mT
    s = torch.linalg.svdvals(u)
    gram = u @ u.mT
    eye = torch.eye(u.size(-2), dtype=u.dtype)
    return (1 - s).abs().max().item(), (torch.linalg.matrix_norm(gram - eye) / u.size(-2)**0.5).item()


@contextlib.contextmanager
def all_fp32(enabled):
    """While enabled, the accelerator reports neither fp16 nor bf16: every kernel computes in fp32."""
    if not enabled:
        yield
        return
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    saved = accelerator.is_fp16_supported, accelerator.is_bf16_supported
    accelerator.is_fp16_supported = accelerator.is_bf16_supported = lambda: False
    try:
        yield
    finally:
        accelerator.is_fp16_supported, accelerator.is_bf16_supported = saved


def measure(shapes, max_steps, fp32, seed=0):
    """``{(input, shape class): {ns_method: [(max|1-s|, rms), ...] for steps 1..max_steps}}``, the
    worst over the class's shapes; and ``{ns_method: dtype}`` the kernels ran in."""
    table, dtypes = {}, {}
    with all_fp32(fp32):
        for k, (cls, shape) in enumerate((c, s) for c, members in shapes.items() for s in members):
            for name, matrix in inputs(shape, seed + k).items():
                rows = table.setdefault((name, cls), {m: [(0.0, 0.0)] * max_steps for m in METHODS})
                for ns_method in METHODS:
                    for steps in range(1, max_steps + 1):
                        out = kernel(ns_method)(matrix, steps)
                        dtypes[ns_method] = out.dtype
                        worst, rms = errors(out)
                        old = rows[ns_method][steps - 1]
                        rows[ns_method][steps - 1] = (max(old[0], worst), max(old[1], rms))
    return table, dtypes


def format_table(title, rows, dtypes):
    """The lines of one table: a header, then one line per iteration count."""
    head = "".join(f"  {m + ' (' + str(dtypes[m]).split('.')[-1] + ')':^29}" for m in METHODS)
    sub = "".join(f"  {'max|1-s|':>12} {'||UU^T-I||/vm':>16}" for _ in METHODS)
    lines = [title, f"{'steps':>5}{head}", f"{'':>5}{sub}"]
    for steps in range(len(next(iter(rows.values())))):
        cells = "".join(f"  {rows[m][steps][0]:12.3e} {rows[m][steps][1]:16.3e}" for m in METHODS)
        lines.append(f"{steps + 1:>5}{cells}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512, help="d: q/k/v/o are d x d")
    p.add_argument("--intermediate", type=int, default=1376, help="f: gate/up f x d, down d x f")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from deepspeed.accelerator import get_accelerator
    shapes = llama_shapes(args.hidden, args.intermediate)
    print(f"Orthogonality of the Newton-Schulz result vs iterations; accelerator {get_accelerator().device_name()}, "
          f"torch {torch.__version__}, {args.threads} thread(s); Llama-shaped matrices "
          f"{', '.join(f'{r}x{c}' for members in shapes.values() for r, c in members)} (d={args.hidden}, "
          f"f={args.intermediate}); fp64 metrics of each kernel's output (no aspect-ratio scale).")
    lines = []
    for fp32, label in ((False, "dtypes as run here"), (True, "all in fp32")):
        table, dtypes = measure(shapes, args.max_steps, fp32, args.seed)
        for (name, cls), rows in table.items():
            lines += [""] + format_table(f"== input: {name}, {cls}, {label} ==", rows, dtypes)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
