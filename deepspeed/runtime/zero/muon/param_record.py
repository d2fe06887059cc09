# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What DeepSpeed's Muon records about one parameter: one ``MuonRecord`` per parameter, read and written here only.

A user steers Muon per parameter with three public attributes set before ``deepspeed.initialize`` (the user guide):
``use_muon`` (Muon or the auxiliary Adam), ``muon_num_heads`` (upstream's per-head Muon) and ``muon_split`` (the
matrices a fused projection holds). What DeepSpeed decides itself goes in one private record, ``param.ds_muon``,
shared by writers (``param_selection``, ``tensor_parallel``) and readers (``newton_schulz``, ``binding``, ``support``):

- ``choice``: ``(use_muon, reason)`` as the parameter selection set ``use_muon`` (another value is the user's);
- ``recognized_split``: the split the selection recognized in a Hugging Face layout (a ``muon_split`` without it is the
  user's own, which ``split_fused_muon: false`` does not undo);
- ``tensor_parallel``: how AutoTP cut the weight (``tensor_parallel.TensorParallelLayout``: its map, or why Muon cannot
  train it whole), for the binding to plan it over the tensor x data-parallel ranks.
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

RECORD_ATTR = "ds_muon"
"""The parameter attribute holding its ``MuonRecord``."""


@dataclass
class MuonRecord:
    """DeepSpeed's record of one parameter (every field None until its writer sets it)."""
    choice: Optional[Tuple[bool, str]] = None
    recognized_split: Optional[Tuple[int, Tuple[int, ...]]] = None
    tensor_parallel: Optional[Any] = None


def record(param: torch.Tensor) -> MuonRecord:
    """``param``'s record, created empty on first use."""
    found = getattr(param, RECORD_ATTR, None)
    if found is None:
        found = MuonRecord()
        setattr(param, RECORD_ATTR, found)
    return found


def recorded(param: torch.Tensor) -> MuonRecord:
    """``param``'s record for reading: an empty one (not attached) where it has none."""
    return getattr(param, RECORD_ATTR, None) or MuonRecord()


def tensor_parallel_layout(param: torch.Tensor) -> Optional[Any]:
    """The layout of a weight AutoTP split (``MuonRecord.tensor_parallel``), None for any other."""
    return recorded(param).tensor_parallel
