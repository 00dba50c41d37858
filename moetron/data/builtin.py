"""Built-in training data: the running interpreter's own standard library, byte-tokenized.

Real text that exists on every machine, so the default recipe needs no download.
A micro-batch is a pure function of (seed, step, its index in the global batch), which
makes sampling deterministic, resumable from any step, and independent of the layout:
data-parallel rank r of D takes global micro-batches r, r+D, r+2D, ..., so one process
accumulating all of them sees exactly the same data.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

BYTE_VOCAB = 256


def stdlib_corpus(max_bytes: int = 8 * 1024 * 1024, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Bytes of the standard library's .py files (sorted paths, capped), as int64 tokens (or `dtype`:
    the trainer keeps uint8, 8 MB instead of 64, and TokenBatches makes each batch int64)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted_sources(root):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data) + 1
        if total >= max_bytes:
            break
    if total < 1024:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}; pass a data file instead")
    blob = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dtype)


def sorted_sources(folder: Path) -> Iterator[Path]:
    """`sorted(folder.rglob("*.py"))`, lazily: the default corpus stops after a few hundred of the
    stdlib's ~13k files, and listing and sorting them all took most of a second at every start.

    Paths sort by their parts, so a depth-first walk taking each folder's entries in name order
    yields the same sequence; like rglob it does not descend into symlinked folders, and it skips
    site-packages and dist-packages, which the corpus leaves out anyway.
    """
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.endswith(".py"):
            yield Path(entry.path)
        try:
            walk = entry.is_dir() and not entry.is_symlink()
        except OSError:
            walk = False
        if walk and entry.name not in ("site-packages", "dist-packages"):
            yield from sorted_sources(Path(entry.path))


class TokenBatches:
    """Random windows of a token stream: inputs and their next-token labels."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"data has {tokens.numel()} tokens, fewer than seq_len+1={seq_len + 1}")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed

    def batch(self, step: int, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Global micro-batch `index` of `step`: `(input_ids, labels)`, labels shifted by one."""
        gen = torch.Generator().manual_seed(hash((self.seed, step, index)) % (2**63))
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=gen)
        windows = torch.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()]).to(torch.int64)
        return windows[:, :-1], windows[:, 1:]
