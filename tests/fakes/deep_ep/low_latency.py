"""DeepEP's low-latency dispatch / combine (csrc/legacy/buffer.hpp, csrc/kernels/legacy/internode_ll.cu) on gloo.

Dispatch sends one message per (token, chosen expert) into the expert's [num_ranks, M] slots (slot order
inside a source block is the senders' atomic order), and the receiver packs each source block at an
offset taken with an atomic add, i.e. in ARRIVAL order: both orders are shuffled here, differently on
every call. FP8 casts per 1x128 channels (amax floor 1e-4; scale = 448/amax, or powers of two with
round_scale); scales come back [L, R*M, H/128] in column-major storage. Combine reduces with weights
in fp32 over the top-k slots in order and returns bfloat16.
"""

import torch
import torch.distributed as dist

from deep_ep.config import ep_assert, low_latency_layout_bytes
from deep_ep.event import EventHandle, EventOverlap

SUPPORTED_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # SWITCH_HIDDEN
NUM_MAX_TOPK = 11
FP8_MARGIN, E4M3_MAX = 1e-4, 448.0


def _cast_fp8(x: torch.Tensor, round_scale: bool):
    T, H = x.shape
    blocks = x.float().view(T, H // 128, 128)
    amax = blocks.abs().amax(-1).clamp_min(FP8_MARGIN)
    if round_scale:
        scale_inv = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
        scale = 1.0 / scale_inv
    else:
        scale_inv, scale = amax / E4M3_MAX, E4M3_MAX / amax
    q = (blocks * scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(T, H), scale_inv


def _finish(buffer, outs, results, async_finish, return_recv_hook):
    """Outputs valid at once, or poisoned until the event (async) or the receive hook runs."""
    from deep_ep.buffer import poison_
    if not (async_finish or return_recv_hook):
        for o, r in zip(outs, results):
            o.copy_(r)
        return EventOverlap(None), None
    for o in outs:
        poison_(o)
    handle = EventHandle(lambda: [o.copy_(r) for o, r in zip(outs, results)])
    if return_recv_hook:
        return EventOverlap(None), handle.current_stream_wait
    return EventOverlap(handle, tuple(outs)), None


def dispatch(buffer, x, topk_idx, M, num_experts, recv_stats, wait_stats, use_fp8, round_scale, use_ue8m0,
             async_finish, return_recv_hook):
    R, me = buffer.group_size, buffer.rank
    ep_assert(buffer.low_latency_mode, "low_latency_mode")
    ep_assert(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16, "x is 2-D contiguous bfloat16")
    ep_assert(x.shape[1] % 8 == 0 and x.shape[1] % 128 == 0, "x.size(1) % 128 == 0")
    ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D contiguous")
    ep_assert(x.shape[0] == topk_idx.shape[0] and x.shape[0] <= M, "num_tokens <= num_max_dispatch_tokens_per_rank")
    ep_assert(topk_idx.dtype == torch.int64, "topk_idx dtype == topk_idx_t")
    ep_assert(num_experts % R == 0, "num_experts % num_ranks == 0")
    L, H = num_experts // R, x.shape[1]
    if recv_stats is not None:
        ep_assert(recv_stats.dtype == torch.int32 and recv_stats.shape == (L,), "cumulative stats int32 [L]")
    ep_assert(low_latency_layout_bytes(M, H, R, num_experts) <= buffer.num_rdma_bytes, "layout.total_bytes <= num_rdma_bytes")
    ep_assert(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
    ep_assert((R * M) % 4 == 0, "(num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0 (TMA)")
    if use_fp8:
        ep_assert(H % 512 == 0, "hidden % 512 == 0 (FP8)")
        ep_assert(not use_ue8m0 or round_scale, "UE8M0 requires round_scale")
        assert not use_ue8m0, "fake: UE8M0 scales are not emulated"
    ep_assert(topk_idx.shape[1] <= NUM_MAX_TOPK, "num_topk <= 11")
    ep_assert(H in SUPPORTED_HIDDEN, "SWITCH_HIDDEN: Unsupported hidden")

    # Send buffer [R, L, M] slots; slot order inside each (expert, source) block is the senders' order.
    buffer._calls += 1
    g = torch.Generator().manual_seed(buffer._calls * 7919 + me)
    data, scales = (_cast_fp8(x, round_scale) if use_fp8 else (x, None))
    nb = H // 128
    send_data = torch.zeros(num_experts, M, H, dtype=data.dtype).view(torch.uint8 if use_fp8 else torch.bfloat16)
    send_scales = torch.zeros(num_experts, M, nb)
    send_src = torch.full((num_experts, M), -1, dtype=torch.int32)
    send_count = torch.zeros(num_experts, dtype=torch.int32)
    for e in range(num_experts):
        toks = torch.nonzero((topk_idx == e).any(1)).flatten()
        toks = toks[torch.randperm(len(toks), generator=g)]
        n = len(toks)
        send_data[e, :n] = (data.view(torch.uint8) if use_fp8 else data)[toks]
        if use_fp8:
            send_scales[e, :n] = scales[toks]
        send_src[e, :n] = toks.to(torch.int32)
        send_count[e] = n
    recvd = []
    for t in (send_data, send_scales, send_src, send_count):
        r = torch.empty_like(t)
        dist.all_to_all_single(r, t, group=buffer.group)  # block of expert e goes to rank e // L
        recvd.append(r)
    r_data, r_scales, r_src, r_count = (t.view(R, L, *t.shape[1:]) for t in recvd)

    # Receiver: each local expert packs its source blocks in arrival order.
    packed = torch.empty(L, R * M, H, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    packed_scales = torch.empty(L, nb, R * M).transpose(1, 2)  # column-major, as DeepEP allocates it
    packed_src = torch.empty(L, R * M, dtype=torch.int32)
    layout_range = torch.zeros(L, R, dtype=torch.int64)
    count = torch.zeros(L, dtype=torch.int32)
    from deep_ep.buffer import poison_
    poison_(packed)  # rows past the count are never written
    for j in range(L):
        begin = 0
        for s in torch.randperm(R, generator=g).tolist():
            n = int(r_count[s, j])
            (packed[j].view(torch.uint8) if use_fp8 else packed[j])[begin:begin + n] = r_data[s, j, :n]
            packed_scales[j, begin:begin + n] = r_scales[s, j, :n]
            packed_src[j, begin:begin + n] = r_src[s, j, :n]
            layout_range[j, s] = (begin << 32) | n
            begin += n
        count[j] = begin
    if recv_stats is not None:
        recv_stats += count
    results = [packed, packed_scales, count, packed_src, layout_range]
    outs = [torch.empty_like(packed), torch.empty(L, nb, R * M).transpose(1, 2), torch.empty_like(count),
            torch.empty_like(packed_src), torch.empty_like(layout_range)]
    event, hook = _finish(buffer, outs, results, async_finish, return_recv_hook)
    recv_x = (outs[0], outs[1]) if use_fp8 else outs[0]
    handle = (outs[3], outs[4], M, H, num_experts)
    return recv_x, outs[2], handle, event, hook


def combine(buffer, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook,
            out, wait_stats):
    src_info, layout_range, M, hidden, num_experts = handle
    R = buffer.group_size
    L = num_experts // R
    ep_assert(buffer.low_latency_mode, "low_latency_mode")
    ep_assert(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16, "x is 3-D contiguous bfloat16")
    ep_assert(x.shape[0] == L and x.shape[1] == R * M, "x is [num_local_experts, num_ranks * M, hidden]")
    ep_assert(x.shape[2] % 8 == 0 and x.shape[2] % 128 == 0, "x.size(2) % 128 == 0")
    ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D contiguous")
    ep_assert(topk_idx.shape == topk_weights.shape, "topk_idx and topk_weights shapes match")
    ep_assert(topk_idx.dtype == torch.int64, "topk_idx dtype == topk_idx_t")
    ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights 2-D contiguous")
    ep_assert(topk_weights.shape[0] <= M, "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank")
    ep_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == kFloat32")
    ep_assert(src_info.dim() == 2 and src_info.dtype == torch.int32 and x.shape[0] == src_info.shape[0], "src_info")
    ep_assert(layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (L, R), "layout_range is [L, R] int64")
    ep_assert(low_latency_layout_bytes(M, x.shape[2], R, num_experts) <= buffer.num_rdma_bytes, "layout fits")
    ep_assert(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
    T, H = topk_idx.shape[0], x.shape[2]
    if out is not None:
        ep_assert(out.dim() == 2 and out.is_contiguous() and tuple(out.shape) == (T, H) and out.dtype == x.dtype, "out")
    ep_assert(topk_idx.shape[1] <= NUM_MAX_TOPK, "num_topk <= 11")
    ep_assert(not (zero_copy and use_logfmt), "not (zero_copy and use_logfmt)")
    ep_assert(H in SUPPORTED_HIDDEN, "SWITCH_HIDDEN: Unsupported hidden")
    assert not use_logfmt and not zero_copy, "fake: LogFMT and zero-copy combine are not emulated"

    # Each valid row goes back to slot (global expert, source token) of its source rank.
    send = torch.zeros(R, L, M, H, dtype=torch.bfloat16)
    for j in range(L):
        for s in range(R):
            packed = int(layout_range[j, s])
            begin, n = packed >> 32, packed & 0xFFFFFFFF
            send[s, j, src_info[j, begin:begin + n].long()] = x[j, begin:begin + n]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=buffer.group)
    per_expert = recv.view(num_experts, M, H)  # [expert, my token]
    acc = torch.zeros(T, H)
    for k in range(topk_idx.shape[1]):
        e = topk_idx[:, k]
        rows = per_expert[e.clamp_min(0), torch.arange(T)].float() * topk_weights[:, k:k + 1]
        acc += torch.where((e >= 0).unsqueeze(1), rows, 0.0)
    combined = out if out is not None else torch.empty(T, H, dtype=torch.bfloat16)
    event, hook = _finish(buffer, [combined], [acc.to(torch.bfloat16)], async_finish, return_recv_hook)
    return combined, event, hook
