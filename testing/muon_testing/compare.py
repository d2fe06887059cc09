# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How trainings are compared: the fp32 floor, relative weight differences, an engine's full weights, a free port."""

import contextlib
import socket

import numpy as np
import torch

FLOOR = 2e-6
"""Relative weight difference allowed between two fp32 runs differing only in the order of fp32 sums (samples split
differently over ranks and micro-steps, reference vs ZeRO-3), Newton-Schulz in fp32 on the CPU: ~3x the largest one
measured on the test models after 4 steps, 6.0e-7 (gas=1 vs gas=4 at W=4; docs/configurations.md). Wrong results are
far off: momentum advanced per micro-step gives 1e-1, clipping the update instead of the gradient 4e-3."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's ``--master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _float64(x):
    if torch.is_tensor(x):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def relative_difference(a, b) -> float:
    """``||a - b|| / ||a||`` over all parameters, in float64; ``a``, ``b``: dicts name -> array (numpy or torch, any
    float dtype) with the same keys, or equal-length sequences of arrays paired in order.

    Raises:
        ValueError: the keys (or lengths) differ.
    """
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise ValueError(f"different parameter names: {sorted(a)} vs {sorted(b)}")
        pairs = [(a[k], b[k]) for k in a]
    else:
        a, b = list(a), list(b)
        if len(a) != len(b):
            raise ValueError(f"different numbers of parameters: {len(a)} vs {len(b)}")
        pairs = list(zip(a, b))
    num = den = 0.0
    for x, y in pairs:
        x, y = _float64(x), _float64(y)
        num += float(np.sum((x - y)**2))
        den += float(np.sum(x**2))
    return (num / den)**0.5


def gathered_weights(engine) -> dict:
    """Full parameters of ``engine.module`` by name, fp32 CPU tensors, on every rank (collective under ZeRO-3). Under
    ZeRO-3 one parameter at a time: stock 0.19.7 gathers several at once and waits on the last handle only, which on
    gloo can return before the others arrive."""
    import deepspeed
    weights = {}
    for name, param in engine.module.named_parameters():
        ctx = deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") else contextlib.nullcontext()
        with ctx:
            weights[name] = param.detach().float().cpu().clone()
    return weights
