"""cache_fp8_weights: one FP8 copy of each weight per training step instead of one per micro-batch.

Current scaling (tensorwise, blockwise, mxfp8) quantizes unchanged weights to the same bytes, so
gradients with the cache equal those without it bitwise, while the tensors saved for backward
hold each weight's FP8 copy once however many micro-batches are in flight. Delayed scaling is
left uncached (its amax history moves every call). The cache must not outlive its block: moetron's
optimizers write weights through views that torch's version counters do not see.
"""

import contextlib
import dataclasses

import pytest
import torch

from moetron.config import apply_overrides
from moetron.model.model import MoETransformer
from moetron.precision import apply_fp8, cache_fp8_weights
from moetron.recipes import get_recipe
from moetron.train import trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
MICRO = 3


def _model(recipe: str) -> MoETransformer:
    cfg = dataclasses.replace(get_recipe("deepseek-v3-tiny").model, num_layers=2)
    torch.manual_seed(0)
    return apply_fp8(MoETransformer(cfg), recipe)


def _batches(vocab: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(MICRO)]


def _step(model, batches, cache: bool):
    """Forward all micro-batches (all in flight), then backward; grads and saved FP8 bytes."""
    saved: dict[int, int] = {}

    def pack(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    ctx = cache_fp8_weights(model) if cache else contextlib.nullcontext()
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = [model(x, labels=x).total_loss for x in batches]
        sum(losses).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(saved.values())


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_cached_weights_give_the_same_gradients_with_one_copy_per_step(recipe):
    model = _model(recipe)
    batches = _batches(model.config.vocab_size)
    plain, plain_bytes = _step(model, batches, cache=False)
    cached, cached_bytes = _step(model, batches, cache=True)
    assert plain.keys() == cached.keys() and len(plain) > 10
    for name in plain:
        assert torch.equal(plain[name], cached[name]), name
    fp8_weights = sum(p.numel() for n, p in model.named_parameters()
                      if p.dim() >= 2 and "embed" not in n and "lm_head" not in n and "router" not in n)
    # Without the cache each micro-batch saves its own copy of every FP8 weight (1 byte each).
    assert plain_bytes - cached_bytes >= (MICRO - 1) * fp8_weights * 0.9, (plain_bytes, cached_bytes)
    assert all(not m._fp8_weight_cache for m in model.modules() if hasattr(m, "_fp8_weight_cache"))


def test_delayed_scaling_is_not_cached():
    model = _model("delayed")
    batches = _batches(model.config.vocab_size)
    with cache_fp8_weights(model):
        model(batches[0], labels=batches[0]).total_loss.backward()
        assert all(not m._fp8_weight_cache for m in model.modules() if hasattr(m, "_fp8_weight_cache"))


def test_a_new_block_sees_weights_written_behind_autograds_back():
    """Weights changed through `.data` (as ZeRO writes them) leave _version alone: each block starts empty."""
    model = _model("tensorwise")
    x = _batches(model.config.vocab_size)[0]
    with cache_fp8_weights(model), torch.no_grad():
        before = model(x, labels=x).total_loss
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.data.mul_(1.5)
    with cache_fp8_weights(model), torch.no_grad():
        cached = model(x, labels=x).total_loss
    with torch.no_grad():
        fresh = model(x, labels=x).total_loss
    assert not torch.equal(before, fresh)
    assert torch.equal(cached, fresh)


def test_trainer_losses_equal_without_the_cache(tmp_path, monkeypatch):
    """3 steps, 2 micro-batches each, blockwise FP8: the cache changes memory, not one bit of the run."""
    def run():
        recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), [
            "model.num_layers=2", "train.seq_len=16", "train.micro_batch_size=2", "train.steps=3",
            "train.grad_accum=2", "train.fp8=blockwise", "train.log_every=100", f"train.metrics_file={tmp_path}/m.jsonl"])
        return [(m["loss"], m["grad_norm"]) for m in trainer.train(recipe, log=lambda s: None)]

    cached = run()
    monkeypatch.setattr(trainer, "cache_fp8_weights", lambda model: contextlib.nullcontext())
    assert run() == cached
