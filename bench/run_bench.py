# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Side-by-side benchmark of Muon under ZeRO-3: stock and patched DeepSpeed 0.19.7 and 0.19.8.

Run through ``python3 dev.py bench [ARGS]``, which prepares one venv per build (cached) and passes
each build's Python as ``--python NAME=PATH``. Every workload runs on every build, in interleaved
launches (repeat 1 of every build, then repeat 2, ...) so machine noise hits all builds alike.
Prints, per world size, one table with a row per workload and build, the ratios patched /
stock 0.19.8, the target checks, the seed table (stage 1/2/3 x gas 1/4 at W=1), and the overlap
comparison; writes ``results.json`` and plots to ``--out``. Asserts nothing about absolute
times; the exit code is non-zero only if a patched build fails a workload.

Workloads (``bench/worker.py``): chains of bias-free Linear layers, every matrix a Muon matrix,
4 matrices each: ``sq256`` (256x256), ``rect256`` (384x256 / 256x384), ``sq1024``, ``rect1024``
(768x1024 / 1024x768). All fp32 with ``gradient_clipping: 0``, ``reduce_scatter: false`` (stock
refuses the default ``true`` with Muon; the patched build accepts both) and
``stage3_param_persistence_threshold: 0``; TorchDynamo off (NS eager on every build).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import model  # noqa: E402  (bench/model.py)

# Shared with the tests and the demo: tests/unit/runtime/zero/zero3_muon_helpers.py.
sys.path.insert(0, str(HERE.parent / "tests"))
from unit.runtime.zero.zero3_muon_helpers import free_port, relative_difference  # noqa: E402

REFERENCE = "stock-0.19.8"
BUILD_ORDER = ("stock-0.19.7", "stock-0.19.8", "patched-0.19.7", "patched-0.19.8")
SHAPES = {
    "sq256": [(256, 256)] * 4,
    "rect256": [(384, 256), (256, 384)] * 2,
    "sq1024": [(1024, 1024)] * 4,
    "rect1024": [(768, 1024), (1024, 768)] * 2,
}
TRAFFIC_TARGET = 0.10  # Muon traffic per rank within 10% of 2P(W-1)/W^2
MODEL_WS = (2, 4, 8, 16, 64, 256, 1024)


def grid(kind: str, steps: int, warmup: int):
    """Workload configs of one launch. ``default``: each workload at gas 4 (fp32), plus, one factor
    at a time, gas 1 and CPU offload for each, gas 16 and bf16 for the ~256 workloads (stock
    0.19.7 runs Newton-Schulz gas times per step: gas 16 on the 1024 workloads alone would take
    longer than the rest); ``full``: the full product; ``quick``: sq256 only, gas 1/4, fp32 and
    offload (a smoke run)."""
    workloads = ["sq256"] if kind == "quick" else list(SHAPES)
    points = []
    for w in workloads:
        if kind == "full":
            points += [(w, g, d, o) for g in (1, 4, 16) for d in ("fp32", "bf16") for o in (False, True)]
        elif kind == "quick":
            points += [(w, 1, "fp32", False), (w, 4, "fp32", False), (w, 4, "fp32", True)]
        else:
            points += [(w, 4, "fp32", False), (w, 1, "fp32", False), (w, 4, "fp32", True)]
            if w.endswith("256"):
                points += [(w, 16, "fp32", False), (w, 4, "bf16", False)]
    return [
        dict(name=f"{w}-gas{g}-{d}{'-offload' if o else ''}",
             workload=w,
             stage=3,
             gas=g,
             dtype=d,
             offload=o,
             micro_batch=2,
             steps=steps,
             warmup=warmup) for w, g, d, o in points
    ]


def overlap_grid(steps, warmup):
    """Patched builds only: the exchange overlapped with NS or not, with buckets small enough to
    make several (2 matrices, then 1 matrix, per bucket)."""
    out = []
    for bucket in (2 * 1024 * 1024, 1024 * 1024):
        for overlap in (True, False):
            out.append(
                dict(name=f"sq1024-gas1-bucket{bucket // 1024}k-{'overlap' if overlap else 'serial'}",
                     workload="sq1024",
                     stage=3,
                     gas=1,
                     dtype="fp32",
                     offload=False,
                     micro_batch=2,
                     steps=steps,
                     warmup=warmup,
                     reduce_bucket_size=bucket,
                     overlap=overlap))
    return out


def seed_grid():
    """The seed table: two Linear(64, 64), 3 steps, W=1, stage 1/2/3 x gas 1/4, 8 samples per step."""
    return [
        dict(name=f"seed-stage{s}-gas{g}",
             workload="seed64",
             stage=s,
             gas=g,
             dtype="fp32",
             offload=False,
             micro_batch=8 // g,
             steps=3,
             warmup=0,
             save_weights=True) for s in (1, 2, 3) for g in (1, 4)
    ]


def launch(python, world_size, configs, workdir, timeout, log):
    """Run ``configs`` in one torchrun launch of ``world_size`` ranks under ``python``; relaunch
    after a crash or hang with the configs not yet run. Returns ``(rows, errors)``."""
    rows, errors = [], {}
    remaining = list(configs)
    while remaining:
        cfg_file = workdir / "configs.json"
        out_file = workdir / "rows.jsonl"
        cfg_file.write_text(json.dumps(remaining))
        out_file.write_text("")
        cmd = [
            python, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", f"--master_port={free_port()}",
            str(HERE / "worker.py"), "--configs",
            str(cfg_file), "--out",
            str(out_file), "--weights-dir",
            str(workdir)
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world_size)),
                   TORCHDYNAMO_DISABLE="1", PYTHONSAFEPATH="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
        # each venv's own compiled DeepSpeed ops (dev.py builds them there at setup)
        extensions = Path(python).absolute().parents[1] / "torch_extensions"  # venv/bin/python, links kept
        if extensions.is_dir():
            env["TORCH_EXTENSIONS_DIR"] = str(extensions)
        started = []
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            stdout, rc = proc.stdout, proc.returncode
            stderr = proc.stderr
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, rc = f"timeout after {timeout} s", None
        log.write(f"$ {' '.join(cmd)}\n{stdout}\n{stderr}\n")
        started = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("START ")]
        done = {line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("DONE ")}
        rows += [json.loads(line) for line in out_file.read_text().splitlines() if line.strip()]
        if rc == 0 and len(done) == len(remaining):
            break
        failed = next((n for n in started if n not in done), remaining[0]["name"])
        lines = [line for line in stderr.splitlines() if line.strip() and "Warning" not in line]
        raised = [line for line in lines if "Error:" in line and "ChildFailedError" not in line]
        tail = (raised or lines)[:1] or ["?"]
        errors[failed] = ("timeout" if rc is None else "crash") + f": {tail[0].strip()[:160]}"
        names = [c["name"] for c in remaining]
        remaining = remaining[names.index(failed) + 1:]
        remaining = [c for c in remaining if c["name"] not in done]
    return rows, errors


def run_job(rep, w, build, python, configs, extra, tmp, out, timeout, log, samples, errors):
    """One launch: the seed table at W=1, else the grid (plus the overlap runs on patched
    builds, minus what already failed on this build and W); adds to ``samples`` and ``errors``."""
    if w == 1:
        cfgs = seed_grid()
    else:
        cfgs = configs + (extra if build.startswith("patched") else [])
        cfgs = [c for c in cfgs if (build, w, c["name"]) not in errors]
    workdir = tmp / f"{build}-w{w}-r{rep}"
    workdir.mkdir()
    rows, errs = launch(python, w, cfgs, workdir, timeout, log)
    for row in rows:
        samples.setdefault((build, w, row["name"]), []).append(row)
    for name, err in errs.items():
        errors[(build, w, name)] = err
    if w == 1:  # keep the weights for the gas=1 vs gas=4 comparison
        for c in cfgs:
            f = workdir / f"{c['name']}.pt"
            if f.exists():
                samples[(build, w, c["name"])][-1]["weights_file"] = str(out / f"{build}-{c['name']}.pt")
                os.replace(f, out / f"{build}-{c['name']}.pt")


def fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def print_table(headers, rows):
    if not rows:
        print("(nothing measured)")
        return
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)] if rows else []
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def aggregate(samples):
    """Median over repeats of the timing and memory fields; counts must agree across repeats."""
    first = dict(samples[0])
    for key in ("boundary_time", "boundary_step_time", "micro_time", "boundary_peak_bytes"):
        values = [s[key] for s in samples if s.get(key) is not None]
        first[key] = statistics.median(values) if values else None
    first["repeats"] = len(samples)
    return first


def muon_traffic(row):
    """Muon elements received per rank per optimizer step (mean over ranks), micro-steps included."""
    return row["muon_elements_boundary_mean"] + row["muon_elements_micro_mean"]


def step_time(row):
    return row["boundary_time"] + (row["gas"] - 1) * (row["micro_time"] or 0.0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--python", action="append", default=[], metavar="BUILD=PATH",
                   help="a build's Python (dev.py bench passes all four)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--grid", choices=("default", "full", "quick"), default="default")
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved launches per build and world size (3 on a quiet machine for tighter medians)")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps per workload")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before measuring")
    p.add_argument("--no-seed", action="store_true", help="skip the seed table")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlap comparison")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch before it counts as hung")
    p.add_argument("--out", default="out/bench")
    args = p.parse_args(argv)
    pythons = dict(item.split("=", 1) for item in args.python)
    builds = [b for b in BUILD_ORDER if b in pythons] + sorted(set(pythons) - set(BUILD_ORDER))
    if not builds:
        p.error("no build given: run `python3 dev.py bench`, or pass --python BUILD=PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = grid(args.grid, args.steps, args.warmup)
    extra = [] if args.no_overlap else overlap_grid(args.steps, args.warmup)

    jobs = [(rep, w, b) for rep in range(args.repeats) for w in args.world_sizes for b in builds]
    if not args.no_seed:
        jobs += [(0, 1, b) for b in builds]
    samples, errors = {}, {}
    t0 = time.time()
    interrupted = False
    with open(out / "launches.log", "w") as log, tempfile.TemporaryDirectory() as tmp:
        try:
            for rep, w, build in tqdm(jobs, desc="launches", unit="launch"):
                run_job(rep, w, build, pythons[build], configs, extra, Path(tmp), out, args.timeout, log, samples, errors)
        except KeyboardInterrupt:  # Ctrl-C: report what was measured so far
            interrupted = True
    elapsed = time.time() - t0
    results = {k: aggregate(v) for k, v in samples.items()}
    if interrupted:
        print(f"\ninterrupted after {elapsed / 60:.1f} min: the tables hold the launches that finished")
    report(results, errors, builds, args, configs, extra, out, elapsed)
    failed_patched = [k for k in errors if k[0].startswith("patched")]
    return 1 if failed_patched else 0


def report(results, errors, builds, args, configs, extra, out, elapsed):
    names = [c["name"] for c in configs]
    print(f"\nZeRO-3 Muon benchmark: {len(builds)} builds, W in {args.world_sizes}, {args.repeats} interleaved "
          f"repeats, {args.steps} measured steps after {args.warmup} warm-up; {elapsed / 60:.1f} min\n")
    print("Per optimizer step and rank. NS: Newton-Schulz calls summed over ranks (micro: on non-boundary "
          "micro-steps). Muon recv: Muon elements received per rank (mean over ranks; micro-steps included), "
          "/bound: over 2P(W-1)/W^2. Times: median, slowest rank. Peak: resident memory of the boundary "
          "micro-step above its start, largest over ranks.\n")
    checks = []
    for w in args.world_sizes:
        print(f"=== W={w} ===")
        table = []
        for name in names:
            for build in builds:
                key = (build, w, name)
                if key in errors:
                    table.append([name, build, errors[key]] + [""] * 7)
                    continue
                r = results.get(key)
                if r is None:
                    continue
                bound = model.lower_bound(SHAPES[r["workload"]], w)
                table.append([
                    name, build, f"{r['ns_calls_per_step']:.0f}/{r['muon_matrices']}",
                    f"{r['ns_calls_micro_per_step']:.0f}", f"{muon_traffic(r) / r['muon_elements']:.3f} P",
                    f"{muon_traffic(r) / bound:.3f}", f"{(r['muon_bytes_boundary_mean'] + r['muon_bytes_micro_mean']) / 2**20:.2f}",
                    f"{r['boundary_time'] * 1e3:.0f}", fmt(r["micro_time"] and r["micro_time"] * 1e3, ".0f"),
                    fmt(r["boundary_peak_bytes"] and r["boundary_peak_bytes"] / 2**20, ".1f")
                ])
        print_table(["workload", "build", "NS/matrices", "NS micro", "Muon recv", "/bound", "MiB recv",
                     "boundary ms", "micro ms", "peak MiB"], table)
        print()
        # ratios patched / stock 0.19.8
        ratio_rows = []
        for name in names:
            ref = results.get((REFERENCE, w, name))
            for build in builds:
                if not build.startswith("patched"):
                    continue
                r = results.get((build, w, name))
                if r is None or ref is None:
                    continue
                ratio_rows.append([
                    name, build,
                    f"{muon_traffic(r) / muon_traffic(ref):.3f}" if muon_traffic(ref) else "-",
                    f"{r['ns_calls_per_step'] / ref['ns_calls_per_step']:.2f}" if ref["ns_calls_per_step"] else "-",
                    f"{r['boundary_time'] / ref['boundary_time']:.2f}", f"{step_time(r) / step_time(ref):.2f}",
                    f"{r['boundary_peak_bytes'] / ref['boundary_peak_bytes']:.2f}"
                    if r.get("boundary_peak_bytes") and ref.get("boundary_peak_bytes") else "-"
                ])
        print(f"Ratios {'patched'} / {REFERENCE} at W={w}:")
        print_table(["workload", "build", "Muon recv", "NS calls", "boundary time", "step time", "peak mem"],
                    ratio_rows)
        print()
        checks += target_checks(results, builds, w, names)

    print("=== targets (patched builds) ===")
    print_table(["target", "build", "W", "measured", "holds"], checks)
    print()
    print_model(results, builds, args.world_sizes)
    if extra:
        print_overlap(results, errors, builds, args.world_sizes, extra)
    if not args.no_seed:
        print_seed(results, errors, builds)
    write_outputs(results, errors, builds, args, out)


def target_checks(results, builds, w, names):
    rows = []
    for build in builds:
        if not build.startswith("patched"):
            continue
        mine = {n: results.get((build, w, n)) for n in names}
        mine = {n: r for n, r in mine.items() if r}
        if not mine:
            continue
        worst = max(abs(muon_traffic(r) / model.lower_bound(SHAPES[r["workload"]], w) - 1) for r in mine.values())
        rows.append(["Muon recv within 10% of 2P(W-1)/W^2 (mean over ranks)", build, w, f"{worst:.4f} off",
                     worst <= TRAFFIC_TARGET])
        worst_max = max(
            abs((r["muon_elements_boundary_max"] + r["muon_elements_micro_max"]) /
                model.lower_bound(SHAPES[r["workload"]], w) - 1) for r in mine.values())
        rows.append(["  the same, busiest rank", build, w, f"{worst_max:.4f} off", worst_max <= TRAFFIC_TARGET])
        ns_ok = all(r["ns_calls_per_step"] == r["muon_matrices"] and r["ns_calls_micro_per_step"] == 0
                    for r in mine.values())
        rows.append(["NS calls = matrices, none on micro-steps (offload too)", build, w,
                     f"{sum(1 for r in mine.values() if r['ns_calls_per_step'] == r['muon_matrices'])}/{len(mine)}",
                     ns_ok])
        for wl in SHAPES:
            g1, g16 = mine.get(f"{wl}-gas1-fp32"), mine.get(f"{wl}-gas16-fp32")
            if g1 and g16:
                flat = muon_traffic(g16) == muon_traffic(g1) and g16["ns_calls_per_step"] == g1["ns_calls_per_step"]
                rows.append([f"Muon cost flat in gas ({wl}: recv, NS gas16/gas1)", build, w,
                             f"{muon_traffic(g16) / muon_traffic(g1):.3f}, "
                             f"{g16['ns_calls_per_step'] / g1['ns_calls_per_step']:.2f}", flat])
        ref = {n: results.get((REFERENCE, w, n)) for n in mine}
        pairs = [(r, ref[n]) for n, r in mine.items() if ref.get(n)]
        if pairs:
            ratios = [r["boundary_time"] / s["boundary_time"] for r, s in pairs]
            rows.append(["boundary time <= stock 0.19.8 (max ratio)", build, w, f"{max(ratios):.2f}",
                         max(ratios) <= 1.0])
        peaks = [(r["boundary_peak_bytes"], r["bucket_bound_bytes"]) for r in mine.values()
                 if r.get("boundary_peak_bytes") is not None and r.get("bucket_bound_bytes")]
        if peaks:
            worst_peak = max(pk / bb for pk, bb in peaks)
            rows.append(["boundary peak / owned bytes of one bucket (max)", build, w, f"{worst_peak:.2f}", "-"])
    return rows


def print_model(results, builds, world_sizes):
    print("=== model check: measured Muon recv per rank / bench/model.py (fp32, gas 4, no offload) ===")
    rows = []
    for w in world_sizes:
        for wl, shapes in SHAPES.items():
            for build, predict in (("patched-0.19.8", lambda: sum(model.patched_traffic(shapes, w)) / w),
                                   ("patched-0.19.7", lambda: sum(model.patched_traffic(shapes, w)) / w),
                                   ("stock-0.19.8", lambda: model.stock_0198_traffic(shapes, w))):
                r = results.get((build, w, f"{wl}-gas4-fp32"))
                if r:
                    rows.append([w, wl, build, f"{muon_traffic(r):.0f}", f"{predict():.0f}",
                                 f"{muon_traffic(r) / predict():.4f}"])
    print_table(["W", "workload", "build", "measured", "model", "ratio"], rows)
    print()
    print("=== model: Llama-2 7B projections (224 Muon matrices, P = 6.48e9), default reduce_bucket_size ===")
    print("traffic: Muon elements received per rank per step / P; NS work: busiest rank's share of all NS work")
    rows = [[r["world_size"], f"{r['bound']:.4g}", f"{r['patched_mean']:.4g}", f"{r['patched_max']:.4g}",
             f"{r['stock_0198']:.4g}", f"{r['stock_0198'] / r['patched_max']:.1f}", f"{r['ns_patched_max']:.4g}",
             f"{r['ns_stock_max']:.4g}", "1"] for r in model.summary(model.LLAMA_7B, MODEL_WS)]
    print_table(["W", "bound", "patched mean", "patched max", "stock 0.19.8", "stock/patched max", "NS patched",
                 "NS stock", "NS stock offload"], rows)
    print()


def print_overlap(results, errors, builds, world_sizes, extra):
    print("=== overlap: exchange of bucket k+1 in flight while the owner orthogonalizes bucket k ===")
    rows = []
    for w in world_sizes:
        for build in builds:
            if not build.startswith("patched"):
                continue
            for c in extra:
                if not c["overlap"]:
                    continue
                on = results.get((build, w, c["name"]))
                off = results.get((build, w, c["name"].replace("overlap", "serial")))
                if on and off:
                    rows.append([w, build, c["name"].rsplit("-", 1)[0], f"{off['boundary_time'] * 1e3:.0f}",
                                 f"{on['boundary_time'] * 1e3:.0f}", f"{on['boundary_time'] / off['boundary_time']:.2f}",
                                 fmt(off["boundary_peak_bytes"] and off["boundary_peak_bytes"] / 2**20, ".1f"),
                                 fmt(on["boundary_peak_bytes"] and on["boundary_peak_bytes"] / 2**20, ".1f")])
    print_table(["W", "build", "workload", "serial ms", "overlap ms", "ratio", "serial peak MiB",
                 "overlap peak MiB"], rows)
    print()


def print_seed(results, errors, builds):
    print("=== seed table: two Linear(64, 64), 3 steps, W=1, 8 samples per step ===")
    rows = []
    for build in builds:
        for stage in (1, 2, 3):
            g1, g4 = (results.get((build, 1, f"seed-stage{stage}-gas{g}")) for g in (1, 4))
            err = errors.get((build, 1, f"seed-stage{stage}-gas1")) or errors.get((build, 1, f"seed-stage{stage}-gas4"))
            if err or not (g1 and g4):
                rows.append([build, stage, err or "missing", "", ""])
                continue
            diff = relative_difference(torch.load(g4["weights_file"]), torch.load(g1["weights_file"]))
            g1["rel_diff_gas1_gas4"] = g4["rel_diff_gas1_gas4"] = diff
            rows.append([build, stage, f"{g1['ns_calls_per_step'] * 3:.0f} / {g4['ns_calls_per_step'] * 3:.0f}",
                         f"{diff:.1e}", "ok" if diff < 1e-5 else "WRONG"])
    print_table(["build", "stage", "NS calls gas1 / gas4 (3 steps)", "gas1 vs gas4", ""], rows)
    print()


def write_outputs(results, errors, builds, args, out):
    data = dict(builds=builds,
                world_sizes=args.world_sizes,
                rows=[dict(v, build=k[0]) for k, v in results.items()],
                errors=[dict(build=k[0], world_size=k[1], name=k[2], error=e) for k, e in errors.items()],
                model={name: model.summary(shapes, args.world_sizes) for name, shapes in SHAPES.items()})
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    try:
        import plots
        for f in plots.make_all(data, out):
            print(f"wrote {f}")
    except ImportError as e:
        print(f"no plots: {e}")
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    sys.exit(main())
