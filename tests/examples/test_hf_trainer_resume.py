# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The Hugging Face Trainer example resumed at another number of ranks from a universal checkpoint.

Three steps, as examples/hf_trainer/README.md gives them ("Resume at another number of ranks"):

    reference  torchrun, 2 ranks, gradient_accumulation_steps 4 x per-device batch 2 (16 windows
               per step), 6 optimizer steps, --save_strategy steps --save_steps 3: the uninterrupted
               run, which also leaves checkpoint-3/ (DeepSpeed's global_step3/ plus the Trainer's
               trainer_state.json, rng_state_<rank>.pth, ...)
    convert    python -m deepspeed.checkpoint.ds_to_universal checkpoint-3/global_step3 ->
               checkpoint-3/global_step3_universal (and checkpoint-3/latest_universal)
    resumed    torchrun, 1 rank, gradient_accumulation_steps 8 x per-device batch 2 (the same 16
               windows per step), --deepspeed ds_config_load_universal.json
               ("checkpoint": {"load_universal": true}), --resume_from_checkpoint checkpoint-3,
               --max_steps 6: steps 4 to 6

Both launch through ``ns_fp32_launch.py`` (Newton-Schulz in fp32, as in test_hf_trainer.py), so
the final weights (``model.safetensors``) can be held to the fp32 floor: relative difference
``||a - b|| / ||a||`` below ``FLOOR`` (2e-6). Measured with this configuration (torch 2.13 CPU,
transformers 5.24, accelerate 1.15, patched 0.19.8, seed 42): 1.46e-7 (1.64e-7 in a pair of runs
whose auxiliary Adam fell back to Muon's inline update); the same resume with every Muon
momentum zeroed in the universal checkpoint: 2.5e-2. Losses of steps 4 to 6: 1e-7 relative.
Each launch trains for a few seconds; the rest is start-up (about 15 s per launch on 2 idle
cores, 5 to 10 minutes at a load of 16 on 2 cores, where the whole test took 14 minutes).

Besides the weights, what the resumed run picked up from the checkpoint, each checked on its own:
the samples (the Trainer skips 3 x 8 micro-batches of 2 at one rank, the same 48 windows the two
ranks trained: each step's global-batch checksum equals the reference's), the Muon momentum and
the Adam moments (their global norms when the resumed run starts equal the reference's after step
3, and are not zero), the learning-rate schedule (DeepSpeed's checkpoint carries the Trainer's
scheduler: the logged rates of steps 4 to 6 equal the reference's), and the step count.
"""

import subprocess
import sys
import time

import pytest

from test_hf_trainer import GLOBAL_BATCH, SEQ_LEN, STEPS, compare_module, launch
from muon_testing.compare import FLOOR

SAVE_STEP = 3
MICRO = 2  # per-device batch, the same at every world size: gradient accumulation absorbs the change
STATES = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def rel(a, b):
    return abs(a - b) / abs(b)


def convert_to_universal(checkpoint):
    """``ds_to_universal`` of ``checkpoint/global_step<SAVE_STEP>``; returns the wall seconds."""
    tag = f"global_step{SAVE_STEP}"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint / tag),
           "--output_folder", str(checkpoint / f"{tag}_universal")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-6000:]}"
    # What "checkpoint": {"load_universal": true} makes the engine read instead of `latest`.
    assert (checkpoint / "latest_universal").read_text().strip() == f"{tag}_universal"
    return time.perf_counter() - t0


@pytest.mark.slow
def test_hf_trainer_resume_universal_at_one_rank(tmp_path):
    ref_dir, resumed_dir = tmp_path / "reference-w2", tmp_path / "resumed-w1"
    reference = launch("torchrun", ref_dir, 4, MICRO, True, nproc=2,
                       extra=("--save_strategy", "steps", "--save_steps", str(SAVE_STEP)))
    checkpoint = ref_dir / f"checkpoint-{SAVE_STEP}"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    seconds_convert = convert_to_universal(checkpoint)
    resumed = launch("torchrun", resumed_dir, GLOBAL_BATCH // MICRO, MICRO, True, nproc=1,
                     ds_config="ds_config_load_universal.json",
                     extra=("--save_strategy", "no", "--resume_from_checkpoint", str(checkpoint)))

    assert reference["world_size"] == 2 and resumed["world_size"] == 1
    assert reference["global_batch"] == resumed["global_batch"] == GLOBAL_BATCH
    assert resumed["resumed_from"] == str(checkpoint)
    assert resumed["engine"]["gradient_accumulation_steps"] == GLOBAL_BATCH // MICRO
    # Steps 4..6 only, and each on the windows the reference trained in that step.
    assert resumed["optimizer_steps"] == STEPS and resumed["loss_steps"] == list(range(SAVE_STEP + 1, STEPS + 1))
    assert resumed["num_items_in_batch"] == [GLOBAL_BATCH * (SEQ_LEN - 1)] * (STEPS - SAVE_STEP)
    assert len(reference["batch_checksums"]) == STEPS
    assert resumed["batch_checksums"] == reference["batch_checksums"][SAVE_STEP:], (
        "the resumed run trained other windows than the reference in steps 4..6", resumed["batch_checksums"],
        reference["batch_checksums"])
    # The scheduler continued where it stopped (linear decay over 6 steps, not restarted).
    assert resumed["learning_rates"] == pytest.approx(reference["learning_rates"][SAVE_STEP:], rel=1e-12)
    # The optimizer state the resumed run starts from is the reference's after step 3.
    start = resumed["optimizer_state_norms"][str(SAVE_STEP)]
    saved = reference["optimizer_state_norms"][str(SAVE_STEP)]
    for state in STATES:
        assert saved[state] > 0, (state, saved)
        assert rel(start[state], saved[state]) < 1e-6, (state, start, saved)
    # Newton-Schulz once per Muon matrix per step, all on the one rank.
    assert [s["ns_calls"] for s in resumed["boundary_stats"]] == [14 * (STEPS - SAVE_STEP)]

    cw = compare_module()
    weight_diff = cw.relative_difference(cw.load(ref_dir), cw.load(resumed_dir))
    loss_diffs = [rel(a, b) for a, b in zip(resumed["losses"], reference["losses"][SAVE_STEP:])]
    final = {s: rel(resumed["optimizer_state_norms"][str(STEPS)][s], reference["optimizer_state_norms"][str(STEPS)][s])
             for s in STATES}
    print(f"resumed at 1 rank vs 2 ranks uninterrupted, after {STEPS} steps: weights {weight_diff:.2e} "
          f"(FLOOR {FLOOR:.0e}), losses of steps {SAVE_STEP + 1}-{STEPS} max {max(loss_diffs):.1e}, final state "
          f"norms {', '.join(f'{k} {v:.1e}' for k, v in final.items())}; wall seconds reference "
          f"{reference['seconds_wall']:.1f}, convert {seconds_convert:.1f}, resumed {resumed['seconds_wall']:.1f}")
    assert weight_diff < FLOOR, weight_diff
    assert max(loss_diffs) < 1e-4, loss_diffs
