# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""QK-clip's knowledge of Hugging Face attention: which layers of a ``transformers`` model it clips, and their logits.

``find_attention`` describes each attention layer (``describe_attention``) or takes the description
``qk_clip.mark_attention`` attached; ``install_recorders`` wraps transformers' ``"sdpa"`` and
``eager_attention_forward`` so each clipped layer reports its per-head maximum logit of every micro-step.
"""

import copy
import importlib
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.qk_clip import (LAYER_MIN, MARK_ATTR, WHERE, AttentionHeads, HeadSpan, is_recorded,
                                                 qk_spans, record_max_logits)

RECORDED_IMPLEMENTATIONS = ("eager", "sdpa")
_QUERY_CHUNK_ELEMENTS = 1 << 24  # logits computed at once by max_logits, to bound its transient memory


def max_logits(query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float,
               is_causal: bool) -> torch.Tensor:
    """fp32 ``(heads,)``: per head the max of ``query @ key^T * scaling`` (``(batch, heads, q_len, d)`` by ``(batch,
    kv_heads, k_len, d)``, query head h on key head ``h // (heads / kv_heads)``) where ``attention_mask`` (additive
    float or boolean, broadcastable to ``(batch, heads, q_len, k_len)``) lets through, or with None and ``is_causal``,
    keys up to ``i + k_len - q_len``; ``-inf`` where a head sees nothing. ``query``'s dtype (fp16 upcast to fp32),
    chunks of about 2^24 logits, no gradient."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    key_t = key.detach().transpose(2, 3)
    chunk = max(1, _QUERY_CHUNK_ELEMENTS // max(1, batch * heads * k_len))
    best = torch.full((heads, ), float("-inf"), dtype=torch.float32, device=query.device)
    with torch.no_grad():
        for lo in range(0, q_len, chunk):
            hi = min(q_len, lo + chunk)
            q = query.detach()[:, :, lo:hi].reshape(batch, kv_heads, group * (hi - lo), head_dim)
            if q.dtype == torch.float16:  # its logits overflow where fp32's and bf16's do not
                q, key_t = q.float(), key_t.float()
            logits = torch.matmul(q, key_t).reshape(batch, heads, hi - lo, k_len) * scaling
            if attention_mask is not None:
                mask = attention_mask[...,
                                      lo:hi, :k_len] if attention_mask.shape[-2] > 1 else attention_mask[..., :k_len]
                if mask.dtype == torch.bool:
                    logits = logits.masked_fill(~mask, float("-inf"))
                else:
                    logits = logits + mask
                    logits = logits.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))
            elif is_causal and q_len > 1:
                rows = torch.arange(lo, hi, device=query.device)[:, None] + (k_len - q_len)
                logits = logits.masked_fill(torch.arange(k_len, device=query.device)[None, :] > rows, float("-inf"))
            best = torch.maximum(best, logits.amax(dim=(0, 2, 3)).float())
    return best


def _recording(attention, sdpa: bool):
    """``attention`` (transformers' signature) wrapped to record the logits of the layers being clipped."""
    if getattr(attention, "_muon_qk_clip", False):
        return attention

    def recorded(module, query, key, value, attention_mask, *args, **kwargs):
        if is_recorded(module) and module.training and not hasattr(module, MARK_ATTR):
            changed = [k for k in ("position_bias", "softcap") if kwargs.get(k) is not None]
            if args or changed:
                raise ValueError(f"{WHERE}: {type(module).__name__} passes {changed or 'positional arguments'} to "
                                 "its attention, which QK-clip's recorded logits do not include.")
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = query.shape[-1]**-0.5
            # eager attends where its mask says, everywhere without one; sdpa is causal without a mask
            is_causal = kwargs.get("is_causal")
            is_causal = sdpa and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
            record_max_logits(module, max_logits(query, key, attention_mask, scaling, is_causal))
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    recorded._muon_qk_clip, recorded.__wrapped__ = True, attention
    return recorded


def install_recorders(modules: Sequence[torch.nn.Module]) -> None:
    """Wrap (once) transformers' ``"sdpa"`` and the ``eager_attention_forward`` of each of ``modules``' files."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    AttentionInterface.register("sdpa", _recording(ALL_ATTENTION_FUNCTIONS["sdpa"], sdpa=True))
    for module in modules:
        modeling = importlib.import_module(type(module).__module__)
        if hasattr(modeling, "eager_attention_forward"):
            modeling.eager_attention_forward = _recording(modeling.eager_attention_forward, sdpa=False)


def describe_attention(module: torch.nn.Module) -> Optional[AttentionHeads]:
    """``AttentionHeads`` of a Hugging Face self-attention layer with ``head_dim``: ``q_proj``/``k_proj`` (Llama,
    Mistral, Qwen2/3 and most decoders; ``q_norm`` if any), Phi-3's ``qkv_proj``, GPT-2's ``c_attn``; else None."""
    from transformers.pytorch_utils import Conv1D
    head_dim, config = getattr(module, "head_dim", None), getattr(module, "config", None)
    if not isinstance(head_dim, int) or head_dim < 1 or getattr(module, "is_cross_attention", False):
        return None
    q, k, qkv, c_attn = (getattr(module, name, None) for name in ("q_proj", "k_proj", "qkv_proj", "c_attn"))
    q, k, qkv = (m if isinstance(m, torch.nn.Linear) else None for m in (q, k, qkv))
    if q is not None and k is not None:
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if not isinstance(heads, int) or heads % kv_heads or (q.out_features, k.out_features) != (heads * head_dim,
                                                                                                  kv_heads * head_dim):
            return None  # e.g. a gated query (Qwen3-Next) or heads the config does not give
        norm = getattr(module, "q_norm", None)
        if norm is None and getattr(module, "k_norm", None) is None:
            return AttentionHeads(heads, qk_spans(q.weight, k.weight, heads, kv_heads, head_dim, q.bias, k.bias))
        if norm is not None and _scales_with_weight(norm, head_dim):
            return AttentionHeads(heads, (HeadSpan(norm.weight, 0, 0, head_dim, LAYER_MIN), ))
    elif qkv is not None and config is not None:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if qkv.out_features == (heads + 2 * kv_heads) * head_dim:
            spans = qk_spans(qkv.weight, qkv.weight, heads, kv_heads, head_dim, qkv.bias, qkv.bias, 0,
                             (0, heads * head_dim))
            return AttentionHeads(heads, spans)
    elif isinstance(c_attn, Conv1D) and c_attn.nf == 3 * getattr(module, "num_heads", 0) * head_dim:
        heads, width = module.num_heads, module.num_heads * head_dim
        spans = qk_spans(c_attn.weight, c_attn.weight, heads, heads, head_dim, c_attn.bias, c_attn.bias, 1, (0, width))
        return AttentionHeads(heads, spans)
    return None


def _scales_with_weight(norm, size: int) -> bool:
    """Whether scaling ``norm``'s sole ``weight`` (of ``size``) scales its output (RMSNorm; not Gemma's ``x * (1 +
    weight)``, not with a bias). Probed on a copy, forward called without hooks (ZeRO-3's would gather)."""
    weight = dict(norm.named_parameters()).get("weight")
    if [n for n, _ in norm.named_parameters()] != ["weight"] or getattr(weight, "ds_numel", weight.numel()) != size:
        return False
    probe, gen = copy.copy(norm), torch.Generator().manual_seed(0)
    x, w = torch.randn(2, size, generator=gen), torch.rand(size, generator=gen) + 0.5
    outputs = []
    for scale in (1.0, 2.0):
        probe._parameters = {"weight": torch.nn.Parameter(w * scale, requires_grad=False)}
        with torch.no_grad():
            outputs.append(type(norm).forward(probe, x).float())
    return torch.allclose(outputs[1], 2 * outputs[0], rtol=1e-5, atol=0)


def _looks_like_attention(module) -> bool:
    """Named like attention with no attention inside (BERT's ``BertAttention`` holds the layer)."""
    return type(module).__name__.endswith("Attention") and not any(
        type(m).__name__.endswith("Attention") for _, m in module.named_modules() if m is not module)


def find_attention(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, AttentionHeads]]:
    """``(name, module, heads)`` of every attention layer of ``model``: marked or of a known layout.

    Raises:
        ValueError: a module named like attention in no known layout or not on eager/sdpa; or no attention layer.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    found, problems = [], []
    for name, module in model.named_modules():
        heads, what = getattr(module, MARK_ATTR, None), f"{name} ({type(module).__name__})"
        if heads is None:
            if not _looks_like_attention(module):
                continue
            heads, config = describe_attention(module), getattr(module, "config", None)
            implementation = getattr(config, "_attn_implementation", None)
            if heads is None:
                problems.append(f"{what}: its query and key projections are not in a layout QK-clip knows "
                                "(q_proj/k_proj with heads from the config and an RMSNorm q_norm if any, qkv_proj, "
                                "GPT-2's c_attn; self-attention); freeze it, or describe it with "
                                "deepspeed.runtime.zero.muon.qk_clip.mark_attention and report its logits with "
                                "record_max_logits.")
                continue
            bypass = {
                "attention implementation " + repr(implementation):
                implementation not in RECORDED_IMPLEMENTATIONS,
                "eager attention without eager_attention_forward":
                implementation == "eager"
                and not hasattr(importlib.import_module(type(module).__module__), "eager_attention_forward"),
                "reorder_and_upcast_attn":
                implementation == "eager" and getattr(module, "reorder_and_upcast_attn", 0),
                "attn_logit_softcapping":
                getattr(config, "attn_logit_softcapping", None) is not None,
                "a local sdpa override (Ulysses)":
                "sdpa" in getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {}),
            }
            if any(bypass.values()):
                problems.append(
                    f"{what} runs {', '.join(k for k, v in bypass.items() if v)}, whose logits QK-clip "
                    "does not record; load the model with attn_implementation 'eager' or 'sdpa' (a model of your own: "
                    "mark_attention).")
                continue
        trainable = {p.requires_grad for span in heads.spans for p in (span.param, )}
        if trainable == {True}:
            found.append((name, module, heads))
        elif trainable != {False}:  # a frozen layer is left as it is
            problems.append(f"{what}: some of the weights QK-clip scales are frozen and some are not.")
    if not found and not problems:
        problems.append("the model has no attention layer QK-clip knows; describe yours with mark_attention.")
    if problems:
        raise ValueError(f"{WHERE}: QK-clip cannot clip every attention layer:\n" + "\n".join(f"- {p}"
                                                                                              for p in problems))
    return found
