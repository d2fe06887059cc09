# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The single-process reference: what a PyTorch user writes by hand, upstream ``muon_update`` plus AdamW.

``train_reference``: the whole batch of a step at once, optionally ``clip_grad_norm_``, then upstream ``muon_update``
per Muon matrix (weight decay and ``-lr * update`` as ``MuonWithAuxAdam`` applies them), ``torch.optim.AdamW`` for
the rest. Newton-Schulz computes in fp32 there and in the runs compared with it (``fp32_newton_schulz``): ``FLOOR``.
"""

import contextlib
from typing import Optional

import torch

from muon_testing.models import HYPER, TOTAL_SAMPLES, build_model, is_muon_param, loss_fn, param_groups, step_batch


def device():
    """DeepSpeed's accelerator's current device (``"cpu"``, ``"cuda:<local rank>"``): references, replays and engine
    inputs go there; results come back as CPU numpy arrays."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


@contextlib.contextmanager
def fp32_newton_schulz(every_method: bool = False):
    """Newton-Schulz's "gram" kernel in fp32, the tests' premise (FLOOR), on any accelerator.

    Upstream's ``ns_compute_dtype`` runs "gram" in fp16 where the accelerator supports fp16: every GPU, and CPUs whose
    oneDNN has it (AVX512-FP16 or AMX, ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``), where reference and ZeRO-3
    then differ by 5.7e-4 (CPU, MixedMLP, 4 steps). So the accelerator reports no fp16 meanwhile (fp16 engines claim
    it back while built, ``fp16_allowed_on_cpu``). ``every_method``: no bf16 either, so "standard" and
    "polar_express" run in fp32 too; fp32 runs only (``bf16.enabled`` needs bf16 at ``deepspeed.initialize``)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    original, original_bf16 = accelerator.is_fp16_supported, accelerator.is_bf16_supported
    accelerator.is_fp16_supported = lambda: False
    if every_method:
        accelerator.is_bf16_supported = lambda: False
    try:
        yield
    finally:
        accelerator.is_fp16_supported, accelerator.is_bf16_supported = original, original_bf16


def reference_muon_update(grad, momentum, beta, ns_method="gram", is_expert_group=False, num_heads=None):
    """Upstream ``muon_update``, except for 4-D conv weights, where its final ``torch.where(finite, update, grad)``
    fails ((out, in*kh*kw) does not broadcast against (out, in, kh, kw)): there its own steps as Keller Jordan's Muon
    composes them (the same lerps, NS on the weight as (out, -1), scaled by its last two dimensions)."""
    from deepspeed.runtime.zero.muon import original_muon
    if num_heads is not None or grad.ndim != 4 or is_expert_group:
        extra = dict(num_heads=num_heads) if num_heads is not None else dict(is_expert_group=is_expert_group)
        return original_muon.muon_update(grad, momentum, beta=beta, ns_method=ns_method, **extra)
    momentum.lerp_(grad, 1 - beta)
    x = grad.lerp_(momentum, beta).view(len(grad), -1)
    kernels = dict(standard="zeropower_via_newtonschulz5", polar_express="zeropower_via_polar_express")
    kernel = getattr(original_muon, kernels.get(ns_method, "zeropower_via_gram_newtonschulz"))
    return kernel(x, steps=5) * max(1, grad.size(-2) / grad.size(-1))**0.5


def muon_settings(model, grouping, hyper, ns_method="gram", is_muon=is_muon_param):
    """Per parameter name, the Muon or AdamW settings the engine resolves (``_muon_param_groups``): the config's shared
    values and ``ns_method``, ``muon_lr`` / ``adam_lr``, then the group's own; ``is_muon(name, param)``: its half."""
    names = {id(p): n for n, p in model.named_parameters()}
    settings = {}
    for group in param_groups(model, grouping) if grouping else [dict(params=list(model.parameters()))]:
        overrides = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            name = names[id(p)]
            if is_muon(name, p):
                base = dict(lr=hyper["muon_lr"],
                            momentum=hyper["momentum"],
                            weight_decay=hyper["weight_decay"],
                            ns_method=ns_method)
            else:
                base = dict(lr=hyper["adam_lr"],
                            betas=hyper["betas"],
                            eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"])
            base.update({k: v for k, v in overrides.items() if k in base})  # the group's own, of this half's keys
            settings[name] = base
    return settings


def train_reference(*args, ns_fp32=False, **kwargs):
    """``_train_reference`` with Newton-Schulz in fp32 (``fp32_newton_schulz``; with ``ns_fp32`` for every method)."""
    with fp32_newton_schulz(every_method=ns_fp32):
        return _train_reference(*args, **kwargs)


def _train_reference(name: str,
                     steps: int,
                     clip: float = 0.0,
                     target_scale: float = 1.0,
                     hyper=HYPER,
                     grouping=None,
                     adamw_only=False,
                     per_head=False,
                     samples: int = TOTAL_SAMPLES,
                     ns_method: Optional[str] = None):
    """Single-process PyTorch + upstream ``muon_update`` training (module docstring).

    A parameter without a gradient in a step (a branch no sample used) gets a zero one, as DeepSpeed's optimizers
    treat it; a frozen one is left out. ``adamw_only``: AdamW (lr ``adam_lr``) everywhere, the reference for
    DeepSpeed's ``"AdamW"``. ``per_head``: the model's ``MUON_HEADS`` orthogonalized per head. ``ns_method``: the
    config's (None: upstream's "gram"). Returns ``(weights, norms)``: final parameters by name (numpy fp32) and the
    pre-clip global gradient norm of every step.
    """
    dev = device()
    model = build_model(name).to(dev)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    heads = getattr(model, "MUON_HEADS", {}) if per_head else {}
    settings = muon_settings(model, grouping, hyper, ns_method or "gram")
    muon = [(n, p) for n, p in named if is_muon_param(n, p) and not adamw_only]
    other = [(n, p) for n, p in named if adamw_only or not is_muon_param(n, p)]
    if adamw_only:
        settings = {
            n: dict(lr=hyper["adam_lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"])
            for n, _ in named
        }

    def loss_of(step):
        x, y = (t.to(dev) for t in step_batch(name, step, target_scale, samples))
        return loss_fn(model(x), y)

    norms = train_steps(model, named, settings, muon, other, heads, steps, clip, loss_of)
    return {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}, norms


def train_steps(model, named, settings, muon, other, heads, steps, clip, loss_of, splits=(), after_step=None) -> list:
    """``steps`` optimizer steps of ``model`` (``loss_of(step)``: the step's loss over all its samples): Muon on
    ``muon`` (``heads``: name -> ``muon_num_heads``; ``splits``: name -> a fused parameter's update, a callable of
    ``(grad, momentum, beta, ns_method)``), AdamW on ``other`` (``(name, param)`` lists; ``settings`` by name),
    optional clipping, ``after_step(step)`` after each step; returns the pre-clip global gradient norm per step."""
    adamw = torch.optim.AdamW([dict(params=[p], **settings[n]) for n, p in other]) if other else None
    momenta = {n: torch.zeros_like(p) for n, p in muon}
    norms = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss_of(step).backward()
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
                if n in splits:
                    update = splits[n](p.grad, momenta[n], s["momentum"], s["ns_method"])
                else:
                    update = reference_muon_update(p.grad.clone(), momenta[n], s["momentum"], s["ns_method"],
                                                   getattr(p, "is_expert_group", False), heads.get(n))
                p.mul_(1 - s["lr"] * s["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-s["lr"])
        if adamw is not None:
            adamw.step()
        if after_step is not None:
            after_step(step)
    return norms
