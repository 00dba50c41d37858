"""Patch a Hugging Face transformers Qwen3-MoE with moetron's MoE layers and fine-tune it.

    python examples/patch_hf_model.py                          # a tiny random Qwen3-MoE
    python examples/patch_hf_model.py --model PATH_OR_HUB_ID   # a real checkpoint (from_pretrained)
    torchrun --nproc-per-node 2 examples/patch_hf_model.py     # experts sharded over 2 ranks

`moetron.integrations.transformers.patch(model)` swaps every MoE block for a `moetron.MoELayer` that holds
the very same weight tensors, so the model computes the same outputs (checked below), its
parameters, optimizer and `save_pretrained` work as before, and training runs through moetron's
router, permute and grouped-GEMM experts. Under torchrun, `patch(model, ep_group=...)` keeps only
each rank's experts (expert parallel); everything else stays replicated and its gradients are
summed over the ranks here, as in any data-parallel loop.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

import moetron.integrations.transformers as hf
from moetron.data.builtin import stdlib_corpus


def tiny_qwen3_moe(args) -> Qwen3MoeForCausalLM:
    """A small random Qwen3-MoE whose vocabulary is bytes (so no tokenizer is needed)."""
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, router_aux_loss_coef=0.01, max_position_embeddings=4 * args.seq_len,
    )
    torch.manual_seed(args.seed)  # the same weights on every rank
    return Qwen3MoeForCausalLM(config)


def token_stream(args) -> torch.Tensor:
    text_bytes = stdlib_corpus(args.data_bytes)
    if args.model is None:
        return text_bytes  # byte-level vocabulary
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = bytes(text_bytes.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="from_pretrained path or hub id (default: a tiny random model)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-bytes", type=int, default=1 << 20)
    p.add_argument("--save", default=None, help="save_pretrained the fine-tuned model to this folder")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")  # on GPUs: "nccl", and move the model to this rank's device
    rank = dist.get_rank() if world > 1 else 0

    if args.model is None:
        model = tiny_qwen3_moe(args)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    tokens = token_stream(args)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank reads different text

    def batch() -> torch.Tensor:
        starts = torch.randint(0, tokens.numel() - args.seq_len, (args.batch_size,), generator=g).tolist()
        return torch.stack([tokens[s:s + args.seq_len] for s in starts])

    # 1. Patch: same weights, same outputs.
    probe = batch()
    with torch.no_grad():
        before = model(probe).logits
    hf.patch(model, ep_group=dist.group.WORLD if world > 1 else None)
    with torch.no_grad():
        after = model(probe).logits
    err = ((after - before).abs().max() / before.abs().max()).item()
    moe = [m for m in model.modules() if isinstance(m, hf.HFMoELayer)]
    if rank == 0:
        print(f"patched {len(moe)} MoE blocks ({moe[0].hf_block} -> moetron MoELayer, "
              f"{moe[0].experts.num_local_experts} of {moe[0].experts.num_experts} experts on this rank); "
              f"logits max relative change {err:.2e}")

    # 2. Fine-tune. Build the optimizer after patching (under EP the experts are new tensors).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    expert_params = {id(p) for m in moe for p in m.experts.parameters()}
    for step in range(1, args.steps + 1):
        ids = batch()
        # labels=ids: transformers shifts them; output_router_logits adds Qwen3's aux loss.
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        (out.loss / world).backward()  # objective: mean of the ranks' losses
        if world > 1:  # experts got every rank's gradient through the all-to-all; the rest:
            for p_ in model.parameters():
                if id(p_) not in expert_params and p_.grad is not None:
                    dist.all_reduce(p_.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out.loss.detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item() / world:.4f}  (aux {out.aux_loss.item():.4f})", flush=True)

    # 3. Save as a plain transformers checkpoint (state_dict keys are transformers' own).
    if args.save:
        state = hf.full_state_dict(model)  # gathers the experts under EP (every rank calls)
        if rank == 0:
            model.save_pretrained(args.save, state_dict=state)
            print(f"saved to {args.save}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
