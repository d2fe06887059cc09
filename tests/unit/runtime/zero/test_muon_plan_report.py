# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon plan`` against ``deepspeed.initialize``: for a Hugging Face config the
report's figures (buckets, depth, peak and kept bytes, NS parallel efficiency) are the ones the engine's update
holds and rank 0 logs, and its buckets are the engine's, NS problem by NS problem, owner by owner; between
optimizer steps Muon holds no exchange buffer; bad inputs exit 2 naming the key."""

import json
import tempfile
from pathlib import Path

import deepspeed
import pytest
import torch

from deepspeed.runtime.zero.muon import original_muon, plan_report
from deepspeed.runtime.zero.muon.__main__ import main as module_main
from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import ds_config
from muon_testing.causal_lm import causal_lm_loss, micro_batches, tiny_llama, tiny_qwen3_moe

NS_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _engine_buckets(update):
    """The engine's plan as the report's ``buckets``: per pipeline (in ``step()``'s order) per bucket, one
    ``{"shape", "owner"}`` per NS problem."""
    out = []
    for _, pipeline in update._every_pipeline():
        for bucket in pipeline.plan.buckets:
            out.append([{
                "shape": [rows, cols],
                "owner": pipeline.plan.owners[k]
            } for k in bucket for batch, rows, cols in pipeline.specs[k].problems for _ in range(batch)])
    return out


class TestPlanReportIsTheEnginesPlan(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("model_name,max_step_memory,zero_extra", [
        ("llama", None, {}),
        ("llama", "momentum_partition", {"reduce_bucket_size": 5000}),
        ("qwen3_moe", None, {"sub_group_size": 3000}),
    ],
                             ids=["llama-default", "llama-strict-buckets", "moe-sub-groups"])
    def test_report_is_what_initialize_plans(self, model_name, max_step_memory, zero_extra):
        model = tiny_llama(layers=3) if model_name == "llama" else tiny_qwen3_moe()
        folder = Path(tempfile.mkdtemp())
        model.config.to_json_file(folder / "config.json")
        config = ds_config(3, 1, self.world_size, zero_extra=zero_extra)
        if max_step_memory is not None:
            config["optimizer"]["params"]["max_step_memory"] = max_step_memory
        (folder / "ds.json").write_text(json.dumps(config))
        ns_dtype = NS_DTYPE[original_muon.ns_compute_dtype("gram")]
        assert module_main([
            "plan", "--config", str(folder / "config.json"), "--world-size",
            str(self.world_size), "--ds-config",
            str(folder / "ds.json"), "--ns-dtype", ns_dtype, "--json",
            str(folder / "plan.json")
        ]) == 0
        report = json.loads((folder / "plan.json").read_text())

        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
        update = engine.optimizer.muon_update
        figures = update.figures
        assert (report["world_size"], report["depth"], report["peak_bytes"],
                report["kept_bytes"]) == (self.world_size, figures.depth, figures.peak_bytes, figures.kept_bytes)
        assert report["ns_efficiency"] == round(figures.ns_efficiency, 4)
        assert len(report["buckets"]) == figures.buckets and report["buckets"] == _engine_buckets(update)
        if zero_extra.get("sub_group_size"):
            assert len(update.pipelines) > 1, "the case has several sub-groups"
        if max_step_memory == "momentum_partition":
            assert figures.buckets > 1, "the case has several buckets"

        # between optimizer steps Muon holds no exchange buffer; during step() it did
        seen = []
        run = update.pipelines[next(iter(update.pipelines))].run

        def spy(*args, **kwargs):
            seen.append(update.reserved_bytes())
            return run(*args, **kwargs)

        update.pipelines[next(iter(update.pipelines))].run = spy
        for ids in micro_batches(0, engine.global_rank, self.world_size, 1):
            engine.backward(causal_lm_loss(engine, ids))
            engine.step()
        assert seen and seen[0] > 0, "the step's buffers"
        assert update.reserved_bytes() == 0 and update.buffers is None
        engine.destroy()


def test_plan_report_refuses_bad_input(tmp_path, capsys):
    config = tiny_llama().config
    config.to_json_file(tmp_path / "config.json")
    (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"type": "Muon", "params": {"max_step_memory": 64}}}))
    rc = plan_report.main(
        ["--config", str(tmp_path / "config.json"), "--world-size", "2", "--ds-config",
         str(tmp_path / "ds.json")])
    message = capsys.readouterr().err
    assert rc == 2 and message.startswith("optimizer.params.max_step_memory: 64 bytes is below what Muon's step needs "
                                          "on a rank: at least "), message
    (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"params": {"pipeline_depth": 0}}}))
    rc = plan_report.main(
        ["--config", str(tmp_path / "config.json"), "--world-size", "2", "--ds-config",
         str(tmp_path / "ds.json")])
    assert rc == 2 and "optimizer.params.pipeline_depth: 0" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="--config"):
        plan_report.main(["--config", str(tmp_path / "missing.json"), "--world-size", "2"])
