# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``muon.tensor_parallel`` on one process: the whole matrix from AutoTP's shard maps and back, ZeRO pieces placed in
the shards' storage, and refusals naming ``tensor_parallel.autotp_size``."""

import pytest
import torch

from deepspeed.checkpoint.affine import contiguous_split_map, replicated_map, sub_param_map
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout
from deepspeed.runtime.zero.muon.tensor_parallel import ShardAssembly, shard_map, splits_whole_heads

MAPS = {
    "rows (LinearLayer)": contiguous_split_map((10, 6), [5, 5], 0),
    "uneven columns (LinearAllreduce)": contiguous_split_map((4, 7), [4, 3], 1),
    "an empty shard": contiguous_split_map((4, 6), [4, 0], 0),
    "fused q, k, v (SubParamColumnParallel)": sub_param_map((16, 4), [8, 4, 4], [[4, 4], [2, 2], [2, 2]], 0),
}


def _shards(amap, whole):
    shards = []
    for t in sorted(amap.shard_shapes):
        shard = torch.empty(amap.shard_shapes[t])
        for piece in amap.pieces_by_rank[t]:
            piece.dest_view(shard).copy_(piece.source_view(whole))
        shards.append(shard.reshape(-1))
    return torch.cat(shards)


@pytest.mark.parametrize("layout", sorted(MAPS))
def test_assembly_round_trip(layout):
    amap = MAPS[layout]
    whole = torch.randn(amap.logical_shape)
    storage = _shards(amap, whole)
    assembly = ShardAssembly.of(amap)
    assert torch.equal(assembly.to_matrix(storage), whole)
    assert torch.equal(assembly.to_storage(whole), storage)


def test_piece_of_padding_only_places_nothing():
    """A 2-element shard over 3 ranks in pieces of 1: the padding-only last piece is placed at the shard's end."""
    storage = torch.arange(4, dtype=torch.float32)
    placements = ((0, 1), (1, 1), (2, 0), (2, 1), (3, 1), (4, 0))
    recv = torch.tensor([0.0, 1.0, -1.0, 2.0, 3.0, -1.0])
    layout = BucketLayout((0, ), (0, ), (4, ), ((1, ) * 6, ), 0, (placements, ))
    assert torch.equal(layout.owned_matrix(recv, 0, (4, )), storage)
    back = torch.full((6, ), 7.0)
    layout.write_result(0, storage, back)
    assert torch.equal(back, torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0]))


def test_pieces_placed_in_storage_past_padding():
    """Two 6-element shards, each over 2 ranks in pieces of 4 (2 padding): shard 0 on ranks 0, 1, shard 1 on 2, 3;
    owner rank 1."""
    storage = torch.arange(12, dtype=torch.float32)
    placements = ((0, 4), (4, 2), (6, 4), (10, 2))
    pieces = (4, 4, 4, 4)
    recv = torch.cat([torch.cat([storage[o:o + n], torch.full((4 - n, ), -1.0)]) for o, n in placements])
    layout = BucketLayout((0, ), (1, ), (12, ), (pieces, ), 1, (placements, ))
    assert torch.equal(layout.owned_matrix(recv, 0, (12, )), storage)
    back = torch.full((16, ), 7.0)
    layout.write_result(0, storage, back)
    assert torch.equal(back, torch.where(recv < 0, torch.zeros(()), recv))


class _Param:

    def __init__(self, meta=None, tensor_parallel=False, **attrs):
        if meta is not None:
            setattr(self, "ds_autotp_universal_checkpoint_meta", meta)
        if tensor_parallel:
            self.tensor_model_parallel = True
        self.__dict__.update(attrs)


def _meta(amap=None, **conversion):
    if amap is not None:
        conversion["affine_map"] = amap.to_dict()
    return {"conversion": conversion}


def test_not_split_is_an_ordinary_matrix():
    assert shard_map(_Param(), "w") is None
    assert shard_map(_Param(_meta(replicated_map((4, 4), 2), replicated=True)), "w") is None


def test_split_gives_its_map():
    amap = shard_map(_Param(_meta(MAPS["rows (LinearLayer)"])), "w")
    assert amap.logical_shape == (10, 6) and sorted(amap.shard_shapes) == [0, 1]


@pytest.mark.parametrize("param", [
    _Param(_meta(unsupported_reason="a layout with no map")),
    _Param(tensor_parallel=True),
    _Param(_meta(replicated_map((4, 4), 2, scale=0.5))),
    _Param(_meta(MAPS["an empty shard"])),
],
                         ids=["undescribed", "no metadata", "scaled", "empty shard"])
def test_refused_naming_the_key(param):
    with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size: .*w\b"):
        shard_map(param, "w")


def test_whole_heads_stay_on_their_shard():
    rows = MAPS["rows (LinearLayer)"]  # shards of 5 rows
    assert splits_whole_heads(_Param(muon_head_dim=5, muon_num_heads=1), rows)
    assert not splits_whole_heads(_Param(muon_head_dim=5, muon_num_heads=1), MAPS["uneven columns (LinearAllreduce)"])
    assert not splits_whole_heads(_Param(muon_head_dim=2, muon_num_heads=None), rows)  # upstream dropped the tag
    assert not splits_whole_heads(_Param(muon_num_heads=2), rows)  # a release that does not re-count per shard
    # shards of whole rows off the head boundaries (3 + 7 rows, heads of 5): not whole heads
    assert not splits_whole_heads(_Param(muon_head_dim=5, muon_num_heads=1), contiguous_split_map((10, 6), [3, 7], 0))
