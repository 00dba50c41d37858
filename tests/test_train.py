"""The main job: recipes, overrides, the trainer and the command line."""

import json

import pytest
import torch

from moetron.cli import main
from moetron.model.model import MoETransformer
from moetron.model.size import model_size
from moetron.recipes import RECIPES, apply_overrides, get_recipe
from moetron.train.data import TokenBatches, stdlib_corpus
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
    x, y = data.batch(step=5, micro=1)
    x2, y2 = data.batch(step=5, micro=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(data.batch(step=6)[0], x)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_training_reduces_loss_and_writes_metrics(name, tmp_path):
    metrics = tmp_path / "m.jsonl"
    recipe = apply_overrides(get_recipe(name), SMALL + ["train.steps=25", "train.warmup_steps=3",
                                                        f"train.metrics_file={metrics}", "train.grad_accum=2"])
    history = train(recipe, log=lambda s: None)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 25 and rows[-1]["step"] == 24
    for key in ("step", "loss", "lm_loss", "grad_norm", "lr", "tokens_per_s"):
        assert key in rows[0]
    first = sum(h["lm_loss"] for h in history[:3]) / 3
    last = sum(h["lm_loss"] for h in history[-3:]) / 3
    assert last < first - 0.3, (first, last)
    if name == "deepseek-v3-tiny":
        assert "mtp_loss" in rows[0] and "seq_aux_loss" in rows[0]


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
