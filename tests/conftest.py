# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Test-session defaults: DeepSpeed on the CPU accelerator, TorchDynamo off.

Newton-Schulz compiles slowly on the CPU, so ordinary tests run it eagerly; the one test of the
compiled path (marked ``compiled``) turns TorchDynamo back on in its own worker processes.
Set before anything imports torch or deepspeed.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# The multi-process helpers live next to the tests that use them; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "unit", "runtime", "zero"))


def pytest_configure(config):
    import deepspeed
    if getattr(deepspeed, "__file__", None) is None:
        raise RuntimeError("`import deepspeed` found the repository's deepspeed/ folder (our new modules only), "
                           "not the installed patched DeepSpeed: run the tests with `python3 dev.py test`, or "
                           "with PYTHONSAFEPATH=1 so the current directory is not on sys.path.")
