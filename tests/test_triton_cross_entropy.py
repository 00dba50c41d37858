"""The Triton token cross-entropy (`train.fusion=triton`, the GPU default through `auto`), run under
TRITON_INTERPRET=1, against float64 `F.cross_entropy`: the summed loss and the logits' gradient
within a few fp32 ulp (no worse than torch's own fp32 kernel by more than that), bf16 logits within
one bf16 rounding of the exact gradient, ignored rows, bad labels, and the model's loss routed
through it. tests/test_cuda.py runs the compiled kernels on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from triton_utils import interpreted_kernels
from moetron import ops

pytestmark = pytest.mark.usefixtures("one_thread")

k = interpreted_kernels("moetron.kernels.triton_cross_entropy")  # the kernels, or a skip saying why


def _loss_and_grad(fn, logits, labels, grad):
    x = logits.clone().requires_grad_()
    loss = fn(x, labels)
    loss.backward(grad)
    return loss.detach(), x.grad


def _reference(x, labels, ignore=-100):  # as ops.functional's: half logits computed in fp32; fp64 kept
    x = x if x.dtype == torch.float64 else x.float()
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1), ignore_index=ignore,
                           reduction="sum")


def _inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g) * 4
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    labels.view(-1)[::7] = -100  # ignored rows (padding, a document's first token)
    return logits, labels


@pytest.mark.parametrize("shape", [(64, 256), (3, 37, 13), (2, 5), (3, 9000)])  # 9000: three blocks a row
def test_fp32_loss_and_gradient_within_a_few_ulp_of_float64(k, shape):
    logits, labels = _inputs(shape, sum(shape))
    grad = torch.tensor(0.37)
    fn = lambda x, y: k.cross_entropy(x, y, -100)  # noqa: E731
    loss, dx = _loss_and_grad(fn, logits, labels, grad)
    want, want_dx = _loss_and_grad(_reference, logits.double(), labels, grad.double())
    torch_loss, torch_dx = _loss_and_grad(_reference, logits, labels, grad)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and dx.dtype == torch.float32
    loss_err, torch_loss_err = abs(float(loss) - float(want)), abs(float(torch_loss) - float(want))
    assert loss_err <= max(2 * torch_loss_err, 1e-6 * abs(float(want))), (loss_err, torch_loss_err)
    dx_err, torch_dx_err = (dx.double() - want_dx).abs().max(), (torch_dx.double() - want_dx).abs().max()
    # Every element of the gradient is at most |grad| in size: 8 fp32 ulps of |grad| (torch's own error is
    # smaller on an AVX-512 CPU than on an AVX2 one: measured there 1.5-2.1e-7 against torch's 4-9e-8).
    assert dx_err <= max(4 * torch_dx_err, 8 * 2**-23 * float(grad)), (float(dx_err), float(torch_dx_err))
    ignored = (labels == -100).reshape(-1)
    assert int(ignored.sum()) and not dx.reshape(-1, shape[-1])[ignored].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_give_the_references_loss_and_a_gradient_within_one_rounding(k, dtype):
    logits, labels = _inputs((48, 3000), 5)
    logits, grad = logits.to(dtype), torch.tensor(1 / 41)
    loss, dx = _loss_and_grad(lambda x, y: k.cross_entropy(x, y, -100), logits, labels, grad)
    want, want_dx = _loss_and_grad(_reference, logits.double(), labels, grad.double())
    ref_loss, ref_dx = _loss_and_grad(_reference, logits, labels, grad)  # fp32 compute, dx cast back
    assert dx.dtype == ref_dx.dtype == dtype and loss.dtype == torch.float32
    assert abs(float(loss) - float(want)) <= 1e-6 * abs(float(want))
    assert abs(float(ref_loss) - float(want)) <= 1e-6 * abs(float(want))
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    # one rounding of the exact value (half a subnormal step near zero), and fp32 noise before it
    bound = (u + 1e-5) * want_dx.abs() + u * torch.finfo(dtype).tiny + 1e-7 * float(grad)
    assert ((dx.double() - want_dx).abs() <= bound).all()
    assert ((ref_dx.double() - want_dx).abs() <= bound).all()  # the bound is the reference's too


def test_every_row_ignored_gives_zero_loss_and_gradient(k):
    logits, labels = torch.randn(4, 9), torch.full((4,), 3)
    loss, dx = _loss_and_grad(lambda x, y: k.cross_entropy(x, y, 3), logits, labels, torch.tensor(1.0))
    assert float(loss) == 0.0 and not dx.any()


def test_a_label_out_of_range_gives_a_nan_loss_not_a_read_past_the_row(k):
    logits, labels = torch.randn(3, 9), torch.tensor([1, 9, -5])
    losses, _ = k.forward(logits, labels, -100)
    assert torch.isfinite(losses[0]) and losses[1:].isnan().all()


def test_bad_arguments_are_refused_by_name(k):
    with pytest.raises(ValueError, match="logits must be a contiguous"):
        k.forward(torch.randn(4, 9).t(), torch.zeros(9, dtype=torch.int64), -100)
    with pytest.raises(ValueError, match="labels must be a contiguous int64"):
        k.forward(torch.randn(4, 9), torch.zeros(4, dtype=torch.int32), -100)
    assert not k.applies(torch.randn(4, 9, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))


def test_the_models_loss_goes_through_it_under_triton_fusion(k, monkeypatch):
    calls = []
    monkeypatch.setattr(k, "cross_entropy", lambda *a: calls.append(1) or _reference(*a))
    logits, labels = _inputs((2, 6, 11), 3)
    ops.set_fusion("triton")
    try:
        loss = ops.cross_entropy(logits, labels)
    finally:
        ops.set_fusion("none")
    assert calls == [1] and torch.allclose(loss, _reference(logits, labels))
