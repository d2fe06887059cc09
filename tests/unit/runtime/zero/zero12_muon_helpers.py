# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 Muon test helpers: a checkpoint of this build rewritten into the older layout."""

import glob
import os

import numpy as np
import torch


def to_older_zero12_layout(checkpoint_dir, tag, shapes, world_size, offload, owners=None):
    """Rewrite a ZeRO-1/2 checkpoint of this build (one process, every rank's file) into the layout of stock DeepSpeed
    and older builds (no ``muon_state_layout``).

    Without offload the momentum becomes the whole momentum of every matrix the partition touches, in order; a
    variant's state becomes those matrices' rows, or with offload the rows of the matrices the rank owns (``owners``:
    owner rank per matrix) with indices under ``<key>_matrices``. The flat buffer is ``shapes`` back to back, no
    padding, cut into equal partitions.
    """
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT
    from deepspeed.runtime.zero.muon.owner_state import state_keys
    paths = [
        glob.glob(os.path.join(checkpoint_dir, tag, f"*zero_pp_rank_{r}_*optim_states.pt"))[0]
        for r in range(world_size)
    ]
    saved = [torch.load(p, map_location="cpu", weights_only=False) for p in paths]
    states = [s[OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE]["state"] for s in saved]
    (group, ) = [g for g, st in states[0].items() if "momentum_buffer" in st]
    numels = [int(np.prod(shape)) for shape in shapes]
    starts = np.cumsum([0] + numels[:-1]).tolist()
    size = states[0][group]["momentum_buffer"].numel()

    def piece(r, j):
        lo, hi = max(starts[j], r * size), min(starts[j] + numels[j], (r + 1) * size)
        return (lo - r * size, hi - lo) if hi > lo else None

    def whole(key, j):
        return torch.cat([states[r][group][key].narrow(0, *piece(r, j)) for r in range(world_size) if piece(r, j)])

    momentum = [whole("momentum_buffer", j) for j in range(len(shapes))]
    keys = [k for k in state_keys() if k in states[0][group]]
    rows = {k: [whole(k, j).view(shapes[j][0], -1)[:, 0].clone() for j in range(len(shapes))] for k in keys}
    for r, (path, sd, state) in enumerate(zip(paths, saved, states)):
        held = [j for j in range(len(shapes)) if piece(r, j)]
        if not offload:
            state[group]["momentum_buffer"] = torch.cat([momentum[j] for j in held])
        for k in keys:
            listed = [j for j in range(len(shapes)) if owners[j] == r] if offload else held
            state[group][k] = torch.cat([rows[k][j] for j in listed]) if listed else torch.zeros(0)
            if offload:
                state[group][k + "_matrices"] = torch.tensor(listed, dtype=torch.float32)
        del sd[OPTIMIZER_STATE_DICT]["muon_state_layout"]
        torch.save(sd, path)
