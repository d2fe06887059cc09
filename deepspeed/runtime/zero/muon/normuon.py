# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""NorMuon: Muon with a per-neuron second moment, run on each matrix's owner rank.

NorMuon (Zichong Li, Liming Liu, Chen Liang, Weizhu Chen, Tuo Zhao, 2025, "NorMuon: Making Muon more efficient and
scalable", arXiv:2510.05491, Algorithm 1) normalizes each output row of the orthogonalized update by its second
moment. The owner rank holds the whole Newton-Schulz result, so the statistic is exact and needs no communication.

Selected per Muon group (or in ``optimizer.params``) by ``"variant": "normuon"``, with ``normuon_beta2`` and
``normuon_eps``, prefixed because ``optimizer.params`` is shared with the auxiliary Adam, whose ``betas`` / ``eps``
mean something else. Importing this module (the package does) registers the variant with ``owner_state``.
"""

import math
from dataclasses import dataclass
from typing import Any, List, Mapping, Tuple

import torch

from deepspeed.runtime.zero.muon.owner_state import register_variant

NORMUON = "normuon"
"""NorMuon's value of ``owner_state.VARIANT_KEY``."""
BETA2_KEY = "normuon_beta2"
"""NorMuon's second-moment decay (the paper's beta_2), default ``NORMUON_BETA2``."""
EPS_KEY = "normuon_eps"
"""NorMuon's epsilon in ``O / (sqrt(v) + eps)``, default ``NORMUON_EPS``."""
NORMUON_BETA2 = 0.95
"""The paper's and microsoft/dion's default beta_2."""
NORMUON_EPS = 1e-8
"""microsoft/dion's epsilon of the normalization (the authors' ``normuon.py`` uses 1e-10)."""
NORMUON_STATE_KEY = "normuon_second_moment"
"""Optimizer-state key (and universal-checkpoint file name) of NorMuon's state in checkpoints."""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class NorMuon:
    """NorMuon's rule on the owner: per-row second moment, row normalization, norm kept.

    For one Newton-Schulz problem ``O`` of ``rows x cols`` (``MatrixSpec.ns_problem``: a matrix, a head under
    ``per_head_muon``, an expert, a conv filter as ``out x in*kh*kw``), with ``v`` its ``rows`` state (zero at start):

        v    <- beta2 * v + (1 - beta2) * mean_cols(O * O)       (Algorithm 1, line "v_t")
        O^   =  O / (sqrt(v) + eps)                              (row-wise, "O^_t")
        U    =  O^ * ||O||_F / ||O^||_F

    ``O`` is ``muon_orthogonalize``'s output: Newton-Schulz of the Nesterov blend of gradient and momentum (Nesterov
    fixed on), times upstream's aspect-ratio scale ``s = sqrt(max(1, rows/cols))``. Implementations differ in the last
    line. The paper steps by ``0.2 * lr * sqrt(m n) / ||O^||_F`` (Adam's update RMS, for an Adam-tuned rate); the
    authors' released ``normuon.py`` (github.com/zichongli5/NorMuon) and microsoft/dion's ``dion/normuon.py`` rescale
    ``O^`` to the Newton-Schulz output's Frobenius norm, then apply their Muon rate scale. This module does the
    latter, so the update keeps the norm of DeepSpeed's Muon update and ``muon_lr`` (default 0.02) its meaning: the
    variant redistributes each update over its rows, it does not resize it. As ``O`` already holds ``s``, ``v`` is
    ``s^2`` times the authors' (who scale after normalizing) and the result equals theirs with ``eps / s`` for
    ``eps``; the rescale is per problem (head, expert), as dion's per-block rescale.

    Attributes:
        beta2 / eps: ``normuon_beta2`` in [0, 1) / ``normuon_eps`` > 0.
    """
    beta2: float = NORMUON_BETA2
    eps: float = NORMUON_EPS
    name = NORMUON
    state_key = NORMUON_STATE_KEY
    defaults = {BETA2_KEY: NORMUON_BETA2, EPS_KEY: NORMUON_EPS}

    @staticmethod
    def key_problems(settings: Mapping[str, Any], where: str) -> List[str]:
        """Problems with ``normuon_beta2`` / ``normuon_eps`` in ``settings`` (a config block or group: ``where``)."""
        problems = []
        if BETA2_KEY in settings:
            beta2 = settings[BETA2_KEY]
            if not _number(beta2) or not 0.0 <= beta2 < 1.0:
                problems.append(f"{where}.{BETA2_KEY}: {beta2!r}; NorMuon's second-moment decay must be a number "
                                "in [0, 1).")
        if EPS_KEY in settings:
            eps = settings[EPS_KEY]
            if not _number(eps) or eps <= 0:
                problems.append(f"{where}.{EPS_KEY}: {eps!r}; NorMuon's epsilon must be a number > 0.")
        return problems

    @classmethod
    def from_group(cls, param_group: Mapping[str, Any]) -> "NorMuon":
        """The rule with a parameter group's settings (the defaults where it has none)."""
        return cls(beta2=float(param_group.get(BETA2_KEY, NORMUON_BETA2)),
                   eps=float(param_group.get(EPS_KEY, NORMUON_EPS)))

    @staticmethod
    def state_numel(spec) -> int:
        """``batch * rows`` of ``spec.ns_problem``: one fp32 value per row of every problem."""
        batch, rows, _ = spec.ns_problem
        return batch * rows

    @staticmethod
    def state_rows(spec) -> Tuple[int, int]:
        """``(state_numel, cols)``: each state row covers ``cols`` consecutive elements of the flattened parameter."""
        batch, rows, cols = spec.ns_problem
        return batch * rows, cols

    @torch.no_grad()
    def apply(self, update: torch.Tensor, state: torch.Tensor, spec) -> torch.Tensor:
        """Advance ``state``; return the normalized update in ``update``'s dtype and shape, computed in fp32.

        Args:
            update: the Newton-Schulz result, ``spec.shape`` (a conv filter may come flattened), any float dtype.
            state: 1-D fp32, ``state_numel(spec)`` elements, on ``update``'s device; updated in place.
            spec: the matrix's ``owner_plan.MatrixSpec``.
        """
        batch, rows, cols = spec.ns_problem
        o = update.reshape(batch, rows, cols).to(torch.float32)
        v = state.view(batch, rows)
        v.lerp_(torch.linalg.vector_norm(o, dim=-1).square_().div_(cols), 1 - self.beta2)
        normalized = o / v.sqrt().add_(self.eps).unsqueeze(-1)
        before = torch.linalg.vector_norm(o, dim=(-2, -1))
        after = torch.linalg.vector_norm(normalized, dim=(-2, -1)).clamp_min_(torch.finfo(torch.float32).tiny)
        normalized.mul_((before / after).view(batch, 1, 1))
        return normalized.reshape(update.shape).to(update.dtype)


register_variant(NorMuon)
