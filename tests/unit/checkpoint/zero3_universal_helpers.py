# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared by the universal-checkpoint tests of any optimizer: ``unequal_states``, and a ZeRO-3
universal checkpoint loaded at ZeRO stage 1 or 2.

A stage-1/2 test runs twice with the same ``tmp_path`` (``world_size`` ``[2, W']``). At W=2
``save_convert_and_continue`` trains a ZeRO-3 run for ``SAVE_AFTER`` steps, saves, converts with
``ds_to_universal`` (tag ``zero3_universal``), records the saved state (fp32 masters and every
optimizer state per parameter, group settings, Adam's step) and trains on for ``MORE`` steps
without stopping. At W' ``load_at`` builds the stage-1/2 engine with ``load_universal`` and loads
the checkpoint; ``check_restored_exactly`` and ``continue_training`` then compare it with what
was recorded.

``broken_checkpoints_refused`` loads tampered copies of a ZeRO-3 universal checkpoint at W=1 and
checks what each refusal says.
"""

import shutil

import numpy as np
import pytest
import torch

from muon_testing.compare import gathered_weights, relative_difference
from muon_testing.models import loss_fn, step_batch
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import convert_to_universal

SAVE_AFTER = 3
"""Optimizer steps before the checkpoint."""
MORE = 2
"""Optimizer steps after it, by the run that never stopped and by the resumed one."""
TAG = "zero3_universal"
"""The universal checkpoint's tag under ``<tmp_path>/ckpt``."""
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")
"""Parameter-group settings compared after loading (a test adds its optimizer's own)."""


def unequal_states(saved: dict, loaded: dict) -> list:
    """The keys of two ``gathered_optimizer_state`` dicts (``(parameter, state)``) whose loaded
    value is not exactly the saved one, or that only one side has."""
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
    """Per parameter name: the fp32 master and every tensor state its ZeRO-3 sub-group holds, full
    shape, fp32 CPU (collective)."""
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
    """The step counts of every optimizer state holding Adam's ``exp_avg`` (None where one has no
    step); one value after a save and a load that kept them."""
    steps = set()
    for group in base_optimizer.param_groups:
        for p in group["params"]:
            state = base_optimizer.state.get(p, {})
            if "exp_avg" in state:
                steps.add(int(state["step"]) if "step" in state else None)
    return steps


def save_convert_and_continue(run, tmp_path, settings=GROUP_SETTINGS):
    """W=2, ZeRO-3: train, save, convert, record, train on; writes ``tmp_path/expected.pt``."""
    import deepspeed.comm as dist
    assert dist.get_world_size() == 2
    engine = run.build_engine(run.config(2))
    train_steps(engine, run, range(SAVE_AFTER))
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="zero3")
    convert_to_universal(str(tmp_path / "ckpt"), "zero3")
    state = _zero3_full_state(engine)
    engine.optimizer._set_fp32_optimizer_param_groups()
    saved = dict(state=state,
                 groups=group_settings(engine.optimizer.optimizer, settings),
                 adam_steps=adam_steps(engine.optimizer.optimizer))
    engine.optimizer._clear_fp32_optimizer_param_groups()
    saved["continued"] = []
    for step in range(SAVE_AFTER, SAVE_AFTER + MORE):
        train_steps(engine, run, [step])
        saved["continued"].append(gathered_weights(engine))
    engine.destroy()
    if dist.get_rank() == 0:
        torch.save(saved, tmp_path / "expected.pt")
    dist.barrier()


def load_at(run, tmp_path, tag=TAG):
    """Build ``run`` (stage 1/2, this W) with load_universal, load, return ``(engine, expected)``."""
    import deepspeed.comm as dist
    config = run.config(dist.get_world_size())
    config["checkpoint"] = {"load_universal": True}
    engine = run.build_engine(config)
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


def continue_training(engine, run, expected):
    """Train the ``MORE`` steps after the save; the relative weight difference to the ZeRO-3 run
    that never stopped after each. Destroys the engine."""
    differences = []
    for k, step in enumerate(range(SAVE_AFTER, SAVE_AFTER + MORE)):
        train_steps(engine, run, [step])
        differences.append(relative_difference(expected["continued"][k], gathered_weights(engine)))
    engine.destroy()
    return differences


def universal_round_trip(run, tmp_path, stage, settings=GROUP_SETTINGS):
    """The two phases: save at W=2 the first time (no ``expected.pt`` yet) and return None; load
    at stage ``stage`` the second, check, and return ``(engine, expected)``."""
    if not (tmp_path / "expected.pt").exists():
        save_convert_and_continue(run, tmp_path, settings)
        return None
    engine, expected = load_at(run.with_(stage=stage), tmp_path)
    check_restored_exactly(engine, expected, settings)
    return engine, expected


def broken_checkpoints_refused(run, tmp_path, saved_at, tamper, refusals, groups_error):
    """At W=2 trains ``run`` to ``saved_at`` and saves its universal checkpoint (tag
    ``restart_universal``); at W=1 loads a copy broken by ``tamper(folder, how)`` for each ``how`` of
    ``refusals`` (``{how: words the ValueError must contain}``), then the checkpoint under
    ``two_muon_groups`` (its error must match ``groups_error``), then the untouched checkpoint."""
    import deepspeed.comm as dist
    if dist.get_world_size() == 2:
        run.with_(steps=saved_at, restart_after=saved_at).train(checkpoint_dir=str(tmp_path))
        return
    resume = run.with_(resume_from=saved_at)
    config = dict(resume.config(1), checkpoint={"load_universal": True})
    for how, words in refusals.items():
        shutil.copytree(tmp_path / "restart_universal", tmp_path / how)
        tamper(tmp_path / how, how)
        engine = resume.build_engine(config)
        with pytest.raises(ValueError) as error:
            engine.load_checkpoint(str(tmp_path), tag=how)
        engine.destroy()
        print(f"[refused {how}] {error.value}")
        for word in words:
            assert word in str(error.value), (how, str(error.value))
    # Other parameter groups than the checkpoint's: refused too.
    engine = resume.with_(groups="two_muon_groups").build_engine(config)
    with pytest.raises(ValueError, match=groups_error):
        engine.load_checkpoint(str(tmp_path), tag="restart_universal")
    engine.destroy()
    # The untouched checkpoint loads.
    engine = resume.build_engine(config)
    engine.load_checkpoint(str(tmp_path), tag="restart_universal")
    engine.destroy()
