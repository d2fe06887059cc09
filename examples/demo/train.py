"""One demo training run, one process per rank (launched by ``run_demo.py`` through torchrun).

Trains a small Llama built from a ``LlamaConfig`` (random init from ``--seed``, nothing
downloaded) on byte windows of the standard library's source with DeepSpeed ZeRO-``--stage``
and the Muon optimizer, fp32, with DeepSpeed's default ``gradient_clipping`` (1.0) unless ``--clip``
is given. Each optimizer step consumes the same
``--global-batch`` windows whatever ``--gas`` is; ``--gas`` only decides how each rank's share
is cut into micro-batches (the engine divides each micro-batch loss by ``gas``).

Newton-Schulz runs in fp32 in every rank, on any CPU: upstream's ``ns_compute_dtype`` runs the
"gram" kernel in fp16 where the accelerator supports fp16, and DeepSpeed's CPU accelerator does
on CPUs whose oneDNN has fp16 (AVX512-FP16 or AMX). fp16 rounding there (gas=4 vs gas=1 1.1e-3
after 6 steps, measured) would hide the fp32 agreement the demo shows, so the ranks train inside
``fp32_newton_schulz(every_method=True)`` (shared with the tests), which makes the CPU accelerator
report no fp16 and no bf16 (the "standard" and "polar_express" kernels compute in bf16 where it is
reported, which DeepSpeed's CPU accelerator always does).

Rank 0 writes, into ``--out``:
- ``result.json``: per-step loss (float, nats/token, mean over the global batch), NS-kernel
  calls, the dtype Newton-Schulz computed in, Muon boundary traffic counters, timings;
- ``weights.pt``: ``{name: fp32 CPU tensor}`` of every parameter at full shape after training.
"""
import argparse
import contextlib
import json
import logging
import os
import pathlib
import sys
import time
import warnings

T_START = time.perf_counter()

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: the hub is never needed
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# torch deprecation notices raised inside DeepSpeed/inductor, once per rank; not actionable here.
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import data  # noqa: E402

# Shared with the tests: the muon_testing package (testing/), which dev.py setup installs.
from muon_testing.compare import gathered_weights  # noqa: E402
from muon_testing.counting import NSCounter  # noqa: E402
from muon_testing.reference import fp32_newton_schulz  # noqa: E402

# Counters the patched build keeps on `engine.optimizer.muon_update.stats` (cumulative, per rank).
BOUNDARY_FIELDS = ("optimizer_steps", "ns_calls", "elements_sent", "elements_received", "bytes_sent",
                   "bytes_received")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for result.json and weights.pt")
    p.add_argument("--stage", type=int, choices=(2, 3), required=True)
    p.add_argument("--gas", type=int, required=True, help="gradient_accumulation_steps")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=16, help="windows per optimizer step, all ranks together")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per window")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=176)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--adam-lr", type=float, default=3e-3)
    p.add_argument("--momentum", type=float, default=0.95)
    p.add_argument("--max-corpus-bytes", type=int, default=None)
    p.add_argument("--clip", type=float, default=None,
                   help="gradient_clipping (default: the key is left out, so DeepSpeed's default 1.0 applies)")
    p.add_argument("--muon-param", action="append", default=[], metavar="KEY=VALUE", type=muon_param,
                   help="another key of the optimizer's params (VALUE is read as JSON, else taken as a string), "
                   "e.g. ns_method=polar_express; repeatable")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def muon_param(text):
    """``KEY=VALUE`` of ``--muon-param`` as ``(key, value)``: VALUE read as JSON (numbers, booleans,
    lists), else taken as a string. Raises argparse.ArgumentTypeError without a ``=``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--muon-param takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def newton_schulz_dtype(ns_method="gram"):
    """The dtype upstream's Newton-Schulz kernel for ``ns_method`` computes in, as it would decide
    now (it decides at every call): upstream's ``ns_compute_dtype`` (0.19.8), or the same rule,
    which 0.19.7 has inline in the kernels. Returns e.g. ``"float32"``."""
    from deepspeed.runtime.zero.muon import original_muon
    rule = getattr(original_muon, "ns_compute_dtype", None)
    if rule is not None:
        dtype = rule(ns_method)
    else:
        from deepspeed.accelerator import get_accelerator
        accelerator = get_accelerator()
        if ns_method == "gram":
            dtype = torch.float16 if accelerator.is_fp16_supported() else torch.float32
        else:
            dtype = torch.bfloat16 if accelerator.is_bf16_supported() else torch.float32
    return str(dtype).replace("torch.", "")


def ds_config(args, micro_batch, patched=True):
    """The DeepSpeed config dict: fp32, Muon with explicit lr/momentum and the ``--muon-param`` keys,
    ``gradient_clipping`` only with ``--clip`` (else DeepSpeed's default, 1.0).

    ``patched``: the +zero3muon build takes ZeRO-3's defaults; stock DeepSpeed refuses Muon at
    stage 3 unless ``reduce_scatter`` is off ("Muon and reduce scatter cannot be used together").
    """
    zero = {"stage": args.stage}
    if args.stage == 3:
        # Every parameter of this small model is under the default persistence threshold (1e5
        # elements), which would leave the parameters unpartitioned; 0 partitions them all.
        zero["stage3_param_persistence_threshold"] = 0
        if not patched:
            zero["reduce_scatter"] = False
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": args.gas,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": args.muon_lr,
                "adam_lr": args.adam_lr,
                "momentum": args.momentum,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.0,
                **dict(args.muon_param),
            },
        },
        "zero_optimization": zero,
    }
    if args.clip is not None:
        config["gradient_clipping"] = args.clip
    return config


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import deepspeed
    patched = deepspeed.__version__.endswith("+zero3muon")
    from deepspeed.utils import logger as ds_logger
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    ds_logger.setLevel(logging.WARNING)
    hf_logging.set_verbosity_error()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    per_rank = args.global_batch // world
    micro = per_rank // args.gas
    if micro * args.gas * world != args.global_batch:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of world size {world} "
                         f"x gas {args.gas}")

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=data.VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False, attention_dropout=0.0)
    model = LlamaForCausalLM(config).float()
    corpus = data.load_corpus(args.max_corpus_bytes)

    ns_method = dict(args.muon_param).get("ns_method", "gram")
    ns_dtype_upstream = newton_schulz_dtype(ns_method)
    pin = contextlib.ExitStack()
    pin.enter_context(fp32_newton_schulz(every_method=True))  # until training ends, below
    ns_dtype = newton_schulz_dtype(ns_method)
    counter = NSCounter().install()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, micro, patched))
    muon_params = [p for p in engine.module.parameters() if getattr(p, "use_muon", False)]
    muon_elements = sum(getattr(p, "ds_numel", p.numel()) for p in muon_params)
    t_ready = time.perf_counter()

    losses = torch.zeros(args.steps, dtype=torch.float64)
    grad_norms = []  # get_global_grad_norm() after each optimizer step: the raw, pre-clip norm
    max_logits, heads_clipped = [], []  # with qk_clip_threshold: each step's largest logit, heads it clipped
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc=os.path.basename(os.path.normpath(args.out)), unit="step",
                   dynamic_ncols=True)
    engine.train()
    for step in range(args.steps):
        batch = data.global_batch(corpus, step, args.global_batch, args.seq_len, args.seed)
        for m in range(args.gas):
            ids = data.micro_batch(batch, rank, world, args.gas, m)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses[step] += loss.item() / args.gas
        norm = engine.get_global_grad_norm()
        grad_norms.append(float(norm) if norm is not None else None)
        clip = getattr(engine.muon, "qk_clip", None) if getattr(engine, "muon", None) is not None else None
        if clip is not None and clip.last_max is not None:
            max_logits.append(float(clip.last_max.max()))
            heads_clipped.append(int((clip.last_max > clip.threshold).sum()))
        if bar is not None:
            bar.set_postfix(rank0_loss=f"{losses[step]:.4f}", refresh=False)
            bar.update()
    if bar is not None:
        bar.close()
    pin.close()
    t_trained = time.perf_counter()

    # Per-step loss averaged over ranks: the mean token loss of the whole global batch.
    torch.distributed.all_reduce(losses)
    losses /= world
    ns_total = torch.tensor([counter.count], dtype=torch.int64)
    torch.distributed.all_reduce(ns_total)

    stats = getattr(getattr(engine.optimizer, "muon_update", None), "stats", None)
    boundary = None
    if stats is not None:
        local = torch.tensor([int(getattr(stats, f)) for f in BOUNDARY_FIELDS], dtype=torch.int64)
        per_rank_stats = [torch.zeros_like(local) for _ in range(world)]
        torch.distributed.all_gather(per_rank_stats, local)
        boundary = [dict(zip(BOUNDARY_FIELDS, t.tolist())) for t in per_rank_stats]

    weights = gathered_weights(engine)  # collective: every rank takes part
    if rank == 0:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out / "weights.pt")
        result = {
            "stage": args.stage,
            "gas": args.gas,
            "micro_batch_per_rank": micro,
            "global_batch": args.global_batch,
            "world_size": world,
            "steps": args.steps,
            "optimizer_steps": engine.global_steps,
            "losses": losses.tolist(),
            "grad_norms": grad_norms,
            "max_logits": max_logits,
            "heads_clipped": heads_clipped,
            "gradient_clipping": engine.gradient_clipping(),
            "ns_calls_total": int(ns_total.item()),  # summed over ranks, all steps
            "ns_calls_by_kernel": dict(counter.by_kernel),  # rank 0's
            # "gram" Newton-Schulz: the dtype it computed in, and the one upstream would pick on this CPU
            "ns_compute_dtype": ns_dtype,
            "ns_compute_dtype_upstream": ns_dtype_upstream,
            "muon_matrices": len(muon_params),
            "muon_elements": int(muon_elements),  # P
            "params": int(sum(w.numel() for w in weights.values())),
            "boundary_stats": boundary,  # per rank, or None on a build without the counters
            "seconds_setup": t_ready - T_START,
            "seconds_train": t_trained - t_ready,
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "ds_config": ds_config(args, micro, patched),
        }
        (out / "result.json").write_text(json.dumps(result, indent=1))
    # Leave together and tear the process group down before the interpreter exits: without
    # destroy_process_group a gloo rank can abort in teardown ("terminate called without an
    # active exception", SIGABRT, seen once in CI on 0.19.7; pytorch/pytorch#190489).
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
