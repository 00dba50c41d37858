"""Two settings of one training run, alternating step by step in one process: what a change buys.

    python benchmarks/step_ab.py --compare weight_grads     # weight gradients beside the backward, or not
    python benchmarks/step_ab.py --compare helper           # a small model's helper thread (wide threads 2), or none
    python benchmarks/step_ab.py --compare attention_split --set train.fusion=none  # torch's attention in two halves, or one call
    python benchmarks/step_ab.py --compare permute          # the MoE permute in torch ops, or the C++ kernel
    python benchmarks/step_ab.py --compare router           # the router (softmax or DeepSeek's sigmoid) in torch ops, or in C++
    python benchmarks/step_ab.py --compare norm_rope        # Qwen3's q/k norm and RoPE as two C++ ops, or one
    python benchmarks/step_ab.py --compare stacked_projections  # q/k/v (gate/up) as one autograd node, or three
    python benchmarks/step_ab.py --compare attention_kernel  # torch's flash attention, or moetron's C++ kernel
    python benchmarks/step_ab.py --compare cross_entropy    # torch's cross_entropy, or moetron's C++ pass
    python benchmarks/step_ab.py --compare grad_norm        # the gradient norm through torch's kernel, or BLAS dots
    python benchmarks/step_ab.py --compare adamw_fast_path  # torch's AdamW.step, or its two kernel calls per group
    python benchmarks/step_ab.py --recipe deepseek-v3-tiny --set train.grad_accum=2 --steps 300 --runs 3

On the shared 2-core development VM the same command's step medians move 10-15 % between runs, more
than most single changes buy. Here both settings train one model on the same data in one process,
switching every step, so drift, allocator state and other load hit both alike and their ratio holds to
~2 %. The run is set up as `moetron train` sets it up (its host choices: one intra-op thread and a
helper for a small model, freed memory kept, sleeping OpenMP waits). Every setting compared here gives
the same bits as its alternative (tested), so switching mid-run changes nothing but the time; the C++
router and cross-entropy agree with the eager ones within a few ulp (tests/test_fused_router.py), so there it also changes
the rounding, as the C++ permute does beyond top-2 (it sums a token's k outputs in slot order, the torch
one in expert order), and so does the trainer's gradient norm (BLAS dots sum in another order than
torch's norm kernel: within 1e-6 of it, tests/test_step_overhead.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `moetron` command sets it (moetron/__main__.py)
import torch  # noqa: E402  (the policy is read when torch loads OpenMP)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import format_table  # noqa: E402


def _switched(owner, attr: str, off, labels: tuple[str, str]):
    """The two settings of `owner.attr`: replaced by `off`, then the real one."""
    real = getattr(owner, attr)
    return [(labels[0], lambda: setattr(owner, attr, off)), (labels[1], lambda: setattr(owner, attr, real))]


def _settings(name: str):
    """(label, apply) for the setting off and on."""
    from moetron.kernels import attention_cpu, cross_entropy_cpu, norm_rope_cpu, sdpa_cpu, threads
    from moetron.ops import linear
    from moetron.train import trainer

    never = lambda *args: False  # noqa: E731
    if name == "weight_grads":
        return _switched(trainer, "_grads_beside", never,
                         ("weight gradients in the backward", "weight gradients beside"))
    if name == "helper":
        wide = threads.wide_threads()
        if wide < 2:
            raise SystemExit("--compare helper: this run has no helper (a small one-process CPU model gets one)")
        return [("no helper (wide threads 1)", lambda: threads.set_wide_threads(1)),
                (f"helper (wide threads {wide})", lambda: threads.set_wide_threads(wide))]
    if name == "attention_split":
        return _switched(sdpa_cpu, "applies", never, ("attention in one call", "attention in two halves"))
    if name == "norm_rope":
        return _switched(norm_rope_cpu, "rms_norm_rope_applies", never,
                         ("q/k norm, then RoPE", "q/k norm and RoPE in one op"))
    if name == "router":  # the softmax top-k router and DeepSeek-V3's sigmoid one alike
        from moetron.kernels import fused_router
        return _switched(fused_router, "applies", never, ("eager router", "C++ router"))
    if name == "attention_kernel":
        return _switched(attention_cpu, "applies", never, ("torch's flash kernel", "moetron's C++ attention"))
    if name == "stacked_projections":
        return _switched(linear, "_stackable", lambda *args: None, ("q, k, v as three nodes", "q, k, v as one node"))
    if name == "cross_entropy":
        return _switched(cross_entropy_cpu, "applies", never, ("torch's cross_entropy", "moetron's C++ cross-entropy"))
    if name == "grad_norm":
        return _switched(trainer, "_optimizer_step", _torch_clip_step,
                         ("torch's gradient norm", "the norm through BLAS dots"))
    if name == "adamw_fast_path":
        from moetron.optim.adamw import AdamW
        return _switched(AdamW, "_fused_step", never, ("torch's AdamW.step", "the fused calls directly"))
    if name == "permute":
        from moetron.dispatch import permute
        return [("torch permute", lambda: permute.set_permute_impl("torch")),
                ("C++ permute", lambda: permute.set_permute_impl("cpp"))]
    raise SystemExit(f"--compare: unknown setting {name!r}")


def _torch_clip_step(run) -> float:
    """The single-process optimizer step with torch's norm (`_foreach_norm`, on a CPU its norm kernel per
    tensor), the trainer's before this session: then the same clip (a multiply when its coefficient is < 1)."""
    utils, max_norm = torch.nn.utils, run.recipe.train.grad_clip
    params = list(run.model.parameters())
    norm = utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    if bool(max_norm / (norm + 1e-6) < 1.0):
        utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    if bool(norm.isfinite()):
        run.optimizer.step()
    return float(norm)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare", required=True, choices=("weight_grads", "helper", "attention_split", "permute", "router", "norm_rope",
                                                       "stacked_projections", "attention_kernel", "cross_entropy", "grad_norm",
                                                       "adamw_fast_path"))
    p.add_argument("--recipe", default="qwen3-moe-tiny")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--steps", type=int, default=200, help="steps per run, the settings alternating")
    p.add_argument("--warmup", type=int, default=10, help="first steps of each run left out")
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")

    from moetron.data.builtin import TokenBatches, stdlib_corpus
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train import trainer
    from moetron.train.host import keep_freed_memory, small_model_threads
    from moetron.train.setup import build_run

    recipe = apply_overrides(get_recipe(args.recipe), args.set)
    t = recipe.train
    run = build_run(recipe, log=lambda line: None)
    small_model_threads(run, recipe, print)
    keep_freed_memory(run.device, print)
    data = TokenBatches(stdlib_corpus(), t.seq_len, t.micro_batch_size, t.seed)
    if args.compare == "attention_split":
        from moetron.kernels import attention_cpu
        from moetron.ops import fusion_mode
        if fusion_mode() == "cpp" and attention_cpu.head_dim_runs(recipe.model.head_dim) and t.dtype == "fp32":
            raise SystemExit("--compare attention_split: this run's attention is moetron's C++ kernel, which splits "
                             "its batch itself; compare torch's kernel in halves with --set train.fusion=none")
    if args.compare == "cross_entropy":
        from moetron.ops import fusion_mode
        if fusion_mode() != "cpp" or t.dtype != "fp32":
            raise SystemExit("--compare cross_entropy: this run's loss is not moetron's C++ cross-entropy (it runs "
                             "fp32 CPU runs under train.fusion=cpp, auto's choice there); nothing would change")
    settings = _settings(args.compare)
    run.model.train()
    print(f"{args.recipe} ({' '.join(args.set) or 'as shipped'}), {args.steps} steps a run alternating "
          f"{len(settings)} settings, first {args.warmup} left out; torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op thread(s)")
    rows, step = [], 0
    for r in range(args.runs):
        times = [[] for _ in settings]
        for i in range(args.steps):
            which = i % len(settings)
            settings[which][1]()
            start = time.perf_counter()
            trainer._train_step(run, data, step, 1.0, trainer._guard(run, "", step))
            if i >= args.warmup:
                times[which].append((time.perf_counter() - start) * 1e3)
            step += 1
        base = statistics.median(times[0])
        for (label, _), ts in zip(settings, times):
            ts.sort()
            rows.append([str(r + 1), label, str(len(ts)), f"{ts[len(ts) // 10]:.1f}", f"{ts[len(ts) // 4]:.1f}",
                         f"{statistics.median(ts):.1f}", f"{statistics.median(ts) / base:.3f}x"])
    settings[-1][1]()
    print(format_table(["run", "setting", "steps", "p10 ms", "p25 ms", "median ms", "vs first"], rows))
    try:
        print(f"load average (1 min) after: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    except OSError:
        pass


if __name__ == "__main__":
    main()
