"""Balancing losses under context parallelism equal those of one process on the whole sequences.

Each CP rank routes its load-balanced chunks of every sequence (split_for_cp). With the CP group
the router sums expert counts over CP and injects its share of the Switch / sequence-wise / global
loss; the reported values must be the one-process ones on every rank, and the router-weight
gradients summed over CP the one-process gradient. The reference is a TopKRouter in one process
on the whole batch (its own formulas are checked against float64 loops in test_balancing.py). The
check is shown to have power: the old per-rank losses (no CP group) miss by far more than TOL.
One spawn, world 2.
"""

import copy

import torch
import torch.distributed as dist

from dist_utils import run_distributed
from moetron import MoEConfig, MoELayer
from moetron.moe import balancing
from moetron.moe.router import TopKRouter
from moetron.parallel.context_parallel import split_for_cp
from moetron.parallel.state import Group

H, B, S, E, K = 16, 3, 16, 8, 2
TOL = 1e-5  # relative, fp32
CASES = {  # name: (MoEConfig overrides, micro-batches)
    "aux_loss": (dict(aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.01), 1),
    "seq_aux_loss": (dict(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1, score_func="sigmoid",
                          norm_topk_prob=True, scaling_factor=2.5, num_groups=4, topk_groups=2), 1),
    "global_aux_loss": (dict(aux_loss_type="global_aux_loss", aux_loss_coeff=0.1), 2),  # running counts
}


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _inputs(seed, micro_batches):
    """Micro-batches of tokens [B,S,H] and random weights [B,S,K] for the objective sum(w * r)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, S, H, generator=gen), torch.rand(B, S, K, generator=gen) * 0.01)
            for _ in range(micro_batches)]


def _train(router, batches, scale, cp=None):
    """Per micro-batch reported loss values, and the router-weight gradient (summed over `cp`)."""
    router.weight.grad = None
    balancing.set_aux_loss_scale(scale)
    values = []
    try:
        for x, r in batches:
            if cp is not None:
                x, r = split_for_cp(x, cp.size, cp.rank), split_for_cp(r, cp.size, cp.rank)
            routing, losses, _ = router(x.reshape(-1, H), x.shape[1])
            (routing.topk_weights * r.reshape(-1, K)).sum().backward()
            values.append({k: v.clone() for k, v in losses.values.items()})
    finally:
        balancing.set_aux_loss_scale(1.0)
    grad = router.weight.grad.clone()
    if cp is not None:
        dist.all_reduce(grad, group=cp.handle)
    return values, grad


def _worker(rank, world):
    cp = Group("cp", tuple(range(world)), rank, dist.group.WORLD)
    report = {}
    for name, (kw, micro_batches) in CASES.items():
        torch.manual_seed(0)
        ref = TopKRouter(MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K, init_std=1.0, **kw))
        batches = _inputs(1, micro_batches)
        want_values, want_grad = _train(copy.deepcopy(ref), batches, 1.0)
        assert want_grad.abs().max() > 0 and set(want_values[0]) >= {kw["aux_loss_type"]}, name

        exact = copy.deepcopy(ref)
        exact.cp_group = cp
        got_values, got_grad = _train(exact, batches, 1.0 / cp.size, cp)
        old_values, old_grad = _train(copy.deepcopy(ref), batches, 1.0 / cp.size, cp)  # per-rank losses

        value_err = old_value_err = 0.0
        for got, old, want in zip(got_values, old_values, want_values):
            assert sorted(got) == sorted(want), name
            for k in want:
                value_err = max(value_err, rel_err(got[k], want[k]))
                if k != "z_loss":  # old z-loss: a per-rank mean (reported per rank), exact only in gradient
                    old_value_err = max(old_value_err, rel_err(old[k], want[k]))
        grad_err, old_grad_err = rel_err(got_grad, want_grad), rel_err(old_grad, want_grad)
        assert value_err < TOL, f"{name}: reported loss off by {value_err:.3g} (relative)"
        assert grad_err < TOL, f"{name}: router gradient off by {grad_err:.3g} (relative)"
        # power: the per-rank formulas of before miss by far more than the tolerance
        assert old_value_err > 100 * TOL and old_grad_err > 100 * TOL, (name, old_value_err, old_grad_err)
        report[name] = (value_err, grad_err, old_value_err, old_grad_err)

    # Recomputed MoE stage (checkpointed route): the CP count all-reduce runs once per forward (it
    # is replayed, not rerun, in backward) and the gradients are the same.
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K, init_std=1.0,
                    aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    plain = MoELayer(cfg)
    recomputed = copy.deepcopy(plain)
    recomputed.recompute_modules = frozenset({"moe"})
    plain.router.cp_group = recomputed.router.cp_group = cp
    calls = []
    original = TopKRouter.cp_sum
    TopKRouter.cp_sum = lambda self, counts: calls.append(1) or original(self, counts)
    try:
        grads = []
        for layer in (plain, recomputed):
            balancing.set_aux_loss_scale(1.0 / cp.size)
            x, r = _inputs(2, 1)[0]
            x = split_for_cp(x, cp.size, cp.rank).requires_grad_()
            (layer(x) * split_for_cp(r, cp.size, cp.rank)[..., :1]).sum().backward()
            grads.append(layer.router.weight.grad)
            layer.router.reset_global_counts()
    finally:
        TopKRouter.cp_sum = original
        balancing.set_aux_loss_scale(1.0)
    assert len(calls) == 2, f"cp_sum ran {len(calls)} times for 2 forwards (a recompute must replay it)"
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])
    return report


def test_cp_balancing_losses_match_one_process():
    reports = run_distributed(_worker, 2)
    for name, (value_err, grad_err, old_value_err, old_grad_err) in reports[0].items():
        print(f"{name:16s} values {value_err:.1e}  router grad {grad_err:.1e}   "
              f"(per-rank formula: {old_value_err:.1e}, {old_grad_err:.1e})")
