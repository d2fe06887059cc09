#!/usr/bin/env python3
"""Developer commands for the ZeRO-3 Muon patch (stdlib only; runs on Python >= 3.9, the venv it
creates needs Python >= 3.10).

  python3 dev.py setup [--base X] [--ops all|demo|test|none]
                                             venv .venv/<X>/ with torch, test deps, patched DeepSpeed and
                                             muon_testing (testing/, editable); the JIT ops (default: all)
  python3 dev.py test  [--base X] [ARGS...]  setup, then pytest (ARGS go to pytest); the JIT ops the tests
                                             load compile beside them (shm comm and FusedAdam before the
                                             tests where ARGS select some)
  python3 dev.py demo  [--base X] [ARGS...]  setup (JIT op: shm comm only), then examples/demo/run_demo.py ARGS
  python3 dev.py bench [--all-bases] [ARGS...]  patched and stock venvs of the default base (every base with
                                             --all-bases), then bench/run_bench.py ARGS
  python3 dev.py export [--base X] [--out DIR] the change as six pull requests (a diff and a description
                                             each, their sizes printed) and the combined diff, against
                                             the release (default DIR: out/export/<X>/; needs no venv)
  python3 dev.py intree --deepspeed-repo PATH [--base X] [--stock] [--cpu-fp16] [-- PYTEST ARGS]
                                             setup, then the exported tests inside a copy of DeepSpeed's
                                             tests/ (its conftest.py, tests/unit/common.py) with
                                             upstream's Muon tests
  python3 dev.py lint [--base X] [--deepspeed-repo PATH] [--fix] [--paths FILE...]
                                             DeepSpeed's pre-commit hooks (yapf, flake8, codespell,
                                             torchdist/torchcuda/license, whitespace) on the Python files
                                             of each exported pull request, from venv .venv/lint/
  python3 dev.py wheelhouse --out DIR [--python-version 3.12] [--bases B...]
                                             the wheels an offline GPU node with torch needs (patched and
                                             stock DeepSpeed of each base, DeepSpeed's other requirements),
                                             manifest.json, SHA256SUMS; fails over 64 MiB (needs no venv)
  python3 dev.py gpu-check --wheels DIR --out OUT [--device cuda|cpu] [--budget-s S]
                                             on the node (stdlib, its python3, no network): installs the
                                             builds it uses with pip --target in a scratch folder, then the
                                             exchange at W=2..8, patched-vs-stock measurements, the W=1
                                             tests and the seed table on the device, each step capped;
                                             OUT/results.json, summary.txt, gpu-check.log, flat (bench/gpu_check.py)

--base defaults to $DS_ZERO3MUON_BASE, else [tool.zero3muon] default-base in pyproject.toml.
Setup is idempotent: requirements are reinstalled only when requirements/*.txt change, and
DeepSpeed is rebuilt only when pyproject.toml, build_backend/zero3muon_build.py, deepspeed/ or
patches/<base>/ change (not for the export's files in build_backend/, which the wheel does not use).
Every venv (patched and stock) also gets the tests' shared package ``muon_testing`` (testing/: models,
comparisons, the single-process reference) as an editable install, so that the tests, the benchmark
and the demo import it plainly; it is reinstalled only when testing/pyproject.toml changes.
Setup also installs the venv's startup hook (build_backend/zero3muon_venv.py): every Python of the
venv runs the venv's ninja, the one setup builds the ops with, and a torch_extensions lock left by a
killed build is removed before a run (docs/user-guide.md, "A run that rebuilds the ops, or hangs").
"""

import argparse
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REQUIREMENTS = [ROOT / "requirements" / "torch.txt", ROOT / "requirements" / "dev.txt"]  # installed in this order
REQUIREMENTS_ABOUT = [("the pinned CPU torch (a 200 MB download the first time)", "about 0.5 to 1 min"),
                      ("pytest, transformers, matplotlib and DeepSpeed's dependencies", "about 0.5 to 1 min")]
DEMO = ROOT / "examples" / "demo" / "run_demo.py"
BENCH = ROOT / "bench" / "run_bench.py"
LINT_REQUIREMENTS = ROOT / "requirements" / "lint.txt"
TESTING = ROOT / "testing"  # the package muon_testing, shared by tests, bench, demo and gpu-check

# DeepSpeed JIT-compiles its C++ ops on the CPU accelerator the first time they are used: the
# shared-memory comm op (at init_distributed, in every distributed run), the CPU FusedAdam of Muon's
# auxiliary Adam (unless the config asks for torch's Adam: "torch_adam": true), CPU Adam (optimizer
# offload) and async I/O (NVMe offload; only where libaio is installed). That takes minutes, so each
# command builds the ops it needs, once, into the venv's own extensions dir (a cache shared between
# venvs is rebuilt whenever another venv's torch path appears in it), with the venv's ninja (another
# ninja version does not read its .ninja_log and rebuilds everything); each op has its own stamp.
JIT_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder")
DEMO_OPS = ("ShareMemCommBuilder", )  # the demo's ranks: init_distributed (its auxiliary Adam is torch's)
# The test suite (cmd_test): the ops nearly every distributed test loads, and the offload ops (CPU
# Adam, async I/O: only the offload and NVMe tests, which run late), the latter at a lower priority;
# a test that needs an op being built waits for it (torch's lock on the op's build dir).
TEST_OPS_FIRST = ("ShareMemCommBuilder", "FusedAdamBuilder")
TEST_OPS_BESIDE = ("CPUAdamBuilder", "AsyncIOBuilder")
OP_EXPECTED = {  # compile time on 2 idle cores, said while it compiles (a busy machine takes longer)
    "ShareMemCommBuilder": "about 1.5 min",
    "FusedAdamBuilder": "3 to 4 min",
    "CPUAdamBuilder": "3 to 4 min",
    "AsyncIOBuilder": "5 to 15 min",
}
HEARTBEAT_S = 30  # a line per op this often while it compiles, so a long build does not look like a hang
# Run by the venv's Python: argv[1] = JSON [[NAME, STAMP, DIGEST], ...]; each op loaded (compiled if needed), then
# its stamp written, so an interrupted run keeps the ops it finished.
WARM_JIT_OPS = f"""
import json, sys, threading, time
from deepspeed.accelerator import get_accelerator
EXPECTED = {OP_EXPECTED!r}
for name, stamp, digest in json.loads(sys.argv[1]):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        print(f"[dev]   {{name}}: compiling or loading (first build {{EXPECTED.get(name, 'minutes')}} on 2 idle cores)",
              flush=True)
        start = time.time()
        done = threading.Event()

        def beat(name=name, start=start, done=done):
            while not done.wait({HEARTBEAT_S}):
                print(f"[dev]   {{name}}: still compiling, {{time.time() - start:.0f}} s so far", flush=True)

        threading.Thread(target=beat, daemon=True).start()
        try:
            builder.load()
        finally:
            done.set()
        print(f"[dev]   {{name}}: ready in {{time.time() - start:.0f}} s", flush=True)
    else:
        print(f"[dev]   {{name}}: not buildable here, skipped", flush=True)
    with open(stamp, "w") as f:
        f.write(digest + "\\n")
"""


class Step:
    """One setup step: says what it does and roughly how long it takes, then how long it took."""

    def __init__(self, what, expected=None):
        self.what, self.expected = what, expected

    def __enter__(self):
        import time
        self.start = time.time()
        log(f"{self.what}" + (f": {self.expected} on 2 idle cores" if self.expected else "") + " ...")
        return self

    def __exit__(self, exc_type, *_):
        import time
        if exc_type is None:
            log(f"  done in {time.time() - self.start:.0f} s")
        return False


def log(msg):
    print(f"[dev] {msg}", flush=True)


def run(cmd, env=None):
    subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, check=True)


def sdist_sha256(base):
    """The sha256 pinned in pyproject.toml for the ``deepspeed==base`` sdist."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(rf'^"{re.escape(base)}"\s*=\s*"([0-9a-fA-F]{{64}})"', text, re.M).group(1)


def project_config():
    """(default base, known bases) from pyproject.toml's [tool.zero3muon]."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
        cfg = tomllib.loads(text)["tool"]["zero3muon"]
        return cfg["default-base"], sorted(cfg["sdist-sha256"])
    except ImportError:  # Python 3.9/3.10: the two fields are simple enough to read directly
        default = re.search(r'^default-base\s*=\s*"([^"]+)"', text, re.M).group(1)
        pins = re.search(r"^\[tool\.zero3muon\.sdist-sha256\][^\n]*$(.*?)(?=^\[|\Z)", text, re.M | re.S).group(1)
        return default, sorted(re.findall(r'^"([^"]+)"\s*=', pins, re.M))


def tree_hash(paths, extra=""):
    """sha256 over the names and contents of the files under ``paths`` (caches skipped)."""
    h = hashlib.sha256(extra.encode())
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix in (".pyc", ".pyo"):
                continue
            h.update(f"\0{f.relative_to(ROOT).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


class Venv:
    def __init__(self, base, stock=False):
        self.base = base
        self.dir = ROOT / ".venv" / (f"stock-{base}" if stock else base)
        self.python = self.dir / "bin" / "python"
        self.extensions = self.dir / "torch_extensions"

    def env(self, **extra):
        """Environment for running the project: CPU accelerator, this venv's JIT op cache, no current
        directory on sys.path (the repo's partial deepspeed/ must not shadow the install), and the
        venv's bin/ first on PATH as in an activated venv (its ninja builds and checks the ops)."""
        path = os.pathsep.join(p for p in (str(self.dir / "bin"), os.environ.get("PATH")) if p)
        return dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(self.extensions), PYTHONSAFEPATH="1",
                    PATH=path, **extra)

    def site_packages(self):
        found = sorted(self.dir.glob("lib/python*/site-packages"))
        if len(found) != 1:
            sys.exit(f"[dev] {self.dir.relative_to(ROOT)}: expected one lib/python*/site-packages, found {len(found)}")
        return found[0]

    def ninja_version(self):
        """The venv's ninja's version (requirements/dev.txt), or None if it has none."""
        ninja = self.dir / "bin" / "ninja"
        if not ninja.is_file():
            return None
        res = subprocess.run([str(ninja), "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return res.stdout.strip() if res.returncode == 0 else None

    def stamp(self, name):
        return self.dir / f".zero3muon-{name}.sha256"

    def is_current(self, name, digest):
        f = self.stamp(name)
        return f.is_file() and f.read_text().strip() == digest

    def mark(self, name, digest):
        self.stamp(name).write_text(digest + "\n")

    def pip(self, *args, env=None):
        run([self.python, "-m", "pip", "--disable-pip-version-check", *args], env=env)


def venv_hook():
    """build_backend/zero3muon_venv.py: the venvs' startup hook (one ninja, locks of killed builds)."""
    sys.path.insert(0, str(ROOT / "build_backend"))
    import zero3muon_venv
    return zero3muon_venv


def install_venv_hook(venv):
    """Install zero3muon_venv.py and its .pth into the venv's site-packages and make its ninja-bin/
    (a link to the venv's ninja): every Python of the venv, however launched, then finds the ninja
    setup built the ops with, and clears a lock a killed build left. Rewritten only when changed."""
    hook = venv_hook()
    site = venv.site_packages()
    for name, text in (("zero3muon_venv.py", Path(hook.__file__).read_text()), ("zero3muon_venv.pth", hook.PTH_LINE)):
        dest = site / name
        if not dest.is_file() or dest.read_text() != text:
            dest.write_text(text)
    if hook.make_ninja_dir(str(venv.dir)) is None:
        sys.exit(f"[dev] {venv.dir.relative_to(ROOT)} has no bin/ninja (requirements/dev.txt installs it)")


def check_extension_locks(venv):
    """Before anything loads an op from the venv's extensions dir: remove the lock a killed build left
    (no process holds it), wait for a killed build's still-running ninja, stop where that cannot
    be decided (naming the file)."""
    _removed, unknown = venv_hook().clear_stale_locks([str(venv.extensions)], say=log)
    if unknown:
        sys.exit("[dev] " + "; ".join(f"{lock}: a torch extension build lock left in place ({why}); if no build "
                                      f"is running, remove it (rm {lock}) and run again" for lock, why in unknown))


def setup(base, stock=False, ops=JIT_OPS):
    """Create or update the venv of ``base``: patched DeepSpeed, or with ``stock`` the unpatched
    release (same pinned torch and dependencies; used by the benchmark), and build the JIT ``ops``
    (names of DeepSpeed op builders) not built yet. Returns the ``Venv``."""
    venv = Venv(base, stock)
    if not venv.python.exists():
        if sys.version_info < (3, 10):
            sys.exit(f"[dev] the pinned torch (requirements/torch.txt) needs Python >= 3.10 in the venv, "
                     f"and this is Python {sys.version.split()[0]}: run dev.py with a newer python3")
        with Step(f"creating venv {venv.dir.relative_to(ROOT)}"):
            run([sys.executable, "-m", "venv", venv.dir])

    req_hash = tree_hash(REQUIREMENTS)
    req_current = venv.is_current("requirements", req_hash)
    if stock:
        build_hash = tree_hash([], extra=f"stock deepspeed=={base} sha256={sdist_sha256(base)}")
    else:
        inputs = [ROOT / "pyproject.toml", ROOT / "build_backend" / "zero3muon_build.py", ROOT / "deepspeed",
                  ROOT / "patches" / base]
        build_hash = tree_hash([p for p in inputs if p.exists()], extra=f"base={base}")
    venv.build_hash = build_hash
    build_current = venv.is_current("build", build_hash)
    # A new venv of the patched build installs DeepSpeed (with its own dependencies, at the versions
    # requirements/dev.txt pins) right after torch, so that its JIT ops compile while pip installs
    # the rest of requirements/dev.txt (transformers, matplotlib, pytest: minutes of unpacking).
    early = not stock and not req_current and not build_current
    reqs = list(zip(REQUIREMENTS, REQUIREMENTS_ABOUT))
    if req_current:
        log("requirements up to date")
        reqs = []
    elif early:
        install_requirements(venv, reqs[:1])
        reqs = reqs[1:]

    label = f"stock deepspeed {base}" if stock else f"deepspeed {base}+zero3muon"
    if build_current:
        log(f"{label} up to date")
    else:
        if not early:
            install_requirements(venv, reqs)
            reqs = []
        venv.stamp("build").unlink(missing_ok=True)
        if stock:
            log(f"installing {label} from its sdist, sha256-checked")
            pin = venv.dir / "stock-deepspeed.txt"
            pin.write_text(f"deepspeed=={base} --hash=sha256:{sdist_sha256(base)}\n")
            # DeepSpeed's setup.py imports torch: build against the venv's pinned torch
            venv.pip("install", "-q", "setuptools", "wheel", "-c", REQUIREMENTS[0])
            venv.pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-binary", "deepspeed",
                     "--require-hashes", "-r", pin)
        else:
            with Step(f"building and installing {label} (pip install .: the release's sdist, downloaded once "
                      "and sha256-checked, with our files and patches)", "about 1 min"):
                env = dict(os.environ, DS_ZERO3MUON_BASE=base)
                venv.pip("install", "-q", *(f"-c{r}" for r in REQUIREMENTS), ".", env=env)
        venv.mark("build", build_hash)

    # Every Python of the venv runs the venv's ninja (the hook, Venv.env); its version is part of
    # the ops' stamps, so ops an older setup built with another ninja (whose .ninja_log the venv's
    # does not read: everything would rebuild at the first run) are rebuilt, once.
    builder = None
    if early:  # the ops compile beside the rest of the requirements
        install_venv_hook(venv)
        check_extension_locks(venv)
        builder = start_ops(venv, ops, beside="the rest of the requirements", nice=0)
    try:
        install_requirements(venv, reqs)
        install_testing(venv)
    finally:
        if builder is not None and builder.poll() is None:
            log("waiting for the JIT op build")
            builder.wait()
    if builder is not None and builder.returncode != 0:
        sys.exit(f"[dev] the JIT op build failed (exit {builder.returncode}): see its lines above")
    if not req_current:
        venv.mark("requirements", req_hash)
    install_venv_hook(venv)
    check_extension_locks(venv)
    build_ops(venv, ops)
    log(f"ready: {venv.dir.relative_to(ROOT)} ({'stock' if stock else 'patched'} DeepSpeed {base})")
    return venv


def install_requirements(venv, reqs):
    """pip install each ``(requirements file, (what, how long))`` of ``reqs``, in order."""
    for req, about in reqs:
        with Step(f"installing {req.relative_to(ROOT)}: {about[0]}", about[1]):
            venv.pip("install", "-q", "-r", req)


def ops_to_build(venv, ops):
    """``[(name, stamp, digest)]`` of the ``ops`` of ``venv`` not built yet for its current build."""
    ninja = venv.ninja_version()
    todo = []
    for name in ops:
        digest = tree_hash([], extra=f"{venv.build_hash} {name} ninja={ninja}")
        if not venv.is_current(f"op-{name}", digest):
            todo.append((name, venv.stamp(f"op-{name}"), digest))
    return todo


def warm_ops_command(venv, todo):
    import json
    return [venv.python, "-c", WARM_JIT_OPS, json.dumps([[name, str(stamp), digest] for name, stamp, digest in todo])]


def build_ops(venv, ops):
    """Build (JIT-compile once) the ``ops`` of ``venv`` that are not built yet, in the foreground."""
    todo = ops_to_build(venv, ops)
    if not todo:
        if ops:
            log(f"DeepSpeed JIT ops up to date: {', '.join(ops)}")
        return
    with Step(f"building DeepSpeed's JIT ops for the CPU accelerator once: {', '.join(n for n, _, _ in todo)}"):
        run(warm_ops_command(venv, todo), env=venv.env())


def start_ops(venv, ops, beside="the tests (a test that needs one first waits for it)", nice=10):
    """Start building the ``ops`` of ``venv`` not built yet beside what runs next, at ``nice``;
    returns the process, or None if there is nothing to build."""
    todo = ops_to_build(venv, ops)
    if not todo:
        return None
    log(f"building DeepSpeed's JIT ops {', '.join(n for n, _, _ in todo)} beside {beside}")
    return subprocess.Popen([str(c) for c in warm_ops_command(venv, todo)], cwd=ROOT, env=venv.env(),
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def install_testing(venv):
    """``pip install --no-deps --no-build-isolation -e testing``: the package ``muon_testing`` (models,
    comparisons, reference) that the tests, the benchmark and the demo import. Editable, so edits to
    its modules need no reinstall; reinstalled when testing/pyproject.toml or this checkout's path
    changes (a venv copied from another checkout would import that one's package)."""
    digest = tree_hash([TESTING / "pyproject.toml"], extra=f"editable {TESTING}")
    if venv.is_current("testing", digest):
        log("muon_testing up to date")
        return
    venv.stamp("testing").unlink(missing_ok=True)
    probe = subprocess.run([str(venv.python), "-c", "import setuptools"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    if probe.returncode != 0:  # the editable build runs in the venv (no build isolation: works offline)
        venv.pip("install", "-q", "setuptools", "-c", REQUIREMENTS[0])
    log(f"installing {TESTING.relative_to(ROOT)}/ (muon_testing, editable)")
    venv.pip("install", "-q", "--no-deps", "--no-build-isolation", "-e", TESTING)
    venv.mark("testing", digest)


OP_SETS = {"all": JIT_OPS, "demo": DEMO_OPS, "test": TEST_OPS_FIRST, "none": ()}


def cmd_setup(args, _extra):
    venv = setup(args.base, ops=OP_SETS[args.ops])
    rel = venv.dir.relative_to(ROOT)
    log(f"your own script (README, 'To run your own scripts'): DS_ACCELERATOR=cpu "
        f"TORCH_EXTENSIONS_DIR={rel}/torch_extensions PYTHONSAFEPATH=1 TORCHDYNAMO_DISABLE=1 "
        f"PYTHONWARNINGS=ignore::FutureWarning {rel}/bin/torchrun --nproc-per-node 2 --master_port 29517 "
        "script.py (DS_ACCELERATOR=cpu only on a machine without GPU)")
    return 0


def pristine_sdist(base):
    """The sha256-checked ``deepspeed-<base>.tar.gz`` the build cached, or None. The tests compare
    the patched ``muon_update`` with the release's own from it (``DS_ZERO3MUON_SDIST``)."""
    sys.path.insert(0, str(ROOT / "build_backend"))
    import zero3muon_build as zb
    cached = zb.default_cache_dir() / f"deepspeed-{base}.tar.gz"
    if cached.is_file() and zb.sha256_of(cached) == sdist_sha256(base):
        return cached
    return None


def cmd_test(args, extra):
    """pytest in the venv of ``--base``. The whole suite (no pytest arguments, as in CI) starts at once,
    with every JIT op it loads compiling beside it: the shm comm op and FusedAdam, which nearly every
    distributed test loads, at normal priority (the first such test waits for them, a few minutes at
    most), CPU Adam and async I/O, which only the offload and NVMe tests load (they run late), at nice
    10. A selection of tests (pytest arguments) gets the first two built before it starts; a selected
    test that loads another op builds it when it needs it (nothing is built beside a selection, so it
    ends when its tests do)."""
    whole_suite = not extra
    venv = setup(args.base, ops=() if whole_suite else TEST_OPS_FIRST)
    env = venv.env(TORCHDYNAMO_DISABLE="1")
    sdist = None if os.environ.get("DS_ZERO3MUON_SDIST") else pristine_sdist(args.base)
    if sdist is not None:
        env["DS_ZERO3MUON_SDIST"] = str(sdist)
        log(f"DS_ZERO3MUON_SDIST={sdist} (the release's muon_update, for the bit-identity tests)")
    builders = [b for b in (start_ops(venv, TEST_OPS_FIRST, nice=0), start_ops(venv, TEST_OPS_BESIDE))
                if b is not None] if whole_suite else []
    log(f"pytest {' '.join(extra)}".rstrip())
    try:
        rc = subprocess.run([str(venv.python), "-m", "pytest", *extra], cwd=ROOT, env=env).returncode
    finally:
        for builder in builders:
            if builder.poll() is None:
                log("waiting for the JIT op build started beside the tests (so the next run has them; Ctrl-C "
                    "stops it, and the op is built again where a test needs it)")
                try:
                    builder.wait()
                except KeyboardInterrupt:
                    builder.terminate()
                    builder.wait()
                    raise
    for builder in builders:
        if builder.returncode != 0:
            log(f"a JIT op build beside the tests failed (exit {builder.returncode}): see its lines above")
            rc = rc or builder.returncode
    if rc == 5:
        log("pytest collected no tests: treated as a failure")
        return 1
    return rc


def cmd_demo(args, extra):
    if not DEMO.is_file():
        log(f"{DEMO.relative_to(ROOT)} does not exist (yet): no demo to run")
        return 1
    venv = setup(args.base, ops=DEMO_OPS)
    if not any(a == "--out" or a.startswith("--out=") for a in extra):
        extra = ["--out", f"out/demo/{args.base}", *extra]  # one directory per base: runs do not overwrite
    return subprocess.run([str(venv.python), str(DEMO), *extra], cwd=ROOT, env=venv.env()).returncode


def bench_bases(args, default_base, known):
    """Bases whose patched and stock builds the benchmark compares: the default base (stock
    0.19.8 is the benchmark's reference) and ``--base`` if another, or every known base with
    ``--all-bases``."""
    return sorted(known) if args.all_bases else sorted({default_base, args.base})


def cmd_bench(args, extra):
    """The venvs the benchmark compares (patched and stock of ``bench_bases``), then the
    benchmark, run by the patched default-base venv's Python (it launches each build's own
    Python per workload)."""
    default_base, known = project_config()
    pythons = {}
    for base in bench_bases(args, default_base, known):
        for stock in (True, False):
            venv = setup(base, stock)
            pythons[f"{'stock' if stock else 'patched'}-{base}"] = str(venv.python)
    driver = Venv(default_base)
    args = [str(driver.python), str(BENCH)] + [f"--python={k}={v}" for k, v in sorted(pythons.items())] + extra
    return subprocess.run(args, cwd=ROOT, env=driver.env()).returncode


def cmd_export(args, _extra):
    sys.path.insert(0, str(ROOT / "build_backend"))
    import zero3muon_export as ze
    try:
        result = ze.export(args.base, args.out, ROOT)
    except ze.zb.BuildError as e:
        log(f"export failed: {e}")
        return 1
    limit = ze.MAX_CHANGED_LINES
    backports = "".join(f" + backport ({bp.group.title})" for bp in result.backports)
    for piece in result.pieces:
        over = f", {piece.changed_lines - limit} over the limit of {limit}: MISSED" if (
            piece.group and piece.changed_lines > limit) else ""
        log(f"{piece.stem}: {piece.group.title if piece.group else 'every pull request' + backports}")
        log(f"  {piece.changed_lines} changed lines{over}; {piece.diffstat.rstrip().splitlines()[-1].strip()}")
        log(f"  wrote {piece.diff_path}")
        log(f"  wrote {piece.text_path}")
    log(f"merge order: {ze.graph_line([pr.group for pr in result.pull_requests])}")
    if not ze.ENFORCE_MAX_CHANGED_LINES and any(pr.changed_lines > limit for pr in result.pull_requests):
        log(f"MISSED: pull requests over the limit of {limit} changed lines: " + ", ".join(
            f"{pr.stem} {pr.changed_lines}" for pr in result.pull_requests if pr.changed_lines > limit) +
            " (not enforced: ENFORCE_MAX_CHANGED_LINES in build_backend/zero3muon_export.py)")
    return 0


# `dev.py intree --cpu-fp16`: written next to the copied tests/ and loaded with `pytest -p`.
CPU_FP16_PLUGIN_NAME = "zero3muon_intree_cpu_fp16"
CPU_FP16_PLUGIN = '''"""pytest plugin of `python3 dev.py intree --cpu-fp16` (written by zero3muon's dev.py).

DeepSpeed's CPU accelerator reports fp16 as supported only where oneDNN says the CPU has fp16
arithmetic; elsewhere upstream's fp16 tests skip (many at module level, on
`get_accelerator().supported_dtypes()`) and `deepspeed.initialize` refuses fp16. torch computes
fp16 on any CPU (slowly), so this reports it as supported: `is_fp16_supported()` is true and
`supported_dtypes()` holds torch.float16. Nothing else changes.

It must act in the pytest process (module-level skips, collection) and in the ranks that
DistributedTest forks from a multiprocessing forkserver, which loads no pytest plugin: the module
patches at import and asks the forkserver to import it too (multiprocessing.set_forkserver_preload,
before the first test starts the forkserver).
"""
import multiprocessing

import torch
from deepspeed.accelerator import cpu_accelerator


def _is_fp16_supported(self):
    return True


def _supported_dtypes(self):
    return [torch.float, torch.bfloat16, torch.float16]


cpu_accelerator.CPU_Accelerator.is_fp16_supported = _is_fp16_supported
cpu_accelerator.CPU_Accelerator.supported_dtypes = _supported_dtypes
multiprocessing.set_forkserver_preload([__name__])
'''
UPSTREAM_MUON_TESTS = "unit/ops/muon"  # upstream's own Muon tests, relative to tests/


def _git_out(*args):
    res = subprocess.run(["git", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def deepspeed_tests(repo, ref, dest):
    """Copy DeepSpeed's tests/ from ``repo`` into ``dest/tests``; return a line naming what was used.

    ``repo``: a checkout (the tests/ of its working tree is copied as it is) or a git directory
    without work tree, e.g. a bare mirror (``git archive <ref> tests``)."""
    repo = Path(repo).expanduser().resolve()
    if (repo / "tests" / "unit" / "common.py").is_file():
        shutil.copytree(repo / "tests", dest / "tests", symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        commit = _git_out("-C", str(repo), "log", "-1", "--format=%H (%cd, %s)", "--date=short")
        dirty = _git_out("-C", str(repo), "status", "--porcelain", "--", "tests")
        state = "not a git checkout"
        if commit:
            state = f"commit {commit}" + (", tests/ with local changes" if dirty else "")
        version = (repo / "version.txt").read_text().strip() if (repo / "version.txt").is_file() else "?"
        return f"DeepSpeed tests/ of the checkout {repo}, {state}, version.txt {version}"
    commit = _git_out("--git-dir", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}")
    if commit is None:
        sys.exit(f"[dev] {repo}: neither a DeepSpeed checkout (no tests/unit/common.py) nor a git directory "
                 f"with a commit {ref!r}")
    res = subprocess.run(["git", "--git-dir", str(repo), "archive", "--format=tar", commit, "tests"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if res.returncode != 0:
        sys.exit(f"[dev] git archive {commit} tests failed in {repo}: {res.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # noqa: S202 - git archive of a local repository
    if not (dest / "tests" / "unit" / "common.py").is_file():
        sys.exit(f"[dev] {repo} at {commit}: no tests/unit/common.py; is it DeepSpeed's repository?")
    about = _git_out("--git-dir", str(repo), "log", "-1", "--format=%cd, %s", "--date=short", commit)
    version = _git_out("--git-dir", str(repo), "show", f"{commit}:version.txt") or "?"
    return f"DeepSpeed tests/ of the git directory {repo}, {ref} = commit {commit} ({about}), version.txt {version}"


def cmd_intree(args, extra):
    """The exported tests inside a copy of DeepSpeed's tests/, run with DeepSpeed's own conftest.py,
    pytest.ini and tests/unit/common.py (DistributedTest) by the patched venv's pytest; with
    --stock, upstream's tests only, by the stock venv's."""
    sys.path.insert(0, str(ROOT / "build_backend"))
    import zero3muon_export
    project = Path(args.tests_from).resolve() if args.tests_from else ROOT
    ours = []
    if not args.stock:
        owners = zero3muon_export.assign(args.base, project, strict=False)
        ours = sorted(p for files in owners.values() for p in files
                      if zero3muon_export.exported_path(p).startswith("tests/"))
        if not ours:
            log(f"no exported tests in {project / 'tests'}")
            return 1
    venv = setup(args.base, stock=args.stock)
    tmp = Path(tempfile.mkdtemp(prefix="zero3muon-intree-"))
    try:
        used = deepspeed_tests(args.deepspeed_repo, args.ref, tmp)
        for rel in ours:  # testing/muon_testing/ goes to tests/muon_testing/, as the export writes it
            dest = tmp / zero3muon_export.exported_path(rel)
            if dest.exists() and dest.read_bytes() != (project / rel).read_bytes():
                log(f"{dest.relative_to(tmp)} exists in DeepSpeed's tests/ with other contents: not overwriting it")
                return 1
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / rel, dest)
        targets = list(extra)
        if not targets:
            targets = [Path(rel).relative_to("tests").as_posix() for rel in ours if Path(rel).name.startswith("test_")]
            targets.append(UPSTREAM_MUON_TESTS)
        cmd = [str(venv.python), "-m", "pytest"]
        env = venv.env(TORCHDYNAMO_DISABLE="1", LOCAL_SIZE="4")
        if args.cpu_fp16:
            (tmp / f"{CPU_FP16_PLUGIN_NAME}.py").write_text(CPU_FP16_PLUGIN)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH")) if p)
            cmd += ["-p", CPU_FP16_PLUGIN_NAME]
        if not any(a.startswith("-r") for a in extra):
            cmd.append("-rfEs")  # the summary names every failure, error and skip, with the reason
        log(used)
        log(f"{'stock' if args.stock else 'patched'} DeepSpeed {args.base} of {venv.dir.relative_to(ROOT)}; "
            + (f"{len(ours)} exported test file(s) of {project} copied in" if ours else "upstream's tests only")
            + ("; fp16 reported as supported by the CPU accelerator (--cpu-fp16)" if args.cpu_fp16 else ""))
        log(f"in {tmp / 'tests'}: DS_ACCELERATOR=cpu LOCAL_SIZE=4 TORCHDYNAMO_DISABLE=1 PYTHONSAFEPATH=1 "
            f"python -m pytest {' '.join(cmd[3:] + targets)}")
        rc = subprocess.run(cmd + targets, cwd=tmp / "tests", env=env).returncode
        log(f"pytest exit {rc}; used {used}")
        if rc == 5:
            log("pytest collected no tests: treated as a failure")
            return 1
        return rc
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def lint_venv():
    """.venv/lint/: the pinned linters of DeepSpeed's pre-commit hooks (requirements/lint.txt), apart
    from the project's venvs; created or updated under a lock (the lint test may create it too)."""
    venv = Venv("lint")
    venv.dir.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.dir.parent / ".lint.lock", "w") as lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # not on POSIX: no lock
            pass
        if not venv.python.exists():
            log(f"creating venv {venv.dir.relative_to(ROOT)}")
            run([sys.executable, "-m", "venv", venv.dir])
        req_hash = tree_hash([LINT_REQUIREMENTS])
        if not venv.is_current("requirements", req_hash):
            log(f"installing {LINT_REQUIREMENTS.relative_to(ROOT)}")
            venv.pip("install", "-q", "-r", LINT_REQUIREMENTS)
            venv.mark("requirements", req_hash)
    return venv


def cmd_lint(args, _extra):
    """DeepSpeed's pre-commit hooks on each exported pull request's Python files
    (build_backend/lint/zero3muon_lint.py); exit 0 clean, 1 findings, 2 could not run."""
    venv = lint_venv()
    sys.path.insert(0, str(ROOT / "build_backend" / "lint"))
    import zero3muon_lint
    return zero3muon_lint.main(args.base,
                               venv.python.parent,
                               ROOT,
                               deepspeed_repo=args.deepspeed_repo,
                               ref=args.ref,
                               fix=args.fix,
                               paths=args.paths,
                               verbose=args.verbose,
                               requirements=LINT_REQUIREMENTS)


def cmd_wheelhouse(args, _extra):
    """The offline wheelhouse (build_backend/zero3muon_wheelhouse.py); exit 1 when it fails or is too big."""
    sys.path.insert(0, str(ROOT / "build_backend"))
    import zero3muon_wheelhouse as wh
    _default, known = project_config()
    bases = args.bases or sorted(known, reverse=True)
    try:
        manifest = wh.make(args.out, bases, args.python_version, ROOT)
    except (wh.WheelhouseError, wh.zb.BuildError) as e:
        log(f"wheelhouse failed: {e}")
        return 1
    for entry in manifest["files"]:
        log(f"  {entry['kind']:10} {entry['file']} ({entry['bytes'] / 2**20:.2f} MiB)")
    log(f"wheelhouse {args.out}: {len(manifest['files'])} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB "
        f"(limit {wh.MAX_BYTES / 2**20:.0f} MiB), Python {manifest['python_version']}")
    return 0


def cmd_gpu_check(args, extra):
    """bench/gpu_check.py's check (stdlib driver; each build runs under --python with PYTHONPATH)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check
    return gpu_check.main(extra, root=ROOT)


def main(argv=None):
    default_base, known = project_config()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, helptext in (("setup", cmd_setup, "create/update .venv/<base>/"),
                                 ("test", cmd_test, "setup, then run pytest (extra args go to pytest)"),
                                 ("demo", cmd_demo, "setup, then run examples/demo/run_demo.py (extra args go "
                                  "to it, e.g. --quick; output in out/demo/<base>/ unless --out)"),
                                 ("bench", cmd_bench, "stock and patched venvs of the default base (--all-bases: "
                                  "every base), then bench/run_bench.py (extra args go to it: --net RATE|auto, "
                                  "--repeats, --world-sizes, --grid, --steps, --out; all of them: "
                                  "python bench/run_bench.py --help under a venv's Python)"),
                                 ("export", cmd_export, "write the change as six pull requests (diff and "
                                  "description each, their changed lines printed) and the combined diff, against "
                                  "the release"),
                                 ("intree", cmd_intree, "setup, then run the exported tests inside a copy of "
                                  "DeepSpeed's tests/ (args after -- go to pytest, run in that tests/)"),
                                 ("lint", cmd_lint, "DeepSpeed's pre-commit hooks (yapf --diff, flake8, codespell, "
                                  "check-torchdist/-torchcuda/-license, trailing whitespace, end of file) on the "
                                  "Python files each exported pull request adds or changes (venv .venv/lint/; "
                                  "exit 1 on findings)"),
                                 ("wheelhouse", cmd_wheelhouse, "the wheels an offline GPU node with torch needs "
                                  "(patched and stock DeepSpeed of every base, DeepSpeed's requirements but torch), "
                                  "manifest.json and SHA256SUMS; fails over 64 MiB"),
                                 ("gpu-check", cmd_gpu_check, "on an offline GPU node: install the builds of a "
                                  "wheelhouse it uses into a scratch --target, then the exchange, the measurements, "
                                  "the W=1 tests and the seed table on the device, within --budget-s; OUT gets "
                                  "three flat files (arguments: python3 bench/gpu_check.py --help)")):
        # gpu-check's options are bench/gpu_check.py's own, so its --help is that script's
        p = sub.add_parser(name, help=helptext, description=helptext, allow_abbrev=False,
                           add_help=name != "gpu-check")
        p.add_argument("--base", default=os.environ.get("DS_ZERO3MUON_BASE") or default_base,
                       help=f"DeepSpeed base release, one of {', '.join(known)} (default: %(default)s)")
        p.set_defaults(func=func)
        if name == "setup":
            p.add_argument("--ops", choices=sorted(OP_SETS), default="all",
                           help="which DeepSpeed JIT ops to build (compile once) now: all four (default: shm comm, "
                           "FusedAdam, CPU Adam, async I/O where libaio is installed), those the demo or the test "
                           "suite builds before it starts, or none (each is then compiled where first used)")
        if name == "bench":
            p.add_argument("--all-bases", action="store_true", help="also every other base's patched and "
                           f"stock builds ({', '.join(b for b in known if b != default_base)}); default: "
                           f"{default_base}'s two")
        if name == "wheelhouse":
            p.add_argument("--out", type=Path, required=True, help="directory to write (replaced if a wheelhouse)")
            p.add_argument("--python-version", default="3.12", help="the node's Python (default: %(default)s)")
            p.add_argument("--bases", nargs="+", choices=known, help="bases to build (default: all)")
        if name == "export":
            p.add_argument("--out", type=Path, help="output directory (default: out/export/<base>/)")
        if name == "intree":
            p.add_argument("--deepspeed-repo", required=True, metavar="PATH",
                           help="a DeepSpeed checkout, or a git directory without work tree (e.g. a bare mirror)")
            p.add_argument("--ref", default="HEAD", help="commit of a git directory to take tests/ from "
                           "(default: %(default)s; a checkout's working tree is used as it is)")
            p.add_argument("--stock", action="store_true", help="the stock venv .venv/stock-<base>/ and "
                           "upstream's tests only (default target: unit/ops/muon)")
            p.add_argument("--cpu-fp16", action="store_true", help="report fp16 as supported by the CPU "
                           "accelerator (a pytest plugin written to the temporary tree), so upstream's fp16 tests run")
            p.add_argument("--tests-from", metavar="CHECKOUT", help="take the exported tests from this project "
                           "checkout instead of this one")
            p.add_argument("--keep", action="store_true", help="keep the temporary tree and print its path")
        if name == "lint":
            p.add_argument("--deepspeed-repo", metavar="PATH", help="a DeepSpeed checkout, or a git directory "
                           "without work tree (e.g. a bare mirror): its .pre-commit-config.yaml, root configs and "
                           "scripts/ (default: the fallback, build_backend/lint/'s statement of the same settings)")
            p.add_argument("--ref", default="HEAD", help="commit of a git directory to take them from "
                           "(default: %(default)s; a checkout's working tree is used as it is)")
            p.add_argument("--fix", action="store_true", help="first run yapf in place on our own files (never "
                           "on patched upstream files), then lint")
            p.add_argument("--paths", nargs="+", metavar="FILE", help="lint these files instead of the pull "
                           "requests' (with --fix: format them in place)")
            p.add_argument("-v", "--verbose", action="store_true", help="also print yapf's hunks and the "
                           "release's own findings")
    args, extra = parser.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.command in ("setup", "export", "lint", "wheelhouse") and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.base not in known:
        parser.error(f"unknown base {args.base!r}; known: {', '.join(known)}")
    try:
        return args.func(args, extra)
    except subprocess.CalledProcessError as e:
        log(f"failed (exit {e.returncode}): {' '.join(map(str, e.cmd))}")
        return e.returncode or 1


if __name__ == "__main__":
    sys.exit(main())
