"""Model pieces that transformers cannot check for us: MTP, output fields, config errors, seams."""

import math

import pytest
import torch
import torch.nn.functional as F

from moetron import ops
from moetron.config import ModelConfig
from moetron.ops.attention_core import core_attention
from moetron.model.model import MoETransformer
from moetron.model.rope import RotaryEmbedding

DEEPSEEK = dict(family="deepseek_v3", vocab_size=61, hidden_size=32, num_layers=2, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_layers=2)


def _ids(batch=2, seq=10, vocab=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def test_mtp_loss_matches_a_hand_rolled_computation():
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**DEEPSEEK)).eval()
    tokens = _ids()
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 3] = -100
    out = model(inputs, labels=labels)

    # Independent reference: run the layers by hand, then each MTP depth on explicit shifts.
    S = inputs.shape[1]
    rope = model.rotary(torch.arange(S).unsqueeze(0), torch.float32)
    h = model.embed_tokens(inputs)
    for layer in model.layers:
        h = layer(h, rope)
    lm_logits = model.lm_head(model.norm(h))
    valid = labels != -100
    lm = F.cross_entropy(lm_logits[valid], labels[valid])
    torch.testing.assert_close(out.loss, lm, rtol=1e-6, atol=0)
    depth_losses = []
    for k, module in enumerate(model.mtp, start=1):
        # position i sees token t[i+k] and predicts t[i+k+1]; t[j] = tokens[:, j]
        future = torch.zeros_like(inputs)
        target = torch.full_like(inputs, -100)
        for i in range(S):
            if i + k < S + 1:
                future[:, i] = torch.where(labels[:, i + k - 1] >= 0, tokens[:, i + k], 0)
            if i + k < S:
                target[:, i] = labels[:, i + k]
        e = module.enorm(model.embed_tokens(future))
        h = module.eh_proj(torch.cat([e, module.hnorm(h)], -1))
        h = module.layer(h, rope)
        logits = model.lm_head(module.final_norm(h))
        keep = target != -100
        depth_losses.append(F.cross_entropy(logits[keep], target[keep]))
    torch.testing.assert_close(out.mtp_loss, torch.stack(depth_losses).mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.total_loss, out.loss + 0.3 * out.mtp_loss)
    assert out.aux_loss is None and out.num_tokens == int(valid.sum())



@pytest.mark.parametrize("dtype,ignored", [(torch.float32, 0), (torch.float32, 37), (torch.bfloat16, 13), (torch.float32, 64)])
def test_lm_loss_counts_its_labels_on_the_device_with_the_bits_of_an_int_count(dtype, ignored):
    """No host int inside the forward (on a GPU it waits for the whole forward before the backward can be
    queued): the count stays a tensor, and dividing by it gives the loss and gradient of dividing by the int."""
    from moetron.model.model import IGNORE_INDEX, lm_cross_entropy
    from moetron.ops.functional import cross_entropy

    g = torch.Generator().manual_seed(ignored)
    logits = torch.randn(64, 97, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 97, (64,), generator=g)
    labels[torch.randperm(64, generator=g)[:ignored]] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    want = cross_entropy(logits, labels, IGNORE_INDEX) / max(count, 1)
    got, counted = lm_cross_entropy(logits, labels)
    assert isinstance(counted, torch.Tensor) and counted.dim() == 0 and int(counted) == count
    assert torch.equal(got, want) and (got > 0 or count == 0)
    assert torch.equal(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0])
    model = MoETransformer(ModelConfig(**DEEPSEEK))
    tokens = _ids()
    out = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert isinstance(out.token_count, torch.Tensor) and out.num_tokens == 20 and isinstance(out.num_tokens, int)

def test_output_without_labels_and_aux_fields():
    torch.manual_seed(1)
    cfg = ModelConfig(**{**DEEPSEEK, "num_mtp_layers": 0, "aux_loss_type": "seq_aux_loss", "aux_loss_coeff": 0.1})
    model = MoETransformer(cfg)
    tokens = _ids()
    out = model(tokens[:, :-1])
    assert out.logits.shape == (2, 10, 61) and out.loss is None and out.mtp_loss is None
    out = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert set(out.aux_losses) == {"seq_aux_loss"} and out.aux_loss > 0
    assert out.total_loss is out.loss  # aux losses never enter the reported loss


@pytest.mark.parametrize("field,value,message", [
    ("num_experts", 6, "num_groups"),
    ("family", "llama", "family"),
    ("first_k_dense_replace", 5, "first_k_dense_replace"),
    ("top_k", 9, "top_k"),
    ("attention_backend", "magic", "attention_backend"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**DEEPSEEK, field: value})


def test_attention_backends_agree_and_unavailable_ones_fail_clearly():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 12, generator=g)
    k = torch.randn(2, 2, 9, 12, generator=g)  # GQA: 2 kv heads for 4 query heads
    v = torch.randn(2, 2, 9, 8, generator=g)  # MLA-like: v head dim differs
    a = core_attention(q, k, v, 0.3, "sdpa")
    b = core_attention(q, k, v, 0.3, "eager")
    ref = torch.zeros_like(a)
    for head in range(4):
        s = q[:, head] @ k[:, head // 2].transpose(-1, -2) * 0.3
        s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -math.inf)
        ref[:, head] = s.softmax(-1) @ v[:, head // 2]
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="flash_attn"):
        core_attention(q, k, v, 0.3, "flash_attn")


def test_yarn_matches_transformers_rope_init():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
               "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
    hf_cfg = transformers.DeepseekV3Config(hidden_size=32, num_attention_heads=4, qk_rope_head_dim=16,
                                           max_position_embeddings=256, rope_scaling=dict(scaling))
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = RotaryEmbedding(16, 10000.0, scaling, 256)
    torch.testing.assert_close(ours.inv_freq, hf_inv, rtol=0, atol=0)
    assert ours.attention_factor == pytest.approx(hf_factor, rel=1e-12) and ours.attention_factor != 1.0


def test_interleaved_rope_rotates_adjacent_pairs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 3, 4, generator=g)
    angle = torch.randn(3, 2, generator=g)
    cos = torch.cat([angle.cos(), angle.cos()], -1).unsqueeze(0)
    sin = torch.cat([angle.sin(), angle.sin()], -1).unsqueeze(0)
    out = ops.apply_rope(x, cos, sin, interleaved=True)[0, 0]
    for pos in range(3):
        for pair in range(2):
            a, b = x[0, 0, pos, 2 * pair], x[0, 0, pos, 2 * pair + 1]
            c, s = angle[pos, pair].cos(), angle[pos, pair].sin()
            # output is written in halves layout: rotated first elements, then rotated second elements
            torch.testing.assert_close(out[pos, pair], a * c - b * s)
            torch.testing.assert_close(out[pos, 2 + pair], b * c + a * s)


def test_fusion_switch_rejects_unknown_modes():
    with pytest.raises(ValueError, match="fusion mode"):
        ops.set_fusion("triton-magic")
    assert ops.fusion_mode() == "none"


@pytest.mark.slow
def test_compiled_ops_match_reference():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 8, 16, generator=g), torch.randn(16, generator=g)
    gate, up = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    logits, labels = torch.randn(6, 11, generator=g), torch.randint(0, 11, (6,), generator=g)
    ref = (ops.rms_norm(x, w, 1e-6), ops.swiglu(gate, up), ops.cross_entropy(logits, labels))
    ops.set_fusion("compile")
    try:
        out = (ops.rms_norm(x, w, 1e-6), ops.swiglu(gate, up), ops.cross_entropy(logits, labels))
    finally:
        ops.set_fusion("none")
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
