# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's momentum: its optimizer-state key, a group's settings, and the elementwise step.

Upstream ``original_muon.muon_update`` (Keller Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural
networks", https://kellerjordan.github.io/posts/muon/) is an elementwise momentum step followed by Newton-Schulz on the
whole matrix (``newton_schulz``). The elementwise step gives the same result on any piece of a matrix, so every ZeRO
stage runs it on its partition and the momentum never travels. It assumes a finite gradient: the stages skip, or the
binding holds back, a step whose gradients are not finite.
"""

from dataclasses import dataclass

import torch

MOMENTUM_KEY = "momentum_buffer"
"""Optimizer-state key of the Muon momentum, as upstream ``MuonWithAuxAdam`` stores it (checkpoints keep it,
and a universal checkpoint names its per-parameter file after it)."""


def is_muon_group(param_group) -> bool:
    """Whether a parameter group of ``MuonWithAuxAdam`` is one of its Muon groups (``use_muon``)."""
    return bool(param_group.get("use_muon", False))


def is_muon_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ``MuonWithAuxAdam`` (imported here: importing Muon compiles kernels)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return isinstance(optimizer, MuonWithAuxAdam)


@dataclass(frozen=True)
class StepSettings:
    """What a Muon group's step reads from the group: ``momentum`` (beta, required), ``nesterov`` (True),
    ``ns_method`` ("gram") and ``ns_steps`` (5), with upstream ``muon_update``'s defaults (the keys' checks:
    ``config.MuonSettings``)."""
    momentum: float
    nesterov: bool
    ns_method: str
    ns_steps: int

    @classmethod
    def of(cls, param_group: dict) -> "StepSettings":
        """Raises: KeyError: the group has no ``momentum``."""
        return cls(momentum=param_group["momentum"],
                   nesterov=param_group.get("nesterov", True),
                   ns_method=param_group.get("ns_method", "gram"),
                   ns_steps=param_group.get("ns_steps", 5))


def momentum_step(grad: torch.Tensor, momentum: torch.Tensor, settings: StepSettings, out: torch.Tensor) -> None:
    """Upstream ``muon_momentum_step_`` on a finite gradient, bit for bit: ``momentum.lerp_(grad, 1 - beta)`` in place,
    then the Nesterov blend ``grad.lerp(momentum, beta)`` (or the momentum) into ``out`` (``grad`` itself, or a send
    buffer of as many elements on ``grad``'s device). ``grad``, ``momentum``: fp32, one shape (a rank's piece of a
    matrix), the gradient unscaled and clipped."""
    momentum.lerp_(grad, 1 - settings.momentum)
    out = out.view(grad.shape)
    if settings.nesterov:
        torch.lerp(grad, momentum, settings.momentum, out=out)
    else:
        out.copy_(momentum)
