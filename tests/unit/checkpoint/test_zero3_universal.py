# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 universal checkpoints of any optimizer: convert, then resume at another world size.

The runs use DeepSpeed's AdamW, whose state ``ds_to_universal`` converted before too, so what is
tested here is what the conversion and the ZeRO-3 loader do for every optimizer: every state of
a sub-group kept (with the step), loaded per sub-group, and each parameter group's settings
taken from its own saved group.

Each resize test runs its method twice, on the saving world size W and then on the loading one
W' (``world_size`` ``[W, W']``, the same ``tmp_path``). At W: 3 optimizer steps, then
``save_checkpoint`` and ``ds_to_universal`` (rank 0); the whole optimizer state at that point is
kept in ``tmp_path``. At W': a fresh engine with ``"checkpoint": {"load_universal": true}`` loads
it, must hold exactly the saved state (fp32 master weights, ``exp_avg``, ``exp_avg_sq`` and
``step``, gathered over the ranks), trains steps 3 and 4, and must then agree with a run at W'
that never stopped, to ``FLOOR`` (bit for bit at W' = W). Cases: MixedMLP in two parameter
groups with their own learning rate and weight decay (a loader that gave every group the first
group's settings would leave the run that never stopped), from 2 to 3 ranks and from 2 to 2.

Refusals (``TestZero3UniversalRefusals``): a state transposed or of the wrong size, a parameter
without ``fp32.pt``, parameters of one sub-group with different states, and another number of
parameter groups are refused at ``load_checkpoint`` with a ``ValueError`` naming the parameter.

The conversion's and the loader's pieces on hand-made files (one process): the extractor, the
merge, and the loader's per-sub-group restore, including a checkpoint without per-parameter
``step.pt``.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import broken_checkpoints_refused, unequal_states
from muon_testing.compare import FLOOR, relative_difference
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

SAVED_AT = 3
"""Optimizer steps before the checkpoint."""
RUN = Zero3MuonRun(gas=2, steps=5, samples=24, universal=True, optimizer="AdamW", groups="two_muon_groups")
"""Every step uses the same 24 samples whatever W' and the gradient accumulation are (24 divides
over 1 to 4 ranks and 2 micro-steps). ``two_muon_groups`` puts fc1 in a group of its own (lr
0.01, no weight decay); AdamW keeps its ``momentum`` key and does not use it."""


class TestZero3Universal(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [
        pytest.param([2, 3], marks=[pytest.mark.core], id="2to3"),
        pytest.param([2, 2], id="2to2"),
    ])
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


def _tamper(folder, how):
    """Break a copy of a universal checkpoint's ``zero/`` folder ``how``."""
    zero = os.path.join(folder, "zero")

    def path(name, state):
        return os.path.join(zero, name, f"{state}.pt")

    def rewrite(name, state, change):
        saved = torch.load(path(name, state), weights_only=False)
        saved["param"] = change(saved["param"])
        torch.save(saved, path(name, state))

    if how == "transposed_moment":
        rewrite("fc1.weight", "exp_avg", lambda t: t.t().contiguous())
    elif how == "short_moment":
        rewrite("fc3.weight", "exp_avg_sq", lambda t: t.flatten()[:-1].clone())
    elif how == "missing_weights":
        os.remove(path("fc3.bias", "fp32"))
    elif how == "states_differ_in_sub_group":
        os.remove(path("fc2.weight", "exp_avg"))


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
    assert zero3_sub_group_states({
        "fp32_flat_groups": [fp32],
        "optimizer_state_dict": {
            "state": {}
        }
    }, 0) == {
        "fp32": fp32
    }
    with pytest.raises(ValueError, match="'exp_avg' of ZeRO-3 sub-group 0"):
        zero3_sub_group_states(_optimizer_file(fp32, {"exp_avg": torch.zeros(2, 3)}), 0)


def test_merge_writes_the_logical_shape_without_padding(tmp_path):
    from deepspeed.checkpoint.ds_to_universal import _merge_zero_shards
    from deepspeed.checkpoint.universal_states import merge_zero3_param_states
    weight = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # 15 elements on 2 ranks: 8 + 7 (1 padding)
    fragments = tmp_path / "tmp" / "w" / "0"
    fragments.mkdir(parents=True)
    for rank, part in enumerate(weight.flatten().split(8)):
        torch.save(part.clone(), fragments / f"fp32.{rank:02d}")
        torch.save(part.clone() * -1, fragments / f"exp_avg.{rank:02d}")
        torch.save(4, fragments / f"step.{rank:02d}")
    written = merge_zero3_param_states(str(tmp_path / "tmp" / "w"), str(tmp_path / "zero" / "w"), [3, 5],
                                       _merge_zero_shards)
    assert written == ["exp_avg", "fp32", "step"]
    assert torch.equal(torch.load(tmp_path / "zero" / "w" / "fp32.pt")["param"], weight)
    assert torch.equal(torch.load(tmp_path / "zero" / "w" / "exp_avg.pt")["param"], -weight)
    assert torch.load(tmp_path / "zero" / "w" / "step.pt") == 4
    with pytest.raises(ValueError, match=r"hold 15 elements, the parameter's shape \(4, 5\) 20"):
        merge_zero3_param_states(str(tmp_path / "tmp" / "w"), str(tmp_path / "zero" / "w2"), [4, 5],
                                 _merge_zero_shards)


class _OneRankZero3:
    """What stage 3 hands ``restore_zero3_optimizer_state``, at W = 1: one ``Zero3SubGroup`` per entry of
    ``sub_groups`` (lists of parameters), each with a flat fp32 partition, the inner optimizer's state and
    groups, and a ``load_hp_checkpoint_state`` that reads a state file whole. ``names``: the parameters'
    names in sub-group order."""

    def __init__(self, sub_groups, names, param_groups):
        from deepspeed.checkpoint.universal_states import Zero3SubGroup
        named = dict(zip((p for group in sub_groups for p in group), names))
        self.fp32_partitioned_groups_flat = [torch.zeros(sum(p.numel() for p in group)) for group in sub_groups]
        self.sub_groups = [
            Zero3SubGroup(group, [named[p] for p in group], fp32)
            for group, fp32 in zip(sub_groups, self.fp32_partitioned_groups_flat)
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
    """Two sub-groups with different states (Adam's moments and a momentum without step), a
    checkpoint without per-parameter ``step.pt``: each sub-group gets its own states in place,
    the step of the saved sub-group with the same states, and each group its own settings."""
    zero = tmp_path / "zero"
    a, b, m = _param(2, 3), _param(4), _param(5)
    _write(zero, "a", fp32=torch.ones(2, 3), exp_avg=torch.full((2, 3), 2.0), exp_avg_sq=torch.full((2, 3), 3.0))
    _write(zero, "b", fp32=torch.ones(4) * 4, exp_avg=torch.full((4, ), 5.0), exp_avg_sq=torch.full((4, ), 6.0))
    _write(zero, "m", fp32=torch.ones(5) * 7, momentum_buffer=torch.full((5, ), 8.0))
    groups = [{"params": [], "lr": 1.0, "weight_decay": 0.5}, {"params": [], "lr": 2.0}]
    opt = _OneRankZero3([[a, b], [m]], ["a", "b", "m"], groups)
    momentum = torch.zeros(5, dtype=torch.bfloat16)  # held in the state already: copied into, dtype kept
    opt.optimizer.state[opt.fp32_partitioned_groups_flat[1]] = {"momentum_buffer": momentum}
    saved = {
        "state": {
            0: {
                "exp_avg": torch.zeros(10),
                "exp_avg_sq": torch.zeros(10),
                "step": 9
            },
            1: {
                "momentum_buffer": torch.zeros(5)
            }
        },
        "param_groups": [{
            "params": [0],
            "lr": 0.1,
            "weight_decay": 0.0
        }, {
            "params": [1],
            "lr": 0.2,
            "momentum": 0.9
        }],
    }
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
