"""Logits and gradient parity with Hugging Face transformers (the reference; DESIGN.md "Testing").

Each case builds a tiny random model in transformers, re-draws every weight (norm weights around
1, the DeepSeek expert bias non-zero: transformers initialises it to zeros, which would hide a
lost bias), saves it with `save_pretrained` and loads it with `moetron.bridge.from_hf`. The
weights are drawn with std fan_in**-0.5 so attention scores and router logits are O(1): with the
tiny default init (0.02) attention is nearly uniform and RoPE / softmax-scale mistakes would not
show in the logits. Negative controls at the end show that the same comparison does fail when
one RoPE / YaRN / routing option is deliberately loaded wrong.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from moetron.bridge import from_hf  # noqa: E402

VOCAB, BATCH, SEQ = 97, 2, 16
LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4

QWEN = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            router_aux_loss_coef=0.0)
DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1,
                routed_scaling_factor=2.5, max_position_embeddings=64)


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


CASES = {
    "qwen-norm_topk": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen-no_norm-sparse_step2": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),
    "qwen-mlp_only-tied": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True)),
    "ds-qlora-g4k2-dense1": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1)),
    "ds-noqlora-g2k1-dense2-yarn_equal": ("deepseek_v3", dict(q_lora_rank=None, n_group=2, topk_group=1,
                                                              first_k_dense_replace=2, rope_parameters=yarn(1.0, 1.0))),
    "ds-qlora-g1-yarn_unequal-no_interleave": ("deepseek_v3", dict(q_lora_rank=24, n_group=1, topk_group=1,
                                                                   first_k_dense_replace=1, rope_interleave=False,
                                                                   rope_parameters=yarn(0.707, 1.0))),
    "ds-noqlora-g4k1-yarn_unequal-interleave-no_norm": ("deepseek_v3", dict(
        q_lora_rank=None, n_group=4, topk_group=1, first_k_dense_replace=1, rope_interleave=True,
        norm_topk_prob=False, rope_parameters=yarn(1.0, 0.707))),
    # head dims the C++ attention takes (q/k 16, v 8), interleaved RoPE, groups: every C++ kernel's case
    "ds-qlora-g4k2-interleave-v8": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2, v_head_dim=8,
                                                        first_k_dense_replace=1, rope_interleave=True)),
}


def build_hf(family: str, overrides: dict, seed: int):
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**QWEN, **overrides)
        model_cls = Qwen3MoeForCausalLM
    else:
        cfg = DeepseekV3Config(**{**DEEPSEEK, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}})
        model_cls = DeepseekV3ForCausalLM
    cfg._attn_implementation = "eager"
    model = model_cls(cfg)
    randomize_(model, seed)
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1000)
    for _, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else noise * p.shape[-1] ** -0.5)
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for b in biases:
        b.copy_(0.3 * torch.randn(b.shape, generator=g))
    if isinstance(model, DeepseekV3ForCausalLM):
        assert biases and all(b.abs().min() > 0 for b in biases)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case id -> (transformers model, folder written by save_pretrained); built once per module."""
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            family, overrides = CASES[case]
            hf = build_hf(family, overrides, seed=len(cache) + 1).eval()
            folder = tmp_path_factory.mktemp(case.replace("_", ""))
            hf.save_pretrained(folder)
            cache[case] = (hf, folder)
        return cache[case]

    return get


def input_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape == (BATCH, SEQ, VOCAB)
    rel = ((out - ref).norm() / ref.norm()).item()
    max_abs = (out - ref).abs().max().item()
    assert rel < LOGITS_RTOL, f"relative error {rel:.3g}"
    assert max_abs < LOGITS_RTOL * ref.abs().max().item(), f"max abs error {max_abs:.3g}"


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def moetron_logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def hub_keys(folder: Path) -> set[str]:
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys |= set(h.keys())
    return keys


# ---- logits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(saved, case):
    hf, folder = saved(case)
    keys = hub_keys(folder)
    # save_pretrained writes the per-expert hub layout: this case exercises the per-expert import.
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
    assert not any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    model = from_hf(folder)
    if CASES[case][0] == "deepseek_v3":  # transformers saves no MTP weights: built without MTP
        assert len(model.mtp) == 0
    ids = input_ids(1)
    assert_logits_close(moetron_logits(model, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("case", ["qwen-no_norm-sparse_step2", "ds-qlora-g1-yarn_unequal-no_interleave"])
def test_logits_match_from_sharded_save_pretrained(saved, case, tmp_path):
    hf, _ = saved(case)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    ids = input_ids(2)
    assert_logits_close(moetron_logits(from_hf(tmp_path), ids), hf_logits(hf, ids))


@pytest.mark.parametrize("case", ["qwen-norm_topk", "qwen-mlp_only-tied", "ds-qlora-g4k2-dense1",
                                  "ds-qlora-g1-yarn_unequal-no_interleave"])
def test_logits_match_with_fused_expert_checkpoint(saved, case, tmp_path):
    """Experts stored as `mlp.experts.gate_up_proj [E,2I,H]` / `down_proj [E,H,I]` (transformers' in-memory layout)."""
    hf, folder = saved(case)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        del state["lm_head.weight"]  # a tied head is not stored, as in save_pretrained
    fused = [k for k in state if k.endswith("mlp.experts.gate_up_proj")]
    assert fused, "transformers no longer keeps experts fused in memory; build the fused layout by hand"
    E, I, H = hf.config.num_local_experts, hf.config.moe_intermediate_size, hf.config.hidden_size
    for k in fused:
        assert state[k].shape == (E, 2 * I, H)
        assert state[k.replace("gate_up_proj", "down_proj")].shape == (E, H, I)
    assert not any(".experts.0." in k for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    ids = input_ids(3)
    model = from_hf(tmp_path)
    assert_logits_close(moetron_logits(model, ids), hf_logits(hf, ids))
    # Same tensors as from the per-expert checkpoint, bit for bit.
    per_expert = from_hf(folder).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, per_expert[k]), k


# ---- gradients ---------------------------------------------------------------------------------------


def hf_name(moetron_name: str) -> str:
    """The transformers parameter holding the same weight (hub layout, experts fused in memory)."""
    if moetron_name == "lm_head.weight":
        return moetron_name
    return "model." + moetron_name.replace(".mlp.router.weight", ".mlp.gate.weight")


def shifted_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def assert_grad_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, name
    ref_norm = ref.norm().item()
    if ref_norm == 0.0:
        assert got.abs().max().item() == 0.0, f"{name}: transformers gradient is zero, moetron's is not"
        return
    rel = ((got - ref).norm() / ref_norm).item()
    assert rel < GRAD_RTOL, f"{name}: relative gradient error {rel:.3g}"


@pytest.mark.parametrize("case", ["qwen-norm_topk", "qwen-no_norm-sparse_step2", "qwen-mlp_only-tied",
                                  "ds-qlora-g4k2-dense1", "ds-noqlora-g2k1-dense2-yarn_equal",
                                  "ds-qlora-g1-yarn_unequal-no_interleave"])
def test_lm_loss_gradients_match_transformers(saved, case):
    check_gradients(*saved(case))


@pytest.mark.usefixtures("cpp_kernels")
@pytest.mark.parametrize("case", ["qwen-norm_topk", "ds-qlora-g4k2-interleave-v8"])
def test_the_cpp_kernels_match_transformers(saved, case, monkeypatch):
    """Under `train.fusion=cpp` with the C++ permute (what the trainer runs on a CPU): logits and LM-loss
    gradients within the same bounds, and the C++ attention, RoPE and router really ran (DeepSeek: MLA's
    v heads narrower than q/k, interleaved RoPE, the group-limited sigmoid router)."""
    from moetron.dispatch.permute import set_permute_impl
    from moetron.kernels import attention_cpu, fused_router, norm_rope_cpu
    from moetron.ops import set_fusion

    ran = []
    for owner, name in ((attention_cpu.CausalAttention, "apply"), (norm_rope_cpu.RopeFunction, "apply"),
                        (norm_rope_cpu.RMSNormRopeFunction, "apply"), (fused_router.TopKSigmoid, "apply"),
                        (fused_router.TopKSoftmax, "apply")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=owner.__name__: ran.append(_name) or _real(*a))
    set_fusion("cpp")  # conftest.py restores the defaults
    set_permute_impl("cpp")
    hf, folder = saved(case)
    assert_logits_close(moetron_logits(from_hf(folder), input_ids(5)), hf_logits(hf, input_ids(5)))
    check_gradients(hf, folder)
    want = ({"CausalAttention", "RMSNormRopeFunction", "TopKSoftmax"} if case.startswith("qwen") else
            {"CausalAttention", "RopeFunction", "TopKSigmoid"})
    assert set(ran) == want


def check_gradients(hf, folder) -> None:
    """moetron's LM loss equals transformers' and every parameter's gradient is within GRAD_RTOL."""
    hf = copy.deepcopy(hf).train()  # a private copy: gradients must not leak into other tests
    model = from_hf(folder).train()
    ids = input_ids(4)
    labels = torch.cat((ids[:, 1:], torch.full((BATCH, 1), -100)), dim=1)  # pre-shifted targets

    loss_ref = shifted_ce(hf(ids).logits, ids)
    out = model(ids, labels=labels)
    loss = shifted_ce(out.logits, ids)
    # moetron's own LM loss is the same number as the reference loss.
    assert torch.allclose(out.loss, loss_ref, rtol=1e-6, atol=0), (out.loss.item(), loss_ref.item())
    loss_ref.backward()
    loss.backward()

    hf_params = dict(hf.named_parameters())
    compared = set()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        ref_name = hf_name(name)
        if ref_name in hf_params:
            assert_grad_close(name, p.grad, hf_params[ref_name].grad)
            compared.add(ref_name)
        else:  # per-expert parameters in transformers: compare against slices of the 3-D tensor
            prefix, which = ref_name.rsplit(".", 1)
            I = model.config.moe_intermediate_size
            for e in range(model.config.num_experts):
                if which == "gate_up_proj":
                    for j, proj in enumerate(("gate_proj", "up_proj")):
                        key = f"{prefix}.{e}.{proj}.weight"
                        assert_grad_close(key, p.grad[e, j * I:(j + 1) * I], hf_params[key].grad)
                        compared.add(key)
                else:
                    key = f"{prefix}.{e}.down_proj.weight"
                    assert_grad_close(key, p.grad[e], hf_params[key].grad)
                    compared.add(key)
    assert compared == set(hf_params), f"not compared: {sorted(set(hf_params) - compared)}"
    # The comparison is not vacuous: expert and router gradients are non-zero.
    experts = [p.grad for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    routers = [p.grad for n, p in model.named_parameters() if n.endswith("router.weight")]
    assert experts and all(g.abs().sum() > 0 for g in experts)
    assert routers and all(g.abs().sum() > 0 for g in routers)


# ---- negative controls: the comparison can fail --------------------------------------------------------


@pytest.mark.parametrize("case, wrong", [
    ("ds-qlora-g1-yarn_unequal-no_interleave", dict(rope_interleave=True)),
    ("ds-qlora-g1-yarn_unequal-no_interleave", dict(rope_scaling={**yarn(1.0, 1.0), "type": "yarn"})),
    ("ds-noqlora-g4k1-yarn_unequal-interleave-no_norm", dict(rope_scaling={**yarn(1.0, 1.0), "type": "yarn"})),
    ("ds-qlora-g4k2-dense1", dict(n_group=1, topk_group=1)),
    ("qwen-no_norm-sparse_step2", dict(norm_topk_prob=True)),
])
def test_parity_check_detects_a_wrong_option(saved, case, wrong):
    """Each option exercised above changes these models' logits far beyond the parity tolerance."""
    hf, folder = saved(case)
    ids = input_ids(1)
    ref = hf_logits(hf, ids)
    out = moetron_logits(from_hf(folder, **wrong), ids)
    assert ((out - ref).norm() / ref.norm()).item() > 1e3 * LOGITS_RTOL
