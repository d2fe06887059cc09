# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon matrices that AutoTP (``"tensor_parallel": {"autotp_size": N}``) split into shards: one matrix each.

Muon is defined on a layer's whole weight; orthogonalizing each tensor-parallel shard on its own is another optimizer,
one that changes with the tensor-parallel degree. AutoTP records on every weight it splits how its shard maps into
the whole (``deepspeed.checkpoint.affine.ParamAffineMap``, the universal checkpoint's description: rows for
``LinearLayer``, columns for ``LinearAllreduce``, a slice of each fused part for ``SubParamColumnParallel`` and
``fused_LinearLayer``, any uneven split). ZeRO then partitions each shard over the data-parallel ranks, so a matrix
lies in pieces over all tensor x data-parallel ranks: the owner plan runs over that group, the owner receives every
rank's piece, places each in the shards' storage (shards back to back in tensor-parallel rank order, each
flattened), rebuilds the whole matrix through the map (``ShardAssembly``), runs Newton-Schulz once and returns the
pieces through the inverse. A weight AutoTP replicated is an ordinary matrix of the data-parallel group.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.muon.binding import SPREAD_ATTR

TP_KEY = "tensor_parallel.autotp_size"
"""The config key every refusal of this module names."""

_UC_META = "ds_autotp_universal_checkpoint_meta"  # deepspeed.checkpoint.constants.DS_AUTOTP_UC_META
_TP_FLAG = "tensor_model_parallel"  # deepspeed.module_inject.layers.DS_TENSOR_MODEL_PARALLEL


def shard_map(param, name: str):
    """The ``ParamAffineMap`` of a Muon parameter AutoTP split over two or more ranks, or None for one it did not
    split (not tensor-parallel, or replicated on every rank).

    Raises:
        ValueError: naming ``tensor_parallel.autotp_size`` and ``name``, for a split AutoTP did not describe
            (its ``unsupported_reason``) or a shard that holds the weight scaled.
    """
    meta = getattr(param, _UC_META, None)
    if meta is None:
        if getattr(param, _TP_FLAG, False):
            raise ValueError(f"{TP_KEY}: {name} is split by tensor parallelism without a description of its shards, "
                             "so Muon cannot orthogonalize the whole matrix. Set `use_muon = False` on it (AdamW) "
                             "or train it without tensor parallelism.")
        return None
    conversion = meta.get("conversion", {})
    if conversion.get("replicated"):
        return None
    described = conversion.get("affine_map")
    if described is None:
        raise ValueError(f"{TP_KEY}: AutoTP split {name} in a layout it does not describe "
                         f"({conversion.get('unsupported_reason') or meta.get('partition_type')}), so Muon cannot "
                         "orthogonalize the whole matrix. Set `use_muon = False` on it (AdamW) or train without "
                         "tensor parallelism.")
    from deepspeed.checkpoint.affine import ParamAffineMap
    amap = ParamAffineMap.from_dict(described)
    if len(amap.shard_shapes) < 2:
        return None
    if any(piece.scale != 1.0 for pieces in amap.pieces_by_rank.values() for piece in pieces):
        raise ValueError(f"{TP_KEY}: AutoTP holds {name} scaled on its shards; Muon cannot orthogonalize the whole "
                         "matrix. Set `use_muon = False` on it.")
    return amap


def splits_whole_heads(param, amap) -> bool:
    """Whether per-head Muon (``muon_num_heads``) on each shard is exactly per-head Muon on the whole matrix: the
    shards split it by rows only, each into whole heads (upstream ``resolve_per_head_muon_after_sharding`` re-counts
    the heads per shard then; without ``muon_head_dim`` the release did not, and the whole matrix is needed)."""
    head_dim = getattr(param, "muon_head_dim", None)
    if head_dim is None or getattr(param, "muon_num_heads", None) is None:
        return False
    columns = tuple(amap.logical_shape[1:])
    return all(
        tuple(piece.shape[1:]) == columns and piece.shape[0] % head_dim == 0
        for pieces in amap.pieces_by_rank.values() for piece in pieces)


def whole_num_heads(param, amap) -> Optional[int]:
    """``muon_num_heads`` of the whole matrix: its rows over ``muon_head_dim`` where upstream re-counted the heads
    per shard, else the model's count as tagged (or None)."""
    head_dim = getattr(param, "muon_head_dim", None)
    if head_dim:
        return amap.logical_shape[0] // head_dim
    return getattr(param, "muon_num_heads", None)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ShardAssembly:
    """Whole matrix <-> its shards' storage (every shard flattened, back to back in tensor-parallel rank order).

    Attributes:
        logical_shape: the whole matrix's shape. shard_shapes: per tensor-parallel rank, its shard's.
        pieces: per tensor-parallel rank, upstream ``AffinePiece`` s: where blocks of its shard lie in the whole.
    """
    logical_shape: Tuple[int, ...]
    shard_shapes: Tuple[Tuple[int, ...], ...]
    pieces: Tuple[tuple, ...]

    @classmethod
    def of(cls, amap) -> "ShardAssembly":
        ranks = sorted(amap.shard_shapes)
        return cls(tuple(amap.logical_shape), tuple(tuple(amap.shard_shapes[t]) for t in ranks),
                   tuple(tuple(amap.pieces_by_rank[t]) for t in ranks))

    @property
    def shard_offsets(self) -> List[int]:
        """Each shard's first element in the storage."""
        offsets, at = [], 0
        for shape in self.shard_shapes:
            offsets.append(at)
            at += _numel(shape)
        return offsets

    def _views(self, storage: torch.Tensor, whole: torch.Tensor):
        for offset, shape, pieces in zip(self.shard_offsets, self.shard_shapes, self.pieces):
            base = storage.storage_offset() + offset
            for piece in pieces:
                if piece.numel:
                    yield (torch.as_strided(whole, piece.shape, piece.source_strides,
                                            whole.storage_offset() + piece.source_offset),
                           torch.as_strided(storage, piece.shape, piece.dest_strides, base + piece.dest_offset))

    def to_matrix(self, storage: torch.Tensor) -> torch.Tensor:
        """The whole matrix (``logical_shape``, a new tensor) from ``storage`` (1-D, contiguous, its numel)."""
        whole = storage.new_empty(self.logical_shape)
        for in_whole, in_storage in self._views(storage, whole):
            in_whole.copy_(in_storage)
        return whole

    def to_storage(self, matrix: torch.Tensor) -> torch.Tensor:
        """The shards' storage (1-D, a new tensor in ``matrix``'s dtype) of the whole ``matrix`` (its numel)."""
        matrix = matrix.reshape(self.logical_shape).contiguous()
        storage = matrix.new_empty(_numel(self.logical_shape))
        for in_whole, in_storage in self._views(storage, matrix):
            in_storage.copy_(in_whole)
        return storage


@dataclass(frozen=True)
class ShardedMatrices:
    """The tensor-parallel matrices of one partition over the tensor x data-parallel ranks (the world).

    Attributes:
        indices: their positions in the partition. shapes: their whole shapes.
        pieces: per matrix, the elements every rank of ``process_group`` holds (in its rank order).
        placements: per matrix and holding rank (those with a nonzero piece, rank order), ``(offset, numel)``
            of the piece's elements in the shards' storage (the rest of the piece is ZeRO-3's padding).
        assemblies: per matrix its ``ShardAssembly``. num_heads: per matrix, ``whole_num_heads``.
        process_group: the exchange's group (None: the world).
    """
    indices: Tuple[int, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    pieces: Tuple[Tuple[int, ...], ...]
    placements: Tuple[Tuple[Tuple[int, int], ...], ...]
    assemblies: Tuple[ShardAssembly, ...]
    num_heads: Tuple[Optional[int], ...]
    process_group: object = None


def shard_matrices(maps: Dict[int, object], params: Sequence, dp_pieces: Sequence[Sequence[int]], dp_group, label: str,
                   names: Sequence[str]) -> ShardedMatrices:
    """``ShardedMatrices`` from ``maps`` (partition index -> ``ParamAffineMap`` of ``params[index]``) and this
    rank's ``dp_pieces``
    (per partition matrix, the elements every rank of the data-parallel ``dp_group`` holds of its shard); one
    all-gather of a small object over the world, at initialization, on every rank.

    Raises:
        ValueError: naming ``tensor_parallel.autotp_size``, where the tensor and data-parallel ranks are not all
            ranks (pipeline or sequence parallelism besides), or the ranks' tensor-parallel matrices differ (shape,
            order, or ``zero_optimization.sub_group_size`` grouping them differently).
    """
    from deepspeed.utils import groups
    indices = tuple(sorted(maps))
    tp_size = groups.get_tensor_model_parallel_world_size()
    tp_rank = groups.get_tensor_model_parallel_rank()
    dp_size, dp_rank = dist.get_world_size(group=dp_group), dist.get_rank(group=dp_group)
    world = dist.get_world_size()
    if tp_size * dp_size != world:
        raise ValueError(f"{TP_KEY}={tp_size}: Muon reassembles a tensor-parallel matrix over the tensor x "
                         f"data-parallel ranks, {tp_size} x {dp_size} here, which are not all {world} ranks "
                         f"({label}: pipeline, sequence or expert parallelism besides). Set `use_muon = False` on "
                         f"{names[indices[0]]} and the other split weights, or train without tensor parallelism.")
    mine = (tp_rank, dp_rank, tuple((tuple(maps[j].logical_shape), tuple(dp_pieces[j])) for j in indices))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    shapes = tuple(s for s, _ in mine[2])
    for r, (t, d, matrices) in enumerate(everyone):
        if tuple(s for s, _ in matrices) != shapes:
            raise ValueError(f"{TP_KEY}: {label}: rank {r} holds other tensor-parallel Muon matrices than rank "
                             f"{dist.get_rank()} ({len(matrices)} against {len(shapes)}, or other shapes or order). "
                             "An autotp_size above the model's key-value heads leaves some ranks an empty shard of "
                             "k_proj and v_proj, which Muon does not support: lower it. Else every rank must see the "
                             "same model, and zero_optimization.sub_group_size may group uneven shards differently: "
                             "raise it.")
    pieces, placements, assemblies = [], [], []
    for k, j in enumerate(indices):
        assembly = ShardAssembly.of(maps[j])
        if len(assembly.shard_shapes) != tp_size:
            raise ValueError(f"{TP_KEY}={tp_size}: {names[j]} is described over {len(assembly.shard_shapes)} "
                             "tensor-parallel ranks.")
        offsets = assembly.shard_offsets
        row, placed = [], []
        for r, (t, d, matrices) in enumerate(everyone):
            shard_pieces = matrices[k][1]
            n = shard_pieces[d]
            row.append(n)
            if n:
                before = sum(shard_pieces[:d])
                placed.append((offsets[t] + before, max(0, min(n, _numel(assembly.shard_shapes[t]) - before))))
        pieces.append(tuple(row))
        placements.append(tuple(placed))
        assemblies.append(assembly)
    return ShardedMatrices(indices, shapes, tuple(pieces), tuple(placements), tuple(assemblies),
                           tuple(whole_num_heads(params[j], maps[j]) for j in indices))


class TensorParallelLayout:
    """``binding.SPREAD_ATTR`` of a weight AutoTP split: its name and map, or why Muon cannot train it whole
    (raised if it is a Muon matrix)."""
    config_key = TP_KEY

    def __init__(self, name: str, amap=None, error: Optional[str] = None):
        self.name, self.amap, self.error = name, amap, error

    @staticmethod
    def spread(part, indices: Sequence[int]) -> ShardedMatrices:
        """``shard_matrices`` of the partition's matrices ``indices`` (each marked with a ``TensorParallelLayout``).

        Raises:
            ValueError: naming ``tensor_parallel.autotp_size``: the first marked matrix Muon cannot train whole;
                see ``shard_matrices``.
        """
        layouts = {j: getattr(part.params[j], SPREAD_ATTR) for j in indices}
        for layout in layouts.values():
            if layout.error:
                raise ValueError(layout.error)
        names = [layouts[j].name if j in layouts else "" for j in range(len(part.params))]
        return shard_matrices({
            j: layout.amap
            for j, layout in layouts.items()
        }, part.params, part.pieces, part.process_group, part.label, names)


def mark_tensor_parallel_matrices(model) -> int:
    """After AutoTP sharded ``model`` (and, where the release has it, re-counted per-head Muon's heads per shard):
    mark every weight it split with a ``TensorParallelLayout`` (``binding.SPREAD_ATTR``), except projections split
    into whole heads (``splits_whole_heads``: exact on each shard). Returns how many were marked."""
    marked = 0
    for name, param in model.named_parameters():
        try:
            amap = shard_map(param, name)
        except ValueError as e:
            setattr(param, SPREAD_ATTR, TensorParallelLayout(name, error=str(e)))
            marked += 1
            continue
        if amap is not None and not splits_whole_heads(param, amap):
            setattr(param, SPREAD_ATTR, TensorParallelLayout(name, amap))
            marked += 1
    return marked
