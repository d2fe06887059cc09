# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``examples/demo/qk_clip_logits.py --quick`` end to end: Muon and MuonClip train the demo's model at ZeRO-3 on 2
ranks, the key reaches the clip, and the clip binds.

Both runs start from the same weights and samples, so the first step's largest logit is the same; at a threshold
below it the clipped run clips heads every step and keeps every later step's largest logit below the unclipped
run's, whose never-reached threshold clips nothing.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo" / "qk_clip_logits.py"


@pytest.mark.slow
def test_qk_clip_logits_quick(tmp_path):
    steps = 4
    proc = subprocess.run([
        sys.executable,
        str(SCRIPT), "--quick", "--steps",
        str(steps), "--threshold", "0.02", "--every", "1", "--tail", "2", "--no-plot", "--out",
        str(tmp_path)
    ],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] == [] and sorted(summary["runs"]) == ["muon", "muonclip"]
    muon, clipped = summary["runs"]["muon"], summary["runs"]["muonclip"]
    for run in (muon, clipped):
        assert len(run["max_logits"]) == steps and all(math.isfinite(x) for x in run["max_logits"])
    assert abs(muon["max_logits"][0] - clipped["max_logits"][0]) <= 1e-6 * muon["max_logits"][0]
    assert muon["max_logits"][0] > 0.02, "the threshold must bind at the first step"
    assert sum(muon["heads_clipped"]) == 0 and all(n > 0 for n in clipped["heads_clipped"])
    assert all(c < m for c, m in zip(clipped["max_logits"][1:], muon["max_logits"][1:]))
