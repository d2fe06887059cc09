# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""No committed file names an absolute path of the machine it was made on.

Captured outputs are the usual way in (a benchmark run with ``--out`` in a temporary folder prints where
it wrote);
such a path means nothing on another machine. Every file git tracks is read as text (binary files
are skipped) and searched for a path under a machine's own top-level folders. Needs a git checkout
(CI's clean clone is one).
"""

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
MACHINE_PATH = re.compile(r"(?<![\w.~$}/-])/(?:tmp|root|home|work|check|opt|mnt|Users|var/folders)/[\w.+-]")


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to list")
    return [REPO_ROOT / name for name in out.decode().split("\0") if name]


def machine_paths(text):
    """``(line number, line)`` of each line of ``text`` that holds a machine's absolute path."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]


def test_the_pattern_finds_machine_paths_and_only_those():
    # written in pieces, so that this file holds no such path itself
    wrote = "wrote " + "/tmp" + "/benchmem/out/ratio_vs_w.png"
    assert machine_paths(wrote) == [(1, wrote)]
    assert machine_paths("venv at " + "/work" + "/main/.venv/stock-0.19.8/bin/python")
    assert machine_paths("see " + "/root" + "/.cache/zero3muon")
    for fine in ("wrote <out>/ratio_vs_w.png", "out/bench-memory/results.json", "${TMPDIR:-/tmp}",
                 "~/.cache/zero3muon", "https://example.org/home/page", "deepspeed/runtime/zero/muon/"):
        assert machine_paths(fine) == [], fine


def test_no_committed_file_names_a_machine_path():
    found = []
    for path in tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a picture or other binary file
        found += [f"{path.relative_to(REPO_ROOT)}:{n}: {line}" for n, line in machine_paths(text)]
    assert not found, "absolute paths of a machine in committed files:\n" + "\n".join(found)
