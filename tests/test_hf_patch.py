"""`moetron.integrations.transformers.patch` against the unpatched transformers model (the reference).

Each family builds a tiny random transformers model whose weights are re-drawn with std
fan_in**-0.5 (router logits O(1), so routing really depends on them; the DeepSeek expert bias
non-zero, as transformers initialises it to zeros), deep-copies it as the reference, patches the
original and compares: logits, loss with the router aux loss, router logits, and the gradient of
every parameter, in fp32. Also checked: the patched model holds the very same Parameter objects
(no copies: same count, same data_ptr), `state_dict` keys and values are unchanged, and a
`save_pretrained` of the patched model loads into the unpatched class with the same logits.

The EP test runs 2 gloo processes, each feeding different tokens through the patched model with
its experts sharded over the world group; the objective is the sum of every rank's loss, so each
rank's logits and its non-expert gradients equal the reference's on the same tokens, and each
expert slice's gradient equals the reference's summed over ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM,
    Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

from dist_utils import run_distributed  # noqa: E402
from moetron import MoELayer  # noqa: E402
import moetron.integrations.transformers as hf  # noqa: E402

VOCAB, BATCH, SEQ = 61, 2, 12
RTOL = 1e-5
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=40, router_aux_loss_coef=0.05, max_position_embeddings=64)

FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
                       num_experts_per_tok=3, norm_topk_prob=False)),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM,
                    dict(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
                         num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                         n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16,
                         q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.1)),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else noise * p.shape[-1] ** -0.5)
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for b in biases:
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    assert (family == "deepseek_v3") == bool(biases)
    return model.train()  # train mode: Mixtral's router jitter is on


def input_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(model, ids, seed: int):
    torch.manual_seed(seed)  # the same jitter noise for the patched and the reference model
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out


def moe_blocks(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in hf.SUPPORTED_BLOCKS]


def check_same(out, ref, params: dict, ref_params: dict, expert_grad=None) -> None:
    """Logits, loss, aux loss, router logits, and every gradient (`expert_grad` maps the reference's)."""
    assert rel_err(out.logits, ref.logits) < RTOL
    assert abs(out.loss.item() - ref.loss.item()) < RTOL * abs(ref.loss.item())
    # transformers 5.17's DeepSeek-V3 returns neither (a plain CausalLMOutputWithPast); 5.24 returns both
    if getattr(ref, "aux_loss", None) is not None:
        assert abs(out.aux_loss.item() - ref.aux_loss.item()) < RTOL * abs(ref.aux_loss.item())
    if hasattr(ref, "router_logits"):
        assert len(out.router_logits) == len(ref.router_logits) > 0
        for a, b in zip(out.router_logits, ref.router_logits):
            assert a.dtype == b.dtype and rel_err(a, b) < RTOL
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        g_ref = ref_params[name].grad
        if expert_grad is not None and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            g_ref = expert_grad(name, g_ref)
        assert p.grad is not None and g_ref is not None, name
        assert p.grad.shape == g_ref.shape, name
        assert rel_err(p.grad, g_ref) < RTOL, f"{name}: gradient relative error {rel_err(p.grad, g_ref):.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_matches_transformers(family, tmp_path):
    model = build(family)
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())  # names as transformers has them
    ptrs = {name: p.data_ptr() for name, p in params.items()}
    blocks = moe_blocks(model)
    hf_tensors = [(b.gate.weight, b.experts.gate_up_proj, b.experts.down_proj) for b in blocks]
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    assert hf.patch(model) is model
    layers = [m for m in model.modules() if isinstance(m, hf.HFMoELayer)]
    assert not moe_blocks(model) and len(layers) == len(blocks) > 0
    # Shared, not copied: the same Parameter objects and storage, nothing new to count or optimise.
    assert {id(p) for p in model.parameters()} == {id(p) for p in params.values()}
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in params.values())
    for layer, block, (gate_w, gate_up, down) in zip(layers, blocks, hf_tensors):
        assert layer.router.weight is gate_w and layer.experts.gate_up_proj is gate_up
        assert layer.experts.down_proj is down
        assert layer.router.weight.data_ptr() == ptrs[next(n for n, p in params.items() if p is gate_w)]
        if family == "deepseek_v3":
            assert layer.router.expert_bias is block.gate.e_score_correction_bias
            assert layer.shared_experts is block.shared_experts
        if family == "qwen2_moe":
            assert layer.shared_experts is block.shared_expert and layer.shared_expert_gate is block.shared_expert_gate
    assert all(p.data_ptr() == ptrs[n] for n, p in params.items())
    # state_dict: transformers' keys and values.
    state_after = model.state_dict()
    assert sorted(state_after) == sorted(state_before)
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())

    ids = input_ids(1)
    check_same(run(model, ids, seed=5), run(ref, ids, seed=5), params, dict(ref.named_parameters()))

    # An optimizer step moves the transformers parameters themselves.
    before = params[next(n for n in params if n.endswith("mlp.experts.gate_up_proj"))].detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(before, params[next(n for n in params if n.endswith("mlp.experts.gate_up_proj"))])

    # save_pretrained of the patched model loads into the plain transformers class.
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model.eval()
    with torch.no_grad():
        assert rel_err(model(ids).logits, reloaded(ids).logits) < RTOL
    # ... and load_state_dict takes transformers' keys.
    model.load_state_dict(ref.state_dict())
    assert all(p.data_ptr() == ptrs[n] for n, p in params.items())
    assert torch.equal(layers[0].router.weight, ref.get_parameter(
        next(n for n in params if n.endswith("mlp.gate.weight"))))


def test_patch_errors_are_clear():
    model = build("qwen3_moe")
    with pytest.raises(ValueError, match="no MoE block"):
        hf.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    hf.patch(model)
    with pytest.raises(ValueError, match="already patched"):
        hf.patch(model)
    silu_free = build("mixtral")
    for block in moe_blocks(silu_free):
        block.experts.act_fn = torch.nn.GELU()
    state = {k: v.clone() for k, v in silu_free.state_dict().items()}
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        hf.patch(silu_free)
    assert moe_blocks(silu_free) and all(torch.equal(v, state[k]) for k, v in silu_free.state_dict().items())


def test_update_expert_bias_moves_the_transformers_buffer():
    model = build("deepseek_v3")
    bias = moe_blocks(model)[0].gate.e_score_correction_bias
    before = bias.clone()
    hf.patch(model)
    model(input_ids(2))
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.update_expert_bias()
    assert not torch.equal(bias, before)
    assert torch.equal(model.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"], bias)


# --- expert parallel ----------------------------------------------------------------------------
EP_CASES = (("qwen3_moe", "alltoall"), ("deepseek_v3", "alltoall"), ("qwen2_moe", "allgather"), ("mixtral", "flex"))


def _ep_worker(rank: int, world: int) -> bool:
    import torch.distributed as dist

    for family, dispatcher in EP_CASES:
        model = build(family)  # the same weights on every rank
        ref = copy.deepcopy(model)
        params = dict(model.named_parameters())
        full_state = {k: v.clone() for k, v in model.state_dict().items()}
        hf.patch(model, ep_group=dist.group.WORLD, dispatcher=dispatcher)
        E = moe_blocks(ref)[0].experts.num_experts
        local = slice(rank * E // world, (rank + 1) * E // world)
        for layer in (m for m in model.modules() if isinstance(m, hf.HFMoELayer)):
            assert layer.experts.local_experts == range(local.start, local.stop)
            assert layer.experts.gate_up_proj.shape[0] == E // world
        # Experts: this rank's slice only, in storage of its own; the rest is shared as before.
        ids_now = {id(p) for p in model.parameters()}
        assert {n for n, p in params.items() if id(p) not in ids_now} == {
            n for n in params if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}

        ids = input_ids(10 + rank)  # different tokens on each rank
        out, out_ref = run(model, ids, seed=3), run(ref, ids, seed=3)

        def expert_grad(name, g_ref):  # the expert's gradient is the sum over every rank's tokens
            g = g_ref.clone()
            dist.all_reduce(g)
            return g[local]

        by_hf_name = dict(params)  # the experts are new objects: look them up by the same names
        for layer_name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, hf.HFMoELayer)):
            by_hf_name[f"{layer_name}.experts.gate_up_proj"] = layer.experts.gate_up_proj
            by_hf_name[f"{layer_name}.experts.down_proj"] = layer.experts.down_proj
        check_same(out, out_ref, by_hf_name, dict(ref.named_parameters()), expert_grad)

        # Full checkpoints out of a sharded model, and full state dicts into it.
        gathered = hf.full_state_dict(model)
        assert gathered.keys() == full_state.keys()
        assert all(torch.equal(gathered[k], v) for k, v in full_state.items())
        model.load_state_dict(ref.state_dict())
        layer_name, layer = next((n, m) for n, m in model.named_modules() if isinstance(m, hf.HFMoELayer))
        assert torch.equal(layer.experts.gate_up_proj, ref.get_parameter(f"{layer_name}.experts.gate_up_proj")[local])
    return True


def test_expert_parallel_patch_matches_transformers():
    assert run_distributed(_ep_worker, 2, timeout=240) == [True, True]
