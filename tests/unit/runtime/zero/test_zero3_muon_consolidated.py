# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Weights out of a ZeRO-3 Muon run.

- ``zero_to_fp32`` (function, file conversion and the copied ``zero_to_fp32.py`` script) gives exactly the engine's
  fp32 masters (``safe_get_full_fp32_param``) for every parameter: W=2, gas=2, fp32, bf16 and CPU offload.
- ``save_16bit_model`` with ``stage3_gather_16bit_weights_on_model_save`` writes exactly the gathered module weights.

Each is compared with ``torch.equal`` to the engine's own weights after a few steps, over every parameter name.
"""

import subprocess
import sys

import pytest
import torch

from unit.common import DistributedTest
from muon_testing.models import build_model, loss_fn, step_batch
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

RUN = Zero3MuonRun(gas=2, steps=3)
FP32_SETTINGS = {"fp32": RUN, "bf16": RUN.with_(dtype="bf16"), "offload": RUN.with_(offload="cpu")}
GATHER_16BIT = (("stage3_gather_16bit_weights_on_model_save", True), )
TAG = "consolidated"


def trained_engine(run: Zero3MuonRun):
    """ZeRO-3 engine of ``run`` after ``run.steps`` steps on ``Zero3MuonRun.train``'s samples (collective)."""
    from deepspeed import comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    input_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[run.dtype]
    micro = run.samples // (world_size * run.gas)
    with fp32_newton_schulz():
        engine = run.build_engine(run.config(world_size))
        for step in range(run.steps):
            x, y = step_batch(run.model, step, run.target_scale, run.samples)
            for m in range(run.gas):
                lo = (m * world_size + rank) * micro
                inputs = x[lo:lo + micro].to(engine.device, input_dtype)
                engine.backward(loss_fn(engine(inputs).float(), y[lo:lo + micro].to(engine.device)))
                engine.step()
    return engine


def fp32_master_weights(engine) -> dict:
    """Full fp32 master weights by name, fp32 CPU, the parameter's shape (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param
    weights = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        assert full is not None, name
        weights[name] = full.detach().cpu().clone()
    return weights


def assert_moved_from_initialization(run, weights):
    """Training changed every parameter, so weights equal to the model's initial ones cannot pass."""
    initial = dict(build_model(run.model).named_parameters())
    assert sorted(weights) == sorted(initial)
    unchanged = [name for name, w in weights.items() if torch.equal(w.float(), initial[name].detach())]
    assert not unchanged, unchanged


def assert_exactly(state_dict, expected, dtype, source):
    """``state_dict`` has exactly ``expected``'s names, in ``dtype``, and values (torch.equal)."""
    assert sorted(state_dict) == sorted(expected), source
    wrong_dtype = {name: t.dtype for name, t in state_dict.items() if t.dtype != dtype}
    assert not wrong_dtype, (source, wrong_dtype)
    different = [name for name in expected if not torch.equal(state_dict[name].cpu(), expected[name])]
    assert not different, (source, different)


class TestZero3MuonConsolidated(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("name", list(FP32_SETTINGS))
    def test_zero_to_fp32_gives_the_fp32_master_weights(self, name, tmp_path):
        import deepspeed.comm as dist
        from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                  get_fp32_state_dict_from_zero_checkpoint)
        run = FP32_SETTINGS[name]
        engine = trained_engine(run)
        master = fp32_master_weights(engine)
        assert_moved_from_initialization(run, master)
        engine.save_checkpoint(str(tmp_path), tag=TAG)
        dist.barrier()
        engine.destroy()

        state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=TAG)
        assert_exactly(state, master, torch.float32, "get_fp32_state_dict_from_zero_checkpoint")
        converted, script = (tmp_path / f"rank{dist.get_rank()}" / out for out in ("converted", "script"))
        convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(converted), tag=TAG)
        assert_exactly(torch.load(converted / "pytorch_model.bin", map_location="cpu", weights_only=True), master,
                       torch.float32, "convert_zero_checkpoint_to_fp32_state_dict")
        if dist.get_rank() == 0:
            # The copy save_checkpoint wrote, run as users do: checkpoint_dir output_dir --tag.
            args = [sys.executable, str(tmp_path / "zero_to_fp32.py"), str(tmp_path), str(script), "--tag", TAG]
            subprocess.run(args, check=True, cwd=str(tmp_path), stdout=subprocess.DEVNULL)
            assert_exactly(torch.load(script / "pytorch_model.bin", map_location="cpu", weights_only=True), master,
                           torch.float32, "zero_to_fp32.py")
        dist.barrier()

    @pytest.mark.parametrize("name", ["fp32", "bf16"])
    def test_save_16bit_model_gives_the_gathered_module_weights(self, name, tmp_path):
        import deepspeed
        import deepspeed.comm as dist
        run = FP32_SETTINGS[name].with_(zero=GATHER_16BIT)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        engine = trained_engine(run)
        module_weights = {}
        for param_name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                module_weights[param_name] = param.detach().cpu().clone()
        master = fp32_master_weights(engine)
        assert_moved_from_initialization(run, module_weights)
        # The module's weights are the fp32 master weights, rounded to bf16 in a bf16 run.
        assert_exactly(module_weights, {n: w.to(dtype) for n, w in master.items()}, dtype, "module vs master")
        assert engine.save_16bit_model(str(tmp_path))
        dist.barrier()
        engine.destroy()
        saved = torch.load(tmp_path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        assert_exactly(saved, module_weights, dtype, "save_16bit_model")
