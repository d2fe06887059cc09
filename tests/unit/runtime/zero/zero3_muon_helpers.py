# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ZeRO Muon tests' harness, on top of ``muon_testing`` (models, data, comparisons, reference).

``Zero3MuonRun`` (one training run as data; ``train()`` runs it on every rank), ``initialize_error``, ``Recorder`` /
``replay`` (each boundary update's inputs and outputs, recomputed with upstream ``muon_update``: no single-process
model reproduces fp16/bf16 runs bit for bit), checkpoint helpers (optimizer state gathered whole, universal
conversion, older layouts), tolerances beyond ``FLOOR`` (measurements: docs/configurations.md).
"""

import contextlib
import copy
import dataclasses
import glob
import os
import types
from typing import Optional
from unittest import mock

import numpy as np
import torch

from muon_testing.compare import gathered_weights
from muon_testing.counting import NSCounter, NS_KERNELS
from muon_testing.models import HYPER, TOTAL_SAMPLES, build_model, loss_fn, param_groups, step_batch
from muon_testing.reference import device, fp32_newton_schulz, train_reference

BF16_NS_FLOOR = 5e-3
"""Runs with the "standard" Newton-Schulz kernel (bf16 on the CPU): one bf16 rounding falling the other way (2^-8
relative) after a 1e-7 input difference moves the weights by up to ~1e-3 (5.3e-4 measured in a two-group run)."""

REPLAY_FLOOR = 1e-6
"""Replay of recorded fp16/bf16/fp32 steps: gradient entering Muon and momentum bit-identical; master weights within
one ulp (3.4e-7 to 4.2e-7 measured): the flat-partition update and the whole-matrix replay vectorize differently."""

OVERFLOW_FACTOR = 1e6
"""Multiplies the inputs of a step's first micro-batch on an ``overflow_steps`` step: fp16 overflows."""


@contextlib.contextmanager
def fp16_allowed_on_cpu(enabled=True):
    """DeepSpeed refuses fp16 on the CPU accelerator, although fp16 tensors work there: claimed while the engine is
    built, and only then, so that Newton-Schulz keeps the reference's fp32 compute dtype."""
    from deepspeed.accelerator import get_accelerator
    patch = mock.patch.object(get_accelerator(), "is_fp16_supported", lambda: True)
    with patch if enabled else contextlib.nullcontext():
        yield


def ds_config(stage: int,
              gas: int,
              world_size: int,
              clip: float = 0.0,
              zero_extra=None,
              hyper=HYPER,
              samples: int = TOTAL_SAMPLES,
              partition_all: bool = True) -> dict:
    """A config for ``samples`` samples per step split over ranks and micro-steps. ``partition_all`` (stage 3):
    every parameter partitioned, as a large model's are (persistence threshold 0; at 1e5 these would stay whole)."""
    zero = {"stage": stage}
    if stage == 3 and partition_all:
        zero["stage3_param_persistence_threshold"] = 0
    zero.update(zero_extra or {})
    params = {k: hyper[k] for k in ("muon_lr", "adam_lr", "momentum", "weight_decay")}
    params.update(betas=list(hyper["betas"]), eps=hyper["eps"])
    optimizer = {"type": "Muon", "params": params}
    return {
        "train_batch_size": samples,
        "train_micro_batch_size_per_gpu": samples // (world_size * gas),
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": optimizer,
        "zero_optimization": zero,
    }


ADAMW = {
    "type": "AdamW",
    "params": dict(lr=HYPER["adam_lr"],
                   betas=list(HYPER["betas"]),
                   eps=HYPER["eps"],
                   weight_decay=HYPER["weight_decay"])
}
"""DeepSpeed's ``AdamW`` with the reference's hyper-parameters (``Zero3MuonRun(optimizer="AdamW")``)."""

FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
"""``Zero3MuonRun(dtype="fp16")``: loss scale 256, grown after 2 clean steps, cut at the first overflow, so a few steps
see the loss scale move both ways."""


@dataclasses.dataclass(frozen=True)
class Zero3MuonRun:
    """One DeepSpeed training run of a test model: ``steps`` optimizer steps of ``samples`` samples (``step_batch``)
    split over W ranks and ``gas`` micro-steps, the same samples whatever ``gas`` and W are.

    Attributes (config keys where not said; None: not set):
        model: a key of MODELS. dtype: "fp32", "bf16" or "fp16" (``FP16``; ``fp16_allowed_on_cpu``). clip:
            ``gradient_clipping`` (0: off). target_scale: multiplies the targets (so a clip of 1.0 bites).
        offload: ``offload_optimizer.device`` ("cpu", "nvme": needs ``train(nvme_dir=...)``). momentum_in_memory:
            ``save_muon_momentum_buffer_in_memory``. zero / extra: more ``zero_optimization`` / top-level keys.
        partition_all: see ``ds_config``. optimizer: "Muon" or "AdamW" (``ADAMW``). groups: a key of GROUPINGS.
        zero_init: build under ``deepspeed.zero.Init``. overflow_steps: steps whose first micro-batch is scaled by
            OVERFLOW_FACTOR. pipeline_depth: buckets in flight ahead of the one orthogonalized (1: serial; default 2).
            max_step_memory: Muon's per-rank cap (bytes or "momentum_partition"). every_matrix_alone: the owner plan
            replaced by one bucket per matrix at the configured depth (``binding.plan_partition`` patched), so that
            the pipeline runs at that depth: for these models' few elements the planner takes one bucket, or depth 1
            under "momentum_partition". per_head: ``per_head_muon`` (also the reference's).
        restart_after: after that many steps ``save_checkpoint`` (tag ``restart``), a fresh engine,
            ``load_checkpoint``, go on (needs ``train(checkpoint_dir=...)``); equal to ``steps``: save and stop.
        universal: checkpoints go through ``ds_to_universal`` (tag ``restart_universal``, on rank 0) and load with
            ``"checkpoint": {"load_universal": true}``. resume_from: start at this step from the checkpoint a run
            with ``restart_after`` equal to it saved in ``checkpoint_dir`` (any world size when ``universal``).
        ns_method: also the reference's (None: upstream's "gram"). ns_fp32: every Newton-Schulz kernel in fp32 in
            the run and its reference (``fp32_newton_schulz(every_method=True)``); fp32 runs only.
        momentum_to_bf16: before that ``load_checkpoint``, the checkpoint's Muon momentum stored in bf16, as stock
            0.19.8 writes it under bf16 training.
    """
    model: str = "mixed"
    stage: int = 3
    gas: int = 4
    steps: int = 4
    samples: int = TOTAL_SAMPLES
    dtype: str = "fp32"
    clip: float = 0.0
    target_scale: float = 1.0
    offload: Optional[str] = None
    momentum_in_memory: bool = False
    zero: tuple = ()
    extra: tuple = ()
    partition_all: bool = True
    optimizer: str = "Muon"
    per_head: bool = False
    groups: Optional[str] = None
    zero_init: bool = False
    pipeline_depth: Optional[int] = None
    max_step_memory: Optional[object] = None
    every_matrix_alone: bool = False
    overflow_steps: tuple = ()
    restart_after: Optional[int] = None
    momentum_to_bf16: bool = False
    universal: bool = False
    resume_from: Optional[int] = None
    ns_method: Optional[str] = None
    ns_fp32: bool = False

    def with_(self, **changes) -> "Zero3MuonRun":
        return dataclasses.replace(self, **changes)

    def config(self, world_size: int, nvme_dir=None) -> dict:
        zero = dict(self.zero)
        if self.offload is not None:
            zero["offload_optimizer"] = {"device": self.offload}
            if self.offload == "nvme":
                zero["offload_optimizer"]["nvme_path"] = str(nvme_dir)
        if self.momentum_in_memory:
            zero["save_muon_momentum_buffer_in_memory"] = True
        config = ds_config(self.stage,
                           self.gas,
                           world_size,
                           clip=self.clip,
                           zero_extra=zero,
                           samples=self.samples,
                           partition_all=self.partition_all)
        if self.dtype == "fp16":
            config["fp16"] = dict(FP16)
        elif self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        if self.optimizer == "AdamW":
            config["optimizer"] = copy.deepcopy(ADAMW)
        if self.per_head:
            config["optimizer"]["params"]["per_head_muon"] = True
        for key in ("ns_method", "pipeline_depth", "max_step_memory"):
            if getattr(self, key) is not None:
                config["optimizer"]["params"][key] = getattr(self, key)
        config.update(dict(self.extra))
        return config

    def reference_key(self) -> tuple:
        """What ``reference()`` depends on: runs with equal keys have the same reference."""
        return (self.model, self.steps, self.clip, self.target_scale, self.groups, self.optimizer, self.per_head,
                self.samples, self.ns_method, self.ns_fp32)

    def reference(self):
        """``train_reference`` of the same model, steps and samples: ``(weights, norms)``."""
        return train_reference(self.model,
                               self.steps,
                               clip=self.clip,
                               target_scale=self.target_scale,
                               grouping=self.groups,
                               adamw_only=self.optimizer == "AdamW",
                               per_head=self.per_head,
                               samples=self.samples,
                               ns_method=self.ns_method,
                               ns_fp32=self.ns_fp32)

    def build_engine(self, config):
        import deepspeed
        with fp16_allowed_on_cpu(self.dtype == "fp16"):
            if self.zero_init:
                with deepspeed.zero.Init(config_dict_or_path=config):
                    net = build_model(self.model)
            else:
                net = build_model(self.model)
            engine, *_ = deepspeed.initialize(model=net,
                                              config=config,
                                              model_parameters=param_groups(net, self.groups))
        return engine

    def train(self, checkpoint_dir=None, nvme_dir=None, record=False) -> "Zero3MuonResult":
        """Train on every rank (collective); micro-step ``m`` of rank ``r`` takes the step's samples
        ``[(m * W + r) * mb, ... + mb)``. ``record``: with a ``Recorder`` (ZeRO-3 Muon only). Newton-Schulz in fp32."""
        with fp32_newton_schulz(every_method=self.ns_fp32), _every_matrix_alone(self.every_matrix_alone):
            return self._train(checkpoint_dir, nvme_dir, record)

    def _save(self, engine, checkpoint_dir, rank):
        """``save_checkpoint`` (tag ``restart``), then what ``momentum_to_bf16`` and ``universal`` ask. Collective."""
        from deepspeed import comm as dist
        engine.save_checkpoint(checkpoint_dir, tag="restart")
        dist.barrier()
        if self.momentum_to_bf16:
            _momentum_to_bf16(checkpoint_dir, "restart", rank)
        dist.barrier()
        if self.universal:  # a ZeRO-1/2 model without universal_checkpoint_info needs it injected
            convert_to_universal(checkpoint_dir, "restart", inject_missing_state=self.stage < 3)

    def _train(self, checkpoint_dir, nvme_dir, record):
        from deepspeed import comm as dist
        from torch._dynamo.utils import counters
        world_size, rank = dist.get_world_size(), dist.get_rank()
        graphs_before = int(counters["stats"]["unique_graphs"])
        config = self.config(world_size, nvme_dir)
        input_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]
        micro = self.samples // (world_size * self.gas)
        ns_per_step, ns_off_boundary, norms, loss_scales = [], 0, [], []
        load_config = dict(config, checkpoint={"load_universal": True}) if self.universal else config
        load_tag = "restart_universal" if self.universal else "restart"
        loaded_state = None
        with NSCounter() as counter:
            engine = self.build_engine(config if self.resume_from is None else load_config)
            if self.resume_from is not None:
                engine.load_checkpoint(checkpoint_dir, tag=load_tag)
                loaded_state = gathered_optimizer_state(engine) if self.stage == 3 else None
            recorder = Recorder(engine) if record else None
            for step in range(self.resume_from or 0, self.steps + 1):
                if step == self.restart_after:
                    self._save(engine, checkpoint_dir, rank)
                    if step == self.steps:
                        break
                    engine.destroy()
                    engine = self.build_engine(load_config)
                    engine.load_checkpoint(checkpoint_dir, tag=load_tag)
                if step == self.steps:
                    break
                x, y = step_batch(self.model, step, self.target_scale, self.samples)
                if recorder is not None:
                    recorder.begin_step()
                for m in range(self.gas):
                    lo = (m * world_size + rank) * micro
                    scale = OVERFLOW_FACTOR if (step in self.overflow_steps and m == 0) else 1.0
                    before = counter.count
                    inputs = (x[lo:lo + micro] * scale).to(engine.device, input_dtype)
                    loss = loss_fn(engine(inputs).float(), y[lo:lo + micro].to(engine.device))
                    engine.backward(loss)
                    engine.step()
                    if m < self.gas - 1:
                        ns_off_boundary += counter.count - before
                    else:
                        ns_per_step.append(counter.count - before)
                if recorder is not None:
                    recorder.end_step()
                norm = engine.get_global_grad_norm()
                norms.append(float(norm) if norm is not None else None)
                loss_scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        boundary = getattr(engine.optimizer, "muon_update", None)
        local = dict(ns_per_step=ns_per_step, ns_off_boundary=ns_off_boundary, ns_by_kernel=dict(counter.by_kernel))
        local.update(stats=dataclasses.asdict(boundary.stats) if boundary is not None else None,
                     plan=(boundary.figures.depth, boundary.figures.buckets) if boundary is not None else None,
                     dynamo_graphs=int(counters["stats"]["unique_graphs"]) - graphs_before)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, local)
        states = engine.optimizer.optimizer.state.values() if self.stage == 3 else []
        heads = {n: getattr(p, "muon_num_heads", None) for n, p in engine.module.named_parameters()}
        result = Zero3MuonResult(weights=gathered_weights(engine),
                                 optimizer_state=gathered_optimizer_state(engine) if self.stage == 3 else None,
                                 loaded_state=loaded_state,
                                 norms=norms,
                                 loss_scales=loss_scales,
                                 per_rank=[types.SimpleNamespace(**r) for r in per_rank],
                                 final_momentum_dtypes=sorted(
                                     {str(s["momentum_buffer"].dtype)
                                      for s in states if "momentum_buffer" in s}),
                                 muon_num_heads=heads,
                                 records=(recorder.steps, recorder.initial_master) if recorder is not None else None,
                                 momentum_dtypes=recorder.momentum_dtypes if recorder is not None else None)
        engine.destroy()
        return result


@contextlib.contextmanager
def _every_matrix_alone(enabled: bool):
    """While open (if ``enabled``): ``binding.plan_partition`` plans every matrix in a bucket of its own and keeps the
    depth it is given."""
    from deepspeed.runtime.zero.muon import binding, owner_plan

    def alone(specs, pieces, world_size, max_step_memory, max_bucket_numel, depth, **plan_args):
        plan = owner_plan.plan_owners(specs,
                                      world_size,
                                      1,
                                      initial_load=plan_args.get("initial_load"),
                                      holders=plan_args.get("holders"),
                                      ns_itemsize=plan_args.get("result_itemsize", 4))
        return plan, depth

    with mock.patch.object(binding, "plan_partition", alone) if enabled else contextlib.nullcontext():
        yield


@dataclasses.dataclass
class Zero3MuonResult:
    """What ``Zero3MuonRun.train`` returns, the same on every rank.

    Attributes:
        weights: full parameters by name (fp32 CPU tensors) after training. norms: ``get_global_grad_norm()`` per
            step. loss_scales: the loss scale after each step (1.0 without one).
        per_rank: per rank: ``ns_per_step`` (NS calls at each boundary), ``ns_off_boundary`` (on other micro-steps),
            ``ns_by_kernel``, ``stats`` (the boundary's counters as a dict, or None), ``plan`` (the pipeline depth
            that ran and the buckets: ``PlanFigures.depth``, ``.buckets``; or None), ``dynamo_graphs`` (graphs
            TorchDynamo compiled during the run: 0 when it is disabled).
        final_momentum_dtypes / optimizer_state: ZeRO-3: the Muon momentum buffers' dtypes and
            ``gathered_optimizer_state`` at the end. loaded_state: with ``resume_from``, the latter right after
            ``load_checkpoint``. muon_num_heads: by parameter name, as DeepSpeed tagged them.
        records / momentum_dtypes: with ``train(record=True)``, ``(Recorder.steps, Recorder.initial_master)`` and
            ``Recorder.momentum_dtypes``.
    """
    weights: dict
    norms: list
    loss_scales: list
    per_rank: list
    final_momentum_dtypes: list
    muon_num_heads: dict
    optimizer_state: Optional[dict] = None
    loaded_state: Optional[dict] = None
    records: Optional[tuple] = None
    momentum_dtypes: Optional[list] = None

    def ns_per_step(self):
        """NS calls at each boundary, summed over ranks."""
        return [sum(r.ns_per_step[s] for r in self.per_rank) for s in range(len(self.per_rank[0].ns_per_step))]

    def ns_off_boundary(self):
        return sum(r.ns_off_boundary for r in self.per_rank)

    def ns_by_kernel(self):
        return {k: sum(r.ns_by_kernel[k] for r in self.per_rank) for k in NS_KERNELS}

    def assert_newton_schulz_once_per_problem_per_step(self, problems, steps):
        """Summed over ranks: ``problems`` matrices orthogonalized at every boundary, none off it."""
        assert self.ns_per_step() == [problems] * steps, self.ns_per_step()
        assert self.ns_off_boundary() == 0


def ds_to_universal_args(checkpoint_dir, tag, inject_missing_state=False) -> types.SimpleNamespace:
    """``ds_to_universal.main``'s arguments, ``checkpoint_dir/tag`` into ``checkpoint_dir/<tag>_universal``, one
    worker as upstream's tests run it; ``inject_missing_state``: ZeRO-1/2 without ``universal_checkpoint_info``."""
    return types.SimpleNamespace(input_folder=os.path.join(checkpoint_dir, tag),
                                 output_folder=os.path.join(checkpoint_dir, f"{tag}_universal"),
                                 num_extract_workers=1,
                                 num_merge_workers=1,
                                 keep_temp_folder=False,
                                 strict=True,
                                 inject_missing_state=inject_missing_state)


def convert_to_universal(checkpoint_dir, tag, inject_missing_state=False) -> str:
    """``ds_to_universal`` (``ds_to_universal_args``) on rank 0; collective. Returns the output folder."""
    from deepspeed import comm as dist
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    args = ds_to_universal_args(checkpoint_dir, tag, inject_missing_state)
    dist.barrier()
    if dist.get_rank() == 0:
        ds_to_universal(args)
    dist.barrier()
    return args.output_folder


def gathered_optimizer_state(engine) -> dict:
    """A ZeRO-3 engine's optimizer state, whole (collective): ``{(name, key): ndarray}``, fp32 (exact for fp32/bf16)
    of the parameter's shape, for ``key`` "fp32" (master weights) and each flat state of the sub-group, plus
    ``(name, "step")``; a Muon variant's owner state is first saved to its checkpoint form."""
    opt = engine.optimizer
    if getattr(opt, "muon_update", None) is not None:
        opt.muon_update.save_owner_state()
    state = {}
    for sub_group_id, params in enumerate(opt.fp16_groups):
        fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
        flats = {"fp32": fp32, **opt.optimizer.state.get(fp32, {})}
        for key, flat in sorted(flats.items()):
            for param in params:
                name = opt.param_names[param]
                if key == "step":
                    state[name, key] = flat.item() if torch.is_tensor(flat) else flat
                else:
                    state[name, key] = _full(opt, sub_group_id, flat, param)
    return state


def _momentum_to_bf16(checkpoint_dir, tag, rank):
    """Rewrite this rank's optimizer-state file with every ``momentum_buffer`` in bf16."""
    (path, ) = glob.glob(os.path.join(checkpoint_dir, tag, f"*zero_pp_rank_{rank}_*optim_states.pt"))
    state = torch.load(path, map_location="cpu", weights_only=False)
    converted = []

    def convert(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "momentum_buffer" and torch.is_tensor(value):
                    node[key] = value.to(torch.bfloat16)
                    converted.append(key)
                else:
                    convert(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                convert(value)

    convert(state)
    assert converted, f"no momentum_buffer in {path}"
    torch.save(state, path)


def initialize_error(run: Zero3MuonRun, nvme_dir=None) -> Optional[str]:
    """The ``"Type: message"`` of the error ``deepspeed.initialize`` raises for ``run``, or None."""
    import deepspeed
    try:
        run.build_engine(run.config(deepspeed.comm.get_world_size(), nvme_dir)).destroy()
    except Exception as error:  # the message is what is checked
        return f"{type(error).__name__}: {error}"
    return None


# Recording and replay: the optimizer checked on the gradients DeepSpeed accumulated (fp16/bf16 runs, loss scaling).


def _full(opt, sub_group_id, flat, param):
    """Gather one parameter's partitions of the sub-group flat tensor ``flat`` to its full shape."""
    import deepspeed.comm as dist
    _, offset, numel = opt.grad_position[opt.get_param_id(param)]
    part = flat.narrow(0, offset, numel).detach().float().contiguous()
    group = opt._get_sub_group_process_group(sub_group_id)
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, part, group=group)
    return torch.cat(parts)[:param.ds_numel].view(param.ds_shape).cpu().numpy().copy()


class Recorder:
    """Hooks on a ZeRO-3 optimizer that record every Muon matrix at every optimizer step (on every rank).

    Attributes:
        steps: one dict per optimizer step: ``skipped`` (no update: overflow), ``loss_scale`` (of the step's
            backward passes, read before ``step()`` may change it), ``norm`` (``get_global_grad_norm()``),
            ``norm_from_gradients`` (of every parameter's accumulated gradient, over the loss scale), and per Muon
            parameter name ``accumulated`` (before unscaling), ``entered`` (what the Muon update received),
            ``momentum`` (after) and ``master`` (fp32 weights after the step); all numpy fp32 of the full shape.
        initial_master: fp32 master weights before training, by name.
        momentum_dtypes: dtype of every Muon sub-group's momentum buffer at every step, as strings.
    """

    def __init__(self, engine):
        self.engine = engine
        self.opt = opt = engine.optimizer
        names = {id(p): n for n, p in engine.module.named_parameters()}
        self.muon = {
            i: [(names[id(p)], p) for p in group]
            for i, group in enumerate(opt.fp16_groups) if opt.sub_groups_using_muon[i]
        }
        self.steps, self.current = [], None
        self.initial_master = self._master()
        self.momentum_dtypes = []
        unscale, apply = opt.unscale_and_clip_grads, opt.muon_update.update

        def unscale_and_clip_grads(sub_group_id, total_norm, *args):
            grad = opt.fp32_partitioned_groups_flat[sub_group_id].grad
            self.current["local_sq"] = self.current.get("local_sq", 0.0) + float(grad.double().square().sum())
            if sub_group_id in self.muon:
                self.current["loss_scale"] = self.current["backward_loss_scale"]
                for name, p in self.muon[sub_group_id]:
                    self.current.setdefault(name, {})["accumulated"] = _full(opt, sub_group_id, grad, p)
            return unscale(sub_group_id, total_norm, *args)

        def muon_apply(sub_group_id, grad):
            for name, p in self.muon.get(sub_group_id, ()):
                self.current[name]["entered"] = _full(opt, sub_group_id, grad, p)
            apply(sub_group_id, grad)

        opt.unscale_and_clip_grads = unscale_and_clip_grads
        opt.muon_update.update = muon_apply

    def _master(self):
        return {
            name: _full(self.opt, i, self.opt.fp32_partitioned_groups_flat[i], p)
            for i, params in self.muon.items()
            for name, p in params
        }

    def _momentum(self):
        gathered = {}
        for i, params in self.muon.items():
            momentum = self.opt.optimizer.state[self.opt.fp32_partitioned_groups_flat[i]]["momentum_buffer"]
            self.momentum_dtypes.append(str(momentum.dtype))
            gathered.update({name: _full(self.opt, i, momentum, p) for name, p in params})
        return gathered

    def begin_step(self):
        """Call before the step's first micro-step."""
        self.current = {"backward_loss_scale": float(self.opt.loss_scale)}

    def end_step(self):
        import deepspeed.comm as dist
        step = self.current
        step["skipped"] = "loss_scale" not in step
        step.pop("backward_loss_scale")
        norm = self.engine.get_global_grad_norm()
        step["norm"] = None if norm is None else float(norm)
        if not step["skipped"]:
            from deepspeed.accelerator import get_accelerator
            total = torch.tensor([step.pop("local_sq")],
                                 dtype=torch.float64,
                                 device=get_accelerator().current_device_name())
            dist.all_reduce(total, group=self.opt.dp_process_group)
            step["norm_from_gradients"] = float(total.sqrt()) / step["loss_scale"]
        for name, master in self._master().items():
            step.setdefault(name, {})["master"] = master
        for name, momentum in self._momentum().items():
            step[name]["momentum"] = momentum
        self.steps.append(step)


def replay(*args, **kwargs):
    """``_replay`` with Newton-Schulz in fp32 (``fp32_newton_schulz``)."""
    with fp32_newton_schulz():
        return _replay(*args, **kwargs)


def _replay(records, names, hyper, clip=0.0):
    """What clip_grad_norm_ (``clip``: ``gradient_clipping``, 0: off) + upstream ``muon_update`` give on the recorded
    accumulated gradients of the Muon parameters ``names``. ``records``: ``(Recorder.steps, Recorder.initial_master)``;
    ``hyper``: ``muon_lr``, ``momentum``, ``weight_decay`` (one Muon group). Returns per step a dict name ->
    ``(expected, recorded)`` for ``entered``, ``momentum`` and ``master`` (a skipped step: the last two unchanged)."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    steps, initial = records
    dev = device()
    momenta = {n: torch.zeros_like(torch.from_numpy(initial[n])).to(dev) for n in names}
    masters = {n: torch.from_numpy(initial[n]).to(dev).clone() for n in names}  # not a view of the records
    out = []
    for step in steps:
        got = {n: {} for n in names}
        coef = min(1.0, clip / (step["norm"] + 1e-6)) if clip > 0 and not step["skipped"] else 1.0
        for n in names:
            if not step["skipped"]:
                grad = torch.from_numpy(step[n]["accumulated"]).to(dev) / step["loss_scale"] * coef
                got[n]["entered"] = (grad.cpu().numpy().copy(), step[n]["entered"])
                update = muon_update(grad, momenta[n], beta=hyper["momentum"])
                # As MuonWithAuxAdam applies it to the flat partition.
                masters[n].mul_(1 - hyper["muon_lr"] * hyper["weight_decay"])
                masters[n].add_(update.reshape(masters[n].shape), alpha=-hyper["muon_lr"])
            got[n].update(momentum=(momenta[n].cpu().numpy().copy(), step[n]["momentum"]),
                          master=(masters[n].cpu().numpy().copy(), step[n]["master"]))
        out.append(got)
    return out


def max_relative_error(pairs):
    """Largest ``||expected - recorded|| / ||expected||`` over ``(expected, recorded)`` pairs."""
    worst = 0.0
    for expected, recorded in pairs:
        expected, recorded = np.asarray(expected, np.float64), np.asarray(recorded, np.float64)
        scale = np.linalg.norm(expected)
        worst = max(worst, float(np.linalg.norm(expected - recorded) / (scale if scale > 0 else 1.0)))
    return worst


# A step whose inputs hold a nan (test_muon_non_finite_step.py)


def momentum_tensors(engine):
    """Every Muon momentum tensor in the optimizer state, cloned, in state order."""
    return [
        s["momentum_buffer"].detach().clone() for s in engine.optimizer.optimizer.state.values()
        if "momentum_buffer" in s
    ]


def train_one_step(engine, step, poison=False):
    """One optimizer step (gas 1) of MixedMLP on ``step_batch("mixed", step)``; with ``poison`` the first input of
    every rank is nan, so every gradient is."""
    x, y = step_batch("mixed", step)
    mb = engine.train_micro_batch_size_per_gpu()
    rank = engine.global_rank
    x, y = x[rank * mb:(rank + 1) * mb].clone(), y[rank * mb:(rank + 1) * mb]
    if poison:
        x[0, 0] = float("nan")
    dtype = next(engine.module.parameters()).dtype  # fp16 / bf16 engines take inputs of their dtype
    loss = loss_fn(engine(x.to(engine.device, dtype)).float(), y.to(engine.device))
    engine.backward(loss)
    engine.step()
