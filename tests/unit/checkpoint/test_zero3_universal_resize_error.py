# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A regular (non-universal) checkpoint loaded at another data-parallel world size.

Saved at W=2 by a ZeRO-3 AdamW run, loaded at W=1 or W=4 (the method runs at the two world sizes
of its ``world_size`` list one after the other, with the same ``tmp_path``): every rank raises
``ZeRORuntimeException``, which keeps both world sizes and names the way out, the
``ds_to_universal`` command for this checkpoint's folders and ``"checkpoint": {"load_universal":
true}``; at W=4 also on ranks 2 and 3, which have no model-states file of their own (without the
check they fail in the state-dict loader on an empty file list). At W=2 the same checkpoint still
loads, the whole optimizer state exactly. Nothing of it depends on the optimizer.
"""

import os
import shlex

import numpy as np
import pytest

from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(gas=2, steps=3, optimizer="AdamW")


class TestZero3RegularCheckpointAtAnotherWorldSize(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [pytest.param([2, 1], id="2to1"), pytest.param([2, 4], id="2to4")])
    def test_error_names_the_universal_checkpoint(self, world_size, tmp_path):
        import deepspeed.comm as dist
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
        saved_world_size, current = world_size
        if dist.get_world_size() == saved_world_size:
            saved = RUN.with_(restart_after=RUN.steps).train(checkpoint_dir=str(tmp_path))
            loaded = RUN.with_(resume_from=RUN.steps).train(checkpoint_dir=str(tmp_path))
            assert sorted(saved.optimizer_state) == sorted(loaded.loaded_state)
            for key, value in saved.optimizer_state.items():
                assert np.array_equal(value, loaded.loaded_state[key]), key
            return

        engine = RUN.build_engine(RUN.config(current))
        with pytest.raises(ZeRORuntimeException) as raised:
            engine.load_checkpoint(str(tmp_path))  # the tag comes from the `latest` file
        engine.destroy()
        message = str(raised.value)
        checkpoint = os.path.join(str(tmp_path), "restart")
        assert f"used a DP world size of {saved_world_size} but the current world size is {current}" in message
        assert (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shlex.quote(checkpoint)} "
                f"--output_folder {shlex.quote(checkpoint + '_universal')}") in message
        assert '"checkpoint": {"load_universal": true}' in message
