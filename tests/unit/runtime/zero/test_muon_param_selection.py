# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which parameters DeepSpeed's Muon puts on Muon (``deepspeed.runtime.zero.muon.param_selection``).

- Plain modules: ``*embed*`` / ``lm_head`` and weights sharing an embedding's storage go to Adam; user flags are kept,
  DeepSpeed's own from an earlier selection are not taken for the user's; report lists cut after 20 names; a Muon
  optimizer with nothing on Muon warns.
- Tiny GPT-2 (head tied to ``wte``), T5 and Llama at ZeRO 1, 2, 3 and under ``zero.Init``, W=2: embeddings and tied
  heads on Adam, other matrices on Muon, user flags kept, tags agree with ``engine.muon_selection``; only rank 0 logs
  at WARNING; one step trains, at stage 3 Newton-Schulz once per Muon matrix.
- Client optimizers: DeepSpeed's ``MuonWithAuxAdam`` from ``use_muon`` groups with untagged tensors trains as
  ``"type": "Muon"`` does to the fp32 floor (stock runs no Newton-Schulz, 5.2e-2 away after 3 steps), at ZeRO-2 and 3;
  a user flag contradicting its group is an error naming the parameter; a Keller-Jordan-style Muon is refused at stages
  1-3 naming the class and the config, and runs at stage 0.
"""

import contextlib
import logging

import pytest
import torch

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, gathered_weights, relative_difference
from muon_testing.counting import NSCounter
from muon_testing.models import HYPER, build_model, loss_fn, step_batch
from muon_testing.reference import fp32_newton_schulz
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, ds_config

VOCAB, SEQ, MICRO = 96, 8, 2

# Per model: the matrices left to Adam (embeddings; a tied head has no name of its own), and two the test flags before
# deepspeed.initialize: one the rule would put on Muon (set False) and one on Adam (set True).
MODELS = {
    "gpt2":
    dict(adam_matrices={"transformer.wte.weight", "transformer.wpe.weight"},
         user_false="transformer.h.0.attn.c_proj.weight",
         user_true="transformer.wpe.weight"),
    "t5":
    dict(adam_matrices={
        "shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    },
         user_false="encoder.block.0.layer.0.SelfAttention.q.weight",
         user_true="decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    "llama":
    dict(adam_matrices={"model.embed_tokens.weight", "lm_head.weight"},
         user_false="model.layers.1.mlp.down_proj.weight",
         user_true="lm_head.weight"),
}


TINY = {  # kind -> its transformers model and config classes, the config's settings besides the vocabulary
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, tie_word_embeddings=False)),
}


def tiny_transformer(kind):
    """A 2-layer ``transformers`` model of width 32 and vocabulary 96, weights fixed by a seed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, config, settings = TINY[kind]
    return getattr(transformers, model)(getattr(transformers, config)(vocab_size=VOCAB, **settings))


@contextlib.contextmanager
def selection_log():
    """The records of DeepSpeed's logger (which does not propagate) while inside."""
    from deepspeed.utils import logger
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# ---- The rule on plain modules ----------------------------------------------------------------


class NamedLayers(torch.nn.Module):
    """Linears ``embed_proj`` (no nn.Embedding), untied ``lm_head`` and ``proj``; an nn.Embedding ``table``."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 6)
        self.embed_proj = torch.nn.Linear(6, 6, bias=False)
        self.proj = torch.nn.Linear(6, 6)
        self.lm_head = torch.nn.Linear(6, 10, bias=False)


def test_name_rule_still_sends_embed_and_lm_head_to_adam():
    from deepspeed.runtime.zero.muon.param_selection import select_muon_parameters
    model = NamedLayers()
    selection = select_muon_parameters(model)
    assert selection.muon == ("proj.weight", )
    assert set(selection.adam_matrices) == {"table.weight", "embed_proj.weight", "lm_head.weight"}
    assert dict(selection.reasons) == {
        "table.weight": "embedding",
        "embed_proj.weight": "name rule",
        "proj.weight": "matrix",
        "proj.bias": "not a matrix",
        "lm_head.weight": "name rule"
    }
    assert [p.use_muon for p in model.parameters()] == [False, False, True, False, False]
    assert selection.muon_numel == 36 and selection.adam_numel == 60 + 36 + 6 + 60


def test_head_sharing_the_embeddings_storage_goes_to_adam():
    from deepspeed.runtime.zero.muon.param_selection import select_muon_parameters
    model = NamedLayers()
    model.out = torch.nn.Linear(6, 10, bias=False)
    model.out.weight = torch.nn.Parameter(model.table.weight)  # another Parameter, same storage
    assert model.out.weight is not model.table.weight
    selection = select_muon_parameters(model)
    assert selection.reasons["out.weight"] == "tied to an embedding" and not model.out.weight.use_muon


def test_user_flags_kept_and_a_second_selection_is_not_user_intent():
    from deepspeed.runtime.zero.muon.param_selection import select_muon_parameters
    model = NamedLayers()
    model.table.weight.use_muon = True
    model.proj.weight.use_muon = False
    first = select_muon_parameters(model)
    assert first.muon == ("table.weight", )
    assert first.reasons["table.weight"] == first.reasons["proj.weight"] == "set by the user"
    # Re-selecting (a second deepspeed.initialize) keeps the user's flags and re-decides DeepSpeed's.
    assert select_muon_parameters(model) == first
    # A flag DeepSpeed chose, then changed by the user: the user's now.
    model.embed_proj.weight.use_muon = True
    assert select_muon_parameters(model).muon == ("table.weight", "embed_proj.weight")


def test_user_true_on_a_vector_is_refused():
    from deepspeed.runtime.zero.muon.param_selection import select_muon_parameters
    model = NamedLayers()
    model.proj.bias.use_muon = True
    with pytest.raises(ValueError, match=r"proj\.bias has use_muon = True but is not a matrix"):
        select_muon_parameters(model)


def test_report_lists_are_cut_past_twenty_names_and_no_muon_warns():
    from deepspeed.runtime.zero.muon.param_selection import format_report, select_muon_parameters
    deep = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(25)])
    (line, ) = format_report(select_muon_parameters(deep))
    assert line.startswith("Muon optimizer: 25 parameters (400 elements) on Muon, 0 parameters (0 elements)")
    assert "19.weight, ... and 5 more." in line and "20.weight" not in line
    assert "Set param.use_muon before deepspeed.initialize to override" in line

    # chosen from a client optimizer's groups: the groups decide, and the report says so
    import dataclasses
    from deepspeed.runtime.zero.muon.param_selection import PARAM_GROUP
    selection = select_muon_parameters(deep)
    by_groups = dataclasses.replace(selection, reasons={name: PARAM_GROUP for name in selection.reasons})
    (line, ) = format_report(by_groups)
    assert "The optimizer's parameter groups decide (their use_muon)" in line and "to override" not in line

    lines = format_report(select_muon_parameters(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4))))
    assert "Matrices on Adam: 0.weight (embedding)." in lines[0]
    assert lines[1].startswith("The Muon optimizer has no parameter on Muon: all 3 trained parameters")


# ---- Transformers models at every stage --------------------------------------------------------


def _batch(kind, rank):
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    return dict(input_ids=ids, labels=ids.roll(1, dims=1))


def _config(stage):
    config = ds_config(stage, gas=1, world_size=2, samples=2 * MICRO)
    config["optimizer"]["params"]["weight_decay"] = 0.0
    return config


class TestMuonSelectionModels(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,zero_init", [(1, False), (2, False), (3, False), (3, True)])
    @pytest.mark.parametrize("kind", list(MODELS))
    def test_embeddings_and_tied_heads_on_adam(self, kind, stage, zero_init):
        import deepspeed
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.muon.param_selection import layer_shape
        spec = MODELS[kind]
        config = _config(stage)
        with deepspeed.zero.Init(config_dict_or_path=config) if zero_init else contextlib.nullcontext():
            model = tiny_transformer(kind)
        if zero_init:  # placeholders: the shapes selection reads are ds_shape
            assert all(p.numel() == 0 for p in model.parameters())
        params = dict(model.named_parameters())
        params[spec["user_false"]].use_muon = False
        params[spec["user_true"]].use_muon = True
        matrices = {n for n, p in params.items() if len(layer_shape(p)) >= 2}
        expected_adam = spec["adam_matrices"] - {spec["user_true"]} | {spec["user_false"]}

        with selection_log() as records, fp32_newton_schulz(), NSCounter() as counter:
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
            loss = engine(**_batch(kind, dist.get_rank())).loss
            engine.backward(loss)
            engine.step()

        selection = engine.muon_selection
        assert set(selection.muon) == matrices - expected_adam
        assert set(selection.adam_matrices) == expected_adam
        assert set(selection.muon) | set(selection.adam) == set(params)
        assert selection.reasons[spec["user_false"]] == selection.reasons[spec["user_true"]] == "set by the user"
        for name in spec["adam_matrices"] - {spec["user_true"]}:
            assert selection.reasons[name] in ("embedding", "name rule"), (name, selection.reasons[name])
        # What the ZeRO optimizers read: the tensors' own flags.
        assert {n for n, p in engine.module.named_parameters() if p.use_muon} == set(selection.muon)
        if kind == "gpt2":
            assert engine.module.lm_head.weight is engine.module.transformer.wte.weight
            assert engine.module.lm_head.weight.use_muon is False
        assert torch.isfinite(loss)
        if stage == 3:
            ns = [None, None]
            dist.all_gather_object(ns, counter.count)
            # one problem per matrix: a fused projection's parts each (GPT-2's c_attn: query, key, value)
            problems = sum(
                len(getattr(p, "muon_split", (None, (p, )))[1]) for n, p in engine.module.named_parameters()
                if n in selection.muon)
            assert sum(ns) == problems, (ns, problems)

        lines = [r for r in records if r.getMessage().startswith("Muon optimizer:")]
        if dist.get_rank() == 0:
            assert len(lines) == 1 and lines[0].levelno == logging.WARNING
            message = lines[0].getMessage()
            assert message.startswith(f"Muon optimizer: {len(selection.muon)} parameters "
                                      f"({selection.muon_numel:,} elements) on Muon, {len(selection.adam)} parameters")
            assert f"On Muon: {', '.join(selection.muon[:20])}" in message
            if len(selection.muon) > 20:
                assert f"... and {len(selection.muon) - 20} more." in message
            assert f"{spec['user_false']} (set by the user)" in message
        else:
            assert lines == []
        engine.destroy()


# ---- Client optimizers -------------------------------------------------------------------------


class KellerStyleMuon(torch.optim.Optimizer):
    """Shaped like Keller Jordan's ``MuonWithAuxAdam``: ``use_muon`` groups whose step needs whole matrices."""

    def __init__(self, param_groups):
        super().__init__(param_groups, dict(lr=0.02))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    assert p.grad.ndim >= 2
                    p.add_(p.grad / (p.grad.norm() + 1e-7), alpha=-group["lr"])
                else:
                    p.add_(p.grad, alpha=-group["lr"])


class Orthogonalizer(torch.optim.SGD):
    """Not called Muon, but its groups carry ``use_muon``."""


def _mixed_groups(model):
    """DeepSpeed's Muon groups for MixedMLP, with the settings of the config-named run (HYPER)."""
    decay = HYPER["weight_decay"]
    muon = dict(use_muon=True, lr=HYPER["muon_lr"], momentum=HYPER["momentum"], weight_decay=decay)
    adam = dict(use_muon=False, lr=HYPER["adam_lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=decay)
    return [dict(params=[p for p in model.parameters() if (p.ndim >= 2) == g["use_muon"]], **g) for g in (muon, adam)]


def _client_config(stage, gas):
    config = ds_config(stage, gas=gas, world_size=2)
    del config["optimizer"]
    return config


class TestMuonClientOptimizer(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [2, 3])
    def test_deepspeed_muon_from_groups_equals_config_run(self, stage):
        """Untagged tensors in use_muon=True groups: Muon runs (stock: 0 NS calls, plain SGD)."""
        import deepspeed
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        run = Zero3MuonRun(model="mixed", stage=stage, gas=2, steps=3)
        reference = run.train()

        world_size, rank = dist.get_world_size(), dist.get_rank()
        model = build_model("mixed")
        assert not any(hasattr(p, "use_muon") for p in model.parameters())
        micro = run.samples // (world_size * run.gas)
        with fp32_newton_schulz(), NSCounter() as counter:
            engine, *_ = deepspeed.initialize(model=model,
                                              optimizer=MuonWithAuxAdam(_mixed_groups(model)),
                                              config=_client_config(stage, run.gas))
            for step in range(run.steps):
                x, y = step_batch("mixed", step)
                for m in range(run.gas):
                    lo = (m * world_size + rank) * micro
                    engine.backward(
                        loss_fn(engine(x[lo:lo + micro].to(engine.device)), y[lo:lo + micro].to(engine.device)))
                    engine.step()
        weights = gathered_weights(engine)
        assert engine.muon_selection.muon == ("fc1.weight", "fc2.weight", "fc3.weight")
        assert all(engine.muon_selection.reasons[n] == "param group" for n in engine.muon_selection.muon)
        difference = relative_difference(reference.weights, weights)
        assert difference < FLOOR, difference
        if stage == 3:
            ns = [None] * world_size
            dist.all_gather_object(ns, counter.count)
            assert sum(ns) == 3 * run.steps, ns
        engine.destroy()

    def test_user_flag_contradicting_its_group_names_the_parameter(self):
        import deepspeed
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        model = build_model("mixed")
        model.fc2.weight.use_muon = False
        with pytest.raises(ValueError,
                           match=r"fc2\.weight has use_muon = False, but the optimizer's parameter group 0"):
            deepspeed.initialize(model=model,
                                 optimizer=MuonWithAuxAdam(_mixed_groups(model)),
                                 config=_client_config(3, 1))

    @pytest.mark.parametrize("optimizer_cls,stage", [(KellerStyleMuon, 1), (KellerStyleMuon, 2), (KellerStyleMuon, 3),
                                                     (Orthogonalizer, 3)])
    def test_other_muon_refused_on_flat_partitions(self, optimizer_cls, stage):
        import deepspeed
        model = build_model("mixed")
        groups = [dict(params=g["params"], use_muon=g["use_muon"], lr=0.01) for g in _mixed_groups(model)]
        with pytest.raises(ValueError) as error:
            deepspeed.initialize(model=model, optimizer=optimizer_cls(groups), config=_client_config(stage, 1))
        message = str(error.value)
        assert optimizer_cls.__qualname__ in message and f"ZeRO stage {stage}" in message
        assert '"optimizer": {"type": "Muon"}' in message

    def test_other_muon_runs_at_stage_0(self):
        import deepspeed
        model = build_model("mixed")
        groups = [dict(params=g["params"], use_muon=g["use_muon"]) for g in _mixed_groups(model)]
        before = model.fc1.weight.detach().clone()
        engine, *_ = deepspeed.initialize(model=model, optimizer=KellerStyleMuon(groups), config=_client_config(0, 1))
        x, y = step_batch("mixed", 0)
        engine.backward(loss_fn(engine(x[:8].to(engine.device)), y[:8].to(engine.device)))
        engine.step()
        assert engine.muon_selection is None
        assert not torch.equal(before, engine.module.fc1.weight.detach())
        engine.destroy()
