"""Recipes as TOML files: the shipped files, `--config`, `recipes --dump`, and errors with file and line."""

from pathlib import Path

import pytest

from moetron.cli import main
from moetron.config import apply_overrides
from moetron.recipes import RECIPES, get_recipe
from moetron.recipes.toml_io import RecipeFileError, dump_recipe, load_recipe
from moetron.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_recipe_is_a_file_in_the_top_level_folder():
    files = sorted(p.stem for p in (ROOT / "recipes").glob("*.toml"))
    assert files == sorted(RECIPES) == sorted(["deepseek-v3-671b", "deepseek-v3-tiny", "qwen3-moe-235b-a22b",
                                                "qwen3-moe-30b-a3b", "qwen3-moe-tiny"])
    ds = get_recipe("deepseek-v3-671b")  # a few values a reader would check against the paper
    assert (ds.model.num_layers, ds.model.num_experts, ds.model.top_k, ds.parallel.pp, ds.parallel.ep) == \
        (61, 256, 8, 16, 64)
    assert ds.model.rope_scaling["factor"] == 40


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("full", [False, True])
def test_dump_then_load_gives_the_same_recipe(name, full, tmp_path):
    recipe = get_recipe(name)
    path = tmp_path / f"{name}.toml"
    path.write_text(dump_recipe(recipe, full=full))
    assert load_recipe(path) == recipe


def test_config_file_trains_exactly_like_the_named_recipe(tmp_path, capsys, one_thread):
    overrides = ["model.num_layers=2", "train.steps=3", "train.seq_len=32", "train.micro_batch_size=2"]
    by_name = train(apply_overrides(get_recipe("qwen3-moe-tiny"), overrides), log=lambda s: None)
    by_file = train(apply_overrides(load_recipe(ROOT / "recipes" / "qwen3-moe-tiny.toml"), overrides),
                    log=lambda s: None)
    assert [h["loss"] for h in by_file] == [h["loss"] for h in by_name]
    assert by_name[0]["loss"] > 4.0  # really trained a byte-level model from scratch
    # The command line: --config FILE plus --set on top.
    args = ["train", "--config", str(ROOT / "recipes" / "qwen3-moe-tiny.toml")] + [
        a for o in overrides for a in ("--set", o)]
    assert main(args) == 0
    assert f"{by_name[0]['loss']:.4f} -> {by_name[-1]['loss']:.4f}" in capsys.readouterr().out


def test_recipes_dump_prints_an_editable_file(tmp_path, capsys):
    assert main(["recipes", "--dump", "deepseek-v3-tiny"]) == 0
    text = capsys.readouterr().out
    assert "[model]" in text and 'family = "deepseek_v3"' in text
    edited = tmp_path / "mine.toml"
    edited.write_text(text.replace("num_layers = 4", "num_layers = 3"))
    assert load_recipe(edited).model.num_layers == 3
    assert main(["recipes", "--dump", "deepseek-v3-tiny", "--full"]) == 0
    assert "# q_lora_rank" not in capsys.readouterr().out  # set in this recipe, so not a comment


@pytest.mark.parametrize("text, expected", [
    ('[model\nfamily = "qwen3_moe"\n', r"bad\.toml: not valid TOML: .*line 1"),
    ('[model]\nfamily = "qwen3_moe"\nvocab_size = "many"\n', r"bad\.toml:3: model\.vocab_size: expected int"),
    ('[model]\nfamily = "qwen3_moe"\n[train]\nstep = 5\n', r"bad\.toml:4: train\.step: TrainConfig has no field 'step'"),
    ('[modle]\nfamily = "qwen3_moe"\n', r"bad\.toml:1: modle: unknown key"),
    ('name = "x"\n', r"bad\.toml: no \[model\] section"),
    ('[model]\nfamily = "qwen3_moe"\nvocab_size = 64\nhidden_size = 32\nnum_layers = 1\n'
     'num_attention_heads = 3\nintermediate_size = 8\nmoe_intermediate_size = 8\nnum_experts = 4\ntop_k = 2\n'
     '[train]\nsteps = 0\n', r"bad\.toml:12: train\.steps: TrainConfig\.steps=0 must be >= 1"),
])
def test_malformed_recipe_files_name_file_key_and_line(tmp_path, capsys, text, expected):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(RecipeFileError, match=expected):
        load_recipe(bad)
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moetron train: error: ") and "bad.toml" in err and len(err.splitlines()) == 1


def test_recipe_and_config_together_is_an_error(capsys):
    assert main(["train", "--recipe", "qwen3-moe-tiny", "--config", "x.toml"]) == 2
    assert "either --recipe NAME or --config FILE.toml" in capsys.readouterr().err
