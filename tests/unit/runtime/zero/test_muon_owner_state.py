# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The distributed core's owner-state extension point (``owner_state``), with a test variant ``RowSum``, W threads.

- A registered variant through the pipeline, ZeRO-3 and ZeRO-1/2 layouts, W = 1 to 4, several bucket sizes: each
  rank's pieces are those of the rule on whole matrices, each state on its owner only; plain Muon allocates none.
- Registry: names resolve with the group's settings; an unknown name, a clashing registration and a refused setting
  are errors naming the key.
- The plan's budget counts the state (``within_budget(state_numels=)``).
- The checkpoint form (``expand_rows`` / ``rows_in_piece``) round-trips over ragged partitions.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon, owner_state
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, plan_owners, within_budget
from deepspeed.runtime.zero.muon.owner_state import (check_same_kind, expand_rows, register_variant, rows_in_piece,
                                                     variant_of)
from muon_testing.threaded_exchange import LAYOUTS, run_pipelines as _run, scatter as _scatter, settings

SETTINGS = settings()


@dataclass(frozen=True)
class RowSum:
    """A variant for the tests: ``v += scale * mean_cols(O^2)`` per row, ``O / (1 + v)``."""
    scale: float = 1.0
    name = "row_sum"
    state_key = "row_sum_state"
    defaults = {"row_sum_scale": 1.0}

    @staticmethod
    def key_problems(settings, where):
        scale = settings.get("row_sum_scale", 1.0)
        return [] if scale > 0 else [f"{where}.row_sum_scale: {scale!r} must be > 0."]

    @classmethod
    def from_group(cls, group):
        return cls(scale=group.get("row_sum_scale", 1.0))

    @staticmethod
    def state_numel(spec):
        return spec.ns_problem[0] * spec.ns_problem[1]

    @staticmethod
    def state_rows(spec):
        batch, rows, cols = spec.ns_problem
        return batch * rows, cols

    def apply(self, update, state, spec):
        batch, rows, cols = spec.ns_problem
        o = update.reshape(batch, rows, cols).float()
        v = state.view(batch, rows)
        v.add_(o.square().mean(dim=-1), alpha=self.scale)
        return (o / (1 + v).unsqueeze(-1)).reshape(update.shape).to(update.dtype)


VARIANT = RowSum(scale=0.5)
RULE_FLOOR = 1e-6
"""Allowed relative difference between the pipeline's pieces and the rule on whole upstream ``muon_update`` matrices:
the same fp32 operations on bit-identical NS results; measured 0.0 (MEASURED), bounded at the fp32 floor."""


@pytest.fixture
def registered(monkeypatch):
    """``RowSum`` registered for the test only."""
    monkeypatch.setattr(owner_state, "_VARIANTS", dict(owner_state._VARIANTS))
    register_variant(RowSum)
    return RowSum


def _reference(specs, grads, variant):
    momenta = [torch.zeros(s.shape) for s in specs]
    states = [torch.zeros(variant.state_numel(s)) for s in specs]
    updates = []
    for step in grads:
        out = []
        for k, (g, m, spec) in enumerate(zip(step, momenta, specs)):
            o = original_muon.muon_update(g.clone(), m, beta=SETTINGS.momentum, ns_steps=5, ns_method="gram")
            out.append(variant.apply(o.reshape(spec.shape), states[k], spec))
        updates.append(out)
    return updates, states


def _relative(a, b):
    return float((a - b).norm() / a.norm()) if a.norm() > 0 else float(b.norm())


def check_through_the_pipeline(layout, world_size, bucket_numel, variant, reference, floor):
    """Each rank's pieces are those of ``reference``'s whole-matrix updates; each state only on its owner, equal."""
    run = _run(LAYOUTS[layout], world_size, bucket_numel, 2, steps=3, variant=variant)
    specs, pieces, slices, plan, grads, _, results, *_, pipelines, _ = run
    updates, states = reference(specs, grads, variant)
    numel = results[0][0].numel()
    worst = max(
        _relative(_scatter(step_updates, pieces, slices, r, numel), results[r][t]) for r in range(world_size)
        for t, step_updates in enumerate(updates))
    print(f"MEASURED {layout} W={world_size} {bucket_numel}: {worst:.2e}")
    assert worst <= floor
    for j, spec in enumerate(specs):
        holding = [r for r in range(world_size) if j in pipelines[r].owner_state.spans]
        assert holding == [plan.owners[j]], (j, holding)
        state = pipelines[plan.owners[j]].owner_state.view(j)
        assert state.numel() == spec.ns_problem[0] * spec.ns_problem[1]
        assert _relative(states[j].reshape(-1), state) <= floor


def check_no_state_without_variant(variant):
    """Plain Muon's pipelines keep no owner state and refuse a variant; ``variant`` changes the update."""
    *_, results, _, _, pipelines, _ = _run(LAYOUTS["zero3"], 2, 100, 2, steps=2)
    assert all(p.owner_state is None for p in pipelines)
    *_, varied, _, _, _, _ = _run(LAYOUTS["zero3"], 2, 100, 2, steps=2, variant=variant)
    assert _relative(results[0][1], varied[0][1]) > 1e-2
    with pytest.raises(RuntimeError, match="without owner state, run with variant"):
        pipelines[0].run(results[0][0].clone(), torch.zeros_like(results[0][0]), SETTINGS, torch.float32, None,
                         variant)


def check_budget_counts_the_state(variant):
    """Tall matrices (small NS working set): a 1000-element bucket fits each momentum partition until ``variant``'s
    per-row owner states are counted too."""
    specs = [MatrixSpec((256, 8)) for _ in range(8)]
    pieces, _ = LAYOUTS["zero3"](specs, 2)
    plan = plan_owners(specs, 2, 1000)
    assert within_budget(plan, pieces, 1)
    assert within_budget(plan, pieces, 1, state_numels=[0] * len(specs))
    assert not within_budget(plan, pieces, 1, state_numels=[variant.state_numel(s) for s in specs])


def test_plain_muon_keeps_no_state_and_the_variant_changes_the_update():
    check_no_state_without_variant(VARIANT)


def test_the_budget_counts_the_owner_state():
    check_budget_counts_the_state(VARIANT)


@pytest.mark.parametrize("bucket_numel", [1, 10**9], ids=["one-per-bucket", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_variant_through_the_pipeline(layout, world_size, bucket_numel):
    check_through_the_pipeline(layout, world_size, bucket_numel, VARIANT, _reference, RULE_FLOOR)


def test_the_registry(registered):
    assert variant_of({"momentum": 0.9}) is None
    assert variant_of({"variant": "muon"}) is None
    assert variant_of({"variant": "row_sum"}) == RowSum(1.0)
    assert variant_of({"variant": "row_sum", "row_sum_scale": 0.25}) == RowSum(0.25)
    assert "row_sum" in owner_state.variants() and "row_sum_state" in owner_state.state_keys()
    with pytest.raises(ValueError, match="variant: 'dion' is not a Muon variant; accepted: 'muon'"):
        variant_of({"variant": "dion"})
    with pytest.raises(ValueError) as info:
        variant_of({"variant": "Row-Sum"})
    assert "variant: 'Row-Sum' is not a Muon variant; accepted: 'muon', " in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="row_sum_scale: -1 must be > 0"):
        variant_of({"variant": "row_sum", "row_sum_scale": -1})
    register_variant(RowSum)  # the same class again: a re-import

    class Clash(RowSum):
        pass

    with pytest.raises(ValueError, match="named 'row_sum' exists already"):
        register_variant(Clash)
    check_same_kind(VARIANT, RowSum(2.0), "here")
    with pytest.raises(RuntimeError,
                       match="here: this engine was built with Muon variant 'row_sum', but the "
                       "parameter group now says 'muon'"):
        check_same_kind(VARIANT, None, "here")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_broadcast_rows_round_trip(world_size):
    for batch, rows, cols in ((1, 7, 5), (3, 5, 12), (1, 1, 3), (2, 9, 1)):
        spec_rows = torch.arange(1, batch * rows + 1, dtype=torch.float32)
        numel = batch * rows * cols
        part = math.ceil(numel / world_size)
        rebuilt = torch.zeros_like(spec_rows)
        whole = spec_rows.repeat_interleave(cols)
        for r in range(world_size):
            start = r * part
            count = max(0, min(part, numel - start))
            piece = expand_rows(spec_rows, cols, start, count)
            assert torch.equal(piece, whole[start:start + count])
            first, values = rows_in_piece(piece, cols, start)
            rebuilt[first:first + values.numel()] += values
        assert torch.equal(rebuilt, spec_rows), (batch, rows, cols, world_size)
