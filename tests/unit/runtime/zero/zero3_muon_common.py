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


class Routed(torch.nn.Module):
    """A branch only some samples use, so some steps (and some micro-steps) give it no gradient.

    Samples whose first input feature is positive also go through ``extra`` (a 9x21 Muon matrix
    and a bias). ``step_batch`` sets that feature so that in step 0 only the last 4 samples use
    the branch (at gas=4 it gets no gradient in the first micro-steps), in step 1 none does (no
    gradient in the whole step), in step 2 all do, in step 3 the first 4. Input (N, 21), output (N, 9).
    """
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
    """The tensor shapes Muon dispatches on: a 3-D expert weight (``is_expert_group``: NS per
    expert), a 4-D convolution weight (flattened), and a 1x3 matrix with fewer elements than
    ranks. Input (N, 12), output (N, 6)."""
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
    """Attention-style projections that ``per_head_muon`` splits into heads: ``attn.q_proj``
    (24x24, 4 heads of 6 rows) and ``attn.k_proj`` (12x24, 2 key/value heads), found through a
    Hugging Face style ``config``; ``attn.o_proj`` and ``out`` stay whole. Input (N, 24), output (N, 5)."""
    in_dim, out_dim = 24, 5
    MUON_HEADS = {"attn.q_proj.weight": 4, "attn.k_proj.weight": 2}

    def __init__(self):
        super().__init__()
        import types
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


MODELS = {
    "mixed": MixedMLP,
    "cross": CrossShapes,
    "routed": Routed,
    "shapes": Shapes,
    "frozen": Frozen,
    "heads": Heads
}


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A fresh model with weights fixed by ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return MODELS[name]()


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule (``set_optimizer_flags``): matrices, except embeddings and the LM head."""
    return param.ndim >= 2 and not any(key in name.lower() for key in ("embed", "lm_head"))


def muon_matrix_count(name: str) -> int:
    """Number of parameters of model ``name`` that DeepSpeed optimizes with Muon."""
    return sum(1 for n, p in build_model(name).named_parameters() if is_muon_param(n, p) and p.requires_grad)


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
    return torch.nn.functional.mse_loss(out, target)


def ds_config(stage: int,
              gas: int,
              world_size: int,
              clip: float = 0.0,
              zero_extra=None,
              hyper=HYPER,
              samples: int = TOTAL_SAMPLES) -> dict:
    """A DeepSpeed config for ``samples`` samples per step split over ranks and micro-steps."""
    zero = {"stage": stage}
    if stage == 3:
        # Partition every parameter, however small (the default keeps parameters under 1e5
        # elements whole on every rank). It also keeps stock 0.19.7 off its coalesced all-gather
        # of persistent parameters, which on gloo waits only for the last handle (0.19.8 fixed
        # it) and can hand the forward a parameter before it has arrived.
        zero["stage3_param_persistence_threshold"] = 0
    zero.update(zero_extra or {})
    return {
        "train_batch_size": samples,
        "train_micro_batch_size_per_gpu": samples // (world_size * gas),
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


GROUPINGS = {
    # MixedMLP's first layer in a Muon group of its own, with its own momentum, learning rate and
    # weight decay; the rest takes the config's settings.
    "two_muon_groups":
    lambda model: [
        dict(params=list(model.fc1.parameters()), momentum=0.8, lr=0.01, weight_decay=0.0),
        dict(params=[p for n, p in model.named_parameters() if not n.startswith("fc1.")]),
    ],
    # The first layer orthogonalized by the "standard" Newton-Schulz kernel, the rest by "gram".
    "standard_first":
    lambda model: [
        dict(params=list(model.fc1.parameters()), ns_method="standard"),
        dict(params=[p for n, p in model.named_parameters() if not n.startswith("fc1.")]),
    ],
}


def param_groups(model, grouping=None):
    """``model_parameters`` for ``deepspeed.initialize``: all parameters, or GROUPINGS[grouping]."""
    if grouping is None:
        return list(model.parameters())
    return GROUPINGS[grouping](model)


def _muon_settings(model, grouping, hyper):
    """Per parameter name, the Muon or AdamW settings DeepSpeed's Muon engine resolves: the
    config's shared values, ``muon_lr`` / ``adam_lr``, then the group's own (engine
    ``_muon_param_groups``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    settings = {}
    for group in param_groups(model, grouping) if grouping else [dict(params=list(model.parameters()))]:
        overrides = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            name = names[id(p)]
            if is_muon_param(name, p):
                base = dict(lr=hyper["muon_lr"], momentum=hyper["momentum"], weight_decay=hyper["weight_decay"],
                            ns_method="gram")
                keys = ("lr", "momentum", "weight_decay", "ns_method")
            else:
                base = dict(lr=hyper["adam_lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"])
                keys = ("lr", "betas", "eps", "weight_decay")
            base.update({k: v for k, v in overrides.items() if k in keys})
            settings[name] = base
    return settings


def reference_muon_update(grad, momentum, beta, ns_method="gram", is_expert_group=False, num_heads=None):
    """Upstream ``muon_update``, except for 4-D convolution weights, where it fails in its final
    ``torch.where(finite, update, grad)`` ((out, in*kh*kw) does not broadcast against
    (out, in, kh, kw)); for those its own steps are composed as Keller Jordan's Muon does them:
    the same lerps, NS on the weight flattened to (out, -1), scaled by its last two dimensions."""
    from deepspeed.runtime.zero.muon import original_muon
    if num_heads is not None:
        return original_muon.muon_update(grad, momentum, beta=beta, ns_method=ns_method, num_heads=num_heads)
    if grad.ndim != 4 or is_expert_group:
        return original_muon.muon_update(grad, momentum, beta=beta, ns_method=ns_method,
                                         is_expert_group=is_expert_group)
    momentum.lerp_(grad, 1 - beta)
    x = grad.lerp_(momentum, beta).view(len(grad), -1)
    kernel = original_muon.zeropower_via_gram_newtonschulz
    if ns_method == "standard":
        kernel = original_muon.zeropower_via_newtonschulz5
    return kernel(x, steps=5) * max(1, grad.size(-2) / grad.size(-1))**0.5


def train_reference(name: str,
                    steps: int,
                    clip: float = 0.0,
                    target_scale: float = 1.0,
                    hyper=HYPER,
                    grouping=None,
                    adamw_only=False,
                    per_head=False,
                    samples: int = TOTAL_SAMPLES):
    """Single-process PyTorch + upstream ``muon_update`` training; see the module docstring.

    A parameter without a gradient in a step (a branch no sample used) gets a zero gradient, as
    DeepSpeed's optimizers treat it; a frozen parameter is left out. With ``adamw_only`` every
    parameter uses AdamW (lr ``adam_lr``), the reference for DeepSpeed's ``"AdamW"`` optimizer.
    With ``per_head`` the model's ``MUON_HEADS`` are orthogonalized per head.

    Returns:
        ``(weights, norms)``: final parameters by name (numpy fp32) and the pre-clip global
        gradient norm of every step.
    """
    model = build_model(name)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    heads = getattr(model, "MUON_HEADS", {}) if per_head else {}
    settings = _muon_settings(model, grouping, hyper)
    muon = [(n, p) for n, p in named if is_muon_param(n, p) and not adamw_only]
    other = [(n, p) for n, p in named if adamw_only or not is_muon_param(n, p)]
    if adamw_only:
        settings = {n: dict(lr=hyper["adam_lr"], betas=hyper["betas"], eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"]) for n, _ in named}
    adamw = torch.optim.AdamW([dict(params=[p], **settings[n]) for n, p in other]) if other else None
    momenta = {n: torch.zeros_like(p) for n, p in muon}
    norms = []
    for step in range(steps):
        x, y = step_batch(name, step, target_scale, samples)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        params = [p for _, p in named]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        norms.append(float(norm))
        with torch.no_grad():
            for n, p in muon:
                s = settings[n]
                update = reference_muon_update(p.grad.clone(), momenta[n], s["momentum"], s["ns_method"],
                                               getattr(p, "is_expert_group", False), heads.get(n))
                p.mul_(1 - s["lr"] * s["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-s["lr"])
        if adamw is not None:
            adamw.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, norms


def relative_difference(a: dict, b: dict) -> float:
    """``||a - b|| / ||a||`` over all parameters (dicts of name -> array)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k].astype(np.float64))**2)) for k in a)
    den = sum(float(np.sum(a[k].astype(np.float64)**2)) for k in a)
    return (num / den)**0.5


class NSCounter:
    """Counts calls into upstream's Newton-Schulz kernels by wrapping the module attributes.

    Attributes:
        count: all calls; by_kernel: calls per kernel name.
    """
    KERNELS = ("zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5")

    def __init__(self):
        from deepspeed.runtime.zero.muon import original_muon
        self.count = 0
        self.by_kernel = dict.fromkeys(self.KERNELS, 0)
        for name in self.KERNELS:
            kernel = getattr(original_muon, name)
            kernel = getattr(kernel, "__wrapped_kernel__", kernel)

            def counted(*args, _kernel=kernel, _name=name, **kwargs):
                self.count += 1
                self.by_kernel[_name] += 1
                return _kernel(*args, **kwargs)

            counted.__wrapped_kernel__ = kernel
            setattr(original_muon, name, counted)
