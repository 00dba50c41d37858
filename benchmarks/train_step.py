"""One optimizer step of the same Qwen3-MoE (or DeepSeek-V3) model: moetron's trainer vs transformers + torch AdamW.

    python benchmarks/train_step.py                                     # tiny and mid, 2 threads
    python benchmarks/train_step.py --sizes tiny --repeats 9 --threads 1
    python benchmarks/train_step.py --model deepseek-v3                 # MLA, group routing, shared experts
    python benchmarks/train_step.py --device cuda --dtype bf16 --sizes tiny,mid,proxy --peak-tflops 989

Both sides start from the same weights (moetron's model written with `moetron.bridge.hf.to_hf` and
loaded by `Qwen3MoeForCausalLM.from_pretrained` with `experts_implementation="grouped_mm"`,
`output_router_logits=True` and the recipe's `router_aux_loss_coef`, sdpa attention) and take the
same batch. Before timing, the script checks that the two compute the same LM loss (relative error
< 1e-5). A step:

- moetron: `moetron.train.trainer._train_step` exactly as `moetron train` runs it (learning-rate
  schedule, forward+backward with the aux loss injected, clipping, AdamW, expert-load metrics).
- transformers: `zero_grad(set_to_none=True)`, `model(input_ids, labels, shift_labels=labels).loss`
  (LM loss + coef * aux loss) `.backward()`, `clip_grad_norm_`, `torch.optim.AdamW.step()` with the
  same lr, betas and weight decay, `fused=True` on every device: its Trainer's default optimizer
  (`adamw_torch_fused` with torch >= 2.8, transformers 5). `--hf-adamw default` gives it torch's own
  choice instead (on a CPU a Python loop over the tensors, ~7x slower at the mid size), the comparison
  this script made before 2026-11-27's ninth session.

`--model deepseek-v3` compares moetron's DeepSeek-V3 model with transformers' `DeepseekV3ForCausalLM`
(grouped_mm experts, sdpa attention) from the `deepseek-v3-tiny` recipe, without the two parts transformers
does not train: the multi-token-prediction layer (`model.num_mtp_layers=0`) and the sequence-wise aux loss
(`model.aux_loss_type=none`); moetron still updates its expert bias after every step (aux-loss-free
balancing), transformers keeps its `e_score_correction_bias` as loaded. Its `mid` size matches the
Qwen3-MoE one (H512, 4 layers, 32 experts top-4, 2x512 tokens) with MLA (q rank 256, kv rank 128, q/k
heads 64 + 32, v heads 64), 4 expert groups (top 2), one shared expert and a dense first layer.

Sizes: `tiny` is the default recipe (H64, 4 layers, 8 experts top-2, 8x128 tokens); `mid` is H512,
4 layers, 32 experts top-4 (moe ffn 256), 2x512 tokens; `proxy` is the GPU proxy of issue 16 (8 layers,
H1024, 16 heads / 4 KV heads, 64 experts top-8, moe ffn 768, vocab 32768: 1.30 B parameters, 240 M active;
4x2048 tokens).

On a GPU (`--device cuda`) both sides run there; with `--dtype bf16` moetron runs its mixed precision
(`train.dtype=bf16`: bf16 parameters, fp32 gradients and AdamW masters) and transformers runs what its
Trainer does with `bf16=True` (fp32 parameters under `torch.autocast(bfloat16)`), with torch's fused AdamW.
The loss check then allows 2e-2 (bf16 rounding on both sides).
Every step ends with `torch.cuda.synchronize()`, so host timers measure the device work. Steps are interleaved round-robin; the table
gives median and min step times, tokens/s of the medians, and moetron's speed-up (hf / moetron).
The process first makes the glibc setting `moetron train` makes on a CPU (freed memory kept for
reuse, `moetron/train/host.py`), so both sides run with it; a MALLOC_* variable turns it off.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `moetron` command sets it (moetron/__main__.py)
import torch  # noqa: E402  (the policy is read when torch loads OpenMP)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import format_table, time_interleaved

SIZES = {
    "tiny": [],
    "mid": ["model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8", "model.num_kv_heads=4",
            "model.head_dim=64", "model.intermediate_size=1024", "model.moe_intermediate_size=256",
            "model.num_experts=32", "model.top_k=4", "train.seq_len=512", "train.micro_batch_size=2"],
    "proxy": ["model.hidden_size=1024", "model.num_layers=8", "model.num_attention_heads=16", "model.num_kv_heads=4",
              "model.head_dim=64", "model.intermediate_size=3072", "model.moe_intermediate_size=768",
              "model.num_experts=64", "model.top_k=8", "model.vocab_size=32768",
              "model.max_position_embeddings=4096", "train.seq_len=2048", "train.micro_batch_size=4"],
}


DEEPSEEK_SIZES = {
    "tiny": [],
    "mid": ["model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8", "model.num_kv_heads=8",
            "model.intermediate_size=1024", "model.moe_intermediate_size=256", "model.num_experts=32",
            "model.top_k=4", "model.q_lora_rank=256", "model.kv_lora_rank=128", "model.qk_nope_head_dim=64",
            "model.qk_rope_head_dim=32", "model.v_head_dim=64", "model.head_dim=96", "train.seq_len=512",
            "train.micro_batch_size=2"],
}
# what transformers' DeepseekV3ForCausalLM does not train (module docstring)
MODELS = {"qwen3-moe": ("qwen3-moe-tiny", SIZES, []),
          "deepseek-v3": ("deepseek-v3-tiny", DEEPSEEK_SIZES, ["model.num_mtp_layers=0", "model.aux_loss_type=none"])}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-moe", choices=tuple(MODELS),
                   help="qwen3-moe (Qwen3MoeForCausalLM) or deepseek-v3 (DeepseekV3ForCausalLM)")
    p.add_argument("--sizes", default="tiny,mid", help=f"comma-separated: {', '.join(SIZES)} (deepseek-v3: "
                                                       f"{', '.join(DEEPSEEK_SIZES)})")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: moetron's train.dtype=bf16 against transformers under torch.autocast (GPU runs)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak (e.g. 989 for an H100 SXM in bf16): adds an MFU column per side")
    p.add_argument("--repeats", type=int, default=9, help="timed steps per candidate (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--wide-threads", type=int, default=None,
                   help="moetron's grouped GEMMs and attention with a helper up to this many threads, and the "
                        "weight gradients on that helper beside the backward pass when > 1 (moetron/kernels/threads.py, "
                        "weight_grads.py; default 1, CPU only); `moetron train` gives a small model --threads 1 "
                        "--wide-threads 2")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="intra-op threads for the transformers side (default: --threads), e.g. torch's default of "
                        "every core against moetron's own choice")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="extra recipe overrides")
    p.add_argument("--hf-adamw", default="fused", choices=("fused", "default"),
                   help="transformers' AdamW: fused (its Trainer's default, adamw_torch_fused) or torch's own "
                        "default implementation (on a CPU a loop over the tensors: the figures before the ninth "
                        "session)")
    p.add_argument("--fused", action="store_true",
                   help="moetron with its fused C++/Triton kernels: train.permute_impl=auto and the experts' "
                        "activation_impl=auto (built on first use)")
    args = p.parse_args(argv)
    sizes = MODELS[args.model][1]
    unknown = [s for s in args.sizes.split(",") if s not in sizes]
    if unknown:
        p.error(f"--sizes: unknown {unknown} for --model {args.model}; choose from {', '.join(sizes)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if args.device == "cuda" and (args.wide_threads is not None or args.hf_threads is not None):
        p.error("--wide-threads and --hf-threads choose CPU threads; with --device cuda leave them out")
    if args.wide_threads is None:
        args.wide_threads = 1
    for name in ("threads", "wide_threads", "hf_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


class FixedBatches:
    """The trainer's data interface (`batch(step, index)`), always the same batch."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        self.inputs, self.labels = inputs, labels

    def batch(self, step: int, index: int = 0):
        return self.inputs, self.labels


def build_pair(overrides: list[str], folder: Path, device: torch.device, hf_adamw: str = "fused",
               model: str = "qwen3-moe"):
    from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

    from moetron.bridge.hf import to_hf
    from moetron.data.builtin import TokenBatches, stdlib_corpus
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.setup import build_run

    recipe_name, _, fixed = MODELS[model]
    recipe = apply_overrides(get_recipe(recipe_name), fixed + overrides)
    t, m = recipe.train, recipe.model
    run = build_run(recipe, log=lambda s: None)
    inputs, labels = (x.contiguous() for x in TokenBatches(stdlib_corpus(), t.seq_len, t.micro_batch_size,
                                                          t.seed).batch(0))
    to_hf(run.model, folder)
    if model == "qwen3-moe":
        hf = Qwen3MoeForCausalLM.from_pretrained(folder, experts_implementation="grouped_mm",
                                                 attn_implementation="sdpa", output_router_logits=True,
                                                 router_aux_loss_coef=m.aux_loss_coeff, dtype=torch.float32)
    else:
        hf = DeepseekV3ForCausalLM.from_pretrained(folder, experts_implementation="grouped_mm",
                                                   attn_implementation="sdpa", dtype=torch.float32)
    hf = hf.to(device).train()
    assert hf.config._experts_implementation == "grouped_mm", hf.config._experts_implementation
    opt = torch.optim.AdamW(hf.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                            fused=True if hf_adamw == "fused" else None)
    return recipe, run, hf, opt, inputs, labels


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def check_same_loss(run, hf, inputs, labels, dtype: torch.dtype) -> float:
    device = run.device
    with torch.no_grad():
        ours = float(run.model(inputs.to(device), labels=labels.to(device)).loss)
        with _autocast(device, dtype):
            out = hf(input_ids=inputs.to(device), labels=labels.to(device), shift_labels=labels.to(device))
        aux = getattr(out, "aux_loss", None)  # Qwen3-MoE's; DeepSeek-V3 in transformers has none
        theirs = float(out.loss if aux is None else out.loss - hf.config.router_aux_loss_coef * aux)
    err = abs(ours - theirs) / abs(theirs)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    if not err < bound:
        raise AssertionError(f"moetron LM loss {ours} and transformers' {theirs} differ (relative {err:.2e})")
    return err


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def moetron_step(run, data, recipe):
    from moetron.model.size import training_flops_per_token
    from moetron.train import trainer

    flops = training_flops_per_token(recipe.model, recipe.train.seq_len)
    state = {"step": 0}
    sync = _sync(run.device)

    def step():
        trainer._train_step(run, data, state["step"], flops, trainer._guard(run, "", state["step"]))
        sync()
        state["step"] += 1
    return step


def hf_step(hf, opt, inputs, labels, clip, threads, dtype):
    device = next(hf.parameters()).device
    inputs, labels = inputs.to(device), labels.to(device)
    sync = _sync(device)

    def step():
        ours = torch.get_num_threads()
        torch.set_num_threads(threads)
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            loss = hf(input_ids=inputs, labels=labels, shift_labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
        opt.step()
        sync()
        torch.set_num_threads(ours)
    return step


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from moetron.kernels.threads import set_wide_threads
    from moetron.model.size import training_flops_per_token
    from moetron.train.host import keep_freed_memory

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cuda = device.type == "cuda"
    # what `moetron train` does on a CPU (unless a MALLOC_* variable is set): for both sides, one process
    kept = keep_freed_memory(device, lambda line: None)
    set_wide_threads(args.wide_threads)  # moetron's side only: transformers' ops run on --hf-threads
    hf_threads = args.threads if args.hf_threads is None else args.hf_threads

    where = (f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}" if cuda else
             f"CPU, threads {torch.get_num_threads()} (moetron's grouped GEMMs and attention "
             f"{max(args.wide_threads, args.threads)}, transformers {hf_threads})")
    precision = ("fp32" if dtype == torch.float32 else
                 "bf16: moetron train.dtype=bf16 (fp32 grads + masters), transformers fp32 weights under autocast")
    print(f"one training step, {precision}, {where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, python {platform.python_version()}, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"MALLOC_MMAP_MAX_={os.environ.get('MALLOC_MMAP_MAX_', 'unset')}, freed memory kept (the trainer's "
          f"glibc setting): {kept}, load before {os.getloadavg()[0]:.2f}, "
          f"moetron kernels: {'fused (--fused)' if args.fused else 'defaults'}")
    on_device = [f"train.device={args.device}"] + (["train.dtype=bf16"] if dtype == torch.bfloat16 else [])
    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            fused = ["train.permute_impl=auto"] if args.fused else []
            recipe, run, hf, opt, inputs, labels = build_pair(MODELS[args.model][1][size] + on_device + fused
                                                              + args.set, Path(tmp) / "hf", device, args.hf_adamw,
                                                              args.model)
        for layer in run.model.moe_layers() if args.fused else ():
            layer.experts.activation_impl = "auto"
        err = check_same_loss(run, hf, inputs, labels, dtype)
        tokens = inputs.numel()
        times = time_interleaved({"moetron": moetron_step(run, FixedBatches(inputs, labels), recipe),
                                  "transformers": hf_step(hf, opt, inputs, labels, recipe.train.grad_clip, hf_threads,
                                                          dtype)},
                                 warmup=args.warmup, repeats=args.repeats)
        ours, theirs = times["moetron"], times["transformers"]
        m = recipe.model
        flops = training_flops_per_token(m, recipe.train.seq_len) * tokens

        def speed(t):
            cells = [f"{t.median * 1e3:.1f}", f"{t.min * 1e3:.1f}"]
            cells += [] if cuda else [f"{t.cpu_median * 1e3:.1f}"]
            cells += [f"{tokens / t.median:.0f}"]
            if args.peak_tflops:
                cells += [f"{flops / t.median / 1e12 / args.peak_tflops:.1%}"]
            return cells
        label = (f"{'' if args.model == 'qwen3-moe' else 'deepseek-v3 '}{size} (H{m.hidden_size} L{m.num_layers} "
                 f"E{m.num_experts} k{m.top_k}, "
                 f"{inputs.shape[0]}x{inputs.shape[1]} tokens)")
        rows.append([label, *speed(ours), *speed(theirs), f"{theirs.median / ours.median:.2f}x",
                     *([] if cuda else [f"{theirs.cpu_median / ours.cpu_median:.2f}x"]), f"{err:.1e}"])
        del run, hf, opt
        if cuda:
            torch.cuda.empty_cache()
    side = ["ms", "min"] + ([] if cuda else ["cpu ms"]) + ["tok/s"] + (["MFU"] if args.peak_tflops else [])
    print(format_table(["size", *(f"moetron {c}" for c in side), *(f"hf {c}" for c in side), "speed-up",
                        *([] if cuda else ["cpu ratio"]), "loss err"], rows))
    print(f"(medians of {args.repeats} steps after {args.warmup} warm-up, interleaved; speed-up = hf median / "
          f"moetron median" + ("" if cuda else ", cpu ratio = the same of process CPU time")
          + f"; load after {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
          + (f"; MFU = model FLOPs (moetron.model.size.training_flops_per_token) / {args.peak_tflops:g} TFLOP/s"
             if args.peak_tflops else "") + ")")
    aux = ("router aux loss on (the recipe's coefficient)" if args.model == "qwen3-moe" else
           "no aux loss and no MTP layer (transformers trains neither)")
    print(f"same comparison on both sides: one model config and weights, sdpa attention, {aux}, "
          "transformers' experts through grouped_mm, AdamW with the same lr / betas / "
          f"weight decay ({'fused' if args.hf_adamw == 'fused' else 'torch' + chr(39) + 's default implementation'} "
          "for transformers), "
          "clipping at the recipe's grad_clip")


if __name__ == "__main__":
    main()
