# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""State a Muon variant keeps per matrix on the matrix's owner rank, and NorMuon, which uses it.

The extension point. The distributed Muon core (``pipeline.MuonPipeline``) runs Newton-Schulz once
per matrix, on its owner rank, with the whole matrix in hand. A *variant* is a rule applied there,
to each Newton-Schulz result, before the result is split back into the ranks' gradient
partitions (``BucketLayout.write_result``). It may keep per-matrix state, which lives only on the
owner, in fp32, on the Newton-Schulz device, and is updated once per optimizer step. A variant
is an object with:

- ``name``: its value of the ``variant`` key;
- ``state_key``: the optimizer-state key its state travels under in checkpoints;
- ``state_numel(spec)``: elements of state one matrix (an ``owner_plan.MatrixSpec``) needs;
- ``apply(update, state, spec)``: the rule. ``update`` is the matrix's Newton-Schulz result
  (``spec.shape``, in the kernel's dtype, scaled by upstream's aspect ratio; not modified),
  ``state`` its 1-D fp32 state of ``state_numel(spec)`` elements, advanced in place; returns the
  update to send back, ``spec.shape`` and ``update``'s dtype.

``OwnerState`` holds the state of the matrices one rank owns in one flat tensor, allocated from
the owner plan at construction. Plain Muon (no ``variant`` key, or ``"muon"``) has no variant:
nothing is allocated and the pipeline runs exactly as before (no call, no collective, the same
results bit for bit). The plan's memory budget counts the state (``owner_plan.within_budget``,
``state_numels``).

NorMuon (Zichong Li, Liming Liu, Chen Liang, Weizhu Chen, Tuo Zhao, 2025, "NorMuon: Making Muon
more efficient and scalable", arXiv:2510.05491, Algorithm 1) is the one variant here: a
per-neuron (per output row) second moment of the orthogonalized update. See ``NorMuon``.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

VARIANT_KEY = "variant"
"""Muon parameter-group (and ``optimizer.params``) key choosing the variant."""
BETA2_KEY = "normuon_beta2"
"""NorMuon's second-moment decay (the paper's beta_2), default ``NORMUON_BETA2``."""
EPS_KEY = "normuon_eps"
"""NorMuon's epsilon in ``O / (sqrt(v) + eps)``, default ``NORMUON_EPS``."""
MUON = "muon"
NORMUON = "normuon"
VARIANTS = (MUON, NORMUON)
NORMUON_BETA2 = 0.95
"""The paper's and microsoft/dion's default beta_2."""
NORMUON_EPS = 1e-8
"""microsoft/dion's epsilon of the normalization (the authors' ``normuon.py`` uses 1e-10)."""
NORMUON_STATE_KEY = "normuon_second_moment"
"""Optimizer-state key (and universal-checkpoint file name) of NorMuon's state in checkpoints."""
KEYS = (VARIANT_KEY, BETA2_KEY, EPS_KEY)
"""The keys of this module, accepted in ``optimizer.params`` and in Muon parameter groups."""


@dataclass(frozen=True)
class NorMuon:
    """NorMuon's rule on the owner: per-row second moment, row normalization, norm kept.

    For one Newton-Schulz problem ``O`` of ``rows x cols`` (``MatrixSpec.ns_problem``: a 2-D
    matrix, one attention head under ``per_head_muon``, one expert of an expert group, a conv
    filter flattened to ``out x in*kh*kw``), with ``v`` its ``rows`` state (zero at the start):

        v    <- beta2 * v + (1 - beta2) * mean_cols(O * O)       (Algorithm 1, line "v_t")
        O^   =  O / (sqrt(v) + eps)                              (row-wise, "O^_t")
        U    =  O^ * ||O||_F / ||O^||_F

    ``O`` is DeepSpeed's Muon update as ``muon_orthogonalize`` returns it: Newton-Schulz of the
    Nesterov blend of gradient and momentum (DeepSpeed's Muon fixes Nesterov on), times upstream's
    aspect-ratio scale ``s = sqrt(max(1, rows/cols))``. The last line is where implementations
    differ. The paper's Algorithm 1 steps by ``0.2 * lr * sqrt(m n) / ||O^||_F`` (an update RMS of
    0.2, Adam's, for an Adam-tuned learning rate). The authors' released ``normuon.py``
    (github.com/zichongli5/NorMuon) and microsoft/dion's ``dion/normuon.py`` rescale ``O^`` to
    the Frobenius norm of the Newton-Schulz output instead, and then apply their Muon learning-rate
    scale. This module does what they do, so that the update has exactly the norm of DeepSpeed's
    Muon update and ``muon_lr`` (tuned for Muon, default 0.02) keeps its meaning: switching the
    variant redistributes each update over its rows, it does not resize it. Since ``O`` already
    holds ``s``, ``v`` is ``s^2`` times the authors' (who scale after normalizing), and the result
    equals theirs with ``eps / s`` for ``eps``; the rescale is per problem (per head, per expert),
    as dion's per-block rescale.

    Attributes:
        beta2: ``normuon_beta2``, in [0, 1).
        eps: ``normuon_eps``, > 0.
    """
    beta2: float = NORMUON_BETA2
    eps: float = NORMUON_EPS
    name = NORMUON
    state_key = NORMUON_STATE_KEY

    @staticmethod
    def state_numel(spec) -> int:
        """``batch * rows`` of ``spec.ns_problem``: one fp32 value per row of every problem."""
        batch, rows, _ = spec.ns_problem
        return batch * rows

    @staticmethod
    def state_rows(spec) -> Tuple[int, int]:
        """``(rows, cols)`` of the state: ``state_numel`` rows, each covering ``cols`` consecutive
        elements of the flattened parameter (row-major over its problems)."""
        batch, rows, cols = spec.ns_problem
        return batch * rows, cols

    @torch.no_grad()
    def apply(self, update: torch.Tensor, state: torch.Tensor, spec) -> torch.Tensor:
        """Advance ``state`` and return the normalized update; see the class docstring.

        Args:
            update: the Newton-Schulz result, ``spec.shape`` (a conv filter may come flattened),
                any float dtype; not modified.
            state: 1-D fp32, ``state_numel(spec)`` elements, on ``update``'s device; in place.
            spec: the matrix's ``owner_plan.MatrixSpec``.

        Returns:
            the update in ``update``'s dtype and shape, computed in fp32.
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


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problems(settings: Mapping[str, Any], where: str) -> List[str]:
    problems = []
    variant = settings.get(VARIANT_KEY, MUON)
    if variant not in VARIANTS:
        problems.append(f"{where}.{VARIANT_KEY}: {variant!r} is not a Muon variant; accepted: "
                        f"{', '.join(repr(v) for v in VARIANTS)}.")
    if BETA2_KEY in settings:
        beta2 = settings[BETA2_KEY]
        if not _number(beta2) or not 0.0 <= beta2 < 1.0:
            problems.append(f"{where}.{BETA2_KEY}: {beta2!r}; NorMuon's second-moment decay must be a number in "
                            "[0, 1).")
    if EPS_KEY in settings:
        eps = settings[EPS_KEY]
        if not _number(eps) or eps <= 0:
            problems.append(f"{where}.{EPS_KEY}: {eps!r}; NorMuon's epsilon must be a number > 0.")
    return problems


def _where_no_owner_runs(engine) -> Optional[str]:
    """Why ``engine``'s Muon update runs outside the owner-centric core, or None where it runs there.

    Stage 0 runs upstream's ``MuonWithAuxAdam.step`` on whole weights; ZeRO stage 1 with bf16
    parameters, fp32 gradient accumulation and no optimizer offload runs DeepSpeed's
    ``BF16_Optimizer`` (the engine's optimizer-wrapper choice), whose Muon is upstream's too.
    """
    stage = engine.zero_optimization_stage()
    if stage == 0:
        return "zero_optimization.stage 0"
    model_dtype, grad_accum_dtype = engine.get_data_types()
    if (stage == 1 and model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32
            and not engine.zero_cpu_offload()):
        return ("zero_optimization.stage 1 with bf16 and data_types.grad_accum_dtype fp32 (DeepSpeed's "
                "BF16_Optimizer)")
    return None


def check_variant_config(optimizer_parameters: Mapping[str, Any], model_parameters, param_groups: Sequence[dict],
                         engine) -> None:
    """Check the variant keys where the engine builds Muon, and fill NorMuon's defaults in.

    Called by the engine (patch 0018) right after ``_muon_param_groups``. A Muon group whose
    ``variant`` is ``"normuon"`` gets ``normuon_beta2`` and ``normuon_eps`` (its own, the
    config's, or the defaults), so checkpoints record them; other groups are left as they are.

    Args:
        optimizer_parameters: the config's ``optimizer.params``.
        model_parameters: what ``deepspeed.initialize`` got (only a list or tuple of group dicts is
            checked for its own keys; the built groups are checked in any case).
        param_groups: the groups the engine built (``use_muon`` halves); modified as above.
        engine: the ``DeepSpeedEngine`` (its ZeRO stage, data types and offload).

    Raises:
        ValueError: naming each key: an unknown ``variant``, ``normuon_beta2`` outside [0, 1),
            ``normuon_eps`` <= 0, NorMuon's keys where no Muon group uses NorMuon; and ``variant: "normuon"`` where no owner rank runs the update
            (``_where_no_owner_runs``: ZeRO stage 0, where upstream's ``MuonWithAuxAdam.step``
            orthogonalizes, and ZeRO-1's ``BF16_Optimizer``).
    """
    problems = _problems(optimizer_parameters or {}, "optimizer.params")
    if isinstance(model_parameters, (list, tuple)):
        for index, group in enumerate(model_parameters):
            if isinstance(group, dict):
                problems += _problems(group, f"model_parameters[{index}]")
    muon_groups = [g for g in param_groups if g.get("use_muon")]
    if not problems and muon_groups and not any(g.get(VARIANT_KEY) == NORMUON for g in muon_groups):
        unused = sorted({k for g in muon_groups for k in (BETA2_KEY, EPS_KEY) if k in g})
        if unused:
            problems.append(f"{', '.join(unused)}: NorMuon's settings, but no Muon group has {VARIANT_KEY} 'normuon', "
                            f"so they would do nothing; add \"{VARIANT_KEY}\": \"normuon\" or remove them.")
    if not problems:
        for index, group in enumerate(param_groups):
            if group.get("use_muon") and group.get(VARIANT_KEY) == NORMUON:
                where = _where_no_owner_runs(engine)
                if where is not None:
                    problems.append(f"optimizer.params.{VARIANT_KEY}: 'normuon' needs ZeRO stage 1, 2 or 3 (its "
                                    "per-row state lives on the rank that orthogonalizes each matrix), and does not "
                                    f"run with {where}; use the default variant 'muon' there.")
                    break
                group.setdefault(BETA2_KEY, NORMUON_BETA2)
                group.setdefault(EPS_KEY, NORMUON_EPS)
    if problems:
        raise ValueError("The Muon optimizer's variant settings are invalid:\n" + "\n".join(f"- {p}"
                                                                                            for p in problems))


def variant_of(param_group: Mapping[str, Any]) -> Optional[NorMuon]:
    """The variant a Muon parameter group runs: ``None`` for plain Muon, else a ``NorMuon``.

    Raises:
        ValueError: invalid settings (see ``check_variant_config``), naming the key.
    """
    problems = _problems(param_group, "optimizer parameter group")
    if problems:
        raise ValueError("; ".join(problems))
    if param_group.get(VARIANT_KEY, MUON) == MUON:
        return None
    return NorMuon(beta2=float(param_group.get(BETA2_KEY, NORMUON_BETA2)),
                   eps=float(param_group.get(EPS_KEY, NORMUON_EPS)))


def check_same_kind(built: Optional[NorMuon], group_variant: Optional[NorMuon], where: str) -> None:
    """Refuse a parameter group whose variant is not the one its state was allocated for.

    A checkpoint's parameter groups replace the engine's settings at ``load_checkpoint`` (torch's
    ``load_state_dict``, the universal loader), ``variant`` included.

    Raises:
        RuntimeError: naming ``where`` and both variants.
    """
    if (built is None) != (group_variant is None):
        names = [MUON if v is None else v.name for v in (built, group_variant)]
        raise RuntimeError(f"{where}: this engine was built with Muon variant '{names[0]}', but the parameter group "
                           f"now says '{names[1]}' (set by a loaded checkpoint?). Build the engine with the "
                           f"{VARIANT_KEY} the checkpoint was trained with.")


class OwnerState:
    """A variant's state of some matrices of one pipeline, in one flat fp32 tensor.

    Args:
        variant: the variant (``state_numel``, ``apply``).
        specs: every matrix of the pipeline (``owner_plan.MatrixSpec``, sub-group order).
        matrices: the indices whose state is kept here, in order (an owner's matrices).
        device: where the state lives (the Newton-Schulz device), when ``flat`` is not given.
        flat: storage to use instead (1-D fp32, ``numel`` elements), e.g. a tensor of the
            optimizer state.

    Attributes:
        spans: ``{matrix index: (offset, numel)}`` in ``flat``.
        numel: elements of state kept here.
    """

    def __init__(self, variant, specs: Sequence, matrices: Iterable[int], device=None, flat=None):
        self.variant = variant
        self.specs = list(specs)
        self.spans: Dict[int, Tuple[int, int]] = {}
        offset = 0
        for j in matrices:
            n = variant.state_numel(self.specs[j])
            self.spans[j] = (offset, n)
            offset += n
        self.numel = offset
        self.flat = torch.zeros(offset, dtype=torch.float32, device=device) if flat is None else flat
        if self.flat.numel() != offset or self.flat.dtype != torch.float32:
            raise ValueError(f"OwnerState needs {offset} fp32 elements, got {self.flat.numel()} {self.flat.dtype}.")

    def view(self, j: int) -> torch.Tensor:
        offset, n = self.spans[j]
        return self.flat.narrow(0, offset, n)

    def apply(self, j: int, update: torch.Tensor, variant=None) -> torch.Tensor:
        """``variant.apply`` of matrix ``j`` (the step's settings; default the one built with)."""
        return (variant or self.variant).apply(update, self.view(j), self.specs[j])


# Checkpoints. A variant's state is saved per parameter, not per owner: in the optimizer state of
# the flat partition, under ``variant.state_key``, as a tensor of the partition's layout holding,
# for every element, the state of its row (the paper's V_t: v broadcast over the row's columns).
# Every checkpoint path then carries it as it carries the momentum (regular checkpoints, and
# ds_to_universal's per-parameter files of the parameter's shape), whatever the owner plan.


def expand_rows(rows: torch.Tensor, cols: int, start: int, count: int) -> torch.Tensor:
    """The broadcast state of elements ``[start, start + count)`` of a flattened parameter.

    Args:
        rows: 1-D, the parameter's state, one value per row of ``cols`` consecutive elements.
        cols: elements per row (``NorMuon.state_rows``).
        start, count: the elements (within the parameter's numel).

    Returns:
        1-D, ``count`` values, ``rows``' dtype and device: element ``e`` gets ``rows[e // cols]``.
    """
    index = torch.arange(start, start + count, device=rows.device) // cols
    return rows.index_select(0, index)


def rows_in_piece(piece: torch.Tensor, cols: int, start: int) -> Tuple[int, torch.Tensor]:
    """The rows whose first element lies in a piece of a broadcast state (``expand_rows``' inverse).

    Args:
        piece: 1-D, the broadcast state of elements ``[start, start + piece.numel())``.
        cols: elements per row. start: the piece's first element in the flattened parameter.

    Returns:
        ``(first_row, values)``: rows ``first_row ..`` and their values (each row's first element
        is in exactly one piece of a partitioned parameter, so summing over pieces rebuilds it).
    """
    end = start + piece.numel()
    first, stop = -(-start // cols), -(-end // cols)
    if stop <= first:
        return first, piece.new_zeros(0)
    return first, piece.narrow(0, first * cols - start, (stop - first - 1) * cols + 1)[::cols]
