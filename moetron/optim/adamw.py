"""torch.optim.AdamW without the torch._dynamo import its first call costs, and without the
per-parameter Python of its fused step.

torch.optim wraps `step`, `zero_grad`, `add_param_group`, `state_dict` and `load_state_dict` in
guards against torch.compile tracing whose first call imports torch._dynamo: about a second of
every run's start-up on a 2-core CPU, more than the default recipe's first 20 steps. `AdamW` runs
the same undecorated bodies, so the update (torch's fused kernel or its loop), the state layout
and the checkpoints are torch.optim.AdamW's, bit for bit. Under torch.compile use torch's own class.

With `fused=True`, once every parameter has its state, a step makes torch's two kernel calls per
group directly (`_foreach_add_` on the step counts, `_fused_adamw_`), the calls torch's step ends
in, in the same order: torch gets there through `_init_group`'s checks on every parameter and a
device/dtype grouping, ~0.5 ms a step on the tiny recipe's 47 tensors (a tenth of its optimizer).
Anything else (a parameter without a gradient, a new one without state, AMP's `grad_scale` /
`found_inf`, tensor hyperparameters, mixed devices or dtypes) takes torch's own step.
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
        if closure is None and self._fused_step():
            return None
        # torch's wrapper sets the grad mode to `differentiable` (and breaks compiled graphs there)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _STEP(self, closure)

    def _fused_step(self) -> bool:
        """torch's fused update without its per-parameter Python; False (nothing done) wherever its
        step would do anything but these calls."""
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return False
        calls = []
        for group in self.param_groups:
            lists = _fused_lists(group, self.state)
            if lists is None:
                return False
            if lists[0]:  # torch makes no call for a group without parameters
                calls.append((group, lists))
        with torch.no_grad():
            for group, (params, grads, avgs, sqs, steps) in calls:
                beta1, beta2 = group["betas"]
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(params, grads, avgs, sqs, [], steps, amsgrad=False, lr=group["lr"],
                                    beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                    maximize=group["maximize"], grad_scale=None, found_inf=None)
        return True


def _fused_lists(group: dict, state) -> tuple | None:
    """(params, grads, exp_avgs, exp_avg_sqs, steps) of a group torch would update with exactly one
    `_fused_adamw_` call; None otherwise."""
    if not (group["fused"] and group["decoupled_weight_decay"]) or group["amsgrad"] or group["differentiable"] \
            or group["capturable"] or not all(type(group[k]) is float for k in ("lr", "weight_decay", "eps")) \
            or not all(type(b) is float for b in group["betas"]):
        return None
    params, grads, avgs, sqs, steps = group["params"], [], [], [], []
    if not params:
        return params, grads, avgs, sqs, steps
    device, dtype = params[0].device, params[0].dtype
    for p in params:
        g, s = p.grad, state.get(p)
        if g is None or not s or p.device != device or p.dtype != dtype or g.dtype != dtype or g.is_sparse \
                or p.is_complex():
            return None
        grads.append(g)
        avgs.append(s["exp_avg"])
        sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    return params, grads, avgs, sqs, steps
