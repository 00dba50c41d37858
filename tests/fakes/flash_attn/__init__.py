"""CPU fake of Dao-AILab/flash-attention 2.8.4 (commit 0251105a, flash_attn/flash_attn_interface.py and
the TORCH_CHECKs of csrc/flash_attn/flash_api.cpp::mha_fwd): `flash_attn_func` only.

Kept: the signature and return value; fp16/bf16 only; q, k, v of one dtype; last dim contiguous
(made so, as `maybe_contiguous` does); head size padded to a multiple of 8 then at most 256; k and v
with q's head size (CHECK_SHAPE); heads of q a multiple of heads of k/v (GQA); causal masks aligned
to the bottom right when seqlen_q != seqlen_k (flash-attn >= 2.1); seqlen_q == 1 is never causal.
Not kept: the CUDA / sm80 checks; dropout, windows, softcap and alibi are refused here.
Semantics: softmax in fp32, output rounded once to the input dtype.
"""

import torch

MOETRON_CPU_FAKE = "Dao-AILab/flash-attention 2.8.4 @0251105a"
__version__ = "2.8.4"


def _check(cond, msg):
    if not cond:
        raise RuntimeError(msg)


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _mha_fwd(q, k, v, softmax_scale, causal):
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    batch_size, seqlen_q, num_heads, head_size = q.shape
    _, seqlen_k, num_heads_k, _ = k.shape
    _check(batch_size > 0, "batch size must be positive")
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(tuple(k.shape) == (batch_size, seqlen_k, num_heads_k, head_size),
           "k must have shape (batch_size, seqlen_k, num_heads_k, head_size)")
    _check(tuple(v.shape) == (batch_size, seqlen_k, num_heads_k, head_size),
           "v must have shape (batch_size, seqlen_k, num_heads_k, head_size)")
    return _mha_fwd_fp32(q.float(), k.float(), v.float(), softmax_scale, causal).to(q.dtype)


class FlashAttnFunc(torch.autograd.Function):
    """Forward by `_mha_fwd`; backward by differentiating the same fp32 math (a reference)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        ctx.save_for_backward(q, k, v)
        ctx.softmax_scale, ctx.causal = softmax_scale, causal
        return _mha_fwd(q, k, v, softmax_scale, causal)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            out = _mha_fwd_fp32(qf, kf, vf, ctx.softmax_scale, ctx.causal)
            dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dout.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _mha_fwd_fp32(q, k, v, scale, causal):
    seqlen_q, seqlen_k, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    qf, kf, vf = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    scores = qf @ kf.transpose(-1, -2) * scale
    if causal and seqlen_q > 1:
        i, j = torch.arange(seqlen_q).unsqueeze(1), torch.arange(seqlen_k).unsqueeze(0)
        scores = scores.masked_fill(j > i + seqlen_k - seqlen_q, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim), k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out (batch, seqlen_q, nheads, headdim)."""
    if dropout_p or softcap or alibi_slopes is not None or tuple(window_size) != (-1, -1) or return_attn_probs:
        raise NotImplementedError("the flash_attn CPU fake implements causal/full attention without dropout, "
                                  "windows, softcap, alibi or returned probabilities")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    head_size_og = q.size(3)
    if head_size_og % 8 != 0:
        pad = [0, 8 - head_size_og % 8]
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    out = FlashAttnFunc.apply(q, k, v, softmax_scale, causal)
    return out[..., :head_size_og]


__all__ = ["flash_attn_func"]
