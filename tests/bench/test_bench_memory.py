# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's allocator-level memory of the boundary step (``bench/worker.py``).

``profiled_peaks`` is checked on allocations of known sizes: a free counts only for a block the
profiler saw allocated (frees of older blocks are invisible to it), including one allocated
before the measured region. Then the worker runs the ``tiny`` workload at W=2 and its memory
fields must be present and consistent: ``engine.step()`` on the boundary micro-step must show at
least the full fp32 gradient of the largest matrix (the Newton-Schulz input every build
materializes there; 0 if the profiler's events were missed), the whole micro-step at least as
much, and ``alloc_boundary_bytes`` must add the retained bytes. On stock DeepSpeed 0.19.8 (when its
venv exists) ``retained_muon_bytes`` must equal what its all-gather cache holds for one bucket:
a local buffer of the rank's partitions and a receive buffer W times as large.
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
from unit.runtime.zero.zero3_muon_helpers import free_port  # noqa: E402

TINY = [(36, 20), (20, 36), (36, 20)]  # bench/worker.py's "tiny" workload
STOCK_PYTHON = pathlib.Path(
    os.environ.get("ZERO3MUON_STOCK_PYTHON", pathlib.Path("/work/main/.venv/stock-0.19.8/bin/python")))
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


def run_worker(python, tmp_path, world_size=2):
    configs = [dict(name="tiny", workload="tiny", stage=3, gas=2, dtype="fp32", offload=False, micro_batch=1, steps=1,
                    warmup=1)]
    (tmp_path / "c.json").write_text(json.dumps(configs))
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
    return json.loads(out.read_text())


def check_memory_fields(row):
    largest_grad = 4 * max(math.prod(s) for s in TINY)  # fp32
    for key in ("alloc_peak_bytes", "alloc_peak_step_bytes", "retained_muon_bytes", "alloc_boundary_bytes"):
        assert isinstance(row[key], int) and row[key] >= 0, (key, row[key])
    assert row["alloc_peak_step_bytes"] >= largest_grad, row
    assert row["alloc_peak_bytes"] >= row["alloc_peak_step_bytes"], row
    assert row["alloc_boundary_bytes"] == row["alloc_peak_step_bytes"] + row["retained_muon_bytes"]


def test_memory_fields_patched(tmp_path):
    row = run_worker(sys.executable, tmp_path)
    check_memory_fields(row)
    assert row["optimizer"] == "muon" and row["ns_calls_per_step"] == row["ns_kernel_calls_per_step"] == len(TINY) and row["ns_seconds_per_step"] > 0
    assert row["boundary_settings"]["overlap"] is True  # the patch's default


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
