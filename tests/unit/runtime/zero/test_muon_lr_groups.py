# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's two learning rates under DeepSpeed's schedulers, and the progress log naming them (``muon.lr_groups``).

Per scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) and ZeRO stage 1-3, 2 gloo ranks, fp32
MixedMLP, 5 steps, ``muon_lr`` 0.02, ``adam_lr`` 0.003: each group's rate at every step is the schedule's formula
(written out below) applied to its own configured rate, and the weights match a single-process reference (upstream
``muon_update``, ``torch.optim.AdamW``) to the fp32 floor. A scalar rate that would overwrite both is refused at
``deepspeed.initialize``; the resolution rules are checked on a bare optimizer.
"""

import math

import deepspeed
from deepspeed import comm as dist
import pytest
import torch

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.models import HYPER, build_model
from unit.runtime.zero.test_muon_config_keys import reference as config_keys_reference, train_config
from unit.runtime.zero.zero3_muon_helpers import ds_config

STEPS = 5
MUON_LR, ADAM_LR = HYPER["muon_lr"], HYPER["adam_lr"]


def _warmup(i, n):  # linear warmup fraction at scheduler iteration i (DeepSpeed's linear warmup_type)
    return i / n if i < n else 1.0


def _cosine(i):  # WarmupCosineLR's ratio at iteration i: warmup from 0.1 over 2, then cosine down to 0.01 at 4
    return 0.1 + 0.9 * i / 2 if i < 2 else 0.01 + 0.99 * (1 + math.cos(math.pi * min(1.0, (i - 1) / 2))) / 2


WARMUP_2_OF_4 = dict(total_num_steps=4, warmup_num_steps=2, warmup_type="linear")
SCHEDULES = {
    # scalar warmup_min_lr 0 overwrites no rate; warmup_max_lr unset: each group's own
    "WarmupLR": dict(warmup_min_lr=0, warmup_num_steps=3, warmup_type="linear"),
    # warmup_max_lr unset: upstream's default would be 0.001 for both groups
    "WarmupDecayLR": WARMUP_2_OF_4,
    # ratios of each group's own rate (upstream already kept both rates)
    "WarmupCosineLR": WARMUP_2_OF_4 | dict(warmup_min_ratio=0.1, cos_min_ratio=0.01),
    # cycle_min_lr as a per-group list (used as given), cycle_max_lr unset: each group's own rate
    "OneCycle": dict(cycle_min_lr=[MUON_LR / 10, ADAM_LR / 4], cycle_first_step_size=2),
    # lr_range_test_min_lr unset: upstream's default would be 0.001 for both groups
    "LRRangeTest": dict(lr_range_test_step_size=2, lr_range_test_step_rate=1.0),
}
# name -> rate(group's configured rate, group index, optimizer step k): the schedule at iteration k - 1 (the scheduler
# sets iteration -1's rate when built and steps after every optimizer step).
RATES = {
    "WarmupLR": lambda c, g, k: 0.0 if k == 0 else c * _warmup(k - 1, 3),
    "WarmupDecayLR": lambda c, g, k: 0.0 if k == 0 else c * (_warmup(k - 1, 2) if k < 3 else max(0.0, (5 - k) / 2)),
    "WarmupCosineLR": lambda c, g, k: 0.0 if k == 0 else c * _cosine(k - 1),
    "OneCycle": lambda c, g, k: [c / 10, c / 4][g] + (c - [c / 10, c / 4][g]) * [0.0, 0.5, 1.0, 0.5, 0.0][k],
    "LRRangeTest": lambda c, g, k: c * (1 + k / 2),
}


def expected_rates(name):
    """[[Muon rate, Adam rate] per optimizer step] of schedule ``name``."""
    rate = RATES[name]
    return [[rate(MUON_LR, 0, k), rate(ADAM_LR, 1, k)] for k in range(STEPS)]


def reference(rates):
    """Single-process reference weights after training at per-step ``[muon_lr, adam_lr]``."""
    return config_keys_reference(len(rates), rates=rates)[-1]


def train(config, steps=STEPS):
    """(per step the groups' ``lr`` the optimizer step used, group names, the full weights at the end)."""
    after, rates, names = train_config(config, steps)
    return rates, names, after[-1]


def scheduled_config(stage, world_size, name, params=None, gas=2):
    config = ds_config(stage, gas, world_size)
    config["scheduler"] = {"type": name, "params": dict(SCHEDULES[name] if params is None else params)}
    return config


def init_error(config):
    """The ``"Type: message"`` of what ``deepspeed.initialize`` raises for ``config``, or None."""
    model = build_model("mixed")
    try:
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    except Exception as error:  # the message is what is checked
        return f"{type(error).__name__}: {error}"
    engine.destroy()
    return None


def test_expected_rates_keep_both_groups_apart():
    """After the first step each schedule keeps the groups' configured ratio (OneCycle: its list's), never one rate."""
    for name in SCHEDULES:
        rates = expected_rates(name)
        assert any(m > 0 for m, _ in rates), name
        for muon, adam in rates:
            assert muon != adam or muon == adam == 0.0, name


class TestSchedulerRatesPerGroup(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2, 3])
    @pytest.mark.parametrize("name", sorted(SCHEDULES))
    def test_rates_and_weights(self, name, stage):
        """The rate of each group at every step is its own schedule's, and the weights the reference's."""
        rates, names, weights = train(scheduled_config(stage, dist.get_world_size(), name))
        expected = expected_rates(name)
        assert names == ["muon-params", "adam-params"]
        for k, (got, want) in enumerate(zip(rates, expected)):
            assert got == pytest.approx(want, rel=1e-12, abs=0.0), (name, stage, k, rates)
        diff = relative_difference(reference(expected), weights)
        if dist.get_rank() == 0:
            print(f"MEASURED {name} stage {stage}: {diff:.2e}")
        assert diff <= FLOOR, (name, stage)
        # what the old single rate would have given is far from it
        assert relative_difference(reference([[0.001, 0.001]] * STEPS), weights) > 1000 * FLOOR

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_scalar_rate_refused(self, stage):
        """WarmupDecayLR ``warmup_max_lr: 0.001`` (Muon at 1/20 of its rate, Adam at 3.3x) is refused, naming the
        key, both groups' rates and the list to write."""
        params = dict(total_num_steps=4, warmup_max_lr=0.001)
        error = init_error(scheduled_config(stage, dist.get_world_size(), "WarmupDecayLR", params))
        assert error is not None and error.startswith("ValueError: scheduler.params.warmup_max_lr: one value, 0.001,")
        for part in ("muon-params (Muon) 0.02", "adam-params (Adam) 0.003",
                     '"warmup_max_lr": [<muon-params>, <adam-params>]', "[0.02, 0.003]",
                     "leave it unset: each group then uses its configured rate (the way under the Hugging Face"):
            assert part in error, (part, error)

    @pytest.mark.parametrize("stage", [1, 3])
    def test_per_group_list_used_as_given(self, stage):
        """``warmup_max_lr`` as a list: each group warms up to its value, and the weights follow."""
        lo, hi = [0.002, 0.0001], [0.01, 0.001]
        params = dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=2, warmup_type="linear")
        rates, _, weights = train(scheduled_config(stage, dist.get_world_size(), "WarmupLR", params))
        expected = [[lo[g] + (hi[g] - lo[g]) * (0.0 if k == 0 else _warmup(k - 1, 2)) for g in range(2)]
                    for k in range(STEPS)]
        for got, want in zip(rates, expected):
            assert got == pytest.approx(want, rel=1e-12, abs=0.0)
        assert relative_difference(reference(expected), weights) <= FLOOR


class TestProgressLog(DistributedTest):
    world_size = 1

    def test_log_names_each_rate(self):
        """Logged rates carry their group names; ``engine.get_lr()`` stays a list in the groups' order."""
        from deepspeed.runtime import engine as engine_module
        lines = []
        original = engine_module.log_dist

        def recording(message, *args, **kwargs):
            lines.append(str(message))
            return original(message, *args, **kwargs)

        config = scheduled_config(3, 1, "WarmupDecayLR", gas=1)
        config["steps_per_print"] = 2
        engine_module.log_dist = recording
        try:
            rates, _, _ = train(config, steps=4)
        finally:
            engine_module.log_dist = original
        progress = [line for line in lines if line.startswith("step=")]
        assert len(progress) == 3, progress  # step 0 (initialize), 2, 4
        assert "lr={'muon-params': 0.0, 'adam-params': 0.0}" in progress[0], progress[0]
        # after 4 steps: iteration 3 of WarmupDecayLR (warmup 2, total 4): (4 - 3) / 2 of each rate
        assert f"lr={{'muon-params': {MUON_LR / 2}, 'adam-params': {ADAM_LR / 2}}}" in progress[2], progress[2]
        assert isinstance(rates[0], list) and len(rates[0]) == 2


# ---------------------------------------------------------------- the rules, on a bare optimizer


def _muon_like(rates=(MUON_LR, ADAM_LR), names=("muon-params", "adam-params")):
    groups = [
        dict(params=[torch.nn.Parameter(torch.zeros(2, 2))], lr=r, use_muon=i == 0, name=n)
        for i, (r, n) in enumerate(zip(rates, names))
    ]
    return torch.optim.SGD(groups, lr=1.0)


def _plain():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_resolution_rules():
    from deepspeed.runtime.zero.muon.lr_groups import scheduler_params_for_groups as resolve
    opt = _muon_like()
    # unset configured-rate keys: each group's rate; unset warmup_min_lr keeps the default 0
    assert resolve("WarmupDecayLR", {"total_num_steps": 9}, opt) == dict(total_num_steps=9,
                                                                         warmup_max_lr=[MUON_LR, ADAM_LR])
    assert resolve("OneCycle", {}, opt) == {"cycle_min_lr": [MUON_LR, ADAM_LR], "cycle_max_lr": [MUON_LR, ADAM_LR]}
    assert resolve("LRRangeTest", {}, opt) == {"lr_range_test_min_lr": [MUON_LR, ADAM_LR]}
    # None counts as unset (a config key written as null)
    assert resolve("WarmupLR", {"warmup_max_lr": None}, opt) == {"warmup_max_lr": [MUON_LR, ADAM_LR]}
    # lists as given, ratios untouched, scalar 0 accepted
    given = {"warmup_min_lr": 0, "warmup_max_lr": (0.1, 0.2)}
    assert resolve("WarmupLR", given, opt) == given
    ratios = {"total_num_steps": 9, "warmup_min_ratio": 0.3, "cos_min_ratio": 0.2}
    assert resolve("WarmupCosineLR", ratios, opt) == ratios
    # one configured rate for all groups: a scalar overwrites nothing that differs
    assert resolve("WarmupLR", {"warmup_max_lr": 0.5}, _muon_like(rates=(0.1, 0.1))) == {"warmup_max_lr": 0.5}
    # not Muon, or a scheduler outside DeepSpeed's: the params themselves, unchanged
    params = {"total_num_steps": 9}
    assert resolve("WarmupDecayLR", params, _plain()) is params
    assert resolve("StepLR", {"step_size": 3}, opt) == {"step_size": 3}


@pytest.mark.parametrize("key,scheduler", [("warmup_min_lr", "WarmupLR"), ("warmup_max_lr", "WarmupDecayLR"),
                                           ("cycle_min_lr", "OneCycle"), ("cycle_max_lr", "OneCycle"),
                                           ("lr_range_test_min_lr", "LRRangeTest")])
def test_scalar_refused(key, scheduler):
    from deepspeed.runtime.zero.muon.lr_groups import scheduler_params_for_groups as resolve
    opt = _muon_like(rates=(0.02, 3e-4, 0.01), names=("attn-muon-params", "attn-adam-params", None))
    with pytest.raises(ValueError) as info:
        resolve(scheduler, {key: 0.001}, opt)
    message = str(info.value)
    assert message.startswith(f"scheduler.params.{key}: one value, 0.001, for all 3 parameter groups"), message
    for part in ("attn-muon-params (Muon) 0.02", "attn-adam-params (Adam) 0.0003", "group 2 (Adam) 0.01",
                 f'"{key}": [<attn-muon-params>, <attn-adam-params>, <group 2>]', "[0.02, 0.0003, 0.01]"):
        assert part in message, (part, message)
    unset = "0 for every group" if key == "warmup_min_lr" else "its configured rate"
    assert unset in message


def test_list_of_wrong_length_refused():
    from deepspeed.runtime.zero.muon.lr_groups import scheduler_params_for_groups as resolve
    with pytest.raises(ValueError) as info:
        resolve("WarmupLR", {"warmup_max_lr": [0.1]}, _muon_like())
    assert str(info.value) == ("scheduler.params.warmup_max_lr: 1 value(s) [0.1], but the Muon optimizer has 2 "
                               "parameter groups: muon-params (Muon) 0.02, adam-params (Adam) 0.003. Give one "
                               "value per group, in this order: \"warmup_max_lr\": [<muon-params>, <adam-params>].")


def test_rates_and_momenta_by_group_labels():
    """Progress log ``lr=``/``mom=`` (Muon beta, Adam betas) by group name, repeats numbered; not Muon: the list."""
    from deepspeed.runtime.zero.muon.lr_groups import momenta_by_group, rates_by_group
    assert rates_by_group(_muon_like(names=("x", "x")), [1, 2]) == {"x#0": 1, "x#1": 2}
    assert rates_by_group(_plain(), [0.1]) == [0.1]
    opt = _muon_like()
    opt.param_groups[0]["momentum"] = 0.95
    opt.param_groups[1]["betas"] = (0.9, 0.95)
    assert momenta_by_group(opt, [0.0, (0.9, 0.95)]) == {"muon-params": 0.95, "adam-params": (0.9, 0.95)}
    assert momenta_by_group(_plain(), [0.0]) == [0.0]
