# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""NorMuon (``normuon``) on the core's owner-state extension point, W threads, against the paper's algorithm.

- Pipeline, ZeRO-3 and ZeRO-1/2 layouts, W = 1 to 4, several bucket sizes: each rank's pieces are those of
  whole-matrix NorMuon (arXiv:2510.05491, Algorithm 1, with the authors' norm-preserving rescale, on upstream
  ``muon_update``) to ``RULE_FLOOR``.
- The state lives on the owner only (none for plain Muon), and the plan's budget counts its rows.
- Settings from a parameter group (``variant_of``), and refusals naming the key.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.normuon import NorMuon
from deepspeed.runtime.zero.muon.owner_state import variant_of
from muon_testing.threaded_exchange import LAYOUTS
from unit.runtime.zero.test_muon_owner_state import (SETTINGS, check_budget_counts_the_state,
                                                     check_no_state_without_variant, check_through_the_pipeline)

VARIANT = NorMuon(beta2=0.9, eps=1e-8)
RULE_FLOOR = 5e-7
"""Allowed relative difference between the pipeline's NorMuon and the formula on the same NS results: both fp32, they
sum row means and norms differently (``vector_norm`` vs ``mean`` of squares): measured <= 9.5e-8 over 3 steps; the
bound is 5x that."""


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


@pytest.mark.parametrize("bucket_numel", [1, 100, 10**9], ids=["one-per-bucket", "buckets", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_normuon_through_the_pipeline(layout, world_size, bucket_numel):
    check_through_the_pipeline(layout, world_size, bucket_numel, VARIANT, _reference, RULE_FLOOR)


def test_plain_muon_keeps_no_state_and_normuon_changes_the_update():
    check_no_state_without_variant(VARIANT)


def test_the_budget_counts_normuon_state():
    check_budget_counts_the_state(VARIANT)


def test_variant_of_a_group():
    assert variant_of({"momentum": 0.9}) is None
    assert variant_of({"variant": "muon"}) is None
    assert variant_of({"variant": "normuon"}) == NorMuon(0.95, 1e-8)
    assert variant_of({"variant": "normuon", "normuon_beta2": 0.5, "normuon_eps": 1e-6}) == NorMuon(0.5, 1e-6)
    for bad, key in ((dict(variant="dion"), "variant"), (dict(variant="normuon", normuon_beta2=1), "normuon_beta2"),
                     (dict(variant="normuon", normuon_eps=-1.0), "normuon_eps")):
        with pytest.raises(ValueError, match=key):
            variant_of(bad)
