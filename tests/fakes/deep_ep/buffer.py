"""`deep_ep.Buffer` (deep_ep/buffers/legacy.py): layout, intranode dispatch / combine over gloo, and the
low-latency methods (low_latency.py). Host checks as in csrc/legacy/buffer.hpp, in its order."""

import os
import weakref
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from deep_ep import low_latency
from deep_ep.config import (NUM_BUFFER_ALIGNMENT_BYTES, NUM_MAX_LOCAL_EXPERTS, NUM_MAX_NVL_PEERS,
                            NUM_MAX_RDMA_PEERS, Config, ep_assert, get_low_latency_rdma_size_hint)
from deep_ep.event import EventHandle, EventOverlap

_LIVE: "weakref.WeakSet[Buffer]" = weakref.WeakSet()
NUM_MAX_TOPK = 32  # intranode kernels: EP_DEVICE_ASSERT(num_topk <= 32)


def live_buffers() -> list:
    """Fake only: the Buffers alive in this process."""
    return list(_LIVE)


def poison_(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # NaN in E4M3
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-7777)
    return t


def deliver(results: list, async_finish: bool):
    """Outputs and their event: valid now, or poisoned until the event is waited on."""
    if not async_finish:
        return results, EventOverlap(None)
    outs = [None if r is None else poison_(torch.empty_like(r)) for r in results]

    def publish():
        for o, r in zip(outs, results):
            if o is not None:
                o.copy_(r)
    return outs, EventOverlap(EventHandle(publish), tuple(o for o in outs if o is not None))


class _Runtime:
    def __init__(self, rank: int, num_ranks: int) -> None:
        self.rank, self.num_ranks = rank, num_ranks

    def get_num_rdma_ranks(self) -> int:
        return max(1, self.num_ranks // NUM_MAX_NVL_PEERS)

    def get_rdma_rank(self) -> int:
        return self.rank // NUM_MAX_NVL_PEERS

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self.rank % NUM_MAX_NVL_PEERS if global_ else 0

    def is_available(self) -> bool:
        return True


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None) -> None:
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = low_latency_mode, explicitly_destroy, enable_shrink
        R = self.group_size
        ep_assert(num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0, "num_nvl_bytes % 128 == 0")
        ep_assert(num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0, "num_rdma_bytes % 128 == 0")
        ep_assert(0 <= self.rank < R and (R <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode),
                  "rank < num_ranks <= 160 (or low-latency mode)")
        ep_assert(R < NUM_MAX_NVL_PEERS or R % NUM_MAX_NVL_PEERS == 0, "num_ranks < 8 or num_ranks % 8 == 0")
        if num_rdma_bytes > 0:
            ep_assert(R > NUM_MAX_NVL_PEERS or low_latency_mode, "RDMA bytes need > 8 ranks or low-latency mode")
        ep_assert(R <= NUM_MAX_NVL_PEERS, "fake: internode (more than 8 ranks) is not emulated")
        self.runtime = _Runtime(self.rank, R)
        ids = [None] * R
        dist.all_gather_object(ids, self.rank, group)  # device ids / IPC handles: construction is collective
        if self.runtime.get_num_rdma_ranks() > 1 or low_latency_mode:
            assert num_qps_per_rank > 0
            self.nvshmem_qp_depth = int(os.environ.get('NVSHMEM_QP_DEPTH', '1024'))
        self.num_qps_per_rank = num_qps_per_rank
        self._calls = 0  # low-latency arrival orders differ from call to call
        _LIVE.add(self)

    def destroy(self):
        assert self.explicitly_destroy, '`explicitly_destroy` flag must be set'
        self.runtime = None

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        config_map = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                      24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                      96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                      160: (28, 720, 12, 128)}
        assert num_ranks in config_map, f'Unsupported number of EP ranks: {num_ranks}'
        return Config(Buffer.num_sms, *config_map[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        config_map = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                      24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                      96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
        assert num_ranks in config_map, f'Unsupported number of EP ranks: {num_ranks}'
        return Config(Buffer.num_sms, *config_map[num_ranks])

    # ---- layout -------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        ep_assert(topk_idx.dim() == 2, "topk_idx.dim() == 2")
        ep_assert(topk_idx.is_contiguous(), "topk_idx.is_contiguous()")
        ep_assert(num_experts > 0, "num_experts > 0")
        ep_assert(topk_idx.dtype == torch.int64, "topk_idx dtype == topk_idx_t")
        if allocate_on_comm_stream:
            ep_assert(previous_event is not None and async_finish, "previous_event and async")
        R = self.group_size
        L = num_experts // R
        valid = topk_idx >= 0
        safe = topk_idx.clamp_min(0)
        per_expert = torch.zeros(num_experts, dtype=torch.int32)
        per_expert.index_add_(0, safe.reshape(-1), valid.reshape(-1).to(torch.int32))
        in_rank = torch.zeros(topk_idx.shape[0], R, dtype=torch.bool)
        in_rank[torch.arange(topk_idx.shape[0]).unsqueeze(1).expand_as(safe)[valid], (safe // L)[valid]] = True
        per_rank = in_rank.sum(0, dtype=torch.int32)
        (per_rank, per_expert, in_rank), event = deliver([per_rank, per_expert, in_rank], async_finish)
        return per_rank, None, per_expert, in_rank, event

    # ---- dispatch -----------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
        wire = send.view(torch.uint8) if send.dtype == torch.float8_e4m3fn else send
        recv = wire.new_empty((sum(recv_splits), *wire.shape[1:]))
        dist.all_to_all_single(recv, wire.contiguous(), recv_splits, send_splits, group=self.group)
        return recv.view(send.dtype)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        config = self.get_dispatch_config(self.group_size) if config is None else config
        assert num_worst_tokens == 0, "fake: num_worst_tokens is not emulated"
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        R, me = self.group_size, self.rank
        ep_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, _ = handle
        else:
            assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
            ep_assert(num_tokens_per_expert.dtype == torch.int32 and num_tokens_per_rank.dtype == torch.int32,
                      "num_tokens_per_expert/rank are int32")
        ep_assert(is_token_in_rank.dtype == torch.bool, "is_token_in_rank.scalar_type() == kBool")
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        ep_assert(x.shape[1] * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        ep_assert(is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous(), "is_token_in_rank 2-D contiguous")
        ep_assert(tuple(is_token_in_rank.shape) == (x.shape[0], R), "is_token_in_rank is [num_tokens, num_ranks]")
        num_experts = 0
        if handle is None:
            num_experts = num_tokens_per_expert.shape[0]
            ep_assert(num_experts % R == 0, "num_tokens_per_expert.size(0) % num_ranks == 0")
            ep_assert(num_experts // R <= NUM_MAX_LOCAL_EXPERTS, "num_local_experts <= 1024")
            ep_assert(num_tokens_per_rank.shape == (R,), "num_tokens_per_rank.size(0) == num_ranks")
        num_topk = 0
        ep_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
        if topk_idx is not None:
            num_topk = topk_idx.shape[1]
            ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D contiguous")
            ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights 2-D contiguous")
            ep_assert(topk_idx.shape[0] == x.shape[0] == topk_weights.shape[0], "num_tokens == topk rows")
            ep_assert(num_topk == topk_weights.shape[1], "num_topk == topk_weights.size(1)")
            ep_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == kFloat32")
        num_scales = 0
        if x_scales is not None:
            ep_assert(x.element_size() == 1, "x.element_size() == 1")
            ep_assert(x_scales.dtype in (torch.float32, torch.int32), "x_scales float or int")
            ep_assert(x_scales.dim() == 2 and x_scales.shape[0] == x.shape[0], "x_scales is [num_tokens, num_scales]")
            num_scales = x_scales.shape[1]
        if allocate_on_comm_stream:
            ep_assert(previous_event is not None and async_finish, "previous_event and async")
        channels, C = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        ep_assert(R * R * 4 + channels * R * 4 * 4 + channels * R * C * (x.shape[1] * x.element_size() + 4 + num_topk * 8
                  + num_topk * 4 + 4 * num_scales) <= self.num_nvl_bytes, "dispatch fits num_nvl_bytes")
        ep_assert(num_topk <= NUM_MAX_TOPK, "(device) num_topk <= 32")
        if previous_event is not None and previous_event.event is not None:
            previous_event.current_stream_wait()

        # Rows to each destination in token order; received rows grouped by source rank, token order.
        send_tok = [torch.nonzero(is_token_in_rank[:, d]).flatten() for d in range(R)]
        send_splits = [len(t) for t in send_tok]
        order = torch.cat(send_tok)
        if handle is None:
            counts = torch.tensor(send_splits, dtype=torch.int64)
            ep_assert(counts.tolist() == num_tokens_per_rank.tolist(), "num_tokens_per_rank matches is_token_in_rank")
            table = [torch.empty_like(counts) for _ in range(R)]
            dist.all_gather(table, counts, group=self.group)
            rank_prefix_matrix = torch.stack(table).cumsum(0).to(torch.int32)  # [src, dst], prefix over sources
        column = rank_prefix_matrix[:, me].tolist()
        recv_splits = [column[0]] + [column[s] - column[s - 1] for s in range(1, R)]
        recv_x = self._exchange(x.index_select(0, order), send_splits, recv_splits)
        recv_scales = None if x_scales is None else self._exchange(x_scales.index_select(0, order), send_splits, recv_splits)
        if handle is not None:
            (recv_x, recv_scales), event = deliver([recv_x, recv_scales], async_finish)
            return (recv_x, recv_scales) if x_scales is not None else recv_x, None, None, None, None, event

        L = num_experts // R
        recv_src_idx = self._exchange(order.to(torch.int32), send_splits, recv_splits)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            dst = torch.cat([torch.full((n,), d) for d, n in enumerate(send_splits)])
            sel = topk_idx.index_select(0, order)
            local = sel - (dst * L).unsqueeze(1)
            mine = (sel >= 0) & (local >= 0) & (local < L)
            recv_topk_idx = self._exchange(torch.where(mine, local, -1), send_splits, recv_splits)
            w = topk_weights.index_select(0, order)
            recv_topk_weights = self._exchange(torch.where(mine, w, 0.0), send_splits, recv_splits)
        per_expert = self._exchange(num_tokens_per_expert.view(R, L).to(torch.int64), [1] * R, [1] * R).sum(0)
        counts_list = [-(-int(c) // expert_alignment) * expert_alignment for c in per_expert.tolist()]
        channel_prefix = torch.zeros(R, channels, dtype=torch.int32)
        send_head = torch.full((x.shape[0], R), -1, dtype=torch.int32)
        for d, toks in enumerate(send_tok):
            send_head[toks, d] = torch.arange(len(toks), dtype=torch.int32)
        new_handle = (rank_prefix_matrix, channel_prefix, channel_prefix.clone(), recv_src_idx, is_token_in_rank, send_head)
        (recv_x, recv_scales, recv_topk_idx, recv_topk_weights), event = deliver(
            [recv_x, recv_scales, recv_topk_idx, recv_topk_weights], async_finish)
        return ((recv_x, recv_scales) if x_scales is not None else recv_x, recv_topk_idx, recv_topk_weights,
                counts_list, new_handle, event)

    # ---- combine ------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        config = self.get_combine_config(self.group_size) if config is None else config
        rank_prefix_matrix, _, _, src_idx, is_recv_token_in_rank, send_head = handle
        bias_0, bias_1 = (bias, None) if isinstance(bias, torch.Tensor) else (bias or (None, None))
        R, me = self.group_size, self.rank
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        ep_assert(src_idx.dtype == torch.int32 and send_head.dtype == torch.int32, "src_idx/send_head int32")
        ep_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        ep_assert(src_idx.shape[0] == x.shape[0], "src_idx.size(0) == num_tokens")
        ep_assert(send_head.shape[1] == R, "send_head.size(1) == num_ranks")
        ep_assert(x.shape[1] * x.element_size() % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0")
        if allocate_on_comm_stream:
            ep_assert(previous_event is not None and async_finish, "previous_event and async")
        if topk_weights is not None:
            ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights 2-D contiguous")
            ep_assert(topk_weights.shape[0] == x.shape[0], "topk_weights.size(0) == num_tokens")
            ep_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == kFloat32")
        T = send_head.shape[0]
        for b in (bias_0, bias_1):
            if b is not None:
                ep_assert(b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype and tuple(b.shape) == (T, x.shape[1]),
                          "bias is [num_recv_tokens, hidden] of x's dtype")
        ep_assert(x.dtype == torch.bfloat16, "SWITCH_TYPES: Unsupported type (combine is bfloat16 only)")
        if previous_event is not None and previous_event.event is not None:
            previous_event.current_stream_wait()
        column = rank_prefix_matrix[:, me].tolist()
        back_splits = [column[0]] + [column[s] - column[s - 1] for s in range(1, R)]
        sent = [int(n) for n in is_recv_token_in_rank.sum(0).tolist()]
        combined = torch.zeros(T, x.shape[1], dtype=torch.float32)
        back = self._exchange(x, back_splits, sent)
        tokens = [torch.nonzero(is_recv_token_in_rank[:, d]).flatten() for d in range(R)]
        dst_order = torch.cat(tokens)
        combined.index_add_(0, dst_order, back.float())  # destination ranks in order, fp32
        for b in (bias_0, bias_1):
            if b is not None:
                combined += b.float()
        combined_w = None
        if topk_weights is not None:
            back_w = self._exchange(topk_weights, back_splits, sent)
            combined_w = torch.zeros(T, topk_weights.shape[1], dtype=torch.float32).index_add_(0, dst_order, back_w)
        (combined, combined_w), event = deliver([combined.to(x.dtype), combined_w], async_finish)
        return combined, combined_w, event

    # ---- low-latency mode (low_latency.py) ------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        ep_assert(self.low_latency_mode, "low_latency_mode")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> \
            Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        return low_latency.dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                    round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2
        return low_latency.combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, combine_wait_recv_cost_stats)
