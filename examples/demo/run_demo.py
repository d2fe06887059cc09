"""Muon under ZeRO-3 with gradient accumulation: the demo driver.

Trains one small Llama three times on 2 CPU ranks (torchrun, gloo, ``DS_ACCELERATOR=cpu``),
fp32 with DeepSpeed's default ``gradient_clipping`` (1.0; ``--clip`` sets another), on the same
global batch at every optimizer step:

    zero3-gas4  ZeRO-3, gradient_accumulation_steps=4
    zero3-gas1  ZeRO-3, gradient_accumulation_steps=1 (one micro-batch holding the same samples)
    zero2-gas4  ZeRO-2, gradient_accumulation_steps=4 (ZeRO-2 applies Muon at the boundary)

The mean gradient of every step is the same in all three by construction, and every stage clips
the raw accumulated gradient before Muon (``clip_grad_norm_`` then Muon), so the weights must
agree to the fp32 floor; the raw gradient norms and the steps where the clip bit are printed.
Newton-Schulz computes in fp32 in every rank: ``train.py`` pins it on the CPU accelerator, which on CPUs whose oneDNN has fp16 reports fp16 support, so that upstream
would otherwise run the "gram" kernel in fp16 (its rounding, 1.1e-3 gas=4 vs gas=1 measured with
--quick, would hide the fp32 agreement). Prints the dtype Newton-Schulz computed in and why, the
per-step losses side by side, the relative weight difference between runs, Newton-Schulz calls
per optimizer step and Muon elements exchanged per rank per step; writes ``summary.json`` and
``loss.png`` to ``--out``. Exits non-zero if a run fails or (unless ``--no-check``) the zero3-gas4
vs zero3-gas1 or zero3-gas4 vs zero2-gas4 difference exceeds ``--tolerance``.

    DS_ACCELERATOR=cpu python examples/demo/run_demo.py [--quick] [--steps N] [--out DIR]
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
# Shared with the tests and the benchmark: the muon_testing package (testing/), which dev.py setup installs.
from muon_testing.compare import free_port, relative_difference  # noqa: E402
NPROC = 2

# Relative weight difference ||W_gas4 - W_gas1|| / ||W_gas4|| allowed between the two ZeRO-3
# runs. They see the same samples each step, so they differ only by fp32 rounding (4 micro-batch
# gradients summed instead of one batch's, matmuls over 2 rows instead of 8 per rank), which
# training then amplifies step by step. Measured on stock DeepSpeed 0.19.8 (CPU, torch 2.13,
# Newton-Schulz in fp32, a CPU without fp16), default settings (40 steps), seeds 1-6 and 1234:
# 4.3e-6 to 1.24e-5; --quick (6 steps), seeds 1-4 and 1234: 7.2e-7 to 1.0e-6; a repeated run:
# exactly 0. On a CPU with AVX512-FP16 and AMX (patched 0.19.8, Newton-Schulz pinned to fp32),
# seed 1234: 6.0e-6 (40 steps), 4.6e-6 (--quick). The tolerance is 4x the largest floor seen.
# ZeRO-2 gas=4 vs ZeRO-3 gas=4 with DeepSpeed's default clipping 1.0 (which bites in 31 of the 40
# steps here), patched 0.19.8, seed 1234: 4.5e-6 (gas=4 vs gas=1 in the same run: 4.4e-6).
# A ZeRO-3 that applies Muon per micro-batch (0.19.7) is off by ~1e-1. The floor grows with the
# number of steps: much longer runs need --tolerance.
TOLERANCE = 5e-5

# (name, legend label, ZeRO stage, gradient_accumulation_steps)
RUNS = (
    ("zero3-gas4", "ZeRO-3, gas=4", 3, 4),
    ("zero3-gas1", "ZeRO-3, gas=1", 3, 1),
    ("zero2-gas4", "ZeRO-2, gas=4", 2, 4),
)
CHECKED_PAIRS = (("zero3-gas4", "zero3-gas1"), ("zero3-gas4", "zero2-gas4"))
QUICK = dict(steps=6, seq_len=64, global_batch=8)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's default-printing help, silent where the default is None (the help says what
    None means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_run_arguments(p, seed=True):
    """The arguments of each training run (model, data, optimizer, clipping, --quick, --eager),
    shared with ``compare_variants.py`` (which takes ``--seeds`` instead: ``seed=False``)."""
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--global-batch", type=int, default=16,
                   help="windows per optimizer step over both ranks; a multiple of 2 x 4")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per window")
    p.add_argument("--hidden", type=int, default=64, help="Llama hidden size")
    p.add_argument("--intermediate", type=int, default=176, help="Llama MLP size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (= key/value heads)")
    if seed:
        p.add_argument("--seed", type=int, default=1234, help="model init and data windows")
    p.add_argument("--muon-lr", type=float, default=0.02, help="lr of the Muon matrices")
    p.add_argument("--adam-lr", type=float, default=3e-3, help="lr of the auxiliary Adam (embeddings, head, norms)")
    p.add_argument("--momentum", type=float, default=0.95, help="Muon momentum")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="truncate the stdlib corpus")
    p.add_argument("--quick", action="store_true",
                   help="short smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run DeepSpeed's torch.compile'd Muon kernels eagerly (TORCHDYNAMO_DISABLE=1 in the ranks); "
                   "saves ~10 s of compilation per run (default: on with --quick, else off)")
    p.add_argument("--clip", type=float, default=None,
                   help="gradient_clipping of every run (default: DeepSpeed's, 1.0; 0 turns clipping off)")
    p.add_argument("--fused-adam", action="store_true",
                   help="DeepSpeed's FusedAdam for the auxiliary Adam (embeddings, head, norms), JIT-compiled on first "
                   "use (3 to 4 min on 2 cores); default: torch's AdamW (\"torch_adam\": true), nothing to compile")


def apply_quick(p, args):
    """--quick's sizes where the user left the default, and --eager's default (on with --quick)."""
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.eager is None:
        args.eager = args.quick
    return args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--out", default="out/demo", help="output directory (created)")
    add_run_arguments(p)
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="max relative weight difference, ZeRO-3 gas=4 vs gas=1 and vs ZeRO-2 gas=4")
    p.add_argument("--no-check", action="store_true", help="report the difference without failing on it")
    p.add_argument("--no-plot", action="store_true", help="skip loss.png")
    return apply_quick(p, p.parse_args(argv))


def extensions_dir():
    """Where the ranks JIT-build DeepSpeed's CPU ops (shm comm, fused Adam): one dir per environment.

    torch's default (~/.cache/torch_extensions/py311_cpu) is shared by every venv of this Python,
    and ninja rebuilds an op whenever another environment (other torch headers, other DeepSpeed
    sources) built it there last, which costs minutes on 2 cores. Used unless
    TORCH_EXTENSIONS_DIR is set.
    """
    import hashlib
    import deepspeed
    import torch
    key = f"{sys.prefix}|{torch.__version__}|{deepspeed.__version__}|{pathlib.Path(deepspeed.__file__).parent}"
    tag = hashlib.sha1(key.encode()).hexdigest()[:12]
    return str(pathlib.Path.home() / ".cache" / "torch_extensions" / f"deepspeed-demo-{tag}")


def launch(args, stage, gas, run_dir, extra=()):
    """Run one training on NPROC ranks (``extra``: more ``train.py`` arguments); returns (exit code,
    wall seconds)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(NPROC),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(HERE / "train.py"), "--out", str(run_dir), "--stage", str(stage), "--gas", str(gas),
        "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
        "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--layers", str(args.layers),
        "--heads", str(args.heads), "--seed", str(args.seed), "--muon-lr", str(args.muon_lr),
        "--adam-lr", str(args.adam_lr), "--momentum", str(args.momentum)
    ]
    if args.max_corpus_bytes is not None:
        cmd += ["--max-corpus-bytes", str(args.max_corpus_bytes)]
    if args.clip is not None:
        cmd += ["--clip", str(args.clip)]
    if not args.fused_adam:
        cmd += ["--muon-param", "torch_adam=true"]
    cmd += [str(a) for a in extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    if args.eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    start = time.perf_counter()
    code = subprocess.run(cmd, env=env).returncode
    return code, time.perf_counter() - start


def exchanged_per_step(result):
    """Muon elements received per rank per optimizer step (max over ranks), or None if not counted."""
    stats = result.get("boundary_stats")
    if not stats:
        return None
    return max(s["elements_received"] / max(1, s["optimizer_steps"]) for s in stats)


def plot(results, path):
    """Loss curves of every run (top) and their distance from the first run (bottom), as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    ref_name, ref = next(iter(results.items()))
    labels = {name: label for name, label, _, _ in RUNS}
    for i, (name, _, _, _) in enumerate(RUNS):
        if name not in results:
            continue
        losses = results[name]["losses"]
        steps = range(1, len(losses) + 1)
        style = dict(color=f"C{i}", linestyle=("-", "--", ":")[i % 3], lw=2)
        top.plot(steps, losses, label=labels[name], **style)
        if name != ref_name:
            bottom.plot(steps, [abs(a - b) for a, b in zip(losses, ref["losses"])], marker="o", ms=3,
                        label=f"{labels[name]} vs {labels[ref_name]}", **style)
    top.set_ylabel("training loss (nats / byte)")
    top.set_title("Muon, 2 CPU ranks, fp32, same samples per optimizer step")
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_ylabel("|loss difference|")
    bottom.set_xlabel("optimizer step")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    if len(results) > 1:
        bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_losses(results, steps):
    print("\nloss per optimizer step (nats/byte, mean over the global batch)")
    print(f"{'step':>5}" + "".join(f"{n:>14}" for n in results))
    for i in range(steps):
        print(f"{i + 1:>5}" + "".join(f"{r['losses'][i]:>14.6f}" for r in results.values()))


def weight_diffs(results, weights):
    """{"a vs b": relative weight difference} for each pair of runs, printed."""
    names = list(results)
    diffs = {f"{a} vs {b}": relative_difference(weights[a], weights[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    if diffs:
        first = results[names[0]]
        print(f"\nrelative weight difference ||W_a - W_b|| / ||W_a|| over all {first['params']} parameters, "
              f"after {first['steps']} steps")
        for pair, d in diffs.items():
            print(f"   {pair:<26} {d:.3e}")
    return diffs


def print_newton_schulz_dtype(results):
    """One line: the dtype the "gram" Newton-Schulz kernel computed in, and why. Returns it (None if mixed)."""
    used = {r["ns_compute_dtype"] for r in results.values()}
    upstream = {r["ns_compute_dtype_upstream"] for r in results.values()}
    dtype = used.pop() if len(used) == 1 else None
    if dtype == "float32" and upstream != {"float32"}:
        line = (f"float32 in every run, pinned on the CPU accelerator: it reports fp16 on this CPU (oneDNN has "
                f"fp16), so upstream would compute in {'/'.join(sorted(upstream))}, whose rounding (~1e-3) would "
                "hide the fp32 agreement checked below")
    elif dtype == "float32":
        line = "float32 in every run (upstream's choice on this CPU; on a CPU with fp16 the demo pins fp32)"
    else:
        per_run = ", ".join(f"{name}: {r['ns_compute_dtype']}" for name, r in results.items())
        line = f"{per_run}: not fp32 everywhere, which the check below assumes"
    print(f"\nNewton-Schulz (\"gram\" kernel) computed in {line}")
    return dtype


def print_muon_counters(results):
    """NS calls per step and Muon traffic per rank per step; adds both to each result. Returns the bound."""
    first = next(iter(results.values()))
    P, W = first["muon_elements"], first["world_size"]
    bound = 2 * P * (W - 1) / W**2
    print(f"\nMuon: {first['muon_matrices']} matrices, P = {P} elements")
    print(f"{'run':<12}{'NS calls/step':>15}{'matrices':>10}   Muon elements received/rank/step (max over ranks)")
    for name, r in results.items():
        r["ns_calls_per_step"] = r["ns_calls_total"] / max(1, r["optimizer_steps"])
        r["elements_received_per_rank_per_step"] = got = exchanged_per_step(r)
        if got is not None:
            got = f"{got:.0f} ({got / P:.3f} P)"
        else:
            got = "n/a (stock build)"
        print(f"{name:<12}{r['ns_calls_per_step']:>15.2f}{r['muon_matrices']:>10}   {got}")
    print(f"owner-centric bound 2P(W-1)/W^2 = {bound:.0f} ({bound / P:.3f} P) elements per rank per step, W = {W}")
    return bound


def print_clipping(results):
    """One line per run: the raw gradient norms (``get_global_grad_norm()``) and the steps the clip bit."""
    print("\nraw gradient norm per optimizer step (get_global_grad_norm(), before clipping)")
    for name, r in results.items():
        norms = [n for n in r["grad_norms"] if n is not None]
        clip = r["gradient_clipping"]
        bit = sum(n > clip for n in norms) if clip > 0 else 0
        where = f"gradient_clipping {clip:g}: bit in {bit} of {len(norms)} steps" if clip > 0 else "clipping off"
        span = f"{min(norms):.3f} to {max(norms):.3f}" if norms else "not reported"
        print(f"   {name:<12} {span}; {where}")


def check(diffs, args):
    """The checks of CHECKED_PAIRS as a list of dicts (a pair whose run failed is left out), printed."""
    verdicts = []
    for a, b in CHECKED_PAIRS:
        pair = f"{a} vs {b}"
        if pair not in diffs:
            print(f"\ncheck: {pair} not available (a run failed)")
            continue
        ok = diffs[pair] <= args.tolerance
        print(f"{chr(10) if not verdicts else ''}check: {pair} = {diffs[pair]:.3e} {'<=' if ok else '>'} tolerance "
              f"{args.tolerance:.1e}: {'OK' if ok else 'FAIL'}{' (not enforced: --no-check)' if args.no_check else ''}")
        verdicts.append({"pair": pair, "value": diffs[pair], "tolerance": args.tolerance, "ok": ok,
                         "enforced": not args.no_check})
    return verdicts


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    if not deepspeed.__version__.endswith("+zero3muon"):
        print(f"WARNING: deepspeed {deepspeed.__version__} is not the patched build (+zero3muon): "
              "expect the stock ZeRO-3 Muon path and no boundary traffic counters.")
    print(f"{len(RUNS)} runs x {args.steps} optimizer steps, {NPROC} ranks, global batch {args.global_batch} x "
          f"{args.seq_len} bytes, Llama hidden {args.hidden} x {args.layers} layers, seed {args.seed}, "
          f"Muon lr {args.muon_lr} momentum {args.momentum}, Adam lr {args.adam_lr}"
          f"{', torch.compile off (--eager)' if args.eager else ''}, auxiliary Adam: "
          f"{'DeepSpeed FusedAdam' if args.fused_adam else 'torch AdamW (torch_adam)'}\n", flush=True)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, weights, seconds, failed = {}, {}, {}, []
    for name, label, stage, gas in RUNS:
        run_dir = out / name
        for stale in ("result.json", "weights.pt"):
            (run_dir / stale).unlink(missing_ok=True)
        print(f"== {name}: {label}", flush=True)
        code, seconds[name] = launch(args, stage, gas, run_dir)
        if code != 0 or not (run_dir / "result.json").exists():
            print(f"FAILED: {name} exited with code {code}", flush=True)
            failed.append(name)
            continue
        results[name] = json.loads((run_dir / "result.json").read_text())
        weights[name] = torch.load(run_dir / "weights.pt")
        print(f"   {seconds[name]:.1f} s wall ({results[name]['seconds_setup']:.1f} s start-up, "
              f"{results[name]['seconds_train']:.1f} s training)", flush=True)

    summary = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "args": vars(args),
               "failed": failed, "seconds_wall": seconds, "runs": results}
    diffs = {}
    if results:
        summary["ns_compute_dtype"] = print_newton_schulz_dtype(results)
        print_losses(results, args.steps)
        diffs = weight_diffs(results, weights)
        print_clipping(results)
        summary["owner_centric_bound"] = print_muon_counters(results)
    summary["weight_rel_diff"] = diffs
    summary["check"] = verdicts = check(diffs, args)
    status = 1 if failed or any(not v["ok"] and v["enforced"] for v in verdicts) else 0
    summary["exit_status"] = status

    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out / 'summary.json'}")
    if results and not args.no_plot:
        plot(results, out / "loss.png")
        print(f"wrote {out / 'loss.png'}")
    if failed:
        print(f"FAILED runs: {', '.join(failed)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
