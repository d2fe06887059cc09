# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon's one entry point in DeepSpeed: every Muon feature ``deepspeed.initialize`` and the engine need.

The engine and ``deepspeed/__init__.py`` call this module only; the ZeRO stages reach ``binding`` (their
``MuonUpdate``) and ``support``; the checkpoint code lives under ``deepspeed/checkpoint/``. ``prepare_model`` from
``deepspeed.set_optimizer_flags``, ``MuonIntegration.create`` from ``engine._configure_optimizer`` before ZeRO flattens
the groups, ``bind`` once the ZeRO optimizer exists (QK-clip after each inner step), ``named_by_group`` for the
progress log. ``qk_clip`` and ``hf_attention`` are imported by name only where a build has them
(``config.has_qk_clip``).
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
    """Check (``config.check_muon_keys``) the keys and values of ``optimizer.params`` and of the group dicts of
    ``model_parameters`` (a list or tuple; a generator is not consumed) before upstream's optimizer reads them, then
    choose each parameter's ``use_muon`` (``param_selection.select_muon_parameters``; a user's flag is kept).

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
    """Copy Muon's own keys into each Muon group: the incoming group's value, else ``optimizer.params``' (the
    precedence of ``_muon_param_groups``, which keeps upstream's keys only); a key set in neither stays unset."""
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
        selection: the ``MuonSelection`` (also ``engine.muon_selection``); None for an opaque client optimizer.
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
        """On ``basic_optimizer`` (before ZeRO wraps it): fill and check Muon's group keys, resolve and report the
        selection, mark AutoTP-split weights, resolve the scheduler's per-group rates, check MuonClip's setup.
        ``client_optimizer`` is None for a config-named one; ``model_parameters``' group dicts carry per-group keys.
        Returns None if it is not DeepSpeed's Muon.

        Raises:
            ValueError: naming the config key: a variant's setting Muon cannot use, ZenFlow at ZeRO-1/2, a client
                Muon that cannot run on flat partitions, a scheduler rate that would overwrite Muon's or Adam's, a
                ``qk_clip_threshold`` that cannot run here or attention it cannot clip.
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
        """Register Muon's work after the inner step with the engine's ``optimizer`` (run by its ``muon_update``).

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
        """``engine.get_lr()`` and ``get_mom()`` labelled with their groups' names for the progress log."""
        return rates_by_group(self._optimizer, lrs), momenta_by_group(self._optimizer, moms)
