"""Host-side choices of a CPU run: intra-op threads and what the allocator does with freed memory.

Neither depends on the machine's load, so a run and its resume compute alike; an environment
variable the user set always wins, and each choice is logged.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch

from moetron.kernels.threads import set_wide_threads

SMALL_OP_ELEMENTS = 1 << 18  # activation elements per op (tokens x hidden) below which a model is "small"
WIDE_THREADS = 2  # threads for a small model's widest ops (a helper): measured on 2 cores, more is untested
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _elements(recipe) -> int:
    t = recipe.train
    return t.micro_batch_size * t.seq_len * recipe.model.hidden_size


def _one_cpu_process(run) -> bool:
    return run.device.type == "cpu" and run.ps.world_size == 1


def small_model_threads(run, recipe, say) -> None:
    """One-process CPU training of a small model: one intra-op thread, and a helper for its widest ops.

    Every op is an OpenMP parallel region whose threads meet at a barrier. At the default recipe's
    sizes (1024 tokens x 64 hidden = 65,536 elements) a second thread saves nothing: most ops are below
    torch's parallel grain, the rest wait at the barrier. At the mid-size proxy's (1024 x 512) two
    threads train 1.46x faster on a quiet 2-core machine (895 vs 615 tokens/s) and as fast as one
    when another process is busy (546 vs 572), now that waiting threads sleep (moetron/__main__.py;
    spinning, they ran 148). The experts' grouped GEMM and the attention core still get a helper thread
    (kernels/threads.py): the same bits, 7-11 % off a default-recipe step's median on a quiet machine,
    +3 % beside a busy process. The helper also computes the weight gradients while the backward pass
    goes on (kernels/weight_grads.py, the trainer's choice): the same bits, about 5 % more off.
    `OMP_NUM_THREADS` overrides.
    """
    cores = torch.get_num_threads()
    if not _one_cpu_process(run) or "OMP_NUM_THREADS" in os.environ or cores < 2:
        return
    elements = _elements(recipe)
    if elements < SMALL_OP_ELEMENTS:
        torch.set_num_threads(1)
        wide = min(cores, WIDE_THREADS)
        set_wide_threads(wide)
        say(f"threads: 1 of {cores} intra-op threads ({elements:,} activation elements per op < "
            f"{SMALL_OP_ELEMENTS:,}: a second thread only waits at every op's barrier), {wide} for the experts' "
            "grouped GEMMs and the attention core, whose helper also computes the weight gradients beside the "
            "backward pass; set OMP_NUM_THREADS to choose")


def user_chose_allocator(environ) -> bool:
    """glibc's MALLOC_* tunables, or another allocator preloaded: the user's choice stands."""
    return "LD_PRELOAD" in environ or any(name.startswith("MALLOC_") for name in environ)


def keep_freed_memory(device: torch.device, say) -> bool:
    """CPU training: freed tensors stay in the process (glibc only).

    glibc hands tensors over 32 MiB (and, once trimmed, the heap's top) back to the kernel when they
    are freed, so every step's fresh activations and gradients page-fault again: 14-17 % of a step of
    the mid-size proxy (benchmarks/train_step.py; nothing measurable at the default recipe's sizes).
    With mmap off and trimming off, a freed block is reused by the next step, as a caching allocator
    would, and the process keeps its peak memory. torch's 64-byte aligned blocks leave the first few
    freed ones a little too small for the same request, so the heap settles after warm-up (the
    mid-size proxy: the same page faults over 8 and 24 steps, max RSS unchanged at 1.42 GB).
    Returns whether the setting was made; it holds for the rest of the process. Any MALLOC_*
    variable or an LD_PRELOAD'ed allocator wins.
    """
    if device.type != "cpu":
        return False
    if user_chose_allocator(os.environ) or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # this process's own symbols: glibc's malloc
    if not (libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1):
        return False
    say("host memory: freed tensors kept for reuse, not page-faulted in again every step (glibc: no mmap, "
        "no trim; set MALLOC_MMAP_MAX_ or MALLOC_TRIM_THRESHOLD_ to choose)")
    return True
