# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A Muon variant's per-matrix state on the owner rank: the registry, the storage, its checkpoint form.

A *variant* is a rule the owner rank applies to each Newton-Schulz result with the whole matrix in hand (``pipeline``),
so statistics over its rows are exact and cost no communication; its per-row state lives on the owner in fp32. A
variant is a class with ``name`` (its value of ``variant``), ``state_key`` (the optimizer-state key of its checkpoint
form), ``defaults`` (``{key: default}`` of its settings), ``key_problems(settings, where)`` and
``from_group(param_group)``; an instance has ``state_numel(spec)``, ``state_rows(spec)`` (``(rows, cols)``: one value
per ``cols`` consecutive elements of the flattened parameter) and ``apply(update, state, spec)`` (the rule on one
``MatrixSpec``'s NS result, its 1-D fp32 ``state`` advanced in place; returns the update in the result's shape and
dtype). A variant's module registers it when imported; plain Muon (``"muon"``) has none, and nothing of this runs.

Checkpoint form: per parameter, not per owner, so any owner plan takes it back: a tensor shaped like the flat
partition, each element holding its row's state (NorMuon's V_t broadcast over the row), under ``state_key`` in the
optimizer state, which every checkpoint path carries like the momentum.
"""

from typing import Dict, Iterable, Sequence, Tuple

import torch

from deepspeed.runtime.rank_agreement import agreed_errors
from deepspeed.runtime.zero.muon.momentum import MOMENTUM_KEY

VARIANT_KEY = "variant"
"""The Muon key naming a group's variant, one of ``variants()`` (``config.MuonSettings.variant`` describes it)."""
MUON = "muon"
"""The default ``variant``: plain Muon, no owner state."""

_VARIANTS: Dict[str, type] = {}


def register_variant(variant: type) -> type:
    """Make ``variant`` (a class as the module docstring describes) selectable by its ``name``; ``ValueError`` where
    the name is ``"muon"`` or another class's."""
    if variant.name == MUON or _VARIANTS.get(variant.name, variant) is not variant:
        raise ValueError(f"A Muon variant named {variant.name!r} exists already.")
    _VARIANTS[variant.name] = variant
    return variant


def registered() -> Dict[str, type]:
    """The registered variant classes by name (a copy)."""
    return dict(_VARIANTS)


def variants() -> Tuple[str, ...]:
    """The accepted values of ``variant``: ``"muon"`` and each registered variant's name."""
    return (MUON, *sorted(_VARIANTS))


def state_keys() -> Tuple[str, ...]:
    return tuple(sorted(v.state_key for v in _VARIANTS.values()))


def variant_of(param_group):
    """``None`` for a plain Muon group, else an instance of its registered variant with the group's settings;
    ``ValueError`` naming the key where ``variant`` is not registered or the variant refuses a setting."""
    name = param_group.get(VARIANT_KEY, MUON)
    if name == MUON:
        return None
    if name not in _VARIANTS:
        raise ValueError(f"optimizer parameter group {VARIANT_KEY}: {name!r} is not a Muon variant; accepted: "
                         f"{', '.join(repr(v) for v in variants())}.")
    problems = _VARIANTS[name].key_problems(param_group, "optimizer parameter group")
    if problems:
        raise ValueError("; ".join(problems))
    return _VARIANTS[name].from_group(param_group)


def check_same_kind(built, group_variant, where: str) -> None:
    """Refuse (``RuntimeError``) a group whose variant is not the one its state was allocated for (a checkpoint's
    groups replace the engine's at ``load_checkpoint``)."""
    names = [MUON if v is None else v.name for v in (built, group_variant)]
    if names[0] != names[1]:
        raise RuntimeError(f"{where}: this engine was built with Muon variant '{names[0]}', but the parameter group "
                           f"now says '{names[1]}' (set by a loaded checkpoint?). Build the engine with the "
                           f"{VARIANT_KEY} the checkpoint was trained with.")


class OwnerState:
    """A variant's state of the ``owned`` matrices (indices into ``specs``, the partition's ``MatrixSpec``) in one
    zero-initialized flat fp32 tensor on ``device``; ``spans`` maps a matrix to its ``(offset, numel)`` in ``flat``."""

    def __init__(self, variant, specs: Sequence, owned: Iterable[int], device):
        self.variant = variant
        self.specs = list(specs)
        self.spans: Dict[int, Tuple[int, int]] = {}
        offset = 0
        for j in owned:
            n = variant.state_numel(self.specs[j])
            self.spans[j] = (offset, n)
            offset += n
        self.flat = torch.zeros(offset, dtype=torch.float32, device=device)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def view(self, j: int) -> torch.Tensor:
        """Matrix ``j``'s state (1-D fp32 view of ``flat``)."""
        offset, n = self.spans[j]
        return self.flat.narrow(0, offset, n)

    def apply(self, j: int, update: torch.Tensor, variant=None) -> torch.Tensor:
        """``variant.apply`` on matrix ``j`` (the step's settings; default those it was built with)."""
        return (variant or self.variant).apply(update, self.view(j), self.specs[j])

    def _pieces(self, pieces: Sequence[Sequence[int]], slices: Sequence[Tuple[int, int]], rank: int):
        """Per matrix ``(j, offset, numel, cols, first, count, start)``: its state's span among all matrices' (``cols``
        per row), then this rank's piece's first element, elements (padding excluded) and offset in the partition."""
        offset = 0
        for j, (spec, piece, (start, _)) in enumerate(zip(self.specs, pieces, slices)):
            n, (_, cols) = self.variant.state_numel(spec), self.variant.state_rows(spec)
            first = sum(piece[:rank])
            yield j, offset, n, cols, first, max(0, min(piece[rank], spec.numel - first)), start
            offset += n

    @staticmethod
    def _all_reduce(tensor: torch.Tensor, op: str, group, world_size: int) -> torch.Tensor:
        if world_size > 1:
            from deepspeed import comm as dist
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
        return tensor

    def to_partition(self, pieces: Sequence[Sequence[int]], slices: Sequence[Tuple[int, int]], rank: int, numel: int,
                     group, world_size: int) -> torch.Tensor:
        """The checkpoint form: a 1-D fp32 host tensor of the flat partition's ``numel``, each element of this rank's
        pieces (``MuonPartition``'s) holding its row's state, the rest zero; collective over ``group``."""
        full = torch.zeros(sum(self.variant.state_numel(s) for s in self.specs), device=self.flat.device)
        for j, offset, n, *_ in self._pieces(pieces, slices, rank):
            if j in self.spans:
                full.narrow(0, offset, n).copy_(self.view(j))
        full = self._all_reduce(full, "SUM", group, world_size).cpu()
        out = torch.zeros(numel, dtype=torch.float32)
        for j, offset, n, cols, first, count, start in self._pieces(pieces, slices, rank):
            if count:
                out.narrow(0, start, count).copy_(expand_rows(full.narrow(0, offset, n), cols, first, count))
        return out

    def from_partition(self, loaded: torch.Tensor, pieces: Sequence[Sequence[int]], slices: Sequence[Tuple[int, int]],
                       rank: int, group, world_size: int) -> None:
        """Take a checkpoint form (as ``to_partition``'s, any device or dtype; each rank its own) back into the owners'
        state; collective over ``group``. ``ValueError`` on every rank where some rank's form is not one value per row
        (another variant's state, a damaged file), naming one such matrix."""
        loaded = loaded.to(device=self.flat.device, dtype=torch.float32)
        full = torch.zeros(sum(self.variant.state_numel(s) for s in self.specs), device=self.flat.device)
        for j, offset, n, cols, first, count, start in self._pieces(pieces, slices, rank):
            if count:  # each row's first element is in exactly one piece: the sum over ranks rebuilds it
                row, values = rows_in_piece(loaded.narrow(0, start, count), cols, first)
                full.narrow(0, offset + row, values.numel()).copy_(values)
        full = self._all_reduce(full, "SUM", group, world_size)
        uneven = [
            j for j, offset, n, cols, first, count, start in self._pieces(pieces, slices, rank) if count and
            not torch.equal(loaded.narrow(0, start, count), expand_rows(full.narrow(0, offset, n), cols, first, count))
        ]
        worst = torch.tensor([max(uneven, default=-1)], device=self.flat.device)
        j = int(self._all_reduce(worst, "MAX", group, world_size).item())
        if j >= 0:
            raise ValueError(f"matrix {j} (shape {tuple(self.specs[j].shape)}) is not {self.variant.name}'s per-row "
                             f"state ({self.variant.state_rows(self.specs[j])[1]} equal values per row).")
        for j, offset, n, *_ in self._pieces(pieces, slices, rank):
            if j in self.spans:
                self.view(j).copy_(full.narrow(0, offset, n))


def load_checkpoint_form(owner: "OwnerState", state: dict, part, exchange, group_variant: str) -> None:
    """Take a loaded checkpoint form out of a partition's optimizer ``state`` into ``owner`` (None for plain Muon);
    collective over ``exchange``'s group; the ranks agree on each one's own checks, so all raise the same error.

    Raises:
        RankAgreedError (a RuntimeError), on every rank: some rank's ``state`` holds another variant's state (it would
            be dropped), or a momentum but no state of ``owner``'s variant (plain Muon's: it would restart at zero),
            or one of another size than ``part.numel``, or none where other ranks' hold one.
        ValueError: the form is not one value per row (``from_partition``).
    """
    own_key = owner.variant.state_key if owner is not None else None
    with agreed_errors(f"loading the Muon state of {part.label}", group=exchange.group):
        foreign = [k for k in state_keys() if k in state and k != own_key]
        if foreign:
            raise RuntimeError(f"the loaded optimizer state holds a Muon variant's {', '.join(foreign)}, but this "
                               f"run's group uses variant {group_variant!r}; build the engine with the variant the "
                               "checkpoint was trained with (refusing to drop the state).")
        loaded = state.pop(own_key, None) if owner is not None else None
        if owner is not None and loaded is None and state.get(MOMENTUM_KEY) is not None:
            raise RuntimeError(f"the loaded optimizer state has no '{own_key}' for the {owner.variant.name} variant "
                               "(a checkpoint of a plain Muon run?); refusing to restart it at zero. Load a "
                               "checkpoint of the same variant.")
        if loaded is not None and loaded.numel() != part.numel:
            raise RuntimeError(f"'{own_key}' has {loaded.numel()} elements for a partition of {part.numel} (another "
                               "partitioning); convert the checkpoint with ds_to_universal and load it as a "
                               "universal checkpoint.")
    if owner is None:
        return
    held = owner._all_reduce(torch.tensor([loaded is None, loaded is not None], device=owner.flat.device), "MAX",
                             exchange.group, exchange.world_size)
    with agreed_errors(f"loading the Muon state of {part.label}", group=exchange.group, enabled=bool(held.all())):
        if loaded is None and held.all():
            raise RuntimeError(f"the loaded optimizer state has no '{own_key}' where other ranks' have one")
    if loaded is None:
        return
    try:
        owner.from_partition(loaded, part.pieces, part.slices, exchange.rank, exchange.group, exchange.world_size)
    except ValueError as e:
        raise ValueError(f"{part.label}: '{own_key}' of the checkpoint: {e}") from e


def expand_rows(rows: torch.Tensor, cols: int, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start + count)`` of a flattened parameter's broadcast state: element ``e`` gets
    ``rows[e // cols]`` (``rows``: 1-D, one value per row of ``cols`` elements)."""
    index = torch.arange(start, start + count, device=rows.device) // cols
    return rows.index_select(0, index)


def rows_in_piece(piece: torch.Tensor, cols: int, start: int) -> Tuple[int, torch.Tensor]:
    """``(first_row, values)``: the rows whose first element lies in ``piece`` (1-D, the broadcast state of elements
    ``[start, start + piece.numel())``), ``expand_rows``' inverse."""
    end = start + piece.numel()
    first, stop = -(-start // cols), -(-end // cols)
    if stop <= first:
        return first, piece.new_zeros(0)
    return first, piece.narrow(0, first * cols - start, (stop - first - 1) * cols + 1)[::cols]
