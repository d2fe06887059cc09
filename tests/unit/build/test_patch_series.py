"""The patch series of each base (``patches/<base>/``) against the pristine upstream release.

- Every patch applies alone to the pristine release (``git apply --check``), so each can be
  proposed upstream on its own.
- The series applies in order, with the build backend's own ``apply_patches``.
- After the series, ``stage3.py`` holds no name of stock's superseded ZeRO-3 Muon path (0.19.7's
  per-micro-step update in the reduce path; 0.19.8's update before the norm, its all-gather helper
  with its buffer cache, the CPU-offload variant and the loss-scale bookkeeping), and the installed
  ``stage3.py`` neither. Likewise ``stage_1_and_2.py`` holds none of stock's ZeRO-1/2 Muon path that
  patch 0012 supersedes (the installed one is checked once its build carries patch 0012).

The pristine sdists are the ones the build verified and cached (``python3 dev.py test --base X``
caches them), or ``DS_ZERO3MUON_SDIST`` naming a ``deepspeed-<base>.tar.gz``; a base whose sdist is
in neither place is skipped with a message saying so. No network, no torch.
"""

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
STAGE3 = "deepspeed/runtime/zero/stage3.py"
STAGE12 = "deepspeed/runtime/zero/stage_1_and_2.py"


def _load_backend():
    path = REPO_ROOT / "build_backend" / "zero3muon_build.py"
    spec = importlib.util.spec_from_file_location("zero3muon_build_for_series", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


zb = _load_backend()
BASES = sorted(d.name for d in (REPO_ROOT / "patches").iterdir() if d.is_dir())

# Names of stock's superseded Muon path in stage3.py, by the base whose pristine stage3.py has them.
SUPERSEDED = {
    "0.19.7": ["_apply_distributed_muon_update", "_partitioned_buffers_all_gather", "muon_update(", "muon_beta",
               "muon_ns_method"],
    "0.19.8": ["_muon_update_sub_group", "_apply_muon_to_accumulated_grads", "_partitioned_buffers_all_gather",
               "_muon_allgather_buffers", "_muon_allgather_buffer_bytes", "_muon_allgather_max_cached_bytes",
               "_clear_muon_allgather_buffers", "_apply_muon_updates_cpu_offload", "_muon_update_lacks_loss_scale",
               "sub_groups_lacking_loss_scale", "muon_beta", "muon_ns_method"],
}
ALL_SUPERSEDED = sorted({name for names in SUPERSEDED.values() for name in names})

# Names of stock's ZeRO-1/2 Muon path in stage_1_and_2.py that patch 0012 (``binding.MuonUpdate``, Muon
# in step() after the norm and the clip) supersedes, by base: the update while the gradient
# partition is filled with its momentum buffer, staging and commit, 0.19.8's CPU-offload update
# before the norm with its all-gather helpers and buffer cache, and its loss-scale bookkeeping.
# ``_is_muon_group`` stays on 0.19.8 (``_use_compact_grad_partition_buffer`` still uses it).
SUPERSEDED_STAGE12 = {
    "0.19.7": ["muon_update(", "_is_muon_group", "_muon_momentum_buffer", "_muon_staging_momentum",
               "_commit_muon_momentum", "_muon_pending_momentum"],
    "0.19.8": ["muon_update(", "_muon_momentum_buffer", "_muon_staging_momentum", "_commit_muon_momentum",
               "_muon_pending_momentum", "_muon_all_gather_partitions", "_muon_param_batches",
               "_clear_muon_allgather_buffers", "_apply_muon_updates_cpu_offload", "_muon_update_lacks_loss_scale",
               "groups_lacking_loss_scale", "_muon_allgather_buffers", "_muon_allgather_buffer_bytes",
               "_muon_allgather_max_cached_bytes", "_muon_allgather_max_buffer_bytes"],
}


def _names_in(text, names):
    """The names found in ``text`` as words; one ending in ``(`` only where called as a function, not
    as an attribute (``muon_update(``: upstream's function; the stages' ``self.muon_update`` is the
    patch's update)."""

    def pattern(name):
        return rf"(?<![.\w]){re.escape(name)}" if name.endswith("(") else rf"\b{re.escape(name)}\b"

    return [name for name in names if re.search(pattern(name), text)]


def _patches(base):
    return zb.list_patches(base, REPO_ROOT)


def _touched_files(patches):
    files = []
    for patch in patches:
        for line in patch.read_text().splitlines():
            match = re.fullmatch(r"diff --git a/(\S+) b/(\S+)", line)
            if match and match.group(1) not in files:
                files.append(match.group(1))
    return files


def _sdist(base):
    sha = zb.load_config(REPO_ROOT)["sdist-sha256"][base]
    candidates = [zb.default_cache_dir() / f"deepspeed-{base}.tar.gz"]
    local = os.environ.get(zb.ENV_SDIST)
    if local and Path(local).name == f"deepspeed-{base}.tar.gz":
        candidates.insert(0, Path(local))
    for path in candidates:
        if path.is_file() and zb.sha256_of(path) == sha:
            return path
    pytest.skip(f"no sha256-verified deepspeed-{base}.tar.gz in {zb.default_cache_dir()} (run "
                f"`python3 dev.py test --base {base}` once, or set {zb.ENV_SDIST})")


@pytest.fixture(scope="module", params=BASES)
def pristine(request, tmp_path_factory):
    """(base, the unpacked pristine release) for each base with a patches/ folder."""
    base = request.param
    sdist = _sdist(base)
    work = tmp_path_factory.mktemp(f"pristine-{base}")
    # Only the files the patches touch, so the module does not unpack all of DeepSpeed.
    members = {f"{_top(sdist)}/{rel}" for rel in _touched_files(_patches(base))}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.name in members:
                data = tar.extractfile(member).read()
                target = work / member.name.split("/", 1)[1]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
    return base, work


def _top(sdist):
    with tarfile.open(sdist) as tar:
        return tar.getmembers()[0].name.split("/", 1)[0]


def _git_apply_check(tree, patch):
    cmd = ["git", "apply", "-p1", "--check", str(patch)]
    return subprocess.run(cmd, cwd=tree, env=zb._git_env(tree), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def test_the_superseded_names_are_in_the_pristine_release(pristine):
    """The names checked below are really stock's (so their absence after the series means something)."""
    base, tree = pristine
    text = (tree / STAGE3).read_text()
    assert _names_in(text, SUPERSEDED[base]) == SUPERSEDED[base]
    text = (tree / STAGE12).read_text()
    assert _names_in(text, SUPERSEDED_STAGE12[base]) == SUPERSEDED_STAGE12[base]


def test_each_patch_applies_alone_to_the_pristine_release(pristine):
    base, tree = pristine
    patches = _patches(base)
    assert [p.name[:4] for p in patches[:3]] == ["0001", "0002", "0003"], [p.name for p in patches]
    failures = {p.name: res.stderr.strip() for p in patches for res in [_git_apply_check(tree, p)] if res.returncode}
    assert not failures, failures


def test_series_applies_in_order_and_leaves_no_superseded_name(pristine, tmp_path):
    base, tree = pristine
    series = tmp_path / "series"
    shutil.copytree(tree, series)
    zb.apply_patches(series, _patches(base))
    text = (series / STAGE3).read_text()
    assert _names_in(text, ALL_SUPERSEDED) == []
    assert "MuonUpdate.create" in text
    text = (series / STAGE12).read_text()
    assert _names_in(text, SUPERSEDED_STAGE12[base]) == []
    assert "MuonUpdate.create" in text


def test_installed_stage3_has_no_superseded_name():
    """The stage3.py of the DeepSpeed these tests run with (the patched build of the venv)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("no installed deepspeed")
    stage3 = Path(spec.origin).parent / "runtime" / "zero" / "stage3.py"
    assert _names_in(stage3.read_text(), ALL_SUPERSEDED) == []


def test_installed_stage_1_and_2_has_no_superseded_name():
    """The stage_1_and_2.py of the DeepSpeed these tests run with, once its build carries patch 0012."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("no installed deepspeed")
    text = (Path(spec.origin).parent / "runtime" / "zero" / "stage_1_and_2.py").read_text()
    if "MuonUpdate.create" not in text:
        pytest.skip("the installed DeepSpeed was built without patch 0012 (rebuild it to check this)")
    base = re.match(r"\d+\.\d+\.\d+", importlib.metadata.version("deepspeed")).group(0)
    if base not in SUPERSEDED_STAGE12:
        pytest.skip(f"no patches/ folder for the installed DeepSpeed {base}")
    assert _names_in(text, SUPERSEDED_STAGE12[base]) == []
