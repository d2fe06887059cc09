# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's learning rates under DeepSpeed's learning-rate schedulers, and in the progress log.

DeepSpeed's Muon optimizer (``MuonWithAuxAdam``) trains two kinds of parameter groups: Muon matrices
(``use_muon=True``, rate ``muon_lr``, default 0.02) and an auxiliary Adam for the rest (``use_muon=False``, rate
``adam_lr``, default 3e-4), two rates about two orders of magnitude apart, and one of each per incoming parameter group
(more with MoE). DeepSpeed's schedulers (``deepspeed.runtime.lr_schedules``) take each rate key as one value per
parameter group and broadcast a scalar to every group (``_format_param``). A scalar, or a library default where the key
is left unset (``WarmupDecayLR``'s ``warmup_max_lr`` of 0.001, ``LRRangeTest``'s ``lr_range_test_min_lr`` of 0.001),
therefore replaced both rates by one: the Muon matrices trained 20x slower than configured and the Adam parameters
faster, with nothing reported.

``scheduler_params_for_groups`` resolves a config scheduler's parameters before the engine builds
the scheduler (``DeepSpeedEngine._scheduler_from_config``), for an optimizer whose groups carry
``use_muon``; for any other optimizer it returns the parameters unchanged. Per key of
``RATE_KEYS``:

- a list or tuple is used as given, one value per parameter group in the optimizer's order; a
  length that is not the number of groups is a ``ValueError`` listing the groups;
- unset: ``CONFIGURED`` keys become the list of each group's configured rate (its ``lr`` when the
  scheduler is built), ``ZERO_DEFAULT`` keys keep the scheduler's default of 0, which is the same
  floor for every group and so overwrites no configured rate;
- a scalar is accepted where it cannot overwrite one rate by another: 0, or where all groups have
  the same configured rate; otherwise a ``ValueError`` names the key, the groups with the rates the
  scalar would overwrite and the list to write instead.

Keys that are ratios of each group's own rate (``WarmupCosineLR``'s ``warmup_min_ratio`` and ``cos_min_ratio``,
``LRRangeTest``'s ``lr_range_test_step_rate``) need nothing: every group keeps its own rate, scaled. A refusal rather
than a rescaling of a scalar: no DeepSpeed scheduler has a convention for scaling one value to several groups, and a
silent reinterpretation of a key that means an absolute rate everywhere else would be a new surprise. Schedulers from
``torch.optim.lr_scheduler`` named in the config and client schedulers are not changed.

``rates_by_group`` gives the progress log (``DeepSpeedEngine._report_progress``, at
``deepspeed.initialize`` and every ``steps_per_print`` steps) each rate with the name of its group.
"""

from typing import Any, List, Mapping, Optional, Sequence

from deepspeed.runtime.zero.muon.momentum import is_muon_group

CONFIGURED = "each group's configured rate"
"""An unset key of this kind becomes the list of the groups' configured rates."""

ZERO_DEFAULT = "0 for every group"
"""An unset key of this kind keeps the scheduler's default of 0."""

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
"""Per DeepSpeed scheduler (``deepspeed.runtime.lr_schedules``), its keys that are absolute
learning rates, and what each means when unset with a Muon optimizer."""


def _torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` a DeepSpeed scheduler drives (a ZeRO or fp16 wrapper's inner
    optimizer), or None."""
    import torch
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


def has_muon_groups(optimizer) -> bool:
    """Whether ``optimizer`` (or the optimizer a DeepSpeed wrapper holds) has Muon parameter groups,
    i.e. groups carrying ``use_muon``."""
    inner = _torch_optimizer(optimizer)
    return inner is not None and any("use_muon" in group for group in inner.param_groups)


def group_names(param_groups: Sequence[Mapping[str, Any]]) -> List[str]:
    """One label per parameter group: its ``name`` (the engine names them ``muon-params``,
    ``adam-params``, ``<group>-muon-params``, ...) or ``group <i>``; a name that several groups
    share gets ``#<i>`` appended, so that every label is distinct."""
    names = [str(group.get("name") or f"group {i}") for i, group in enumerate(param_groups)]
    return [f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _rate(value) -> float:
    import torch
    return float(value.item()) if torch.is_tensor(value) else float(value)


def _describe(param_groups, names) -> str:
    return ", ".join(f"{name} ({'Muon' if is_muon_group(group) else 'Adam'}) {_rate(group['lr']):g}"
                     for name, group in zip(names, param_groups))


def scheduler_params_for_groups(scheduler_name: Optional[str], params: Optional[Mapping[str, Any]], optimizer):
    """The ``scheduler.params`` to build ``scheduler_name`` with on ``optimizer``.

    Args:
        scheduler_name: the config's ``scheduler.type``.
        params: the config's ``scheduler.params`` (not modified).
        optimizer: what the engine hands the scheduler (the basic optimizer or its ZeRO / fp16 wrapper); its groups'
            ``lr`` are the configured rates (no scheduler has run yet).

    Returns:
        For an optimizer with Muon groups and a scheduler of ``RATE_KEYS``: a new dict, ``params`` with each unset
        ``CONFIGURED`` rate key set to the list of the groups' configured rates. Otherwise ``params`` itself, so that
        nothing changes for other optimizers and schedulers.

    Raises:
        ValueError: a scalar rate key that would overwrite differing configured rates, or a list
            whose length is not the number of parameter groups; the message names
            ``scheduler.params.<key>``, each group with its rate, and the list to write.
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
        raise ValueError(f"{where}: one value, {value}, for all {len(groups)} parameter groups of the Muon "
                         f"optimizer would overwrite their configured learning rates, which differ: "
                         f"{_describe(groups, names)} (muon_lr for the Muon groups, adam_lr for the Adam "
                         f"groups, or a group's own lr). Give one value per group, in this order: \"{key}\": "
                         f"{form} (the configured rates are {rates}); or {instead}.")
    return resolved


def rates_by_group(optimizer, lrs):
    """The learning rates ``lrs`` (``engine.get_lr()``: one per parameter group of ``optimizer``)
    labelled by group, for the progress log: a dict ``{group label: lr}`` (labels of
    ``group_names``) when ``optimizer`` has Muon groups, else ``lrs`` unchanged."""
    if not has_muon_groups(optimizer):
        return lrs
    groups = _torch_optimizer(optimizer).param_groups
    if len(groups) != len(lrs):
        return lrs
    return dict(zip(group_names(groups), lrs))


def momenta_by_group(optimizer, moms):
    """The momentum settings for the progress log, labelled by group like ``rates_by_group``: a
    Muon group's ``momentum`` (its beta) and an Adam group's ``betas``. ``engine.get_mom()`` reads
    ``betas`` only, which a Muon group does not have (it would log 0.0). ``moms`` unchanged when
    ``optimizer`` has no Muon groups or the counts differ."""
    if not has_muon_groups(optimizer):
        return moms
    groups = _torch_optimizer(optimizer).param_groups
    if len(groups) != len(moms):
        return moms
    values = [g.get("momentum") if is_muon_group(g) else g.get("betas", m) for g, m in zip(groups, moms)]
    return dict(zip(group_names(groups), values))
