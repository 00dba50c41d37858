"""grouped_gemm/backend.py and the TORCH_CHECKs of csrc/grouped_gemm.cu::GroupedGemm, on the CPU
(the `a.is_cuda()` checks are the one thing a CPU fake cannot keep)."""

import torch


def _check(cond, what):
    if not cond:  # TORCH_CHECK raises RuntimeError with the failed expression
        raise RuntimeError(f"Expected {what} to be true, but got false.")


def _allocate_output(a, b, batch_sizes, trans_a, trans_b):
    assert not (trans_a and trans_b)
    assert batch_sizes.ndim == 1, "Expected 1d tensor for batch_sizes"
    assert a.ndim == 2, "Expected 2d tensor for 'a'"
    assert b.ndim == (2 if trans_a else 3)
    shape = ((batch_sizes.shape[0], a.shape[1], b.shape[1]) if trans_a else
             (a.shape[0], (b.shape[1] if trans_b else b.shape[2])))
    return torch.empty(*shape, device=a.device, dtype=a.dtype)


def _grouped_gemm(a, b, c, batch_sizes, trans_a, trans_b):
    _check(not (trans_a and trans_b), "!(trans_a && trans_b)")
    _check(batch_sizes.device.type == "cpu", "batch_sizes.is_cpu()")
    _check(batch_sizes.ndim == 1, "batch_sizes.ndimension() == 1")
    _check(batch_sizes.dtype == torch.int64, "batch_sizes.scalar_type() == torch::kInt64")
    _check(a.ndim == 2, "a.ndimension() == 2")
    _check(a.dtype == torch.bfloat16, "a.scalar_type() == torch::kBFloat16")
    _check(b.dtype == torch.bfloat16, "b.scalar_type() == torch::kBFloat16")
    _check(c.dtype == torch.bfloat16, "c.scalar_type() == torch::kBFloat16")
    _check(a.is_contiguous(), "a.is_contiguous()")
    _check(b.is_contiguous(), "b.is_contiguous()")
    _check(c.is_contiguous(), "c.is_contiguous()")
    counts = batch_sizes.tolist()
    if trans_a:  # c[e] = a[rows e]^T @ b[rows e]  (weight gradients)
        _check(b.ndim == 2, "b.ndimension() == 2")
        _check(a.shape[0] == b.shape[0], "tokens == b.size(0)")
        _check(c.ndim == 3 and c.shape == (len(counts), a.shape[1], b.shape[1]), "c shape")
        for e, (ae, be) in enumerate(zip(a.split(counts), b.split(counts))):
            c[e] = (ae.float().t() @ be.float()).to(c.dtype)
        return
    _check(b.ndim == 3, "b.ndimension() == 3")
    _check(b.shape[0] == len(counts), "batch_sizes.size(0) == num_experts")
    hidden_in = b.shape[2] if trans_b else b.shape[1]
    _check(hidden_in == a.shape[1], "hidden_in == a.size(1)")
    _check(sum(counts) == a.shape[0], "sum(batch_sizes) == tokens")
    start = 0
    for e, n in enumerate(counts):  # fp32 accumulation, one rounding to bf16 (CUTLASS / cuBLAS)
        be = b[e].float()
        c[start:start + n] = (a[start:start + n].float() @ (be.t() if trans_b else be)).to(c.dtype)
        start += n


def gmm(a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
    if c is None:
        c = _allocate_output(a, b, batch_sizes, trans_a, trans_b)
    _grouped_gemm(a, b, c, batch_sizes, trans_a, trans_b)
    return c
