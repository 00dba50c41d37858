"""Ring attention (`parallel.cp_comm_type=p2p`): K/V blocks travel around the CP ring.

Each rank holds the two chunks g and 2n-1-g of the causal load-balanced split (n ring ranks,
context_parallel.py) for q, k and v. Over n steps every rank's K/V visits every rank (isend/irecv
to the next rank, posted before the step's compute so the transfer overlaps it); each step attends
this rank's queries to the visiting block and merges the partial result by log-sum-exp. Causality
by block: at step 0 the local block (causal), then from a lower rank only its first chunk (all
queries), from a higher rank the whole block (second query chunk only) - every rank does the same
work. Backward is a second ring in the same autograd Function: K/V travel again, each with the
gradient accumulated for it so far, and arrive home with every rank's contribution.

The block math is torch's own (fp32 softmax statistics, grouped-query heads without expanding K/V),
so `attention_backend` must be sdpa or eager. Design notes: docs/parallel.md (context parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetron.parallel.state import Group

__all__ = ["ring_attention"]

_TAG_KV, _TAG_DKV = 71, 72  # distinct tags: a K/V block and a gradient block may be in flight together


class _Shift:
    """Send `x` to the next rank of the ring and receive the previous rank's into a new buffer."""

    def __init__(self, x: torch.Tensor, group: Group, tag: int):
        self._x = x.contiguous()  # alive (and unmodified) until wait()
        self.buf = torch.empty_like(self._x)
        n, me = group.size, group.rank
        ops = [dist.P2POp(dist.isend, self._x, group.ranks[(me + 1) % n], group.handle, tag),
               dist.P2POp(dist.irecv, self.buf, group.ranks[(me - 1) % n], group.handle, tag)]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._x = None
        return self.buf


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B,h,S,d] -> [B,kv_heads,h/kv_heads,S,d]: query head j serves kv head j // (h/kv_heads)."""
    B, h, S, d = x.shape
    return x.reshape(B, kv_heads, h // kv_heads, S, d)


SCORE_BUDGET = 1 << 26  # score elements per piece of a block (256 MiB fp32): query rows are taken in pieces


def _row_pieces(q: torch.Tensor, Sk: int):
    """(start, stop) of query-row pieces whose [B,h,rows,Sk] scores stay within SCORE_BUDGET."""
    B, h, Sq = q.shape[:3]
    rows = max(1, SCORE_BUDGET // max(B * h * Sk, 1))
    return [(r, min(r + rows, Sq)) for r in range(0, Sq, rows)]


def _scores(q, k, scale, causal_row0):
    """[B,hk,G,rows,Sk] scaled scores; causal_row0 (None: no mask) is the first row's index in a causal
    block (Sq == Sk: row i sees keys 0..i)."""
    s = torch.matmul(_grouped(q, k.shape[1]), k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal_row0 is not None:
        rows = torch.arange(causal_row0, causal_row0 + s.shape[-2], device=s.device)
        s = s.masked_fill(torch.arange(s.shape[-1], device=s.device) > rows.unsqueeze(-1), float("-inf"))
    return s


def _block_forward(q, k, v, scale, causal):
    """Attention of q [B,h,Sq,dqk] to one block k [B,hk,Sk,dqk], v [B,hk,Sk,dv]: (out [B,h,Sq,dv], lse [B,h,Sq])."""
    outs, lses = [], []
    for r0, r1 in _row_pieces(q, k.shape[-2]):
        s = _scores(q[..., r0:r1, :], k, scale, r0 if causal else None)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2)))
        lses.append(lse)
    B, h, Sq = q.shape[:3]
    return torch.cat(outs, dim=-2).reshape(B, h, Sq, -1), torch.cat(lses, dim=-1).reshape(B, h, Sq)


def _block_backward(q, k, v, dout, lse, delta, scale, causal):
    """Gradients (dq, dk, dv) of one block of `_block_forward`, given the merged output's lse and
    delta = rowsum(dout * out) (flash attention's backward)."""
    hk = k.shape[1]
    dqs, dk, dv = [], 0, 0
    for r0, r1 in _row_pieces(q, k.shape[-2]):
        qr = q[..., r0:r1, :]
        p = torch.exp(_scores(qr, k, scale, r0 if causal else None) - _grouped(lse[..., r0:r1, None], hk))
        do = _grouped(dout[..., r0:r1, :], hk)
        dv = dv + torch.einsum("bkgqs,bkgqd->bksd", p, do)
        ds = p * (torch.matmul(do, v.unsqueeze(2).transpose(-1, -2)) - _grouped(delta[..., r0:r1, None], hk))
        dqs.append(torch.matmul(ds, k.unsqueeze(2)).mul_(scale).reshape(qr.shape))
        dk = dk + torch.einsum("bkgqs,bkgqd->bksd", ds, _grouped(qr, hk)).mul_(scale)
    return torch.cat(dqs, dim=-2), dk, dv


def _merge(out, lse, out_b, lse_b) -> None:
    """out, lse (views of the accumulators) := the softmax-weighted merge with a block's partial result."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


def _steps(group: Group):
    """(step, kind) per ring step: "local" (causal), "early" (a lower rank's block: its first chunk to
    every query) or "late" (a higher rank's block: all of it to the second query chunk)."""
    n, g = group.size, group.rank
    for t in range(n):
        j = (g - t) % n
        yield t, "local" if t == 0 else "early" if j < g else "late"


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, group):
        acc = torch.promote_types(q.dtype, torch.float32)
        qf, kv = q.to(acc), torch.cat((k, v), dim=-1).to(acc)
        dqk, L = k.shape[-1], q.shape[-2] // 2
        out = lse = None
        for t, kind in _steps(group):
            shift = _Shift(kv, group, _TAG_KV) if t < group.size - 1 else None
            kt, vt = kv[..., :dqk], kv[..., dqk:]
            if kind == "local":
                out, lse = _block_forward(qf, kt, vt, scale, causal=True)
            elif kind == "early":
                _merge(out, lse, *_block_forward(qf, kt[..., :L, :], vt[..., :L, :], scale, causal=False))
            else:
                _merge(out[..., L:, :], lse[..., L:], *_block_forward(qf[..., L:, :], kt, vt, scale, causal=False))
            if shift is not None:
                kv = shift.wait()
        ctx.scale, ctx.group = scale, group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        acc = out.dtype
        qf, dof = q.to(acc), dout.to(acc)
        delta = (dof * out).sum(-1)
        kv = torch.cat((k, v), dim=-1).to(acc)
        dqk, L = k.shape[-1], q.shape[-2] // 2
        dq = torch.zeros_like(qf)
        dkv_shift = None
        for t, kind in _steps(group):
            kv_shift = _Shift(kv, group, _TAG_KV) if t < group.size - 1 else None
            kt, vt = kv[..., :dqk], kv[..., dqk:]
            dkv = torch.zeros_like(kv)
            if kind == "local":
                dq_b, dk_b, dv_b = _block_backward(qf, kt, vt, dof, lse, delta, scale, causal=True)
                dq += dq_b
                dkv[..., :dqk], dkv[..., dqk:] = dk_b, dv_b
            elif kind == "early":
                dq_b, dk_b, dv_b = _block_backward(qf, kt[..., :L, :], vt[..., :L, :], dof, lse, delta, scale, False)
                dq += dq_b
                dkv[..., :L, :dqk], dkv[..., :L, dqk:] = dk_b, dv_b
            else:
                dq_b, dk_b, dv_b = _block_backward(qf[..., L:, :], kt, vt, dof[..., L:, :], lse[..., L:],
                                                   delta[..., L:], scale, False)
                dq[..., L:, :] += dq_b
                dkv[..., :dqk], dkv[..., dqk:] = dk_b, dv_b
            if dkv_shift is not None:  # what the ranks before added for this block
                dkv += dkv_shift.wait()
            dkv_shift = _Shift(dkv, group, _TAG_DKV)
            if kv_shift is not None:
                kv = kv_shift.wait()
        dkv = dkv_shift.wait()  # this rank's own block, back home with every rank's contribution
        return dq.to(q.dtype), dkv[..., :dqk].to(k.dtype), dkv[..., dqk:].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: Group) -> torch.Tensor:
    """Causal attention of this ring rank's q [B,h,2L,dqk] over the whole sequence's keys, from its
    k [B,hk,2L,dqk], v [B,hk,2L,dv] (h a multiple of hk) in the two-chunk layout of `group`.
    Returns [B,h,2L,dv]; collective over `group` in forward and backward."""
    S_local = q.shape[-2]
    if S_local % 2 or k.shape[-2] != S_local or v.shape[-2] != S_local:
        raise ValueError(f"ring attention: q, k, v must hold this rank's two equal chunks, got {S_local}, "
                         f"{k.shape[-2]} and {v.shape[-2]} positions")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
    if group.size == 1:
        raise ValueError("ring attention needs a ring of at least 2 ranks")
    return _RingAttention.apply(q, k, v, scale, group)
