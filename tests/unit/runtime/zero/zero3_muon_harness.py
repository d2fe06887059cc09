# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A small multi-process harness: run one function on W ranks over gloo and collect the results.

``run_distributed(fn, world_size, *args)`` spawns W fresh processes (``spawn`` start method, so
nothing of the parent's torch state leaks in), sets the usual ``torch.distributed`` environment
(``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``), ``DS_ACCELERATOR=cpu`` and one
intra-op thread per rank, calls ``deepspeed.init_distributed(dist_backend="gloo")`` and then
``fn(*args, **kwargs)``. It returns the W return values in rank order (they must pickle; return
numpy arrays or plain Python). If any rank raises, the others are stopped and the parent raises
``DistributedWorkerError`` carrying every rank's traceback; a rank that does not answer within
``timeout`` seconds fails the run the same way.

``fn`` must be importable by the children: define it at module level in a module on
``sys.path`` (the children receive the parent's ``sys.path``).
"""

import contextlib
import multiprocessing
import os
import queue
import socket
import time
import traceback
from datetime import timedelta


class DistributedWorkerError(AssertionError):
    """One or more ranks failed; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _environ(values):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _entry(fn, rank, world_size, timeout, args, kwargs, results):
    try:
        import torch
        torch.set_num_threads(1)
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=timeout))
        out = fn(*args, **kwargs)
        results.put((rank, True, out))
    except BaseException:  # report everything, including SystemExit from a failing assert helper
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        import torch.distributed
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception:
        pass


def run_distributed(fn, world_size, *args, timeout=600, env=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results in rank order.

    Args:
        fn: module-level function, called once on every rank after ``init_distributed``.
        world_size: number of processes (W).
        timeout: seconds the whole run may take before it is failed.
        env: extra environment variables for the ranks (set before they import anything).

    Raises:
        DistributedWorkerError: a rank raised, died, or the run timed out.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    base_env.update(env or {})
    procs = []
    for rank in range(world_size):
        with _environ(dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))):
            proc = ctx.Process(target=_entry, args=(fn, rank, world_size, timeout, args, kwargs, results))
            proc.start()
        procs.append(proc)

    outputs, failures = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures["timeout"] = f"no answer from ranks {sorted(set(range(world_size)) - set(outputs))} " \
                                      f"within {timeout} s"
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    failures.update({r: f"rank {r} died with exit code {procs[r].exitcode}" for r in dead})
                    break
                continue
            (outputs if ok else failures)[rank] = payload
            if failures:
                break
    finally:
        if failures:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        report = "\n".join(f"--- {key} ---\n{value}" for key, value in sorted(failures.items(), key=str))
        raise DistributedWorkerError(f"{fn.__name__} failed on {world_size} ranks:\n{report}")
    return [outputs[rank] for rank in range(world_size)]
