# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 Muon at world size 1: the configurations of the W=2 tests that one device can run.

A one-GPU node runs only DistributedTests that fit its device count, so ``dev.py gpu-check`` runs these: bf16 and fp16
loss scaling checked by replay; CPU optimizer (and parameter) offload against the reference; upstream's
``torch.compile``d Newton-Schulz. Same checks and tolerances as the W=2 tests, at W=1 gas 2 (the boundary still takes
two micro-steps).
"""

import pytest

from unit.common import DistributedTest
from unit.runtime.zero.test_zero3_muon_compiled import RUN as COMPILED_RUN
from unit.runtime.zero.test_zero3_muon_compiled import compiled_newton_schulz
from unit.runtime.zero.test_zero3_muon_precision import MARKS, MUON_NAMES, RUNS, assert_matches_replay
from muon_testing.compare import FLOOR, relative_difference
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

PRECISION = ("bf16", "bf16_clip", "fp16")
OFFLOAD = {
    "offload_optimizer": Zero3MuonRun(gas=2, offload="cpu"),
    "offload_param": Zero3MuonRun(gas=2, offload="cpu", zero=(("offload_param", {
        "device": "cpu"
    }), )),
}


@pytest.fixture(scope="module")
def offload_reference():
    """The single-process reference of both OFFLOAD runs (same model, steps and samples)."""
    return OFFLOAD["offload_optimizer"].reference()[0]


@pytest.fixture(scope="module")
def compiled_reference():
    return COMPILED_RUN.reference()[0]


class TestZero3MuonSingleRank(DistributedTest):
    world_size = 1
    reuse_dist_env = True
    exec_timeout = 1200

    @pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS[n]) for n in PRECISION])
    def test_precision_matches_replay(self, name):
        run, check = RUNS[name]
        assert_matches_replay(run, check, run.train(record=True))

    @pytest.mark.parametrize("name", sorted(OFFLOAD))
    def test_matches_reference(self, name, offload_reference):
        """CPU optimizer (and parameter) offload: the reference to the fp32 floor; NS once per matrix per step."""
        result = OFFLOAD[name].train()
        assert relative_difference(offload_reference, result.weights) <= FLOOR
        assert result.ns_off_boundary() == 0
        assert set(result.ns_per_step()) == {len(MUON_NAMES)}

    @pytest.mark.compiled
    def test_compiled_newton_schulz_matches_eager_reference(self, compiled_reference):
        """Upstream's compiled NS kernels: the eager reference to the fp32 floor, and TorchDynamo did compile."""
        with compiled_newton_schulz():
            result = COMPILED_RUN.train()
        assert sum(r.dynamo_graphs for r in result.per_rank) > 0
        assert relative_difference(compiled_reference, result.weights) <= FLOOR
