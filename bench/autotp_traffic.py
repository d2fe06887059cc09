# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Muon's exchange traffic and Newton-Schulz calls under AutoTP, against the owner bound of the whole group.

Under ``"tensor_parallel": {"autotp_size": T}`` with D data-parallel ranks, every attention and MLP matrix lies
in pieces over all W = T x D ranks (T shards, each ZeRO-partitioned over D); the patched build sends each piece
to one owner among the W ranks, which orthogonalizes the whole matrix once and returns the pieces. Per
configuration (tensor x data parallelism, ZeRO stage) this trains a Llama-shaped Hugging Face model (``--hidden``,
``--intermediate``, ``--layers``; 8 query heads over 4 key-value heads; every projection split by AutoTP) for ``--steps`` optimizer steps on the patched
build and prints, per optimizer step: Newton-Schulz calls summed over the ranks against the number of
matrices (target: equal, each matrix once), and the elements a rank received in Muon's all-to-alls, mean and max over
ranks, against the owner-centric lower bound for the pieces as the ranks hold them: per matrix, the owner receives
every piece but its own and returns them, at best ``2 (sum - max of the pieces)``, over W ranks (target: mean within
10 % of it). Under ZeRO-3 every rank holds an equal piece and that is ``2 P (W - 1) / W^2`` for P elements of Muon
matrices (printed too); under ZeRO-1/2 a shard mostly lies whole on one data-parallel rank, so fewer ranks hold a
matrix and less travels. Run under the patched build's Python, e.g.::

    DS_ACCELERATOR=cpu .venv/0.19.8/bin/python bench/autotp_traffic.py

Output of the run the docs quote: ``docs/performance/bench-autotp-output.txt``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

TRAFFIC_TARGET = 0.10  # mean received per rank within 10% of 2P(W-1)/W^2
CONFIGS = ((2, 1, 3), (2, 2, 3), (4, 1, 3), (2, 2, 1), (2, 2, 2))  # (tensor parallel, data parallel, ZeRO stage)


def worker(args):
    """One rank: train, then write this rank's counters (rank 0 also the Muon elements) as JSON."""
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from muon_testing.causal_lm import SAMPLES, causal_lm_loss, micro_batches, tiny_llama

    deepspeed.init_distributed()
    model = tiny_llama(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=8, kv_heads=4)
    matrices = [p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    config = {
        "train_micro_batch_size_per_gpu": SAMPLES // args.dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "tensor_parallel": {
            "autotp_size": args.tp
        },
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": 0.02,
                "adam_lr": 0.003
            }
        },
        "zero_optimization": {
            "stage": args.stage,
            "stage3_param_persistence_threshold": 0
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    dp_rank = dist.get_rank() // args.tp
    for step in range(args.steps):
        for ids in micro_batches(step, dp_rank, args.dp, 1):
            engine.backward(causal_lm_loss(engine, ids))
            engine.step()
    update = engine.optimizer.muon_update
    stats = update.stats
    pieces = [p for pipeline in update.spread_pipelines.values() for layout in pipeline.layouts for p in layout.pieces]
    row = dict(rank=dist.get_rank(),
               bound=sum(2 * (sum(p) - max(p)) for p in pieces) / dist.get_world_size(),
               received=stats.elements_received / args.steps,
               ns_calls=stats.ns_calls / args.steps,
               matrices=len(matrices),
               muon_elements=sum(matrices))
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(row, f)
    engine.destroy()


def launch(tp, dp, stage, args):
    """Rows of every rank of one configuration (torchrun, W = tp x dp processes)."""
    from muon_testing.compare import free_port
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp * dp}", f"--master_port={free_port()}",
            __file__, "--worker", "--tp",
            str(tp), "--dp",
            str(dp), "--stage",
            str(stage), "--steps",
            str(args.steps), "--hidden",
            str(args.hidden), "--intermediate",
            str(args.intermediate), "--layers",
            str(args.layers), "--out", out
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = []
        for r in range(tp * dp):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                rows.append(json.load(f))
    return rows


def report(tp, dp, stage, rows) -> list:
    """The table row and target lines of one configuration."""
    world = tp * dp
    muon_elements, matrices = rows[0]["muon_elements"], rows[0]["matrices"]
    bound, equal_pieces = rows[0]["bound"], 2 * muon_elements * (world - 1) / world**2
    received = [r["received"] for r in rows]
    mean = sum(received) / world
    ns = sum(r["ns_calls"] for r in rows)
    name = f"tp{tp} x dp{dp} ZeRO-{stage}"
    lines = [
        f"{name:<18} W={world}  matrices {matrices:>3}  NS calls/step {ns:>5.0f}  received/rank mean {mean:>10.0f} "
        f"max {max(received):>10.0f}  bound {bound:>10.0f} (2P(W-1)/W^2 {equal_pieces:>10.0f})  "
        f"mean/bound {mean / bound:.3f}"
    ]
    lines.append(f"target {name} NS calls = matrices: {ns:.0f} vs {matrices} "
                 f"{'met' if ns == matrices else 'MISSED'}")
    lines.append(f"target {name} traffic within {TRAFFIC_TARGET:.0%} of the bound: {mean / bound:.3f} "
                 f"{'met' if abs(mean / bound - 1) <= TRAFFIC_TARGET else 'MISSED'}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"Llama-shaped: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers; "
          f"{args.steps} optimizer steps; per optimizer step:")
    missed = 0
    for tp, dp, stage in CONFIGS:
        for line in report(tp, dp, stage, launch(tp, dp, stage, args)):
            print(line, flush=True)
            missed += line.endswith("MISSED")
    print(f"{missed} target(s) missed")


if __name__ == "__main__":
    main()
