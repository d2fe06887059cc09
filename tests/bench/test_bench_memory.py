# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's allocator-level memory of the boundary step (``bench/worker.py``).

``profiled_peaks`` is checked on allocations of known sizes: a free counts only for a block the
profiler saw allocated (frees of older blocks are invisible to it), including one allocated
before the measured region. ``live_bytes`` counts a block only while a tensor object uses it: one
freed on another thread (where the profiler records no free) is not counted, the buffers a kept
collective's work object holds are. Then the worker runs the ``tiny`` workload at W=2 and its memory
fields must be present and consistent: ``engine.step()`` on the boundary micro-step must show at
least the full fp32 gradient of the largest matrix (the Newton-Schulz input every build
materializes there; 0 if the profiler's events were missed), the whole micro-step at least as
much, ``alloc_boundary_bytes`` must add the retained bytes, ``kept_bytes`` the optimizer state
and ``step_peak_bytes`` the step's peak. On the patched build the state is the fp32 momentum
partition, no exchange buffer is retained between steps (they are allocated per step), the plan
the worker records is the one ``bench/model.py`` predicts (default ``pipeline_depth`` 2 and, set by
the config key, 1; ``max_step_memory`` at its default and ``"momentum_partition"``), and the
allocator's count of what ``initialize`` and the steps left alive differs from AdamW's by exactly
the introspected difference. On stock DeepSpeed 0.19.8 (when its venv exists)
``retained_muon_bytes`` must equal what its all-gather cache holds for one bucket: a local buffer
of the rank's partitions and a receive buffer W times as large.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import model  # noqa: E402
from deepspeed.runtime.zero.muon import owner_plan  # noqa: E402
from muon_testing.compare import free_port  # noqa: E402

TINY = [(36, 20), (20, 36), (36, 20)]  # bench/worker.py's "tiny" workload
STOCK_PYTHON = pathlib.Path(
    os.environ.get("ZERO3MUON_STOCK_PYTHON", ROOT / ".venv" / "stock-0.19.8" / "bin" / "python"))
MIB = 1 << 20


def test_profiled_peaks_counts_known_frees_only():
    import worker
    from torch.profiler import ProfilerActivity, profile, record_function
    before = torch.empty(MIB // 4)  # 1 MiB, allocated before profiling: its free is not recorded
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        early = torch.empty(MIB // 2)  # 2 MiB, recorded, freed inside the region
        with record_function("region"):
            del early  # -2 MiB
            a = torch.empty(3 * MIB // 4)  # +1 MiB above the start
            del before  # not recorded: no change
            b = torch.empty(MIB // 4)  # +2 MiB: the peak
            del a, b
            with record_function("inner"):
                c = torch.empty(MIB // 8)  # +0.5 MiB above the inner region's start
                del c
    peaks = worker.profiled_peaks(prof, ("region", "inner"))
    assert peaks == {"region": 2 * MIB, "inner": MIB // 2}
    with pytest.raises(KeyError):
        worker.profiled_peaks(prof, ("absent", ))


def test_live_bytes_counts_held_blocks_only():
    """A block whose last reference another thread drops is freed there without a profiler event
    (the profiler records frees on the threads it profiles, as with a collective backend's worker
    thread); ``live_bytes`` must not count it, and must count the blocks Python still holds,
    including the buffers a kept collective work object still holds from C++."""
    import threading
    import worker
    import torch.distributed as tdist
    from torch.profiler import ProfilerActivity, profile, record_function
    own_group = not tdist.is_initialized()
    if own_group:
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
            with record_function("region"):
                kept = torch.empty(MIB // 4)  # 1 MiB, held to the end
                handed = [torch.empty(MIB // 2)]  # 2 MiB, freed by the other thread
                freed = torch.empty(MIB // 8)  # 0.5 MiB, freed on this thread
                del freed
                sent, received = torch.ones(MIB // 16), torch.empty(MIB // 16)  # 0.25 MiB each
                work = tdist.all_to_all_single(received, sent, async_op=True)
                work.wait()
                del sent, received  # held by the work object alone, which is kept: a leak to count
            outside = torch.empty(MIB // 16)  # outside the region: never counted
            thread = threading.Thread(target=handed.clear)
            thread.start()
            thread.join()
            held = worker.held_cpu_blocks()
        assert handed == [] and kept.untyped_storage().data_ptr() in held
        assert worker.live_bytes(prof, ("region", ), held) == MIB + MIB // 2
        # every block taken as held: the other thread's free has no event, the premise of the filter

        class Everything:

            def __contains__(self, ptr):
                return True

        assert worker.live_bytes(prof, ("region", ), Everything()) == 3 * MIB + MIB // 2
        del kept, outside, work
    finally:
        if own_group:
            tdist.destroy_process_group()


def tiny(**extra):
    return dict(dict(name="tiny", workload="tiny", stage=3, gas=2, dtype="fp32", offload=False, micro_batch=1, steps=1,
                     warmup=1), **extra)


def run_worker(python, tmp_path, world_size=2, configs=None):
    """The rows of one worker launch (the default: ``tiny`` alone, returned as one row)."""
    (tmp_path / "c.json").write_text(json.dumps(configs or [tiny()]))
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([
        str(python), "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", f"--master_port={free_port()}",
        str(ROOT / "bench" / "worker.py"), "--configs",
        str(tmp_path / "c.json"), "--out",
        str(out)
    ],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return rows if configs else rows[0]


def check_memory_fields(row):
    largest_grad = 4 * max(math.prod(s) for s in TINY)  # fp32
    for key in ("alloc_peak_bytes", "alloc_peak_step_bytes", "retained_muon_bytes", "alloc_boundary_bytes",
                "optimizer_state_bytes", "kept_bytes", "step_peak_bytes"):
        assert isinstance(row[key], int) and row[key] >= 0, (key, row[key])
    if row["optimizer"] == "muon":
        assert row["alloc_peak_step_bytes"] >= largest_grad, row
    assert row["alloc_peak_bytes"] >= row["alloc_peak_step_bytes"], row
    assert row["alloc_boundary_bytes"] == row["alloc_peak_step_bytes"] + row["retained_muon_bytes"]
    assert row["kept_bytes"] == row["optimizer_state_bytes"] + row["retained_muon_bytes"]
    assert row["step_peak_bytes"] == row["kept_bytes"] + row["alloc_peak_step_bytes"]


def test_memory_fields_patched(tmp_path):
    world_size = 2
    muon, serial, strict, adamw = run_worker(sys.executable, tmp_path, world_size, [
        tiny(lifetime_memory=True),
        tiny(name="tiny-depth1", pipeline_depth=1, batch_ns=False),
        tiny(name="tiny-strict", max_step_memory="momentum_partition"),
        tiny(name="tiny-adamw", optimizer="adamw", lifetime_memory=True)
    ])
    for row in (muon, serial, strict, adamw):
        check_memory_fields(row)
    assert muon["optimizer"] == "muon" and muon["ns_calls_per_step"] == muon["ns_kernel_calls_per_step"] == len(TINY)
    assert muon["ns_seconds_per_step"] > 0
    assert muon["boundary_settings"]["pipeline_depth"] == model.zero3_depth(TINY, world_size, depth=2)
    assert muon["boundary_settings"]["batch_ns"] is None
    assert serial["boundary_settings"]["pipeline_depth"] == 1 and serial["boundary_settings"]["batch_ns"] is False
    # max_step_memory as the config sets it: the plan (buckets, depth) owner_plan makes for that value
    specs, pieces = model.specs_for(model.muon_order(TINY)), model.zero3_pieces(TINY, world_size)
    for row, value in ((muon, owner_plan.DEFAULT_MAX_STEP_MEMORY), (strict, "momentum_partition")):
        plan, depth = owner_plan.plan_partition(specs, pieces, world_size, value, model.DEFAULT_BUCKET, 2)
        assert row.get("max_step_memory") == (None if row is muon else value)
        assert (row["boundary_settings"]["muon_buckets"], row["boundary_settings"]["pipeline_depth"]) == \
            (len(plan.buckets), depth)
        assert row["boundary_settings"]["plan_peak_bytes"] > 0
    # the fp32 momentum partition; no exchange buffer kept between steps (allocated per step)
    momentum = 4 * sum(math.ceil(math.prod(s) / world_size) for s in TINY)
    for row in (muon, serial, strict):
        assert row["optimizer_state_bytes"] == momentum and row["retained_muon_bytes"] == 0
        assert row["kept_bytes"] == momentum
    assert adamw["retained_muon_bytes"] == 0 and adamw["optimizer_state_bytes"] >= 2 * momentum
    # the allocator: what initialize and the steps left alive, Muon against AdamW, is the introspected
    # difference, up to a few scalar tensors that live outside the state (norms, 8 bytes each)
    live = muon["alloc_live_bytes"] - adamw["alloc_live_bytes"]
    kept = muon["alloc_live_kept_bytes"] - adamw["alloc_live_kept_bytes"]
    assert abs(live - kept) <= 256, (live, kept)
    assert muon["alloc_live_kept_bytes"] == muon["kept_bytes"]  # the patch keeps the same from the first step on


@pytest.mark.skipif(not STOCK_PYTHON.exists(), reason=f"no stock DeepSpeed venv at {STOCK_PYTHON} "
                    "(set ZERO3MUON_STOCK_PYTHON)")
def test_memory_fields_stock_count_the_allgather_cache(tmp_path):
    world_size = 2
    row = run_worker(STOCK_PYTHON, tmp_path, world_size)
    check_memory_fields(row)
    # all three matrices in one bucket: the gradients and then the momenta go through one
    # cached (local, receive) pair, fp32
    local = sum(math.ceil(math.prod(s) / world_size) for s in TINY)
    assert row["retained_muon_bytes"] == 4 * (local + world_size * local)
    assert row["optimizer_state_bytes"] == 4 * local  # its momentum partition, fp32 in an fp32 run
