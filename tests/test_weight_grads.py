"""Weight gradients beside the backward pass (moetron/kernels/weight_grads.py, moetron/ops/linear.py):
the same bits as autograd (one use, several uses in a pass, accumulation over passes, whole trainer
steps of both families), errors reach the caller, and a weight that autograd also reaches is refused."""

import threading

import pytest
import torch
import torch.nn.functional as F

from moetron.kernels import threads, weight_grads
from moetron.kernels.weight_grads import defer_weight_grad, weight_grads_active, weight_grads_beside
from moetron.ops.linear import _Linear, linear

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _spy(monkeypatch) -> list:
    """Records each weight gradient that really went to the helper."""
    deferred = []
    real = weight_grads.defer_weight_grad

    def spy(weight, compute):
        done = real(weight, compute)
        deferred.append(done)
        return done

    monkeypatch.setattr("moetron.ops.linear.defer_weight_grad", spy)
    return deferred


@pytest.mark.parametrize("shape,out", [((8, 128, 64), 64), ((1024, 64), 8), ((3, 7, 48), 20), ((4, 9, 32), 256)])
def test_linear_is_f_linear_bit_for_bit(monkeypatch, shape, out):
    deferred = _spy(monkeypatch)
    g = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(*shape, generator=g), torch.randn(out, shape[-1], generator=g)
    dy = torch.randn(*shape[:-1], out, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with weight_grads_beside():
        y = linear(x, w)
        assert isinstance(y.grad_fn, _Linear._backward_cls)
        y.backward(dy)
        assert w.grad is None  # it arrives when the pass ends
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.linear(xr, wr)
    ref.backward(dy)
    assert deferred == [True]
    assert torch.equal(y, ref) and torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)
    assert w.grad.abs().max() > 1


def test_a_pass_leaves_no_reference_cycle_holding_its_tensors():
    """A deferred gradient's task, its closure and the pass referred to each other: each step's saved
    tensors then lived until a garbage collection (~20 MB a default-recipe step, 12 ms pauses)."""
    import gc
    import weakref

    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        with weight_grads_beside():
            y = linear(x * 1.0, w)  # the product is saved for the weight gradient, and only there
            saved = weakref.ref(y.grad_fn.saved_tensors[0])
            y.sum().backward()
        del y
        assert saved() is None  # freed by reference counting, no collection needed
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert w.grad is not None and w.grad.abs().max() > 1


def test_linear_outside_a_pass_or_under_autocast_is_f_linear():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    assert not weight_grads_active()
    assert linear(x, w).grad_fn.name() == F.linear(x, w).grad_fn.name()
    with weight_grads_beside(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts in F.linear
        y = linear(x, w)
        assert y.dtype == torch.bfloat16 and not isinstance(y.grad_fn, _Linear._backward_cls)


def test_several_uses_and_passes_sum_as_autograd_does():
    """A weight used twice in each of two passes (an MTP head): autograd sums a pass's gradients before
    adding them to .grad, and so must the helper (adding each to .grad in turn rounds differently)."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(64, 32, generator=g) * 10 ** (i % 3) for i in range(4)]
    w0 = torch.randn(48, 32, generator=g)

    def run(beside: bool, naive: bool = False):
        w = w0.clone().requires_grad_()
        for p in range(2):
            with weight_grads_beside(beside):
                a, b = xs[2 * p], xs[2 * p + 1]
                if naive:  # .grad += each gradient in turn
                    for x in (a, b):
                        (linear(x, w) ** 2).sum().backward()
                else:
                    ((linear(a, w) ** 2).sum() + (linear(b, w) ** 2).sum()).backward()
        return w.grad

    ref = run(False)
    assert not torch.equal(run(False, naive=True), ref)  # the order matters for these values
    assert torch.equal(run(True), ref)


def test_a_weight_that_autograd_also_reaches_is_refused():
    x, w = torch.randn(16, 8), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"shape \(4, 8\) got gradients both through autograd and beside"):
        with weight_grads_beside():
            (linear(x, w).sum() + (w * 2).sum()).backward()


def test_a_hooked_weight_keeps_autograd():
    x, w = torch.randn(16, 8), torch.randn(4, 8, requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    with weight_grads_beside():
        linear(x, w).sum().backward()
        assert len(seen) == 1  # through AccumulateGrad, during backward
    assert torch.equal(w.grad, seen[0])


class _Deferring(torch.autograd.Function):
    """y = x * w, whose weight gradient is `compute` run beside."""

    @staticmethod
    def forward(ctx, x, w, compute):
        ctx.w, ctx.compute = w, compute
        return x * w

    @staticmethod
    def backward(ctx, grad):
        assert defer_weight_grad(ctx.w, ctx.compute)
        return grad * ctx.w, None, None


def test_errors_reach_the_caller_and_the_pass_closes():
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    assert not defer_weight_grad(w, torch.ones_like)  # outside a pass: nothing queued

    def boom():
        raise ValueError("from the helper")

    with pytest.raises(ValueError, match="from the helper"):
        with weight_grads_beside():
            _Deferring.apply(x, w, boom).sum().backward()
    assert not weight_grads_active() and w.grad is None
    with weight_grads_beside():  # the next pass works
        _Deferring.apply(x, w, lambda: torch.ones(3)).sum().backward()
    assert torch.equal(w.grad, torch.ones(3))


def test_only_the_thread_that_opened_the_pass_defers():
    seen = []
    with weight_grads_beside():
        t = threading.Thread(target=lambda: seen.append(weight_grads_active()))
        t.start()
        t.join()
        assert weight_grads_active()
    assert seen == [False]
    with weight_grads_beside(enabled=False):
        assert not weight_grads_active()


@pytest.mark.parametrize("recipe,overrides", [("qwen3-moe-tiny", ["train.grad_accum=2"]),
                                              ("deepseek-v3-tiny", [])])  # MLA, dense layers, shared experts, MTP
def test_trainer_steps_are_the_same_bits(monkeypatch, recipe, overrides):
    """Three trainer steps with the helper (wide threads 2: experts' GEMMs, attention and weight
    gradients beside) and without (1) end with the same parameters to the bit."""
    from moetron.data.builtin import TokenBatches, stdlib_corpus
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train import trainer
    from moetron.train.setup import build_run

    deferred = _spy(monkeypatch)
    states = []
    for wide in (1, 2):
        threads.set_wide_threads(wide)
        try:
            r = apply_overrides(get_recipe(recipe), overrides + ["train.steps=3"])
            run = build_run(r, log=lambda s: None)
            data = TokenBatches(stdlib_corpus(), r.train.seq_len, r.train.micro_batch_size, r.train.seed)
            for step in range(3):
                trainer._train_step(run, data, step, 1.0, trainer._guard(run, "", step))
        finally:
            threads.set_wide_threads(1)
        states.append({k: v.detach().clone() for k, v in run.model.state_dict().items()})
        assert any(deferred) == (wide == 2)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_autograd_grad_inside_a_pass_leaves_grad_alone():
    """`torch.autograd.grad` differentiates only what it is asked for: no weight gradient reaches
    .grad, beside or not; a backward() after it in the same pass still does."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 8, generator=g, requires_grad=True), torch.randn(4, 8, generator=g, requires_grad=True)
    with weight_grads_beside():
        y = (linear(x, w) ** 2).sum()
        (gx,) = torch.autograd.grad(y, x, retain_graph=True)
        y.backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (F.linear(xr, wr) ** 2).sum().backward()
    assert torch.equal(gx, xr.grad) and torch.equal(w.grad, wr.grad)
    w.grad = None
    with weight_grads_beside():
        torch.autograd.grad((linear(x, w) ** 2).sum(), x)
    assert w.grad is None


def test_the_trainer_defers_only_with_a_helper_to_spare():
    from moetron.recipes import get_recipe
    from moetron.train import trainer
    from moetron.train.setup import build_run

    run = build_run(get_recipe("qwen3-moe-tiny"), log=lambda s: None)
    try:
        for intra, wide, expected in ((1, 1, False), (1, 2, True), (2, 2, False)):
            torch.set_num_threads(intra)
            threads.set_wide_threads(wide)
            assert trainer._grads_beside(run) == expected, (intra, wide)
    finally:
        threads.set_wide_threads(1)
        torch.set_num_threads(1)


def test_a_tensor_subclass_weight_keeps_f_linear():
    class Sub(torch.Tensor):
        pass

    x, w = torch.randn(4, 8), torch.randn(3, 8).as_subclass(Sub).requires_grad_()
    with weight_grads_beside():
        assert not isinstance(linear(x, w).grad_fn, _Linear._backward_cls)
