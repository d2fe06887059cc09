# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Test utilities for Muon's Newton-Schulz: a call counter on upstream's kernels, and upstream
``muon_update`` as the single-process reference (conv weights composed as Keller Jordan's Muon)."""

import math
import time

import torch

NS_KERNELS = ("zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5", "zeropower_via_polar_express")
"""Upstream's Newton-Schulz kernels, module attributes of ``deepspeed.runtime.zero.muon.original_muon``
(Polar Express's where patch 0017 imports it there, ``polar_express.zeropower_via_polar_express``)."""


class NSCounter:
    """Counts calls into upstream's Newton-Schulz kernels by replacing the ``original_muon`` module
    attributes with counting wrappers (every caller looks them up there at call time).

    Install before the first optimizer step: where ``muon_update`` itself is ``torch.compile``d
    (0.19.7) and TorchDynamo is on, it is traced with the kernels it finds then, and the counting
    is replayed as a side effect of each call. ``uninstall`` (or leaving the ``with`` block)
    restores the kernels. Works on stock DeepSpeed too (a kernel ``original_muon`` lacks, Polar
    Express there, is not counted; its count stays 0).

    Attributes:
        count: matrices orthogonalized, over all calls: a call on a batch of shape
            ``(..., rows, cols)`` counts the product of its leading dimensions, so one batched call
            on k same-shape matrices counts k, as k calls of one would (an expert group of E experts
            counts E; a per-head projection its number of heads);
        by_kernel: the same per kernel name (NS_KERNELS);
        calls: kernel calls;
        seconds: wall time spent inside the kernels, in seconds (``time.perf_counter`` around each
            outermost call; on a device other than the CPU the device is synchronized before and
            after, so that asynchronous launches are not timed as free).
    """

    def __init__(self):
        self.count = 0
        self.calls = 0
        self.by_kernel = dict.fromkeys(NS_KERNELS, 0)
        self.seconds = 0.0
        self._saved = {}
        self._depth = 0  # a kernel calling the other through the module is timed once

    def install(self):
        from deepspeed.runtime.zero.muon import original_muon
        for name in NS_KERNELS:
            if not hasattr(original_muon, name):
                continue
            kernel = self._saved[name] = getattr(original_muon, name)

            def counted(*args, _kernel=kernel, _name=name, **kwargs):
                G = args[0] if args else kwargs["G"]
                problems = math.prod(G.shape[:-2])
                self.count += problems
                self.by_kernel[_name] += problems
                self.calls += 1
                if self._depth:
                    return _kernel(*args, **kwargs)
                self._depth += 1
                try:
                    self._synchronize(G)
                    start = time.perf_counter()
                    out = _kernel(*args, **kwargs)
                    self._synchronize(G)
                    self.seconds += time.perf_counter() - start
                finally:
                    self._depth -= 1
                return out

            setattr(original_muon, name, counted)
        return self

    @staticmethod
    def _synchronize(tensor):
        if tensor.device.type != "cpu":
            torch.accelerator.synchronize(tensor.device)

    def uninstall(self):
        from deepspeed.runtime.zero.muon import original_muon
        for name, kernel in self._saved.items():
            setattr(original_muon, name, kernel)
        self._saved = {}

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()


def reference_muon_update(grad, momentum, beta, ns_method="gram", is_expert_group=False, num_heads=None):
    """Upstream ``muon_update``, except for 4-D convolution weights, where it fails in its final
    ``torch.where(finite, update, grad)`` ((out, in*kh*kw) does not broadcast against
    (out, in, kh, kw)); for those its own steps are composed as Keller Jordan's Muon does them:
    the same lerps, NS on the weight flattened to (out, -1), scaled by its last two dimensions."""
    from deepspeed.runtime.zero.muon import original_muon
    if num_heads is not None:
        return original_muon.muon_update(grad, momentum, beta=beta, ns_method=ns_method, num_heads=num_heads)
    if grad.ndim != 4 or is_expert_group:
        return original_muon.muon_update(grad,
                                         momentum,
                                         beta=beta,
                                         ns_method=ns_method,
                                         is_expert_group=is_expert_group)
    momentum.lerp_(grad, 1 - beta)
    x = grad.lerp_(momentum, beta).view(len(grad), -1)
    kernel = original_muon.zeropower_via_gram_newtonschulz
    if ns_method == "standard":
        kernel = original_muon.zeropower_via_newtonschulz5
    elif ns_method == "polar_express":
        kernel = original_muon.zeropower_via_polar_express
    return kernel(x, steps=5) * max(1, grad.size(-2) / grad.size(-1))**0.5


def orthogonalize_all(matrices, specs, ns_steps, ns_method, dtype, batch=None, max_call_numel=None):
    """``newton_schulz.orthogonalize_each`` over matrices in hand: their updates as a list, in order."""
    from deepspeed.runtime.zero.muon.newton_schulz import orthogonalize_each
    updates = [None] * len(matrices)
    device = matrices[0].device if matrices else "cpu"
    for members, results in orthogonalize_each(matrices.__getitem__, specs, ns_steps, ns_method, dtype, device, batch,
                                               max_call_numel):
        for k, result in zip(members, results):
            updates[k] = result
    return updates
