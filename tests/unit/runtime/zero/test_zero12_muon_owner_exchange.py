# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 Muon on the owner core: Newton-Schulz once per matrix over all ranks; only straddling matrices travel.

ZeRO-1/2 cut a group's flat buffer into W consecutive runs, so most matrices lie whole in one partition. MixedMLP's
Muon group (33x21, 17x33, 7x17: 1373 elements) splits into runs of 688 at W=2 (the first matrix straddles) and 458 at
W=3 (the first two straddle). With and without offload, per step:

- NS calls over all ranks equal the number of Muon matrices (one owner among each matrix's holders);
- Muon elements received over all ranks are at most twice the straddling ones'; no all-to-all carries a whole matrix;
- the momentum is one fp32 tensor of the partition's size, like Adam's ``exp_avg``.
"""

import pytest
import torch

from unit.common import DistributedTest
from muon_testing.compare import FLOOR, relative_difference
from unit.runtime.zero.zero3_muon_helpers import Zero3MuonRun

STRADDLING = {2: 1, 3: 2}
"""MixedMLP's Muon matrices crossing a partition boundary, by W."""
STEPS = 3
RUN = Zero3MuonRun(model="mixed", steps=STEPS, samples=24, gas=2)


@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (2, "cpu")])
class TestZero12OwnerExchange(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [2, 3])
    def test_ns_once_per_matrix_and_straddling_traffic(self, stage, offload, world_size):
        from deepspeed import comm as dist
        run = RUN.with_(stage=stage, offload=offload)
        engine = run.build_engine(run.config(world_size))
        update = engine.optimizer.muon_update
        (partition, ) = update.partitions.values()
        rank = dist.get_rank()
        straddling = [j for j, pieces in enumerate(partition.pieces) if sum(1 for n in pieces if n) > 1]
        straddling_numel = sum(torch.Size(partition.shapes[j]).numel() for j in straddling)
        assert len(straddling) == STRADDLING[world_size]
        momentum = update.momentum(partition.key, partition.flat.device)
        assert momentum.dtype == torch.float32 and momentum.numel() == partition.numel == partition.flat.numel()
        engine.destroy()

        result = run.train()
        ns_calls = sum(r.stats["ns_calls"] for r in result.per_rank)
        received = sum(r.stats["elements_received"] for r in result.per_rank)
        assert all(r.stats["optimizer_steps"] == STEPS for r in result.per_rank)
        if rank == 0:
            print(f"MEASURED ZeRO-{stage} offload={offload} W={world_size}: {ns_calls / STEPS:.0f} NS calls and "
                  f"{received / STEPS:.0f} elements received per step summed over ranks, {len(straddling)} "
                  f"straddling matrices of {straddling_numel} elements")
        assert ns_calls == 3 * STEPS
        assert 0 < received <= 2 * straddling_numel * STEPS
        assert relative_difference(run.reference()[0], result.weights) <= FLOOR
