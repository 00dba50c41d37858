"""GPU paths: the same contracts as the CPU tests, on a CUDA device. Skipped without one.

CI has no GPU, so these run only where one is lent (`pytest tests/test_cuda.py` on the GPU
machine); the README's support matrix records which of them ran and where. Each check compares
the CUDA path with an independent reference: the torch permute reference, a CPU fp64 run of
the same module, the emulated FP8 GEMM, a single-process dispatcher.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEV = "cuda"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 comparisons against CPU fp64 need true fp32 matmuls."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ------------------------------------------------------------------ permute kernels (Triton)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad_multiple", [1, 16])
def test_triton_permute_matches_reference_bitwise(dtype, pad_multiple):
    from moetron.dispatch.permute import permute, unpermute

    g = torch.Generator(device=DEV).manual_seed(0)
    T, H, E, k = 1000, 384, 16, 4
    x = torch.randn(T, H, device=DEV, dtype=dtype, generator=g)
    idx = torch.rand(T, E, device=DEV, generator=g).topk(k, dim=-1).indices
    idx[::7, 1] = -1  # dropped slots
    w = torch.rand(T, k, device=DEV, generator=g) * (idx >= 0)
    dy = torch.randn(T, H, device=DEV, dtype=dtype, generator=g)
    results = {}
    for impl in ("torch", "triton"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        x_NH, state = permute(xi, idx, E, pad_multiple=pad_multiple, impl=impl, deterministic=True)
        y_NH = x_NH * 1.5 + 0.25
        out = unpermute(y_NH, state, wi, impl=impl, deterministic=True)
        out.backward(dy)
        results[impl] = (x_NH.detach(), out.detach(), xi.grad, wi.grad, state.rows_per_expert)
    ref, got = results["torch"], results["triton"]
    assert ref[1].abs().max() > 0.1  # a real output, not zeros
    for name, a, b in zip(("permuted", "combined", "grad x", "grad w", "rows"), got, ref):
        assert torch.equal(a, b), f"triton vs torch {name} ({dtype}, pad {pad_multiple}): max diff {(a.double() - b.double()).abs().max()}"


# ------------------------------------------------------------------ weighted SwiGLU (Triton)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_weighted_swiglu_matches_fp64(dtype):
    """The compiled Triton SwiGLU(+routing weights), forward and backward, vs float64 math on the same
    inputs: within the reference expression's own error in this dtype (bf16: a few bf16 ulp)."""
    from moetron.kernels.fused_swiglu import weighted_swiglu_reference
    from moetron.ops.functional import weighted_swiglu

    g = torch.Generator(device=DEV).manual_seed(4)
    N, F = 4099, 1000  # N, F not multiples of any block size
    gate_up = (torch.randn(N, 2 * F, device=DEV, generator=g) * 3).to(dtype)
    probs = torch.rand(N, device=DEV, generator=g)
    dy = torch.randn(N, F, device=DEV, generator=g).to(dtype)
    results = {}
    for name, fn in (("triton", lambda a, b: weighted_swiglu(a, b, impl="triton")),
                     ("torch", weighted_swiglu_reference), ("fp64", weighted_swiglu_reference)):
        wide = name == "fp64"
        a = (gate_up.double() if wide else gate_up.clone()).requires_grad_()
        b = (probs.double() if wide else probs.clone()).requires_grad_()
        out = fn(a, b)
        out.backward(dy.double() if wide else dy)
        results[name] = (out.detach(), a.grad, b.grad)
    assert results["fp64"][0].abs().max() > 1
    for i, what in enumerate(("output", "d gate_up", "d probs")):
        err, ref_err = _rel(results["triton"][i], results["fp64"][i]), _rel(results["torch"][i], results["fp64"][i])
        print(f"weighted SwiGLU {dtype} {what}: triton {err:.2e}, torch reference {ref_err:.2e} (vs fp64)")
        assert err <= max(2 * ref_err, 1e-6), (what, err, ref_err)


# ------------------------------------------------------------------ RMSNorm (Triton)

@pytest.mark.parametrize("N, D, xd, wd", [(8192, 1024, torch.bfloat16, torch.bfloat16),
                                          (8192 * 16, 64, torch.bfloat16, torch.bfloat16),  # Qwen3's q/k norm
                                          (4096, 2048, torch.bfloat16, torch.float32),
                                          (1000, 20000, torch.bfloat16, torch.bfloat16),  # rows past one block
                                          (513, 4096, torch.float16, torch.float16),
                                          (4096, 40, torch.float32, torch.float32)])
def test_triton_rmsnorm_matches_fp64(N, D, xd, wd):
    """The compiled Triton RMSNorm (train.fusion=triton, auto's choice on a GPU), forward and backward, vs
    float64 math with the reference's rounding of the normalised x: no worse than the eager reference."""
    from moetron.kernels import triton_rmsnorm
    from moetron.ops.functional import _rms_norm_ref

    g = torch.Generator(device=DEV).manual_seed(5)
    x = (torch.randn(N, D, device=DEV, generator=g) * torch.rand(N, 1, device=DEV, generator=g) * 4).to(xd)
    w = (1 + 0.5 * torch.randn(D, device=DEV, generator=g)).to(wd)
    dy = torch.randn(N, D, device=DEV, generator=g).to(torch.result_type(w, x))
    assert triton_rmsnorm.applies(x, w)
    got = {}
    for name, fn in (("triton", triton_rmsnorm.RMSNormFunction.apply), ("torch", _rms_norm_ref)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-6)
        y.backward(dy)
        got[name] = (y.detach(), xi.grad, wi.grad)
    xs, ws = x.double().requires_grad_(), w.double().requires_grad_()
    xh = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
    exact = ws * (xh + (xh.to(xd).double() - xh).detach())  # the forward's rounding, the exact gradient
    exact.backward(dy.double())
    want = (exact.detach(), xs.grad, ws.grad)
    for i, what in enumerate(("output", "grad x", "grad weight")):
        assert got["triton"][i].dtype == got["torch"][i].dtype, what
        err, ref_err = _rel(got["triton"][i], want[i]), _rel(got["torch"][i], want[i])
        print(f"RMSNorm {N}x{D} {xd}/{wd} {what}: triton {err:.2e}, torch reference {ref_err:.2e} (vs fp64)")
        assert err <= max(2 * ref_err, 1e-6), (what, err, ref_err)


# ------------------------------------------------------------------ softmax top-k router (Triton)

@pytest.mark.parametrize("T, E, K, normalize", [(16384, 64, 8, True), (4099, 60, 4, False), (8192, 256, 8, True)])
def test_triton_router_matches_the_eager_router(T, E, K, normalize):
    """The compiled Triton router against the eager router's ops on the same GPU: the same experts and counts, weights and the logits' gradient (with the balancing
    loss's) within a few ulp."""
    from moetron.kernels import triton_router
    from moetron.kernels.fused_router import TopKSoftmax

    g = torch.Generator(device=DEV).manual_seed(T)
    # distinct logits a row (a random order of E steps of 0.1): no exact ties, whose order torch.topk leaves open
    logits = torch.rand(T, E, device=DEV, generator=g).argsort(-1).float() * 0.1
    grad_w = torch.randn(T, K, device=DEV, generator=g)
    aux = torch.rand(E, device=DEV, generator=g) * 0.1
    results = []
    for fused in (True, False):
        x = logits.clone().requires_grad_()
        if fused:
            w, idx, counts, psum = TopKSoftmax.apply(x, K, normalize, 2.0, lambda c: aux, triton_router)
            loss = (w * grad_w).sum()
        else:
            probs = torch.softmax(x, dim=-1)
            idx = torch.topk(probs.detach(), K, dim=-1).indices
            w = probs.gather(1, idx)
            if normalize:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * 2.0
            counts, psum = torch.bincount(idx.reshape(-1), minlength=E), probs.detach().sum(0)
            loss = (w * grad_w).sum() + (probs * aux).sum()
        loss.backward()
        results.append((idx, w.detach(), counts, psum, x.grad))
    got, want = results
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-6 * want[4].abs().max().item())


# ------------------------------------------------------------------ grouped GEMM + MoE layer

@pytest.mark.parametrize("N, V, dtype", [(8192, 32768, torch.bfloat16), (1000, 50257, torch.float32),
                                         (37, 100, torch.float16)])
def test_triton_cross_entropy_matches_fp64(N, V, dtype):
    """The compiled Triton cross-entropy against fp64 `F.cross_entropy` on the same GPU: the summed loss
    within 1e-6 relative, the logits' gradient within one rounding of the exact value (as torch's own
    fp32 path, whose error is printed beside it); ignored rows give zero gradient."""
    import torch.nn.functional as F

    from moetron.kernels import triton_cross_entropy

    g = torch.Generator(device=DEV).manual_seed(V)
    logits = (torch.randn(N, V, device=DEV, generator=g) * 4).to(dtype)
    labels = torch.randint(0, V, (N,), device=DEV, generator=g)
    labels[::7] = -100
    grad = torch.tensor(1 / 41, device=DEV)
    results = []
    for fn, leaf in ((lambda x: triton_cross_entropy.cross_entropy(x, labels, -100), logits),
                     (lambda x: F.cross_entropy(x, labels, reduction="sum"), logits.double()),  # an fp64 leaf
                     (lambda x: F.cross_entropy(x.float(), labels, reduction="sum"), logits)):
        x = leaf.clone().requires_grad_()
        loss = fn(x)
        loss.backward(grad.to(loss.dtype))
        results.append((loss.detach().double(), x.grad.double()))
    (loss, dx), (want, want_dx), (ref, ref_dx) = results
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]
    # one rounding of the exact value, fp32 noise before it (a value near a rounding tie may go either way)
    bound = (u + 1e-5) * want_dx.abs() + u * torch.finfo(dtype).tiny + 1e-7 * float(grad)
    rel = lambda v: abs(float(v - want)) / float(want)  # noqa: E731
    worst = lambda d: float(((d - want_dx).abs() / bound).max())  # noqa: E731
    print(f"triton cross-entropy {dtype} [{N}, {V}]: loss rel err {rel(loss):.1e} (torch {rel(ref):.1e}), "
          f"grad max err / bound {worst(dx):.2f} (torch {worst(ref_dx):.2f})")
    assert abs(float(loss - want)) <= 1e-6 * float(want)
    assert ((dx - want_dx).abs() <= bound).all() and not dx[labels == -100].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_rope_matches_the_eager_rope(dtype):
    """The compiled Triton RoPE against the eager `_RopeFunction` on the same GPU, on the proxy's q
    (a transposed [4, 2048, 16, 64] view): bf16 and fp16 the same bits (each product exact in fp32,
    then rounded as torch rounds it), fp32 within 1 ulp (the GPU may fuse the multiply-add)."""
    from moetron.kernels import triton_rope
    from moetron.ops.functional import _rope_eager

    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(4, 2048, 16, 64, device=DEV, generator=g).to(dtype).transpose(1, 2)
    angles = torch.rand(1, 2048, 32, device=DEV, generator=g, dtype=torch.float64) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dy = torch.randn(4, 16, 2048, 64, device=DEV, generator=g).to(dtype)
    results = []
    for fn in (triton_rope.RopeFunction.apply, lambda x, c, s: _rope_eager(x, c, s, False)):
        xi = x.detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_()
        out = fn(xi, cos, sin)
        out.backward(dy)
        results.append((out.detach(), xi.grad))
    (out, dx), (want, want_dx) = results
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2.4e-7, atol=1e-6)  # 1e-6: a near-cancelling sum
        torch.testing.assert_close(dx, want_dx, rtol=2.4e-7, atol=1e-6)
    else:
        assert torch.equal(out, want) and torch.equal(dx, want_dx)
    assert dx.stride() == x.stride()


def test_grouped_linear_backends_agree_on_cuda_bf16():
    from moetron.moe.grouped_gemm import grouped_linear, resolve_backend

    g = torch.Generator(device=DEV).manual_seed(1)
    rows = torch.tensor([0, 64, 16, 300, 32, 0, 128, 48], device=DEV)
    x = torch.randn(int(rows.sum()), 256, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(8, 512, 256, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05
    chosen = resolve_backend("auto", x, w)
    ref = grouped_linear(x.double().cpu(), w.double().cpu(), rows.cpu(), backend="loop")
    for backend in {"loop", chosen}:
        y = grouped_linear(x, w, rows, backend=backend)
        assert _rel(y, ref) < 1e-2, (backend, _rel(y, ref))
    print(f"grouped_linear auto backend on {torch.cuda.get_device_name()}: {chosen}")


def test_moe_layer_cuda_fp32_matches_cpu_fp64():
    from moetron import MoEConfig, MoELayer

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, norm_topk_prob=True,
                    shared_expert_ffn_size=128)
    ref = MoELayer(cfg).double()
    gpu = MoELayer(cfg).to(DEV)
    gpu.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    x = torch.randn(2, 300, 256, dtype=torch.float64)
    dy = torch.randn_like(x)
    xr, xg = x.clone().requires_grad_(), x.float().to(DEV).requires_grad_()
    ref(xr).backward(dy)
    y = gpu(xg)
    y.backward(dy.float().to(DEV))
    assert _rel(y.detach(), ref(x).detach()) < 1e-5
    assert _rel(xg.grad, xr.grad) < 1e-5
    for (name, p_ref), (_, p_gpu) in zip(ref.named_parameters(), gpu.named_parameters()):
        assert _rel(p_gpu.grad, p_ref.grad) < 1e-5, name


def test_model_trains_on_cuda_bf16_close_to_fp32():
    """A tiny DeepSeek-V3 (MLA, MTP, group routing): bf16 on CUDA vs fp32 on CPU, loss and grads."""
    from moetron.recipes import get_recipe
    from moetron.model.model import MoETransformer

    cfg = get_recipe("deepseek-v3-tiny").model
    torch.manual_seed(0)
    ref = MoETransformer(cfg)
    gpu = MoETransformer(cfg)
    gpu.load_state_dict(ref.state_dict())
    gpu = gpu.to(DEV, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    out_ref = ref(ids, labels=ids)
    out_ref.total_loss.backward()
    out_gpu = gpu(ids.to(DEV), labels=ids.to(DEV))
    out_gpu.total_loss.backward()
    assert abs(out_gpu.total_loss.item() - out_ref.total_loss.item()) / out_ref.total_loss.item() < 2e-2
    # The whole gradient by norm: single small tensors (router bias, norms) carry bf16's
    # rounding plus the odd token whose near-tied top-k picks another expert.
    pairs = [(pg.grad.float().flatten(), pr.grad.flatten()) for pr, pg in zip(ref.parameters(), gpu.parameters())
             if pr.grad is not None]
    assert len(pairs) == len(list(ref.parameters()))
    whole = _rel(torch.cat([g.cpu() for g, _ in pairs]), torch.cat([r for _, r in pairs]))
    print(f"bf16 CUDA vs fp32 CPU: loss {out_gpu.total_loss.item():.5f} vs {out_ref.total_loss.item():.5f}, "
          f"gradient norm-relative error {whole:.3e}")
    assert whole < 3e-2, whole


# ------------------------------------------------------------------ FP8 on torch._scaled_mm

@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_fp8_linear_scaled_mm_matches_emulation(scaling):
    from moetron.precision import apply_fp8, get_fp8_recipe

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability >= 8.9")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).to(DEV)
    x = torch.randn(512, 256, device=DEV)
    outs = {}
    for backend in ("emulate", "auto"):
        m = torch.nn.Sequential(*[type(l)(*([l.in_features, l.out_features] if hasattr(l, "in_features") else []))
                                  for l in base]).to(DEV)
        m.load_state_dict(base.state_dict())
        try:
            apply_fp8(m, get_fp8_recipe(scaling, backend=backend))
        except (RuntimeError, NotImplementedError) as e:  # a recipe the torch backend cannot run
            pytest.skip(f"{scaling} with backend {backend}: {e}")
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.square().mean().backward()
        outs[backend] = (y.detach(), xi.grad, m[0].weight.grad)
    ref = base(x)
    assert _rel(outs["auto"][0], ref) < 0.1  # FP8 vs full precision: quantisation error only
    # Same quantisation, different GEMM accumulation: an intermediate that lands on the other
    # side of an FP8 rounding boundary moves by one e4m3/e5m2 step, so agree to a few percent.
    errs = {what: _rel(a, b) for a, b, what in zip(outs["auto"], outs["emulate"], ("y", "grad x", "grad w"))}
    print(f"FP8 {scaling}: torch._scaled_mm vs emulation, norm-relative: {errs}")
    assert all(e < 5e-2 for e in errs.values()), errs


# ------------------------------------------------------------------ NCCL, world of one

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nccl_world():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=torch.device(DEV, 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_dispatchers_over_nccl_match_local(nccl_world):
    """allgather / alltoall over a one-rank NCCL group equal the local dispatcher."""
    from moetron import MoEConfig, MoELayer
    from moetron.dispatch.allgather import AllGatherDispatcher
    from moetron.dispatch.alltoall import AllToAllDispatcher
    from moetron.dispatch.flex import FlexTokenDispatcher

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=128, ffn_hidden_size=64, num_experts=8, top_k=2)
    layer = MoELayer(cfg).to(DEV)
    x = torch.randn(4, 50, 128, device=DEV)
    want = layer(x).detach()
    assert want.abs().max() > 1e-3
    for dispatcher in (AllToAllDispatcher(nccl_world, 8), AllGatherDispatcher(nccl_world, 8, range(8)),
                       FlexTokenDispatcher(nccl_world, 8, backend="torch")):
        other = MoELayer(cfg, dispatcher).to(DEV)
        other.load_state_dict(layer.state_dict())
        got = other(x).detach()
        assert _rel(got, want) < 1e-6, type(dispatcher).__name__


def test_flex_low_latency_round_trip_in_a_cuda_graph(nccl_world):
    """Low-latency dispatch + combine captured in a CUDA graph (possible only without host syncs)
    and replayed on new inputs: combine(dispatch(x)) with identity experts is sum_k w_k x."""
    from moetron.dispatch.flex import FlexBuffer

    E, H, T, k = 8, 128, 64, 2
    flex = FlexBuffer(nccl_world, E, backend="torch")
    x = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
    idx = torch.empty(T, k, device=DEV, dtype=torch.long)
    w = torch.empty(T, k, device=DEV)

    def fill(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(T, H, device=DEV, generator=g))
        idx.copy_(torch.rand(T, E, device=DEV, generator=g).topk(k, dim=-1).indices)
        w.copy_(torch.rand(T, k, device=DEV, generator=g))

    def round_trip():
        recv, counts, handle, _, _ = flex.low_latency_dispatch(x, idx, T, E)
        out, _, _ = flex.low_latency_combine(recv, idx, w, handle)
        return out, counts

    fill(0)
    eager, _ = round_trip()  # warm-up outside the graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out, counts = round_trip()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        want = (w.unsqueeze(-1) * x.float().unsqueeze(1)).sum(1)
        assert int(counts.sum()) == T * k
        assert _rel(out.float(), want) < 1e-2, seed


@pytest.mark.parametrize("impl", ["triton"])
def test_dropless_permute_round_trip_never_waits_for_the_host(impl):
    """Dropless permute -> unpermute (forward and backward) with CUDA's sync debug mode set to error.
    (The torch references may sync: the deterministic one masks rows in its backward.)"""
    from moetron.dispatch.permute import permute, unpermute

    g = torch.Generator(device=DEV).manual_seed(3)
    T, H, E, k = 512, 256, 32, 4
    x = torch.randn(T, H, device=DEV, generator=g).requires_grad_()
    idx = torch.rand(T, E, device=DEV, generator=g).topk(k, dim=-1).indices
    w = torch.rand(T, k, device=DEV, generator=g).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x_NH, state = permute(x, idx, E, impl=impl, deterministic=True, dropless=True)
        out = unpermute(x_NH * 2.0, state, w, impl=impl, deterministic=True)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = 2.0 * w.detach().sum(-1, keepdim=True) * x.detach()
    assert _rel(out.detach(), want) < 1e-6


# ------------------------------------------------------------------ the trainer on a GPU

def _train(overrides, **kwargs):
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    base = ["model.num_layers=2", "train.log_every=100", "train.steps=6"]
    return [h["loss"] for h in train(apply_overrides(get_recipe("deepseek-v3-tiny"), base + overrides),
                                     log=lambda s: None, **kwargs)]


def test_trainer_on_cuda_matches_cpu_and_resumes(tmp_path):
    cpu = _train(["train.device=cpu"])
    gpu = _train(["train.device=cuda"])
    assert all(abs(a - b) / b < 1e-4 for a, b in zip(gpu, cpu)), (gpu, cpu)
    bf16 = _train(["train.device=cuda", "train.dtype=bf16"])
    assert all(abs(a - b) / b < 2e-2 for a, b in zip(bf16, cpu)), (bf16, cpu)
    assert bf16[-1] < bf16[0] - 0.2
    full = _train(["train.device=cuda", f"train.save_dir={tmp_path / 'a'}", "train.save_every=3"])
    _train(["train.device=cuda", f"train.save_dir={tmp_path / 'b'}", "train.steps=3"])
    rest = _train(["train.device=cuda", f"train.save_dir={tmp_path / 'b'}", "train.resume=true"])
    print(f"trainer on CUDA: cpu {cpu}\n gpu {gpu}\n bf16 {bf16}\n resumed {rest} vs {full[3:]}")
    assert rest == full[3:]


def test_moe_layer_step_never_waits_for_the_host():
    """Router + local dispatch + grouped GEMMs + combine, forward and backward, dropless:
    no device-to-host sync (CUDA's sync debug mode raises on one)."""
    from moetron import MoEConfig, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4,
                               aux_loss_type="aux_loss", aux_loss_coeff=1e-2)).to(DEV, torch.bfloat16)
    x = torch.randn(2, 128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    layer(x)  # warm-up: kernel compilation and one-time checks may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x)
        y.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and x.grad.abs().max() > 0


def test_distributed_optimizer_fused_cuda_step_matches_torch_adamw():
    """ZeRO-1 in one process on CUDA (fused AdamW kernel) vs torch.optim.AdamW (foreach), 3 steps."""
    from moetron.optim import DistributedOptimizer
    from moetron.parallel import ParallelConfig, ParallelState
    from moetron.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(DEV)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(DEV)
    ours.load_state_dict(ref.state_dict())
    ddp = DataParallel(ours, ParallelState.single(ParallelConfig()), use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)  # clips every step
    # moetron's default groups: no weight decay on 1-D parameters (biases, norms)
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                lr=1e-2, foreach=True)
    for step in range(3):
        x = torch.randn(32, 64, device=DEV)
        ddp.zero_grad()
        ours(x).square().mean().backward()
        ddp.finish_grad_sync()
        norm = opt.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        assert abs(float(norm) - float(want)) / float(want) < 1e-5
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert _rel(a, b) < 1e-6
