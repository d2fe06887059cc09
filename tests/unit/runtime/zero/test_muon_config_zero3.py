# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Configurations ZeRO-3 with Muon cannot serve fail at ``deepspeed.initialize``, naming the key.

Each would otherwise train wrongly or fail later: ZenFlow's selective step skips the boundary update; autocast's fp16
GradScaler unscales after Muon fed the momentum; quantized gradients fail at the first backward without the quantizer
op (CPU); NVMe offload fails opaquely without async I/O. ``mics_shard_size`` is refused by upstream itself.
"""

import os
from unittest import mock

import pytest

from unit.common import DistributedTest
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun, initialize_error

OURS = "ValueError: ZeRO-3 with the Muon optimizer cannot run"
RUN = Zero3MuonRun(gas=1, steps=0)
CASES = {
    "mics": (RUN.with_(zero=(("mics_shard_size", 2), )), "zero_optimization.mics_shard_size"),
    "zenflow": (RUN.with_(offload="cpu", zero=(("zenflow", dict(topk_ratio=0.1)), )), "zero_optimization.zenflow"),
    "quantized_gradients":
    (RUN.with_(zero=(("zero_quantized_gradients", True), )), "zero_optimization.zero_quantized_gradients"),
    "torch_autocast_fp16":
    (RUN.with_(extra=(("torch_autocast", dict(enabled=True, dtype="torch.float16")), )), "torch_autocast"),
}


class TestZero3MuonErrors(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.core
    @pytest.mark.parametrize("name", list(CASES))
    def test_refused_at_initialize_naming_the_key(self, name):
        """The error names the offending key, and no other case's key."""
        from deepspeed.runtime import torch_autocast
        run, key = CASES[name]
        # torch_autocast sets process-wide module globals: patch.multiple restores them for later tests. The quantized
        # all-to-all runs only across nodes, so the ranks pose as W one-device nodes (LOCAL_SIZE: device_count()).
        saved = {k: getattr(torch_autocast, k) for k in ("TORCH_AUTOCAST_INITIALIZED", "TORCH_AUTOCAST_DTYPE")}
        env = {"LOCAL_SIZE": "1"} if name == "quantized_gradients" else {}
        with mock.patch.multiple(torch_autocast, **saved), mock.patch.dict(os.environ, env):
            message = initialize_error(run)
        assert message is not None and key in message, message
        prefix = "DeepSpeedConfigError: MiCS ZeRO-3 sharding has been removed" if name == "mics" else OURS
        assert message.startswith(prefix), message
        others = [k for n, (_, k) in CASES.items() if n != name]
        assert not any(other in message for other in others), message

    @pytest.mark.world_size(1)
    def test_nvme_offload_without_async_io_is_refused(self, tmp_path):
        from deepspeed.runtime.zero.muon import support
        with mock.patch.object(support, "async_io_available", lambda: False):
            message = initialize_error(RUN.with_(offload="nvme"), nvme_dir=tmp_path)
        assert message is not None and "zero_optimization.offload_optimizer.device 'nvme'" in message
        assert "libaio" in message


@pytest.mark.parametrize("dtype,key", [("bfloat16", "bf16.bf16_master_weights_and_grads"),
                                       ("float16", "fp16.fp16_master_weights_and_grads")])
def test_half_precision_master_weights_are_refused(dtype, key):
    """With bf16/fp16 master weights the gradient partitions Muon reads are not fp32."""
    import types

    import torch
    from deepspeed.runtime.zero.muon.support import refuse_unsupported_zero3
    optimizer = types.SimpleNamespace(use_muon=True, master_weights_and_grads_dtype=getattr(torch, dtype))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        refuse_unsupported_zero3(optimizer)
    refuse_unsupported_zero3(types.SimpleNamespace(use_muon=True, master_weights_and_grads_dtype=torch.float32))
    refuse_unsupported_zero3(
        types.SimpleNamespace(use_muon=False, master_weights_and_grads_dtype=getattr(torch, dtype)))
