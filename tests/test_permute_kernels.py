"""Fused permute / unpermute: the torch reference, the C++ CPU kernel and the Triton kernel agree.

* every implementation against a plain Python loop over (token, slot) in fp64 (independent);
* the C++ and Triton kernels against the deterministic torch reference, bit for bit, forward
  and backward (permute: grad x; unpermute: grad y and grad of the gate weights);
* the original (index_add) reference against the deterministic one within fp tolerance;
* dropped slots (-1), padding to a multiple and to a capacity, empty experts, zero tokens,
  every slot dropped, fp32 / bf16 / fp16 / fp64;
* selection: an unavailable implementation is a clear error, auto falls back with one notice.

The C++ kernel is compiled once per machine (cached by torch.utils.cpp_extension); its tests
skip only when no compiler or ninja is present, and fail when the build itself fails. The
Triton tests run the kernels under the interpreter (TRITON_INTERPRET=1, set only while the
module is imported) and skip when triton is not installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from triton_utils import load_triton_interpreted
from moetron.dispatch import permute as permute_impls
from moetron.dispatch.permute import permute, unpermute
from moetron.kernels import cpp_build


_TRITON_SKIP = load_triton_interpreted("moetron.kernels.triton_permute")[1]


def require_cpp():
    ok, reason = cpp_build.cpp_status(build=True)
    if not ok:
        if reason.startswith(("no C++ compiler", "ninja is not installed")):
            pytest.skip(reason)
        pytest.fail(f"the C++ permute kernel failed to build: {reason}")


def require(impl):
    if impl == "cpp":
        require_cpp()
    elif impl == "triton" and _TRITON_SKIP:
        pytest.skip(_TRITON_SKIP)


FUSED = ["cpp", "triton"]


# ---- routings ----

def make_routing(case: str, gen: torch.Generator):
    """`(T, K, E, topk_idx)` for a named situation; distinct experts per token, -1 = dropped."""
    if case == "basic":
        T, K, E = 13, 3, 5
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.2, -1)
    elif case == "empty_experts":  # experts 0, 3, 4, 5, 7 receive nothing
        T, K, E = 11, 2, 8
        used = torch.tensor([1, 2, 6])
        idx = torch.stack([used[torch.randperm(3, generator=gen)[:K]] for _ in range(T)])
        idx[3, 1] = -1
    elif case == "one_expert":  # every token to expert 2, k=1
        T, K, E = 9, 1, 4
        idx = torch.full((T, K), 2)
    elif case == "all_dropped":
        T, K, E = 6, 2, 3
        idx = torch.full((T, K), -1)
    elif case == "zero_tokens":
        T, K, E = 0, 2, 4
        idx = torch.empty(T, K, dtype=torch.int64)
    else:
        raise ValueError(case)
    return T, K, E, idx


def pad_kwargs(pad: str, idx: torch.Tensor, E: int) -> dict:
    if pad == "none":
        return {}
    if pad == "multiple":
        return {"pad_multiple": 4}
    load = torch.bincount(idx[idx >= 0], minlength=E)
    return {"pad_to": int(load.max()) + 2 if load.numel() and idx.numel() else 3}


def run(impl, case, pad, dtype, H, deterministic=True, seed=0):
    """Forward and backward of permute and of a weighted unpermute on independent random leaves."""
    gen = torch.Generator().manual_seed(seed)
    T, K, E, idx = make_routing(case, gen)
    kw = pad_kwargs(pad, idx, E)
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
    x_NH, state = permute(x, idx, E, impl=impl, deterministic=deterministic, **kw)
    R = x_NH.shape[0]
    g_NH = torch.randn(R, H, generator=gen).to(dtype)
    x_NH.backward(g_NH)
    # unpermute of fresh expert outputs: padding rows hold garbage that must be ignored
    y = torch.randn(R, H, generator=gen).to(dtype).requires_grad_()
    w = (torch.rand(T, K, generator=gen) + 0.1).requires_grad_()
    out = unpermute(y, state, w)
    g_TH = torch.randn(T, H, generator=gen).to(dtype)
    out.backward(g_TH)
    return dict(idx=idx, E=E, kw=kw, x=x.detach(), g_NH=g_NH, y=y.detach(), w=w.detach(), g_TH=g_TH,
                state=state, x_NH=x_NH.detach(), grad_x=x.grad, out=out.detach(), grad_y=y.grad, grad_w=w.grad)


def loop_reference(r):
    """Plain Python loops in fp64: the expected layout, output and gradients."""
    idx, E, kw = r["idx"], r["E"], r["kw"]
    T, K = idx.shape
    rows_of_expert = [[(t, k) for t in range(T) for k in range(K) if int(idx[t, k]) == e] for e in range(E)]
    sizes = []
    for rows in rows_of_expert:
        n = len(rows)
        if "pad_to" in kw:
            n = kw["pad_to"]
        elif "pad_multiple" in kw:
            n = -(-n // kw["pad_multiple"]) * kw["pad_multiple"]
        sizes.append(n)
    row_of = {}
    start = 0
    for e, rows in enumerate(rows_of_expert):
        for i, slot in enumerate(rows):
            row_of[slot] = start + i
        start += sizes[e]
    x, y, w = r["x"].double(), r["y"].double(), r["w"].double()
    g_NH, g_TH = r["g_NH"].double(), r["g_TH"].double()
    H = x.shape[1]
    x_NH = torch.zeros(start, H, dtype=torch.float64)
    grad_x = torch.zeros_like(x)
    out = torch.zeros(T, H, dtype=torch.float64)
    grad_y = torch.zeros(start, H, dtype=torch.float64)
    grad_w = torch.zeros(T, K, dtype=torch.float64)
    for (t, k), row in row_of.items():
        x_NH[row] = x[t]
        grad_x[t] += g_NH[row]
        out[t] += w[t, k] * y[row]
        grad_y[row] = g_TH[t] * w[t, k]
        grad_w[t, k] = (g_TH[t] * y[row]).sum()
    return dict(rows_per_expert=torch.tensor(sizes), x_NH=x_NH, grad_x=grad_x, out=out, grad_y=grad_y,
                grad_w=grad_w)


RESULTS = ["x_NH", "grad_x", "out", "grad_y", "grad_w"]
CASES = ["basic", "empty_experts", "one_expert", "all_dropped", "zero_tokens"]
PADS = ["none", "multiple", "capacity"]
TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_close_to(got, want, dtype, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel():
        err = (got.double() - want).abs().max().item()
        scale = want.abs().max().item() + 1e-30
        assert err <= TOL[dtype] * max(scale, 1.0), f"{what}: max abs error {err:.3g} (scale {scale:.3g})"


def assert_bitwise(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    assert torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), \
        f"{what}: not bitwise equal (max abs diff {(got.double() - want.double()).abs().max().item():.3g})"


@pytest.mark.parametrize("impl", ["torch", *FUSED])
@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("case", CASES)
def test_matches_loop_reference(impl, case, pad):
    require(impl)
    H = 300 if case == "basic" else 24  # 300: two chunks of the 256 dot lanes, with a ragged tail
    r = run(impl, case, pad, torch.float32, H)
    want = loop_reference(r)
    assert r["state"].impl == impl
    assert torch.equal(r["state"].rows_per_expert, want["rows_per_expert"])
    for name in RESULTS:
        assert_close_to(r[name], want[name], torch.float32, f"{impl} {case} {pad} {name}")
    assert torch.equal(r["x_NH"], want["x_NH"].float())  # permute is a copy: exact


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("case", CASES)
def test_fused_equals_deterministic_reference_bitwise(impl, case, pad):
    require(impl)
    H = 300 if case == "basic" else 24
    want = run("torch", case, pad, torch.float32, H, deterministic=True)
    got = run(impl, case, pad, torch.float32, H, deterministic=True)
    for field in ["token_idx", "slot_idx", "rows_per_expert", "row_of_slot", "slot_of_row"]:
        assert torch.equal(getattr(got["state"], field), getattr(want["state"], field)), field
    for name in RESULTS:
        assert_bitwise(got[name], want[name], f"{impl} {case} {pad} {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("impl", ["torch", *FUSED])
def test_dtypes_bitwise_and_close(impl, dtype):
    require(impl)
    want = run("torch", "basic", "multiple", dtype, 300, deterministic=True, seed=3)
    got = run(impl, "basic", "multiple", dtype, 300, deterministic=True, seed=3)
    loop = loop_reference(got)
    for name in RESULTS:
        assert got[name].dtype == (torch.float32 if name == "grad_w" else dtype), name
        assert_bitwise(got[name], want[name], f"{impl} {dtype} {name}")
        assert_close_to(got[name], loop[name], torch.float32 if name == "grad_w" else dtype, f"{impl} {dtype} {name}")


@pytest.mark.parametrize("impl", FUSED)
def test_original_reference_is_close(impl):
    """The default (index_add, activation-dtype) reference differs only by rounding."""
    require(impl)
    for dtype in (torch.float32, torch.bfloat16):
        legacy = run("torch", "basic", "capacity", dtype, 300, deterministic=False, seed=5)
        fused = run(impl, "basic", "capacity", dtype, 300, deterministic=False, seed=5)
        assert fused["state"].impl == impl and legacy["state"].impl == "torch"
        for name in RESULTS:
            assert_close_to(fused[name], legacy[name].double(), dtype, f"{impl} vs original {dtype} {name}")
        assert_bitwise(fused["x_NH"], legacy["x_NH"], "permute forward")


@pytest.mark.parametrize("impl", ["torch", *FUSED])
def test_unweighted_unpermute_and_partial_grads(impl):
    """No gate weights (the all-to-all regroup), and weights / outputs that need no grad."""
    require(impl)
    gen = torch.Generator().manual_seed(11)
    T, K, E, idx = make_routing("basic", gen)
    x = torch.randn(T, 40, generator=gen)
    x_NH, state = permute(x, idx, E, impl=impl, deterministic=True, pad_multiple=2)
    y = torch.randn(x_NH.shape, generator=gen, requires_grad=True)
    out = unpermute(y, state)
    g = torch.randn(T, 40, generator=gen)
    out.backward(g)
    ref_x_NH, ref_state = permute(x, idx, E, impl="torch", deterministic=True, pad_multiple=2)
    y_ref = y.detach().clone().requires_grad_()
    unpermute(y_ref, ref_state).backward(g)
    assert_bitwise(out.detach(), unpermute(y.detach(), ref_state), "unweighted out")
    assert_bitwise(y.grad, y_ref.grad, "unweighted grad y")
    # grad only for the weights, then only for y
    w = torch.rand(T, K, generator=gen)
    for need_y, need_w in [(False, True), (True, False)]:
        grads = {}
        for name, st in [("impl", state), ("ref", ref_state)]:
            yy = y.detach().clone().requires_grad_(need_y)
            ww = w.clone().requires_grad_(need_w)
            unpermute(yy, st, ww).backward(g)
            grads[name] = (yy.grad, ww.grad)
        for a, b in zip(grads["impl"], grads["ref"]):
            assert (a is None) == (b is None)
            if a is not None:
                assert_bitwise(a, b, f"partial grads need_y={need_y} need_w={need_w}")


# ---- C++ specifics ----

def test_cpp_parallel_rows_bitwise():
    """Enough rows that at::parallel_for splits the work between threads."""
    require_cpp()
    gen = torch.Generator().manual_seed(2)
    T, K, E, H = 700, 4, 16, 96
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.05, -1)
    results = {}
    for impl in ("torch", "cpp"):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        w = torch.rand(T, K, generator=torch.Generator().manual_seed(4), requires_grad=True)
        x_NH, state = permute(x, idx, E, impl=impl, deterministic=True, pad_multiple=16)
        y = x_NH * 1.5
        out = unpermute(y, state, w)
        out.backward(torch.randn(T, H, generator=torch.Generator().manual_seed(5)))
        results[impl] = (x_NH, out, x.grad, w.grad)
    for a, b in zip(results["cpp"], results["torch"]):
        assert_bitwise(a.detach(), b.detach(), "cpp parallel")


def test_cpp_rejects_out_of_range_expert():
    require_cpp()
    idx = torch.tensor([[0, 1], [2, 5]])
    with pytest.raises(IndexError, match="num_experts=4"):
        permute(torch.randn(2, 8), idx, 4, impl="cpp")


def test_pad_to_smaller_than_load_is_an_error_in_every_impl():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    for impl in ["torch", *FUSED]:
        if impl == "cpp" and not cpp_build.cpp_status(build=True)[0] or impl == "triton" and _TRITON_SKIP:
            continue
        with pytest.raises(ValueError, match="pad_to=2 is smaller than the largest expert load 3"):
            permute(torch.randn(3, 8), idx, 3, pad_to=2, impl=impl)


# ---- selection ----

def test_auto_picks_cpp_on_cpu_and_state_carries_the_choice():
    require_cpp()
    assert permute_impls.resolve("auto", None, torch.device("cpu")) == ("cpp", False)
    x_NH, state = permute(torch.randn(4, 8), torch.tensor([[0], [1], [0], [1]]), 2, impl="auto")
    assert state.impl == "cpp"
    assert unpermute(x_NH, state).shape == (4, 8)


def test_trainer_takes_the_cpp_permute_with_the_cpu_fusion(monkeypatch):
    """The trainer's CPU default: the C++ permute whenever `train.fusion` resolves to cpp (its library is
    built then); the recipe's field, then $MOETRON_PERMUTE_IMPL, say otherwise."""
    require_cpp()
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.setup import build_run

    monkeypatch.delenv("MOETRON_PERMUTE_IMPL", raising=False)
    for overrides, expected in [([], "cpp"), (["train.fusion=none"], "default"),
                                (["train.permute_impl=torch"], "torch")]:
        build_run(apply_overrides(get_recipe("qwen3-moe-tiny"), overrides), log=None)
        assert permute_impls.permute_impl()[0] == expected, overrides
    monkeypatch.setenv("MOETRON_PERMUTE_IMPL", "torch")
    build_run(get_recipe("qwen3-moe-tiny"), log=None)
    assert permute_impls.permute_impl()[0] == "torch"


def test_process_default_is_used_when_no_impl_is_given(monkeypatch):
    require_cpp()
    monkeypatch.setattr(permute_impls, "_default_impl", "torch")
    monkeypatch.setattr(permute_impls, "_default_deterministic", False)
    permute_impls.set_permute_impl("cpp", deterministic=True)
    assert permute_impls.permute_impl() == ("cpp", True)
    _, state = permute(torch.randn(3, 4), torch.tensor([[1], [0], [1]]), 2)
    assert (state.impl, state.deterministic) == ("cpp", True)
    with pytest.raises(ValueError, match="unknown"):
        permute_impls.set_permute_impl("cuda")


def test_unknown_impl_is_an_error():
    with pytest.raises(ValueError, match="permute impl 'fast' is unknown"):
        permute(torch.randn(2, 4), torch.tensor([[0], [1]]), 2, impl="fast")


def test_unavailable_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(permute_impls, "_triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="'triton' was requested but is unavailable: python package 'triton' is not"):
        permute(torch.randn(2, 4), torch.tensor([[0], [1]]), 2, impl="triton")


def test_cpp_on_a_non_cpu_device_is_a_clear_error():
    ok, reason = permute_impls.impl_status("meta")[1][1:]
    assert not ok and "CPU tensors only" in reason


@pytest.fixture
def fresh_cpp_state(monkeypatch, tmp_path):
    """Forget the real build for one test (monkeypatch restores it afterwards)."""
    monkeypatch.setattr(cpp_build, "_result", None)
    monkeypatch.setattr(cpp_build, "_build_seconds", None)
    monkeypatch.setattr(permute_impls, "_fallback_noticed", False)
    monkeypatch.setattr(permute_impls, "_kernel_sets", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return monkeypatch


def _auto_twice_and_cpp():
    x, idx = torch.randn(5, 8), torch.tensor([[0, 1], [1, 2], [2, 0], [0, -1], [1, 2]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out1, state = permute(x, idx, 3, impl="auto")
        out2, _ = permute(x, idx, 3, impl="auto")
    notices = [str(w.message) for w in caught if "fused C++ permute unavailable" in str(w.message)]
    assert len(notices) == 1, notices
    assert "\n" not in notices[0] and "using the torch reference" in notices[0]
    assert state.impl == "torch" and torch.equal(out1, out2)
    assert torch.equal(out1, permute(x, idx, 3, impl="torch")[0])
    with pytest.raises(RuntimeError, match="'cpp' was requested but is unavailable"):
        permute(x, idx, 3, impl="cpp")
    return notices[0]


def test_no_compiler_falls_back_with_one_notice(fresh_cpp_state):
    fresh_cpp_state.setenv("CXX", "/nonexistent/c++")
    assert "no C++ compiler" in _auto_twice_and_cpp()


def test_failed_build_falls_back_with_one_notice(fresh_cpp_state, tmp_path):
    if cpp_build._missing_tool() is not None:
        pytest.skip(cpp_build._missing_tool())
    # every source of the one library broken: a real one would compile (~20 s with torch's headers) for nothing
    for attr in ("BASE_UNIT", "FMA_UNIT"):  # the two units the build compiles
        broken = tmp_path / f"{attr.lower()}.cpp"
        broken.write_text("#error this source is broken on purpose\n")
        fresh_cpp_state.setattr(cpp_build, attr, broken)
    fresh_cpp_state.setattr(cpp_build, "EXTENSION_NAME", "moetron_permute_broken_on_purpose")
    assert "failed" in _auto_twice_and_cpp()
