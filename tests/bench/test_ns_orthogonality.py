# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``bench/ns_orthogonality.py``: its tables have one row per iteration count and a column pair per
method, its metrics measure what they say, and on small Llama-shaped matrices they show what the
user guide states (fp32: Polar Express's per-row distance from orthonormal below the quintic's
from 5 iterations, and its singular values on the decaying input within 1e-4 of 1 after 8, where
the quintic's stay 0.3 away)."""

import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import ns_orthogonality  # noqa: E402


def test_metrics():
    q, _ = torch.linalg.qr(torch.randn(12, 5, dtype=torch.float64))
    assert max(ns_orthogonality.errors(q.T)) < 1e-12 and max(ns_orthogonality.errors(q)) < 1e-12
    worst, rms = ns_orthogonality.errors(2 * q.T)  # every singular value 2: |1 - 2|, |4 - 1|
    assert abs(worst - 1) < 1e-12 and abs(rms - 3) < 1e-12


def test_tables_on_small_llama_shapes(capsys):
    shapes = ns_orthogonality.llama_shapes(24, 64)
    table, dtypes = ns_orthogonality.measure(shapes, 8, fp32=True)
    assert set(table) == {(i, c) for i in ("gaussian", "decaying") for c in ("square", "rectangular")}
    assert all(d == torch.float32 for d in dtypes.values())
    for (name, cls), rows in table.items():
        polar, quintic = rows["polar_express"], rows["standard"]
        for steps in range(5, 9):
            assert polar[steps - 1][1] < quintic[steps - 1][1], (name, cls, steps)
    decaying = table[("decaying", "rectangular")]
    assert decaying["polar_express"][7][0] < 1e-4 and decaying["standard"][7][0] > 0.25
    ns_orthogonality.main(["--hidden", "24", "--intermediate", "64", "--max-steps", "3", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.count("== input: ") == 8
    assert "polar_express (float32)" in out and "  max|1-s|" in out
    assert [line.split()[0] for line in out.splitlines() if line[:5].strip().isdigit()] == ["1", "2", "3"] * 8
