# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark driver's pure parts, without a launch: statistics over interleaved repeats
(paired ratios, median and min-max), the ``target <name>: <value> <met|MISSED>`` lines, the grid
with and without ``--net`` (the namespace and rate modules stubbed), and the builds
``dev.py bench`` passes by default and with ``--all-bases``.
"""

import contextlib
import importlib.util
import json
import math
import pathlib
import re
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import repeats  # noqa: E402
import run_bench  # noqa: E402

TARGET = re.compile(r"^target (?P<name>.+?): (?P<value>\S+) (?P<verdict>met|MISSED)(?: \((?P<reason>.+)\))?$")


# --- statistics over repeats -------------------------------------------------------------------


def row(**per_repeat):
    """An aggregated row with ``key_per_repeat`` lists over repeats 0..n-1 (None: not measured)."""
    n = len(next(iter(per_repeat.values())))
    out = dict(repeat_index=list(range(n)))
    for key, values in per_repeat.items():
        out[key + "_per_repeat"] = values
    return out


def test_paired_ratios_pair_repeat_i_with_repeat_i():
    # repeat 1 crashed on the numerator's build, repeat 3 on the denominator's: only 0 and 2 pair
    assert repeats.paired_ratios({0: 2.0, 2: 3.0, 3: 9.0}, {0: 4.0, 1: 1.0, 2: 1.5}) == [0.5, 2.0]


def test_paired_ratios_zero_denominator():
    assert repeats.paired_ratios({0: 0.0, 1: 5.0}, {0: 0.0, 1: 0.0}) == [1.0, math.inf]


def test_spread_is_median_min_max_of_measured_values():
    sp = repeats.spread([3.0, None, 1.0, 2.0, 10.0])
    assert (sp.median, sp.low, sp.high, sp.n) == (2.5, 1.0, 10.0, 4)
    assert repeats.spread([None, None]) is None
    assert sp.format(".1f") == "2.5 [1.0-10.0]"
    assert repeats.spread([0.1234]).format("auto", 1e3) == "123"  # one sample: no range


def test_ratio_spread_uses_per_repeat_ratios_not_ratio_of_medians():
    patched = row(boundary_time=[1.0, 4.0, 2.0])
    stock = row(boundary_time=[2.0, 2.0, 1.0])
    sp = repeats.ratio_spread(patched, stock, "boundary_time")
    assert (sp.median, sp.low, sp.high, sp.n) == (2.0, 0.5, 2.0, 3)  # ratio of medians would be 1.0
    assert repeats.ratio_spread(patched, row(other=[1.0, 1.0, 1.0]), "boundary_time") is None


def test_aggregate_keeps_every_repeat_and_the_median():
    samples = [
        dict(name="sq256-gas4-fp32", gas=4, repeat=r, boundary_time=b, boundary_step_time=b / 2, micro_time=0.1,
             boundary_peak_bytes=None) for r, b in ((2, 0.3), (0, 0.1), (1, 0.5))
    ]
    agg = run_bench.aggregate(samples)
    assert agg["repeat_index"] == [0, 1, 2]
    assert agg["boundary_time_per_repeat"] == [0.1, 0.5, 0.3]
    assert agg["boundary_time"] == 0.3
    # no step_time from the worker: boundary + (gas - 1) x micro, per repeat
    assert agg["step_time_per_repeat"] == pytest.approx([0.4, 0.8, 0.6])
    assert agg["step_time_source"] == "boundary_time + (gas - 1) x micro_time"
    # a field this worker does not write stays None (printed "-")
    assert agg["alloc_boundary_bytes"] is None and agg["boundary_peak_bytes"] is None
    assert run_bench.fmt_spread(agg, "alloc_boundary_bytes") == "-"
    assert run_bench.fmt_spread(agg, "boundary_time", 1e3) == "300 [100-500]"


def test_adamw_row_that_ran_muon_is_refused():
    assert run_bench.row_error(dict(optimizer="adamw", ns_calls_per_step=4)) is not None
    assert run_bench.row_error(dict(optimizer="adamw", ns_calls_per_step=0)) is None
    assert run_bench.row_error(dict(optimizer="muon", ns_calls_per_step=4)) is None


# --- target lines -----------------------------------------------------------------------------


def test_target_line_met_and_missed():
    met = repeats.target_line("boundary time W=2 <= 1.0", 0.934, True, "not printed when met")
    assert met == "target boundary time W=2 <= 1.0: 0.93 met"
    missed = repeats.target_line("boundary time W=2 <= 1.0", 1.2, False, "worst rect1024: 812 ms vs 640 ms")
    assert missed == "target boundary time W=2 <= 1.0: 1.20 MISSED (worst rect1024: 812 ms vs 640 ms)"
    m = TARGET.match(missed)
    assert m and m["verdict"] == "MISSED" and m["value"] == "1.20" and m["reason"].startswith("worst")


def test_target_line_not_measured_is_missed():
    line = repeats.target_line("memory <= 1.0", None, True, "not measured")
    assert line == "target memory <= 1.0: - MISSED (not measured)"


def test_target_name_must_not_hold_the_separator():
    with pytest.raises(ValueError):
        repeats.target_line("a: b", 1.0, True)


def fake_row(name, build, w, times, step_times=None, **fields):
    """A Muon row of four 1024x1024 matrices whose traffic is the patched bound, timed per repeat."""
    p = 4 * 1024 * 1024
    r = dict(name=name, build=build, workload=name.split("-")[0], gas=4, world_size=w, optimizer="muon", muon_elements=p,
             muon_matrices=4, ns_calls_per_step=4, ns_calls_micro_per_step=0,
             muon_elements_boundary_mean=2 * p * (w - 1) / w**2, muon_elements_micro_mean=0,
             muon_elements_boundary_max=2 * p * (w - 1) / w**2, muon_elements_micro_max=0,
             repeat_index=list(range(len(times))), boundary_time=sorted(times)[len(times) // 2],
             boundary_time_per_repeat=list(times),
             boundary_step_time_per_repeat=list(step_times or [t / 2 for t in times]))
    r.update(fields)
    return r


def test_boundary_target_missed_names_the_worst_workload_and_why():
    names = ["sq1024-gas4-fp32", "rect1024-gas4-fp32"]
    results = {
        ("", "patched-0.19.8", 2, names[0]): fake_row(names[0], "patched-0.19.8", 2, [0.9, 1.0, 0.95]),
        ("", "stock-0.19.8", 2, names[0]): fake_row(names[0], "stock-0.19.8", 2, [1.0, 1.0, 1.0]),
        ("", "patched-0.19.8", 2, names[1]): fake_row(names[1], "patched-0.19.8", 2, [1.3, 1.1, 1.2],
                                                      step_times=[1.0, 0.8, 0.9]),
        ("", "stock-0.19.8", 2, names[1]): fake_row(names[1], "stock-0.19.8", 2, [1.0, 1.0, 1.0]),
    }
    lines = run_bench.target_lines(results, ["stock-0.19.8", "patched-0.19.8"], "", 2, names, run_bench.Links(None))
    boundary = [TARGET.match(line) for line in lines if line.startswith("target boundary micro-step")]
    assert len(boundary) == 1
    m = boundary[0]
    assert m["verdict"] == "MISSED" and m["value"] == "1.20" and "<= 1.0" in m["name"]
    assert "rect1024-gas4-fp32" in m["reason"] and "1.10-1.30" in m["reason"] and "step() ratio 1.80" in m["reason"]
    # the step()-only ratio follows, a target too
    after = TARGET.match(lines[lines.index(m.string) + 1])
    assert "step() time at the boundary" in after["name"] and (after["value"], after["verdict"]) == ("1.80", "MISSED")
    # memory fields absent from these rows: printed as not measured, MISSED
    memory = [TARGET.match(line) for line in lines if "tensor memory" in line]
    assert memory and all(m["verdict"] == "MISSED" and m["value"] == "-" for m in memory)
    # counts at the bound, NS once per matrix
    assert all(TARGET.match(line)["verdict"] == "met" for line in lines if "Muon recv per rank" in line)

    results[("", "patched-0.19.8", 2, names[1])]["boundary_time_per_repeat"] = [0.8, 0.7, 0.9]
    lines = run_bench.target_lines(results, ["stock-0.19.8", "patched-0.19.8"], "", 2, names, run_bench.Links(None))
    line = next(line for line in lines if line.startswith("target boundary micro-step"))
    assert line.endswith(": 0.95 met")


def test_memory_and_batched_ns_targets():
    w, mib = 4, 2**20
    llama = dict(gas=4)
    results = {
        ("", "patched-0.19.8", w, "sq1024-gas4-fp32"): fake_row(
            "sq1024-gas4-fp32", "patched-0.19.8", w, [1.0], alloc_boundary_bytes=10 * mib,
            alloc_boundary_bytes_per_repeat=[10 * mib], bucket_bound_bytes=4 * mib),
        ("", "stock-0.19.8", w, "sq1024-gas4-fp32"): fake_row(
            "sq1024-gas4-fp32", "stock-0.19.8", w, [1.0], alloc_boundary_bytes=20 * mib,
            alloc_boundary_bytes_per_repeat=[20 * mib]),
        ("", "patched-0.19.8", w, "llama-gas4-fp32-ns-batched"): fake_row(
            "llama-gas4-fp32-ns-batched", "patched-0.19.8", w, [1.0, 1.0], ns_seconds_per_step=0.5,
            ns_seconds_per_step_per_repeat=[0.5, 0.6], loss_last=1.0, **llama),
        ("", "patched-0.19.8", w, "llama-gas4-fp32-ns-onebyone"): fake_row(
            "llama-gas4-fp32-ns-onebyone", "patched-0.19.8", w, [1.0, 1.0], ns_seconds_per_step=1.0,
            ns_seconds_per_step_per_repeat=[1.0, 0.6], loss_last=1.0 + 1e-3, **llama),
    }
    names = ["sq1024-gas4-fp32", "llama-gas4-fp32-ns-batched", "llama-gas4-fp32-ns-onebyone"]
    lines = run_bench.target_lines(results, ["stock-0.19.8", "patched-0.19.8"], "", w, names, run_bench.Links(None))
    by_name = {TARGET.match(line)["name"]: TARGET.match(line) for line in lines if line.startswith("target ")}
    mem = by_name["boundary peak tensor memory patched-0.19.8/stock-0.19.8 W=4 every Muon workload <= 1.0"]
    assert (mem["value"], mem["verdict"]) == ("0.50", "met")
    bucket = by_name["boundary peak tensor memory / largest bucket's exchange bytes patched-0.19.8 W=4 <= 3"]
    assert (bucket["value"], bucket["verdict"]) == ("2.50", "met")
    batched = by_name["batched NS time per step / one-by-one patched-0.19.8 llama-gas4 W=4 <= 0.8"]
    assert (batched["value"], batched["verdict"]) == ("0.75", "met")  # median of 0.5 and 1.0
    same = next(m for n, m in by_name.items() if n.startswith("batched NS same results"))
    assert same["verdict"] == "MISSED" and "1.0e-03" == same["value"]


# --- grids and --net ----------------------------------------------------------------------------


def test_default_grid_holds_llama_batched_and_one_by_one_and_adamw():
    configs = {c["name"]: c for c in run_bench.grid("default", 1, 1)}
    for wl in ("sq256", "rect256", "sq1024", "rect1024"):
        assert f"{wl}-gas4-fp32" in configs and f"{wl}-gas1-fp32" in configs
    patched = {c["name"]: c for c in run_bench.configs_for("patched-0.19.8", configs.values())}
    stock = {c["name"]: c for c in run_bench.configs_for("stock-0.19.8", configs.values())}
    assert "batch_ns" not in patched["llama-gas4-fp32"], "the default batching"
    assert patched["llama-gas4-fp32-ns-batched"]["batch_ns"] is True
    assert patched["llama-gas4-fp32-ns-onebyone"]["batch_ns"] is False
    assert "llama-gas4-fp32-ns-onebyone" not in stock and "llama-gas4-fp32-ns-batched" not in stock
    assert "batch_ns" not in stock["llama-gas4-fp32"]
    for name in ("sq1024-gas4-fp32-adamw", "llama-gas4-fp32-adamw"):
        assert patched[name]["optimizer"] == stock[name]["optimizer"] == "adamw"
    assert not any(k in c for c in list(patched.values()) + list(stock.values()) for k in ("only", "patched"))


def test_net_grid_and_builds():
    names = [c["name"] for c in run_bench.grid("net", 1, 1)]
    assert names == ["sq1024-gas1-fp32", "sq1024-gas1-fp32-strict", "rect1024-gas1-fp32", "sq1024-gas1-fp32-adamw"]
    net = run_bench.grid("net", 1, 1)
    patched = {c["name"]: c for c in run_bench.configs_for("patched-0.19.8", net)}
    stock = {c["name"]: c for c in run_bench.configs_for("stock-0.19.8", net)}
    assert patched["sq1024-gas1-fp32-strict"]["max_step_memory"] == "momentum_partition"
    assert "max_step_memory" not in patched["sq1024-gas1-fp32"], "the default: the key unset, as a user leaves it"
    assert "sq1024-gas1-fp32-strict" not in stock and not any("max_step_memory" in c for c in stock.values())
    pythons = {b: "python" for b in run_bench.BUILD_ORDER}
    assert run_bench.select_builds(pythons, ["auto"]) == ["stock-0.19.8", "patched-0.19.8"]
    assert run_bench.select_builds(pythons, None) == list(run_bench.BUILD_ORDER)


def fake_launches(monkeypatch):
    """Replace the torchrun launch with rows made from the configs; returns the launches seen."""
    seen = []

    def launch(python, world_size, configs, workdir, timeout, log, prefix=()):
        seen.append(dict(python=python, w=world_size, names=[c["name"] for c in configs], prefix=list(prefix)))
        rows = []
        for c in configs:
            muon = c.get("optimizer", "muon") == "muon"
            r = fake_row(c["name"], python, world_size, [0.5], **{k: v for k, v in c.items() if k != "name"})
            r.update(boundary_time=0.5, boundary_step_time=0.2, micro_time=0.1, boundary_peak_bytes=1.0,
                     muon_bytes_boundary_mean=0, muon_bytes_micro_mean=0)
            if not muon:
                r.update(muon_elements=0, muon_matrices=0, ns_calls_per_step=0)
            rows.append({k: v for k, v in r.items() if not k.endswith("_per_repeat") and k != "repeat_index"})
        return rows, {}

    monkeypatch.setattr(run_bench, "launch", launch)
    monkeypatch.setattr(run_bench, "write_outputs", lambda *a, **k: None)
    return seen


def stub_net(monkeypatch, unavailable=None):
    """bench/netns.py and bench/link_rate.py as their interface says, recording the namespaces."""
    made = []
    netns = types.ModuleType("netns")
    netns.parse_rate = lambda text: {"1gbit": 1e9}[text]
    netns.format_rate = lambda bits: f"{bits / 1e9:g}gbit"
    netns.unavailable_reason = lambda: unavailable

    @contextlib.contextmanager
    def shaped_namespace(rate_bits):
        made.append(rate_bits)
        yield ["ip", "netns", "exec", f"ns{len(made)}"]

    netns.shaped_namespace = shaped_namespace
    netns.measure_throughput = lambda prefix, nbytes: 0.9 * made[-1]
    link_rate = types.ModuleType("link_rate")

    def derive(w):
        return types.SimpleNamespace(inter_node_rate_bits=w * 1e10, intra_node_rate_bits=1e12,
                                     lines=lambda: [f"derived for W={w}"])

    link_rate.derive = derive
    monkeypatch.setitem(sys.modules, "netns", netns)
    monkeypatch.setitem(sys.modules, "link_rate", link_rate)
    return made


PYTHONS = [f"--python={b}={b}" for b in run_bench.BUILD_ORDER]


def test_run_without_net_has_no_namespace(monkeypatch, tmp_path, capsys):
    seen = fake_launches(monkeypatch)
    assert run_bench.main(PYTHONS[1::2] + ["--repeats", "2", "--world-sizes", "2", "--no-seed", "--out", str(tmp_path)]) == 0
    grid_launches = [s for s in seen if s["w"] == 2]
    assert len(grid_launches) == 4  # 2 repeats x 2 builds, interleaved
    assert [s["python"] for s in grid_launches] == ["stock-0.19.8", "patched-0.19.8"] * 2
    assert all(s["prefix"] == [] for s in seen)
    assert "llama-gas4-fp32-ns-onebyone" in grid_launches[1]["names"]
    out = capsys.readouterr().out
    assert "Network: none" in out and "target boundary micro-step time" in out


def test_net_auto_and_rate_run_the_net_grid_in_one_namespace_per_rate_and_w(monkeypatch, tmp_path, capsys):
    made = stub_net(monkeypatch)
    seen = fake_launches(monkeypatch)
    argv = PYTHONS + ["--net", "auto", "1gbit", "--repeats", "2", "--world-sizes", "2", "4", "--out", str(tmp_path)]
    assert run_bench.main(argv) == 0
    assert made == [2e10, 4e10, 1e9, 1e9]  # auto at W=2, W=4, then 1gbit at W=2, W=4
    assert {s["python"] for s in seen} == {"patched-0.19.8", "stock-0.19.8"}
    assert len(seen) == 4 * 2 * 2  # (rate, W) x repeats x builds; no seed table
    assert all(s["names"] == [c["name"] for c in run_bench.configs_for(s["python"], run_bench.grid("net", 1, 1))]
               for s in seen)
    assert seen[0]["prefix"] == ["ip", "netns", "exec", "ns1"] and seen[-1]["prefix"][-1] == "ns4"
    out = capsys.readouterr().out
    assert "derived for W=2" in out and "measured 18gbit" in out
    assert "=== W=2, link 20gbit (derived inter-node rate), measured 18gbit ===" in out
    assert "=== W=4, link 1gbit, measured 0.9gbit ===" in out
    targets = [TARGET.match(line) for line in out.splitlines() if line.startswith("target boundary micro-step")]
    assert sorted(m["name"].rsplit(" ", 1)[-1] for m in targets) == ["0.4", "0.6"]  # at the derived rate only


def test_a_failing_namespace_skips_its_launches_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    made = stub_net(monkeypatch)
    netns = sys.modules["netns"]
    good = netns.shaped_namespace

    @contextlib.contextmanager
    def shaped_namespace(rate_bits):
        if rate_bits == 1e9:
            raise RuntimeError("tc: qdisc refused\nmore")
        with good(rate_bits) as prefix:
            yield prefix

    monkeypatch.setattr(netns, "shaped_namespace", shaped_namespace)
    seen = fake_launches(monkeypatch)
    assert run_bench.main(PYTHONS + ["--net", "1gbit", "auto", "--repeats", "1", "--world-sizes", "2", "--out",
                                     str(tmp_path)]) == 0
    assert made == [2e10] and len(seen) == 2
    out = capsys.readouterr().out
    assert "=== W=2, link 1gbit, FAILED: RuntimeError: tc: qdisc refused ===" in out
    assert "=== W=2, link 20gbit (derived inter-node rate), measured 18gbit ===" in out


def test_net_unavailable_runs_without_limit_and_says_so(monkeypatch, tmp_path, capsys):
    made = stub_net(monkeypatch, unavailable="no CAP_NET_ADMIN")
    seen = fake_launches(monkeypatch)
    assert run_bench.main(PYTHONS + ["--net", "auto", "--repeats", "1", "--world-sizes", "2", "--out",
                                     str(tmp_path)]) == 0
    assert made == [] and all(s["prefix"] == [] for s in seen) and len(seen) == 2
    out = capsys.readouterr().out
    assert "network emulation unavailable: no CAP_NET_ADMIN" in out
    assert "Network: emulation unavailable (no CAP_NET_ADMIN); ran WITHOUT a network limit" in out


# --- dev.py bench -------------------------------------------------------------------------------


@pytest.fixture
def dev(monkeypatch):
    spec = importlib.util.spec_from_file_location("zero3muon_dev", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("DS_ZERO3MUON_BASE", raising=False)
    module.calls = []

    def setup(base, stock=False):
        return types.SimpleNamespace(python=f"/venv/{'stock-' if stock else ''}{base}/bin/python")

    def run(args, **kwargs):
        module.calls.append(args)
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(module, "setup", setup)
    monkeypatch.setattr(module.subprocess, "run", run)
    return module


def bench_pythons(args):
    return sorted(a.split("=", 1)[1].split("=")[0] for a in args if a.startswith("--python="))


def test_dev_bench_default_is_the_default_base_pair(dev):
    default_base, known = dev.project_config()
    assert dev.main(["bench", "--repeats", "3"]) == 0
    args = dev.calls[-1]
    assert bench_pythons(args) == sorted([f"patched-{default_base}", f"stock-{default_base}"])
    assert args[-2:] == ["--repeats", "3"] and "--all-bases" not in args


def test_dev_bench_all_bases(dev):
    _, known = dev.project_config()
    assert dev.main(["bench", "--all-bases", "--grid", "quick"]) == 0
    args = dev.calls[-1]
    assert bench_pythons(args) == sorted(f"{kind}-{b}" for b in known for kind in ("patched", "stock"))
    assert args[-2:] == ["--grid", "quick"] and "--all-bases" not in args
    assert json.dumps(args)  # plain strings


# --- plots ----------------------------------------------------------------------------------------


def test_plots_ratio_vs_w_and_time_vs_rate(tmp_path):
    import plots
    rows = []
    for net, rate in (("", None), ("auto", 2e10), ("1gbit", 1e9)):
        for w in (2, 4):
            for build, times in (("patched-0.19.8", [0.5, 0.6, 0.7]), ("stock-0.19.8", [1.0, 1.0, 1.4])):
                rows.append(fake_row("sq1024-gas4-fp32", build, w, times, net=net, net_rate_bits=rate))
    results = dict(builds=["stock-0.19.8", "patched-0.19.8"], world_sizes=[2, 4], nets=["", "auto", "1gbit"],
                   rows=rows)
    assert plots.ratio_vs_w(results, tmp_path / "ratio.png") and (tmp_path / "ratio.png").stat().st_size > 0
    assert plots.time_vs_rate(results, tmp_path / "rate.png") and (tmp_path / "rate.png").stat().st_size > 0
    no_net = dict(results, rows=[r for r in rows if not r["net"]], nets=[""])
    assert not plots.time_vs_rate(no_net, tmp_path / "none.png")
    only_patched = dict(no_net, rows=[r for r in no_net["rows"] if r["build"].startswith("patched")])
    assert not plots.ratio_vs_w(only_patched, tmp_path / "none.png")


def test_batched_ns_targets_missed_with_the_error_when_llama_did_not_run():
    names = ["llama-gas4-fp32-ns-batched", "llama-gas4-fp32-ns-onebyone"]
    results = {("", "stock-0.19.8", 2, "sq1024-gas4-fp32"): fake_row("sq1024-gas4-fp32", "stock-0.19.8", 2, [1.0]),
               ("", "patched-0.19.8", 2, "sq1024-gas4-fp32"): fake_row("sq1024-gas4-fp32", "patched-0.19.8", 2, [1.0])}
    errors = {("", "patched-0.19.8", 2, n): "crash: KeyError: 'llama'" for n in names}
    lines = run_bench.target_lines(results, ["stock-0.19.8", "patched-0.19.8"], "", 2, ["sq1024-gas4-fp32"] + names,
                                   run_bench.Links(None), errors)
    batched = [TARGET.match(line) for line in lines if line.startswith("target batched NS")]
    assert len(batched) == 2
    assert all(m["value"] == "-" and m["verdict"] == "MISSED" and "KeyError: 'llama'" in m["reason"] for m in batched)


def test_memory_against_adamw_and_zero12_targets():
    w, mib = 2, 2**20
    name = "decoder12-gas2-fp32"

    def mem(build, optimizer, state, buffers, step, repeats=2):
        r = fake_row(name + ("-adamw" if optimizer == "adamw" else ""), build, w, [1.0] * repeats, optimizer=optimizer,
                     stage=3, optimizer_state_bytes=state, retained_muon_bytes=buffers)
        for key, value in (("kept_bytes", state + buffers), ("step_peak_bytes", state + buffers + step),
                           ("alloc_peak_step_bytes", step)):
            r[key], r[key + "_per_repeat"] = value, [value] * repeats
        return r

    def zero12(build, offload, by_collective, ns, kept, straddling=(1, 117000)):
        per_rank = sum(by_collective.values())
        return fake_row(f"llama-zero2-gas2-fp32{'-offload' if offload else ''}", build, w, [1.0], stage=2,
                        offload=offload, muon_matrices=28, ns_calls_per_step=ns, muon_elements_boundary_mean=per_rank,
                        muon_elements_boundary_max=per_rank, muon_elements_by_collective=by_collective,
                        muon_straddling_matrices=straddling[0], muon_straddling_elements=straddling[1],
                        kept_bytes=kept)

    exchange = {"all_to_all_single": 58000.0, "all_reduce": 1.0}
    results = {
        ("", "patched-0.19.8", w, name): mem("patched-0.19.8", "muon", 2 * mib, 2 * mib, 3 * mib),
        ("", "patched-0.19.8", w, name + "-adamw"): mem("patched-0.19.8", "adamw", 4 * mib, 0, 2 * mib),
        ("", "stock-0.19.8", w, name): mem("stock-0.19.8", "muon", 2 * mib, 6 * mib, 3 * mib),
        ("", "stock-0.19.8", w, name + "-adamw"): mem("stock-0.19.8", "adamw", 4 * mib, 0, 2 * mib),
        ("", "patched-0.19.8", w, "llama-zero2-gas2-fp32-offload"): zero12("patched-0.19.8", True, exchange, 28, 3 * mib),
        ("", "stock-0.19.8", w, "llama-zero2-gas2-fp32-offload"): zero12(
            "stock-0.19.8", True, {"all_gather_into_tensor": 3e6}, 56, 20 * mib),
        ("", "patched-0.19.8", w, "llama-zero2-gas2-fp32"): zero12("patched-0.19.8", False, exchange, 29, 3 * mib),
        ("", "stock-0.19.8", w, "llama-zero2-gas2-fp32"): zero12("stock-0.19.8", False, {}, 29, 2 * mib),
    }
    names = [name, name + "-adamw", "llama-zero2-gas2-fp32-offload", "llama-zero2-gas2-fp32"]
    lines = run_bench.target_lines(results, ["stock-0.19.8", "patched-0.19.8"], "", w, names, run_bench.Links(None))
    by_name = {TARGET.match(line)["name"]: TARGET.match(line) for line in lines if line.startswith("target ")}
    kept = by_name[f"optimizer memory kept between steps Muon/AdamW patched-0.19.8 {name} W=2 <= 1"]
    assert (kept["value"], kept["verdict"]) == ("1.000", "met") and "state 2.00 + buffers 2.00" in kept["reason"]
    peak = by_name[f"optimizer memory at the peak of step() Muon/AdamW patched-0.19.8 {name} W=2 <= 1"]
    assert (peak["value"], peak["verdict"]) == ("1.167", "MISSED")  # (4 + 3) / (4 + 2)
    stock = by_name[f"optimizer memory kept between steps Muon/AdamW stock-0.19.8 {name} W=2 <= 1"]
    assert (stock["value"], stock["verdict"]) == ("2.000", "MISSED")
    # the ZeRO-1/2 rows stay out of the ZeRO-3 targets
    assert not any("llama-zero2" in (m["reason"] or "") for n, m in by_name.items() if "ZeRO-1/2" not in n)
    for row in ("llama-zero2-gas2-fp32-offload", "llama-zero2-gas2-fp32"):
        where = f"patched-0.19.8 {row} W=2"
        moved = by_name[f"ZeRO-1/2 Muon exchange (all-to-all) recv summed over ranks / (2 x straddling elements) {where} <= 1"]
        assert (moved["value"], moved["verdict"]) == (f"{58000 * 2 / (2 * 117000):.3f}", "met")
        ns = by_name[f"ZeRO-1/2 NS calls per step summed over ranks {where} = Muon matrices (28)"]
        assert (ns["value"], ns["verdict"]) == (("28", "met") if row.endswith("offload") else ("29", "MISSED"))
        kept = by_name[f"ZeRO-1/2 optimizer memory kept between steps patched-0.19.8/stock-0.19.8 {row} W=2 <= 1"]
        assert (kept["value"], kept["verdict"]) == (("0.150", "met") if row.endswith("offload") else ("1.500", "MISSED"))
    info = [line for line in lines if line.startswith("  info stock-0.19.8 llama-zero2-gas2-fp32-offload")]
    assert info and "NS 56 per step for 28 matrices" in info[0]
    assert run_bench.print_memory_table(results, ["stock-0.19.8", "patched-0.19.8"], "", w, names)
    assert run_bench.print_zero12_table(results, ["stock-0.19.8", "patched-0.19.8"], "", w, names)


def test_memory_grid_and_pipeline_depth_variants():
    names = [c["name"] for c in run_bench.grid("memory", 1, 1)]
    assert names[:3] == ["decoder12-gas2-fp32", "decoder12-gas2-fp32-strict", "decoder12-gas2-fp32-adamw"]
    assert {f"{wl}-zero{s}-gas2-fp32{o}" for wl in ("decoder12", "llama") for s in (1, 2) for o in ("", "-offload")} \
        <= set(names)
    assert set(names) <= {c["name"] for c in run_bench.grid("default", 1, 1)}
    strict = [n for n in names if n.endswith("-strict")]
    assert strict == ["decoder12-gas2-fp32-strict"] + [f"decoder12-zero{s}-gas2-fp32{o}-strict" for s in (1, 2)
                                                        for o in ("", "-offload")]
    memory = run_bench.grid("memory", 1, 1)
    patched = {c["name"]: c for c in run_bench.configs_for("patched-0.19.8", memory)}
    assert all(patched[n]["max_step_memory"] == "momentum_partition" for n in strict)
    assert all(patched[n[:-len("-strict")]].get("max_step_memory") is None for n in strict)
    assert patched["decoder12-zero2-gas2-fp32-offload-strict"]["offload"] is True
    assert not set(strict) & {c["name"] for c in run_bench.configs_for("stock-0.19.8", memory)}
    overlap = run_bench.overlap_grid(1, 1)
    patched = {c["name"]: c for c in run_bench.configs_for("patched-0.19.8", overlap)}
    assert {c["pipeline_depth"] for n, c in patched.items() if n.endswith("-overlap")} == {2}
    assert {c["pipeline_depth"] for n, c in patched.items() if n.endswith("-serial")} == {1}
    assert not run_bench.configs_for("stock-0.19.8", overlap)


# --- max_step_memory: the default against "momentum_partition" ---------------------------------


def strict_rows(w=4, repeats=3):
    """sq1024 at gas 1: patched default (one bucket, depth 2), patched strict (four buckets, depth
    1; its step() twice as slow), stock; decoder12-like memory fields on both patched rows."""
    mib, p = 2**20, 4 * 1024 * 1024
    wire = 4 * 2 * p * (w - 1) / w**2  # fp32 bytes per rank at the bound

    def muon(name, build, step_times, buckets, depth, kept, peak):
        r = fake_row(name, build, w, [2 * t for t in step_times], step_times=step_times, gas=1,
                     muon_bytes_boundary_mean=wire, muon_bytes_boundary_max=wire,
                     boundary_settings=None if buckets is None else dict(muon_buckets=buckets, pipeline_depth=depth,
                                                                         plan_peak_bytes=peak))
        for key, value in (("kept_bytes", kept), ("step_peak_bytes", peak)):
            r[key], r[key + "_per_repeat"] = value, [value] * repeats
        return r

    name = "sq1024-gas1-fp32"
    return name, {
        ("", "patched-0.19.8", w, name): muon(name, "patched-0.19.8", [0.10, 0.11, 0.12], 1, 2, 4 * mib, 36 * mib),
        ("", "patched-0.19.8", w, name + "-strict"): muon(name + "-strict", "patched-0.19.8", [0.20, 0.22, 0.30], 4,
                                                          1, 4 * mib, 33 * mib),
        ("", "stock-0.19.8", w, name): muon(name, "stock-0.19.8", [0.5, 0.5, 0.5], None, None, 8 * mib, 40 * mib),
    }


def test_max_step_memory_grid_runs_sq1024_default_strict_and_stock():
    configs = run_bench.grid("max-step-memory", 1, 1)
    assert [c["name"] for c in configs] == list(run_bench.MAX_STEP_MEMORY_NET)
    patched = run_bench.configs_for("patched-0.19.8", configs)
    assert [c.get("max_step_memory") for c in patched] == [None, "momentum_partition"]
    assert all(c["workload"] == "sq1024" and c["gas"] == 1 and c["stage"] == 3 for c in patched)
    assert [c["name"] for c in run_bench.configs_for("stock-0.19.8", configs)] == ["sq1024-gas1-fp32"]
    assert run_bench.reference_name("decoder12-zero2-gas2-fp32-offload-strict") == "decoder12-zero2-gas2-fp32-offload"


def test_net_with_grid_max_step_memory_runs_that_grid(monkeypatch, tmp_path, capsys):
    stub_net(monkeypatch)
    seen = fake_launches(monkeypatch)
    argv = PYTHONS + ["--net", "auto", "--repeats", "3", "--world-sizes", "4", "--grid", "max-step-memory", "--out",
                      str(tmp_path)]
    assert run_bench.main(argv) == 0
    assert [s["python"] for s in seen] == ["stock-0.19.8", "patched-0.19.8"] * 3
    assert [s["names"] for s in seen[:2]] == [["sq1024-gas1-fp32"], list(run_bench.MAX_STEP_MEMORY_NET)]
    out = capsys.readouterr().out
    assert "max_step_memory at W=4" in out and '  info max_step_memory default / "momentum_partition"' in out
    # without max-step-memory, --net keeps running the net grid whatever --grid says
    seen.clear()
    assert run_bench.main(PYTHONS + ["--net", "auto", "--repeats", "1", "--world-sizes", "4", "--grid", "memory",
                                     "--out", str(tmp_path)]) == 0
    assert seen[1]["names"] == [c["name"] for c in run_bench.configs_for("patched-0.19.8", run_bench.grid("net", 1, 1))]


def test_step_memory_table_and_lines_pair_default_with_strict(capsys):
    name, results = strict_rows()
    builds = ["stock-0.19.8", "patched-0.19.8"]
    names = [name, name + "-strict"]
    assert run_bench.print_step_memory_table(results, builds, "", 4, names)
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.startswith(name)]
    default, strict, stock = table[0], table[1], table[2]
    assert default[1:6] == ["patched-0.19.8", "default", "1", "2", "36.00"]
    assert strict[1:6] == ["patched-0.19.8", "momentum_partition", "4", "1", "33.00"]
    assert stock[1:5] == ["stock-0.19.8", "(stock)", "-", "-"]
    assert default[6] == strict[6] == "6291456"  # 4 bytes x 2P(W-1)/W^2 per rank
    ratio = table[3]  # default / strict, paired: 0.10/0.20, 0.11/0.22, 0.12/0.30
    assert ratio[1:5] == ["patched-0.19.8", "0.50", "[0.40-0.50]", "0.50"]
    assert " 1 / 4 " in out.splitlines()[-1]
    lines = run_bench.step_memory_lines(results, builds, "", 4, names)
    assert len(lines) == 1 and lines[0].startswith('  info max_step_memory default / "momentum_partition" '
                                                   'patched-0.19.8 sq1024-gas1-fp32 W=4: ')
    assert "boundary step() time 0.50 [0.40-0.50] over 3 repeats" in lines[0]
    assert "Muon bytes per rank per step 6291456 vs 6291456" in lines[0] and "buckets 1 vs 4, depth 2 vs 1" in lines[0]
    assert "kept 4.000 vs 4.000 MiB, peak of step() 36.000 vs 33.000 MiB" in lines[0]


def test_strict_variant_is_checked_against_adamw_and_stock_like_its_default():
    w, mib = 2, 2**20
    name = "decoder12-gas2-fp32"

    def mem(row_name, build, optimizer, kept, peak, **extra):
        r = fake_row(row_name, build, w, [1.0, 1.0], optimizer=optimizer, stage=3, optimizer_state_bytes=kept,
                     retained_muon_bytes=0, alloc_peak_step_bytes=peak - kept, **extra)
        for key, value in (("kept_bytes", kept), ("step_peak_bytes", peak)):
            r[key], r[key + "_per_repeat"] = value, [value] * 2
        return r

    results = {
        ("", "patched-0.19.8", w, name): mem(name, "patched-0.19.8", "muon", 4 * mib, 9 * mib),
        ("", "patched-0.19.8", w, name + "-strict"): mem(name + "-strict", "patched-0.19.8", "muon", 4 * mib, 7 * mib),
        ("", "patched-0.19.8", w, name + "-adamw"): mem(name + "-adamw", "patched-0.19.8", "adamw", 8 * mib, 8 * mib),
        ("", "stock-0.19.8", w, name): mem(name, "stock-0.19.8", "muon", 6 * mib, 12 * mib),
    }
    names = [name, name + "-strict", name + "-adamw"]
    lines = run_bench.target_lines(results, ["stock-0.19.8", "patched-0.19.8"], "", w, names, run_bench.Links(None))
    by_name = {TARGET.match(line)["name"]: TARGET.match(line) for line in lines if line.startswith("target ")}
    for variant, peak in ((name, ("1.125", "MISSED")), (name + "-strict", ("0.875", "met"))):
        kept = by_name[f"optimizer memory kept between steps Muon/AdamW patched-0.19.8 {variant} W=2 <= 1"]
        assert (kept["value"], kept["verdict"]) == ("0.500", "met")
        top = by_name[f"optimizer memory at the peak of step() Muon/AdamW patched-0.19.8 {variant} W=2 <= 1"]
        assert (top["value"], top["verdict"]) == peak
    # the boundary-time targets stay patched default / stock: the strict row has no stock row of its name
    assert all("-strict" not in (m["reason"] or "") for n, m in by_name.items() if n.startswith("boundary"))
    assert run_bench.print_memory_table(results, ["stock-0.19.8", "patched-0.19.8"], "", w, names)
