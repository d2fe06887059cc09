"""Hugging Face ``Trainer`` with DeepSpeed ZeRO-3 and DeepSpeed's Muon optimizer, gradient accumulation.

A small Llama built from a ``LlamaConfig`` (random init from ``--seed``, nothing downloaded) learns
the Python standard library's own source as bytes (``examples/demo/data.py``: one token per
byte, vocabulary 256) in fixed-length windows, so no padding and no tokenizer. Every argument of
``TrainingArguments`` is accepted; ``--deepspeed examples/hf_trainer/ds_config.json`` selects
ZeRO-3 and ``"optimizer": {"type": "Muon"}``, and ``--gradient_accumulation_steps`` the
accumulation. Launch with ``torchrun --nproc_per_node N`` or ``accelerate launch`` (see README.md).

What the Trainer does with the loss under gradient accumulation (transformers 5.x): before each
optimizer step it fetches the step's ``gradient_accumulation_steps`` micro-batches, counts the
label tokens that are prediction targets (``labels[..., 1:] != -100``), sums that count over all
ranks (``average_tokens_across_devices``, default on) and passes it to the model as
``num_items_in_batch``. Llama's loss is then ``sum of token losses / num_items_in_batch``, times
the number of ranks (DeepSpeed averages gradients over ranks); the Trainer does not divide by
the accumulation steps again, and tells DeepSpeed not to either (``scale_wrt_gas=False``). The
gradient of a step is therefore the mean over every target token of the step's global batch, the
same however the batch is cut into micro-batches. With the same samples in each step (the
sampler's permutation depends only on ``--seed``/``--data_seed`` and the epoch, and consecutive
micro-batches of every rank make up a step), ``--gradient_accumulation_steps 4
--per_device_train_batch_size b`` trains the same weights as ``1`` and ``4b``, to the fp32 floor.

Besides the Trainer's own output (``--output_dir``: ``model.safetensors`` full fp32 weights,
gathered from the ZeRO-3 partitions on save), rank 0 writes ``zero3muon_run.json``: which
optimizer and ZeRO stage DeepSpeed really ran (checked at the start of training: the run stops
if the Trainer did not hand the optimizer to DeepSpeed), the loss and learning rate of every
optimizer step, a checksum of each step's global batch, the norms of the optimizer's state
(Muon momentum, Adam moments) when training starts and after every step, and the patched
build's Muon counters per rank. The last three show what a resumed run
(``--resume_from_checkpoint``, README.md) picked up: the samples, the state, the schedule.
"""
import dataclasses
import importlib.util
import json
import logging
import os
import pathlib
import sys
import time
import warnings

T_START = time.perf_counter()
HERE = pathlib.Path(__file__).resolve().parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: the hub is never needed
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)  # torch deprecations raised inside libraries

import torch  # noqa: E402
from transformers import (AutoModelForCausalLM, HfArgumentParser, LlamaConfig, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments, default_data_collator, set_seed)


def _load_demo_data():
    """``examples/demo/data.py`` (stdlib corpus), loaded by path so its name cannot clash."""
    spec = importlib.util.spec_from_file_location("zero3muon_demo_data", HERE.parent / "demo" / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


stdlib_data = _load_demo_data()

RESULT_FILE = "zero3muon_run.json"
# Counters the patched build keeps on `engine.optimizer.muon_update.stats` (cumulative, per rank).
BOUNDARY_FIELDS = ("optimizer_steps", "ns_calls", "elements_sent", "elements_received", "bytes_sent",
                   "bytes_received")
# Per-parameter optimizer states whose norms the run report follows: Muon's momentum, Adam's moments.
STATE_NORM_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class ExampleArguments:
    """Model and data of the example (the rest is ``TrainingArguments``)."""
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Llama hidden size"})
    intermediate_size: int = dataclasses.field(default=176, metadata={"help": "Llama MLP size"})
    num_hidden_layers: int = dataclasses.field(default=2, metadata={"help": "decoder layers"})
    num_attention_heads: int = dataclasses.field(default=4, metadata={"help": "attention (= key/value) heads"})
    seq_len: int = dataclasses.field(default=128, metadata={"help": "bytes (tokens) per training window"})
    max_corpus_bytes: int = dataclasses.field(default=None,
                                              metadata={"help": "truncate the stdlib corpus (default: all of it)"})
    deepspeed_info_log: bool = dataclasses.field(
        default=False,
        metadata={"help": "show all of DeepSpeed's INFO log (by default only warnings and the ZeRO-3 Muon line)"})


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive non-overlapping ``seq_len``-byte windows of a 1-D ``uint8`` corpus.

    Item ``i``: ``{"input_ids": int64 [seq_len], "labels": the same}``; the causal-LM loss shifts
    the labels itself. Every window is full, so every item has ``seq_len - 1`` target tokens.
    """

    def __init__(self, corpus, seq_len):
        n = corpus.numel() // seq_len
        if n == 0:
            raise ValueError(f"the corpus ({corpus.numel()} bytes) is shorter than one window of {seq_len}")
        self.windows = corpus[:n * seq_len].view(n, seq_len)

    def __len__(self):
        return self.windows.shape[0]

    def __getitem__(self, i):
        ids = self.windows[i].long()
        return {"input_ids": ids, "labels": ids.clone()}


class _DeepSpeedLogFilter(logging.Filter):
    """Warnings and up, plus the ZeRO-3 Muon plan line the patched build logs at ``deepspeed.initialize``."""

    def filter(self, record):
        return record.levelno >= logging.WARNING or record.getMessage().startswith("ZeRO-3 Muon")


def configure_deepspeed_log(show_all_info):
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.INFO)
    for handler in ds_logger.handlers:
        handler.setLevel(logging.INFO)
        if not show_all_info:
            handler.addFilter(_DeepSpeedLogFilter())


def build_report():
    """The patched build's one-line report (``python -m deepspeed.runtime.zero.muon``), or why there is none."""
    import deepspeed
    try:
        from deepspeed.runtime.zero.muon.__main__ import report
    except ImportError:
        return (f"deepspeed {deepspeed.__version__}: no `python -m deepspeed.runtime.zero.muon` report "
                "(stock DeepSpeed, or a zero3muon build older than the report)")
    return report()[1]


def engine_facts(trainer):
    """What DeepSpeed is really running under ``trainer`` (call once training has started).

    Raises ``RuntimeError`` if the Trainer did not train through a DeepSpeed ZeRO-3 engine with
    DeepSpeed's Muon (``MuonWithAuxAdam``) as the optimizer.
    """
    import deepspeed
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    engine = trainer.model_wrapped
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise RuntimeError(f"the Trainer is not training through DeepSpeed (model is a {type(engine).__name__}); "
                           "pass --deepspeed examples/hf_trainer/ds_config.json")
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", None)
    facts = {
        "deepspeed": deepspeed.__version__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "engine_optimizer": type(zero).__name__,
        "optimizer": type(inner).__name__,
        # the optimizer the Trainer steps: accelerate's wrapper around the engine's
        "trainer_optimizer": f"{type(trainer.optimizer).__name__}({type(trainer.optimizer.optimizer).__name__})",
        "muon_matrices": sum(1 for p in engine.module.parameters() if getattr(p, "use_muon", False)),
        "adam_tensors": sum(1 for p in engine.module.parameters() if not getattr(p, "use_muon", True)),
        "param_groups": [{
            "name": g.get("name"),
            "use_muon": bool(g.get("use_muon")),
            "lr": g.get("lr"),
            "momentum": g.get("momentum"),
            "betas": list(g["betas"]) if "betas" in g else None,
            "weight_decay": g.get("weight_decay"),
        } for g in inner.param_groups] if inner is not None else [],
        "boundary_update": ("owner-centric at the accumulation boundary"
                            if getattr(zero, "muon_update", None) is not None else "stock DeepSpeed's"),
        "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
        "train_micro_batch_size_per_gpu": int(engine.train_micro_batch_size_per_gpu()),
        "gradient_clipping": float(engine.gradient_clipping()),
    }
    problems = []
    if facts["zero_stage"] != 3:
        problems.append(f"ZeRO stage {facts['zero_stage']}, not 3")
    if not isinstance(inner, MuonWithAuxAdam):
        problems.append(f"the engine's optimizer is {facts['optimizer']}, not DeepSpeed's Muon (MuonWithAuxAdam)")
    if trainer.optimizer.optimizer is not zero:
        problems.append("the Trainer steps an optimizer other than the DeepSpeed engine's")
    if facts["muon_matrices"] == 0:
        problems.append("no parameter is optimized with Muon")
    if problems:
        raise RuntimeError("not DeepSpeed ZeRO-3 with Muon: " + "; ".join(problems))
    return facts


class RunRecorder(TrainerCallback):
    """Checks the optimizer at the start of training and records the loss of every logged step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.facts = None
        self.losses = {}  # optimizer step -> mean token loss over the global batch (as the Trainer logs it)
        self.grad_norms = {}
        self.learning_rates = {}  # optimizer step -> learning rate of the Muon group (as the Trainer logs it)
        self.group_rates = {}  # optimizer step -> [[use_muon, lr] per param group] after the step
        self.state_norms = {}  # optimizer step -> {state: global norm}, from the step training starts at

    def on_train_begin(self, args, state, control, **kwargs):
        self.facts = engine_facts(self.trainer)
        # After --resume_from_checkpoint has loaded the checkpoint: the state the run starts from.
        self.state_norms[state.global_step] = optimizer_state_norms(self.trainer)
        if args.process_index == 0:
            f = self.facts
            print(f"[hf_trainer] DeepSpeed {f['deepspeed']}: ZeRO-{f['zero_stage']} {f['engine_optimizer']} over "
                  f"{f['optimizer']} ({f['muon_matrices']} Muon matrices, {f['adam_tensors']} auxiliary-Adam "
                  f"tensors), {f['boundary_update']} Muon update, gradient_accumulation_steps "
                  f"{f['gradient_accumulation_steps']} x micro-batch {f['train_micro_batch_size_per_gpu']} "
                  f"x {args.world_size} ranks", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.state_norms[state.global_step] = optimizer_state_norms(self.trainer)
        inner = getattr(getattr(self.trainer.model_wrapped, "optimizer", None), "optimizer", None)
        if inner is not None:
            self.group_rates[state.global_step] = [[bool(g.get("use_muon")), float(g["lr"])] for g in inner.param_groups]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])
            if "grad_norm" in logs:
                self.grad_norms[state.global_step] = float(logs["grad_norm"])
            if "learning_rate" in logs:
                self.learning_rates[state.global_step] = float(logs["learning_rate"])


class CountingTrainer(Trainer):
    """``Trainer`` that also records, per optimizer step, ``num_items_in_batch`` and a checksum of the
    step's global batch (for the run report)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_items_per_step = []
        self.batch_checksums = []

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.num_items_per_step.append(None if num_items is None else float(num_items))
        self.batch_checksums.append(global_batch_checksum(batch_samples))
        return batch_samples, num_items


def global_batch_checksum(batch_samples):
    """A checksum of the windows in one optimizer step's global batch, the same for any split. Collective.

    ``sum over windows and positions j of input_ids[j] * (j + 1)``, summed over the step's
    micro-batches (``input_ids``: int64 ``[micro, seq_len]``) and all ranks, in float64 (exact:
    far below 2**53). It does not depend on how the global batch is cut into ranks and
    micro-batches, so two runs that train a step on the same windows give the same number, and
    a resumed run shows whether the Trainer skipped exactly the windows already trained.
    """
    local = torch.zeros((), dtype=torch.float64)
    for micro_batch in batch_samples:
        ids = micro_batch["input_ids"].to("cpu", torch.float64)
        local += (ids * torch.arange(1, ids.shape[-1] + 1, dtype=torch.float64)).sum()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(local)
    return float(local)


def optimizer_state_norms(trainer):
    """``{state: global L2 norm}`` of the optimizer's per-parameter states (``STATE_NORM_KEYS``). Collective.

    Under ZeRO-3 each rank holds a 1/W partition of every state (fp32 flat tensors, zero
    padding): the squares are summed over the local partitions in float64 and all-reduced, so
    the norm is that of the whole state, independent of W. A state the optimizer does not hold
    (before its first step, or ``exp_avg`` without an Adam group) is 0.0.
    """
    inner = trainer.model_wrapped.optimizer.optimizer
    squares = torch.zeros(len(STATE_NORM_KEYS), dtype=torch.float64)
    for per_param in inner.state.values():
        for i, key in enumerate(STATE_NORM_KEYS):
            value = per_param.get(key)
            if torch.is_tensor(value) and value.dim() > 0:
                squares[i] += value.detach().to("cpu", torch.float64).pow(2).sum()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(squares)
    return dict(zip(STATE_NORM_KEYS, squares.sqrt().tolist()))


def boundary_stats(trainer):
    """Per rank, the patched build's Muon counters (``None`` on a build without them). Collective."""
    stats = getattr(getattr(trainer.model_wrapped.optimizer, "muon_update", None), "stats", None)
    if stats is None or not torch.distributed.is_initialized():
        return None
    local = torch.tensor([int(getattr(stats, f)) for f in BOUNDARY_FIELDS], dtype=torch.int64)
    gathered = [torch.zeros_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, local)
    return [dict(zip(BOUNDARY_FIELDS, t.tolist())) for t in gathered]


def _has_option(argv, name):
    return any(a == name or a.startswith(name + "=") for a in argv)


def configure_cpu_state(argv):
    """On DeepSpeed's CPU accelerator, set up accelerate's distributed state (gloo) before ``TrainingArguments``.

    accelerate (1.15) finds no distributed backend for DeepSpeed without a GPU: ``TrainingArguments``
    would initialize torch.distributed but record a single process, and the batch size it fills
    into the DeepSpeed config would be wrong by the number of ranks. (``--use_cpu`` is no way
    out: it makes the Trainer drop DeepSpeed altogether and train with its own optimizer.) So on
    the CPU accelerator, under torchrun or ``accelerate launch``, the state is created here with
    the gloo backend and ``TrainingArguments`` is told to use it (``--accelerator_config
    '{"use_configured_state": true}'``). Returns the arguments to parse. Nothing changes on a GPU.
    """
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu" or "LOCAL_RANK" not in os.environ:
        return argv
    if _has_option(argv, "--accelerator_config"):
        raise SystemExit("on the CPU accelerator this example passes --accelerator_config itself "
                         '({"use_configured_state": true}); add your settings to configure_cpu_state() in train.py')
    from accelerate import PartialState
    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what TrainingArguments sets while it creates the state
    try:
        PartialState(backend="gloo")
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    return [*argv, "--accelerator_config", json.dumps({"use_configured_state": True})]


def main(argv=None):
    parser = HfArgumentParser((ExampleArguments, TrainingArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    # DeepSpeed comes from --deepspeed, or from `accelerate launch` with a DeepSpeed config.
    if not _has_option(argv, "--deepspeed") and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        parser.error("this example is about DeepSpeed: pass --deepspeed examples/hf_trainer/ds_config.json")
    ex, args = parser.parse_args_into_dataclasses(args=configure_cpu_state(argv))
    configure_deepspeed_log(ex.deepspeed_info_log)
    if args.process_index == 0:
        print(f"[hf_trainer] {build_report()}", flush=True)

    # The model is built after TrainingArguments (which registers the DeepSpeed config), so
    # from_config builds it under deepspeed.zero.Init: each rank only ever holds its partition.
    set_seed(args.seed)
    config = LlamaConfig(vocab_size=stdlib_data.VOCAB_SIZE, hidden_size=ex.hidden_size,
                         intermediate_size=ex.intermediate_size, num_hidden_layers=ex.num_hidden_layers,
                         num_attention_heads=ex.num_attention_heads, num_key_value_heads=ex.num_attention_heads,
                         max_position_embeddings=ex.seq_len, tie_word_embeddings=False, attention_dropout=0.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dataset = ByteWindows(stdlib_data.load_corpus(ex.max_corpus_bytes), ex.seq_len)

    trainer = CountingTrainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)
    recorder = RunRecorder(trainer)
    trainer.add_callback(recorder)
    t_ready = time.perf_counter()
    # TrainingArguments only carries --resume_from_checkpoint; the script hands it to train(), as HF's examples do.
    train_output = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    t_trained = time.perf_counter()

    per_rank = boundary_stats(trainer)
    trainer.save_model()  # full weights, gathered from the partitions (stage3_gather_16bit_weights_on_model_save)
    if trainer.is_world_process_zero():
        out = pathlib.Path(args.output_dir)
        result = {
            "engine": recorder.facts,
            "world_size": args.world_size,
            "seed": args.seed,
            "optimizer_steps": trainer.state.global_step,
            "global_batch": args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps,
            "seq_len": ex.seq_len,
            "dataset_windows": len(dataset),
            "losses": [recorder.losses[s] for s in sorted(recorder.losses)],
            "loss_steps": sorted(recorder.losses),
            "grad_norms": [recorder.grad_norms[s] for s in sorted(recorder.grad_norms)],
            "learning_rates": [recorder.learning_rates[s] for s in sorted(recorder.learning_rates)],
            # per optimizer step, each param group's rate after it: the Trainer's scheduler scales both
            "group_rates": [recorder.group_rates[s] for s in sorted(recorder.group_rates)],
            "num_items_in_batch": trainer.num_items_per_step,
            "batch_checksums": trainer.batch_checksums,
            # {optimizer step: {state: norm}}: the first key is the step training started at (0, or the
            # resumed checkpoint's), measured after the checkpoint was loaded
            "optimizer_state_norms": {str(k): v for k, v in sorted(recorder.state_norms.items())},
            "resumed_from": args.resume_from_checkpoint,
            "boundary_stats": per_rank,
            "train_loss": train_output.training_loss,
            "seconds_setup": t_ready - T_START,
            "seconds_train": t_trained - t_ready,
            "ds_config": trainer.accelerator.state.deepspeed_plugin.deepspeed_config,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        }
        (out / RESULT_FILE).write_text(json.dumps(result, indent=1, default=str))
        print(f"[hf_trainer] {result['optimizer_steps']} optimizer steps, loss {result['losses'][0]:.4f} -> "
              f"{result['losses'][-1]:.4f}; wrote {out / 'model.safetensors'} and {out / RESULT_FILE}", flush=True)
    # Leave together and tear the process group down before the interpreter exits: a rank that
    # exits while the other still writes can abort in gloo's teardown ("terminate called without
    # an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Results are written and the process group is torn down. Skip the interpreter's teardown of
    # C++ objects: a gloo rank still aborts there now and then under load ("terminate called without
    # an active exception"), which would turn a finished run into a failed launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
