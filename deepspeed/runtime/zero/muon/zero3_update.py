# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The Muon update of ZeRO-3, run once per optimizer step at the accumulation boundary.

``DeepSpeedZeroOptimizer_Stage3`` creates one ``Zero3MuonUpdate`` at initialization (``None``
when the optimizer is not Muon) and, inside ``step()``'s sub-group loop, calls
``update_gradient(sub_group_id)`` after ``unscale_and_clip_grads`` and before the optimizer
step. Nothing runs on the micro-steps: the reduce path accumulates Muon gradients like any other.

At that point the sub-group's fp32 gradient partition holds the accumulated gradient with the
loss scale and the clip coefficient already divided out, which is what a PyTorch user's
``clip_grad_norm_`` followed by Muon feeds the momentum. ``update_gradient`` runs the sub-group's
``pipeline.MuonPipeline``: per bucket, each rank advances its momentum partition and sends its
partition of the Newton-Schulz input to the matrix's owner rank (all-to-all), the owner runs
Newton-Schulz once on the whole matrix, and a second all-to-all returns each rank its partition
of the update, written into the gradient partition. The momentum never leaves its rank.

The optimizer (``MuonWithAuxAdam``) then applies weight decay and ``-lr * update`` to the flat
fp32 partition, as it already does for ZeRO partitions. The update is not rescaled afterwards.

A Muon group with ``variant: "normuon"`` (``normuon.NorMuon``) keeps NorMuon's per-row state
on each matrix's owner (``MuonPipeline.owner_state``). Checkpoints hold it per parameter:
``export_owner_state`` (called by ``state_dict()``, patch 0018) gathers it and puts its broadcast
form (``owner_state.expand_rows``) into the optimizer state of the flat partition under
``normuon.NORMUON_STATE_KEY``; the next ``update_gradient`` takes a loaded one back to the
owners (``rows_in_piece``, one small all-reduce) and refuses a loaded optimizer state without it.
"""

import hashlib
from typing import Dict, Optional

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum import MOMENTUM_KEY, MuonSettings
from deepspeed.runtime.zero.muon.newton_schulz import matrix_spec
from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers, ExchangeStats
from deepspeed.runtime.zero.muon.owner_state import check_same_kind, expand_rows, rows_in_piece, variant_of
from deepspeed.runtime.zero.muon.pipeline import DEFAULT_DEPTH, MuonPipeline
from deepspeed.utils import logger


def refuse_unsupported(optimizer) -> None:
    """Refuse the ZeRO-3 configurations the Muon boundary update cannot serve, before anything is
    allocated (called from ``DeepSpeedZeroOptimizer_Stage3.__init__`` once offloading is configured).

    Raises:
        ValueError: naming every offending config key and why.
    """
    from deepspeed.runtime.torch_autocast import get_autocast_dtype, is_autocast_initialized
    problems = []
    if getattr(optimizer, "zenflow", False):
        problems.append("zero_optimization.zenflow: ZenFlow's selective, overlapped optimizer step does not run "
                        "the Muon boundary update; train Muon without zenflow.")
    if is_autocast_initialized() and get_autocast_dtype() == torch.float16:
        problems.append("torch_autocast with fp16: torch's GradScaler unscales the gradients inside the optimizer "
                        "step, after Muon has fed them to its momentum. Use DeepSpeed's fp16 section (its loss "
                        "scale is divided out before Muon) or bf16.")
    if getattr(optimizer, "all2all_process_group", None) is not None and _quantized_reduce_unavailable():
        problems.append("zero_optimization.zero_quantized_gradients: its all-to-all reduction needs DeepSpeed's "
                        f"quantizer op, which the {get_accelerator().device_name()} accelerator does not provide; "
                        "training would fail at the first backward. Turn zero_quantized_gradients off here.")
    if getattr(optimizer, "swap_optimizer", False) and not _async_io_available():
        problems.append("zero_optimization.offload_optimizer.device 'nvme': DeepSpeed's async I/O op cannot be "
                        "built here (it needs libaio: on Debian/Ubuntu `apt-get install libaio-dev`); use "
                        "offload_optimizer.device 'cpu' or install libaio.")
    master_dtype = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)
    if master_dtype != torch.float32:
        key = "bf16.bf16_master_weights_and_grads" if master_dtype == torch.bfloat16 else \
            "fp16.fp16_master_weights_and_grads"
        problems.append(f"{key}: the Muon update reads fp32 gradient partitions into its fp32 momentum; train Muon "
                        "with fp32 master weights and gradients (the default).")
    if problems:
        raise ValueError("ZeRO-3 with the Muon optimizer cannot run this configuration:\n- " + "\n- ".join(problems))


def _async_io_available() -> bool:
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


def _quantized_reduce_unavailable() -> bool:
    """Whether ZeRO-3's quantized all-to-all gradient reduction would run and fail here.

    Stage 3 only takes that path with more than one node (``world_size / device_count() > 1``,
    as ``__avg_scatter_grads`` decides); it then loads the accelerator's ``QuantizerBuilder``.
    """
    accelerator = get_accelerator()
    if dist.get_world_size() // max(1, accelerator.device_count()) <= 1:
        return False
    builder = accelerator.create_op_builder("QuantizerBuilder")
    if builder is None or getattr(builder, "NAME", "") == "deepspeed_not_implemented":
        return True
    return not builder.is_compatible(verbose=False)


class Zero3MuonUpdate:
    """Muon's momentum and Newton-Schulz for the Muon sub-groups of a ZeRO-3 optimizer.

    Args:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3`` (after its fp32 partitions exist).
        pipeline_depth: buckets in flight ahead of the one being orthogonalized
            (``pipeline.MuonPipeline``; 1 runs the buckets one after the other).
        batch_ns: True: an owner orthogonalizes the matrices of a bucket whose Newton-Schulz
            problems have the same shape in one batched call; False: one call per matrix; None
            (default): batched where it pays (``newton_schulz.batches``).

    Attributes:
        stats: ``ExchangeStats``, cumulative on this rank.
        pipelines: per Muon sub-group id, its ``MuonPipeline`` (plan, layouts).
        buffers: the ``ExchangeBuffers`` every sub-group's pipeline uses in turn (sized to the
            largest demand, not their sum: ``step()`` runs the sub-groups one after the other).

    Raises:
        ValueError: at initialization, on every rank, for a Muon parameter that is not a matrix,
            or with ``muon_num_heads`` on a tensor that is not 2-D, on rows it does not divide, or
            on a base without per-head Muon (``newton_schulz.newton_schulz_problem``;
            configurations are checked earlier, by ``check_config``).
        RuntimeError: at initialization, if the ranks of a partition group built different
            owner plans.
    """

    def __init__(self, optimizer, pipeline_depth: int = DEFAULT_DEPTH, batch_ns: Optional[bool] = None):
        self.optimizer = optimizer
        self.stats = ExchangeStats()
        self.device = torch.device(get_accelerator().current_device_name())
        self.pipelines: Dict[int, MuonPipeline] = {}
        loads = {}  # NS cost owned per rank so far, per partition process group
        for i, params in enumerate(optimizer.fp16_groups):
            if optimizer.sub_groups_using_muon[i] and params:
                self.pipelines[i] = self._build_pipeline(i, params, loads, pipeline_depth, batch_ns)
        self._check_plans_agree()
        self.buffers = ExchangeBuffers.covering([p.buffer_demand for p in self.pipelines.values()], self.device)
        # Owner state: the optimizer-state dict each sub-group last ran with (``load_state_dict``
        # replaces it) and the broadcast states ``export_owner_state`` put there.
        self._state_seen = {i: optimizer.optimizer.state for i in self.pipelines}
        self._exported: Dict[int, torch.Tensor] = {}
        self._log_plan()

    @staticmethod
    def check_config(optimizer) -> None:
        """For a Muon optimizer, ``refuse_unsupported``; nothing otherwise."""
        if getattr(optimizer, "use_muon", False):
            refuse_unsupported(optimizer)

    @classmethod
    def create(cls, optimizer) -> Optional["Zero3MuonUpdate"]:
        """The Muon update for ``optimizer``, or ``None`` when it does not use Muon."""
        if not getattr(optimizer, "use_muon", False):
            return None
        return cls(optimizer)

    def _param_group(self, sub_group_id):
        opt = self.optimizer
        return opt.optimizer.param_groups[opt.sub_group_to_group_id[sub_group_id]]

    def _build_pipeline(self, i, params, loads, depth, batch_ns) -> MuonPipeline:
        opt = self.optimizer
        ns_method = MuonSettings.of(self._param_group(i)).ns_method
        variant = variant_of(self._param_group(i))
        group = opt._get_sub_group_process_group(i)
        world_size = dist.get_world_size(group=group)
        # Every rank meets its sub-groups in the same order, so keying by the local group object
        # pools the same sub-groups on every rank.
        load = loads.setdefault(id(group), [0.0] * world_size)
        slices, specs = [], []
        for param in params:
            _, offset, partition_numel = opt.grad_position[opt.get_param_id(param)]
            slices.append((offset, partition_numel))
            specs.append(matrix_spec(param, param.ds_shape, ns_method))
        pieces = [(numel, ) * world_size for _, numel in slices]
        pipeline = MuonPipeline.for_process_group(specs,
                                                  pieces,
                                                  slices,
                                                  group,
                                                  self.stats,
                                                  self.device,
                                                  opt.fp32_partitioned_groups_flat[i].device,
                                                  opt.reduce_bucket_size,
                                                  depth,
                                                  batch_ns,
                                                  variant=variant,
                                                  initial_load=load,
                                                  result_itemsize=original_muon.ns_compute_dtype(ns_method).itemsize)
        for r, cost in enumerate(pipeline.plan.load()):
            load[r] += cost
        return pipeline

    def _check_plans_agree(self):
        """One all-reduce per sub-group: MAX of ``[count, digest, -count, -digest]``, where ``count``
        is the number of Muon matrices and ``digest`` a SHA-256 of the shapes, partition sizes, NS
        problems, plan and pipeline depth (the order of the collectives follows from them; fixed
        length, so ranks with different matrix counts still meet in the same collective). Every rank holds the same vector exactly when the maximum of each entry
        and of its negation (the minimum) both equal its own."""
        for i, pipeline in self.pipelines.items():
            if pipeline.exchange.world_size == 1:
                continue
            description = repr([(s.shape, n, s.ns_problem) for s, (_, n) in zip(pipeline.specs, pipeline.slices)] +
                               pipeline.plan.signature() + [pipeline.depth])
            digest = hashlib.sha256(description.encode()).digest()
            # 56-bit chunks: non-negative and their negations fit in int64.
            mine = [len(pipeline.specs)] + [int.from_bytes(digest[k:k + 7], "little") for k in range(0, 28, 7)]
            extremes = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=pipeline.exchange.group)
            most, least = extremes[:len(mine)].tolist(), [-v for v in extremes[len(mine):].tolist()]
            if most[0] != least[0]:
                raise RuntimeError(f"ZeRO-3 Muon: ranks disagree on the number of Muon matrices in sub-group {i} "
                                   f"({len(pipeline.specs)} here, from {least[0]} to {most[0]} over the ranks).")
            if most != mine or least != mine:
                raise RuntimeError(f"ZeRO-3 Muon: ranks built different owner plans for sub-group {i}. Every rank "
                                   "must see the same parameter shapes, Muon flags and "
                                   "zero_optimization.reduce_bucket_size.")

    def _log_plan(self):
        if not self.pipelines or dist.get_rank() != 0:
            return
        matrices = sum(len(p.specs) for p in self.pipelines.values())
        buckets = sum(len(p.plan.buckets) for p in self.pipelines.values())
        depth = min(p.depth for p in self.pipelines.values())
        imbalance = max(p.plan.imbalance() for p in self.pipelines.values())
        momentum = 4 * sum(n for p in self.pipelines.values() for _, n in p.slices)
        reserved = self.reserved_bytes()
        workspace = 4 * max(p.plan.workspace(p.exchange.rank) for p in self.pipelines.values())
        fits = reserved + workspace <= momentum
        logger.info(f"ZeRO-3 Muon: owner-centric update at the accumulation boundary for {matrices} matrices in "
                    f"{len(self.pipelines)} sub-group(s), {buckets} bucket(s), pipeline depth {depth}, {reserved} "
                    f"bytes of exchange buffers and {workspace} bytes of owner Newton-Schulz working set on rank 0 "
                    f"({'within' if fits else 'over'} its momentum partition of {momentum} bytes); owner NS cost "
                    f"max/mean {imbalance:.3f}")

    def momentum_partition(self, sub_group_id, like: torch.Tensor) -> torch.Tensor:
        """The sub-group's fp32 momentum partition (1-D, ``fp16_partitioned_groups_flat_numel``
        elements, on ``like``'s device), kept in the optimizer state under ``MOMENTUM_KEY`` (and with
        ``save_muon_momentum_buffer_in_memory`` in the optimizer's in-memory table), so checkpoints
        save it.

        Stage 3 allocates it with the fp32 partitions (``_create_momentum_buffer``); a state loaded
        without one (an optimizer state saved by another optimizer) gets a zero momentum from the
        same allocator, as a fresh run would. A momentum of another dtype or device (DeepSpeed's
        own bf16 path keeps it in bf16; offload moves it) is converted once and stored back.

        Raises:
            RuntimeError: the momentum held for the sub-group has another number of elements (a
                checkpoint of another partitioning, loaded without the universal-checkpoint path):
                training on would silently drop the momentum.
        """
        opt = self.optimizer
        fp32_partition = opt.fp32_partitioned_groups_flat[sub_group_id]
        numel = opt.fp16_partitioned_groups_flat_numel[sub_group_id]
        in_memory = opt.save_muon_momentum_buffer_in_memory
        if in_memory:
            momentum = opt.muon_momentum_buffer_partitioned_groups_flat.get(sub_group_id)
        else:
            momentum = opt.optimizer.state.get(fp32_partition, {}).get(MOMENTUM_KEY)
        if momentum is None:
            opt._create_momentum_buffer(numel, sub_group_id, fp32_partition.ds_id)
            momentum = opt.optimizer.state[fp32_partition][MOMENTUM_KEY]
        if momentum.numel() != numel:
            raise RuntimeError(
                f"ZeRO-3 Muon: sub-group {sub_group_id} holds a momentum of {momentum.numel()} elements "
                f"for a partition of {numel}: the optimizer state comes from another partitioning "
                "(world size, sub_group_size or parameters). Load such a checkpoint as a universal "
                "checkpoint (\"checkpoint\": {\"load_universal\": true}).")
        if momentum.dtype != torch.float32 or momentum.device != like.device:
            momentum = momentum.to(device=like.device, dtype=torch.float32)
            opt.optimizer.state.setdefault(fp32_partition, {})[MOMENTUM_KEY] = momentum
            if in_memory:
                opt.muon_momentum_buffer_partitioned_groups_flat[sub_group_id] = momentum
        return momentum

    def reserved_bytes(self) -> int:
        """Bytes of exchange buffer this rank keeps between steps, over all Muon sub-groups."""
        return self.buffers.reserved_bytes()

    @torch.no_grad()
    def update_gradient(self, sub_group_id: int) -> None:
        """Replace the sub-group's gradient partition with its partition of the Muon update.

        Call once per optimizer step, on every rank of the sub-group's partition group, after
        the gradient partition has been unscaled and clipped. Does nothing for a sub-group that
        is not Muon. ``step()`` never gets here with a non-finite gradient: it skips such a step
        before the sub-group loop, as it skips an overflow.

        Reads ``fp32_partitioned_groups_flat[sub_group_id].grad`` (1-D, fp32, the sub-group's
        flat partition) and the momentum partition of the same layout; writes both in place.
        """
        pipeline = self.pipelines.get(sub_group_id)
        if pipeline is None:
            return
        group = self._param_group(sub_group_id)
        settings = MuonSettings.of(group)
        variant = variant_of(group)
        check_same_kind(pipeline.owner_state and pipeline.owner_state.variant, variant,
                        f"ZeRO-3 Muon, sub-group {sub_group_id}")
        grad_flat = self.optimizer.fp32_partitioned_groups_flat[sub_group_id].grad
        momentum_flat = self.momentum_partition(sub_group_id, grad_flat)
        if pipeline.owner_state is not None:
            self._take_loaded_owner_state(sub_group_id, pipeline)
        pipeline.run(grad_flat, momentum_flat, settings, original_muon.ns_compute_dtype(settings.ns_method),
                     self.buffers, variant)
        if sub_group_id == min(self.pipelines):
            self.stats.optimizer_steps += 1

    def _full_owner_state(self, pipeline: MuonPipeline) -> torch.Tensor:
        """Every matrix's owner state of a sub-group, concatenated in sub-group order, on every
        rank (1-D fp32 on the accelerator: one all-reduce SUM, each matrix has one owner)."""
        state = pipeline.owner_state
        numels = [state.variant.state_numel(spec) for spec in pipeline.specs]
        full = torch.zeros(sum(numels), dtype=torch.float32, device=self.device)
        offset = 0
        for j, n in enumerate(numels):
            if j in state.spans:
                full.narrow(0, offset, n).copy_(state.view(j))
            offset += n
        if pipeline.exchange.world_size > 1:
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pipeline.exchange.group)
        return full

    @torch.no_grad()
    def export_owner_state(self) -> None:
        """Put each Muon variant's owner state into the optimizer state, per parameter, for a checkpoint.

        Collective over each variant sub-group's partition group; called by the stage's
        ``state_dict()`` (patch 0018), which every rank runs in ``save_checkpoint``. For each such
        sub-group, the flat partition's state gets, under the variant's ``state_key``, a host fp32
        tensor of the partition's layout (``fp16_partitioned_groups_flat_numel`` elements): each
        element holds its row's state (``expand_rows``), padding zero. A plain Muon run does nothing.
        """
        opt = self.optimizer
        for i, pipeline in self.pipelines.items():
            if pipeline.owner_state is None:
                continue
            full = self._full_owner_state(pipeline).cpu()
            broadcast = torch.zeros(opt.fp16_partitioned_groups_flat_numel[i], dtype=torch.float32)
            rank, offset = pipeline.exchange.rank, 0
            for spec, (start, numel) in zip(pipeline.specs, pipeline.slices):
                n, cols = pipeline.owner_state.variant.state_rows(spec)
                first = rank * numel
                count = max(0, min(numel, spec.numel - first))
                if count:
                    broadcast.narrow(0, start, count).copy_(expand_rows(full.narrow(0, offset, n), cols, first, count))
                offset += n
            opt.optimizer.state.setdefault(opt.fp32_partitioned_groups_flat[i],
                                           {})[pipeline.owner_state.variant.state_key] = broadcast
            self._exported[i] = broadcast

    @torch.no_grad()
    def _take_loaded_owner_state(self, sub_group_id: int, pipeline: MuonPipeline) -> None:
        """Before a variant sub-group's update: take back the state a checkpoint loaded.

        Collective over the sub-group's partition group, with the same outcome on every rank (every
        rank loads the same checkpoint). A broadcast state in the optimizer state that this engine
        did not export itself (``load_checkpoint``, regular or universal) is read back into the
        owners' state (``rows_in_piece``, one all-reduce SUM); either way it is removed from the
        optimizer state. An optimizer state that ``load_state_dict`` replaced without one refuses.

        Raises:
            RuntimeError: a loaded optimizer state without the variant's state (a checkpoint of a
                plain Muon run, or of a build without variants): training on would restart it at
                zero.
        """
        opt = self.optimizer
        state_key = pipeline.owner_state.variant.state_key
        state = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[sub_group_id], {})
        exported = self._exported.pop(sub_group_id, None)
        loaded = state.pop(state_key, None)
        replaced = opt.optimizer.state is not self._state_seen[sub_group_id]
        self._state_seen[sub_group_id] = opt.optimizer.state
        if loaded is None:
            if replaced:
                raise RuntimeError(f"ZeRO-3 Muon, sub-group {sub_group_id}: the loaded optimizer state has no "
                                   f"'{state_key}' for the {pipeline.owner_state.variant.name} variant (a checkpoint "
                                   "of a plain Muon run?); refusing to restart it at zero. Load a checkpoint of "
                                   "the same variant.")
            return
        if loaded is exported:
            return
        numel = opt.fp16_partitioned_groups_flat_numel[sub_group_id]
        if loaded.numel() != numel:
            raise RuntimeError(f"ZeRO-3 Muon, sub-group {sub_group_id}: '{state_key}' has {loaded.numel()} elements "
                               f"for a partition of {numel} (another partitioning); load it as a universal "
                               "checkpoint.")
        loaded = loaded.to(device=self.device, dtype=torch.float32)
        variant = pipeline.owner_state.variant
        numels = [variant.state_numel(spec) for spec in pipeline.specs]
        full = torch.zeros(sum(numels), dtype=torch.float32, device=self.device)
        rank, offset = pipeline.exchange.rank, 0
        for spec, (start, part), n in zip(pipeline.specs, pipeline.slices, numels):
            _, cols = variant.state_rows(spec)
            first = rank * part
            count = max(0, min(part, spec.numel - first))
            if count:
                row, values = rows_in_piece(loaded.narrow(0, start, count), cols, first)
                full.narrow(0, offset + row, values.numel()).copy_(values)
            offset += n
        if pipeline.exchange.world_size > 1:
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pipeline.exchange.group)
        offset = 0
        for j, n in enumerate(numels):
            if j in pipeline.owner_state.spans:
                pipeline.owner_state.view(j).copy_(full.narrow(0, offset, n))
            offset += n
