# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Checkpoints: save at step 3, load into a fresh engine, and continue to step 6 bit-identically
to an uninterrupted run, momentum included (it shapes every later update), W=2, gas=2, in fp32,
bf16 and with CPU optimizer offload.

A checkpoint written by stock 0.19.8 under bf16 holds the Muon momentum in bf16 (stock allocates
it in the communication dtype); the same layout, made by storing this build's momentum in bf16,
must load, be upcast to fp32, and train on.

A resume late in training (step 15 of 16, fp32) is bit-identical here too. In other models the
auxiliary Adam's parameters can differ by an ulp after such a resume (the Muon matrices do not):
upstream's CPU Adam kernel (``csrc/includes/cpu_adam.h``, ``Adam_Optimizer::IncrementStep``)
multiplies beta**step up by one fp32 product per step while a run goes on, but recomputes it with
``std::pow`` when the step jumps, as it does after ``load_checkpoint``. Stock 0.19.8 with plain
``"Adam"`` does the same (measured on a 3-rank MLP with 180-element biases: resumed at step 15,
1.5e-8 max abs after one step; 0.0 when resumed at step 3 or 8). If this test fails only on 1-D
parameters, that is the cause.
"""

import functools
import tempfile

import numpy as np
import pytest

from zero3_muon_common import relative_difference
from zero3_muon_harness import run_distributed
from zero3_muon_workers import train_runs

STEPS, RESTART = 6, 3
LATE_STEPS, LATE_RESTART = 16, 15
BF16 = {"bf16": {"enabled": True}}
SETTINGS = {
    "fp32": {},
    "bf16": dict(ds_extra=BF16),
    "offload": dict(zero_extra={"offload_optimizer": {"device": "cpu"}}),
}


@functools.lru_cache(maxsize=None)
def trained():
    runs, names = [], []
    for name, kwargs in SETTINGS.items():
        runs += [dict(gas=2, steps=STEPS, **kwargs),
                 dict(gas=2, steps=STEPS, restart_after=RESTART, checkpoint_dir=tempfile.mkdtemp(), **kwargs)]
        names += [(name, "straight"), (name, "restarted")]
    runs.append(dict(gas=2, steps=STEPS, restart_after=RESTART, checkpoint_dir=tempfile.mkdtemp(), momentum_to_bf16=True,
                     ds_extra=BF16))
    names.append(("bf16", "stock_momentum"))
    runs += [dict(gas=2, steps=LATE_STEPS),
             dict(gas=2, steps=LATE_STEPS, restart_after=LATE_RESTART, checkpoint_dir=tempfile.mkdtemp())]
    names += [("late", "straight"), ("late", "restarted")]
    return dict(zip(names, run_distributed(train_runs, 2, runs, timeout=1200)[0]))


@pytest.mark.parametrize("name", [*SETTINGS, "late"])
def test_resume_is_bit_identical(name):
    straight, restarted = trained()[(name, "straight")], trained()[(name, "restarted")]
    for key in straight["weights"]:
        assert np.array_equal(straight["weights"][key], restarted["weights"][key]), key
    assert straight["norms"] == restarted["norms"]
    assert restarted["final_momentum_dtypes"] == ["torch.float32"]


def test_bf16_momentum_from_a_stock_checkpoint_is_upcast_and_trains():
    straight, upcast = trained()[("bf16", "straight")], trained()[("bf16", "stock_momentum")]
    assert upcast["final_momentum_dtypes"] == ["torch.float32"]
    difference = relative_difference(straight["weights"], upcast["weights"])
    # The momentum lost its low bits once (bf16 keeps 8 of fp32's 24), so the runs part a little.
    assert 0 < difference < 1e-2

