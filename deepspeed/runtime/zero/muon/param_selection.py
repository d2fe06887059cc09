# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which parameters DeepSpeed's Muon optimizer orthogonalizes and which go to its auxiliary Adam.

The rule (``select_muon_parameters``, from ``deepspeed.set_optimizer_flags``), per parameter, first match wins:

1. ``param.use_muon`` set by the user before ``deepspeed.initialize``: kept (True on a non-matrix: ``ValueError``).
2. Fewer than 2 dimensions as a layer (``ds_shape`` under ``zero.Init``): Adam.
3. Owned by an ``nn.Embedding`` / ``nn.EmbeddingBag``, or tied to one (same ``Parameter``, or outside ZeRO-3 same
   storage): Adam, as Muon's author advises AdamW for the input embedding and the output layer.
4. Name contains ``embed`` or ``lm_head`` (case-insensitive; upstream's rule, kept so nothing it sent to Adam moves to
   Muon): Adam.
5. Otherwise: Muon.

Each choice made here is recorded (``MuonRecord.choice``); a ``use_muon`` equal to DeepSpeed's record is decided
again, so a second ``initialize`` of the same model is not mistaken for user intent.

At ``deepspeed.initialize`` (``resolve_optimizer_selection``, before ZeRO flattens the groups), a client
``MuonWithAuxAdam`` has each tensor tagged from its group (the ZeRO optimizers read ``use_muon`` per tensor); any other
client Muon (a class name containing "Muon", or groups carrying ``use_muon``) is refused at ZeRO stage >= 1, where it
would run Newton-Schulz on 1-D partitions; at stage 0 it sees whole tensors and is allowed. Rank 0 logs the selection
at WARNING (INFO is hidden by default) and the engine keeps it as ``engine.muon_selection``.
"""

import dataclasses
import math
import types
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.momentum import is_muon_group, is_muon_optimizer
from deepspeed.runtime.zero.muon.newton_schulz import SPLIT_ATTR, SPLIT_KEY, Split
from deepspeed.runtime.zero.muon.param_record import record, recorded

USER = "set by the user"
NOT_MATRIX = "not a matrix"
EMBEDDING = "embedding"
TIED = "tied to an embedding"
NAME_RULE = "name rule"
MATRIX = "matrix"
PARAM_GROUP = "param group"
UNKNOWN = "tagged before"

NAME_KEYWORDS = ("embed", "lm_head")
"""Name parts that send a parameter to Adam (DeepSpeed's original rule)."""

LISTED_NAMES = 20
"""Names the report lists before "... and N more"."""

REFERENCE_CONFIG = '"optimizer": {"type": "Muon"}'


@dataclasses.dataclass(frozen=True)
class MuonSelection:
    """What goes to Muon and what to the auxiliary Adam.

    Attributes:
        muon / adam: names of the trained parameters on Muon / the auxiliary Adam, in ``named_parameters`` order.
        muon_numel / adam_numel: their elements (layer sizes, also under ``zero.Init``).
        adam_matrices: names in ``adam`` whose layer has >= 2 dimensions (embeddings, tied heads, user choices).
        frozen: names of parameters not trained (``requires_grad`` False, or in no optimizer group).
        reasons: name -> why it went where it did (one of the reason constants above).
    """
    muon: Tuple[str, ...]
    adam: Tuple[str, ...]
    muon_numel: int
    adam_numel: int
    adam_matrices: Tuple[str, ...] = ()
    frozen: Tuple[str, ...] = ()
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False, compare=False)


def layer_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """``ds_shape`` under ZeRO-3 (a placeholder, ``torch.Size([0])`` on ranks not holding it), else the shape."""
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if ds_shape is None else tuple(ds_shape)


def layer_numel(param: torch.Tensor) -> int:
    return math.prod(layer_shape(param))


def user_flag(param: torch.Tensor) -> Optional[bool]:
    """The user's ``use_muon`` on ``param``, or None when it has none (or only DeepSpeed's)."""
    if not hasattr(param, "use_muon"):
        return None
    choice = recorded(param).choice
    if choice is not None and choice[1] != USER and bool(param.use_muon) == choice[0]:
        return None
    return bool(param.use_muon)


def _tag(param: torch.Tensor, use_muon: bool, reason: str) -> None:
    param.use_muon = use_muon
    record(param).choice = (use_muon, reason)


def _storage_key(param: torch.Tensor):
    """Where a whole (not ZeRO-3 partitioned, not meta) tensor's data lives, or None."""
    if hasattr(param, "ds_id") or param.numel() == 0 or param.device.type == "meta":
        return None
    return (param.device, param.data_ptr(), tuple(param.shape), tuple(param.stride()))


def embedding_weights(model: torch.nn.Module):
    """``(ids, storages)`` of every parameter an ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` owns directly."""
    ids, storages = set(), set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            for param in module.parameters(recurse=False):
                ids.add(id(param))
                key = _storage_key(param)
                if key is not None:
                    storages.add(key)
    return ids, storages


def rule(name: str, param: torch.Tensor, embeddings=None) -> Tuple[bool, str]:
    """DeepSpeed's ``(use_muon, reason)`` for a parameter, ignoring flags; ``embeddings``: ``embedding_weights``."""
    if len(layer_shape(param)) < 2:
        return False, NOT_MATRIX
    ids, storages = embeddings or (set(), set())
    if id(param) in ids:
        return False, EMBEDDING
    key = _storage_key(param)
    if key is not None and key in storages:
        return False, TIED
    if any(keyword in name.lower() for keyword in NAME_KEYWORDS):
        return False, NAME_RULE
    return True, MATRIX


def select_muon_parameters(model: torch.nn.Module) -> MuonSelection:
    """Tag every parameter with ``use_muon`` by the module docstring's rule; return the trainable ``MuonSelection``.

    Raises:
        ValueError: the user set ``use_muon = True`` on a non-matrix (it would fail at the first step).
    """
    embeddings = embedding_weights(model)
    for name, param in model.named_parameters():
        flag = user_flag(param)
        if flag is None:
            _tag(param, *rule(name, param, embeddings))
            continue
        if flag and len(layer_shape(param)) < 2:
            raise ValueError(f"{name} has use_muon = True but is not a matrix (shape {layer_shape(param)}); Muon "
                             "orthogonalizes parameters with at least 2 dimensions. Set use_muon = False on it "
                             "or leave it unset.")
        _tag(param, flag, USER)
    return model_selection(model)


EXPERTS_GATE_UP_ROWS = frozenset(
    ("AXK1Experts", "AXK2Experts", "AfmoeExperts", "BailingHybridExperts", "Cohere2MoeExperts",
     "DeepseekOcr2TextExperts", "DeepseekV2Experts", "DeepseekV32Experts", "DeepseekV3Experts",
     "DiffusionGemmaTextExperts", "Dots1Experts", "Dots3NoteExperts", "Ernie4_5_MoeExperts",
     "Ernie4_5_VLMoeMoeExperts", "ExaoneMoeExperts", "FlexOlmoExperts", "FlintExperts", "Gemma4TextExperts",
     "Glm4MoeExperts", "Glm4MoeLiteExperts", "Glm4vMoeTextExperts", "GlmMoeDsaExperts", "GraniteMoeExperts",
     "GraniteMoeHybridExperts", "GraniteMoeSWAExperts", "GraniteMoeSharedExperts", "HYV3Experts",
     "HunYuanMoEV1Experts", "InklingExperts", "JambaExperts", "KimiLinearExperts", "Kolibri1Experts", "LagunaExperts",
     "LaraMiniExperts", "Lfm2MoeExperts", "LongcatFlashExperts", "MellumExperts", "MiMoV2FlashExperts",
     "MiniMaxExperts", "MiniMaxM2Experts", "Mistral4Experts", "MistralLarge4TextExperts", "MixtralExperts",
     "MuseSparkExperts", "OlmoeExperts", "PhimoeExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "Qwen3NextExperts",
     "Qwen3OmniMoeTalkerTextExperts", "Qwen3OmniMoeThinkerTextExperts", "Qwen3VLMoeTextExperts", "Qwen3_5MoeExperts",
     "Qwen4ExpTextExperts", "SolarOpenExperts", "UnlimitedOcrTextExperts", "ZayaExperts"))
"""transformers 5 experts modules whose ``gate_up_proj`` is ``(experts, 2 I, H)``, gate and up the halves of its rows
(found in transformers 5.24 by their forward's ``chunk(2, dim=-1)``). Interleaved layouts (GPT-OSS) are not listed."""
EXPERTS_GATE_UP_COLUMNS = frozenset(("AriaExperts", "Llama4TextExperts"))
"""Experts modules whose ``gate_up_proj`` is ``(experts, H, 2 I)``, gate and up the two halves of its columns."""
LINEAR_GATE_UP = frozenset(
    ("DiaMLP", "Dots3NoteAudioMLP", "EsmFold2SwiGLU", "Glm4MLP", "Glm4vTextMLP", "GlmImageTextMLP", "GlmMLP",
     "GlmOcrTextMLP", "MiniMaxM3VLDenseMLP", "Phi3MLP", "Phi4MultimodalAudioMLP", "Phi4MultimodalMLP"))
"""MLP modules whose ``gate_up_proj`` is a ``Linear`` of ``2 I`` outputs chunked into gate and up."""
QKV_ROWS = frozenset(("Phi3Attention", "Phi4MultimodalAttention"))
"""Attention modules whose ``qkv_proj`` ``Linear`` holds query, key and value rows (``num_attention_heads``,
``num_key_value_heads``, ``num_key_value_heads`` heads of ``head_dim``)."""
C_ATTN_COLUMNS = frozenset(("GPT2Attention", "DecisionTransformerGPT2Attention", "ImageGPTAttention"))
"""Attention modules whose ``c_attn`` ``Conv1D`` holds q, k, v (k, v if cross-attention) in ``split_size`` columns."""


def recognized_split(parent, path: Tuple[str, ...], shape: Sequence[int]) -> Optional[Split]:
    """The split of parameter ``path`` of ``parent`` (``("gate_up_proj",)``: its own; ``("qkv_proj", "weight")``: a
    child's) of whole ``shape``, for the layouts listed above by ``parent``'s class and PyTorch's
    ``MultiheadAttention.in_proj_weight``; else None (kept whole)."""
    shape, kind = tuple(shape), type(parent).__name__
    if path == ("in_proj_weight", ) and isinstance(parent, torch.nn.MultiheadAttention) and shape[0] % 3 == 0:
        return (-2, (shape[0] // 3, ) * 3)  # query, key and value rows of ``embed_dim`` each
    if path == ("gate_up_proj", ) and len(shape) == 3:
        if kind in EXPERTS_GATE_UP_ROWS and shape[-2] % 2 == 0:
            return (-2, (shape[-2] // 2, ) * 2)
        if kind in EXPERTS_GATE_UP_COLUMNS and shape[-1] % 2 == 0:
            return (-1, (shape[-1] // 2, ) * 2)
        return None
    if len(path) != 2 or path[1] != "weight" or len(shape) != 2:
        return None
    if path[0] == "gate_up_proj" and kind in LINEAR_GATE_UP and shape[0] % 2 == 0:
        return (-2, (shape[0] // 2, ) * 2)
    if path[0] == "qkv_proj" and kind in QKV_ROWS:
        config, head_dim = getattr(parent, "config", None), getattr(parent, "head_dim", None)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if all(isinstance(n, int) for n in (head_dim, heads, kv_heads)):
            sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
            if sum(sizes) == shape[0]:
                return (-2, sizes)
    if path[0] == "c_attn" and kind in C_ATTN_COLUMNS:
        width = getattr(parent, "split_size", None)
        if isinstance(width, int) and width > 0 and shape[1] % width == 0 and shape[1] > width:
            return (-1, (width, ) * (shape[1] // width))
    return None


def whole_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """An AutoTP shard's whole shape (from the map AutoTP records on it), else ``layer_shape``."""
    meta = getattr(param, "ds_autotp_universal_checkpoint_meta", None) or {}
    described = meta.get("conversion", {}).get("affine_map")
    return tuple(described["logical_shape"]) if described else layer_shape(param)


def tag_fused_projections(model: torch.nn.Module) -> Dict[str, Split]:
    """Set ``muon_split`` (and its record) on each recognized Muon parameter the user did not; return name -> split."""
    tagged = {}
    for module_name, parent in model.named_modules():
        found = [((leaf, ), p) for leaf, p in parent.named_parameters(recurse=False)]
        found += [((attribute, "weight"), child.weight) for attribute, child in parent.named_children()
                  if isinstance(getattr(child, "weight", None), torch.nn.Parameter)]
        for path, param in found:
            if not getattr(param, "use_muon", False):
                continue
            if getattr(param, SPLIT_ATTR, None) is not None and recorded(param).recognized_split is None:
                continue  # the user's own
            split = recognized_split(parent, path, whole_shape(param))
            if split is not None:
                setattr(param, SPLIT_ATTR, split)
                record(param).recognized_split = split
                tagged[".".join((module_name, ) + path if module_name else path)] = split
    return tagged


def check_split(split, shape: Sequence[int], where: str, num_heads=None) -> Split:
    """``split`` as ``(dim, sizes)``, ``dim`` -2 or -1 of ``shape`` (2-D or 3-D).

    Raises:
        ValueError: ``num_heads`` too, not ``(dim, sizes)``, ``shape`` not 2-D/3-D, another ``dim``, or sizes not
            positive or not summing to ``shape[dim]``.
    """
    if num_heads is not None:
        raise ValueError(f"muon_split and muon_num_heads (per_head_muon) on {where}: orthogonalize it per head or "
                         "per part, not both.")
    try:
        dim, sizes = split
        dim, sizes = int(dim), tuple(int(s) for s in sizes)
    except (TypeError, ValueError):
        raise ValueError(
            f"muon_split of {where}: {split!r}; expected (dim, sizes), e.g. (-2, (1024, 1024)).") from None
    shape = tuple(shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"muon_split of {where}: a tensor of shape {shape}; parts are split from a matrix or a "
                         "batch of matrices (2-D or 3-D).")
    if dim >= 0:
        dim -= len(shape)
    if dim not in (-2, -1):
        raise ValueError(f"muon_split of {where}: dim {split[0]} of shape {shape}; parts lie along the rows (-2) "
                         "or the columns (-1).")
    if len(sizes) < 2 or min(sizes) < 1 or sum(sizes) != shape[dim]:
        raise ValueError(f"muon_split of {where}: sizes {sizes} along dim {dim} of shape {shape}; they must be "
                         f"two or more positive sizes summing to {shape[dim]}.")
    return dim, sizes


def _reason(param) -> str:
    choice = recorded(param).choice
    return choice[1] if choice is not None and choice[0] == bool(param.use_muon) else UNKNOWN


def _build(entries: Iterable, frozen: Iterable[str]) -> MuonSelection:
    """``entries``: ``(name, param, use_muon)`` of the trained parameters."""
    muon, adam, adam_matrices, reasons = [], [], [], {}
    muon_numel = adam_numel = 0
    for name, param, use_muon in entries:
        reasons[name] = _reason(param) if hasattr(param, "use_muon") else UNKNOWN
        if use_muon:
            muon.append(name)
            muon_numel += layer_numel(param)
        else:
            adam.append(name)
            adam_numel += layer_numel(param)
            if len(layer_shape(param)) >= 2:
                adam_matrices.append(name)
    return MuonSelection(muon=tuple(muon),
                         adam=tuple(adam),
                         muon_numel=muon_numel,
                         adam_numel=adam_numel,
                         adam_matrices=tuple(adam_matrices),
                         frozen=tuple(frozen),
                         reasons=types.MappingProxyType(reasons))


def model_selection(model: torch.nn.Module) -> MuonSelection:
    """The selection the ``use_muon`` tags of ``model`` describe (untagged parameters count as Adam)."""
    named = list(model.named_parameters())
    return _build([(n, p, bool(getattr(p, "use_muon", False))) for n, p in named if p.requires_grad],
                  [n for n, p in named if not p.requires_grad])


def optimizer_selection(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> MuonSelection:
    """The selection the groups' ``use_muon`` make, named from ``model`` (else ``group<g>.param<i>``)."""
    named = list(model.named_parameters()) if model is not None else []
    position = {id(p): (0, i, n) for i, (n, p) in enumerate(named)}
    entries, trained = [], set()
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if not param.requires_grad or id(param) in trained:
                continue
            trained.add(id(param))
            key = position.get(id(param), (1, len(entries), f"group{g}.param{i}"))
            entries.append((key, param, is_muon_group(group)))
    # The model's order (Muon groups come sorted by size), then the parameters the model lacks.
    entries = [(key[2], param, use_muon) for key, param, use_muon in sorted(entries, key=lambda e: e[0][:2])]
    return _build(entries, [n for n, p in named if id(p) not in trained])


def _listed(names: Tuple[str, ...], limit: int) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def format_report(selection: MuonSelection, limit: int = LISTED_NAMES) -> Tuple[str, ...]:
    """Rank 0's WARNING lines: counts, Muon names, Adam matrices with reasons (cut at ``limit``), all-Adam warning."""
    adam_matrices = tuple(f"{name} ({selection.reasons.get(name, UNKNOWN)})" for name in selection.adam_matrices)
    lines = [
        f"Muon optimizer: {len(selection.muon)} parameters ({selection.muon_numel:,} elements) on Muon, "
        f"{len(selection.adam)} parameters ({selection.adam_numel:,} elements) on the auxiliary Adam. "
        f"On Muon: {_listed(selection.muon, limit) or 'none'}. "
        f"Matrices on Adam: {_listed(adam_matrices, limit) or 'none'}. " +
        ("The optimizer's parameter groups decide (their use_muon); engine.muon_selection holds the lists."
         if PARAM_GROUP in selection.reasons.values() else
         "Set param.use_muon before deepspeed.initialize to override; engine.muon_selection holds the lists.")
    ]
    if not selection.muon:
        lines.append(f"The Muon optimizer has no parameter on Muon: all {len(selection.adam)} trained parameters "
                     "go to its auxiliary Adam, so this run trains with Adam alone.")
    return tuple(lines)


def _looks_like_muon(optimizer) -> bool:
    return "muon" in type(optimizer).__name__.lower() or any("use_muon" in g for g in optimizer.param_groups)


def tag_client_groups(optimizer, model: Optional[torch.nn.Module]) -> None:
    """Tag each tensor of a client ``MuonWithAuxAdam`` with its group's ``use_muon``: the ZeRO optimizers decide per
    tensor and would step an untagged one as plain SGD.

    Raises:
        ValueError: a user flag contradicts its group's ``use_muon``, or a ``use_muon=True`` group holds a non-matrix.
    """
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for g, group in enumerate(optimizer.param_groups):
        group_flag = is_muon_group(group)
        for i, param in enumerate(group["params"]):
            name = names.get(id(param), f"param {i} of group {g}")
            flag = user_flag(param)
            if flag is not None and flag != group_flag:
                raise ValueError(f"{name} has use_muon = {flag}, but the optimizer's parameter group {g} it is in has "
                                 f"use_muon = {group_flag}. Put it in a group with use_muon = {flag}, or change "
                                 "its flag.")
            if group_flag and len(layer_shape(param)) < 2:
                raise ValueError(f"{name} (shape {layer_shape(param)}) is in parameter group {g} with use_muon = "
                                 "True, but Muon orthogonalizes matrices only; put it in a use_muon = False group.")
            _tag(param, group_flag, PARAM_GROUP if flag is None else USER)


def refuse_flat_partition_muon(optimizer, zero_stage: int) -> None:
    """Refuse a client Muon other than ``MuonWithAuxAdam`` at ZeRO stage >= 1: it (e.g. Keller Jordan's) would run
    Newton-Schulz on a 1-D flat partition, failing ``G.ndim >= 2`` or training something other than Muon.

    Raises:
        ValueError: naming the class and the config to use instead.
    """
    if zero_stage < 1 or not _looks_like_muon(optimizer) or is_muon_optimizer(optimizer):
        return
    cls = type(optimizer)
    raise ValueError(f"The client optimizer {cls.__module__}.{cls.__qualname__} looks like Muon (its name, or param "
                     f"groups with use_muon), and ZeRO stage {zero_stage} hands an optimizer flat 1-D partitions "
                     "of the parameters, on which Muon's Newton-Schulz cannot run. Use DeepSpeed's Muon instead: "
                     f"{REFERENCE_CONFIG} in the config (parameters choose with param.use_muon), or pass "
                     "deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam; or use ZeRO stage 0.")


def resolve_optimizer_selection(optimizer,
                                model: Optional[torch.nn.Module],
                                client: bool,
                                zero_stage: int,
                                log=None) -> Optional[MuonSelection]:
    """The engine's hook on the basic optimizer, before any ZeRO wrapper replaces its groups: checks and tags a
    client's groups, checks ``muon_split``s; for DeepSpeed's Muon logs the selection on rank 0 (to ``log``, default
    DeepSpeed's logger) and returns it, else None.
    """
    if not _looks_like_muon(optimizer):
        return None
    if client:
        refuse_flat_partition_muon(optimizer, zero_stage)
    if not is_muon_optimizer(optimizer):
        return None
    if client:
        tag_client_groups(optimizer, model)
    selection = optimizer_selection(optimizer, model)
    if model is not None:
        tag_fused_projections(model)
    whole = {
        id(p)
        for g in optimizer.param_groups if is_muon_group(g) and g.get(SPLIT_KEY) is False for p in g["params"]
    }
    fused, kept = {}, []
    for name, param in model.named_parameters() if model is not None else ():
        if getattr(param, "use_muon", False) and getattr(param, SPLIT_ATTR, None) is not None:
            setattr(
                param, SPLIT_ATTR,
                check_split(getattr(param, SPLIT_ATTR), whole_shape(param), name,
                            getattr(param, "muon_num_heads", None)))
            recognized = recorded(param).recognized_split is not None
            if recognized and id(param) in whole:
                kept.append(name)
            else:
                fused[name] = f"{getattr(param, SPLIT_ATTR)}{'' if recognized else ' (yours)'}"
    import deepspeed.comm as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        if log is None:
            from deepspeed.utils import logger as log
        for line in format_report(selection):
            log.warning(line)
        if fused or kept:
            where = ("not at ZeRO stage 0, where upstream's Muon orthogonalizes every tensor whole"
                     if zero_stage == 0 else "at ZeRO stages 1 to 3, not under ZeRO-1's BF16_Optimizer")
            parts = []
            if fused:
                parts.append(f"{len(fused)} fused projection(s) hold several matrices; each part is orthogonalized "
                             f"on its own ({where}): "
                             f"{_listed(tuple(f'{n} {s}' for n, s in fused.items()), LISTED_NAMES)}")
            if kept:
                parts.append(f"{len(kept)} fused projection(s) kept whole ({SPLIT_KEY} false): "
                             f"{_listed(tuple(kept), LISTED_NAMES)}")
            log.warning("Muon: " + "; ".join(parts))
    return selection
