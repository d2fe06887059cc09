# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 Muon refuses a momentum of another size rather than dropping it.

The momentum follows the fp32 partition's layout, so one saved at another world size (or an older build's whole
parameters) has another size; zeroing it would silently train on without it.
"""
import pytest

import deepspeed
from unit.common import DistributedTest
from muon_testing.models import build_model
from unit.runtime.zero.zero3_muon_helpers import ds_config, train_one_step


class TestZero12MuonMomentumOfAnotherSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,offload", [(2, None), (2, "cpu"), (1, None)])
    def test_refused_at_the_next_step(self, stage, offload):
        zero = {"offload_optimizer": {"device": offload}} if offload else {}
        net = build_model("mixed")
        engine, *_ = deepspeed.initialize(model=net,
                                          config=ds_config(stage, 1, self.world_size, zero_extra=zero),
                                          model_parameters=list(net.parameters()))
        train_one_step(engine, 0)
        held = [s for s in engine.optimizer.optimizer.state.values() if "momentum_buffer" in s]
        assert held, "Muon keeps its momentum in the optimizer state"
        held[0]["momentum_buffer"] = held[0]["momentum_buffer"][:-1].clone()
        with pytest.raises(RuntimeError,
                           match=f"ZeRO-{stage} Muon, parameter group 0 holds a momentum of .* another partitioning "
                           r"\(data-parallel world size.*Convert the checkpoint with ds_to_universal"):
            train_one_step(engine, 1)
