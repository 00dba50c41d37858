"""torch.optim.AdamW without the torch._dynamo import its first call costs.

torch.optim wraps `step`, `zero_grad`, `add_param_group`, `state_dict` and `load_state_dict` in
guards against torch.compile tracing whose first call imports torch._dynamo: about a second of
every run's start-up on a 2-core CPU, more than the default recipe's first 20 steps. `AdamW` runs
the same undecorated bodies, so the update (torch's fused kernel or its loop), the state layout
and the checkpoints are torch.optim.AdamW's, bit for bit. Under torch.compile use torch's own class.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["AdamW", "clip_and_step"]

_Optimizer = torch.optim.Optimizer
_STEP = inspect.unwrap(torch.optim.AdamW.step)  # the body inside the grad-mode / graph-break wrapper


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, same numerics) that never imports torch._dynamo."""

    add_param_group = inspect.unwrap(_Optimizer.add_param_group)
    zero_grad = inspect.unwrap(_Optimizer.zero_grad)
    state_dict = inspect.unwrap(_Optimizer.state_dict)
    load_state_dict = inspect.unwrap(_Optimizer.load_state_dict)

    def step(self, closure=None):
        # torch's wrapper sets the grad mode to `differentiable` (and breaks compiled graphs there)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _STEP(self, closure)


def clip_and_step(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], norm: torch.Tensor,
                  max_norm: float) -> None:
    """Clip `grads` by the global `norm` as torch's `clip_grad_norm_` does, then `optimizer.step()`.

    torch multiplies every gradient by `max_norm / (norm + 1e-6)` when that is < 1 (a pass that reads
    and writes each gradient, ~18 ms a step for 54M on a 2-core CPU), and by 1.0 otherwise. Here the
    factor 1.0 is skipped, and a fused AdamW divides by the inverse in its own pass instead (its
    `grad_scale`, the hook GradScaler uses): the same update within an ulp of the gradient. Other
    optimizers get torch's multiply.
    """
    clip = max_norm / (norm + 1e-6)
    if not bool(clip < 1.0):  # torch's coefficient, compared as torch computes it
        optimizer.step()
    elif optimizer.defaults.get("fused"):
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).to(torch.float32)
        try:
            optimizer.step()
        finally:
            optimizer.grad_scale = None
    else:
        torch._foreach_mul_(grads, clip.to(grads[0].dtype))
        optimizer.step()
