# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 configurations a Muon user reaches for, each on W gloo ranks against the single-process reference.

Newton-Schulz must run once per Muon matrix per step over all ranks (stock 0.19.8 runs each on every rank under CPU
offload). Each run: 4 steps of 16 samples (24 at W=3), fp32, gas=4 unless said otherwise. ``FLOOR`` = 2e-6, about 3x
the largest fp32-sum-order difference measured (every run here 0.8e-7 to 5.5e-7 from its reference; offload,
``reduce_scatter`` off, non-contiguous gradients, ``overlap_comm``, buckets: bit-identical to the default run); the
"standard" kernel (bf16 on CPU) is held to ``BF16_NS_FLOOR``.

Cases: ``default`` (``{"stage": 3}``, ``reduce_scatter`` true, which stock refuses); ``stage3_alone`` (no persistence
threshold: small parameters stay whole); the other reduce paths; CPU and NVMe (where libaio builds) offload, with and
without ``save_muon_momentum_buffer_in_memory``; ``groups`` (different momentum, lr, weight decay; stock refuses
different momenta); ``standard_first`` (one group per NS kernel; stock applies the last group's ``ns_method`` to all);
``shapes`` (3-D expert, 4-D conv, fewer elements than ranks); ``heads``; ``routed`` (a matrix without gradient in some
micro-steps and a whole step; stock feeds it the previous step's); a frozen layer; ``zero.Init``; ``hpz`` at W=4;
``buckets*`` (one bucket per matrix: ``max_step_memory: "momentum_partition"`` with ``reduce_bucket_size`` small
enough, where the depth falls to 1 as these matrices' NS working set exceeds their momentum partition; and at pipeline
depth 1, 2, 3 with the plan replaced by one bucket per matrix: ``every_matrix_alone``).
"""

import pytest

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.models import build_model, newton_schulz_problem_count
from unit.runtime.zero.zero3_muon_helpers import BF16_NS_FLOOR, Zero3MuonRun

STEPS = 4
NO_PER_HEAD = pytest.mark.skipif(not hasattr(original_muon, "_per_head_orthogonalize"),
                                 reason="this DeepSpeed base has no per-head Muon")
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
    (2, "standard_first"): DEFAULT.with_(groups="standard_first"),
    (2, "heads"): DEFAULT.with_(model="heads", per_head=True),
    (2, "frozen"): DEFAULT.with_(model="frozen"),
}
HEADS = SINGLE_RUNS[2, "heads"]
CORE = {(2, "stage3_alone"), (2, "shapes"), (2, "routed"), (4, "hpz")}
MARKS = {key: [pytest.mark.core] if key in CORE else [] for key in SINGLE_RUNS}
MARKS[2, "heads"] = [NO_PER_HEAD]
OFFLOAD = {
    "offload": DEFAULT.with_(offload="cpu"),
    "offload_in_memory": DEFAULT.with_(offload="cpu", momentum_in_memory=True),
}
NVME = DEFAULT.with_(offload="nvme")
BUCKETS = DEFAULT.with_(zero=(("reduce_bucket_size", BUCKET), ), max_step_memory="momentum_partition")
BUCKET_RUNS = {2: {"buckets": BUCKETS}, 3: {"buckets": BUCKETS.with_(samples=SAMPLES[3])}}
DEPTHS = {f"buckets_depth{d}": DEFAULT.with_(every_matrix_alone=True, pipeline_depth=d) for d in (1, 2, 3)}
BUCKET_RUNS[2].update(DEPTHS)


@pytest.fixture(scope="module")
def references():
    """Reference weights by ``reference_key()``, computed once in the pytest process and handed to the ranks."""
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
    return reference_of(references, default(world_size))


def standard_first_kernels(result):
    """fc1 (own group, ns_method "standard") to the standard kernel, the other two to Gram, once per step each."""
    assert result.ns_by_kernel() == dict(zeropower_via_newtonschulz5=STEPS,
                                         zeropower_via_gram_newtonschulz=2 * STEPS,
                                         zeropower_via_polar_express=0)


def heads_tagged(result):
    """That they matter: ``test_settings_matter[heads]``."""
    heads = result.muon_num_heads
    assert (heads["attn.q_proj.weight"], heads["attn.k_proj.weight"], heads["attn.o_proj.weight"]) == (4, 2, None)


def frozen_layer_unchanged(result):
    initial = dict(build_model("frozen").named_parameters())
    for name in ("fc1.weight", "fc1.bias"):
        assert (result.weights[name] == initial[name].detach()).all(), name


CHECKS = {"standard_first": standard_first_kernels, "heads": heads_tagged, "frozen": frozen_layer_unchanged}


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
        result = run.train()
        # "standard" Newton-Schulz computes in bf16 on the CPU
        check_against_reference(name, run, result, reference, BF16_NS_FLOOR if name == "standard_first" else FLOOR)
        if name in CHECKS:
            CHECKS[name](result)

    @pytest.mark.core
    @pytest.mark.parametrize("world_size", [2])
    def test_offload_equals_device_run(self, world_size, expected_default):
        """CPU offload, momentum in memory or not: the device run's weights, NS once per matrix per step."""
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
        """One bucket per matrix, run at depth 1, 2, 3, gives the one-bucket plan's weights: owners change, NS inputs
        not."""
        one_bucket = default(world_size).train()
        assert one_bucket.per_rank[0].plan[1] == 1
        exchanges = one_bucket.per_rank[0].stats["exchanges"]
        assert exchanges % (2 * STEPS) == 0 and 2 * STEPS <= exchanges <= 2 * 3 * STEPS
        for name, bucketed in BUCKET_RUNS[world_size].items():
            result = bucketed.train()
            check_against_reference(name, bucketed, result, expected_default)
            depth = 1 if bucketed.max_step_memory == "momentum_partition" else bucketed.pipeline_depth
            assert result.per_rank[0].plan == (depth, 3), (name, result.per_rank[0].plan)
            assert result.per_rank[0].stats["exchanges"] == 2 * 3 * STEPS, name
            assert relative_difference(one_bucket.weights, result.weights) <= FLOOR, name


@pytest.mark.parametrize("run,without", [
    pytest.param(DEFAULT.with_(groups="two_muon_groups"), DEFAULT, id="groups"),
    pytest.param(HEADS, HEADS.with_(per_head=False), id="heads", marks=NO_PER_HEAD)
])
def test_settings_matter(references, run, without):
    """Per-group settings and per-head NS move the result far beyond the floor: matching the reference shows use."""
    assert relative_difference(reference_of(references, without), reference_of(references, run)) > 100 * FLOOR
