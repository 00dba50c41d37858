"""The switches whose cost is communication only: ZeRO stage (parallel.zero_stage) and the context-parallel
exchange (parallel.cp_comm_type): which layouts can use them, and the time they expose.

ZeRO-1 reduce-scatters the gradients once per step (behind the last backward) and all-gathers the
parameters once (behind the first forward); ZeRO-2 reduce-scatters after every micro-batch (parallel/zero.py:
m times the traffic, each behind its own backward); ZeRO-3 (FSDP2, data parallel only) also all-gathers each
layer's parameters before its forward and again before its backward, per micro-batch. CP: allgather gathers
K/V (MLA: the latent) and waits for it; p2p passes K/V blocks around a ring behind the attention core;
a2a (Ulysses) exchanges q, k, v and the output between sequence and head sharding, exposed; a2a+p2p does
the a2a inside the NVLink domain and the ring across. Design notes: docs/planning.md.
"""

from __future__ import annotations

from moetron.config import ModelConfig
from moetron.plan.candidate import Candidate, Pruned


def cp_split(c: ModelConfig, cand: Candidate, per_node: int) -> tuple[int, int]:
    """(a2a, p2p) sizes of the CP group for `cand.cp_comm_type` (a2a+p2p: the largest a2a group inside
    the NVLink domain whose size fits the heads, parallel.hierarchical_cp = [a2a, p2p])."""
    kind, cp = cand.cp_comm_type, cand.cp
    if kind == "a2a":
        return cp, 1
    if kind != "a2a+p2p":
        return 1, cp
    inner = [d for d in range(2, cp) if cp % d == 0 and d * cand.tp <= per_node and _heads_fit(c, cand.tp, d)]
    if not inner:
        raise Pruned(f"cp_comm_type=a2a+p2p with cp={cp}: no a2a group size in 2..{cp // 2} divides cp, the heads "
                     f"per tp rank, and fits one NVLink domain ({per_node} GPUs) with tp={cand.tp}")
    return inner[-1], cp // inner[-1]


def _heads_fit(c: ModelConfig, tp: int, a2a: int) -> bool:
    """parallel/config.py: a2a divides the query heads per tp rank, and divides the kv heads or is a multiple."""
    heads = c.num_attention_heads // tp
    if heads % a2a:
        return False
    if c.attention_type != "gqa":
        return True
    kv = c.num_kv_heads // tp if c.num_kv_heads % tp == 0 else 1
    return kv % a2a == 0 or a2a % kv == 0


def check_zero_and_cp(c: ModelConfig, cand: Candidate, dp: int, per_node: int) -> None:
    """Raise Pruned where parallel/config.py would refuse the switch, or where it would change nothing."""
    if cand.zero_stage == 3 and (cand.tp, cand.cp, cand.ep, cand.etp, cand.pp) != (1, 1, 1, 1, 1):
        raise Pruned("zero_stage=3 (FSDP2) runs data parallel only (tp=cp=ep=pp=1)")
    if cand.zero_stage in (2, 3) and dp * cand.cp == 1:
        raise Pruned(f"zero_stage={cand.zero_stage} with one data-parallel rank shards nothing")
    if cand.cp_comm_type != "allgather" and cand.cp == 1:
        raise Pruned(f"cp_comm_type={cand.cp_comm_type} with cp=1")
    if cand.cp_comm_type == "a2a" and not _heads_fit(c, cand.tp, cand.cp):
        raise Pruned(f"cp_comm_type=a2a: cp={cand.cp} does not fit the heads per tp rank")
    if cand.cp > 1:
        cp_split(c, cand, per_node)


def cp_time(c: ModelConfig, cand: Candidate, T: int, b: int, core: float, per_node: int, link) -> tuple[float, float]:
    """Exposed CP communication of one layer and micro-batch: (forward, backward). `link(size, stride)` is
    the bytes/s of a group (plan/cost.py `group_link`); `core` the forward attention core's time."""
    cp, tp, h = cand.cp, cand.tp, c.num_attention_heads // cand.tp
    if cp == 1:
        return 0.0, 0.0
    if c.attention_type == "gqa":
        qk = v = c.head_dim
        kv_heads = c.num_kv_heads // tp if c.num_kv_heads % tp == 0 else 1
        kv = kv_heads * (qk + v)
        latent = kv
    else:
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        kv_heads, kv = h, h * (qk + v)
        latent = c.kv_lora_rank + c.qk_rope_head_dim
    if cand.cp_comm_type == "allgather":  # gathered before the core, its gradient reduce-scattered after
        t = T * latent * b * (cp - 1) / link(cp, tp)
        return t, t
    a2a, p2p = cp_split(c, cand, per_node)
    exposed = 0.0
    if a2a > 1:  # q, k, v in and the output back, each [T, width] re-sharded over a2a ranks
        width = h * qk + kv_heads * (qk + v) + h * v
        exposed = T * width * b * (a2a - 1) / a2a / link(a2a, tp)
    if p2p == 1:
        return exposed, exposed
    ring = T * kv * b * (p2p - 1) / link(p2p, tp * a2a)  # K/V blocks (the heads this a2a rank holds x a2a tokens)
    return exposed + max(0.0, ring - core), exposed + max(0.0, 2 * ring - 2.5 * core)  # backward: K/V and dK/dV


def dp_exposed(zero: int, m: int, chunks: int, F: float, B: float, W: float, reduce: float, gather: float,
               overlap_reduce: bool = True) -> float:
    """Data-parallel time not hidden behind compute for one step: `reduce` (fp32 gradients reduce-scattered)
    and `gather` (parameters all-gathered) are one full pass over this rank's parameters; F, B, W one
    micro-batch of one chunk. overlap_reduce=False (Megatron's overlap_grad_reduce off): ZeRO-1's
    reduce-scatter runs after the last backward, all of it exposed."""
    if not overlap_reduce and zero == 1:
        return max(0.0, gather - F * chunks) + reduce
    if zero == 3:
        return m * (max(0.0, gather - F) + max(0.0, gather + reduce - B - W))
    per_step = max(0.0, gather - F * chunks)
    if zero == 2:
        return per_step + m * max(0.0, reduce - (B + W) * chunks)
    return per_step + max(0.0, reduce - (B + W) * chunks)
