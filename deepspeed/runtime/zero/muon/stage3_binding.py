# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The owner-centric Muon update of ZeRO-3, run once per optimizer step at the accumulation boundary.

``DeepSpeedZeroOptimizer_Stage3`` creates one ``Zero3MuonBoundary`` at initialization (``None``
when the optimizer is not Muon) and, inside ``step()``'s sub-group loop, calls
``apply(sub_group_id)`` after ``unscale_and_clip_grads`` and before the optimizer step. Nothing
runs on the micro-steps: the reduce path accumulates Muon gradients like any other.

At that point the sub-group's fp32 gradient partition holds the accumulated gradient with the
loss scale and the clip coefficient already divided out, which is what a PyTorch user's
``clip_grad_norm_`` followed by Muon feeds the momentum. ``apply``:

1. agrees over ranks, with one small all-reduce, which matrices have a finite gradient (the
   flags stay on the device: nothing in the update waits for the host);
2. on each rank, advances the momentum partition and forms the NS-input partition in place
   (upstream ``muon_momentum_step_``'s math, via ``momentum_math.momentum_step_``); the momentum
   never leaves its rank;
3. per bucket (``bucket_pipeline.BucketPipeline``), sends the NS-input partitions to each
   matrix's owner rank (all-to-all), the owner runs Newton-Schulz once per matrix (upstream
   ``muon_orthogonalize``; matrices of the same shape in one batched call,
   ``momentum_math.orthogonalize``), and a second all-to-all returns each rank its partition of
   the update, written into the gradient partition. The exchange buffers are allocated at the
   first step and reused.

The optimizer (``MuonWithAuxAdam``) then applies weight decay and ``-lr * update`` to the flat
fp32 partition, as it already does for ZeRO partitions. The update is not rescaled afterwards.
"""

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.bucket_pipeline import BucketPipeline
from deepspeed.runtime.zero.muon.momentum_math import (MOMENTUM_KEY, MuonSettings, all_finite_flags, matrix_spec,
                                                       momentum_step_, orthogonalize)
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, OwnerPlan, plan_owners
from deepspeed.utils import logger


@dataclass
class _SubGroup:
    """What the boundary update needs to know about one Muon sub-group, fixed at initialization."""
    offsets: List[int]  # offset of each parameter's partition in the sub-group's flat partition
    specs: List[MatrixSpec]  # shape, partition size and NS dispatch of each parameter
    plan: OwnerPlan
    pipeline: BucketPipeline  # holds the exchange (process group, rank, world size), layouts, buffers

    @property
    def slices(self) -> List[Tuple[int, int]]:
        """``(offset, numel)`` of each parameter's partition in the flat partition."""
        return [(offset, spec.partition_numel) for offset, spec in zip(self.offsets, self.specs)]

    def partitions(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Per parameter, its partition in ``flat`` (1-D views)."""
        return [flat.narrow(0, offset, numel) for offset, numel in self.slices]

    @property
    def exchange(self) -> OwnerExchange:
        return self.pipeline.exchange


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


class Zero3MuonBoundary:
    """Muon's momentum and Newton-Schulz for the Muon sub-groups of a ZeRO-3 optimizer.

    Args:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3`` (after its fp32 partitions exist).

    Attributes:
        stats: ``ExchangeStats``, cumulative on this rank.
        overlap: when True (default), while the owners orthogonalize bucket k the forward
            all-to-all of bucket k+1 and the back all-to-all of bucket k-1 are in flight; the
            buffers of three buckets are kept. False runs the buckets one after the other (one
            bucket's buffers; the benchmark compares the two). See ``bucket_pipeline``.
        batch_ns: True: an owner orthogonalizes the matrices of a bucket whose Newton-Schulz
            problems have the same shape in one batched call; False: one call per matrix; None
            (default): batched where it pays (always on an accelerator, small problems on the
            CPU; ``momentum_math.batches``). The benchmark compares True and False.

    Raises:
        ValueError: at initialization, on every rank, for a Muon parameter that is not a matrix,
            or with ``muon_num_heads`` on a tensor that is not 2-D, on rows it does not divide, or
            on a base without per-head Muon (``momentum_math.newton_schulz_problem``;
            configurations are checked earlier, by ``check_config``).
        RuntimeError: at initialization, if the ranks of a partition group built different
            owner plans.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.stats = ExchangeStats()
        self.overlap = True
        self.batch_ns = None
        self.device = torch.device(get_accelerator().current_device_name())
        self.sub_groups = {}
        loads = {}  # NS cost owned per rank so far, per partition process group
        for i, params in enumerate(optimizer.fp16_groups):
            if optimizer.sub_groups_using_muon[i] and params:
                self.sub_groups[i] = self._build_sub_group(i, params, loads)
        self._check_plans_agree()
        self._log_plan()

    @staticmethod
    def check_config(optimizer) -> None:
        """For a Muon optimizer, ``refuse_unsupported``; nothing otherwise."""
        if getattr(optimizer, "use_muon", False):
            refuse_unsupported(optimizer)

    @classmethod
    def create(cls, optimizer) -> Optional["Zero3MuonBoundary"]:
        """The boundary update for ``optimizer``, or ``None`` when it does not use Muon."""
        if not getattr(optimizer, "use_muon", False):
            return None
        return cls(optimizer)

    def _param_group(self, sub_group_id):
        opt = self.optimizer
        return opt.optimizer.param_groups[opt.sub_group_to_group_id[sub_group_id]]

    def _build_sub_group(self, i, params, loads) -> _SubGroup:
        opt = self.optimizer
        ns_method = MuonSettings.of(self._param_group(i)).ns_method
        group = opt._get_sub_group_process_group(i)
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        # Every rank meets its sub-groups in the same order, so keying by the local group object
        # pools the same sub-groups on every rank.
        load = loads.setdefault(id(group), [0.0] * world_size)
        offsets, specs = [], []
        for param in params:
            _, offset, partition_numel = opt.grad_position[opt.get_param_id(param)]
            offsets.append(offset)
            specs.append(matrix_spec(param, param.ds_shape, partition_numel, ns_method))
        plan = plan_owners(specs, world_size, opt.reduce_bucket_size, initial_load=load)
        for r, cost in enumerate(plan.load()):
            load[r] += cost
        layouts = [
            BucketLayout(owners=[plan.owners[j] for j in bucket],
                         shapes=[specs[j].shape for j in bucket],
                         partition_numels=[specs[j].partition_numel for j in bucket],
                         rank=rank,
                         world_size=world_size) for bucket in plan.buckets
        ]
        exchange = OwnerExchange(group, rank, world_size, self.device, dist.all_to_all_single, self.stats)
        return _SubGroup(offsets, specs, plan, BucketPipeline(exchange, plan.buckets, layouts))

    def _check_plans_agree(self):
        """One all-reduce per sub-group: MAX of ``[count, digest, -count, -digest]``, where ``count``
        is the number of Muon matrices and ``digest`` a SHA-256 of the shapes, partition sizes, NS
        problems and plan (fixed length, so ranks with different matrix counts still meet in the
        same collective). Every rank holds the same vector exactly when the maximum of each entry
        and of its negation (the minimum) both equal its own."""
        for i, sg in self.sub_groups.items():
            if sg.exchange.world_size == 1:
                continue
            description = repr([(s.shape, s.partition_numel, s.ns_problem) for s in sg.specs] + sg.plan.signature())
            digest = hashlib.sha256(description.encode()).digest()
            # 56-bit chunks: non-negative and their negations fit in int64.
            mine = [len(sg.specs)] + [int.from_bytes(digest[k:k + 7], "little") for k in range(0, 28, 7)]
            extremes = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=sg.exchange.group)
            most, least = extremes[:len(mine)].tolist(), [-v for v in extremes[len(mine):].tolist()]
            if most[0] != least[0]:
                raise RuntimeError(f"ZeRO-3 Muon: ranks disagree on the number of Muon matrices in sub-group {i} "
                                   f"({len(sg.specs)} here, from {least[0]} to {most[0]} over the ranks).")
            if most != mine or least != mine:
                raise RuntimeError(f"ZeRO-3 Muon: ranks built different owner plans for sub-group {i}. Every rank "
                                   "must see the same parameter shapes, Muon flags and "
                                   "zero_optimization.reduce_bucket_size.")

    def _log_plan(self):
        if not self.sub_groups or dist.get_rank() != 0:
            return
        matrices = sum(len(sg.specs) for sg in self.sub_groups.values())
        buckets = sum(len(sg.plan.buckets) for sg in self.sub_groups.values())
        imbalance = max(sg.plan.imbalance() for sg in self.sub_groups.values())
        logger.info(f"ZeRO-3 Muon: owner-centric update at the accumulation boundary for {matrices} matrices in "
                    f"{len(self.sub_groups)} sub-group(s), {buckets} bucket(s) of at most "
                    f"{self.optimizer.reduce_bucket_size} elements; owner NS cost max/mean {imbalance:.3f}")

    def momentum_partition(self, sub_group_id, like: torch.Tensor) -> torch.Tensor:
        """The sub-group's fp32 momentum partition (1-D, ``fp16_partitioned_groups_flat_numel``
        elements, on ``like``'s device): created zero if missing, upcast if not fp32 (a checkpoint of
        stock 0.19.8 keeps it in bf16). The same tensor is kept in the optimizer state under
        ``MOMENTUM_KEY`` (and with ``save_muon_momentum_buffer_in_memory`` in the optimizer's
        in-memory table), so checkpoints save it."""
        opt = self.optimizer
        fp32_partition = opt.fp32_partitioned_groups_flat[sub_group_id]
        numel = opt.fp16_partitioned_groups_flat_numel[sub_group_id]
        in_memory = opt.save_muon_momentum_buffer_in_memory
        if in_memory:
            momentum = opt.muon_momentum_buffer_partitioned_groups_flat.get(sub_group_id)
        else:
            momentum = opt.optimizer.state.get(fp32_partition, {}).get(MOMENTUM_KEY)
        if momentum is None or momentum.numel() != numel:
            opt._create_momentum_buffer(numel, sub_group_id, fp32_partition.ds_id)
            momentum = opt.optimizer.state[fp32_partition][MOMENTUM_KEY]
        if momentum.dtype != torch.float32 or momentum.device != like.device:
            momentum = momentum.to(device=like.device, dtype=torch.float32)
            opt.optimizer.state.setdefault(fp32_partition, {})[MOMENTUM_KEY] = momentum
            if in_memory:
                opt.muon_momentum_buffer_partitioned_groups_flat[sub_group_id] = momentum
        return momentum

    def bucket_exchange_bytes(self) -> int:
        """Bytes of this rank's two exchange buffers for its largest bucket in fp32 (its partitions,
        ``send_numel``, and the whole matrices it owns, ``W * owned_numel``, padding included): what
        one bucket in flight holds beyond the partitions."""
        return max(((layout.send_numel + layout.world_size * layout.owned_numel) * torch.float32.itemsize
                    for sg in self.sub_groups.values() for layout in sg.pipeline.layouts),
                   default=0)

    def retained_bytes(self) -> int:
        """Bytes the update keeps allocated between steps (the exchange buffers), on this rank."""
        return sum(sg.pipeline.retained_bytes() for sg in self.sub_groups.values())

    def _finite_flags(self, sg: _SubGroup, grad_flat: torch.Tensor) -> torch.Tensor:
        """Per matrix, whether its whole gradient is finite: MIN over ranks of each partition's
        flag (int32, shape ``(matrices,)``, on the device; never read on the host)."""
        flags = all_finite_flags(sg.partitions(grad_flat)).to(self.device)
        if sg.exchange.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=sg.exchange.group)
        return flags.to(grad_flat.device).bool()

    @torch.no_grad()
    def apply(self, sub_group_id: int) -> None:
        """Replace the sub-group's gradient partition with its partition of the Muon update.

        Call once per optimizer step, on every rank of the sub-group's partition group, after
        the gradient partition has been unscaled and clipped. Does nothing for a sub-group that
        is not Muon.

        Reads ``fp32_partitioned_groups_flat[sub_group_id].grad`` (1-D, fp32, the sub-group's
        flat partition) and the momentum partition of the same layout; writes both in place.
        """
        sg = self.sub_groups.get(sub_group_id)
        if sg is None:
            return
        settings = MuonSettings.of(self._param_group(sub_group_id))
        grad_flat = self.optimizer.fp32_partitioned_groups_flat[sub_group_id].grad
        momentum_flat = self.momentum_partition(sub_group_id, grad_flat)
        finite = self._finite_flags(sg, grad_flat)
        to_owner = momentum_step_(grad_flat, momentum_flat, sg.slices, settings.momentum, settings.nesterov, finite)
        update_dtype = original_muon.ns_compute_dtype(settings.ns_method)  # sent back without loss
        owner_finite = finite.to(self.device)

        def owner_update(indices, matrices):
            self.stats.ns_calls += len(indices)
            return orthogonalize(matrices, [sg.specs[j] for j in indices], settings.ns_steps, settings.ns_method,
                                 update_dtype, [owner_finite[j] for j in indices], self.batch_ns)

        sg.pipeline.run(to_owner, sg.partitions(grad_flat), owner_update, grad_flat.dtype, update_dtype,
                        self.overlap)
        if sub_group_id == min(self.sub_groups):
            self.stats.optimizer_steps += 1
