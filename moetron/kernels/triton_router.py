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

Sums run in another order than the eager router's: weights and gradients within a few ulp of it
(tests/test_triton_router.py). On CPU tensors this module runs only under the interpreter: set
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
    sel = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        e = tl.min(tl.where(key == best, offs, BLOCK_E), axis=0)  # ties: the lower expert
        sel = tl.where(slots == j, e, sel)
        w = tl.where(slots == j, tl.sum(tl.where(offs == e, p, 0.0), axis=0), w)  # exactly p[e]; NaN stays
        key = tl.where(offs == e, -1.0, key)
    if NORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scale
    tl.store(idx_ptr + t * K + slots, sel.to(tl.int64), mask=slots < K)
    tl.store(w_ptr + t * K + slots, w, mask=slots < K)
    tl.atomic_add(counts_ptr + sel, 1, mask=slots < K)


@triton.jit
def _backward_kernel(gw_ptr, probs_ptr, idx_ptr, aux_ptr, out_ptr, E, scale, K: tl.constexpr,
                     NORMALIZE: tl.constexpr, HAS_AUX: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    p = tl.load(probs_ptr + t * E + offs, mask=m, other=0.0)
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
    if HAS_AUX:
        dp += tl.load(aux_ptr + offs, mask=m, other=0.0)
    dot = tl.sum(p * dp, axis=0)
    tl.store(out_ptr + t * E + offs, p * (dp - dot), mask=m)


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
