"""Muon, Muon with Polar Express, and NorMuon on the demo's text: loss curves side by side.

Trains the demo's small Llama (``train.py``: byte windows of Python's standard library, 2 CPU
ranks, ZeRO-3, fp32, DeepSpeed's default clipping) once per variant and seed, with the same
model, samples, learning rates and steps, changing only the optimizer's params:

    muon           "ns_method": "gram" (DeepSpeed's default kernel, 5 quintic iterations)
    polar-express  "ns_method": "polar_express" (Amsel et al. 2025's per-iteration coefficients)
    normuon        "variant": "normuon" (Li et al. 2025: per-row second moment of the update)

Prints the per-step losses, each variant's mean loss over the last ``--tail`` steps (mean and
range over the seeds) and its difference from Muon's, and writes ``summary.json`` and
``variants_loss.png`` (loss per step: mean over seeds, shaded min to max) to ``--out``. This is a
small model on a few hundred steps of one corpus: it shows the variants train and how their
curves compare here, not which one is better at scale.

    DS_ACCELERATOR=cpu python examples/demo/compare_variants.py [--steps N] [--seeds S ...] [--out DIR]
"""
import argparse
import json
import os
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run_demo  # noqa: E402

# (name, legend label, train.py arguments beyond the shared ones)
VARIANTS = (
    ("muon", "Muon (gram)", ()),
    ("polar-express", "Muon, Polar Express", ("--muon-param", "ns_method=polar_express")),
    ("normuon", "NorMuon", ("--muon-param", "variant=normuon")),
)
STAGE = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=run_demo.HelpFormatter)
    p.add_argument("--out", default="out/variants", help="output directory (created)")
    run_demo.add_run_arguments(p, seed=False)
    p.set_defaults(steps=150)
    p.add_argument("--gas", type=int, default=4, help="gradient_accumulation_steps of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234], help="one run per variant and seed (model init and data windows)")
    p.add_argument("--tail", type=int, default=20, help="steps at the end whose mean loss is compared")
    p.add_argument("--variants", nargs="+", type=lambda name: name.replace("_", "-"), choices=[v[0] for v in VARIANTS],
                   default=[v[0] for v in VARIANTS], help="runs to train (polar_express, the ns_method's spelling, "
                   "is accepted for polar-express)")
    p.add_argument("--no-plot", action="store_true", help="skip variants_loss.png")
    p.add_argument("--from-summary", type=pathlib.Path, default=None,
                   help="train nothing: print and plot the runs of this summary.json (its variants, seeds and steps)")
    args = run_demo.apply_quick(p, p.parse_args(argv))
    if args.from_summary is not None:
        saved = json.loads(args.from_summary.read_text())["args"]
        for key in ("steps", "seeds", "gas", "variants", "global_batch", "seq_len", "hidden", "layers", "muon_lr",
                    "momentum", "adam_lr"):
            setattr(args, key, saved[key])
    if args.tail > args.steps:
        p.error(f"--tail {args.tail} exceeds --steps {args.steps}")
    return args


def tail_mean(losses, tail):
    return sum(losses[-tail:]) / tail


def moving_average(values, window):
    """Mean of each ``window`` consecutive values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(curves, labels, path, title, window=10):
    """``curves``: {variant: [losses per seed]}. Top: loss per step, mean over seeds, shaded min..max.
    Bottom: each variant's loss minus Muon's at the same step and seed, mean over seeds, as a moving
    average over ``window`` steps (the per-step batches' noise is common to all variants and cancels)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    for i, (name, runs) in enumerate(curves.items()):
        steps = range(1, len(runs[0]) + 1)
        per_step = list(zip(*runs))
        top.plot(steps, [statistics.fmean(s) for s in per_step], color=f"C{i}", lw=1.5, label=labels[name])
        if len(runs) > 1:
            top.fill_between(steps, [min(s) for s in per_step], [max(s) for s in per_step], color=f"C{i}", alpha=0.2)
        if "muon" in curves and name != "muon":
            deltas = [statistics.fmean(r[k] - m[k] for r, m in zip(runs, curves["muon"])) for k in range(len(runs[0]))]
            bottom.plot(steps, moving_average(deltas, window), color=f"C{i}", lw=1.5, label=f"{labels[name]} - Muon")
    top.set_ylabel("training loss (nats / byte)")
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend()
    bottom.axhline(0.0, color="C0", lw=1)
    bottom.set_ylabel(f"loss - Muon's ({window}-step mean)")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    variants = [v for v in VARIANTS if v[0] in args.variants]
    labels = {name: label for name, label, _ in VARIANTS}
    print(f"{len(variants)} variants x {len(args.seeds)} seeds x {args.steps} optimizer steps, ZeRO-{STAGE}, "
          f"gas {args.gas}, {run_demo.NPROC} ranks, global batch {args.global_batch} x {args.seq_len} bytes, "
          f"Llama hidden {args.hidden} x {args.layers} layers, Muon lr {args.muon_lr} momentum {args.momentum}, "
          f"Adam lr {args.adam_lr}\n", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves, failed, results = {}, [], {}
    if args.from_summary is not None:
        saved = json.loads(args.from_summary.read_text())
        failed, results = saved["failed"], saved["runs"]
    for name, label, extra in variants:
        for seed in args.seeds:
            key = f"{name}-seed{seed}"
            if args.from_summary is None:
                run_dir = out / key
                (run_dir / "result.json").unlink(missing_ok=True)
                print(f"== {name}, seed {seed}: {label}", flush=True)
                run_args = argparse.Namespace(**{**vars(args), "seed": seed})
                code, seconds = run_demo.launch(run_args, STAGE, args.gas, run_dir, extra)
                if code != 0 or not (run_dir / "result.json").exists():
                    print(f"FAILED: {name} seed {seed} exited with code {code}", flush=True)
                    failed.append(key)
                    continue
                results[key] = json.loads((run_dir / "result.json").read_text())
                print(f"   {seconds:.1f} s wall, final loss {results[key]['losses'][-1]:.4f}", flush=True)
            if key in results:
                curves.setdefault(name, []).append(results[key]["losses"])

    print(f"\nloss per optimizer step (nats/byte, mean over the global batch{' and seeds' if len(args.seeds) > 1 else ''})")
    print(f"{'step':>5}" + "".join(f"{n:>16}" for n in curves))
    for i in range(0, args.steps, max(1, args.steps // 15)):
        print(f"{i + 1:>5}" + "".join(f"{statistics.fmean(r[i] for r in runs):>16.4f}" for runs in curves.values()))

    print(f"\nmean loss over the last {args.tail} steps (over {len(args.seeds)} seed(s): mean, min to max)")
    table = {}
    reference = curves.get("muon")
    for name, runs in curves.items():
        tails = [tail_mean(r, args.tail) for r in runs]
        row = {"mean": statistics.fmean(tails), "min": min(tails), "max": max(tails), "per_seed": tails}
        line = f"   {labels[name]:<22} {row['mean']:.4f} ({row['min']:.4f} to {row['max']:.4f})"
        if reference is not None and name != "muon":
            deltas = [tail_mean(r, args.tail) - tail_mean(m, args.tail) for r, m in zip(runs, reference)]
            row["minus_muon"] = deltas
            line += f"   minus Muon's: {statistics.fmean(deltas):+.4f} ({min(deltas):+.4f} to {max(deltas):+.4f})"
        table[name] = row
        print(line)

    summary = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
               "args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
               "failed": failed, "tail_loss": table, "runs": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out / 'summary.json'}")
    if curves and not args.no_plot:
        title = (f"Demo text, ZeRO-{STAGE} gas {args.gas}, {run_demo.NPROC} CPU ranks, fp32, "
                 f"{len(args.seeds)} seed(s)")
        plot(curves, labels, out / "variants_loss.png", title)
        print(f"wrote {out / 'variants_loss.png'}")
    if failed:
        print(f"FAILED runs: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
