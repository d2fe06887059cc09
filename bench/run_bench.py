# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Side-by-side benchmark of Muon under ZeRO-3: patched and stock DeepSpeed 0.19.8 (and 0.19.7).

Run through ``python3 dev.py bench [ARGS]``, which prepares one venv per build (cached) and passes
each build's Python as ``--python NAME=PATH`` (patched-0.19.8 and stock-0.19.8; with
``--all-bases`` also 0.19.7's pair). Every workload runs on every build, in interleaved launches
(repeat 1 of every build, then repeat 2, ...) so machine noise hits all builds alike, and a ratio
between two builds pairs repeat i with repeat i (``bench/repeats.py``). Prints, per link rate
(``--net``) and world size, one table with a row per workload and build (timings as median
[min-max] over repeats), the ratios patched / stock 0.19.8 (median [min-max] of the paired
per-repeat ratios), one ``target <name>: <value> <met|MISSED>`` line per target, the seed table
(stage 1/2/3 x gas 1/4 at W=1) and the overlap comparison; writes ``results.json`` (every
repeat's value) and plots to ``--out``. Asserts nothing about absolute times; the exit code is
non-zero only if a patched build fails a workload.

``--net RATE|auto [...]`` runs the net grid inside a network namespace whose link is shaped to
RATE (``bench/netns.py``; ``auto``: the inter-node rate ``bench/link_rate.py`` derives for each
world size), so the exchange's traffic costs what it would between nodes.

Workloads (``bench/worker.py``): chains of bias-free Linear layers, every matrix a Muon matrix,
4 matrices each: ``sq256`` (256x256), ``rect256`` (384x256 / 256x384), ``sq1024``, ``rect1024``
(768x1024 / 1024x768); ``llama``: one Llama-shaped layer set (d x d q/k/v/o, f x d gate/up, d x f
down; sizes in ``bench/worker.py``), with Newton-Schulz batched or one matrix at a time
(``batch_ns``, patched builds), and AdamW runs (``optimizer: adamw``) as the step-time reference;
``decoder12`` (a GPT-shaped decoder, 12 matrices, 1,052,676 elements): Muon against AdamW at ZeRO-3
(optimizer memory kept between steps and at the peak of ``step()``, targets <= AdamW on each build)
and Muon at ZeRO-1 and ZeRO-2 with and without ``offload_optimizer: cpu`` (Muon traffic, NS
calls and optimizer memory kept; ``--grid memory`` runs only these). Variants of the patch (``pipeline_depth``, ``batch_ns``,
``max_step_memory``) are keys of the Muon optimizer's config, set like a user sets them (patched builds only); the
strict ``max_step_memory: "momentum_partition"`` twin of sq1024 (net grid, ``--grid max-step-memory``) and of
decoder12's Muon rows (memory grid) is printed side by side with the default (``print_step_memory_table``: buckets,
Muon bytes per rank, boundary ``step()`` time and its paired ratio, kept and peak memory). All fp32 with ``gradient_clipping: 0``, ``reduce_scatter: false`` (stock
refuses the default ``true`` with Muon; the patched build accepts both) and
``stage3_param_persistence_threshold: 0``; TorchDynamo off (NS eager on every build).
"""

import argparse
import contextlib
import json
import math
import os
import re
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
from repeats import Spread, per_repeat, ratio_spread, spread, target_line  # noqa: E402

# Shared with the tests and the demo: the muon_testing package (testing/), which dev.py setup installs.
from muon_testing.compare import free_port, relative_difference  # noqa: E402

REFERENCE = "stock-0.19.8"
PATCHED_DEFAULT = "patched-0.19.8"
NET_BUILDS = (PATCHED_DEFAULT, REFERENCE)  # the builds of a --net run
BUILD_ORDER = ("stock-0.19.7", "stock-0.19.8", "patched-0.19.7", "patched-0.19.8")
SHAPES = {
    "sq256": [(256, 256)] * 4,
    "rect256": [(384, 256), (256, 384)] * 2,
    "sq1024": [(1024, 1024)] * 4,
    "rect1024": [(768, 1024), (1024, 768)] * 2,
}
TRAFFIC_TARGET = 0.10  # Muon traffic per rank within 10% of 2P(W-1)/W^2
MODEL_WS = (2, 4, 8, 16, 64, 256, 1024)
# Boundary micro-step time patched / stock 0.19.8: no network limit (every Muon workload) and on
# the emulated link at the derived inter-node rate (the 1024 workloads), per world size.
BOUNDARY_TARGET_NO_LIMIT = 1.0
BOUNDARY_TARGET_NET = {2: 0.6, 4: 0.4}
MEMORY_TARGET_BUCKETS = 3.0  # boundary peak tensor bytes <= 3x the largest bucket's exchange bytes
BATCH_NS_TARGET = 0.8  # batched NS time per step <= 0.8x one matrix at a time (llama)
SAME_RESULTS_TOLERANCE = 1e-5  # relative loss difference, batched vs one-by-one NS
MUON_ADAMW = ("sq1024-gas4-fp32", "llama-gas4-fp32", "sq1024-gas1-fp32", "decoder12-gas2-fp32")  # with an AdamW twin
DECODER12 = [(513, 171), (171, 171), (684, 171), (171, 684)] * 3  # bench/worker.py's decoder12 (DECODERS)
LLAMA = ([(256, 256)] * 4 + [(688, 256)] * 2 + [(256, 688)]) * 4  # bench/worker.py's llama (LLAMAS)
MODEL_SHAPES = dict(SHAPES, decoder12=DECODER12, llama=LLAMA)  # workload -> Muon matrix shapes, for bench/model.py
KEPT_TARGET = 1.0  # Muon's optimizer memory kept between steps <= AdamW's on the same model
PEAK_TARGET = 1.0  # Muon's optimizer memory at the peak of step() <= AdamW's
ZERO12_TRAFFIC_TARGET = 1.0  # patched ZeRO-1/2: Muon exchange elements summed over ranks <= 2x straddling elements
ZERO12_KEPT_TARGET = 1.0  # patched ZeRO-1/2: Muon's optimizer memory kept between steps <= stock 0.19.8's
BATCH_NS_PAIR = ("llama-gas4-fp32-ns-batched", "llama-gas4-fp32-ns-onebyone")  # patched only: batch_ns True / False
SMALL_BATCH_NS_PAIR = ("llama64-gas4-fp32-ns-batched", "llama64-gas4-fp32-ns-onebyone")  # the same, 64-wide
# Fields kept per repeat (seconds, then bytes); the row's value is their median.
TIMING_KEYS = ("boundary_time", "boundary_step_time", "step_time", "micro_time", "ns_seconds_per_step")
MEMORY_KEYS = ("boundary_peak_bytes", "alloc_boundary_bytes", "alloc_peak_bytes", "alloc_peak_step_bytes",
               "retained_muon_bytes", "optimizer_state_bytes", "kept_bytes", "step_peak_bytes", "alloc_live_bytes",
               "alloc_live_kept_bytes")
NO_NET = ""  # the net label of runs without a network limit
# max_step_memory (the Muon optimizer's key): the default (a byte cap, every owner computing at once) against the
# strict value, a patched-only variant of a workload named <workload>STRICT_SUFFIX, compared with it side by side.
MAX_STEP_MEMORY_KEY = "max_step_memory"
STRICT_VALUE = "momentum_partition"
STRICT_SUFFIX = "-strict"
MAX_STEP_MEMORY_NET = ("sq1024-gas1-fp32", "sq1024-gas1-fp32" + STRICT_SUFFIX)  # the --grid max-step-memory pair
GRIDS = ("default", "full", "quick", "memory", "max-step-memory")  # --grid's choices
NET_GRIDS = ("max-step-memory", )  # grids --net runs as given (any other --grid: the net grid)


def workload_config(name, workload, gas, steps, warmup, dtype="fp32", offload=False, only=None, patched=None,
                    stage=3, **extra):
    """One workload config as ``bench/worker.py`` reads it, plus two driver-only keys:
    ``only`` ("patched": run on patched builds only) and ``patched`` (keys merged into the config
    on patched builds, e.g. ``batch_ns`` or ``pipeline_depth``, config keys of the patch's Muon
    optimizer that stock builds do not have)."""
    cfg = dict(name=name, workload=workload, stage=stage, gas=gas, dtype=dtype, offload=offload, micro_batch=2,
               steps=steps, warmup=warmup, **extra)
    if only:
        cfg["only"] = only
    if patched:
        cfg["patched"] = dict(patched)
    return cfg


def strict_variant(cfg):
    """The patched-only twin of workload config ``cfg`` with ``max_step_memory: "momentum_partition"`` set in the
    Muon optimizer's params like a user sets it (the strict rule: buckets within each rank's momentum partition),
    named ``cfg["name"] + STRICT_SUFFIX``."""
    out = dict(cfg, name=cfg["name"] + STRICT_SUFFIX, only="patched")
    out["patched"] = dict(cfg.get("patched", {}), **{MAX_STEP_MEMORY_KEY: STRICT_VALUE})
    return out


def reference_name(name):
    """The workload a variant's row compares with on other builds and against AdamW: ``name`` without
    ``STRICT_SUFFIX`` (the strict variant runs on patched builds only; its stock and AdamW rows are its
    default's)."""
    return name[:-len(STRICT_SUFFIX)] if name.endswith(STRICT_SUFFIX) else name


def llama_and_adamw(steps, warmup):
    """The Llama-shaped workload at gas 4 on every build (patched: the default batching of
    Newton-Schulz, ``newton_schulz.batches``), on patched builds also with every same-shape
    problem batched and with one matrix at a time (the batched-NS target's pair; the same for the
    64-wide ``llama64``, whose problems the CPU batches by default), and the AdamW
    twins of sq1024 and llama at gas 4 on every build (the Muon / AdamW step-time ratio)."""
    return [
        workload_config("llama-gas4-fp32", "llama", 4, steps, warmup, optimizer="muon"),
        workload_config(BATCH_NS_PAIR[0], "llama", 4, steps, warmup, optimizer="muon", only="patched",
                        patched={"batch_ns": True}),
        workload_config(BATCH_NS_PAIR[1], "llama", 4, steps, warmup, optimizer="muon", only="patched",
                        patched={"batch_ns": False}),
        workload_config(SMALL_BATCH_NS_PAIR[0], "llama64", 4, steps, warmup, optimizer="muon", only="patched",
                        patched={"batch_ns": True}),
        workload_config(SMALL_BATCH_NS_PAIR[1], "llama64", 4, steps, warmup, optimizer="muon", only="patched",
                        patched={"batch_ns": False}),
        workload_config("sq1024-gas4-fp32-adamw", "sq1024", 4, steps, warmup, optimizer="adamw"),
        workload_config("llama-gas4-fp32-adamw", "llama", 4, steps, warmup, optimizer="adamw"),
    ]


def memory_and_zero12(steps, warmup):
    """On every build, at gas 2: the GPT-shaped ``decoder12`` (12 matrices, 1,052,676 elements) at
    ZeRO-3 with Muon and with AdamW (the memory targets: optimizer memory kept between steps and at
    the peak of ``step()``, with the allocator's whole-engine count, ``lifetime_memory``); then
    ``decoder12`` and ``llama`` (28 matrices; one of them straddles the partition boundary at W=2,
    where decoder12's boundary falls between two matrices) with Muon at ZeRO-1 and ZeRO-2, with and
    without ``offload_optimizer: cpu`` (Muon traffic and NS calls). Every decoder12 Muon row also
    with ``max_step_memory: "momentum_partition"`` (``strict_variant``, patched builds only), for
    the kept and peak memory of both values of the key side by side."""
    out = [
        workload_config("decoder12-gas2-fp32", "decoder12", 2, steps, warmup, optimizer="muon", lifetime_memory=True),
        workload_config("decoder12-gas2-fp32-adamw", "decoder12", 2, steps, warmup, optimizer="adamw",
                        lifetime_memory=True),
    ]
    out.insert(1, strict_variant(out[0]))
    for wl in ("decoder12", "llama"):
        for stage in (1, 2):
            for offload in (False, True):
                out.append(workload_config(f"{wl}-zero{stage}-gas2-fp32{'-offload' if offload else ''}", wl, 2, steps,
                                           warmup, offload=offload, stage=stage, optimizer="muon"))
                if wl == "decoder12":
                    out.append(strict_variant(out[-1]))
    return out


def max_step_memory_grid(steps, warmup):
    """``--grid max-step-memory``: sq1024 at gas 1 (fp32) on every build, and on patched builds
    also with ``max_step_memory: "momentum_partition"``: at W=4 each 1024x1024 matrix (1M elements)
    exceeds a rank's momentum partition (1M / 4), so the strict rule puts every matrix alone in its
    own bucket at pipeline depth 1, while the default cap puts all four in one bucket (one per owner)."""
    default = workload_config(MAX_STEP_MEMORY_NET[0], "sq1024", 1, steps, warmup)
    return [default, strict_variant(default)]


def grid(kind: str, steps: int, warmup: int):
    """Workload configs of one launch.

    ``default``: each of the four chain workloads at gas 4 (fp32), plus, one factor at a time,
    gas 1 and CPU offload for each, gas 16 and bf16 for the ~256 workloads (stock 0.19.7 runs
    Newton-Schulz gas times per step: gas 16 on the 1024 workloads alone would take longer than
    the rest), plus ``llama_and_adamw``; ``full``: the full product plus ``llama_and_adamw``;
    ``quick``: sq256 only, gas 1/4, fp32 and offload (a smoke run); ``memory``: only
    ``memory_and_zero12`` (which ``default`` and ``full`` hold too); ``net`` (the grid of a
    ``--net`` run): sq1024 and rect1024 at gas 1 (fp32), and sq1024's AdamW twin (at gas 1: over
    an emulated link the parameter all-gathers of every micro-step take seconds, so gas 4 would
    quadruple the run for the same boundary step), sq1024's strict twin (``max_step_memory:
    "momentum_partition"``, patched builds only); ``max-step-memory``: only sq1024 at gas 1 and its
    strict twin (``max_step_memory_grid``; with ``--net`` or without).
    Raises ValueError for another kind."""
    if kind not in GRIDS + ("net", ):
        raise ValueError(f"unknown grid {kind!r}")
    if kind == "memory":
        return memory_and_zero12(steps, warmup)
    if kind == "max-step-memory":
        return max_step_memory_grid(steps, warmup)
    if kind == "net":
        points = [(w, 1, "fp32", False) for w in ("sq1024", "rect1024")]
    else:
        points = []
        for w in (["sq256"] if kind == "quick" else list(SHAPES)):
            if kind == "full":
                points += [(w, g, d, o) for g in (1, 4, 16) for d in ("fp32", "bf16") for o in (False, True)]
            elif kind == "quick":
                points += [(w, 1, "fp32", False), (w, 4, "fp32", False), (w, 4, "fp32", True)]
            else:
                points += [(w, 4, "fp32", False), (w, 1, "fp32", False), (w, 4, "fp32", True)]
                if w.endswith("256"):
                    points += [(w, 16, "fp32", False), (w, 4, "bf16", False)]
    configs = [
        workload_config(f"{w}-gas{g}-{d}{'-offload' if o else ''}", w, g, steps, warmup, dtype=d, offload=o)
        for w, g, d, o in points
    ]
    if kind in ("default", "full"):
        configs += llama_and_adamw(steps, warmup) + memory_and_zero12(steps, warmup)
    if kind == "net":
        configs.insert(1, strict_variant(configs[0]))
        configs.append(workload_config("sq1024-gas1-fp32-adamw", "sq1024", 1, steps, warmup, optimizer="adamw"))
    return configs


def configs_for(build, configs):
    """The configs a launch of ``build`` runs: ``only``-patched ones dropped on stock builds,
    ``patched`` keys merged in on patched builds, the driver-only keys removed."""
    patched = build.startswith("patched")
    out = []
    for c in configs:
        if c.get("only") == "patched" and not patched:
            continue
        cfg = {k: v for k, v in c.items() if k not in ("only", "patched")}
        if patched:
            cfg.update(c.get("patched", {}))
        out.append(cfg)
    return out


def select_builds(pythons, net):
    """Builds to run, in ``BUILD_ORDER`` then by name: every given one, or with ``--net`` only
    patched-0.19.8 and stock-0.19.8 (of those given)."""
    builds = [b for b in BUILD_ORDER if b in pythons] + sorted(set(pythons) - set(BUILD_ORDER))
    if net:
        builds = [b for b in builds if b in NET_BUILDS]
    return builds


OVERLAP_DEPTHS = {"overlap": 2, "serial": 1}  # pipeline_depth of the overlap comparison's pair


def overlap_grid(steps, warmup):
    """Patched builds only: the exchange overlapped with NS (``pipeline_depth`` 2, the default) or
    not (1), with ``reduce_bucket_size`` 2 and 1 matrices (the patch may pick smaller buckets, to
    fit its buffers in the momentum partition)."""
    out = []
    for bucket in (2 * 1024 * 1024, 1024 * 1024):
        for kind, depth in OVERLAP_DEPTHS.items():
            out.append(
                workload_config(f"sq1024-gas1-bucket{bucket // 1024}k-{kind}", "sq1024", 1, steps, warmup,
                                only="patched", reduce_bucket_size=bucket, patched={"pipeline_depth": depth}))
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


def launch(python, world_size, configs, workdir, timeout, log, prefix=()):
    """Run ``configs`` in one torchrun launch of ``world_size`` ranks under ``python``, the command
    preceded by ``prefix`` (e.g. ``ip netns exec NAME``: the launch inside a shaped namespace);
    relaunch after a crash or hang with the configs not yet run. Returns ``(rows, errors)``."""
    rows, errors = [], {}
    remaining = list(configs)
    while remaining:
        cfg_file = workdir / "configs.json"
        out_file = workdir / "rows.jsonl"
        cfg_file.write_text(json.dumps(remaining))
        out_file.write_text("")
        cmd = list(prefix) + [
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


def run_job(job, python, configs, tmp, out, timeout, log, samples, errors, prefix=()):
    """One launch ``job = (net, w, rep, build)``: the seed table at W=1, else the grid's configs
    for this build (``configs_for``) minus what already failed on this build, W and link; adds
    each row, tagged with its repeat and link, to ``samples`` and each failure to ``errors``,
    both keyed ``(net, build, w, name)``. Returns the launch's wall time in seconds (relaunches
    after a crash included)."""
    net, w, rep, build = job
    if w == 1:
        cfgs = seed_grid()
    else:
        cfgs = [c for c in configs_for(build, configs) if (net, build, w, c["name"]) not in errors]
    workdir = tmp / f"{build}-w{w}-r{rep}-{re.sub(r'[^A-Za-z0-9.]+', '_', net) or 'nolimit'}"
    workdir.mkdir()
    started = time.time()
    rows, errs = launch(python, w, cfgs, workdir, timeout, log, prefix)
    seconds = time.time() - started
    log.write(f"# {build} W={w} repeat {rep} {net or 'no network limit'}: {seconds:.1f} s\n")
    for row in rows:
        row["repeat"], row["net"] = rep, net
        err = row_error(row)
        if err:
            errs[row["name"]] = err
            continue
        samples.setdefault((net, build, w, row["name"]), []).append(row)
    for name, err in errs.items():
        errors[(net, build, w, name)] = err
    if w == 1:  # keep the weights for the gas=1 vs gas=4 comparison
        for c in cfgs:
            f = workdir / f"{c['name']}.pt"
            if f.exists():
                samples[(net, build, w, c["name"])][-1]["weights_file"] = str(out / f"{build}-{c['name']}.pt")
                os.replace(f, out / f"{build}-{c['name']}.pt")
    return seconds


def row_error(row):
    """Why a row cannot be used, or None: an AdamW config whose row counted Newton-Schulz calls
    ran Muon (a worker that does not know ``optimizer``), so its times are not AdamW's."""
    if row.get("optimizer") == "adamw" and row.get("ns_calls_per_step"):
        return "ran Muon, not AdamW: the worker ignores optimizer=adamw (NS calls counted)"
    return None


def with_step_time(row):
    """The row with ``step_time`` (seconds per optimizer step): the worker's if it writes one, else
    boundary micro-step + (gas - 1) x median non-boundary micro-step, and ``step_time_source``
    saying which."""
    row = dict(row)
    if row.get("step_time") is None and row.get("boundary_time") is not None:
        row["step_time"] = row["boundary_time"] + (row["gas"] - 1) * (row.get("micro_time") or 0.0)
        row["step_time_source"] = "boundary_time + (gas - 1) x micro_time"
    else:
        row["step_time_source"] = "worker"
    return row


def aggregate(samples):
    """One row from the repeats of one (link, build, W, workload): the first repeat's counts
    (they must agree across repeats), and for every timing and memory field its value per repeat
    (``<key>_per_repeat``, aligned with ``repeat_index``) and the median of those as ``<key>``
    (None when no repeat has it: a field the worker does not write)."""
    samples = sorted((with_step_time(s) for s in samples), key=lambda s: s["repeat"])
    first = dict(samples[0])
    first.pop("repeat", None)
    first["repeat_index"] = [s["repeat"] for s in samples]
    for key in TIMING_KEYS + MEMORY_KEYS:
        values = [s.get(key) for s in samples]
        first[key + "_per_repeat"] = values
        sp = spread(values)
        first[key] = sp.median if sp else None
    first["repeats"] = len(samples)
    return first


def muon_traffic(row):
    """Muon elements received per rank per optimizer step (mean over ranks), micro-steps included."""
    return row["muon_elements_boundary_mean"] + row["muon_elements_micro_mean"]


def is_muon(row):
    return row.get("optimizer", "muon") == "muon" and bool(row.get("muon_elements"))


def is_zero3(row):
    return row.get("stage", 3) == 3


def lower_bound(row):
    """2P(W-1)/W^2 elements for the row's P Muon elements (``model.lower_bound`` from the row's count)."""
    w = row["world_size"]
    return 2 * row["muon_elements"] * (w - 1) / w**2


def fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def fmt_spread(row, key, scale=1.0, spec="auto"):
    """``median [min-max]`` over the repeats of ``row[key]`` times ``scale``; ``-`` when absent."""
    sp = spread(per_repeat(row, key).values()) if row else None
    return sp.format(spec, scale) if sp else "-"


def fmt_ratio(sp: Spread, spec=".2f"):
    return sp.format(spec) if sp else "-"


def mib(x):
    return None if x is None else x / 2**20


def print_table(headers, rows):
    if not rows:
        print("(nothing measured)")
        return
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def net_jobs(nets, world_sizes, repeats, builds, seed):
    """Launch order ``[(net, w, rep, build), ...]``: per link and world size, the repeats, each
    repeat running every build once (interleaved); then the seed table at W=1 without a link."""
    jobs = [(net, w, rep, b) for net in nets for w in world_sizes for rep in range(repeats) for b in builds]
    if seed:
        jobs += [(NO_NET, 1, 0, b) for b in builds]
    return jobs


@contextlib.contextmanager
def no_namespace(_rate):
    yield ()


class Links:
    """The links of a run: ``NO_NET`` without ``--net``, else each ``--net`` value (``auto`` or a
    rate such as ``1gbit``), with the namespace module and the rate derivation loaded lazily (so
    a run without ``--net`` needs neither). ``unavailable`` holds why emulation cannot run (then
    every launch runs without a limit, under the ``NO_NET`` label)."""

    def __init__(self, specs):
        self.specs = list(specs or [])
        self.unavailable = None
        self.rates = {}  # (net, w) -> bits/s
        self.measured = {}  # (net, w) -> bits/s measured through the namespace
        self.derivations = {}  # w -> lines
        self.failures = {}  # (net, w) -> why the namespace failed
        if self.specs:
            import netns  # bench/netns.py
            self.netns = netns
            self.show = getattr(netns, "describe_rate", netns.format_rate)  # for people, if it has one
            self.unavailable = netns.unavailable_reason()

    @property
    def labels(self):
        return [NO_NET] if not self.specs or self.unavailable else self.specs

    def rate(self, net, w):
        """Link rate in bits/s of ``net`` at world size ``w`` (None without a link)."""
        if net == NO_NET:
            return None
        if (net, w) not in self.rates:
            if net == "auto":
                import link_rate  # bench/link_rate.py
                derivation = link_rate.derive(w)
                self.derivations[w] = list(derivation.lines())
                self.rates[(net, w)] = derivation.inter_node_rate_bits
            else:
                self.rates[(net, w)] = self.netns.parse_rate(net)
        return self.rates[(net, w)]

    def describe(self, net, w):
        """The link of ``net`` at ``w`` in words, from what the run found (no new measurement)."""
        if net == NO_NET:
            return "no network limit"
        rate = self.rates.get((net, w))
        if rate is None:
            return f"link {net}, not run" + (f", FAILED: {self.failures[(net, w)]}" if (net, w) in self.failures else "")
        text = f"link {self.show(rate)}" + (" (derived inter-node rate)" if net == "auto" else "")
        if (net, w) in self.measured:
            text += f", measured {self.show(self.measured[(net, w)])}"
        if (net, w) in self.failures:
            text += f", FAILED: {self.failures[(net, w)]}"
        return text

    @contextlib.contextmanager
    def namespace(self, net, w, say=print):
        """Command prefix of the launches of ``net`` at ``w``: a shaped namespace created here
        and removed on exit (its derivation and measured throughput printed once), or ``()``."""
        rate = self.rate(net, w)
        if rate is None:
            yield ()
            return
        with self.netns.shaped_namespace(rate) as prefix:
            if net == "auto":
                for line in self.derivations.get(w, []):
                    say(line)  # the lines name W themselves
            nbytes = probe_bytes(rate)
            self.measured[(net, w)] = self.netns.measure_throughput(prefix, nbytes)
            say(f"[W={w}] namespace shaped to {self.show(rate)}: measured "
                f"{self.show(self.measured[(net, w)])} ({nbytes / 2**20:.1f} MiB sent)")
            if hasattr(self.netns, "link_check"):
                say(f"[W={w}] {self.netns.link_check(rate, self.measured[(net, w)])}")
            yield list(prefix)


def probe_bytes(rate_bits):
    """Bytes of the throughput probe at ``rate_bits`` bits/s: about 1 s of traffic (tbf lets its
    bucket, 10 ms, through at once, so the probe must last much longer), 2 to 64 MiB."""
    return int(min(64 * 2**20, max(2 * 2**20, rate_bits / 8)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--python", action="append", default=[], metavar="BUILD=PATH",
                   help="a build's Python (dev.py bench passes patched-0.19.8 and stock-0.19.8; "
                   "with --all-bases 0.19.7's too)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--grid", choices=GRIDS, default="default",
                   help="workloads (with --net: the net grid, unless max-step-memory); memory: only the decoder12 rows "
                   "(ZeRO-3 Muon and AdamW memory, ZeRO-1/2 Muon traffic and NS calls, decoder12 Muon also with "
                   "max_step_memory \"momentum_partition\"), which default and full hold too; max-step-memory: only "
                   "sq1024 at gas 1 with the default max_step_memory and with \"momentum_partition\" (patched) and on "
                   "stock, with or without --net")
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved launches per build, world size and link (medians and min-max over them); "
                   "a launch of the default grid took 50 to 65 s at W=2 on 2 shared cores, so the default run "
                   "(2 builds x W 2, 4) takes about 20 to 25 min")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps per workload")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before measuring")
    p.add_argument("--net", nargs="+", metavar="RATE|auto",
                   help="run the net grid (sq1024, rect1024 at gas 1, sq1024 AdamW, sq1024 with max_step_memory "
                   "\"momentum_partition\" (patched); or --grid max-step-memory; patched-0.19.8 and stock-0.19.8) inside a network namespace shaped to each RATE (e.g. 1gbit); auto: the "
                   "inter-node rate bench/link_rate.py derives for each W")
    p.add_argument("--no-seed", action="store_true", help="skip the seed table")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlap comparison")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch before it counts as hung")
    p.add_argument("--out", default="out/bench")
    args = p.parse_args(argv)
    pythons = dict(item.split("=", 1) for item in args.python)
    builds = select_builds(pythons, args.net)
    if not builds:
        p.error("no build given: run `python3 dev.py bench`, or pass --python BUILD=PATH"
                + (f" (--net runs {' and '.join(NET_BUILDS)} only)" if args.net else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    links = Links(args.net)
    if links.unavailable:
        print(f"network emulation unavailable: {links.unavailable}; running the net grid without a network limit")
    configs = grid(args.grid if args.grid in NET_GRIDS or not args.net else "net", args.steps, args.warmup)
    extra = [] if (args.no_overlap or args.net) else overlap_grid(args.steps, args.warmup)
    seed = not (args.no_seed or args.net)
    jobs = net_jobs(links.labels, args.world_sizes, args.repeats, builds, seed)
    samples, errors = {}, {}
    durations = {}  # (net, w, build) -> seconds of each launch
    t0 = time.time()
    interrupted = False
    with open(out / "launches.log", "w") as log, tempfile.TemporaryDirectory() as tmp:
        try:
            bar = tqdm(total=len(jobs), desc="launches", unit="launch")
            groups = {}
            for job in jobs:
                groups.setdefault((job[0], job[1]), []).append(job)
            for (net, w), group in groups.items():
                done = 0
                try:
                    with links.namespace(net, w, say=tqdm.write) as prefix:
                        for job in group:
                            seconds = run_job(job, pythons[job[3]], configs + extra, Path(tmp), out, args.timeout,
                                              log, samples, errors, prefix)
                            durations.setdefault(job[:2] + job[3:], []).append(seconds)
                            done += 1
                            bar.update()
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # the namespace failed
                    links.failures[(net, w)] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                    tqdm.write(f"link {net} at W={w} failed, its remaining launches skipped: {links.failures[(net, w)]}")
                    bar.update(len(group) - done)
            bar.close()
        except KeyboardInterrupt:  # Ctrl-C: report what was measured so far
            interrupted = True
    elapsed = time.time() - t0
    results = {k: aggregate(v) for k, v in samples.items()}
    if interrupted:
        print(f"\ninterrupted after {elapsed / 60:.1f} min: the tables hold the launches that finished")
    report(results, errors, builds, args, configs, extra, out, elapsed, links, durations)
    failed_patched = [k for k in errors if k[1].startswith("patched")]
    return 1 if failed_patched else 0


def report(results, errors, builds, args, configs, extra, out, elapsed, links, durations):
    names = [c["name"] for c in configs + extra]
    print(f"\nZeRO-3 Muon benchmark: {len(builds)} builds ({', '.join(builds)}), W in {args.world_sizes}, "
          f"{args.repeats} interleaved repeats, {args.steps} measured steps after {args.warmup} warm-up; "
          f"{elapsed / 60:.1f} min")
    print("Launch wall time, s, median [min-max] over repeats: " + "; ".join(
        f"{'' if net == NO_NET else net + ' '}W={w} {build} {spread(v).format('.0f')}"
        for (net, w, build), v in durations.items()))
    if links.unavailable:
        print(f"Network: emulation unavailable ({links.unavailable}); ran WITHOUT a network limit")
    elif links.specs:
        print(f"Network: launches inside a namespace shaped to each of {', '.join(links.specs)} (one table per rate)")
    else:
        print("Network: none (no limit; gloo through shared memory on this machine)")
    print("Boundary-time targets are checked twice: on the whole boundary micro-step (forward + backward + "
          "step(): what a user waits for) and on step() at the boundary alone (where Muon's update and its "
          "traffic run on both builds; the micro-step also carries the parameter all-gathers, the same on both).\n")
    print("Per optimizer step and rank. NS: Newton-Schulz calls summed over ranks (micro: on non-boundary "
          "micro-steps). Muon recv: Muon elements received per rank (mean over ranks; micro-steps included), "
          "/bound: over 2P(W-1)/W^2 (ZeRO-3 rows). Times (ms): median [min-max] over repeats, slowest rank; boundary: the "
          "boundary micro-step, step(): engine.step() in it, step: the optimizer step (every micro-step). RSS: "
          "resident memory of the boundary micro-step above its start; tensor: peak live tensor bytes of step() "
          "at the boundary above its start plus retained (Muon buffers kept across steps); MiB, largest over "
          "ranks. Ratios: median [min-max] of the per-repeat ratios, repeat i paired with repeat i. '-': not "
          "measured (a field this worker does not write).\n")
    lines = []
    for net in links.labels:
        for w in args.world_sizes:
            print(f"=== W={w}, {links.describe(net, w)} ===")
            if net == "auto":
                for line in links.derivations.get(w, []):
                    print(line)
            print_results_table(results, errors, builds, net, w, names)
            print()
            print_ratio_table(results, builds, net, w, names)
            print()
            if print_memory_table(results, builds, net, w, names):
                print()
            if print_step_memory_table(results, builds, net, w, names):
                print()
            if print_zero12_table(results, builds, net, w, names):
                print()
            lines += target_lines(results, builds, net, w, names, links, errors)
    print("=== targets ===")
    for line in lines:
        print(line)
    print()
    if not args.net:
        print_model(results, builds, args.world_sizes)
    if extra:
        print_overlap(results, builds, args.world_sizes, extra)
    if not (args.no_seed or args.net):
        print_seed(results, errors, builds)
    write_outputs(results, errors, builds, args, out, links, lines, durations)


def print_results_table(results, errors, builds, net, w, names):
    table = []
    for name in names:
        for build in builds:
            key = (net, build, w, name)
            if key in errors:
                table.append([name, build, errors[key]] + [""] * 11)
                continue
            r = results.get(key)
            if r is None:
                continue
            muon = is_muon(r)
            table.append([
                name, build, f"{r['ns_calls_per_step']:.0f}/{r['muon_matrices']}", f"{r['ns_calls_micro_per_step']:.0f}",
                f"{muon_traffic(r) / r['muon_elements']:.3f} P" if muon else "-",
                f"{muon_traffic(r) / lower_bound(r):.3f}" if muon and is_zero3(r) else "-",
                fmt_spread(r, "boundary_time", 1e3), fmt_spread(r, "boundary_step_time", 1e3),
                fmt_spread(r, "step_time", 1e3), fmt_spread(r, "ns_seconds_per_step", 1e3),
                fmt(mib(r.get("boundary_peak_bytes")), ".1f"), fmt(mib(r.get("alloc_boundary_bytes")), ".1f"),
                fmt(mib(r.get("retained_muon_bytes")), ".1f"), fmt(mib(r.get("bucket_bound_bytes")), ".1f")
            ])
    print_table(["workload", "build", "NS/matrices", "NS micro", "Muon recv", "/bound", "boundary ms", "step() ms",
                 "step ms", "NS ms", "RSS MiB", "tensor MiB", "retained MiB", "bucket MiB"], table)


def print_memory_table(results, builds, net, w, names):
    """Muon against AdamW on the same model (ZeRO-3 workloads with an ``-adamw`` twin): the
    optimizer's memory kept between steps and at the peak of ``step()``, MiB, largest rank, median
    [min-max] over repeats, and the paired ratio. Returns whether anything was printed."""
    rows = []
    for build in builds:
        for name, muon, adamw in adamw_pairs(results, net, build, w, names):
            for opt, r in (("Muon", muon), ("AdamW", adamw)):
                rows.append([name, build, opt, fmt(mib(r.get("optimizer_state_bytes")), ".3f"),
                             fmt(mib(r.get("retained_muon_bytes")), ".3f"), fmt_spread(r, "kept_bytes", 2**-20, ".3f"),
                             fmt_spread(r, "alloc_peak_step_bytes", 2**-20, ".3f"),
                             fmt_spread(r, "step_peak_bytes", 2**-20, ".3f"), fmt(mib(r.get("alloc_live_bytes")), ".3f"),
                             fmt(mib(r.get("alloc_live_kept_bytes")), ".3f"),
                             "" if r is adamw else fmt_ratio(ratio_spread(muon, adamw, "kept_bytes"), ".3f"),
                             "" if r is adamw else fmt_ratio(ratio_spread(muon, adamw, "step_peak_bytes"), ".3f")])
            diff = {k: paired_differences(muon, adamw, k) for k in ("kept_bytes", "alloc_live_bytes", "alloc_live_kept_bytes")}
            if diff["alloc_live_bytes"]:
                rows.append([name, build, "Muon-AdamW", "", ""] +
                            [diff["kept_bytes"].format(".3f", 2**-20) if diff["kept_bytes"] else "-", "", ""] +
                            [diff[k].format(".3f", 2**-20) if diff[k] else "-"
                             for k in ("alloc_live_bytes", "alloc_live_kept_bytes")] + ["", ""])
    if not rows:
        return False
    print(f"Optimizer memory, Muon vs AdamW on the same model, W={w} (MiB, largest rank; state: tensors of the "
          "optimizer state, by introspection; buffers: the exchange buffers (patched) or all-gather cache (stock) "
          "kept across steps; kept = state + buffers; step() = allocator peak of engine.step() above its start; "
          "peak = kept + step(); live: allocator bytes allocated in initialize and in the warm-up steps' step() and "
          "live at their end, while a Python tensor object uses them; kept then: kept at that moment, by introspection; "
          "Muon-AdamW: differences over paired repeats, live against kept then: what the allocator sees beyond the "
          "introspection):")
    print_table(["workload", "build", "optimizer", "state", "buffers", "kept", "step()", "peak", "live", "kept then",
                 "kept ratio", "peak ratio"], rows)
    return True


def strict_pairs(results, net, build, w, names):
    """``(name, default row, strict row)`` of every Muon workload of ``names`` whose strict variant
    (``name + STRICT_SUFFIX``, ``max_step_memory: "momentum_partition"``) ran on ``build`` too."""
    out = []
    for name in names:
        default, strict = results.get((net, build, w, name)), results.get((net, build, w, name + STRICT_SUFFIX))
        if default and strict and is_muon(default):
            out.append((name, default, strict))
    return out


def muon_bytes(row):
    """Muon bytes received per rank per optimizer step, mean over ranks (micro-steps included): what
    crosses each rank's link, by the worker's traffic counters."""
    return row.get("muon_bytes_boundary_mean", 0.0) + row.get("muon_bytes_micro_mean", 0.0)


def muon_bytes_max(row):
    """Muon bytes received per optimizer step by the busiest rank (micro-steps included)."""
    return row.get("muon_bytes_boundary_max", 0.0) + row.get("muon_bytes_micro_max", 0.0)


def plan_setting(row, key):
    """``boundary_settings[key]`` of a row (the patch's plan as it ran: ``muon_buckets``,
    ``pipeline_depth``, ...), None where the worker recorded none (stock, AdamW)."""
    return (row.get("boundary_settings") or {}).get(key)


def print_step_memory_table(results, builds, net, w, names):
    """``max_step_memory``, the default against ``"momentum_partition"`` (the strict rule), per
    patched build and workload with a strict variant, side by side with the same workload on stock
    0.19.8 and with AdamW where those ran: the plan (buckets, pipeline depth, the planned peak of
    Muon's step per rank), Muon bytes received per rank per step (mean over ranks and busiest: per
    link), the boundary micro-step and its ``step()`` (ms, median [min-max] over repeats), the
    optimizer memory kept between steps and at the peak of ``step()`` (MiB, largest rank, median
    [min-max]); then the paired ratios default / strict. Returns whether anything was printed."""
    rows, ratios = [], []
    for build in builds:
        if not build.startswith("patched"):
            continue
        for name, default, strict in strict_pairs(results, net, build, w, names):
            stock = results.get((net, REFERENCE, w, name))
            adamw = results.get((net, build, w, name + "-adamw"))
            for label, where, r in (("default", build, default), (STRICT_VALUE, build, strict),
                                    ("(stock)", REFERENCE, stock), ("AdamW", build, adamw)):
                if r is None:
                    continue
                muon = is_muon(r)
                rows.append([name, where, label, fmt(plan_setting(r, "muon_buckets"), ".0f"),
                             fmt(plan_setting(r, "pipeline_depth"), ".0f"),
                             fmt(mib(plan_setting(r, "plan_peak_bytes")), ".2f"),
                             f"{muon_bytes(r):.0f}" if muon else "-", f"{muon_bytes_max(r):.0f}" if muon else "-",
                             f"{muon_traffic(r) / lower_bound(r):.3f}" if muon and is_zero3(r) else "-",
                             fmt_spread(r, "boundary_time", 1e3), fmt_spread(r, "boundary_step_time", 1e3),
                             fmt_spread(r, "kept_bytes", 2**-20, ".3f"),
                             fmt_spread(r, "step_peak_bytes", 2**-20, ".3f")])
            ratios.append([name, build, fmt_ratio(ratio_spread(default, strict, "boundary_step_time")),
                           fmt_ratio(ratio_spread(default, strict, "boundary_time")),
                           fmt_ratio(ratio_spread(default, strict, "step_time")),
                           f"{muon_bytes(default) / muon_bytes(strict):.3f}" if muon_bytes(strict) else "-",
                           f"{fmt(plan_setting(default, 'muon_buckets'), '.0f')} / "
                           f"{fmt(plan_setting(strict, 'muon_buckets'), '.0f')}",
                           fmt_ratio(ratio_spread(default, strict, "kept_bytes"), ".3f"),
                           fmt_ratio(ratio_spread(default, strict, "step_peak_bytes"), ".3f")])
    if not rows:
        return False
    print(f"max_step_memory at W={w}: the default (a byte cap: buckets in which every owner computes at once) against "
          f"\"{STRICT_VALUE}\" (the strict rule: buckets within each rank's momentum partition), patched build, "
          "with the same workload on stock and with AdamW where they ran. Plan: buckets, pipeline depth and planned "
          "peak of Muon's step per rank (MiB) as the patch's Muon update ran them; Muon bytes received per rank per "
          "step (mean over ranks, busiest; what crosses a rank's link), /bound: Muon elements over 2P(W-1)/W^2; "
          "times ms, memory MiB (largest rank; kept: optimizer state + buffers kept between steps; peak: kept + "
          "step()'s allocator peak above its start), median [min-max] over repeats:")
    print_table(["workload", "build", "max_step_memory", "buckets", "depth", "plan peak", "Muon bytes/rank",
                 "busiest", "/bound", "boundary ms", "step() ms", "kept MiB", "peak MiB"], rows)
    print(f"default / \"{STRICT_VALUE}\" at W={w}, median [min-max] of the per-repeat ratios (repeat i with repeat i, "
          "both in the same launch):")
    print_table(["workload", "build", "step() at boundary", "boundary time", "step time", "Muon bytes/rank",
                 "buckets", "kept", "peak"], ratios)
    return True


def step_memory_lines(results, builds, net, w, names, rate_text=""):
    """Information lines (no target): per patched build and workload with a strict variant, the
    boundary ``step()`` time default / strict (paired repeats), the Muon bytes per rank of both,
    the buckets of both, and the kept and peak optimizer memory of both."""
    out = []
    for build in builds:
        for name, default, strict in strict_pairs(results, net, build, w, names):
            sp = ratio_spread(default, strict, "boundary_step_time")
            both = lambda f: f"{f(default)} vs {f(strict)}"  # noqa: E731
            out.append(f"  info max_step_memory default / \"{STRICT_VALUE}\" {build} {name} W={w}{rate_text}: "
                       f"boundary step() time {sp.format('.2f') if sp else '-'}"
                       f"{f' over {sp.n} repeats' if sp else ''} "
                       f"({both(lambda r: fmt_spread(r, 'boundary_step_time', 1e3, '.0f'))} ms); "
                       f"Muon bytes per rank per step {both(lambda r: f'{muon_bytes(r):.0f}')}; "
                       f"buckets {both(lambda r: fmt(plan_setting(r, 'muon_buckets'), '.0f'))}, depth "
                       f"{both(lambda r: fmt(plan_setting(r, 'pipeline_depth'), '.0f'))}; kept "
                       f"{both(lambda r: fmt(mib(r.get('kept_bytes')), '.3f'))} MiB, peak of step() "
                       f"{both(lambda r: fmt(mib(r.get('step_peak_bytes')), '.3f'))} MiB")
    return out


def paired_differences(numerator_row, denominator_row, key):
    """Median and min-max of ``numerator_row[key] - denominator_row[key]`` over paired repeats."""
    a, b = per_repeat(numerator_row, key), per_repeat(denominator_row, key)
    return spread([a[i] - b[i] for i in sorted(set(a) & set(b))])


def print_zero12_table(results, builds, net, w, names):
    """ZeRO-1/2 Muon rows: Muon elements received per rank per step (mean, busiest, by collective),
    summed over ranks, against the model and the straddling matrices; NS calls per step summed over
    ranks; the other traffic (gradient reduction, parameter all-gathers) for comparison. Returns
    whether anything was printed."""
    rows = []
    for name, build, r in zero12_rows(results, builds, net, w, names):
        patched, shapes = build.startswith("patched"), MODEL_SHAPES.get(r["workload"])
        predicted = ns_model = None
        if shapes:
            if patched:
                predicted = sum(model.zero12_traffic(shapes, w))
            elif r.get("offload"):
                predicted = model.stock_zero12_offload_traffic(shapes, w) * w
            ns_model = model.zero12_ns_calls(shapes, w, r.get("offload"), "patched" if patched else "stock")
        collectives = ", ".join(f"{c} {v:.0f}" for c, v in (r.get("muon_elements_by_collective") or {}).items()) or "-"
        rows.append([name, build, f"{fmt(r.get('muon_straddling_matrices'), '.0f')} / "
                     f"{fmt(r.get('muon_straddling_elements'), '.0f')}", f"{muon_traffic(r):.0f}",
                     f"{r['muon_elements_boundary_max'] + r['muon_elements_micro_max']:.0f}",
                     f"{zero12_summed_traffic(r):.0f}", fmt(predicted, ".0f"), collectives,
                     f"{r['ns_calls_per_step']:.0f}/{r['muon_matrices']}", fmt(ns_model, ".0f"),
                     f"{r['ns_calls_micro_per_step']:.0f}",
                     f"{r.get('other_elements_boundary_mean', 0) + r.get('other_elements_micro_mean', 0):.0f}",
                     fmt_spread(r, "step_time", 1e3), fmt(mib(r.get("kept_bytes")), ".2f")])
    if not rows:
        return False
    print(f"ZeRO-1/2 Muon at W={w}, per optimizer step: straddling = Muon matrices crossing a partition boundary / "
          "their elements; Muon recv per rank (mean, busiest) and summed over ranks, model = bench/model.py's "
          "prediction of the sum (patched: owner exchange + one flag per group; stock offload: the all-gathers); "
          "by collective: per rank mean; NS summed over ranks / matrices (model), micro: on non-boundary "
          "micro-steps; other: the rest of the traffic per rank (gradient reduction, parameter all-gathers); "
          "step ms; kept: optimizer state + Muon buffers, MiB, largest rank")
    print_table(["workload", "build", "straddling", "Muon recv mean", "busiest", "summed", "model", "by collective",
                 "NS/matrices", "NS model", "NS micro", "other recv", "step ms", "kept MiB"], rows)
    ratio_rows = []
    for name, build, r in zero12_rows(results, builds, net, w, names):
        ref = results.get((net, REFERENCE, w, reference_name(name)))
        if build.startswith("patched") and ref:
            ratio_rows.append([name, build, f"{muon_traffic(r) / muon_traffic(ref):.4f}" if muon_traffic(ref) else "-",
                               f"{r['ns_calls_per_step'] / ref['ns_calls_per_step']:.2f}" if ref["ns_calls_per_step"]
                               else "-", fmt_ratio(ratio_spread(r, ref, "step_time"))])
    if ratio_rows:
        print(f"ZeRO-1/2 patched / {REFERENCE} at W={w}:")
        print_table(["workload", "build", "Muon recv", "NS calls", "step time"], ratio_rows)
    return True


def print_ratio_table(results, builds, net, w, names):
    rows = []
    for name in names:
        ref = results.get((net, REFERENCE, w, reference_name(name)))  # a strict variant against stock's default
        for build in builds:
            r = results.get((net, build, w, name))
            if not build.startswith("patched") or r is None or ref is None:
                continue
            rows.append([
                name, build,
                f"{muon_traffic(r) / muon_traffic(ref):.3f}" if is_muon(r) and muon_traffic(ref) else "-",
                f"{r['ns_calls_per_step'] / ref['ns_calls_per_step']:.2f}" if ref["ns_calls_per_step"] else "-",
                fmt_ratio(ratio_spread(r, ref, "boundary_time")), fmt_ratio(ratio_spread(r, ref, "boundary_step_time")),
                fmt_ratio(ratio_spread(r, ref, "step_time")), fmt_ratio(ratio_spread(r, ref, "boundary_peak_bytes")),
                fmt_ratio(ratio_spread(r, ref, "alloc_boundary_bytes"))
            ])
    print(f"Ratios patched / {REFERENCE} at W={w}:")
    print_table(["workload", "build", "Muon recv", "NS calls", "boundary time", "step() at boundary", "step time",
                 "RSS peak", "tensor peak"], rows)


def worst_ratio(results, net, build, w, names, key):
    """``(name, Spread)`` of the workload with the largest median paired ratio build / stock
    0.19.8 of ``key`` among ``names``, or None when no workload has both."""
    pairs = []
    for name in names:
        sp = ratio_spread(results.get((net, build, w, name)), results.get((net, REFERENCE, w, name)), key)
        if sp is not None:
            pairs.append((sp.median, name, sp))
    if not pairs:
        return None
    _, name, sp = max(pairs)
    return name, sp


def boundary_reason(results, net, build, w, name, sp):
    """What was measured on the workload that decided a boundary-time target: both medians, the
    range of the per-repeat ratios, and which part of the micro-step is slower (step() or
    forward + backward)."""
    r, ref = results[(net, build, w, name)], results[(net, REFERENCE, w, name)]

    def fwd_bwd(row):
        t, s = per_repeat(row, "boundary_time"), per_repeat(row, "boundary_step_time")
        return {i: t[i] - s[i] for i in t if i in s}

    step = ratio_spread(r, ref, "boundary_step_time")
    fb = spread(
        [a / b for a, b in ((fwd_bwd(r)[i], fwd_bwd(ref)[i]) for i in set(fwd_bwd(r)) & set(fwd_bwd(ref))) if b > 0])
    return (f"worst {name}: {r['boundary_time'] * 1e3:.0f} ms vs {ref['boundary_time'] * 1e3:.0f} ms, per-repeat "
            f"ratios {sp.low:.2f}-{sp.high:.2f} over {sp.n}; step() ratio {fmt(step and step.median, '.2f')}, "
            f"forward+backward ratio {fmt(fb and fb.median, '.2f')}")


def target_lines(results, builds, net, w, names, links, errors=None):
    """The target lines (and information lines) of one link and world size, for every patched
    build present, against stock 0.19.8 (``errors``: why a workload has no row, for reasons)."""
    out = []
    rate_text = "" if net == NO_NET else f" link {links.describe(net, w).split(',')[0].replace('link ', '')}"
    # the ZeRO-3 targets; the ZeRO-1/2 rows have their own (zero12_lines)
    muon_names = [
        n for n in names
        if any(is_muon(r) and is_zero3(r) for (nt, b, ww, nn), r in results.items() if nt == net and ww == w and nn == n)
    ]
    for build in builds:
        if not build.startswith("patched"):
            continue
        mine = {n: results.get((net, build, w, n)) for n in names}
        mine = {n: r for n, r in mine.items() if r and is_zero3(r)}
        if not mine:
            continue
        pair = f"{build}/{REFERENCE}"
        # boundary micro-step time
        if net == NO_NET:
            limit, scope, wl_names = BOUNDARY_TARGET_NO_LIMIT, "every Muon workload", muon_names
        else:
            limit, scope = (BOUNDARY_TARGET_NET.get(w) if net == "auto" else None), "1024 workloads"
            wl_names = [n for n in muon_names if n.startswith(("sq1024", "rect1024"))]
        # The boundary micro-step (forward, backward, step()) is what a user sees; step() at the
        # boundary is where Muon's exchange runs (stock's all-gathers too), so on a link both are
        # targets (the micro-step also carries the parameter all-gathers, the same on both builds).
        for key, what in (("boundary_time", "boundary micro-step time"),
                          ("boundary_step_time", "optimizer step() time at the boundary")):
            worst = worst_ratio(results, net, build, w, wl_names, key)
            name = f"{what} {pair} W={w}{rate_text} {scope} (median of repeats)"
            if limit is not None:
                out.append(target_line(f"{name} <= {limit}", worst and worst[1].median,
                                       worst is not None and worst[1].median <= limit,
                                       boundary_reason(results, net, build, w, *worst) if worst else "not measured"))
            elif worst:
                out.append(f"  info {name}: worst {worst[1].format('.2f')} ({worst[0]})")
        out += memory_lines(results, net, build, w, muon_names, mine, pair, rate_text)
        if net == NO_NET:
            out += batch_ns_lines(results, net, build, w, names, errors)
            out += traffic_lines(mine, build, w)
    out += kept_memory_lines(results, builds, net, w, names, rate_text)
    out += step_memory_lines(results, builds, net, w, names, rate_text)
    if net == NO_NET:
        out += zero12_lines(results, builds, net, w, names)
    return out + muon_adamw_lines(results, builds, net, w, rate_text)


def target_with_figures(name, value, met, figures, spec=".2f"):
    """``target_line`` with the figures behind it in parentheses whether met or MISSED."""
    line = target_line(name, value, met, figures, spec=spec)
    return f"{line} ({figures})" if met and value is not None else line


def adamw_pairs(results, net, build, w, names):
    """``(name, Muon row, AdamW row)`` of every ZeRO-3 Muon workload of ``names`` whose
    ``-adamw`` twin ran on ``build`` too (a strict variant's: its default's, ``reference_name``)."""
    out = []
    for name in names:
        muon, adamw = results.get((net, build, w, name)), results.get((net, build, w, reference_name(name) + "-adamw"))
        if muon and adamw and is_muon(muon) and is_zero3(muon):
            out.append((name, muon, adamw))
    return out


def kept_memory_lines(results, builds, net, w, names, rate_text=""):
    """The memory targets against AdamW, per build (patched and stock) and Muon workload with an
    AdamW twin: the optimizer's memory kept between steps (``kept_bytes``: state plus the buffers
    kept across steps) and at the peak of ``step()`` (``step_peak_bytes``), Muon / AdamW on the
    same model, median of the per-repeat ratios (range in the reason), each <= 1. A ratio nobody
    measured is MISSED."""
    out = []
    for build in builds:
        for name, muon, adamw in adamw_pairs(results, net, build, w, names):
            for key, limit, what in (("kept_bytes", KEPT_TARGET, "optimizer memory kept between steps"),
                                     ("step_peak_bytes", PEAK_TARGET, "optimizer memory at the peak of step()")):
                sp = ratio_spread(muon, adamw, key)
                reason = (f"Muon {fmt(mib(muon.get(key)), '.2f')} MiB vs AdamW {fmt(mib(adamw.get(key)), '.2f')} MiB; "
                          f"Muon: state {fmt(mib(muon.get('optimizer_state_bytes')), '.2f')} + buffers "
                          f"{fmt(mib(muon.get('retained_muon_bytes')), '.2f')}"
                          + (f" + step() above its start {fmt(mib(muon.get('alloc_peak_step_bytes')), '.2f')}"
                             if key == "step_peak_bytes" else "")
                          + f" MiB; per-repeat ratios {sp.low:.3f}-{sp.high:.3f} over {sp.n}" if sp else
                          "not measured: no " + key + " in both rows")
                if key == "step_peak_bytes" and sp and "patched" in build and name.split("-")[0] in MODEL_SHAPES:
                    floor = 4 * model.zero3_owner_floor_numel(MODEL_SHAPES[name.split("-")[0]], w)
                    momentum = muon.get("optimizer_state_bytes") or 0
                    reason += (f"; floor on this model: the largest matrix's owner needs {mib(floor):.2f} MiB of "
                               f"buffers and Newton-Schulz working set against a momentum partition of "
                               f"{mib(momentum):.2f} MiB" + (" (cannot be met here)" if floor > momentum else ""))
                out.append(target_with_figures(f"{what} Muon/AdamW {build} {name} W={w}{rate_text} <= {limit:g}",
                                               sp.median if sp else None, sp is not None and sp.median <= limit, reason,
                                               spec=".3f"))
    return out


def zero12_rows(results, builds, net, w, names):
    """``(name, build, row)`` of the ZeRO-1/2 Muon rows."""
    return [(n, b, results[(net, b, w, n)]) for n in names for b in builds
            if (net, b, w, n) in results and not is_zero3(results[(net, b, w, n)]) and is_muon(results[(net, b, w, n)])]


def zero12_summed_traffic(row):
    """Muon elements received per optimizer step, summed over ranks (micro-steps included)."""
    return muon_traffic(row) * row["world_size"]


def zero12_lines(results, builds, net, w, names):
    """ZeRO-1/2 Muon, per patched build and row (with and without offload): the elements the owner
    exchange (all-to-all) delivers per step summed over ranks at most twice the elements of the
    straddling matrices (each goes to one of its holders and back; the one flag per group
    all-reduced beside it is in the detail's total), NS calls per step summed over ranks equal to
    the Muon matrices, and the optimizer memory kept between steps (``kept_bytes``) at most stock
    0.19.8's on the same row. Information lines: the stock rows."""
    out = []
    for name, build, r in zero12_rows(results, builds, net, w, names):
        where = f"{build} {name} W={w}"
        summed, straddle = zero12_summed_traffic(r), r.get("muon_straddling_elements")
        ns, matrices = r["ns_calls_per_step"], r["muon_matrices"]
        detail = (f"Muon recv {summed:.0f} elements per step summed over ranks (per rank mean "
                  f"{muon_traffic(r):.0f}, busiest {r['muon_elements_boundary_max'] + r['muon_elements_micro_max']:.0f}); "
                  f"straddling {fmt(r.get('muon_straddling_matrices'), '.0f')} matrices, {fmt(straddle, '.0f')} "
                  f"elements; NS {ns:.0f} per step for {matrices} matrices; kept {fmt(mib(r.get('kept_bytes')), '.2f')} MiB")
        if not build.startswith("patched"):
            out.append(f"  info {where}: {detail}")
            continue
        exchanged = (r.get("muon_elements_by_collective") or {}).get("all_to_all_single", 0.0) * r["world_size"]
        if straddle is None:
            value = None
        else:
            value = exchanged / (2 * straddle) if straddle else (0.0 if exchanged == 0 else math.inf)
        out.append(target_with_figures(f"ZeRO-1/2 Muon exchange (all-to-all) recv summed over ranks / (2 x "
                                       f"straddling elements) {where} <= {ZERO12_TRAFFIC_TARGET:g}", value,
                                       value is not None and value <= ZERO12_TRAFFIC_TARGET,
                                       f"exchange {exchanged:.0f} elements; {detail}", spec=".3f"))
        out.append(target_line(f"ZeRO-1/2 NS calls per step summed over ranks {where} = Muon matrices ({matrices})", ns,
                               ns == matrices and not r["ns_calls_micro_per_step"], detail, spec=".0f"))
        ref = results.get((net, REFERENCE, w, reference_name(name)))
        kept = ref and r.get("kept_bytes") is not None and ref.get("kept_bytes")
        value = r["kept_bytes"] / ref["kept_bytes"] if kept else None
        reason = (f"{mib(r['kept_bytes']):.2f} vs {mib(ref['kept_bytes']):.2f} MiB" if kept else
                  f"not measured: no {REFERENCE} row with kept_bytes")
        out.append(target_line(f"ZeRO-1/2 optimizer memory kept between steps {build}/{REFERENCE} {name} W={w} <= "
                               f"{ZERO12_KEPT_TARGET:g}", value, value is not None and value <= ZERO12_KEPT_TARGET,
                               reason, spec=".3f"))
    return out


def memory_lines(results, net, build, w, muon_names, mine, pair, rate_text):
    """Boundary peak tensor memory (``alloc_boundary_bytes``): at most stock 0.19.8's (worst
    workload's median ratio), and at most ``MEMORY_TARGET_BUCKETS`` x the largest bucket's
    exchange bytes (``bucket_bound_bytes``) on every patched Muon workload."""
    out = []
    worst = worst_ratio(results, net, build, w, muon_names, "alloc_boundary_bytes")
    reason = "not measured: no workload with alloc_boundary_bytes on both builds"
    if worst:
        r, ref = results[(net, build, w, worst[0])], results[(net, REFERENCE, w, worst[0])]
        reason = (f"worst {worst[0]}: {mib(r['alloc_boundary_bytes']):.1f} MiB vs {mib(ref['alloc_boundary_bytes']):.1f} "
                  f"MiB, retained {fmt(mib(r.get('retained_muon_bytes')), '.1f')} vs "
                  f"{fmt(mib(ref.get('retained_muon_bytes')), '.1f')} MiB")
    out.append(target_line(f"boundary peak tensor memory {pair} W={w}{rate_text} every Muon workload <= 1.0",
                           worst and worst[1].median, worst is not None and worst[1].median <= 1.0, reason))
    per_bucket = [(r["alloc_boundary_bytes"] / r["bucket_bound_bytes"], n) for n, r in mine.items()
                  if is_muon(r) and r.get("alloc_boundary_bytes") is not None and r.get("bucket_bound_bytes")]
    reason = "not measured: rows lack alloc_boundary_bytes or bucket_bound_bytes"
    if per_bucket:
        value, n = max(per_bucket)
        reason = (f"worst {n}: {mib(mine[n]['alloc_boundary_bytes']):.1f} MiB against "
                  f"{mib(mine[n]['bucket_bound_bytes']):.1f} MiB of exchange")
    out.append(target_line(f"boundary peak tensor memory / largest bucket's exchange bytes {build} W={w}{rate_text} "
                           f"<= {MEMORY_TARGET_BUCKETS:g}", max(per_bucket)[0] if per_bucket else None,
                           bool(per_bucket) and max(per_bucket)[0] <= MEMORY_TARGET_BUCKETS, reason))
    return out


def batch_ns_lines(results, net, build, w, names=(), errors=None):
    """Batched NS on the Llama-shaped workload: NS time per step over one-by-one's (paired
    repeats), and the same results (relative difference of the last loss). Printed when either
    row exists or the grid (``names``) has them; a missing row is MISSED, with its error."""
    llama = BATCH_NS_PAIR
    batched, single = (results.get((net, build, w, n)) for n in llama)
    if batched is None and single is None and not any(n in names for n in llama):
        return []
    failed = [f"{n}: {(errors or {}).get((net, build, w, n), 'no row')}" for n in llama
              if results.get((net, build, w, n)) is None]
    sp = ratio_spread(batched, single, "ns_seconds_per_step")
    reason = "not measured: " + ("; ".join(failed) if failed else "no ns_seconds_per_step in both rows")
    if sp:
        reason = (f"NS {batched['ns_seconds_per_step'] * 1e3:.0f} ms vs {single['ns_seconds_per_step'] * 1e3:.0f} ms "
                  f"per step, per-repeat ratios {sp.low:.2f}-{sp.high:.2f}; kernel calls per step "
                  f"{fmt(batched.get('ns_kernel_calls_per_step'), '.0f')} vs "
                  f"{fmt(single.get('ns_kernel_calls_per_step'), '.0f')}")
    out = [target_line(f"batched NS time per step / one-by-one {build} llama-gas4 W={w} <= {BATCH_NS_TARGET}",
                       sp and sp.median, sp is not None and sp.median <= BATCH_NS_TARGET, reason)]
    step = ratio_spread(batched, single, "step_time")
    if step:
        out.append(f"  info optimizer step time batched / one-by-one {build} llama-gas4 W={w}: {step.format('.2f')}")
    small = ratio_spread(*(results.get((net, build, w, n)) for n in SMALL_BATCH_NS_PAIR), "ns_seconds_per_step")
    if small:
        out.append(f"  info batched NS time per step / one-by-one {build} llama64-gas4 W={w} (64-wide, batched by "
                   f"default on the CPU): {small.format('.2f')}")
    diff = None
    if batched and single and batched.get("loss_last") is not None and single.get("loss_last") is not None:
        diff = abs(batched["loss_last"] - single["loss_last"]) / max(abs(single["loss_last"]), 1e-30)
    out.append(
        target_line(f"batched NS same results as one-by-one {build} llama-gas4 W={w} (relative loss difference) "
                    f"<= {SAME_RESULTS_TOLERANCE:g}", diff, diff is not None and diff <= SAME_RESULTS_TOLERANCE,
                    reason if failed else "not measured: no loss_last" if diff is None else
                    f"last loss {batched['loss_last']:.9g} vs {single['loss_last']:.9g}", spec=".1e"))
    return out


def muon_adamw_lines(results, builds, net, w, rate_text):
    """Optimizer step time Muon / AdamW per build (no target): paired repeats of each workload of
    ``MUON_ADAMW`` and its ``-adamw`` twin."""
    out = []
    for name in MUON_ADAMW:
        parts = []
        for build in builds:
            sp = ratio_spread(results.get((net, build, w, name)), results.get((net, build, w, name + "-adamw")),
                              "step_time")
            if sp:
                parts.append(f"{build} {sp.format('.2f')}")
        if parts and any(b.startswith("patched") for b in builds):
            out.append(f"info step time Muon/AdamW {name} W={w}{rate_text}: {', '.join(parts)}")
    return out


def traffic_lines(mine, build, w):
    """The count targets: Muon traffic per rank within 10% of 2P(W-1)/W^2 (mean over ranks and
    busiest rank), NS once per matrix per step and never on a micro-step, Muon cost flat in gas."""
    muon = {n: r for n, r in mine.items() if is_muon(r)}
    if not muon:
        return []
    out = []
    worst = max((abs(muon_traffic(r) / lower_bound(r) - 1), n) for n, r in muon.items())
    out.append(target_line(f"Muon recv per rank off 2P(W-1)/W^2 (mean over ranks) {build} W={w} <= {TRAFFIC_TARGET}",
                           worst[0], worst[0] <= TRAFFIC_TARGET, f"worst {worst[1]}", spec=".4f"))
    worst = max((abs((r["muon_elements_boundary_max"] + r["muon_elements_micro_max"]) / lower_bound(r) - 1), n)
                for n, r in muon.items())
    out.append(target_line(f"Muon recv per rank off 2P(W-1)/W^2 (busiest rank) {build} W={w} <= {TRAFFIC_TARGET}",
                           worst[0], worst[0] <= TRAFFIC_TARGET, f"worst {worst[1]}", spec=".4f"))
    bad = [n for n, r in muon.items() if r["ns_calls_per_step"] != r["muon_matrices"] or r["ns_calls_micro_per_step"]]
    out.append(target_line(f"workloads with NS calls per step != Muon matrices or NS on micro-steps {build} W={w} "
                           f"(of {len(muon)}) = 0", len(bad), not bad, ", ".join(bad), spec=".0f"))
    for wl in SHAPES:
        g1, g16 = muon.get(f"{wl}-gas1-fp32"), muon.get(f"{wl}-gas16-fp32")
        if g1 and g16:
            flat = muon_traffic(g16) == muon_traffic(g1) and g16["ns_calls_per_step"] == g1["ns_calls_per_step"]
            out.append(target_line(f"Muon recv gas16/gas1 {wl} {build} W={w} (and NS calls equal) = 1", muon_traffic(g16) /
                                   muon_traffic(g1), flat, f"NS calls gas16/gas1 "
                                   f"{g16['ns_calls_per_step'] / g1['ns_calls_per_step']:.2f}", spec=".3f"))
    return out


def print_model(results, builds, world_sizes):
    print("=== model check: measured Muon recv per rank / bench/model.py (ZeRO-3, fp32, gas 4 (decoder12: 2), "
          "no offload) ===")
    rows = []
    checked = {f"{wl}-gas4-fp32": shapes for wl, shapes in SHAPES.items()}
    checked.update({"llama-gas4-fp32": LLAMA, "decoder12-gas2-fp32": DECODER12})
    for w in world_sizes:
        for name, shapes in checked.items():
            for build, predict in (("patched-0.19.8", lambda: sum(model.patched_traffic(shapes, w)) / w),
                                   ("patched-0.19.7", lambda: sum(model.patched_traffic(shapes, w)) / w),
                                   ("stock-0.19.8", lambda: model.stock_0198_traffic(shapes, w))):
                r = results.get((NO_NET, build, w, name))
                if r:
                    rows.append([w, name.split("-")[0], build, f"{muon_traffic(r):.0f}", f"{predict():.0f}",
                                 f"{muon_traffic(r) / predict():.4f}"])
    print_table(["W", "workload", "build", "measured", "model", "ratio"], rows)
    print()
    print("=== model: Llama-2 7B projections (224 Muon matrices, P = 6.48e9), default reduce_bucket_size ===")
    print("traffic: Muon elements received per rank per step / P; NS work: busiest rank's share of all NS work; "
          "kept/AdamW: the patch's momentum + exchange buffers over AdamW's two moments on the same partition "
          "(pipeline_depth 2), largest over ranks")
    rows = [[r["world_size"], f"{r['bound']:.4g}", f"{r['patched_mean']:.4g}", f"{r['patched_max']:.4g}",
             f"{r['stock_0198']:.4g}", f"{r['stock_0198'] / r['patched_max']:.1f}", f"{r['ns_patched_max']:.4g}",
             f"{r['ns_stock_max']:.4g}", "1", f"{r['kept_over_adamw_max']:.3f}"]
            for r in model.summary(model.LLAMA_7B, MODEL_WS)]
    print_table(["W", "bound", "patched mean", "patched max", "stock 0.19.8", "stock/patched max", "NS patched",
                 "NS stock", "NS stock offload", "kept/AdamW"], rows)
    print()


def print_overlap(results, builds, world_sizes, extra):
    print("=== overlap: pipeline_depth 2 (the next bucket's exchange in flight while the owner orthogonalizes) "
          "against 1 (serial) ===")
    rows = []
    for w in world_sizes:
        for build in builds:
            if not build.startswith("patched"):
                continue
            for c in extra:
                if not c["name"].endswith("-overlap"):
                    continue
                on = results.get((NO_NET, build, w, c["name"]))
                off = results.get((NO_NET, build, w, c["name"][:-len("overlap")] + "serial"))
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
            g1, g4 = (results.get((NO_NET, build, 1, f"seed-stage{stage}-gas{g}")) for g in (1, 4))
            err = (errors.get((NO_NET, build, 1, f"seed-stage{stage}-gas1"))
                   or errors.get((NO_NET, build, 1, f"seed-stage{stage}-gas4")))
            if err or not (g1 and g4):
                rows.append([build, stage, err or "missing", "", ""])
                continue
            diff = relative_difference(torch.load(g4["weights_file"]), torch.load(g1["weights_file"]))
            g1["rel_diff_gas1_gas4"] = g4["rel_diff_gas1_gas4"] = diff
            rows.append([build, stage, f"{g1['ns_calls_per_step'] * 3:.0f} / {g4['ns_calls_per_step'] * 3:.0f}",
                         f"{diff:.1e}", "ok" if diff < 1e-5 else "WRONG"])
    print_table(["build", "stage", "NS calls gas1 / gas4 (3 steps)", "gas1 vs gas4", ""], rows)
    print()


def write_outputs(results, errors, builds, args, out, links, lines, durations):
    data = dict(builds=builds,
                world_sizes=args.world_sizes,
                repeats=args.repeats,
                nets=links.labels,
                net_unavailable=links.unavailable,
                net_rates={f"{net}|{w}": rate for (net, w), rate in links.rates.items()},
                net_measured={f"{net}|{w}": rate for (net, w), rate in links.measured.items()},
                rows=[dict(v, build=k[1], net=k[0], net_rate_bits=links.rates.get((k[0], k[2])))
                      for k, v in results.items()],
                errors=[dict(net=k[0], build=k[1], world_size=k[2], name=k[3], error=e) for k, e in errors.items()],
                targets=lines,
                launch_seconds=[dict(net=k[0], world_size=k[1], build=k[2], seconds=v) for k, v in durations.items()],
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
