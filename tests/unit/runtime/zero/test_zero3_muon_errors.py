# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Configurations ZeRO-3 with Muon cannot serve fail at ``deepspeed.initialize``, naming the key.

Each of these would otherwise train wrongly or fail later: ZenFlow's selective step skips the
Muon boundary update; torch autocast's fp16 GradScaler unscales gradients after Muon has fed them
to the momentum; quantized gradients fail at the first backward on an accelerator without the
quantizer op (the CPU here); NVMe offload fails deep in its setup with an opaque message when the
async I/O op cannot be built. MiCS (``mics_shard_size``) is gone from both bases: upstream
refuses the key itself, which is checked here too.
"""

import functools
import tempfile

import pytest

from zero3_muon_harness import run_distributed
from zero3_muon_workers import initialize_errors

OURS = "ValueError: ZeRO-3 with the Muon optimizer cannot run"
CASES = {
    "mics": (dict(zero_extra={"mics_shard_size": 2}), "zero_optimization.mics_shard_size"),
    "zenflow": (dict(zero_extra={"offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}),
                "zero_optimization.zenflow"),
    "quantized_gradients": (dict(zero_extra={"zero_quantized_gradients": True}),
                            "zero_optimization.zero_quantized_gradients"),
    # Last: torch autocast is process-wide state once an engine has turned it on.
    "torch_autocast_fp16": (dict(ds_extra={"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}),
                            "torch_autocast"),
}


@functools.lru_cache(maxsize=None)
def messages():
    names = list(CASES)
    return dict(zip(names, run_distributed(initialize_errors, 2, [CASES[n][0] for n in names])[0]))


@pytest.mark.parametrize("name", list(CASES))
def test_refused_at_initialize_naming_the_key(name):
    message = messages()[name]
    assert message is not None and CASES[name][1] in message
    prefix = "DeepSpeedConfigError: MiCS ZeRO-3 sharding has been removed" if name == "mics" else OURS
    assert message.startswith(prefix)


def test_only_the_offending_key_is_named():
    assert "torch_autocast" not in messages()["zenflow"] and "zenflow" not in messages()["quantized_gradients"]


def test_nvme_offload_without_async_io_is_refused():
    nvme = dict(zero_extra={"offload_optimizer": {"device": "nvme", "nvme_path": tempfile.gettempdir()}})
    message = run_distributed(initialize_errors, 1, [nvme], pretend_no_async_io=True)[0][0]
    assert message is not None and "zero_optimization.offload_optimizer.device 'nvme'" in message
    assert "libaio" in message
