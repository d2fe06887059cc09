# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3's coalesced parameter all-gather returns only once every parameter is gathered.

``Init._allgather_params_coalesced`` (``partition_parameters.py``, reached by
``param.all_gather(param_list=...)`` with more than one parameter of a group, e.g. the persistent
parameters after every step) launches one asynchronous all-gather per parameter. DeepSpeed 0.19.7
waited on the last handle only; on gloo the handles complete independently, and the CPU
accelerator's ``synchronize()`` does nothing, so a parameter could be read while its all-gather
was still writing the freshly allocated (uninitialized) buffer. 0.19.8 waits on every handle; on
0.19.7 the build carries that fix as ``patches/0.19.7/0005-zero3-allgather-coalesced-wait-every-handle.patch``.

The test gathers four Linear(1024, 1024) layers' parameters together 60 times at W=2 and compares
every gathered parameter with the same partitions gathered by one plain blocking ``all_gather``.
Each round first writes new random values into every rank's partitions, so a buffer that still
holds a previous round's (or any stale) data is caught too. The failure it looks for is a race, so
it is probabilistic: on stock 0.19.7 (gloo, 2 CPU cores shared with other work) two runs found 15
and 14 of the 60 coalesced all-gathers returning a parameter early, so a run that misses it is
very unlikely (0.75^60 < 1e-7 if rounds were independent); on 0.19.8 and on the patched 0.19.7,
none.
"""

import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest

# Linear(1024, 1024): each weight's all-gather (2 MiB per rank) is launched just before its bias's (2 KiB),
# so the last handle, a bias, is likely to complete while the last weight is still being gathered.
NUM_LAYERS = 4
ROUNDS = 60


def _blocking_full(params):
    """Every parameter's full tensor from the partitions on every rank, by one blocking ``all_gather``."""
    group = params[0].ds_process_group
    local = torch.cat([param.ds_tensor for param in params])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, local, group=group)
    full, offset = [], 0
    for param in params:
        numel = param.ds_tensor.numel()
        gathered = torch.cat([part.narrow(0, offset, numel) for part in parts])
        full.append(gathered.narrow(0, 0, param.ds_numel).view(param.ds_shape))
        offset += numel
    return full


class TestAllgatherCoalescedWait(DistributedTest):
    world_size = 2

    def test_every_gathered_parameter_is_complete(self):
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):
            model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(NUM_LAYERS)])
        params = list(model.parameters())
        generator = torch.Generator().manual_seed(1234 + dist.get_rank())

        wrong_gathers = wrong_params = 0
        for _ in range(ROUNDS):
            with torch.no_grad():
                for param in params:
                    param.ds_tensor.copy_(torch.randn(param.ds_tensor.shape, generator=generator))
            expected = _blocking_full(params)
            params[0].all_gather(param_list=params)  # the coalesced path: one group, several parameters
            # Last launched first: by the time the first parameters are compared, the race is usually over.
            wrong = sum(not torch.equal(param.data, full) for param, full in reversed(list(zip(params, expected))))
            wrong_gathers += wrong > 0
            wrong_params += wrong
            params[0].partition(param_list=params)

        assert wrong_gathers == 0, (
            f"rank {dist.get_rank()}: {wrong_gathers} of {ROUNDS} coalesced all-gathers returned "
            f"{wrong_params} parameters before their all-gather completed")
