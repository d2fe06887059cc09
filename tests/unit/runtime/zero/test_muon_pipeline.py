# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The distributed Muon core (``pipeline.MuonPipeline``), W threads, on ZeRO-3 pieces (``ceil(numel / W)``, zero
padded) or ZeRO-1/2's (the flat buffer cut in W): each rank's pieces must be those of upstream ``muon_update`` of the
whole matrix, update and momentum, bit for bit, at depths 1 to 3, on the CPU and the accelerator.
"""

import pytest

from deepspeed.accelerator import get_accelerator
from muon_testing.threaded_exchange import LAYOUTS, device_check, mismatches, run_pipelines


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("bucket_numel", [1, 100, 10**9], ids=["one-per-bucket", "buckets", "one-bucket"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_gets_its_pieces_of_upstreams_update(layout, world_size, bucket_numel, depth):
    run = run_pipelines(LAYOUTS[layout], world_size, bucket_numel, depth)
    assert not mismatches(run)


def test_the_exchange_on_the_accelerator_up_to_eight_ranks():
    """``device_check`` on this device: W = 2..8, both layouts, depths 1, 2, three bucket sizes (one each on the
    CPU). Bit for bit on the CPU; elsewhere views at other offsets may pick other kernels, so the bound is one ulp of
    the NS compute dtype relative to the largest element."""
    import torch
    device = get_accelerator().current_device_name()
    cpu = torch.device(device).type == "cpu"
    rows = device_check(device, depths=(2, ) if cpu else (1, 2), bucket_numels=(300, ) if cpu else (1, 300, 10**9))
    assert {r["world_size"] for r in rows} == set(range(2, 9)) and all(r["exchanges"] for r in rows)
    if cpu:
        assert all(r["bit_equal"] for r in rows), [r for r in rows if not r["bit_equal"]]
    else:
        worst = max(rows, key=lambda r: r["max_relative_difference"])
        assert worst["max_relative_difference"] <= torch.finfo(getattr(torch, worst["ns_dtype"])).eps, worst
