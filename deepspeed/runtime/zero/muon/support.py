# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What runs where: the configurations Muon's owner-centric update cannot serve, and why.

Kept apart from ``config`` (keys and values only) because these checks need the engine, the ZeRO optimizer or the
accelerator's op builders; every function imports what it reads when called, so this module loads no other Muon module.
"""

from typing import Optional, Sequence


def where_no_owner_runs(engine) -> Optional[str]:
    """Why ``engine``'s Muon update runs outside the owner-centric update (the config keys choosing that path, as a
    phrase for messages), or None. Stage 0 runs upstream's ``MuonWithAuxAdam.step`` on whole weights; ZeRO stage 1 with
    bf16 parameters, fp32 gradient accumulation and no optimizer offload runs DeepSpeed's ``BF16_Optimizer``, whose
    Muon is upstream's too."""
    import torch
    stage = engine.zero_optimization_stage()
    if stage == 0:
        return "zero_optimization.stage 0"
    model_dtype, grad_accum_dtype = engine.get_data_types()
    if (stage == 1 and model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32
            and not engine.zero_cpu_offload()):
        return ("zero_optimization.stage 1 with bf16 and data_types.grad_accum_dtype fp32 (DeepSpeed's "
                "BF16_Optimizer)")
    return None


def spread_problem(muon_groups: Sequence[dict], engine) -> Optional[str]:
    """Why the AutoTP-split weights of ``muon_groups`` cannot be orthogonalized whole under ``engine``'s configuration,
    naming the tensor-parallel key; None where there are none or an owner rank runs them."""
    from deepspeed.runtime.zero.muon.param_record import tensor_parallel_layout
    spread = [p for g in muon_groups for p in g["params"] if tensor_parallel_layout(p) is not None]
    where = where_no_owner_runs(engine) if spread else None
    if where is None:
        return None
    return (f"{tensor_parallel_layout(spread[0]).config_key}: Muon orthogonalizes a weight AutoTP split "
            f"({len(spread)} of them) whole only at ZeRO stages 1 to 3, and not with {where}, where each shard "
            "would be orthogonalized on its own.")


def refuse_unsupported_zero3(optimizer) -> None:
    """Refuse, before anything is allocated, the ZeRO-3 configurations the Muon boundary update cannot serve (called
    from ``DeepSpeedZeroOptimizer_Stage3.__init__``); nothing without Muon.

    Raises:
        ValueError: naming every offending config key and why: ZenFlow, torch autocast with fp16, quantized gradients
            without the quantizer op, NVMe offload without async I/O, bf16/fp16 master weights.
    """
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.torch_autocast import get_autocast_dtype, is_autocast_initialized
    if not getattr(optimizer, "use_muon", False):
        return
    problems = []
    if getattr(optimizer, "zenflow", False):
        problems.append("zero_optimization.zenflow: ZenFlow's selective, overlapped optimizer step does not run "
                        "the Muon boundary update; train Muon without zenflow.")
    if is_autocast_initialized() and get_autocast_dtype() == torch.float16:
        problems.append("torch_autocast with fp16: torch's GradScaler unscales the gradients inside the optimizer "
                        "step, after Muon has fed them to its momentum. Use DeepSpeed's fp16 section (its loss "
                        "scale is divided out before Muon) or bf16.")
    if getattr(optimizer, "all2all_process_group", None) is not None and quantized_reduce_unavailable():
        problems.append("zero_optimization.zero_quantized_gradients: its all-to-all reduction needs DeepSpeed's "
                        f"quantizer op, which the {get_accelerator().device_name()} accelerator does not provide; "
                        "training would fail at the first backward. Turn zero_quantized_gradients off here.")
    if getattr(optimizer, "swap_optimizer", False) and not async_io_available():
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


def async_io_available() -> bool:
    """Whether the accelerator's async I/O op (NVMe offload) can be built here."""
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


def quantized_reduce_unavailable() -> bool:
    """Whether ZeRO-3's quantized all-to-all gradient reduction would run and fail here: stage 3 takes it only across
    nodes (``world_size / device_count() > 1``, as ``__avg_scatter_grads``), loading the ``QuantizerBuilder``."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if dist.get_world_size() // max(1, accelerator.device_count()) <= 1:
        return False
    builder = accelerator.create_op_builder("QuantizerBuilder")
    if builder is None or getattr(builder, "NAME", "") == "deepspeed_not_implemented":
        return True
    return not builder.is_compatible(verbose=False)
