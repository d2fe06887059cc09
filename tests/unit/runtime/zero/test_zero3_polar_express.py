# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ns_method: "polar_express"`` through DeepSpeed, on W gloo ranks (``DS_ACCELERATOR=cpu``).

MixedMLP, 4 steps of the same 16 samples, fp32, NS in fp32 for every method (``ns_fp32=True``: on the CPU Polar Express
computes in bf16, and one rounding falling the other way would hide the fp32 agreement). The weights must equal the
single-process reference (upstream ``muon_update`` with "polar_express") to ``FLOOR`` (2e-6; measured < 5e-7) at
ZeRO-3 for W=1, 2 (gas 1, 4) and 4 (gas 4), ZeRO-2 with offload (W=2) and stage 0, with Polar Express once per Muon
matrix per step over all ranks and no other kernel; set in one group only, only that group's matrix uses it. "gram"
ends 1e-2 away. An unknown ``ns_method`` (config or group) is refused at ``deepspeed.initialize`` naming the key and
the accepted methods.
"""

import deepspeed
import pytest

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.models import build_model, newton_schulz_problem_count
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, initialize_error

STEPS = 4
RUN = Zero3MuonRun(model="mixed", gas=4, steps=STEPS, ns_method="polar_express", ns_fp32=True)
FIRST = Zero3MuonRun(model="mixed", gas=4, steps=STEPS, groups="polar_express_first", ns_fp32=True)
ACCEPTED = "Accepted: gram, polar_express, standard."


@pytest.fixture(scope="module")
def references():
    """Reference weights of RUN, of RUN with "gram" (the default), and of FIRST."""
    return RUN.reference()[0], RUN.with_(ns_method=None).reference()[0], FIRST.reference()[0]


def check(name, result, references):
    """``result`` equals RUN's reference, far from "gram"'s; Polar Express once per problem per step, nothing else."""
    reference, gram, _ = references
    diff = relative_difference(reference, result.weights)
    print(f"MEASURED {name}: {diff:.2e} from the reference, {relative_difference(gram, result.weights):.2e} "
          "from the gram reference")
    assert diff <= FLOOR, name
    assert relative_difference(gram, result.weights) > 1000 * FLOOR, name
    assert result.ns_by_kernel() == dict(zeropower_via_polar_express=newton_schulz_problem_count("mixed") * STEPS,
                                         zeropower_via_gram_newtonschulz=0,
                                         zeropower_via_newtonschulz5=0), name


class TestPolarExpress(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size, gas",
                             [pytest.param(w, g, marks=pytest.mark.core) for w in (1, 2) for g in (1, 4)] + [(4, 4)])
    def test_zero3_matches_reference(self, world_size, gas, references):
        result = RUN.with_(gas=gas).train()
        check(f"zero3 W={world_size} gas={gas}", result, references)
        assert sum(r.stats["ns_calls"] for r in result.per_rank) == newton_schulz_problem_count("mixed") * STEPS

    @pytest.mark.world_size(2)
    def test_zero2_offload_runs_the_same_core(self, references):
        result = RUN.with_(stage=2, offload="cpu").train()
        check("zero2 offload W=2", result, references)
        assert result.per_rank[0].stats["optimizer_steps"] == STEPS

    @pytest.mark.world_size(1)
    def test_stage0_runs_it_in_upstreams_optimizer(self, references):
        check("stage 0", RUN.with_(stage=0).train(), references)

    @pytest.mark.world_size(2)
    def test_one_group_on_polar_express(self, references):
        result = FIRST.train()
        diff = relative_difference(references[2], result.weights)
        print(f"MEASURED polar_express_first: {diff:.2e}")
        assert diff <= FLOOR
        assert result.ns_by_kernel() == dict(zeropower_via_polar_express=STEPS,
                                             zeropower_via_gram_newtonschulz=2 * STEPS,
                                             zeropower_via_newtonschulz5=0)

    @pytest.mark.world_size(1)
    def test_unknown_ns_method_refused_at_initialize(self):
        for stage in (0, 1, 2, 3):
            error = initialize_error(RUN.with_(stage=stage, ns_method="polar-express"))
            assert error is not None and error.startswith("ValueError: "), (stage, error)
            assert f"optimizer.params.ns_method: 'polar-express' is not a Newton-Schulz method of Muon. {ACCEPTED}" \
                in error, (stage, error)
            config = RUN.with_(stage=stage, ns_method=None).config(1)
            model = build_model("mixed")
            groups = [
                dict(params=list(model.fc1.parameters()), ns_method="quintic"),
                dict(params=[p for n, p in model.named_parameters() if not n.startswith("fc1.")])
            ]
            with pytest.raises(ValueError,
                               match=rf"model_parameters\[0\]\.ns_method: 'quintic' is not a "
                               rf"Newton-Schulz method of Muon\. {ACCEPTED}"):
                deepspeed.initialize(model=model, config=config, model_parameters=groups)
