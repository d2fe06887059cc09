# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Profile the patched build's Muon boundary update (``MuonUpdate.update``) with torch's profiler.

Run under a build's Python with ``torch.distributed.run`` (W ranks, gloo, ``DS_ACCELERATOR=cpu``):

    python -m torch.distributed.run --nproc_per_node 2 bench/profile_boundary.py --workload sq1024

Trains the workload (``bench/worker.py``'s models and config) for ``--warmup`` optimizer steps, then
profiles ``--steps`` more and prints, on rank 0, the operators of the boundary update sorted by
self CPU time and the share of ``MuonUpdate.update`` spent in Newton-Schulz and in the all-to-alls
(the rest: momentum, packing and unpacking). ``--export DIR`` also writes a Chrome trace per rank.
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import deepspeed
from deepspeed.accelerator import get_accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker  # noqa: E402  (bench/worker.py: models, config, batches)

UPDATE_LABEL = "MuonUpdate.update"
NS_OPS = ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="sq1024", choices=sorted(worker.WORKLOADS))
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="operators to print")
    p.add_argument("--export", help="directory for Chrome traces")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = dict(workload=args.workload, stage=3, gas=args.gas, dtype="fp32", micro_batch=2)
    model = worker.build_model(args.workload)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=worker.ds_config(cfg, world_size))
    update = engine.optimizer.muon_update
    run_update = update.update

    def profiled_update(key, grad_partition):
        with record_function(UPDATE_LABEL):
            return run_update(key, grad_partition)

    update.update = profiled_update  # an instance attribute: the label around the boundary update
    # Newton-Schulz kernels, labelled where the owner calls them
    from deepspeed.runtime.zero.muon import original_muon
    for name in NS_OPS:
        kernel = getattr(original_muon, name)

        def labelled(*a, _kernel=kernel, _name=name, **k):
            with record_function(_name):
                return _kernel(*a, **k)

        setattr(original_muon, name, labelled)
    dim = worker.WORKLOADS[args.workload][0]

    def train_step(step):
        for micro in range(args.gas):
            x, y = worker.batch(cfg, step, micro, rank, world_size, dim, engine.device, torch.float32)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    for step in range(args.warmup):
        train_step(step)
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(args.warmup, args.warmup + args.steps):
            train_step(step)
    events = prof.key_averages()
    total = {e.key: e for e in events}
    if rank == 0:
        update_us = total[UPDATE_LABEL].cpu_time_total
        ns_us = sum(total[k].cpu_time_total for k in NS_OPS if k in total)
        a2a = [e for e in events if "all_to_all" in e.key]
        a2a_us = max((e.cpu_time_total for e in a2a), default=0.0)
        print(f"W={world_size} {args.workload} gas={args.gas}: MuonUpdate.update {update_us / args.steps / 1e3:.1f} ms "
              f"per step, Newton-Schulz {ns_us / update_us:.1%}, all-to-all {a2a_us / update_us:.1%}, "
              f"rest {(update_us - ns_us - a2a_us) / update_us:.1%}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.export:
        Path(args.export).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.export) / f"trace-rank{rank}.json"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
