# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared by the universal-checkpoint tests. A two-phase test runs twice with one ``tmp_path`` (``[2, W']``): at W=2
``save_convert_and_continue`` saves, converts, records and trains ``MORE`` steps; at W' ``load_at`` loads and
``check_restored_exactly`` and ``continue_training`` compare with the record."""

import os
import shutil

import numpy as np
import pytest
import torch

from muon_testing.compare import gathered_weights, relative_difference
from muon_testing.models import loss_fn, step_batch
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import convert_to_universal

SAVE_AFTER = 3  # optimizer steps before the checkpoint
MORE = 2  # optimizer steps after it, by the run that never stopped and by the resumed one
TAG = "zero3_universal"  # the universal checkpoint's tag under <tmp_path>/ckpt
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")  # compared after loading (tests add their optimizer's)
CONTINUE_FLOOR = 1e-6
"""Relative weight difference allowed after each ``MORE`` step between a resumed run and the one never stopped: same
math from bit-identical state, fp32 sums reduced in another order. Measured (0.19.8, Muon from ZeRO-3): at most
1.74e-7; the bound is about 6x that. A state not restored or misread moves the weights by ~1e-2."""


def unequal_states(saved: dict, loaded: dict) -> list:
    """``(parameter, state)`` keys of two ``gathered_optimizer_state`` dicts that differ or that one side lacks."""
    return sorted(key for key in saved.keys() | loaded.keys()
                  if key not in saved or key not in loaded or not np.array_equal(saved[key], loaded[key]))


def train_steps(engine, run, steps):
    """Optimizer steps ``steps`` (indices) of ``run``'s samples on this engine, as Zero3MuonRun does."""
    import deepspeed.comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    micro = run.samples // (world_size * run.gas)
    input_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[run.dtype]
    with fp32_newton_schulz():
        for step in steps:
            x, y = step_batch(run.model, step, run.target_scale, run.samples)
            for m in range(run.gas):
                lo = (m * world_size + rank) * micro
                loss = loss_fn(engine(x[lo:lo + micro].to(input_dtype)).float(), y[lo:lo + micro])
                engine.backward(loss)
                engine.step()


def _zero3_full_state(engine):
    """Per parameter name: the fp32 master and every state of its sub-group, full, fp32 CPU (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    opt = engine.optimizer
    state = {}
    for sub_group_id, params in enumerate(opt.fp16_groups):
        flat_state = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[sub_group_id], {})
        keys = sorted(k for k, v in flat_state.items() if torch.is_tensor(v) and v.dim() == 1)
        for param in params:
            entry = {"fp32": safe_get_full_fp32_param(param).detach().float().cpu().clone()}
            for key in keys:
                entry[key] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
            state[opt.param_names[param]] = entry
    return state


def group_settings(base_optimizer, settings):
    """``settings`` of every parameter group, in order (None where a group lacks one)."""
    return [{k: group.get(k) for k in settings} for group in base_optimizer.param_groups]


def adam_steps(base_optimizer):
    """The step counts of every state holding Adam's ``exp_avg`` (None where one has no step)."""
    steps = set()
    for group in base_optimizer.param_groups:
        for p in group["params"]:
            state = base_optimizer.state.get(p, {})
            if "exp_avg" in state:
                steps.add(int(state["step"]) if "step" in state else None)
    return steps


def save_convert_and_continue(run, tmp_path, settings=GROUP_SETTINGS):
    """First phase (True; False once ``tmp_path/expected.pt`` exists): at W=2 train, save (tag ``zero3``, or
    ``zero12`` with ``--inject_missing_state``), convert, record, train on."""
    import deepspeed.comm as dist
    if (tmp_path / "expected.pt").exists():
        return False
    assert dist.get_world_size() == 2
    engine = run.build_engine(run.config(2))
    train_steps(engine, run, range(SAVE_AFTER))
    tag = "zero3" if run.stage == 3 else "zero12"
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    convert_to_universal(str(tmp_path / "ckpt"), tag, inject_missing_state=run.stage < 3)
    saved = dict(continued=[])
    if run.stage == 3:
        saved["state"] = _zero3_full_state(engine)
        engine.optimizer._set_fp32_optimizer_param_groups()
        saved.update(groups=group_settings(engine.optimizer.optimizer, settings),
                     adam_steps=adam_steps(engine.optimizer.optimizer))
        engine.optimizer._clear_fp32_optimizer_param_groups()
    for step in range(SAVE_AFTER, SAVE_AFTER + MORE):
        train_steps(engine, run, [step])
        saved["continued"].append(gathered_weights(engine))
    engine.destroy()
    if dist.get_rank() == 0:
        torch.save(saved, tmp_path / "expected.pt")
    dist.barrier()
    return True


def universal_engine(run):
    """``run``'s engine at this W with ``"checkpoint": {"load_universal": true}``."""
    import deepspeed.comm as dist
    return run.build_engine(dict(run.config(dist.get_world_size()), checkpoint={"load_universal": True}))


def load_at(run, tmp_path, tag=TAG):
    """Build ``run`` with load_universal at this W, load, return ``(engine, expected)``."""
    engine = universal_engine(run)
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    return engine, torch.load(tmp_path / "expected.pt", weights_only=False)


def check_restored_exactly(engine, expected, settings=GROUP_SETTINGS):
    """fp32 masters, Adam's moments and step, group ``settings``: bit-identical to the saved ones."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    for name, param in engine.module.named_parameters():
        saved = expected["state"][name]
        assert torch.equal(safe_get_full_fp32_param(param).float().cpu(), saved["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            if key in saved:
                assert torch.equal(safe_get_full_optimizer_state(param, key).float().cpu(), saved[key]), (name, key)
    assert group_settings(engine.optimizer.optimizer, settings) == expected["groups"]
    assert adam_steps(engine.optimizer.optimizer) == expected["adam_steps"] and None not in expected["adam_steps"]


def continue_training(phase, run, label):
    """Train ``(engine, expected)`` ``MORE`` steps, each within ``CONTINUE_FLOOR`` of the run never stopped."""
    engine, expected = phase
    differences = []
    for k, step in enumerate(range(SAVE_AFTER, SAVE_AFTER + MORE)):
        train_steps(engine, run, [step])
        differences.append(relative_difference(expected["continued"][k], gathered_weights(engine)))
    engine.destroy()
    print(f"MEASURED {label}: relative weight differences per step {differences}")
    assert max(differences) < CONTINUE_FLOOR, differences


def universal_round_trip(run, tmp_path, load, settings=GROUP_SETTINGS):
    """Saves ``run`` the first time (None); loads as ``load`` the second, checks it, returns ``(engine, expected)``."""
    if save_convert_and_continue(run, tmp_path, settings):
        return None
    engine, expected = load_at(load, tmp_path)
    check_restored_exactly(engine, expected, settings)
    return engine, expected


def state_file(folder, name, state):
    return os.path.join(folder, "zero", name, f"{state}.pt")


def rewrite_state(folder, name, state, change):
    """Replace the universal checkpoint's ``state`` of parameter ``name`` by ``change`` of it."""
    saved = torch.load(state_file(folder, name, state), weights_only=False)
    saved["param"] = change(saved["param"])
    torch.save(saved, state_file(folder, name, state))


def broken_checkpoints_refused(run, tmp_path, saved_at, tamper, refusals, groups_error):
    """At W=2 save a universal checkpoint at ``saved_at``; at W=1 each copy broken by ``tamper(folder, how)`` raises a
    ValueError with ``refusals[how]``'s words, other groups raise ``groups_error``, the untouched one loads."""
    import deepspeed.comm as dist
    if dist.get_world_size() == 2:
        run.with_(steps=saved_at, restart_after=saved_at).train(checkpoint_dir=str(tmp_path))
        return
    resume = run.with_(resume_from=saved_at)
    for how, words in refusals.items():
        shutil.copytree(tmp_path / "restart_universal", tmp_path / how)
        tamper(tmp_path / how, how)
        engine = universal_engine(resume)
        with pytest.raises(ValueError) as error:
            engine.load_checkpoint(str(tmp_path), tag=how)
        engine.destroy()
        print(f"[refused {how}] {error.value}")
        for word in words:
            assert word in str(error.value), (how, str(error.value))
    engine = universal_engine(resume.with_(groups="two_muon_groups"))
    with pytest.raises(ValueError, match=groups_error):
        engine.load_checkpoint(str(tmp_path), tag="restart_universal")
    engine.destroy()
    engine = universal_engine(resume)
    engine.load_checkpoint(str(tmp_path), tag="restart_universal")
    engine.destroy()
