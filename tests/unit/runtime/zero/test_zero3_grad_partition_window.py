# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a parameter that gets no gradient in part of an accumulation window, or in all of it.

``Routed``'s ``extra`` layer, at W=2 and gas=4, gets a gradient only in the last micro-step of step 0, none of step 1,
every one of step 2 and the first of step 3: its step gradient must be the sum over the micro-steps that used it (zero
if none), as in ``train_reference``. Unfixed ZeRO-3 kept the previous window's partition when a parameter's first
gradient came after micro-step 0, and re-fed a parameter without gradient its last one (1.5e-2 off on 0.19.8).

DeepSpeed's ``AdamW`` (the fix is ZeRO-3's own), with and without CPU offload; runs differ only in fp32 sum order:
``FLOOR``.
"""

import pytest

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.models import build_model
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(model="routed", optimizer="AdamW", gas=4, steps=4)


@pytest.fixture(scope="module")
def reference():
    return RUN.reference()[0]


class TestZero3GradPartitionWindow(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("offload", [None, "cpu"])
    def test_matches_whole_batch_reference(self, offload, reference):
        weights = RUN.with_(offload=offload).train().weights
        initial = {n: p.detach() for n, p in build_model("routed").named_parameters()}
        assert relative_difference({"extra.weight": initial["extra.weight"]},
                                   {"extra.weight": weights["extra.weight"]}) > 1000 * FLOOR, "extra trains"
        per_parameter = {n: relative_difference({n: reference[n]}, {n: weights[n]}) for n in weights}
        assert relative_difference(reference, weights) <= FLOOR, per_parameter
