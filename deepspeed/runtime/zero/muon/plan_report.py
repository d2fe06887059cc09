# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon plan``: the owner plan Muon's step will run, before launching.

From a Hugging Face ``config.json`` the model is built on the meta device (no weights, no GPU, no process group);
its parameters are chosen as ``deepspeed.initialize`` chooses them (``param_selection``: embeddings and heads to
Adam, recognized fused projections split), kept in the optimizer's order (upstream ``MuonWithAuxAdam`` sorts a
group by ``size()``, descending) and cut into the partitions the ZeRO stage makes: ZeRO-3's sub-groups (a rank's
partition elements up to ``sub_group_size``, every rank holding ``ceil(numel / W)`` of each matrix), ZeRO-1/2's
flat buffer cut in W. Each partition is planned by ``owner_plan.plan_partition`` with the NS cost carried over, as
``binding.MuonUpdate`` plans it, and the figures are ``owner_plan.plan_figures``: the ones rank 0 logs at
``deepspeed.initialize``.

Assumptions, where the DeepSpeed config does not say: ZeRO-3, one Muon parameter group, the default Muon keys, and
Newton-Schulz in the dtype it runs in on a GPU (``original_muon.ns_compute_dtype``: fp16 for "gram", bf16 for the
others; ``--ns-dtype fp32`` for a CPU). ZeRO-1/2's flat buffer is taken without DeepSpeed's alignment padding
(a few elements per rank).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from deepspeed.runtime.zero.muon.owner_plan import (DEFAULT_MAX_STEP_MEMORY, DEFAULT_REDUCE_BUCKET_SIZE,
                                                    DEFAULT_SUB_GROUP_SIZE, STRICT, CapBelowFloor, plan_figures,
                                                    plan_partitions)

NS_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}


def model_on_meta(config_path: Path):
    """The causal LM (else the base model) a Hugging Face ``config.json`` (a file, or a folder holding one)
    describes, built on the meta device.

    Raises:
        FileNotFoundError: no such file. ValueError: transformers does not know its ``model_type``.
    """
    import torch
    import transformers
    config_path = Path(config_path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--config: {config_path} does not exist (a Hugging Face config.json is expected)")
    settings = json.loads(config_path.read_text())
    if "model_type" not in settings:
        raise ValueError(f"--config: {config_path} has no model_type; a Hugging Face config.json names its model")
    config = transformers.AutoConfig.for_model(**settings)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            return transformers.AutoModel.from_config(config)


def muon_specs(model, ns_method: str, split_fused: bool = True) -> list:
    """``(name, MatrixSpec)`` of every Muon matrix of ``model`` in the optimizer's order, chosen as
    ``deepspeed.initialize`` chooses them (``select_muon_parameters``, ``tag_fused_projections``)."""
    from deepspeed.runtime.zero.muon.newton_schulz import SPLIT_KEY, matrix_spec, split_of
    from deepspeed.runtime.zero.muon.param_selection import select_muon_parameters, tag_fused_projections
    select_muon_parameters(model)
    tag_fused_projections(model)
    chosen = [(n, p) for n, p in model.named_parameters() if p.requires_grad and getattr(p, "use_muon", False)]
    chosen = sorted(chosen, key=lambda np: np[1].size(), reverse=True)  # stable, as MuonWithAuxAdam
    group = {SPLIT_KEY: split_fused}
    return [(n, matrix_spec(p, tuple(p.shape), ns_method, None, split_of(p, group))) for n, p in chosen]


def _figures(partitions: list, world_size: int):
    return plan_figures([(plan, d, pieces, itemsize, state) for _, plan, d, pieces, itemsize, state, *_ in partitions],
                        world_size)


def plan_json(partitions: list, specs: Sequence, world_size: int) -> dict:
    """The ``--json`` object: ``world_size``, ``depth``, ``peak_bytes``, ``kept_bytes``, ``ns_efficiency`` (the
    ``PlanFigures``), ``buckets``: per bucket (a partition's in order, partitions one after another) one
    ``{"shape": [rows, cols], "owner": r}`` per Newton-Schulz problem."""
    figures = _figures(partitions, world_size)
    buckets = []
    for indices, plan, *_ in partitions:
        for bucket in plan.buckets:
            buckets.append([{
                "shape": [rows, cols],
                "owner": plan.owners[k]
            } for k in bucket for batch, rows, cols in specs[indices[k]].problems for _ in range(batch)])
    return dict(world_size=world_size,
                depth=figures.depth,
                peak_bytes=figures.peak_bytes,
                kept_bytes=figures.kept_bytes,
                ns_efficiency=round(figures.ns_efficiency, 4),
                buckets=buckets)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def text_report(name: str, named_specs: Sequence, partitions: list, world_size: int, stage: int,
                max_step_memory, floor: int, ns_dtype: str) -> List[str]:
    """The report's lines (``main``)."""
    specs = [s for _, s in named_specs]
    figures = _figures(partitions, world_size)
    muon = sum(s.numel for s in specs)
    cap = (f"{max_step_memory} bytes ({_gib(max_step_memory)})" if max_step_memory != STRICT else
           f"\"{STRICT}\" (within each rank's momentum partition where any plan fits, buckets of at most "
           "reduce_bucket_size)")
    lines = [
        f"Muon owner plan: {name}, {len(specs)} Muon matrices ({muon:,} elements), ZeRO stage {stage}, "
        f"W={world_size}, Newton-Schulz in {ns_dtype}, max_step_memory {cap}",
        f"  partitions: {len(partitions)} ({'sub-groups' if stage == 3 else 'flat partition of the Muon group'}); "
        f"buckets: {figures.buckets}; pipeline depth: {figures.depth}",
        f"  peak of Muon's step per rank: {figures.peak_bytes} bytes ({_gib(figures.peak_bytes)}); least any plan "
        f"needs (every matrix alone, depth 1): {floor} bytes ({_gib(floor)})",
        f"  kept between steps per rank (fp32 momentum and a variant's state): {figures.kept_bytes} bytes "
        f"({_gib(figures.kept_bytes)})",
        f"  NS parallel efficiency: {figures.ns_efficiency:.3f} (max(total / W, largest matrix) over the busiest "
        "owner's NS summed over buckets; 1: every owner computes at once)",
    ]
    for p, (indices, plan, d, *_) in enumerate(partitions):
        sizes = [len(b) for b in plan.buckets]
        owners = [len({plan.owners[k] for k in b}) for b in plan.buckets]
        lines.append(f"  partition {p}: {len(indices)} matrices, {len(plan.buckets)} bucket(s) of {min(sizes)}-"
                     f"{max(sizes)} matrices on {min(owners)}-{max(owners)} owners, depth {min(d, len(sizes))}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``plan`` command (module docstring); 0, or 2 where the cap is below the least need or an input is
    wrong (the message on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m deepspeed.runtime.zero.muon plan",
                                     description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--config", required=True, type=Path, help="the model's Hugging Face config.json")
    parser.add_argument("--world-size", required=True, type=int, help="data-parallel ranks W")
    parser.add_argument("--ds-config",
                        type=Path,
                        help="a DeepSpeed config (JSON): zero_optimization.stage, sub_group_size, "
                        "reduce_bucket_size and the Muon keys of optimizer.params are read (without it, or where it "
                        "sets no stage: ZeRO-3; the default keys)")
    parser.add_argument("--ns-dtype",
                        choices=sorted(NS_ITEMSIZE),
                        help="the dtype Newton-Schulz runs in (default: as on a GPU, fp16 for ns_method "
                        "\"gram\", bf16 otherwise; fp32 for a CPU without fp16 and bf16)")
    parser.add_argument("--json", type=Path, help="also write the plan as one JSON object to this file")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    ds = json.loads(args.ds_config.read_text()) if args.ds_config else {}
    zero = ds.get("zero_optimization", {}) or {}
    params = dict((ds.get("optimizer", {}) or {}).get("params", {}) or {})
    stage = int(zero.get("stage", 3))
    if stage not in (1, 2, 3):
        parser.error(f"zero_optimization.stage {stage}: the owner plan runs at ZeRO stages 1 to 3")
    from deepspeed.runtime.zero.muon.config import check_muon_keys
    from deepspeed.runtime.zero.muon.owner_state import variant_of
    try:
        check_muon_keys(params, None)
    except ValueError as e:
        print(f"{args.ds_config}: {e}", file=sys.stderr)
        return 2
    ns_method = params.get("ns_method", "gram")
    ns_dtype = args.ns_dtype or ("fp16" if ns_method == "gram" else "bf16")
    cap = params.get("max_step_memory")
    cap = DEFAULT_MAX_STEP_MEMORY if cap is None else (cap if cap == STRICT else int(cap))
    model = model_on_meta(args.config)
    from deepspeed.runtime.zero.muon.newton_schulz import SPLIT_KEY
    named = muon_specs(model, ns_method, params.get(SPLIT_KEY) is not False)
    specs = [s for _, s in named]
    sub_group = zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    bucket = zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_SIZE)
    sub_group = DEFAULT_SUB_GROUP_SIZE if sub_group == "auto" else int(sub_group)
    bucket = DEFAULT_REDUCE_BUCKET_SIZE if bucket == "auto" else int(bucket)
    itemsize = NS_ITEMSIZE[ns_dtype]
    variant = variant_of(params)
    try:
        partitions = plan_partitions(specs, args.world_size, stage, sub_group, bucket, cap,
                                     params.get("pipeline_depth", 2), itemsize, variant)
    except CapBelowFloor:
        # every partition's least need (the strict rule plans them all), the most of them as at initialize
        strict = plan_partitions(specs, args.world_size, stage, sub_group, bucket, STRICT,
                                 params.get("pipeline_depth", 2), itemsize, variant)
        needed = 4 * max(entry[-1] for entry in strict)
        print(f"optimizer.params.max_step_memory: {cap} bytes is below what Muon's step needs on a rank: at least "
              f"{needed} bytes ({_gib(needed)}); deepspeed.initialize would refuse it. Set max_step_memory to at "
              "least that, or to \"momentum_partition\".",
              file=sys.stderr)
        return 2
    floor = 4 * max(entry[-1] for entry in partitions)
    name = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    print("\n".join(text_report(name, named, partitions, args.world_size, stage, cap, floor, ns_dtype)))
    if args.json:
        args.json.write_text(json.dumps(plan_json(partitions, specs, args.world_size)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
