# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""One rank of one benchmark launch: trains each workload of a config list and measures it.

Launched by ``bench/run_bench.py`` with ``python -m torch.distributed.run --nproc_per_node W``
under the Python of one build (stock or patched DeepSpeed). Uses only DeepSpeed's public API and
upstream module names, so it runs unchanged on every build.

Per optimizer step and rank it measures, at DeepSpeed's communication layer
(``deepspeed.comm.comm.cdb``, the backend every ZeRO collective goes through), the elements and
bytes each collective delivers to this rank, split into Muon traffic (issued from a function
whose name contains ``muon`` or from a file under ``runtime/zero/muon/``) and the rest, and into
non-boundary micro-steps and the boundary micro-step; Newton-Schulz calls (by wrapping upstream's
kernels in ``original_muon``); wall time of each micro-step (forward, backward, ``step()``;
ranks start each micro-step together); and the peak resident memory of the boundary micro-step
above its start (``VmHWM`` reset through ``/proc/self/clear_refs`` on Linux; allocator peak on an
accelerator with one).

Received elements per collective, for a group of W ranks (the ring algorithms' counts):
all-gather ``(W-1)/W`` of the output; reduce-scatter ``(W-1)`` times the output; all-reduce
``2(W-1)/W`` of the tensor; all-to-all everything but the rank's own chunk; broadcast the tensor on
non-source ranks.

Writes one JSON line per finished workload to ``--out`` (rank 0) and prints ``START name`` /
``DONE name`` so the driver can tell which workload a crash or hang hit.
"""

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import deepspeed
import deepspeed.comm as ds_comm
from deepspeed.accelerator import get_accelerator

# NSCounter and gathered_weights are shared with the tests (tests/unit/runtime/zero/zero3_muon_helpers.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from unit.runtime.zero.zero3_muon_helpers import NSCounter, gathered_weights  # noqa: E402

# Workloads: dims of a chain of bias-free Linear layers (all Muon matrices), tanh between them.
WORKLOADS = {
    "sq256": [256] * 5,  # four 256x256
    "rect256": [256, 384, 256, 384, 256],  # 384x256, 256x384, ...
    "sq1024": [1024] * 5,  # four 1024x1024
    "rect1024": [1024, 768, 1024, 768, 1024],
    "seed64": [64, 64, 64],  # the seed table's two Linear(64, 64)
    "tiny": [20, 36, 20, 36],  # 36x20, 20x36, 36x20: sizes W=2..4 do not divide (tests)
}


def _is_muon_caller() -> bool:
    frame = inspect.currentframe().f_back.f_back
    while frame is not None:
        code = frame.f_code
        if "muon" in code.co_name.lower() or "/runtime/zero/muon/" in code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


class CommCounter:
    """Wraps the collectives of DeepSpeed's communication backend to count what each delivers to
    this rank. ``snapshot()`` returns cumulative ``{(kind, unit): value}`` with kind ``muon`` or
    ``other`` and unit ``elements`` or ``bytes``."""

    def __init__(self):
        self.totals = defaultdict(float)
        backend = ds_comm.comm.cdb
        for name, received in self._rules().items():
            method = getattr(backend, name, None)
            if method is None:
                continue
            setattr(backend, name, self._wrap(name, method, received))

    @staticmethod
    def _group_size_rank(group):
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)

    def _rules(self):

        def all_gather_into_tensor(a, w, r):
            return a["output_tensor"].numel() * (w - 1) // w, a["input_tensor"]

        def all_gather(a, w, r):
            return sum(t.numel() for t in a["tensor_list"]) - a["tensor"].numel(), a["tensor"]

        def reduce_scatter_tensor(a, w, r):
            return a["output_tensor"].numel() * (w - 1), a["input_tensor"]

        def all_reduce(a, w, r):
            return 2 * (w - 1) * a["tensor"].numel() / w, a["tensor"]

        def all_reduce_coalesced(a, w, r):
            return sum(2 * (w - 1) * t.numel() / w for t in a["tensors"]), a["tensors"][0]

        def all_to_all_single(a, w, r):
            out = a["output"]
            splits = a.get("output_split_sizes")
            own = splits[r] if splits else out.numel() // w
            return out.numel() - own, out

        def broadcast(a, w, r):  # src is a global rank
            return (0 if torch.distributed.get_rank() == a["src"] else a["tensor"].numel()), a["tensor"]

        return dict(all_gather_into_tensor=all_gather_into_tensor,
                    all_gather=all_gather,
                    reduce_scatter_tensor=reduce_scatter_tensor,
                    all_reduce=all_reduce,
                    all_reduce_coalesced=all_reduce_coalesced,
                    all_to_all_single=all_to_all_single,
                    broadcast=broadcast)

    # parameter names of deepspeed.comm.torch.TorchBackend's methods (they are wrapped, so
    # inspect cannot see them)
    PARAMS = dict(all_gather_into_tensor=("output_tensor", "input_tensor", "group"),
                  all_gather=("tensor_list", "tensor", "group"),
                  reduce_scatter_tensor=("output_tensor", "input_tensor", "op", "group"),
                  all_reduce=("tensor", "op", "group"),
                  all_reduce_coalesced=("tensors", "op", "group"),
                  all_to_all_single=("output", "input", "output_split_sizes", "input_split_sizes", "group"),
                  broadcast=("tensor", "src", "group"))

    def _wrap(self, name, method, received):
        names = self.PARAMS[name]

        def counted(*args, **kwargs):
            a = dict(zip(names, args))
            a.update(kwargs)
            w, r = self._group_size_rank(a.get("group"))
            if w > 1:
                elements, like = received(a, w, r)
                kind = "muon" if _is_muon_caller() else "other"
                self.totals[(kind, "elements")] += elements
                self.totals[(kind, "bytes")] += elements * like.element_size()
            return method(*args, **kwargs)

        return counted

    def snapshot(self):
        return dict(self.totals)


def _diff(after, before):
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


class PeakMemory:
    """Peak memory above the start of a region, in bytes: the accelerator allocator's peak where
    the accelerator has one, else the process's peak resident set (Linux ``VmHWM``, reset by
    writing 5 to ``/proc/self/clear_refs``). ``None`` where neither is available."""

    def __init__(self):
        acc = get_accelerator()
        self.device_stats = acc.device_name() != "cpu"
        self.rss = Path("/proc/self/clear_refs").exists()

    @staticmethod
    def _status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return None

    @contextlib.contextmanager
    def measure(self, out: dict):
        acc = get_accelerator()
        if self.device_stats:
            acc.reset_peak_memory_stats()
            start = acc.memory_allocated()
        elif self.rss:
            Path("/proc/self/clear_refs").write_text("5")
            start = self._status("VmRSS")
        yield
        if self.device_stats:
            out["peak"] = acc.max_memory_allocated() - start
        elif self.rss:
            out["peak"] = self._status("VmHWM") - start
        else:
            out["peak"] = None


def build_model(workload):
    dims = WORKLOADS[workload]

    class Chain(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:]))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.tanh(x)
            return x

    torch.manual_seed(1234)
    return Chain()


def ds_config(cfg, world_size):
    zero = {"stage": cfg["stage"]}
    if cfg["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=0, reduce_scatter=False)
    if cfg.get("reduce_bucket_size"):
        zero["reduce_bucket_size"] = cfg["reduce_bucket_size"]
    if cfg.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": cfg["micro_batch"],
        "gradient_accumulation_steps": cfg["gas"],
        "train_batch_size": cfg["micro_batch"] * cfg["gas"] * world_size,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": 0.02,
                "adam_lr": 3e-4,
                "momentum": 0.95
            }
        },
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }
    if cfg.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def batch(cfg, step, micro, rank, world_size, dim, device, dtype):
    """This rank's micro-batch ``micro`` of optimizer step ``step``: a slice of the step's global
    batch, identical whatever the split into ranks and micro-steps."""
    g = torch.Generator().manual_seed(10_000 + step)
    total = cfg["micro_batch"] * cfg["gas"] * world_size
    x = torch.randn(total, dim, generator=g)
    y = torch.randn(total, WORKLOADS[cfg["workload"]][-1], generator=g)
    start = (micro * world_size + rank) * cfg["micro_batch"]
    sl = slice(start, start + cfg["micro_batch"])
    return x[sl].to(device, dtype), y[sl].to(device, dtype)


def run_workload(cfg, ns, comm, peak):
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build_model(cfg["workload"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(cfg, world_size))
    boundary = getattr(engine.optimizer, "muon_boundary", None)
    if boundary is not None and cfg.get("overlap") is not None:
        boundary.overlap = cfg["overlap"]
    device = engine.device
    dtype = torch.bfloat16 if cfg.get("dtype") == "bf16" else torch.float32
    dim = WORKLOADS[cfg["workload"]][0]
    steps = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        rec = dict(micro_times=[], micro_traffic=[], ns_micro=0)
        for micro in range(cfg["gas"]):
            is_boundary = micro == cfg["gas"] - 1
            x, y = batch(cfg, step, micro, rank, world_size, dim, device, dtype)
            torch.distributed.barrier()
            ns0, c0 = ns.count, comm.snapshot()
            mem = {}
            with peak.measure(mem) if is_boundary else contextlib.nullcontext():
                t0 = time.perf_counter()
                loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
                engine.backward(loss)
                t1 = time.perf_counter()
                engine.step()
                get_accelerator().synchronize()
                t2 = time.perf_counter()
            traffic = _diff(comm.snapshot(), c0)
            if is_boundary:
                rec.update(boundary_time=t2 - t0, boundary_step_time=t2 - t1, boundary_traffic=traffic,
                           ns_boundary=ns.count - ns0, peak=mem.get("peak"), loss=loss.item())
            else:
                rec["micro_times"].append(t2 - t0)
                rec["micro_traffic"].append(traffic)
                rec["ns_micro"] += ns.count - ns0
        if step >= cfg["warmup"]:
            steps.append(rec)
    result = dict(steps=steps)
    if boundary is not None:
        result["muon_stats"] = dict(vars(boundary.stats))
        result["bucket_bound_bytes"] = boundary.peak_bucket_bytes() if hasattr(boundary, "peak_bucket_bytes") else None
    if cfg.get("save_weights"):
        result["weights"] = gathered_weights(engine)
    muon_params = [p for p in engine.module.parameters() if getattr(p, "use_muon", False)]
    result["muon_elements"] = sum(getattr(p, "ds_numel", p.numel()) for p in muon_params)
    result["muon_matrices"] = len(muon_params)
    engine.destroy()
    return result


def summarize(cfg, per_rank):
    """Combine the ranks' records into one row: sums over ranks for NS calls, mean and max over
    ranks for traffic, max over ranks then median over steps for times and memory."""
    world_size = len(per_rank)
    n_steps = len(per_rank[0]["steps"])

    def traffic(step_rec, where, kind, unit):
        if where == "boundary":
            return step_rec["boundary_traffic"].get((kind, unit), 0.0)
        return sum(t.get((kind, unit), 0.0) for t in step_rec["micro_traffic"])

    row = dict(cfg)
    row.pop("save_weights", None)
    row["world_size"] = world_size
    row["muon_elements"] = per_rank[0]["muon_elements"]
    row["muon_matrices"] = per_rank[0]["muon_matrices"]
    row["ns_calls_per_step"] = sum(r["steps"][s]["ns_boundary"] + r["steps"][s]["ns_micro"] for r in per_rank
                                   for s in range(n_steps)) / n_steps
    row["ns_calls_micro_per_step"] = sum(r["steps"][s]["ns_micro"] for r in per_rank for s in range(n_steps)) / n_steps
    for where in ("boundary", "micro"):
        for kind in ("muon", "other"):
            for unit in ("elements", "bytes"):
                per = [statistics.mean(traffic(r["steps"][s], where, kind, unit) for s in range(n_steps))
                       for r in per_rank]
                row[f"{kind}_{unit}_{where}_mean"] = statistics.mean(per)
                row[f"{kind}_{unit}_{where}_max"] = max(per)
    row["boundary_time"] = statistics.median(max(r["steps"][s]["boundary_time"] for r in per_rank)
                                             for s in range(n_steps))
    row["boundary_step_time"] = statistics.median(
        max(r["steps"][s]["boundary_step_time"] for r in per_rank) for s in range(n_steps))
    micro = [max(r["steps"][s]["micro_times"][m] for r in per_rank) for s in range(n_steps)
             for m in range(cfg["gas"] - 1)]
    row["micro_time"] = statistics.median(micro) if micro else None
    peaks = [max(r["steps"][s]["peak"] for r in per_rank) for s in range(n_steps) if per_rank[0]["steps"][s]["peak"]
             is not None]
    row["boundary_peak_bytes"] = statistics.median(peaks) if peaks else None
    row["loss_last"] = per_rank[0]["steps"][-1]["loss"]
    row["muon_stats"] = per_rank[0].get("muon_stats")
    row["bucket_bound_bytes"] = max((r.get("bucket_bound_bytes") or 0) for r in per_rank) or None
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="JSON file: list of workload configs")
    p.add_argument("--out", required=True, help="JSON-lines file rank 0 appends a row to per workload")
    p.add_argument("--weights-dir", help="where rank 0 saves final weights of configs with save_weights")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    ns, comm, peak = NSCounter().install(), CommCounter(), PeakMemory()
    for cfg in json.loads(Path(args.configs).read_text()):
        if rank == 0:
            print(f"START {cfg['name']}", flush=True)
        result = run_workload(cfg, ns, comm, peak)
        weights = result.pop("weights", None)
        # str keys for the object collective; the tuples come back in summarize
        for s in result["steps"]:
            s["boundary_traffic"] = {"|".join(k): v for k, v in s["boundary_traffic"].items()}
            s["micro_traffic"] = [{"|".join(k): v for k, v in t.items()} for t in s["micro_traffic"]]
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, result)
        if rank == 0:
            for r in gathered:
                for s in r["steps"]:
                    s["boundary_traffic"] = {tuple(k.split("|")): v for k, v in s["boundary_traffic"].items()}
                    s["micro_traffic"] = [{tuple(k.split("|")): v for k, v in t.items()} for t in s["micro_traffic"]]
            row = summarize(cfg, gathered)
            if weights is not None and args.weights_dir:
                torch.save(weights, Path(args.weights_dir) / f"{cfg['name']}.pt")
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"DONE {cfg['name']}", flush=True)
    # Leave together and tear the process group down before the interpreter exits: without
    # destroy_process_group a gloo rank can abort in teardown ("terminate called without an
    # active exception", SIGABRT; pytorch/pytorch#190489).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # Results are written and the process group is torn down. Skip the interpreter's teardown of
    # C++ objects: a gloo rank still aborts there now and then under load ("terminate called without
    # an active exception", seen once in 3 ranks after barrier + destroy_process_group), which would
    # turn a finished run into a failed launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
