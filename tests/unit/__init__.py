# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Unit tests; ``tests/`` is on sys.path, so this package is importable as ``unit``, as in DeepSpeed."""
