# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""fp16 with dynamic loss scaling, bf16, and gradient clipping, checked by replay.

No single-process model reproduces fp16/bf16 forward passes bit for bit, so each run (W=2, gas=2, 8 steps) records
per step each Muon matrix's accumulated (loss-scaled) gradient, the loss scale, the gradient entering Muon, the
momentum and the fp32 masters (``Recorder``); the replay recomputes ``clip_grad_norm_`` on raw gradients then upstream
``muon_update`` in fp32. Stock 0.19.8 fails: its momentum keeps loss-scaled gradients (40-70% off once the scale
changes) and it clips the orthogonalized update. fp16 runs on CPU via ``fp16_allowed_on_cpu``. Tolerance:
``REPLAY_FLOOR`` = 1e-6 (gradient and momentum come out bit-identical, masters within one ulp).
"""

import math

import numpy as np
import pytest

from unit.common import DistributedTest
from muon_testing.models import HYPER, build_model, is_muon_param
from unit.runtime.zero.zero3_muon_helpers import REPLAY_FLOOR, Zero3MuonRun, max_relative_error, replay

OVERFLOWS = (3, 5)  # steps whose first micro-batch overflows fp16: the scale goes down twice, up in between
BASE = Zero3MuonRun(gas=2, steps=8)
FP16 = BASE.with_(dtype="fp16", overflow_steps=OVERFLOWS)
BITES = dict(clip=1.0, target_scale=10.0)  # gradient norms of 8-30
LOOSE = dict(clip=100.0)  # never reached
MUON_NAMES = [n for n, p in build_model("mixed").named_parameters() if is_muon_param(n, p)]


def loss_scale_moves_both_ways_and_overflow_steps_change_nothing(run, result):
    scales = result.loss_scales
    assert any(b > a for a, b in zip(scales, scales[1:])) and any(b < a for a, b in zip(scales, scales[1:]))
    steps, _ = result.records
    assert [i for i, s in enumerate(steps) if s["skipped"]] == list(run.overflow_steps)
    for i in run.overflow_steps:
        for n in MUON_NAMES:
            assert np.array_equal(steps[i][n]["momentum"], steps[i - 1][n]["momentum"])
            assert np.array_equal(steps[i][n]["master"], steps[i - 1][n]["master"])


def clip_bites_but_muon_steps_keep_their_size(run, result):
    """With the clip biting (raw norms 8-30 vs 1.0) each Muon matrix still moves by lr x ~sqrt(min(rows, cols)) x the
    aspect-ratio scale: clipping only rescales what enters the momentum (stock ZeRO clips the orthogonalized update,
    dividing every step by the norm of all updates, over 7.5 here)."""
    steps, initial = result.records
    assert min(s["norm"] for s in steps if not s["skipped"]) > 5 * run.clip
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


def loose_clip_does_not_bite(run, result):
    steps, _ = result.records
    assert max(s["norm"] for s in steps if not s["skipped"]) < run.clip


RUNS = {
    "fp16": (FP16, loss_scale_moves_both_ways_and_overflow_steps_change_nothing),
    "fp16_offload": (FP16.with_(offload="cpu"), loss_scale_moves_both_ways_and_overflow_steps_change_nothing),
    "fp16_clip": (FP16.with_(overflow_steps=OVERFLOWS[:1], **BITES), clip_bites_but_muon_steps_keep_their_size),
    "fp16_clip_loose": (BASE.with_(dtype="fp16", **LOOSE), loose_clip_does_not_bite),
    "bf16": (BASE.with_(dtype="bf16"), None),
    "bf16_clip": (BASE.with_(dtype="bf16", **BITES), clip_bites_but_muon_steps_keep_their_size),
    "bf16_clip_loose": (BASE.with_(dtype="bf16", **LOOSE), loose_clip_does_not_bite),
    "fp32_clip": (BASE.with_(**BITES), clip_bites_but_muon_steps_keep_their_size),
    "fp32_clip_loose": (BASE.with_(**LOOSE), loose_clip_does_not_bite),
}
MARKS = {name: [pytest.mark.core] if name in ("fp16", "bf16_clip") else [] for name in RUNS}


def assert_matches_replay(run, check, result):
    """Gradient entering Muon, fp32 momentum and masters match the replay every step; and the run's property holds."""
    steps = replay(result.records, MUON_NAMES, HYPER, clip=run.clip)
    for key in ("entered", "momentum", "master"):
        pairs = [step[n][key] for step in steps for n in MUON_NAMES if key in step[n]]
        assert pairs, key
        error = max_relative_error(pairs)
        assert error <= REPLAY_FLOOR, (key, error)
    assert set(result.momentum_dtypes) == {"torch.float32"}
    if check is not None:
        check(run, result)


class TestZero3MuonPrecision(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS[n]) for n in RUNS])
    def test_muon_update_matches_replay(self, name):
        """Matches the replay; ``get_global_grad_norm()`` is the raw norm (1e-5: the same norm of the fp32 partitions
        summed in another order)."""
        run, check = RUNS[name]
        result = run.train(record=True)
        assert_matches_replay(run, check, result)
        recorded = [s for s in result.records[0] if not s["skipped"]]
        assert recorded
        for step in recorded:
            assert step["norm"] == pytest.approx(step["norm_from_gradients"], rel=1e-5)
