# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 Muon at world size 1: the configurations of the W=2 tests that one device can run.

A node with one GPU runs a DistributedTest only where its world size fits the device count, so these are the variants
``dev.py gpu-check`` runs on the GPU: bf16 and fp16 with dynamic loss scaling checked by replay
(``test_zero3_muon_precision.py``); CPU optimizer offload, and parameter offload with it, against the reference;
upstream's ``torch.compile``d Newton-Schulz (the W=1 checkpoint resume: ``test_zero3_muon_checkpoint.py``). Same runs,
checks and tolerances as those tests, at W=1 gas 2 (the boundary still takes two micro-steps).
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
        """CPU offload of the optimizer (and of the parameters): the single-process reference, to the fp32 floor;
        Newton-Schulz once per Muon matrix per step."""
        result = OFFLOAD[name].train()
        assert relative_difference(offload_reference, result.weights) <= FLOOR
        assert result.ns_off_boundary() == 0
        assert set(result.ns_per_step()) == {len(MUON_NAMES)}

    @pytest.mark.compiled
    def test_compiled_newton_schulz_matches_eager_reference(self, compiled_reference):
        """Upstream's compiled Newton-Schulz kernels (TorchDynamo on): the eager reference to the fp32 floor, and
        TorchDynamo compiled something (else this did not test the compiled path)."""
        with compiled_newton_schulz():
            result = COMPILED_RUN.train()
        assert sum(r.dynamo_graphs for r in result.per_rank) > 0
        assert relative_difference(compiled_reference, result.weights) <= FLOOR
