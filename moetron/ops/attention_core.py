"""The attention core behind one seam: softmax(q k^T * scale + causal) v.

Backends: `sdpa` (torch's scaled_dot_product_attention; flash kernels on GPU; on a CPU under
`train.fusion=cpp`, moetron's C++ kernel for head dims a multiple of 8 up to 128 and sequences
whose keys fit in L2, kernels/attention_cpu.py),
`eager` (explicit matmuls, the readable reference), `flash_attn` and `te`
(Transformer Engine), the last two GPU-only and used only when asked for.
Shapes: q [B,h,Sq,dqk], k [B,h_kv,Sk,dqk], v [B,h_kv,Sk,dv]; dv may differ from dqk
(MLA). Returns [B,h,Sq,dv].

The causal mask is aligned to the bottom right: the queries are the last Sq positions of the
Sk keys, so query i sees keys 0..Sk-Sq+i. With Sq == Sk (one process) that is the usual causal
mask; Sq < Sk is how context parallel attends a local chunk of queries to the prefix of the
gathered keys that ends with that chunk (moetron/parallel/context_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetron import backends
from moetron.kernels import attention_cpu, sdpa_cpu
from moetron.ops.functional import fusion_mode


def _expand_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat each kv head for its group of query heads (kv head j serves heads j*g..j*g+g-1)."""
    groups = num_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _eager(q, k, v, scale):
    Sq, Sk = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    causal = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).triu(Sk - Sq + 1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def check_flash_attn(q: torch.Tensor, v: torch.Tensor) -> None:
    """flash-attn's limits, as moetron errors: fp16/bf16 only, one head size <= 256 (v padded to q's)."""
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(f"model.attention_backend=flash_attn runs fp16/bf16 only, got {q.dtype}: set "
                         f"train.dtype=bf16 (or model.attention_backend=sdpa)")
    head = -(-max(q.shape[-1], v.shape[-1]) // 8) * 8  # flash-attn pads the head size to a multiple of 8
    if head > FLASH_MAX_HEAD_DIM:
        raise ValueError(f"model.attention_backend=flash_attn supports head dims up to {FLASH_MAX_HEAD_DIM}; this "
                         f"model's is {head} (q/k {q.shape[-1]}, v {v.shape[-1]}): use attention_backend=sdpa or te")


def _flash_attn(q, k, v, scale):
    from flash_attn import flash_attn_func  # optional GPU package

    check_flash_attn(q, v)
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:  # flash-attn wants one head size: pad v, slice the output
        v = F.pad(v, (0, dqk - dv))
    # flash-attn >= 2.1 aligns causal=True to the bottom right when Sq != Sk
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          softmax_scale=scale, causal=True)
    return out.transpose(1, 2)[..., :dv]


_te_modules: dict = {}  # one te.DotProductAttention per shape and mask (it has no parameters)


def _te(q, k, v, scale):
    import transformer_engine.pytorch as te  # optional GPU package

    B, h, S, dqk = q.shape
    dv = v.shape[-1]
    mask_type = "causal" if k.shape[-2] == S else "causal_bottom_right"
    key = (h, k.shape[1], dqk, dv, scale, mask_type)
    if key not in _te_modules:
        _te_modules[key] = te.DotProductAttention(h, (dqk, dv), num_gqa_groups=k.shape[1],
                                                  attn_mask_type=mask_type, qkv_format="bshd",
                                                  softmax_scale=scale)
    out = _te_modules[key](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.view(B, S, h, dv).transpose(1, 2)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   backend: str = "sdpa") -> torch.Tensor:
    Sq, Sk = q.shape[-2], k.shape[-2]
    if Sq > Sk:
        raise ValueError(f"core_attention: {Sq} queries but only {Sk} keys; the queries must be the "
                         f"last positions of the keys (bottom-right causal alignment)")
    if backend == "flash_attn":
        backends.require("flash_attn")
        return _flash_attn(q, k, v, scale)
    if backend == "te":
        backends.require("transformer_engine")
        return _te(q, k, v, scale)
    if backend == "eager":
        return _eager(q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), scale)
    if Sq == Sk and fusion_mode() == "cpp" and attention_cpu.applies(q, k, v):
        return attention_cpu.CausalAttention.apply(q, k, v, scale)  # moetron's C++ kernel (fp32 CPU)
    # On the CPU, SDPA reads each kv head for its group of query heads itself (enable_gqa): no
    # repeated copies of k and v nor their backward sums, the same output bit for bit.
    gqa = q.device.type == "cpu" and k.shape[1] != q.shape[1]
    if not gqa:
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if Sq == Sk:
        if sdpa_cpu.applies(q, k, v):  # a small CPU model: half of the batch on a helper thread, the same bits
            return sdpa_cpu.SplitCausalAttention.apply(q, k, v, scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    # Bottom-right causal mask as a boolean tensor (torch.nn.attention.bias would import torch._dynamo:
    # over a second of start-up for every run).
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
