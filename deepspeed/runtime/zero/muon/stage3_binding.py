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

1. agrees over ranks, with one small all-reduce, which matrices have a finite gradient;
2. on each rank, advances the momentum partition and forms the NS-input partition in place
   (``momentum_math.momentum_and_ns_input_``); the momentum never leaves its rank;
3. per bucket, sends the NS-input partitions to each matrix's owner rank (all-to-all), the owner
   runs Newton-Schulz once (``momentum_math.orthogonalize``), and a second all-to-all returns
   each rank its partition of the update, written into the gradient partition.

The optimizer (``MuonWithAuxAdam``) then applies weight decay and ``-lr * update`` to the flat
fp32 partition, as it already does for ZeRO partitions. The update is not rescaled afterwards.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon.momentum_math import (all_finite_flags, check_per_head_available,
                                                       momentum_and_ns_input_, ns_output_dtype, orthogonalize)
from deepspeed.runtime.zero.muon.owner_exchange import BucketLayout, ExchangeStats, OwnerExchange
from deepspeed.runtime.zero.muon.owner_plan import MatrixSpec, OwnerPlan, plan_owners
from deepspeed.utils import logger

MOMENTUM_KEY = "momentum_buffer"
"""Optimizer-state key of the Muon momentum, as upstream stores it (checkpoints keep it)."""


@dataclass
class _SubGroup:
    """What the boundary update needs to know about one Muon sub-group, fixed at initialization."""
    offsets: List[int]  # offset of each parameter's partition in the sub-group's flat partition
    partition_numels: List[int]
    specs: List[MatrixSpec]
    plan: OwnerPlan
    layouts: List[BucketLayout]  # one per bucket of ``plan``
    exchange: OwnerExchange
    group: object  # the partition process group


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
        overlap: when True (default), the forward all-to-all of bucket k+1 and the back
            all-to-all of bucket k run asynchronously while the owner orthogonalizes bucket k;
            at most two buckets' exchange buffers are alive at once. False runs the buckets one
            after the other (one bucket alive; the benchmark compares the two).

    Raises:
        ValueError: at initialization, on every rank, for a Muon parameter that is not a matrix,
            or with ``muon_num_heads`` on a tensor that is not 2-D, on rows it does not divide, or
            on a base without per-head Muon (configurations are checked earlier, by
            ``check_config``).
        RuntimeError: at initialization, if the ranks of a partition group built different
            owner plans.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.stats = ExchangeStats()
        self.overlap = True
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
        ns_method = self._param_group(i).get("ns_method", "gram")
        group = opt._get_sub_group_process_group(i)
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        # Every rank meets its sub-groups in the same order, so keying by the local group object
        # pools the same sub-groups on every rank.
        load = loads.setdefault(id(group), [0.0] * world_size)
        offsets, partition_numels, specs = [], [], []
        for param in params:
            _, offset, partition_numel = opt.grad_position[opt.get_param_id(param)]
            offsets.append(offset)
            partition_numels.append(partition_numel)
            specs.append(
                MatrixSpec(shape=tuple(param.ds_shape),
                           partition_numel=partition_numel,
                           ns_method=ns_method,
                           is_expert_group=bool(getattr(param, "is_expert_group", False)),
                           num_heads=getattr(param, "muon_num_heads", None)))
        if any(spec.num_heads is not None for spec in specs):
            check_per_head_available()  # here, on every rank, not at the first step on the owner
        plan = plan_owners(specs, world_size, opt.reduce_bucket_size, initial_load=load)
        for r, cost in enumerate(plan.load()):
            load[r] += cost
        layouts = [
            BucketLayout(owners=[plan.owners[j] for j in bucket],
                         shapes=[specs[j].shape for j in bucket],
                         partition_numels=[partition_numels[j] for j in bucket],
                         rank=rank,
                         world_size=world_size) for bucket in plan.buckets
        ]
        exchange = OwnerExchange(group, rank, world_size, self.device, dist.all_to_all_single, self.stats)
        return _SubGroup(offsets, partition_numels, specs, plan, layouts, exchange, group)

    def _check_plans_agree(self):
        for i, sg in self.sub_groups.items():
            if sg.plan.world_size == 1:
                continue
            signature = torch.tensor([len(sg.specs)] + sg.plan.signature(), dtype=torch.int64, device=self.device)
            lengths = signature[:1].clone()
            high, low = signature.clone(), signature.clone()
            dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=sg.group)
            if int(lengths.item()) != len(sg.specs):
                raise RuntimeError(f"ZeRO-3 Muon: ranks disagree on the number of Muon matrices in sub-group {i} "
                                   f"({len(sg.specs)} here, up to {int(lengths.item())} elsewhere).")
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=sg.group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=sg.group)
            if not (torch.equal(high, signature) and torch.equal(low, signature)):
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

    def _momentum(self, sub_group_id, like: torch.Tensor) -> torch.Tensor:
        """The sub-group's fp32 momentum partition (created zero if missing, upcast if not fp32)."""
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

    def peak_bucket_bytes(self) -> int:
        """Bytes of the matrices this rank owns in its largest bucket, as exchanged (padding
        included): what the boundary update holds beyond the partitions, per bucket in flight."""
        opt = self.optimizer
        itemsize = torch.empty((), dtype=opt.fp32_partitioned_groups_flat[0].dtype).element_size() if \
            opt.fp32_partitioned_groups_flat else 4
        return max((layout.world_size * layout.owned_numel * itemsize for sg in self.sub_groups.values()
                    for layout in sg.layouts), default=0)

    def _finite_flags(self, sg: _SubGroup, grads: List[torch.Tensor]) -> List[bool]:
        flags = all_finite_flags(grads).to(self.device)
        if sg.plan.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=sg.group)
        return [bool(f) for f in flags.tolist()]

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
        group_settings = self._param_group(sub_group_id)
        beta = group_settings["momentum"]
        nesterov = group_settings.get("nesterov", True)
        ns_method = group_settings.get("ns_method", "gram")
        ns_steps = group_settings.get("ns_steps", 5)

        grad_flat = self.optimizer.fp32_partitioned_groups_flat[sub_group_id].grad
        momentum_flat = self._momentum(sub_group_id, grad_flat)
        grads = [grad_flat.narrow(0, o, n) for o, n in zip(sg.offsets, sg.partition_numels)]
        finite = self._finite_flags(sg, grads)
        if all(finite):
            momentum_and_ns_input_(grad_flat, momentum_flat, beta, nesterov, True)
        else:
            for j, (offset, numel) in enumerate(zip(sg.offsets, sg.partition_numels)):
                momentum_and_ns_input_(grads[j], momentum_flat.narrow(0, offset, numel), beta, nesterov, finite[j])

        result_dtype = ns_output_dtype(ns_method)
        buckets = list(zip(sg.plan.buckets, sg.layouts))

        def send_forward(b):
            bucket, layout = buckets[b]
            return sg.exchange.send_to_owners(layout, [grads[j] for j in bucket], grad_flat.dtype, self.overlap)

        def finish_back(pending):
            bucket, layout, back, handle = pending
            _wait(handle)
            layout.unpack(back, [grads[j] for j in bucket])

        forward = send_forward(0) if buckets else None
        pending_back = None
        for b, (bucket, layout) in enumerate(buckets):
            recv, handle = forward
            _wait(handle)
            if b + 1 < len(buckets) and self.overlap:
                forward = send_forward(b + 1)  # in flight while this bucket is orthogonalized
            results = []
            for k, x in zip(layout.owned, layout.owned_matrices(recv)):
                j = bucket[k]
                if finite[j]:
                    spec = sg.specs[j]
                    results.append(orthogonalize(x, ns_method, ns_steps, spec.is_expert_group, spec.num_heads))
                    self.stats.ns_calls += 1
                else:
                    results.append(x)
            del recv
            if pending_back is not None:
                finish_back(pending_back)
            back, handle = sg.exchange.send_to_ranks(layout, results, result_dtype, self.overlap)
            pending_back = (bucket, layout, back, handle)
            del results
            if not self.overlap:
                finish_back(pending_back)
                pending_back = None
                if b + 1 < len(buckets):
                    forward = send_forward(b + 1)
        if pending_back is not None:
            finish_back(pending_back)
        if sub_group_id == min(self.sub_groups):
            self.stats.optimizer_steps += 1


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()
