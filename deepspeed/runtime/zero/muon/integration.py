# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's one entry point in DeepSpeed: every Muon feature ``deepspeed.initialize`` and the engine need.

The engine and ``deepspeed/__init__.py`` call this module only; the ZeRO stages reach ``binding`` (their
``MuonUpdate``, built from their own description of their partitions) and ``support`` (the configurations the update
cannot serve), and the checkpoint code lives under ``deepspeed/checkpoint/``:

- ``prepare_model`` (``deepspeed.set_optimizer_flags``, before the engine is built): the keys and values of
  ``optimizer.params`` and of the parameter groups checked (``config``) before upstream's optimizer reads them, and
  each parameter's ``use_muon`` chosen (``param_selection``);
- ``MuonIntegration.create`` (``engine._configure_optimizer``, with the basic optimizer, before the wrapper checks and
  ZeRO replace its groups by flat partitions): Muon's own group keys copied into each Muon group and the variants'
  settings checked, the selection resolved and reported (``param_selection``), ZenFlow refused at ZeRO-1/2, the weights
  AutoTP split marked (``tensor_parallel``), the scheduler's per-group rates resolved (``lr_groups``), MuonClip's
  threshold, placement and attention layers checked;
- ``bind`` (once the engine built its optimizer): what runs right after each inner optimizer step, registered with the
  ZeRO stage's update (``binding.MuonUpdate.add_after_inner_step``): MuonClip's QK-clip (``qk_clip``);
- ``named_by_group`` (the progress log): each rate and momentum with its group's name.

The ZeRO stages build their ``MuonUpdate`` themselves (it is their step). ``qk_clip`` and
``hf_attention`` are imported by name only where a build has them (``config.has_qk_clip``: the pull
request of Muon's variants adds them).
"""

import importlib
from typing import Any, Mapping, Optional

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import MUON_OPTIMIZER
from deepspeed.runtime.zero.muon.config import (QK_CLIP_KEY, check_muon_groups, check_muon_keys, has_qk_clip,
                                                muon_group_keys)
from deepspeed.runtime.zero.muon.lr_groups import momenta_by_group, rates_by_group, scheduler_params_for_groups
from deepspeed.runtime.zero.muon.momentum import is_muon_group
from deepspeed.runtime.zero.muon.param_selection import resolve_optimizer_selection, select_muon_parameters
from deepspeed.runtime.zero.muon.support import spread_problem, where_no_owner_runs
from deepspeed.runtime.zero.muon.tensor_parallel import mark_tensor_parallel_matrices
from deepspeed.utils import logger


def prepare_model(optimizer_parameters: Mapping[str, Any], model, model_parameters=None) -> None:
    """``deepspeed.initialize``'s call for DeepSpeed's Muon, before the engine is built: the keys and values of
    ``optimizer.params`` and of the group dicts of ``model_parameters`` (a list or tuple; a generator is not
    consumed) checked (``config.check_muon_keys``) before upstream's optimizer reads them, then each
    parameter's ``use_muon`` chosen (``param_selection.select_muon_parameters``; a flag the user set is kept).

    Raises:
        ValueError: naming each key or value Muon cannot use.
    """
    check_muon_keys(optimizer_parameters or {}, model_parameters)
    select_muon_parameters(model)


def _source_groups(model_parameters) -> Mapping[int, dict]:
    """Per ``id`` of a parameter, the group dict of ``model_parameters`` it came in (the engine hands a list)."""
    if not isinstance(model_parameters, (list, tuple)):
        return {}
    return {id(p): group for group in model_parameters if isinstance(group, dict) for p in group.get("params", ())}


def fill_muon_group_keys(param_groups, optimizer_parameters: Mapping[str, Any], model_parameters) -> None:
    """Copy Muon's own keys (``config.muon_group_keys``) into each Muon group of ``param_groups``: the incoming
    group's value, else ``optimizer.params``' (the precedence of ``DeepSpeedEngine._muon_param_groups``, which
    keeps upstream's keys only). A key set in neither stays unset (each reader has its default)."""
    sources = _source_groups(model_parameters)
    for group in param_groups:
        if not is_muon_group(group) or not group["params"]:
            continue
        source = sources.get(id(group["params"][0]), {})
        for key in muon_group_keys():
            if key in source:
                group[key] = source[key]
            elif key in optimizer_parameters:
                group[key] = optimizer_parameters[key]


class MuonIntegration:
    """What one ``DeepSpeedEngine`` runs for Muon.

    Attributes:
        selection: ``param_selection.MuonSelection``: which parameters Muon trains and why (also
            ``engine.muon_selection``); None for a client optimizer DeepSpeed cannot see into.
        qk_clip: MuonClip's ``qk_clip.QKClip`` once bound, None where ``qk_clip_threshold`` is unset.
    """

    def __init__(self, optimizer, selection, qk_clip_layers=None, qk_clip_threshold=None, steps_per_print=0):
        self._optimizer = optimizer
        self.selection = selection
        self._qk_clip_layers, self._qk_clip_threshold = qk_clip_layers, qk_clip_threshold
        self._steps_per_print = steps_per_print
        self.qk_clip = None

    @classmethod
    def create(cls, engine, basic_optimizer, client_optimizer, model_parameters) -> Optional["MuonIntegration"]:
        """Muon's checks and settings on ``basic_optimizer`` (the engine's, before ZeRO wraps it); None where it
        is not DeepSpeed's Muon.

        Args:
            engine: the ``DeepSpeedEngine`` (its config, module, ZeRO stage and scheduler).
            basic_optimizer: the optimizer built from the config or the client's (its groups are modified:
                Muon's group keys filled in, variants' defaults).
            client_optimizer: the client's optimizer (or callable), None for a config-named one.
            model_parameters: what ``deepspeed.initialize`` got (its group dicts carry per-group keys).

        Raises:
            ValueError: naming the config key: a variant's setting Muon cannot use (``config.check_muon_groups``; the
                keys and values were checked by ``prepare_model``), ZenFlow at ZeRO-1/2, a client Muon that cannot run
                on flat partitions (``param_selection``), a scheduler rate that would overwrite Muon's or Adam's rates
                (``lr_groups``), a ``qk_clip_threshold`` that cannot run here or attention it cannot clip.
        """
        named = client_optimizer is None and engine.optimizer_name() == MUON_OPTIMIZER
        optimizer_parameters = dict(engine.optimizer_params() or {}) if named else {}
        selection = resolve_optimizer_selection(basic_optimizer, engine.module, client_optimizer is not None,
                                                engine.zero_optimization_stage())
        if not named and selection is None:
            return None
        if engine.zero_optimization_stage() in (1, 2) and engine.zenflow_config() is not None:
            raise ValueError("zero_optimization.zenflow: ZenFlow's selective, overlapped optimizer step does not run "
                             "the Muon update at ZeRO stages 1 and 2; train Muon without zenflow.")
        if engine.autotp_size() > 1:
            mark_tensor_parallel_matrices(engine.module)
        if named:
            fill_muon_group_keys(basic_optimizer.param_groups, optimizer_parameters, model_parameters)
            check_muon_groups(optimizer_parameters, model_parameters, basic_optimizer.param_groups, engine)
        else:  # a client MuonWithAuxAdam: its groups are its own, AutoTP's split weights are still refused
            problem = spread_problem([g for g in basic_optimizer.param_groups if is_muon_group(g)], engine)
            if problem is not None:
                raise ValueError(problem)
        if engine.client_lr_scheduler is None:
            resolved = scheduler_params_for_groups(engine.scheduler_name(), engine.scheduler_params(), basic_optimizer)
            if resolved is not engine.scheduler_params():
                engine._config.scheduler_params = resolved  # what _scheduler_from_config builds the scheduler with
        layers = threshold = None
        if optimizer_parameters.get(QK_CLIP_KEY) is not None and has_qk_clip():
            qk_clip = importlib.import_module("deepspeed.runtime.zero.muon.qk_clip")
            hf_attention = importlib.import_module("deepspeed.runtime.zero.muon.hf_attention")
            threshold = qk_clip.check_threshold(optimizer_parameters[QK_CLIP_KEY])
            qk_clip.check_runs_here(where_no_owner_runs(engine), engine.autotp_size())
            layers = hf_attention.find_attention(engine.module)
        return cls(basic_optimizer, selection, layers, threshold, engine.steps_per_print() or 0)

    def bind(self, optimizer) -> None:
        """Register Muon's work after the inner optimizer step with ``optimizer``, the one the engine built (a
        ZeRO stage's runs it from its ``muon_update``).

        Raises:
            ValueError: ``qk_clip_threshold`` with an optimizer that runs no Muon update (no ZeRO stage).
        """
        if self._qk_clip_layers is not None:
            self.qk_clip = self._bind_qk_clip(optimizer)

    def _bind_qk_clip(self, zero_optimizer):
        """MuonClip's clip of the layers ``create`` found, after every inner step of ``zero_optimizer``."""
        qk_clip = importlib.import_module("deepspeed.runtime.zero.muon.qk_clip")
        hf_attention = importlib.import_module("deepspeed.runtime.zero.muon.hf_attention")
        muon_update = getattr(zero_optimizer, "muon_update", None)
        if muon_update is None:
            raise ValueError(f"{qk_clip.WHERE}: QK-clip runs in the Muon update of ZeRO stages 1 to 3, and "
                             f"{type(zero_optimizer).__name__} runs none.")
        clip = qk_clip.QKClip(self._qk_clip_threshold, self._qk_clip_layers, zero_optimizer.dp_process_group,
                              torch.device(get_accelerator().current_device_name()), self._steps_per_print,
                              len(muon_update.described))
        hf_attention.install_recorders([m for m in clip.modules if getattr(m, qk_clip.MARK_ATTR, None) is None])
        muon_update.add_after_inner_step(clip.apply)
        if dist.get_rank() == 0:
            logger.info(f"QK-clip ({QK_CLIP_KEY} {clip.threshold:g}): {len(clip.layers)} attention layers, "
                        f"{clip.offsets[-1]} heads; logits recorded on the eager and sdpa paths.")
        return clip

    def named_by_group(self, lrs, moms):
        """``engine.get_lr()`` and ``get_mom()`` for the progress log, each value with its group's name
        (``lr_groups.rates_by_group``, ``momenta_by_group``)."""
        return rates_by_group(self._optimizer, lrs), momenta_by_group(self._optimizer, moms)
