# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A regular (non-universal) checkpoint loaded at another data-parallel world size.

Saved at W=2 by ZeRO-3 AdamW, loaded at W'=1 or 4: every rank (at W=4 also ranks 2, 3 without a model-states file)
raises ``ZeRORuntimeException`` with both world sizes and the way out (the ``ds_to_universal`` command and
``"checkpoint": {"load_universal": true}``). At W=2 it loads exactly. At ZeRO-2 the command carries
``--inject_missing_state`` (no ``universal_checkpoint_info``), and the converted checkpoint loads at W=1.
"""

import os
import shlex

import numpy as np
import pytest

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import universal_engine
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(gas=2, steps=3, optimizer="AdamW")


def _resize_error(run, world_size, tmp_path):
    """``(message, folder)`` of the error loading the regular checkpoint (tag from ``latest``) at ``world_size``."""
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    engine = run.build_engine(run.config(world_size))
    with pytest.raises(ZeRORuntimeException) as raised:
        engine.load_checkpoint(str(tmp_path))
    engine.destroy()
    return str(raised.value), os.path.join(str(tmp_path), "restart")


class TestZero3RegularCheckpointAtAnotherWorldSize(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [pytest.param([2, 1], id="2to1"), pytest.param([2, 4], id="2to4")])
    def test_error_names_the_universal_checkpoint(self, world_size, tmp_path):
        import deepspeed.comm as dist
        saved_world_size, current = world_size
        if dist.get_world_size() == saved_world_size:
            saved = RUN.with_(restart_after=RUN.steps).train(checkpoint_dir=str(tmp_path))
            loaded = RUN.with_(resume_from=RUN.steps).train(checkpoint_dir=str(tmp_path))
            assert sorted(saved.optimizer_state) == sorted(loaded.loaded_state)
            for key, value in saved.optimizer_state.items():
                assert np.array_equal(value, loaded.loaded_state[key]), key
            return
        message, checkpoint = _resize_error(RUN, current, tmp_path)
        assert f"used a DP world size of {saved_world_size} but the current world size is {current}" in message
        assert (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shlex.quote(checkpoint)} "
                f"--output_folder {shlex.quote(checkpoint + '_universal')}") in message
        assert '"checkpoint": {"load_universal": true}' in message


class TestZero2RegularCheckpointAtAnotherWorldSize(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [pytest.param([2, 1], id="2to1")])
    def test_command_converts(self, world_size, tmp_path):
        import deepspeed.comm as dist
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        from unit.runtime.zero.zero3_muon_helpers import ds_to_universal_args
        run = RUN.with_(stage=2)
        if dist.get_world_size() == 2:
            run.with_(restart_after=run.steps).train(checkpoint_dir=str(tmp_path))
            return
        message, checkpoint = _resize_error(run, 1, tmp_path)
        assert (f"--input_folder {shlex.quote(checkpoint)} --output_folder {shlex.quote(checkpoint + '_universal')} "
                "--inject_missing_state\n(at ZeRO stage 1/2 the converter needs the model's universal_checkpoint_info"
                ) in message, message
        ds_to_universal(ds_to_universal_args(str(tmp_path), "restart", inject_missing_state=True))
        engine = universal_engine(run)
        engine.load_checkpoint(str(tmp_path))  # the tag comes from the `latest_universal` file
        assert engine.global_steps == run.steps
        engine.destroy()
