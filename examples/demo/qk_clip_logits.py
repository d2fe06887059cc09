"""MuonClip on the demo's text: the largest attention logit per step with and without QK-clip.

Trains the demo's small Llama (``train.py``: byte windows of Python's standard library, 2 CPU ranks, ZeRO-3, fp32,
multi-head attention) twice with the same model, samples and steps, at a Muon learning rate high enough that the
attention logits grow without bound (default 0.1, 5x the demo's):

    muon      "qk_clip_threshold": 1e30 (logits recorded, no head ever clipped: plain Muon bit for bit, as
              tests/unit/runtime/zero/test_muon_qk_clip.py checks)
    muonclip  "qk_clip_threshold": --threshold (default 100, Kimi K2's)

Prints every ``--every`` steps the largest pre-softmax logit over all heads and the step's batch (after the
all-reduce over the ranks), the heads clipped and the loss, then the largest logit of each run and its mean loss
over the last ``--tail`` steps; writes ``summary.json`` and ``qk_clip_logits.png`` (top: the largest logit per
step, log scale, the threshold dashed; bottom: the loss) to ``--out``. Exits non-zero if a run fails.

    DS_ACCELERATOR=cpu python examples/demo/qk_clip_logits.py [--steps N] [--threshold T] [--out DIR]
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

NEVER = 1e30  # a threshold no logit reaches: the logits are recorded and nothing is clipped
STAGE = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=run_demo.HelpFormatter)
    p.add_argument("--out", default="out/qk-clip", help="output directory (created)")
    run_demo.add_run_arguments(p, seed=True)
    p.set_defaults(steps=300, muon_lr=0.1)
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps of both runs")
    p.add_argument("--threshold", type=float, default=100.0, help="qk_clip_threshold of the clipped run")
    p.add_argument("--every", type=int, default=20, help="print every this many steps")
    p.add_argument("--tail", type=int, default=50, help="steps at the end whose mean loss is compared")
    p.add_argument("--no-plot", action="store_true", help="skip qk_clip_logits.png")
    return run_demo.apply_quick(p, p.parse_args(argv))


def plot(results, labels, threshold, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    for i, (name, result) in enumerate(results.items()):
        steps = range(1, len(result["losses"]) + 1)
        top.plot(steps, result["max_logits"], color=f"C{i}", lw=1.5, label=labels[name])
        bottom.plot(steps, result["losses"], color=f"C{i}", lw=1.0, label=labels[name])
    top.axhline(threshold, color="k", ls="--", lw=1, label=f"threshold {threshold:g}")
    top.set_yscale("log")
    top.set_ylabel("largest attention logit of the step")
    top.set_title(title)
    top.grid(alpha=0.3, which="both")
    top.legend()
    bottom.set_ylabel("training loss (nats / byte)")
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
    runs = (("muon", "Muon", NEVER), ("muonclip", f"MuonClip (threshold {args.threshold:g})", args.threshold))
    labels = {name: label for name, label, _ in runs}
    print(f"{args.steps} optimizer steps, ZeRO-{STAGE}, gas {args.gas}, {run_demo.NPROC} ranks, global batch "
          f"{args.global_batch} x {args.seq_len} bytes, Llama hidden {args.hidden} x {args.layers} layers x "
          f"{args.heads} heads, Muon lr {args.muon_lr} momentum {args.momentum}, Adam lr {args.adam_lr}, seed "
          f"{args.seed}\n", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    for name, label, threshold in runs:
        run_dir = out / name
        (run_dir / "result.json").unlink(missing_ok=True)
        print(f"== {name}: {label}", flush=True)
        code, seconds = run_demo.launch(args, STAGE, args.gas, run_dir,
                                        ("--muon-param", f"qk_clip_threshold={threshold!r}"))
        if code != 0 or not (run_dir / "result.json").exists():
            print(f"FAILED: {name} exited with code {code}", flush=True)
            failed.append(name)
            continue
        results[name] = json.loads((run_dir / "result.json").read_text())
        print(f"   {seconds:.1f} s wall", flush=True)

    heads = args.layers * args.heads
    print(f"\nper step: largest logit over all {heads} heads, heads clipped, loss (nats/byte)")
    print(f"{'step':>5}" + "".join(f"{n + ' logit':>16}{'clipped':>9}{'loss':>8}" for n in results))
    for i in list(range(0, args.steps, args.every)) + [args.steps - 1]:
        print(f"{i + 1:>5}" + "".join(f"{r['max_logits'][i]:>16.2f}{r['heads_clipped'][i]:>9}{r['losses'][i]:>8.4f}"
                                      for r in results.values()))
    print()
    table = {}
    for name, r in results.items():
        table[name] = {"largest_logit": max(r["max_logits"]), "final_logit": r["max_logits"][-1],
                       "heads_clipped": sum(r["heads_clipped"]),
                       "tail_loss": statistics.fmean(r["losses"][-args.tail:])}
        row = table[name]
        print(f"{labels[name]:<28} largest logit {row['largest_logit']:8.2f} (last step {row['final_logit']:.2f}), "
              f"{row['heads_clipped']} head-steps clipped, mean loss of the last {args.tail} steps "
              f"{row['tail_loss']:.4f}")
    summary = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
               "args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
               "failed": failed, "table": table, "runs": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out.name}/summary.json")
    if results and not args.no_plot:
        plot(results, labels, args.threshold, out / "qk_clip_logits.png",
             f"Demo text, ZeRO-{STAGE} gas {args.gas}, {run_demo.NPROC} CPU ranks, fp32, Muon lr {args.muon_lr}")
        print(f"wrote {out.name}/qk_clip_logits.png")
    if failed:
        print(f"FAILED runs: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
