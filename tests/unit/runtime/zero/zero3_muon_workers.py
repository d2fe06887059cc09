# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Functions the ZeRO-3 Muon tests run on every rank through ``run_distributed``."""

import dataclasses

import torch

from zero3_muon_common import TOTAL_SAMPLES, NSCounter, build_model, ds_config, loss_fn, step_batch


def _gathered_weights(engine, stage):
    """Full parameters by name. Under ZeRO-3 one at a time: stock 0.19.7 gathers several at once
    with a wait on the last handle only, which on gloo can return before the others arrive."""
    params = list(engine.module.named_parameters())
    if stage != 3:
        return {n: p.detach().cpu().numpy().copy() for n, p in params}
    import deepspeed
    weights = {}
    for n, p in params:
        with deepspeed.zero.GatheredParameters([p]):
            weights[n] = p.detach().cpu().numpy().copy()
    return weights


def train_run(model="mixed", stage=3, gas=1, steps=3, clip=0.0, target_scale=1.0, zero_extra=None):
    """Train ``model`` with DeepSpeed Muon on this rank's share of every step's samples.

    Micro-step ``m`` of rank ``r`` takes samples ``[(m * W + r) * mb, ... + mb)`` of the step, so
    every step uses the same ``TOTAL_SAMPLES`` samples whatever ``gas`` and W are.

    Returns:
        dict with ``weights`` (full parameters by name), ``ns_per_step`` (NS calls on this rank
        at each boundary), ``ns_off_boundary`` (NS calls on non-boundary micro-steps),
        ``norms`` (``get_global_grad_norm()`` per step) and ``stats`` (the boundary's counters,
        or None when the optimizer has none) and ``dynamo_graphs`` (graphs TorchDynamo compiled in
        this process so far: 0 when it is disabled).
    """
    import deepspeed
    import deepspeed.comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    counter = NSCounter()
    config = ds_config(stage, gas, world_size, clip=clip, zero_extra=zero_extra)
    net = build_model(model)
    engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=net.parameters())
    micro = TOTAL_SAMPLES // (world_size * gas)
    ns_per_step, ns_off_boundary, norms = [], 0, []
    for step in range(steps):
        x, y = step_batch(model, step, target_scale)
        for m in range(gas):
            lo = (m * world_size + rank) * micro
            before = counter.count
            loss = loss_fn(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            if m < gas - 1:
                ns_off_boundary += counter.count - before
            else:
                ns_per_step.append(counter.count - before)
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    boundary = getattr(engine.optimizer, "muon_boundary", None)
    from torch._dynamo.utils import counters
    result = dict(weights=_gathered_weights(engine, stage),
                  dynamo_graphs=int(counters["stats"]["unique_graphs"]),
                  ns_per_step=ns_per_step,
                  ns_off_boundary=ns_off_boundary,
                  norms=norms,
                  stats=dataclasses.asdict(boundary.stats) if boundary is not None else None)
    engine.destroy()
    return result


def train_runs(runs):
    """``train_run(**kwargs)`` for every dict in ``runs``, in one process group; list of results."""
    return [train_run(**kwargs) for kwargs in runs]
