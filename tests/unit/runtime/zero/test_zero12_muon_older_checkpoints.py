# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO-1/2 checkpoint saved by stock DeepSpeed or an older build of the Muon patch still loads.

Without offload those kept the whole momentum of every matrix a partition touches; this build keeps the partition's
layout, marks it (``zero12_checkpoints.STATE_LAYOUT_KEY``) and takes an unmarked one apart at load. A checkpoint
rewritten into the older layout (W=3: two matrices straddle) loads and trains on bit-identically to the uninterrupted
run after 5 steps. Loading it at another world size is refused naming the setting.
"""

import numpy as np
import pytest

from unit.common import DistributedTest
from muon_testing.models import build_model, is_muon_param
from unit.runtime.zero.zero12_muon_helpers import to_older_zero12_layout
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(model="mixed", gas=2, steps=5, samples=24)
SAVED_AT = 3


def muon_shapes():
    return [tuple(p.shape) for n, p in build_model("mixed").named_parameters() if is_muon_param(n, p)]


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
class TestZero12OlderCheckpoints(DistributedTest):
    world_size = 3
    reuse_dist_env = True

    def test_resume_equals_the_uninterrupted_run(self, stage, offload, tmp_path):
        from deepspeed import comm as dist
        run = RUN.with_(stage=stage, offload=offload)
        straight = run.train()
        run.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        dist.barrier()
        if dist.get_rank() == 0:
            to_older_zero12_layout(str(tmp_path), "restart", muon_shapes(), self.world_size, offload)
        dist.barrier()
        resumed = run.with_(resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        for name in straight.weights:
            assert np.array_equal(straight.weights[name], resumed.weights[name]), name
        if offload is None:  # the older layout's sizes depend on the world size that saved it
            with pytest.raises(RuntimeError,
                               match="saved with another data-parallel world size or "
                               "zero_optimization.offload_optimizer setting"):
                run.with_(resume_from=SAVED_AT, offload="cpu").train(checkpoint_dir=str(tmp_path))
