# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared by the ZeRO Muon tests, the benchmark, the demo and the GPU check: test models, the single-process reference
and how results are compared.

- ``compare``: ``FLOOR``, ``relative_difference``, ``gathered_weights``, ``free_port``.
- ``counting``: ``NSCounter``, Newton-Schulz calls counted on upstream's kernels (``NS_KERNELS``).
- ``models``: the test models, their per-step data (``step_batch``), ``loss_fn`` and parameter groups.
- ``reference``: ``train_reference``, what a PyTorch user writes by hand (one process, upstream ``muon_update`` per
  matrix, AdamW for the rest), with Newton-Schulz pinned to fp32.

Every module imports only numpy and torch at module level and DeepSpeed inside its functions, so it loads under stock
DeepSpeed too (the benchmark compares stock builds). Import the modules (``from muon_testing.compare import FLOOR``):
this file imports none of them.
"""
