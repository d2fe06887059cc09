# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's instruments agree with the traffic model and with the patch's own counters.

``bench/worker.py`` counts what every collective of DeepSpeed's communication layer delivers to
a rank and attributes it to Muon by call stack; ``bench/model.py`` predicts the owner-centric
traffic from the patch's own owner plan (``plan_within_budget``). On the patched build, at W=2 and
W=3 with matrices whose sizes W does not divide (so the plan and the padding matter), the counted
Muon traffic per rank must equal the model's exactly (the exchange's two all-to-alls: no flag
travels at ZeRO-3), the patch's ``ExchangeStats`` must equal it, Newton-Schulz must run once per
matrix per step and nothing Muon may cross ranks on a non-boundary micro-step. At ZeRO-2 with
optimizer offload, W=2, only the matrix that straddles the partition boundary travels (plus one
flag per group), as the model predicts, and NS runs once per matrix. The model mirrors a few of
the patch's constants and its parameter order; those are checked against the installed build.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import model  # noqa: E402
from muon_testing.compare import free_port  # noqa: E402

TINY = [(36, 20), (20, 36), (36, 20)]  # bench/worker.py's "tiny" workload


def run_worker(tmp_path, world_size, configs):
    (tmp_path / "c.json").write_text(json.dumps(configs))
    proc = subprocess.run([
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", f"--master_port={free_port()}",
        str(ROOT / "bench" / "worker.py"), "--configs",
        str(tmp_path / "c.json"), "--out",
        str(tmp_path / "rows.jsonl")
    ],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_counted_traffic_equals_model(tmp_path, world_size):
    configs = [dict(name="tiny", workload="tiny", stage=3, gas=3, dtype="fp32", offload=False, micro_batch=1, steps=2,
                    warmup=1)]
    row, = run_worker(tmp_path, world_size, configs)
    assert row["muon_matrices"] == len(TINY) and row["muon_elements"] == sum(math.prod(s) for s in TINY)
    assert row["ns_calls_per_step"] == len(TINY) and row["ns_calls_micro_per_step"] == 0
    assert row["muon_elements_micro_max"] == 0
    predicted = model.patched_traffic(TINY, world_size)
    assert row["muon_elements_boundary_mean"] == pytest.approx(sum(predicted) / world_size, rel=1e-12)
    assert row["muon_elements_boundary_max"] == pytest.approx(max(predicted), rel=1e-12)
    assert set(row["muon_elements_by_collective"]) <= {"all_to_all_single"}
    # ExchangeStats (rank 0, cumulative over warm-up and measured steps) counts the same all-to-alls
    stats = row["muon_stats"]
    assert stats["optimizer_steps"] == 3
    assert stats["elements_received"] == pytest.approx(3 * predicted[0], rel=1e-12)
    assert row["boundary_settings"]["muon_buckets"] == len(model.zero3_plan(TINY, world_size).buckets)


def test_zero2_moves_only_the_straddling_matrix(tmp_path):
    """With and without optimizer offload alike: only the straddling matrix travels, there and back,
    and Newton-Schulz runs once per matrix summed over ranks."""
    world_size = 2
    assert model.straddling(TINY, world_size) == (1, 720)  # sorted (36, 20), (36, 20), (20, 36): the second
    configs = [dict(name=f"tiny-zero2{'-offload' if offload else ''}", workload="tiny", stage=2, gas=2, dtype="fp32",
                    offload=offload, micro_batch=1, steps=2, warmup=1) for offload in (True, False)]
    rows = run_worker(tmp_path, world_size, configs)
    assert [row["offload"] for row in rows] == [True, False]
    for row in rows:
        assert (row["muon_straddling_matrices"], row["muon_straddling_elements"]) == (1, 720)
        assert row["muon_elements_micro_max"] == 0 and row["ns_calls_micro_per_step"] == 0
        predicted = model.zero12_traffic(TINY, world_size)
        assert row["muon_elements_boundary_mean"] == pytest.approx(sum(predicted) / world_size, rel=1e-12)
        assert row["muon_elements_boundary_max"] == pytest.approx(max(predicted), rel=1e-12)
        assert row["ns_calls_per_step"] == model.zero12_ns_calls(TINY, world_size, row["offload"]) == len(TINY)
        exchanged = row["muon_elements_by_collective"]["all_to_all_single"] * world_size
        assert 0 < exchanged <= 2 * 720


def test_model_mirrors_the_patch():
    """``bench/model.py`` restates the pipeline's slot count and default depth (that module
    imports torch) and the order of a Muon group; here against the installed build."""
    import torch
    from deepspeed.runtime.zero.muon import pipeline
    from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam
    import run_bench
    import worker
    assert model.DEFAULT_DEPTH == pipeline.DEFAULT_DEPTH
    assert all(model.slots_for_depth(d) == pipeline.slots_for_depth(d) for d in (1, 2, 3, 5))
    shapes = worker.decoder_shapes("decoder12") + [(20, 36), (36, 20)]
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    group, = MuonWithAuxAdam([dict(params=params, use_muon=True)]).param_groups
    assert [tuple(p.shape) for p in group["params"]] == model.muon_order(shapes)
    assert run_bench.DECODER12 == worker.decoder_shapes("decoder12")
    llama = worker.LLAMAS["llama"]
    h, f = llama["hidden"], llama["intermediate"]
    assert run_bench.LLAMA == ([(h, h)] * 4 + [(f, h)] * 2 + [(h, f)]) * llama["layers"]
