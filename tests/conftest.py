# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Test-session defaults: DeepSpeed on the CPU accelerator unless ``DS_ACCELERATOR`` says
otherwise (e.g. ``cuda``: ``dev.py gpu-check``), TorchDynamo off, and the local stand-in of
DeepSpeed's ``DistributedTest`` (``tests/unit/common.py``) wired into pytest, with a summary of
where its ranks ran.

Newton-Schulz compiles slowly on the CPU, so ordinary tests run it eagerly; the test of the
compiled path (marked ``compiled``) compiles upstream's kernels in its own ranks. Set before
anything imports torch or deepspeed.
"""

import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# As in DeepSpeed's tree: tests/ on sys.path, so `from unit.common import DistributedTest` and
# `from unit.runtime.zero.zero3_muon_helpers import ...` resolve (and in the ranks, which
# receive this sys.path). `muon_testing` (testing/) is installed in the venv by dev.py setup.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    import deepspeed
    if getattr(deepspeed, "__file__", None) is None:
        raise RuntimeError("`import deepspeed` found the repository's deepspeed/ folder (our new modules only), "
                           "not the installed patched DeepSpeed: run the tests with `python3 dev.py test`, or "
                           "with PYTHONSAFEPATH=1 so the current directory is not on sys.path.")
    config.addinivalue_line("markers", "world_size(n): run this DistributedTest method on n ranks")
    config.addinivalue_line("markers", "distributed: a DistributedTest method (set here, on every one)")
    config.addinivalue_line(
        "markers", "core: the DistributedTest methods worth running on every base; "
        "e.g. -m 'core or not distributed' runs them and every other test")
    config.addinivalue_line("markers", "compiled: runs upstream's torch.compile'd Newton-Schulz kernels")


def pytest_collection_modifyitems(items):
    for item in items:
        if getattr(item.cls, "is_dist_test", False):
            item.add_marker(pytest.mark.distributed)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``DistributedTest`` method runs on its ranks (unit.common), not in this process."""
    cls = pyfuncitem.cls
    if cls is not None and getattr(cls, "is_dist_test", False):
        cls()(pyfuncitem._request)
        return True
    return None


def pytest_terminal_summary(terminalreporter):
    """Where the DistributedTest ranks ran: one line per (world size, accelerator, backend)."""
    common = sys.modules.get("unit.common")
    placements = getattr(common, "PLACEMENTS", None)
    if not placements:
        return
    counts = {}
    for _node, world_size, accelerator, backend in placements:
        key = (world_size, accelerator, backend)
        counts[key] = counts.get(key, 0) + 1
    terminalreporter.section("DistributedTest placement")
    for (world_size, accelerator, backend), n in sorted(counts.items()):
        terminalreporter.write_line(f"W={world_size} on {accelerator} ({backend}): {n} test run(s)")


def pytest_sessionfinish(session):
    common = sys.modules.get("unit.common")
    if common is not None and hasattr(common, "close_pools"):
        common.close_pools()
