# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``examples/demo/compare_variants.py --quick`` end to end: Muon, Polar Express and NorMuon train
the demo's model at ZeRO-3 on 2 ranks, and each variant reaches the optimizer.

Every run starts from the same weights and samples, so the first loss is the same in all three;
after that the curves must differ, else a variant's key was dropped on the way to the optimizer
(the engine keeps only the keys it knows). The runs' own records say which Newton-Schulz kernel ran.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo" / "compare_variants.py"


@pytest.mark.slow
def test_compare_variants_quick(tmp_path):
    steps = 4
    proc = subprocess.run([
        sys.executable,
        str(SCRIPT), "--quick", "--steps",
        str(steps), "--tail", "2", "--no-plot", "--out",
        str(tmp_path)
    ],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] == []
    runs = summary["runs"]
    assert sorted(runs) == ["muon-seed1234", "normuon-seed1234", "polar-express-seed1234"]
    losses = {name: run["losses"] for name, run in runs.items()}
    for name, curve in losses.items():
        assert len(curve) == steps and all(math.isfinite(x) for x in curve), name
    # same start, then each variant's own trajectory
    first = {curve[0] for curve in losses.values()}
    assert max(first) - min(first) < 1e-6, losses
    assert len({round(curve[-1], 6) for curve in losses.values()}) == 3, losses
    kernels = {name: run["ns_calls_by_kernel"] for name, run in runs.items()}
    assert kernels["polar-express-seed1234"].get("zeropower_via_polar_express", 0) > 0, kernels
    assert kernels["muon-seed1234"].get("zeropower_via_gram_newtonschulz", 0) > 0, kernels
    assert kernels["normuon-seed1234"].get("zeropower_via_gram_newtonschulz", 0) > 0, kernels
    for row in summary["tail_loss"].values():
        assert row["min"] <= row["mean"] <= row["max"]
    assert "minus Muon's" in proc.stdout
