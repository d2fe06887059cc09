# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 universal checkpoints of any optimizer (DeepSpeed's AdamW): every sub-group state kept (with the step),
loaded per sub-group, each parameter group's settings from its own saved group.

Resize tests run twice with one ``tmp_path`` (``world_size`` ``[W, W']``): at W 3 steps, save, convert; at W' exactly
the saved state (fp32 masters, ``exp_avg``, ``exp_avg_sq``, ``step``), then after 2 steps the never-stopped run at W'
to ``FLOOR`` (bit for bit at W' = W). Two groups with own lr and weight decay catch a loader giving every group the
first one's settings. Also: loading at ZeRO-1/2, broken checkpoints refused, and the pieces on hand-made files.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import (broken_checkpoints_refused, continue_training, rewrite_state,
                                                     state_file, universal_round_trip, unequal_states)
from muon_testing.compare import FLOOR, relative_difference
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

SAVED_AT = 3  # optimizer steps before the checkpoint
RUN = Zero3MuonRun(gas=2, steps=5, samples=24, universal=True, optimizer="AdamW", groups="two_muon_groups")
"""24 samples per step divide over 1 to 4 ranks and 2 micro-steps. ``two_muon_groups`` puts fc1 in its own group (lr
0.01, no weight decay); AdamW keeps the ``momentum`` key unused."""


class TestZero3Universal(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize(
        "world_size", [pytest.param([2, 3], marks=[pytest.mark.core], id="2to3"),
                       pytest.param([2, 2], id="2to2")])
    def test_resume_at_another_world_size(self, world_size, tmp_path):
        import deepspeed.comm as dist
        saved_file = tmp_path / "saved_state.pt"
        if not saved_file.exists():  # first launch: train, save, convert
            saved = RUN.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            assert os.path.isdir(tmp_path / "restart_universal" / "zero")
            dist.barrier()
            if dist.get_rank() == 0:
                torch.save(saved.optimizer_state, saved_file)
            dist.barrier()
            return

        saved_state = torch.load(saved_file, weights_only=False)
        resumed = RUN.with_(resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        straight = RUN.train()
        assert unequal_states(saved_state, resumed.loaded_state) == []
        assert {key for _, key in resumed.loaded_state} == {"fp32", "exp_avg", "exp_avg_sq", "step"}
        assert {v for (_, key), v in resumed.loaded_state.items() if key == "step"} == {SAVED_AT}

        difference = relative_difference(straight.weights, resumed.weights)
        print(f"[universal AdamW {world_size[0]}->{world_size[1]}] resumed vs never stopped: {difference:.3g}")
        if world_size[0] == world_size[1]:
            for key in straight.weights:
                assert torch.equal(straight.weights[key], resumed.weights[key]), key
        else:
            assert difference <= FLOOR


ZERO12_RUN = Zero3MuonRun(model="mixed", gas=2, groups="two_muon_groups", clip=0.0, optimizer="AdamW")


class TestZero3UniversalAtZero12(DistributedTest):
    """Stage 1/2 accepts ZeRO-3 model-states files and ``optimizer_state.pt`` (no ``ds_version``): exactly the saved
    state, then the ZeRO-3 run's weights to ``CONTINUE_FLOOR``."""
    reuse_dist_env = True

    @pytest.mark.parametrize("stage, load_world_size", [
        pytest.param(2, 1, marks=pytest.mark.world_size([2, 1]), id="stage2-1"),
        pytest.param(1, 2, marks=pytest.mark.world_size([2, 2]), id="stage1-2")
    ])
    def test_restores_exactly_and_continues(self, stage, load_world_size, tmp_path):
        phase = universal_round_trip(ZERO12_RUN, tmp_path, ZERO12_RUN.with_(stage=stage))
        if phase is not None:
            continue_training(phase, ZERO12_RUN, f"AdamW stage {stage} W'={load_world_size}")


def _tamper(folder, how):
    if how == "transposed_moment":
        rewrite_state(folder, "fc1.weight", "exp_avg", lambda t: t.t().contiguous())
    elif how == "short_moment":
        rewrite_state(folder, "fc3.weight", "exp_avg_sq", lambda t: t.flatten()[:-1].clone())
    elif how == "missing_weights":
        os.remove(state_file(folder, "fc3.bias", "fp32"))
    elif how == "states_differ_in_sub_group":
        os.remove(state_file(folder, "fc2.weight", "exp_avg"))


REFUSALS = {  # how the checkpoint is broken: what the error must say
    "transposed_moment": ["fc1.weight", "exp_avg", "(21, 33)", "(33, 21)"],
    "short_moment": ["fc3.weight", "exp_avg_sq", "(118,)", "(7, 17)"],
    "missing_weights": ["fc3.bias", "fp32"],
    "states_differ_in_sub_group": ["fc2.weight", "different optimizer states"],
}


class TestZero3UniversalRefusals(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [[2, 1]])
    def test_broken_checkpoint_is_refused_naming_the_parameter(self, world_size, tmp_path):
        broken_checkpoints_refused(RUN.with_(groups=None), tmp_path, SAVED_AT, _tamper, REFUSALS,
                                   "it has 1 optimizer parameter groups, this run 2")


# The conversion's and the loader's pieces on hand-made files (one process).


def _optimizer_file(fp32, state):
    return {"fp32_flat_groups": [fp32], "optimizer_state_dict": {"state": {0: state}, "param_groups": []}}


def test_sub_group_states_keep_every_state_upcast_and_the_step():
    from deepspeed.checkpoint.universal_states import zero3_sub_group_states
    fp32 = torch.arange(6, dtype=torch.float32)
    momentum = torch.linspace(-1, 1, 6).bfloat16()
    sgd = zero3_sub_group_states(_optimizer_file(fp32, {"momentum_buffer": momentum}), 0)
    assert sorted(sgd) == ["fp32", "momentum_buffer"]
    assert sgd["momentum_buffer"].dtype == torch.float32 and torch.equal(sgd["momentum_buffer"], momentum.float())
    adam = zero3_sub_group_states(_optimizer_file(fp32, {"exp_avg": fp32 * 2, "exp_avg_sq": fp32 * 3, "step": 7}), 0)
    assert sorted(adam) == ["exp_avg", "exp_avg_sq", "fp32", "step"] and adam["step"] == 7
    empty = dict(fp32_flat_groups=[fp32], optimizer_state_dict=dict(state={}))
    assert zero3_sub_group_states(empty, 0) == {"fp32": fp32}
    with pytest.raises(ValueError, match="'exp_avg' of ZeRO-3 sub-group 0"):
        zero3_sub_group_states(_optimizer_file(fp32, {"exp_avg": torch.zeros(2, 3)}), 0)


def test_merge_writes_the_logical_shape_without_padding(tmp_path):
    from deepspeed.checkpoint.ds_to_universal import _merge_zero_shards
    from deepspeed.checkpoint.universal_states import merge_zero3_param_states
    weight = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # 15 elements on 2 ranks: 8 + 7 (1 padding)
    fragments, out = tmp_path / "tmp" / "w" / "0", tmp_path / "zero"
    fragments.mkdir(parents=True)
    for rank, part in enumerate(weight.flatten().split(8)):
        torch.save(part.clone(), fragments / f"fp32.{rank:02d}")
        torch.save(part.clone() * -1, fragments / f"exp_avg.{rank:02d}")
        torch.save(4, fragments / f"step.{rank:02d}")
    written = merge_zero3_param_states(str(fragments.parent), str(out / "w"), [3, 5], _merge_zero_shards)
    assert written == ["exp_avg", "fp32", "step"]
    assert torch.equal(torch.load(tmp_path / "zero" / "w" / "fp32.pt")["param"], weight)
    assert torch.equal(torch.load(tmp_path / "zero" / "w" / "exp_avg.pt")["param"], -weight)
    assert torch.load(tmp_path / "zero" / "w" / "step.pt") == 4
    with pytest.raises(ValueError, match=r"hold 15 elements, the parameter's shape \(4, 5\) 20"):
        merge_zero3_param_states(str(fragments.parent), str(out / "w2"), [4, 5], _merge_zero_shards)


class _OneRankZero3:
    """Stage 3 as ``restore_zero3_optimizer_state`` sees it at W = 1: a ``Zero3SubGroup`` per ``sub_groups`` entry."""

    def __init__(self, sub_groups, names, param_groups):
        from deepspeed.checkpoint.universal_states import Zero3SubGroup
        named = dict(zip((p for group in sub_groups for p in group), names))
        self.fp32_partitioned_groups_flat = [torch.zeros(sum(p.numel() for p in group)) for group in sub_groups]
        flats = self.fp32_partitioned_groups_flat
        self.sub_groups = [
            Zero3SubGroup(group, [named[p] for p in group], fp32) for group, fp32 in zip(sub_groups, flats)
        ]
        self.optimizer = SimpleNamespace(state={}, param_groups=param_groups)

    def load_hp_checkpoint_state(self, folder, key, param=None):
        from deepspeed.checkpoint.universal_states import check_loaded_state
        stored = torch.load(os.path.join(folder, f"{key}.pt"), weights_only=False)
        loaded = stored["param"].flatten()
        check_loaded_state(param, folder, key, loaded, stored)
        return loaded

    def restore(self, zero_dir, optim_sd):
        from deepspeed.checkpoint.universal_states import restore_zero3_optimizer_state
        restore_zero3_optimizer_state(self.sub_groups, self.optimizer.state, self.optimizer.param_groups,
                                      self.load_hp_checkpoint_state, zero_dir, optim_sd)


def _param(*shape):
    param = torch.nn.Parameter(torch.zeros(shape))
    param.ds_shape = torch.Size(shape)
    return param


def _write(zero, name, **states):
    os.makedirs(zero / name, exist_ok=True)
    for key, value in states.items():
        torch.save(value if key == "step" else {"param": value}, zero / name / f"{key}.pt")


def test_restore_per_sub_group(tmp_path):
    """Sub-groups with different states (Adam's moments; a momentum without step), no ``step.pt``: each gets its own
    states in place, the step of the saved sub-group with the same states, and its group's own settings."""
    zero = tmp_path / "zero"
    a, b, m = _param(2, 3), _param(4), _param(5)
    _write(zero, "a", fp32=torch.ones(2, 3), exp_avg=torch.full((2, 3), 2.0), exp_avg_sq=torch.full((2, 3), 3.0))
    _write(zero, "b", fp32=torch.ones(4) * 4, exp_avg=torch.full((4, ), 5.0), exp_avg_sq=torch.full((4, ), 6.0))
    _write(zero, "m", fp32=torch.ones(5) * 7, momentum_buffer=torch.full((5, ), 8.0))
    groups = [{"params": [], "lr": 1.0, "weight_decay": 0.5}, {"params": [], "lr": 2.0}]
    opt = _OneRankZero3([[a, b], [m]], ["a", "b", "m"], groups)
    momentum = torch.zeros(5, dtype=torch.bfloat16)  # held in the state already: copied into, dtype kept
    opt.optimizer.state[opt.fp32_partitioned_groups_flat[1]] = {"momentum_buffer": momentum}
    saved_groups = [dict(params=[0], lr=0.1, weight_decay=0.0), dict(params=[1], lr=0.2, momentum=0.9)]
    saved_adam = dict(exp_avg=torch.zeros(10), exp_avg_sq=torch.zeros(10), step=9)
    saved = dict(state={0: saved_adam, 1: dict(momentum_buffer=torch.zeros(5))}, param_groups=saved_groups)
    opt.restore(str(zero), {"optimizer_state_dict": saved, "param_groups": saved["param_groups"]})
    adam = opt.optimizer.state[opt.fp32_partitioned_groups_flat[0]]
    assert torch.equal(opt.fp32_partitioned_groups_flat[0], torch.tensor([1.0] * 6 + [4.0] * 4))
    assert torch.equal(adam["exp_avg"], torch.tensor([2.0] * 6 + [5.0] * 4)) and adam["step"] == 9
    assert torch.equal(adam["exp_avg_sq"], torch.tensor([3.0] * 6 + [6.0] * 4))
    held = opt.optimizer.state[opt.fp32_partitioned_groups_flat[1]]
    assert held["momentum_buffer"] is momentum and torch.equal(momentum.float(), torch.full((5, ), 8.0))
    assert "step" not in held
    assert groups == [{"params": [], "lr": 0.1, "weight_decay": 0.0}, {"params": [], "lr": 0.2, "momentum": 0.9}]

    os.remove(zero / "b" / "exp_avg.pt")
    with pytest.raises(ValueError, match="parameters of one ZeRO-3 sub-group hold different optimizer states"):
        opt.restore(str(zero), {"optimizer_state_dict": saved})
