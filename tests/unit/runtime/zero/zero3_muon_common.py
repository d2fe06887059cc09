# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Models, data, configs and the single-process reference shared by the ZeRO-3 Muon tests.

The reference is what a PyTorch user writes by hand: one process, the whole batch of a step at
once, optionally ``torch.nn.utils.clip_grad_norm_``, then upstream ``muon_update`` per Muon
matrix (weight decay and ``-lr * update`` as ``MuonWithAuxAdam`` applies them) and
``torch.optim.AdamW`` for everything else.
"""

import numpy as np
import torch

TOTAL_SAMPLES = 16
"""Samples per optimizer step, whatever the world size and gradient accumulation."""

HYPER = dict(muon_lr=0.02, adam_lr=0.003, momentum=0.95, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)


class MixedMLP(torch.nn.Module):
    """Matrices of different shapes, none of whose sizes divides by 2, 3 or 4, plus 1-D params.

    Muon matrices: 33x21 (tall), 17x33 (wide), 7x17 (wide); AdamW: two biases and a LayerNorm.
    Input (N, 21) fp32, output (N, 7).
    """
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
    """Two bias-free Linear layers with weights 48x64 and 64x48, the shapes that crash stock
    DeepSpeed 0.19.7's reduce-path Muon at W=2. Input (N, 64), output (N, 64)."""
    in_dim, out_dim = 64, 64

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 48, bias=False)
        self.b = torch.nn.Linear(48, 64, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


MODELS = {"mixed": MixedMLP, "cross": CrossShapes}


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A fresh model with weights fixed by ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return MODELS[name]()


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule (``set_optimizer_flags``): matrices, except embeddings and the LM head."""
    return param.ndim >= 2 and not any(key in name.lower() for key in ("embed", "lm_head"))


def muon_matrix_count(name: str) -> int:
    """Number of parameters of model ``name`` that DeepSpeed optimizes with Muon."""
    return sum(1 for n, p in build_model(name).named_parameters() if is_muon_param(n, p))


def step_batch(name: str, step: int, target_scale: float = 1.0):
    """The ``TOTAL_SAMPLES`` samples of optimizer step ``step``: inputs (N, in) and targets (N, out)."""
    model_cls = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOTAL_SAMPLES, model_cls.in_dim, generator=gen)
    y = torch.randn(TOTAL_SAMPLES, model_cls.out_dim, generator=gen) * target_scale
    return x, y


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


def ds_config(stage: int, gas: int, world_size: int, clip: float = 0.0, zero_extra=None, hyper=HYPER) -> dict:
    """A DeepSpeed config for ``TOTAL_SAMPLES`` samples per step split over ranks and micro-steps."""
    zero = {"stage": stage}
    if stage == 3:
        zero["reduce_scatter"] = False
        # Partition every parameter, however small (the default keeps parameters under 1e5
        # elements whole on every rank). It also keeps stock 0.19.7 off its coalesced all-gather
        # of persistent parameters, which on gloo waits only for the last handle (0.19.8 fixed
        # it) and can hand the forward a parameter before it has arrived.
        zero["stage3_param_persistence_threshold"] = 0
    zero.update(zero_extra or {})
    return {
        "train_batch_size": TOTAL_SAMPLES,
        "train_micro_batch_size_per_gpu": TOTAL_SAMPLES // (world_size * gas),
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": hyper["muon_lr"],
                "adam_lr": hyper["adam_lr"],
                "momentum": hyper["momentum"],
                "weight_decay": hyper["weight_decay"],
                "betas": list(hyper["betas"]),
                "eps": hyper["eps"],
            },
        },
        "zero_optimization": zero,
    }


def train_reference(name: str, steps: int, clip: float = 0.0, target_scale: float = 1.0, hyper=HYPER):
    """Single-process PyTorch + upstream ``muon_update`` training; see the module docstring.

    Returns:
        ``(weights, norms)``: final parameters by name (numpy fp32) and the pre-clip global
        gradient norm of every step.
    """
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    model = build_model(name)
    named = list(model.named_parameters())
    muon = [p for n, p in named if is_muon_param(n, p)]
    other = [p for n, p in named if not is_muon_param(n, p)]
    adamw = torch.optim.AdamW(other,
                              lr=hyper["adam_lr"],
                              betas=hyper["betas"],
                              eps=hyper["eps"],
                              weight_decay=hyper["weight_decay"]) if other else None
    momenta = {p: torch.zeros_like(p) for p in muon}
    norms = []
    for step in range(steps):
        x, y = step_batch(name, step, target_scale)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        params = [p for _, p in named]
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        norms.append(float(norm))
        with torch.no_grad():
            for p in muon:
                update = muon_update(p.grad.clone(), momenta[p], beta=hyper["momentum"])
                p.mul_(1 - hyper["muon_lr"] * hyper["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-hyper["muon_lr"])
        if adamw is not None:
            adamw.step()
    return {n: p.detach().numpy().copy() for n, p in named}, norms


def relative_difference(a: dict, b: dict) -> float:
    """``||a - b|| / ||a||`` over all parameters (dicts of name -> array)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k].astype(np.float64))**2)) for k in a)
    den = sum(float(np.sum(a[k].astype(np.float64)**2)) for k in a)
    return (num / den)**0.5


class NSCounter:
    """Counts calls into upstream's Newton-Schulz kernels by wrapping the module attributes."""
    KERNELS = ("zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5")

    def __init__(self):
        from deepspeed.runtime.zero.muon import original_muon
        self.count = 0
        for name in self.KERNELS:
            kernel = getattr(original_muon, name)
            kernel = getattr(kernel, "__wrapped_kernel__", kernel)

            def counted(*args, _kernel=kernel, **kwargs):
                self.count += 1
                return _kernel(*args, **kwargs)

            counted.__wrapped_kernel__ = kernel
            setattr(original_muon, name, counted)
