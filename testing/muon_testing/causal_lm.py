# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Small Hugging Face causal LMs (Llama, GPT-2, Qwen3-MoE, Phi-3), their token batches and single-process reference.

For runs under tensor parallelism (AutoTP; ``expected_shard`` cuts the reference's whole matrix as AutoTP cut a rank's)
and with fused projections (``train_causal_lm_reference`` updates them part by part where asked).
"""

import functools

import torch

from muon_testing.models import HYPER, is_muon_param
from muon_testing.reference import fp32_newton_schulz, muon_settings, reference_muon_update, train_steps

VOCAB, SEQUENCE, SAMPLES = 96, 16, 8
"""Vocabulary, tokens per sample and samples per optimizer step."""


def tiny_llama(seed: int = 0,
               hidden: int = 64,
               intermediate: int = 96,
               layers: int = 2,
               heads: int = 4,
               kv_heads: int = 2):
    """A ``LlamaForCausalLM`` (default: 2 layers of width 64, MLP width 96, 4 query heads over 2 key-value heads:
    grouped-query attention), eager attention (identical on every rank and in the reference)."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB,
                                      hidden_size=hidden,
                                      intermediate_size=intermediate,
                                      num_hidden_layers=layers,
                                      num_attention_heads=heads,
                                      num_key_value_heads=kv_heads,
                                      max_position_embeddings=SEQUENCE,
                                      attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def token_batch(step: int) -> torch.Tensor:
    """The ``(SAMPLES, SEQUENCE)`` token ids of optimizer step ``step`` (labels are the inputs)."""
    return torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(100 + step))


def micro_batches(step: int, dp_rank: int, dp_size: int, gas: int):
    """This data-parallel rank's ``SAMPLES / dp_size`` samples of step ``step`` in ``gas`` equal micro-batches (the
    same on every rank of a tensor-parallel group)."""
    mine = token_batch(step).chunk(dp_size)[dp_rank]
    return mine.chunk(gas)


def causal_lm_loss(model, ids):
    """The model's mean next-token loss on ``ids`` (labels: the inputs)."""
    return model(input_ids=ids, labels=ids).loss


def reference_muon_update_parts(grad, momentum, beta, ns_method="gram", split=None):
    """Upstream ``muon_update`` on each part of a fused parameter (``split = (dim, sizes)``, dim -2 or -1; momentum
    parts are views) as if separate layers (3-D: per expert); the parts' updates side by side."""
    dim, sizes = split
    parts = zip(grad.split(list(sizes), dim=dim), momentum.split(list(sizes), dim=dim))
    return torch.cat(
        [reference_muon_update(g.clone(), m, beta, ns_method, is_expert_group=g.ndim == 3) for g, m in parts], dim=dim)


def train_model_reference(model,
                          loss_of,
                          steps: int,
                          clip: float = 0.0,
                          hyper=HYPER,
                          heads=None,
                          splits=None,
                          muon_names=None,
                          after_step=None):
    """The single-process reference for any ``model``, trained in place, Newton-Schulz in fp32: Muon on ``muon_names``
    (default: ``is_muon_param``'s) with the config's settings; ``heads``: name -> ``muon_num_heads``; ``splits``: name
    -> ``(dim, sizes)`` of a fused parameter; ``loss_of(step)``: the step's loss; ``after_step(step)``: called after
    each step. Returns the pre-clip global gradient norm of every step."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if muon_names is None:
        muon_names = {n for n, p in named if is_muon_param(n, p)}
    settings = muon_settings(model, None, hyper, is_muon=lambda n, p: n in muon_names)
    muon = [(n, p) for n, p in named if n in muon_names]
    other = [(n, p) for n, p in named if n not in muon_names]
    with fp32_newton_schulz():
        updates = {
            n: functools.partial(reference_muon_update_parts, split=split)
            for n, split in (splits or {}).items()
        }
        return train_steps(model, named, settings, muon, other, heads or {}, steps, clip, loss_of, updates, after_step)


def expected_shard(param, whole: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The part of ``whole`` that ``param`` (a rank's parameter after AutoTP) holds: ``whole`` itself unless AutoTP
    split it, else cut through the map AutoTP recorded on it."""
    from deepspeed.checkpoint.affine import ParamAffineMap
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    meta = getattr(param, DS_AUTOTP_UC_META, None)
    described = meta and meta.get("conversion", {}).get("affine_map")
    if not described or meta["conversion"].get("replicated"):
        return whole
    amap = ParamAffineMap.from_dict(described)
    shard = torch.empty(amap.shard_shapes[tp_rank], dtype=whole.dtype)
    for piece in amap.pieces_by_rank[tp_rank]:
        piece.dest_view(shard).copy_(piece.source_view(whole.contiguous()))
    return shard


def tiny_gpt2(seed: int = 0):
    """A 2-layer ``GPT2LMHeadModel`` of width 32 with 4 heads: each ``c_attn`` a ``Conv1D`` of shape (32, 96),
    query, key and value side by side in its columns."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB,
                                     n_positions=SEQUENCE,
                                     n_embd=32,
                                     n_layer=2,
                                     n_head=4,
                                     resid_pdrop=0.0,
                                     embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def tiny_qwen3_moe(seed: int = 0):
    """A 2-layer ``Qwen3MoeForCausalLM`` of width 32, 4 experts (2 per token) of width 16: each layer's experts
    hold gate and up as one ``gate_up_proj`` of shape (4, 32, 32), transformers 5's layout."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB,
                                         hidden_size=32,
                                         intermediate_size=64,
                                         moe_intermediate_size=16,
                                         num_experts=4,
                                         num_experts_per_tok=2,
                                         num_hidden_layers=2,
                                         num_attention_heads=4,
                                         num_key_value_heads=2,
                                         head_dim=8,
                                         max_position_embeddings=SEQUENCE,
                                         attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(config)


def tiny_phi3(seed: int = 0):
    """A 1-layer ``Phi3ForCausalLM`` of width 32: ``qkv_proj`` of 4 query heads and 2 key-value heads of 8 (shape
    (64, 32)), ``gate_up_proj`` of shape (2 x 48, 32)."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.Phi3Config(vocab_size=VOCAB,
                                     hidden_size=32,
                                     intermediate_size=48,
                                     num_hidden_layers=1,
                                     num_attention_heads=4,
                                     num_key_value_heads=2,
                                     max_position_embeddings=SEQUENCE,
                                     pad_token_id=0,
                                     attn_implementation="eager")
    return transformers.Phi3ForCausalLM(config)


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen3_moe": tiny_qwen3_moe, "phi3": tiny_phi3}


def train_causal_lm_reference(name: str,
                              steps: int,
                              clip: float = 0.0,
                              hyper=HYPER,
                              heads=None,
                              splits=None,
                              muon_names=None):
    """``MODELS[name]`` trained by ``train_model_reference`` on every step's whole batch; returns the model."""
    model = MODELS[name]()
    train_model_reference(model, lambda step: causal_lm_loss(model, token_batch(step)), steps, clip, hyper, heads,
                          splits, muon_names)
    return model
