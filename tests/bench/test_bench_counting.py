# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's instruments agree with the traffic model and with the patch's own counters.

``bench/worker.py`` counts what every collective of DeepSpeed's communication layer delivers to
a rank and attributes it to Muon by call stack; ``bench/model.py`` predicts the owner-centric
traffic from the owner plan. On the patched build, at W=2 and W=3 with matrices whose sizes W
does not divide (so the plan and the padding matter), the counted Muon traffic per rank must
equal the model's exactly (the exchange's two all-to-alls plus the one-flag-per-matrix
all-reduce), the patch's ``ExchangeStats`` must equal the all-to-all part, Newton-Schulz must run
once per matrix per step and nothing Muon may cross ranks on a non-boundary micro-step.
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
from unit.runtime.zero.zero3_muon_helpers import free_port  # noqa: E402

TINY = [(36, 20), (20, 36), (36, 20)]  # bench/worker.py's "tiny" workload


@pytest.mark.parametrize("world_size", [2, 3])
def test_counted_traffic_equals_model(tmp_path, world_size):
    configs = [dict(name="tiny", workload="tiny", stage=3, gas=3, dtype="fp32", offload=False, micro_batch=1, steps=2,
                    warmup=1)]
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
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    assert row["muon_matrices"] == len(TINY) and row["muon_elements"] == sum(math.prod(s) for s in TINY)
    assert row["ns_calls_per_step"] == len(TINY) and row["ns_calls_micro_per_step"] == 0
    assert row["muon_elements_micro_max"] == 0
    predicted = model.patched_traffic(TINY, world_size)
    assert row["muon_elements_boundary_mean"] == pytest.approx(sum(predicted) / world_size, rel=1e-12)
    assert row["muon_elements_boundary_max"] == pytest.approx(max(predicted), rel=1e-12)
    # ExchangeStats (rank 0, cumulative over warm-up and measured steps) counts the all-to-alls only
    flags = 2 * (world_size - 1) * len(TINY) / world_size
    stats = row["muon_stats"]
    assert stats["optimizer_steps"] == 3
    assert stats["elements_received"] == pytest.approx(3 * (predicted[0] - flags), rel=1e-12)
