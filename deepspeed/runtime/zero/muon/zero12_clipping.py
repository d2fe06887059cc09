# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Muon at ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``), clipped like ZeRO-3 and like PyTorch.

A PyTorch user writes ``clip_grad_norm_(params, max_norm)`` and then Muon: the global norm is the
norm of the raw accumulated gradients, the clip coefficient divides the gradient before it enters
the momentum, and the orthogonalized update is applied as it is. ZeRO-3 does that with this
project (``stage3_binding``). Upstream's ZeRO-1/2 instead run ``muon_update`` while the gradient
partition is filled (``get_flat_partition``) or, with ``offload_optimizer``, before the norm
(0.19.8's ``_apply_muon_updates_cpu_offload``), so the norm, the clip and ``get_global_grad_norm()``
see the orthogonalized update: with the default ``gradient_clipping: 1.0`` every Muon step of a
model whose update norm exceeds 1.0 is divided down (upstream issues #8439, #7776).

``DeepSpeedZeroOptimizer`` creates one ``Zero12MuonClipping`` at initialization (``None`` when the
optimizer is not Muon) and the patches wire it in at two places:

1. ``get_flat_partition`` (the accumulation boundary) no longer runs Muon; it hands each Muon
   group's whole accumulated gradients to ``hold_gradients`` and fills the partition with the raw
   gradient like for any optimizer. The norm (``scaled_global_norm``) is therefore the raw one.
2. ``step()``, per parameter group, right after ``unscale_and_clip_grads`` divided the fp32
   gradient partition by the loss scale and the clip coefficient, calls ``step_group``, which
   replaces the partition's Muon slices with this rank's slice of the Muon update:

   - without offload: the held whole gradients go through the same ``unscale_and_clip_grads``
     (the same coefficient, the same fp32 operation as the partition), then, per matrix, upstream
     ``muon_momentum_step_``'s math (``momentum_math.momentum_step_``) on the whole matrix, then
     Newton-Schulz (``momentum_math.orthogonalize``, upstream ``muon_orthogonalize``). The momentum
     keeps upstream's layout (the whole momentum of every parameter of ``params_in_partition``,
     concatenated; ``universal_zero12`` restores it so), in fp32.
   - with ``offload_optimizer``: the fp32 gradient partition is all this rank has, so the momentum
     advances on the partition (elementwise, as ZeRO-3 does; the momentum never travels, and stays
     in the partition layout), the finite flags are agreed over the ranks (MIN), and only the
     Newton-Schulz input is all-gathered, in windows of at most ``reduce_bucket_size`` elements.
     Each rank orthogonalizes only the matrices it holds a piece of.

Nothing runs on the micro-steps and nothing runs on a step the overflow check discards, so the
momentum needs no staging. The optimizer (``MuonWithAuxAdam``) then applies weight decay and
``-lr * update``; the update is not rescaled.

Non-Muon optimizers never create this object: their stage-1/2 path is upstream's, unchanged.
"""

from typing import Dict, List, Optional, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum_math import (MOMENTUM_KEY, MuonSettings, all_finite_flags, matrix_spec,
                                                       momentum_step_, orthogonalize)

def _is_muon_optimizer(optimizer) -> bool:
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return isinstance(optimizer, MuonWithAuxAdam)


class Zero12MuonClipping:
    """Muon's momentum and Newton-Schulz for the Muon groups of a ZeRO-1/2 optimizer, run in
    ``step()`` on the unscaled and clipped gradient.

    Args:
        zero_optimizer: the ``DeepSpeedZeroOptimizer`` (its partitions and offsets exist).

    Attributes:
        ns_calls: Newton-Schulz calls (whole parameters orthogonalized) on this rank, cumulative.
    """

    def __init__(self, zero_optimizer):
        self.zero_optimizer = zero_optimizer
        self.device = torch.device(get_accelerator().current_device_name())
        self._held: Dict[int, torch.Tensor] = {}
        self.ns_calls = 0

    @classmethod
    def create(cls, zero_optimizer) -> Optional["Zero12MuonClipping"]:
        """The Muon step for ``zero_optimizer``, or ``None`` when its optimizer is not Muon."""
        if not _is_muon_optimizer(zero_optimizer.optimizer):
            return None
        return cls(zero_optimizer)

    def _settings(self, group_idx: int) -> MuonSettings:
        return MuonSettings.of(self.zero_optimizer.optimizer.param_groups[group_idx])

    def is_muon_group(self, group_idx: int) -> bool:
        return bool(self.zero_optimizer.optimizer.param_groups[group_idx].get("use_muon", False))

    def hold_gradients(self, group_idx: int, params: List[torch.nn.Parameter], grads: List[torch.Tensor]) -> None:
        """Keep an fp32 copy of the whole accumulated gradients of a Muon group's
        ``params_in_partition`` for ``step_group``.

        Called at the accumulation boundary (``get_flat_partition``), instead of upstream's
        ``muon_update`` there. A copy, not the tensors: the gradient partition ``step()`` builds
        may be a view of them (one tensor in the partition, fp32), which ``unscale_and_clip_grads``
        divides in place before ``step_group`` runs. ``step_group`` or ``release`` drops it.

        Args:
            group_idx: the parameter group.
            params: ``params_in_partition[group_idx]``.
            grads: their accumulated gradients (``all_grad_tensors[group_idx]``), each the whole
                parameter's reduced gradient, loss-scaled, in the gradient accumulation dtype.
        """
        if self.is_muon_group(group_idx) and params:
            self._held[group_idx] = torch.cat([g.reshape(-1) for g in grads]).to(torch.float32)

    def release(self) -> None:
        """Drop held gradients (a step the overflow check discarded)."""
        self._held.clear()

    @torch.no_grad()
    def step_group(self, group_idx: int, grad_partition: torch.Tensor, total_norm) -> None:
        """Replace the Muon slices of the group's fp32 gradient partition with the Muon update.

        Call in ``step()`` on every rank of the group's data-parallel group, after
        ``unscale_and_clip_grads([grad_partition], total_norm)``. Does nothing for a group that is
        not Muon.

        Args:
            group_idx: the parameter group.
            grad_partition: the group's flat fp32 gradient partition (1-D, ``partition_size``
                elements), already divided by the loss scale and the clip coefficient; written in
                place.
            total_norm: the (loss-scaled) global norm ``unscale_and_clip_grads`` was given.
        """
        if not self.is_muon_group(group_idx):
            return
        if self.zero_optimizer.cpu_offload:
            self._step_partition(group_idx, grad_partition)
        else:
            self._step_whole(group_idx, grad_partition, total_norm)

    def _momentum(self, group_idx: int, numel: int, device) -> torch.Tensor:
        """The group's fp32 momentum (``numel`` elements on ``device``): created zero if missing or
        of another size, upcast if not fp32 (stock 0.19.8 keeps it in the gradient dtype, bf16
        under bf16 training), kept in the optimizer state under ``MOMENTUM_KEY``."""
        base = self.zero_optimizer.optimizer
        flat = base.param_groups[group_idx]["params"][0]
        state = base.state.setdefault(flat, {})
        momentum = state.get(MOMENTUM_KEY)
        if momentum is None or momentum.numel() != numel:
            momentum = torch.zeros(numel, dtype=torch.float32, device=device)
            state[MOMENTUM_KEY] = momentum
        elif momentum.dtype != torch.float32 or momentum.device != torch.device(device):
            momentum = momentum.to(device=device, dtype=torch.float32)
            state[MOMENTUM_KEY] = momentum
        return momentum

    def _step_whole(self, group_idx: int, grad_partition: torch.Tensor, total_norm) -> None:
        """Without offload: Muon on the held whole gradients, this rank's slices written back."""
        opt = self.zero_optimizer
        grad_flat = self._held.pop(group_idx, None)
        params = opt.params_in_partition[group_idx]
        if grad_flat is None or not params:
            return
        settings = self._settings(group_idx)
        numels = [p.numel() for p in params]
        # The whole gradients in the momentum's layout, divided exactly as the partition was
        # (same function, same coefficient, same fp32 multiply).
        opt.unscale_and_clip_grads([grad_flat], total_norm)
        momentum = self._momentum(group_idx, grad_flat.numel(), grad_flat.device)
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        slices = list(zip(offsets, numels))
        finite = all_finite_flags([grad_flat.narrow(0, o, n) for o, n in slices]).bool()
        ns_inputs = momentum_step_(grad_flat, momentum, slices, settings.momentum, settings.nesterov, finite)
        specs = [matrix_spec(p, p.shape, p.numel(), settings.ns_method) for p in params]
        updates = orthogonalize([x.view(p.shape) for x, p in zip(ns_inputs, params)], specs, settings.ns_steps,
                                settings.ns_method, original_muon.ns_compute_dtype(settings.ns_method),
                                [finite[j] for j in range(len(params))])
        self.ns_calls += len(params)
        rank = dist.get_rank(group=opt.real_dp_process_group[group_idx])
        partition_size = int(opt.partition_size[group_idx])
        for param, update in zip(params, updates):
            param_id = opt.get_param_id(param)
            source = int(opt.grad_start_offset[group_idx][rank][param_id])
            dest = int(opt.grad_partition_insertion_offset[group_idx][rank][param_id])
            count = int(min(param.numel() - source, partition_size - dest))
            if count > 0:
                grad_partition.narrow(0, dest, count).copy_(update.reshape(-1).narrow(0, source, count))

    def _layout(self, group_idx: int):
        """Per parameter of the whole group (flat-buffer order): ``(param, global offset)``; and
        this rank's partition range ``[start, start + partition_size)`` of the flat buffer."""
        opt = self.zero_optimizer
        params = opt.round_robin_bit16_groups[group_idx]
        offsets, offset = [], 0
        for p in params:
            offsets.append(offset)
            offset += p.numel()
        group = opt.real_dp_process_group[group_idx]
        partition_size = int(opt.partition_size[group_idx])
        return params, offsets, dist.get_rank(group=group) * partition_size, partition_size, group

    def _step_partition(self, group_idx: int, grad_partition: torch.Tensor) -> None:
        """With offload: momentum on the partition, NS input all-gathered per window, NS where needed."""
        opt = self.zero_optimizer
        settings = self._settings(group_idx)
        params, offsets, start, partition_size, group = self._layout(group_idx)
        world_size = dist.get_world_size(group=group)
        end = start + partition_size

        def local(j) -> Tuple[int, int]:
            lo, hi = max(offsets[j], start), min(offsets[j] + params[j].numel(), end)
            return (lo - start, hi - lo) if hi > lo else (0, 0)

        pieces = [local(j) for j in range(len(params))]
        mine = [j for j, (_, n) in enumerate(pieces) if n > 0]
        flags = torch.ones(len(params), dtype=torch.int32, device=self.device)
        if mine:
            flags[mine] = all_finite_flags([grad_partition.narrow(0, *pieces[j]) for j in mine]).to(self.device)
        if world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        finite = flags.bool()
        momentum = self._momentum(group_idx, grad_partition.numel(), grad_partition.device)
        finite_here = finite.to(grad_partition.device)
        sent = momentum_step_(grad_partition, momentum, [pieces[j] for j in mine], settings.momentum,
                              settings.nesterov, finite_here[mine] if mine else finite_here[:0])
        if not settings.nesterov:  # the NS input is a new tensor: put it where the gather reads
            for j, x in zip(mine, sent):
                grad_partition.narrow(0, *pieces[j]).copy_(x)
        update_dtype = original_muon.ns_compute_dtype(settings.ns_method)
        for window in self._windows(params, int(opt.reduce_bucket_size)):
            lo, hi = offsets[window[0]], offsets[window[-1]] + params[window[-1]].numel()
            whole = self._gather_range(grad_partition, lo, hi, partition_size, world_size, group)
            needed = [j for j in window if pieces[j][1] > 0]
            if not needed:
                continue
            matrices = [whole.narrow(0, offsets[j] - lo, params[j].numel()).view(params[j].shape) for j in needed]
            updates = orthogonalize(matrices, [matrix_spec(params[j], params[j].shape, params[j].numel(), settings.ns_method) for j in needed],
                                    settings.ns_steps, settings.ns_method, update_dtype, [finite[j] for j in needed])
            self.ns_calls += len(needed)
            for j, update in zip(needed, updates):
                offset, count = pieces[j]
                source = start + offset - offsets[j]
                grad_partition.narrow(0, offset, count).copy_(update.reshape(-1).narrow(0, source, count))

    @staticmethod
    def _windows(params, bucket_numel: int) -> List[List[int]]:
        """Consecutive parameter indices in windows of at most ``bucket_numel`` elements (a larger
        parameter alone in its window)."""
        windows, current, size = [], [], 0
        for j, p in enumerate(params):
            if current and size + p.numel() > bucket_numel:
                windows.append(current)
                current, size = [], 0
            current.append(j)
            size += p.numel()
        if current:
            windows.append(current)
        return windows

    def _gather_range(self, grad_partition, lo: int, hi: int, partition_size: int, world_size: int,
                      group) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the group's flat buffer, assembled from every rank's partition
        (collective over ``group``): 1-D fp32 on the accelerator, ``hi - lo`` elements. Each rank
        sends its intersection with ``[lo, hi)``, padded to the longest one."""
        spans = []
        for r in range(world_size):
            a, b = max(lo, r * partition_size), min(hi, (r + 1) * partition_size)
            spans.append((a, max(0, b - a)))
        longest = max(n for _, n in spans)
        rank = dist.get_rank(group=group)
        send = torch.zeros(longest, dtype=torch.float32, device=self.device)
        a, n = spans[rank]
        if n > 0:
            send.narrow(0, 0, n).copy_(grad_partition.narrow(0, a - rank * partition_size, n))
        if world_size == 1:
            return send.narrow(0, 0, n)
        received = [torch.empty_like(send) for _ in range(world_size)]
        dist.all_gather(received, send, group=group)
        return torch.cat([received[r].narrow(0, 0, n) for r, (_, n) in enumerate(spans) if n > 0])
