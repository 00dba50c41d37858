"""The C++ token cross-entropy (`train.fusion=cpp`, the CPU default through `auto`) against float64
`F.cross_entropy`: the summed loss and the logits' gradient within a few fp32 ulp (no worse than torch's
own fp32 kernel by more than that), ignored rows, bad labels, non-finite logits, and the model's loss
routed through it."""

import math

import pytest
import torch
import torch.nn.functional as F

from moetron import ops
from moetron.kernels import cross_entropy_cpu

pytestmark = pytest.mark.usefixtures("one_thread", "cpp_kernels")  # conftest.py


@pytest.fixture
def cpp_fusion():
    ops.set_fusion("cpp")
    yield
    ops.set_fusion("none")


def _loss_and_grad(fn, logits, labels, grad):
    x = logits.clone().requires_grad_()
    loss = fn(x, labels)
    loss.backward(grad)
    return loss.detach(), x.grad


def _reference(x, labels, ignore=-100):
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1), ignore_index=ignore, reduction="sum")


@pytest.mark.parametrize("shape", [(1024, 256), (3, 37, 13), (2, 5), (4, 70000)])
def test_loss_and_gradient_within_a_few_ulp_of_float64(shape):
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(*shape, generator=g) * 4
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    labels.view(-1)[::7] = -100  # ignored rows (padding, a document's first token)
    grad = torch.tensor(0.37)
    fn = lambda x, y: cross_entropy_cpu.cross_entropy(x, y, -100)  # noqa: E731
    loss, dx = _loss_and_grad(fn, logits, labels, grad)
    want, want_dx = _loss_and_grad(_reference, logits.double(), labels, grad.double())
    torch_loss, torch_dx = _loss_and_grad(_reference, logits, labels, grad)
    assert type(loss) is torch.Tensor and loss.dtype == torch.float32 and loss.dim() == 0
    rows = int((labels != -100).sum())
    loss_err, torch_loss_err = abs(float(loss) - float(want)), abs(float(torch_loss) - float(want))
    assert rows and loss_err <= max(2 * torch_loss_err, 1e-6 * abs(float(want))), (loss_err, torch_loss_err)
    dx_err, torch_dx_err = (dx.double() - want_dx).abs().max(), (torch_dx.double() - want_dx).abs().max()
    assert dx_err <= max(4 * torch_dx_err, 3e-7 * float(grad)), (float(dx_err), float(torch_dx_err))
    ignored = (labels == -100).reshape(-1)
    assert torch.equal(dx.reshape(-1, shape[-1])[ignored], torch.zeros(int(ignored.sum()), shape[-1]))


def test_every_row_ignored_gives_zero_loss_and_gradient():
    logits = torch.randn(4, 9)
    labels = torch.full((4,), 3)
    loss, dx = _loss_and_grad(lambda x, y: cross_entropy_cpu.cross_entropy(x, y, 3), logits, labels,
                              torch.tensor(1.0))
    assert float(loss) == 0.0 and torch.equal(dx, torch.zeros(4, 9))


def test_a_label_out_of_range_names_its_row():
    labels = torch.tensor([1, 2, 9, 0])
    with pytest.raises(RuntimeError, match="label 9 of row 2 is out of range for 9 classes"):
        cross_entropy_cpu.cross_entropy(torch.randn(4, 9), labels, -100)


def test_non_finite_logits_give_a_non_finite_loss():
    """The trainer skips or stops on a non-finite loss: the fused pass must not hide one."""
    for bad in (math.nan, math.inf):
        logits = torch.randn(3, 20)
        logits[1, 5] = bad
        loss = cross_entropy_cpu.cross_entropy(logits, torch.tensor([0, 1, 2]), -100)
        assert not math.isfinite(float(loss))


def test_applies_only_to_fp32_cpu_logits():
    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))
    assert cross_entropy_cpu.applies(x, y)
    assert not cross_entropy_cpu.applies(x.double(), y)
    assert not cross_entropy_cpu.applies(x, y.int())
    assert not cross_entropy_cpu.applies(x, y[:3])


def test_the_models_loss_goes_through_it_under_cpp(cpp_fusion):
    from moetron.config import ModelConfig
    from moetron.model.model import MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4, top_k=2)
    model = MoETransformer(cfg)
    ids = torch.randint(0, 64, (2, 12))
    labels = ids.clone()
    labels[:, 0] = -100
    seen = []
    real = cross_entropy_cpu.cross_entropy
    cross_entropy_cpu.cross_entropy = lambda *a: seen.append(1) or real(*a)
    try:
        fused = model(ids, labels=labels).loss
    finally:
        cross_entropy_cpu.cross_entropy = real
    ops.set_fusion("none")
    eager = model(ids, labels=labels).loss
    assert seen == [1]
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=0)
