# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 universal checkpoints of any optimizer: every state converted, then loaded at W' = 1 and 2.

The extractor must not read ``exp_avg``/``exp_avg_sq`` by name (SGD's momentum hit ``KeyError``). Each round trip runs
three times with one ``tmp_path`` (``world_size`` ``[2, 1, 2]``):

- W=2: MixedMLP (1427 parameters: last partition padded) in two groups (fc1's own settings) trains, saves, converts
  with ``--inject_missing_state``; the folders must hold exactly every recorded state (fp32 masters, optimizer states,
  step, group settings). One more step follows.
- W'=1, then 2: a ``load_universal`` engine must hold exactly the recorded state and, after the same step, the
  uninterrupted run's, bit for bit (AdamW at W'=1: within ``ADAM_ULPS``). 16 samples per step in micro-batches of 8
  (W=2: gas 1; W'=1: 2) keep each fp32 gradient sum identical (halving is exact) and the step is elementwise.

Cases: SGD with momentum and weight decay (client optimizer; ``zero_force_ds_cpu_optimizer: false`` with offload) at
ZeRO-1, 2, 2 + CPU offload; DeepSpeed's AdamW (FusedAdam, DeepSpeedCPUAdam with offload) at ZeRO-1 and 2 + offload. A
state of another length is refused.
"""

import copy
import dataclasses
import glob
import os

import pytest
import torch

from unit.common import DistributedTest
from muon_testing.models import build_model, loss_fn, step_batch
from unit.runtime.zero.zero3_muon_helpers import ADAMW, convert_to_universal, ds_to_universal_args

SAVE_AFTER = 2  # optimizer steps before the checkpoint (SGD's momentum is a plain gradient after the first)
SAMPLES, MICRO = 16, 8  # samples per optimizer step, and per micro-batch at every world size
TAG = "zero12"  # the regular checkpoint's tag under <tmp_path>/ckpt; the universal one is zero12_universal
SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)  # the SGD defaults (the second group's settings)
FIRST_GROUP = dict(sgd=dict(lr=0.02, momentum=0.8, weight_decay=0.0), adamw=dict(lr=0.01, weight_decay=0.0))


@dataclasses.dataclass(frozen=True)
class Case:
    """A ZeRO-1/2 run of MixedMLP: ``optimizer`` "sgd" (``torch.optim.SGD``, client) or "adamw" (``ADAMW``)."""
    optimizer: str
    stage: int
    offload: bool = False

    def config(self, world_size):
        zero = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {
            "train_batch_size": SAMPLES,
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": SAMPLES // (MICRO * world_size),
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        }
        if self.optimizer == "adamw":
            config["optimizer"] = copy.deepcopy(ADAMW)
        return config

    def build_engine(self, world_size, load_universal=False):
        import deepspeed
        config = self.config(world_size)
        if load_universal:
            config["checkpoint"] = {"load_universal": True}
        model = build_model("mixed")
        rest = [p for n, p in model.named_parameters() if not n.startswith("fc1.")]
        groups = [dict(params=list(model.fc1.parameters()), **FIRST_GROUP[self.optimizer]), dict(params=rest)]
        optimizer = torch.optim.SGD(groups, **SGD) if self.optimizer == "sgd" else None
        engine, *_ = deepspeed.initialize(model=model,
                                          config=config,
                                          model_parameters=None if optimizer else groups,
                                          optimizer=optimizer)
        return engine


ADAM_ULPS = 8
"""Largest difference (``ulps``) allowed between AdamW's state one step after loading at W'=1 and the run that never
stopped at W=2 (elsewhere bit-equal). CPU Adam (``cpu_adam.h`` ``Step_AVX``, ``cpu_adam_impl.cpp`` ``Step_1``) updates
FMA vector tiles and the remainder element-wise, rounded differently, and the W'=1 partition is twice as long. Measured
1-3 ulps, 6 on an AVX-512 host (the split follows the vector width); 8: the largest measured, rounded up; the loaded
state itself is bit-identical (0.19.7, 0.19.8). A state not restored differs by far more."""

CASES = [Case(*c) for c in [("sgd", 1), ("sgd", 2), ("sgd", 2, True), ("adamw", 1), ("adamw", 2, True)]]


def train_step(engine, step):
    """Optimizer step ``step``: micro-step m of rank r takes samples ``[(m * W + r) * MICRO, +MICRO)``."""
    import deepspeed.comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    x, y = step_batch("mixed", step, samples=SAMPLES)
    for m in range(SAMPLES // (MICRO * world_size)):
        lo = (m * world_size + rank) * MICRO
        engine.backward(loss_fn(engine(x[lo:lo + MICRO].to(engine.device)), y[lo:lo + MICRO].to(engine.device)))
        engine.step()


def _whole(param, flat):
    """``param``'s elements of flat partition tensor ``flat``, gathered (collective): fp32 CPU, ``param``'s shape.
    Read via fragment addresses: ``safe_get_full_optimizer_state`` knows only states held before the first step, which
    SGD's ``momentum_buffer`` is not."""
    import deepspeed.comm as dist
    buffer = torch.zeros(param.numel(), dtype=torch.float32)
    mapping = param._hp_mapping
    if mapping is not None:
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        buffer.narrow(0, lp.start, lp.numel).copy_(flat.detach().narrow(0, hp.start, hp.numel).float().cpu())
    dist.all_reduce(buffer)
    return buffer.view(param.shape)


def full_state(engine):
    """Full state (collective): ``state[(name, key)]`` fp32 CPU (``fp32``: master); per group ``steps``, ``groups``."""
    opt = engine.optimizer
    state, steps, groups = {}, [], []
    for group_id, group in enumerate(opt.optimizer.param_groups):
        flat = group["params"][0]
        flat_state = opt.optimizer.state.get(flat, {})
        tensors = {k: v for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == flat.shape}
        tensors["fp32"] = flat
        step = flat_state.get("step")
        steps.append(None if step is None else int(step))
        groups.append({k: v for k, v in group.items() if k != "params"})
        for param in opt.bit16_groups[group_id]:
            for key, tensor in sorted(tensors.items()):
                state[opt.param_names[param], key] = _whole(param, tensor)
    return dict(state=state, steps=steps, groups=groups)


def check_converted(folder, saved):
    """Every parameter's folder holds exactly its recorded states (``step.pt``: the group's step), bit for bit."""
    expected = {}
    for name, key in saved["state"]:
        expected.setdefault(name, set()).add(key)
    for name, keys in expected.items():
        files = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(folder, "zero", name, "*.pt"))}
        assert files == keys | ({"step"} if saved["steps"][0] is not None else set()), (name, files, keys)
        for key in keys:
            stored = torch.load(os.path.join(folder, "zero", name, f"{key}.pt"), weights_only=False)["param"]
            assert stored.dtype == torch.float32 and torch.equal(stored, saved["state"][name, key]), (name, key)


def ulps(expected, actual):
    """Largest difference of two fp32 tensors in ulps of ``expected`` (of the smallest normal fp32 where it is 0)."""
    magnitude = expected.abs().clamp_min(torch.finfo(torch.float32).tiny)
    spacing = torch.nextafter(magnitude, torch.tensor(float("inf"))) - magnitude
    return float(((expected - actual).abs() / spacing).max())


def unequal(expected, actual):
    """``{(name, key): ulps or "missing"}`` of the tensors that differ or that one side lacks."""
    return {
        key: ulps(expected[key], actual[key]) if key in expected and key in actual else "missing"
        for key in expected.keys() | actual.keys()
        if key not in expected or key not in actual or not torch.equal(expected[key], actual[key])
    }


class TestZero12UniversalRoundTrip(DistributedTest):
    world_size = [2, 1, 2]
    reuse_dist_env = True

    @pytest.mark.parametrize("case",
                             CASES,
                             ids=lambda c: f"{c.optimizer}-stage{c.stage}{'-offload' if c.offload else ''}")
    def test_converts_every_state_and_resumes_exactly(self, case, tmp_path):
        import deepspeed.comm as dist
        world_size = dist.get_world_size()
        ckpt = str(tmp_path / "ckpt")
        recorded = tmp_path / "recorded.pt"
        if not recorded.exists():  # W=2: train, save, convert, record, one more step
            assert world_size == 2
            engine = case.build_engine(world_size)
            for step in range(SAVE_AFTER):
                train_step(engine, step)
            engine.save_checkpoint(ckpt, tag=TAG)
            folder = convert_to_universal(ckpt, TAG, inject_missing_state=True)
            saved = full_state(engine)
            if dist.get_rank() == 0:
                check_converted(folder, saved)
            train_step(engine, SAVE_AFTER)
            continued = full_state(engine)
            engine.destroy()
            if dist.get_rank() == 0:
                torch.save(dict(saved=saved, continued=continued), recorded)
            dist.barrier()
            return

        expected = torch.load(recorded, weights_only=False)
        engine = case.build_engine(world_size, load_universal=True)
        engine.load_checkpoint(ckpt, tag=f"{TAG}_universal")
        loaded = full_state(engine)
        assert unequal(expected["saved"]["state"], loaded["state"]) == {}
        assert loaded["steps"] == expected["saved"]["steps"] and loaded["groups"] == expected["saved"]["groups"]
        keys = {key for _, key in loaded["state"]}
        assert keys == ({"fp32", "momentum_buffer"} if case.optimizer == "sgd" else {"fp32", "exp_avg", "exp_avg_sq"})
        train_step(engine, SAVE_AFTER)
        after = full_state(engine)
        engine.destroy()
        differences = unequal(expected["continued"]["state"], after["state"])
        print(f"[{case} W'={world_size}] one step after loading vs the run that never stopped (ulps): {differences}")
        if case.optimizer == "sgd" or world_size == 2:
            assert differences == {}
        else:
            assert all(d != "missing" and d <= ADAM_ULPS for d in differences.values()), differences
        assert after["steps"] == expected["continued"]["steps"] and after["groups"] == expected["continued"]["groups"]


class TestZero12UniversalRefusal(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_state_of_another_length_is_refused(self, tmp_path):
        """Rank 1's file gets a state one element longer than its partition in group 1: refused naming it."""
        import deepspeed.comm as dist
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        case = Case("adamw", 2)
        engine = case.build_engine(2)
        train_step(engine, 0)
        engine.save_checkpoint(str(tmp_path), tag=TAG)
        engine.destroy()
        dist.barrier()
        if dist.get_rank() == 0:
            (path, ) = glob.glob(str(tmp_path / TAG / "*zero_pp_rank_1_*optim_states.pt"))
            sd = torch.load(path, weights_only=False)
            group = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][1]
            group["row_scale"] = torch.zeros(group["exp_avg"].numel() + 1)
            torch.save(sd, path)
            args = ds_to_universal_args(str(tmp_path), TAG, inject_missing_state=True)
            with pytest.raises(ValueError) as error:
                ds_to_universal(args)
            print(f"[refused] {error.value}")
            message = str(error.value)
            assert "optimizer state 'row_scale' of ZeRO-1/2 parameter group 1 in " in message, message
            assert os.path.basename(path) in message and "not a flat tensor of the partition's" in message
            assert not os.path.exists(os.path.join(args.output_folder, "zero")), "a parameter was written"
        dist.barrier()


# The extractor's and the merge's pieces on hand-made input (one process).


def _zero12_file(fp32, state, fragments):
    from deepspeed.utils.tensor_fragment import fragment_address
    mappings = {name: fragment_address(numel=n, start=s) for name, (s, n) in fragments.items()}
    return dict(single_partition_of_fp32_groups=[fp32],
                base_optimizer_state=dict(state={} if state is None else {0: state}, param_groups=[]),
                param_slice_mappings=[mappings])


def test_zero12_group_states_keep_every_state_of_the_partition():
    from deepspeed.checkpoint.universal_states import zero12_group_states
    fp32 = torch.arange(6, dtype=torch.float32)
    fragments = {"a": (0, 4), "b": (4, 2)}
    momentum = torch.linspace(-1, 1, 6).bfloat16()
    sgd = zero12_group_states(_zero12_file(fp32, {"momentum_buffer": momentum}, fragments), 0, "f.pt")
    assert sorted(sgd) == ["fp32", "momentum_buffer"] and sgd["fp32"] is fp32
    assert sgd["momentum_buffer"].dtype == torch.float32 and torch.equal(sgd["momentum_buffer"], momentum.float())
    step = torch.tensor(3.0)
    adam = zero12_group_states(_zero12_file(fp32, dict(exp_avg=fp32 * 2, exp_avg_sq=fp32 * 3, step=step), fragments),
                               0, "f.pt")
    assert sorted(adam) == ["exp_avg", "exp_avg_sq", "fp32", "step"] and adam["step"] is step
    assert zero12_group_states(_zero12_file(fp32, None, fragments), 0, "f.pt") == {"fp32": fp32}
    # BF16_Optimizer: the fp32 partition keeps 2 elements of padding, the converter strips them from the states
    padded = torch.arange(8, dtype=torch.float32)
    bf16 = zero12_group_states(_zero12_file(padded, {"exp_avg": fp32}, fragments), 0, "f.pt")
    assert torch.equal(bf16["exp_avg"], fp32)
    for bad in (torch.zeros(7), torch.zeros(5), torch.zeros(2, 3), torch.tensor(1.0), 0.5):
        with pytest.raises(ValueError) as error:
            zero12_group_states(_zero12_file(padded, {"exp_avg": fp32, "row_scale": bad}, fragments), 0, "r1.pt")
        assert "optimizer state 'row_scale' of ZeRO-1/2 parameter group 0 in r1.pt is" in str(error.value)
        assert "not a flat tensor of the partition's 8 elements" in str(error.value)


def test_fragment_states_lists_what_was_extracted(tmp_path):
    from deepspeed.checkpoint.universal_states import fragment_states
    for name in ("0/fp32.00", "0/fp32.01", "0/momentum_buffer.01", "1/exp_avg.00", "0/step.00"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).touch()
    assert fragment_states(str(tmp_path)) == ["exp_avg", "fp32", "momentum_buffer"]
    assert fragment_states(str(tmp_path / "missing")) == []


def test_affine_scale_power():
    from deepspeed.checkpoint.affine import replicated_map
    from deepspeed.checkpoint.universal_states import affine_scale_power
    known = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}
    plain, scaled = replicated_map((2, 3), 2), replicated_map((2, 3), 2, scale=0.5)
    assert [affine_scale_power(s, known, scaled, "w") for s in ("fp32", "exp_avg", "exp_avg_sq")] == [1, -1, -2]
    assert affine_scale_power("momentum_buffer", known, scaled, "w") == -1
    # where no piece is scaled every power moves the state unchanged
    shard = torch.arange(6.0).reshape(2, 3)
    power = affine_scale_power("sum", known, plain, "w")
    assert torch.equal(plain.rebuild({0: shard, 1: shard}, power), shard)
    with pytest.raises(ValueError, match=r"w: its affine map holds pieces scaled by \[0.5\].*state 'sum'"):
        affine_scale_power("sum", known, scaled, "w")
