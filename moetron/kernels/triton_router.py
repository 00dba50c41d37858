"""The softmax top-k router's selection as one Triton kernel each way, for fp32 CUDA logits.

`moetron.moe.router.TopKRouter` takes it under `set_fusion("triton")` (`train.fusion=auto` on a GPU)
for the routers the C++ kernel covers too (`fused_router_covers`), through the same autograd Function:
`moetron.kernels.fused_router.TopKSoftmax.apply(..., kernels=this module)`. Why: on the H100 the eager router was ~21 launches a
MoE layer forward and took 2.3 ms of wall for ~0.5 ms of device work (docs/performance.md, eighth
session); here it is torch's softmax, this kernel, the counts' cast and the probabilities' sum.

* forward   one program per token: the k largest probabilities (NaN first, ties to the lower expert,
            as `torch.topk`), their weights (normalised, scaled), and the expert counts (int32 atomics:
            exact). The probabilities are torch's softmax, so the experts chosen are the eager router's.
* backward  one program per token: the normalisation's and scale's gradient, the balancing loss's
            gradient (the same for every token), then the softmax's: `p * (dp - sum(p * dp))`.

DeepSeek-V3's sigmoid router (`sigmoid_forward` / `sigmoid_backward`, through
`fused_router.TopKSigmoid.apply(..., kernels=this module)`): one program per token from torch's sigmoid
on: the expert bias, each group's score (its two largest biased scores), the best groups, the k largest
kept experts, their unbiased weights (normalised, scaled) and counts; its backward hands torch's sigmoid
backward d scores.

Sums run in another order than the eager router's: weights and gradients within a few ulp of it
(tests/test_triton_router.py, tests/test_triton_sigmoid_router.py). On CPU tensors this module runs only under the interpreter: set
`TRITON_INTERPRET=1` before it is imported (tests do).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetron.kernels import availability

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton.jit decides at decoration
MAX_EXPERTS = 4096  # one token's probabilities live in one program's registers


@triton.jit
def _forward_kernel(probs_ptr, idx_ptr, w_ptr, counts_ptr, E, scale, K: tl.constexpr, NORMALIZE: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    p = tl.load(probs_ptr + t * E + offs, mask=offs < E, other=0.0)
    # rank keys: probabilities are in [0, 1]; NaN ranks first (as torch.topk), padding and taken last
    key = tl.where(p != p, 2.0, p)
    key = tl.where(offs < E, key, -2.0)
    _choose(key, p, offs, slots, t, idx_ptr, w_ptr, counts_ptr, scale, K, NORMALIZE, BLOCK_E, BLOCK_K)


@triton.jit
def _choose(key, vals, offs, slots, t, idx_ptr, w_ptr, counts_ptr, scale, K: tl.constexpr, NORMALIZE: tl.constexpr,
            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Token t's k largest `key`s (ties to the lower expert) into idx, their `vals` as weights (normalised,
    scaled), and the expert counts (int32 atomics: exact)."""
    taken = offs < 0
    sel = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        avail = tl.where(taken, float("-inf"), key)
        best = tl.max(avail, axis=0)
        e = tl.min(tl.where((avail == best) & ~taken, offs, BLOCK_E), axis=0)  # ties: the lower expert
        sel = tl.where(slots == j, e, sel)
        w = tl.where(slots == j, tl.sum(tl.where(offs == e, vals, 0.0), axis=0), w)  # exactly vals[e]; NaN stays
        taken = taken | (offs == e)
    if NORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scale
    tl.store(idx_ptr + t * K + slots, sel.to(tl.int64), mask=slots < K)
    tl.store(w_ptr + t * K + slots, w, mask=slots < K)
    tl.atomic_add(counts_ptr + sel, 1, mask=slots < K)


@triton.jit
def _gathered_grad(gw_ptr, idx_ptr, p, offs, t, scale, K: tl.constexpr, NORMALIZE: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Token t's d p [BLOCK_E] for w_j = p[idx_j] (/ (sum_j p[idx_j] + 1e-20) when normalised) * scale."""
    denom = 1e-20
    gp = 0.0  # sum_i gw_i * p[idx_i]
    for j in tl.static_range(K):
        e = tl.load(idx_ptr + t * K + j)
        pj = tl.sum(tl.where(offs == e, p, 0.0), axis=0)
        denom += pj
        gp += tl.load(gw_ptr + t * K + j) * scale * pj
    dp = tl.zeros([BLOCK_E], dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.load(idx_ptr + t * K + j)
        g = tl.load(gw_ptr + t * K + j) * scale
        if NORMALIZE:
            g = g / denom - gp / (denom * denom)
        dp += tl.where(offs == e, g, 0.0)
    return dp


@triton.jit
def _backward_kernel(gw_ptr, probs_ptr, idx_ptr, aux_ptr, out_ptr, E, scale, K: tl.constexpr,
                     NORMALIZE: tl.constexpr, HAS_AUX: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    p = tl.load(probs_ptr + t * E + offs, mask=m, other=0.0)
    dp = _gathered_grad(gw_ptr, idx_ptr, p, offs, t, scale, K, NORMALIZE, BLOCK_E)
    if HAS_AUX:
        dp += tl.load(aux_ptr + offs, mask=m, other=0.0)
    dot = tl.sum(p * dp, axis=0)
    tl.store(out_ptr + t * E + offs, p * (dp - dot), mask=m)


@triton.jit
def _sigmoid_forward_kernel(scores_ptr, bias_ptr, idx_ptr, w_ptr, counts_ptr, E, scale, K: tl.constexpr,
                            GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_G: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    m = offs < E
    s = tl.load(scores_ptr + t * E + offs, mask=m, other=0.0)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + offs, mask=m, other=0.0)
    # rank keys: NaN first (as torch.topk), padding last; scores are finite otherwise
    key = tl.where(c != c, float("inf"), c)
    key = tl.where(m, key, float("-inf"))
    if GROUPS > 1:
        per_group = E // GROUPS
        group = offs // per_group
        gofs = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):  # the sum of each group's two largest
            in_g = m & (group == g)
            first = tl.max(tl.where(in_g, key, float("-inf")), axis=0)
            at = tl.min(tl.where(in_g & (key == first), offs, BLOCK_E), axis=0)
            second = tl.max(tl.where(in_g & (offs != at), key, float("-inf")), axis=0)
            score = first + second if per_group > 1 else first
            gscore = tl.where(gofs == g, score, gscore)
        keep = offs < 0
        for j in tl.static_range(TOPK_GROUPS):  # the best groups, ties to the lower group
            best = tl.max(gscore, axis=0)
            g = tl.min(tl.where(gscore == best, gofs, BLOCK_G), axis=0)
            keep = keep | (group == g)
            gscore = tl.where(gofs == g, float("-inf"), gscore)
        key = tl.where(keep & m, key, float("-inf"))
    _choose(key, s, offs, slots, t, idx_ptr, w_ptr, counts_ptr, scale, K, NORMALIZE, BLOCK_E, BLOCK_K)


@triton.jit
def _sigmoid_backward_kernel(gw_ptr, scores_ptr, idx_ptr, out_ptr, E, scale, K: tl.constexpr,
                             NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    s = tl.load(scores_ptr + t * E + offs, mask=m, other=0.0)
    ds = _gathered_grad(gw_ptr, idx_ptr, s, offs, t, scale, K, NORMALIZE, BLOCK_E)
    tl.store(out_ptr + t * E + offs, ds, mask=m)


def applies(logits: torch.Tensor) -> bool:
    """Whether the kernels take these logits: contiguous fp32 [T, E] on a GPU (a CPU under the
    interpreter), E <= MAX_EXPERTS."""
    on_device = logits.device.type == "cuda" or (INTERPRET and logits.device.type == "cpu")
    return (on_device and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()
            and 0 < logits.shape[1] <= MAX_EXPERTS)


def _launching():
    return availability.interpreted_launch(INTERPRET)


def _check(logits: torch.Tensor, k: int) -> None:
    if not applies(logits):
        raise ValueError(f"triton router: logits must be contiguous fp32 [T, E<={MAX_EXPERTS}] on a GPU (CPU only "
                         f"under TRITON_INTERPRET=1), got {logits.dtype} {tuple(logits.shape)} on {logits.device}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"triton router: top_k={k} must be in [1, E={logits.shape[1]}]")


def forward(logits: torch.Tensor, k: int, normalize: bool, scale: float):
    """logits [T, E] -> (probs [T, E], idx [T, k] int64, weights [T, k], counts [E] int64, prob_sums [E])."""
    _check(logits, k)
    T, E = logits.shape
    probs = torch.softmax(logits, dim=-1)  # torch's: the experts chosen are the eager router's
    idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    counts = torch.zeros(E, dtype=torch.int32, device=logits.device)
    if T:
        with _launching():
            _forward_kernel[(T,)](probs, idx, weights, counts, E, float(scale), K=k, NORMALIZE=normalize,
                                  BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k))
    return probs, idx, weights, counts.long(), probs.sum(0)


def backward(grad_weights: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor, normalize: bool, scale: float,
             aux: torch.Tensor | None) -> torch.Tensor:
    """d logits [T, E] from d weights [T, k] and, when given, the balancing loss's d probs [E]."""
    T, E = probs.shape
    out = torch.empty_like(probs)
    if T:
        grad_weights = grad_weights.contiguous().float()
        aux = aux.contiguous().float() if aux is not None else None
        with _launching():
            _backward_kernel[(T,)](grad_weights, probs, idx, aux if aux is not None else probs, out, E, float(scale),
                                   K=idx.shape[1], NORMALIZE=normalize, HAS_AUX=aux is not None,
                                   BLOCK_E=triton.next_power_of_2(E))
    return out


def sigmoid_forward(scores: torch.Tensor, bias: torch.Tensor | None, k: int, groups: int, topk_groups: int,
                    normalize: bool, scale: float):
    """scores [T, E] (torch.sigmoid of the logits) -> (weights [T, k], idx [T, k] int64, counts [E] int64)."""
    _check(scores, k)
    T, E = scores.shape
    if not (groups >= 1 and E % groups == 0 and 1 <= topk_groups <= groups and k <= topk_groups * (E // groups)):
        raise ValueError(f"triton router: {groups} groups of E={E} experts, top {topk_groups} of them and "
                         f"top_k={k} do not fit (E a multiple of the groups, top_k <= the kept experts)")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != E or bias.device != scores.device):
        raise ValueError(f"triton router: the expert bias must be fp32 [E={E}] on {scores.device}, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    idx = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=scores.device)
    counts = torch.zeros(E, dtype=torch.int32, device=scores.device)
    if T:
        with _launching():
            _sigmoid_forward_kernel[(T,)](scores, bias.contiguous() if bias is not None else scores, idx, weights,
                                          counts, E, float(scale), K=k, GROUPS=groups, TOPK_GROUPS=topk_groups,
                                          HAS_BIAS=bias is not None, NORMALIZE=normalize,
                                          BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k),
                                          BLOCK_G=triton.next_power_of_2(groups))
    return weights, idx, counts.long()


def sigmoid_backward(grad_weights: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, normalize: bool,
                     scale: float) -> torch.Tensor:
    """d scores [T, E] (zero off the chosen experts) from d weights [T, k]."""
    T, E = scores.shape
    out = torch.empty_like(scores)
    if T:
        with _launching():
            _sigmoid_backward_kernel[(T,)](grad_weights.contiguous().float(), scores, idx, out, E, float(scale),
                                           K=idx.shape[1], NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(E))
    return out
