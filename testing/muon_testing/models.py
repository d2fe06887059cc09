# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The test models, the samples of every optimizer step, the loss and the parameter groups.

Each model is small and covers a case Muon or ZeRO-3 must handle (padding, shapes, routing, frozen layers, heads,
expert and conv weights). ``step_batch`` gives a step the same samples whatever
the world size and gradient accumulation, so runs that cut them differently must end equal (``FLOOR``).
"""

import types
from typing import Optional

import torch

TOTAL_SAMPLES = 16
"""Samples per optimizer step."""

HYPER = dict(muon_lr=0.02, adam_lr=0.003, momentum=0.95, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)
"""Hyper-parameters of the runs and of the reference (``ds_config``'s optimizer block)."""


class MixedMLP(torch.nn.Module):
    """Muon matrices 33x21, 17x33, 7x17 (odd numels; 1427 parameters in all, divisible by none of W = 2, 3, 4); AdamW:
    two biases and a LayerNorm. Input (N, 21) fp32, output (N, 7)."""
    in_dim, out_dim = 21, 7

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(21, 33)
        self.fc2 = torch.nn.Linear(33, 17, bias=False)
        self.fc3 = torch.nn.Linear(17, 7)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x):
        return self.norm(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


class CrossShapes(torch.nn.Module):
    """Two bias-free Linear layers with weights 48x64 and 64x48, the shapes that crash stock DeepSpeed 0.19.7's
    reduce-path Muon at W=2. Input (N, 64), output (N, 64)."""
    in_dim, out_dim = 64, 64

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 48, bias=False)
        self.b = torch.nn.Linear(48, 64, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Routed(torch.nn.Module):
    """A branch (``extra``: a 9x21 Muon matrix and a bias) only samples with a positive first feature use, so some
    steps and micro-steps give it no gradient. By ``ROUTES``: the last 4 samples in step 0 (at gas=4 none in the first
    micro-steps), none in step 1, all in step 2, the first 4 in step 3. Input (N, 21), output (N, 9)."""
    in_dim, out_dim = 21, 9
    ROUTES = {0: range(12, 16), 1: range(0), 2: range(16), 3: range(0, 4)}

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(21, 9)
        self.extra = torch.nn.Linear(21, 9)

    def forward(self, x):
        out = self.fc(x)
        routed = x[:, 0] > 0
        if bool(routed.any()):
            out = out + torch.where(routed[:, None], self.extra(x), torch.zeros_like(out))
        return out


class Shapes(torch.nn.Module):
    """The tensor shapes Muon dispatches on: a 3-D expert weight (``is_expert_group``: NS per expert), a 4-D
    convolution weight (flattened), and a 1x3 matrix with fewer elements than ranks. Input (N, 12), output (N, 6)."""
    in_dim, out_dim = 12, 6

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.Parameter(torch.randn(3, 5, 12) * 0.3)  # (expert, out, in)
        self.experts.is_expert_group = True
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=(2, 3), bias=False)  # weight (4, 3, 2, 3)
        self.tiny = torch.nn.Linear(3, 1, bias=False)  # weight (1, 3)
        self.head = torch.nn.Linear(16 + 1, 6)

    def forward(self, x):
        mixed = torch.einsum("eoi,ni->neo", self.experts, x).mean(1)  # (N, 5)
        image = torch.tanh(x.view(-1, 3, 2, 2).repeat(1, 1, 2, 2))  # (N, 3, 4, 4)
        features = self.conv(image).mean(dim=(2, 3))  # (N, 4)
        tiny = self.tiny(x[:, :3])  # (N, 1)
        hidden = torch.cat([torch.tanh(mixed), features, torch.tanh(x[:, 3:10]), tiny], dim=1)  # (N, 17)
        return self.head(hidden)


class Frozen(MixedMLP):
    """MixedMLP with its first layer frozen (``requires_grad=False``): no optimizer state, no update."""

    def __init__(self):
        super().__init__()
        self.fc1.requires_grad_(False)


class Heads(torch.nn.Module):
    """Attention-style projections that ``per_head_muon`` splits into heads: ``attn.q_proj`` (24x24, 4 heads of 6 rows)
    and ``attn.k_proj`` (12x24, 2 key/value heads), found through a Hugging Face style ``config``; ``attn.o_proj`` and
    ``out`` stay whole. Input (N, 24), output (N, 5)."""
    in_dim, out_dim = 24, 5
    MUON_HEADS = {"attn.q_proj.weight": 4, "attn.k_proj.weight": 2}

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=24, head_dim=6)
        self.attn = torch.nn.Module()
        self.attn.q_proj = torch.nn.Linear(24, 24, bias=False)
        self.attn.k_proj = torch.nn.Linear(24, 12, bias=False)
        self.attn.o_proj = torch.nn.Linear(24, 24, bias=False)
        self.out = torch.nn.Linear(24, 5)

    def forward(self, x):
        q = self.attn.q_proj(x)
        k = self.attn.k_proj(x).repeat(1, 2)
        return self.out(self.attn.o_proj(torch.tanh(q) * torch.tanh(k)))


MODELS = dict(mixed=MixedMLP, cross=CrossShapes, routed=Routed, shapes=Shapes, frozen=Frozen, heads=Heads)


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A fresh model with weights fixed by ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return MODELS[name]()


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's ``param_selection`` on these models (no ``nn.Embedding``): matrices but ``embed``/``lm_head``."""
    return param.ndim >= 2 and not any(key in name.lower() for key in ("embed", "lm_head"))


def newton_schulz_problem_count(name: str, num_heads: Optional[dict] = None) -> int:
    """2-D Newton-Schulz problems per optimizer step of model ``name`` (what ``NSCounter.count`` counts): per Muon
    parameter one per matrix, per expert of an expert group, or per head of a projection in ``num_heads`` (parameter
    name -> ``muon_num_heads``, as ``Zero3MuonResult.muon_num_heads`` reports them; ``muon_ns_problem``)."""
    from deepspeed.runtime.zero.muon.newton_schulz import newton_schulz_problem
    heads = num_heads or {}
    return sum(
        newton_schulz_problem(p.shape, getattr(p, "is_expert_group", False), heads.get(n))[0]
        for n, p in build_model(name).named_parameters() if is_muon_param(n, p) and p.requires_grad)


def step_batch(name: str, step: int, target_scale: float = 1.0, samples: int = TOTAL_SAMPLES):
    """The samples of optimizer step ``step``: inputs (N, in) and targets (N, out), N = ``samples``."""
    model_cls = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(samples, model_cls.in_dim, generator=gen)
    y = torch.randn(samples, model_cls.out_dim, generator=gen) * target_scale
    routes = getattr(model_cls, "ROUTES", None)
    if routes is not None:
        x[:, 0] = -1.0
        x[list(routes[step % len(routes)]), 0] = 1.0
    return x, y


def loss_fn(out, target):
    """Every test model's loss: mean squared error (both (N, out) fp32: a model's output is cast first)."""
    return torch.nn.functional.mse_loss(out, target)


def _fc1_apart(**fc1_settings):
    """MixedMLP's first layer in a group of its own, with ``fc1_settings``; the rest takes the config's settings."""
    return lambda model: [
        dict(params=list(model.fc1.parameters()), **fc1_settings),
        dict(params=[p for n, p in model.named_parameters() if not n.startswith("fc1.")]),
    ]


GROUPINGS = {
    "two_muon_groups": _fc1_apart(momentum=0.8, lr=0.01, weight_decay=0.0),  # its own momentum, lr, weight decay
    "standard_first": _fc1_apart(ns_method="standard"),  # the "standard" Newton-Schulz kernel, the rest "gram"
    "polar_express_first": _fc1_apart(ns_method="polar_express"),  # Polar Express, the rest "gram"
}


def param_groups(model, grouping=None):
    """``model_parameters`` for ``deepspeed.initialize``: all parameters, or GROUPINGS[grouping]."""
    if grouping is None:
        return list(model.parameters())
    return GROUPINGS[grouping](model)
