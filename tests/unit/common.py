# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A small local stand-in for DeepSpeed's ``tests/unit/common.py``: the part of its interface the
ZeRO-3 Muon tests use, so that they run unchanged here and inside DeepSpeed's ``tests/unit``
(where DeepSpeed's own module is imported instead; this file is never exported).

Interface (as in DeepSpeed):

- ``class TestX(DistributedTest)`` with a ``world_size`` class attribute (an int, or a list of
  ints run one after the other), overridden per test by ``@pytest.mark.world_size(n)`` or by a
  ``world_size`` argument of the test (e.g. ``@pytest.mark.parametrize("world_size", [1, 2])``).
- The body of every ``test*`` method runs on each of W ranks after
  ``deepspeed.init_distributed``; its arguments (parametrize values and ordinary pytest fixtures,
  of any scope) are resolved in the pytest process and pickled to the ranks, so a module-scoped
  fixture is computed once and handed to every rank of every test that asks for it.
- ``pytest.skip`` in a rank skips the test; an exception in any rank fails it.
- ``reuse_dist_env = True`` keeps the W processes (and their process group) alive for the next
  test with the same W, in any class that sets it; the processes end with the pytest session.
- ``exec_timeout`` (seconds, default ``DS_UNITTEST_TIMEOUT`` or 600) per world size.
- ``class_tmpdir``: a directory shared by a class's tests.

Where the ranks run (``placement``): on the accelerator DeepSpeed detects in the pytest process
(``DS_ACCELERATOR``; ``tests/conftest.py`` defaults it to ``cpu``) with its backend (NCCL on CUDA),
rank r on its device r, where the world size is at most its device count; otherwise (a W=2 test on
one GPU, or the CPU accelerator) on the CPU accelerator with gloo. DeepSpeed's own DistributedTest
skips a test whose world size exceeds the device count instead. The session's summary says which
tests ran where (``PLACEMENTS``, printed by ``tests/conftest.py``); each test also records it as
the junit property ``ranks``.

Other differences: ranks get one intra-op thread; processes start with ``spawn``; a failure
reports every failing rank's traceback (and names ranks that did not answer, e.g. because they
wait in a collective for the failed one), then ends those processes. The pytest hook that routes
a ``DistributedTest`` here is ``pytest_pyfunc_call`` in ``tests/conftest.py``.

Inside DeepSpeed's tree (copy the ``test_zero3_muon_*.py`` files and ``zero3_muon_helpers.py``
into its ``tests/unit/runtime/zero/`` and ``testing/muon_testing/`` to its ``tests/muon_testing/``, as
``dev.py intree`` does), on the CPU:
``cd tests && LOCAL_SIZE=4 DS_ACCELERATOR=cpu TORCHDYNAMO_DISABLE=1 python -m pytest
unit/runtime/zero/test_zero3_muon_gas.py`` (LOCAL_SIZE: the CPU accelerator's device count,
which DeepSpeed's DistributedTest compares with the world size).
"""

import glob
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest

DEEPSPEED_TEST_TIMEOUT = int(os.environ.get("DS_UNITTEST_TIMEOUT", "600"))

FAILURE_GRACE = 10.0
"""Seconds the other ranks get to report once one rank has failed (they may fail too)."""


def placement(world_size):
    """``(accelerator, backend)`` the ranks of a ``world_size`` test run on (see the module
    docstring): DeepSpeed's accelerator and its communication backend where it has at least
    ``world_size`` devices and is not the CPU, else ``("cpu", "gloo")``."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and world_size <= accelerator.device_count():
        return accelerator.device_name(), accelerator.communication_backend_name()
    return "cpu", "gloo"


PLACEMENTS = []
"""``(node id, world size, accelerator, backend)`` of every DistributedTest launch this session."""


def _rank_main(rank, world_size, port, init_file, timeout, conn, accelerator="cpu", backend="gloo"):
    """A rank's process: join the process group once, then run tasks until told to stop."""
    os.environ.update(RANK=str(rank),
                      LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size),
                      DS_ACCELERATOR=accelerator,
                      OMP_NUM_THREADS="1",
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    initialized = False
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            break
        sys_path, payload = task
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        try:
            if not initialized:
                import torch
                torch.set_num_threads(1)
                import deepspeed
                from deepspeed.accelerator import get_accelerator
                if accelerator != "cpu":
                    get_accelerator().set_device(rank)
                deepspeed.init_distributed(dist_backend=backend,
                                           init_method=f"file://{init_file}",
                                           rank=rank,
                                           world_size=world_size,
                                           timeout=timedelta(seconds=timeout))
                initialized = True
            func, kwargs = pickle.loads(payload)
            func(**kwargs)
            reply = ("ok", None)
        except pytest.skip.Exception as skip:
            reply = ("skip", skip.msg)
        except BaseException:  # report everything, including SystemExit
            reply = ("error", traceback.format_exc())
        conn.send(reply)
    if initialized:
        import torch.distributed
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class _RankPool:
    """W processes joined in one process group (``placement``), running one task at a time on every rank."""

    def __init__(self, world_size, timeout):
        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.accelerator, self.backend = placement(world_size)
        self.tmpdir = tempfile.mkdtemp(prefix=f"ds-test-w{world_size}-")
        init_file = os.path.join(self.tmpdir, "filestore")  # the rendezvous; MASTER_PORT is only set
        with socket.socket() as sock:  # because DeepSpeed looks for it before it uses init_method
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.port = port
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main,
                               args=(rank, world_size, port, init_file, timeout, child, self.accelerator,
                                     self.backend),
                               daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, payload, timeout):
        """Run the pickled ``(func, kwargs)`` on every rank; return ``{rank: (status, detail)}``.

        Ranks that did not answer in time, or died, appear with status ``"error"``; after any
        error the pool is no longer usable (``self.broken``).
        """
        for conn in self.conns:
            conn.send((list(sys.path), payload))
        replies = {}
        deadline = time.monotonic() + timeout
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout=remaining)
            for item in ready:
                if item in sentinels:  # a process ended: take its reply if it sent one
                    rank = sentinels.pop(item)
                    conn = self.conns[rank]
                    if conn not in waiting:
                        continue
                    if not conn.poll():
                        del waiting[conn]
                        replies[rank] = ("error", f"rank {rank} died with exit code {self.procs[rank].exitcode}")
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
                        continue
                    item = conn
                if item in waiting:
                    rank = waiting.pop(item)
                    try:
                        replies[rank] = item.recv()
                    except EOFError:
                        replies[rank] = ("error", f"rank {rank} closed its connection")
                    if replies[rank][0] == "error":
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        for rank in waiting.values():
            if any(status == "error" for status, _ in replies.values()):
                detail = "no answer (waiting for a failed rank?)"
            else:
                detail = f"no answer within {timeout:.0f} s"
            replies[rank] = ("error", f"rank {rank}: {detail}")
        self.broken = any(status == "error" for status, _ in replies.values())
        return replies

    def close(self, graceful=True):
        if graceful:
            for conn, proc in zip(self.conns, self.procs):
                if proc.is_alive():
                    try:
                        conn.send(None)
                    except OSError:
                        pass
        for proc in self.procs:
            proc.join(timeout=30 if graceful else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        # DeepSpeed's CPU shared-memory allreduce leaves one buffer file per rank (about 70 MB)
        # in /dev/shm, named after the process group's master port; the processes are gone now.
        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{self.port}_*"):
            os.remove(leftover)


_POOLS = {}
"""Live pools of ``reuse_dist_env`` tests, by world size."""


def close_pools():
    """End every kept process group (called at the end of the pytest session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


class DistributedExec:
    """Settings shared with DeepSpeed's class of the same name (see the module docstring)."""
    world_size = 2
    backend = "gloo"  # DeepSpeed's attribute; here ``placement`` picks the backend by world size
    init_distributed = True
    requires_cuda_env = True
    reuse_dist_env = False
    exec_timeout = DEEPSPEED_TEST_TIMEOUT


class DistributedTest(DistributedExec):
    """Base class of tests whose methods run on every rank; see the module docstring."""
    is_dist_test = True

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def class_tmpdir(cls, tmpdir_factory):
        return tmpdir_factory.mktemp(cls.__name__)

    def __call__(self, request):
        """Run the test method of ``request`` on every rank, once per world size."""
        method = getattr(self, request.function.__name__)
        kwargs = {}
        for name in inspect.signature(method).parameters:
            try:
                kwargs[name] = request.getfixturevalue(name)
            except pytest.FixtureLookupError:
                pass  # an argument with a default value
        marks = [m.args[0] for m in request.node.iter_markers("world_size")]
        world_sizes = marks[0] if marks else kwargs.get("world_size", self.world_size)
        payload = pickle.dumps((method, kwargs))
        for world_size in [world_sizes] if isinstance(world_sizes, int) else world_sizes:
            self._launch(world_size, payload, request)

    def _launch(self, world_size, payload, request=None):
        pool = _POOLS.pop(world_size, None) if self.reuse_dist_env else None
        if pool is None:
            pool = _RankPool(world_size, self.exec_timeout)
        if request is not None:
            PLACEMENTS.append((request.node.nodeid, world_size, pool.accelerator, pool.backend))
            request.node.user_properties.append(("ranks", f"W={world_size} {pool.accelerator}/{pool.backend}"))
        try:
            replies = pool.run(payload, self.exec_timeout)
        except BaseException:
            pool.close(graceful=False)
            raise
        if pool.broken or not self.reuse_dist_env:
            pool.close(graceful=not pool.broken)
        else:
            _POOLS[world_size] = pool
        errors = {rank: detail for rank, (status, detail) in replies.items() if status == "error"}
        if errors:
            report = "\n".join(f"----- rank {rank} -----\n{detail}" for rank, detail in sorted(errors.items()))
            pytest.fail(f"{len(errors)} of {world_size} ranks failed:\n{report}", pytrace=False)
        skips = {detail for status, detail in replies.values() if status == "skip"}
        if skips:
            pytest.skip("; ".join(sorted(skips)))
