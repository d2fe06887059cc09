# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Runs a training script in this process with Newton-Schulz computing in fp32 on the CPU accelerator.

    torchrun --nproc_per_node 2 tests/examples/ns_fp32_launch.py SCRIPT [ARGS...]
    accelerate launch ... tests/examples/ns_fp32_launch.py SCRIPT [ARGS...]

Each rank enters ``fp32_newton_schulz()`` (``muon_testing.reference``: the
CPU accelerator reports no fp16, so upstream's ``ns_compute_dtype`` picks fp32 for the "gram"
kernel), prints one line naming the dtype Newton-Schulz computes in and the one upstream would
pick on this CPU, then runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` (``runpy``).
The tests use it to keep an ordinary example script unchanged while comparing its runs against
the fp32 floor on CPUs whose oneDNN has fp16 (AVX512-FP16 or AMX), where upstream would run the
kernel in fp16. Other accelerators are left alone.
"""

import os
import runpy
import sys

from muon_testing.reference import fp32_newton_schulz

PREFIX = "[ns_fp32_launch]"


def gram_ns_dtype():
    """The dtype upstream's "gram" Newton-Schulz kernel would compute in now, e.g. ``"float32"``
    (``ns_compute_dtype`` on 0.19.8; 0.19.7 has the same rule inline in the kernel)."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon
    rule = getattr(original_muon, "ns_compute_dtype", None)
    if rule is not None:
        dtype = rule("gram")
    else:
        from deepspeed.accelerator import get_accelerator
        dtype = torch.float16 if get_accelerator().is_fp16_supported() else torch.float32
    return str(dtype).replace("torch.", "")


def main():
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [ARGS...]")
    script, args = sys.argv[1], sys.argv[2:]
    upstream = gram_ns_dtype()
    with fp32_newton_schulz():
        if os.environ.get("RANK", "0") == "0":
            print(f"{PREFIX} Newton-Schulz (gram) computes in {gram_ns_dtype()} (upstream on this machine: "
                  f"{upstream})", flush=True)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
