"""Train a small Mixture-of-Experts language model from scratch with `moetron.MoELayer`.

Plain PyTorch: the model, the data and the training loop are all in this file; moetron only
provides the MoE layer (router -> dispatch -> experts -> combine, plus a shared expert).

    python examples/train_moe_from_scratch.py                       # one process (CPU is fine)
    torchrun --nproc-per-node 2 examples/train_moe_from_scratch.py  # expert parallel over 2 ranks

With N processes the experts are sharded over the N ranks (expert parallel, ep = N): each rank
keeps num_experts / N experts and the MoE layers send every token to the rank holding its
experts and back (all-to-all). Everything else (attention, router, shared expert, embeddings)
is replicated and trained data-parallel: each rank takes its share of the global batch, and the
gradients of the replicated parameters are summed over the ranks explicitly below.

The weights are drawn from one seed at full size and sliced, and the global batch is the same
for any number of processes, so the printed losses are the same (up to rounding) whether you
run on 1 process or N.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetron import MoEConfig, MoELayer
from moetron.moe.balancing import set_aux_loss_scale
from moetron.parallel import ParallelConfig, init_from_env
from moetron.data.builtin import stdlib_corpus

VOCAB = 256  # bytes


# --- the model --------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, H))


class Block(nn.Module):
    """Pre-norm transformer block whose feed-forward is a moetron MoE layer."""

    def __init__(self, hidden: int, heads: int, moe_config: MoEConfig, parallel_state):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.moe_norm = nn.RMSNorm(hidden)
        # parallel_state tells the layer its expert-parallel group; with ep = 1 every expert is
        # local and no communication happens.
        self.moe = MoELayer(moe_config, parallel_state=parallel_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class TinyMoELM(nn.Module):
    def __init__(self, args, parallel_state):
        super().__init__()
        moe_config = MoEConfig(
            hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_experts=args.experts, top_k=args.top_k,
            score_func="sigmoid", norm_topk_prob=True,  # DeepSeek-V3 style routing, balanced by
            expert_bias=True, bias_update_rate=args.bias_update_rate,  # a selection bias (update_expert_bias)
            aux_loss_type="seq_aux_loss", aux_loss_coeff=args.aux_loss_coeff,  # and a per-sequence aux loss
            shared_expert_ffn_size=args.ffn,  # one always-on shared expert
        )
        self.embed = nn.Embedding(VOCAB, args.hidden)
        self.pos = nn.Embedding(args.seq_len, args.hidden)
        self.blocks = nn.ModuleList(Block(args.hidden, args.heads, moe_config, parallel_state)
                                    for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """The same weights for any number of processes: experts are drawn full size, then sliced."""
    g = torch.Generator().manual_seed(seed)
    experts = {id(m.experts) for m in model.modules() if isinstance(m, MoELayer)}
    for module in model.modules():
        if id(module) in experts:  # this rank holds experts module.local_experts of module.num_experts
            E, F_, H = module.num_experts, module.ffn_hidden_size, module.gate_up_proj.shape[-1]
            module.load_full_experts(torch.randn(E, 2 * F_, H, generator=g) * std,
                                     torch.randn(E, H, F_, generator=g) * std)
            continue
        for p in module.parameters(recurse=False):  # norms start at 1, matrices small and random
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=g) * std)


# --- data ---------------------------------------------------------------------------------------
def global_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int):
    """Random windows of the byte stream: the same global batch on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g).tolist()
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


# --- training -----------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences), split over ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=64, help="ffn size of each expert and of the shared expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--bias-update-rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-bytes", type=int, default=1 << 20, help="bytes of the stdlib corpus to sample from")
    args = p.parse_args()

    # Under torchrun this joins the process group (gloo on CPU, nccl on GPU) and builds the
    # groups of the layout; alone it returns a single-process state and touches nothing.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps = init_from_env(ParallelConfig(ep=world))
    rank = ps.rank
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} processes")

    model = TinyMoELM(args, ps)
    init_weights(model, args.seed)
    model.to(device)
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    # Expert weights live on one rank each; everything else is a replica on every rank.
    expert_params = {id(p) for m in moe_layers for p in m.experts.parameters()}
    replicated = [p for p in model.parameters() if id(p) not in expert_params]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if rank == 0:
        ex = moe_layers[0].experts
        print(f"{world} process(es): experts {ex.local_experts.start}..{ex.local_experts.stop - 1} of "
              f"{ex.num_experts} on rank 0; {sum(p.numel() for p in model.parameters())} parameters on rank 0")

    # The aux loss is not added to `loss`: its gradient is injected in backward, scaled by this
    # factor. Use the same 1/world as the main loss below, so N ranks train like one process.
    set_aux_loss_scale(1.0 / world)

    tokens = stdlib_corpus(args.data_bytes)
    per_rank = args.batch_size // world
    for step in range(1, args.steps + 1):
        inputs, labels = global_batch(tokens, step, args.batch_size, args.seq_len, args.seed)
        inputs = inputs[rank * per_rank:(rank + 1) * per_rank].to(device)  # this rank's share
        labels = labels[rank * per_rank:(rank + 1) * per_rank].to(device)

        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1))
        # The objective is the mean over the global batch = the sum over ranks of loss / world.
        # Backward through the all-to-all already sums every rank's contribution into each
        # expert's gradient; the replicated parameters get only this rank's, so sum them here.
        (loss / world).backward()
        if world > 1:
            for p in replicated:
                dist.all_reduce(p.grad, group=ps.dp_cp.handle)  # data-parallel sum
            # (ps.edp: ranks holding the same experts; a single rank when ep = world size.)
            if ps.edp.size > 1:
                for m in moe_layers:
                    for p in m.experts.parameters():
                        dist.all_reduce(p.grad, group=ps.edp.handle)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for m in moe_layers:  # aux-loss-free balancing: counts summed over every rank
            m.update_expert_bias()

        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
        # Load of each layer over the global batch (a collective: every rank calls stats()).
        loads = [m.stats(group=m.balance_groups)["max_over_mean"] for m in moe_layers]
        if rank == 0:
            aux = moe_layers[0].aux_losses["seq_aux_loss"].item() if args.aux_loss_coeff else 0.0
            print(f"step {step:4d}  loss {global_loss.item() / world:.4f}  layer-0 aux {aux:.4f}  "
                  f"expert load max/mean {' '.join(f'{x:.2f}' for x in loads)}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
