# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Plots of the benchmark (matplotlib): Muon traffic per rank against W, step time against gas,
the boundary-time ratio patched / stock 0.19.8 against W, and boundary time against link rate.

``make_all(results, out)`` takes the dict ``run_bench.py`` writes to ``results.json`` and writes
``traffic_vs_w.png``, ``time_vs_gas.png`` (runs without a network limit), ``ratio_vs_w.png`` and,
when the run had ``--net`` links, ``time_vs_rate.png`` to ``out``; ``python bench/plots.py
results.json OUT_DIR`` redraws them from a saved run.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model  # noqa: E402
from repeats import per_repeat, ratio_spread, spread  # noqa: E402

STYLE = {
    "stock-0.19.7": dict(color="tab:red", marker="v"),
    "stock-0.19.8": dict(color="tab:orange", marker="s"),
    "patched-0.19.7": dict(color="tab:cyan", marker="^"),
    "patched-0.19.8": dict(color="tab:blue", marker="o"),
}
MODEL_WS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
REFERENCE = "stock-0.19.8"


def _no_limit(rows):
    """The rows measured without a network limit (all rows of a run before ``--net`` existed)."""
    return [r for r in rows if not r.get("net")]


def _measured(rows, build, name):
    return sorted(((r["world_size"], r) for r in _no_limit(rows) if r["build"] == build and r["name"] == name),
                  key=lambda p: p[0])


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
    _save(fig, path)


def time_vs_gas(results, path):
    """Optimizer-step time (boundary micro-step plus gas-1 non-boundary micro-steps, medians) per
    build against gas, for the fp32 workloads measured at gas 1, 4 and 16, at the smallest W."""
    rows = _no_limit(results["rows"])
    w = min(results["world_sizes"])
    workloads = sorted({r["workload"] for r in rows if r["world_size"] == w and r["gas"] == 16})
    if not workloads:
        return False
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 3.6), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        for build in results["builds"]:
            pts = sorted(((r["gas"], r) for r in rows
                         if r["build"] == build and r["world_size"] == w and r["workload"] == wl and r["dtype"] == "fp32"
                         and not r["offload"] and r.get("reduce_bucket_size") is None
                          and r.get("optimizer", "muon") == "muon" and r.get("batch_ns") is not False
                          and r.get("stage", 3) == 3),
                         key=lambda p: p[0])
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
    _save(fig, path)
    return True


def _errorbar(ax, xs, spreads, scale=1.0, **kw):
    """Median with min-max error bars (``repeats.Spread`` per x)."""
    ax.errorbar(xs, [s.median * scale for s in spreads],
                yerr=[[(s.median - s.low) * scale for s in spreads], [(s.high - s.median) * scale for s in spreads]],
                capsize=3, **kw)


def _net_label(net):
    return "no network limit" if not net else f"link {net}"


def ratio_vs_w(results, path):
    """Boundary micro-step time patched / stock 0.19.8 against W, one panel per link (no limit
    first) and per patched build's line per ZeRO-3 Muon workload: median of the per-repeat ratios, error
    bars min-max (repeat i paired with repeat i). Returns False when no workload has both builds."""
    rows = results["rows"]
    nets = [n for n in results.get("nets", [""])]
    panels = []
    for net in nets:
        lines = {}
        for r in rows:
            if (r.get("net") or "") != net or not r["build"].startswith("patched") or r["world_size"] < 2:
                continue
            if r.get("optimizer", "muon") != "muon" or r.get("stage", 3) != 3:  # ZeRO-3 workloads
                continue
            ref = next((x for x in rows if x["build"] == REFERENCE and (x.get("net") or "") == net
                        and x["world_size"] == r["world_size"] and x["name"] == r["name"]), None)
            sp = ratio_spread(r, ref, "boundary_time")
            if sp:
                lines.setdefault((r["build"], r["name"]), []).append((r["world_size"], sp))
        if lines:
            panels.append((net, lines))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (net, lines) in zip(axes[0], panels):
        ws = sorted({w for pts in lines.values() for w, _ in pts})
        step = 0.6 / max(1, len(lines))  # the lines side by side around each W
        for i, ((build, name), pts) in enumerate(sorted(lines.items())):
            pts.sort(key=lambda p: p[0])
            xs = [ws.index(w) + step * (i - (len(lines) - 1) / 2) for w, _ in pts]
            _errorbar(ax, xs, [s for _, s in pts], marker=STYLE.get(build, {}).get("marker", "o"), ms=4, ls="-", lw=0.8,
                      label=f"{name} ({build})")
        ax.axhline(1.0, color="k", ls=":", lw=1)
        ax.set(xlabel="ranks W", ylabel=f"boundary time patched / {REFERENCE}",
               title=f"boundary micro-step, {_net_label(net)}\nmedian of per-repeat ratios, bars min-max")
        ax.set_xticks(range(len(ws)), labels=[str(w) for w in ws])
        ax.set_xlim(-0.5, len(ws) - 0.5)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    _save(fig, path)
    return True


def time_vs_rate(results, path):
    """Boundary micro-step time against the link rate (``net_rate_bits``) for every build, one
    panel per W, a line per build and Muon workload: medians with min-max over repeats (one point
    per rate given to ``--net``). Returns False without ``--net`` rows."""
    rows = results["rows"]
    shaped = [r for r in rows if r.get("net") and r.get("net_rate_bits") and r.get("optimizer", "muon") == "muon"]
    if not shaped:
        return False
    ws = sorted({r["world_size"] for r in shaped})
    fig, axes = plt.subplots(1, len(ws), figsize=(6 * len(ws), 4.5), squeeze=False)
    for ax, w in zip(axes[0], ws):
        for build in results["builds"]:
            for name in sorted({r["name"] for r in shaped if r["world_size"] == w}):
                pts = sorted(((r["net_rate_bits"], spread(per_repeat(r, "boundary_time").values())) for r in shaped
                              if r["build"] == build and r["world_size"] == w and r["name"] == name),
                             key=lambda p: p[0])
                pts = [(x, s) for x, s in pts if s]
                if not pts:
                    continue
                _errorbar(ax, [x / 1e9 for x, _ in pts], [s for _, s in pts], **STYLE.get(build, {}), ms=4,
                          ls="-" if name.endswith("gas4-fp32") else "--", label=f"{name} ({build})")
        ax.set(xscale="log", yscale="log", xlabel="link rate, Gbit/s", ylabel="boundary micro-step time, s",
               title=f"W={w}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    _save(fig, path)
    return True


def _save(fig, path):
    """Lay out ``fig``, write it to ``path`` (PNG, 120 dpi) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def make_all(results, out):
    out = Path(out)
    written = []
    if any(not r.get("net") and r.get("muon_elements") for r in results["rows"]):
        traffic_vs_w(results, out / "traffic_vs_w.png")
        written.append(out / "traffic_vs_w.png")
    for name, draw in (("time_vs_gas.png", time_vs_gas), ("ratio_vs_w.png", ratio_vs_w),
                       ("time_vs_rate.png", time_vs_rate)):
        if draw(results, out / name):
            written.append(out / name)
    return written


if __name__ == "__main__":
    for f in make_all(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]):
        print(f"wrote {f}")
