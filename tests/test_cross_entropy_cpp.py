"""moetron's C++ cross-entropy (moetron/kernels/cross_entropy_cpu.py, csrc/cross_entropy_cpu.cpp): the
summed loss and the logits' gradient against torch's `F.cross_entropy` and a float64 reference, with
ignored labels; the same bits on one thread or two; `ops.cross_entropy` takes it only under the C++
fusion; labels out of range are errors naming the row."""

import pytest
import torch
import torch.nn.functional as F

from moetron.kernels import cross_entropy_cpu
from moetron.ops import cross_entropy, set_fusion

pytestmark = pytest.mark.usefixtures("one_thread", "cpp_kernels")  # conftest.py


def _data(N, V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * scale
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    return logits, labels


def _run(fn, logits, labels, dloss):
    x = logits.clone().requires_grad_()
    loss = fn(x, labels)
    loss.backward(dloss)
    return loss.detach(), x.grad


@pytest.mark.parametrize("N,V", [(1024, 256), (37, 1000), (3, 5), (64, 129)])
def test_matches_torch_and_float64(N, V):
    logits, labels = _data(N, V)
    dloss = torch.tensor(0.37)
    got, dgot = _run(lambda x, y: cross_entropy_cpu.CrossEntropyFunction.apply(x, y, -100), logits, labels, dloss)
    want, dwant = _run(lambda x, y: F.cross_entropy(x, y, reduction="sum"), logits, labels, dloss)
    ref, dref = _run(lambda x, y: F.cross_entropy(x, y, reduction="sum"), logits.double(), labels, dloss.double())
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - ref.item()) <= 2e-6 * abs(ref.item()) + 1e-6
    assert abs(got.item() - want.item()) <= 4e-6 * abs(ref.item()) + 1e-6
    scale = dref.abs().max()
    assert scale > 0.1
    assert (dgot.double() - dref).abs().max() <= 2e-6 * scale
    assert (dgot - dwant).abs().max() <= 4e-6 * scale
    ignored = labels == -100
    assert torch.equal(dgot[ignored], torch.zeros_like(dgot[ignored]))


def test_the_same_bits_on_two_threads():
    logits, labels = _data(2048, 256, seed=1)
    one = _run(lambda x, y: cross_entropy_cpu.CrossEntropyFunction.apply(x, y, -100), logits, labels, torch.tensor(1.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = _run(lambda x, y: cross_entropy_cpu.CrossEntropyFunction.apply(x, y, -100), logits, labels,
                   torch.tensor(1.0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_ops_cross_entropy_takes_it_under_the_cpp_fusion_only():
    logits, labels = _data(2, 16)
    x = logits.view(2, 1, 16).expand(2, 3, 16).clone().requires_grad_()  # [B, S, V] as the model hands it
    y = torch.randint(0, 16, (2, 3))
    assert cross_entropy(x, y).grad_fn.name() != "CrossEntropyFunctionBackward"
    set_fusion("cpp")  # conftest.py restores "none"
    loss = cross_entropy(x, y)
    assert "CrossEntropyFunctionBackward" in loss.grad_fn.name()
    assert torch.allclose(loss, F.cross_entropy(x.reshape(-1, 16), y.reshape(-1), reduction="sum"), rtol=1e-6)
    assert not cross_entropy_cpu.applies(x.double(), y)
    assert not cross_entropy_cpu.applies(x, y.int())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cross_entropy_cpu.applies(x, y)


def test_a_label_out_of_range_is_an_error_naming_its_row():
    logits, labels = _data(8, 10)
    labels[6] = 10
    with pytest.raises(RuntimeError, match="label 10 at row 6 is out of range for 10 classes"):
        cross_entropy_cpu.ops().cross_entropy_forward(logits, labels, -100)
    with pytest.raises(RuntimeError, match="logits must be a contiguous float32 CPU tensor"):
        cross_entropy_cpu.ops().cross_entropy_forward(logits.t(), labels[:10], -100)
