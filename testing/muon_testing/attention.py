# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The attention logits of ``causal_lm``'s models from their weights alone (projections, norms, rotary embedding,
causal mask; no attention function called), and QK-clip (Kimi K2, arXiv 2507.20534) on their whole matrices: the
single-process reference of ``deepspeed.runtime.zero.muon.qk_clip``, written independently of it."""

import importlib

import torch


def _queries_keys(module, hidden, kwargs):
    """``(query, key)``, ``(batch, heads, seq, head_dim)``, as the layer computes them before attention."""
    shape = (*hidden.shape[:2], -1, module.head_dim)
    if hasattr(module, "c_attn"):  # GPT-2: query, key and value side by side in Conv1D columns
        q, k, _ = module.c_attn(hidden).split(module.split_size, dim=2)
        return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
    if hasattr(module, "qkv_proj"):  # Phi-3: query, key and value heads in rows
        q_rows, k_rows = (n * module.head_dim for n in (module.config.num_attention_heads, module.num_key_value_heads))
        q, k, _ = module.qkv_proj(hidden).split([q_rows, k_rows, k_rows], dim=-1)
    else:
        q, k = module.q_proj(hidden), module.k_proj(hidden)
    q, k = q.view(shape), k.view(shape)
    if hasattr(module, "q_norm"):
        q, k = module.q_norm(q), module.k_norm(k)
    modeling = importlib.import_module(type(module).__module__)
    return modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *kwargs["position_embeddings"])


def attention_layers(model):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]


@torch.no_grad()
def reference_max_logits(model, ids) -> dict:
    """Per attention layer, fp32 ``(heads,)``: the largest ``q . k * scaling`` over ``ids`` and causal positions."""
    maxima = {}

    def record(name, module, args, kwargs, output):
        q, k = _queries_keys(module, args[0] if args else kwargs["hidden_states"], kwargs)
        logits = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(2, 3) * module.scaling
        future = torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1)
        maxima[name] = logits.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3)).float()

    layers = attention_layers(model)
    handles = [m.register_forward_hook(lambda *a, n=n: record(n, *a), with_kwargs=True) for n, m in layers]
    try:
        model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return maxima


@torch.no_grad()
def reference_qk_clip(model, maxima: dict, tau: float) -> None:
    """``model``'s query and key weights scaled in place for ``maxima``: heads h over tau get ``gamma_h = tau / S_h``,
    ``sqrt`` on W_q and W_k rows (GPT-2: columns) and biases; grouped-query: all on W_q; ``q_norm``: the smallest."""
    tau = torch.tensor(tau, dtype=torch.float32)
    for name, module in attention_layers(model):
        gamma = torch.where(maxima[name] > tau, tau / maxima[name], torch.ones_like(maxima[name]))
        heads, width = gamma.numel(), gamma.numel() * module.head_dim
        if hasattr(module, "q_norm"):
            module.q_norm.weight.mul_(gamma.min())
        elif hasattr(module, "c_attn"):
            for lo in (0, width):
                module.c_attn.weight[:, lo:lo + width].view(-1, heads, module.head_dim).mul_(gamma.sqrt()[:, None])
                module.c_attn.bias[lo:lo + width].view(heads, -1).mul_(gamma.sqrt()[:, None])
        else:
            mha = module.k_proj.out_features == module.q_proj.out_features
            for proj in (module.q_proj, module.k_proj) if mha else (module.q_proj, ):
                for p in (proj.weight, proj.bias) if proj.bias is not None else (proj.weight, ):
                    p.view(heads, module.head_dim, -1).mul_((gamma.sqrt() if mha else gamma)[:, None, None])
