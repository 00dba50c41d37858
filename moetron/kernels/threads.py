"""Wide ops: the few kernels of a small model that run on more threads than its other ops.

A small model trains on one intra-op thread (moetron/train/host.py): most of its ops are too small for
a second thread to pay for the barrier where the threads meet. The experts' grouped GEMM is not: it
does a whole layer's expert matmuls in one call and hands the experts to whichever thread is free
(csrc/grouped_gemm_cpu.cpp). With `set_wide_threads(2)` the calling thread gets a helper task on
torch's inter-op pool for it, and waits only for pieces the helper has started, so a helper that
another process keeps off its core costs nothing. The result is the same to the bit.
"""

from __future__ import annotations

import torch

_wide_threads = 1


def set_wide_threads(n: int) -> None:
    """Threads for wide ops; 1 runs them like every other op."""
    global _wide_threads
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"wide-op threads must be an int >= 1, got {n!r}")
    _wide_threads = n


def wide_threads() -> int:
    return _wide_threads


def helper_threads() -> int:
    """Helper tasks a wide op adds to the calling thread: none where the intra-op threads already
    number as many (they run it as every other op)."""
    return _wide_threads - 1 if _wide_threads > torch.get_num_threads() else 0
