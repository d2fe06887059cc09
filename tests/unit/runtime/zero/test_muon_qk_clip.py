# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""MuonClip's QK-clip (``qk_clip_threshold``) under ZeRO-1/2/3 on unchanged Hugging Face models: logits as recorded
by ``muon_testing.attention``; runs equal the whole-matrix reference (``FLOOR``); the cap is exact; far above every
logit plain Muon bit for bit; the log counts; bit-identical resumes; bad values and layouts refused by name."""

import logging

import pytest
import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.zero.muon import hf_attention, qk_clip
from deepspeed.runtime.zero.muon.config import check_muon_keys
from deepspeed.runtime.zero.muon.param_selection import select_muon_parameters, tag_fused_projections
from deepspeed.utils import logger
from unit.common import DistributedTest
from muon_testing.attention import reference_max_logits, reference_qk_clip
from muon_testing.causal_lm import MODELS, causal_lm_loss, micro_batches, token_batch, train_model_reference
from muon_testing.compare import FLOOR, gathered_weights, relative_difference
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import ds_config

transformers = pytest.importorskip("transformers")

STEPS = 2
W = 2  # ranks of the tests but the world sizes test_equals_reference names


def _clip(model):
    """A clip of ``model``'s attention at tau 1 on this process, its logits recorded (as the engine binds it)."""
    layers = hf_attention.find_attention(model)
    clip = qk_clip.QKClip(1.0, layers, None, torch.device("cpu"))
    hf_attention.install_recorders([m for _, m, _ in layers if getattr(m, qk_clip.MARK_ATTR, None) is None])
    return clip


@pytest.mark.parametrize("name,attention", [("llama", "eager"), ("llama", "sdpa"), ("gpt2", "sdpa"), ("gpt2", "eager"),
                                            ("qwen3_moe", "eager"), ("phi3", "eager")])
def test_recorded_logits_equal_reference(name, attention):
    model = MODELS[name]().train()
    model.set_attn_implementation(attention)
    clip = _clip(model)
    model(input_ids=token_batch(0))
    got = {name: clip.maxima[clip.offsets[i]:clip.offsets[i + 1]] for i, name in enumerate(clip.names)}
    want = reference_max_logits(model, token_batch(0))
    assert sorted(got) == sorted(want) and len(want) >= 1
    assert relative_difference(want, got) <= FLOOR, relative_difference(want, got)


def test_max_logits_masks_agree(monkeypatch):
    monkeypatch.setattr(hf_attention, "_QUERY_CHUNK_ELEMENTS", 40)  # two queries a chunk
    torch.manual_seed(0)
    query, key = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    additive = torch.zeros(5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    masks = ((causal[None, None], False), (additive[None, None], False), (None, True), (None, False))
    by_bool, by_float, by_flag, everywhere = (hf_attention.max_logits(query, key, m, 0.5, flag) for m, flag in masks)
    logits = (query @ key.repeat_interleave(2, dim=1).transpose(2, 3) * 0.5).masked_fill(~causal, float("-inf"))
    assert torch.equal(by_bool, by_float) and torch.equal(by_bool, by_flag) and not torch.equal(everywhere, by_bool)
    assert torch.allclose(by_bool, logits.amax(dim=(0, 2, 3)), rtol=1e-6, atol=0)
    assert torch.equal(hf_attention.max_logits(query, key, torch.ones(2, 1, 1, 5, dtype=torch.bool), 0.5, False),
                       everywhere)
    big = hf_attention.max_logits((query * 300).half(), (key * 300).half(), None, 0.5, False)  # fp16 logits overflow
    assert torch.allclose(big, everywhere * 9e4, rtol=1e-2, atol=0)


def test_layouts_and_rules():
    gpt2 = hf_attention.find_attention(MODELS["gpt2"]())
    spans = {name: [(s.dim, s.start, s.rule) for s in heads.spans] for name, _, heads in gpt2}
    assert spans["transformer.h.0.attn"] == [(1, 0, "sqrt"), (0, 0, "sqrt"), (1, 32, "sqrt"), (0, 32, "sqrt")]
    llama = hf_attention.find_attention(MODELS["llama"]())  # 4 query heads share 2 key heads: queries take gamma
    assert [
        (h.num_heads, [(s.param.shape, s.rule) for s in h.spans]) for _, _, h in llama
    ] == [(4, [(torch.Size([64, 64]), "full")])] * 2 and llama[0][2].spans[0].param is llama[0][1].q_proj.weight
    qwen = hf_attention.find_attention(MODELS["qwen3_moe"]())  # q_norm undoes a scale of W_q: its weight takes it
    assert all(h.spans[0].param is m.q_norm.weight and h.spans[0].rule == "layer_min" for _, m, h in qwen)
    phi3 = hf_attention.find_attention(MODELS["phi3"]())[0][2]
    assert [(s.param.shape, s.start, s.rule) for s in phi3.spans] == [(torch.Size([64, 32]), 0, "full")]


def test_scale_of_a_piece_across_rows():
    """A piece that starts and ends inside rows (ZeRO-1/2 boundaries) gets each element its row's scale."""
    weight = torch.nn.Parameter(torch.zeros(6, 5))
    span = qk_clip.HeadSpan(weight, 0, 2, 2, qk_clip.FULL)
    clip = qk_clip.QKClip.__new__(qk_clip.QKClip)
    clip.spans, clip.offsets, clip._lines = {id(weight): [(span, 0)]}, [0, 2], {}
    clip.gamma, clip._clipped = torch.tensor([0.5, 0.25]), [True]
    scale = clip._piece_scale(weight, 7, 17, torch.device("cpu"))
    want = torch.tensor([1, 1, .5, .5, .25, .25]).repeat_interleave(5)[7:24]  # rows 2, 3: head 0; 4, 5: head 1
    assert torch.equal(scale, want)


class TinyAttention(torch.nn.Module):
    """Named like attention, in no layout QK-clip knows."""

    def __init__(self):
        super().__init__()
        self.head_dim = 4
        self.to_qkv = torch.nn.Linear(8, 24)


def test_unknown_layout_and_implementation_refused():
    with pytest.raises(ValueError, match=r"qk_clip_threshold.*\n- 0 \(TinyAttention\).*mark_attention"):
        hf_attention.find_attention(torch.nn.Sequential(TinyAttention()))
    model = MODELS["llama"]()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError,
                       match=r"model.layers.0.self_attn \(LlamaAttention\) runs attention "
                       r"implementation 'flex_attention'"):
        hf_attention.find_attention(model)
    with pytest.raises(ValueError, match="no attention layer"):
        hf_attention.find_attention(torch.nn.Linear(2, 2))
    sizes = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    gemma = transformers.Gemma3TextConfig(vocab_size=96, num_hidden_layers=1, **sizes)
    with pytest.raises(ValueError, match=r"Gemma3Attention\): its query and key projections are not in a layout"):
        hf_attention.find_attention(transformers.Gemma3ForCausalLM(gemma))  # its q_norm: x * (1 + w), not x * w
    model = MODELS["llama"]()
    model.model.layers[0].self_attn.requires_grad_(False)  # a frozen layer is left alone
    assert [name for name, _, _ in hf_attention.find_attention(model)] == ["model.layers.1.self_attn"]


def test_marked_layer_records_its_own():
    layer = TinyAttention()
    qk_clip.mark_attention(
        layer,
        qk_clip.AttentionHeads(2, qk_clip.qk_spans(layer.to_qkv.weight, layer.to_qkv.weight, 2, 2, 4, starts=(0, 8))))
    clip = _clip(torch.nn.Sequential(layer))
    qk_clip.record_max_logits(layer, torch.tensor([3.0, 0.5]))
    qk_clip.record_max_logits(layer, torch.tensor([2.0, 0.75]))
    assert torch.equal(clip.maxima, torch.tensor([3.0, 0.75]))


def test_a_dropped_clip_frees_its_model():
    import gc
    import weakref
    model = MODELS["llama"]()
    clip, layer = _clip(model), weakref.ref(model)
    del model, clip
    gc.collect()
    assert layer() is None


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True, "100"])
def test_bad_threshold_refused(value):
    with pytest.raises(ValueError, match=r"optimizer.params.qk_clip_threshold: .*finite number > 0"):
        qk_clip.check_threshold(value)
    assert qk_clip.check_threshold(None) is None and qk_clip.check_threshold(100) == 100.0
    with pytest.raises(ValueError,
                       match=r"model_parameters\[0\].qk_clip_threshold: does nothing in a "
                       r"parameter group: a key of the whole optimizer"):
        check_muon_keys({}, [{"params": [], "qk_clip_threshold": 50.0}])
    check_muon_keys({"qk_clip_threshold": 50.0}, None)


def _threshold(name):
    """Tau between the heads' largest logits at the start (their median): some heads are clipped, some not."""
    first = torch.cat(list(reference_max_logits(MODELS[name](), token_batch(0)).values()))
    return float(first.median())


def _config(stage, gas, world_size, tau, offload=False, **params):
    offloaded = {"offload_optimizer": {"device": "cpu"}}
    config = ds_config(stage, gas, world_size, zero_extra=offloaded if offload else None)
    del config["train_batch_size"]
    config["optimizer"]["params"].update(params if tau is None else dict(params, qk_clip_threshold=tau))
    return config


def _engine(name, config, model=None):
    model = MODELS[name]() if model is None else model
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    return engine


def _train(engine, gas, world_size, steps=STEPS, first=0):
    with fp32_newton_schulz():
        for step in range(first, first + steps):
            for ids in micro_batches(step, dist.get_rank(), world_size, gas):
                engine.backward(causal_lm_loss(engine, ids))
                engine.step()


def _reference(name, tau, initial=None):
    """Single-process run from ``MODELS[name]`` or ``initial``, QK-clip at ``tau`` (None: plain Muon) after each
    step: ``(weights, each step's maxima before it)``."""
    selected = MODELS[name]()
    muon_names = set(select_muon_parameters(selected).muon)
    splits = tag_fused_projections(selected)  # fused projections orthogonalized part by part, as DeepSpeed's
    model, history = MODELS[name](), []
    if initial is not None:
        model.load_state_dict(initial)

    def loss_of(step):
        history.append(reference_max_logits(model, token_batch(step)))
        return causal_lm_loss(model, token_batch(step))

    clip = None if tau is None else lambda step: reference_qk_clip(model, history[step], tau)
    train_model_reference(model, loss_of, STEPS, splits=splits, muon_names=muon_names, after_step=clip)
    return {n: p.detach().float() for n, p in model.named_parameters()}, history


LLAMA = [(2, "llama", stage, gas, "") for stage in (1, 2, 3) for gas in (1, 4)]  # grouped-query attention
OTHERS = ((1, "llama", 3, 4), (4, "llama", 1, 1), (4, "llama", 3, 2), (2, "gpt2", 1, 1), (2, "gpt2", 3, 1),
          (2, "qwen3_moe", 2, 1))  # GPT-2: the fused c_attn; Qwen3-MoE: q_norm
EXTRAS = [(2, "llama", 2, 1, "offload"), (2, "llama", 3, 1, "offload"), (2, "llama", 3, 1, "zero.Init")]
CASES = LLAMA + [(*case, "") for case in OTHERS] + EXTRAS


class TestQKClip(DistributedTest):
    world_size = W
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size,name,stage,gas,extra", CASES)
    def test_equals_reference(self, world_size, name, stage, gas, extra):
        """Weights after ``STEPS`` steps equal the reference's, which clips some heads, not all; plain Muon's not."""
        tau = _threshold(name)
        config = _config(stage, gas, world_size, tau, extra == "offload")
        model = None
        if extra == "zero.Init":
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = MODELS[name]()
        engine = _engine(name, config, model)
        initial = gathered_weights(engine) if model is not None else None  # zero.Init initializes otherwise
        _train(engine, gas, world_size)
        weights = gathered_weights(engine)
        engine.destroy()
        (want, history), (plain, _) = _reference(name, tau, initial), _reference(name, None, initial)
        clipped = sum(int((m > tau).sum()) for step in history for m in step.values())
        heads = sum(m.numel() for step in history for m in step.values())
        difference, unclipped = relative_difference(want, weights), relative_difference(plain, weights)
        if dist.get_rank() == 0:
            print(f"MEASURED qk-clip {name} W={world_size} stage {stage} gas {gas} {extra}: tau {tau:.4g}, {clipped} "
                  f"of {heads} heads clipped; from the reference {difference:.3e}, without the clip {unclipped:.3e}")
        assert 0 < clipped < heads and difference <= FLOOR and unclipped > 100 * FLOOR

    @pytest.mark.parametrize("stage", [1, 3])
    def test_below_threshold_bit_identical(self, stage):
        """Tau above every logit: the clip never fires and the run is plain Muon's, bit for bit."""
        weights = []
        for tau in (1e9, None):
            engine = _engine("llama", _config(stage, 1, W, tau))
            _train(engine, 1, W)
            weights.append(gathered_weights(engine))
            engine.destroy()
        assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])

    @pytest.mark.parametrize("name,stage,bf16", [("llama", 1, False), ("llama", 3, False), ("llama", 2, True),
                                                 ("llama", 3, True), ("gpt2", 3, False), ("qwen3_moe", 2, False)])
    def test_logit_capped_at_threshold(self, name, stage, bf16):
        """With a zero update, one step leaves the first layer's largest logit per head at min(S, tau) (Llama, GPT-2),
        or every head's times the smallest tau / S (Qwen3-MoE's q_norm); first layer only, as clipping changes the next
        layer's inputs. bf16: tau at half the smallest logit lands every head on tau to bf16 rounding (1e-2)."""
        before = next(iter(reference_max_logits(MODELS[name](), token_batch(0)).values()))
        tau = float(before.min()) / 2 if bf16 else float(before.median())
        config = _config(stage, 1, W, tau, muon_lr=0.0, adam_lr=0.0, weight_decay=0.0)
        if bf16:
            config["bf16"] = {"enabled": True}
        engine = _engine(name, config)
        _train(engine, 1, W, steps=1)
        model = MODELS[name]()
        assert next(engine.module.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float)
        model.load_state_dict(gathered_weights(engine), strict=False)  # GPT-2's head is its embedding
        engine.destroy()
        after = next(iter(reference_max_logits(model, token_batch(0)).values()))
        assert (before > tau).any() and (bf16 or (before < tau).any())
        gamma = torch.where(before > tau, tau / before, torch.ones_like(before))
        want = before * (gamma.min() if name == "qwen3_moe" else gamma)
        assert torch.allclose(after, want, rtol=1e-2 if bf16 else FLOOR, atol=0), (after, want)

    def test_progress_log_counts_heads_clipped(self):
        tau, lines, level = _threshold("llama"), [], logger.level
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            engine = _engine("llama", {**_config(3, 1, W, tau), "steps_per_print": STEPS})
            _train(engine, 1, W)
            engine.destroy()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        _, history = _reference("llama", tau)
        clipped = sum(int((m > tau).sum()) for step in history for m in step.values())
        if dist.get_rank() == 0:
            assert any(f"QK-clip: {clipped} head-steps clipped over the last {STEPS} steps (8 heads" in line
                       for line in lines), lines

    @pytest.mark.parametrize("stage", [1, 3])
    def test_checkpoint_resumes_bit_identical(self, stage, tmpdir):
        config = _config(stage, 1, W, _threshold("llama"))
        weights = []
        for resume in (False, True):
            engine = _engine("llama", config)
            if resume:
                engine.load_checkpoint(str(tmpdir), tag="clip")
            else:
                _train(engine, 1, W)
                engine.save_checkpoint(str(tmpdir), tag="clip")
            _train(engine, 1, W, steps=1, first=STEPS)
            weights.append(gathered_weights(engine))
            engine.destroy()
        assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])

    def test_stage_zero_refused(self):
        with pytest.raises(ValueError,
                           match="optimizer.params.qk_clip_threshold: QK-clip runs at ZeRO stages 1 to "
                           "3.*zero_optimization.stage 0"):
            _engine("llama", _config(0, 1, W, 10.0))
