# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""NorMuon (``"variant": "normuon"``) through the owner-centric Muon core, on W gloo ranks.

The reference (``normuon_reference``, independent of ``owner_state``) follows the paper's Algorithm 1 (Li et al. 2025,
"NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491) with the norm-preserving rescale of the authors'
code and microsoft/dion: one process, upstream ``muon_update`` for O, then per row of each Newton-Schulz problem
``v = beta2 v + (1 - beta2) mean_cols(O^2)``, ``O / (sqrt(v) + eps)`` rescaled to ``||O||_F``; AdamW for the rest.

ZeRO-3 at W = 1, 2 (gas 1, 4) and 4 (gas 4), ZeRO-1, ZeRO-2 (also offloaded) must equal it to ``FLOOR`` (2e-6;
MEASURED lines) and be far from plain Muon. Without the variant no owner state is kept, and ``variant: "muon"`` gives
plain Muon bit for bit with the same exchange counters.
"""

import numpy as np
import pytest
import torch

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from muon_testing.models import HYPER, build_model, is_muon_param, loss_fn, step_batch
from muon_testing.reference import fp32_newton_schulz, reference_muon_update
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, ds_config, initialize_error

BETA2, EPS = 0.9, 1e-8
"""The tests' NorMuon settings (beta2 off its 0.95 default, so the key is seen to reach the update)."""


def normuon_block(**extra) -> dict:
    """The tests' Muon block (``ds_config``'s) with ``variant: "normuon"`` and ``extra``."""
    block = ds_config(3, 1, 1)["optimizer"]
    block["params"].update(variant="normuon", normuon_beta2=BETA2, normuon_eps=EPS, **extra)
    return block


def normuon_run(**changes) -> Zero3MuonRun:
    return Zero3MuonRun(**{"steps": 5, "extra": (("optimizer", normuon_block()), ), **changes})


def _problem(shape, is_expert_group, num_heads):
    """(batch, rows, cols) of the Newton-Schulz problems of a Muon parameter, as Muon defines them."""
    if num_heads is not None:
        return num_heads, shape[0] // num_heads, shape[1]
    if len(shape) == 4 and not is_expert_group:
        return 1, shape[0], shape[1] * shape[2] * shape[3]
    return int(np.prod(shape[:-2])), shape[-2], shape[-1]


def normuon_reference(model_name="mixed", steps=5, samples=16, num_heads=None, ns_method="gram", ns_fp32=False):
    """Single-process NorMuon final weights by name (numpy); ``ns_fp32``: every NS kernel in fp32 on the CPU."""
    with fp32_newton_schulz(every_method=ns_fp32):
        model = build_model(model_name)
        heads = num_heads or {}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        muon = [(n, p) for n, p in named if is_muon_param(n, p)]
        other = [p for n, p in named if not is_muon_param(n, p)]
        adam_settings = {key: HYPER[key] for key in ("betas", "eps", "weight_decay")}
        adamw = torch.optim.AdamW(other, lr=HYPER["adam_lr"], **adam_settings)
        momenta = {n: torch.zeros_like(p) for n, p in muon}
        problems = {n: _problem(p.shape, getattr(p, "is_expert_group", False), heads.get(n)) for n, p in muon}
        second = {n: torch.zeros(problems[n][:2]) for n, _ in muon}
        for step in range(steps):
            x, y = step_batch(model_name, step, samples=samples)
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            with torch.no_grad():
                for n, p in muon:
                    o = reference_muon_update(p.grad.clone(), momenta[n], HYPER["momentum"], ns_method,
                                              getattr(p, "is_expert_group", False), heads.get(n))
                    o = o.reshape(problems[n]).float()
                    second[n] = BETA2 * second[n] + (1 - BETA2) * (o * o).mean(dim=-1)
                    normalized = o / (second[n].sqrt() + EPS)[..., None]
                    normalized = normalized * (o.norm(dim=(-2, -1)) / normalized.norm(dim=(-2, -1)))[:, None, None]
                    p.mul_(1 - HYPER["muon_lr"] * HYPER["weight_decay"])
                    p.add_(normalized.reshape(p.shape), alpha=-HYPER["muon_lr"])
            adamw.step()
        return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references():
    mixed, shapes = normuon_reference("mixed"), normuon_reference("shapes")
    return dict(mixed=mixed, muon=Zero3MuonRun(steps=5).reference()[0], shapes=shapes)


def check_normuon(label, weights, expected, other=None, apart=1000):
    """``weights`` equal ``expected`` to the fp32 floor and lie over ``apart`` floors from ``other`` (if given)."""
    diff = relative_difference(expected, weights)
    away = float("nan") if other is None else relative_difference(other, weights)
    print(f"MEASURED normuon {label}: {diff:.2e} from the reference, {away:.2e} from the other")
    assert diff <= FLOOR
    if other is not None:
        assert away > apart * FLOOR, (label, away)


class TestZero3NorMuon(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size, gases", [(1, (1, 4)), (2, (1, 4)), (4, (4, ))])
    def test_matches_the_reference(self, world_size, gases, references):
        from deepspeed import comm as dist
        for gas in gases:
            weights = normuon_run(gas=gas).train().weights
            check_normuon(f"W={world_size} gas={gas}, other: Muon", weights, references["mixed"], references["muon"])
        # The state lives on the owners: one fp32 value per row of each Newton-Schulz problem, over the ranks.
        engine = normuon_run(steps=0).build_engine(normuon_run().config(world_size))
        rows = [None] * world_size
        pipelines = engine.optimizer.muon_update.pipelines.values()
        dist.all_gather_object(rows, sum(p.owner_state.numel for p in pipelines if p.owner_state is not None))
        engine.destroy()
        muon = [p for n, p in build_model("mixed").named_parameters() if is_muon_param(n, p)]
        problems = [_problem(p.shape, getattr(p, "is_expert_group", False), None) for p in muon]
        assert sum(rows) == sum(batch * height for batch, height, _ in problems)

    @pytest.mark.world_size(2)
    def test_expert_conv_and_tiny_matrices(self, references):
        """3-D expert weights (rows per expert), a 4-D conv filter (flattened), a 1x3 matrix."""
        check_normuon("shapes W=2 gas=2", normuon_run(model="shapes", gas=2).train().weights, references["shapes"])

    @pytest.mark.world_size(2)
    def test_per_head(self):
        from deepspeed.runtime.zero.muon.config import has_per_head_muon
        if not has_per_head_muon():
            pytest.skip("this DeepSpeed has no per-head Muon")
        block = normuon_block(per_head_muon=True)
        result = normuon_run(model="heads", gas=2, extra=(("optimizer", block), )).train()
        expected = normuon_reference("heads", num_heads=result.muon_num_heads)
        assert any(v is not None for v in result.muon_num_heads.values())
        check_normuon("per-head W=2, other: whole rows", result.weights, expected, normuon_reference("heads"), 100)

    @pytest.mark.world_size(2)
    def test_with_polar_express(self):
        """NorMuon on another ns_method's result (Polar Express), fp32 kernels."""
        from deepspeed.runtime.zero.muon import original_muon
        if "polar_express" not in original_muon.NS_METHODS:
            pytest.skip("this build has no polar_express ns_method")
        result = normuon_run(gas=2, ns_fp32=True,
                             extra=(("optimizer", normuon_block(ns_method="polar_express")), )).train()
        expected = normuon_reference(ns_method="polar_express", ns_fp32=True)
        check_normuon("+ polar_express W=2 gas=2, other: gram's", result.weights, expected, normuon_reference(), 100)

    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
    def test_zero12_through_the_same_core(self, stage, offload, references):
        result = normuon_run(stage=stage, gas=2, offload=offload).train()
        check_normuon(f"ZeRO-{stage} offload={offload} W=2", result.weights, references["mixed"])

    @pytest.mark.world_size(2)
    def test_default_muon_keeps_no_state_and_is_unchanged(self):
        """No variant key: no owner state; ``variant: "muon"`` is the same run bit for bit, no extra collective."""
        plain = Zero3MuonRun(steps=3, gas=2)
        engine = plain.build_engine(plain.config(2))
        assert all(p.owner_state is None for p in engine.optimizer.muon_update.pipelines.values())
        assert all("variant" not in g for g in engine.optimizer.optimizer.param_groups)
        engine.destroy()
        block = ds_config(3, 1, 1)["optimizer"]
        block["params"]["variant"] = "muon"
        a, b = plain.train(), plain.with_(extra=(("optimizer", block), )).train()
        for key in a.weights:
            assert np.array_equal(a.weights[key], b.weights[key]), key
        assert [r.stats for r in a.per_rank] == [r.stats for r in b.per_rank]


class TestNorMuonRefusals(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("params, stage, expected", [
        (dict(variant="adamuon"), 3, "optimizer.params.variant: 'adamuon' is not a Muon variant"),
        (dict(variant="normuon", normuon_beta2=1.0), 3, "optimizer.params.normuon_beta2: 1.0"),
        (dict(variant="normuon", normuon_beta2=-0.1), 3, "optimizer.params.normuon_beta2: -0.1"),
        (dict(variant="normuon", normuon_eps=0.0), 3, "optimizer.params.normuon_eps: 0.0"),
        (dict(variant="normuon", normuon_eps="1e-8"), 3, "optimizer.params.normuon_eps: '1e-8'"),
        (dict(variant="normuon"), 0, "optimizer.params.variant: 'normuon' needs ZeRO stage 1, 2 or 3"),
        (dict(normuon_beta2=0.9), 3, "normuon_beta2 (optimizer.params or a parameter group): normuon's settings, but "
         "no Muon group has variant 'normuon'"),
        (dict(variant="normuon"), "bf16-stage1", "does not run with zero_optimization.stage 1 with bf16 and "
         "data_types.grad_accum_dtype fp32 (DeepSpeed's BF16_Optimizer)"),
    ])
    def test_refused_at_initialize_naming_the_key(self, params, stage, expected):
        block = ds_config(3, 1, 1)["optimizer"]
        block["params"].update(params)
        run = Zero3MuonRun(stage=stage, extra=(("optimizer", block), ))
        if stage == "bf16-stage1":  # the engine picks BF16_Optimizer, which runs upstream's Muon
            run = run.with_(stage=1, dtype="bf16", extra=run.extra + (("data_types", {"grad_accum_dtype": "fp32"}), ))
        error = initialize_error(run)
        assert error is not None and error.startswith("ValueError:"), error
        assert expected in error, error

    def test_group_keys_refused_naming_the_group(self):
        run = Zero3MuonRun(groups="two_muon_groups")
        from muon_testing import models
        original = models.GROUPINGS["two_muon_groups"]
        models.GROUPINGS[
            "normuon_bad_group"] = lambda model: [dict(original(model)[0], normuon_beta2=2.0),
                                                  original(model)[1]]
        try:
            error = initialize_error(run.with_(groups="normuon_bad_group"))
        finally:
            del models.GROUPINGS["normuon_bad_group"]
        assert error is not None and "model_parameters[0].normuon_beta2: 2.0" in error, error
