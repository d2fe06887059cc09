# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Newton-Schulz calls counted on upstream's kernels (``NSCounter``): matrices orthogonalized per step, and time."""

import math
import time

import torch

NS_KERNELS = ("zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5", "zeropower_via_polar_express")
"""Upstream's Newton-Schulz kernels, attributes of ``deepspeed.runtime.zero.muon.original_muon`` (Polar Express's
where this DeepSpeed imports it there from ``polar_express``)."""


class NSCounter:
    """Counts calls into upstream's Newton-Schulz kernels by replacing the ``original_muon`` module attributes with
    counting wrappers (every caller looks them up there at call time); ``uninstall`` or leaving ``with`` restores them.

    Install before the first optimizer step: where ``muon_update`` is ``torch.compile``d (0.19.7) and TorchDynamo is
    on, it is traced with the kernels it finds then, the counting replayed as a side effect of each call. On stock
    DeepSpeed a kernel ``original_muon`` lacks (Polar Express) keeps count 0.

    Attributes:
        count: matrices orthogonalized: a call on ``(..., rows, cols)`` counts the product of the leading dimensions,
            as that many calls of one would (an expert group of E experts counts E; a per-head projection its heads).
        by_kernel: the same per kernel name (NS_KERNELS). calls: kernel calls.
        seconds: wall time inside the kernels (``time.perf_counter`` around each outermost call; off the CPU the
            device is synchronized before and after, so asynchronous launches are not timed as free).
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
