# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The compiled path: upstream's ``torch.compile``'d Newton-Schulz kernels run through inductor in the ranks.

The other tests run with ``TORCHDYNAMO_DISABLE=1`` (NS compiles slowly on the CPU), under which ``torch.compile``
returns the kernels undecorated at import; here the ranks decorate them again for the test (inductor compiles C++ for
each matrix shape on the CPU, hence one small model). Measured (0.19.8 base, W=2, 3 steps): compiled and eager ZeRO-3
weights are bit-identical (inductor keeps fp32 arithmetic, no FMA contraction, and the matmuls are the same library
calls); both are 5.8e-7 from the eager reference, gas=1 vs gas=4 6.1e-7. So the tolerance is the eager one, ``FLOOR``.
"""

import contextlib
import os
from unittest import mock

import pytest

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.counting import NS_KERNELS
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(model="cross", gas=4, steps=3)


@contextlib.contextmanager
def compiled_newton_schulz():
    """Upstream's NS kernels wrapped in ``torch.compile`` (as ``@compiler.compile()`` wraps them when TorchDynamo is on
    at import), and TorchDynamo on; both restored on exit."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon
    saved = {name: getattr(original_muon, name) for name in NS_KERNELS if hasattr(original_muon, name)}
    with mock.patch.dict(os.environ, TORCHDYNAMO_DISABLE="0"):
        try:
            for name, kernel in saved.items():
                if not hasattr(kernel, "_torchdynamo_orig_callable"):
                    setattr(original_muon, name, torch.compile(kernel))
            yield
        finally:
            for name, kernel in saved.items():
                setattr(original_muon, name, kernel)


@pytest.fixture(scope="module")
def reference():
    return RUN.reference()[0]


@pytest.mark.slow
@pytest.mark.compiled
class TestZero3MuonCompiled(DistributedTest):
    world_size = 2
    reuse_dist_env = True
    exec_timeout = 1200

    def test_compiled_newton_schulz_matches_eager_reference(self, reference):
        with compiled_newton_schulz():
            gas4, gas1 = RUN.train(), RUN.with_(gas=1).train()
        assert gas4.ns_per_step()[-1] == 2
        assert sum(r.dynamo_graphs for r in gas4.per_rank) > 0, \
            "TorchDynamo compiled nothing: this did not test the compiled path"
        assert relative_difference(reference, gas4.weights) <= FLOOR
        assert relative_difference(gas1.weights, gas4.weights) <= FLOOR
