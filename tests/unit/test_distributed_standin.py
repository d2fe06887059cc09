# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The local stand-in of DeepSpeed's DistributedTest (``tests/unit/common.py``): values reach the
ranks, a skip in the ranks skips, a failure reports every failing rank. Not exported."""

import os
import pickle

import pytest
import torch.distributed as dist

from unit.common import DistributedTest


@pytest.fixture(scope="module")
def parent_pid():
    """Computed once, in the pytest process."""
    return os.getpid()


def _gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _fail_differently():
    raise ValueError(f"rank {dist.get_rank()} failed")


def _rank0_fails_rank1_waits():
    if dist.get_rank() == 0:
        raise ValueError("only rank 0 failed")
    dist.barrier()


def _skip_everywhere():
    pytest.skip("nothing to do here")


class TestDistributedStandIn(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("value", [7])
    def test_values_reach_every_rank(self, value, parent_pid, class_tmpdir):
        assert dist.get_world_size() == 2 and int(os.environ["WORLD_SIZE"]) == 2
        assert _gathered(dist.get_rank()) == [0, 1]
        assert os.getpid() != parent_pid
        assert _gathered((value, parent_pid, str(class_tmpdir))) == [(value, parent_pid, str(class_tmpdir))] * 2

    @pytest.mark.world_size(1)
    def test_world_size_mark(self):
        assert dist.get_world_size() == 1


def test_skip_in_the_ranks_skips():
    with pytest.raises(pytest.skip.Exception, match="nothing to do here"):
        TestDistributedStandIn()._launch(2, pickle.dumps((_skip_everywhere, {})))


def test_failure_reports_every_failing_rank():
    with pytest.raises(pytest.fail.Exception) as failure:
        TestDistributedStandIn()._launch(2, pickle.dumps((_fail_differently, {})))
    assert "2 of 2 ranks failed" in str(failure.value)
    assert "ValueError: rank 0 failed" in str(failure.value) and "ValueError: rank 1 failed" in str(failure.value)
    with pytest.raises(pytest.fail.Exception) as failure:
        TestDistributedStandIn()._launch(2, pickle.dumps((_rank0_fails_rank1_waits, {})))
    assert "ValueError: only rank 0 failed" in str(failure.value)
    assert "rank 1: no answer (waiting for a failed rank?)" in str(failure.value)
