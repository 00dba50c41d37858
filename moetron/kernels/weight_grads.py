"""Weight gradients beside the backward pass: a small model's free core computes them.

A small model trains on one intra-op thread (moetron/train/host.py), so during its backward pass the
second core idles except inside the wide ops (kernels/threads.py). A weight gradient is needed only at
the optimizer step, so inside `weight_grads_beside` (one forward and backward pass of the trainer,
single process) the layers that support it (the experts' grouped GEMM, `moetron.ops.linear`) queue
their weight-gradient GEMM on the helper thread and go on with the input gradient. The helper runs
`run_beside`'s halves first and these in order; on exit each weight's gradients of the pass, summed in
the order autograd would sum them, are added to `.grad` once, as AccumulateGrad does: the same bits.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from moetron.kernels.threads import _helper, _Task


class _Pass:
    """The weight gradients of one backward pass that run on the helper (`weight_grads_beside`)."""

    def __init__(self):
        self.tasks: list[_Task] = []
        self.weights: dict[int, torch.Tensor] = {}  # id -> weight, in the order of their first gradient
        self.grads_before: dict[int, tuple] = {}  # id -> the weight's .grad when the pass began
        self.sums: dict[int, torch.Tensor] = {}  # id -> the weight's gradients of this pass, summed
        self.nodes: dict[int, object] = {}  # id -> the weight's AccumulateGrad node (the pass's graph holds it)

    def add(self, key: int, grad: torch.Tensor) -> None:  # on the helper, in submission order
        self.sums[key] = grad if key not in self.sums else self.sums[key] + grad

    def finish(self) -> None:
        """Wait for the helper's tasks, run the ones it has not taken, then add each sum to `.grad`
        once, as autograd's AccumulateGrad would (its input buffer sums a pass's gradients first)."""
        mine = _helper.take_background()
        error = None
        for task in self.tasks:
            if task in mine:
                task.run()
            else:
                task.wait()
            error = error or task.error
        if error is not None:
            raise error
        for key in self.sums:  # every check before any write: stacked weights' grads share a version counter
            weight = self.weights[key]
            if _grad_state(weight) != self.grads_before[key]:
                raise RuntimeError(f"a weight of shape {tuple(weight.shape)} got gradients both through autograd and "
                                   "beside it (weight_grads_beside): pass moetron.ops.linear only weights that "
                                   "nothing else in the step differentiates")
        for key, grad in self.sums.items():
            weight = self.weights[key]
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad += grad


def _grad_state(weight: torch.Tensor) -> tuple:
    grad = weight.grad
    return (None,) if grad is None else (id(grad), grad._version)


_pass: _Pass | None = None
_owner: int | None = None  # the thread that opened the pass (autograd runs a CPU backward on it)


@contextlib.contextmanager
def weight_grads_beside(enabled: bool = True):
    """Within (one forward and backward pass), `defer_weight_grad` runs weight gradients on the helper
    thread while the backward pass goes on; on exit they reach `.grad` (the first error is raised).
    For a single process whose deferred weights have no gradient hooks: `.grad` is set outside autograd."""
    global _pass, _owner
    if not enabled or _pass is not None:
        yield
        return
    state = _pass = _Pass()
    _owner = threading.get_ident()
    try:
        yield
    finally:
        _pass = _owner = None
        state.finish()


def weight_grads_active() -> bool:
    """Whether the calling code runs inside `weight_grads_beside`."""
    return _pass is not None and _owner == threading.get_ident()


def defer_weight_grad(weight: torch.Tensor | None, compute: Callable[[], torch.Tensor]) -> bool:
    """Queue `compute()`, the gradient of the parameter `weight`, on the helper thread, if inside
    `weight_grads_beside` and `weight` has no hooks; False (nothing done) otherwise."""
    return defer_weight_grads((weight,), compute)


def defer_weight_grads(weights, compute: Callable[[], torch.Tensor | list[torch.Tensor]]) -> bool:
    """`defer_weight_grad` for several parameters whose gradients `compute()` returns as a list, in
    their order (the projections of one input, ops/linear.py): all are queued, or none."""
    state = _pass
    if not weight_grads_active() or any(w is None or not w.is_leaf or _has_hooks(w) for w in weights):
        return False
    if not all(_accumulates(w, state.nodes) for w in weights):  # e.g. torch.autograd.grad(..., inputs=x): dropped
        return False
    keys = [id(w) for w in weights]
    for key, weight in zip(keys, weights):
        if key not in state.weights:
            state.weights[key], state.grads_before[key] = weight, _grad_state(weight)
    def run():
        grad = compute()
        for key, part in zip(keys, grad if isinstance(grad, (list, tuple)) else (grad,)):
            state.add(key, part)

    task = _Task(run)
    state.tasks.append(task)
    _helper.submit(task, urgent=False)
    return True


def _accumulates(weight: torch.Tensor, nodes: dict) -> bool:
    """Whether the running backward pass adds to `weight.grad` (a `torch.autograd.grad` call does not).
    `nodes` keeps each weight's AccumulateGrad node for the pass: finding it makes a view of the weight."""
    edge, will_run = getattr(torch.autograd.graph, "get_gradient_edge", None), \
        getattr(torch._C, "_will_engine_execute_node", None)
    if edge is None or will_run is None:
        return False
    try:
        node = nodes.get(id(weight))
        if node is None:
            node = nodes[id(weight)] = edge(weight).node
        return will_run(node)
    except RuntimeError:  # not inside a backward pass
        return False


def _has_hooks(p: torch.Tensor) -> bool:
    return bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))
