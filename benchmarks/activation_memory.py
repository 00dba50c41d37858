"""Activation memory per decoder layer for each recompute option: measured, and the formula.

    python benchmarks/activation_memory.py                    # tiny recipes + mid-size DeepSeek-V3, fp32
    python benchmarks/activation_memory.py --dtype bfloat16   # the same in bf16
    python benchmarks/activation_memory.py --quick            # tiny recipes only

Configs: the two tiny recipes (qwen3-moe-tiny, deepseek-v3-tiny) at their training shape
(micro-batch 8 x 128 tokens), and a mid-size DeepSeek-V3 built with ModelConfig: 8 decoder layers
(the first dense) + 1 MTP layer, hidden 1024, MLA with DeepSeek-V3's head sizes (8 heads, q_lora
512, kv_lora 256, nope/rope/v 128/64/128), 64 routed experts (ffn 256) top-6 in 8 groups (best 4),
one shared expert, sequence-wise aux loss; batch 1 x 512 tokens on the CPU (`--mid-seq`).

Measured: the bytes saved for backward by each decoder layer's forward (ActivationMeter:
saved-tensor hooks, each storage once, parameters excluded). Formula: `layer_activation_bytes`
(docs/activation_memory.md) with the layer's measured routed rows. Each row is one setting of
`recompute_modules` / `recompute_every_n_layers`; the columns are one dense and one MoE layer
(bytes and the saving against no recompute), and whether the formula equals the measurement for
every layer of the model (MTP layer included), to the byte. The script exits non-zero on a mismatch.
For the mid-size model a last column gives the formula's MoE layer with a fused attention kernel
(sdpa flash / cuDNN, flash-attn, TE: what a GPU runs), where the CPU runs MLA through sdpa's math
path; that column is not measured here.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moetron.config import ModelConfig
from moetron.model.activation_memory import ActivationMeter, attention_path, layer_activation_bytes
from moetron.model.model import MoETransformer
from moetron.ops.recompute import MODULES, set_recompute
from moetron.recipes import get_recipe

MID_DEEPSEEK = ModelConfig(
    family="deepseek_v3", vocab_size=16384, hidden_size=1024, num_layers=8, num_attention_heads=8,
    intermediate_size=2816, moe_intermediate_size=256, num_experts=64, top_k=6, first_k_dense_replace=1,
    n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, q_lora_rank=512, kv_lora_rank=256,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_mtp_layers=1, max_position_embeddings=4096,
    aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-4)

SETTINGS = ([("none", [], 0)] + [(m, [m], 0) for m in MODULES]
            + [("moe_act+layernorm", ["moe_act", "layernorm"], 0),
               ("moe_act+layernorm+mla_up_proj", ["moe_act", "layernorm", "mla_up_proj"], 0),
               ("all selective", list(MODULES), 0),
               ("full, every 2nd layer", [], 2), ("full, every layer", [], 1)])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="the tiny recipes only")
    p.add_argument("--mid-seq", type=int, default=512, help="sequence length of the mid-size run (batch 1)")
    return p.parse_args(argv)


def measure(model: MoETransformer, ids: torch.Tensor):
    meter = ActivationMeter(model)
    with meter:
        model(ids, labels=ids)
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "layer_idx")}
    rows = {n: int(m.mlp.last_tokens_per_expert.sum()) if m.is_moe else None for n, m in layers.items()}
    return meter.layer_bytes, rows, layers


def run_config(title: str, cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype,
               gpu_column: bool = False) -> bool:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = MoETransformer(cfg).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "layer_idx")}
    dense = next((n for n, m in layers.items() if not m.is_moe), None)
    moe = next(n for n, m in layers.items() if m.is_moe)
    print(f"\n### {title}: {cfg.family}, {cfg.num_layers} layers + {cfg.num_mtp_layers} MTP, hidden {cfg.hidden_size}, "
          f"batch {batch} x seq {seq}, {str(dtype)[6:]}, attention core: {attention_path(cfg)}\n")
    cols = ([f"dense `{dense}` bytes", "saved"] if dense else []) + [f"MoE `{moe}` bytes", "saved",
                                                                      "formula = measured (every layer)"]
    if gpu_column:  # what the formula gives with a fused attention kernel (GPU): not measured here
        cols += ["MoE layer, fused attention (formula)", "saved"]
    print("| recompute | " + " | ".join(cols) + " |")
    print("|---|" + "".join(":---:|" if c.startswith("formula =") else "---:|" for c in cols))
    base = gpu_base = None
    all_ok = True
    for label, modules, every in SETTINGS:
        set_recompute(model, modules, every)
        got, rows, _ = measure(model, ids)
        base = base or got
        mismatches = []
        for name, layer in layers.items():
            want = layer_activation_bytes(cfg, layer.layer_idx, batch, seq, rows[name], modules=modules,
                                          every_n_layers=every, dtype=dtype)
            if want.total != got[name]:
                mismatches.append(f"{name}: {got[name]} vs {want.total}")
        all_ok &= not mismatches
        cells = []
        for name in ([dense] if dense else []) + [moe]:
            cells += [f"{got[name]:,}", f"{1 - got[name] / base[name]:.1%}" if got[name] != base[name] else "0"]
        cells.append("yes" if not mismatches else "NO: " + "; ".join(mismatches))
        if gpu_column:
            gpu = layer_activation_bytes(cfg, layers[moe].layer_idx, batch, seq, rows[moe], modules=modules,
                                         every_n_layers=every, dtype=dtype, device="cuda").total
            gpu_base = gpu_base or gpu
            cells += [f"{gpu:,}", f"{1 - gpu / gpu_base:.1%}" if gpu != gpu_base else "0"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    rows_note = ", ".join(f"{n}: {r}" for n, r in rows.items() if r is not None)
    print(f"\nrouted rows per MoE layer: {rows_note}  ({time.perf_counter() - t0:.1f} s)")
    return all_ok


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    ok = True
    with torch.random.fork_rng():
        for name in ("qwen3-moe-tiny", "deepseek-v3-tiny"):
            recipe = get_recipe(name)
            ok &= run_config(name, recipe.model, recipe.train.micro_batch_size, recipe.train.seq_len, dtype)
        if not args.quick:
            ok &= run_config("mid-size DeepSeek-V3", MID_DEEPSEEK, 1, args.mid_seq, dtype, gpu_column=True)
    print("\nformula matches the measurement for every layer and setting" if ok else "\nFORMULA MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
