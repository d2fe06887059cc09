# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's learning rates under DeepSpeed's learning-rate schedulers, and in the progress log.

``MuonWithAuxAdam`` has Muon groups (``use_muon=True``, ``muon_lr``, default 0.02) and auxiliary Adam groups
(``adam_lr``, default 3e-4), rates about two orders of magnitude apart. DeepSpeed's schedulers
(``deepspeed.runtime.lr_schedules``) broadcast a scalar rate key to every group (``_format_param``), so a scalar, or a
default for an unset key (``WarmupDecayLR``'s ``warmup_max_lr``, ``LRRangeTest``'s ``lr_range_test_min_lr``: 0.001),
would silently replace both rates by one: Muon 20x slower than configured, Adam faster.

``scheduler_params_for_groups`` resolves a config scheduler's parameters before the engine builds it
(``_scheduler_from_config``), for an optimizer whose groups carry ``use_muon``. Per key of ``RATE_KEYS``:

- a list or tuple is used as given, one value per group in the optimizer's order (another length: ``ValueError``);
- unset: ``CONFIGURED`` keys become the list of the groups' configured ``lr``; ``ZERO_DEFAULT`` keys keep the
  scheduler's 0, a floor that overwrites no configured rate;
- a scalar is accepted when it cannot overwrite one rate by another (0, or all groups share one rate); otherwise a
  ``ValueError`` names the key, the groups' rates and the list to write instead.

Ratio keys (e.g. ``cos_min_ratio``) scale each group's own rate and need nothing. A scalar is refused, not rescaled:
no DeepSpeed scheduler has a convention for that, and silently reinterpreting an absolute rate would surprise. Torch
and client schedulers are not changed. ``rates_by_group`` names each rate's group in the progress log.
"""

from typing import Any, List, Mapping, Optional, Sequence

from deepspeed.runtime.zero.muon.momentum import is_muon_group

CONFIGURED = "each group's configured rate"

ZERO_DEFAULT = "0 for every group"

RATE_KEYS: Mapping[str, Mapping[str, str]] = {
    "WarmupLR": {
        "warmup_min_lr": ZERO_DEFAULT,
        "warmup_max_lr": CONFIGURED
    },
    "WarmupDecayLR": {
        "warmup_min_lr": ZERO_DEFAULT,
        "warmup_max_lr": CONFIGURED
    },
    "WarmupCosineLR": {},
    "OneCycle": {
        "cycle_min_lr": CONFIGURED,
        "cycle_max_lr": CONFIGURED
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": CONFIGURED
    },
}
"""Per DeepSpeed scheduler, its absolute learning-rate keys and what each means when unset with Muon."""


def _torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` a DeepSpeed scheduler drives (a ZeRO or fp16 wrapper's inner one), or None."""
    import torch
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


def has_muon_groups(optimizer) -> bool:
    """Whether ``optimizer`` (or the one a DeepSpeed wrapper holds) has groups carrying ``use_muon``."""
    inner = _torch_optimizer(optimizer)
    return inner is not None and any("use_muon" in group for group in inner.param_groups)


def group_names(param_groups: Sequence[Mapping[str, Any]]) -> List[str]:
    """One distinct label per group: its ``name`` (e.g. ``muon-params``, ``<group>-muon-params``) or ``group <i>``;
    a name several groups share gets ``#<i>`` appended."""
    names = [str(group.get("name") or f"group {i}") for i, group in enumerate(param_groups)]
    return [f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _rate(value) -> float:
    import torch
    return float(value.item()) if torch.is_tensor(value) else float(value)


def _describe(param_groups, names) -> str:
    return ", ".join(f"{name} ({'Muon' if is_muon_group(group) else 'Adam'}) {_rate(group['lr']):g}"
                     for name, group in zip(names, param_groups))


def scheduler_params_for_groups(scheduler_name: Optional[str], params: Optional[Mapping[str, Any]], optimizer):
    """The ``scheduler.params`` to build ``scheduler_name`` (``scheduler.type``) with on ``optimizer`` (basic or
    wrapped; its groups' ``lr`` are the configured rates): a new dict resolved as the module docstring says, or
    ``params`` itself (never modified) for other optimizers and schedulers.

    Raises:
        ValueError: a scalar that would overwrite differing configured rates, or a list of the wrong length.
    """
    keys = RATE_KEYS.get(scheduler_name or "")
    if not keys or not has_muon_groups(optimizer):
        return params
    resolved = dict(params or {})
    groups = _torch_optimizer(optimizer).param_groups
    names = group_names(groups)
    rates = [_rate(group["lr"]) for group in groups]
    form = "[" + ", ".join(f"<{name}>" for name in names) + "]"
    for key, unset in keys.items():
        where = f"scheduler.params.{key}"
        if key not in resolved or resolved[key] is None:
            if unset == CONFIGURED:
                resolved[key] = list(rates)
            continue
        value = resolved[key]
        if isinstance(value, (list, tuple)):
            if len(value) != len(groups):
                raise ValueError(f"{where}: {len(value)} value(s) {list(value)}, but the Muon optimizer has "
                                 f"{len(groups)} parameter groups: {_describe(groups, names)}. Give one value "
                                 f"per group, in this order: \"{key}\": {form}.")
            continue
        if _rate(value) == 0.0 or len(set(rates)) <= 1:
            continue
        instead = ("leave it unset: each group then uses its configured rate"
                   if unset == CONFIGURED else "leave it unset: 0 for every group")
        if key == "warmup_max_lr":  # what the Hugging Face Trainer's "auto" fills in (a list it refuses)
            instead += " (the way under the Hugging Face Trainer, whose \"auto\" fills in one value)"
        raise ValueError(f"{where}: one value, {value}, for all {len(groups)} parameter groups of the Muon "
                         f"optimizer would overwrite their configured learning rates, which differ: "
                         f"{_describe(groups, names)} (muon_lr for the Muon groups, adam_lr for the Adam "
                         f"groups, or a group's own lr). Give one value per group, in this order: \"{key}\": "
                         f"{form} (the configured rates are {rates}); or {instead}.")
    return resolved


def rates_by_group(optimizer, lrs):
    """``lrs`` (``engine.get_lr()``, one per group) as ``{group_names label: lr}`` for the progress log when
    ``optimizer`` has Muon groups, else unchanged."""
    if not has_muon_groups(optimizer):
        return lrs
    groups = _torch_optimizer(optimizer).param_groups
    if len(groups) != len(lrs):
        return lrs
    return dict(zip(group_names(groups), lrs))


def momenta_by_group(optimizer, moms):
    """Like ``rates_by_group`` for momenta: a Muon group's ``momentum``, an Adam group's ``betas``
    (``engine.get_mom()`` reads ``betas`` only and would log 0.0 for Muon)."""
    if not has_muon_groups(optimizer):
        return moms
    groups = _torch_optimizer(optimizer).param_groups
    if len(groups) != len(moms):
        return moms
    values = [g.get("momentum") if is_muon_group(g) else g.get("betas", m) for g, m in zip(groups, moms)]
    return dict(zip(group_names(groups), values))
