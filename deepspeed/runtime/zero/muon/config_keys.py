# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The keys DeepSpeed's Muon optimizer accepts, checked at ``deepspeed.initialize``.

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

Precedence of the learning rates: a Muon group's rate is the parameter group's own ``lr``, else
``muon_lr``, else ``lr``, else 0.02; an Adam group's the group's own ``lr``, else ``adam_lr``,
else ``lr``, else 3e-4.
"""

import difflib
from typing import Any, Iterable, Mapping

MUON = "Muon matrices"
ADAM = "auxiliary Adam"
BOTH = "both"
IMPLEMENTATION = "auxiliary Adam (implementation)"

CONFIG_KEYS: Mapping[str, str] = {
    "lr": BOTH,
    "muon_lr": MUON,
    "adam_lr": ADAM,
    "momentum": MUON,
    "ns_method": MUON,
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
    "momentum": MUON,
    "ns_method": MUON,
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


def config_keys(muon_half_keys: Iterable[str] = ()) -> Mapping[str, str]:
    """``CONFIG_KEYS``, plus ``per_head_muon`` (Muon matrices) where this DeepSpeed has per-head Muon,
    and each of ``muon_half_keys`` (the engine's ``_MUON_HALF_KEYS``) not among them (Muon matrices:
    a Muon variant's keys where the engine copies them, patch 0018)."""
    keys = dict(CONFIG_KEYS)
    if has_per_head_muon():
        keys["per_head_muon"] = MUON
    keys.update({k: MUON for k in muon_half_keys if k not in keys})
    return keys


def group_keys(muon_half_keys: Iterable[str] = ()) -> Mapping[str, str]:
    """``GROUP_KEYS`` plus each of ``muon_half_keys`` not among them (Muon matrices)."""
    return {**{k: MUON for k in muon_half_keys}, **GROUP_KEYS}


GROUP_HINTS: Mapping[str, str] = {
    "use_muon": "which half a tensor goes to is its own flag: set param.use_muon on the tensors instead",
    "muon_lr":
    "a group's lr applies to both of its halves; for different rates put the tensors in groups of their own",
    "adam_lr":
    "a group's lr applies to both of its halves; for different rates put the tensors in groups of their own",
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


def check_muon_keys(optimizer_parameters: Mapping[str, Any], model_parameters,
                    muon_half_keys: Iterable[str] = ()) -> None:
    """Refuse every key of the Muon block and of its parameter groups that the engine would drop,
    and every ``ns_method`` Muon has no kernel for.

    Args:
        optimizer_parameters: the config's ``optimizer.params`` (not modified).
        model_parameters: what ``deepspeed.initialize`` got as ``model_parameters``: tensors
            and/or parameter-group dicts (a generator is not consumed; only a list or tuple of
            dicts is checked).
        muon_half_keys: the keys the engine copies into a Muon half (``_MUON_HALF_KEYS``), so
            that every key that reaches Muon is accepted (a variant's too, with patch 0018).

    Raises:
        ValueError: one message listing each unknown key: ``optimizer.params.<key>`` with the
            accepted config keys, ``model_parameters[<i>].<key>`` with the accepted group keys, and
            for ``per_head_muon`` on a DeepSpeed without per-head Muon, that this base lacks it;
            then each ``ns_method`` (in ``optimizer.params`` or a group) that is not one of
            ``ns_methods()``, with the accepted values.
    """
    muon_half_keys = tuple(muon_half_keys)
    accepted = config_keys(muon_half_keys)
    problems, values = [], []
    if "ns_method" in (optimizer_parameters or {}) and not _is_ns_method(optimizer_parameters["ns_method"]):
        values.append(_bad_ns_method("optimizer.params", optimizer_parameters["ns_method"]))
    for key in (optimizer_parameters or {}):
        if key in accepted:
            continue
        if key == "per_head_muon":
            problems.append("optimizer.params.per_head_muon: this DeepSpeed has no per-head Muon, so the key "
                            "would do nothing; remove it.")
        else:
            hint = FIXED_SETTINGS.get(key) or ""
            problems.append(f"optimizer.params.{key}: not a key of the Muon optimizer, so it would do nothing"
                            f"{hint}. Accepted: {_accepted(accepted)}.{'' if hint else did_you_mean(key, accepted)}")
    if isinstance(model_parameters, (list, tuple)):
        accepted_in_groups = group_keys(muon_half_keys)
        for index, group in enumerate(model_parameters):
            if not isinstance(group, dict):
                continue
            for key in group:
                if key not in accepted_in_groups:
                    why = GROUP_HINTS.get(key, "not a key of a Muon parameter group")
                    guess = "" if key in GROUP_HINTS else did_you_mean(key, accepted_in_groups)
                    problems.append(f"model_parameters[{index}].{key}: {why}, so it would do nothing. Accepted: "
                                    f"{_accepted(accepted_in_groups)}.{guess}")
            if "ns_method" in group and not _is_ns_method(group["ns_method"]):
                values.append(_bad_ns_method(f"model_parameters[{index}]", group["ns_method"]))
    sections = []
    if problems:
        sections.append("The Muon optimizer's configuration has keys that would do nothing:\n" +
                        "\n".join(f"- {problem}" for problem in problems))
    if values:
        sections.append("The Muon optimizer's configuration has values it cannot use:\n" +
                        "\n".join(f"- {value}" for value in values))
    if sections:
        raise ValueError("\n".join(sections))
