"""Where one training step's time goes: torch.profiler over a few trainer steps of a recipe.

    python benchmarks/profile_step.py --recipe qwen3-moe-tiny --set train.dtype=bf16 ...
    python benchmarks/profile_step.py --rows 30 --sort self_cpu_time_total
    python benchmarks/profile_step.py ... --trace step.json.gz    # also a Chrome trace (chrome://tracing, Perfetto)
    python benchmarks/profile_step.py ... --syncs     # on a GPU: where the host waits for the device, per step

Builds the run exactly as `moetron train` does (same overrides, OpenMP wait policy and host choices),
runs `--warmup` steps, then profiles `--steps` steps and prints the op table (device time on a GPU,
CPU time otherwise) and the split of wall time between forward+backward, gradient sync and optimizer
step.

`--syncs` (a CUDA run) profiles nothing: it runs `--steps` steps under `torch.cuda.set_sync_debug_mode("warn")`
and prints how often each line of the step makes the host wait for the device (`.item()`, `float(t)`,
`.tolist()`, a copy to the host...). Every such wait empties the GPU's queue, which then idles while the host
prepares what comes next: the number that says whether a step can run ahead of its host.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `moetron` command sets it (moetron/__main__.py)
import torch  # noqa: E402  (the policy is read when torch loads OpenMP)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="qwen3-moe-tiny")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--sort", default=None, help="profiler column to sort by (default: device or CPU self time)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write the profiled steps as a Chrome trace (gzip-compressed when FILE ends in .gz)")
    p.add_argument("--syncs", action="store_true",
                   help="on a GPU: count each line's host-device synchronisations over --steps steps (no profile)")
    args = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from moetron.model.size import training_flops_per_token
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train import trainer
    from moetron.data.builtin import TokenBatches, stdlib_corpus
    from moetron.train.host import keep_freed_memory, small_model_threads
    from moetron.train.setup import build_run

    recipe = apply_overrides(get_recipe(args.recipe), args.set)
    t = recipe.train
    run = build_run(recipe, log=print)
    # the host choices `moetron train` makes on a CPU (threads, freed memory kept): without them a mid-size
    # step's fresh tensors page-fault every step and a tiny model's ops meet second-thread barriers
    small_model_threads(run, recipe, print)
    keep_freed_memory(run.device, print)
    data = TokenBatches(stdlib_corpus(), t.seq_len, t.micro_batch_size, t.seed)
    flops = training_flops_per_token(recipe.model, t.seq_len)
    cuda = run.device.type == "cuda"
    if args.syncs and not cuda:
        p.error(f"--syncs counts host-device synchronisations: it needs a CUDA run (--set train.device=cuda), "
                f"this one is on {run.device}")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run.model.train()
    for step in range(args.warmup):
        trainer._train_step(run, data, step, flops, trainer._guard(run, "", step))
    sync()
    if args.syncs:
        count_syncs(lambda step: trainer._train_step(run, data, step, flops, trainer._guard(run, "", step)),
                    range(args.warmup, args.warmup + args.steps))
        return
    start = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in range(args.warmup, args.warmup + args.steps):
            metrics = trainer._train_step(run, data, step, flops, trainer._guard(run, "", step))
        sync()
    wall = (time.perf_counter() - start) / args.steps
    sort = args.sort or ("self_cuda_time_total" if cuda else "self_cpu_time_total")
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    if args.trace:
        write_trace(prof, args.trace)
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum
    print(f"{args.steps} profiled steps: {wall * 1e3:.1f} ms/step (profiler on), {tokens / wall:.0f} tok/s, "
          f"{flops * tokens / wall / 1e12:.1f} TFLOP/s of model FLOPs; last loss {metrics['loss']:.4f}")


def count_syncs(step_fn, steps: range) -> None:
    """Run `step_fn(step)` for each step with CUDA's sync debug mode warning at every host-device
    synchronisation; print each synchronising line with its count per step, most frequent first."""
    import collections
    import linecache
    import warnings

    sites: collections.Counter = collections.Counter()
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in steps:
                step_fn(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / len(steps)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            sites[(w.filename, w.lineno)] += 1
    print(f"{sum(sites.values()) / len(steps):.1f} host-device synchronisations a step over {len(steps)} steps "
          f"({wall * 1e3:.1f} ms a step with the warnings on)")
    print("per step  where")
    for (filename, lineno), n in sites.most_common():
        short = filename.split("site-packages/")[-1]
        short = short[short.rfind("moetron/"):] if "moetron/" in short else short
        print(f"{n / len(steps):8.1f}  {short}:{lineno}  {linecache.getline(filename, lineno).strip()[:80]}")


def write_trace(prof, path: str) -> None:
    """The profile as a Chrome trace; gzip-compressed when `path` ends in .gz (traces shrink ~10x)."""
    import gzip
    import shutil
    import tempfile

    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
    else:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            prof.export_chrome_trace(tmp.name)
            with open(tmp.name, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    print(f"trace written to {path}")


if __name__ == "__main__":
    main()
