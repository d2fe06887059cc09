# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's configuration: one typed model of its keys, values and defaults, checked at ``deepspeed.initialize``.

``MuonConfig`` describes ``"optimizer": {"type": "Muon", "params": {...}}`` and ``MuonGroupConfig`` a parameter group
passed as ``model_parameters``; both share ``MuonSettings``'s fields, so each key's type, default, accepted values and
description sit in one place. Keys are checked because the engine builds Muon's parameter groups itself
(``DeepSpeedEngine._muon_param_groups``), keeping only these keys, so a misspelled key (``muon_momentum``) or one of
another optimizer (``amsgrad``, ``ns_steps``) would silently train with the defaults. ``check_muon_keys`` refuses such
keys and values; ``check_muon_groups`` checks variants on the built groups and fills their defaults. Learning rates: a
Muon group's is its own ``lr``, else ``muon_lr``, else ``lr``, else 0.02; an Adam group's its own ``lr``, else
``adam_lr``, else ``lr``, else 3e-4. Modules that read a setting import its key name from here (``variant``'s from
``owner_state.VARIANT_KEY``). This module imports only ``owner_plan``'s constants, ``momentum``, ``owner_state`` and
``support``, none of which imports it, so every Muon module may import it.
"""

import difflib
import math
from typing import Annotated, Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Type

from pydantic import AfterValidator, Field, Strict, StrictBool, StrictStr, ValidationError

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.zero.muon.momentum import is_muon_group
from deepspeed.runtime.zero.muon.owner_plan import DEFAULT_MAX_STEP_MEMORY, STRICT
from deepspeed.runtime.zero.muon.owner_state import MUON, VARIANT_KEY, registered, variants
from deepspeed.runtime.zero.muon.support import spread_problem, where_no_owner_runs

MUON_MATRICES = "Muon matrices"
ADAM = "auxiliary Adam"
BOTH = "both"
IMPLEMENTATION = "auxiliary Adam (implementation)"

PIPELINE_DEPTH_KEY = "pipeline_depth"
BATCH_NS_KEY = "batch_ns"
MAX_STEP_MEMORY_KEY = "max_step_memory"
SPLIT_KEY = "split_fused_muon"
QK_CLIP_KEY = "qk_clip_threshold"
PER_HEAD_KEY = "per_head_muon"
AUTOTP_SIZE_KEY = "tensor_parallel.autotp_size"
"""DeepSpeed's AutoTP key (not a Muon key), named in the errors of Muon's tensor-parallel update."""

DEFAULT_PIPELINE_DEPTH = 2
"""One bucket exchanged while the next is orthogonalized."""
DEFAULT_VARIANT = MUON
DEFAULT_MOMENTUM = 0.95
DEFAULT_NS_METHOD = "gram"
"""Upstream ``Muon``'s defaults (``original_muon.Muon.__init__``)."""


def _finite(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


Number = Annotated[float, Strict(), AfterValidator(_finite)]
"""A finite JSON number (int or float); a bool or a string is refused."""
NonNegative = Annotated[Number, Field(ge=0)]
Fraction = Annotated[Number, Field(ge=0, lt=1)]


def ns_methods() -> frozenset:
    """The ``ns_method`` values upstream's Muon accepts (``original_muon.NS_METHODS``)."""
    from deepspeed.runtime.zero.muon import original_muon
    return frozenset(original_muon.NS_METHODS)


def _ns_method(value):
    if value not in ns_methods():
        raise ValueError("not a Newton-Schulz method")
    return value


def _step_memory(value):
    """A ``max_step_memory``: ``STRICT``, a positive whole number of bytes (JSON's ``8e9`` included), or null."""
    if value is None or value == STRICT:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or not float(value).is_integer():
        raise ValueError("not a step memory")
    return value


def _key(default, reaches: str, description: str):
    """A field whose ``json_schema_extra["reaches"]`` names what the key reaches (``MUON_MATRICES``, ``ADAM``, ...)."""
    return Field(default, description=description, json_schema_extra={"reaches": reaches})


class MuonSettings(DeepSpeedConfigModel):
    """The keys shared by ``optimizer.params`` and a Muon group (whose value wins); descriptions end value errors."""
    lr: Optional[NonNegative] = _key(
        None, BOTH, "the learning rate of both halves where muon_lr / adam_lr (or a group's own lr) do not set it "
        "(a number >= 0; unset: 0.02 for Muon, 3e-4 for Adam)")
    weight_decay: NonNegative = _key(0, BOTH, "decoupled weight decay of both halves (a number >= 0, default 0)")
    momentum: Fraction = _key(DEFAULT_MOMENTUM, MUON_MATRICES,
                              f"Muon's momentum (a number in [0, 1), default {DEFAULT_MOMENTUM})")
    ns_method: Annotated[StrictStr, AfterValidator(_ns_method)] = _key(
        DEFAULT_NS_METHOD, MUON_MATRICES, f"Muon's Newton-Schulz method (default {DEFAULT_NS_METHOD!r})")
    betas: Optional[Tuple[Fraction, Fraction]] = _key(
        None, ADAM, "the auxiliary Adam's (beta1, beta2) (two numbers in [0, 1); unset: the Adam's own default)")
    eps: Optional[NonNegative] = _key(None, ADAM,
                                      "the auxiliary Adam's epsilon (a number >= 0; unset: the Adam's own default)")
    pipeline_depth: Annotated[int, Strict(), Field(ge=1)] = _key(
        DEFAULT_PIPELINE_DEPTH, MUON_MATRICES,
        "buckets of the boundary update in flight ahead of the one being orthogonalized (an integer >= 1, default "
        f"{DEFAULT_PIPELINE_DEPTH}; 1 runs them one after the other, more overlaps more and needs more buffer)")
    batch_ns: Optional[StrictBool] = _key(
        None, MUON_MATRICES, "same-shape Newton-Schulz problems of a bucket in one call (true), one call per matrix "
        "(false), or where it pays (null, the default)")
    max_step_memory: Annotated[Any, AfterValidator(_step_memory)] = _key(
        None, MUON_MATRICES, "bytes Muon's step may add on a rank's accelerator: exchange buffers, owner matrices, "
        "Newton-Schulz working set, a variant's owner state (a positive integer; null or unset: "
        f"{DEFAULT_MAX_STEP_MEMORY} = {DEFAULT_MAX_STEP_MEMORY / 2**30:g} GiB), or \"{STRICT}\" to stay within each "
        "rank's momentum partition where any plan can")
    split_fused_muon: Optional[StrictBool] = _key(
        None, MUON_MATRICES, "orthogonalize each part of a fused projection DeepSpeed recognizes (gate_up_proj, "
        "qkv_proj, c_attn) on its own (true or null, the default) or the fused tensor whole (false)")
    variant: StrictStr = _key(
        DEFAULT_VARIANT, MUON_MATRICES,
        f"the Muon variant (default {DEFAULT_VARIANT!r}, or a registered variant's name; a variant's own keys "
        "beside it)")


class MuonConfig(MuonSettings):
    """``optimizer.params`` of ``"optimizer": {"type": "Muon"}``: ``MuonSettings`` plus the whole optimizer's keys."""
    muon_lr: Optional[NonNegative] = _key(None, MUON_MATRICES,
                                          "the Muon matrices' learning rate, over lr (a number >= 0)")
    adam_lr: Optional[NonNegative] = _key(None, ADAM, "the auxiliary Adam's learning rate, over lr (a number >= 0)")
    adam_w_mode: StrictBool = _key(
        True, ADAM, "decoupled (AdamW, true, the default) or L2 (false) weight decay of the auxiliary Adam")
    torch_adam: Optional[StrictBool] = _key(None, IMPLEMENTATION,
                                            "torch's AdamW for the auxiliary Adam (true or false)")
    foreach: Optional[StrictBool] = _key(None, IMPLEMENTATION,
                                         "torch's foreach implementation with torch_adam (true or false)")
    fp32_optimizer_states: Optional[StrictBool] = _key(None, IMPLEMENTATION,
                                                       "the auxiliary Adam's states in fp32 (true or false)")
    per_head_muon: Optional[StrictBool] = _key(None, MUON_MATRICES,
                                               "attention projections orthogonalized per head (true or false)")
    qk_clip_threshold: Optional[Annotated[Number, Field(gt=0)]] = _key(
        None, "the attention layers (QK-clip after each step)",
        "the largest attention logit QK-clip lets a head keep, a finite number > 0 (Kimi K2 used 100), "
        "or null (the default) for no clipping")


class MuonGroupConfig(MuonSettings):
    """A parameter group passed as ``model_parameters``: ``MuonSettings`` (copied into its Muon or Adam half), its
    tensors and name, and ``moe``, which DeepSpeed's MoE helpers (``create_moe_param_groups``) put in every group."""
    params: Any = _key(None, "the group's tensors", "the group's tensors")
    name: Optional[StrictStr] = _key(None,
                                     "the group's name (its halves are named <name>-muon-params, <name>-adam-params)",
                                     "the group's name (its halves are named <name>-muon-params, <name>-adam-params)")
    moe: Any = _key(None, "set by DeepSpeed's MoE helpers; the MoE split reads the tensors' own attributes",
                    "set by DeepSpeed's MoE helpers")


UPDATE_KEYS = (PIPELINE_DEPTH_KEY, BATCH_NS_KEY, MAX_STEP_MEMORY_KEY, SPLIT_KEY)
"""The distributed update's settings, per Muon group (read once, when the ZeRO optimizer is built)."""


def _reaches(model: Type[MuonSettings]) -> dict:
    return {name: field.json_schema_extra["reaches"] for name, field in model.model_fields.items()}


def has_per_head_muon() -> bool:
    """Whether the installed DeepSpeed has per-head Muon (``per_head_muon``)."""
    import deepspeed
    return hasattr(deepspeed, "resolve_per_head_muon_after_sharding")


def has_qk_clip() -> bool:
    """Whether the installed DeepSpeed has MuonClip's QK-clip (``muon.qk_clip``)."""
    import importlib.util
    return importlib.util.find_spec("deepspeed.runtime.zero.muon.qk_clip") is not None


def _variant_keys() -> List[str]:
    return sorted({k for v in registered().values() for k in v.defaults})


def muon_group_keys() -> tuple:
    """Keys the engine copies into each Muon group besides ``momentum``, ``ns_method``, ``lr`` and ``weight_decay``."""
    return (*UPDATE_KEYS, VARIANT_KEY, *_variant_keys())


def config_keys() -> Mapping[str, str]:
    """Every key of ``optimizer.params`` and the half it reaches: ``MuonConfig``'s fields (``per_head_muon`` and
    ``qk_clip_threshold`` only where this DeepSpeed has them) and every registered variant's keys."""
    available = {PER_HEAD_KEY: has_per_head_muon(), QK_CLIP_KEY: has_qk_clip()}
    keys = {k: v for k, v in _reaches(MuonConfig).items() if available.get(k, True)}
    keys.update({k: MUON_MATRICES for k in _variant_keys() if k not in keys})
    return keys


def group_keys() -> Mapping[str, str]:
    """Every key of a Muon parameter group and what it reaches, registered variants' keys included."""
    return {**_reaches(MuonGroupConfig), **{k: MUON_MATRICES for k in _variant_keys()}}


GROUP_HINTS: Mapping[str, str] = {
    "use_muon":
    "which half a tensor goes to is its own flag: set param.use_muon on the tensors instead",
    "muon_lr":
    "a group's lr applies to both of its halves; for different rates put the tensors in groups of their own",
    "adam_lr":
    "a group's lr applies to both of its halves; for different rates put the tensors in groups of their own",
    QK_CLIP_KEY:
    "a key of the whole optimizer (QK-clip acts on attention heads, whose query and key weights may lie in "
    "different groups; set it in optimizer.params)",
}
"""Why a key that is accepted in ``optimizer.params`` (or elsewhere) does nothing in a group."""

FIXED_SETTINGS = {
    "ns_steps": " (Newton-Schulz always runs upstream's 5 iterations)",
    "nesterov": " (Muon always uses the Nesterov blend of gradient and momentum)",
}
"""Keys users carry over from other Muon implementations, for settings DeepSpeed's Muon fixes."""


def _accepted(keys: Iterable[str]) -> str:
    return ", ".join(sorted(keys))


def did_you_mean(value, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the choice closest to ``value`` (lower-cased, ``difflib`` ratio >= 0.75), else "":
    "Gram" -> 'gram', ``muon_momentum`` -> 'momentum'; ``ns_steps`` gets none (0.47 from ``ns_method``)."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value.lower(), sorted(choices), n=1, cutoff=0.75)
    return f" Did you mean {close[0]!r}?" if close else ""


def _value_problem(model: Type[MuonSettings], key: str, value, where: str) -> str:
    if key == "ns_method":
        return (f"{where}.ns_method: {value!r} is not a Newton-Schulz method of Muon. "
                f"Accepted: {_accepted(ns_methods())}.{did_you_mean(value, ns_methods())}")
    guess = did_you_mean(value, (STRICT, )) if key == MAX_STEP_MEMORY_KEY else ""
    return f"{where}.{key}: {value!r} is invalid; {model.model_fields[key].description}.{guess}"


def value_problems(model: Type[MuonSettings], settings: Mapping[str, Any], where: str) -> List[str]:
    """One message per value of ``settings`` (a config block or group named ``where``) that its field of ``model``
    refuses, in field order; keys that are not fields are left to ``check_muon_keys``."""
    known = {k: v for k, v in settings.items() if k in model.model_fields}
    try:
        model(strict=True, **known)  # strict: "auto" is a value like any other, refused where a number belongs
    except ValidationError as error:
        refused = {e["loc"][0] for e in error.errors() if e["loc"]}
        return [_value_problem(model, k, known[k], where) for k in model.model_fields if k in refused]
    return []


def _settings_blocks(optimizer_parameters: Mapping[str, Any], model_parameters):
    """``(where, settings, model)`` of ``optimizer.params`` and each dict in a list or tuple ``model_parameters``."""
    yield "optimizer.params", optimizer_parameters or {}, MuonConfig
    if isinstance(model_parameters, (list, tuple)):
        for index, group in enumerate(model_parameters):
            if isinstance(group, dict):
                yield f"model_parameters[{index}]", group, MuonGroupConfig


def check_muon_keys(optimizer_parameters: Mapping[str, Any], model_parameters) -> None:
    """Refuse each key of the Muon block and its parameter groups that the engine would drop, and each value its field
    in ``MuonConfig`` / ``MuonGroupConfig`` does not accept.

    Args:
        optimizer_parameters: the config's ``optimizer.params`` (not modified).
        model_parameters: ``deepspeed.initialize``'s; only a list or tuple of group dicts is checked (a generator is
            not consumed).

    Raises:
        ValueError: one message listing each unknown key (``optimizer.params.<key>`` or
            ``model_parameters[<i>].<key>``, with the keys accepted there; ``per_head_muon`` where this DeepSpeed lacks
            it), then each refused value as ``<where>.<key>: <value> is invalid; <what the key accepts>``, with the
            closest accepted name where one is close.
    """
    accepted, accepted_in_groups = config_keys(), group_keys()
    problems, values = [], []
    for where, settings, model in _settings_blocks(optimizer_parameters, model_parameters):
        in_group = model is MuonGroupConfig
        for key in settings:
            if key in (accepted_in_groups if in_group else accepted):
                continue
            if in_group:
                if key in GROUP_HINTS:
                    why, guess = f"does nothing in a parameter group: {GROUP_HINTS[key]}", ""
                else:
                    why = "not a key of a Muon parameter group, so it would do nothing"
                    guess = did_you_mean(key, accepted_in_groups)
                problems.append(f"{where}.{key}: {why}. Accepted: {_accepted(accepted_in_groups)}.{guess}")
            elif key == PER_HEAD_KEY:
                problems.append(f"optimizer.params.{PER_HEAD_KEY}: this DeepSpeed has no per-head Muon, so the key "
                                "would do nothing; remove it.")
            else:
                hint = FIXED_SETTINGS.get(key) or ""
                problems.append(
                    f"optimizer.params.{key}: not a key of the Muon optimizer, so it would do nothing"
                    f"{hint}. Accepted: {_accepted(accepted)}.{'' if hint else did_you_mean(key, accepted)}")
        values += value_problems(model, settings, where)
    sections = []
    if problems:
        sections.append("The Muon optimizer's configuration has keys that would do nothing:\n" +
                        "\n".join(f"- {problem}" for problem in problems))
    if values:
        sections.append("The Muon optimizer's configuration has values it cannot use:\n" +
                        "\n".join(f"- {value}" for value in values))
    if sections:
        raise ValueError("\n".join(sections))


def _variant_problems(settings: Mapping[str, Any], where: str) -> List[str]:
    variant = settings.get(VARIANT_KEY, DEFAULT_VARIANT)
    problems = []
    if variant not in variants():
        problems.append(f"{where}.{VARIANT_KEY}: {variant!r} is not a Muon variant; accepted: "
                        f"{', '.join(repr(v) for v in variants())}.{did_you_mean(variant, variants())}")
    for cls in registered().values():
        problems += cls.key_problems(settings, where)
    return problems


def check_muon_groups(optimizer_parameters: Mapping[str, Any], model_parameters, param_groups: Sequence[dict],
                      engine) -> None:
    """Check the variant settings on the groups the engine built (right after ``_muon_param_groups``) and fill each
    variant's defaults into the Muon groups using it, so checkpoints record them.

    Args:
        optimizer_parameters, model_parameters: as for ``check_muon_keys``.
        param_groups: the groups the engine built (``use_muon`` halves); modified as above.
        engine: the ``DeepSpeedEngine`` (its ZeRO stage, data types and offload).

    Raises:
        ValueError: naming each key: an unknown ``variant``, a setting its variant refuses (``key_problems``), a
            variant's settings no Muon group uses, a variant or an AutoTP-split weight where no owner rank runs the
            update (``support``).
    """
    problems = [
        p for where, settings, _ in _settings_blocks(optimizer_parameters, model_parameters)
        for p in _variant_problems(settings, where)
    ]
    muon_groups = [g for g in param_groups if is_muon_group(g)]
    if not problems and muon_groups:
        used = {g.get(VARIANT_KEY, DEFAULT_VARIANT) for g in muon_groups}
        for name, cls in sorted(registered().items()):
            unused = sorted({k for g in muon_groups for k in cls.defaults if k in g})
            if unused and name not in used:
                problems.append(f"{', '.join(unused)} (optimizer.params or a parameter group): {name}'s settings, "
                                f"but no Muon group has {VARIANT_KEY} {name!r}, so they would do nothing; add "
                                f"\"{VARIANT_KEY}\": \"{name}\" or remove them.")
    spread = spread_problem(muon_groups, engine) if not problems and muon_groups else None
    if spread is not None:
        problems.append(spread)
    if not problems:
        for group in muon_groups:
            cls = registered().get(group.get(VARIANT_KEY, DEFAULT_VARIANT))
            if cls is None:
                continue
            where = where_no_owner_runs(engine)
            if where is not None:
                problems.append(f"optimizer.params.{VARIANT_KEY}: {cls.name!r} needs ZeRO stage 1, 2 or 3 (its "
                                "state lives on the rank that orthogonalizes each matrix), and does not run with "
                                f"{where}; use the default variant {DEFAULT_VARIANT!r} there.")
                break
            for key, default in cls.defaults.items():
                group.setdefault(key, default)
    if problems:
        raise ValueError("The Muon optimizer's variant and tensor-parallel settings are invalid:\n" +
                         "\n".join(f"- {p}" for p in problems))
