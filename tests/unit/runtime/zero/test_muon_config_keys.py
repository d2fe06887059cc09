# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Every Muon config key is checked, and each accepted key changes the update of the half it is documented to reach.

- A key the engine would drop (``muon_momentum``, ``amsgrad``, ``ns_steps``; ``use_muon`` or ``muon_lr`` in a group)
  is refused at ``deepspeed.initialize`` (``ValueError``) naming it and the accepted keys.
- Per accepted key (MixedMLP, ZeRO-3, 1 rank, fp32, 2 steps): the weights equal a single-process reference with that
  setting (upstream ``muon_update``; torch's AdamW or Adam) to the fp32 floor and are far from the baseline's; after
  the first step the half the key does not reach is the baseline's bit for bit (later the halves interact).
- The precedence of ``lr``, ``muon_lr``, ``adam_lr`` and a group's own ``lr``; ``pipeline_depth`` and ``batch_ns``
  reach the update the engine builds, and values it cannot use are refused naming the key.
"""

import re

import deepspeed
import pytest
import torch

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, gathered_weights, relative_difference
from muon_testing.models import HYPER, build_model, is_muon_param, loss_fn, step_batch
from muon_testing.reference import fp32_newton_schulz, reference_muon_update
from unit.runtime.zero.zero3_muon_helpers import ds_config

STEPS = 2

NS_STANDARD_FLOOR = 1e-3
"""``ns_method: standard`` computes Newton-Schulz in bf16 on the CPU: run and reference differ by bf16 roundings
(4.9e-4 measured after 2 steps; see ``BF16_NS_FLOOR``), while "standard" and "gram" differ by 4.9e-3."""


def reference(steps=STEPS, muon=None, adam=None, adam_w_mode=True, rates=None):
    """Single-process training, a step's whole batch at once; returns the weights after each step. Upstream
    ``muon_update`` on the matrices with ``muon`` settings, torch's AdamW (Adam with L2 weight decay if not
    ``adam_w_mode``) on the rest with ``adam`` settings; ``rates``: per step ``[muon lr, adam lr]`` overriding lr."""
    m = dict(lr=HYPER["muon_lr"], momentum=HYPER["momentum"], weight_decay=HYPER["weight_decay"], ns_method="gram")
    a = dict(lr=HYPER["adam_lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    m.update(muon or {})
    a.update(adam or {})
    with fp32_newton_schulz():
        model = build_model("mixed")
        named = list(model.named_parameters())
        matrices = [(n, p) for n, p in named if is_muon_param(n, p)]
        other = [p for n, p in named if not is_muon_param(n, p)]
        adam_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        adam_opt = adam_cls(other, lr=a["lr"], betas=tuple(a["betas"]), eps=a["eps"], weight_decay=a["weight_decay"])
        momenta = {n: torch.zeros_like(p) for n, p in matrices}
        after = []
        for step in range(steps):
            muon_lr, adam_lr = rates[step] if rates else (m["lr"], a["lr"])
            x, y = step_batch("mixed", step)
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            with torch.no_grad():
                for n, p in matrices:
                    update = reference_muon_update(p.grad.clone(), momenta[n], m["momentum"], m["ns_method"])
                    p.mul_(1 - muon_lr * m["weight_decay"])
                    p.add_(update.reshape(p.shape), alpha=-muon_lr)
            for group in adam_opt.param_groups:
                group["lr"] = adam_lr
            adam_opt.step()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return after


def train_config(config, steps=STEPS, model_parameters=None):
    """MixedMLP trained on every rank under ``config`` (micro-step m of rank r: samples [(m * W + r) * mb, ... + mb)).
    Returns the full weights after each step, per step the groups' ``lr`` of that step, and the group names."""
    world_size, rank = deepspeed.comm.get_world_size(), deepspeed.comm.get_rank()
    gas, micro = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    with fp32_newton_schulz():
        model = build_model("mixed")
        parameters = model_parameters(model) if model_parameters else list(model.parameters())
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=parameters)
        names = [g.get("name") for g in engine.basic_optimizer.param_groups]
        after, rates = [], []
        for step in range(steps):
            x, y = step_batch("mixed", step)
            for m in range(gas):
                lo = (m * world_size + rank) * micro
                engine.backward(loss_fn(engine(x[lo:lo + micro].to(engine.device)),
                                        y[lo:lo + micro].to(engine.device)))
                if m == gas - 1:
                    rates.append(list(engine.get_lr()))
                engine.step()
            after.append(gathered_weights(engine))
        engine.destroy()
    return after, rates, names


def train(params, stage=3, steps=STEPS, model_parameters=None, zero=None):
    """ZeRO ``stage``, gas 1, ``params`` as ``optimizer.params``, ``zero`` added: the full weights after each step."""
    config = ds_config(stage, 1, deepspeed.comm.get_world_size())
    config["optimizer"]["params"] = params
    config["zero_optimization"].update(zero or {})
    return train_config(config, steps, model_parameters)[0]


def _halves(weights):
    names = {n: is_muon_param(n, p) for n, p in build_model("mixed").named_parameters()}
    muon = {n: w for n, w in weights.items() if names[n]}
    adam = {n: w for n, w in weights.items() if not names[n]}
    return muon, adam


SHARED = {k: HYPER[k] for k in ("momentum", "weight_decay", "eps")} | {"betas": list(HYPER["betas"])}
BASELINE = dict(muon_lr=HYPER["muon_lr"], adam_lr=HYPER["adam_lr"], **SHARED)
"""``ds_config``'s Muon block: the tests' hyper-parameters."""

# key -> (params, the reference's (muon, adam, adam_w_mode), the halves it reaches, floor); the user guide cites these.
CASES = {
    "lr": (SHARED | dict(lr=0.005), (dict(lr=0.005), dict(lr=0.005), True), ("muon", "adam"), FLOOR),
    "muon_lr": (BASELINE | dict(muon_lr=0.05), (dict(lr=0.05), None, True), ("muon", ), FLOOR),
    "adam_lr": (BASELINE | dict(adam_lr=0.01), (None, dict(lr=0.01), True), ("adam", ), FLOOR),
    "momentum": (BASELINE | dict(momentum=0.5), (dict(momentum=0.5), None, True), ("muon", ), FLOOR),
    "ns_method":
    (BASELINE | dict(ns_method="standard"), (dict(ns_method="standard"), None, True), ("muon", ), NS_STANDARD_FLOOR),
    "weight_decay": (BASELINE | dict(weight_decay=0.5), (dict(weight_decay=0.5), dict(weight_decay=0.5), True),
                     ("muon", "adam"), FLOOR),
    "betas": (BASELINE | dict(betas=[0.5, 0.9]), (None, dict(betas=(0.5, 0.9)), True), ("adam", ), FLOOR),
    "eps": (BASELINE | dict(eps=1e-2), (None, dict(eps=1e-2), True), ("adam", ), FLOOR),
    "adam_w_mode": (BASELINE | dict(adam_w_mode=False, weight_decay=0.5),
                    (dict(weight_decay=0.5), dict(weight_decay=0.5), False), ("muon", "adam"), FLOOR),
}


class TestEachKeyReachesItsHalf(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("key", sorted(CASES))
    def test_key(self, key):
        params, (muon, adam, adam_w_mode), reaches, floor = CASES[key]
        ours = train(params)
        expected = reference(muon=muon, adam=adam, adam_w_mode=adam_w_mode)
        baseline = reference()
        diff = relative_difference(expected[-1], ours[-1])
        print(f"MEASURED {key}: {diff:.2e} from its reference, "
              f"{relative_difference(baseline[-1], ours[-1]):.2e} from the baseline")
        assert diff <= floor, key
        # the key changes the update: the baseline is at least 4x the floor from the run
        assert relative_difference(baseline[-1], ours[-1]) > 4 * floor, key
        # after step 1 a half the key does not reach is the baseline's (exactly in the reference: same gradients)
        for half, ref_half, base_half in zip(("muon", "adam"), _halves(expected[0]), _halves(baseline[0])):
            if half not in reaches:
                assert relative_difference(base_half, ref_half) == 0.0, (key, half)
                assert relative_difference(base_half, _halves(ours[0])[("muon", "adam").index(half)]) <= FLOOR

    def test_adam_implementation_keys_keep_the_update(self):
        """``torch_adam`` (with or without ``foreach``), ``fp32_optimizer_states``: an implementation, not the math."""
        baseline = reference()[-1]
        for extra in ({"torch_adam": True}, {"torch_adam": True, "foreach": False}, {"fp32_optimizer_states": True}):
            diff = relative_difference(baseline, train(BASELINE | extra)[-1])
            print(f"MEASURED {extra}: {diff:.2e}")
            assert diff <= FLOOR, extra

    def test_misspelled_keys_refused_at_initialize(self):
        params = BASELINE | {"muon_momentum": 0.9, "lr_muon": 0.05}
        with pytest.raises(ValueError) as info:
            train(params, steps=0)
        message = str(info.value)
        assert message.startswith("The Muon optimizer's configuration has keys that would do nothing:"), message
        assert "- optimizer.params.muon_momentum: not a key of the Muon optimizer" in message
        assert "- optimizer.params.lr_muon: not a key of the Muon optimizer" in message
        assert ("Accepted: adam_lr, adam_w_mode, batch_ns, betas, eps, foreach, fp32_optimizer_states, lr, "
                "max_step_memory, momentum" in message), message

    def test_ns_method_refused_before_the_optimizer_is_built(self):
        """A bad ``ns_method`` fails naming the key (upstream's constructor would assert on it first)."""
        with pytest.raises(ValueError,
                           match=re.escape("- optimizer.params.ns_method: 'foo' is not a Newton-Schulz method")):
            train(BASELINE | {"ns_method": "foo"}, steps=0)

    @pytest.mark.parametrize("stage", [1, 2])
    def test_zenflow_refused_at_zero12(self, stage):
        """ZenFlow's own step at ZeRO-1/2 would skip the Muon update: refused naming the key."""
        zenflow = {"offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}
        with pytest.raises(ValueError, match=r"^zero_optimization\.zenflow: .* does not run the Muon update"):
            train(BASELINE, stage=stage, steps=0, zero=zenflow)

    def test_group_keys_refused_at_initialize(self):

        def groups(model):
            return [
                dict(params=list(model.fc1.parameters()), muon_lr=0.05),
                dict(params=[p for n, p in model.named_parameters() if not n.startswith("fc1.")], use_muon=True)
            ]

        with pytest.raises(ValueError) as info:
            train(BASELINE, steps=0, model_parameters=groups)
        message = str(info.value)
        assert ("- model_parameters[0].muon_lr: does nothing in a parameter group: a group's lr applies to both of "
                "its halves") in message, message
        assert ("- model_parameters[1].use_muon: does nothing in a parameter group: which half a tensor goes to "
                "is its own flag") in message, message
        # every key the engine copies into a Muon half is accepted (a variant's too, where the engine has one)
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.muon.config import group_keys
        accepted = sorted(set(group_keys()) | set(DeepSpeedEngine._MUON_HALF_KEYS))
        assert {"betas", "eps", "lr", "moe", "momentum", "name", "ns_method", "params",
                "weight_decay"} <= set(accepted)
        assert f"Accepted: {', '.join(accepted)}." in message


def test_check_muon_keys_accepts_every_key_it_lists():
    """Every key ``config_keys`` / ``group_keys`` lists is accepted with a valid value (default, or one set here)."""
    from deepspeed.runtime.zero.muon import config
    valid = {"ns_method": "gram", "pipeline_depth": 2, "batch_ns": None, "variant": "muon", "lr": 0.01}
    fields = config.MuonConfig.model_fields | config.MuonGroupConfig.model_fields
    defaults = {key: fields[key].default if key in fields else None for key in config.config_keys()}
    params = defaults | valid
    group = {key: fields[key].default if key in fields else None for key in config.group_keys()} | valid
    group["ns_method"] = "standard"
    assert {"pipeline_depth", "batch_ns", "variant"} <= set(params) & set(group)
    config.check_muon_keys(params, [group, torch.zeros(1)])
    with pytest.raises(ValueError, match=r"optimizer\.params\.a_variant_key: not a key of the Muon optimizer"):
        config.check_muon_keys(params | {"a_variant_key": 1}, [group])
    # a generator is left alone (not consumed)
    gen = (p for p in [torch.zeros(1)])
    config.check_muon_keys({}, gen)
    assert next(gen) is not None


def test_variant_refused_with_a_guess():
    """An unknown ``variant`` is refused where the engine builds Muon, with the closest accepted name."""
    from deepspeed.runtime.zero.muon import config
    with pytest.raises(ValueError) as info:
        config.check_muon_groups({"variant": "Muon"}, [{"params": [], "variant": "nor-muon"}], [], engine=None)
    message = str(info.value)
    assert message.startswith("The Muon optimizer's variant and tensor-parallel settings are invalid:\n"), message
    assert "- optimizer.params.variant: 'Muon' is not a Muon variant; accepted: 'muon'" in message, message
    assert "Did you mean 'muon'?" in message, message
    assert "- model_parameters[0].variant: 'nor-muon' is not a Muon variant" in message, message


def test_check_muon_keys_refusals():
    from deepspeed.runtime.zero.muon import config
    for key in ("amsgrad", "ns_steps", "nesterov", "bias_correction", "muon_momentum", "lr_muon"):
        with pytest.raises(ValueError, match=rf"- optimizer\.params\.{key}: not a key of the Muon optimizer"):
            config.check_muon_keys({key: 1}, None)
    with pytest.raises(ValueError,
                       match=r"ns_steps: .* nothing \(Newton-Schulz always runs upstream's 5 iterations\)"):
        config.check_muon_keys({"ns_steps": 3}, None)
    with pytest.raises(ValueError, match=r"nesterov: .* nothing \(Muon always uses the Nesterov blend"):
        config.check_muon_keys({"nesterov": False}, None)
    with pytest.raises(ValueError, match=r"model_parameters\[0\]\.ns_steps: not a key of a Muon parameter group"):
        config.check_muon_keys({}, [{"params": [], "ns_steps": 3}])


def test_check_muon_keys_suggests_the_key_meant():
    """A misspelled key or value gets the closest accepted one, lower-cased first; a key far from every accepted one,
    or with a reason of its own, gets none."""
    from deepspeed.runtime.zero.muon import config
    for key, meant in (("muon_momentum", "momentum"), ("weight_decy", "weight_decay"), ("Momentum", "momentum"),
                       ("adamlr", "adam_lr"), ("ns_methods", "ns_method")):
        with pytest.raises(ValueError) as info:
            config.check_muon_keys({key: 1}, None)
        assert str(info.value).endswith(f". Did you mean {meant!r}?"), str(info.value)
    for key in ("amsgrad", "epsilon", "ns_steps", "nesterov"):
        with pytest.raises(ValueError) as info:
            config.check_muon_keys({key: 1}, None)
        assert "Did you mean" not in str(info.value), str(info.value)
    with pytest.raises(ValueError) as info:
        config.check_muon_keys({}, [{"params": [], "momentun": 0.9}, {"params": [], "muon_lr": 0.1}])
    first, second = str(info.value).splitlines()[1:]
    assert first.startswith("- model_parameters[0].momentun:") and first.endswith(" Did you mean 'momentum'?")
    assert second.startswith("- model_parameters[1].muon_lr: does nothing in a parameter group: a group's lr"
                             ) and "Did you mean" not in second
    for value, meant in (("Gram", "gram"), ("polar-express", "polar_express"), ("PolarExpress", "polar_express")):
        with pytest.raises(ValueError,
                           match=rf"is not a Newton-Schulz method of Muon\. .*\. Did you mean {meant!r}\?"):
            config.check_muon_keys({"ns_method": value}, None)


def test_check_muon_keys_ns_method_values():
    """Every Newton-Schulz method of upstream's Muon is accepted in the config and in a group; anything else is
    refused naming the key, the value and the accepted methods, after the unknown keys."""
    from deepspeed.runtime.zero.muon import config, original_muon
    assert config.ns_methods() == set(original_muon.NS_METHODS) >= {"gram", "standard"}
    for method in config.ns_methods():
        config.check_muon_keys({"ns_method": method}, [{"params": [], "ns_method": method}])
    accepted = f"Accepted: {', '.join(sorted(original_muon.NS_METHODS))}."
    for bad in ("polar-express", "Gram", None, 5, ["gram"]):
        with pytest.raises(ValueError) as info:
            config.check_muon_keys({"ns_method": bad}, [{"params": []}, {"params": [], "ns_method": bad}])
        message = str(info.value)
        assert message.startswith("The Muon optimizer's configuration has values it cannot use:"), message
        assert f"- optimizer.params.ns_method: {bad!r} is not a Newton-Schulz method of Muon. {accepted}" in message
        assert f"- model_parameters[1].ns_method: {bad!r} is not a Newton-Schulz method of Muon. {accepted}" in message
    with pytest.raises(ValueError) as info:
        config.check_muon_keys({"ns_method": "newton", "ns_steps": 3}, None)
    keys, values = str(info.value).split("\nThe Muon optimizer's configuration has values it cannot use:\n")
    assert "optimizer.params.ns_steps" in keys and "optimizer.params.ns_method: 'newton'" in values


def test_per_head_muon_on_each_base():
    """Accepted where DeepSpeed has per-head Muon, refused (saying so) where it has none."""
    from deepspeed.runtime.zero.muon import config
    if config.has_per_head_muon():
        config.check_muon_keys({"per_head_muon": True}, None)
    else:
        with pytest.raises(ValueError, match="per_head_muon: this DeepSpeed has no per-head Muon"):
            config.check_muon_keys({"per_head_muon": True}, None)


def _resolved(optimizer_params, groups=None):
    """[(use_muon, lr)] of the groups DeepSpeed's Muon is built with (the engine's grouping, then
    ``MuonWithAuxAdam``'s defaults), for a matrix and a bias, or ``groups(matrix, bias)``."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    matrix, bias = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3))
    matrix.use_muon, bias.use_muon = True, False
    model_parameters = groups(matrix, bias) if groups else [matrix, bias]
    built = MuonWithAuxAdam(DeepSpeedEngine._muon_param_groups(model_parameters, optimizer_params))
    return [(g["use_muon"], g["lr"]) for g in built.param_groups]


def test_learning_rate_precedence():
    """A group's own lr, else muon_lr / adam_lr, else lr, else 0.02 (Muon) / 3e-4 (Adam)."""
    assert _resolved({}) == [(True, 0.02), (False, 3e-4)]
    assert _resolved({"lr": 0.01}) == [(True, 0.01), (False, 0.01)]
    assert _resolved({"lr": 0.01, "muon_lr": 0.05}) == [(True, 0.05), (False, 0.01)]
    assert _resolved({"lr": 0.01, "adam_lr": 0.003}) == [(True, 0.01), (False, 0.003)]
    assert _resolved({"muon_lr": 0.05, "adam_lr": 0.003}) == [(True, 0.05), (False, 0.003)]
    own = lambda matrix, bias: [dict(params=[matrix, bias], lr=0.007)]  # noqa: E731
    assert _resolved({"lr": 0.01, "muon_lr": 0.05, "adam_lr": 0.003}, own) == [(True, 0.007), (False, 0.007)]


class TestUpdateSettingsReachTheUpdate(DistributedTest):
    """``pipeline_depth`` and ``batch_ns`` reach each pipeline of the update the engine builds (ZeRO-2/3). The depth is
    an upper bound: ``owner_plan`` lowers it where the exchange buffers would not fit the momentum's memory."""
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [2, 3])
    def test_settings_reach_every_pipeline(self, stage):
        from deepspeed.runtime.zero.muon.pipeline import DEFAULT_DEPTH
        cases = [({}, DEFAULT_DEPTH, None), (dict(pipeline_depth=1, batch_ns=False), 1, False),
                 (dict(batch_ns=True), DEFAULT_DEPTH, True)]
        for settings, depth, batch_ns in cases:
            net = build_model("mixed")
            config = ds_config(stage, 1, self.world_size)
            config["optimizer"]["params"].update(settings)
            engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))
            pipelines = list(engine.optimizer.muon_update.pipelines.values())
            assert pipelines and all(p.batch_ns is batch_ns for p in pipelines), settings
            assert all(1 <= p.depth <= depth for p in pipelines), settings  # depth 1: exactly 1
            engine.destroy()

    @pytest.mark.parametrize("stage", [2, 3])
    def test_max_step_memory_below_the_least_need_refused_at_initialize(self, stage):
        """A cap below what every matrix alone needs is refused on every rank with that need in bytes; at that
        need the plan fits (depth 1), and the strict value plans within the momentum partition."""
        from deepspeed.runtime.zero.muon.owner_plan import rank_numels, slots_for_depth

        def initialize(cap):
            net = build_model("mixed")
            config = ds_config(stage, 1, self.world_size)
            config["optimizer"]["params"]["max_step_memory"] = cap
            return deepspeed.initialize(model=net, config=config, model_parameters=list(net.parameters()))[0]

        with pytest.raises(ValueError) as refused:
            initialize(64)
        message = str(refused.value)
        assert message.startswith("max_step_memory (optimizer.params or the Muon parameter group): 64 bytes is below "
                                  "what Muon's step needs on a rank for "), message
        needed = int(re.search(r"at least (\d+) bytes \(", message).group(1))
        assert f"Set max_step_memory to at least {needed}, or to \"momentum_partition\"" in message
        engine = initialize(needed)
        for p in engine.optimizer.muon_update.pipelines.values():
            assert 4 * max(rank_numels(p.plan, p.pieces, slots_for_depth(p.depth), p.result_itemsize)[0]) <= needed
        engine.destroy()
        engine = initialize("momentum_partition")
        assert engine.optimizer.muon_update.pipelines
        engine.destroy()


BAD_VALUES = {
    "lr": ("0.01", -0.1, True, float("nan"), "auto"),
    "muon_lr": ("0.02", -1, False),
    "adam_lr": ("3e-4", -1e-3),
    "momentum": ("0.9", 1.0, -0.5, None),
    "weight_decay": ("0.1", -0.1, None),
    "betas": ("0.9,0.95", [0.9], [0.9, 1.5], ["0.9", 0.95], 0.9),
    "eps": ("1e-8", -1e-8, True),
    "adam_w_mode": ("false", 0, None),
    "torch_adam": ("yes", 1),
    "foreach": ("true", 0),
    "fp32_optimizer_states": (1, "no"),
    "split_fused_muon": ("yes", 0),
    "variant": (5, None),
}
"""Per ``MuonConfig`` key: values its field refuses (wrong type, out of range); the update's settings: below."""


def _check_values(key, bad, good=(), described=""):
    """Each ``bad`` value is refused naming the block and key, repeating the value and giving the field's description
    (which starts ``described``), in a parameter group too for a group key; each ``good`` value is accepted in both."""
    from deepspeed.runtime.zero.muon import config
    description = config.MuonConfig.model_fields[key].description
    assert description.startswith(described), description
    for value in good:
        config.check_muon_keys({key: value}, [{"params": [], key: value}])
    for value in bad:
        with pytest.raises(ValueError) as info:
            config.check_muon_keys({key: value}, None)
        message, head = str(info.value), "The Muon optimizer's configuration has values it cannot use:\n"
        assert message.startswith(f"{head}- optimizer.params.{key}: {value!r} is invalid; {description}."), message
        if key in config.MuonGroupConfig.model_fields:
            group = config.MuonGroupConfig.model_fields[key].description
            with pytest.raises(ValueError,
                               match=re.escape(f"- model_parameters[0].{key}: {value!r} is invalid; {group}.")):
                config.check_muon_keys({}, [{"params": [], key: value}])


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_each_bad_value_refused_naming_the_key(key):
    _check_values(key, BAD_VALUES[key])


def test_update_settings_values_refused_naming_the_key():
    _check_values("pipeline_depth", (0, -1, 2.0, True, "2", None), (1, 3), "buckets of the boundary update in flight")
    _check_values("batch_ns", (1, "yes", 0.5), (True, False), "same-shape Newton-Schulz")


def test_max_step_memory_values_refused_naming_the_key():
    from deepspeed.runtime.zero.muon import config
    _check_values("max_step_memory", (0, -4096, 1.5, True, "8GB", "momentum-partition"),
                  (1, 8 * 2**30, 8e9, "momentum_partition", None), "bytes Muon's step may add on a rank's accelerator")
    with pytest.raises(ValueError, match="Did you mean 'momentum_partition'"):
        config.check_muon_keys({}, [{"params": [], "max_step_memory": "momentum-partition"}])


def test_qk_clip_threshold_value_refused_naming_the_key():
    from deepspeed.runtime.zero.muon import config
    if not config.has_qk_clip():
        pytest.skip("this DeepSpeed has no QK-clip")
    for bad in (0, -1.0, "100", True, float("inf")):
        with pytest.raises(ValueError,
                           match=re.escape(f"optimizer.params.qk_clip_threshold: {bad!r} is invalid; "
                                           "the largest attention logit")):
            config.check_muon_keys({"qk_clip_threshold": bad}, None)
    config.check_muon_keys({"qk_clip_threshold": 100}, None)


def test_defaults_are_the_ones_the_update_uses():
    """The model's defaults are those of the code that reads each key when it is unset."""
    import inspect
    from deepspeed.runtime.zero.muon import config, original_muon, owner_state
    from deepspeed.runtime.zero.muon.pipeline import DEFAULT_DEPTH
    defaults = config.MuonConfig()
    assert defaults.pipeline_depth == DEFAULT_DEPTH
    assert defaults.variant == owner_state.MUON
    upstream = inspect.signature(original_muon.Muon.__init__).parameters
    assert defaults.momentum == upstream["momentum"].default and defaults.ns_method == upstream["ns_method"].default
    assert defaults.weight_decay == upstream["weight_decay"].default
    assert defaults.max_step_memory is None and defaults.batch_ns is None and defaults.split_fused_muon is None
    assert defaults.adam_w_mode is True and defaults.lr is None


def test_group_keys_come_from_the_same_model():
    """The keys a group shares with ``optimizer.params`` are one set of fields (``MuonSettings``); the engine's
    keys of each half, the update's keys and the key names other modules read are among them."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon import binding, config, newton_schulz, owner_state
    shared = config.MuonSettings.model_fields
    for model in (config.MuonConfig, config.MuonGroupConfig):
        assert all(model.model_fields[k].description == shared[k].description for k in shared)
    assert set(shared) <= set(config.group_keys()) and set(shared) <= set(config.config_keys())
    assert set(DeepSpeedEngine._MUON_HALF_KEYS) | set(DeepSpeedEngine._ADAM_HALF_KEYS) <= set(shared)
    variant_keys = {k for v in owner_state.registered().values() for k in v.defaults}
    assert set(config.muon_group_keys()) <= set(shared) | variant_keys
    for name in (binding.PIPELINE_DEPTH_KEY, binding.BATCH_NS_KEY, binding.MAX_STEP_MEMORY_KEY,
                 newton_schulz.SPLIT_KEY, owner_state.VARIANT_KEY, config.VARIANT_KEY):
        assert name in shared, name
    assert config.QK_CLIP_KEY in config.MuonConfig.model_fields and config.QK_CLIP_KEY not in shared


def _module_imports(module) -> set:
    """The modules ``module`` imports at import time (its top-level ``import`` / ``from`` statements)."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_config_imports_only_modules_below_it():
    """Of Muon's modules ``config`` imports only ``momentum``, ``owner_plan``, ``owner_state`` and ``support``, none
    of which reaches ``config`` (the binding, stages and features import it without a cycle); ``support`` none."""

    import importlib
    from deepspeed.runtime.zero.muon import config, support
    package = "deepspeed.runtime.zero.muon"
    muon = lambda names: {n for n in names if n.startswith(package + ".") and n.count(".") == 4}  # noqa: E731
    below = muon(_module_imports(config))
    assert below == {f"{package}.{m}" for m in ("momentum", "owner_plan", "owner_state", "support")}, below
    reached, todo = set(), list(below)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += muon(_module_imports(importlib.import_module(name)))
    assert config.__name__ not in reached, reached
    assert not muon(_module_imports(support))
