"""Wide ops: the few kernels of a small model that run on more intra-op threads than the rest.

A small model trains on one intra-op thread (moetron/train/host.py): most of its ops are too small for
a second thread to pay for the barrier where the threads meet. The experts' grouped GEMM is not: it
does a whole layer's expert matmuls in one call and hands the experts to whichever thread is free
(csrc/grouped_gemm_cpu.cpp), so two threads finish it ~1.3x sooner in a default-recipe step, a
descheduled partner costs little, and the result is the same to the bit. `wide()` raises the thread
count around such a call and puts it back; with `set_wide_threads(1)` (the default) it does nothing.
"""

from __future__ import annotations

import contextlib

import torch

_wide_threads = 1


def set_wide_threads(n: int) -> None:
    """Intra-op threads for wide ops; 1 runs them like every other op."""
    global _wide_threads
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"wide-op threads must be an int >= 1, got {n!r}")
    _wide_threads = n


def wide_threads() -> int:
    return _wide_threads


@contextlib.contextmanager
def wide():
    """Run the enclosed ops on the wide-op thread count where that is more than the current one."""
    prev = torch.get_num_threads()
    if _wide_threads <= prev:
        yield
        return
    torch.set_num_threads(_wide_threads)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
