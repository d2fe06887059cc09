# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The compiled path: upstream's ``torch.compile``'d Newton-Schulz kernels run through inductor in the ranks.

Other tests set ``TORCHDYNAMO_DISABLE=1`` (NS compiles slowly on the CPU), leaving the kernels undecorated; here the
ranks decorate them again (one small model: inductor compiles C++ per shape). Measured (0.19.8, W=2, 3 steps): compiled
and eager weights are bit-identical (no FMA contraction, same matmul calls), both 5.8e-7 from the reference: ``FLOOR``.
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
    """Upstream's NS kernels wrapped in ``torch.compile`` as at import with TorchDynamo on; restored on exit."""
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
