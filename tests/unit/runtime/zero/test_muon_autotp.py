# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon under AutoTP (``"tensor_parallel": {"autotp_size": 2}``) orthogonalizes each whole matrix, not its shards.

A small Llama at ZeRO-1, 2, 3, TP 2 over DP 1 and 2, gas 1 and 4, must hold on every rank the shards of a
single-process whole-matrix reference to ``FLOOR``, with Newton-Schulz once per whole matrix over all ranks;
per-shard orthogonalization is 2e-2 away after 2 steps (MEASURED line). Also: clipping by the whole matrices' global
norm, a bit-identical resume at the same TP size, and refusals naming ``tensor_parallel.autotp_size``.
"""

import copy
import functools
import inspect
import os

import pytest
import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.module_inject import layers as autotp_layers
from deepspeed.utils import groups
from unit.common import DistributedTest
from muon_testing.causal_lm import (causal_lm_loss, expected_shard, micro_batches, tiny_llama,
                                    train_causal_lm_reference)
from muon_testing.compare import FLOOR, gathered_weights, relative_difference
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import convert_to_universal, ds_config

pytest.importorskip("transformers")

TP = 2
STEPS = 2
MUON_MATRICES = 14
"""q, k, v, o, gate, up and down of 2 layers: every one split by AutoTP."""


def _config(stage, gas, world_size, clip=0.0, tp=TP, **muon_params):
    config = ds_config(stage, gas, world_size // tp, clip)
    del config["train_batch_size"]  # the batch is counted over data-parallel ranks only
    config["tensor_parallel"] = {"autotp_size": tp}
    config["optimizer"]["params"].update(muon_params)
    return config


def _engine(config, splits=None):
    model = tiny_llama()
    for name, param in model.named_parameters():
        if name in (splits or {}):
            param.muon_split = splits[name]
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    return engine


def _train(engine, steps, first=0):
    dp_size = dist.get_world_size() // TP
    dp_rank = dist.get_rank() // TP  # AutoTP's mesh is (data parallel, tensor parallel)
    gas = engine.gradient_accumulation_steps()
    with fp32_newton_schulz():
        for step in range(first, first + steps):
            for ids in micro_batches(step, dp_rank, dp_size, gas):
                engine.backward(causal_lm_loss(engine, ids))
                engine.step()


def _difference_from_reference(engine, reference) -> float:
    whole = dict(reference.named_parameters())
    tp_rank = dist.get_rank() % TP
    got = gathered_weights(engine)
    want = {n: expected_shard(p, whole[n].detach().float(), tp_rank) for n, p in engine.module.named_parameters()}
    return relative_difference(want, got)


def _ns_calls(engine) -> int:
    calls = torch.tensor([engine.optimizer.muon_update.stats.ns_calls])
    dist.all_reduce(calls)
    return int(calls.item())


def _whole_heads(engine) -> dict:
    """Per per-head projection, its head count in the whole matrix (upstream re-counts it per shard after AutoTP)."""
    whole = {n: p.shape[0] for n, p in tiny_llama().named_parameters()}
    return {
        n: whole[n] // p.muon_head_dim
        for n, p in engine.module.named_parameters() if getattr(p, "muon_head_dim", None)
    }


def _check_whole_matrix_muon(stage, gas, world_size, clip=0.0, splits=None, **muon_params):
    engine = _engine(_config(stage, gas, world_size, clip, **muon_params), splits)
    _train(engine, STEPS)
    heads = _whole_heads(engine) if muon_params.get("per_head_muon") else None
    assert heads is None or len(heads) == 6, heads  # q, k and v of both layers
    reference = train_causal_lm_reference("llama", STEPS, clip, heads=heads, splits=splits)
    difference = _difference_from_reference(engine, reference)
    if dist.get_rank() == 0:
        print(f"MEASURED autotp {TP} x dp {world_size // TP}, stage {stage}, gas {gas}, clip {clip} {muon_params}: "
              f"{difference:.3e} from whole-matrix Muon")
    assert difference <= FLOOR, difference
    assert clip == 0.0 or engine.get_global_grad_norm() > clip, "the clip did not act"
    # a projection split into whole heads runs per-head Newton-Schulz on each shard, once per shard
    assert _ns_calls(engine) == (MUON_MATRICES + (TP - 1) * len(heads or ())) * STEPS
    params = dict(engine.module.named_parameters())
    assert all(getattr(params[n], "muon_split", None) == split for n, split in (splits or {}).items())
    engine.destroy()


def _own_autotp_state(test):
    """``test``, then AutoTP's process-wide state reset (mesh groups, ``mpu``, mode, ``layers`` and
    ``TensorParallel_Layer`` globals): unlike upstream's fresh processes, these ranks serve later tests."""

    def state():
        items = [((m.__name__, k), v) for m in (groups, autotp_layers, autotp_layers.TensorParallel_Layer)
                 for k, v in vars(m).items() if not callable(v) and not k.startswith("__")]
        return {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in items}

    @functools.wraps(test)
    def run(*args, **kwargs):
        before = state()
        try:
            result = test(*args, **kwargs)
        finally:
            made = {groups._DATA_PARALLEL_GROUP, groups._TENSOR_MODEL_PARALLEL_GROUP} - {None, dist.get_world_group()}
            for group in made:
                dist.destroy_process_group(group)
            groups._DATA_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._TENSOR_MODEL_PARALLEL_GROUP = None
            groups.mpu = None
            autotp_layers.set_autotp_mode(training=False)
        left = sorted(k for k, v in state().items() if k not in before or before[k] is not v and before[k] != v)
        assert not left, f"AutoTP state the test left: {left}"
        return result

    run.__signature__ = inspect.signature(test)  # upstream's harness reads getfullargspec, which ignores wraps
    return run


class WholeMatrixMuon(DistributedTest):
    """Every stage and gas 1 and 4, and a clip, at ``world_size`` ranks of tensor parallelism 2."""
    reuse_dist_env = True
    clip_stage = 1

    @pytest.mark.parametrize("gas", [1, 4])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    @_own_autotp_state
    def test_whole_matrix_muon(self, stage, gas):
        _check_whole_matrix_muon(stage, gas, self.world_size)

    @_own_autotp_state
    def test_clipping_counts_each_element_once(self):
        _check_whole_matrix_muon(self.clip_stage, 1, self.world_size, clip=0.05)


class TestMuonAutoTPOneReplica(WholeMatrixMuon):
    """Tensor parallelism 2, data parallelism 1."""
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 3])
    @_own_autotp_state
    def test_fused_parts_of_the_whole_matrix(self, stage):
        """``muon_split`` parts (up: rows 32 + 64; down, split by columns: 32 + 64) crossing AutoTP's shards of 48
        are cut from the whole matrix on the owner."""
        splits = {f"model.layers.{i}.mlp.up_proj.weight": (-2, (32, 64)) for i in (0, 1)}
        splits |= {f"model.layers.{i}.mlp.down_proj.weight": (-1, (32, 64)) for i in (0, 1)}
        _check_whole_matrix_muon(stage, 1, self.world_size, splits=splits)

    @pytest.mark.parametrize("stage", [1, 3])
    @_own_autotp_state
    def test_per_head_muon(self, stage):
        """Heads the shards split whole stay on their rank; per-head Newton-Schulz of the whole matrix."""
        if not hasattr(deepspeed, "resolve_per_head_muon_after_sharding"):
            pytest.skip("this DeepSpeed has no per-head Muon")
        _check_whole_matrix_muon(stage, 1, self.world_size, per_head_muon=True)

    @_own_autotp_state
    def test_per_shard_muon_is_far(self):
        """What stock trains (Newton-Schulz per shard), measured: the bar the floor is set against."""
        engine = _engine(_config(1, 1, self.world_size))
        update = engine.optimizer.muon_update
        update.spread_pipelines.clear()  # every matrix orthogonalized as the shard this rank holds
        update.pipelines.update(_shard_pipelines(engine))
        _train(engine, STEPS)
        difference = _difference_from_reference(engine, train_causal_lm_reference("llama", STEPS))
        if dist.get_rank() == 0:
            print(f"MEASURED per-shard Muon at autotp {TP}: {difference:.3e} from whole-matrix Muon")
        assert difference > 1e3 * FLOOR
        engine.destroy()


def _shard_pipelines(engine):
    """Each partition's matrices as this rank's shards (what Muon trained before it knew AutoTP's maps)."""
    update, loads, pipelines = engine.optimizer.muon_update, {}, {}
    for key, part in update.partitions.items():
        shapes = [tuple(p.shape) for p in part.params]
        pipelines[key] = update._build_pipeline(part, list(range(len(shapes))), part.pieces, shapes, loads)
    return pipelines


def _saved_then_trained_on(stage, world_size, checkpoint_dir) -> dict:
    """Weights after ``STEPS`` steps, a checkpoint (tag "tp") and one more step."""
    engine = _engine(_config(stage, 1, world_size))
    _train(engine, STEPS)
    engine.save_checkpoint(checkpoint_dir, tag="tp")
    _train(engine, 1, first=STEPS)
    weights = gathered_weights(engine)
    engine.destroy()
    return weights


def _resumed(config, load_dir, tag) -> dict:
    """Weights after loading ``load_dir/tag`` into a fresh engine of ``config`` and one more step."""
    engine = _engine(config)
    engine.load_checkpoint(load_dir, tag=tag)
    _train(engine, 1, first=STEPS)
    weights = gathered_weights(engine)
    engine.destroy()
    return weights


class TestMuonAutoTPTwoReplicas(WholeMatrixMuon):
    """Tensor parallelism 2, data parallelism 2."""
    world_size = 4
    clip_stage = 3

    @pytest.mark.parametrize("stage", [1, 3])
    @_own_autotp_state
    def test_checkpoint_resumes_bit_identical(self, stage, tmpdir):
        straight = _saved_then_trained_on(stage, self.world_size, str(tmpdir))
        again = _resumed(_config(stage, 1, self.world_size), str(tmpdir), "tp")
        for name in straight:
            assert torch.equal(straight[name], again[name]), name

    @pytest.mark.parametrize("stage", [1, 3])
    @_own_autotp_state
    def test_universal_checkpoint_resumes(self, stage, tmpdir):
        """AutoTP checkpoint via ``ds_to_universal``, same TP size: every shard's weights and state (momentum too)."""
        straight = _saved_then_trained_on(stage, self.world_size, str(tmpdir))
        folder = convert_to_universal(str(tmpdir), "tp", inject_missing_state=stage < 3)
        config = dict(_config(stage, 1, self.world_size), checkpoint={"load_universal": True})
        difference = relative_difference(straight, _resumed(config, os.path.dirname(folder), os.path.basename(folder)))
        if dist.get_rank() == 0:
            print(f"MEASURED autotp universal resume, stage {stage}: {difference:.3e}")
        assert difference <= FLOOR, difference

    @_own_autotp_state
    def test_variant_refused(self):
        with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size: .*'normuon'"):
            _engine(_config(3, 1, self.world_size, variant="normuon"))

    @pytest.mark.parametrize("stage", [1, 3])
    @_own_autotp_state
    def test_empty_shards_refused(self, stage):
        """autotp_size 4 over the test model's 2 key-value heads: AutoTP leaves two ranks empty k and v shards."""
        with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size: AutoTP gave .* empty shard"):
            _engine(_config(stage, 1, self.world_size, tp=4))

    @_own_autotp_state
    def test_stage_0_refused(self):
        """ZeRO stage 0 would run Muon per shard: refused, also with DeepSpeed's Muon as client optimizer."""
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size: .*stage 0"):
            _engine(_config(0, 1, self.world_size))
        config = _config(0, 1, self.world_size)
        del config["optimizer"]
        model = tiny_llama()
        matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        optimizer = MuonWithAuxAdam([dict(params=matrices, use_muon=True), dict(params=rest, use_muon=False)])
        with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size: .*stage 0"):
            deepspeed.initialize(model=model, config=config, optimizer=optimizer)
