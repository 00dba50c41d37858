"""The hot elementwise pieces of the model, each one function with a swappable body.

The unfused bodies are the reference (they match Hugging Face transformers'
numerics). `set_fusion("compile")` routes the same calls through `torch.compile`d
versions of the same bodies, so a fused kernel never changes the math written
here; `set_fusion("cpp")` sends fp32/fp64 CPU RMSNorm, RoPE and the experts' weighted SwiGLU,
and fp32 CPU cross-entropy, to one C++ pass each way (moetron/kernels/norm_rope_cpu.py,
fused_swiglu.py, cross_entropy_cpu.py: RoPE bit for bit, the others within a few ulp), and the MoE
router reads it too (moetron/kernels/fused_router.py);
`set_fusion("triton")` sends CUDA RMSNorm to one Triton kernel each way (moetron/kernels/triton_rmsnorm.py:
on a GPU a step's eager norms were ~8 launches forward and ~12 backward each, with the host behind), and
RoPE and the token cross-entropy too (triton_rope.py, triton_cross_entropy.py); the MoE router reads
it (triton_router.py).
Library kernels (Liger, Transformer Engine) plug in the same way.

Eagerly (`none`), fp32 RMSNorm and halves-layout RoPE run as autograd Functions: the reference's
forward ops without an autograd node each, and a hand-written backward (RMSNorm: about 9 ops where
autograd runs about 20; RoPE: 6 for about 10). A small model's step is mostly per-op overhead.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetron.kernels import availability, cpp_build, cross_entropy_cpu, fused_swiglu, norm_rope_cpu

FUSION_MODES = ("none", "cpp", "triton", "compile")
_mode = "none"
_compiled: dict[str, Callable] = {}
_triton_rmsnorm = None  # moetron.kernels.triton_rmsnorm, imported by set_fusion("triton")
_triton_ce = _triton_rope = None  # moetron.kernels.triton_cross_entropy and triton_rope, likewise


def set_fusion(mode: str) -> None:
    """Choose `none` (reference eager ops), `cpp` (C++ RMSNorm, RoPE and the experts' weighted
    SwiGLU on CPU tensors, built on first use: raises `CppBuildError` when it cannot be), `triton`
    (Triton RMSNorm, RoPE and cross-entropy on CUDA tensors; needs the triton package) or `compile`
    (torch.compile'd kernels)."""
    global _mode, _triton_rmsnorm, _triton_ce, _triton_rope
    if mode not in FUSION_MODES:
        raise ValueError(f"fusion mode {mode!r} is unknown; choose one of {FUSION_MODES}")
    if mode == "cpp":
        norm_rope_cpu.ops()
    if mode == "triton" and _triton_rmsnorm is None:
        if not availability.triton_installed():
            raise ValueError("fusion mode 'triton' needs the triton package (pip install triton)")
        from moetron.kernels import triton_cross_entropy, triton_rmsnorm, triton_rope
        _triton_rmsnorm, _triton_ce, _triton_rope = triton_rmsnorm, triton_cross_entropy, triton_rope
    _mode = mode


def fusion_mode() -> str:
    return _mode


def resolve_fusion(mode: str, device: torch.device, fp8: bool = False,
                   dtype: torch.dtype = torch.float32) -> tuple[str, str | None]:
    """The mode a run on `device` takes for `train.fusion=mode`, and a one-line notice or None.

    `auto`: `cpp` on a CPU when moetron's C++ library builds here (it holds the CPU grouped GEMM
    too), else `none` with the reason; `triton` on a GPU when the triton package is installed, else
    `none` with the reason; `none` under FP8 (`fp8`): tensorwise and delayed scales turn the kernels'
    few-ulp differences into a visible divergence between tensor-parallel and one-process runs
    (tests/test_fp8_tp.py), which the eager reference keeps within its bounds.
    `cpp` on a GPU, for bf16 parameters (the kernels take fp32 and fp64), or where it cannot build, and
    `triton` off a GPU or without the package, are errors naming the fix; `auto` runs those eager."""
    if mode not in ("auto", *FUSION_MODES):
        raise ValueError(f"train.fusion={mode!r} is unknown; choose auto or one of {FUSION_MODES}")
    gpu = device.type == "cuda"
    if mode == "triton" or (mode == "auto" and gpu and not fp8):
        if not gpu:
            raise ValueError(f"train.fusion=triton runs CUDA tensors, but this run is on {device.type}; "
                             "use train.fusion=auto, none or compile")
        if not availability.triton_installed():
            if mode == "triton":
                raise ValueError("train.fusion=triton needs the triton package: pip install triton "
                                 "(or use train.fusion=auto, none or compile)")
            return "none", ("fusion: eager RMSNorm, RoPE, cross-entropy and router (python package 'triton' "
                            "is not installed: pip install triton)")
        return "triton", None
    if mode not in ("auto", "cpp"):
        return mode, None
    if mode == "auto" and (fp8 or dtype not in norm_rope_cpu.DTYPES):
        return "none", None
    if dtype not in norm_rope_cpu.DTYPES:
        raise ValueError(f"train.fusion=cpp runs fp32 and fp64 tensors, but the parameters are {dtype}; "
                         "use train.fusion=auto or none, or train.dtype=fp32")
    if device.type != "cpu":
        if mode == "cpp":
            raise ValueError(f"train.fusion=cpp runs CPU tensors, but this run is on {device.type}; "
                             "use train.fusion=auto, none or compile")
        return "none", None
    try:
        norm_rope_cpu.ops()
    except cpp_build.CppBuildError as exc:
        if mode == "cpp":
            raise ValueError(f"train.fusion=cpp: moetron's C++ kernels cannot be built here ({exc}); "
                             "use train.fusion=none") from None
        return "none", f"fusion: eager RMSNorm, RoPE and SwiGLU ({exc})"
    return "cpp", None


def _dispatch(name: str, reference: Callable) -> Callable:
    if _mode != "compile":
        return reference
    if name not in _compiled:
        _compiled[name] = torch.compile(reference, dynamic=True)
    return _compiled[name]


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back, then scale: the order transformers uses.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # x [B,h,S,d]; cos/sin [B or 1,S,d] holding each frequency twice (halves layout).
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not interleaved:
        return x * cos + _rotate_half(x) * sin
    # Interleaved pairs (x0,x1),(x2,x3)... rotate by one frequency each; the output
    # is written in halves layout, as DeepSeek's checkpoints expect.
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _RMSNormFunction(torch.autograd.Function):
    """`_rms_norm_ref` for fp32 x and weight: the same forward ops; saves x and the 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x * rstd)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x * rstd
        grad_normed = grad * weight
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        grad_w = (grad * normed).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class _RopeFunction(torch.autograd.Function):
    """`_rope_ref` in the halves layout, cos/sin [B or 1,1,S,d] without grad: the same forward ops."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        g1, g2 = (grad * sin).chunk(2, dim=-1)
        return grad * cos + torch.cat((g2, -g1), dim=-1), None, None  # rotate_half's transpose


def _rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        return _RMSNormFunction.apply(x, weight, eps)
    return _rms_norm_ref(x, weight, eps)


def _rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved or cos.requires_grad or sin.requires_grad:
        return _rope_ref(x, cos, sin, interleaved)
    return _RopeFunction.apply(x, cos.unsqueeze(1), sin.unsqueeze(1))


def _cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _mode == "compile":
        return _dispatch("rms_norm", _rms_norm_ref)(x, weight, eps)
    if _mode == "cpp" and norm_rope_cpu.rms_norm_applies(x, weight):
        return norm_rope_cpu.RMSNormFunction.apply(x, weight, eps)
    if _mode == "triton" and _triton_rmsnorm.applies(x, weight):
        return _triton_rmsnorm.RMSNormFunction.apply(x, weight, eps)
    return _rms_norm_eager(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _dispatch("swiglu", _swiglu_ref)(gate, up)


def weighted_swiglu(gate_up: torch.Tensor, probs: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """`silu(gate) * up * probs[:, None]` on `gate_up [N, 2F]` (gate columns first); `probs [N]` fp32 or None.

    `impl` (moetron/kernels/fused_swiglu.py): None by device (Triton on CUDA, else the reference),
    "auto" the fused kernel the device has (C++ on CPU, compiled on first use), or "torch" / "cpp" /
    "triton". The reference goes through the fusion switch like the other bodies here.
    """
    if impl is None and _mode == "cpp" and gate_up.device.type == "cpu" and gate_up.dtype in norm_rope_cpu.DTYPES:
        impl = "cpp"  # train.fusion=cpp: the C++ SwiGLU of the same library (within a few ulp)
    impl = fused_swiglu.resolve(impl, gate_up.device)
    if impl == "torch":
        fused_swiglu.check_args(gate_up, probs)
        return _dispatch("weighted_swiglu", fused_swiglu.weighted_swiglu_reference)(gate_up, probs)
    return fused_swiglu.fused_swiglu(gate_up, probs, impl)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if _mode == "compile":
        return _dispatch("rope", _rope_ref)(x, cos, sin, interleaved)
    if (_mode == "cpp" and not (cos.requires_grad or sin.requires_grad)
            and norm_rope_cpu.rope_applies(x, cos, sin)):
        return norm_rope_cpu.RopeFunction.apply(x, cos.unsqueeze(1), sin.unsqueeze(1), interleaved)
    if _mode == "triton" and _triton_rope.applies(x, cos, sin, interleaved):
        return _triton_rope.RopeFunction.apply(x, cos, sin, interleaved)
    return _rope_eager(x, cos, sin, interleaved)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """RoPE (halves layout) of the RMSNorm of x [B, S, heads, d], as [B, heads, S, d]: Qwen3's q/k norms.
    Under `cpp` one C++ op each way (the same bits as the two apart), else `rms_norm` then `apply_rope`."""
    if (_mode == "cpp" and not (cos.requires_grad or sin.requires_grad)
            and norm_rope_cpu.rms_norm_rope_applies(x, weight, cos, sin)):
        return norm_rope_cpu.RMSNormRopeFunction.apply(x, weight, eps, cos, sin)
    return apply_rope(rms_norm(x, weight, eps).transpose(1, 2), cos, sin)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (divide by the token count you want). Under `cpp`, fp32 CPU
    logits take one C++ pass each way (moetron/kernels/cross_entropy_cpu.py: within a few ulp), under
    `triton` CUDA logits one Triton kernel each way (moetron/kernels/triton_cross_entropy.py)."""
    if _mode == "cpp" and cross_entropy_cpu.applies(logits, labels):
        return cross_entropy_cpu.cross_entropy(logits, labels, ignore_index)
    if _mode == "triton" and _triton_ce.applies(logits, labels):
        return _triton_ce.cross_entropy(logits, labels, ignore_index)
    return _dispatch("cross_entropy", _cross_entropy_ref)(logits, labels, ignore_index)
