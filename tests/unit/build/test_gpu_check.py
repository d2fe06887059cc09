# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tests of ``python3 dev.py wheelhouse`` (build_backend/zero3muon_wheelhouse.py) and ``python3 dev.py
gpu-check`` (bench/gpu_check.py).

The fast tests check the wheelhouse's manifest, size limit and checks with fake wheels, and the
gpu-check driver's own rules (the output folder's return limits, stale locks, arguments). The slow
ones need the package registry (pip download) and the cached release sdist: a real wheelhouse of
the 0.19.8 base, installed offline with ``pip --no-index --no-deps --target`` into an empty
directory under a Python 3.12 interpreter without torch (pyenv's, ``ZERO3MUON_PY312`` to choose
another), whose compiled dependencies (pydantic-core) must import there; then ``gpu-check
--device cpu`` on it, small (patched 0.19.8 only, every step at its smallest: the exchange at W=2,
the fp32 test group, one repeat), under this interpreter (a project venv: torch, pytest), and once
with a budget too small for any step. The gpu-check runs keep their installs and JIT-built ops in
``out/test-gpu-check-cache/`` (the first run builds DeepSpeed's CPU shared-memory comm op and
FusedAdam, a few minutes on 2 idle cores).
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "build_backend"))
sys.path.insert(0, str(REPO_ROOT / "bench"))
import gpu_check  # noqa: E402
import zero3muon_wheelhouse as wh  # noqa: E402


def _installed_base():
    """The DeepSpeed release this test run's build is of (``0.19.8`` of ``0.19.8+zero3muon``), or None."""
    from importlib import metadata
    try:
        return metadata.version("deepspeed").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


# The slow tests build, install and run the 0.19.8 base whatever build runs the suite: once per CI
# run (the default base's pass) is enough.
only_on_the_default_base = pytest.mark.skipif(_installed_base() not in (None, "0.19.8"),
                                              reason="the wheelhouse and gpu-check dry run use the 0.19.8 base; "
                                              "they run in the 0.19.8 pass of the suite")

def _python312():
    """``ZERO3MUON_PY312``, else pyenv's newest 3.12 (``PYENV_ROOT``, default ~/.pyenv), else ``python3.12`` on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = sorted(pyenv.glob("versions/3.12*/bin/python3.12"))
    return os.environ.get("ZERO3MUON_PY312") or (str(found[-1]) if found else shutil.which("python3.12") or "python3.12")


PY312 = _python312()
CACHE = REPO_ROOT / "out" / "test-gpu-check-cache"


def fake_wheel(directory, name, version, tag="py3-none-any", size=100):
    path = Path(directory) / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "x" * size)
        zf.writestr(f"{name}-{version}.dist-info/RECORD", f"{name}/__init__.py,sha256=x,{size}\n")
        zf.writestr(f"{name}-{version}.dist-info/top_level.txt", f"{name}\n")
    return path


@pytest.fixture
def fake_sources(monkeypatch, tmp_path):
    """make() with the builds and downloads replaced by fake wheels (no network, seconds)."""
    sdist = tmp_path / "deepspeed-0.19.8.tar.gz"

    def build_wheels(bases, out, root, python=sys.executable):
        built = []
        for base in bases:
            built.append(("patched", base, fake_wheel(out, "deepspeed", f"{base}+zero3muon")))
            built.append(("stock", base, fake_wheel(out, "deepspeed", base)))
        return built, {base: sdist for base in bases}

    def download(requirements, out, python_version, python=sys.executable):
        return [
            fake_wheel(out, "hjson", "3.1.0"),
            fake_wheel(out, "pydantic_core", "2.0", "cp312-cp312-manylinux_2_17_x86_64", size=4000)
        ]

    monkeypatch.setattr(wh, "build_wheels", build_wheels)
    monkeypatch.setattr(wh,
                        "build_testing_wheel",
                        lambda out, root, python=sys.executable: fake_wheel(out, "muon_testing", "0.1.0"))
    monkeypatch.setattr(wh, "download_dependencies", download)
    monkeypatch.setattr(wh, "sdist_requirements", lambda sdist, base: ["hjson", "pydantic>=2"])


def test_manifest_sums_and_verify(fake_sources, tmp_path):
    out = tmp_path / "wh"
    manifest = wh.make(out, ["0.19.8"], "3.12")
    kinds = sorted((e["kind"], e["name"], e["version"]) for e in manifest["files"])
    assert kinds == [("dependency", "hjson", "3.1.0"), ("dependency", "pydantic-core", "2.0"),
                     ("patched", "deepspeed", "0.19.8+zero3muon"), ("stock", "deepspeed", "0.19.8"),
                     ("testing", "muon-testing", "0.1.0")]
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in out.glob("*.whl"))
    sums = (out / wh.SUMS).read_text().splitlines()
    assert len(sums) == 5 and all(len(line.split("  ")[0]) == 64 for line in sums)
    assert wh.verify(out)["python_version"] == "3.12"
    (out / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"changed")
    with pytest.raises(wh.WheelhouseError, match="sha256 differs"):
        wh.verify(out)


def test_over_the_limit_fails_loudly(fake_sources, tmp_path):
    with pytest.raises(wh.WheelhouseError, match=r"over the limit of 0 MiB"):
        wh.make(tmp_path / "wh", ["0.19.8"], "3.12", max_bytes=1000)


def test_refuses_to_replace_another_directory(fake_sources, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(wh.WheelhouseError, match="not a wheelhouse"):
        wh.make(tmp_path / "mine", ["0.19.8"], "3.12")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_requirement_names_and_wheel_tags():
    assert wh.requirement_name("pydantic>=2.0.0  # comment") == "pydantic"
    assert wh.requirement_name("Py_CPUInfo") == "py-cpuinfo"
    assert wh.requirement_name("# only a comment") is None
    assert wh.wheel_name_version("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl") == ("pydantic-core",
                                                                                                  "2.50.5")
    assert gpu_check._wheel_fits("hjson-3.1.0-py3-none-any.whl", "cp311")
    assert gpu_check._wheel_fits("psutil-7.2.2-cp36-abi3-manylinux_2_28_x86_64.whl", "cp311")
    assert not gpu_check._wheel_fits("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl", "cp311")
    assert gpu_check._wheel_fits("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl", "cp312")


def test_measurements_summarized_with_spread_and_ratios():
    samples = {}
    for build, times in (("patched-0.19.8", [1.0, 3.0, 2.0]), ("stock-0.19.8", [4.0, 4.0, 5.0])):
        for t in times:
            gpu_check._add_samples(
                samples, build,
                {"m": dict(boundary_step_time=t, ns_seconds_per_step=t / 2, alloc_peak_step_bytes=None)})
    out = gpu_check.summarize_samples(samples)
    assert out["patched-0.19.8"]["m"]["boundary_step_time"] == dict(median=2.0, min=1.0, max=3.0, n=3)
    assert "alloc_peak_step_bytes" not in out["patched-0.19.8"]["m"]  # None is not a sample
    assert out["patched-0.19.8"]["m"]["ns_share_of_step"] == pytest.approx(0.5)
    assert out["patched_over_stock_0.19.8"]["m"]["boundary_step_time"] == pytest.approx(0.5)


@pytest.mark.parametrize("extra,message", [
    (["--budget-s", "0"], "must be positive"),
    (["--device", "tpu"], "invalid choice"),
    (["--steps", "measure"], "add install"),
    (["--steps", "install", "exchange", "--builds", "stock-0.19.7"], "no build that step"),
    (["--exchange-world-sizes", "1"], "at least 2"),
])
def test_bad_arguments_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--wheels", "w", "--out", "o", *extra])
    assert message in capsys.readouterr().err


def test_only_the_builds_the_steps_use_are_installed():
    args = gpu_check.parse_args(["--wheels", "w", "--out", "o", "--steps", "install", "exchange", "measure"])
    assert gpu_check.needed_builds(args) == ["patched-0.19.8", "stock-0.19.8"]
    args = gpu_check.parse_args(["--wheels", "w", "--out", "o"])
    assert gpu_check.needed_builds(args) == ["patched-0.19.8", "stock-0.19.8", "stock-0.19.7"]


def test_out_dir_rules(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in gpu_check.OUT_FILES:
        (out / name).write_text("x")
    assert gpu_check.check_out_dir(out) == []
    assert gpu_check.check_out_dir(out, limits=dict(files=2, depth=2, file_bytes=10)) == ["3 files, over 2"]
    (out / "big.txt").write_text("x" * 11)
    problems = gpu_check.check_out_dir(out, allowed=None, limits=dict(files=8, depth=2, file_bytes=10))
    assert problems == ["big.txt: 11 bytes, over 10"]
    (out / "work").mkdir()
    (out / "work" / "rows.jsonl").write_text("{}")
    (out / "a b.txt").write_text("x")
    problems = gpu_check.check_out_dir(out)
    assert "work/: a folder (results are flat)" in problems and "work/rows.jsonl: in a folder (results are flat)" in problems
    assert any(p.startswith("a b.txt: a name of other characters") for p in problems)
    assert any(p.startswith("big.txt: not one of results.json") for p in problems)


def test_an_out_that_would_break_the_return_rules_is_refused(tmp_path, capsys):
    base = ["--wheels", str(tmp_path / "wh"), "--device", "cpu", "--scratch", str(tmp_path / "scratch")]
    out = tmp_path / "out"
    (out / "gpu" / "work").mkdir(parents=True)
    assert gpu_check.main([*base, "--out", str(out)]) == 2
    assert "holds what this check did not write" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == ["gpu", "work"]  # nothing written
    assert gpu_check.main([*base, "--out", str(tmp_path / "new"), "--scratch", str(tmp_path / "new" / "s")]) == 2
    assert "inside --out" in capsys.readouterr().err


def test_stale_locks_are_cleared_and_a_second_driver_is_refused(tmp_path):
    from types import SimpleNamespace
    ext = tmp_path / "ext"
    (ext / "patched-0.19.8" / "fused_adam").mkdir(parents=True)
    (ext / "patched-0.19.8" / "fused_adam" / "lock").write_text("")
    (ext / "patched-0.19.8" / "fused_adam" / "fused_adam.so").write_text("kept")
    first = SimpleNamespace(extensions=ext, driver_lock=None)
    assert gpu_check.take_extensions_dir(first) == dict(stale_locks_cleared=["patched-0.19.8/fused_adam/lock"])
    assert (ext / "patched-0.19.8" / "fused_adam" / "fused_adam.so").is_file()
    with pytest.raises(RuntimeError, match="another gpu-check is running"):
        gpu_check.take_extensions_dir(SimpleNamespace(extensions=ext, driver_lock=None))
    first.driver_lock.close()
    assert gpu_check.take_extensions_dir(SimpleNamespace(extensions=ext,
                                                         driver_lock=None)) == dict(stale_locks_cleared=[])


def test_exchange_verdict_is_the_tests_criterion():
    row = dict(world_size=2, exchanges=4, bit_equal=True, max_relative_difference=0.0, ns_dtype="float16")
    assert gpu_check.exchange_verdict([row], "cpu") is None
    off = dict(row, bit_equal=False, max_relative_difference=5e-4)
    assert "not bit-equal" in gpu_check.exchange_verdict([row, off], "cpu")
    assert gpu_check.exchange_verdict([row, off], "cuda") is None  # within fp16's eps, 2**-10
    assert "beyond the NS dtype's eps" in gpu_check.exchange_verdict([dict(off, max_relative_difference=1e-3)], "cuda")
    assert "without an exchange" in gpu_check.exchange_verdict([dict(row, exchanges=0)], "cuda")
    assert gpu_check.exchange_verdict([], "cuda") == "no runs"


def test_the_log_is_cut_in_the_middle(tmp_path):
    log = tmp_path / "gpu-check.log"
    log.write_bytes(b"a" * 50 + b"b" * 50)
    assert not gpu_check.cap_log(log, cap=100)
    assert gpu_check.cap_log(log, cap=40)
    text = log.read_text()
    assert text.startswith("a" * 20 + "\n[... 60 bytes cut") and text.endswith("b" * 20)


def test_sdist_requirements_exclude_torch():
    sdist = Path.home() / ".cache" / "zero3muon" / "sdists" / "deepspeed-0.19.8.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"no cached sdist {sdist} (dev.py setup downloads it)")
    reqs = wh.sdist_requirements(sdist, "0.19.8")
    names = {wh.requirement_name(r) for r in reqs}
    assert {"hjson", "pydantic", "numpy", "packaging"} <= names and "torch" not in names


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """A real wheelhouse of the 0.19.8 base for Python 3.12 (dev.py wheelhouse; the registry)."""
    out = tmp_path_factory.mktemp("wheelhouse") / "wh"
    res = subprocess.run(
        [sys.executable,
         str(REPO_ROOT / "dev.py"), "wheelhouse", "--bases", "0.19.8", "--out",
         str(out)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True)
    assert res.returncode == 0, res.stdout[-3000:]
    return out


@pytest.mark.slow
@only_on_the_default_base
def test_wheelhouse_installs_offline_under_python312(wheelhouse, tmp_path):
    manifest = json.loads((wheelhouse / wh.MANIFEST).read_text())
    names = {e["name"] for e in manifest["files"]}
    assert {"deepspeed", "muon-testing", "hjson", "pydantic", "pydantic-core", "annotated-types",
            "typing-inspection"} <= names
    assert "torch" not in names and manifest["total_bytes"] <= wh.MAX_BYTES
    print(f"wheelhouse (0.19.8 only): {len(manifest['files'])} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB")
    if not Path(PY312).is_file():
        pytest.skip(f"no Python 3.12 at {PY312} (set ZERO3MUON_PY312)")
    target = tmp_path / "target"
    patched = [e["file"] for e in manifest["files"] if e["kind"] == "patched"]
    deps = [e["file"] for e in manifest["files"] if e["kind"] == "dependency"]
    res = subprocess.run([
        PY312, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-index", "--no-deps", "--target",
        str(target), *(str(wheelhouse / f) for f in patched + deps)
    ],
                         stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT,
                         text=True)
    assert res.returncode == 0, res.stdout
    code = (
        "import importlib.metadata as md, json, pydantic, pydantic_core, hjson, annotated_types, typing_inspection\n"
        "class M(pydantic.BaseModel):\n    x: int\n"
        "assert M.model_validate({'x': '3'}).x == 3\n"  # pydantic-core's compiled validator runs
        "print(json.dumps(dict(ds=md.version('deepspeed'), core=pydantic_core.__file__, hjson=hjson.__file__)))")
    env = dict(os.environ, PYTHONPATH=str(target), PYTHONNOUSERSITE="1")
    res = subprocess.run([PY312, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert res.returncode == 0, res.stdout
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found["ds"] == "0.19.8+zero3muon"
    assert found["core"].startswith(str(target)) and found["hjson"].startswith(str(target))
    assert (target / "deepspeed" / "runtime" / "zero" / "muon" / "binding.py").is_file()


def _gpu_check(wheelhouse, out, *extra):
    cmd = [
        sys.executable,
        str(REPO_ROOT / "dev.py"), "gpu-check", "--wheels",
        str(wheelhouse), "--out",
        str(out), "--device", "cpu", "--site",
        str(CACHE / "site"), "--extensions-dir",
        str(CACHE / "torch_extensions"), "--scratch",
        str(out.parent / "scratch"), "--builds", "patched-0.19.8", *extra
    ]
    env = dict(os.environ)
    env.pop("DS_ZERO3MUON_SDIST", None)
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = json.loads((out / "results.json").read_text())
    # what a borrowed node brings back: the three files, flat, plain names, under 16 MiB each
    assert sorted(p.name for p in out.rglob("*")) == sorted(gpu_check.OUT_FILES), res.stdout[-2000:]
    assert gpu_check.check_out_dir(out) == [] and results["out_problems"] == []
    assert not Path(results["work"]).exists()  # the work folder (configs, rows, weights, junit) is scratch
    return res, results


@pytest.mark.slow
@only_on_the_default_base
def test_gpu_check_dry_run_on_the_cpu(wheelhouse, tmp_path):
    stale = CACHE / "torch_extensions" / "patched-0.19.8" / "stale_op" / "lock"  # as a build killed at the budget
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("")
    res, results = _gpu_check(wheelhouse, tmp_path / "out", "--tests", "fp32_reference", "--repeats", "1",
                              "--exchange-world-sizes", "2", "--budget-s", "900")
    print(res.stdout[-3000:])
    steps = results["steps"]
    assert res.returncode == 0, res.stdout[-3000:]
    assert {
        k: v["status"]
        for k, v in steps.items()
    } == dict(locks="ok", device="ok", wheels="ok", install="ok", exchange="ok", measure="ok", tests="ok", seed="ok")
    assert list(steps) == ["locks", "device", "wheels", *gpu_check.STEPS]  # the order they ran in
    assert "patched-0.19.8/stale_op/lock" in steps["locks"]["result"]["stale_locks_cleared"] and not stale.exists()
    install = steps["install"]["result"]
    builds = install["builds"]
    assert list(builds) == ["patched-0.19.8"] and builds["patched-0.19.8"]["version"] == "0.19.8+zero3muon"
    assert all(b["accelerator"] == "cpu" and b["file"].startswith(str(CACHE / "site")) for b in builds.values())
    assert builds["patched-0.19.8"]["unmet"] == [] and builds["patched-0.19.8"]["versions"]["pydantic"]
    assert {d["used"] for d in install["deps"].values()} <= {"node", "wheelhouse"}
    assert install["testing"].startswith("muon_testing-")  # the tests' package, from its wheel
    assert all(b["muon_testing_file"].startswith(str(CACHE / "site" / "testing")) for b in builds.values())
    ns_dtype = builds["patched-0.19.8"]["ns_dtype"]["gram"]  # upstream's rule on this accelerator
    # the exchange at W=2 on the CPU: bit for bit upstream's
    exchange = steps["exchange"]["result"]
    assert exchange["world_sizes"] == [2] and all(r["bit_equal"] and r["exchanges"] for r in exchange["rows"])
    assert exchange["ns_dtypes"] == [ns_dtype]
    measured = steps["measure"]["result"]
    assert {
        v: {r["ns_dtype"]
            for r in rows}
        for v, rows in measured["ns_batch"].items()
    } == {
        "fp32/ns-upstream": {ns_dtype},
        "bf16/ns-upstream": {ns_dtype},
        "fp32/ns-fp32": {"float32"}
    }
    for opt in ("muon", "adamw"):
        row = measured["steps"]["patched-0.19.8"][f"llama64-{opt}"]
        assert row["boundary_step_time"]["n"] == 1 and row["alloc_peak_step_bytes"]["median"] > 0
    assert "ns_share_of_step" in measured["steps"]["patched-0.19.8"]["llama64-muon"]
    assert [r["ns_dtypes"] for r in measured["rows"]["patched-0.19.8"]["llama64-muon"]] == [[ns_dtype]]
    assert [r["ns_dtypes"] for r in measured["rows"]["patched-0.19.8"]["llama64-adamw"]] == [[]]
    tests = steps["tests"]["result"]
    assert tests["ops"]["FusedAdamBuilder"]["status"] == "built"
    group = tests["groups"]["fp32_reference"]
    assert group["status"] == "ok" and len(group["tests"]) == 2 and group["ops"] == {"FusedAdamBuilder": "built"}
    assert {t["outcome"] for t in group["tests"].values()} == {"passed"}
    seed = steps["seed"]["result"]["table"]
    assert sorted(seed) == [
        "patched-0.19.8/bf16", "patched-0.19.8/bf16/ns-fp32", "patched-0.19.8/fp32", "patched-0.19.8/fp32/ns-fp32"
    ]
    for key, row in seed.items():
        assert row["ns_calls_gas1"] == row["ns_calls_gas4"] == 6 and row["ns_calls_micro_gas4"] == 0
        assert row["ns_dtypes"] == (["float32"] if key.endswith("ns-fp32") else [ns_dtype])
    # upstream's "gram" Newton-Schulz computes in fp16 wherever the accelerator allows it (CPU too): a
    # 1e-7 change of its input moves its output by 0 or ~3e-3 (fp16's resolution), so gas 1 and 4 agree
    # to that floor (measured on this CPU: 7.4e-4 after 3 steps); in fp32 to fp32's (measured: 4.2e-7)
    assert seed["patched-0.19.8/fp32"]["rel_diff_gas1_gas4"] < 1e-2
    assert seed["patched-0.19.8/fp32/ns-fp32"]["rel_diff_gas1_gas4"] < 1e-5
    assert sorted(results["out_files"]) == sorted(gpu_check.OUT_FILES)


@pytest.mark.slow
@only_on_the_default_base
def test_gpu_check_stops_at_its_budget_and_still_writes(wheelhouse, tmp_path):
    res, results = _gpu_check(wheelhouse, tmp_path / "out", "--budget-s", "1")
    statuses = {k: v["status"] for k, v in results["steps"].items()}
    assert set(statuses.values()) <= {"ok", "skipped-budget", "stopped-budget", "skipped"}, statuses
    assert set(gpu_check.STEPS) <= set(statuses)
    assert statuses["seed"] in ("skipped-budget", "skipped") and statuses["measure"] in ("skipped-budget", "skipped")
    assert res.returncode == 0, res.stdout[-2000:]
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
