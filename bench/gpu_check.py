# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python3 dev.py gpu-check``: the patch checked on an offline GPU node, within a time budget.

The driver (this module's ``main``) is stdlib-only, like dev.py: it runs under the node's
``python3`` (``--python``, default: the interpreter running it) and starts every build's work as
a subprocess of that same interpreter with ``PYTHONPATH=<the build's --target dir>:<testing>:<deps>``,
so nothing is installed into the node's environment. It is sized for a borrowed node: one command
of at most 10 minutes, at most 8 files of at most 16 MiB brought back from the output folder, none
more than 2 folders down. Steps, in this order (each recorded in ``OUT/results.json`` with
``status``, ``seconds``, its budget and its result; ``STEP_BUDGETS`` gives each step's share of
``--budget-s`` and why):

a. ``install``: only the builds the chosen steps use (patched and stock DeepSpeed 0.19.8, stock
   0.19.7 for the seed table): ``pip install --no-index --no-deps --target SITE/<build>`` of its
   wheel from ``--wheels`` (a ``dev.py wheelhouse``, sha256-checked against its manifest), the
   dependencies the interpreter lacks or has older than the wheelhouse's into ``SITE/deps`` (kept
   while the wheels are the same), the tests' package ``muon_testing`` into ``SITE/testing``, then
   under that path ``import deepspeed``: version label, file, accelerator, the Newton-Schulz compute
   dtype upstream's rule gives there, and every installed requirement's version against what
   DeepSpeed and its dependencies require (a mismatch fails the build). Then, in the background
   while the next steps run, the patched 0.19.8 build JIT-compiles the ops the tests use (FusedAdam,
   CPU Adam for the offload group): built or failed, recorded under ``ops``.
b. ``exchange``: the exchange's device code on one device: ``muon_testing.threaded_exchange.
   device_check`` on ``cuda:0`` (W = 2..8 simulated ranks by threads, both layouts, depths 1 and 2,
   three bucket sizes) against upstream's update on the same device; pass as
   ``test_the_exchange_on_the_accelerator_up_to_eight_ranks``: bit-equal on the CPU, on CUDA a
   largest relative difference of at most the NS compute dtype's eps. Its rows are recorded.
c. ``measure``: patched vs stock 0.19.8: ``engine.step()`` time, the boundary micro-step, the
   Newton-Schulz time and share of the step and ``max_memory_allocated`` of the step, Muon vs AdamW,
   on a Llama-shaped model (``bench/worker.py``, workload ``llama-gpu``: 226M parameters;
   ``llama64`` with ``--device cpu``), ``--repeats`` launches per build, interleaved, with the
   spread; then Newton-Schulz batched vs one by one (``bench/ns_batch.py``, patched only: stock has
   no batched entry point) on fp32 and bf16 input with upstream's compute dtype, and on fp32 input
   computed in fp32. Every row says which NS dtype ran.
d. ``tests``: W=1 correctness tests of the patched 0.19.8 build from ``tests/unit`` on the device
   (pytest node ids in ``TESTS``), one pytest run per group, after the background op builds ended.
e. ``seed``: the seed table: two Linear(64, 64), 3 optimizer steps of 8 samples, W=1, ZeRO-3,
   gas 1 and gas 4, fp32 and bf16, each with upstream's NS compute dtype (fp16 "gram" wherever the
   accelerator has fp16) and with NS forced to fp32 (``worker.py``'s ``ns_dtype``), on stock
   0.19.7, stock 0.19.8 and patched 0.19.8: NS calls over the 3 steps (CPU facts, repeated for
   free), the relative weight difference gas 4 vs gas 1 and the NS dtypes that ran. Last: what it
   adds on a GPU is the size of that difference in the GPU's arithmetic.

A step's ``status``: ``ok``; ``failed`` (``error`` says why); ``refused`` (its prerequisite, a
build from ``install``, is missing: nothing ran); ``stopped-budget`` (its budget ran out while it
ran: what it finished is kept); ``skipped-budget`` (not started, too little time left);
``skipped`` (not applicable, ``error`` says why). Exit status 0 when no step failed or was refused
(skips included), else 1; 2 for bad arguments or an ``--out`` that would break the return rules.

Output: ``OUT`` holds exactly ``OUT_FILES`` (results.json, summary.txt, gpu-check.log), flat; an
``OUT`` holding anything else is refused before anything runs, and at the end the driver checks the
folder against the return limits (``check_out_dir``: count, depth, names, sizes; the log is cut in
the middle to stay under its cap) and records what it found in results.json. Everything else (the
installs, JIT-built ops, the benchmark's configs, rows and weights, the tests' junit files) goes to
the scratch directory (``--scratch``, default ``$TMPDIR/zero3muon-gpu-check-<uid>-<checkout hash>``). At start the
driver takes a lock of its own on the extensions directory (a second run on the same directory is
refused) and deletes the ``lock`` files that a build killed at the budget left there (torch's
cpp_extension waits on such a file forever).

Choices: TorchDynamo off (``TORCHDYNAMO_DISABLE=1``) except in the compiled test, as in the
benchmark (a compile per matrix shape would eat the budget); in the seed table and the
measurements Muon's auxiliary Adam and AdamW are torch's (``"torch_adam": true``), so no FusedAdam
build is on their path; the tests keep their configs (a user's default: FusedAdam; CPU Adam for the
offload group), built once in the background. No op is pre-built (``DS_BUILD_OPS`` unset): each
build JIT-compiles what it uses into ``<--extensions-dir>/<build>``. ``--device cpu`` runs the
same code with the CPU accelerator and tiny sizes, as a dry run on a machine without GPU.

Worker mode (``python gpu_check.py --worker diff A1 B1 [A2 B2 ...]``) runs under a build's Python
and needs torch.
"""

import argparse
import hashlib
import json
import os
import re
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
BUILDS = ("patched-0.19.8", "stock-0.19.8", "stock-0.19.7")
SEED_BUILDS = ("stock-0.19.7", "stock-0.19.8", "patched-0.19.8")
MEASURE_BUILDS = ("patched-0.19.8", "stock-0.19.8")
TEST_BUILD = "patched-0.19.8"
STEPS = ("install", "exchange", "measure", "tests", "seed")
"""The steps in the order they run: the measurements and the tests first, the seed table last."""
STEP_BUILDS = {"exchange": (TEST_BUILD, ), "measure": MEASURE_BUILDS, "tests": (TEST_BUILD, ), "seed": SEED_BUILDS}
"""The builds each step uses (those among ``--builds``); ``install`` installs their union only."""
STATUSES = ("ok", "failed", "refused", "stopped-budget", "skipped-budget", "skipped")
TESTING_SITE = "testing"  # SITE/testing: muon_testing, the tests' package, shared by every build

STEP_BUDGETS = {
    "cuda": dict(install=60, exchange=60, measure=190, tests=170, seed=90),
    "cpu": dict(install=None, exchange=None, measure=None, tests=None, seed=None),
}
"""Seconds each step may take at most (``None``: only ``--budget-s`` bounds it). On CUDA, against these estimates
for one H200 (docs/user-guide.md, "Offline GPU nodes", derives them from this machine's dry run; none is measured
on a GPU yet): install 35 s (three builds' pip and import checks), exchange 30 s (168 small threaded runs), measure
175 s (6 launches of the 226M model, 1 of ns_batch), tests 160 s (6 pytest runs, the compiled one with Inductor;
FusedAdam and CPU Adam built in the background from the end of install on, about 90 s, during exchange and measure),
seed 60 s (3 launches). Measurements and tests end by about 410 s of the default 480; the seed table comes last and
is what the budget cuts first. A step that hangs stops at its cap and the next one runs; one that ends early leaves
its time to the next."""

TEST_OPS = {"offload": ("CPUAdamBuilder", )}
"""The JIT-built ops each test group needs (default: FusedAdam, the tests' Adam): built in the background."""

OUT_FILES = ("results.json", "summary.txt", "gpu-check.log")
"""All that ``--out`` holds, flat."""
OUT_LIMITS = dict(files=8, depth=2, file_bytes=16 * 2**20)
"""What a borrowed node brings back from its output folder: files, folders down, bytes per file."""
LOG_CAP_BYTES = 8 * 2**20
"""gpu-check.log is cut in the middle beyond this (head and tail kept)."""
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")

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
"""Step (d): test groups, in order, and their pytest node ids (W=1 parametrizations)."""

SIZES = {
    "cuda":
    dict(ns_hidden=4096,
         ns_intermediate=11008,
         ns_batch=4,
         llama="llama-gpu",
         micro_batch=4,
         steps=3,
         warmup=1,
         device="cuda:0"),
    "cpu":
    dict(ns_hidden=64,
         ns_intermediate=172,
         ns_batch=4,
         llama="llama64",
         micro_batch=2,
         steps=2,
         warmup=1,
         device="cpu"),
}
"""Sizes by device: Newton-Schulz shapes (a Llama layer's hidden x hidden and intermediate x hidden,
Llama-2-7B's on the GPU), the step workload (``bench/worker.py`` LLAMAS key) and its steps, the exchange's device."""

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
"""``torch.finfo(dtype).eps`` by name (the driver has no torch): the exchange step's bound on CUDA."""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BudgetExceeded(Exception):
    """The step's command ran past the step's or the check's deadline."""


class Skip(Exception):
    """The step does not apply; the message says why."""


class Refused(Exception):
    """The step's prerequisite (a build from ``install``) is missing; the message says which."""


class OutError(Exception):
    """``--out`` (or a scratch path) would break the return rules; the message says how."""


def check_out_dir(out, allowed=OUT_FILES, limits=OUT_LIMITS):
    """The return rules applied to ``out``: a list of problems (empty where it complies). Each file must be directly
    under ``out`` (so ``out`` itself may be at most ``depth`` folders below the folder brought back), one of
    ``allowed`` (None: any plain name), at most ``file_bytes``, at most ``files`` of them; no links, no folders."""
    problems, files = [], []
    for path in sorted(Path(out).rglob("*")):
        rel = path.relative_to(out)
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{rel}: not a plain file")
        elif path.is_dir():
            problems.append(f"{rel}/: a folder (results are flat)")
        elif len(rel.parts) > 1:
            problems.append(f"{rel}: in a folder (results are flat)")
        else:
            files.append(path)
            if not PLAIN_NAME.match(path.name):
                problems.append(f"{rel}: a name of other characters than letters, digits, '.', '_', '-'")
            if allowed is not None and path.name not in allowed:
                problems.append(f"{rel}: not one of {', '.join(allowed)}")
            if path.stat().st_size > limits["file_bytes"]:
                problems.append(f"{rel}: {path.stat().st_size} bytes, over {limits['file_bytes']}")
    if len(files) > limits["files"]:
        problems.append(f"{len(files)} files, over {limits['files']}")
    return problems


class Check:
    """The run's state: options, deadlines, log, results; ``step`` runs and records one step."""

    def __init__(self, args, root):
        self.args, self.root = args, Path(root)
        self.out = Path(args.out).resolve()
        if self.out.exists() and not self.out.is_dir():
            raise OutError(f"--out {self.out} is not a folder")
        if self.out.is_dir():
            problems = check_out_dir(self.out)
            if problems:
                raise OutError(f"--out {self.out} holds what this check did not write ({'; '.join(problems[:5])}): "
                               "give an empty or new folder (the node brings back at most "
                               f"{OUT_LIMITS['files']} plain files, {OUT_LIMITS['depth']} folders down)")
        # one default per user and checkout: two checkouts' dry runs on one machine neither collide nor reinstall
        checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
        scratch = Path(args.scratch).resolve() if args.scratch else (Path(tempfile.gettempdir()) /
                                                                     f"zero3muon-gpu-check-{os.getuid()}-{checkout}")
        self.site = Path(args.site).resolve() if args.site else scratch / "site"
        self.extensions = Path(args.extensions_dir).resolve() if args.extensions_dir else scratch / "torch_extensions"
        self.work = scratch / f"work-{os.getpid()}"
        for name, path in (("--site", self.site), ("--extensions-dir", self.extensions), ("the work folder",
                                                                                          self.work)):
            if path == self.out or self.out in path.parents:
                raise OutError(f"{name} {path} is inside --out {self.out}: it would come back with the results; "
                               "give --scratch (or --site, --extensions-dir) outside it")
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.step_deadline = self.deadline
        self.logfile = open(self.out / "gpu-check.log", "w")
        self.results = dict(device=args.device,
                            budget_s=args.budget_s,
                            python=args.python,
                            wheels=str(args.wheels),
                            site=str(self.site),
                            extensions=str(self.extensions),
                            work=str(self.work),
                            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            steps={})
        self.installed = {}
        self.ops_proc = None
        self.driver_lock = None

    def log(self, msg):
        line = f"[gpu-check {time.monotonic() - self.started:6.1f}s] {msg}"
        print(line, flush=True)
        self.logfile.write(line + "\n")
        self.logfile.flush()

    def remaining(self):
        """Seconds left to the current step's deadline (its cap or the check's, whichever comes first)."""
        return min(self.deadline, self.step_deadline) - time.monotonic()

    def save(self):
        """results.json and summary.txt as they stand: a run killed at the device's timeout still returns both."""
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")
        try:
            text = summary_text(self.results)
        except Exception as e:  # a partial record the table cannot show yet: results.json has it
            text = f"summary not available yet ({type(e).__name__}: {e}); see results.json\n"
        (self.out / "summary.txt").write_text(text)

    def step(self, name, func, min_seconds=5.0):
        """Run ``func()`` (returns the step's result, a JSON-able dict) within the step's budget (``STEP_BUDGETS``)
        unless under ``min_seconds`` of the check's budget are left; record status, seconds and result or error
        under ``name``."""
        cap = STEP_BUDGETS[self.args.device].get(name)
        rec = dict(status="skipped-budget", seconds=0.0, budget_s=cap)
        self.results["steps"][name] = rec
        left = self.deadline - time.monotonic()
        if left < min_seconds:
            self.log(f"{name}: skipped, {left:.0f} s of budget left")
            self.save()
            return rec
        self.log(f"{name}: start" + (f" (at most {cap} s)" if cap else ""))
        start = time.monotonic()
        self.step_deadline = start + cap if cap else self.deadline
        try:
            rec["result"] = func()
            rec["status"] = "ok"
        except BudgetExceeded as e:
            rec.update(status="stopped-budget", error=str(e))
        except Skip as e:
            rec.update(status="skipped", error=str(e))
        except Refused as e:
            rec.update(status="refused", error=str(e))
        except Exception as e:  # noqa: BLE001 - recorded, the next step runs
            rec.update(status="failed", error=f"{type(e).__name__}: {e}")
        finally:
            self.step_deadline = self.deadline
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
                   TORCHINDUCTOR_CACHE_DIR=str(self.extensions / "inductor"),
                   TORCHDYNAMO_DISABLE="1",
                   PYTHONWARNINGS="ignore::FutureWarning",
                   PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def run(self, cmd, env=None, cwd=None, partial=None):
        """Run ``cmd`` until it ends or the step's budget does; log it; return stdout+stderr. Raises
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

    def python(self, build, code, *args, **extra_env):
        return self.run([self.args.python, "-c", code, *args], env=self.env(build, **extra_env))

    def needs(self, step):
        """The builds ``step`` uses among ``--builds``; raises Refused where one did not install in this run."""
        builds = [b for b in STEP_BUILDS[step] if b in self.args.builds]
        missing = [b for b in builds if b not in self.installed]
        if missing:
            inst = self.results["steps"].get("install", {})
            raise Refused(f"needs {', '.join(missing)} installed by this run's install step "
                          f"(install: {inst.get('status', 'not run')}): not run")
        return builds


def take_extensions_dir(check):
    """The driver's own lock on the extensions directory (held until it exits: a second gpu-check on the same
    directory is refused), then the ``lock`` files there deleted: torch's cpp_extension leaves one in an op's build
    folder when a build is killed (at the budget, say), and the next build of that op waits on it forever."""
    import fcntl
    check.extensions.mkdir(parents=True, exist_ok=True)
    check.driver_lock = open(check.extensions / ".gpu-check-driver.lock", "w")
    try:
        fcntl.flock(check.driver_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError(f"another gpu-check is running on {check.extensions}: not clearing its locks") from None
    cleared = []
    for path in sorted(check.extensions.rglob("lock")):
        if path.is_file():
            path.unlink()
            cleared.append(str(path.relative_to(check.extensions)))
    return dict(stale_locks_cleared=cleared)


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
    # A rank in a session of its own (torchrun's workers) may outlive SIGKILL of the group and keep the pipe open:
    # stop reading rather than wait past the budget.
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
    return "(output lost: a process of the group kept its pipe open after SIGKILL)\n"


# ----------------------------------------------------------------------------- (a) install

PROBE = r"""
import importlib.metadata as md, json, sys
names, requirements = json.loads(sys.argv[1]), json.loads(sys.argv[2])
versions, unmet = {}, {}
for n in names:
    try:
        versions[n] = md.version(n)
    except md.PackageNotFoundError:
        versions[n] = None
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # no packaging on the node: the caller compares versions instead
    Requirement = None
if Requirement is not None:
    for text in requirements:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in versions and versions[name] is not None and (req.marker is None or req.marker.evaluate(
                {"extra": ""})) and not req.specifier.contains(versions[name], prereleases=True):
            unmet.setdefault(name, []).append(text)
print("PROBE " + json.dumps(dict(versions=versions, unmet=unmet, checked=Requirement is not None,
                                 python="%d.%d" % sys.version_info[:2])))
"""


def wheel_requirements(path):
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    import zipfile
    with zipfile.ZipFile(path) as zf:
        meta = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta[0]).decode("utf-8", "replace") if meta else ""
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]


IMPORT_CHECK = r"""
import importlib.metadata as md, json, sys
import deepspeed, torch, muon_testing.compare
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon
acc = get_accelerator()
report = dict(version=deepspeed.__version__, file=deepspeed.__file__, torch=torch.__version__,
              muon_testing_file=muon_testing.compare.__file__,
              accelerator=acc.device_name(), device=acc.current_device_name(), device_count=acc.device_count())
rule = getattr(original_muon, "ns_compute_dtype", None)
report["ns_dtype"] = {m: str(rule(m)).replace("torch.", "") if rule else None for m in ("gram", "standard")}
try:
    from deepspeed.runtime.zero.muon import _build_info
    report["patch"] = _build_info.PATCH_VERSION
except ImportError:
    report["patch"] = None
# every requirement of DeepSpeed and of the wheelhouse's dependencies met by the versions this path imports
from packaging.requirements import Requirement
names, versions, unmet = ["deepspeed"] + json.loads(sys.argv[1]), {}, []
for name in names:
    try:
        versions[name] = md.version(name)
        requires = md.requires(name) or []
    except md.PackageNotFoundError:
        continue
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{name} needs {req}: not installed")
            continue
        if not req.specifier.contains(found, prereleases=True):
            unmet.append(f"{name} needs {req}: found {found}")
report.update(versions=versions, unmet=unmet)
print("IMPORT " + json.dumps(report))
"""


def _version_key(version):
    """``"4.15.0"`` -> ``(4, 15, 0)``: the leading numeric release parts (enough to tell older from newer here)."""
    key = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        key.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(key)


def needed_builds(args):
    """The builds the chosen steps use, among ``--builds``, in ``BUILDS`` order."""
    used = {b for s in args.steps if s != "install" for b in STEP_BUILDS[s]}
    return [b for b in BUILDS if b in used and b in args.builds]


def install(check, manifest):
    """Step (a): the builds the steps use into their own --target dirs, the dependencies the interpreter lacks or has
    older than the wheelhouse's into deps/; imports and requirement versions checked; then the ops in background."""
    wheels = Path(check.args.wheels)
    deps = [e for e in manifest["files"] if e["kind"] == "dependency"]
    # what the wheelhouse's DeepSpeed wheels and dependencies require, checked against the node's versions: a
    # dependency the node lacks or has at a version some requirement excludes (pydantic 2.14 needs
    # typing-extensions>=4.16, say) is installed from the wheelhouse into deps/, which shadows the node's
    requirements = sorted({
        r
        for e in manifest["files"] if e["kind"] in ("dependency", "patched", "stock")
        for r in wheel_requirements(wheels / e["file"])
    })
    out = check.run([check.args.python, "-c", PROBE, json.dumps([e["name"] for e in deps]), json.dumps(requirements)])
    probe = json.loads(next(ln for ln in out.splitlines() if ln.startswith("PROBE "))[len("PROBE "):])
    found, unmet = probe["versions"], probe["unmet"]

    def needed(e):
        if found[e["name"]] is None or e["name"] in unmet:
            return True
        # without packaging on the node: anything older than the wheelhouse's
        return not probe["checked"] and _version_key(found[e["name"]]) < _version_key(e["version"])

    need = [e for e in deps if needed(e)]
    result = dict(python=probe["python"],
                  deps={
                      e["name"]:
                      dict(node=found[e["name"]],
                           wheelhouse=e["version"],
                           used="wheelhouse" if e in need else "node",
                           **(dict(node_excluded_by=unmet[e["name"]]) if e["name"] in unmet else {}))
                      for e in deps
                  },
                  builds={})
    cp_tag = "cp" + probe["python"].replace(".", "")
    compiled = [e["file"] for e in need if not _wheel_fits(e["file"], cp_tag)]
    if compiled:
        raise RuntimeError(f"the interpreter is Python {probe['python']} and lacks {compiled}, built for Python "
                           f"{manifest['python_version']}: make a wheelhouse with `dev.py wheelhouse "
                           f"--python-version {probe['python']}`")
    if need:
        stamp = json.dumps(sorted((e["file"], e["sha256"]) for e in need))
        _pip_target(check, check.site / "deps", [wheels / e["file"] for e in need], stamp=stamp)
    else:
        shutil.rmtree(check.site / "deps", ignore_errors=True)  # no older install shadowing the node's packages
    testing = [e for e in manifest["files"] if e["kind"] == "testing"]
    if not testing:
        raise RuntimeError("the wheelhouse holds no muon_testing wheel (the tests' package, testing/): make it "
                           "again with `dev.py wheelhouse`")
    _pip_target(check,
                check.site / TESTING_SITE, [wheels / testing[0]["file"]],
                stamp=wheel_contents_digest(wheels / testing[0]["file"]))
    result["testing"] = testing[0]["file"]
    check.results["steps"]["install"]["result"] = result
    for build in needed_builds(check.args):
        kind, base = build.split("-", 1)
        entry = [e for e in manifest["files"] if e["kind"] == kind and e["base"] == base]
        if not entry:
            result["builds"][build] = dict(status="failed", error=f"no {kind} {base} wheel in the wheelhouse")
            continue
        try:
            _pip_target(check,
                        check.site / build, [wheels / entry[0]["file"]],
                        stamp=wheel_contents_digest(wheels / entry[0]["file"]))
            out = check.python(build, IMPORT_CHECK, json.dumps([e["name"] for e in deps]))
            report = json.loads(next(ln for ln in out.splitlines() if ln.startswith("IMPORT "))[len("IMPORT "):])
            expected = entry[0]["version"]
            if report["version"] != expected:
                raise RuntimeError(f"imported deepspeed {report['version']}, expected {expected}")
            if not report["file"].startswith(str(check.site / build)):
                raise RuntimeError(f"imported {report['file']}, not the build under {check.site / build}")
            if report["unmet"]:
                raise RuntimeError("requirements not met: " + "; ".join(report["unmet"]))
            result["builds"][build] = dict(status="ok", **report)
            check.installed[build] = report
        except (RuntimeError, StopIteration) as e:
            result["builds"][build] = dict(status="failed", error=str(e) or type(e).__name__)
        if build == TEST_BUILD and build in check.installed and "tests" in check.args.steps:
            start_ops(check)
    failed = [b for b, r in result["builds"].items() if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"not installed: {', '.join(failed)}: " +
                           "; ".join(f"{b}: {result['builds'][b]['error'][:300]}" for b in failed))
    return result


OPS_BUILD = r"""
import json, sys, time
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
for name in sys.argv[1:]:
    start = time.perf_counter()
    try:
        builder = acc.create_op_builder(name)
        if builder is None:
            rec = dict(status="absent", error=f"the {acc.device_name()} accelerator has no {name}")
        else:
            builder.load(verbose=False)
            rec = dict(status="built", op=builder.name)
    except BaseException as e:
        rec = dict(status="failed", error=f"{type(e).__name__}: {e}"[-600:])
    rec["seconds"] = round(time.perf_counter() - start, 1)
    print("OP " + json.dumps({name: rec}), flush=True)
"""


def ops_needed(groups):
    return sorted({op for g in groups for op in TEST_OPS.get(g, ("FusedAdamBuilder", ))})


def start_ops(check):
    """Start the JIT builds of the ops the test groups use, under the patched 0.19.8 build, in the background
    (nvcc and the host compiler work while the GPU steps run); ``wait_ops`` collects them."""
    ops = ops_needed(g for g, _ in TESTS)
    check.ops_log = check.work / "ops.log"
    check.log(f"  ops: building {', '.join(ops)} in the background ({check.ops_log})")
    check.ops_started = time.monotonic()
    check.ops_proc = subprocess.Popen([check.args.python, "-c", OPS_BUILD, *ops],
                                      env=check.env(TEST_BUILD),
                                      cwd=check.root,
                                      stdout=open(check.ops_log, "w"),
                                      stderr=subprocess.STDOUT,
                                      text=True,
                                      start_new_session=True)
    check.results["ops"] = {op: dict(status="building") for op in ops}


def wait_ops(check, timeout):
    """Wait up to ``timeout`` s for the background op builds; record each op's outcome in ``results["ops"]``
    (``built``; ``failed``: DeepSpeed falls back where it can, the error says why; ``stopped-budget``)."""
    proc = check.ops_proc
    if proc is None:
        return check.results.get("ops", {})
    try:
        proc.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        _stop(proc)
    text = check.ops_log.read_text(errors="replace")
    check.logfile.write(f"$ (background) op builds\n{text}\n[exit {proc.returncode}]\n")
    check.ops_proc = None
    ops = check.results["ops"]
    for line in text.splitlines():
        if line.startswith("OP "):
            ops.update(json.loads(line[3:]))
    for op, rec in ops.items():
        if rec["status"] == "building":
            rec.update(status="stopped-budget" if proc.returncode in (-9, -15) else "failed",
                       error=f"the builder exited {proc.returncode} before reporting it")
    check.results["ops_seconds"] = round(time.monotonic() - check.ops_started, 1)
    check.log("  ops: " + ", ".join(f"{op} {r['status']} ({r.get('seconds', '-')} s)" for op, r in ops.items()))
    return ops


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


# ----------------------------------------------------------------------------- launches


def worker_launch(check, build, configs, name):
    """``bench/worker.py`` under ``torch.distributed.run`` with one rank; returns its rows by name
    and its work folder (in scratch). Rows finished before the budget ran out are kept in ``check.partial_rows``."""
    workdir = check.work / f"{name}-{build}"
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


# ----------------------------------------------------------------------------- (b) exchange

EXCHANGE = r"""
import json, sys
try:
    from muon_testing.threaded_exchange import device_check
except ImportError as e:
    raise SystemExit(f"muon_testing has no threaded_exchange ({e}): make the wheelhouse again with this checkout")
for row in device_check(sys.argv[1], world_sizes=[int(w) for w in sys.argv[2].split(",")]):
    print("ROW " + json.dumps(row), flush=True)
"""


def exchange_verdict(rows, device):
    """The pass criterion of ``test_the_exchange_on_the_accelerator_up_to_eight_ranks``: every run exchanged; on the
    CPU every piece bit-equal to upstream's; elsewhere the largest relative difference at most the eps of the NS
    compute dtype. Returns None or what failed."""
    if not rows:
        return "no runs"
    if not all(r["exchanges"] for r in rows):
        return f"runs without an exchange: {[r for r in rows if not r['exchanges']][:2]}"
    if device == "cpu":
        bad = [r for r in rows if not r["bit_equal"]]
        return f"{len(bad)} runs not bit-equal to upstream on the CPU, e.g. {bad[0]}" if bad else None
    bad = [r for r in rows if r["max_relative_difference"] > EPS.get(r["ns_dtype"], 0.0)]
    return f"{len(bad)} runs beyond the NS dtype's eps, e.g. {bad[0]}" if bad else None


def exchange(check):
    check.needs("exchange")
    rows = []
    result = check.results["steps"]["exchange"]["result"] = dict(device=SIZES[check.args.device]["device"],
                                                                 build=TEST_BUILD,
                                                                 rows=rows)

    def keep(out):
        rows.extend(json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith("ROW "))

    keep(
        check.run(
            [check.args.python, "-c", EXCHANGE, result["device"], ",".join(map(str, check.args.exchange_world_sizes))],
            env=check.env(TEST_BUILD),
            partial=keep))
    result.update(world_sizes=sorted({r["world_size"]
                                      for r in rows}),
                  ns_dtypes=sorted({r["ns_dtype"]
                                    for r in rows}),
                  bit_equal=sum(r["bit_equal"] for r in rows),
                  max_relative_difference=max((r["max_relative_difference"] for r in rows), default=None))
    verdict = exchange_verdict(rows, check.args.device)
    if verdict:
        raise RuntimeError(verdict)
    return result


# ----------------------------------------------------------------------------- (c) measurements


def measure(check):
    builds = check.needs("measure")
    sizes = SIZES[check.args.device]
    result = check.results["steps"]["measure"].setdefault("result", {})
    result["builds"] = builds
    samples, rows_seen = {}, result.setdefault("rows", {})
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

    def record(build, rows):
        _add_samples(samples, build, rows)
        result["steps"] = summarize_samples(samples)
        for name, row in rows.items():
            rows_seen.setdefault(build, {}).setdefault(name, []).append(
                {k: row.get(k)
                 for k in KEYS + ("ns_dtypes", "ns_kernel_calls_per_step", "boundary_settings")})
        check.save()

    for rep in range(check.args.repeats):
        for build in builds:
            check.partial_rows = {}
            try:
                rows, _ = worker_launch(check, build, configs, f"measure-r{rep}")
            except BudgetExceeded:
                record(build, check.partial_rows)
                raise
            record(build, rows)
    # one process for the three variants (one import): upstream's NS dtype on fp32 and bf16 input, and NS in fp32
    out = check.run([
        check.args.python, HERE / "ns_batch.py", "--device", sizes["device"], "--variants", "fp32:upstream",
        "bf16:upstream", "fp32:fp32", "--shapes", f"llama:{sizes['ns_hidden']}:{sizes['ns_intermediate']}", "--batch",
        str(sizes["ns_batch"]), "--repeats",
        str(max(3, check.args.repeats)), "--json", "--threads",
        str(check.args.threads)
    ],
                    env=check.env(TEST_BUILD))
    ns = result["ns_batch"] = {}
    for row in (json.loads(ln[len("JSON "):]) for ln in out.splitlines() if ln.startswith("JSON ")):
        ns.setdefault(f"{row['dtype']}/ns-{row['ns_rule']}", []).append(row)
    result["plan"] = plan_records()
    check.save()
    return result


PLAN_WORLD_SIZES = (32, 1024)


def plan_records(world_sizes=PLAN_WORLD_SIZES):
    """The plan report's figures (``owner_plan.plan_figures`` of ``plan_partitions``, default ``max_step_memory``,
    NS in fp16) for ``bench/scale.py``'s Llama-3 8B, 70B and Qwen3-30B-A3B at ``world_sizes``: pure Python from this
    checkout (no transformers on the node; ``python -m deepspeed.runtime.zero.muon plan`` gives the same figures
    from a Hugging Face config, a test checks it against the engine)."""
    sys.path.insert(0, str(HERE))
    import scale
    records = []
    for arch in scale.ARCHS:
        for w in world_sizes:
            plans = scale.gpu_plans(arch.muon_shapes, w)
            f = scale.owner_plan.plan_figures([(p, d, pieces, scale.BACK_ITEMSIZE, None) for p, d, pieces in plans], w)
            records.append(
                dict(model=arch.name,
                     world_size=w,
                     sub_groups=len(plans),
                     buckets=f.buckets,
                     depth=f.depth,
                     peak_bytes=f.peak_bytes,
                     kept_bytes=f.kept_bytes,
                     ns_efficiency=round(f.ns_efficiency, 4)))
    return records


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


# ----------------------------------------------------------------------------- (d) tests


def tests(check):
    check.needs("tests")
    ops = wait_ops(check, check.remaining() - 20)
    result = check.results["steps"]["tests"].setdefault("result", {})
    result["ops"] = ops
    groups = result.setdefault("groups", {})
    for group, ids in TESTS:
        if check.remaining() < 20:
            groups[group] = dict(status="skipped-budget")
            continue
        xml = check.work / f"tests-{group}.xml"
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
        groups[group] = dict(status=status,
                             seconds=round(time.monotonic() - start, 1),
                             ops={op: ops.get(op, {}).get("status")
                                  for op in ops_needed([group])},
                             tests=junit_results(xml))
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
    return result


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


# ----------------------------------------------------------------------------- (e) seed table

SEED_VARIANTS = (("", None), ("/ns-fp32", "fp32"))
"""The seed table's Newton-Schulz variants: upstream's compute dtype, and fp32 (``worker.py``'s ``ns_dtype``)."""


def seed_configs():
    return [
        dict(name=f"seed-{dtype}-gas{gas}" + ("-nsfp32" if ns else ""),
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
             memory_step=False,
             **(dict(ns_dtype=ns) if ns else {})) for _, ns in SEED_VARIANTS for dtype in ("fp32", "bf16")
        for gas in (1, 4)
    ]


def seed(check):
    builds = check.needs("seed")
    table = {}
    check.results["steps"]["seed"]["result"] = dict(table=table)
    for build in builds:
        try:
            rows, workdir = worker_launch(check, build, seed_configs(), "seed")
        except RuntimeError as e:
            table[build] = dict(error=str(e))
            continue
        pairs = {}
        for suffix, ns in SEED_VARIANTS:
            for dtype in ("fp32", "bf16"):
                tail = "-nsfp32" if ns else ""
                g1, g4 = rows.get(f"seed-{dtype}-gas1{tail}"), rows.get(f"seed-{dtype}-gas4{tail}")
                if not (g1 and g4):
                    table[f"{build}/{dtype}{suffix}"] = dict(error="missing rows")
                    continue
                pairs[f"{build}/{dtype}{suffix}"] = (g1, g4)
        if not pairs:
            continue
        files = [workdir / f"{g['name']}.pt" for g1, g4 in pairs.values() for g in (g1, g4)]
        out = check.run([check.args.python, Path(__file__), "--worker", "diff", *files], env=check.env(build))
        diffs = json.loads(out.strip().splitlines()[-1])
        for (key, (g1, g4)), diff in zip(pairs.items(), diffs):
            table[key] = dict(ns_calls_gas1=round(g1["ns_calls_per_step"] * 3),
                              ns_calls_gas4=round(g4["ns_calls_per_step"] * 3),
                              ns_calls_micro_gas4=round(g4["ns_calls_micro_per_step"] * 3),
                              ns_dtypes=sorted(set(g1.get("ns_dtypes", [])) | set(g4.get("ns_dtypes", []))),
                              rel_diff_gas1_gas4=diff["rel_diff"])
        check.save()
    errors = [k for k, v in table.items() if "error" in v]
    if errors:
        raise RuntimeError(f"seed rows failed: {errors}: {json.dumps({k: table[k] for k in errors})[:600]}")
    return dict(table=table)


# ----------------------------------------------------------------------------- summary


def summary_text(results):
    lines = [
        f"gpu-check on {results['device']}: {results.get('gpu', '')} budget {results['budget_s']} s, "
        f"elapsed {results.get('elapsed_s')} s, python {results['python']}"
    ]
    for name, rec in results["steps"].items():
        cap = f"/{rec['budget_s']}" if rec.get("budget_s") else ""
        lines.append(f"{name:10} {rec['status']:15} {rec['seconds']:7.1f}{cap} s  {rec.get('error', '')[:200]}")
    cleared = (results["steps"].get("locks", {}).get("result") or {}).get("stale_locks_cleared")
    if cleared:
        lines.append(f"  stale locks cleared: {', '.join(cleared)}")
    inst = results["steps"].get("install", {}).get("result") or {}
    for build, r in (inst.get("builds") or {}).items():
        lines.append(f"  install {build:16} {r['status']:6} {r.get('version', r.get('error', ''))[:300]} "
                     f"{r.get('accelerator', '')} {r.get('device', '')} NS dtype {r.get('ns_dtype', '-')}")
    from_wheels = [
        f"{n} {d['wheelhouse']} (node: {d['node']})" for n, d in (inst.get("deps") or {}).items()
        if d["used"] == "wheelhouse"
    ]
    if from_wheels:
        lines.append(f"  dependencies from the wheelhouse: {', '.join(from_wheels)}")
    for op, r in (results.get("ops") or {}).items():
        lines.append(f"  op {op}: {r['status']} ({r.get('seconds', '-')} s) {r.get('error', '')[:200]}" +
                     (" -> the tests that use it fell back or failed" if r["status"] != "built" else ""))
    exch = results["steps"].get("exchange", {}).get("result") or {}
    if exch.get("rows") and "world_sizes" in exch:
        lines.append(f"  exchange on {exch['device']}: {len(exch['rows'])} runs, W {exch['world_sizes']}, NS dtype "
                     f"{exch['ns_dtypes']}, bit-equal {exch['bit_equal']}, largest relative difference "
                     f"{exch['max_relative_difference']:.2e}")
    meas = results["steps"].get("measure", {}).get("result") or {}
    for r in meas.get("plan") or ():
        lines.append(f"  plan {r['model']} W={r['world_size']}: {r['buckets']} bucket(s), depth {r['depth']}, peak "
                     f"{r['peak_bytes'] / 2**30:.2f} GiB, kept {r['kept_bytes'] / 2**30:.2f} GiB, NS efficiency "
                     f"{r['ns_efficiency']:.3f}")
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

            dtypes = sorted({d for r in (meas.get("rows") or {}).get(build, {}).get(name, []) for d in r["ns_dtypes"]})
            lines.append(f"  {build} {name}: " + "; ".join([
                fmt("boundary_step_time", 1e3, " ms"),
                fmt("boundary_time", 1e3, " ms"),
                fmt("ns_seconds_per_step", 1e3, " ms"),
                fmt("alloc_peak_step_bytes", 2**-20, " MiB")
            ]) + (f"; NS share of step() {row['ns_share_of_step']:.2f}" if "ns_share_of_step" in row else "") +
                         f"; NS dtype {dtypes or '-'}")
    for variant, rows in (meas.get("ns_batch") or {}).items():
        for r in rows:
            lines.append(f"  NS {variant} (computes in {r.get('ns_dtype')}) {r['shape']:>11} x{r['batch']}: one by "
                         f"one {r['one_ms']:.2f} ms [{r['one_min_ms']:.2f}-{r['one_max_ms']:.2f}], batched "
                         f"{r['batched_ms']:.2f} ms [{r['batched_min_ms']:.2f}-{r['batched_max_ms']:.2f}], "
                         f"ratio {r['ratio']:.2f}")
    for group, r in (((results["steps"].get("tests", {}).get("result") or {}).get("groups")) or {}).items():
        lines.append(f"  tests {group:16} {r['status']:15} {r.get('seconds', 0):6.1f} s  ops {r.get('ops')}")
        for tid, t in r.get("tests", {}).items():
            lines.append(f"      {t['outcome']:8} {tid.rsplit('::', 1)[-1]} [{t.get('ranks')}] {t['message'][:120]}")
    seed_rec = (results["steps"].get("seed", {}).get("result") or {}).get("table", {})
    if seed_rec:
        lines.append("  seed table (ZeRO-3, W=1, 3 steps): build/dtype[/NS variant]  NS calls gas1 / gas4 "
                     "(micro-steps)  rel. weight diff gas1 vs gas4  NS dtype")
        for key, r in seed_rec.items():
            if "error" in r:
                lines.append(f"    {key:30} {r['error'][:150]}")
            else:
                lines.append(f"    {key:30} {r['ns_calls_gas1']} / {r['ns_calls_gas4']} ({r['ns_calls_micro_gas4']})"
                             f"   {r['rel_diff_gas1_gas4']:.2e}  {','.join(r['ns_dtypes']) or '-'}")
    for problem in results.get("out_problems") or []:
        lines.append(f"  WARNING --out: {problem}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dev.py gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", required=True, help="a `dev.py wheelhouse` directory")
    p.add_argument("--out",
                   required=True,
                   help="output folder: results.json, summary.txt, gpu-check.log and nothing else (an OUT holding "
                   "anything else is refused); on a borrowed node give $OUT itself")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="DS_ACCELERATOR (cpu: a dry run)")
    p.add_argument("--budget-s",
                   type=float,
                   default=480.0,
                   help="stop after this many seconds, every step included (default %(default)s; STEP_BUDGETS caps "
                   "each step on CUDA)")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch (default: this one)")
    p.add_argument("--scratch",
                   help="installs, JIT-built ops and work files (default: $TMPDIR/zero3muon-gpu-check-<uid>; "
                   "never inside --out)")
    p.add_argument("--site",
                   help="where the builds are installed (default: SCRATCH/site; kept between runs, a build is "
                   "reinstalled only when its wheel's contents changed)")
    p.add_argument("--extensions-dir",
                   help="parent of each build's TORCH_EXTENSIONS_DIR (default: SCRATCH/torch_extensions)")
    p.add_argument("--builds",
                   nargs="+",
                   default=list(BUILDS),
                   choices=BUILDS,
                   help="builds the steps may use (default: all; only those a chosen step uses are installed)")
    p.add_argument("--steps",
                   nargs="+",
                   default=list(STEPS),
                   choices=STEPS,
                   help=f"steps to run (default: all); they run in the order {', '.join(STEPS)}")
    p.add_argument("--tests",
                   nargs="+",
                   choices=[g for g, _ in TESTS],
                   help="test groups of the tests step (default: all)")
    p.add_argument("--repeats",
                   type=int,
                   default=3,
                   help="launches per build in the measure step (default %(default)s)")
    p.add_argument("--exchange-world-sizes",
                   type=int,
                   nargs="+",
                   default=list(range(2, 9)),
                   help="simulated ranks of the exchange step (default: 2 to 8)")
    p.add_argument("--threads",
                   type=int,
                   default=max(1, (os.cpu_count() or 2) // 2),
                   help="OMP threads of a rank (default: half the cores, %(default)s here)")
    args = p.parse_args(argv)
    if args.budget_s <= 0 or args.repeats < 1 or args.threads < 1:
        p.error("--budget-s, --repeats and --threads must be positive")
    if any(w < 2 for w in args.exchange_world_sizes):
        p.error("--exchange-world-sizes: each at least 2 (the exchange has nothing to exchange at W=1)")
    build_steps = [s for s in args.steps if s != "install"]
    if build_steps and "install" not in args.steps:
        p.error(
            f"--steps {' '.join(build_steps)} need the builds the install step installs and checks in the same run:"
            " add install")
    unused = [s for s in build_steps if not any(b in args.builds for b in STEP_BUILDS[s])]
    if unused:
        p.error(f"--builds {' '.join(args.builds)} has no build that step(s) {', '.join(unused)} use "
                f"({'; '.join(f'{s}: {chr(44).join(STEP_BUILDS[s])}' for s in unused)})")
    if "measure" in args.steps and "patched-0.19.8" not in args.builds:
        p.error("the measure step needs patched-0.19.8 among --builds")
    return args


def device_probe(check):
    """The GPU (or the CPU for --device cpu) and nvcc, before anything starts; raises if CUDA is absent."""
    code = (
        "import json, torch; ok = torch.cuda.is_available(); print('PROBE ' + json.dumps(dict(torch=torch.__version__,"  #ignore-cuda
        " cuda=ok, count=torch.cuda.device_count() if ok else 0, name=torch.cuda.get_device_name(0) if ok else None,"  #ignore-cuda
        " cuda_version=torch.version.cuda)))")
    out = check.run([check.args.python, "-c", code])
    probe = json.loads(next(ln for ln in out.splitlines() if ln.startswith("PROBE "))[6:])
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    probe["nvcc"] = nvcc if nvcc and os.path.isfile(nvcc) else None
    if probe["nvcc"]:
        res = subprocess.run([nvcc, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        probe["nvcc_version"] = (res.stdout.strip().splitlines() or [""])[-1]
    if check.args.device == "cuda" and not probe["cuda"]:
        raise RuntimeError(f"no CUDA device visible to {check.args.python} (torch {probe['torch']}); "
                           "run with --device cpu for a dry run")
    return probe


def cap_log(path, cap=LOG_CAP_BYTES):
    """Cut ``path`` in the middle (first and last ``cap / 2`` bytes kept) where it is over ``cap`` bytes."""
    size = path.stat().st_size
    if size <= cap:
        return False
    with open(path, "rb") as f:
        head = f.read(cap // 2)
        f.seek(size - cap // 2)
        tail = f.read()
    path.write_bytes(head +
                     f"\n[... {size - cap} bytes cut by gpu-check to stay under the return limit ...]\n".encode() +
                     tail)
    return True


def main(argv=None, root=ROOT):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.tests:
        global TESTS
        TESTS = tuple(t for t in TESTS if t[0] in args.tests)
    try:
        check = Check(args, root)
    except OutError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(root) / "build_backend"))
    import zero3muon_wheelhouse as wh
    manifest = {}

    def verify():
        manifest.update(wh.verify(args.wheels))
        return dict(bases=manifest["bases"], files=len(manifest["files"]), total_bytes=manifest["total_bytes"])

    try:
        locks = check.step("locks", lambda: take_extensions_dir(check))
        probe = check.step("device", lambda: device_probe(check))
        if probe["status"] == "ok":
            r = probe["result"]
            check.results["gpu"] = f"{r['name']} x{r['count']}" if r["cuda"] else "no GPU"
        wheels = check.step("wheels", verify)
        first = {"locks": locks, "device": probe, "wheels": wheels}
        blocked = {n: r["status"] for n, r in first.items() if r["status"] != "ok"}
        funcs = dict(install=lambda: install(check, manifest),
                     exchange=lambda: exchange(check),
                     measure=lambda: measure(check),
                     tests=lambda: tests(check),
                     seed=lambda: seed(check))
        for name in STEPS:
            if name not in args.steps:
                continue
            if blocked:  # the budget ran out before the first checks ended, or one of them failed
                budget = set(blocked.values()) <= {"skipped-budget"}
                check.results["steps"][name] = dict(status="skipped-budget" if budget else "refused",
                                                    seconds=0.0,
                                                    error=f"not run: {blocked}")
                continue
            check.step(name, funcs[name])
    finally:
        if check.ops_proc is not None:  # the tests step did not collect them: stopped now, recorded
            wait_ops(check, 0)
        check.save()
        text = summary_text(check.results)
        (check.out / "summary.txt").write_text(text)
        print(text, end="", flush=True)
        check.log(f"wrote {', '.join(str(check.out / f) for f in OUT_FILES)}")
        check.logfile.close()
        cap_log(check.out / "gpu-check.log")
        problems = check_out_dir(check.out)
        check.results["out_files"] = {p.name: p.stat().st_size for p in sorted(check.out.iterdir()) if p.is_file()}
        check.results["out_problems"] = problems
        check.save()
        problems = check_out_dir(check.out)  # results.json itself, once more
        for problem in problems:
            print(f"gpu-check: WARNING --out breaks the return rules: {problem}", file=sys.stderr)
        shutil.rmtree(check.work, ignore_errors=True)
    bad = [n for n, r in check.results["steps"].items() if r["status"] in ("failed", "refused")]
    return 1 if bad or problems else 0


def _worker(argv):
    """Worker mode under a build's Python: ``diff A1 B1 [A2 B2 ...]`` prints a JSON list of the relative weight
    differences of each pair of ``torch.save``d weight dicts."""
    if argv[:1] == ["diff"] and len(argv) >= 3 and len(argv) % 2 == 1:
        import torch
        from muon_testing.compare import relative_difference
        load = lambda p: torch.load(p, map_location="cpu", weights_only=True)  # noqa: E731
        print(
            json.dumps([dict(rel_diff=relative_difference(load(a), load(b))) for a, b in zip(argv[1::2], argv[2::2])]))
        return 0
    raise SystemExit(f"unknown worker command {argv!r} (expected: diff A1 B1 [A2 B2 ...])")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main())
