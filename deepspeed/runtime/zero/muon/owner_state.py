# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""State a Muon variant keeps per matrix on the matrix's owner rank: the extension point.

The distributed Muon core (``pipeline.MuonPipeline``) runs Newton-Schulz once per matrix, on its
owner rank, with the whole matrix in hand. A *variant* is a rule applied there, to each
Newton-Schulz result, before the result is split back into the ranks' gradient partitions
(``BucketLayout.write_result``). Statistics over a matrix's rows or the whole matrix are therefore
exact and cost no communication. A variant may keep per-row state, which lives only on the owner,
in fp32, on the Newton-Schulz device, and is updated once per optimizer step. It is a class with:

- ``name``: its value of the ``variant`` key; ``state_key``: the optimizer-state key its state
  travels under in checkpoints; ``defaults``: ``{key: default}`` of its own settings;
- ``key_problems(settings, where)``: what is wrong with its settings in a config block or group;
- ``from_group(param_group)``: the rule with a group's settings;
- on an instance: ``state_numel(spec)`` (elements of state one matrix, an
  ``owner_plan.MatrixSpec``, needs), ``state_rows(spec)`` (``(rows, cols)``: the state holds one
  value per row of ``cols`` consecutive elements of the flattened parameter, which is how
  checkpoints carry it), and ``apply(update, state, spec)``: the rule. ``update`` is the matrix's
  Newton-Schulz result (``spec.shape``, in the kernel's dtype, scaled by upstream's aspect ratio;
  not modified), ``state`` its 1-D fp32 state of ``state_numel(spec)`` elements, advanced in
  place; it returns the update to send back, ``spec.shape`` and ``update``'s dtype.

A variant's module registers it (``register_variant``) when imported; NorMuon
(``deepspeed.runtime.zero.muon.normuon``) is imported by the engine (patch 0018).

``OwnerState`` holds the state of the matrices one rank owns in one flat tensor, allocated from
the owner plan at construction. Plain Muon (no ``variant`` key, or ``"muon"``) has no variant:
nothing is allocated and the pipeline runs exactly as before (no call, no collective, the same
results bit for bit). The plan's memory budget counts the state (``owner_plan.within_budget``,
``state_numels``).
"""

import difflib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

VARIANT_KEY = "variant"
"""Muon parameter-group (and ``optimizer.params``) key choosing the variant."""
MUON = "muon"
"""The default ``variant``: plain Muon, no owner state."""

_VARIANTS: Dict[str, type] = {}
"""The registered variants by name (``register_variant``)."""


def register_variant(variant: type) -> type:
    """Make ``variant`` (a class as described in the module docstring) selectable by its ``name``.

    Raises:
        ValueError: the name is ``"muon"`` or already registered by another class.
    """
    if variant.name == MUON or _VARIANTS.get(variant.name, variant) is not variant:
        raise ValueError(f"A Muon variant named {variant.name!r} exists already.")
    _VARIANTS[variant.name] = variant
    return variant


def variants() -> Tuple[str, ...]:
    """The accepted values of ``variant``: ``"muon"`` and each registered variant's name."""
    return (MUON, *sorted(_VARIANTS))


def state_keys() -> Tuple[str, ...]:
    """The optimizer-state keys of the registered variants."""
    return tuple(sorted(v.state_key for v in _VARIANTS.values()))


def _closest(value, choices: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for the choice closest to ``value`` lower-cased ("NorMuon",
    "nor-muon": 'normuon'; ``difflib`` ratio >= 0.75), else ""."""
    close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.75) if isinstance(value, str) else []
    return f" Did you mean {close[0]!r}?" if close else ""


def _problems(settings: Mapping[str, Any], where: str) -> List[str]:
    variant = settings.get(VARIANT_KEY, MUON)
    problems = []
    if variant not in variants():
        problems.append(f"{where}.{VARIANT_KEY}: {variant!r} is not a Muon variant; accepted: "
                        f"{', '.join(repr(v) for v in variants())}.{_closest(variant, variants())}")
    for registered in _VARIANTS.values():
        problems += registered.key_problems(settings, where)
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
    """Check the variant keys where the engine builds Muon, and fill each variant's defaults in.

    Called by the engine (patch 0018) right after ``_muon_param_groups``. A Muon group that uses a
    variant gets each of the variant's settings (its own, the config's, or the default), so
    checkpoints record them; other groups are left as they are.

    Args:
        optimizer_parameters: the config's ``optimizer.params``.
        model_parameters: what ``deepspeed.initialize`` got (only a list or tuple of group dicts is
            checked for its own keys; the built groups are checked in any case).
        param_groups: the groups the engine built (``use_muon`` halves); modified as above.
        engine: the ``DeepSpeedEngine`` (its ZeRO stage, data types and offload).

    Raises:
        ValueError: naming each key: an unknown ``variant``, a variant's setting it refuses
            (``key_problems``), a variant's settings where no Muon group uses that variant, and
            a variant where no owner rank runs the update (``_where_no_owner_runs``: ZeRO stage 0,
            where upstream's ``MuonWithAuxAdam.step`` orthogonalizes, and ZeRO-1's
            ``BF16_Optimizer``).
    """
    problems = _problems(optimizer_parameters or {}, "optimizer.params")
    if isinstance(model_parameters, (list, tuple)):
        for index, group in enumerate(model_parameters):
            if isinstance(group, dict):
                problems += _problems(group, f"model_parameters[{index}]")
    muon_groups = [g for g in param_groups if g.get("use_muon")]
    if not problems and muon_groups:
        used = {g.get(VARIANT_KEY, MUON) for g in muon_groups}
        for name, registered in sorted(_VARIANTS.items()):
            unused = sorted({k for g in muon_groups for k in registered.defaults if k in g})
            if unused and name not in used:
                problems.append(f"{', '.join(unused)} (optimizer.params or a parameter group): {name}'s settings, "
                                f"but no Muon group has {VARIANT_KEY} {name!r}, so they would do nothing; add "
                                f"\"{VARIANT_KEY}\": \"{name}\" or remove them.")
    if not problems:
        for group in param_groups:
            registered = _VARIANTS.get(group.get(VARIANT_KEY, MUON)) if group.get("use_muon") else None
            if registered is None:
                continue
            where = _where_no_owner_runs(engine)
            if where is not None:
                problems.append(f"optimizer.params.{VARIANT_KEY}: {registered.name!r} needs ZeRO stage 1, 2 or 3 "
                                "(its state lives on the rank that orthogonalizes each matrix), and does not run "
                                f"with {where}; use the default variant 'muon' there.")
                break
            for key, default in registered.defaults.items():
                group.setdefault(key, default)
    if problems:
        raise ValueError("The Muon optimizer's variant settings are invalid:\n" + "\n".join(f"- {p}"
                                                                                            for p in problems))


def variant_of(param_group: Mapping[str, Any]):
    """The variant a Muon parameter group runs: ``None`` for plain Muon, else an instance of the
    registered variant with the group's settings.

    Raises:
        ValueError: invalid settings (see ``check_variant_config``), naming the key.
    """
    problems = _problems(param_group, "optimizer parameter group")
    if problems:
        raise ValueError("; ".join(problems))
    name = param_group.get(VARIANT_KEY, MUON)
    return None if name == MUON else _VARIANTS[name].from_group(param_group)


def check_same_kind(built, group_variant, where: str) -> None:
    """Refuse a parameter group whose variant is not the one its state was allocated for.

    A checkpoint's parameter groups replace the engine's settings at ``load_checkpoint`` (torch's
    ``load_state_dict``, the universal loader), ``variant`` included.

    Raises:
        RuntimeError: naming ``where`` and both variants.
    """
    names = [MUON if v is None else v.name for v in (built, group_variant)]
    if names[0] != names[1]:
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
        cols: elements per row (the variant's ``state_rows``).
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
