# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Plots of the benchmark (matplotlib): Muon traffic per rank against W, and step time against gas.

``make_all(results, out)`` takes the dict ``run_bench.py`` writes to ``results.json`` and writes
``traffic_vs_w.png`` and ``time_vs_gas.png`` to ``out``; ``python bench/plots.py results.json
OUT_DIR`` redraws them from a saved run.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model  # noqa: E402

STYLE = {
    "stock-0.19.7": dict(color="tab:red", marker="v"),
    "stock-0.19.8": dict(color="tab:orange", marker="s"),
    "patched-0.19.7": dict(color="tab:cyan", marker="^"),
    "patched-0.19.8": dict(color="tab:blue", marker="o"),
}
MODEL_WS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def _measured(rows, build, name):
    return sorted((r["world_size"], r) for r in rows if r["build"] == build and r["name"] == name)


def traffic_vs_w(results, path):
    """Model curves for Llama-2 7B's projections (W 2..1024) and the measured points of every
    fp32 gas=4 workload, as Muon elements received per rank per optimizer step over P."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = model.summary(model.LLAMA_7B, MODEL_WS)
    ws = [r["world_size"] for r in rows]
    ax.plot(ws, [r["stock_0198"] for r in rows], color="tab:orange", label="model: stock 0.19.8 (Llama-2 7B)")
    ax.plot(ws, [r["patched_max"] for r in rows], color="tab:blue", ls="--",
            label="model: patched, busiest rank (Llama-2 7B)")
    ax.plot(ws, [r["patched_mean"] for r in rows], color="tab:blue", label="model: patched, mean over ranks")
    ax.plot(ws, [r["bound"] for r in rows], color="k", ls=":", label="bound 2(W-1)/W^2")
    for build in results["builds"]:
        for name in sorted({r["name"] for r in results["rows"] if r["name"].endswith("-gas4-fp32")}):
            pts = _measured(results["rows"], build, name)
            if not pts:
                continue
            traffic = [(r["muon_elements_boundary_mean"] + r["muon_elements_micro_mean"]) / r["muon_elements"]
                       for _, r in pts]
            ax.scatter([w for w, _ in pts], traffic, s=22, alpha=0.8, **STYLE.get(build, {}),
                       label=f"measured: {build}" if name.startswith("sq256") else None)
    ax.set(xscale="log", yscale="log", xlabel="ranks W", ylabel="Muon elements received per rank per step / P",
           title="Muon traffic per rank and optimizer step")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_vs_gas(results, path):
    """Optimizer-step time (boundary micro-step plus gas-1 non-boundary micro-steps, medians) per
    build against gas, for the fp32 workloads measured at gas 1, 4 and 16, at the smallest W."""
    rows = results["rows"]
    w = min(results["world_sizes"])
    workloads = sorted({r["workload"] for r in rows if r["world_size"] == w and r["gas"] == 16})
    if not workloads:
        return False
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 3.6), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        for build in results["builds"]:
            pts = sorted((r["gas"], r) for r in rows
                         if r["build"] == build and r["world_size"] == w and r["workload"] == wl and r["dtype"] == "fp32"
                         and not r["offload"] and r.get("reduce_bucket_size") is None)
            if not pts:
                continue
            ax.plot([g for g, _ in pts], [r["boundary_time"] + (g - 1) * (r["micro_time"] or 0) for g, r in pts],
                    label=build, **STYLE.get(build, {}))
        ax.set(xscale="log", yscale="log", xlabel="gradient_accumulation_steps", title=f"{wl}, W={w}")
        ax.set_xticks([1, 4, 16], labels=["1", "4", "16"])
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("optimizer step time, s")
    for ax in axes[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def make_all(results, out):
    out = Path(out)
    written = [out / "traffic_vs_w.png"]
    traffic_vs_w(results, written[0])
    if time_vs_gas(results, out / "time_vs_gas.png"):
        written.append(out / "time_vs_gas.png")
    return written


if __name__ == "__main__":
    for f in make_all(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]):
        print(f"wrote {f}")
