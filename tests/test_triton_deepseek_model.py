"""A DeepSeek-V3 model under `train.fusion=triton` (what `auto` runs on a GPU), its kernels interpreted on
CPU tensors (TRITON_INTERPRET=1): MLA's interleaved RoPE on strided slices of q and of the kv latent's
output, the sigmoid router's selection (expert bias, group limit), RMSNorm and the token cross-entropy all
run, together, and the model's loss and gradients equal the eager model's within fp32 noise. The kernels'
own tests hold their bits; this one holds the wiring (which tensor reaches which kernel, and how back)."""

import pytest
import torch

from triton_utils import load_triton_interpreted
from moetron import ops
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.moe import router as router_module

pytestmark = pytest.mark.usefixtures("one_thread")

_MODULES = ("rope", "router", "cross_entropy", "rmsnorm")
_LOADED = {name: load_triton_interpreted(f"moetron.kernels.triton_{name}") for name in _MODULES}


@pytest.fixture
def kernels():
    for module, why in _LOADED.values():
        if why:
            pytest.skip(why)
    return {name: module for name, (module, _) in _LOADED.items()}


def _model() -> MoETransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=2,
                      intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2,
                      first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True)
    model = MoETransformer(cfg)
    for module in model.modules():  # a non-zero expert bias, so that the selection depends on it
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return model


def test_a_deepseek_v3_model_under_triton_fusion_trains_as_eager(kernels, monkeypatch):
    monkeypatch.setattr(router_module, "_triton", [kernels["router"]])
    calls = []

    def counted(real, label):
        return lambda *a, **kw: (calls.append((label, a[-1] if label == "rope" else None)), real(*a, **kw))[1]

    for owner, name, label in ((kernels["rope"].RopeFunction, "apply", "rope"),
                               (kernels["router"], "sigmoid_forward", "router"),
                               (kernels["cross_entropy"], "cross_entropy", "cross_entropy"),
                               (kernels["rmsnorm"].RMSNormFunction, "apply", "rms_norm")):
        monkeypatch.setattr(owner, name, counted(getattr(owner, name), label))

    model = _model()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :2] = -100
    runs = {}
    try:
        for mode in ("triton", "none"):
            ops.set_fusion(mode)
            model.zero_grad(set_to_none=True)
            out = model(ids, labels=labels)
            out.loss.backward()
            runs[mode] = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None})
    finally:
        ops.set_fusion("none")
    (loss, grads), (want, want_grads) = runs["triton"], runs["none"]
    # per layer: RoPE on q's and on the latent's rotary slices, interleaved; the MoE layer's router
    assert [c for c in calls if c[0] == "rope"] == [("rope", True)] * 4
    assert sum(c[0] == "router" for c in calls) == 1
    assert sum(c[0] == "cross_entropy" for c in calls) == 1
    # per layer 2 norms and the q and kv latents' norms; the final norm
    assert sum(c[0] == "rms_norm" for c in calls) == 2 * 4 + 1
    assert grads.keys() == want_grads.keys() and len(grads) > 10
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
