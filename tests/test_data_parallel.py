"""Data parallel (bucketed, overlapped gradient reduction) and the ZeRO-1 distributed optimizer.

The reference is always one process on the full batch: gradients of the full-batch mean loss,
and torch.optim.AdamW with torch.nn.utils.clip_grad_norm_ for training. One 4-rank spawn runs
every distributed case: dp=4 on a tiny Qwen3-MoE (all-reduce, accumulation, bucket overlap,
ZeRO-1 training, state-dict resume) and ep=2 x edp=2 on an embedding + expert-parallel MoELayer
+ head (expert gradients reduced over EDP, ZeRO-1 shards of experts over EDP).
"""

import contextlib
import functools
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import run_distributed
from moetron import MoEConfig, MoELayer
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.optim import DistributedOptimizer
from moetron.parallel import ParallelConfig, ParallelState
from moetron.parallel import data_parallel as dp_module
from moetron.parallel.data_parallel import PAD_ALIGN, DataParallel, default_bucket_size

WORLD = 4
QWEN = dict(family="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
            top_k=2)
ROWS, SEQ = 8, 8  # global batch per step: 2 rows per rank
LR, WD, STEPS = 1e-2, 0.1, 3
CLIP, EP_CLIP = 0.5, 0.1  # well under the gradient norms (about 1.3 and 0.2): clipping is active
# AdamW's update lr * g / (|g| + eps) turns a gradient difference dg into an update difference of
# up to lr * dg / (4 eps) (at |g| = eps). Reordering the reduction changes gradients by ~1e-8
# here (embedding rows summing many positions), so the default eps=1e-8 would put a few elements
# far past the tolerance however exact the optimizer is; eps=1e-3 bounds the effect by ~2e-8
# while the large gradients (embedding, head: up to 0.1) still run in Adam's normalised regime.
# The exact arithmetic with the default eps is checked on identical gradients in
# test_adamw_matches_torch_on_identical_grads.
EPS = 1e-3
SMALL_BUCKET = 2000  # elements: 9 buckets over the two buffers; lm_head.weight alone in one
V, H, F, E = 64, 16, 8, 8  # the expert-parallel model


def assert_close(got, want, rtol=1e-5, msg=""):
    """|got - want| <= rtol * (|want| + max|want|) elementwise."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    atol = rtol * want.abs().max().item()
    excess = ((got - want).abs() - rtol * want.abs() - atol).max().item()
    assert excess <= 0, f"{msg}: worst excess {excess:.3g} over atol {atol:.3g}"


def reference_adamw(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, weight_decay=WD, eps=EPS)


def lm_loss(model, ids):
    return model(ids[:, :-1], labels=ids[:, 1:]).total_loss


class TinyEPModel(nn.Module):
    """Embedding -> residual MoE layer (expert parallel when given ps) -> head; mean token CE."""

    def __init__(self, ps=None):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=2, norm_topk_prob=True,
                        shared_expert_ffn_size=8)
        self.moe = MoELayer(cfg, parallel_state=ps)
        self.head = nn.Linear(H, V)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.moe(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def ep_loss(model, ids):
    return model(ids[:, :-1], ids[:, 1:])


def train_reference(model, loss_fn, batches, clip):
    """torch AdamW + clipping, one full batch per step: losses, norms, params after each step."""
    opt = reference_adamw(model)
    out = {"losses": [], "norms": [], "params": [], "states": []}
    for ids in batches:
        opt.zero_grad()
        loss = loss_fn(model, ids)
        loss.backward()
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        out["losses"].append(loss.item())
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        out["states"].append({n: {k: v.clone() for k, v in opt.state[p].items()}
                              for n, p in model.named_parameters()})
    return out


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@functools.cache
def references():
    """Initial states, data and single-process results for both models (computed once)."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, V, (ROWS, SEQ + 1), generator=gen) for _ in range(STEPS + 1)]
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**QWEN))
    dp = {"init": {k: v.clone() for k, v in model.state_dict().items()}}
    lm_loss(model, batches[0]).backward()
    dp["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    dp["grad_norm"] = torch.stack([g.norm() for g in dp["grads"].values()]).norm().item()
    model.zero_grad()
    dp.update(train_reference(model, lm_loss, batches, CLIP))  # STEPS + 1 steps: the last for resuming

    torch.manual_seed(0)
    ep_model = TinyEPModel()
    with torch.no_grad():  # larger weights than the default init, so routing and grads matter
        for n, p in ep_model.named_parameters():
            p.normal_(0, 0.5 if n == "moe.router.weight" else 0.2)
    ep = {"init": {k: v.clone() for k, v in ep_model.state_dict().items()}}
    ep_loss(ep_model, batches[0]).backward()
    ep["grads"] = {n: p.grad.clone() for n, p in ep_model.named_parameters()}
    ep["grad_norm"] = torch.stack([g.norm() for g in ep["grads"].values()]).norm().item()
    ep_model.zero_grad()
    ep.update(train_reference(ep_model, ep_loss, batches[:STEPS], EP_CLIP))
    return {"batches": batches, "dp": dp, "ep": ep}


# --- the distributed run ------------------------------------------------------------------------


class CollectiveLog:
    """Record every launch of the bucket collectives (patched into torch.distributed)."""

    NAMES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
             "all_gather_into_tensor")

    def __init__(self, events):
        self.events = events

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.events.append(("launch", name))
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def count(self):
        return sum(e[0] == "launch" for e in self.events)


def rank_rows(batch, rank):
    return batch[2 * rank:2 * rank + 2]


def mean_over_world(value):
    t = torch.tensor(float(value))
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def check_all_reduce(rank, ps, ref):
    """(a) one bucket per buffer, full-batch grads on every rank, one all-reduce per bucket."""
    model = MoETransformer(ModelConfig(**QWEN))
    model.load_state_dict(ref["dp"]["init"])
    ddp = DataParallel(model, ps)
    assert [len(b.buckets) for b in ddp.buffers] == [1, 1]
    assert sorted(b.group.name for b in ddp.buffers) == ["dp_cp", "edp"]
    events = []
    with CollectiveLog(events) as log:
        lm_loss(model, rank_rows(ref["batches"][0], rank)).backward()
        ddp.finish_grad_sync()
    assert log.count() == 2 and {e[1] for e in events} == {"all_reduce"}
    for name, p in model.named_parameters():
        assert p.grad.data_ptr() == p.main_grad.data_ptr()  # autograd accumulated into the buffer
        assert_close(p.grad, ref["dp"]["grads"][name], msg=f"rank {rank} all-reduce grad {name}")
    check_clip(ddp, ref["dp"], CLIP, lambda name, t: t)


def check_clip(ddp, want, clip, local):
    """DataParallel.clip_grad_norm_ (all-reduce mode): the full model's norm, grads scaled."""
    norm = ddp.clip_grad_norm_(clip).item()
    assert_close(norm, want["grad_norm"], msg="all-reduce grad norm")
    assert norm > clip
    coef = clip / (want["grad_norm"] + 1e-6)
    for name, p in ddp.named_parameters():
        assert_close(p.grad, local(name, want["grads"][name]) * coef, msg=f"clipped grad {name}")


def check_accumulation_and_overlap(rank, ps, ref):
    """(b) two micro-batches communicate once; (c) buckets launch while backward still runs."""
    model = MoETransformer(ModelConfig(**QWEN))
    model.load_state_dict(ref["dp"]["init"])
    ddp = DataParallel(model, ps, bucket_size=SMALL_BUCKET)
    assert len(ddp.buckets) >= 5
    events = []
    for name, p in model.named_parameters():  # after DataParallel's own hooks, so they run after
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("grad", name)))
    rows = rank_rows(ref["batches"][0], rank)
    with CollectiveLog(events) as log:
        with ddp.no_sync():
            (lm_loss(model, rows[:1]) / 2).backward()
        assert log.count() == 0, "the first micro-batch must not communicate"
        events.clear()
        (lm_loss(model, rows[1:]) / 2).backward()
        launched_in_backward = log.count()
        ddp.finish_grad_sync()
    assert log.count() == len(ddp.buckets), (log.count(), len(ddp.buckets))
    kinds = [e[0] for e in events]
    last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
    assert kinds.index("launch") < last_grad, "no bucket was launched before backward ended"
    assert launched_in_backward >= len(ddp.buckets) - 1, events
    for name, p in model.named_parameters():
        assert_close(p.grad, ref["dp"]["grads"][name], msg=f"rank {rank} accumulated grad {name}")


def train_distributed(rank, ddp, opt, loss_fn, batches, micro_batches, resume_at=None):
    """ZeRO-1 steps; rank r takes rows 2r, 2r+1, split into micro-batches. Returns losses, norms."""
    losses, norms, saved = [], [], None
    for step, batch in enumerate(batches):
        if step == resume_at:
            saved = (opt.state_dict(), {n: p.detach().clone() for n, p in ddp.named_parameters()})
        opt.zero_grad()
        rows, total = rank_rows(batch, rank), 0.0
        for i, micro in enumerate(rows.chunk(micro_batches)):
            ctx = ddp.no_sync() if i < micro_batches - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(ddp.module, micro) / micro_batches
                loss.backward()
            total += loss.item()
        norms.append(opt.step())
        losses.append(mean_over_world(total))
    return losses, norms, saved


class DeferredWork:
    def __init__(self, run):
        self.run = run

    def wait(self):
        self.run()


@contextlib.contextmanager
def deferred_param_gathers():
    """Parameter all-gathers that happen only when waited for: a parameter read before its
    bucket's wait sees stale values, so a missing wait fails the comparison every time."""
    saved = dp_module._all_gather

    def deferred(out, t, handle):
        return DeferredWork(lambda: saved(out, t, handle).wait())

    dp_module._all_gather = deferred
    try:
        yield
    finally:
        dp_module._all_gather = saved


def check_zero1_dense(rank, ps, ref):
    """(d) 3 steps of ZeRO-1 with clipping and 2 micro-batches == torch AdamW on the full batch;
    the state dict resumes bit-identically; the overlapped param gather is really deferred."""
    model = MoETransformer(ModelConfig(**QWEN))
    model.load_state_dict(ref["dp"]["init"])
    ddp = DataParallel(model, ps, bucket_size=SMALL_BUCKET, use_distributed_optimizer=True,
                       overlap_param_gather=True)
    for b in ddp.buckets:
        assert b.numel % (WORLD * PAD_ALIGN) == 0
    opt = DistributedOptimizer(ddp, lr=LR, weight_decay=WD, eps=EPS, max_grad_norm=CLIP)
    assert all(s.master.dtype == torch.float32 for s in opt.shards)
    want = ref["dp"]
    with deferred_param_gathers():
        losses, norms, (saved, before) = train_distributed(
            rank, ddp, opt, lm_loss, ref["batches"][:STEPS], micro_batches=2, resume_at=STEPS - 1)
        assert ddp.pending_param_gathers > 0, "overlap_param_gather: step() must not wait for gathers"
        ddp.finish_param_sync()
    assert ddp.modules_waited_at_forward_start == ["lm_head"]  # used through F.linear, never called
    assert_close(losses, want["losses"][:STEPS], msg="ZeRO-1 losses")
    assert_close(norms, want["norms"][:STEPS], msg="ZeRO-1 grad norms")
    assert min(norms) > CLIP  # clipping was active at every step
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in after.items():
        assert_close(p, want["params"][STEPS - 1][name], msg=f"rank {rank} ZeRO-1 param {name}")
    final_state = opt.state_dict()

    # resume: back to the state before the last step, redo it, land on the same bits
    opt.load_state_dict(saved)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), f"load_state_dict did not restore {name}"
    train_distributed(rank, ddp, opt, lm_loss, ref["batches"][STEPS - 1:STEPS], micro_batches=2)
    ddp.finish_param_sync()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), after[name]), f"resumed step differs in {name}"
    return final_state


def load_ep_model(ps, init):
    model = TinyEPModel(ps)
    dense = {k: v for k, v in init.items() if not k.startswith("moe.experts.")}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert sorted(missing) == ["moe.experts.down_proj", "moe.experts.gate_up_proj"] and not unexpected
    model.moe.experts.load_full_experts(init["moe.experts.gate_up_proj"], init["moe.experts.down_proj"])
    return model


def ep_slice(name, full, ps):
    """This rank's experts of a full [E, ...] expert tensor (ep only, no etp), sliced by hand."""
    if not name.startswith("moe.experts."):
        return full
    per = E // ps.ep.size
    return full[ps.ep.rank * per:(ps.ep.rank + 1) * per]


def check_expert_parallel(rank, ps, ref):
    """(e) ep=2, edp=2: expert grads reduce over EDP, dense over DP; ZeRO-1 shards each over its
    own group and trains like the single process."""
    assert (ps.dp.size, ps.ep.size, ps.edp.size) == (4, 2, 2)
    want = ref["ep"]
    model = load_ep_model(ps, want["init"])
    ddp = DataParallel(model, ps)
    groups = {b.group.name: b for b in ddp.buffers}
    assert [s.name for s in groups["edp"].slots] == ["moe.experts.down_proj", "moe.experts.gate_up_proj"]
    ep_loss(model, rank_rows(ref["batches"][0], rank)).backward()
    ddp.finish_grad_sync()
    for name, p in model.named_parameters():
        assert_close(p.grad, ep_slice(name, want["grads"][name], ps), msg=f"rank {rank} EP grad {name}")
    check_clip(ddp, want, EP_CLIP, lambda name, t: ep_slice(name, t, ps))

    model = load_ep_model(ps, want["init"])
    ddp = DataParallel(model, ps, bucket_size=200, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=LR, weight_decay=WD, eps=EPS, max_grad_norm=EP_CLIP)
    losses, norms, _ = train_distributed(rank, ddp, opt, ep_loss, ref["batches"][:STEPS], micro_batches=1)
    assert_close(losses, want["losses"], msg="EP ZeRO-1 losses")
    assert_close(norms, want["norms"], msg="EP ZeRO-1 grad norms")
    assert min(norms) > EP_CLIP
    for name, p in model.named_parameters():
        assert_close(p.detach(), ep_slice(name, want["params"][-1][name], ps),
                     msg=f"rank {rank} EP param {name}")


def to_bytes(obj) -> bytes:
    """Tensors cross the process boundary as bytes: torch's shared-memory passing would send one
    file descriptor per tensor (too many for the forkserver)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def distributed_cases(rank, world_size, ref_bytes):
    ref = from_bytes(ref_bytes)
    torch.manual_seed(0)
    ps = ParallelState.build(ParallelConfig())
    check_all_reduce(rank, ps, ref)
    check_accumulation_and_overlap(rank, ps, ref)
    state = check_zero1_dense(rank, ps, ref)
    check_expert_parallel(rank, ParallelState.build(ParallelConfig(ep=2)), ref)
    return to_bytes(state)


def test_data_parallel_and_zero1_match_one_process():
    ref = references()
    outputs = run_distributed(distributed_cases, WORLD, to_bytes(ref), timeout=180)
    states = [from_bytes(s) for s in outputs]

    # The four ZeRO-1 shards together are torch AdamW's state, and they load into one process
    # (a different DP size: re-sharding) that resumes with the reference's next step.
    want = ref["dp"]
    model = MoETransformer(ModelConfig(**QWEN))
    names = {n for n, _ in model.named_parameters()}
    assert all(len(s["pieces"]) < len(names) for s in states)  # every rank holds a part only
    ddp = DataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=LR, weight_decay=WD, eps=EPS, max_grad_norm=CLIP)
    opt.load_state_dict(states)
    for name, p in model.named_parameters():
        assert_close(p.detach(), want["params"][STEPS - 1][name], msg=f"re-sharded param {name}")
    merged = opt.state_dict()["pieces"]
    assert set(merged) == names
    for name, piece in merged.items():
        assert piece["offset"] == 0 and piece["numel"] == want["init"][name].numel()
        for slot in ("exp_avg", "exp_avg_sq"):
            assert_close(piece[slot], want["states"][STEPS - 1][name][slot].flatten(),
                         msg=f"{name}.{slot}")
    assert [g["step"] for g in opt.param_groups] == [STEPS, STEPS]
    opt.zero_grad()
    lm_loss(model, ref["batches"][STEPS]).backward()
    assert_close(opt.step(), want["norms"][STEPS], msg="resumed grad norm")
    for name, p in model.named_parameters():
        assert_close(p.detach(), want["params"][STEPS][name], msg=f"resumed param {name}")


# --- single process ---------------------------------------------------------------------------


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig(**QWEN))


def test_default_bucket_size():
    assert default_bucket_size(1) == 40_000_000
    assert default_bucket_size(40) == 40_000_000
    assert default_bucket_size(64) == 64_000_000


def test_buckets_reverse_order_and_grad_views():
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    ddp = DataParallel(model, bucket_size=SMALL_BUCKET)
    for buf in ddp.buffers:
        order = [names.index(s.name) for s in buf.slots]
        assert order == sorted(order, reverse=True)  # reverse registration order
        assert all(b.numel >= SMALL_BUCKET for b in buf.buckets[:-1])
        assert all(b.numel - b.slots[-1].param.numel() < SMALL_BUCKET for b in buf.buckets)
        assert [b.start for b in buf.buckets[1:]] == [b.end for b in buf.buckets[:-1]]
        assert buf.expert == all(".experts." in s.name for s in buf.slots)
    assert sum(s.param.numel() for s in ddp.slots) == sum(p.numel() for p in model.parameters())
    # the launch sequence follows backward: lm_head's bucket before layer 0's, embedding last
    first = [min(names.index(s.name) for s in b.slots) for b in ddp.buckets]
    assert first == sorted(first, reverse=True) and ddp.buckets[-1].slots[-1].name == "embed_tokens.weight"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # the second step accumulates into the same zeroed buffer
        ddp.zero_grad()
        lm_loss(model, ids).backward()
        ddp.finish_grad_sync()
        for buf in ddp.buffers:
            for s in buf.slots:
                assert s.param.grad.data_ptr() == buf.grad_data[s.start:].data_ptr()
    ref = tiny_model()
    lm_loss(ref, ids).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad), name


def test_adamw_matches_torch_on_identical_grads():
    """One process (dp=1), the reference given our gradients: default eps, clipping, a
    learning-rate change between steps, and no weight decay on 1-D parameters."""
    model, ref = tiny_model(), tiny_model()
    ddp = DataParallel(model, bucket_size=SMALL_BUCKET, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=LR, weight_decay=WD, max_grad_norm=CLIP)
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() >= 2]},
                                 {"params": [p for p in ref.parameters() if p.dim() < 2],
                                  "weight_decay": 0.0}], lr=LR, weight_decay=WD)
    gen = torch.Generator().manual_seed(6)
    for step in range(3):
        for group in (*opt.param_groups, *ref_opt.param_groups):
            group["lr"] = LR / (step + 1)
        ids = torch.randint(0, 64, (4, 9), generator=gen)
        opt.zero_grad()
        lm_loss(model, ids).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        assert want_norm > CLIP
        assert_close(opt.step(), want_norm, rtol=1e-6, msg="grad norm")
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-6, msg=name)


def test_bf16_params_fp32_master_and_fp32_main_grad():
    model = tiny_model().to(torch.bfloat16)
    plain = tiny_model().to(torch.bfloat16)
    ddp = DataParallel(model, use_distributed_optimizer=True, grad_dtype=torch.float32)
    opt = DistributedOptimizer(ddp, lr=LR, weight_decay=WD)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    opt.zero_grad()
    lm_loss(model, ids).backward()
    lm_loss(plain, ids).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is None and p.main_grad.dtype == torch.float32, name
        assert torch.equal(p.main_grad, q.grad.float()), name
    # reference: torch AdamW on fp32 copies of the bf16 weights with the same grads
    masters = [nn.Parameter(q.detach().float()) for q in plain.parameters()]
    for m, q in zip(masters, plain.parameters()):
        m.grad = q.grad.float()
    ref_opt = torch.optim.AdamW([{"params": [m for m in masters if m.dim() >= 2]},
                                 {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0}],
                                lr=LR, weight_decay=WD)
    ref_opt.step()
    opt.step()
    shard = {p.slot.name: p for s in opt.shards for p in s.pieces}
    for (name, p), m in zip(model.named_parameters(), masters):
        piece = shard[name]
        master = piece.shard.master[piece.flat]
        assert master.dtype == torch.float32
        assert_close(master, m.detach().flatten(), rtol=1e-6, msg=name)
        assert torch.equal(p.detach().flatten(), master.to(torch.bfloat16)), name
    assert any(not torch.equal(p.detach(), q.detach())
               for p, q in zip(model.parameters(), plain.parameters()))


def test_bf16_main_grads_copy_first_add_then_and_zero_the_unused():
    """zero_grad() leaves an all-bf16 buffer as it was: the first gradient of a step is copied in, later
    micro-batches add, and a parameter without a gradient this step reads zero after finish_grad_sync(),
    not last step's value. The sums equal fp32 additions onto zero."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, use_b=True):
            y = self.a(x)
            return self.b(y) if use_b else y

    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    ddp = DataParallel(model, use_distributed_optimizer=True, grad_dtype=torch.float32)
    xs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]

    def loss(x, use_b=True):
        return model(x, use_b).float().square().sum()

    ddp.zero_grad()
    loss(xs[0]).backward()
    ddp.finish_grad_sync()
    assert model.b.weight.main_grad.abs().sum() > 0  # step 1 wrote b's gradient
    a = [model.a.weight, model.a.bias]
    want = [g1.float() + g2.float() for g1, g2 in zip(torch.autograd.grad(loss(xs[1], False), a),
                                                       torch.autograd.grad(loss(xs[2], False), a))]
    ddp.zero_grad()
    with ddp.no_sync():
        loss(xs[1], use_b=False).backward()
    loss(xs[2], use_b=False).backward()
    ddp.finish_grad_sync()
    for p, w in zip(a, want):
        assert p.main_grad.abs().sum() > 0 and torch.equal(p.main_grad, w)
    for p in (model.b.weight, model.b.bias):
        assert torch.equal(p.main_grad, torch.zeros_like(p.main_grad))


def test_nonfinite_norm_skips_the_step():
    model = tiny_model()
    ddp = DataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=LR, max_grad_norm=CLIP)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    lm_loss(model, torch.randint(0, 64, (2, 9))).backward()
    model.norm.weight.grad[0] = float("inf")
    assert opt.step() == float("inf") and opt.last_step_skipped
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert [g["step"] for g in opt.param_groups] == [0, 0]


def test_misuse_raises_clear_errors():
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    model = tiny_model()
    with pytest.raises(ValueError, match="bucket_size"):
        DataParallel(model, bucket_size=0)
    with pytest.raises(ValueError, match="overlap_param_gather=True needs use_distributed_optimizer"):
        DataParallel(model, overlap_param_gather=True)
    ddp = DataParallel(model)
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(ddp)
    with ddp.no_sync():
        lm_loss(model, ids).backward()
        with pytest.raises(RuntimeError, match="inside no_sync"):
            ddp.finish_grad_sync()
    lm_loss(model, ids).backward()
    ddp.finish_grad_sync()
    with pytest.raises(RuntimeError, match="call DataParallel.zero_grad"):
        lm_loss(model, ids).backward()
    ddp.zero_grad()
    lm_loss(model, ids).backward()
    with pytest.raises(RuntimeError, match="arrived twice"):
        lm_loss(model, ids).backward()

    model = tiny_model()
    ddp = DataParallel(model, use_distributed_optimizer=True)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="in no param group"):
        DistributedOptimizer(ddp, [{"params": params[1:]}])
    with pytest.raises(ValueError, match="in param groups 0 and 1"):
        DistributedOptimizer(ddp, [{"params": params}, {"params": params[:1]}])
    with pytest.raises(ValueError, match="not supported"):
        DistributedOptimizer(ddp, [{"params": params, "momentum": 0.9}])
    with pytest.raises(ValueError, match="max_grad_norm"):
        DistributedOptimizer(ddp, max_grad_norm=0.0)
    opt = DistributedOptimizer(ddp)
    state = opt.state_dict()
    name = "layers.0.self_attn.q_proj.weight"
    piece = state["pieces"][name]
    first5 = {**piece, "offset": 0, "numel": 5, **{k: piece[k][:5] for k in ("master", "exp_avg", "exp_avg_sq")}}
    with pytest.raises(ValueError, match=f"lacks '{name}' element 5"):
        opt.load_state_dict({**state, "pieces": {**state["pieces"], name: first5}})
    with pytest.raises(ValueError, match="is for shape"):
        opt.load_state_dict({**state, "pieces": {**state["pieces"], name: {**piece, "shape": [16, 64]}}})
    with pytest.raises(ValueError, match="names no parameter"):
        opt.load_state_dict({**state, "pieces": {**state["pieces"], "nope.weight": piece}})
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict({**state, "param_groups": state["param_groups"][:1]})
