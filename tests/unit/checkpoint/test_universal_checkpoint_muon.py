# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Universal checkpoints of ZeRO-3 Muon runs: convert, then resume at another world size.

Each resize test runs twice with one ``tmp_path`` (``world_size`` ``[W, W']``): at W 3 steps, save, convert; at W' the
loaded state (fp32 masters, Muon momentum, Adam moments, step) must equal the saved one, and after 2 more steps the
weights must match a 5-step run at W' to the fp32 ``FLOOR`` (only fp32 sum order differs), bit for bit at W' = W. bf16
runs at different world sizes part by bf16 rounding (~1e-2 after 5 steps), so there the distance is only printed.

Cases: MixedMLP (33x21, 17x33, 7x17: every partition ragged at 2, 3, 4 ranks); ``shapes`` (a 1x3 matrix smaller than
W' = 4); bf16; CPU offload; two Muon groups with own momentum, lr, weight decay; a frozen layer; a bf16 momentum as
stock 0.19.8 writes it. Broken checkpoints are refused naming the parameter before anything is read.
"""

import functools
import os
import shutil
import numpy as np
import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.zero3_universal_helpers import (broken_checkpoints_refused, rewrite_state, state_file,
                                                     unequal_states)
from muon_testing.compare import FLOOR, relative_difference
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

SAVED_AT = 3  # optimizer steps before the checkpoint
RUN = Zero3MuonRun(gas=2, steps=5, samples=24, universal=True)
CASES = dict(fp32=RUN, shapes=RUN.with_(model="shapes"), bf16=RUN.with_(dtype="bf16"))
CASES.update(offload=RUN.with_(offload="cpu"), groups=RUN.with_(groups="two_muon_groups"))
CASES.update(frozen=RUN.with_(model="frozen"), stock_bf16_momentum=RUN.with_(momentum_to_bf16=True))
RESIZES = [("fp32", ws) for ws in ([2, 1], [2, 2], [2, 3], [2, 4], [4, 2])] + [("shapes", [2, 4]), ("bf16", [2, 2])]
RESIZES += [(name, [2, 3]) for name in ("bf16", "offload", "groups", "frozen", "stock_bf16_momentum")]


class TestZero3MuonUniversal(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("name, world_size", [
        pytest.param(
            n, ws, marks=[pytest.mark.core] if (n, ws) == ("fp32", [2, 3]) else [], id=f"{n}-{ws[0]}to{ws[1]}")
        for n, ws in RESIZES
    ])
    def test_resume_at_another_world_size(self, name, world_size, tmp_path):
        import deepspeed.comm as dist
        run = CASES[name]
        saved_file = tmp_path / "saved_state.pt"
        if not saved_file.exists():  # first launch: train, save, convert
            saved = run.with_(steps=SAVED_AT, restart_after=SAVED_AT).train(checkpoint_dir=str(tmp_path))
            assert os.path.isdir(tmp_path / "restart_universal" / "zero")
            # bf16 runs at different W part far above the fp32 floor: the run that never stopped at W is only printed.
            straight_at_save = run.train().weights if run.dtype == "bf16" else None
            dist.barrier()
            if dist.get_rank() == 0:
                torch.save((saved.optimizer_state, straight_at_save), saved_file)
            dist.barrier()
            return

        saved_state, straight_at_save = torch.load(saved_file, weights_only=False)
        resumed = run.with_(resume_from=SAVED_AT).train(checkpoint_dir=str(tmp_path))
        straight = run.train()

        expected = dict(saved_state)
        if run.momentum_to_bf16:  # the checkpoint held the momentum in bf16: that is what loads
            for key in [k for k in expected if k[1] == "momentum_buffer"]:
                expected[key] = torch.from_numpy(expected[key]).bfloat16().float().numpy()
        assert unequal_states(expected, resumed.loaded_state) == []
        momenta = [v for k, v in resumed.loaded_state.items() if k[1] == "momentum_buffer"]
        assert momenta and all(np.any(m) for m in momenta), "no Muon momentum was loaded"

        difference = relative_difference(straight.weights, resumed.weights)
        print(f"[universal {name} {world_size[0]}->{world_size[1]}] resumed vs never stopped: {difference:.3g}")
        if run.momentum_to_bf16:
            # The momentum lost its low bits once (bf16 keeps 8 of fp32's 24): near, not equal.
            assert 0 < difference < 1e-2
        elif world_size[0] == world_size[1]:
            for key in straight.weights:
                assert torch.equal(straight.weights[key], resumed.weights[key]), key
        elif run.dtype == "bf16":
            # Printed only; the resharding itself is checked exactly above, and bit for bit at W' = W.
            spread = relative_difference(straight.weights, straight_at_save)
            print(f"[universal {name}] never stopped at {world_size[0]} vs at {world_size[1]}: {spread:.3g}")
        else:
            assert difference <= FLOOR
        resumed.assert_newton_schulz_once_per_problem_per_step(straight.ns_per_step()[0], run.steps - SAVED_AT)


def _tamper(folder, how):
    path = functools.partial(state_file, folder)
    if how == "missing_momentum":
        os.remove(path("fc2.weight", "momentum_buffer"))
    elif how == "adam_moments_on_muon":
        os.rename(path("fc2.weight", "momentum_buffer"), path("fc2.weight", "exp_avg"))
        shutil.copy(path("fc2.weight", "exp_avg"), path("fc2.weight", "exp_avg_sq"))
    elif how == "transposed_momentum":
        rewrite_state(folder, "fc1.weight", "momentum_buffer", lambda t: t.t().contiguous())
    elif how == "short_momentum":
        rewrite_state(folder, "fc3.weight", "momentum_buffer", lambda t: t.flatten()[:-1].clone())
    elif how == "momentum_on_adam":
        shutil.copy(path("fc1.bias", "exp_avg"), path("fc1.bias", "momentum_buffer"))


REFUSALS = {  # how the checkpoint is broken: what the error must say
    "missing_momentum": ["fc2.weight", "momentum_buffer", "from zero"],
    "adam_moments_on_muon": ["fc2.weight", "momentum_buffer", "exp_avg"],
    "transposed_momentum": ["fc1.weight", "(21, 33)", "(33, 21)"],
    "short_momentum": ["fc3.weight", "(118,)", "(7, 17)"],
    "momentum_on_adam": ["fc1.bias", "momentum_buffer", "Adam"],
}


class TestZero3MuonUniversalRefusals(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [[2, 1]])
    def test_broken_checkpoint_is_refused_naming_the_parameter(self, world_size, tmp_path):
        broken_checkpoints_refused(RUN, tmp_path, SAVED_AT, _tamper, REFUSALS, "parameter groups")
