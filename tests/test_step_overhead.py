"""What the default run's start-up and small-model step avoid, each against an independent reference:
the corpus walk against `sorted(rglob)`, the dynamo-free AdamW against torch.optim.AdamW (and no
torch._dynamo import in a whole trainer step, in a fresh process), the eager RMSNorm / RoPE autograd
Functions against the reference bodies (and float64 gradcheck), SDPA's own GQA against the
expanded kv heads, and the trainer's gradient clipping against torch's clip_grad_norm_."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from moetron.data.builtin import TokenBatches, sorted_sources, stdlib_corpus
from moetron.ops import functional
from moetron.ops.attention_core import _expand_kv, core_attention
from moetron.optim.adamw import AdamW

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _reference_sources(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts and "dist-packages" not in p.parts]


def test_source_walk_is_sorted_rglob_on_a_tricky_tree(tmp_path):
    """Prefix names ('a' / 'a-b.py' / 'a.py'), a folder named like a source, a symlinked folder
    (not followed, as rglob), site-packages pruned, case order."""
    for rel in ["a/z.py", "a/b/c.py", "a-b.py", "a.py", "B.py", "b.py", "d.py/e.py", "x/y.txt", "x/.h.py",
                "site-packages/s.py", "k/dist-packages/t.py", "k/l.py"]:
        path = tmp_path / "root" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)
    (tmp_path / "root" / "link").symlink_to(tmp_path / "root" / "a", target_is_directory=True)
    root = tmp_path / "root"
    assert list(sorted_sources(root)) == _reference_sources(root)
    assert len(_reference_sources(root)) == 10  # the tree is not trivially empty


def test_stdlib_corpus_reads_the_files_sorted_rglob_lists():
    root = Path(sysconfig.get_paths()["stdlib"])
    reference = _reference_sources(root)
    walked = list(sorted_sources(root))
    assert walked == reference and len(walked) > 100
    chunks, total = [], 0
    for path in reference:  # the corpus as the rglob version built it
        data = path.read_bytes()
        chunks.append(data)
        total += len(data) + 1
        if total >= 1 << 20:
            break
    want = torch.tensor(list(b"\n".join(chunks)[: 1 << 20]), dtype=torch.int64)
    assert torch.equal(stdlib_corpus(max_bytes=1 << 20), want)
    small = stdlib_corpus(max_bytes=1 << 20, dtype=torch.uint8)  # what the trainer holds
    assert small.dtype == torch.uint8 and torch.equal(small.long(), want)
    for step, index in ((0, 0), (7, 3)):
        got, ref = TokenBatches(small, 32, 4, 5).batch(step, index), TokenBatches(want, 32, 4, 5).batch(step, index)
        assert all(a.dtype == torch.int64 and torch.equal(a, b) for a, b in zip(got, ref))


def _twin_models():
    """Two copies of one small model: one trained by moetron's AdamW, one by torch's."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    theirs = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _one_step(model, opt, x, step, frozen_bias=False):
    for group in opt.param_groups:
        group["lr"] = 3e-2 / (step + 1)
    model(x).square().sum().backward()
    if frozen_bias:  # a parameter without a gradient this step
        model[2].bias.grad = None
    opt.step()
    opt.zero_grad(set_to_none=True)


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("fused", [True, None])
def test_adamw_equals_torch_adamw_and_their_states_interchange(fused):
    ours_model, torch_model = _twin_models()
    kw = dict(lr=3e-2, betas=(0.9, 0.95), fused=fused)
    ours, theirs = AdamW(_groups(ours_model), **kw), torch.optim.AdamW(_groups(torch_model), **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(5, 6, generator=g)
        for model, opt in ((ours_model, ours), (torch_model, theirs)):
            _one_step(model, opt, x, step)
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)
        assert not torch.equal(a, torch.zeros_like(a))
    state = ours.state_dict()
    assert str(state) == str(theirs.state_dict())
    fresh = torch.optim.AdamW(_groups(torch_model), **kw)
    fresh.load_state_dict(state)  # ours -> torch's, and torch's -> ours
    back = AdamW(_groups(ours_model), **kw)
    back.load_state_dict(theirs.state_dict())
    assert str(fresh.state_dict()) == str(back.state_dict()) == str(state)


def test_adamw_fused_fast_path_equals_torch_step_by_step(monkeypatch):
    """The fused fast path (torch's two kernel calls per group, without its per-parameter Python) against
    torch.optim.AdamW bit for bit, through the cases it must leave to torch's step: the first step (no
    state), a parameter without a gradient, an empty group, a state reloaded mid-run; and it must run."""
    from moetron.optim import adamw

    slow, torch_step = [], adamw._STEP
    monkeypatch.setattr(adamw, "_STEP", lambda *args: slow.append(1) or torch_step(*args))
    ours_model, torch_model = _twin_models()
    kw = dict(lr=3e-2, betas=(0.9, 0.95), fused=True)
    ours = AdamW(_groups(ours_model) + [{"params": []}], **kw)
    theirs = torch.optim.AdamW(_groups(torch_model) + [{"params": []}], **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(7):
        x = torch.randn(5, 6, generator=g)
        for model, opt in ((ours_model, ours), (torch_model, theirs)):
            _one_step(model, opt, x, step, frozen_bias=step == 3)  # torch skips it: the fast path must not run
        if step == 4:
            ours.load_state_dict(ours.state_dict())  # new state tensors: read afresh, not cached
        for a, b in zip(ours_model.parameters(), torch_model.parameters()):
            assert torch.equal(a, b), step
    assert str(ours.state_dict()) == str(theirs.state_dict())
    assert len(slow) == 2, slow  # step 0 (no state yet) and step 3 (a gradient missing); 5 fast steps

def test_a_trainer_step_never_imports_torch_dynamo():
    """torch.optim's first step / zero_grad imports torch._dynamo (about a second of start-up)."""
    code = """
import sys
import torch
from moetron.data.builtin import TokenBatches, stdlib_corpus
from moetron.model.size import training_flops_per_token
from moetron.recipes import apply_overrides, get_recipe
from moetron.train import trainer
from moetron.train.setup import build_run
recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), ["model.num_layers=1", "train.seq_len=16"])
run = build_run(recipe, log=lambda s: None)
data = TokenBatches(stdlib_corpus(1 << 16), 16, 2, 0)
for step in range(2):
    m = trainer._train_step(run, data, step, training_flops_per_token(recipe.model, 16), trainer._guard(run, "", step))
run.optimizer.load_state_dict(run.optimizer.state_dict())
assert m["grad_norm"] > 0 and m["loss"] > 0, m
print(sorted(k for k in sys.modules if k.startswith("torch._dynamo")))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 4, 16)])
def test_rms_norm_function_matches_the_reference(shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g).requires_grad_()
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).requires_grad_()
    grad = torch.randn(*shape, generator=g)
    want = functional._rms_norm_ref(x, w, 1e-6)
    got = functional.rms_norm(x, w, 1e-6)
    assert got.grad_fn.name().endswith("_RMSNormFunctionBackward")
    assert torch.equal(got, want)  # the same forward ops
    for a, b in zip(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(functional._RMSNormFunction.apply, (x64, w64, 1e-6))
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    assert functional.rms_norm(xb, wb, 1e-6).grad_fn.name() == "MulBackward0"  # bf16: the reference


def test_rope_function_matches_the_reference_bit_for_bit():
    from moetron.model.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    cos, sin = RotaryEmbedding(16, 10000.0)(torch.arange(9).unsqueeze(0), torch.float32)
    x = torch.randn(2, 4, 9, 16, generator=g).requires_grad_()
    grad = torch.randn(2, 4, 9, 16, generator=g)
    got, want = functional.apply_rope(x, cos, sin), functional._rope_ref(x, cos, sin, False)
    assert got.grad_fn.name().endswith("_RopeFunctionBackward")
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0])
    args = (x.detach().double().requires_grad_(), cos.unsqueeze(1).double(), sin.unsqueeze(1).double())
    assert torch.autograd.gradcheck(functional._RopeFunction.apply, args)


@pytest.mark.parametrize("queries", [9, 4])
def test_cpu_sdpa_reads_kv_heads_for_their_groups_as_the_expanded_reference(queries):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, queries, 8, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 9, 8, generator=g).requires_grad_() for _ in range(2))
    grad = torch.randn(2, 6, queries, 8, generator=g)
    got = core_attention(q, k, v, 0.3)
    keep = torch.ones(queries, 9, dtype=torch.bool).tril(9 - queries)
    want = torch.nn.functional.scaled_dot_product_attention(q, _expand_kv(k, 6), _expand_kv(v, 6), attn_mask=keep,
                                                             scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_norm_of_norm", [2.0, 0.5, 1.0])  # no clip, clip, at the norm itself
def test_clip_equals_torch_and_skips_the_pass_that_multiplies_by_one(monkeypatch, max_norm_of_norm):
    """The trainer's norm (a BLAS dot per large fp32 CPU gradient, `_foreach_norm` for the rest) within
    1e-6 of torch's, and its clip torch's multiply by torch's coefficient (the same bits given the norm),
    skipped where that coefficient is not < 1."""
    from moetron.parallel.grad_norm import clip_, sum_of_squares

    gen = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (5,), (3, 4, 2), (300, 250)]  # the last one large enough for a BLAS dot
    grads = [torch.randn(s, generator=gen) for s in shapes]
    want_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    norm = sum_of_squares(grads, "cpu").sqrt()
    torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
    max_norm = float(norm) * max_norm_of_norm
    ours, ref = ([torch.nn.Parameter(torch.zeros(s)) for s in shapes] for _ in range(2))
    for a, b, g in zip(ours, ref, grads):
        a.grad, b.grad = g.clone(), g.clone()
    passes = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: passes.append(1) or real(*a, **k))
    clip_([p.grad for p in ours], norm, max_norm)
    monkeypatch.setattr(torch, "_foreach_mul_", real)
    torch.nn.utils.clip_grads_with_norm_(ref, max_norm, norm, foreach=True)  # torch's clip, given our norm
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, ref))
    clipped = bool(max_norm / (norm + 1e-6) < 1.0)  # at the norm itself: < 1 only where the 1e-6 shows in fp32
    assert clipped == (max_norm_of_norm == 0.5 or (max_norm_of_norm == 1.0 and float(norm + 1e-6) > float(norm)))
    assert passes == ([1] if clipped else [])
    assert any(not torch.equal(a.grad, g) for a, g in zip(ours, grads)) == clipped
