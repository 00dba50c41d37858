"""transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py (fake):
`DotProductAttention` with TE's signature and forward asserts; unfused math (fp32 softmax, any
float dtype, as TE's unfused backend). Masks: "no_mask", "causal" (top-left diagonal, TE's meaning
when seqlen_q != seqlen_kv) and "causal_bottom_right". Not kept: the CUDA-tensor assert."""

from typing import Optional, Tuple, Union

import torch
from torch import nn

AttnMaskTypes = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                 "padding_causal_bottom_right", "arbitrary")


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None, bottom_right_diagonal: Optional[bool] = None,
                 sequence_parallel: bool = False, tp_size: int = 1, get_rng_state_tracker=None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self", cp_group=None,
                 cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False, name: Optional[str] = None) -> None:
        super().__init__()
        if attention_dropout:
            raise NotImplementedError("the TE fake implements attention without dropout")
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = (
            kv_channels if isinstance(kv_channels, tuple) else (kv_channels, kv_channels))
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups_per_partition = num_gqa_groups or num_attention_heads
        assert num_attention_heads % self.num_gqa_groups_per_partition == 0, \
            "The number of attention heads must be divisible by the number of GQA groups!"
        self.qkv_format, self.attn_mask_type, self.bottom_right_diagonal = qkv_format, attn_mask_type, bottom_right_diagonal
        self.softmax_scale = softmax_scale if softmax_scale is not None else \
            self.hidden_size_per_attention_head_k ** -0.5

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                bottom_right_diagonal=None, checkpoint_core_attention: bool = False, **unused):
        q, k, v = query_layer, key_layer, value_layer
        assert q.dtype == k.dtype and q.dtype == v.dtype, "Queries, keys and values must have the same data type!"
        assert k.shape[:-1] == v.shape[:-1], \
            "Keys and values must have the same batch size, sequence length and number of heads!"
        assert q.shape[-1] == k.shape[-1], "Queries and keys must have the same head dimension!"
        assert q.shape[-1] == self.hidden_size_per_attention_head_k, \
            f"Keys have head_dim = {q.shape[-1]}, but expected head_dim = {self.hidden_size_per_attention_head_k}!"
        assert v.shape[-1] == self.hidden_size_per_attention_head_v, \
            f"Values have head_dim = {v.shape[-1]}, but expected head_dim = {self.hidden_size_per_attention_head_v}!"
        assert k.shape[-2] == self.num_gqa_groups_per_partition, \
            f"Keys and values must have num_gqa_group = {self.num_gqa_groups_per_partition} heads! Found {k.shape[-2]}."
        mask = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        assert mask in AttnMaskTypes, f"Attention mask type {mask} is not supported!"
        if mask not in ("no_mask", "causal", "causal_bottom_right"):
            raise NotImplementedError(f"the TE fake implements no_mask / causal / causal_bottom_right, not {mask}")
        fmt = qkv_format or self.qkv_format
        assert fmt in ["sbhd", "bshd", "thd"], "DotProductAttention only supports qkv_format = {'sbhd', 'bshd', 'thd'}!"
        if fmt == "thd":
            raise NotImplementedError("the TE fake implements sbhd and bshd")
        assert all(len(x.shape) == 4 for x in (q, k, v)), f"Queries, keys and values must be 4D tensors when {fmt=}!"
        if fmt == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        B, Sq, h, _ = q.shape
        Sk, g = k.shape[1], h // k.shape[2]
        qf = q.float().transpose(1, 2)
        kf = k.float().transpose(1, 2).repeat_interleave(g, 1)
        vf = v.float().transpose(1, 2).repeat_interleave(g, 1)
        scores = qf @ kf.transpose(-1, -2) * self.softmax_scale
        if mask != "no_mask":
            shift = Sk - Sq if mask == "causal_bottom_right" else 0
            i, j = torch.arange(Sq).unsqueeze(1), torch.arange(Sk).unsqueeze(0)
            scores = scores.masked_fill(j > i + shift, float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ vf).transpose(1, 2).to(q.dtype)  # [B, Sq, h, dv]
        out = out.reshape(B, Sq, h * v.shape[-1])
        return out.transpose(0, 1).contiguous() if fmt == "sbhd" else out
