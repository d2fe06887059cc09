# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's momentum: its optimizer-state key, a parameter group's settings, and the elementwise step.

Upstream ``deepspeed.runtime.zero.muon.original_muon.muon_update`` (Keller Jordan et al., 2024,
"Muon: An optimizer for hidden layers in neural networks",
https://kellerjordan.github.io/posts/muon/) is an elementwise momentum step followed by
Newton-Schulz on the whole matrix. The elementwise step gives the same result on any slice of a
matrix as on the whole, so every ZeRO stage runs it where the gradient is (a ZeRO-3 partition,
a ZeRO-1/2 partition under optimizer offload, or the whole matrix), and the momentum never
travels. ``newton_schulz`` holds the other half.

The step assumes a finite gradient: a step whose gradients are not finite never reaches it
(ZeRO-3 skips such a step before the sub-group loop, as it skips an overflow; ZeRO-1/2 agree one
flag per group, ``zero12_update``), so no per-matrix flag travels.
"""

from dataclasses import dataclass

import torch

MOMENTUM_KEY = "momentum_buffer"
"""Optimizer-state key of the Muon momentum, as upstream ``MuonWithAuxAdam`` stores it (checkpoints keep it)."""


@dataclass(frozen=True)
class MuonSettings:
    """A Muon parameter group's settings, with upstream ``muon_update``'s defaults.

    Attributes:
        momentum: beta of the momentum (the group's ``momentum``; required).
        nesterov: Nesterov blend of gradient and momentum (default True).
        ns_method: Newton-Schulz kernel, "gram", "standard" or "polar_express" (default "gram").
        ns_steps: Newton-Schulz iterations (default 5).
    """
    momentum: float
    nesterov: bool
    ns_method: str
    ns_steps: int

    @classmethod
    def of(cls, param_group: dict) -> "MuonSettings":
        """Raises: KeyError: the group has no ``momentum``."""
        return cls(momentum=param_group["momentum"],
                   nesterov=param_group.get("nesterov", True),
                   ns_method=param_group.get("ns_method", "gram"),
                   ns_steps=param_group.get("ns_steps", 5))


def momentum_step(grad: torch.Tensor, momentum: torch.Tensor, settings: MuonSettings, out: torch.Tensor) -> None:
    """Advance the momentum in place and write the Newton-Schulz input into ``out``.

    Upstream ``muon_momentum_step_`` on a finite gradient, bit for bit: ``momentum.lerp_(grad,
    1 - beta)``, then the Nesterov blend ``grad.lerp(momentum, beta)`` (or the momentum itself).
    ``out`` may be ``grad`` (in place, what upstream leaves in the gradient) or a send buffer, in
    which case the gradient is left as it is.

    Args:
        grad: gradient slice (any shape, fp32), unscaled and clipped.
        momentum: the momentum of the same slice, same shape, fp32; advanced in place.
        settings: the parameter group's ``MuonSettings`` (``momentum``, ``nesterov``).
        out: receives the NS input: same number of elements, on the same device as ``grad``.
    """
    momentum.lerp_(grad, 1 - settings.momentum)
    out = out.view(grad.shape)
    if settings.nesterov:
        torch.lerp(grad, momentum, settings.momentum, out=out)
    else:
        out.copy_(momentum)
