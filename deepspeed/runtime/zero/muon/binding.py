# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The Muon update of every ZeRO stage, run once per optimizer step at the accumulation boundary.

Each stage describes its rank's share of every ZeRO-3 sub-group or ZeRO-1/2 parameter group once (``MuonPartition``).
In ``step()``, once the gradient partition is divided by the loss scale and the clip coefficient (as
``clip_grad_norm_`` before Muon in PyTorch), each rank advances its fp32 momentum on its pieces; each matrix held by
several ranks goes by all-to-all to one owner among them, which runs Newton-Schulz once on the whole matrix, and the
update's pieces come back in place of the gradient (``pipeline``). Under ZeRO-3 every rank holds a piece of every
matrix; under ZeRO-1/2 most matrices lie whole in one partition and never travel. The momentum never travels and
nothing runs on micro-steps. The stage calls ``update`` in ``step()``, ``after_inner_step`` after the inner step, and
``save_owner_state`` / ``load_saved_state`` from ``state_dict()`` / ``load_state_dict()``. The momentum is optimizer
state of the flat partition in its layout (as Adam's ``exp_avg``), so every checkpoint path carries it.
``MuonWithAuxAdam`` then applies weight decay and ``-lr * update`` (not rescaled).
"""

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.rank_agreement import agreed_errors
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.config import BATCH_NS_KEY, MAX_STEP_MEMORY_KEY, PIPELINE_DEPTH_KEY, SPLIT_KEY
from deepspeed.runtime.zero.muon.momentum import MOMENTUM_KEY, StepSettings, is_muon_optimizer
from deepspeed.runtime.zero.muon.newton_schulz import matrix_spec, split_of
from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import (DEFAULT_MAX_STEP_MEMORY, STRICT, CapBelowFloor, plan_figures,
                                                    plan_partition)
from deepspeed.runtime.zero.muon.owner_state import (MUON, VARIANT_KEY, check_same_kind, load_checkpoint_form,
                                                     variant_of)
from deepspeed.runtime.zero.muon.param_record import tensor_parallel_layout
from deepspeed.runtime.zero.muon.pipeline import DEFAULT_DEPTH, MuonPipeline, stays_home
from deepspeed.utils import logger

LOW_EFFICIENCY = 0.5
"""Below this NS parallel efficiency rank 0 warns at initialization that the cap serializes Newton-Schulz."""


@dataclass(frozen=True, eq=False)
class MuonPartition:
    """One ZeRO-3 sub-group or ZeRO-1/2 parameter group as this rank holds it, built once by the stage.

    Attributes:
        key, label: the stage's index (passed to ``update`` and ``after_inner_step``) and its name in messages.
        group_index: its group in ``optimizer.param_groups`` (read at each step: a loaded checkpoint replaces them).
        muon: whether its parameters are Muon matrices; other groups are described for the after-inner-step hooks.
        params, shapes: the parameters in partition order and their full shapes.
        pieces: per matrix, the elements each rank of ``process_group`` holds of the flattened matrix, in rank order
            (ZeRO-3 zero-pads past its end).
        slices: per matrix, ``(offset, numel)`` of this rank's piece in ``flat``.
        flat, numel: the fp32 partition (its optimizer state holds the momentum; on the pieces' device), its elements.
        bucket_numel: most elements of whole matrices exchanged at once (``reduce_bucket_size``).
        allocate_momentum: makes ``flat``'s zero fp32 momentum the stage's way (ZeRO-3's knows swapping); None: zeros.
        agree_finite: where some rank's gradient is not finite, keep the momentum and return a zero update (ZeRO-1/2
            may step on such a gradient; ZeRO-3 skips the step itself).
    """
    key: int
    label: str
    group_index: int
    params: Sequence[torch.nn.Parameter]
    shapes: Sequence[Tuple[int, ...]]
    pieces: Sequence[Tuple[int, ...]]
    slices: Sequence[Tuple[int, int]]
    process_group: object
    flat: torch.Tensor
    numel: int
    bucket_numel: int
    muon: bool = True
    allocate_momentum: Optional[Callable[[], None]] = None
    agree_finite: bool = False

    def held_pieces(self) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """``(param, start, offset, numel)`` per parameter this rank holds: its elements ``[start, start + numel)`` lie
        at ``offset`` of ``flat`` (ZeRO-3's padding left out)."""
        rank = dist.get_rank(group=self.process_group)
        held = []
        for param, shape, piece, (offset, numel) in zip(self.params, self.shapes, self.pieces, self.slices):
            start = sum(piece[:rank])
            numel = max(0, min(numel, math.prod(shape) - start))
            if numel:
                held.append((param, start, offset, numel))
        return held


class MuonUpdate:
    """Muon's momentum and Newton-Schulz for the Muon partitions of one ZeRO optimizer (a ``MuonWithAuxAdam``).

    Attributes:
        stats: ``ExchangeStats``, cumulative on this rank.
        pipelines: per partition key its ``MuonPipeline`` (owner plan, layouts, owner state).
        buffers: the running pipeline's ``ExchangeBuffers``; None between runs, so the device memory serves the next
            forward and backward (pinned host staging for optimizer offload is kept: slow to pin).
        figures: the plans' ``owner_plan.PlanFigures`` (every rank's).

    Raises:
        ValueError: at initialization, on every rank: a Muon parameter that is not a matrix, ``muon_num_heads`` that
            does not fit it, an unknown ``variant``, a ``max_step_memory`` below what every matrix alone needs;
            matrices spread over more ranks by two kinds of layout or with a variant's owner state; a variant with
            ``split_fused_muon`` on parts of unequal rows.
        RuntimeError: at initialization, where a group's ranks built different owner plans or its warm-up all-to-all
            (``OwnerExchange.warm_up``) came back wrong.
    """

    def __init__(self, optimizer, partitions: Sequence[MuonPartition]):
        self.optimizer = optimizer
        self.stats = ExchangeStats()
        self.device = torch.device(get_accelerator().current_device_name())
        self.described: Dict[int, MuonPartition] = {p.key: p for p in partitions}
        self.partitions: Dict[int, MuonPartition] = {p.key: p for p in partitions if p.muon and p.params}
        self._after_inner_step: List[Callable[[MuonPartition], None]] = []
        self.pipelines: Dict[int, MuonPipeline] = {}
        self.spread_pipelines: Dict[int, MuonPipeline] = {}
        loads = {}  # NS cost owned per rank so far, per process group
        spread = self._spread_matrices()
        refused = []  # (needed bytes, partition label, cap) of every partition no plan fits
        for key, part in self.partitions.items():
            sharded = spread.get(key)
            local = [j for j in range(len(part.params)) if sharded is None or j not in sharded.indices]
            try:
                if local:
                    self.pipelines[key] = self._build_pipeline(part, local, [part.pieces[j] for j in local],
                                                               [tuple(part.shapes[j]) for j in local], loads)
                if sharded is not None:
                    self.spread_pipelines[key] = self._build_pipeline(part, sharded.indices, sharded.pieces,
                                                                      sharded.shapes, loads, sharded)
            except CapBelowFloor as e:
                refused.append((4 * e.needed_numel, part.label, 4 * e.cap_numel))
        if refused:  # every rank plans the same: each refuses with the most any partition needs
            needed, label, cap = max(refused)
            raise ValueError(
                f"{MAX_STEP_MEMORY_KEY} (optimizer.params or the Muon parameter group): {cap} bytes is below what "
                f"Muon's step needs on a rank for {label}: at least {needed} bytes ({needed / 2**30:.2f} GiB), the "
                "largest matrix whole on its owner rank with its Newton-Schulz working set and one bucket's exchange "
                "buffers (every matrix alone, pipeline depth 1)"
                f"{f', the most of {len(refused)} partitions' if len(refused) > 1 else ''}. Set {MAX_STEP_MEMORY_KEY} "
                f"to at least {needed}, or to \"momentum_partition\" (within each rank's momentum partition where "
                "possible, else that least need).")
        self._check_plans_agree()
        warm = {id(p.exchange.group): p.exchange for _, p in self._every_pipeline() if p.exchange.world_size > 1}
        for exchange in warm.values():  # every rank of a group meets its pipelines in the same order
            exchange.warm_up(self.device)
        self.buffers = None
        self._staging = ExchangeBuffers.covering([p.buffer_demand for _, p in self._every_pipeline()],
                                                 self.device,
                                                 device_buffers=False)
        self.figures = self._plan_figures()
        self._log_plan()

    def _plan_figures(self):
        """``owner_plan.plan_figures`` of the pipelines of each process group, merged: buckets summed, the least
        depth, the largest peak and kept bytes; NS efficiency of the group with the most matrices."""
        groups = {}
        for _, p in self._every_pipeline():
            groups.setdefault(p.exchange.world_size, []).append(p)
        figures = [(sum(len(p.specs) for p in ps),
                    plan_figures([(p.plan, p.depth, p.pieces, p.result_itemsize, p.state_numels) for p in ps], w))
                   for w, ps in groups.items()]
        if not figures:
            return plan_figures([], 1)
        main = max(figures, key=lambda f: f[0])[1]
        return dataclasses.replace(main,
                                   buckets=sum(f.buckets for _, f in figures),
                                   depth=min(f.depth for _, f in figures),
                                   peak_bytes=max(f.peak_bytes for _, f in figures),
                                   kept_bytes=max(f.kept_bytes for _, f in figures))

    @classmethod
    def create(cls, optimizer, partitions: Callable[[], Sequence[MuonPartition]]) -> Optional["MuonUpdate"]:
        """The update for ``optimizer``, or None unless it is ``MuonWithAuxAdam`` (only then is ``partitions`` run)."""
        return cls(optimizer, partitions()) if is_muon_optimizer(optimizer) else None

    def _group(self, part: MuonPartition) -> dict:
        return self.optimizer.param_groups[part.group_index]

    def _spread_matrices(self) -> dict:
        """Per partition key, its matrices spread over more ranks than its group (AutoTP's, marked by
        ``param_record.tensor_parallel_layout``), as one call of the layout's ``spread`` describes them: ``indices``,
        ``shapes`` (whole), ``pieces`` (over ``process_group``), ``placements``, ``assemblies``, ``num_heads``."""
        requests = {}
        for key, part in self.partitions.items():
            layouts = {j: tensor_parallel_layout(p) for j, p in enumerate(part.params)}
            marked = {j: layout for j, layout in layouts.items() if layout is not None}
            if marked:
                requests[key] = (part, marked)
        kinds = {type(layout): layout for _, marked in requests.values() for layout in marked.values()}
        if len(kinds) > 1:
            raise ValueError(f"Muon matrices spread over more ranks by {len(kinds)} kinds of layout; one at a time.")
        if not kinds:
            return {}
        layout = kinds.popitem()[1]
        for part, _ in requests.values():
            if variant_of(self._group(part)) is not None:
                raise ValueError(
                    f"{layout.config_key}: {part.label}: the Muon variant {self._group(part)[VARIANT_KEY]!r} "
                    "keeps owner state that matrices spread over more ranks do not support yet.")
        return layout.spread(requests)

    def _build_pipeline(self,
                        part: MuonPartition,
                        indices: Sequence[int],
                        pieces: Sequence[Tuple[int, ...]],
                        shapes: Sequence[Tuple[int, ...]],
                        loads,
                        sharded=None) -> MuonPipeline:
        """The pipeline of the partition's matrices ``indices`` of (whole) ``shapes``, held as ``pieces`` over its
        group or as ``sharded`` (a layout's ``spread``) says, planned under the group's ``max_step_memory`` with the
        variant's owner state counted. Raises ``owner_plan.CapBelowFloor`` where no plan fits."""
        group = self._group(part)
        ns_method = StepSettings.of(group).ns_method
        heads = sharded.num_heads if sharded is not None else [
            getattr(part.params[j], "muon_num_heads", None) for j in indices
        ]
        specs = [
            matrix_spec(part.params[j], shape, ns_method, n, split_of(part.params[j], group))
            for j, shape, n in zip(indices, shapes, heads)
        ]
        if sharded is not None:  # the owner's copies of a spread matrix: its storage, then the whole matrix
            specs = [dataclasses.replace(s, extra_numel=2 * s.numel) for s in specs]
        if variant_of(group) is not None:
            uneven = [s.shape for s in specs if s.split and (s.split[0] != -2 or len(set(s.split[1])) > 1)]
            if uneven:
                raise ValueError(f"{SPLIT_KEY}: {part.label}: the Muon variant {group.get(VARIANT_KEY)!r} keeps one "
                                 f"value per row of equal parts; fused parameters of shapes {uneven} split into "
                                 f"columns or unequal parts. Set \"{SPLIT_KEY}\": false (recognized fused "
                                 "projections), remove your muon_split, or use a plain Muon group.")
        process_group = part.process_group if sharded is None else sharded.process_group
        rank, world_size = dist.get_rank(group=process_group), dist.get_world_size(group=process_group)
        max_step_memory = group.get(MAX_STEP_MEMORY_KEY)
        max_step_memory = DEFAULT_MAX_STEP_MEMORY if max_step_memory is None else (
            max_step_memory if max_step_memory == STRICT else int(max_step_memory))
        # every rank meets its partitions in the same order: keyed by the group, the same ones pool
        load = loads.setdefault(id(process_group), [0.0] * world_size)
        held = [[r for r, n in enumerate(p) if n] for p in pieces]
        placements, assemblies = (None, None) if sharded is None else (sharded.placements, sharded.assemblies)
        specs = [
            dataclasses.replace(s, travels=not stays_home(p, part.flat.device, self.device, a))
            for s, p, a in zip(specs, pieces, assemblies or [None] * len(specs))
        ]
        variant = variant_of(group)
        state_numels = None if variant is None else [variant.state_numel(s) for s in specs]
        result_itemsize = original_muon.ns_compute_dtype(ns_method).itemsize
        plan, depth = plan_partition(specs,
                                     pieces,
                                     world_size,
                                     max_step_memory,
                                     part.bucket_numel,
                                     group.get(PIPELINE_DEPTH_KEY, DEFAULT_DEPTH),
                                     initial_load=load,
                                     holders=None if all(len(h) == world_size for h in held) else held,
                                     result_itemsize=result_itemsize,
                                     state_numels=state_numels)
        exchange = OwnerExchange(process_group, rank, world_size, dist.all_to_all_single, self.stats)
        pipeline = MuonPipeline(plan, specs, pieces,
                                [part.slices[j] for j in indices], exchange, self.device, part.flat.device, depth,
                                group.get(BATCH_NS_KEY), variant, placements, assemblies, result_itemsize,
                                state_numels)
        for r, cost in enumerate(pipeline.plan.load()):
            load[r] += cost
        return pipeline

    def _check_plans_agree(self):
        """Per pipeline one all-reduce MAX of ``[count, digest, -count, -digest]`` (matrix count and SHA-256 of the
        shapes, pieces, problems, plan and depth, which fix the collectives' order; fixed length, so ranks of different
        counts still meet): agreed if max == min."""
        for key, pipeline in self._every_pipeline():
            if pipeline.exchange.world_size == 1:
                continue
            part = self.partitions[key]
            specs = pipeline.specs
            description = repr([(specs[j].shape, layout.pieces, specs[j].ns_problem) for layout in pipeline.layouts
                                for j in layout.matrices] + pipeline.plan.signature() + [pipeline.depth])
            digest = hashlib.sha256(description.encode()).digest()
            # 56-bit chunks: non-negative and their negations fit in int64.
            mine = [len(pipeline.specs)] + [int.from_bytes(digest[k:k + 7], "little") for k in range(0, 28, 7)]
            extremes = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=pipeline.exchange.group)
            most, least = extremes[:len(mine)].tolist(), [-v for v in extremes[len(mine):].tolist()]
            if most[0] != least[0]:
                raise RuntimeError(f"{part.label}: ranks disagree on the number of Muon matrices "
                                   f"({len(pipeline.specs)} here, from {least[0]} to {most[0]} over the ranks).")
            if most != mine or least != mine:
                raise RuntimeError(f"{part.label}: ranks built different owner plans. Every rank must see the same "
                                   "parameter shapes, Muon flags and zero_optimization.reduce_bucket_size.")

    def _every_pipeline(self):
        """``(key, pipeline)`` of every pipeline, in the order every rank runs them."""
        for key in self.partitions:
            for pipelines in (self.pipelines, self.spread_pipelines):
                if key in pipelines:
                    yield key, pipelines[key]

    def _log_plan(self):
        if not self.partitions or dist.get_rank() != 0:
            return
        f = self.figures
        if f.ns_efficiency < LOW_EFFICIENCY and f.buckets > 1:
            logger.warning(f"Muon: NS parallel efficiency {f.ns_efficiency:.2f} over {f.buckets} buckets: most owner "
                           "ranks wait while one orthogonalizes, because max_step_memory (or \"momentum_partition\") "
                           f"leaves room for few matrices per bucket (peak {f.peak_bytes} bytes per rank). A larger "
                           "max_step_memory lets every owner compute at once; python -m deepspeed.runtime.zero.muon "
                           "plan shows the plan for a value before launching.")
        pipelines = [p for _, p in self._every_pipeline()]
        travel = sum(1 for p in pipelines for piece in p.pieces if sum(map(bool, piece)) > 1)
        spread = sum(len(p.specs) for p in self.spread_pipelines.values())
        logger.info(f"{next(iter(self.partitions.values())).label.split(',')[0]}: owner-centric update at the "
                    f"accumulation boundary for {sum(len(p.specs) for p in pipelines)} matrices ({travel} held by "
                    f"more than one rank, {spread} over all ranks: tensor-parallel) in {len(pipelines)} "
                    f"pipeline(s) over {f.world_size} ranks, Newton-Schulz in {self._ns_dtypes()}: {f.buckets} "
                    f"bucket(s), pipeline depth {f.depth}, "
                    f"peak of Muon's step {f.peak_bytes} bytes per rank at most, kept between steps "
                    f"{f.kept_bytes} bytes per rank at most, NS parallel efficiency {f.ns_efficiency:.2f}; owner NS "
                    f"cost max/mean {max(p.plan.imbalance() for p in pipelines):.3f}")

    def _ns_dtypes(self) -> str:
        dtypes = {
            original_muon.ns_compute_dtype(StepSettings.of(self._group(p)).ns_method)
            for p in self.partitions.values()
        }
        return ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))

    def add_after_inner_step(self, hook: Callable[[MuonPartition], None]) -> None:
        """Run ``hook(partition)`` right after the inner optimizer stepped each partition, Muon or not, on every rank
        in the stage's order, hooks in the order added (MuonClip's QK-clip)."""
        self._after_inner_step.append(hook)

    def after_inner_step(self, key: int) -> None:
        """Called right after the inner optimizer stepped partition ``key`` (``flat`` updated, not yet copied out)."""
        for hook in self._after_inner_step:
            hook(self.described[key])

    def reserved_bytes(self) -> int:
        """Bytes of exchange buffer this rank holds on its device now: 0 between steps (``buffers``)."""
        return 0 if self.buffers is None else self.buffers.reserved_bytes()

    def _state(self, part: MuonPartition) -> dict:
        return self.optimizer.state.setdefault(part.flat, {})

    def momentum(self, key: int, device) -> torch.Tensor:
        """The partition's fp32 momentum (1-D, ``numel``, on ``device``), created (zero), upcast (older checkpoints
        hold bf16) and size-checked (``RuntimeError``) here alone."""
        part = self.partitions[key]
        state = self._state(part)
        if state.get(MOMENTUM_KEY) is None:
            if part.allocate_momentum is not None:
                part.allocate_momentum()
                state = self._state(part)
            else:
                state[MOMENTUM_KEY] = torch.zeros(part.numel, dtype=torch.float32, device=device)
        momentum = state[MOMENTUM_KEY]
        self._check_momentum(part, momentum)
        if momentum.dtype != torch.float32 or momentum.device != torch.device(device):
            converted = momentum.to(device=device, dtype=torch.float32)
            if hasattr(momentum, "swappable"):  # ZeRO-3 keeps some momenta out of the NVMe swapper
                converted.swappable = momentum.swappable
            momentum = state[MOMENTUM_KEY] = converted
        return momentum

    @staticmethod
    def _check_momentum(part: MuonPartition, momentum: torch.Tensor) -> None:
        if momentum.numel() != part.numel:
            raise RuntimeError(
                f"{part.label} holds a momentum of {momentum.numel()} elements for a partition of {part.numel}: the "
                "optimizer state comes from another partitioning (data-parallel world size, "
                "zero_optimization.sub_group_size, offload_optimizer or the parameters). Convert the checkpoint "
                "with ds_to_universal and load it with \"checkpoint\": {\"load_universal\": true}.")

    @torch.no_grad()
    def update(self, key: int, grad_partition: torch.Tensor) -> None:
        """Replace in place this rank's pieces of partition ``key``'s gradient (``grad_partition``: 1-D fp32, divided
        by the loss scale and the clip coefficient) with its pieces of the Muon update; once per step on every rank of
        the group. With ``agree_finite`` and a non-finite gradient on some rank, the momentum stays and the pieces
        become zero (weight decay only). ``RuntimeError`` where the group's ``variant`` is not the state's."""
        pipelines = [p for k, p in self._every_pipeline() if k == key]
        if not pipelines:
            return
        part = self.partitions[key]
        if part.agree_finite and not self._all_finite(pipelines[-1], grad_partition):
            for start, numel in part.slices:  # no step for the matrices, as at ZeRO-3's skipped step
                grad_partition.narrow(0, start, numel).zero_()
            return
        group = self._group(part)
        variant = variant_of(group)
        settings = StepSettings.of(group)
        momentum = self.momentum(key, grad_partition.device)
        for pipeline in pipelines:
            check_same_kind(pipeline.owner_state and pipeline.owner_state.variant, variant, part.label)
            if pipeline.owner_state is not None:
                # A checkpoint form save_owner_state() left here has served its save.
                self._state(part).pop(pipeline.owner_state.variant.state_key, None)
            # one pipeline's buffers at a time: each was planned within max_step_memory on its own
            self.buffers = ExchangeBuffers.covering([pipeline.buffer_demand], self.device, self._staging)
            try:
                pipeline.run(grad_partition, momentum, settings, original_muon.ns_compute_dtype(settings.ns_method),
                             self.buffers, variant)
            finally:
                self.buffers = None
        if key == next(iter(self.partitions)):
            self.stats.optimizer_steps += 1

    def _all_finite(self, pipeline: MuonPipeline, grad_partition: torch.Tensor) -> bool:
        flag = torch.isfinite(grad_partition).all().to(device=self.device, dtype=torch.int32).view(1)
        if pipeline.exchange.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pipeline.exchange.group)
        return bool(flag.item())

    @torch.no_grad()
    def save_owner_state(self) -> None:
        """Put each variant's owner state in checkpoint form (``OwnerState.to_partition``) under its ``state_key`` in
        the optimizer state for ``state_dict()`` (dropped at the next ``update``); collective per variant group."""
        for key, pipeline in self.pipelines.items():
            if pipeline.owner_state is None:
                continue
            part, exchange = self.partitions[key], pipeline.exchange
            self._state(part)[pipeline.owner_state.variant.state_key] = pipeline.owner_state.to_partition(
                part.pieces, part.slices, exchange.rank, part.numel, exchange.group, exchange.world_size)

    @torch.no_grad()
    def load_saved_state(self) -> None:
        """Take over the Muon state the stage just loaded (regular or universal checkpoint); collective per group.

        Raises:
            RankAgreedError (a RuntimeError), on every rank: a momentum of another size on some rank, a ``variant`` the
                checkpoint changed, or a variant's state missing, foreign or misfit (``load_checkpoint_form``).
            ValueError: a variant's state not in its checkpoint form.
        """
        for key, pipeline in self._every_pipeline():
            part, owner = self.partitions[key], pipeline.owner_state
            group, state = self._group(part), self._state(part)
            with agreed_errors(f"loading the Muon state of {part.label}", group=pipeline.exchange.group):
                check_same_kind(owner and owner.variant, variant_of(group), part.label)
                if state.get(MOMENTUM_KEY) is not None:
                    self._check_momentum(part, state[MOMENTUM_KEY])
            load_checkpoint_form(owner, state, part, pipeline.exchange, group.get(VARIANT_KEY, MUON))
