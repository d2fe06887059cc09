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
non-boundary micro-steps and the boundary micro-step; Newton-Schulz calls, matrices and seconds
(by wrapping upstream's kernels in ``original_muon``); wall time of each micro-step (forward,
backward, ``step()``; ranks start each micro-step together); and the peak resident memory of the
boundary micro-step above its start (``VmHWM`` reset through ``/proc/self/clear_refs`` on Linux;
allocator peak on an accelerator with one). After the measured steps, one more optimizer step,
not timed, measures the boundary micro-step at the allocator (``torch.profiler`` memory events
on the CPU, ``max_memory_allocated`` on an accelerator; see ``allocator_memory_step``).

Received elements per collective, for a group of W ranks (the ring algorithms' counts):
all-gather ``(W-1)/W`` of the output; reduce-scatter ``(W-1)`` times the output; all-reduce
``2(W-1)/W`` of the tensor; all-to-all everything but the rank's own split; broadcast the tensor on
non-source ranks.

Config keys (one dict per workload; ``run_bench.grid`` builds them): ``name``, ``workload`` (a
key of ``WORKLOADS``, ``LLAMAS`` or ``DECODERS``), ``stage``, ``gas``, ``dtype`` (``fp32``/``bf16``),
``offload``, ``micro_batch``, ``steps`` (measured), ``warmup``; optional ``reduce_bucket_size``,
``torch_adam`` (the optimizer's ``"torch_adam": true``: torch's Adam for AdamW and Muon's auxiliary
Adam instead of DeepSpeed's JIT-built FusedAdam),
``optimizer`` (``muon`` default, ``adamw``), ``pipeline_depth``, ``batch_ns`` and ``max_step_memory`` (the Muon
optimizer's config keys of those names, set in its ``params`` where given and not ``None``; the
driver passes them to patched builds only), ``memory_step`` (default True), ``lifetime_memory`` (default False: see
``alloc_live_bytes``), ``save_weights``, ``ns_dtype`` (``"fp32"``: upstream's ``original_muon.ns_compute_dtype``
replaced for the workload by one that returns fp32, so that Newton-Schulz runs in fp32 where upstream picks fp16 or
bf16; DeepSpeed itself is not changed; see ``ns_dtype_rule``).

Writes one JSON line per finished workload to ``--out`` (rank 0) and prints ``START name`` /
``DONE name`` so the driver can tell which workload a crash or hang hit. A row holds the config's
keys (without ``save_weights``; ``optimizer`` always present) and, with "per step" meaning per
optimizer step (all its micro-steps), times in seconds, sizes in bytes:

- ``world_size``; ``muon_elements``, ``muon_matrices``: the model's Muon parameters.
- ``ns_dtypes``: the dtypes Newton-Schulz computed in during the workload (what
  ``original_muon.ns_compute_dtype`` returned to its callers, over all ranks; empty where no NS ran).
- ``ns_calls_per_step`` / ``ns_calls_micro_per_step``: matrices Newton-Schulz orthogonalized
  (``NSCounter.count``: a batched kernel call on ``[b, m, n]`` counts b), summed over ranks,
  mean over measured steps; all micro-steps / non-boundary ones only.
- ``ns_kernel_calls_per_step``: Newton-Schulz kernel calls, summed over ranks, mean over steps
  (fewer than ``ns_calls_per_step`` where an owner batches).
- ``ns_seconds_per_step``: time inside the kernels, slowest rank, median over steps.
- ``{muon,other}_{elements,bytes}_{boundary,micro}_{mean,max}``: traffic received per rank per
  step (``micro``: summed over the non-boundary micro-steps), mean over steps, then mean / max
  over ranks.
- ``boundary_time`` (forward, backward and ``step()`` of the boundary micro-step),
  ``boundary_step_time`` (its ``step()``), ``micro_time`` (one non-boundary micro-step; None at
  gas 1), ``step_time`` (all micro-steps of a step): slowest rank per step, median over steps.
- ``boundary_peak_bytes``: resident-set (or device allocator) peak of the boundary micro-step
  above its start, slowest rank, median over steps (measured during the timed steps).
- ``alloc_peak_bytes`` / ``alloc_peak_step_bytes``: allocator peak above the start of the extra
  step's boundary micro-step / of its ``engine.step()``; ``retained_muon_bytes``: the exchange
  buffers the Muon path keeps allocated across steps (``retained_muon_bytes``); ``alloc_boundary_bytes``:
  ``alloc_peak_step_bytes + retained_muon_bytes`` per rank. Max over ranks; None without
  ``memory_step`` (and the last two where the retained bytes are unknown, stock 0.19.7).
- ``optimizer_state_bytes``: bytes of the tensors the optimizer keeps in its state between steps
  (``optimizer_state_bytes``: Muon's momentum and the auxiliary Adam's moments, or AdamW's two
  moments); ``kept_bytes``: ``optimizer_state_bytes + retained_muon_bytes``, the optimizer's memory
  kept between steps; ``step_peak_bytes``: ``kept_bytes + alloc_peak_step_bytes``, the optimizer's
  memory at the peak of ``engine.step()`` (kept memory plus what the step allocates above its
  start). Per rank, then max over ranks (after the extra step; None where a part is unknown).
- ``alloc_live_bytes`` (``lifetime_memory`` configs only, else None): the CPU allocator's bytes
  allocated inside ``deepspeed.initialize`` or inside ``engine.step()`` of the warm-up steps and
  still live at their end (``torch.profiler`` memory events: partitions, flat buffers, optimizer
  state, exchange buffers: what the engine sets up and what its steps keep; not what forward and
  backward allocate). A block counts only while a Python tensor object uses its storage: a
  collective's buffer freed on the backend's own thread leaves no event (``live_bytes``). Max over
  ranks; ``alloc_live_kept_bytes``: ``kept_bytes`` by introspection at that same moment
  (the end of the warm-up steps; stock 0.19.8's all-gather cache can differ there from later
  steps). Muon minus AdamW of the two must agree: the allocator checks the introspection.
- ``muon_straddling_matrices`` / ``muon_straddling_elements`` (ZeRO-1/2, else None): the Muon
  matrices whose flat-buffer range crosses a partition boundary (``param_to_partition_ids``) and
  their elements.
- ``muon_elements_by_collective``: per collective (``all_to_all_single``, ``all_gather_into_tensor``,
  ...) that delivered any, the Muon elements received per rank per step, mean over ranks.
- ``loss_last``: rank 0's loss on the last measured boundary micro-step.
- ``boundary_settings``: ``pipeline_depth`` / ``batch_ns`` as the patch's Muon update ran them
  (from its pipelines; None where it has none), ``muon_buckets``, the buckets of its plans, and where the build
  has them its plan figures (``plan_peak_bytes``, ``plan_kept_bytes``, ``plan_ns_efficiency``: ``owner_plan.PlanFigures``
  of the update's ``figures``) (rank 0; None on stock or without Muon).
- ``muon_stats``: the patch's ``ExchangeStats`` on rank 0 after the measured steps (None on stock);
  ``bucket_bound_bytes``: the fp32 bytes of the patch's two exchange buffers for its largest
  bucket (send and receive, from its pipelines' layouts), max over ranks (None on stock or where
  no pipeline runs).
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
from torch.profiler import ProfilerActivity, profile, record_function

import deepspeed
import deepspeed.comm as ds_comm
from deepspeed.accelerator import get_accelerator

# Shared with the tests: the muon_testing package (testing/), installed in every venv and by gpu-check.
from muon_testing.compare import gathered_weights
from muon_testing.counting import NSCounter

# Workloads: dims of a chain of bias-free Linear layers (all Muon matrices), tanh between them;
# "llama" and "llama64" are LlamaShaped below.
WORKLOADS = {
    "sq256": [256] * 5,  # four 256x256
    "rect256": [256, 384, 256, 384, 256],  # 384x256, 256x384, ...
    "sq1024": [1024] * 5,  # four 1024x1024
    "rect1024": [1024, 768, 1024, 768, 1024],
    "seed64": [64, 64, 64],  # the seed table's two Linear(64, 64)
    "tiny": [20, 36, 20, 36],  # 36x20, 20x36, 36x20: sizes W=2..4 do not divide (tests)
}
LLAMAS = {
    "llama": dict(hidden=256, intermediate=688, layers=4),
    "llama64": dict(hidden=64, intermediate=172, layers=4),
    "llama-gpu": dict(hidden=1536, intermediate=4096, layers=8),
}
"""The Llama-shaped workloads' shapes: per layer q, k, v, o (hidden x hidden), gate and up
(intermediate x hidden), down (hidden x intermediate), as in a small Llama without embeddings;
``llama64`` has problems small enough for the CPU to gain from batching them
(``newton_schulz.CPU_BATCH_MAX_ELEMENTS``); ``llama-gpu`` (226,492,416 parameters, all Muon
matrices) is ``dev.py gpu-check``'s step-time and memory workload on one GPU."""
DECODERS = {"decoder12": dict(hidden=171, layers=3)}
"""GPT-shaped decoders (``DecoderShaped``): per layer the fused attention input (3 hidden x hidden),
its output (hidden x hidden), the MLP's up (4 hidden x hidden) and down (hidden x 4 hidden)
projections. ``decoder12``: 12 Muon matrices, 1,052,676 elements, the memory and ZeRO-1/2 rows of
the benchmark (a 12-matrix decoder of about 1.05M elements, as in the review issue, whose own
shapes are not in the repository: these are GPT-2's proportions). At ZeRO-1/2 its W=2 partition
boundary falls between two matrices (Muon orders them by size), at W=4 three matrices straddle."""


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
                if kind == "muon":
                    self.totals[(f"muon:{name}", "elements")] += elements
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


class LlamaShaped(torch.nn.Module):
    """The Muon matrices of a small Llama's decoder layers (``LLAMAS``), under a simple residual
    forward that uses each of them: per layer, with ``n`` a weightless RMS norm,
    ``x + o(silu(q(n(x))) * k(n(x)) + v(n(x)))`` then ``x + down(silu(gate(n(x))) * up(n(x)))``.
    Not Llama's attention (no heads, no softmax, no rotary embedding): what matters for batched
    Newton-Schulz is seven matrices per layer in three shapes. Input and output ``[batch, hidden]``."""

    def __init__(self, hidden, intermediate, layers):
        super().__init__()
        linear = lambda a, b: torch.nn.Linear(a, b, bias=False)  # noqa: E731
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                dict(q=linear(hidden, hidden),
                     k=linear(hidden, hidden),
                     v=linear(hidden, hidden),
                     o=linear(hidden, hidden),
                     gate=linear(hidden, intermediate),
                     up=linear(hidden, intermediate),
                     down=linear(intermediate, hidden))) for _ in range(layers))

    def forward(self, x):
        norm = lambda t: torch.nn.functional.rms_norm(t, (t.shape[-1], ))  # noqa: E731
        for m in self.layers:
            h = norm(x)
            x = x + m["o"](torch.nn.functional.silu(m["q"](h)) * m["k"](h) + m["v"](h))
            h = norm(x)
            x = x + m["down"](torch.nn.functional.silu(m["gate"](h)) * m["up"](h))
        return x


class DecoderShaped(torch.nn.Module):
    """A GPT-shaped decoder's Muon matrices (``DECODERS``) under a residual forward that uses each:
    per layer, with ``n`` a weightless RMS norm, ``q, k, v = attn(n(x))`` split in three, ``x + o(
    silu(q) * k + v)``, then ``x + down(gelu(up(n(x))))``. No embeddings, no heads, no softmax.
    Input and output ``[batch, hidden]``."""

    def __init__(self, hidden, layers):
        super().__init__()
        linear = lambda a, b: torch.nn.Linear(a, b, bias=False)  # noqa: E731
        self.hidden = hidden
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                dict(attn=linear(hidden, 3 * hidden),
                     o=linear(hidden, hidden),
                     up=linear(hidden, 4 * hidden),
                     down=linear(4 * hidden, hidden))) for _ in range(layers))

    def forward(self, x):
        norm = lambda t: torch.nn.functional.rms_norm(t, (t.shape[-1], ))  # noqa: E731
        for m in self.layers:
            q, k, v = m["attn"](norm(x)).split(self.hidden, dim=-1)
            x = x + m["o"](torch.nn.functional.silu(q) * k + v)
            x = x + m["down"](torch.nn.functional.gelu(m["up"](norm(x))))
        return x


def decoder_shapes(workload):
    """The weight shapes of a ``DECODERS`` workload, in parameter order."""
    h, layers = DECODERS[workload]["hidden"], DECODERS[workload]["layers"]
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)] * layers


def io_dims(workload):
    """``(input features, output features)`` of a workload's model."""
    if workload in LLAMAS:
        return LLAMAS[workload]["hidden"], LLAMAS[workload]["hidden"]
    if workload in DECODERS:
        return DECODERS[workload]["hidden"], DECODERS[workload]["hidden"]
    return WORKLOADS[workload][0], WORKLOADS[workload][-1]


def build_model(workload):
    if workload in LLAMAS:
        torch.manual_seed(1234)
        return LlamaShaped(**LLAMAS[workload])
    if workload in DECODERS:
        torch.manual_seed(1234)
        return DecoderShaped(**DECODERS[workload])
    dims = WORKLOADS[workload]

    class Chain(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:]))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.tanh(x)
            return x

    torch.manual_seed(1234)
    return Chain()


OPTIMIZERS = {
    "muon": {
        "type": "Muon",
        "params": {
            "muon_lr": 0.02,
            "adam_lr": 3e-4,
            "momentum": 0.95
        }
    },
    "adamw": {
        "type": "AdamW",
        "params": {
            "lr": 3e-4
        }
    },
}
"""ds_config ``optimizer`` sections by the config key ``optimizer`` (default ``muon``): AdamW is the
baseline Muon is compared to, on the same model and ZeRO config."""


UPDATE_KEYS = ("pipeline_depth", "batch_ns", "max_step_memory")  # the patch's Muon keys a config may set


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
        "optimizer": dict(OPTIMIZERS[cfg.get("optimizer", "muon")]),
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }
    if cfg.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    if cfg.get("torch_adam"):
        config["optimizer"]["params"] = dict(config["optimizer"]["params"], torch_adam=True)
    update_keys = {k: cfg[k] for k in UPDATE_KEYS if cfg.get(k) is not None}
    if update_keys:
        config["optimizer"]["params"] = dict(config["optimizer"]["params"], **update_keys)
    return config


def batch(cfg, step, micro, rank, world_size, dim, device, dtype):
    """This rank's micro-batch ``micro`` of optimizer step ``step``: a slice of the step's global
    batch, identical whatever the split into ranks and micro-steps."""
    g = torch.Generator().manual_seed(10_000 + step)
    total = cfg["micro_batch"] * cfg["gas"] * world_size
    x = torch.randn(total, dim, generator=g)
    y = torch.randn(total, io_dims(cfg["workload"])[1], generator=g)
    start = (micro * world_size + rank) * cfg["micro_batch"]
    sl = slice(start, start + cfg["micro_batch"])
    return x[sl].to(device, dtype), y[sl].to(device, dtype)


def patch_update(optimizer):
    """The patch's Muon update on a ZeRO optimizer (``muon_update``, ``binding.MuonUpdate``):
    ``(True, object)``, ``(True, None)`` where the patched optimizer has none (not Muon),
    ``(False, None)`` on a stock build."""
    if not hasattr(optimizer, "muon_update"):
        return False, None
    return True, optimizer.muon_update


def update_settings(update):
    """What the patch's Muon update runs with: ``pipeline_depth`` and ``batch_ns`` of its first
    pipeline (None without one), ``muon_buckets``, the buckets of its plans, and its plan figures
    (``figures``, where the build has them: the peak of Muon's step and the kept bytes per rank it
    planned, its NS parallel efficiency; else None)."""
    pipelines = list(update.pipelines.values())
    first = pipelines[0] if pipelines else None
    figures = getattr(update, "figures", None)
    return dict(pipeline_depth=first.depth if first else None,
                batch_ns=first.batch_ns if first else None,
                muon_buckets=sum(len(p.plan.buckets) for p in pipelines),
                plan_peak_bytes=getattr(figures, "peak_bytes", None),
                plan_kept_bytes=getattr(figures, "kept_bytes", None),
                plan_ns_efficiency=getattr(figures, "ns_efficiency", None))


def bucket_exchange_bytes(update):
    """fp32 bytes of the two exchange buffers (send and receive) of the patch's largest bucket on
    this rank, from its pipelines' layouts; None without a pipeline."""
    sizes = [(layout.send_numel + layout.recv_numel) * 4 for p in update.pipelines.values()
             for layout in p.layouts]
    return max(sizes) if sizes else None


def retained_muon_bytes(optimizer):
    """Bytes the Muon path keeps allocated from one optimizer step to the next besides the
    optimizer state, by introspection: the patch's exchange buffers (``reserved_bytes()`` of its
    Muon update, reserved at initialization; 0 without Muon), else stock 0.19.8's all-gather cache
    (``_muon_allgather_buffer_bytes``, up to 256 MiB, ZeRO-3 and ZeRO-1/2); ``None`` on a build
    with neither (stock 0.19.7)."""
    patched, update = patch_update(optimizer)
    if patched:
        return 0 if update is None else int(update.reserved_bytes())
    cached = getattr(optimizer, "_muon_allgather_buffer_bytes", None)
    return None if cached is None else int(cached)


def optimizer_state_bytes(optimizer):
    """Bytes of the tensors the optimizer keeps between steps as its state, by introspection:
    every tensor in the base optimizer's ``state`` (Muon's ``momentum_buffer``, the auxiliary
    Adam's or AdamW's ``exp_avg`` / ``exp_avg_sq``, tensor ``step`` counters), plus ZeRO-3's
    in-memory Muon momentum table (``muon_momentum_buffer_partitioned_groups_flat``, with
    ``save_muon_momentum_buffer_in_memory``). Counted per storage (a tensor's whole storage, each
    storage once). Optimizer state swapped to NVMe is not in memory and not counted."""
    storages = {}

    def add(t):
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            storages[(t.device.type, storage.data_ptr())] = storage.nbytes()

    base = getattr(optimizer, "optimizer", optimizer)
    for state in base.state.values():
        for value in state.values():
            add(value)
    for value in (getattr(optimizer, "muon_momentum_buffer_partitioned_groups_flat", None) or {}).values():
        add(value)
    return sum(storages.values())


def straddling_muon(optimizer):
    """``(matrices, elements)`` of the Muon parameters whose range of the ZeRO-1/2 flat buffer
    crosses a partition boundary (DeepSpeed's ``param_to_partition_ids``); ``(None, None)`` at
    ZeRO-3."""
    ids = getattr(optimizer, "param_to_partition_ids", None)
    groups = getattr(optimizer, "bit16_groups", None)
    if ids is None or groups is None:
        return None, None
    matrices = elements = 0
    for i, group in enumerate(groups):
        for param in group:
            if getattr(param, "use_muon", False) and len(ids[i][optimizer.get_param_id(param)]) > 1:
                matrices += 1
                elements += param.numel()
    return matrices, elements


INIT_MARK = "zero3muon_bench::initialize"
WARMUP_STEP_MARK = "zero3muon_bench::warmup_engine_step"


def kept_now(optimizer):
    """``optimizer_state_bytes + retained_muon_bytes`` at this moment (None where the retained
    bytes are unknown)."""
    retained = retained_muon_bytes(optimizer)
    return None if retained is None else optimizer_state_bytes(optimizer) + retained


def held_cpu_blocks():
    """Start addresses of the CPU storages of every tensor object Python still has
    (``gc.get_objects()`` after ``gc.collect()``; run it while the profiler records, so that the
    collection's frees are recorded too). A tensor made in Python that only C++ still holds (an
    unfinished collective's buffers, kept by its work object) keeps its Python object and is
    included; storage held without a tensor object, or a tensor C++ made and never handed to
    Python (an autograd graph's saved intermediates), is not."""
    import gc
    gc.collect()
    blocks = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                blocks.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
                pass
    return blocks


def live_bytes(prof, marks, held):
    """Bytes of the CPU allocator's blocks allocated inside any occurrence of the
    ``record_function`` regions ``marks`` while ``prof`` ran (``profile_memory=True``), not
    freed by its end (the event walk of ``profiled_peaks``) and in ``held``
    (``held_cpu_blocks()`` at that end).

    The profiler records a free only on a thread it profiles: a collective's buffer whose last
    reference the backend's own thread drops (gloo's worker threads) is freed there without an
    event and would otherwise count as live, in some runs and not others. A block that no tensor
    object uses is taken as freed (what this misses: ``held_cpu_blocks``).
    """
    from torch._C._profiler import _EventType
    events, windows = [], []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            if node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name in marks:
            windows.append((node.start_time_ns, node.end_time_ns))
        nodes.extend(node.children)
    events.sort(key=lambda e: e[0])
    live = {}
    for t, ptr, size in events:
        if size > 0:
            if any(t0 <= t <= t1 for t0, t1 in windows):
                live[ptr] = size
            else:
                live.pop(ptr, None)  # the address is reused by a block not counted
        else:
            live.pop(ptr, None)
    return sum(size for ptr, size in live.items() if ptr in held)


def end_lifetime(prof, marks, optimizer):
    """Stops ``prof`` and returns ``(live_bytes(prof, marks, held), kept_now(optimizer))`` at that moment.

    A backend may still hold a finished asynchronous collective's tensors on its own thread after wait()
    returned (gloo's worker threads): a barrier, queued behind them, gives that thread time to let go of them
    before ``held_cpu_blocks()`` looks (otherwise they count as held, and are freed later on that thread,
    unrecorded)."""
    torch.distributed.barrier()
    held = held_cpu_blocks()
    prof.__exit__(None, None, None)
    return live_bytes(prof, marks, held), kept_now(optimizer)


BOUNDARY_MARK = "zero3muon_bench::boundary_micro_step"
STEP_MARK = "zero3muon_bench::engine_step"


def profiled_peaks(prof, marks):
    """Peak live bytes of the CPU allocator within each marked region of a ``torch.profiler``
    run with ``profile_memory=True``, above the region's start.

    The profiler records one ``[memory]`` event per allocation (positive size) and free (negative)
    made by c10's CPU allocator while it profiles, with the block's address. Frees of blocks
    allocated before profiling started are not recorded (c10's ``ProfiledCPUMemoryReporter`` does
    not know their size; it logs "Memory block of unknown size was allocated before the profiling
    started"). Its running ``total_allocated`` is process-wide and drifts across profiling runs
    (a block allocated while profiling and freed outside keeps counting), so it is not used: the
    live total is summed here from the events, and a free counts only for a block whose allocation
    this run recorded. The result is the exact peak of the blocks allocated since the profiler
    started, minus those freed; it can only overstate the true rise, by blocks allocated before
    profiling started and freed inside the region before the peak.

    The events come from ``prof.profiler.kineto_results.experimental_event_tree()`` (torch 2.13;
    what ``torch.profiler._memory_profiler`` reads too): ``prof.events()`` attributes sizes to
    operators without addresses, and the kineto events carry sizes without addresses.

    Args:
        prof: a finished ``torch.profiler.profile``.
        marks: names of ``torch.profiler.record_function`` regions run once each.

    Returns:
        ``{mark: peak bytes (int, >= 0)}``.

    Raises:
        KeyError: a mark that does not occur in the profile.
    """
    from torch._C._profiler import _EventType
    events, windows = [], {}
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                events.append((node.start_time_ns, f.ptr, f.alloc_size))
        elif node.name in marks:
            windows[node.name] = (node.start_time_ns, node.end_time_ns)
        nodes.extend(node.children)
    events.sort(key=lambda e: e[0])
    peaks = {}
    for mark in marks:
        t0, t1 = windows[mark]
        known, live, peak = {}, 0, 0
        for t, ptr, size in events:
            if t > t1:
                break
            if size > 0:
                known[ptr] = size
                if t >= t0:
                    live += size
                    peak = max(peak, live)
            else:
                size = known.pop(ptr, None)
                if size is not None and t >= t0:
                    live -= size
        peaks[mark] = peak
    return peaks


@contextlib.contextmanager
def ns_dtype_rule(force=None):
    """Records the dtypes upstream's rule ``original_muon.ns_compute_dtype`` returns while the block runs (upstream's
    kernels and the patch look it up there at call time, so this is the dtype Newton-Schulz computed in); with
    ``force="fp32"`` the rule returns float32 instead. Yields the set of dtype names; restores the rule after."""
    from deepspeed.runtime.zero.muon import original_muon
    forced = {None: None, "fp32": torch.float32}
    if force not in forced:
        raise ValueError(f"ns_dtype {force!r}: expected 'fp32' or absent")
    rule, seen = getattr(original_muon, "ns_compute_dtype", None), set()
    if rule is None:  # a build without the rule (0.19.7: fp16 wherever the accelerator has it): nothing recorded
        seen.add("unrecorded" if force is None else "unrecorded, not forced: this build has no ns_compute_dtype")
        yield seen
        return

    def recorded(*args, **kwargs):
        dtype = forced[force] or rule(*args, **kwargs)
        seen.add(str(dtype).replace("torch.", ""))
        return dtype

    original_muon.ns_compute_dtype = recorded
    try:
        yield seen
    finally:
        original_muon.ns_compute_dtype = rule


def run_workload(cfg, ns, comm, peak):
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    lifetime = alloc_live = live_kept = None
    model = build_model(cfg["workload"])
    if cfg.get("lifetime_memory"):
        # the allocations of initialize and of every step() to the end of the warm-up steps
        # (see alloc_live_bytes)
        lifetime = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        lifetime.__enter__()
    with record_function(INIT_MARK) if lifetime is not None else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=model,
                                          model_parameters=model.parameters(),
                                          config=ds_config(cfg, world_size))
        update = patch_update(engine.optimizer)[1]
    if lifetime is not None and cfg["warmup"] == 0:  # no warm-up step: the engine as built
        (alloc_live, live_kept), lifetime = end_lifetime(lifetime, (INIT_MARK, ), engine.optimizer), None
    device = engine.device
    acc = get_accelerator()
    dtype = torch.bfloat16 if cfg.get("dtype") == "bf16" else torch.float32
    dim = io_dims(cfg["workload"])[0]

    def forward_backward(step, micro):
        x, y = batch(cfg, step, micro, rank, world_size, dim, device, dtype)
        torch.distributed.barrier()
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        return loss

    steps = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        rec = dict(micro_times=[], micro_traffic=[], ns_micro=0)
        ns_kernel_calls0, ns_seconds0 = ns.calls, ns.seconds
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
                with record_function(WARMUP_STEP_MARK) if lifetime is not None else contextlib.nullcontext():
                    engine.step()
                acc.synchronize()
                t2 = time.perf_counter()
            traffic = _diff(comm.snapshot(), c0)
            if is_boundary:
                rec.update(boundary_time=t2 - t0,
                           boundary_step_time=t2 - t1,
                           boundary_traffic=traffic,
                           ns_boundary=ns.count - ns0,
                           peak=mem.get("peak"),
                           loss=loss.item())
            else:
                rec["micro_times"].append(t2 - t0)
                rec["micro_traffic"].append(traffic)
                rec["ns_micro"] += ns.count - ns0
        rec.update(ns_kernel_calls=ns.calls - ns_kernel_calls0, ns_seconds=ns.seconds - ns_seconds0)
        if step >= cfg["warmup"]:
            steps.append(rec)
        if lifetime is not None and step == cfg["warmup"] - 1:
            (alloc_live, live_kept), lifetime = end_lifetime(lifetime, (INIT_MARK, WARMUP_STEP_MARK),
                                                             engine.optimizer), None
    result = dict(steps=steps, alloc_live_bytes=alloc_live, alloc_live_kept_bytes=live_kept)
    # what the patch's Muon update actually ran with (an argument the build lacks is not applied)
    result["boundary_settings"] = None if update is None else update_settings(update)
    if update is not None:
        result["muon_stats"] = dict(vars(update.stats))
        result["bucket_bound_bytes"] = bucket_exchange_bytes(update)
    result["muon_straddling_matrices"], result["muon_straddling_elements"] = straddling_muon(engine.optimizer)
    if cfg.get("save_weights"):
        result["weights"] = gathered_weights(engine)
    muon_params = [p for p in engine.module.parameters() if getattr(p, "use_muon", False)]
    result["muon_elements"] = sum(getattr(p, "ds_numel", p.numel()) for p in muon_params)
    result["muon_matrices"] = len(muon_params)
    # After the timed steps (and after the weights and the patch's counters were read, so both
    # describe the warm-up and measured steps only): one more optimizer step, its boundary
    # micro-step measured at the allocator.
    if cfg.get("memory_step", True):
        result.update(allocator_memory_step(engine, cfg, forward_backward))
    engine.destroy()
    return result


def allocator_memory_step(engine, cfg, forward_backward):
    """One more optimizer step (every micro-step) whose boundary micro-step is measured at the
    allocator, in bytes above the region's start: ``alloc_peak_bytes`` (forward, backward and
    ``step()``) and ``alloc_peak_step_bytes`` (``engine.step()`` alone); then
    ``retained_muon_bytes`` (see ``retained_muon_bytes``) and ``alloc_boundary_bytes``, the step's
    peak plus what Muon keeps across steps (allocated before the step starts, so the step's peak
    cannot see it); ``None`` where the retained bytes are unknown. Then, after the step,
    ``optimizer_state_bytes``, ``kept_bytes`` (state plus retained buffers) and ``step_peak_bytes``
    (kept plus the step's peak above its start).

    On the CPU the whole optimizer step runs under ``torch.profiler`` with ``profile_memory``, so
    that blocks allocated on an earlier micro-step of the step and freed on the boundary one count
    (``profiled_peaks``); on an accelerator with allocator statistics, ``max_memory_allocated``
    after ``reset_peak_memory_stats``. Profiling slows the step: its times are not recorded."""
    acc = get_accelerator()
    step = cfg["warmup"] + cfg["steps"]
    last = cfg["gas"] - 1
    out = {}
    if acc.device_name() == "cpu":
        from torch.profiler import ProfilerActivity, profile, record_function
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
            for micro in range(cfg["gas"]):
                region = record_function(BOUNDARY_MARK) if micro == last else contextlib.nullcontext()
                with region:
                    forward_backward(step, micro)
                    with record_function(STEP_MARK) if micro == last else contextlib.nullcontext():
                        engine.step()
        peaks = profiled_peaks(prof, (BOUNDARY_MARK, STEP_MARK))
        out.update(alloc_peak_bytes=peaks[BOUNDARY_MARK], alloc_peak_step_bytes=peaks[STEP_MARK])
    else:
        for micro in range(cfg["gas"]):
            if micro < last:
                forward_backward(step, micro)
                engine.step()
                continue
            acc.synchronize()
            acc.reset_peak_memory_stats()
            start = acc.memory_allocated()
            forward_backward(step, micro)
            acc.synchronize()
            forward_peak = acc.max_memory_allocated() - start
            acc.reset_peak_memory_stats()
            step_start = acc.memory_allocated()
            engine.step()
            acc.synchronize()
            out.update(alloc_peak_step_bytes=acc.max_memory_allocated() - step_start,
                       alloc_peak_bytes=max(forward_peak,
                                            acc.max_memory_allocated() - start))
    retained = retained_muon_bytes(engine.optimizer)
    out["retained_muon_bytes"] = retained
    out["alloc_boundary_bytes"] = None if retained is None else out["alloc_peak_step_bytes"] + retained
    out["optimizer_state_bytes"] = state = optimizer_state_bytes(engine.optimizer)
    out["kept_bytes"] = None if retained is None else state + retained
    out["step_peak_bytes"] = None if retained is None else state + retained + out["alloc_peak_step_bytes"]
    return out


MEMORY_FIELDS = ("alloc_peak_bytes", "alloc_peak_step_bytes", "retained_muon_bytes", "alloc_boundary_bytes",
                 "optimizer_state_bytes", "kept_bytes", "step_peak_bytes", "alloc_live_bytes", "alloc_live_kept_bytes")


def summarize(cfg, per_rank):
    """Combine the ranks' records into one row (fields: the module docstring): sums over ranks for
    NS matrices and kernel calls, mean and max over ranks for traffic, max over ranks then median over
    steps for times (NS seconds included) and resident memory, max over ranks for the allocator
    memory of the extra step."""
    world_size = len(per_rank)
    n_steps = len(per_rank[0]["steps"])

    def traffic(step_rec, where, kind, unit):
        if where == "boundary":
            return step_rec["boundary_traffic"].get((kind, unit), 0.0)
        return sum(t.get((kind, unit), 0.0) for t in step_rec["micro_traffic"])

    row = dict(cfg)
    row.pop("save_weights", None)
    row["optimizer"] = cfg.get("optimizer", "muon")
    row["world_size"] = world_size
    row["muon_elements"] = per_rank[0]["muon_elements"]
    row["muon_matrices"] = per_rank[0]["muon_matrices"]
    row["ns_dtypes"] = sorted({d for r in per_rank for d in r.get("ns_dtypes", ())})
    row["ns_calls_per_step"] = sum(r["steps"][s]["ns_boundary"] + r["steps"][s]["ns_micro"] for r in per_rank
                                   for s in range(n_steps)) / n_steps
    row["ns_calls_micro_per_step"] = sum(r["steps"][s]["ns_micro"] for r in per_rank for s in range(n_steps)) / n_steps
    for where in ("boundary", "micro"):
        for kind in ("muon", "other"):
            for unit in ("elements", "bytes"):
                per = [
                    statistics.mean(traffic(r["steps"][s], where, kind, unit) for s in range(n_steps))
                    for r in per_rank
                ]
                row[f"{kind}_{unit}_{where}_mean"] = statistics.mean(per)
                row[f"{kind}_{unit}_{where}_max"] = max(per)
    row["boundary_time"] = statistics.median(
        max(r["steps"][s]["boundary_time"] for r in per_rank) for s in range(n_steps))
    row["boundary_step_time"] = statistics.median(
        max(r["steps"][s]["boundary_step_time"] for r in per_rank) for s in range(n_steps))
    micro = [
        max(r["steps"][s]["micro_times"][m] for r in per_rank) for s in range(n_steps) for m in range(cfg["gas"] - 1)
    ]
    row["micro_time"] = statistics.median(micro) if micro else None
    row["step_time"] = statistics.median(
        max(r["steps"][s]["boundary_time"] + sum(r["steps"][s]["micro_times"]) for r in per_rank)
        for s in range(n_steps))
    row["ns_seconds_per_step"] = statistics.median(
        max(r["steps"][s]["ns_seconds"] for r in per_rank) for s in range(n_steps))
    row["ns_kernel_calls_per_step"] = sum(r["steps"][s]["ns_kernel_calls"] for r in per_rank
                                          for s in range(n_steps)) / n_steps
    peaks = [
        max(r["steps"][s]["peak"] for r in per_rank) for s in range(n_steps)
        if per_rank[0]["steps"][s]["peak"] is not None
    ]
    row["boundary_peak_bytes"] = statistics.median(peaks) if peaks else None
    row["loss_last"] = per_rank[0]["steps"][-1]["loss"]
    row["muon_stats"] = per_rank[0].get("muon_stats")
    row["boundary_settings"] = per_rank[0].get("boundary_settings")
    row["bucket_bound_bytes"] = max((r.get("bucket_bound_bytes") or 0) for r in per_rank) or None
    row["muon_straddling_matrices"] = per_rank[0].get("muon_straddling_matrices")
    row["muon_straddling_elements"] = per_rank[0].get("muon_straddling_elements")
    collectives = sorted({
        k[0].split(":", 1)[1]
        for r in per_rank
        for s in r["steps"]
        for t in [s["boundary_traffic"], *s["micro_traffic"]]
        for k in t if k[0].startswith("muon:")
    })
    by_collective = {
        c:
        statistics.mean(
            statistics.mean(
                traffic(r["steps"][s], "boundary", f"muon:{c}", "elements") +
                traffic(r["steps"][s], "micro", f"muon:{c}", "elements") for s in range(n_steps)) for r in per_rank)
        for c in collectives
    }
    row["muon_elements_by_collective"] = {c: v for c, v in by_collective.items() if v}
    for key in MEMORY_FIELDS:
        values = [r.get(key) for r in per_rank]
        row[key] = None if None in values else max(values)
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
        with ns_dtype_rule(cfg.get("ns_dtype")) as ns_dtypes:
            result = run_workload(cfg, ns, comm, peak)
        result["ns_dtypes"] = sorted(ns_dtypes)
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
