#!/usr/bin/env python3
"""Developer commands for the ZeRO-3 Muon patch (stdlib only; runs on Python >= 3.9, the venv it
creates needs Python >= 3.10).

  python3 dev.py setup [--base X]            venv .venv/<X>/ with torch, test deps and patched DeepSpeed
  python3 dev.py test  [--base X] [ARGS...]  setup, then pytest (ARGS go to pytest)
  python3 dev.py demo  [--base X] [ARGS...]  setup, then examples/demo/run_demo.py ARGS
  python3 dev.py bench [ARGS...]             patched and stock venvs of every base, then bench/run_bench.py ARGS
  python3 dev.py export [--base X] [--out DIR] the change as one diff against the release + PR text
                                             (default DIR: out/export/<X>/; needs no venv)

--base defaults to $DS_ZERO3MUON_BASE, else [tool.zero3muon] default-base in pyproject.toml.
Setup is idempotent: requirements are reinstalled only when requirements/*.txt change, and
DeepSpeed is rebuilt only when pyproject.toml, build_backend/, deepspeed/ or patches/<base>/ change.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REQUIREMENTS = [ROOT / "requirements" / "torch.txt", ROOT / "requirements" / "dev.txt"]  # installed in this order
DEMO = ROOT / "examples" / "demo" / "run_demo.py"
BENCH = ROOT / "bench" / "run_bench.py"

# DeepSpeed JIT-compiles its C++ ops on the CPU accelerator the first time they are used: the
# shared-memory comm op (at init_distributed), the CPU FusedAdam of Muon's auxiliary Adam, CPU
# Adam (optimizer offload) and async I/O (NVMe offload; only where libaio is installed). That
# takes minutes, so setup builds them once, into the venv's own extensions dir (a cache shared
# between venvs is rebuilt whenever another venv's torch path appears in it).
JIT_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder")
WARM_JIT_OPS = f"""
import time
from deepspeed.accelerator import get_accelerator
for name in {JIT_OPS!r}:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        print(f"[dev]   {{name}}: loading (compiled on first use: minutes on a small machine)", flush=True)
        start = time.time()
        builder.load()
        print(f"[dev]   {{name}}: ready in {{time.time() - start:.0f}} s", flush=True)
    else:
        print(f"[dev]   {{name}}: not buildable here, skipped", flush=True)
"""


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
        """Environment for running the project: CPU accelerator, this venv's JIT op cache, and no
        current directory on sys.path (the repo's partial deepspeed/ must not shadow the install)."""
        return dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(self.extensions), PYTHONSAFEPATH="1",
                    **extra)

    def stamp(self, name):
        return self.dir / f".zero3muon-{name}.sha256"

    def is_current(self, name, digest):
        f = self.stamp(name)
        return f.is_file() and f.read_text().strip() == digest

    def mark(self, name, digest):
        self.stamp(name).write_text(digest + "\n")

    def pip(self, *args, env=None):
        run([self.python, "-m", "pip", "--disable-pip-version-check", *args], env=env)


def setup(base, stock=False):
    """Create or update the venv of ``base``: patched DeepSpeed, or with ``stock`` the unpatched
    release (same pinned torch and dependencies; used by the benchmark). Returns the ``Venv``."""
    venv = Venv(base, stock)
    if not venv.python.exists():
        if sys.version_info < (3, 10):
            sys.exit(f"[dev] the pinned torch (requirements/torch.txt) needs Python >= 3.10 in the venv, "
                     f"and this is Python {sys.version.split()[0]}: run dev.py with a newer python3")
        log(f"creating venv {venv.dir.relative_to(ROOT)}")
        run([sys.executable, "-m", "venv", venv.dir])

    req_hash = tree_hash(REQUIREMENTS)
    if venv.is_current("requirements", req_hash):
        log("requirements up to date")
    else:
        for req in REQUIREMENTS:
            log(f"installing {req.relative_to(ROOT)}")
            venv.pip("install", "-q", "-r", req)
        venv.mark("requirements", req_hash)

    if stock:
        build_hash = tree_hash([], extra=f"stock deepspeed=={base} sha256={sdist_sha256(base)}")
    else:
        inputs = [ROOT / "pyproject.toml", ROOT / "build_backend", ROOT / "deepspeed", ROOT / "patches" / base]
        build_hash = tree_hash([p for p in inputs if p.exists()], extra=f"base={base}")
    label = f"stock deepspeed {base}" if stock else f"deepspeed {base}+zero3muon"
    if venv.is_current("build", build_hash):
        log(f"{label} up to date")
    else:
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
            log(f"building and installing {label} (pip install .)")
            env = dict(os.environ, DS_ZERO3MUON_BASE=base)
            venv.pip("install", "-q", "-c", REQUIREMENTS[0], ".", env=env)
        venv.mark("build", build_hash)
        venv.stamp("jit-ops").unlink(missing_ok=True)

    ops_hash = tree_hash([], extra=f"{build_hash} {JIT_OPS}")
    if venv.is_current("jit-ops", ops_hash):
        log("DeepSpeed JIT ops up to date")
    else:
        log(f"building DeepSpeed's JIT ops for the CPU accelerator once: {', '.join(JIT_OPS)}")
        run([venv.python, "-c", WARM_JIT_OPS], env=venv.env())
        venv.mark("jit-ops", ops_hash)
    log(f"ready: {venv.dir.relative_to(ROOT)} ({'stock' if stock else 'patched'} DeepSpeed {base})")
    return venv


def cmd_setup(args, _extra):
    setup(args.base)
    return 0


def cmd_test(args, extra):
    venv = setup(args.base)
    log(f"pytest {' '.join(extra)}".rstrip())
    rc = subprocess.run([str(venv.python), "-m", "pytest", *extra], cwd=ROOT,
                        env=venv.env(TORCHDYNAMO_DISABLE="1")).returncode
    if rc == 5:
        log("pytest collected no tests: treated as a failure")
        return 1
    return rc


def cmd_demo(args, extra):
    if not DEMO.is_file():
        log(f"{DEMO.relative_to(ROOT)} does not exist (yet): no demo to run")
        return 1
    venv = setup(args.base)
    if not any(a == "--out" or a.startswith("--out=") for a in extra):
        extra = ["--out", f"out/demo/{args.base}", *extra]  # one directory per base: runs do not overwrite
    return subprocess.run([str(venv.python), str(DEMO), *extra], cwd=ROOT, env=venv.env()).returncode


def cmd_bench(_args, extra):
    """Every venv the benchmark compares (patched and stock, each base), then the benchmark, run by
    the patched default-base venv's Python (it launches each build's own Python per workload)."""
    default_base, known = project_config()
    pythons = {}
    for base in known:
        for stock in (True, False):
            venv = setup(base, stock)
            pythons[f"{'stock' if stock else 'patched'}-{base}"] = str(venv.python)
    driver = Venv(default_base)
    args = [str(driver.python), str(BENCH)] + [f"--python={k}={v}" for k, v in sorted(pythons.items())] + extra
    return subprocess.run(args, cwd=ROOT, env=driver.env()).returncode


def cmd_export(args, _extra):
    sys.path.insert(0, str(ROOT / "build_backend"))
    import zero3muon_export
    try:
        result = zero3muon_export.export(args.base, args.out, ROOT)
    except zero3muon_export.zb.BuildError as e:
        log(f"export failed: {e}")
        return 1
    for piece in result.pieces:
        title = piece.group.title if piece.group else "combined: every pull request" + "".join(
            f" + backport ({bp.group.title})" for bp in result.backports)
        log(f"{piece.stem}: {title}")
        log(f"  wrote {piece.diff_path}")
        log(f"  wrote {piece.text_path}")
        print(piece.diffstat, end="", flush=True)
    return 0


def main(argv=None):
    default_base, known = project_config()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, helptext in (("setup", cmd_setup, "create/update .venv/<base>/"),
                                 ("test", cmd_test, "setup, then run pytest (extra args go to pytest)"),
                                 ("demo", cmd_demo, "setup, then run examples/demo/run_demo.py (extra args go "
                                  "to it, e.g. --quick; output in out/demo/<base>/ unless --out)"),
                                 ("bench", cmd_bench, "stock and patched venvs of every base, then bench/run_bench.py"),
                                 ("export", cmd_export, "write the change as one diff against the release, "
                                  "and a PR description")):
        p = sub.add_parser(name, help=helptext, description=helptext, allow_abbrev=False)
        p.add_argument("--base", default=os.environ.get("DS_ZERO3MUON_BASE") or default_base,
                       help=f"DeepSpeed base release, one of {', '.join(known)} (default: %(default)s)")
        p.set_defaults(func=func)
        if name == "export":
            p.add_argument("--out", type=Path, help="output directory (default: out/export/<base>/)")
    args, extra = parser.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.command in ("setup", "export") and extra:
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
