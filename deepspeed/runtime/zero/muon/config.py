# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's configuration, checked at ``deepspeed.initialize``: its keys, their values, the variants.

The engine builds Muon's parameter groups itself (``DeepSpeedEngine._muon_param_groups``): it
reads a fixed set of keys from ``"optimizer": {"type": "Muon", "params": {...}}`` and from each
parameter group passed as ``model_parameters``, and drops every other key. A misspelled key
(``muon_momentum``, ``lr_muon``) or one meant for another optimizer (``amsgrad``, ``ns_steps``)
therefore trained silently with the defaults. ``check_muon_keys`` (called where the engine
builds Muon) refuses such a key with a ``ValueError`` naming it and the accepted keys, as
DeepSpeed's own config sections refuse unknown fields. It also refuses an ``ns_method`` that is
not one of upstream's Newton-Schulz methods (``original_muon.NS_METHODS``: "gram", "standard",
and "polar_express" with patch 0017), which the optimizer would otherwise reject with a bare
``AssertionError`` (``MuonWithAuxAdam``), or, where nothing checks it, run as "standard".

The distributed update's settings (``pipeline_depth``, ``batch_ns``: ``binding``) and a variant's
(``variant`` and the registered variants' own keys, ``owner_state``) reach the Muon groups like
``momentum`` (``muon_group_keys``); ``check_muon_groups`` checks them on the groups the engine built,
fills each variant's defaults in, and refuses a variant where no owner rank runs the update.

Precedence of the learning rates: a Muon group's rate is the parameter group's own ``lr``, else
``muon_lr``, else ``lr``, else 0.02; an Adam group's the group's own ``lr``, else ``adam_lr``,
else ``lr``, else 3e-4.
"""

import difflib
from typing import Any, Iterable, List, Mapping, Optional, Sequence

from deepspeed.runtime.zero.muon.binding import BATCH_NS_KEY, MAX_STEP_MEMORY_KEY, PIPELINE_DEPTH_KEY, SPREAD_ATTR
from deepspeed.runtime.zero.muon.newton_schulz import SPLIT_KEY
from deepspeed.runtime.zero.muon.momentum import is_muon_group
from deepspeed.runtime.zero.muon.owner_plan import DEFAULT_MAX_STEP_MEMORY, STRICT
from deepspeed.runtime.zero.muon.owner_state import MUON, VARIANT_KEY, registered, variants

MUON_MATRICES = "Muon matrices"
ADAM = "auxiliary Adam"
BOTH = "both"
IMPLEMENTATION = "auxiliary Adam (implementation)"

CONFIG_KEYS: Mapping[str, str] = {
    "lr": BOTH,
    "muon_lr": MUON_MATRICES,
    "adam_lr": ADAM,
    "momentum": MUON_MATRICES,
    "ns_method": MUON_MATRICES,
    "weight_decay": BOTH,
    "betas": ADAM,
    "eps": ADAM,
    "adam_w_mode": ADAM,
    "torch_adam": IMPLEMENTATION,
    "foreach": IMPLEMENTATION,
    "fp32_optimizer_states": IMPLEMENTATION,
}
"""Keys of ``optimizer.params`` the engine reads for Muon, and which half each reaches
(``per_head_muon`` too, on a DeepSpeed that has per-head Muon, and the keys the engine copies
into Muon's half beyond these: ``config_keys``)."""

GROUP_KEYS: Mapping[str, str] = {
    "params": "the group's tensors",
    "name": "the group's name (its halves are named <name>-muon-params, <name>-adam-params)",
    "lr": BOTH,
    "weight_decay": BOTH,
    "momentum": MUON_MATRICES,
    "ns_method": MUON_MATRICES,
    "betas": ADAM,
    "eps": ADAM,
    "moe": "set by DeepSpeed's MoE helpers; the MoE split reads the tensors' own attributes",
}
"""Keys of a parameter group passed as ``model_parameters`` with the Muon optimizer: the keys
``_muon_param_groups`` copies into the group's Muon or Adam half (``_MUON_HALF_KEYS``,
``_ADAM_HALF_KEYS``), the group's tensors and name, and ``moe``, which DeepSpeed's MoE helpers
(``create_moe_param_groups``) put in every group they build; plus the keys the engine copies into
Muon's half beyond these (``group_keys``)."""


def has_per_head_muon() -> bool:
    """Whether the installed DeepSpeed has per-head Muon (``per_head_muon``)."""
    import deepspeed
    return hasattr(deepspeed, "resolve_per_head_muon_after_sharding")


UPDATE_KEYS: Mapping[str, str] = {
    PIPELINE_DEPTH_KEY:
    "buckets of the boundary update in flight ahead of the one being orthogonalized (an "
    "integer >= 1, default 2; 1 runs them one after the other, more overlaps more and needs more buffer)",
    BATCH_NS_KEY:
    "same-shape Newton-Schulz problems of a bucket in one call (true), one call per matrix (false), "
    "or where it pays (null, the default)",
    MAX_STEP_MEMORY_KEY:
    f"bytes Muon's step may add on a rank's accelerator: exchange buffers, owner matrices, Newton-Schulz working "
    f"set, a variant's owner state (a positive integer; null or unset: {DEFAULT_MAX_STEP_MEMORY} = {DEFAULT_MAX_STEP_MEMORY / 2**30:g} GiB), or "
    f"\"{STRICT}\" to stay within each rank's momentum partition where any plan can",
    SPLIT_KEY:
    "orthogonalize each part of a fused projection DeepSpeed recognizes (gate_up_proj, qkv_proj, c_attn) on its own "
    "(true or null, the default) or the fused tensor whole (false, as before)",
}
"""The distributed update's settings, per Muon group (read once, when the ZeRO optimizer is built)."""


def muon_group_keys() -> tuple:
    """Keys the engine copies into each Muon group beyond ``momentum``, ``ns_method``, ``lr`` and
    ``weight_decay``: ``UPDATE_KEYS``, ``variant`` and every registered variant's own keys."""
    return (*UPDATE_KEYS, VARIANT_KEY, *sorted({k for v in registered().values() for k in v.defaults}))


QK_CLIP_KEY = "qk_clip_threshold"
"""MuonClip's threshold (``qk_clip``, which checks its value), where this DeepSpeed has QK-clip."""


def has_qk_clip() -> bool:
    """Whether the installed DeepSpeed has MuonClip's QK-clip (``muon.qk_clip``)."""
    import importlib.util
    return importlib.util.find_spec("deepspeed.runtime.zero.muon.qk_clip") is not None


def config_keys() -> Mapping[str, str]:
    """``CONFIG_KEYS``, plus ``per_head_muon`` (Muon matrices) where this DeepSpeed has per-head Muon,
    ``qk_clip_threshold`` (the attention layers) where it has QK-clip, and ``muon_group_keys`` (Muon matrices)."""
    keys = dict(CONFIG_KEYS)
    if has_per_head_muon():
        keys["per_head_muon"] = MUON_MATRICES
    if has_qk_clip():
        keys[QK_CLIP_KEY] = "the attention layers (QK-clip after each step)"
    keys.update({k: MUON_MATRICES for k in muon_group_keys() if k not in keys})
    return keys


def group_keys() -> Mapping[str, str]:
    """``GROUP_KEYS`` plus ``muon_group_keys`` (Muon matrices)."""
    return {**{k: MUON_MATRICES for k in muon_group_keys()}, **GROUP_KEYS}


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
    """`` Did you mean 'x'?`` for the choice closest to ``value`` (lower-cased) by
    ``difflib.get_close_matches`` at a ratio of at least 0.75, else "" (and for a non-string):
    "Gram" -> 'gram', "polar-express" -> 'polar_express', ``muon_momentum`` -> 'momentum';
    ``ns_steps`` gets none (0.47 from ``ns_method``)."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value.lower(), sorted(choices), n=1, cutoff=0.75)
    return f" Did you mean {close[0]!r}?" if close else ""


def ns_methods() -> frozenset:
    """The ``ns_method`` values upstream's Muon accepts (``original_muon.NS_METHODS``)."""
    from deepspeed.runtime.zero.muon import original_muon
    return frozenset(original_muon.NS_METHODS)


def _is_ns_method(value) -> bool:
    return isinstance(value, str) and value in ns_methods()


def _bad_ns_method(where: str, value) -> str:
    return (f"{where}.ns_method: {value!r} is not a Newton-Schulz method of Muon. "
            f"Accepted: {_accepted(ns_methods())}.{did_you_mean(value, ns_methods())}")


def _is_step_memory(value) -> bool:
    """A ``max_step_memory``: ``STRICT``, a positive whole number of bytes (JSON's ``8e9`` included), or null (the
    default)."""
    if value is None or value == STRICT:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and float(value).is_integer()


def _update_value_problems(settings: Mapping[str, Any], where: str) -> List[str]:
    """What is wrong with ``pipeline_depth`` / ``batch_ns`` / ``max_step_memory`` / ``split_fused_muon`` in a config
    block or group (``where``)."""
    problems = []
    depth = settings.get(PIPELINE_DEPTH_KEY, 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        problems.append(f"{where}.{PIPELINE_DEPTH_KEY}: {depth!r}; {UPDATE_KEYS[PIPELINE_DEPTH_KEY]}.")
    if settings.get(BATCH_NS_KEY) is not None and not isinstance(settings[BATCH_NS_KEY], bool):
        problems.append(f"{where}.{BATCH_NS_KEY}: {settings[BATCH_NS_KEY]!r}; {UPDATE_KEYS[BATCH_NS_KEY]}.")
    if MAX_STEP_MEMORY_KEY in settings and not _is_step_memory(settings[MAX_STEP_MEMORY_KEY]):
        value = settings[MAX_STEP_MEMORY_KEY]
        problems.append(f"{where}.{MAX_STEP_MEMORY_KEY}: {value!r} is invalid; {UPDATE_KEYS[MAX_STEP_MEMORY_KEY]}."
                        f"{did_you_mean(value, (STRICT, ))}")
    if settings.get(SPLIT_KEY) is not None and not isinstance(settings[SPLIT_KEY], bool):
        problems.append(f"{where}.{SPLIT_KEY}: {settings[SPLIT_KEY]!r}; {UPDATE_KEYS[SPLIT_KEY]}.")
    return problems


def _settings_blocks(optimizer_parameters: Mapping[str, Any], model_parameters):
    """``(where, settings)`` of ``optimizer.params`` and of each group dict of ``model_parameters``
    (only a list or tuple is looked into: a generator is not consumed)."""
    yield "optimizer.params", optimizer_parameters or {}
    if isinstance(model_parameters, (list, tuple)):
        for index, group in enumerate(model_parameters):
            if isinstance(group, dict):
                yield f"model_parameters[{index}]", group


def check_muon_keys(optimizer_parameters: Mapping[str, Any], model_parameters) -> None:
    """Refuse every key of the Muon block and of its parameter groups that the engine would drop,
    every ``ns_method`` Muon has no kernel for, and values of ``UPDATE_KEYS`` it cannot use.

    Args:
        optimizer_parameters: the config's ``optimizer.params`` (not modified).
        model_parameters: what ``deepspeed.initialize`` got as ``model_parameters``: tensors
            and/or parameter-group dicts (a generator is not consumed; only a list or tuple of
            dicts is checked).

    Raises:
        ValueError: one message listing each unknown key: ``optimizer.params.<key>`` with the
            accepted config keys, ``model_parameters[<i>].<key>`` with the accepted group keys, and
            for ``per_head_muon`` on a DeepSpeed without per-head Muon, that this base lacks it;
            then each value it cannot use: an ``ns_method`` that is not one of ``ns_methods()``,
            with the accepted values, a ``pipeline_depth`` that is not an integer >= 1, a
            ``batch_ns`` that is not true, false or null, a ``max_step_memory`` that is not a positive
            whole number of bytes, null or "momentum_partition".
    """
    accepted, accepted_in_groups = config_keys(), group_keys()
    problems, values = [], []
    for where, settings in _settings_blocks(optimizer_parameters, model_parameters):
        in_group = where != "optimizer.params"
        for key in settings:
            if key in (accepted_in_groups if in_group else accepted):
                continue
            if in_group:
                why = GROUP_HINTS.get(key, "not a key of a Muon parameter group")
                guess = "" if key in GROUP_HINTS else did_you_mean(key, accepted_in_groups)
                problems.append(f"{where}.{key}: {why}, so it would do nothing. Accepted: "
                                f"{_accepted(accepted_in_groups)}.{guess}")
            elif key == "per_head_muon":
                problems.append("optimizer.params.per_head_muon: this DeepSpeed has no per-head Muon, so the key "
                                "would do nothing; remove it.")
            else:
                hint = FIXED_SETTINGS.get(key) or ""
                problems.append(
                    f"optimizer.params.{key}: not a key of the Muon optimizer, so it would do nothing"
                    f"{hint}. Accepted: {_accepted(accepted)}.{'' if hint else did_you_mean(key, accepted)}")
        if "ns_method" in settings and not _is_ns_method(settings["ns_method"]):
            values.append(_bad_ns_method(where, settings["ns_method"]))
        values += _update_value_problems(settings, where)
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
    variant = settings.get(VARIANT_KEY, MUON)
    problems = []
    if variant not in variants():
        problems.append(f"{where}.{VARIANT_KEY}: {variant!r} is not a Muon variant; accepted: "
                        f"{', '.join(repr(v) for v in variants())}.{did_you_mean(variant, variants())}")
    for cls in registered().values():
        problems += cls.key_problems(settings, where)
    return problems


def _where_no_owner_runs(engine) -> Optional[str]:
    """Why ``engine``'s Muon update runs outside the owner-centric update, or None where it runs there.

    Stage 0 runs upstream's ``MuonWithAuxAdam.step`` on whole weights; ZeRO stage 1 with bf16
    parameters, fp32 gradient accumulation and no optimizer offload runs DeepSpeed's
    ``BF16_Optimizer`` (the engine's optimizer-wrapper choice), whose Muon is upstream's too.
    """
    import torch
    stage = engine.zero_optimization_stage()
    if stage == 0:
        return "zero_optimization.stage 0"
    model_dtype, grad_accum_dtype = engine.get_data_types()
    if (stage == 1 and model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32
            and not engine.zero_cpu_offload()):
        return ("zero_optimization.stage 1 with bf16 and data_types.grad_accum_dtype fp32 (DeepSpeed's "
                "BF16_Optimizer)")
    return None


def check_muon_groups(optimizer_parameters: Mapping[str, Any], model_parameters, param_groups: Sequence[dict],
                      engine) -> None:
    """Check the variant settings on the groups the engine built, and fill each variant's defaults in.

    Called by the engine right after ``_muon_param_groups``. A Muon group that uses a variant gets
    each of the variant's settings (its own, the config's, or the default), so checkpoints record
    them; other groups are left as they are.

    Args:
        optimizer_parameters, model_parameters: as for ``check_muon_keys``.
        param_groups: the groups the engine built (``use_muon`` halves); modified as above.
        engine: the ``DeepSpeedEngine`` (its ZeRO stage, data types and offload).

    Raises:
        ValueError: naming each key: an unknown ``variant``, a variant's setting it refuses
            (``key_problems``), a variant's settings where no Muon group uses that variant, and
            a variant or a weight AutoTP split (``binding.SPREAD_ATTR``) where no owner rank runs the update
            (``_where_no_owner_runs``: ZeRO stage 0 and ZeRO-1's ``BF16_Optimizer``).
    """
    problems = [
        p for where, settings in _settings_blocks(optimizer_parameters, model_parameters)
        for p in _variant_problems(settings, where)
    ]
    muon_groups = [g for g in param_groups if is_muon_group(g)]
    if not problems and muon_groups:
        used = {g.get(VARIANT_KEY, MUON) for g in muon_groups}
        for name, cls in sorted(registered().items()):
            unused = sorted({k for g in muon_groups for k in cls.defaults if k in g})
            if unused and name not in used:
                problems.append(f"{', '.join(unused)} (optimizer.params or a parameter group): {name}'s settings, "
                                f"but no Muon group has {VARIANT_KEY} {name!r}, so they would do nothing; add "
                                f"\"{VARIANT_KEY}\": \"{name}\" or remove them.")
    spread = [p for g in muon_groups for p in g["params"] if hasattr(p, SPREAD_ATTR)]
    if not problems and spread and _where_no_owner_runs(engine) is not None:
        problems.append(f"{getattr(spread[0], SPREAD_ATTR).config_key}: Muon orthogonalizes a weight AutoTP split "
                        f"({len(spread)} of them) whole only at ZeRO stages 1 to 3, and not with "
                        f"{_where_no_owner_runs(engine)}, where each shard would be orthogonalized on its own.")
    if not problems:
        for group in muon_groups:
            cls = registered().get(group.get(VARIANT_KEY, MUON))
            if cls is None:
                continue
            where = _where_no_owner_runs(engine)
            if where is not None:
                problems.append(f"optimizer.params.{VARIANT_KEY}: {cls.name!r} needs ZeRO stage 1, 2 or 3 (its "
                                "state lives on the rank that orthogonalizes each matrix), and does not run with "
                                f"{where}; use the default variant 'muon' there.")
                break
            for key, default in cls.defaults.items():
                group.setdefault(key, default)
    if problems:
        raise ValueError("The Muon optimizer's variant and tensor-parallel settings are invalid:\n" +
                         "\n".join(f"- {p}" for p in problems))


def refuse_unsupported_zero3(optimizer) -> None:
    """Refuse the ZeRO-3 configurations the Muon boundary update cannot serve, before anything is
    allocated (called from ``DeepSpeedZeroOptimizer_Stage3.__init__`` once it knows ``use_muon`` and
    its offloading); nothing without Muon.

    Raises:
        ValueError: naming every offending config key and why.
    """
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.torch_autocast import get_autocast_dtype, is_autocast_initialized
    if not getattr(optimizer, "use_muon", False):
        return
    problems = []
    if getattr(optimizer, "zenflow", False):
        problems.append("zero_optimization.zenflow: ZenFlow's selective, overlapped optimizer step does not run "
                        "the Muon boundary update; train Muon without zenflow.")
    if is_autocast_initialized() and get_autocast_dtype() == torch.float16:
        problems.append("torch_autocast with fp16: torch's GradScaler unscales the gradients inside the optimizer "
                        "step, after Muon has fed them to its momentum. Use DeepSpeed's fp16 section (its loss "
                        "scale is divided out before Muon) or bf16.")
    if getattr(optimizer, "all2all_process_group", None) is not None and _quantized_reduce_unavailable():
        problems.append("zero_optimization.zero_quantized_gradients: its all-to-all reduction needs DeepSpeed's "
                        f"quantizer op, which the {get_accelerator().device_name()} accelerator does not provide; "
                        "training would fail at the first backward. Turn zero_quantized_gradients off here.")
    if getattr(optimizer, "swap_optimizer", False) and not _async_io_available():
        problems.append("zero_optimization.offload_optimizer.device 'nvme': DeepSpeed's async I/O op cannot be "
                        "built here (it needs libaio: on Debian/Ubuntu `apt-get install libaio-dev`); use "
                        "offload_optimizer.device 'cpu' or install libaio.")
    master_dtype = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)
    if master_dtype != torch.float32:
        key = "bf16.bf16_master_weights_and_grads" if master_dtype == torch.bfloat16 else \
            "fp16.fp16_master_weights_and_grads"
        problems.append(f"{key}: the Muon update reads fp32 gradient partitions into its fp32 momentum; train Muon "
                        "with fp32 master weights and gradients (the default).")
    if problems:
        raise ValueError("ZeRO-3 with the Muon optimizer cannot run this configuration:\n- " + "\n- ".join(problems))


def _async_io_available() -> bool:
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


def _quantized_reduce_unavailable() -> bool:
    """Whether ZeRO-3's quantized all-to-all gradient reduction would run and fail here.

    Stage 3 only takes that path with more than one node (``world_size / device_count() > 1``,
    as ``__avg_scatter_grads`` decides); it then loads the accelerator's ``QuantizerBuilder``.
    """
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if dist.get_world_size() // max(1, accelerator.device_count()) <= 1:
        return False
    builder = accelerator.create_op_builder("QuantizerBuilder")
    if builder is None or getattr(builder, "NAME", "") == "deepspeed_not_implemented":
        return True
    return not builder.is_compatible(verbose=False)
