# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The Hugging Face Trainer example (``examples/hf_trainer/``) on 2 CPU ranks, launched both ways.

Four short runs of ``train.py`` with ``--deepspeed ds_config.json`` (ZeRO-3, DeepSpeed's Muon,
HF "auto" values; 6 optimizer steps of 16 windows of 64 bytes, fp32, the Trainer's default
``max_grad_norm`` 1.0 and linear decay), and the dtype Newton-Schulz (the "gram" kernel)
computes in:

    torchrun-gas4     torchrun, gradient_accumulation_steps 4, per-device batch 2   NS in fp32 (pinned)
    torchrun-gas1     torchrun, gradient_accumulation_steps 1, per-device batch 8   NS in fp32 (pinned)
                      (the same samples per step)
    accelerate-gas4   accelerate launch --config_file accelerate_config.yaml,       NS in fp32 (pinned)
                      as torchrun-gas4
    upstream-ns-gas4  torchrun-gas4 with train.py launched as it is                 NS in upstream's dtype:
                                                                                    fp16 on a CPU whose oneDNN
                                                                                    has fp16, else fp32

The pinned runs launch the example through ``ns_fp32_launch.py``, which enters
``fp32_newton_schulz()`` in each rank and then runs ``train.py`` unchanged: the comparisons
below are against the fp32 floor, and upstream's ``ns_compute_dtype`` would otherwise run the
kernel in fp16 on such a CPU (DeepSpeed's CPU accelerator reports fp16 there), whose rounding
puts gas=4 and gas=1 far above it (8.3e-4 measured, both unpinned; upstream-ns-gas4 vs
torchrun-gas4 7.9e-4). upstream-ns-gas4 shows that the example as a user runs it
still trains through the same engine; on a CPU without fp16 it must also give torchrun-gas4's
weights (the wrapper changes nothing else).

Each must train through DeepSpeed's ZeRO-3 engine with ``MuonWithAuxAdam`` (not an HF
optimizer), normalize every step's loss by the same token count (``num_items_in_batch`` =
16 x 63), run Newton-Schulz once per Muon matrix per step, and lower the loss. The final weights
(``model.safetensors``, gathered by ``trainer.save_model``) of gas=4 and gas=1 must agree to
the fp32 floor: relative difference ``||a - b|| / ||a||`` over all parameters below
``FLOOR``; so must accelerate-gas4 and torchrun-gas4.

Floor, measured with exactly this configuration (2 gloo ranks, torch 2.13 CPU, transformers
5.24, accelerate 1.15), torchrun gas=4 vs gas=1: patched 0.19.8, seeds 1-5 and 42: 5.5e-7 to
6.9e-7 (6.7e-7 at the seed used here); patched 0.19.7, seeds 1, 2 and 42: the same values bit for
bit (the Muon path is the same code). On a CPU with AVX512-FP16 and AMX, pinned, patched 0.19.8,
seed 42: 6.3e-7. A repeated run, and accelerate launch vs torchrun at gas=4: exactly 0. ``FLOOR``
is the project's 2e-6, about 3x the largest floor.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muon_testing.compare import FLOOR, free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer"
NS_FP32_LAUNCH = Path(__file__).resolve().parent / "ns_fp32_launch.py"
STEPS = 6
GLOBAL_BATCH = 16
SEQ_LEN = 64
COMMON = [
    "--max_steps", str(STEPS),
    "--learning_rate", "3e-3",
    "--logging_steps", "1",
    "--report_to", "none",
    "--disable_tqdm", "true",
    "--seq_len", str(SEQ_LEN),
    "--max_corpus_bytes", "200000",
    "--seed", "42",
]


def launch(launcher, out, gas, micro, pin_fp32_ns, nproc=2, ds_config="ds_config.json",
           extra=("--save_strategy", "no")):
    """Run ``train.py`` on ``nproc`` ranks (``accelerate``: the yaml's 2) with ``--deepspeed
    EXAMPLE/ds_config`` and ``COMMON`` plus ``extra`` arguments; ``pin_fp32_ns``: through
    ``ns_fp32_launch.py``. Returns its ``zero3muon_run.json`` plus ``output`` (stdout and stderr)
    and ``seconds_wall``; fails the test if the launch does."""
    args = [*COMMON, "--deepspeed", str(EXAMPLE / ds_config), *extra, "--output_dir", str(out),
            "--gradient_accumulation_steps", str(gas), "--per_device_train_batch_size", str(micro)]
    script = [str(EXAMPLE / "train.py")]
    if pin_fp32_ns:
        script = [str(NS_FP32_LAUNCH), *script]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), *script, *args]
    else:
        assert nproc == 2, "accelerate_config.yaml launches 2 processes"
        cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
               str(EXAMPLE / "accelerate_config.yaml"), "--main_process_port", str(free_port()), *script, *args]
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1", PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    # From the repository root: accelerate_config.yaml names ds_config.json relative to it.
    proc = subprocess.run(cmd, cwd=EXAMPLE.parents[1], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-6000:]}"
    result = json.loads((out / "zero3muon_run.json").read_text())
    result["output"] = proc.stdout
    result["seconds_wall"] = time.perf_counter() - t0
    return result


def compare_module():
    """``examples/hf_trainer/compare_weights.py`` (``load``, ``relative_difference``), loaded by path."""
    spec = importlib.util.spec_from_file_location("hf_trainer_compare_weights", EXAMPLE / "compare_weights.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_hf_trainer_gas4_matches_gas1(tmp_path):
    runs = {  # launcher, gradient_accumulation_steps, per-device batch, Newton-Schulz pinned to fp32
        "torchrun-gas4": ("torchrun", 4, 2, True),
        "torchrun-gas1": ("torchrun", 1, 8, True),
        "accelerate-gas4": ("accelerate", 4, 2, True),
        "upstream-ns-gas4": ("torchrun", 4, 2, False),
    }
    results = {
        name: launch(launcher, tmp_path / name, gas, micro, pinned)
        for name, (launcher, gas, micro, pinned) in runs.items()
    }

    for name, r in results.items():
        e = r["engine"]
        gas, micro, pinned = runs[name][1:]
        # Two ranks write to one pipe: another rank's unfinished line can precede the prefix.
        ns_line = [line[line.index("[ns_fp32_launch] "):] for line in r["output"].splitlines()
                   if "[ns_fp32_launch] " in line]
        if pinned:
            assert len(ns_line) == 1 and "Newton-Schulz (gram) computes in float32 (" in ns_line[0], (name, ns_line)
        else:
            assert ns_line == [], name
        assert (e["zero_stage"], e["engine_optimizer"], e["optimizer"]) == (3, "DeepSpeedZeroOptimizer_Stage3",
                                                                           "MuonWithAuxAdam"), name
        assert e["trainer_optimizer"] == "DeepSpeedOptimizerWrapper(DeepSpeedZeroOptimizer_Stage3)", name
        assert (e["gradient_accumulation_steps"], e["train_micro_batch_size_per_gpu"]) == (gas, micro), name
        assert e["boundary_update"] == "owner-centric at the accumulation boundary", name
        assert e["muon_matrices"] == 14 and e["adam_tensors"] == 7, name  # 2 layers x 7 matrices; embed, head, norms
        lrs = {g["use_muon"]: g["lr"] for g in e["param_groups"]}
        assert lrs[True] == 0.02 and lrs[False] == 3e-3, name  # muon_lr from the config, "lr": "auto" for Adam
        # the Trainer's scheduler (LambdaLR) scales each group's own rate: both rates, in their ratio, every step
        assert len(r["group_rates"]) == STEPS, name
        for groups in r["group_rates"]:
            muon = {lr for use_muon, lr in groups if use_muon}
            adam = {lr for use_muon, lr in groups if not use_muon}
            assert len(muon) == len(adam) == 1, (name, groups)
            assert muon.pop() == pytest.approx(adam.pop() * 0.02 / 3e-3, rel=1e-9, abs=1e-15), (name, groups)
        assert max(lr for groups in r["group_rates"] for use_muon, lr in groups if use_muon) > 0, name
        # The Trainer normalizes each step by the target tokens of the whole global batch.
        assert r["num_items_in_batch"] == [GLOBAL_BATCH * (SEQ_LEN - 1)] * STEPS, name
        assert r["optimizer_steps"] == STEPS and r["loss_steps"] == list(range(1, STEPS + 1)), name
        assert sum(s["ns_calls"] for s in r["boundary_stats"]) == e["muon_matrices"] * STEPS, name
        losses = r["losses"]
        assert losses[-1] < losses[0] - 0.5, (name, losses)
        assert "ZeRO-3 Muon: owner-centric update at the accumulation boundary" in r["output"], name
        assert "[hf_trainer] deepspeed " in r["output"] and "+zero3muon: upstream" in r["output"], name

    # What upstream would pick on this machine, as the pinned runs' wrapper reported it.
    upstream_ns = results["torchrun-gas4"]["output"].split("(upstream on this machine: ", 1)[1].split(")", 1)[0]
    cw = compare_module()
    weights = {name: cw.load(tmp_path / name) for name in runs}
    gas_diff = cw.relative_difference(weights["torchrun-gas4"], weights["torchrun-gas1"])
    launcher_diff = cw.relative_difference(weights["torchrun-gas4"], weights["accelerate-gas4"])
    upstream_diff = cw.relative_difference(weights["torchrun-gas4"], weights["upstream-ns-gas4"])
    timings = {name: round(r["seconds_wall"], 1) for name, r in results.items()}
    print(f"gas4 vs gas1 {gas_diff:.2e}, accelerate vs torchrun {launcher_diff:.2e}, Newton-Schulz in "
          f"{upstream_ns} (upstream) vs fp32 {upstream_diff:.2e}, wall seconds {timings}")
    assert gas_diff < FLOOR, gas_diff
    assert launcher_diff < FLOOR, launcher_diff
    if upstream_ns == "float32":
        assert upstream_diff < FLOOR, upstream_diff
    # Same samples, same first step: the losses agree to float rounding.
    for a, b in zip(results["torchrun-gas4"]["losses"], results["torchrun-gas1"]["losses"]):
        assert abs(a - b) < 1e-4 * abs(a)
