# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python3 dev.py gpu-check``: the patch checked on an offline GPU node, within a time budget.

The driver (this module's ``main``) is stdlib-only, like dev.py: it runs under the node's
``python3`` (``--python``, default: the interpreter running it) and starts every build's work as
a subprocess of that same interpreter with ``PYTHONPATH=<the build's --target dir>:<testing>:<deps>``,
so nothing is installed into the node's environment. Steps, in priority order (each recorded in
``OUT/results.json`` with ``status``, ``seconds`` and its result):

a. ``install``: for each build (patched and stock DeepSpeed 0.19.8 and 0.19.7) ``pip install
   --no-index --no-deps --target SITE/<build>`` of its wheel from ``--wheels`` (a ``dev.py
   wheelhouse``, sha256-checked against its manifest), the dependencies the interpreter lacks
   (hjson, pydantic, ...) into ``SITE/deps``, the tests' package ``muon_testing`` (``testing/``)
   into ``SITE/testing``, then ``import deepspeed`` and ``muon_testing`` under that path: its
   version label, file, accelerator. SITE (``--site``) is a scratch directory by default, out of
   OUT, so that OUT holds only results.
b. ``seed``: the seed table on the device: two Linear(64, 64), 3 optimizer steps of 8 samples,
   W=1, ZeRO-3, gas 1 and gas 4, fp32 and bf16, on stock 0.19.7, stock 0.19.8 and patched 0.19.8
   (``bench/worker.py`` under ``torch.distributed.run``): Newton-Schulz calls over the 3 steps
   and the relative weight difference gas 4 vs gas 1.
c. ``tests``: W=1 correctness tests of the patched 0.19.8 build from ``tests/unit`` on the
   device (pytest node ids in ``TESTS``), one pytest run per group, each test's outcome.
d. ``measure``: patched vs stock 0.19.8: Newton-Schulz batched vs one by one on Llama-shaped
   matrices, fp32 and bf16 (``bench/ns_batch.py``, patched only: stock has no batched entry
   point); ``engine.step()`` time, the boundary micro-step, the Newton-Schulz share of the step
   and ``max_memory_allocated`` of the step, Muon vs AdamW, on a Llama-shaped model
   (``bench/worker.py``, workload ``llama-gpu``: 226M parameters; ``llama64`` with ``--device
   cpu``), ``--repeats`` launches per build, interleaved, with the spread.

A step's ``status``: ``ok``; ``failed`` (``error`` says why); ``stopped-budget`` (the budget ran
out while it ran: what it finished is kept); ``skipped-budget`` (not started, too little time
left); ``skipped`` (not applicable, ``error`` says why, e.g. its build did not install).
``OUT/summary.txt`` is the human-readable table of the same; ``OUT/gpu-check.log`` holds every
command and its output. Exit status 0 when no step failed (skips included), else 1.

Choices: TorchDynamo off (``TORCHDYNAMO_DISABLE=1``) except in the compiled test, as in the
benchmark (a compile per matrix shape would eat the budget); in the seed table and the
measurements Muon's auxiliary Adam and AdamW are torch's (``"torch_adam": true``): DeepSpeed's
FusedAdam would be JIT-compiled once per build (about a minute each with nvcc) for figures that do
not measure it; the tests keep their configs (a user's default: FusedAdam, compiled once, for the
patched 0.19.8 build, in the first test group; CPU Adam for the offload group, last); no op is pre-built (``DS_BUILD_OPS``
unset), each build JIT-compiles what it uses into ``<--extensions-dir>/<build>`` (on the CPU the
shared-memory comm op, about 1.5 minutes per build on 2 cores; the tests' CPU offload needs CPU Adam
on any device, a few minutes: they come last). ``--device cpu`` runs the same code with the CPU
accelerator and tiny sizes, as a dry run on a machine without GPU.

Worker mode (``python gpu_check.py --worker diff A B``) runs under a build's Python and needs torch.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUILDS = ("patched-0.19.8", "patched-0.19.7", "stock-0.19.8", "stock-0.19.7")
SEED_BUILDS = ("stock-0.19.7", "stock-0.19.8", "patched-0.19.8")
MEASURE_BUILDS = ("patched-0.19.8", "stock-0.19.8")
TEST_BUILD = "patched-0.19.8"
STATUSES = ("ok", "failed", "stopped-budget", "skipped-budget", "skipped")
TESTING_SITE = "testing"  # SITE/testing: muon_testing, the tests' package, shared by every build

ZERO = "tests/unit/runtime/zero/"
SINGLE = ZERO + "test_zero3_muon_single_rank.py::TestZero3MuonSingleRank::"
CHECKPOINT = "tests/unit/checkpoint/test_zero3_muon_checkpoint.py::TestZero3MuonCheckpointOneRank::"
TESTS = (
    ("fp32_reference", [
        ZERO + "test_zero3_muon_gas.py::TestZero3MuonGas::test_gas4_matches_gas1_zero2_and_reference[1]",
        ZERO + "test_zero3_muon_gas.py::TestZero3MuonGas::test_clipping_feeds_the_momentum_like_clip_grad_norm[1]"
    ]),
    ("bf16", [SINGLE + "test_precision_matches_replay[bf16]", SINGLE + "test_precision_matches_replay[bf16_clip]"]),
    ("fp16_overflow", [SINGLE + "test_precision_matches_replay[fp16]"]),
    ("checkpoint",
     [CHECKPOINT + "test_resume_is_bit_identical[fp32]", CHECKPOINT + "test_resume_is_bit_identical[bf16]"]),
    ("compiled", [SINGLE + "test_compiled_newton_schulz_matches_eager_reference"]),
    ("offload",
     [SINGLE + "test_matches_reference[offload_optimizer]", SINGLE + "test_matches_reference[offload_param]"]),
)
"""Step (c): test groups, in order, and their pytest node ids (W=1 parametrizations)."""

SIZES = {
    "cuda": dict(ns_hidden=4096,
                 ns_intermediate=11008,
                 ns_batch=4,
                 llama="llama-gpu",
                 micro_batch=4,
                 steps=3,
                 warmup=1),
    "cpu": dict(ns_hidden=64, ns_intermediate=172, ns_batch=4, llama="llama64", micro_batch=2, steps=2, warmup=1),
}
"""Sizes by device: Newton-Schulz shapes (a Llama layer's hidden x hidden and intermediate x hidden,
Llama-2-7B's on the GPU), the step workload (``bench/worker.py`` LLAMAS key) and its steps."""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BudgetExceeded(Exception):
    """The step's command ran past the check's deadline."""


class Check:
    """The run's state: options, deadline, log, results; ``step`` runs and records one step."""

    def __init__(self, args, root):
        self.args, self.root = args, Path(root)
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.gettempdir()) / f"zero3muon-gpu-check-{os.getuid()}"
        self.site = Path(args.site).resolve() if args.site else scratch / "site"
        self.extensions = Path(args.extensions_dir).resolve() if args.extensions_dir else scratch / "torch_extensions"
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.logfile = open(self.out / "gpu-check.log", "w")
        self.results = dict(device=args.device,
                            budget_s=args.budget_s,
                            python=args.python,
                            wheels=str(args.wheels),
                            site=str(self.site),
                            extensions=str(self.extensions),
                            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            steps={})
        self.installed = {}

    def log(self, msg):
        line = f"[gpu-check {time.monotonic() - self.started:6.1f}s] {msg}"
        print(line, flush=True)
        self.logfile.write(line + "\n")
        self.logfile.flush()

    def remaining(self):
        return self.deadline - time.monotonic()

    def save(self):
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")

    def step(self, name, func, min_seconds=5.0):
        """Run ``func()`` (returns the step's result, a JSON-able dict) unless under ``min_seconds``
        of budget are left; record status, seconds and result or error under ``name``."""
        rec = dict(status="skipped-budget", seconds=0.0)
        self.results["steps"][name] = rec
        if self.remaining() < min_seconds:
            self.log(f"{name}: skipped, {self.remaining():.0f} s of budget left")
            self.save()
            return rec
        self.log(f"{name}: start")
        start = time.monotonic()
        try:
            rec["result"] = func()
            rec["status"] = "ok"
        except BudgetExceeded as e:
            rec.update(status="stopped-budget", error=str(e))
        except Skip as e:
            rec.update(status="skipped", error=str(e))
        except Exception as e:  # noqa: BLE001 - recorded, the next step runs
            rec.update(status="failed", error=f"{type(e).__name__}: {e}")
        rec["seconds"] = round(time.monotonic() - start, 1)
        self.log(f"{name}: {rec['status']} in {rec['seconds']} s" +
                 (f" ({rec['error'][:300]})" if "error" in rec else ""))
        self.save()
        return rec

    def env(self, build, **extra):
        """Environment of a build's subprocess: its target dir, muon_testing's and the deps dir on PYTHONPATH."""
        env = dict(os.environ)
        for key in ("DS_BUILD_OPS", "PYTHONHOME"):
            env.pop(key, None)
        paths = [str(self.site / build), str(self.site / TESTING_SITE), str(self.site / "deps")]
        env.update(PYTHONPATH=os.pathsep.join(paths),
                   DS_ACCELERATOR=self.args.device,
                   PYTHONSAFEPATH="1",
                   TORCH_EXTENSIONS_DIR=str(self.extensions / build),
                   TORCHDYNAMO_DISABLE="1",
                   PYTHONWARNINGS="ignore::FutureWarning",
                   PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def run(self, cmd, env=None, cwd=None, partial=None):
        """Run ``cmd`` until it ends or the budget does; log it; return stdout+stderr. Raises
        RuntimeError on a non-zero exit, BudgetExceeded at the deadline (``partial`` is then
        called with the output so far, to keep what finished)."""
        cmd = [str(c) for c in cmd]
        self.logfile.write("$ " + " ".join(cmd) + "\n")
        self.logfile.flush()
        timeout = self.remaining()
        if timeout <= 1:
            raise BudgetExceeded("no budget left to start it")
        # Own process group; at the deadline SIGTERM first: torchrun passes it on to its ranks,
        # which run in sessions of their own and would outlive a plain kill of torchrun (a rank
        # left holding the GPU or a half-built op's lock).
        proc = subprocess.Popen(cmd,
                                env=env,
                                cwd=cwd or self.root,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out = _stop(proc)
            self.logfile.write(out + "\n[stopped at the budget]\n")
            if partial is not None:
                partial(out)
            raise BudgetExceeded(f"budget reached after {timeout:.0f} s") from None
        res = subprocess.CompletedProcess(cmd, proc.returncode, out)
        self.logfile.write(res.stdout + f"\n[exit {res.returncode}]\n")
        self.logfile.flush()
        if res.returncode != 0:
            tail = [ln for ln in res.stdout.splitlines() if ln.strip()][-6:]
            raise RuntimeError(f"exit {res.returncode}: " + " | ".join(tail)[-800:])
        return res.stdout

    def python(self, build, code, **extra_env):
        return self.run([self.args.python, "-c", code], env=self.env(build, **extra_env))


def _stop(proc, grace_s=20.0):
    """Stop ``proc`` (a session leader) and what it started: SIGTERM to its group (torchrun ends its
    ranks on SIGTERM), then SIGKILL after ``grace_s`` seconds. Returns the output read so far."""
    import signal
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            out, _ = proc.communicate(timeout=wait)
            return out or ""
        except subprocess.TimeoutExpired:
            continue
    out, _ = proc.communicate()
    return out or ""


class Skip(Exception):
    """The step does not apply (e.g. its build did not install); the message says why."""


# ----------------------------------------------------------------------------- (a) install

PROBE = r"""
import importlib.metadata as md, json, sys
names = json.loads(sys.argv[1])
missing = []
for n in names:
    try:
        md.version(n)
    except md.PackageNotFoundError:
        missing.append(n)
print(json.dumps(dict(missing=missing, python="%d.%d" % sys.version_info[:2])))
"""

IMPORT_CHECK = r"""
import json, os
import deepspeed, pydantic, hjson, torch, muon_testing.compare
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
report = dict(version=deepspeed.__version__, file=deepspeed.__file__, pydantic=pydantic.VERSION,
              muon_testing_file=muon_testing.compare.__file__,
              pydantic_file=pydantic.__file__, hjson_file=hjson.__file__, torch=torch.__version__,
              accelerator=acc.device_name(), device=acc.current_device_name(), device_count=acc.device_count())
try:
    from deepspeed.runtime.zero.muon import _build_info
    report["patch"] = _build_info.PATCH_VERSION
except ImportError:
    report["patch"] = None
print("IMPORT " + json.dumps(report))
"""


def install(check, manifest):
    """Step (a): each build into its own --target dir, the missing dependencies into deps/."""
    wheels = Path(check.args.wheels)
    deps = [e for e in manifest["files"] if e["kind"] == "dependency"]
    probe = json.loads(check.run([check.args.python, "-c", PROBE, json.dumps([e["name"] for e in deps])]).strip())
    need = [e for e in deps if e["name"] in probe["missing"]]
    result = dict(python=probe["python"], deps_installed=[e["file"] for e in need], builds={})
    cp_tag = "cp" + probe["python"].replace(".", "")
    compiled = [e["file"] for e in need if not _wheel_fits(e["file"], cp_tag)]
    if compiled:
        raise RuntimeError(f"the interpreter is Python {probe['python']} and lacks {compiled}, built for Python "
                           f"{manifest['python_version']}: make a wheelhouse with `dev.py wheelhouse "
                           f"--python-version {probe['python']}`")
    if need:
        _pip_target(check, check.site / "deps", [wheels / e["file"] for e in need])
    testing = [e for e in manifest["files"] if e["kind"] == "testing"]
    if not testing:
        raise RuntimeError("the wheelhouse holds no muon_testing wheel (the tests' package, testing/): make it "
                           "again with `dev.py wheelhouse`")
    _pip_target(check, check.site / TESTING_SITE, [wheels / testing[0]["file"]],
                stamp=wheel_contents_digest(wheels / testing[0]["file"]))
    result["testing"] = testing[0]["file"]
    for build in check.args.builds:
        kind, base = build.split("-", 1)
        entry = [e for e in manifest["files"] if e["kind"] == kind and e["base"] == base]
        if not entry:
            result["builds"][build] = dict(status="failed", error=f"no {kind} {base} wheel in the wheelhouse")
            continue
        try:
            _pip_target(check,
                        check.site / build, [wheels / entry[0]["file"]],
                        stamp=wheel_contents_digest(wheels / entry[0]["file"]))
            out = check.python(build, IMPORT_CHECK)
            report = json.loads(next(ln for ln in out.splitlines() if ln.startswith("IMPORT "))[len("IMPORT "):])
            expected = entry[0]["version"]
            if report["version"] != expected:
                raise RuntimeError(f"imported deepspeed {report['version']}, expected {expected}")
            if not report["file"].startswith(str(check.site / build)):
                raise RuntimeError(f"imported {report['file']}, not the build under {check.site / build}")
            result["builds"][build] = dict(status="ok", **report)
            check.installed[build] = report
        except (RuntimeError, StopIteration, BudgetExceeded) as e:
            if isinstance(e, BudgetExceeded):
                raise
            result["builds"][build] = dict(status="failed", error=str(e))
    failed = [b for b, r in result["builds"].items() if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"not installed: {', '.join(failed)}; " + json.dumps(result))
    return result


def _wheel_fits(filename, cp_tag):
    """Whether a wheel's python tag (PEP 427) installs on CPython ``cp_tag`` (e.g. "cp312"): a pure
    ``py3`` wheel, the ``cp_tag`` itself or the stable ABI ``abi3``."""
    _name, _version, *tags = filename[:-len(".whl")].split("-")
    python_tags, abi = tags[-3].split("."), tags[-2]
    if any(t in ("py3", "py2", cp_tag) for t in python_tags):
        return True
    minor = lambda tag: int(tag[3:]) if tag.startswith("cp3") and tag[3:].isdigit() else None  # noqa: E731
    # abi3: built for the oldest CPython it names, runs on every later one
    return abi == "abi3" and any(minor(t) is not None and minor(t) <= minor(cp_tag) for t in python_tags)


def wheel_contents_digest(path):
    """sha256 of a wheel's ``*.dist-info/RECORD`` (every file's own sha256): equal for two builds of
    the same files, unlike the wheel's, whose zip entries carry build times."""
    import hashlib
    import zipfile
    with zipfile.ZipFile(path) as zf:
        records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise RuntimeError(f"{path}: expected one .dist-info/RECORD, found {len(records)}")
        return hashlib.sha256(zf.read(records[0])).hexdigest()


def _pip_target(check, target, wheels, stamp=None):
    """``pip install --no-index --no-deps --target``; kept as it is when ``stamp`` (the wheel's
    contents digest) matches the previous install's: reinstalled files would be newer than the ops
    JIT-built from them, which ninja would then rebuild (minutes per op on a CPU)."""
    stamp_file = target / ".gpu-check-wheel.sha256"
    if stamp is not None and stamp_file.is_file() and stamp_file.read_text().strip() == stamp:
        check.log(f"  {target.name}: already installed from this wheel")
        return
    shutil.rmtree(target, ignore_errors=True)
    check.run([
        check.args.python, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-index", "--no-deps",
        "--no-compile", "--target", target, *wheels
    ])
    if stamp is not None:
        stamp_file.write_text(stamp + "\n")


# ----------------------------------------------------------------------------- (b) seed table


def worker_launch(check, build, configs, name):
    """``bench/worker.py`` under ``torch.distributed.run`` with one rank; returns its rows by name.
    Rows finished before the budget ran out are kept in ``check.partial_rows``."""
    workdir = check.out / "work" / f"{name}-{build}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "configs.json").write_text(json.dumps(configs))
    rows_file = workdir / "rows.jsonl"
    rows_file.write_text("")
    cmd = [
        check.args.python, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
        HERE / "worker.py", "--configs", workdir / "configs.json", "--out", rows_file, "--weights-dir", workdir
    ]

    def read_rows(_out=None):
        return {r["name"]: r for r in (json.loads(ln) for ln in rows_file.read_text().splitlines() if ln.strip())}

    try:
        check.run(cmd, env=check.env(build, OMP_NUM_THREADS=str(check.args.threads)))
    except BudgetExceeded:
        check.partial_rows = read_rows()
        raise
    return read_rows(), workdir


def seed_configs(device):
    return [
        dict(name=f"seed-{dtype}-gas{gas}",
             workload="seed64",
             stage=3,
             gas=gas,
             dtype=dtype,
             offload=False,
             micro_batch=8 // gas,
             steps=3,
             warmup=0,
             save_weights=True,
             torch_adam=True,
             memory_step=False) for dtype in ("fp32", "bf16") for gas in (1, 4)
    ]


def seed(check):
    table = {}
    builds = [b for b in SEED_BUILDS if b in check.args.builds]
    if not builds:
        raise Skip(f"none of {SEED_BUILDS} among --builds")
    for build in builds:
        if build not in check.installed:
            table[build] = dict(error="not installed")
            continue
        try:
            rows, workdir = worker_launch(check, build, seed_configs(check.args.device), "seed")
        except RuntimeError as e:
            table[build] = dict(error=str(e))
            continue
        finally:
            check.results["steps"]["seed"]["result"] = dict(table=table)
        for dtype in ("fp32", "bf16"):
            g1, g4 = rows.get(f"seed-{dtype}-gas1"), rows.get(f"seed-{dtype}-gas4")
            if not (g1 and g4):
                table[f"{build}/{dtype}"] = dict(error="missing rows")
                continue
            out = check.run([
                check.args.python,
                Path(__file__), "--worker", "diff", workdir / f"{g1['name']}.pt", workdir / f"{g4['name']}.pt"
            ],
                            env=check.env(build))
            diff = json.loads(out.strip().splitlines()[-1])
            table[f"{build}/{dtype}"] = dict(ns_calls_gas1=round(g1["ns_calls_per_step"] * 3),
                                             ns_calls_gas4=round(g4["ns_calls_per_step"] * 3),
                                             ns_calls_micro_gas4=round(g4["ns_calls_micro_per_step"] * 3),
                                             rel_diff_gas1_gas4=diff["rel_diff"])
    errors = [k for k, v in table.items() if "error" in v]
    if errors:
        raise RuntimeError(f"seed rows failed: {errors}: {json.dumps(table)[:600]}")
    return dict(table=table)


# ----------------------------------------------------------------------------- (c) tests


def tests(check):
    if TEST_BUILD not in check.installed:
        raise Skip(f"{TEST_BUILD} did not install")
    groups = check.results["steps"]["tests"].setdefault("groups", {})
    for group, ids in TESTS:
        if check.remaining() < 20:
            groups[group] = dict(status="skipped-budget")
            continue
        xml = check.out / "work" / f"tests-{group}.xml"
        xml.parent.mkdir(parents=True, exist_ok=True)
        xml.unlink(missing_ok=True)
        start = time.monotonic()
        cmd = [check.args.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={xml}", *ids]
        env = check.env(TEST_BUILD, DS_UNITTEST_TIMEOUT=str(max(60, int(check.remaining()))))
        try:
            check.run(cmd, env=env)
            status = "ok"
        except BudgetExceeded:
            status = "stopped-budget"
        except RuntimeError:
            status = "failed"
        groups[group] = dict(status=status, seconds=round(time.monotonic() - start, 1), tests=junit_results(xml))
        if status == "ok" and any(t["outcome"] == "skipped" for t in groups[group]["tests"].values()):
            groups[group]["status"] = "skipped"
        check.log(f"  tests {group}: {groups[group]['status']} "
                  f"({', '.join(t['outcome'] for t in groups[group]['tests'].values()) or 'no results'})")
        check.save()
    bad = {g: r["status"] for g, r in groups.items() if r["status"] in ("failed", "stopped-budget")}
    if any(s == "failed" for s in bad.values()):
        raise RuntimeError(f"test groups failed: {bad}")
    if bad:
        raise BudgetExceeded(f"test groups stopped: {bad}")
    return dict(groups=groups)


def junit_results(xml):
    """``{node id tail: {outcome, seconds, message}}`` from pytest's --junitxml file (may be absent)."""
    import xml.etree.ElementTree as ET
    if not Path(xml).is_file():
        return {}
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "")[:400]
        props = {q.get("name"): q.get("value") for q in case.iter("property")}
        results[f"{case.get('classname')}::{case.get('name')}"] = dict(outcome=outcome,
                                                                       ranks=props.get("ranks"),
                                                                       seconds=float(case.get("time", 0)),
                                                                       message=message)
    return results


# ----------------------------------------------------------------------------- (d) measurements


def measure(check):
    sizes = SIZES[check.args.device]
    result = check.results["steps"]["measure"].setdefault("result", {})
    if "patched-0.19.8" in check.installed:
        ns = {}
        for dtype in ("fp32", "bf16"):
            out = check.run([
                check.args.python, HERE / "ns_batch.py", "--device", check.args.device, "--dtype", dtype, "--shapes",
                f"llama:{sizes['ns_hidden']}:{sizes['ns_intermediate']}", "--batch",
                str(sizes["ns_batch"]), "--repeats",
                str(max(3, check.args.repeats)), "--json", "--threads",
                str(check.args.threads)
            ],
                            env=check.env("patched-0.19.8"))
            ns[dtype] = [json.loads(ln[len("JSON "):]) for ln in out.splitlines() if ln.startswith("JSON ")]
        result["ns_batch"] = ns
        check.save()
    samples = {}
    configs = [
        dict(name=f"{sizes['llama']}-{opt}",
             workload=sizes["llama"],
             stage=3,
             gas=2,
             dtype="bf16",
             offload=False,
             micro_batch=sizes["micro_batch"],
             steps=sizes["steps"],
             warmup=sizes["warmup"],
             optimizer=opt,
             torch_adam=True) for opt in ("muon", "adamw")
    ]
    for rep in range(check.args.repeats):
        for build in [b for b in MEASURE_BUILDS if b in check.args.builds]:
            if build not in check.installed:
                continue
            check.partial_rows = {}
            try:
                rows, _ = worker_launch(check, build, configs, f"measure-r{rep}")
            except BudgetExceeded:
                rows = check.partial_rows
                _add_samples(samples, build, rows)
                result["steps"] = summarize_samples(samples)
                raise
            _add_samples(samples, build, rows)
            result["steps"] = summarize_samples(samples)
            check.save()
    return result


KEYS = ("step_time", "boundary_time", "boundary_step_time", "micro_time", "ns_seconds_per_step",
        "alloc_peak_step_bytes", "optimizer_state_bytes", "ns_calls_per_step", "muon_elements")


def _add_samples(samples, build, rows):
    for name, row in rows.items():
        for key in KEYS:
            if row.get(key) is not None:
                samples.setdefault(build, {}).setdefault(name, {}).setdefault(key, []).append(row[key])


def summarize_samples(samples):
    """Per build, workload and key: median, min, max and count over the repeats; plus the Newton-Schulz
    share of the boundary ``step()`` and the ratios patched / stock 0.19.8 of the medians."""
    out = {}
    for build, by_name in samples.items():
        for name, by_key in by_name.items():
            row = out.setdefault(build, {}).setdefault(name, {})
            for key, values in by_key.items():
                row[key] = dict(median=statistics.median(values), min=min(values), max=max(values), n=len(values))
            if "ns_seconds_per_step" in row and "boundary_step_time" in row:
                row["ns_share_of_step"] = row["ns_seconds_per_step"]["median"] / row["boundary_step_time"]["median"]
    if "patched-0.19.8" in out and "stock-0.19.8" in out:
        ratios = {}
        for name, row in out["patched-0.19.8"].items():
            stock = out["stock-0.19.8"].get(name, {})
            for key in ("boundary_step_time", "step_time", "alloc_peak_step_bytes"):
                if key in row and key in stock and stock[key]["median"]:
                    ratios.setdefault(name, {})[key] = row[key]["median"] / stock[key]["median"]
        out["patched_over_stock_0.19.8"] = ratios
    return out


# ----------------------------------------------------------------------------- summary


def summary_text(results):
    lines = [
        f"gpu-check on {results['device']}: {results.get('gpu', '')} budget {results['budget_s']} s, "
        f"elapsed {results.get('elapsed_s')} s, python {results['python']}"
    ]
    for name, rec in results["steps"].items():
        lines.append(f"{name:10} {rec['status']:15} {rec['seconds']:7.1f} s  {rec.get('error', '')[:200]}")
    inst = results["steps"].get("install", {}).get("result") or {}
    for build, r in (inst.get("builds") or {}).items():
        lines.append(f"  install {build:16} {r['status']:6} {r.get('version', r.get('error', ''))} "
                     f"{r.get('accelerator', '')} {r.get('device', '')}")
    seed_rec = (results["steps"].get("seed", {}).get("result") or {}).get("table", {})
    if seed_rec:
        lines.append("  seed table (ZeRO-3, W=1, 3 steps): build/dtype  NS calls gas1 / gas4 (micro-steps)  "
                     "rel. weight diff gas1 vs gas4")
        for key, r in seed_rec.items():
            if "error" in r:
                lines.append(f"    {key:22} {r['error'][:150]}")
            else:
                lines.append(f"    {key:22} {r['ns_calls_gas1']} / {r['ns_calls_gas4']} ({r['ns_calls_micro_gas4']})"
                             f"   {r['rel_diff_gas1_gas4']:.2e}")
    for group, r in ((results["steps"].get("tests", {}).get("groups")) or {}).items():
        lines.append(f"  tests {group:16} {r['status']:15} {r.get('seconds', 0):6.1f} s")
        for tid, t in r.get("tests", {}).items():
            lines.append(f"      {t['outcome']:8} {tid.rsplit('::', 1)[-1]} [{t.get('ranks')}] {t['message'][:120]}")
    meas = results["steps"].get("measure", {}).get("result") or {}
    for dtype, rows in (meas.get("ns_batch") or {}).items():
        for r in rows:
            lines.append(f"  NS {dtype} {r['shape']:>11} x{r['batch']}: one by one {r['one_ms']:.2f} ms "
                         f"[{r['one_min_ms']:.2f}-{r['one_max_ms']:.2f}], batched {r['batched_ms']:.2f} ms "
                         f"[{r['batched_min_ms']:.2f}-{r['batched_max_ms']:.2f}], ratio {r['ratio']:.2f}")
    for build, by_name in (meas.get("steps") or {}).items():
        if build.startswith("patched_over"):
            for name, ratios in by_name.items():
                lines.append(f"  patched/stock 0.19.8 {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
            continue
        for name, row in by_name.items():

            def fmt(key, scale=1.0, unit=""):
                if key not in row:
                    return f"{key} -"
                s = row[key]
                return f"{key} {s['median'] * scale:.4g}{unit} [{s['min'] * scale:.4g}-{s['max'] * scale:.4g}] n={s['n']}"

            lines.append(f"  {build} {name}: " + "; ".join([
                fmt("boundary_step_time", 1e3, " ms"),
                fmt("boundary_time", 1e3, " ms"),
                fmt("ns_seconds_per_step", 1e3, " ms"),
                fmt("alloc_peak_step_bytes", 2**-20, " MiB")
            ]) + (f"; NS share of step() {row['ns_share_of_step']:.2f}" if "ns_share_of_step" in row else ""))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dev.py gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", required=True, help="a `dev.py wheelhouse` directory")
    p.add_argument("--out", required=True, help="output directory (results.json, summary.txt, gpu-check.log, site/)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="DS_ACCELERATOR (cpu: a dry run)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop after this many seconds (default %(default)s)")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch (default: this one)")
    p.add_argument("--site",
                   help="where the builds are installed (default: $TMPDIR/zero3muon-gpu-check-<uid>/site; "
                   "kept between runs, a build is reinstalled only when its wheel's contents changed)")
    p.add_argument("--extensions-dir",
                   help="parent of each build's TORCH_EXTENSIONS_DIR (default: "
                   "$TMPDIR/zero3muon-gpu-check-<uid>/torch_extensions)")
    p.add_argument("--builds", nargs="+", default=list(BUILDS), choices=BUILDS, help="builds to install (default: all)")
    p.add_argument("--steps",
                   nargs="+",
                   default=["install", "seed", "tests", "measure"],
                   choices=("install", "seed", "tests", "measure"),
                   help="steps to run, in this order (default: all)")
    p.add_argument("--tests", nargs="+", choices=[g for g, _ in TESTS], help="test groups of the tests step (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="launches per build in the measure step (default %(default)s)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="OMP threads of a rank (default: half the cores, %(default)s here)")
    args = p.parse_args(argv)
    if args.budget_s <= 0 or args.repeats < 1:
        p.error("--budget-s and --repeats must be positive")
    return args


def device_probe(check):
    """The GPU (or the CPU for --device cpu), before anything starts; raises if CUDA is absent."""
    code = (
        "import json, torch; ok = torch.cuda.is_available(); print('PROBE ' + json.dumps(dict(torch=torch.__version__,"  #ignore-cuda
        " cuda=ok, count=torch.cuda.device_count() if ok else 0, name=torch.cuda.get_device_name(0) if ok else None,"  #ignore-cuda
        " cuda_version=torch.version.cuda)))")
    out = check.run([check.args.python, "-c", code])
    probe = json.loads(next(ln for ln in out.splitlines() if ln.startswith("PROBE "))[6:])
    if check.args.device == "cuda" and not probe["cuda"]:
        raise RuntimeError(f"no CUDA device visible to {check.args.python} (torch {probe['torch']}); "
                           "run with --device cpu for a dry run")
    return probe


def main(argv=None, root=ROOT):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.tests:
        global TESTS
        TESTS = tuple(t for t in TESTS if t[0] in args.tests)
    check = Check(args, root)
    sys.path.insert(0, str(Path(root) / "build_backend"))
    import zero3muon_wheelhouse as wh
    manifest = {}

    def verify():
        manifest.update(wh.verify(args.wheels))
        return dict(bases=manifest["bases"], files=len(manifest["files"]), total_bytes=manifest["total_bytes"])

    probe = check.step("device", lambda: device_probe(check))
    if probe["status"] == "ok":
        r = probe["result"]
        check.results["gpu"] = f"{r['name']} x{r['count']}" if r["cuda"] else "no GPU"
    wheels = check.step("wheels", verify)
    go = probe["status"] == "ok" and wheels["status"] == "ok"
    for name, func in (("install", lambda: install(check, manifest)), ("seed", lambda: seed(check)),
                       ("tests", lambda: tests(check)), ("measure", lambda: measure(check))):
        if name not in args.steps:
            continue
        if not go:
            check.results["steps"][name] = dict(status="skipped",
                                                seconds=0.0,
                                                error="device or wheelhouse check failed")
            continue
        check.step(name, func)
    check.save()
    text = summary_text(check.results)
    (check.out / "summary.txt").write_text(text)
    print(text, end="", flush=True)
    check.log(f"wrote {check.out / 'results.json'}, {check.out / 'summary.txt'}, {check.out / 'gpu-check.log'}")
    return 1 if any(r["status"] == "failed" for r in check.results["steps"].values()) else 0


def _worker(argv):
    """Worker mode under a build's Python: ``diff A B`` prints the relative weight difference of two
    ``torch.save``d weight dicts as JSON."""
    if argv[:1] == ["diff"]:
        import torch
        from muon_testing.compare import relative_difference
        a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in argv[1:3])
        print(json.dumps(dict(rel_diff=relative_difference(a, b))))
        return 0
    raise SystemExit(f"unknown worker command {argv!r}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main())
