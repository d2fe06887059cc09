# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Fused projections orthogonalized part by part (``muon_split``, ``split_fused_muon``).

Recognized Hugging Face layouts (transformers 5 MoE ``gate_up_proj``, GPT-2 ``c_attn``, Phi-3 ``qkv_proj`` with GQA
and ``gate_up_proj``) are tagged with their parts; ``orthogonalize_parts`` is upstream's NS per part; GPT-2 and
Qwen3-MoE at ZeRO-1, 2, 3 equal a reference running ``muon_update`` per part as separate layers (``FLOOR``), far from
the fused update (MEASURED), which ``"split_fused_muon": false`` gives; a bad ``muon_split`` or key value is refused.
"""

import pytest
import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.newton_schulz import SPLIT_ATTR, orthogonalize_parts
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.param_selection import (check_split, resolve_optimizer_selection,
                                                         select_muon_parameters, tag_fused_projections)
from unit.common import DistributedTest
from muon_testing.causal_lm import MODELS, causal_lm_loss, micro_batches, train_causal_lm_reference
from muon_testing.compare import FLOOR, gathered_weights, relative_difference
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import ds_config

pytest.importorskip("transformers")

STEPS = 2


def _tagged(name):
    model = MODELS[name]()
    select_muon_parameters(model)
    return model, tag_fused_projections(model)


def test_recognized_layouts():
    _, gpt2 = _tagged("gpt2")
    assert gpt2 == {f"transformer.h.{i}.attn.c_attn.weight": (-1, (32, 32, 32)) for i in range(2)}
    _, moe = _tagged("qwen3_moe")
    assert moe == {f"model.layers.{i}.mlp.experts.gate_up_proj": (-2, (16, 16)) for i in range(2)}
    _, phi3 = _tagged("phi3")
    assert phi3 == {
        "model.layers.0.self_attn.qkv_proj.weight": (-2, (32, 16, 16)),  # 4 query and 2 key-value heads of 8
        "model.layers.0.mlp.gate_up_proj.weight": (-2, (48, 48)),
    }
    fused, separate = torch.nn.MultiheadAttention(24, 4), torch.nn.MultiheadAttention(24, 4, kdim=8)
    torch_attention = torch.nn.Sequential(fused, separate)
    select_muon_parameters(torch_attention)  # the second's query, key and value are separate parameters
    assert tag_fused_projections(torch_attention) == {"0.in_proj_weight": (-2, (24, 24, 24))}


@pytest.mark.parametrize(
    "name,attr,shape",
    [
        ("GptOssExperts", "gate_up_proj", (4, 32, 32)),  # GPT-OSS: (experts, H, 2 I), gate, up interleaved by column
        ("Qwen3MoeExperts", "gate_up_proj", (4, 33, 32)),  # named as a recognized class, but odd rows cannot halve
        ("CodeGenAttention", "qkv_proj", None),  # CodeGen: blocks of q, v and k per device, not three runs of rows
    ])
def test_layouts_not_listed_stay_whole(name, attr, shape):
    module = type(name, (torch.nn.Module, ), {})()
    setattr(module, attr, torch.nn.Parameter(torch.zeros(shape)) if shape else torch.nn.Linear(32, 96, bias=False))
    model = torch.nn.Sequential(module)
    for param in model.parameters():
        param.use_muon = True
    assert tag_fused_projections(model) == {}


def test_user_split_kept_and_adam_untouched():
    model = MODELS["gpt2"]()
    select_muon_parameters(model)
    attn = model.transformer.h[0].attn.c_attn.weight
    setattr(attn, SPLIT_ATTR, (-1, (64, 32)))
    model.transformer.h[1].attn.c_attn.weight.use_muon = False
    tagged = tag_fused_projections(model)
    assert getattr(attn, SPLIT_ATTR) == (-1, (64, 32)) and not tagged


@pytest.mark.parametrize("shape,split", [((12, 5), (-2, (4, 8))), ((5, 12), (1, (6, 6))), ((3, 8, 5), (-2, (4, 4)))])
def test_parts_orthogonalized_on_their_own(shape, split):
    torch.manual_seed(0)
    update, checked = torch.randn(shape), check_split(split, shape, "w")
    with fp32_newton_schulz():
        got = orthogonalize_parts(update, checked, 5, "gram", torch.float32)
        want = [
            original_muon.muon_orthogonalize(part.contiguous(), 5, "gram", part.ndim == 3, None, torch.float32)
            for part in update.split(list(split[1]), dim=checked[0])
        ]
    assert relative_difference([torch.cat(want, dim=checked[0])], [got]) <= FLOOR


@pytest.mark.parametrize("split,heads,message", [((0, (4, 4)), None, "sizes"), ((2, (6, 6)), None, "dim"),
                                                 ("rows", None, "expected"), ((0, (6, 6)), 2, "not both")])
def test_bad_split_refused(split, heads, message):
    with pytest.raises(ValueError, match=f"muon_split .*{message}"):
        check_split(split, (12, 6), "w", heads)


def _initialize(model, stage, gas, world_size, **muon_params):
    config = ds_config(stage, gas, world_size)
    del config["train_batch_size"]
    config["optimizer"]["params"].update(muon_params)
    return deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))[0]


def _train(name, stage, gas, world_size, **muon_params):
    engine = _initialize(MODELS[name](), stage, gas, world_size, **muon_params)
    with fp32_newton_schulz():
        for step in range(STEPS):
            for ids in micro_batches(step, dist.get_rank(), world_size, gas):
                engine.backward(causal_lm_loss(engine, ids))
                engine.step()
    splits = {n: getattr(p, SPLIT_ATTR) for n, p in engine.module.named_parameters() if hasattr(p, SPLIT_ATTR)}
    weights = gathered_weights(engine)
    engine.destroy()
    return weights, splits


def _reference(name, splits=None):
    muon_names = set(select_muon_parameters(MODELS[name]()).muon)  # DeepSpeed's rule: GPT-2's wpe goes to Adam
    model = train_causal_lm_reference(name, STEPS, splits=splits, muon_names=muon_names)
    return {n: p.detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("split", [True, False])
def test_report_names_what_is_split_and_what_kept(split):
    """The init warning lists the fused projections split (or kept whole when ``split_fused_muon`` is false)."""
    model = MODELS["gpt2"]()
    select_muon_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        dict(params=[p for p in params if p.use_muon], use_muon=True, split_fused_muon=split),
        dict(params=[p for p in params if not p.use_muon], use_muon=False)
    ]
    lines = []

    class Log:
        warning = staticmethod(lines.append)

    resolve_optimizer_selection(MuonWithAuxAdam(groups), model, client=False, zero_stage=1, log=Log)
    fused = [line for line in lines if "fused projection" in line]
    assert len(fused) == 1, lines
    if split:
        assert "2 fused projection(s) hold several matrices" in fused[0] and "kept whole" not in fused[0], fused
    else:
        assert fused[0].startswith("Muon: 2 fused projection(s) kept whole (split_fused_muon false): "), fused
        assert "orthogonalized on its own" not in fused[0] and ": ;" not in fused[0], fused


class TestFusedProjections(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,gas", [(1, 1), (2, 1), (3, 1), (3, 4)])
    @pytest.mark.parametrize("name", ["gpt2", "qwen3_moe"])
    def test_each_part_its_own_matrix(self, name, stage, gas):
        weights, splits = _train(name, stage, gas, self.world_size)
        assert len(splits) == 2, splits
        separate, fused = _reference(name, splits), _reference(name)
        difference, from_fused = relative_difference(separate, weights), relative_difference(fused, weights)
        if dist.get_rank() == 0:
            print(
                f"MEASURED {name} ZeRO-{stage} gas {gas}: {difference:.3e} from per-part Muon, {from_fused:.3e} from "
                "the fused update")
        assert difference <= FLOOR, difference
        assert from_fused > 1e3 * FLOOR, from_fused

    @pytest.mark.parametrize("stage", [1, 3])
    def test_off_is_the_fused_update(self, stage):
        weights, _ = _train("gpt2", stage, 1, self.world_size, split_fused_muon=False)
        difference = relative_difference(_reference("gpt2"), weights)
        assert difference <= FLOOR, difference

    def test_bad_user_split_refused(self):
        model = MODELS["gpt2"]()
        setattr(model.transformer.h[0].attn.c_attn.weight, SPLIT_ATTR, (-1, (32, 32)))
        with pytest.raises(ValueError, match=r"muon_split of transformer\.h\.0\.attn\.c_attn\.weight: sizes"):
            _initialize(model, 1, 1, self.world_size)

    def test_bad_value_refused(self):
        with pytest.raises(ValueError, match="split_fused_muon: 'yes'"):
            _train("gpt2", 1, 1, self.world_size, split_fused_muon="yes")
