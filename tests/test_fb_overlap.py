"""Overlapped forward-backward with asynchronous EP all-to-alls (pipeline/overlap.py).

World 4 = EP2 x PP2 with the all-to-all dispatcher: each pipeline stage's two ranks are one EP
group, so every MoE layer run as pieces has its two all-to-alls as communication pieces, issued
asynchronously by the executor. Checked in one spawn:
(a) numerics: fb_overlap="moe" gives the losses, routing counts and every gradient of
    fb_overlap="off" (whole stages, synchronous all-to-alls through autograd), per rank, on
    DualPipeV (FB pairs plus split backward B/W actions), on DualPipeV with recomputation, and
    on 1F1B and interleaved 1F1B (FB pairs made by `pair_forward_backward`);
(b) structure: a recorder around every piece shows that between the issue and the wait of an
    all-to-all (forward rows and backward gradients alike) the other micro-batch of the FB
    pair ran pieces, and that a wait comes only right before the piece that needs the rows.
"""

import pytest
import torch

from dist_utils import run_distributed
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.ops.recompute import set_recompute
from moetron.moe.layer import MoELayer
from moetron.parallel import ParallelConfig, ParallelState
from moetron.model.parallelize import expert_parallelize
from moetron.pipeline import build_schedule, parse_layout
from moetron.moe.pieces import CommPiece, Transfer
from moetron.pipeline.overlap import pair_forward_backward
from moetron.pipeline.runtime import run_schedule
from moetron.pipeline.schedules import validate_schedule
from moetron.pipeline.stage import MicroBatch, PipelineStageModule, build_stage_modules

DEEPSEEK = dict(family="deepseek_v3", vocab_size=61, hidden_size=32, num_layers=4, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_layers=1,
                aux_loss_type="seq_aux_loss", aux_loss_coeff=0.05, init_std=0.1)
B, S = 2, 6
# name: (schedule, microbatches, vpp, layout, recompute (modules, every_n_layers))
CASES = {
    "dualpipev": ("dualpipev", 4, None, "Et|tt|t|mL", ([], 0)),
    "dualpipev_recompute": ("dualpipev", 4, None, "Et|tt|t|mL", (["moe", "layernorm", "moe_act"], 0)),
    "1f1b": ("1f1b", 4, None, "Ett|ttmL", ([], 0)),
    "interleaved": ("interleaved", 4, 2, "Et|t|t|tmL", ([], 2)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def assert_close(got, want, rtol, msg):
    """|got - want| <= rtol * (|want| + max|want|) elementwise."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    atol = rtol * want.abs().max().item()
    excess = ((got - want).abs() - rtol * want.abs() - atol).max().item()
    assert excess <= 0, f"{msg}: worst excess {excess:.3g} over atol {atol:.3g}"


# ------------------------------------------------------------------ the recorder


class Recorder:
    """Logs (event, micro-batch, piece) for every piece run by the executor, in order.

    Events: "F" a forward piece ran; "B" a backward piece started (a hook on its outputs);
    "F-issue"/"F-wait" and "B-issue"/"B-wait" around a communication piece's all-to-all.
    """

    def __init__(self):
        self.events: list[tuple[str, int, str]] = []
        self.mb_of: dict[int, int] = {}
        self._original = PipelineStageModule.pieces

    def __enter__(self):
        recorder, original = self, self._original

        def pieces(module, batch, split="moe"):
            mb = recorder.mb_of[id(batch)]
            return [(name, RecordedComm(fn, recorder, mb, name) if isinstance(fn, CommPiece)
                     else recorder.compute(fn, mb, name)) for name, fn in original(module, batch, split)]

        PipelineStageModule.pieces = pieces
        return self

    def __exit__(self, *exc):
        PipelineStageModule.pieces = self._original

    def log(self, *event):
        self.events.append(event)

    def compute(self, fn, mb, name):
        def run(state):
            self.log("F", mb, name)
            out = fn(state)
            started = []

            def hook(grad):
                if not started:  # the first output gradient this piece's backward sees
                    started.append(True)
                    self.log("B", mb, name)

            for t in out:
                if t.grad_fn is not None:
                    t.register_hook(hook)
            return out
        return run


class RecordedComm(CommPiece):
    def __init__(self, inner, recorder, mb, name):
        super().__init__(inner.entry, inner.exchange)
        self.recorder, self.mb, self.name = recorder, mb, name

    def start(self, state):
        self.recorder.log("F-issue", self.mb, self.name)
        return RecordedTransfer(self, self.entry, self.exchange(), state)


class RecordedTransfer(Transfer):
    def __init__(self, piece, *args):
        self.piece = piece
        super().__init__(*args)

    def wait(self):
        out = super().wait()
        self.piece.recorder.log("F-wait", self.piece.mb, self.piece.name)
        return out

    def start_backward(self, grads):
        p = self.piece
        p.recorder.log("B-issue", p.mb, p.name)
        pending = super().start_backward(grads)
        inner_wait = pending.wait

        def wait():
            out = inner_wait()
            p.recorder.log("B-wait", p.mb, p.name)
            return out
        pending.wait = wait
        return pending


def overlapped_transfers(events):
    """{(direction, all-to-all kind): [number of other-micro-batch pieces run while in flight]}."""
    found = {}
    for i, (kind, mb, name) in enumerate(events):
        if not kind.endswith("-issue"):
            continue
        direction = kind[0]
        j = events.index((f"{direction}-wait", mb, name), i)
        others = [e for e in events[i + 1:j] if e[0] in ("F", "B") and e[1] != mb]
        found.setdefault((direction, name.rstrip("0123456789")), []).append(len(others))
        if direction == "F":  # the rows are waited for only by the piece that needs them
            assert events[j + 1][:2] == ("F", mb) and events[j + 1][2].startswith(("experts", "combine")), \
                (events[j + 1], name)
    return found


# ------------------------------------------------------------------ the worker


def _worker(rank, world):
    torch.manual_seed(0)
    ps = ParallelState.build(ParallelConfig(ep=2, pp=2))
    assert ps.ep.size == 2 and ps.pp.size == 2
    report = {}
    for name, (sched_name, m, vpp, text, (modules, every)) in CASES.items():
        torch.manual_seed(0)  # the same model everywhere
        model = MoETransformer(ModelConfig(**DEEPSEEK))
        expert_parallelize(model, ps, "alltoall")
        cfg = model.config
        g = torch.Generator().manual_seed(100 + ps.dp.rank)  # each EP rank its own tokens
        tokens = torch.randint(0, cfg.vocab_size, (m * B, S + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
        labels[:, 2] = -100
        batches = [MicroBatch(inputs[i * B:(i + 1) * B], labels[i * B:(i + 1) * B]) for i in range(m)]
        schedule = build_schedule(sched_name, pp=2, microbatches=m, vpp=vpp)
        layout = parse_layout(text, num_layers=cfg.num_layers, mtp_layers=cfg.num_mtp_layers, pp=2,
                              vpp=schedule.num_stages // 2)
        chunks = build_stage_modules(model, layout, schedule, ps.pp.rank)
        params = {n: p for c in chunks for n, p in c.named_parameters()}
        moe_layers = {n: mod for c in chunks for n, mod in c.named_modules() if isinstance(mod, MoELayer)}
        got = {}
        for mode in ("off", "moe"):
            set_recompute(model, modules if mode == "moe" else [], every if mode == "moe" else 0)
            model.zero_grad(set_to_none=True)
            for layer in moe_layers.values():
                layer.pending_counts.zero_()
            with Recorder() as recorder:
                recorder.mb_of = {id(b): i for i, b in enumerate(batches)}
                result = run_schedule(schedule, chunks, batches, group=ps.pp, fb_overlap=mode)
            got[mode] = (result, {n: p.grad.clone() for n, p in params.items()},
                         {n: layer.pending_counts.clone() for n, layer in moe_layers.items()})
        (off, off_grads, off_counts), (moe, moe_grads, moe_counts) = got["off"], got["moe"]
        where = f"{name} rank {rank}"
        assert torch.allclose(moe.losses, off.losses, rtol=1e-6, atol=0), (where, moe.losses, off.losses)
        for n in off_counts:
            assert torch.equal(moe_counts[n], off_counts[n]), (where, n)
        for n in off_grads:
            assert_close(moe_grads[n], off_grads[n], 1e-5, f"{where}: grad of {n}")
        assert any(t.startswith("FB(") for t in moe.timeline), (where, moe.timeline)
        report[name] = {"timeline": moe.timeline, "overlapped": overlapped_transfers(recorder.events),
                        "events": len(recorder.events)}
    return report


def test_async_all_to_all_pieces_match_and_overlap():
    results = run_distributed(_worker, 4, timeout=300)
    for name in CASES:
        timelines = [r[name]["timeline"] for r in results]
        if name.startswith("dualpipev"):  # FB pairs and split backward (B then W) in one run
            assert any(t.startswith("Bi") for t in timelines[0]) and any(t.startswith("W") for t in timelines[0])
        overlapped = {}
        for r in results:
            for key, counts in r[name]["overlapped"].items():
                overlapped.setdefault(key, []).extend(counts)
        # Every kind of all-to-all, forward rows and backward gradients, had the other micro-batch's
        # pieces running while it was in flight.
        for key in [("F", "dispatch_a2a"), ("F", "combine_a2a"), ("B", "dispatch_a2a"), ("B", "combine_a2a")]:
            assert key in overlapped and max(overlapped[key]) > 0, (name, key, overlapped)


# ------------------------------------------------------------------ in one process


def test_pairing_forward_and_backward():
    """1F1B / interleaved get FB pairs (each full backward with the forward after it) that can
    run to the end; split backwards and DualPipe's own pairs are left alone."""
    s = pair_forward_backward(build_schedule("1f1b", pp=4, microbatches=8))
    assert [str(a) for a in s.rank_actions[3]] == (
        ["F0@s3"] + [f"FB(F{i + 1}@s3,B{i}@s3)" for i in range(7)] + ["B7@s3"])
    assert [str(a) for a in s.rank_actions[0][:5]] == ["F0@s0", "F1@s0", "F2@s0", "F3@s0", "FB(F4@s0,B0@s0)"]
    for pp, m, vpp in [(2, 3, None), (3, 7, None), (4, 8, 2), (2, 5, 3), (2, 4, 2)]:
        paired = pair_forward_backward(build_schedule("interleaved" if vpp else "1f1b", pp=pp, microbatches=m,
                                                      vpp=vpp))
        validate_schedule(paired)
        assert any(a.kind == "FB" for a in paired.rank_actions[0]), (pp, m, vpp)
    for name in ("zb1p", "dualpipev"):
        schedule = build_schedule(name, pp=2, microbatches=4)
        assert pair_forward_backward(schedule) is schedule


@pytest.mark.parametrize("sched,vpp,text", [("1f1b", None, "EtttmL"), ("interleaved", 2, "Ett|tmL")])
def test_one_rank_pairs_match_back_to_back(sched, vpp, text):
    """pp=1 (local dispatcher, no communication pieces): the paired run equals the plain one."""
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**{**DEEPSEEK, "num_layers": 3}))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 61, (3 * B, S + 1), generator=g)
    batches = [(tokens[i * B:(i + 1) * B, :-1], tokens[i * B:(i + 1) * B, 1:]) for i in range(3)]
    schedule = build_schedule(sched, pp=1, microbatches=3, vpp=vpp)
    layout = parse_layout(text, num_layers=3, mtp_layers=1, pp=1, vpp=schedule.num_stages)
    chunks = build_stage_modules(model, layout, schedule, 0)
    got = {}
    for mode in ("off", "moe"):
        model.zero_grad(set_to_none=True)
        result = run_schedule(schedule, chunks, batches, fb_overlap=mode)
        got[mode] = (result, {n: p.grad.clone() for n, p in model.named_parameters()})
    assert any(t.startswith("FB(") for t in got["moe"][0].timeline)
    assert torch.allclose(got["moe"][0].losses, got["off"][0].losses, rtol=1e-6, atol=0)
    for n, want in got["off"][1].items():
        assert_close(got["moe"][1][n], want, 1e-5, n)
