"""A user's first hour (issue 18): start from a Hugging Face checkpoint and export it back with its
config.json unchanged, read the run, refuse what cannot fit, print the resolved config."""

import json
import time

import pytest
import torch

from moetron.cli import main
from moetron.recipes import apply_overrides, get_recipe
from moetron.train.model_source import resolve_model
from moetron.train.preflight import check_layout, estimate_memory

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["--set", "train.steps=2", "--set", "train.seq_len=32", "--set", "train.micro_batch_size=2",
       "--set", "train.warmup_steps=1", "--set", "train.log_every=100"]

# Both families, with routing settings that differ from moetron's defaults and the recipes'.
QWEN = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, max_position_embeddings=256, router_aux_loss_coef=0.001)
DEEPSEEK = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1,
                routed_scaling_factor=2.5, max_position_embeddings=256, n_group=2, topk_group=1,
                first_k_dense_replace=1, q_lora_rank=24)


def _hf_folder(family: str, path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK))
    model.save_pretrained(path)
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hf_round_trip_keeps_the_config(family, tmp_path, capsys):
    """`moetron train --hf DIR` trains the checkpoint's model (not the recipe's), and the export's
    config.json equals the source's, with no --set model.*; a conflicting --set is one line."""
    source = _hf_folder(family, tmp_path / "hf")
    recipe = "qwen3-moe-tiny" if family == "qwen3_moe" else "deepseek-v3-tiny"
    args = ["train", "--recipe", recipe, "--hf", str(tmp_path / "hf"), *RUN,
            "--set", f"train.save_dir={tmp_path / 'ck'}", "--set", f"train.export_hf={tmp_path / 'out'}"]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "exported" in out and "differs" not in out
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported == source
    meta = json.loads((tmp_path / "ck" / "step-00000002" / "meta.json").read_text())
    if family == "qwen3_moe":
        assert meta["model_config"]["norm_topk_prob"] is False and meta["model_config"]["max_position_embeddings"] == 256
        assert meta["model_config"]["aux_loss_coeff"] == 0.001
    else:
        assert (meta["model_config"]["n_group"], meta["model_config"]["topk_group"]) == (2, 1)

    # A setting that changes what the weights mean: one line naming both values.
    bad = "model.norm_topk_prob=true" if family == "qwen3_moe" else "model.n_group=4"
    assert main(["train", "--recipe", recipe, "--hf", str(tmp_path / "hf"), "--set", bad, "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("moetron train: error: --set " + bad), err
    assert ("norm_topk_prob=False" in err) if family == "qwen3_moe" else ("n_group=2" in err and "4" in err)
    # A training-time option may differ; the export lists what training changed on purpose.
    if family == "qwen3_moe":
        from moetron.train.trainer import train  # the API: a recipe whose model is not the checkpoint's

        matched = resolve_model(apply_overrides(get_recipe(recipe), [f"train.init_hf={tmp_path / 'hf'}"]), [])
        with pytest.raises(ValueError, match=r"in what the weights mean: norm_topk_prob: checkpoint False, recipe "
                                             r"True; take the model"):
            train(apply_overrides(matched, ["model.norm_topk_prob=true"]), log=lambda s: None)
        args = [a.replace(str(tmp_path / "ck"), str(tmp_path / "ck2")).replace(str(tmp_path / "out"),
                                                                                str(tmp_path / "out2")) for a in args]
        assert main(args + ["--set", "model.aux_loss_coeff=0.02", "--set", "model.capacity_factor=2.0"]) == 0
        assert "router_aux_loss_coef: 0.001 -> 0.02" in capsys.readouterr().out
        changed = json.loads((tmp_path / "out2" / "config.json").read_text())
        assert changed == {**source, "router_aux_loss_coef": 0.02}


def test_print_config_is_the_resolved_recipe(tmp_path, capsys):
    from moetron.recipes.toml_io import load_recipe

    assert main(["train", "--print-config", "--set", "train.steps=7", "--set", "parallel.ep=2"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "r.toml").write_text(text)
    again = load_recipe(tmp_path / "r.toml")
    assert again.train.steps == 7 and again.parallel.ep == 2 and again.model == get_recipe("qwen3-moe-tiny").model
    assert "[model]" in text and "norm_topk_prob" in text  # full: every field


def test_layout_errors_name_user_fields_in_one_process():
    r = get_recipe("qwen3-moe-tiny")
    with pytest.raises(ValueError, match=r"parallel\.ep=3 does not divide model\.num_experts=8"):
        check_layout(apply_overrides(r, ["parallel.ep=3"]), 1)
    with pytest.raises(ValueError, match=r"parallel\.layout=.*parallel\.pp=1"):
        check_layout(apply_overrides(r, ["parallel.layout=Et*4L"]), 1)
    with pytest.raises(ValueError, match=r"train\.grad_accum=2 .*parallel\.pp=4|train\.grad_accum"):
        check_layout(apply_overrides(r, ["parallel.pp=4", "parallel.schedule=interleaved", "parallel.vpp=2",
                                         "train.grad_accum=2"]), 4)
    with pytest.raises(ValueError, match="one process"):
        check_layout(apply_overrides(r, ["parallel.ep=2"]), 1)
    check_layout(apply_overrides(r, ["parallel.ep=2"]), 2)  # fine on two processes


def test_a_recipe_that_cannot_fit_is_refused_at_once(capsys):
    """qwen3-moe-30b-a3b on this machine: refused before any model is built, with the memory."""
    start = time.perf_counter()
    code = main(["train", "--recipe", "qwen3-moe-30b-a3b", "--set", "parallel.ep=1"])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and seconds < 5, (code, seconds, err)
    assert "needs ~" in err and "GB per rank" in err and "this machine has" in err and "moetron plan" in err
    # The estimate: parameters + gradients + Adam moments (4 + 4 + 8 bytes) of 30.5B parameters.
    experts = 48 * 128 * 3 * 2048 * 768  # layers x experts x (gate, up, down) x hidden x ffn
    parts = estimate_memory(get_recipe("qwen3-moe-30b-a3b"), 8)  # ep=8: experts split, the rest whole
    assert parts["parameters"] / 4 == pytest.approx(30.53e9 - experts + experts / 8, rel=0.01)
    one = estimate_memory(apply_overrides(get_recipe("qwen3-moe-30b-a3b"), ["parallel.ep=1"]), 1)
    assert one["parameters"] == pytest.approx(4 * 30.53e9, rel=0.01)
    assert one["optimizer"] == 2 * one["parameters"] and one["activations"] > 1e9


def test_resolve_model_without_a_checkpoint_is_the_recipe():
    r = resolve_model(get_recipe("qwen3-moe-tiny"), ["model.num_layers=2"])
    assert r.model.num_layers == 2


def test_simulator_picture(tmp_path, capsys, recwarn):
    """`moetron simulate --png`: a picture with rank rows, every kind's colour (blocks and legend),
    no warnings."""
    import struct
    import zlib

    from moetron.pipeline.timeline_png import COLOURS

    png = tmp_path / "t.png"
    assert main(["simulate", "--schedule", "zb1p", "--pp", "4", "--microbatches", "8", "--B", "1", "--W", "1",
                 "--png", str(png)]) == 0
    assert "bubble_fraction=0.1250" in capsys.readouterr().out and not recwarn.list
    data = png.read_bytes()
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 560 and height >= 4 * 24 + 60  # four rank rows, title, axis, legend
    length = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + length])
    pixels = {raw[i:i + 3] for y in range(height) for i in range(y * (1 + 3 * width) + 1, (y + 1) * (1 + 3 * width), 3)}
    assert all(bytes(COLOURS[k]) in pixels for k in ("F", "b", "W"))
