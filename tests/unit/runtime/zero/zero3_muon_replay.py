# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Record what ZeRO-3's Muon boundary update saw and did, then replay it with upstream ``muon_update``.

Where no single-process model can reproduce a run bit for bit (fp16 and bf16 forward passes,
loss scaling), the tests check the optimizer on the gradients DeepSpeed actually accumulated:
``Recorder`` (installed on every rank) gathers, at every optimizer step, each Muon matrix's
accumulated gradient as the reduce path left it (still multiplied by the loss scale), the loss
scale, the raw norm, the gradient that entered the Muon update, the momentum after it and the
fp32 master weights after the step. ``replay`` then recomputes, from the recorded accumulated
gradients and loss scales alone, what a PyTorch user gets from ``clip_grad_norm_`` followed by
upstream ``muon_update`` in fp32, and returns it next to what was recorded.
"""

import numpy as np
import torch


def _full(opt, sub_group_id, flat, param):
    """Gather one parameter's partitions of the sub-group flat tensor ``flat`` to its full shape."""
    import deepspeed.comm as dist
    _, offset, numel = opt.grad_position[opt.get_param_id(param)]
    part = flat.narrow(0, offset, numel).detach().float().contiguous()
    group = opt._get_sub_group_process_group(sub_group_id)
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, part, group=group)
    return torch.cat(parts)[:param.ds_numel].view(param.ds_shape).numpy().copy()


class Recorder:
    """Hooks on a ZeRO-3 optimizer that record every Muon matrix at every optimizer step.

    Attributes:
        steps: one dict per optimizer step: ``skipped`` (no update: overflow), ``loss_scale``
            (the scale in force during the step's backward passes, read before ``step()`` may
            grow or shrink it),
            ``norm`` (``get_global_grad_norm()``), ``norm_from_gradients`` (the norm of every
            parameter's accumulated gradient over the loss scale), and per Muon parameter name
            ``accumulated``
            (before unscaling), ``entered`` (what the Muon update received), ``momentum`` (after)
            and ``master`` (fp32 weights after the step); all numpy fp32 of the full shape.
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
        unscale, apply = opt.unscale_and_clip_grads, opt.muon_boundary.apply

        def unscale_and_clip_grads(sub_group_id, total_norm, *args):
            grad = opt.fp32_partitioned_groups_flat[sub_group_id].grad
            self.current["local_sq"] = self.current.get("local_sq", 0.0) + float(grad.double().square().sum())
            if sub_group_id in self.muon:
                self.current["loss_scale"] = self.current["backward_loss_scale"]
                for name, p in self.muon[sub_group_id]:
                    self.current.setdefault(name, {})["accumulated"] = _full(opt, sub_group_id, grad, p)
            return unscale(sub_group_id, total_norm, *args)

        def muon_apply(sub_group_id):
            grad = opt.fp32_partitioned_groups_flat[sub_group_id].grad
            for name, p in self.muon.get(sub_group_id, ()):
                self.current[name]["entered"] = _full(opt, sub_group_id, grad, p)
            apply(sub_group_id)

        opt.unscale_and_clip_grads = unscale_and_clip_grads
        opt.muon_boundary.apply = muon_apply

    def _master(self):
        return {
            name: _full(self.opt, i, self.opt.fp32_partitioned_groups_flat[i], p)
            for i, params in self.muon.items() for name, p in params
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
            # The raw norm of all parameters' accumulated gradients, from the partitions.
            total = torch.tensor([step.pop("local_sq")], dtype=torch.float64)
            dist.all_reduce(total, group=self.opt.dp_process_group)
            step["norm_from_gradients"] = float(total.sqrt()) / step["loss_scale"]
        for name, master in self._master().items():
            step.setdefault(name, {})["master"] = master
        for name, momentum in self._momentum().items():
            step[name]["momentum"] = momentum
        self.steps.append(step)


def replay(records, names, hyper, clip=0.0):
    """What clip_grad_norm_ + upstream ``muon_update`` give on the recorded accumulated gradients.

    Args:
        records: ``Recorder.steps`` and ``Recorder.initial_master`` as ``(steps, initial)``.
        names: the Muon parameter names to replay.
        hyper: ``muon_lr``, ``momentum``, ``weight_decay`` (one Muon group).
        clip: ``gradient_clipping`` (0: off).

    Returns:
        list (per step) of dicts name -> ``(expected, recorded)`` for ``entered``, ``momentum``
        and ``master``; a skipped step expects momentum and master unchanged.
    """
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    steps, initial = records
    momenta = {n: torch.zeros_like(torch.from_numpy(initial[n])) for n in names}
    masters = {n: torch.from_numpy(initial[n]).clone() for n in names}
    out = []
    for step in steps:
        got = {}
        if step["skipped"]:
            for n in names:
                got[n] = dict(momentum=(momenta[n].numpy().copy(), step[n]["momentum"]),
                              master=(masters[n].numpy().copy(), step[n]["master"]))
            out.append(got)
            continue
        raw = {n: torch.from_numpy(step[n]["accumulated"]) / step["loss_scale"] for n in names}
        coef = 1.0
        if clip > 0:
            coef = min(1.0, clip / (step["norm"] + 1e-6))
        for n in names:
            grad = raw[n] * coef
            entered = grad.clone()
            update = muon_update(grad, momenta[n], beta=hyper["momentum"])
            # As MuonWithAuxAdam applies it to the flat partition.
            masters[n].mul_(1 - hyper["muon_lr"] * hyper["weight_decay"])
            masters[n].add_(update.reshape(masters[n].shape), alpha=-hyper["muon_lr"])
            got[n] = dict(entered=(entered.numpy(), step[n]["entered"]),
                          momentum=(momenta[n].numpy().copy(), step[n]["momentum"]),
                          master=(masters[n].numpy().copy(), step[n]["master"]))
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
