"""Training step time of a transformers Qwen3-MoE model, unpatched vs `moetron.integrations.transformers.patch`.

    python benchmarks/hf_patch.py             # 2 layers, hidden 512, 32 experts top-4, seq 512, fp32, 2 threads
    python benchmarks/hf_patch.py --quick     # tiny sizes, a few seconds

Candidates, in one process, on the same input and the same weights (deep copies of one model):

- hf grouped_mm   the model as loaded: transformers 5's default experts implementation
                  (`integrations.moe.grouped_mm_experts_forward`: sort, `torch._grouped_mm`).
- hf eager        the same model with `set_experts_implementation("eager")`: the Python loop over
                  experts written in `Qwen3MoeExperts.forward`.
- moetron patch   `hf.patch(model)`: every MoE block replaced by a moetron `MoELayer` sharing
                  its weights.

One step = zero grads, forward with labels (causal LM loss), backward. Before timing the patched
model's logits are checked against the unpatched model's. Then `--warmup` steps of each, and
`--repeats` steps of each interleaved round-robin (the starting candidate rotating every round, so
drift of a shared machine hits all alike); the table gives median and min wall time per step and
the median's ratio to `hf grouped_mm`, for wall time and for the process's CPU time (all its
threads; on a machine shared with other jobs CPU time is the steadier of the two: waiting for a
core shows in wall time only).
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import statistics
import time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moetron.integrations.transformers as hf

QUICK = dict(layers=1, hidden=64, moe_ffn=32, experts=8, topk=2, seq=64, vocab=256, repeats=3, warmup=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--moe-ffn", type=int, default=256, help="moe_intermediate_size of each expert")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip-eager", action="store_true", help="leave out the (slow) hf eager candidate")
    p.add_argument("--quick", action="store_true", help="tiny sizes")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def build(args) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128),
        head_dim=min(64, args.hidden), intermediate_size=2 * args.hidden, moe_intermediate_size=args.moe_ffn,
        num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
        max_position_embeddings=max(2048, args.seq), router_aux_loss_coef=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).train()
    with torch.no_grad():  # O(1) router logits, so the routing is spread as in a trained model
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=args.hidden ** -0.5)
    return model


def step_fn(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    return step


def time_interleaved(candidates: dict, warmup: int, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and process CPU seconds per call, candidates interleaved round-robin."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples = {name: ([], []) for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                cpu, start = time.process_time(), time.perf_counter()
                candidates[name]()
                samples[name][0].append(time.perf_counter() - start)
                samples[name][1].append(time.process_time() - cpu)
    finally:
        gc.enable()
    return samples


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build(args)
    models = {"hf grouped_mm": base}
    if not args.skip_eager:
        models["hf eager"] = copy.deepcopy(base)
        models["hf eager"].set_experts_implementation("eager")
    models["moetron patch"] = hf.patch(copy.deepcopy(base))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        ref = base(ids).logits
        for name, model in models.items():
            err = ((model(ids).logits - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-5:
                raise SystemExit(f"{name}: logits differ from the unpatched model (max relative error {err:.2e})")

    candidates = {name: step_fn(model, ids) for name, model in models.items()}
    samples = time_interleaved(candidates, args.warmup, args.repeats)

    print(f"Qwen3-MoE training step (fwd+bwd), {args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts top-{args.topk}, expert ffn {args.moe_ffn}, batch {args.batch} x seq {args.seq}, "
          f"vocab {args.vocab}, fp32, CPU {args.threads} threads")
    cpu_name = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {cpu_name}; "
          f"{args.warmup} warm-up + {args.repeats} interleaved repeats")
    wall0, cpu0 = (statistics.median(s) for s in samples["hf grouped_mm"])
    header = ("candidate", "wall median ms", "wall min ms", "ratio", "cpu median ms", "cpu min ms", "ratio")
    rows = [(name, f"{statistics.median(wall) * 1e3:.1f}", f"{min(wall) * 1e3:.1f}",
             f"{statistics.median(wall) / wall0:.2f}x", f"{statistics.median(cpu) * 1e3:.1f}",
             f"{min(cpu) * 1e3:.1f}", f"{statistics.median(cpu) / cpu0:.2f}x")
            for name, (wall, cpu) in samples.items()]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for i, row in enumerate((header, *rows)):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
