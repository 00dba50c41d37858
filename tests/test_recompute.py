"""Selective and full-layer activation recomputation (moetron/ops/recompute.py).

Recomputation must not change the numerics at all: with each option (and with all of them, and
with full-layer recompute) the loss, every gradient, the balancing losses and the routing counts
are bit-identical (torch.equal) to the run without it, in one process (both families, MTP,
shared experts, dense layers, global-batch aux loss), under tensor / expert / context parallel
layouts and under pipeline schedules (including split backward and MoE pieces). The memory it
saves is measured with saved-tensor hooks (ActivationMeter) and must equal the formula of
docs/activation_memory.md to the byte; the formula itself is checked against the measured total
of every layer. Two distributed spawns (world 2) run every parallel case.
"""

import gc

import pytest
import torch

from dist_utils import run_distributed
from moetron.config import ModelConfig
from moetron import ops
from moetron.kernels import attention_cpu, cpp_build
from moetron.ops import recompute
from moetron.model.activation_memory import ActivationMeter, layer_activation_bytes
from moetron.model.model import MoETransformer
from moetron.ops.recompute import MODULES, set_recompute
from moetron.pipeline import build_schedule, parse_layout
from moetron.pipeline.runtime import run_schedule
from moetron.pipeline.split_backward import backward_input
from moetron.pipeline.stage import MicroBatch, PipelineStageModule, build_stage_modules

V, B, S = 64, 2, 8
QWEN = dict(family="qwen3_moe", vocab_size=V, hidden_size=32, num_layers=3, num_attention_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2,
            mlp_only_layers=[1], aux_loss_type="global_aux_loss", aux_loss_coeff=0.05, z_loss_coeff=0.01,
            init_std=0.1)
DEEPSEEK = dict(family="deepseek_v3", vocab_size=V, hidden_size=32, num_layers=3, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_layers=1,
                aux_loss_type="seq_aux_loss", aux_loss_coeff=0.05, init_std=0.1)
FAMILIES = {"qwen": QWEN, "deepseek": DEEPSEEK, "deepseek_eager_no_qlora": {
    **DEEPSEEK, "attention_backend": "eager", "q_lora_rank": None}}
# every option alone, all together, full-layer recompute (every layer / every 2nd, with options)
SETTINGS = [([m], 0) for m in MODULES] + [(list(MODULES), 0), ([], 1), (["moe_act", "layernorm"], 2)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def data(seed=1, batch=B):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, S), generator=g)
    labels = torch.randint(0, V, (batch, S), generator=g)
    labels[0, :2] = -100
    return ids, labels


def build(cfg_dict, **changes):
    torch.manual_seed(0)
    return MoETransformer(ModelConfig(**{**cfg_dict, **changes}))


def train_step(model, ids, labels, saved_bytes=None):
    """Loss, gradients, balancing losses and routing counts of one forward + backward (and the
    bytes the forward saved for backward, appended to `saved_bytes` when given)."""
    model.zero_grad(set_to_none=True)
    for m in model.moe_layers():
        m.pending_counts.zero_()
        m.router.reset_global_counts()
    meter = ActivationMeter(model)
    with meter if saved_bytes is not None else torch.enable_grad():
        out = model(ids, labels=labels)
    if saved_bytes is not None:
        saved_bytes.append(meter.total_bytes)
    out.total_loss.backward()
    return {"loss": out.total_loss.detach(), **{f"aux {k}": v for k, v in out.aux_losses.items()},
            **{f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            **{f"counts {i}": m.pending_counts.clone() for i, m in enumerate(model.moe_layers())}}


def assert_identical(got, want, what):
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        assert torch.equal(got[k], w), f"{what}: {k} differs (max {(got[k] - w).abs().max().item():.3g})"


# ---- configuration ---------------------------------------------------------------------------------


def test_config_fields_validate_and_parse_from_the_command_line():
    from moetron.recipes import get_recipe
    from moetron.config import apply_overrides

    with pytest.raises(ValueError, match=r"recompute_modules=\['moe_act', 'attn'\]: unknown module 'attn'; "
                                         r"valid: core_attn, mlp, moe, shared_experts \(checkpointed\), moe_act, "
                                         r"layernorm, mla_up_proj \(output-discarding\)"):
        ModelConfig(**QWEN, recompute_modules=["moe_act", "attn"])
    with pytest.raises(ValueError, match=r"recompute_modules='moe_act': must be a list of module names"):
        ModelConfig(**QWEN, recompute_modules="moe_act")
    with pytest.raises(ValueError, match=r"recompute_every_n_layers=-1: must be an integer >= 0"):
        ModelConfig(**QWEN, recompute_every_n_layers=-1)
    recipe = apply_overrides(get_recipe("deepseek-v3-tiny"), ['model.recompute_modules=["moe_act","layernorm"]',
                                                             "model.recompute_every_n_layers=2"])
    cfg = recipe.model
    assert cfg.recompute_modules == ["moe_act", "layernorm"] and cfg.recompute_every_n_layers == 2
    model = MoETransformer(cfg.replace(num_layers=2, num_mtp_layers=1))
    plans = [layer.recompute for layer in model.layers] + [model.mtp[0].layer.recompute]
    assert [p.full for p in plans] == [False, True, False]  # layers 1 and 3 (MTP) of 0..2: every 2nd
    assert all(p.modules == {"moe_act", "layernorm"} for p in plans)
    with pytest.raises(ValueError, match=r"--set model.recompute_modules=moe_act: expected a value of type list"):
        apply_overrides(get_recipe("deepseek-v3-tiny"), ["model.recompute_modules=moe_act"])


# ---- one process: bit-identical gradients ------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_bit_identical_with_every_option(family):
    model = build(FAMILIES[family])
    with torch.no_grad():  # sharper routing, so the balancing losses and counts matter
        for m in model.moe_layers():
            m.router.weight.mul_(5)
    ids, labels = data()
    want = train_step(model, ids, labels)
    assert any(k.startswith("aux ") for k in want) and want["counts 0"].sum() > 0
    for modules, every in SETTINGS:
        set_recompute(model, modules, every)
        assert_identical(train_step(model, ids, labels), want, f"{family} {modules} every {every}")
    # built from the config, not switched on afterwards
    built = build(FAMILIES[family], recompute_modules=list(MODULES))
    with torch.no_grad():
        for m in built.moe_layers():
            m.router.weight.mul_(5)
    assert_identical(train_step(built, ids, labels), want, f"{family} built with every option")


def test_no_recompute_without_grad_and_in_eval():
    model = build(DEEPSEEK, recompute_modules=list(MODULES), recompute_every_n_layers=2)
    ids, labels = data()
    ref = build(DEEPSEEK)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    model.eval(), ref.eval()
    assert torch.equal(model(ids, labels=labels).total_loss, ref(ids, labels=labels).total_loss)


# ---- the mechanism ---------------------------------------------------------------------------------------


def test_discarded_output_is_freed_and_recomputed_once():
    """A consumer's saved copy of a discarded output is a handle: the output's memory is freed
    after the forward; backward recomputes the region once and gives the same gradients."""
    calls = []

    def region(x, w):
        calls.append(1)
        return torch.tanh(x * w) * 3

    g = torch.Generator().manual_seed(0)
    x0, w0, m0 = (torch.randn(64, 32, generator=g) for _ in range(3))
    results = []
    for discard in (False, True):
        calls.clear()
        x, w, m = (t.clone().requires_grad_() for t in (x0, w0, m0))
        y = recompute.discard_output(region, x, w) if discard else region(x, w)
        with recompute.saved_outputs(discard):
            z = (y.t() @ m).sin()  # matmul saves y (as a view) and m
        storage = torch.multiprocessing.reductions.StorageWeakRef(y.untyped_storage())
        del y
        gc.collect()
        assert storage.expired() == discard  # only the consumer held y
        z.sum().backward()
        assert len(calls) == 1 + discard  # the forward, then one recompute in backward
        results.append((x.grad, w.grad, m.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_replayed_method_is_not_called_again_in_recompute():
    class Counter:
        def __init__(self):
            self.calls = 0

        def next(self, x):
            self.calls += 1
            return x * self.calls

    counter = Counter()

    def fn(x):
        with recompute.replayed(counter, "next"):
            return (counter.next(x) * x).exp()

    x = torch.randn(5, requires_grad=True)
    y = recompute.checkpoint(fn, x)
    assert counter.calls == 1 and "next" not in vars(counter)
    y.sum().backward()
    assert counter.calls == 1  # the recompute used the recorded value
    x2 = x.detach().clone().requires_grad_()
    (x2 * x2).exp().sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_split_backward_of_pipeline_pieces_with_recompute():
    """Zero-bubble split backward (input grads, then weight grads in a second autograd call)
    through MoE pieces: every region is recomputed again in the second call, and the gradients
    equal the ones without recompute."""
    model = build(DEEPSEEK, num_mtp_layers=0)
    layout = parse_layout("Et|ttL", num_layers=3, mtp_layers=0, pp=2)
    ids, labels = data()
    batch = MicroBatch(ids, labels)
    stage = PipelineStageModule(model, layout, 1)
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(4))
    got = {}
    for setting in (([], 0), (list(MODULES), 0), (["moe_act", "layernorm"], 2)):
        set_recompute(model, *setting)
        model.zero_grad(set_to_none=True)
        state, record = (x.clone().requires_grad_(),), []
        for i, (_, fn) in enumerate(stage.pieces(batch, split="moe")):
            if i:
                state = tuple(t.detach().requires_grad_() if t.requires_grad else t for t in state)
            out = fn(state)
            record.append((state, out))
            state = out
        grads, works = [torch.tensor(0.7)] + [None] * (len(state) - 1), []
        for ins, outs in reversed(record):
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            grads, work = backward_input([o for o, _ in pairs], [g for _, g in pairs], ins)
            works.append(work)
        assert all(p.grad is None for p in stage.parameters())
        for work in works:
            work.run()
        got[str(setting)] = {"dx": grads[0], **{n: p.grad for n, p in stage.named_parameters()}}
    base = got.pop(str(([], 0)))
    for setting, g in got.items():
        assert_identical(g, base, setting)


def test_one_rank_schedules_bit_identical():
    """pp=1 pipeline runs (every transfer local; split backward under zb1p), with and without."""
    model = build(DEEPSEEK)
    ids, labels = data(batch=3 * B)
    mbs = [(ids[i * B:(i + 1) * B], labels[i * B:(i + 1) * B]) for i in range(3)]
    for sched, vpp, text in (("zb1p", None, "EtttmL"), ("interleaved", 3, "Et|t|tmL")):
        schedule = build_schedule(sched, pp=1, microbatches=3, vpp=vpp)
        layout = parse_layout(text, num_layers=3, mtp_layers=1, pp=1, vpp=schedule.num_stages)
        chunks = build_stage_modules(model, layout, schedule, 0)
        runs = []
        for setting in (([], 0), (["moe", "layernorm", "mla_up_proj", "core_attn"], 0), (["moe_act"], 2)):
            set_recompute(model, *setting)
            model.zero_grad(set_to_none=True)
            result = run_schedule(schedule, chunks, mbs)
            runs.append({"losses": result.losses, **{n: p.grad.clone() for n, p in model.named_parameters()}})
        for got in runs[1:]:
            assert_identical(got, runs[0], sched)


# ---- activation memory: measured against the formula ----------------------------------------------------


def measure(model, ids, labels):
    meter = ActivationMeter(model)
    with meter:
        out = model(ids, labels=labels)
    out.total_loss.backward()  # the graph really is differentiable with what was kept
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "layer_idx")}
    rows = {n: int(m.mlp.last_tokens_per_expert.sum()) if m.is_moe else None for n, m in layers.items()}
    return meter.layer_bytes, rows, {n: m.layer_idx for n, m in layers.items()}


@pytest.mark.parametrize("family", ["qwen", "deepseek", "qwen_switch", "deepseek_cpp_attention"])
def test_the_cpp_fusion_saves_what_the_formula_says(family):
    """Under train.fusion=cpp (the CPU default) the experts' SwiGLU is one C++ kernel, so is the permute
    the trainer then takes, so is a softmax router that `fused_router_covers` (qwen_switch) and DeepSeek's
    sigmoid router's selection, and so is
    MLA's attention where its head dims are multiples of 8 (deepseek_cpp_attention: q/k 16, v 8; the
    other deepseek's q/k 12 keep SDPA's math path): the formula's `fused_*` / `cpp_attention` terms, to
    the byte, with and without moe_act (the norms and RoPE save as before)."""
    if not cpp_build.cpp_status(build=True)[0]:
        pytest.skip("moetron's C++ kernels cannot be built here")
    from moetron.dispatch.permute import set_permute_impl
    from moetron.moe.router import fused_router_covers

    config = ({**QWEN, "aux_loss_type": "aux_loss", "z_loss_coeff": 0.0} if family == "qwen_switch" else
              {**FAMILIES["deepseek"], "qk_rope_head_dim": 8} if family == "deepseek_cpp_attention" else
              FAMILIES[family])
    model = build(config)
    c = model.config
    cpp_attention = attention_cpu.shape_runs(S, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
    assert cpp_attention == (family == "deepseek_cpp_attention") or c.attention_type == "gqa"
    fused_router = fused_router_covers(model.config.moe_config())
    assert fused_router == (family == "qwen_switch")
    ids, labels = data()
    ops.set_fusion("cpp")
    set_permute_impl("cpp")  # as the trainer does under train.fusion=cpp (conftest.py restores the default)
    for modules in ([], ["moe_act"]):
        set_recompute(model, modules, 0)
        got, rows, index = measure(model, ids, labels)
        for name, nbytes in got.items():
            want = layer_activation_bytes(model.config, index[name], B, S, rows[name], modules=modules,
                                          every_n_layers=0, fused_swiglu=True, fused_permute=True,
                                          fused_router=fused_router, cpp_attention=cpp_attention,
                                          cpp_sigmoid_router=True)
            assert nbytes == want.total, (family, modules, name, nbytes, want.terms)
    assert "expert silu(gate)" not in want.terms
    assert ("core probabilities" in want.terms) == (family == "deepseek")  # SDPA's math path saves them
    if c.moe_config().score_func == "sigmoid":  # DeepSeek's router selects in C++: no normalisation kept
        assert c.norm_topk_prob and "router weight normalisation" not in want.terms


@pytest.mark.parametrize("family,dtype,batch", [("qwen", torch.float32, B), ("deepseek", torch.float32, B),
                                                ("deepseek", torch.float32, 1),
                                                ("deepseek_eager_no_qlora", torch.float32, 1),
                                                ("deepseek_eager_no_qlora", torch.float32, B),
                                                ("deepseek", torch.bfloat16, B)])
def test_measured_activation_bytes_match_the_formula(family, dtype, batch):
    """Every layer's measured bytes equal the formula, for every setting, and so does each saving.
    (batch 1: MLA's v reaches the attention core as a view of the up-projection's output.)"""
    model = build(FAMILIES[family]).to(dtype)
    cfg = model.config
    ids, labels = data(batch=batch)
    base, rows, index = measure(model, ids, labels)
    assert set(base) == {"layers.0", "layers.1", "layers.2"} | ({"mtp.0.layer"} if cfg.num_mtp_layers else set())
    saved_something = set()
    for modules, every in [([], 0)] + SETTINGS + [(["layernorm", "moe"], 0), (["mla_up_proj", "core_attn"], 0)]:
        set_recompute(model, modules, every)
        got, got_rows, _ = measure(model, ids, labels)
        assert got_rows == rows  # the same routing
        for name, nbytes in got.items():
            want = layer_activation_bytes(cfg, index[name], batch, S, rows[name], modules=modules,
                                          every_n_layers=every, dtype=dtype)
            assert nbytes == want.total, (family, modules, every, name, nbytes, want.total, want.terms)
            base_want = layer_activation_bytes(cfg, index[name], batch, S, rows[name], modules=[],
                                               every_n_layers=0, dtype=dtype)
            assert base[name] - nbytes == base_want.total - want.total  # the saving, to the byte
            if nbytes < base[name]:
                saved_something.add(tuple(modules) if not every else ("full",))
    expected = {(m,) for m in MODULES} - {("mla_up_proj",)} | {tuple(MODULES), ("full",)}
    if cfg.family == "qwen3_moe":
        expected -= {("mla_up_proj",), ("shared_experts",)}
    if cfg.attention_type == "mla" and cfg.attention_backend == "sdpa":
        expected -= {("core_attn",)}  # on CPU the math path holds as much as the checkpoint's inputs
    if cfg.attention_backend == "eager" or (cfg.attention_type == "mla" and batch == 1):
        expected |= {("mla_up_proj",)}  # the core saves q, k (eager) or v (batch 1) themselves: freed
    assert expected <= saved_something, expected - saved_something


# ---- parallel layouts and pipeline schedules (two spawns of two ranks) ----------------------------------


LAYOUT_CASES = {  # name: (model, parallel sizes, how to parallelize, settings)
    "deepseek_tp2_sp": (DEEPSEEK, dict(tp=2, sp=True), "tp", SETTINGS),
    "qwen_tp2": (QWEN, dict(tp=2), "tp", [(list(MODULES), 0), (["moe"], 0), (["core_attn", "mlp"], 0)]),
    "qwen_ep2": (QWEN, dict(ep=2), "ep", [(["moe"], 0), (["moe_act", "layernorm"], 0), ([], 2)]),
    "deepseek_ep2": (DEEPSEEK, dict(ep=2), "ep", [(list(MODULES), 0)]),
    "deepseek_cp2": (DEEPSEEK, dict(cp=2), "cp", [(["core_attn", "mla_up_proj", "layernorm"], 0),
                                                   (["core_attn"], 0), ([], 1)]),
    "qwen_cp2": (QWEN, dict(cp=2), "cp", [(["core_attn", "layernorm", "moe"], 0)]),
}


def _layouts_worker(rank, world):
    """TP=2 with and without sequence parallel, EP=2 (all-to-all), CP=2: every setting against the
    same layout without recompute, bit for bit."""
    from moetron.moe import balancing
    from moetron.parallel import ParallelConfig, ParallelState
    from moetron.model.parallelize import context_parallelize
    from moetron.parallel.context_parallel import split_batch
    from moetron.model.parallelize import expert_parallelize, tensor_parallelize

    torch.set_num_threads(1)
    ids, labels = data()
    states = {}

    def state(**sizes):
        key = tuple(sorted(sizes.items()))
        if key not in states:  # every rank builds the same groups in the same order
            states[key] = ParallelState.build(ParallelConfig(**sizes))
        return states[key]

    checked = []
    for name, (cfg_dict, sizes, how, settings) in LAYOUT_CASES.items():
        ps = state(**sizes)
        model = build(cfg_dict)
        inputs = dict(input_ids=ids, labels=labels)
        if how == "tp":
            tensor_parallelize(model, ps)
        elif how == "ep":
            expert_parallelize(model, ps)
        else:
            context_parallelize(model, ps)
            inputs = split_batch(ps.cp, ids, labels)
            del inputs["position_ids"]
            balancing.set_aux_loss_scale(0.5)
        try:
            saved = []
            want = train_step(model, inputs.pop("input_ids"), inputs.pop("labels"), saved)
            for modules, every in settings:
                set_recompute(model, modules, every)
                local = split_batch(ps.cp, ids, labels) if how == "cp" else dict(input_ids=ids, labels=labels)
                got = train_step(model, local["input_ids"], local["labels"], saved)
                what = f"rank {rank} {name} {modules} every {every}"
                assert_identical(got, want, what)
                if every or {"moe", "moe_act", "layernorm", "mlp"} & set(modules):  # really recomputed
                    assert saved[-1] < saved[0], (what, saved[-1], saved[0])
                checked.append((name, tuple(modules), every))
        finally:
            balancing.set_aux_loss_scale(1.0)
    return checked


def test_parallel_layouts_bit_identical():
    results = run_distributed(_layouts_worker, 2, timeout=240)
    assert results[0] == results[1] and len(results[0]) == sum(len(c[3]) for c in LAYOUT_CASES.values())


PIPELINE_CASES = {  # name: (model, schedule, microbatches, layout, run_schedule options)
    "qwen_1f1b": (QWEN, "1f1b", 4, "Et|ttL", {}),
    "deepseek_zb1p_split_backward": (DEEPSEEK, "zb1p", 3, "Ett|tmL", {}),
    "deepseek_dualpipev_moe_pieces": (DEEPSEEK, "dualpipev", 4, "E|tt|t|mL", {"fb_overlap": "moe"}),
}


def _pipeline_worker(rank, world):
    torch.set_num_threads(1)
    checked = []
    for name, (cfg_dict, sched, m, text, options) in PIPELINE_CASES.items():
        model = build(cfg_dict)
        cfg = model.config
        schedule = build_schedule(sched, pp=world, microbatches=m)
        layout = parse_layout(text, num_layers=cfg.num_layers, mtp_layers=cfg.num_mtp_layers, pp=world,
                              vpp=schedule.num_stages // world)
        chunks = build_stage_modules(model, layout, schedule, rank)
        ids, labels = data(seed=3, batch=m * B)
        mbs = [MicroBatch(ids[i * B:(i + 1) * B], labels[i * B:(i + 1) * B]) for i in range(m)]
        results = {}
        for setting in (([], 0), (list(MODULES), 0), (["moe_act", "layernorm", "mla_up_proj"], 2), ([], 1)):
            set_recompute(model, *setting)
            model.zero_grad(set_to_none=True)
            for layer in model.moe_layers():
                layer.pending_counts.zero_()
                layer.router.reset_global_counts()  # global_aux_loss counts the step's micro-batches
            meter = ActivationMeter(model)
            with meter:
                result = run_schedule(schedule, chunks, mbs, **options)
            saved = sum(e.storage_bytes for e in meter.entries)  # over the run (storages are reused)
            params = {n: p for c in chunks for n, p in c.named_parameters()}
            results[setting[1], tuple(setting[0])] = {
                "saved": torch.tensor(saved), "losses": result.losses,
                **{f"grad {n}": p.grad.clone() for n, p in params.items()},
                **{f"counts {n}": mod.pending_counts.clone() for c in chunks for n, mod in c.named_modules()
                   if hasattr(mod, "pending_counts")}}
        want = results.pop((0, ()))
        for key, got in results.items():
            assert got.pop("saved") < want["saved"], (rank, name, key)  # really recomputed
            want_grads = {k: v for k, v in want.items() if k != "saved"}
            assert_identical(got, want_grads, f"rank {rank} {name} {key}")
            checked.append((name, key))
    return checked


def test_pipeline_schedules_bit_identical():
    results = run_distributed(_pipeline_worker, 2, timeout=240)
    assert len(results[0]) == len(results[1]) == 3 * len(PIPELINE_CASES)
