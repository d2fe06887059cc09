# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon matrices that AutoTP (``"tensor_parallel": {"autotp_size": N}``) split into shards: one matrix each.

Muon is defined on a layer's whole weight; orthogonalizing each shard alone would change with the tensor-parallel
degree. AutoTP records how each shard maps into the whole (``deepspeed.checkpoint.affine.ParamAffineMap``), and ZeRO
partitions each shard over the data-parallel ranks, so the owner plan runs over all tensor x data-parallel ranks: the
owner gathers the pieces into the shards' storage (shards flattened, in tensor-parallel rank order), rebuilds the
matrix through the map (``ShardAssembly``), runs Newton-Schulz once and returns the pieces. Replicated weights are
ordinary matrices of the data-parallel group.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.muon.param_record import record
from deepspeed.runtime.zero.muon.config import AUTOTP_SIZE_KEY as TP_KEY  # the key every refusal here names

_UC_META = "ds_autotp_universal_checkpoint_meta"  # deepspeed.checkpoint.constants.DS_AUTOTP_UC_META
_TP_FLAG = "tensor_model_parallel"  # deepspeed.module_inject.layers.DS_TENSOR_MODEL_PARALLEL


def shard_map(param, name: str):
    """The ``ParamAffineMap`` of a parameter AutoTP split over two or more ranks, else None.

    Raises:
        ValueError: a split AutoTP did not describe, an empty shard, or a shard holding the weight scaled.
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
    empty = [t for t, shape in sorted(amap.shard_shapes.items()) if _numel(shape) == 0]
    if empty:
        raise ValueError(f"{TP_KEY}: AutoTP gave tensor-parallel rank(s) {empty} an empty shard of {name} (an "
                         "autotp_size above the model's key-value heads); Muon does not support empty shards: lower "
                         "autotp_size to at most the key-value heads, or set `use_muon = False` on it.")
    if any(piece.scale != 1.0 for pieces in amap.pieces_by_rank.values() for piece in pieces):
        raise ValueError(f"{TP_KEY}: AutoTP holds {name} scaled on its shards; Muon cannot orthogonalize the whole "
                         "matrix. Set `use_muon = False` on it.")
    return amap


def splits_whole_heads(param, amap) -> bool:
    """Whether per-head Muon on each shard equals it on the whole: rows-only shards of whole heads (upstream
    ``resolve_per_head_muon_after_sharding`` re-counts heads per shard; without ``muon_head_dim`` the release did not,
    and the whole matrix is needed)."""
    head_dim = getattr(param, "muon_head_dim", None)
    if head_dim is None or getattr(param, "muon_num_heads", None) is None:
        return False
    columns = tuple(amap.logical_shape[1:])
    return all(
        tuple(piece.shape[1:]) == columns and piece.shape[0] % head_dim == 0
        for pieces in amap.pieces_by_rank.values() for piece in pieces)


def whole_num_heads(param, amap) -> Optional[int]:
    """The whole matrix's heads: rows over ``muon_head_dim`` where upstream re-counted per shard, else as tagged."""
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
        logical_shape / shard_shapes / pieces: the whole's shape / per tensor-parallel rank, its shard's shape and
            the ``AffinePiece``s placing the shard's blocks in the whole.
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
        indices / shapes: their positions in the partition / whole shapes.
        pieces: per matrix, the elements every rank of ``process_group`` holds (in rank order).
        placements: per matrix and rank with a nonzero piece, ``(offset, numel)`` of its elements in the shards'
            storage (the rest is ZeRO-3's padding).
        assemblies / num_heads: per matrix, its ``ShardAssembly`` / ``whole_num_heads``.
        process_group: the exchange's group (None: the world).
    """
    indices: Tuple[int, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    pieces: Tuple[Tuple[int, ...], ...]
    placements: Tuple[Tuple[Tuple[int, int], ...], ...]
    assemblies: Tuple[ShardAssembly, ...]
    num_heads: Tuple[Optional[int], ...]
    process_group: object = None


def _local_shape(param) -> Tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def shard_matrices(requests: Dict[int, tuple]) -> Dict[int, ShardedMatrices]:
    """``ShardedMatrices`` per key of ``requests`` (key -> ``(MuonPartition, {index: TensorParallelLayout})``), from
    one small all-gather over the world on every rank; the checks read what all ranks gathered, so all raise together.

    Raises:
        ValueError: a marked matrix Muon cannot train whole; tensor x data-parallel ranks that are not the world
            (pipeline or sequence parallelism, MiCS or hpZ besides); ranks whose tensor-parallel matrices differ
            (``zero_optimization.sub_group_size`` grouping uneven shards differently), whose mesh positions repeat, or
            whose shard is not AutoTP's.
    """
    from deepspeed.utils import groups
    tp_size, tp_rank = groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank()
    world = dist.get_world_size()
    errors = [layout.error for _, layouts in requests.values() for layout in layouts.values() if layout.error]
    mine = {"tp": tp_rank, "dp": {}, "matrices": {}, "errors": errors[:1]}
    for key, (part, layouts) in requests.items():
        dp_size = dist.get_world_size(group=part.process_group)
        if tp_size * dp_size != world:
            raise ValueError(f"{TP_KEY}={tp_size}: Muon reassembles a tensor-parallel matrix over the tensor x "
                             f"data-parallel ranks, {tp_size} x {dp_size} here, which are not all {world} ranks "
                             f"({part.label}: pipeline or sequence parallelism, MiCS or hpZ besides). Set "
                             f"`use_muon = False` on the split weights ({next(iter(layouts.values())).name}, ...), "
                             "or train without tensor parallelism.")
        mine["dp"][key] = dist.get_rank(group=part.process_group)
        mine["matrices"][key] = [(layout.name, _local_shape(part.params[j]), tuple(part.pieces[j]))
                                 for j, layout in sorted(layouts.items())]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    # A rank whose shard of a weight is empty may not hold it in a partition: raise what any rank found, everywhere.
    for theirs in everyone:
        if theirs["errors"]:
            raise ValueError(theirs["errors"][0])
    names = {key: [m[0] for m in matrices] for key, matrices in mine["matrices"].items()}
    for r, theirs in enumerate(everyone):
        if {key: [m[0] for m in matrices] for key, matrices in theirs["matrices"].items()} != names:
            raise ValueError(f"{TP_KEY}: rank {r} holds other tensor-parallel Muon matrices, or in other ZeRO "
                             f"partitions, than rank {dist.get_rank()}. Every rank must see the same model; "
                             "zero_optimization.sub_group_size may group uneven shards differently: raise it.")
    for key in names:
        mesh = [(theirs["tp"], theirs["dp"][key]) for theirs in everyone]
        if len(set(mesh)) != world:
            raise ValueError(f"{TP_KEY}: the ranks' (tensor, data)-parallel ranks repeat ({mesh}); Muon cannot tell "
                             "which shard a rank holds.")
    result = {}
    for key, (part, layouts) in requests.items():
        indices = tuple(sorted(layouts))
        pieces, placements, assemblies = [], [], []
        for k, j in enumerate(indices):
            assembly = ShardAssembly.of(layouts[j].amap)
            offsets = assembly.shard_offsets
            row, placed = [], []
            for r, theirs in enumerate(everyone):
                t, d = theirs["tp"], theirs["dp"][key]
                name, local_shape, shard_pieces = theirs["matrices"][key][k]
                if len(assembly.shard_shapes) != tp_size or tuple(local_shape) != assembly.shard_shapes[t]:
                    raise ValueError(f"{TP_KEY}: rank {r} holds {name} as a shard of shape {tuple(local_shape)}, "
                                     f"AutoTP's map says {assembly.shard_shapes[t % len(assembly.shard_shapes)]} for "
                                     f"tensor-parallel rank {t} of {len(assembly.shard_shapes)}.")
                row.append(shard_pieces[d])
                if shard_pieces[d]:
                    # ZeRO-3 pads a shard's last pieces: a piece wholly past its end places nothing.
                    shard_numel, before = _numel(assembly.shard_shapes[t]), sum(shard_pieces[:d])
                    placed.append(
                        (offsets[t] + min(before, shard_numel), max(0, min(shard_pieces[d], shard_numel - before))))
            pieces.append(tuple(row))
            placements.append(tuple(placed))
            assemblies.append(assembly)
        result[key] = ShardedMatrices(indices, tuple(a.logical_shape for a in assemblies), tuple(pieces),
                                      tuple(placements), tuple(assemblies),
                                      tuple(whole_num_heads(part.params[j], layouts[j].amap) for j in indices))
    return result


class TensorParallelLayout:
    """``MuonRecord.tensor_parallel`` of a weight AutoTP split: its name and map, or why Muon cannot train it whole
    (raised if it is a Muon matrix)."""
    config_key = TP_KEY
    spread = staticmethod(shard_matrices)

    def __init__(self, name: str, amap=None, error: Optional[str] = None):
        self.name, self.amap, self.error = name, amap, error


def mark_tensor_parallel_matrices(model) -> int:
    """After AutoTP sharded ``model``, mark every split weight with a ``TensorParallelLayout``, except projections
    split into whole heads (``splits_whole_heads``); return how many were marked."""
    marked = 0
    for name, param in model.named_parameters():
        try:
            amap = shard_map(param, name)
        except ValueError as e:
            record(param).tensor_parallel = TensorParallelLayout(name, error=str(e))
            marked += 1
            continue
        if amap is not None and not splits_whole_heads(param, amap):
            record(param).tensor_parallel = TensorParallelLayout(name, amap)
            marked += 1
    return marked
