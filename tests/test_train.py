"""The main job: recipes, overrides, the trainer and the command line."""

import json

import pytest
import torch

from moetron.cli import main
from moetron.model.model import MoETransformer
from moetron.model.size import model_size
from moetron.recipes import RECIPES, apply_overrides, get_recipe
from moetron.train import trainer
from moetron.data.builtin import TokenBatches, stdlib_corpus
from moetron.train.setup import build_run
from moetron.train.trainer import train

SMALL = ["model.num_layers=2", "train.seq_len=32", "train.micro_batch_size=4", "train.log_every=100"]


def test_every_recipe_builds_and_sizes_match_real_modules():
    for name, build in RECIPES.items():
        recipe = build()
        assert recipe.name == name
        size = model_size(recipe.model)
        assert size.active < size.total
        if "tiny" in name:
            model = MoETransformer(recipe.model)
            assert size.total == sum(p.numel() for p in model.parameters())
    assert 600e9 < model_size(get_recipe("deepseek-v3-671b").model).total < 700e9
    assert 30e9 < model_size(get_recipe("qwen3-moe-30b-a3b").model).total < 31e9


def test_overrides_coerce_types_and_name_bad_fields():
    r = apply_overrides(get_recipe("deepseek-v3-tiny"),
                        ["train.steps=7", "model.q_lora_rank=none", "train.lr=1e-3", "parallel.ep=2",
                         "model.mlp_only_layers=[]", "model.tie_word_embeddings=true"])
    assert (r.train.steps, r.model.q_lora_rank, r.train.lr, r.parallel.ep) == (7, None, 1e-3, 2)
    assert r.model.tie_word_embeddings is True
    with pytest.raises(ValueError, match="no field 'stepz'"):
        apply_overrides(r, ["train.stepz=3"])
    with pytest.raises(ValueError, match="unknown section"):
        apply_overrides(r, ["optim.lr=3"])
    with pytest.raises(ValueError, match="type int"):
        apply_overrides(r, ["train.steps=many"])
    with pytest.raises(ValueError, match="num_experts"):
        apply_overrides(r, ["model.num_experts=6"])  # n_group=4 no longer divides
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("gpt-5")


def test_batches_are_deterministic_shifted_and_real_text():
    tokens = stdlib_corpus(max_bytes=1 << 20)
    assert tokens.max() < 256 and tokens.unique().numel() > 60  # real text, not zeros
    data = TokenBatches(tokens, seq_len=16, batch_size=3, seed=1)
    x, y = data.batch(step=5, index=1)
    x2, y2 = data.batch(step=5, index=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(data.batch(step=6)[0], x)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_training_reduces_loss_and_writes_metrics(name, tmp_path):
    """30 steps: the mean LM loss of the last 5 is well below that of the first 5 (a run with
    lr=1e-9, i.e. a trainer that does not update, moves it by under 0.05 nats)."""
    metrics = tmp_path / "m.jsonl"
    recipe = apply_overrides(get_recipe(name), SMALL + ["train.steps=30", "train.warmup_steps=3",
                                                        f"train.metrics_file={metrics}"])
    history = train(recipe, log=lambda s: None)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 30 and rows[-1]["step"] == 30  # steps done, as the console counts
    for key in ("step", "loss", "lm_loss", "grad_norm", "lr", "tokens_per_s", "max_over_mean_load",
                "dropped_fraction", "skipped_steps"):
        assert key in rows[0]
    moe_layers = [f"layer{i}" for i in range(2) if recipe.model.is_moe_layer(i)]
    moe_layers += [f"mtp{d + 1}" for d in range(recipe.model.num_mtp_layers)]
    assert sorted(rows[0]["moe_load"]) == sorted(moe_layers)
    first = sum(h["lm_loss"] for h in history[:5]) / 5
    last = sum(h["lm_loss"] for h in history[-5:]) / 5
    assert last < first - 0.5, (first, last)
    if name == "deepseek-v3-tiny":
        assert "mtp_loss" in rows[0] and "seq_aux_loss" in rows[0]


def test_load_metrics_match_the_routing_of_every_micro_batch(monkeypatch):
    """`moe_load` per layer, recomputed here from each micro-batch's routed expert indices
    (-1 = dropped by capacity): counts summed over the step's micro-batches, then max/mean."""
    routed = {}  # decoder layer -> topk_idx of every router call, in order

    def build_and_watch(recipe, log):
        run = build_run(recipe, log)
        for i, layer in enumerate(run.model.layers):
            if layer.is_moe:
                routed[i] = []
                layer.mlp.router.register_forward_hook(
                    lambda mod, args, out, i=i: routed[i].append(out[0].topk_idx.detach().clone()))
        return run

    monkeypatch.setattr(trainer, "build_run", build_and_watch)
    accum = 3
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"),
                             SMALL + ["train.steps=2", f"train.grad_accum={accum}", "model.capacity_factor=1.0"])
    history = train(recipe, log=lambda s: None)
    E = recipe.model.num_experts
    dropped_somewhere = False
    for step, metrics in enumerate(history):
        assert sorted(metrics["moe_load"]) == [f"layer{i}" for i in sorted(routed)]
        for i, calls in routed.items():
            idx = torch.cat([c.reshape(-1) for c in calls[step * accum:(step + 1) * accum]]).tolist()
            counts = [idx.count(e) for e in range(E)]
            mean = sum(counts) / E
            got = metrics["moe_load"][f"layer{i}"]
            assert got["max_over_mean"] == pytest.approx(max(counts) / mean, rel=1e-12)
            assert got["dropped_fraction"] == pytest.approx(idx.count(-1) / len(idx), rel=1e-12)
            dropped_somewhere |= idx.count(-1) > 0
        worst = max(s["max_over_mean"] for s in metrics["moe_load"].values())
        assert metrics["max_over_mean_load"] == worst
        assert metrics["dropped_fraction"] == max(s["dropped_fraction"] for s in metrics["moe_load"].values())
    assert dropped_somewhere  # capacity_factor=1.0 really drops, so dropped_fraction is tested
    assert all(len(c) == accum * len(history) for c in routed.values())  # one router call per micro-batch


def test_runs_are_reproducible():
    recipe = apply_overrides(get_recipe("deepseek-v3-tiny"), SMALL + ["train.steps=3"])
    a = [h["loss"] for h in train(recipe, log=lambda s: None)]
    b = [h["loss"] for h in train(recipe, log=lambda s: None)]
    assert a == b


def test_cli_train_recipes_env(capsys):
    assert main(["train", "--set", "train.steps=2", *sum((["--set", s] for s in SMALL), [])]) == 0
    assert "done: loss" in capsys.readouterr().out
    assert main(["recipes"]) == 0
    assert "deepseek-v3-671b" in capsys.readouterr().out
    assert main(["env"]) == 0
    assert "torch_grouped_mm" in capsys.readouterr().out
    assert main(["train", "--set", "train.steps=0"]) == 2
    assert "TrainConfig.steps=0" in capsys.readouterr().err
    assert main(["train", "--recipe", "qwen3-moe-30b-a3b"]) == 2
    assert "one process" in capsys.readouterr().err


def test_resume_continues_bit_identically(tmp_path):
    base = SMALL + ["train.steps=6", "train.warmup_steps=2", f"train.save_dir={tmp_path / 'ckpt'}"]
    straight = train(apply_overrides(get_recipe("deepseek-v3-tiny"), base + ["train.save_every=3"]),
                     log=lambda s: None)
    # Interrupted run: stop after 3 steps, then resume to 6 from the step-3 checkpoint.
    other = tmp_path / "other"
    first = apply_overrides(get_recipe("deepseek-v3-tiny"), base[:-1] + ["train.steps=3", f"train.save_dir={other}"])
    train(first, log=lambda s: None)
    resumed = train(apply_overrides(get_recipe("deepseek-v3-tiny"),
                                    base[:-1] + [f"train.save_dir={other}", "train.resume=true"]), log=lambda s: None)
    assert [h["step"] for h in resumed] == [3, 4, 5]
    for a, b in zip(straight[3:], resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["lr"] == b["lr"]
    from safetensors.torch import load_file
    final_a = load_file(str(tmp_path / "ckpt" / "step-00000006" / "model.safetensors"))
    final_b = load_file(str(other / "step-00000006" / "model.safetensors"))
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert not any(p.name.startswith(".") and "partial" in p.name for p in other.iterdir())


def test_incomplete_checkpoint_is_refused(tmp_path):
    from moetron.checkpoint import CheckpointError
    from moetron.checkpoint.training import load_checkpoint
    from moetron.train.trainer import build_optimizer

    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), SMALL)
    model = MoETransformer(recipe.model)
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="meta.json: key 'format' is missing"):
        load_checkpoint(tmp_path, model, build_optimizer(model, recipe))


def test_fp8_training_tracks_fp32_first_steps():
    base = SMALL + ["train.steps=3", "train.warmup_steps=1"]
    ref = train(apply_overrides(get_recipe("qwen3-moe-tiny"), base), log=lambda s: None)
    fp8 = train(apply_overrides(get_recipe("qwen3-moe-tiny"), base + ["train.fp8=blockwise"]), log=lambda s: None)
    for a, b in zip(ref, fp8):
        assert a["loss"] != b["loss"]  # FP8 really ran
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 0.02
    with pytest.raises(ValueError, match="train.fp8|fp8"):
        apply_overrides(get_recipe("qwen3-moe-tiny"), ["train.fp8=fp4"])


def test_default_pipeline_layout_is_balanced_by_flops():
    from moetron.pipeline import balanced_layout, item_costs, parse_layout

    r = get_recipe("deepseek-v3-671b")
    costs = item_costs(r.model, r.train.seq_len)
    assert costs.layers[3] < costs.layers[0] * 2  # an MoE layer (37B active total) is not free
    text = balanced_layout(costs, pp=16)
    layout = parse_layout(text, num_layers=61, mtp_layers=1, pp=16)
    per_stage = [sum(costs.layers[i] for i in s.decoder_layers) for s in layout.stages]
    assert max(per_stage) <= 1.5 * (sum(costs.layers) / 16)  # no stage far above the mean


def test_bf16_training_keeps_fp32_masters_and_tracks_fp32():
    """train.dtype=bf16: bf16 parameters, fp32 gradient buffers and master weights (ZeRO-1 in one
    process), fp32 routing buffers; the loss curve stays within bf16 rounding of the fp32 run."""
    recipe = apply_overrides(get_recipe("deepseek-v3-tiny"), SMALL + ["train.steps=8"])
    fp32 = [h["loss"] for h in train(recipe, log=lambda s: None)]
    bf16_recipe = apply_overrides(recipe, ["train.dtype=bf16"])
    run = build_run(bf16_recipe, log=lambda s: None)
    assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
    assert all(b.dtype != torch.bfloat16 for b in run.model.buffers())
    assert run.optimizer.shards[0].master.dtype == torch.float32
    bf16 = [h["loss"] for h in train(bf16_recipe, log=lambda s: None)]
    assert all(abs(a - b) / b < 2e-2 for a, b in zip(bf16, fp32)), (bf16, fp32)
    assert bf16 != fp32  # really ran in bf16
    assert bf16[-1] < bf16[0] - 0.3


def test_precision_and_device_fields_are_checked():
    with pytest.raises(ValueError, match="train.dtype=bf16 needs parallel.distributed_optimizer"):
        build_run(apply_overrides(get_recipe("qwen3-moe-tiny"),
                                  SMALL + ["train.dtype=bf16", "parallel.distributed_optimizer=false"]))
    with pytest.raises(ValueError, match="TrainConfig.dtype"):
        apply_overrides(get_recipe("qwen3-moe-tiny"), ["train.dtype=fp16"])
    with pytest.raises(ValueError, match="TrainConfig.fusion"):
        apply_overrides(get_recipe("qwen3-moe-tiny"), ["train.fusion=liger"])
    with pytest.raises(ValueError, match="train.fusion=triton runs CUDA tensors, but this run is on cpu"):
        build_run(apply_overrides(get_recipe("qwen3-moe-tiny"), SMALL + ["train.fusion=triton", "train.device=cpu"]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="train.device=cuda"):
            build_run(apply_overrides(get_recipe("qwen3-moe-tiny"), SMALL + ["train.device=cuda"]))


def test_load_metrics_summarise_each_layer_and_count_idle_experts():
    """The step's load line: per layer max/mean and dropped fraction, the worst of each, and the experts
    that got no token (a collapse sign), from one read of every layer's totals; a layer that routed
    nothing is left out."""
    from types import SimpleNamespace

    totals = {0: [6.0, 0.0, 2.0, 0.0, 8.0], 1: [0.0, 0.0, 0.0, 0.0, 0.0], 3: [3.0, 3.0, 1.0, 1.0, 10.0]}
    layers = {i: SimpleNamespace(load_totals=lambda t=t: torch.tensor(t, dtype=torch.float64))
              for i, t in totals.items()}
    model = SimpleNamespace(moe_layers_by_index=lambda: layers, config=SimpleNamespace(num_layers=3))
    run = SimpleNamespace(model=model, ps=SimpleNamespace(world=SimpleNamespace(size=1)))
    m = trainer._load_metrics(run)
    assert m["moe_load"] == {"layer0": {"max_over_mean": 3.0, "dropped_fraction": 0.0},
                             "mtp1": {"max_over_mean": 1.5, "dropped_fraction": pytest.approx(0.2)}}
    assert m["max_over_mean_load"] == 3.0 and m["dropped_fraction"] == pytest.approx(0.2)
    assert m["idle_experts"] == 2  # layer 0's; layer 1 routed nothing and is left out



@pytest.mark.parametrize("extra", [[], ["train.dtype=bf16", "parallel.distributed_optimizer=true"]],
                         ids=["adamw", "distributed-optimizer"])
def test_a_step_reads_nothing_on_the_host_after_its_update(monkeypatch, extra):
    """Every host read of a step (losses, the norm, load metrics) comes before its optimizer update: on a GPU
    a read after it waits for the update, and the next step's kernels queue behind the wait."""
    run = build_run(apply_overrides(get_recipe("qwen3-moe-tiny"), SMALL + extra), log=lambda s: None)
    data = TokenBatches(stdlib_corpus(1 << 16), 32, 4, 0)
    trainer._train_step(run, data, 0, 1.0, trainer._guard(run, "", 0))  # the optimizer's state exists
    events = []
    for method in ("__float__", "__int__", "__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda t, *a, _real=real, **k: events.append("read") or _real(t, *a, **k))
    update = run.optimizer.step

    def step(*args, **kwargs):
        events.append("update")
        result = update(*args, **kwargs)
        events.append("updated")
        return result

    monkeypatch.setattr(run.optimizer, "step", step)
    m = trainer._train_step(run, data, 1, 1.0, trainer._guard(run, "", 1))
    assert events.count("update") == 1 and events[:events.index("update")].count("read") >= 3  # losses, norm, loads
    assert "read" not in events[events.index("updated"):], events
    assert m["loss"] > 0 and m["grad_norm"] > 0 and m["moe_load"]
