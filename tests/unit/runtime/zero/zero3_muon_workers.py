# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Functions the ZeRO-3 Muon tests run on every rank through ``run_distributed``."""

import contextlib
import dataclasses

import torch

from zero3_muon_common import (TOTAL_SAMPLES, NSCounter, build_model, ds_config, loss_fn, param_groups, step_batch)

OVERFLOW_FACTOR = 1e6
"""Multiplies the inputs of a step's first micro-batch on an ``overflow_steps`` step: fp16 overflows."""


def _gathered_weights(engine, stage):
    """Full parameters by name (fp32 numpy). Under ZeRO-3 one at a time: stock 0.19.7 gathers
    several at once with a wait on the last handle only, which on gloo can return early."""
    params = list(engine.module.named_parameters())
    if stage != 3:
        return {n: p.detach().float().cpu().numpy().copy() for n, p in params}
    import deepspeed
    weights = {}
    for n, p in params:
        with deepspeed.zero.GatheredParameters([p]):
            weights[n] = p.detach().float().cpu().numpy().copy()
    return weights


@contextlib.contextmanager
def fp16_allowed_on_cpu(enabled):
    """DeepSpeed refuses fp16 on the CPU accelerator, although fp16 tensors work on the CPU. The
    fp16 tests claim support while the engine is built (and only then, so that Newton-Schulz
    keeps its fp32 compute dtype on the CPU, the precision the reference uses)."""
    if not enabled:
        yield
        return
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    original = accelerator.is_fp16_supported
    accelerator.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        accelerator.is_fp16_supported = original


def _input_dtype(config):
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    return torch.float32


def build_engine(model, config, groups=None, zero_init=False, fp16_on_cpu=False):
    """``deepspeed.initialize`` on a fresh ``model``; optionally constructed under ``zero.Init``."""
    import deepspeed
    with fp16_allowed_on_cpu(fp16_on_cpu):
        if zero_init:
            with deepspeed.zero.Init(config_dict_or_path=config):
                net = build_model(model)
        else:
            net = build_model(model)
        engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=param_groups(net, groups))
    return engine


def train_run(model="mixed",
              stage=3,
              gas=1,
              steps=3,
              clip=0.0,
              target_scale=1.0,
              zero_extra=None,
              ds_extra=None,
              optimizer=None,
              opt_extra=None,
              groups=None,
              zero_init=False,
              fp16_on_cpu=False,
              overflow_steps=(),
              record=False,
              restart_after=None,
              checkpoint_dir=None,
              momentum_to_bf16=False,
              muon_overlap=True,
              samples=TOTAL_SAMPLES):
    """Train ``model`` with DeepSpeed on this rank's share of every step's samples.

    Micro-step ``m`` of rank ``r`` takes samples ``[(m * W + r) * mb, ... + mb)`` of the step, so
    every step uses the same ``samples`` samples whatever ``gas`` and W are.

    Args:
        zero_extra / ds_extra: merged into ``zero_optimization`` / the top level of the config.
        optimizer: replaces the config's ``optimizer`` section (default: Muon, see ds_config).
        opt_extra: merged into the optimizer's ``params`` (e.g. ``per_head_muon``).
        groups: name of a parameter grouping in ``zero3_muon_common.GROUPINGS``.
        zero_init: build the model under ``deepspeed.zero.Init``.
        fp16_on_cpu: let the engine use fp16 on the CPU accelerator (see fp16_allowed_on_cpu).
        overflow_steps: steps whose first micro-batch is scaled by OVERFLOW_FACTOR.
        record: install a ``zero3_muon_replay.Recorder`` and return its records.
        restart_after / checkpoint_dir: after that many steps, ``save_checkpoint``, throw the
            engine away, build a new one and ``load_checkpoint``, then go on.
        momentum_to_bf16: before that ``load_checkpoint``, store the checkpoint's Muon momentum
            in bf16, as stock 0.19.8 writes it under bf16 training.
        muon_overlap: ``Zero3MuonBoundary.overlap`` (exchange of the next bucket in flight while
            the owner orthogonalizes this one).

    Returns:
        dict with ``weights`` (full parameters by name), ``ns_per_step`` (NS calls on this rank
        at each boundary), ``ns_off_boundary`` (NS calls on non-boundary micro-steps),
        ``ns_by_kernel`` (calls per NS kernel, all steps), ``norms`` (``get_global_grad_norm()``
        per step), ``stats`` (the boundary's counters, or
        None when the optimizer has none), ``dynamo_graphs`` (graphs TorchDynamo compiled in
        this process: 0 when it is disabled), ``loss_scales``, ``muon_num_heads`` (by parameter
        name, as DeepSpeed tagged them), and with ``record`` the
        ``records`` (steps, initial master) and ``momentum_dtypes``.
    """
    import deepspeed.comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    counter = NSCounter()
    config = ds_config(stage, gas, world_size, clip=clip, zero_extra=zero_extra, samples=samples)
    config.update(ds_extra or {})
    if optimizer is not None:
        config["optimizer"] = optimizer
    config["optimizer"]["params"].update(opt_extra or {})
    engine = build_engine(model, config, groups, zero_init, fp16_on_cpu)
    if getattr(engine.optimizer, "muon_boundary", None) is not None:
        engine.optimizer.muon_boundary.overlap = muon_overlap
    recorder = None
    if record:
        from zero3_muon_replay import Recorder
        recorder = Recorder(engine)
    dtype = _input_dtype(config)
    micro = samples // (world_size * gas)
    ns_per_step, ns_off_boundary, norms, loss_scales = [], 0, [], []
    for step in range(steps):
        if restart_after is not None and step == restart_after:
            engine.save_checkpoint(checkpoint_dir, tag="restart")
            dist.barrier()
            if momentum_to_bf16:
                _momentum_to_bf16(checkpoint_dir, "restart", rank)
            dist.barrier()
            engine.destroy()
            engine = build_engine(model, config, groups, zero_init, fp16_on_cpu)
            engine.load_checkpoint(checkpoint_dir, tag="restart")
        x, y = step_batch(model, step, target_scale, samples)
        if recorder is not None:
            recorder.begin_step()
        for m in range(gas):
            lo = (m * world_size + rank) * micro
            inputs = x[lo:lo + micro] * (OVERFLOW_FACTOR if (step in overflow_steps and m == 0) else 1.0)
            before = counter.count
            loss = loss_fn(engine(inputs.to(dtype)).float(), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            if m < gas - 1:
                ns_off_boundary += counter.count - before
            else:
                ns_per_step.append(counter.count - before)
        if recorder is not None:
            recorder.end_step()
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
        loss_scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
    boundary = getattr(engine.optimizer, "muon_boundary", None)
    from torch._dynamo.utils import counters
    result = dict(weights=_gathered_weights(engine, stage),
                  dynamo_graphs=int(counters["stats"]["unique_graphs"]),
                  ns_per_step=ns_per_step,
                  ns_off_boundary=ns_off_boundary,
                  ns_by_kernel=dict(counter.by_kernel),
                  norms=norms,
                  loss_scales=loss_scales,
                  final_momentum_dtypes=sorted({
                      str(state["momentum_buffer"].dtype)
                      for state in engine.optimizer.optimizer.state.values() if "momentum_buffer" in state
                  }) if stage == 3 else [],
                  muon_num_heads={n: getattr(p, "muon_num_heads", None)
                                  for n, p in engine.module.named_parameters()},
                  stats=dataclasses.asdict(boundary.stats) if boundary is not None else None)
    if recorder is not None:
        result.update(records=(recorder.steps, recorder.initial_master), momentum_dtypes=recorder.momentum_dtypes)
    engine.destroy()
    return result


def _momentum_to_bf16(checkpoint_dir, tag, rank):
    """Rewrite this rank's optimizer-state file with every ``momentum_buffer`` in bf16."""
    import glob
    import os
    (path, ) = glob.glob(os.path.join(checkpoint_dir, tag, f"*zero_pp_rank_{rank}_*optim_states.pt"))
    state = torch.load(path, map_location="cpu", weights_only=False)
    converted = []

    def convert(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "momentum_buffer" and torch.is_tensor(value):
                    node[key] = value.to(torch.bfloat16)
                    converted.append(key)
                else:
                    convert(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                convert(value)

    convert(state)
    assert converted, f"no momentum_buffer in {path}"
    torch.save(state, path)


def train_runs(runs):
    """``train_run(**kwargs)`` for every dict in ``runs``, in one process group; list of results."""
    return [train_run(**kwargs) for kwargs in runs]


def initialize_errors(cases, pretend_no_async_io=False):
    """For each dict of ``train_run`` arguments, the message of the error ``deepspeed.initialize``
    raised, or None. With ``pretend_no_async_io`` the async I/O op reports itself unbuildable."""
    from deepspeed.runtime.zero.muon import stage3_binding
    if pretend_no_async_io:
        stage3_binding._async_io_available = lambda: False
    messages = []
    for kwargs in cases:
        try:
            train_run(steps=0, **kwargs)
            messages.append(None)
        except Exception as error:  # the message is what is checked
            messages.append(f"{type(error).__name__}: {error}")
    return messages
