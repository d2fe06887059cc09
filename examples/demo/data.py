"""Training text for the demo: the Python standard library's own source, as bytes.

Nothing is downloaded. The corpus is every ``.py`` file under ``sysconfig``'s ``stdlib`` path
(test suites and installed packages left out), in sorted path order, concatenated as raw bytes.
A token is a byte, so the vocabulary is 256 and there is no tokenizer.

Batches are fixed by ``(seed, step)`` alone: the same global batch of windows comes out of
every run, whatever the world size or gradient-accumulation split, and each run only decides
how to cut it into per-rank micro-batches (``micro_batch``).
"""
import pathlib
import sysconfig

import torch

VOCAB_SIZE = 256  # byte-level tokens
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_sources():
    """Sorted list of ``pathlib.Path`` to the standard library's ``.py`` files (no tests)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1]))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes=None):
    """The corpus as a 1-D ``torch.uint8`` tensor of byte tokens (files joined by a blank line).

    ``max_bytes`` (int or None) truncates it, keeping files in sorted order.
    """
    chunks, total = [], 0
    for path in stdlib_sources():
        data = path.read_bytes() + b"\n\n"
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if not blob:
        raise RuntimeError(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def global_batch(corpus, step, batch_size, seq_len, seed):
    """The windows of optimizer step ``step``: ``torch.int64`` tensor ``[batch_size, seq_len]``.

    Window starts are drawn uniformly from a generator seeded by ``(seed, step)``, so the batch
    of a step does not depend on anything a run is configured with besides these arguments.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len, (batch_size, ), generator=gen)
    return torch.stack([corpus[s:s + seq_len] for s in starts.tolist()]).long()


def micro_batch(batch, rank, world_size, gas, micro):
    """Rank ``rank``'s ``micro``-th micro-batch out of a global ``batch`` ``[B, T]``.

    The global batch is split evenly over ranks, then each rank's share over its ``gas``
    micro-batches: result ``[B // (world_size * gas), T]``, same dtype as ``batch``.
    """
    per_rank = batch.shape[0] // world_size
    per_micro = per_rank // gas
    if per_micro * gas * world_size != batch.shape[0]:
        raise ValueError(f"global batch {batch.shape[0]} does not split into {world_size} ranks x {gas} micro-batches")
    start = rank * per_rank + micro * per_micro
    return batch[start:start + per_micro]
