# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""fp16 with dynamic loss scaling, bf16, and gradient clipping, checked by replay.

fp16 and bf16 forward passes cannot be reproduced bit for bit by a single-process model, so each
run (W=2, gas=2, 8 steps) records, at every optimizer step, every Muon matrix's accumulated
gradient as DeepSpeed's reduce path left it (still multiplied by the loss scale), the loss scale,
the gradient that entered the Muon update, the momentum after it and the fp32 master weights
(``zero3_muon_replay``). The replay recomputes, from the accumulated gradients and loss scales
alone, what ``clip_grad_norm_`` on the raw gradients followed by upstream ``muon_update`` in fp32
gives. Stock 0.19.8 fails this: its momentum keeps loss-scaled gradients (40-70% off once the
scale changes) and it clips the orthogonalized update.

fp16 on the CPU accelerator: DeepSpeed refuses fp16 there although fp16 tensors work on the CPU;
the fp16 runs claim accelerator support while their engine is built (``fp16_allowed_on_cpu`` in
``zero3_muon_workers``), then Newton-Schulz keeps its fp32 compute dtype.

Tolerance (REPLAY_FLOOR = 1e-6): the gradient entering Muon and the momentum are elementwise fp32
operations on the same values and come out bit-identical (measured 0.0); the master weights
differ by at most one ulp (measured 3.4e-7 to 4.2e-7 relative) where the optimizer's vectorized
update of the flat partition and the replay's update of the whole matrix put different elements in
the scalar remainder loop.
"""

import functools
import math

import numpy as np
import pytest

from zero3_muon_common import HYPER, build_model, is_muon_param
from zero3_muon_harness import run_distributed
from zero3_muon_replay import max_relative_error, replay
from zero3_muon_workers import train_runs

REPLAY_FLOOR = 1e-6
STEPS = 8
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}}
BF16 = {"bf16": {"enabled": True}}
OVERFLOWS = (3, 5)  # steps whose first micro-batch overflows fp16: the scale goes down twice, up in between
BITES = dict(clip=1.0, target_scale=10.0)  # gradient norms of 8-30
LOOSE = dict(clip=100.0)  # never reached

RUNS = {
    "fp16": dict(ds_extra=FP16, fp16_on_cpu=True, overflow_steps=OVERFLOWS),
    "fp16_offload": dict(ds_extra=FP16, fp16_on_cpu=True, overflow_steps=OVERFLOWS,
                         zero_extra={"offload_optimizer": {"device": "cpu"}}),
    "fp16_clip": dict(ds_extra=FP16, fp16_on_cpu=True, overflow_steps=OVERFLOWS[:1], **BITES),
    "fp16_clip_loose": dict(ds_extra=FP16, fp16_on_cpu=True, **LOOSE),
    "bf16": dict(ds_extra=BF16),
    "bf16_clip": dict(ds_extra=BF16, **BITES),
    "bf16_clip_loose": dict(ds_extra=BF16, **LOOSE),
    "fp32_clip": dict(**BITES),
    "fp32_clip_loose": dict(**LOOSE),
}
MUON_NAMES = [n for n, p in build_model("mixed").named_parameters() if is_muon_param(n, p)]


@functools.lru_cache(maxsize=None)
def recorded():
    names = list(RUNS)
    per_rank = run_distributed(train_runs, 2, [dict(gas=2, steps=STEPS, record=True, **RUNS[n]) for n in names],
                               timeout=1200)
    return dict(zip(names, per_rank[0]))


def _replayed(name):
    run = recorded()[name]
    return run, replay(run["records"], MUON_NAMES, HYPER, clip=RUNS[name].get("clip", 0.0))


@pytest.mark.parametrize("name", list(RUNS))
def test_muon_update_matches_replay(name):
    run, steps = _replayed(name)
    for key in ("entered", "momentum", "master"):
        pairs = [step[n][key] for step in steps for n in MUON_NAMES if key in step[n]]
        assert pairs and max_relative_error(pairs) <= REPLAY_FLOOR, key
    assert set(run["momentum_dtypes"]) == {"torch.float32"}


@pytest.mark.parametrize("name", list(RUNS))
def test_reported_norm_is_the_raw_gradient_norm(name):
    steps = [s for s in recorded()[name]["records"][0] if not s["skipped"]]
    assert steps
    for step in steps:
        assert step["norm"] == pytest.approx(step["norm_from_gradients"], rel=1e-5)


@pytest.mark.parametrize("name", ["fp16", "fp16_offload"])
def test_loss_scale_moves_both_ways_and_overflow_steps_change_nothing(name):
    run = recorded()[name]
    scales = run["loss_scales"]
    assert any(b > a for a, b in zip(scales, scales[1:])) and any(b < a for a, b in zip(scales, scales[1:]))
    steps, initial = run["records"]
    assert [i for i, s in enumerate(steps) if s["skipped"]] == list(OVERFLOWS)
    for i in OVERFLOWS:
        for n in MUON_NAMES:
            assert np.array_equal(steps[i][n]["momentum"], steps[i - 1][n]["momentum"])
            assert np.array_equal(steps[i][n]["master"], steps[i - 1][n]["master"])


@pytest.mark.parametrize("name", ["fp16_clip", "bf16_clip", "fp32_clip"])
def test_clip_bites_but_muon_steps_keep_their_size(name):
    """With the clip biting (raw norms 8-30 against 1.0), each Muon matrix still moves by lr times
    an orthogonal matrix's norm, ~sqrt(min(rows, cols)) times the aspect-ratio scale: clipping
    only rescales what enters the momentum. (Clipping the orthogonalized update instead, as
    stock ZeRO does, divides every step by the norm of all the updates: over 7.5 here, from the
    three Muon matrices alone.)"""
    run = recorded()[name]
    steps, initial = run["records"]
    assert min(s["norm"] for s in steps if not s["skipped"]) > 5 * RUNS[name]["clip"]
    previous = initial
    lr, wd = HYPER["muon_lr"], HYPER["weight_decay"]
    for step in steps:
        if step["skipped"]:
            continue
        for n in MUON_NAMES:
            rows, cols = step[n]["master"].shape
            update = (previous[n] * (1 - lr * wd) - step[n]["master"]) / lr
            ratio = np.linalg.norm(update) / (math.sqrt(min(rows, cols)) * max(1.0, rows / cols)**0.5)
            assert 0.5 < ratio < 1.5, (n, ratio)
        previous = {n: step[n]["master"] for n in MUON_NAMES}


@pytest.mark.parametrize("name", ["fp16_clip_loose", "bf16_clip_loose", "fp32_clip_loose"])
def test_loose_clip_does_not_bite(name):
    steps = recorded()[name]["records"][0]
    assert max(s["norm"] for s in steps if not s["skipped"]) < RUNS[name]["clip"]
