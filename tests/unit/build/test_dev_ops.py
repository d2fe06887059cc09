"""dev.py builds the DeepSpeed JIT ops each command needs, once each (issue 39, items 2 and 3).

No compiler here: a stand-in ``deepspeed.accelerator`` (on PYTHONPATH) plays the op builders, and
the commands' subprocesses are recorded instead of run.
"""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def dev(monkeypatch):
    spec = importlib.util.spec_from_file_location("zero3muon_dev_ops", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("DS_ZERO3MUON_BASE", raising=False)
    return module


@pytest.fixture
def venv(dev, tmp_path, monkeypatch):
    v = dev.Venv("0.19.8")
    v.dir = tmp_path / "venv"
    v.dir.mkdir()
    v.python = Path(sys.executable)
    v.build_hash = "build-1"
    monkeypatch.setattr(dev.Venv, "ninja_version", lambda self: "1.13.2")
    return v


def test_each_op_has_its_own_stamp_tied_to_the_build_and_ninja(dev, venv, monkeypatch):
    names = lambda todo: [name for name, _, _ in todo]  # noqa: E731
    assert names(dev.ops_to_build(venv, dev.JIT_OPS)) == list(dev.JIT_OPS)
    for name, stamp, digest in dev.ops_to_build(venv, dev.DEMO_OPS):
        stamp.write_text(digest + "\n")
    assert dev.ops_to_build(venv, dev.DEMO_OPS) == []
    assert names(dev.ops_to_build(venv, dev.JIT_OPS)) == [n for n in dev.JIT_OPS if n not in dev.DEMO_OPS]
    venv.build_hash = "build-2"  # a rebuilt DeepSpeed: its ops again
    assert names(dev.ops_to_build(venv, dev.DEMO_OPS)) == list(dev.DEMO_OPS)
    venv.build_hash = "build-1"
    monkeypatch.setattr(dev.Venv, "ninja_version", lambda self: "1.11.1")  # another ninja: rebuilt too
    assert names(dev.ops_to_build(venv, dev.DEMO_OPS)) == list(dev.DEMO_OPS)


def test_the_commands_split_the_ops(dev):
    assert set(dev.TEST_OPS_FIRST) | set(dev.TEST_OPS_BESIDE) == set(dev.JIT_OPS)
    assert not set(dev.TEST_OPS_FIRST) & set(dev.TEST_OPS_BESIDE)
    assert set(dev.DEMO_OPS) <= set(dev.TEST_OPS_FIRST)
    assert dev.OP_SETS["all"] == dev.JIT_OPS and dev.OP_SETS["none"] == ()
    assert set(dev.OP_EXPECTED) == set(dev.JIT_OPS)


FAKE_ACCELERATOR = '''
import os, time
class _Builder:
    def __init__(self, name):
        self.name = name
    def is_compatible(self):
        return self.name != "AsyncIOBuilder"
    def load(self):
        if self.name == os.environ.get("FAKE_FAIL"):
            raise RuntimeError("compile error in " + self.name)
        time.sleep(float(os.environ.get("FAKE_LOAD_S", "0")))
class _Accelerator:
    def create_op_builder(self, name):
        return _Builder(name)
def get_accelerator():
    return _Accelerator()
'''


def _fake_deepspeed(tmp_path):
    pkg = tmp_path / "fake" / "deepspeed"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "accelerator.py").write_text(FAKE_ACCELERATOR)
    return pkg.parent


def _warm(dev, venv, tmp_path, ops, **env):
    todo = dev.ops_to_build(venv, ops)
    cmd = [str(c) for c in dev.warm_ops_command(venv, todo)]
    full_env = dict(os.environ, PYTHONPATH=str(_fake_deepspeed(tmp_path)), **env)
    return subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_warm_script_stamps_each_op_when_ready_and_says_what_it_does(dev, venv, tmp_path, monkeypatch):
    # the heartbeat is compiled into the script's text: rebuild it with the short period
    script = dev.WARM_JIT_OPS.replace(f"done.wait({dev.HEARTBEAT_S})", "done.wait(0.2)")
    assert script != dev.WARM_JIT_OPS
    monkeypatch.setattr(dev, "WARM_JIT_OPS", script)
    res = _warm(dev, venv, tmp_path, dev.JIT_OPS, FAKE_LOAD_S="0.5")
    assert res.returncode == 0, res.stdout
    assert dev.ops_to_build(venv, dev.JIT_OPS) == []
    assert "ShareMemCommBuilder: still compiling" in res.stdout  # a long build says it is alive
    assert "ShareMemCommBuilder: ready in" in res.stdout and "1.5 min" in res.stdout
    assert "AsyncIOBuilder: not buildable here, skipped" in res.stdout


def test_a_failed_op_keeps_the_ops_built_before_it(dev, venv, tmp_path):
    res = _warm(dev, venv, tmp_path, dev.JIT_OPS, FAKE_FAIL="CPUAdamBuilder")
    assert res.returncode != 0 and "compile error in CPUAdamBuilder" in res.stdout
    left = [name for name, _, _ in dev.ops_to_build(venv, dev.JIT_OPS)]
    assert left == ["CPUAdamBuilder", "AsyncIOBuilder"]


class _Recorder:

    def __init__(self, dev, monkeypatch, builder_rc=0):
        self.setup_ops, self.started, self.runs = None, None, []
        self.builder = types.SimpleNamespace(returncode=None, poll=lambda: None, wait=self._wait)
        self.builder_rc = builder_rc
        fake_venv = types.SimpleNamespace(python=Path("/venv/bin/python"), dir=ROOT / ".venv" / "0.19.8",
                                          env=lambda **kw: dict(kw))
        monkeypatch.setattr(dev, "setup", self.setup(fake_venv))
        monkeypatch.setattr(dev, "start_ops", self.start_ops)
        monkeypatch.setattr(dev, "pristine_sdist", lambda base: None)
        monkeypatch.setattr(dev.subprocess, "run", self.run)

    def setup(self, fake_venv):

        def setup(base, stock=False, ops=None):
            self.setup_ops = ops
            return fake_venv

        return setup

    def start_ops(self, venv, ops, nice=10):
        self.started = (self.started or ()) + tuple(ops)
        self.nice = getattr(self, "nice", ()) + (nice, )
        return self.builder

    def _wait(self):
        self.builder.returncode = self.builder_rc
        return self.builder_rc

    def run(self, cmd, **kwargs):
        self.runs.append(cmd)
        return types.SimpleNamespace(returncode=0)


def test_a_selection_builds_the_first_ops_before_and_nothing_beside_pytest(dev, monkeypatch):
    """A selection ends when its tests do: no op build beside it to wait for (a test that loads another op builds
    it when it needs it)."""
    rec = _Recorder(dev, monkeypatch)
    assert dev.main(["test", "-k", "x"]) == 0
    assert rec.setup_ops == dev.TEST_OPS_FIRST and rec.started is None
    assert rec.runs[-1][-3:] == ["pytest", "-k", "x"]


def test_the_whole_suite_starts_at_once_with_every_op_beside_it(dev, monkeypatch):
    rec = _Recorder(dev, monkeypatch)
    assert dev.main(["test"]) == 0
    assert rec.setup_ops == ()
    assert rec.started == dev.TEST_OPS_FIRST + dev.TEST_OPS_BESIDE and rec.nice == (0, 10)
    assert rec.runs[-1][-2:] == ["-m", "pytest"]


def test_test_fails_when_the_op_build_beside_it_fails(dev, monkeypatch):
    rec = _Recorder(dev, monkeypatch, builder_rc=1)
    assert dev.main(["test"]) == 1
    assert rec.builder.returncode == 1


def test_demo_builds_only_the_ops_its_ranks_load(dev, monkeypatch):
    rec = _Recorder(dev, monkeypatch)
    assert dev.main(["demo", "--quick"]) == 0
    assert rec.setup_ops == dev.DEMO_OPS and rec.started is None


def test_setup_ops_choice(dev, monkeypatch):
    rec = _Recorder(dev, monkeypatch)
    for choice in ("none", "demo", "test", "all"):
        assert dev.main(["setup", "--ops", choice]) == 0
        assert rec.setup_ops == dev.OP_SETS[choice]
    assert json.dumps(dev.OP_SETS["all"])  # names only
