# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""What MuonClip's QK-clip costs per optimizer step, measured against the same run without it.

W ranks (``--world-size``, gloo, ``DS_ACCELERATOR=cpu``) train three engines of one Llama-shaped Hugging Face model
(``--hidden``, ``--layers``, ``--heads`` query heads over ``--kv-heads``, ``--seq-len`` tokens, ``--attention``
eager or sdpa) at ZeRO ``--stage``, identical but for ``optimizer.params``:

    off     no qk_clip_threshold
    record  qk_clip_threshold 1e30: every layer's per-head maximum logit recorded on every micro-step, one MAX
            all-reduce per step, no head ever clipped (the recording's cost alone)
    clip    qk_clip_threshold just above the initial logits' median: recording plus the clip of the heads above
            it, every step

Each repeat times ``--steps`` optimizer steps of each engine in turn (interleaved rounds: the machine's noise hits
each ratio's both sides), after ``--warmup`` steps each; prints per configuration the seconds per step (median
[min-max] over repeats) and the ratios to ``off`` paired by repeat. Run under the patched build's Python, e.g.::

    DS_ACCELERATOR=cpu .venv/0.19.8/bin/python bench/qk_clip_cost.py

Output of the run the docs quote: ``docs/performance/qk-clip-cost-output.txt``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from repeats import paired_ratios, spread  # noqa: E402

CONFIGS = ("off", "record", "clip")


def worker(args):
    """One rank: build the three engines, time them in interleaved rounds, rank 0 writes the times as JSON."""
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from muon_testing.attention import reference_max_logits
    from muon_testing.causal_lm import tiny_llama

    deepspeed.init_distributed()
    torch.set_num_threads(1)

    def model():
        m = tiny_llama(hidden=args.hidden, intermediate=args.hidden * 8 // 3, layers=args.layers, heads=args.heads,
                       kv_heads=args.kv_heads)
        m.config.max_position_embeddings = args.seq_len
        m.set_attn_implementation(args.attention)
        return m

    ids = [torch.randint(0, 96, (args.micro_batch, args.seq_len), generator=torch.Generator().manual_seed(s))
           for s in range(args.warmup + args.steps)]
    first = torch.cat(list(reference_max_logits(model(), ids[0]).values()))
    thresholds = {"off": None, "record": 1e30, "clip": float(first.median())}
    engines = {}
    for name in CONFIGS:
        params = {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "weight_decay": 0.0}
        if thresholds[name] is not None:
            params["qk_clip_threshold"] = thresholds[name]
        config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0, "steps_per_print": 1 << 30, "optimizer": {"type": "Muon", "params": params},
                  "zero_optimization": {"stage": args.stage}}
        m = model()
        engines[name], *_ = deepspeed.initialize(model=m, config=config, model_parameters=m.parameters())

    def run(engine, batches):
        for x in batches:
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()

    for engine in engines.values():
        run(engine, ids[:args.warmup])
    times = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            run(engine, ids[args.warmup:])
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
    clipped = engines["clip"].muon.qk_clip.heads_clipped
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"times": times, "threshold": thresholds["clip"], "heads_clipped": clipped,
                       "heads": engines["clip"].muon.qk_clip.offsets[-1], "deepspeed": deepspeed.__version__,
                       "torch": torch.__version__}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--attention", choices=("eager", "sdpa"), default="sdpa")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per engine and repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world_size),
               "--master-port", "29631", os.path.abspath(__file__), "--worker", "--result", result,
               *[a for a in sys.argv[1:]]]
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if code.returncode != 0:
            print(code.stderr[-4000:])
            return code.returncode
        with open(result) as f:
            r = json.load(f)
    print(f"deepspeed {r['deepspeed']}, torch {r['torch']}; W={args.world_size} ranks (gloo, CPU, 1 thread each), "
          f"ZeRO-{args.stage}, Llama hidden {args.hidden} x {args.layers} layers, {args.heads} query heads over "
          f"{args.kv_heads} key-value heads, {args.seq_len} tokens x micro-batch {args.micro_batch}, attention "
          f"{args.attention}; {args.repeats} interleaved repeats of {args.steps} steps (after {args.warmup})")
    print(f"clip: threshold {r['threshold']:.4g}, {r['heads_clipped']} head-steps clipped of "
          f"{r['heads']} heads x {args.repeats * args.steps + args.warmup} steps\n")
    times = {k: dict(enumerate(v)) for k, v in r["times"].items()}
    print(f"{'configuration':<14}{'s / step, median [min-max]':>30}{'ratio to off, median [min-max]':>36}")
    for name in CONFIGS:
        ratio = "" if name == "off" else spread(paired_ratios(times[name], times["off"])).format(".3f")
        print(f"{name:<14}{spread(times[name].values()).format('.4f'):>30}{ratio:>36}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
