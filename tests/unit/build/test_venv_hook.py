# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The venvs' startup hook (``build_backend/zero3muon_venv.py``, installed by ``dev.py setup``): one
ninja in every launch, and no hang on the lock a killed op build leaves.

ninja 1.11 and 1.13 do not read each other's ``.ninja_log``, so an op built by one is rebuilt from
scratch by the other (minutes per op); setup builds with the venv's ninja, and the hook makes every
Python of the venv find that one first on ``PATH``, whatever ``PATH`` it was started with. torch's
``FileBaton`` lock (``<extensions dir>/<op>/lock``, empty, kept open by the building process) of a
killed build made every later ``deepspeed.initialize`` wait forever; the hook removes a lock no
process holds, waits for a killed build's orphaned ninja, leaves a held one, and says why where it
cannot decide (``dev.py`` stops there, naming the file). Fast: fake ninjas, tiny processes, a venv
without pip. Linux only (``/proc``).
"""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the lock check reads /proc (Linux)")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _load("zero3muon_venv_under_test", REPO_ROOT / "build_backend" / "zero3muon_venv.py")
dev = _load("zero3muon_dev", REPO_ROOT / "dev.py")


def fake_ninja(directory, version):
    directory.mkdir(parents=True, exist_ok=True)
    ninja = directory / "ninja"
    ninja.write_text(f"#!/bin/sh\necho {version}\n")
    ninja.chmod(0o755)
    return ninja


def hold_lock(lock):
    """A child that creates ``lock`` as torch's FileBaton.try_acquire does and keeps it open."""
    code = ("import os, sys, time\n"
            "os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, ZERO3MUON_VENV_HOOK="0"))
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def op_dir(tmp_path):
    d = tmp_path / "torch_extensions" / "fused_adam"
    d.mkdir(parents=True)
    return d


# --------------------------------------------------------------------------- ninja


def test_venv_ninja_goes_first_whatever_path_says(tmp_path):
    prefix = tmp_path / "venv"
    venv_ninja = fake_ninja(prefix / "bin", "1.13.2")
    system = fake_ninja(tmp_path / "usr" / "bin", "1.11.1").parent
    path = os.pathsep.join([str(system), "/usr/bin", "/bin"])
    assert hook.path_with_venv_ninja(str(prefix), path) == path, "without ninja-bin/ nothing is changed"
    link = hook.make_ninja_dir(str(prefix))
    assert Path(link).parent == prefix / "ninja-bin" and os.listdir(prefix / "ninja-bin") == ["ninja"]
    assert os.path.samefile(link, venv_ninja) and hook.make_ninja_dir(str(prefix)) == link  # idempotent

    fixed = hook.path_with_venv_ninja(str(prefix), path)
    assert fixed == os.pathsep.join([str(prefix / "ninja-bin"), path]), "the system ninja came first"
    assert os.path.samefile(hook.first_on_path("ninja", fixed), venv_ninja)
    assert hook.path_with_venv_ninja(str(prefix), "") == str(prefix / "ninja-bin")

    activated = os.pathsep.join([str(prefix / "bin"), path])  # an activated venv, dev.py's Venv.env()
    assert hook.path_with_venv_ninja(str(prefix), activated) == activated
    assert hook.path_with_venv_ninja(str(prefix), fixed) == fixed  # a child of a fixed process


def test_dev_env_puts_the_venv_bin_first(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    venv = dev.Venv("0.19.8")
    env = venv.env(X="1")
    assert env["PATH"].split(os.pathsep)[0] == str(venv.dir / "bin") and env["PATH"].endswith("/usr/bin:/bin")
    assert env["TORCH_EXTENSIONS_DIR"] == str(venv.extensions) and env["X"] == "1"


@pytest.fixture(scope="module")
def hooked_venv(tmp_path_factory):
    """A real venv (no pip) with a fake ninja 1.13 in bin/ and the hook installed as dev.py setup does."""
    root = tmp_path_factory.mktemp("hooked")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    fake_ninja(root / "venv" / "bin", "1.13.2-venv")
    venv = dev.Venv("0.19.8")
    venv.dir, venv.python, venv.extensions = root / "venv", root / "venv" / "bin" / "python", root / "ext"
    dev.install_venv_hook(venv)
    dev.install_venv_hook(venv)  # idempotent
    system = fake_ninja(root / "system", "1.11.1-system").parent
    launcher = root / "venv" / "bin" / "launcher"  # a console script, as bin/deepspeed and bin/torchrun are
    launcher.write_text(f"#!{venv.python}\nimport subprocess\nsubprocess.run(['ninja', '--version'])\n")
    launcher.chmod(0o755)
    return venv, system


def run_in(venv, system, *args, **env):
    environ = dict(os.environ, PATH=os.pathsep.join([str(system), "/usr/bin", "/bin"]),
                   TORCH_EXTENSIONS_DIR=str(venv.extensions), **env)
    return subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, timeout=120)


def test_every_launch_of_the_venv_runs_its_ninja(hooked_venv):
    venv, system = hooked_venv
    site = venv.site_packages()
    assert (site / "zero3muon_venv.pth").read_text() == "import zero3muon_venv; zero3muon_venv.startup()\n"
    assert (site / "zero3muon_venv.py").read_text() == (REPO_ROOT / "build_backend" / "zero3muon_venv.py").read_text()
    show = "import subprocess; subprocess.run(['ninja', '--version'])"
    for cmd in ([str(venv.python), "-c", show], [str(venv.dir / "bin" / "launcher")]):
        proc = run_in(venv, system, *cmd)
        assert proc.returncode == 0 and proc.stdout.strip() == "1.13.2-venv", (cmd, proc.stdout, proc.stderr)
        assert proc.stderr == ""
    proc = run_in(venv, system, str(venv.python), "-c", show, ZERO3MUON_VENV_HOOK="0")
    assert proc.stdout.strip() == "1.11.1-system", "the switch turns the hook off"
    proc = run_in(venv, system, "ninja", "--version")
    assert proc.stdout.strip() == "1.11.1-system", "outside the venv's Pythons PATH is the user's"


def test_setup_stamp_follows_the_ninja_version(hooked_venv):
    venv, _system = hooked_venv
    assert venv.ninja_version() == "1.13.2-venv"


# --------------------------------------------------------------------------- locks


def test_lock_of_a_killed_build_is_removed_a_held_one_kept(op_dir):
    lock = op_dir / "lock"
    holder = hold_lock(lock)
    try:
        verdict, pids = hook.lock_state(str(lock), recheck_s=0)
        assert verdict == hook.HELD and pids == [holder.pid]
        said = []
        assert hook.clear_stale_locks([str(op_dir.parent)], say=said.append, recheck_s=0) == ([], [])
        assert lock.exists() and len(said) == 1 and f"pid {holder.pid}" in said[0]
    finally:
        kill(holder)
    assert lock.exists(), "a killed holder leaves its lock"
    said = []
    removed, unknown = hook.clear_stale_locks([str(op_dir.parent)], say=said.append, recheck_s=0)
    assert removed == [str(lock)] and unknown == [] and not lock.exists()
    assert said == [f"removed {lock}: a torch extension build lock that no process holds (a build was killed; "
                    "the op is rebuilt or reloaded at its next use)"]


def test_torch_file_baton_no_longer_waits_forever(op_dir):
    file_baton = pytest.importorskip("torch.utils.file_baton")
    lock = op_dir / "lock"
    kill(hold_lock(lock))
    baton = file_baton.FileBaton(str(lock))
    assert not baton.try_acquire(), "a later load finds the lock and would wait in FileBaton.wait()"
    hook.clear_stale_locks([str(op_dir.parent)], say=lambda _: None, recheck_s=0)
    start = time.monotonic()
    baton.wait()
    assert time.monotonic() - start < 5
    assert baton.try_acquire()
    baton.release()


def test_a_killed_builds_orphaned_ninja_is_waited_for(op_dir, tmp_path):
    lock = op_dir / "lock"
    lock.touch()
    fake = tmp_path / "bin" / "ninja"  # /proc/<pid>/comm says "ninja"
    fake.parent.mkdir()
    shutil.copy(shutil.which("sleep"), fake)
    orphan = subprocess.Popen([str(fake), "30"], cwd=op_dir)
    try:
        deadline = time.monotonic() + 10
        while hook.lock_state(str(lock), recheck_s=0)[0] != hook.ORPHAN_BUILD and time.monotonic() < deadline:
            time.sleep(0.05)  # until the exec shows in /proc
        verdict, pids = hook.lock_state(str(lock), recheck_s=0)
        assert verdict == hook.ORPHAN_BUILD and pids == [orphan.pid]
        said, polls = [], []

        def sleep(seconds):
            polls.append(seconds)
            if len(polls) == 2:  # the build ends while we wait
                kill(orphan)

        removed, _ = hook.clear_stale_locks([str(op_dir.parent)], say=said.append, recheck_s=0, wait_poll_s=7,
                                            sleep=sleep)
        assert removed == [str(lock)] and not lock.exists()
        assert 7 in polls and "waiting for it to end" in said[0] and f"pid {orphan.pid}" in said[0]
    finally:
        if orphan.poll() is None:
            kill(orphan)


def test_a_lock_released_during_the_recheck_is_not_touched(op_dir):
    lock = op_dir / "lock"
    lock.touch()

    def release_then_new_build(_seconds):  # the owner removes it; another build creates a new one
        lock.unlink()

    assert hook.lock_state(str(lock), sleep=release_then_new_build) == (hook.GONE, None)
    lock.touch()
    replaced = []

    def replace(_seconds):
        if not replaced:
            lock.unlink()
            lock.touch()
            replaced.append(os.lstat(lock).st_ino)

    verdict, inode = hook.lock_state(str(lock), sleep=replace)
    assert verdict == hook.STALE and inode[1] == replaced[0], "judged again on the new file"
    assert not hook.remove_if_stale(str(lock), (inode[0], inode[1] + 1)) and lock.exists()


@pytest.mark.parametrize("case", ["no proc", "other user", "network filesystem"])
def test_undecidable_lock_is_left_with_a_message(op_dir, tmp_path, case):
    lock = op_dir / "lock"
    lock.touch()
    kwargs = {"recheck_s": 0}
    if case == "no proc":
        kwargs["proc"] = str(tmp_path / "noproc")
    elif case == "other user":
        kwargs["euid"] = os.lstat(lock).st_uid + 1 or 1
    else:
        mounts = tmp_path / "mounts"
        mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/home {op_dir.parent.parent} nfs4 rw 0 0\n")
        kwargs["mounts"] = str(mounts)
    said = []
    removed, unknown = hook.clear_stale_locks([str(op_dir.parent)], say=said.append, **kwargs)
    assert removed == [] and lock.exists() and [u[0] for u in unknown] == [str(lock)]
    assert str(lock) in said[0] and f"rm {lock}" in said[0] and "waits forever" in said[0]


def test_dev_stops_naming_the_lock_it_cannot_judge(op_dir, monkeypatch):
    lock = op_dir / "lock"
    lock.touch()
    module = dev.venv_hook()
    monkeypatch.setattr(module, "undecidable", lambda *a, **k: "it lies on a nfs filesystem")
    venv = dev.Venv("0.19.8")
    venv.extensions = op_dir.parent
    with pytest.raises(SystemExit) as exc:
        dev.check_extension_locks(venv)
    assert str(lock) in str(exc.value) and f"rm {lock}" in str(exc.value) and lock.exists()
    monkeypatch.setattr(module, "undecidable", lambda *a, **k: None)
    dev.check_extension_locks(venv)
    assert not lock.exists()


def test_extension_dirs_are_the_ones_torch_uses(tmp_path):
    assert hook.extension_dirs({"TORCH_EXTENSIONS_DIR": "/x"}) == ["/x"]
    root = tmp_path / "torch_extensions"
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}_"
    for d in (f"{tag}cpu", f"{tag}cu128", "py39_cpu", "deepspeed-demo-abc"):
        (root / d).mkdir(parents=True)
    found = hook.extension_dirs({"XDG_CACHE_HOME": str(tmp_path)})
    assert found == [str(root / f"{tag}cpu"), str(root / f"{tag}cu128")]
    assert hook.extension_dirs({"XDG_CACHE_HOME": str(tmp_path / "none")}) == []


def test_a_launch_after_a_killed_build_removes_the_lock_at_startup(hooked_venv):
    venv, system = hooked_venv
    lock = venv.extensions / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    kill(hold_lock(lock))
    proc = run_in(venv, system, str(venv.dir / "bin" / "launcher"))
    assert proc.returncode == 0 and not lock.exists(), proc.stderr
    assert proc.stderr == f"[zero3muon] removed {lock}: a torch extension build lock that no process holds (a build " \
                          "was killed; the op is rebuilt or reloaded at its next use)\n"
    proc = run_in(venv, system, str(venv.python), "-c", "print(1)")
    assert proc.stdout == "1\n" and proc.stderr == "", "nothing to say without a lock"


def test_this_venv_has_the_current_hook():
    """Under ``dev.py test`` (a venv of this checkout) setup installed the hook, as it is in the repository."""
    prefix = Path(sys.prefix).resolve()
    if prefix.parent != (REPO_ROOT / ".venv").resolve():
        pytest.skip(f"not a venv of this checkout: {prefix}")
    installed = sys.modules.get("zero3muon_venv")  # imported by zero3muon_venv.pth at startup
    assert installed is not None, f"{prefix} has no zero3muon_venv.pth: run python3 dev.py setup"
    assert Path(installed.__file__).resolve().is_relative_to(prefix)
    assert Path(installed.__file__).read_text() == (REPO_ROOT / "build_backend" / "zero3muon_venv.py").read_text()
    assert os.path.samefile(hook.first_on_path("ninja", os.environ["PATH"]), prefix / "bin" / "ninja")
