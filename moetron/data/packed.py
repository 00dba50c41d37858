"""Training batches from a prepared folder: memory-mapped tokens, packed sequences, resumable sampling.

Design notes: docs/data.md (`moetron/data/packed.py`).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import warnings
from pathlib import Path

import torch

from moetron.data.prepare import FORMAT, FORMAT_VERSION, META_FILE

IGNORE_INDEX = -100  # moetron.model.model.IGNORE_INDEX
_DTYPES = {"uint16": (torch.uint16, 2), "uint32": (torch.uint32, 4)}
_M64 = (1 << 64) - 1
_ROUNDS = 6


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fixed, platform-independent 64-bit mixing function."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A keyed pseudo-random bijection of [0, n): balanced Feistel network on the next even
    power of two at or above n, walking the cycle until the value falls inside [0, n)."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        self.round_keys = [_mix64((key & _M64) ^ _mix64(r)) for r in range(_ROUNDS)]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        half, mask, x = self.half, self.mask, i
        while True:
            left, right = x >> half, x & mask
            for k in self.round_keys:
                left, right = right, left ^ (_mix64(k ^ right) & mask)
            x = (left << half) | right
            if x < self.n:
                return x


def _map(path: Path, dtype: torch.dtype, itemsize: int, count: int) -> torch.Tensor:
    """`count` items of `path` as a tensor over a read-only memory map (never write to it).

    Read-only and shared, not copy-on-write: a private writable map of a file larger than RAM
    is refused by the kernel's overcommit accounting, and a read-only one costs nothing.
    """
    with open(path, "rb") as f:  # the map outlives the file descriptor
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # "the given buffer is not writable": we only ever read it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=dtype, count=count)


class PreparedCorpus:
    """A folder written by `moetron data prepare`, memory-mapped: `tokens`, `offsets`, `meta`.

    `tokens` and `offsets` are tensors over read-only maps: read them (slices, `.to()`), never
    write into them.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"data folder {str(self.path)!r} does not exist; make one with "
                                    "`moetron data prepare INPUT... --tokenizer tokenizer.json --output FOLDER`")
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise ValueError(f"{self.path} has no {META_FILE}: it is not a prepared-data folder, or its "
                             "preparation did not finish; run `moetron data prepare` again")
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError as exc:
            raise ValueError(f"{meta_path}: not valid JSON ({exc})") from exc
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: format version {meta.get('version')}, this moetron reads version "
                             f"{FORMAT_VERSION}; prepare the data again with this moetron")
        if meta.get("dtype") not in _DTYPES:
            raise ValueError(f"{meta_path}: dtype {meta.get('dtype')!r}, expected one of {', '.join(_DTYPES)}")
        if sys.byteorder != "little":
            raise NotImplementedError("prepared data is little-endian; reading it on a big-endian host is not "
                                      "supported")
        self.meta = meta
        self.vocab_size = int(meta["vocab_size"])
        self.num_tokens = int(meta["num_tokens"])
        self.num_documents = int(meta["num_documents"])
        self.separator_id = int(meta["separator_id"])
        dtype, itemsize = _DTYPES[meta["dtype"]]
        tokens_path, index_path = self.path / meta["tokens_file"], self.path / meta["index_file"]
        for file, expected in ((tokens_path, self.num_tokens * itemsize), (index_path, (self.num_documents + 1) * 8)):
            size = file.stat().st_size if file.is_file() else None
            if size != expected:
                raise ValueError(f"{file}: {'missing' if size is None else f'{size} bytes'}, {META_FILE} says "
                                 f"{expected}; the folder is damaged, prepare it again")
        self.tokens = _map(tokens_path, dtype, itemsize, self.num_tokens)
        self.offsets = _map(index_path, torch.int64, 8, self.num_documents + 1)
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.num_tokens:
            raise ValueError(f"{index_path}: offsets run from {int(self.offsets[0])} to {int(self.offsets[-1])}, "
                             f"expected 0 to {self.num_tokens}; the folder is damaged, prepare it again")

    def document(self, i: int) -> torch.Tensor:
        """Tokens of document `i` (int64), without its trailing separator."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} of {self.num_documents}")
        return self.tokens[int(self.offsets[i]): int(self.offsets[i + 1]) - 1].to(torch.int64)

    def window(self, start: int, length: int) -> torch.Tensor:
        """`length` tokens of the packed stream from `start`, as int64."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) of {self.num_tokens}")
        return self.tokens[start: start + length].to(torch.int64)


class PackedBatches:
    """Micro-batches `(input_ids, labels)` of packed sequences; see the module docstring."""

    def __init__(self, data: str | os.PathLike | PreparedCorpus, seq_len: int, batch_size: int, seed: int,
                 micro_batches_per_step: int = 1, *, mask_boundary_labels: bool = False,
                 model_vocab_size: int | None = None):
        self.corpus = data if isinstance(data, PreparedCorpus) else PreparedCorpus(data)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                            ("micro_batches_per_step", micro_batches_per_step)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.corpus.num_tokens < seq_len + 1:
            raise ValueError(f"{self.corpus.path} has {self.corpus.num_tokens} tokens, fewer than "
                             f"seq_len+1={seq_len + 1}; prepare more text or shorten train.seq_len")
        if model_vocab_size is not None and self.corpus.vocab_size > model_vocab_size:
            raise ValueError(f"{self.corpus.path} was tokenized with a vocabulary of {self.corpus.vocab_size} "
                             f"tokens but model.vocab_size={model_vocab_size}; set --set "
                             f"model.vocab_size={self.corpus.vocab_size} (or larger)")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.micro_batches_per_step = micro_batches_per_step
        self.mask_boundary_labels = mask_boundary_labels
        self.num_sequences = (self.corpus.num_tokens - 1) // seq_len  # per epoch
        self._perms: dict[int, FeistelPermutation] = {}

    @property
    def samples_per_step(self) -> int:
        return self.micro_batches_per_step * self.batch_size

    def permutation(self, epoch: int) -> FeistelPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 4:
                self._perms.clear()
            key = _mix64(_mix64(self.seed & _M64) ^ (epoch & _M64))
            perm = self._perms[epoch] = FeistelPermutation(self.num_sequences, key)
        return perm

    def sequence_ids(self, step: int, index: int = 0) -> list[int]:
        """Which sequences (0..num_sequences-1) micro-batch `index` of `step` holds, row by row."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if not 0 <= index < self.micro_batches_per_step:
            raise ValueError(f"micro-batch index {index} is outside [0, {self.micro_batches_per_step}): "
                             "micro_batches_per_step must be the global micro-batch count per step "
                             "(grad_accum x data-parallel size)")
        first = (step * self.micro_batches_per_step + index) * self.batch_size
        ids = []
        for g in range(first, first + self.batch_size):
            epoch, j = divmod(g, self.num_sequences)
            ids.append(self.permutation(epoch)(j))
        return ids

    def batch(self, step: int, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Global micro-batch `index` of `step`: `(input_ids, labels)`, int64 `[batch_size, seq_len]`."""
        length = self.seq_len + 1
        windows = torch.stack([self.corpus.window(s * self.seq_len, length) for s in self.sequence_ids(step, index)])
        inputs, labels = windows[:, :-1], windows[:, 1:].clone()
        if self.mask_boundary_labels:
            labels[inputs == self.corpus.separator_id] = IGNORE_INDEX
        return inputs, labels

    def epoch_of(self, step: int) -> float:
        """How many passes over the data `step` steps make (for logs)."""
        return step * self.samples_per_step / self.num_sequences

    def describe(self) -> str:
        c = self.corpus
        steps = self.num_sequences / self.samples_per_step
        return (f"data {c.path}: {c.num_tokens:,} tokens in {c.num_documents:,} documents "
                f"(vocabulary {c.vocab_size:,}), {self.num_sequences:,} packed sequences of {self.seq_len}; "
                f"one epoch is {steps:,.1f} steps of {self.samples_per_step} sequences")
