"""`deep_ep.Config` with its asserts and buffer-size hints (csrc/legacy/config.hpp), and the host-assert
helper: DeepEP's `EP_HOST_ASSERT` raises a RuntimeError ("Assertion error"); the fake records each one
in `host_asserts` so tests can prove moetron refused a call before the library's check fired."""

NUM_MAX_NVL_PEERS = 8
NUM_MAX_RDMA_PEERS = 20
NUM_MAX_LOCAL_EXPERTS = 1024
NUM_BUFFER_ALIGNMENT_BYTES = 128
SOURCE_META_BYTES = 8  # internode SourceMeta: two ints
TOPK_IDX_BYTES = 8

host_asserts: list = []


class EPHostAssert(RuntimeError):
    pass


def ep_assert(cond: bool, what: str) -> None:
    if not cond:
        host_asserts.append(what)
        raise EPHostAssert(f"Failed: Assertion error (DeepEP host check) '{what}'")


class Config:
    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int) -> None:
        ep_assert(num_sms >= 0, "num_sms >= 0")
        ep_assert(num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0, "nvl chunks > 0")
        ep_assert(num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "nvl send < recv")
        ep_assert(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0, "rdma chunks > 0")
        rdma_recv = -(-num_max_rdma_chunked_recv_tokens // num_max_rdma_chunked_send_tokens) * num_max_rdma_chunked_send_tokens
        ep_assert(num_max_rdma_chunked_send_tokens < rdma_recv, "rdma send < recv")
        ep_assert(num_max_rdma_chunked_send_tokens <= rdma_recv // 2, "rdma send <= recv / 2")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        ep_assert(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % 8 == 0")
        ep_assert(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0, "num_sms % 2 == 0")
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        per = (self.num_sms // 2) * nvl_ranks
        tokens = self.num_max_nvl_chunked_recv_tokens
        n = per * (2 * rdma_ranks + 3) * 4 + per * tokens * (hidden_bytes + SOURCE_META_BYTES + 128 * TOPK_IDX_BYTES
                                                             + 128 * 4 + 128 * 4)
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        ep_assert(num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % 8 == 0")
        ep_assert(self.num_sms % 2 == 0, "num_sms % 2 == 0")
        per = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        tokens = self.num_max_rdma_chunked_recv_tokens
        n = per * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + per * tokens * 2 * (
            hidden_bytes + SOURCE_META_BYTES + 128 * TOPK_IDX_BYTES + 128 * 4 + 128 * 4 + 16)
        return (n + 127) // 128 * 128


def low_latency_layout_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int) -> int:
    """LowLatencyLayout.total_bytes: two odd/even send, receive and signalling buffers."""
    M, num_scales = num_max_dispatch_tokens_per_rank, hidden // 128
    ep_assert(num_scales * 4 <= hidden, "num_scales * sizeof(float) <= hidden")
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(M * dispatch_msg, num_experts * M * combine_msg)
    recv = max(num_experts * M * dispatch_msg, num_experts * M * combine_msg)
    signal = (num_experts * 4 + 127) // 128 * 128
    return 2 * (send + recv + signal)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    n = low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return (n + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES
