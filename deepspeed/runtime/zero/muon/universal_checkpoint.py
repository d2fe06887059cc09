# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of ZeRO-3 runs whose optimizer is Muon (or any other optimizer whose
per-parameter state is not Adam's ``exp_avg``/``exp_avg_sq``), and the way to another world size.

A universal checkpoint (``python -m deepspeed.checkpoint.ds_to_universal``) stores every
parameter in a folder of its own, ``<output>/zero/<parameter name>/``, independent of the number
of ranks that wrote it, so ``"checkpoint": {"load_universal": true}`` can load it at any
data-parallel world size W'. Per parameter:

- ``fp32.pt``: the fp32 master weights;
- one file per optimizer state of the parameter's sub-group: ``momentum_buffer.pt`` for a Muon
  matrix (fp32, also when the checkpoint kept it in bf16 as stock 0.19.8 does),
  ``exp_avg.pt`` and ``exp_avg_sq.pt`` for a parameter of the auxiliary Adam (or of Adam);
- ``step.pt``: the optimizer's step count, where the sub-group's state has one (Adam's).

Each tensor file holds ``{"param": tensor}`` with the parameter's logical shape (``ds_shape``,
no ZeRO padding), the form both the ZeRO-3 and the ZeRO-1/2 universal loaders read.
``<output>/zero/optimizer_state.pt`` keeps the optimizer's ``param_groups`` (per group:
``use_muon``, ``lr``, ``momentum``, ``betas``, ``ns_method``, ``weight_decay``, ...) and the loss
scaler.
"""

# Regular checkpoints at another world size
