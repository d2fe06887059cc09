# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""NorMuon (``normuon``) on the owner-state extension point of the distributed core, W ranks
simulated by threads (``muon_testing.threaded_exchange``), against the paper's algorithm.

- NorMuon through the pipeline, ZeRO-3 and ZeRO-1/2 layouts, W = 1 to 4, several bucket sizes:
  every rank's pieces are its pieces of whole-matrix NorMuon (written here from arXiv:2510.05491,
  Algorithm 1, with the authors' norm-preserving rescale, on upstream ``muon_update``), to
  ``RULE_FLOOR``.
- The state lives on the owner only: each matrix's rows on exactly one rank, none for plain Muon.
- Its settings from a parameter group (``variant_of``), and refusals naming the key.
- The plan's budget counts its rows (``within_budget(state_numels=)``).
"""

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_owners, within_budget
from deepspeed.runtime.zero.muon.normuon import NorMuon
from deepspeed.runtime.zero.muon.owner_state import variant_of
from muon_testing.threaded_exchange import LAYOUTS, run_pipelines as _run, scatter as _scatter, settings

SETTINGS = settings()

VARIANT = NorMuon(beta2=0.9, eps=1e-8)
RULE_FLOOR = 5e-7
"""Relative difference allowed between the pipeline's NorMuon and the test's formula on the same
Newton-Schulz results (bit-identical to upstream's, ``test_muon_pipeline``): both fp32, they differ
in how the row means and norms are summed (``vector_norm`` vs ``mean`` of squares): measured at
most 9.5e-8 over 3 steps (printed, MEASURED), so 5x that."""


def _reference(specs, grads, variant):
    """Whole-matrix NorMuon, one process: upstream ``muon_update`` for O, then per problem row
    ``v = b2 v + (1 - b2) mean_cols(O^2)``, ``O / (sqrt(v) + eps)`` rescaled to ``||O||_F``."""
    momenta = [torch.zeros(s.shape) for s in specs]
    second = [torch.zeros(s.ns_problem[:2]) for s in specs]
    updates = []
    for step in grads:
        out = []
        for k, (g, m, spec) in enumerate(zip(step, momenta, specs)):
            o = original_muon.muon_update(g.clone(), m, beta=SETTINGS.momentum, ns_steps=5, ns_method="gram")
            o = o.reshape(spec.ns_problem)
            second[k] = variant.beta2 * second[k] + (1 - variant.beta2) * (o * o).mean(dim=-1)
            normalized = o / (second[k].sqrt() + variant.eps)[..., None]
            normalized = normalized * (o.norm(dim=(-2, -1)) / normalized.norm(dim=(-2, -1)))[:, None, None]
            out.append(normalized.reshape(spec.shape))
        updates.append(out)
    return updates, second


def _relative(a, b):
    return float((a - b).norm() / a.norm()) if a.norm() > 0 else float(b.norm())


@pytest.mark.parametrize("bucket_numel", [1, 100, 10**9], ids=["one-per-bucket", "buckets", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_normuon_through_the_pipeline(layout, world_size, bucket_numel):
    specs, pieces, slices, plan, grads, _, results, *_, pipelines, _ = _run(LAYOUTS[layout],
                                                                            world_size,
                                                                            bucket_numel,
                                                                            2,
                                                                            steps=3,
                                                                            variant=VARIANT)
    updates, second = _reference(specs, grads, VARIANT)
    numel = results[0][0].numel()
    worst = 0.0
    for r in range(world_size):
        for t, step_updates in enumerate(updates):
            expected = _scatter(step_updates, pieces, slices, r, numel)
            worst = max(worst, _relative(expected, results[r][t]))
    print(f"MEASURED {layout} W={world_size} {bucket_numel}: {worst:.2e}")
    assert worst <= RULE_FLOOR
    # The state: each matrix's rows on its owner, nowhere else; equal to the reference's.
    for j, spec in enumerate(specs):
        holding = [r for r in range(world_size) if j in pipelines[r].owner_state.spans]
        assert holding == [plan.owners[j]], (j, holding)
        state = pipelines[plan.owners[j]].owner_state.view(j)
        assert state.numel() == spec.ns_problem[0] * spec.ns_problem[1]
        assert _relative(second[j].reshape(-1), state) <= RULE_FLOOR


def test_normuon_changes_the_update_and_plain_muon_keeps_no_state():
    specs, pieces, slices, _, grads, _, results, *_, pipelines, _ = _run(LAYOUTS["zero3"], 2, 100, 2, steps=2)
    assert all(p.owner_state is None for p in pipelines)
    *_, normuon, _, _, _, _ = _run(LAYOUTS["zero3"], 2, 100, 2, steps=2, variant=VARIANT)
    assert _relative(results[0][1], normuon[0][1]) > 1e-2
    with pytest.raises(RuntimeError, match="without owner state, run with variant"):
        pipelines[0].run(results[0][0].clone(), torch.zeros_like(results[0][0]), SETTINGS, torch.float32, None,
                         VARIANT)


def test_variant_of_a_group():
    assert variant_of({"momentum": 0.9}) is None
    assert variant_of({"variant": "muon"}) is None
    assert variant_of({"variant": "normuon"}) == NorMuon(0.95, 1e-8)
    assert variant_of({"variant": "normuon", "normuon_beta2": 0.5, "normuon_eps": 1e-6}) == NorMuon(0.5, 1e-6)
    for bad, key in (({
            "variant": "dion"
    }, "variant"), ({
            "variant": "normuon",
            "normuon_beta2": 1
    }, "normuon_beta2"), ({
            "variant": "normuon",
            "normuon_eps": -1.0
    }, "normuon_eps")):
        with pytest.raises(ValueError, match=key):
            variant_of(bad)


def test_the_budget_counts_the_owner_state():
    """Tall matrices (many rows, a small Newton-Schulz working set): one bucket of 1000 elements in
    flight fits each rank's momentum partition, until the owners' NorMuon rows are counted too."""
    specs = [MatrixSpec((256, 8)) for _ in range(8)]
    pieces, _ = LAYOUTS["zero3"](specs, 2)
    plan = plan_owners(specs, 2, 1000)
    assert within_budget(plan, pieces, 1)
    assert within_budget(plan, pieces, 1, state_numels=[0] * len(specs))
    assert not within_budget(plan, pieces, 1, state_numels=[VARIANT.state_numel(s) for s in specs])
