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

__all__ = ["AdamW"]

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
