"""Wide ops: the few kernels of a small model that run on more threads than its other ops.

A small model trains on one intra-op thread (moetron/train/host.py): most of its ops are too small for
a second thread to pay for the barrier where the threads meet. Two are not, and with
`set_wide_threads(2)` each gets a helper that the caller never waits for before it has started (a
helper that another process keeps off its core costs nothing); the results are the same to the bit:
- the experts' grouped GEMM hands whole experts to the caller and a task on torch's inter-op pool
  (`helper_threads`, csrc/grouped_gemm_cpu.cpp), and moetron's C++ attention its (sequence, kv head)
  tasks (csrc/causal_attention_cpu.cpp), both through csrc/helper_tasks.h;
- torch's attention (train.fusion=none) runs half of the batch on a helper thread (`run_beside`,
  kernels/sdpa_cpu.py).
The same helper thread computes weight gradients beside the backward pass (kernels/weight_grads.py);
`run_beside`'s halves go first, since a caller waits for them.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Callable

import torch

_wide_threads = 1


def set_wide_threads(n: int) -> None:
    """Threads for wide ops; 1 runs them like every other op. The grouped GEMM takes n - 1 helpers; the
    attention splits its batch in two whatever n >= 2 (the trainer sets 2: what was measured)."""
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


class _Task:
    """A call that either the helper or the caller runs: whoever claims it first, in the caller's grad
    mode (grad mode is per thread: the helper's own would record a graph of the call)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.result, self.error = fn, None, None
        self.grad = torch.is_grad_enabled()
        # two bare locks: an Event is a Python Condition, ~3 us to make, and a step makes ~20 tasks
        self._claim, self._done = threading.Lock(), threading.Lock()
        self._done.acquire()  # released when the call has run

    def claim(self) -> bool:
        return self._claim.acquire(blocking=False)

    def wait(self) -> None:
        """Until whoever claimed the task has run it."""
        with self._done:
            pass

    def run(self) -> None:
        try:
            with torch.set_grad_enabled(self.grad):
                self.result = self.fn()
        except BaseException as exc:  # handed to the caller, which raises it
            self.error = exc
        finally:
            # drop the call and what it holds now: a deferred weight gradient's closure refers to its pass,
            # which lists this task, and that cycle kept each step's saved tensors until a collection
            self.fn = None
            self._done.release()


class _Helper:
    """One daemon thread that runs the side half of `run_beside` calls first, then queued weight
    gradients in order; started on first use in each process (a forked child has none of its
    parent's threads)."""

    def __init__(self):
        self.pid = None

    def submit(self, task: _Task, urgent: bool = True) -> None:
        if self.pid != os.getpid():
            self.pid, self.ready = os.getpid(), threading.Condition()
            self.urgent, self.background = collections.deque(), collections.deque()
            threading.Thread(target=self._loop, name="moetron-wide-op", daemon=True).start()
        with self.ready:
            (self.urgent if urgent else self.background).append(task)
            self.ready.notify()

    def take_background(self) -> set[_Task]:
        """The queued weight-gradient tasks, taken off the queue for the caller to run."""
        if self.pid != os.getpid():
            return set()
        with self.ready:
            tasks = set(self.background)
            self.background.clear()
        return tasks

    def _loop(self) -> None:
        ready, urgent, background = self.ready, self.urgent, self.background
        while True:
            with ready:
                while not (urgent or background):
                    ready.wait()
                task = urgent.popleft() if urgent else background.popleft()
            if task.claim():
                task.run()


_helper = _Helper()


def run_beside(main: Callable[[], Any], side: Callable[[], Any]) -> tuple[Any, Any]:
    """`(main(), side())`, side on the helper thread where it starts in time: torch's ops release the
    GIL, so the two overlap. The caller runs `side` itself if the helper has not claimed it by the
    time `main` is done, so a helper kept off its core by another process costs nothing."""
    task = _Task(side)
    _helper.submit(task)
    first = main()
    if task.claim():
        return first, side()
    task.wait()
    if task.error is not None:
        raise task.error
    return first, task.result
