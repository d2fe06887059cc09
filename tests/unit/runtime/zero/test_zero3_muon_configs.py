# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ZeRO-3 configurations a Muon user reaches for, each trained on W gloo ranks and compared
with the single-process PyTorch reference (``muon_testing.reference.train_reference``); Newton-Schulz
must run once per Muon matrix per step, summed over ranks, in each (stock 0.19.8 runs every
matrix on every rank under CPU offload).

Every run is 4 optimizer steps of 16 samples (24 at W=3), fp32, gas=4 unless said otherwise,
so the fp32 floor holds: ``FLOOR`` = 2e-6, about 3x the largest difference measured between runs
that differ only in the order of fp32 sums (every run here: 0.8e-7 to 5.5e-7 from its
reference; offload, ``reduce_scatter`` off, non-contiguous gradients, ``overlap_comm``, buckets:
bit-identical to the default run). Runs using the "standard" Newton-Schulz kernel, which computes
in bf16 on the CPU, are held to ``BF16_NS_FLOOR`` (see its docstring).

What each run covers:
- ``default``: ``{"stage": 3}`` with Muon (``reduce_scatter`` at its default, true, which stock
  DeepSpeed refuses; every parameter partitioned, see ``ds_config``); ``stage3_alone``: the
  same without ``stage3_param_persistence_threshold``, so these small parameters stay whole on
  every rank (persistent) and are refreshed by ZeRO-3's coalesced all-gather after each step;
  ``reduce_scatter_off``, ``non_contiguous``, ``overlap_comm``: the other reduce paths.
- ``offload`` / ``offload_in_memory``: ``offload_optimizer: cpu``, with and without
  ``save_muon_momentum_buffer_in_memory``; ``nvme``: ``offload_optimizer: nvme`` where the async
  I/O op builds (libaio).
- ``groups``: two Muon groups with different momentum, learning rate and weight decay (stock
  refuses different momenta); ``standard_first``: one group on each Newton-Schulz kernel (stock
  applies the last group's ``ns_method`` to every matrix).
- ``shapes``: a 3-D expert weight, a 4-D convolution weight and a matrix with fewer elements than
  ranks; ``heads``: per-head Newton-Schulz (``per_head_muon``; bases that have it).
- ``routed``: a Muon matrix with no gradient in some micro-steps and in a whole step (stock ZeRO-3
  feeds it the previous step's gradient; the grad-window fix, a pull request of its own with its own
  AdamW test ``test_zero3_grad_partition_window.py``, makes it count as zero; skipped without it).
- ``frozen``: a frozen layer; ``zero_init``: the model built under ``deepspeed.zero.Init``;
  ``hpz``: ``zero_hpz_partition_size: 2`` at W=4.
- ``buckets`` / ``buckets_serial`` / ``buckets_depth3``: ``max_step_memory: "momentum_partition"`` (whose
  buckets ``reduce_bucket_size`` bounds) with ``reduce_bucket_size`` small enough for one bucket per matrix, at
  pipeline depth 2 (the default), 1 (serial) and 3; under the default cap these small models' matrices share one
  bucket.
"""

import pytest

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.models import build_model, newton_schulz_problem_count
from unit.runtime.zero.zero3_muon_helpers import BF16_NS_FLOOR, Zero3MuonRun

STEPS = 4
HAS_PER_HEAD = hasattr(original_muon, "_per_head_orthogonalize")
BUCKET = 600  # MixedMLP's Muon matrices have 693, 561 and 119 elements: one bucket each
DEFAULT = Zero3MuonRun(gas=4, steps=STEPS)
SAMPLES = {2: 16, 3: 24, 4: 16}  # 24 at W=3, so that 3 ranks x 4 micro-steps divide them


def default(world_size):
    return DEFAULT.with_(samples=SAMPLES[world_size])


SINGLE_RUNS = {
    (2, "stage3_alone"): DEFAULT.with_(partition_all=False),
    (2, "reduce_scatter_off"): DEFAULT.with_(zero=(("reduce_scatter", False), )),
    (2, "non_contiguous"): DEFAULT.with_(zero=(("contiguous_gradients", False), )),
    (2, "overlap_comm"): DEFAULT.with_(zero=(("overlap_comm", True), )),
    (2, "groups"): DEFAULT.with_(groups="two_muon_groups"),
    (2, "shapes"): DEFAULT.with_(model="shapes"),
    (2, "routed"): DEFAULT.with_(model="routed"),
    (2, "zero_init"): DEFAULT.with_(zero_init=True),
    (3, "shapes"): default(3).with_(model="shapes"),
    (4, "shapes"): DEFAULT.with_(model="shapes"),
    (4, "hpz"): DEFAULT.with_(zero=(("zero_hpz_partition_size", 2), )),
}
CORE = {(2, "stage3_alone"), (2, "shapes"), (2, "routed"), (4, "hpz")}
MARKS = {key: [pytest.mark.core] if key in CORE else [] for key in SINGLE_RUNS}
STANDARD_FIRST = DEFAULT.with_(groups="standard_first")
HEADS = DEFAULT.with_(model="heads", per_head=True)
FROZEN = DEFAULT.with_(model="frozen")
OFFLOAD = {
    "offload": DEFAULT.with_(offload="cpu"),
    "offload_in_memory": DEFAULT.with_(offload="cpu", momentum_in_memory=True),
}
NVME = DEFAULT.with_(offload="nvme")
STRICT = "momentum_partition"
BUCKET_RUNS = {
    2: {
        "buckets": DEFAULT.with_(zero=(("reduce_bucket_size", BUCKET), ), max_step_memory=STRICT),
        "buckets_serial": DEFAULT.with_(zero=(("reduce_bucket_size", BUCKET), ),
                                        pipeline_depth=1,
                                        max_step_memory=STRICT),
        "buckets_depth3": DEFAULT.with_(zero=(("reduce_bucket_size", BUCKET), ),
                                        pipeline_depth=3,
                                        max_step_memory=STRICT),
    },
    3: {
        "buckets": default(3).with_(zero=(("reduce_bucket_size", BUCKET), ), max_step_memory=STRICT)
    },
}


@pytest.fixture(scope="module")
def references():
    """Reference weights by ``Zero3MuonRun.reference_key()``, computed in the pytest process, once
    per module (``reference_of``), and handed to the ranks."""
    return {}


def reference_of(references, run):
    key = run.reference_key()
    if key not in references:
        references[key] = run.reference()[0]
    return references[key]


@pytest.fixture
def reference(references, run):
    return reference_of(references, run)


@pytest.fixture
def expected_default(references, world_size):
    """Reference weights of the default run at ``world_size``."""
    return reference_of(references, default(world_size))


@pytest.fixture(scope="module")
def standard_first_reference(references):
    return reference_of(references, STANDARD_FIRST)


@pytest.fixture(scope="module")
def heads_references(references):
    """Reference weights with and without per-head Newton-Schulz."""
    return reference_of(references, HEADS), reference_of(references, HEADS.with_(per_head=False))


@pytest.fixture(scope="module")
def frozen_reference(references):
    return reference_of(references, FROZEN)


def check_against_reference(name, run, result, reference, floor=FLOOR):
    assert relative_difference(reference, result.weights) <= floor, name
    if run.optimizer == "Muon":
        result.assert_newton_schulz_once_per_problem_per_step(
            newton_schulz_problem_count(run.model, result.muon_num_heads), run.steps)


class TestZero3MuonConfigs(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.core
    @pytest.mark.parametrize("world_size", [2, 3, 4])
    def test_gas_equivalence(self, world_size, expected_default):
        """The default run at gas=4 and gas=1 each match the reference and each other."""
        run = default(world_size)
        gas4, gas1 = run.train(), run.with_(gas=1).train()
        check_against_reference("gas4", run, gas4, expected_default)
        check_against_reference("gas1", run, gas1, expected_default)
        assert relative_difference(gas1.weights, gas4.weights) <= FLOOR

    @pytest.mark.parametrize(
        "world_size,name,run",
        [pytest.param(w, n, r, marks=MARKS.get((w, n), []), id=f"W{w}-{n}") for (w, n), r in SINGLE_RUNS.items()])
    def test_matches_reference(self, world_size, name, run, reference):
        check_against_reference(name, run, run.train(), reference)

    @pytest.mark.core
    @pytest.mark.parametrize("world_size", [2])
    def test_offload_equals_device_run(self, world_size, expected_default):
        """CPU offload, with and without the momentum kept in memory: the weights of the device
        run, NS once per matrix per step summed over ranks."""
        device = DEFAULT.train()
        for name, run in OFFLOAD.items():
            result = run.train()
            check_against_reference(name, run, result, expected_default)
            assert relative_difference(device.weights, result.weights) <= FLOOR, name

    @pytest.mark.parametrize("world_size", [2])
    def test_nvme_offload_equals_device_run(self, world_size, expected_default, tmp_path):
        if not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
            pytest.skip("NVMe offload needs DeepSpeed's async I/O op, which cannot be built here (libaio missing)")
        device, nvme = DEFAULT.train(), NVME.train(nvme_dir=tmp_path)
        check_against_reference("nvme", NVME, nvme, expected_default)
        assert relative_difference(device.weights, nvme.weights) <= FLOOR

    @pytest.mark.parametrize("world_size", sorted(BUCKET_RUNS))
    def test_buckets_equal_one_bucket(self, world_size, expected_default):
        """One bucket per matrix (two all-to-alls each per step), at pipeline depth 1, 2 and 3, gives
        the weights of the default plan (these small matrices share one bucket under the default
        max_step_memory): the owners change, the Newton-Schulz inputs do not."""
        one_bucket = default(world_size).train()
        exchanges = one_bucket.per_rank[0].stats["exchanges"]
        assert exchanges % (2 * STEPS) == 0 and 2 * STEPS <= exchanges <= 2 * 3 * STEPS
        for name, bucketed in BUCKET_RUNS[world_size].items():
            result = bucketed.train()
            check_against_reference(name, bucketed, result, expected_default)
            assert result.per_rank[0].stats["exchanges"] == 2 * 3 * STEPS, name
            assert relative_difference(one_bucket.weights, result.weights) <= FLOOR, name

    @pytest.mark.world_size(2)
    def test_each_group_uses_its_own_newton_schulz_method(self, standard_first_reference):
        """fc1 (its own group, ns_method "standard") goes to the standard kernel, the other two
        matrices to the Gram kernel, once per step each, summed over ranks."""
        result = STANDARD_FIRST.train()
        check_against_reference("standard_first",
                                STANDARD_FIRST,
                                result,
                                standard_first_reference,
                                floor=BF16_NS_FLOOR)
        assert result.ns_by_kernel() == {
            "zeropower_via_newtonschulz5": STEPS,
            "zeropower_via_gram_newtonschulz": 2 * STEPS,
            "zeropower_via_polar_express": 0
        }

    @pytest.mark.skipif(not HAS_PER_HEAD, reason="this DeepSpeed base has no per-head Muon")
    @pytest.mark.world_size(2)
    def test_heads_are_tagged_and_matter(self, heads_references):
        per_head, whole_heads = heads_references
        assert relative_difference(whole_heads, per_head) > 100 * FLOOR
        result = HEADS.train()
        check_against_reference("heads", HEADS, result, per_head)
        heads = result.muon_num_heads
        assert (heads["attn.q_proj.weight"], heads["attn.k_proj.weight"], heads["attn.o_proj.weight"]) == (4, 2, None)

    @pytest.mark.world_size(2)
    def test_frozen_layer_unchanged(self, frozen_reference):
        result = FROZEN.train()
        check_against_reference("frozen", FROZEN, result, frozen_reference)
        initial = dict(build_model("frozen").named_parameters())
        for name in ("fc1.weight", "fc1.bias"):
            assert (result.weights[name] == initial[name].detach()).all(), name


def test_groups_differ_from_shared_settings(references):
    """The per-group settings change the result well beyond the floor, so matching the
    reference (test_matches_reference, W2-groups) means they were used."""
    assert relative_difference(reference_of(references, DEFAULT),
                               reference_of(references, DEFAULT.with_(groups="two_muon_groups"))) > 100 * FLOOR
