# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The main job still runs: ``examples/demo/run_demo.py --quick`` end to end (2 ranks, 3 runs).

Checks the demo's own verdicts (ZeRO-3 gas=4 vs gas=1 and vs ZeRO-2 gas=4, within its stated
tolerance, with DeepSpeed's default gradient_clipping 1.0, which every run reports) and what it
reports: the "gram" Newton-Schulz kernel computed in fp32 in every run, and the line saying so
(the demo pins fp32 on CPUs whose oneDNN has fp16, where upstream would pick fp16; its tolerance
assumes fp32); one Newton-Schulz call per Muon matrix per step at ZeRO-3; and, on the patched build,
Muon traffic per rank per step equal to the owner-centric bound 2P(W-1)/W^2 (at W=2 every rank
receives exactly P/2 whatever the owner plan, so equality is exact).
"""

import json
import pathlib
import subprocess
import sys

import pytest

DEMO = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo" / "run_demo.py"


@pytest.mark.slow
def test_demo_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(DEMO), "--quick", "--no-plot", "--out", str(tmp_path)],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] == []
    assert [v["pair"] for v in summary["check"]] == ["zero3-gas4 vs zero3-gas1", "zero3-gas4 vs zero2-gas4"]
    assert all(v["ok"] and v["enforced"] for v in summary["check"]), summary["check"]
    for name, run in summary["runs"].items():
        assert run["gradient_clipping"] == 1.0, name
        assert len(run["grad_norms"]) == run["steps"] and all(n > 0 for n in run["grad_norms"]), name
    assert summary["ns_compute_dtype"] == "float32"
    assert 'Newton-Schulz ("gram" kernel) computed in float32 in every run' in proc.stdout
    for name, run in summary["runs"].items():
        assert run["ns_compute_dtype"] == "float32", name
        assert run["ns_calls_by_kernel"]["zeropower_via_newtonschulz5"] == 0, name
        assert run["ns_calls_by_kernel"]["zeropower_via_gram_newtonschulz"] > 0, name
    for name in ("zero3-gas4", "zero3-gas1"):
        run = summary["runs"][name]
        assert run["ns_calls_per_step"] == run["muon_matrices"] > 0
        assert run["elements_received_per_rank_per_step"] == summary["owner_centric_bound"]
