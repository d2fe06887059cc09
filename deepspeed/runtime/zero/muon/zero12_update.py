# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The Muon update of ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``), run in ``step()`` on the
unscaled and clipped gradient, like ZeRO-3's and like PyTorch's.

A PyTorch user writes ``clip_grad_norm_(params, max_norm)`` and then Muon: the global norm is the
norm of the raw accumulated gradients, the clip coefficient divides the gradient before it enters
the momentum, and the orthogonalized update is applied as it is (upstream issues #8439, #7776
describe the clip of the orthogonalized update instead).

``DeepSpeedZeroOptimizer`` creates one ``Zero12MuonUpdate`` at initialization (``None`` when the
optimizer is not Muon) and calls it at two places:

1. ``get_flat_partition`` (the accumulation boundary) hands each Muon group's whole accumulated
   gradients to ``hold_gradients`` and fills the partition with the raw gradient like for any
   optimizer, so the norm (``scaled_global_norm``) is the raw one.
2. ``step()``, per parameter group, right after ``unscale_and_clip_grads`` divided the fp32
   gradient partition by the loss scale and the clip coefficient, calls ``update_group``, which
   replaces the partition's Muon slices with this rank's slice of the Muon update:

   - with ``offload_optimizer``: the fp32 gradient partition is all this rank has. The group runs
     the distributed core (``pipeline.MuonPipeline``), as ZeRO-3 does: the momentum advances on
     the partition, and each matrix goes to one owner among the ranks holding a piece of it. The
     flat layout keeps most matrices whole inside one rank's partition; those never travel, and
     only a matrix that straddles a partition boundary is exchanged (its pieces to the owner and
     the update's pieces back).
   - without offload: every rank holds the whole reduced gradients, so nothing travels. The
     held gradients go through the same ``unscale_and_clip_grads`` (the same coefficient and fp32
     operation as the partition), then the momentum step and Newton-Schulz on each whole matrix
     of the rank's partition. The momentum keeps upstream's layout (the whole momentum of every
     parameter of ``params_in_partition``, concatenated) in fp32. A matrix that straddles a
     partition boundary is orthogonalized by each rank holding a piece of it.

ZeRO-1/2 do not always skip a step whose gradients are not finite (bf16 without an overflow
check), so the group agrees one flag (a MIN all-reduce of one integer): where it is not finite
the gradient is left as it is and the momentum unchanged, which is what ``muon_update`` does for
a non-finite gradient. Nothing runs on the micro-steps and nothing on a step the overflow check
discards. The optimizer (``MuonWithAuxAdam``) then applies weight decay and ``-lr * update``.

A Muon group with ``variant: "normuon"`` (``normuon.NorMuon``) keeps NorMuon's per-row state
in the optimizer state of the group's flat partition under ``normuon.NORMUON_STATE_KEY``
(fp32), so ZeRO-1/2 checkpoints carry it: without offload every rank keeps it for the whole
matrices of its ``params_in_partition`` (each holder of a straddling matrix advances its own
copy, on the same inputs); with offload it is the pipeline's owner state (the matrices this rank
owns), with the owned matrices' indices under ``NORMUON_STATE_KEY + "_matrices"``, checked at load.
A loaded optimizer state without it is refused.
"""

from typing import Dict, List, Optional

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.momentum import MOMENTUM_KEY, MuonSettings, momentum_step
from deepspeed.runtime.zero.muon.newton_schulz import matrix_spec, orthogonalize_each
from deepspeed.runtime.zero.muon.owner_exchange import ExchangeBuffers, ExchangeStats
from deepspeed.runtime.zero.muon.owner_state import OwnerState, check_same_kind, variant_of
from deepspeed.runtime.zero.muon.pipeline import DEFAULT_DEPTH, MuonPipeline


def _is_muon_optimizer(optimizer) -> bool:
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return isinstance(optimizer, MuonWithAuxAdam)


class Zero12MuonUpdate:
    """Muon's momentum and Newton-Schulz for the Muon groups of a ZeRO-1/2 optimizer.

    Args:
        zero_optimizer: the ``DeepSpeedZeroOptimizer`` (its partitions and offsets exist).
        pipeline_depth, batch_ns: as for ``zero3_update.Zero3MuonUpdate`` (offload only: that is
            where the distributed core runs).

    Attributes:
        stats: ``ExchangeStats``, cumulative on this rank (``ns_calls``: matrices orthogonalized
            here; the elements count what crossed ranks, under offload only).
        pipelines: per Muon parameter group under offload, its ``MuonPipeline``.
        buffers: the ``ExchangeBuffers`` the pipelines use in turn (empty without offload).
    """

    def __init__(self, zero_optimizer, pipeline_depth: int = DEFAULT_DEPTH, batch_ns: Optional[bool] = None):
        self.zero_optimizer = zero_optimizer
        self.device = torch.device(get_accelerator().current_device_name())
        self.stats = ExchangeStats()
        self.batch_ns = batch_ns
        self._held: Dict[int, torch.Tensor] = {}
        self.pipelines: Dict[int, MuonPipeline] = {}
        if zero_optimizer.cpu_offload:
            for i in range(len(zero_optimizer.round_robin_bit16_groups)):
                if self.is_muon_group(i):
                    self.pipelines[i] = self._build_pipeline(i, pipeline_depth)
        self.buffers = ExchangeBuffers.covering([p.buffer_demand for p in self.pipelines.values()], self.device)
        self._variants = {
            i: variant_of(zero_optimizer.optimizer.param_groups[i])
            for i in range(len(zero_optimizer.round_robin_bit16_groups)) if self.is_muon_group(i)
        }
        self._state_seen = {i: zero_optimizer.optimizer.state for i in self._variants}

    @classmethod
    def create(cls, zero_optimizer) -> Optional["Zero12MuonUpdate"]:
        """The Muon update for ``zero_optimizer``, or ``None`` when its optimizer is not Muon."""
        if not _is_muon_optimizer(zero_optimizer.optimizer):
            return None
        return cls(zero_optimizer)

    def _settings(self, group_idx: int) -> MuonSettings:
        return MuonSettings.of(self.zero_optimizer.optimizer.param_groups[group_idx])

    def is_muon_group(self, group_idx: int) -> bool:
        return bool(self.zero_optimizer.optimizer.param_groups[group_idx].get("use_muon", False))

    def _build_pipeline(self, group_idx: int, depth: int) -> MuonPipeline:
        """The core over the flat buffer's layout: rank ``r`` holds elements ``[r * partition_size,
        (r + 1) * partition_size)`` of the group's parameters concatenated in order."""
        opt = self.zero_optimizer
        params = opt.round_robin_bit16_groups[group_idx]
        group = opt.real_dp_process_group[group_idx]
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        partition_size = int(opt.partition_size[group_idx])
        ns_method = self._settings(group_idx).ns_method
        specs, pieces, slices, start = [], [], [], 0
        for param in params:
            end = start + param.numel()
            held = [
                max(0,
                    min(end, (r + 1) * partition_size) - max(start, r * partition_size)) for r in range(world_size)
            ]
            specs.append(matrix_spec(param, param.shape, ns_method))
            pieces.append(tuple(held))
            slices.append((max(start, rank * partition_size) - rank * partition_size if held[rank] else 0, held[rank]))
            start = end
        holders = [[r for r, n in enumerate(p) if n] for p in pieces]
        return MuonPipeline.for_process_group(specs,
                                              pieces,
                                              slices,
                                              group,
                                              self.stats,
                                              self.device,
                                              opt.single_partition_of_fp32_groups[group_idx].device,
                                              opt.reduce_bucket_size,
                                              depth,
                                              self.batch_ns,
                                              variant=variant_of(opt.optimizer.param_groups[group_idx]),
                                              holders=holders,
                                              result_itemsize=original_muon.ns_compute_dtype(ns_method).itemsize)

    def reserved_bytes(self) -> int:
        """Bytes of exchange buffer this rank keeps between steps (under offload)."""
        return self.buffers.reserved_bytes()

    def hold_gradients(self, group_idx: int, params: List[torch.nn.Parameter], grads: List[torch.Tensor]) -> None:
        """Keep an fp32 copy of the whole accumulated gradients of a Muon group's
        ``params_in_partition`` for ``update_group`` (without offload).

        Called at the accumulation boundary (``get_flat_partition``). A copy, not the tensors:
        the gradient partition ``step()`` builds may be a view of them (one tensor in the
        partition, fp32), which ``unscale_and_clip_grads`` divides in place before
        ``update_group`` runs. ``update_group`` or ``release`` drops it.

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
    def update_group(self, group_idx: int, grad_partition: torch.Tensor, total_norm) -> None:
        """Replace the Muon slices of the group's fp32 gradient partition with the Muon update.

        Call in ``step()`` on every rank of the group's data-parallel group, after
        ``unscale_and_clip_grads([grad_partition], total_norm)``. Does nothing for a group that is
        not Muon, or, leaving the momentum unchanged, when the group's gradient is not finite on
        some rank.

        Args:
            group_idx: the parameter group.
            grad_partition: the group's flat fp32 gradient partition (1-D, ``partition_size``
                elements), already divided by the loss scale and the clip coefficient; written in
                place.
            total_norm: the (loss-scaled) global norm ``unscale_and_clip_grads`` was given.
        """
        if not self.is_muon_group(group_idx):
            return
        held = self._held.pop(group_idx, None)
        if not self._group_is_finite(group_idx, grad_partition if held is None else held):
            return
        settings = self._settings(group_idx)
        variant = variant_of(self.zero_optimizer.optimizer.param_groups[group_idx])
        check_same_kind(self._variants[group_idx], variant, f"ZeRO-1/2 Muon, parameter group {group_idx}")
        if group_idx == min(i for i in range(len(self.zero_optimizer.round_robin_bit16_groups))
                            if self.is_muon_group(i)):
            self.stats.optimizer_steps += 1
        if group_idx in self.pipelines:
            momentum = self._momentum(group_idx, grad_partition.numel(), grad_partition.device)
            if variant is not None:
                self._pipeline_owner_state(group_idx)
            self.pipelines[group_idx].run(grad_partition, momentum, settings,
                                          original_muon.ns_compute_dtype(settings.ns_method), self.buffers, variant)
        elif held is not None:
            momentum = self._momentum(group_idx, held.numel(), held.device)
            self._update_whole(group_idx, held, momentum, settings, grad_partition, total_norm, variant)

    def _group_is_finite(self, group_idx: int, grads: torch.Tensor) -> bool:
        flag = torch.isfinite(grads).all().to(device=self.device, dtype=torch.int32).view(1)
        group = self.zero_optimizer.real_dp_process_group[group_idx]
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def _momentum(self, group_idx: int, numel: int, device) -> torch.Tensor:
        """The group's fp32 momentum (``numel`` elements on ``device``), kept in the optimizer state
        under ``MOMENTUM_KEY``: created zero if missing, upcast if not fp32 (a checkpoint may keep it
        in the gradient dtype).

        Raises:
            RuntimeError: the state holds a momentum of another size (saved with another world
                size, or with and without ``offload_optimizer``, whose layouts differ): training
                on would silently drop it.
        """
        base = self.zero_optimizer.optimizer
        flat = base.param_groups[group_idx]["params"][0]
        state = base.state.setdefault(flat, {})
        momentum = state.get(MOMENTUM_KEY)
        if momentum is None:
            momentum = state[MOMENTUM_KEY] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif momentum.numel() != numel:
            layout = "partition" if self.zero_optimizer.cpu_offload else "whole parameters of the partition"
            raise RuntimeError(
                f"ZeRO-1/2 Muon: parameter group {group_idx} holds a momentum of {momentum.numel()} "
                f"elements where this configuration keeps {numel} ({layout}): the optimizer state "
                "comes from another world size or another zero_optimization.offload_optimizer "
                "setting. Resume a ZeRO-1/2 checkpoint of a Muon run with the world size and "
                "offload_optimizer setting that saved it (ds_to_universal does not convert its Muon "
                "state); a universal checkpoint of a ZeRO-3 run loads at any world size (\"checkpoint\": "
                "{\"load_universal\": true}).")
        elif momentum.dtype != torch.float32 or momentum.device != torch.device(device):
            momentum = state[MOMENTUM_KEY] = momentum.to(device=device, dtype=torch.float32)
        return momentum

    def _loaded_without(self, group_idx: int, state: dict, key: str) -> None:
        """Refuse an optimizer state that ``load_state_dict`` replaced without the variant's ``key``."""
        base = self.zero_optimizer.optimizer
        replaced = base.state is not self._state_seen[group_idx]
        self._state_seen[group_idx] = base.state
        if replaced and key not in state:
            raise RuntimeError(f"ZeRO-1/2 Muon, parameter group {group_idx}: the loaded optimizer state has no "
                               f"'{key}' for the {self._variants[group_idx].name} variant (a checkpoint of a plain "
                               "Muon run?); refusing to restart it at zero. Load a checkpoint of the same variant.")

    def _whole_owner_state(self, group_idx: int, specs, variant, device) -> OwnerState:
        """Without offload: the variant's state of every matrix of ``params_in_partition``, kept in
        the optimizer state (created zero on the first step, checked after a load).

        Raises:
            RuntimeError: a loaded state without it, or with another number of elements.
        """
        base = self.zero_optimizer.optimizer
        state = base.state.setdefault(base.param_groups[group_idx]["params"][0], {})
        self._loaded_without(group_idx, state, variant.state_key)
        owner = OwnerState(variant, specs, range(len(specs)), device=device, flat=state.get(variant.state_key))
        if state.get(variant.state_key) is None:
            state[variant.state_key] = owner.flat
        return owner

    def _pipeline_owner_state(self, group_idx: int) -> None:
        """With offload: the pipeline's owner state is the optimizer state's tensor; a loaded one is
        copied in after its matrices are checked.

        Raises:
            RuntimeError: a loaded state without it, or kept for other matrices (another world size,
                ``reduce_bucket_size`` or parameters: another owner plan).
        """
        base = self.zero_optimizer.optimizer
        owner = self.pipelines[group_idx].owner_state
        key = owner.variant.state_key
        state = base.state.setdefault(base.param_groups[group_idx]["params"][0], {})
        self._loaded_without(group_idx, state, key)
        owned = torch.tensor(sorted(owner.spans), dtype=torch.float32)
        loaded, matrices = state.get(key), state.get(key + "_matrices")
        if loaded is not None and loaded is not owner.flat:
            if matrices is None or not torch.equal(matrices.cpu().float(), owned):
                raise RuntimeError(f"ZeRO-1/2 Muon, parameter group {group_idx}: the loaded '{key}' belongs to "
                                   "another owner plan (world size, zero_optimization.reduce_bucket_size or "
                                   "parameters differ); load the checkpoint with the configuration it was saved "
                                   "with.")
            owner.flat.copy_(loaded.reshape(-1))
        state[key] = owner.flat
        state[key + "_matrices"] = owned

    def _update_whole(self,
                      group_idx: int,
                      grad_flat: torch.Tensor,
                      momentum: torch.Tensor,
                      settings: MuonSettings,
                      grad_partition: torch.Tensor,
                      total_norm,
                      variant=None) -> None:
        """Without offload: Muon on the held whole gradients, this rank's slices written back."""
        opt = self.zero_optimizer
        params = opt.params_in_partition[group_idx]
        # The whole gradients in the momentum's layout, divided exactly as the partition was
        # (same function, same coefficient, same fp32 multiply).
        opt.unscale_and_clip_grads([grad_flat], total_norm)
        inputs, offset = [], 0
        for param in params:
            grad, mom = grad_flat.narrow(0, offset, param.numel()), momentum.narrow(0, offset, param.numel())
            momentum_step(grad, mom, settings, out=grad)
            inputs.append(grad.view(param.shape))
            offset += param.numel()
        specs = [matrix_spec(p, p.shape, settings.ns_method) for p in params]
        rank = dist.get_rank(group=opt.real_dp_process_group[group_idx])
        partition_size = int(opt.partition_size[group_idx])
        calls = orthogonalize_each(inputs.__getitem__, specs, settings.ns_steps, settings.ns_method,
                                   original_muon.ns_compute_dtype(settings.ns_method), grad_flat.device, self.batch_ns,
                                   max(spec.ns_workspace_numel for spec in specs))
        owner = None if variant is None else self._whole_owner_state(group_idx, specs, variant, grad_flat.device)
        for indices, updates in calls:
            self.stats.ns_calls += len(indices)
            for k, update in zip(indices, updates):
                if owner is not None:
                    update = owner.apply(k, update, variant)
                param_id = opt.get_param_id(params[k])
                source = int(opt.grad_start_offset[group_idx][rank][param_id])
                dest = int(opt.grad_partition_insertion_offset[group_idx][rank][param_id])
                count = int(min(params[k].numel() - source, partition_size - dest))
                if count > 0:
                    grad_partition.narrow(0, dest, count).copy_(update.reshape(-1).narrow(0, source, count))
