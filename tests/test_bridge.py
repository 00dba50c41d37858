"""moetron.bridge: export to the hub layout, exact round trips, strict key accounting, corrupt input,
atomic writes and block-scaled FP8.

Models here are built by moetron itself (with MTP layers, which transformers cannot build) and
every tensor is re-drawn: norm weights around 1, the DeepSeek expert bias non-zero, projections
with std fan_in**-0.5. The external references are transformers' `from_pretrained` (for the
exported layout) and the E4M3 rounding bound derived in `fp8_bound`.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moetron.bridge import CheckpointError, config_from_hf, config_to_hf, from_hf, to_hf
from moetron.checkpoint import safetensors_io
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.precision.blockwise import quantize_blockwise

VOCAB, BATCH, SEQ = 97, 2, 16
INDEX = "model.safetensors.index.json"


def qwen_config(**kw) -> ModelConfig:
    base = dict(family="qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_layers=3, num_attention_heads=4,
                num_kv_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                top_k=2, norm_topk_prob=True, mlp_only_layers=[1])
    return ModelConfig(**{**base, **kw})


def deepseek_config(**kw) -> ModelConfig:
    base = dict(family="deepseek_v3", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=24,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, num_mtp_layers=2,
                max_position_embeddings=64,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0})
    return ModelConfig(**{**base, **kw})


@torch.no_grad()
def randomize_(model: MoETransformer, seed: int) -> MoETransformer:
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("expert_bias"):
            t.copy_(0.3 * noise)
        elif t.dim() == 1:
            t.copy_(1.0 + 0.2 * noise)
        else:
            t.copy_(noise * t.shape[-1] ** -0.5)
    return model


def build(cfg: ModelConfig, seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return randomize_(MoETransformer(cfg), seed).eval()


def ids_and_labels(seed: int = 0):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = torch.cat((ids[:, 1:], torch.full((BATCH, 1), -100)), dim=1)
    return ids, labels


def file_keys(folder: Path) -> dict[str, str]:
    """hub key -> safetensors file name, read from the files themselves."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = f.name
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(message: str, title: str) -> str:
    lines = [line for line in message.splitlines()[1:] if f" {title} key(s):" in line]
    assert len(lines) == 1, f"no single {title!r} line in:\n{message}"
    return lines[0]


# ---- export: transformers loads what to_hf writes ----------------------------------------------------


EXPORTS = {
    "qwen": lambda: build(qwen_config(), 1),
    "qwen-tied-sparse2": lambda: build(qwen_config(tie_word_embeddings=True, mlp_only_layers=[], decoder_sparse_step=2,
                                                   norm_topk_prob=False), 2),
    "deepseek-mtp2-yarn": lambda: build(deepseek_config(), 3),
    "deepseek-noqlora-g1-mtp1": lambda: build(deepseek_config(q_lora_rank=None, n_group=None, topk_group=None,
                                                              rope_interleave=False, rope_scaling=None,
                                                              num_mtp_layers=1), 4),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", list(EXPORTS))
def test_to_hf_loads_in_transformers_with_same_logits(name, sharded, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = EXPORTS[name]()
    cfg = model.config
    to_hf(model, tmp_path / "ckpt", max_shard_bytes=20_000 if sharded else 2 * 1024**3)
    assert (tmp_path / "ckpt" / INDEX).exists() == sharded
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager",
                                                                 output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[cfg.family]
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    mtp_prefixes = tuple(f"model.layers.{cfg.num_layers + k}." for k in range(cfg.num_mtp_layers))
    # transformers ignores the MTP layers and nothing else.
    assert all(mtp_prefixes and k.startswith(mtp_prefixes) for k in info["unexpected_keys"]), info
    assert bool(info["unexpected_keys"]) == bool(mtp_prefixes), info
    # Every weight transformers holds is the moetron weight, bit for bit (nothing re-initialised).
    own = model.state_dict()
    for key, value in hf.state_dict().items():
        if key.endswith("inv_freq"):
            continue
        own_key = key.removeprefix("model.").replace("mlp.gate.weight", "mlp.router.weight").replace(
            "mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            own_key = "embed_tokens.weight"
        assert torch.equal(value, own[own_key]), key
    ids, _ = ids_and_labels(5)
    with torch.no_grad():
        ref, out = hf(ids).logits, model(ids).logits
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-5 and (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), rel


# ---- exact round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded", "fused", "fused-sharded"])
@pytest.mark.parametrize("name", ["qwen", "qwen-tied-sparse2", "deepseek-mtp2-yarn"])
def test_round_trip_is_bit_identical(name, layout, tmp_path):
    model = EXPORTS[name]()
    cfg = model.config
    sharded, fused = "sharded" in layout, "fused" in layout
    folder = to_hf(model, tmp_path / "ckpt", max_shard_bytes=16_000 if sharded else 2 * 1024**3,
                   fused_experts=fused)
    keys = file_keys(folder)
    if sharded:
        index = json.loads((folder / INDEX).read_text())
        assert len(set(keys.values())) >= 3
        assert index["weight_map"] == keys  # every key in the file the index names, and no other
        total = 0
        for f in set(keys.values()):
            with safe_open(str(folder / f), framework="pt") as h:
                total += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys())
        assert index["metadata"]["total_size"] == total
    else:
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    moe_layers = [i for i in range(cfg.num_layers + cfg.num_mtp_layers) if cfg.is_moe_layer(i)]
    per_expert = [k for k in keys if ".mlp.experts." in k and ".mlp.experts.gate_up_proj" not in k
                  and ".mlp.experts.down_proj" not in k]
    if fused:
        assert not per_expert
        assert {k for k in keys if k.endswith("experts.gate_up_proj")} == \
            {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in moe_layers}
    else:
        assert len(per_expert) == 3 * cfg.num_experts * len(moe_layers)

    loaded = from_hf(folder, mtp="require" if cfg.num_mtp_layers else "auto")
    before, after = model.state_dict(), loaded.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    assert any(k.endswith("expert_bias") for k in before) == (cfg.family == "deepseek_v3")


def test_per_expert_hub_keys_hold_the_right_slices(tmp_path):
    """gate rows first in moetron's gate_up_proj; down_proj per expert; the expert bias stays fp32."""
    model = EXPORTS["deepseek-mtp2-yarn"]()
    folder = to_hf(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    tensors = load_file(str(folder / "model.safetensors"))
    I = model.config.moe_intermediate_size
    for layer_name, layer in (("model.layers.1", model.layers[1]), ("model.layers.3", model.mtp[1].layer)):
        experts = layer.mlp.experts
        for e in (0, 5, 7):
            p = f"{layer_name}.mlp.experts.{e}"
            assert torch.equal(tensors[f"{p}.gate_proj.weight"], experts.gate_up_proj[e, :I].bfloat16())
            assert torch.equal(tensors[f"{p}.up_proj.weight"], experts.gate_up_proj[e, I:].bfloat16())
            assert torch.equal(tensors[f"{p}.down_proj.weight"], experts.down_proj[e].bfloat16())
        bias = tensors[f"{layer_name}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, layer.mlp.router.expert_bias)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bf16_round_trip_keeps_the_expert_bias_fp32(tmp_path):
    """from_hf(dtype=bf16): weights in bf16, bit-identical to the bf16 export; the expert bias stays fp32."""
    model = EXPORTS["deepseek-mtp2-yarn"]()
    folder = to_hf(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    loaded = from_hf(folder, dtype=torch.bfloat16, mtp="require").state_dict()
    for k, v in model.state_dict().items():
        if k.endswith("expert_bias"):
            assert loaded[k].dtype == torch.float32 and torch.equal(loaded[k], v), k
        else:
            assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], v.bfloat16()), k


def test_mtp_round_trip_keeps_mtp_loss(tmp_path):
    model = EXPORTS["deepseek-mtp2-yarn"]()
    N = model.config.num_layers
    ids, labels = ids_and_labels(6)
    with torch.no_grad():
        out = model(ids, labels=labels)
    assert out.mtp_loss is not None and torch.isfinite(out.mtp_loss) and out.mtp_loss > 0
    folder = to_hf(model, tmp_path / "ckpt")
    hf_config = json.loads((folder / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 2 and hf_config["num_hidden_layers"] == N
    keys = file_keys(folder)
    for k in range(2):
        layer = f"model.layers.{N + k}"
        for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                       "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                       "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias",
                       "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
            assert f"{layer}.{suffix}" in keys
    loaded = from_hf(folder, mtp="require")
    assert len(loaded.mtp) == 2
    with torch.no_grad():
        again = loaded.eval()(ids, labels=labels)
    assert torch.equal(again.mtp_loss, out.mtp_loss)
    assert torch.equal(again.loss, out.loss) and torch.equal(again.total_loss, out.total_loss)


def test_checkpoint_without_mtp_weights(tmp_path, caplog):
    """As transformers saves DeepSeek-V3: "auto" builds without MTP and warns; "require" lists the keys."""
    model = EXPORTS["deepseek-mtp2-yarn"]()
    folder = to_hf(model, tmp_path / "ckpt")
    N = model.config.num_layers
    tensors = load_file(str(folder / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith((f"model.layers.{N}.", f"model.layers.{N + 1}."))}
    assert len(kept) < len(tensors)
    save_file(kept, str(folder / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        loaded = from_hf(folder)
    assert len(loaded.mtp) == 0 and "MTP" in caplog.text
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    with pytest.raises(CheckpointError) as err:
        from_hf(folder, mtp="require")
    missing = error_line(str(err.value), "missing")
    # every removed MTP key except the two optional copies (embedding, head) per MTP layer
    assert f" {len(tensors) - len(kept) - 2 * 2} missing key(s): model.layers.{N}.enorm.weight" in missing


@pytest.mark.parametrize("cfg", [qwen_config(), qwen_config(tie_word_embeddings=True, decoder_sparse_step=2),
                                 deepseek_config(), deepseek_config(q_lora_rank=None, rope_interleave=False,
                                                                    rope_scaling=None, norm_topk_prob=False)],
                         ids=["qwen", "qwen-tied", "deepseek", "deepseek-plain"])
def test_config_round_trip(cfg):
    back = config_from_hf(json.loads(json.dumps(config_to_hf(cfg))))
    assert back == cfg


# ---- strict key accounting ----------------------------------------------------------------------------


@pytest.fixture
def qwen_ckpt(tmp_path):
    model = EXPORTS["qwen"]()
    folder = to_hf(model, tmp_path / "ckpt")
    return folder, load_file(str(folder / "model.safetensors"))


def rewrite(folder: Path, tensors: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def has_line(message: str, title: str) -> bool:
    return any(f" {title} key(s):" in line for line in message.splitlines()[1:])


def test_missing_key_is_listed(qwen_ckpt):
    folder, tensors = qwen_ckpt
    gone = ["model.layers.0.self_attn.k_norm.weight", "lm_head.weight"]
    rewrite(folder, {k: v for k, v in tensors.items() if k not in gone})
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    msg = str(err.value)
    assert msg.startswith(str(folder))
    line = error_line(msg, "missing")
    assert "2 missing" in line and all(k in line for k in gone)
    assert not has_line(msg, "unexpected") and not has_line(msg, "mis-shaped")


def test_missing_expert_key_is_listed_alone(qwen_ckpt):
    """One absent per-expert key is the only problem: its 15 sibling expert keys are not 'unexpected'."""
    folder, tensors = qwen_ckpt
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite(folder, {k: v for k, v in tensors.items() if k != gone})
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    msg = str(err.value)
    assert "1 missing" in error_line(msg, "missing") and gone in error_line(msg, "missing")
    assert not has_line(msg, "unexpected"), msg


def test_unexpected_key_is_listed(qwen_ckpt):
    folder, tensors = qwen_ckpt
    extra = {"model.layers.0.self_attn.extra.weight": torch.randn(3),
             "model.layers.0.mlp.experts.8.gate_proj.weight": torch.randn(16, 32),  # expert index out of range
             "model.layers.3.input_layernorm.weight": torch.randn(32)}  # a layer the config does not have
    rewrite(folder, {**tensors, **extra})
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    line = error_line(str(err.value), "unexpected")
    assert "3 unexpected" in line and all(k in line for k in extra)
    assert not has_line(str(err.value), "missing") and not has_line(str(err.value), "mis-shaped")


def test_misshaped_key_is_listed(qwen_ckpt):
    folder, tensors = qwen_ckpt
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.randn(32, 40)
    rewrite(folder, tensors)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    line = error_line(str(err.value), "mis-shaped")
    assert "model.layers.0.self_attn.o_proj.weight" in line and "(32, 40)" in line and "(32, 64)" in line


def test_misshaped_single_expert_is_listed(qwen_ckpt):
    """One per-expert tensor of the wrong shape is a mis-shaped key, not a crash while stacking experts."""
    folder, tensors = qwen_ckpt
    tensors["model.layers.2.mlp.experts.3.down_proj.weight"] = torch.randn(32, 17)
    rewrite(folder, tensors)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in error_line(str(err.value), "mis-shaped")


def test_missing_unexpected_and_misshaped_in_one_error(qwen_ckpt):
    folder, tensors = qwen_ckpt
    del tensors["model.norm.weight"]
    tensors["model.layers.1.mlp.bogus.weight"] = torch.randn(4)
    tensors["model.embed_tokens.weight"] = torch.randn(VOCAB + 1, 32)
    rewrite(folder, tensors)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    msg = str(err.value)
    assert "model.norm.weight" in error_line(msg, "missing")
    assert "model.layers.1.mlp.bogus.weight" in error_line(msg, "unexpected")
    assert "model.embed_tokens.weight" in error_line(msg, "mis-shaped")


def test_expert_bias_is_required(tmp_path):
    model = build(deepseek_config(num_mtp_layers=0), 3)
    folder = to_hf(model, tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    rewrite(folder, tensors)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in error_line(str(err.value), "missing")


@pytest.mark.parametrize("copy", ["embed_tokens.weight", "shared_head.head.weight"])
def test_mtp_copy_that_differs_is_an_error(copy, tmp_path):
    model = EXPORTS["deepseek-mtp2-yarn"]()
    folder = to_hf(model, tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    key = f"model.layers.{model.config.num_layers + 1}.{copy}"
    tensors[key] = tensors[key].clone()
    tensors[key][3, 5] += 1e-3
    rewrite(folder, tensors)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert key in str(err.value)


# ---- corrupt input ------------------------------------------------------------------------------------


def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_truncated_file_names_file_and_key(qwen_ckpt):
    folder, _ = qwen_ckpt
    path = folder / "model.safetensors"
    header, data = read_raw(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert str(path) in str(err.value) and repr(last) in str(err.value)


def test_file_shorter_than_its_header_prefix(qwen_ckpt):
    folder, _ = qwen_ckpt
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="truncated") as err:
        from_hf(folder)
    assert str(path) in str(err.value)


def test_header_length_beyond_file(qwen_ckpt):
    folder, _ = qwen_ckpt
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert str(path) in str(err.value)


def test_header_that_lies_about_a_shape(qwen_ckpt):
    folder, _ = qwen_ckpt
    path = folder / "model.safetensors"
    header, data = read_raw(path)
    key = "model.layers.0.self_attn.q_proj.weight"
    header[key]["shape"] = [header[key]["shape"][0], header[key]["shape"][1] + 1]
    write_raw(path, header, data)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert str(path) in str(err.value) and repr(key) in str(err.value)


def test_header_that_lies_about_offsets(qwen_ckpt):
    folder, _ = qwen_ckpt
    path = folder / "model.safetensors"
    header, data = read_raw(path)
    key = "model.norm.weight"
    begin, end = header[key]["data_offsets"]
    header[key]["data_offsets"] = [len(data) + begin, len(data) + end]  # past the end of the data
    write_raw(path, header, data)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert str(path) in str(err.value) and repr(key) in str(err.value)


def test_index_pointing_at_a_missing_shard(tmp_path):
    model = EXPORTS["qwen"]()
    folder = to_hf(model, tmp_path / "ckpt", max_shard_bytes=16_000)
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    msg = str(err.value)
    assert INDEX in msg and shard in msg
    assert any(repr(k) in msg for k, v in weight_map.items() if v == shard)


def test_index_naming_the_wrong_shard_for_a_key(tmp_path):
    model = EXPORTS["qwen"]()
    folder = to_hf(model, tmp_path / "ckpt", max_shard_bytes=16_000)
    index = json.loads((folder / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][key] = shards[1]
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert INDEX in str(err.value) and repr(key) in str(err.value)


def test_invalid_config_json(qwen_ckpt):
    folder, _ = qwen_ckpt
    (folder / "config.json").write_text('{"model_type": "qwen3_moe", ')
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert str(folder / "config.json") in str(err.value)


def test_missing_config_json(qwen_ckpt):
    folder, _ = qwen_ckpt
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        from_hf(folder)


def test_unsupported_model_type(qwen_ckpt):
    folder, _ = qwen_ckpt
    hf = json.loads((folder / "config.json").read_text())
    hf["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError) as err:
        from_hf(folder)
    assert "config.json" in str(err.value) and "llama" in str(err.value)


@pytest.mark.parametrize("field", ["hidden_size", "num_experts_per_tok"])
def test_config_missing_a_required_field(qwen_ckpt, field):
    """A config.json without a required field is bad input: a ValueError naming the file and the field."""
    folder, _ = qwen_ckpt
    hf = json.loads((folder / "config.json").read_text())
    del hf[field]
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError) as err:
        from_hf(folder)
    assert "config.json" in str(err.value) and field in str(err.value)


def test_folder_without_weights(qwen_ckpt):
    folder, _ = qwen_ckpt
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        from_hf(folder)
    assert str(folder) in str(err.value)


# ---- atomic output ------------------------------------------------------------------------------------


def test_existing_folder_is_not_overwritten(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    (dst / "config.json").write_text("{}")
    before = snapshot(dst)
    with pytest.raises(FileExistsError):
        to_hf(EXPORTS["qwen"](), dst)
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_the_whole_folder(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "stale.safetensors").write_text("old")
    model = EXPORTS["qwen"]()
    to_hf(model, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    for k, v in from_hf(dst).state_dict().items():
        assert torch.equal(v, model.state_dict()[k])


def failing_save_file(monkeypatch, fail_on_call: int):
    calls = []
    real = safetensors_io.save_file

    def flaky(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == fail_on_call:
            raise OSError(28, "No space left on device (simulated)")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors_io, "save_file", flaky)
    return calls


def test_failure_midway_leaves_no_output(tmp_path, monkeypatch):
    calls = failing_save_file(monkeypatch, fail_on_call=3)
    with pytest.raises(OSError, match="simulated"):
        to_hf(EXPORTS["qwen"](), tmp_path / "out", max_shard_bytes=16_000)
    assert len(calls) == 3  # two shards were really written before the failure
    assert list(tmp_path.iterdir()) == []  # no output folder, no partial temporary folder


def test_failed_overwrite_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    old = EXPORTS["qwen"]()
    dst = to_hf(old, tmp_path / "out")
    before = snapshot(dst)
    failing_save_file(monkeypatch, fail_on_call=2)
    with pytest.raises(OSError, match="simulated"):
        to_hf(EXPORTS["qwen-tied-sparse2"](), dst, max_shard_bytes=16_000, overwrite=True)
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- FP8 (E4M3, 128x128 block scales) ---------------------------------------------------------------


def fp8_bound(w: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """Largest |w - dequant(quant(w))| allowed, elementwise, for block scale `s` (expanded to w's shape).

    x = w / s lies in [-448, 448] (the block amax maps to E4M3's largest finite value 448, which is
    representable, so nothing saturates). E4M3 has 3 explicit mantissa bits: for normal |x| in
    [2^e, 2^(e+1)), e >= -6, the spacing is 2^(e-3) and round-to-nearest is off by at most half of it,
    2^(e-4) <= 2^-4 |x|. Below the smallest normal 2^-6 the subnormal spacing is 2^-9, so the error is
    at most 2^-10. Hence |w - ŵ| = s |x - q| <= max(2^-4 |w|, 2^-10 s); 1e-6 |w| covers fp32 rounding of
    w / s and q * s.
    """
    return torch.maximum(w.abs() * 2.0**-4, scale_full * 2.0**-10) + 1e-6 * w.abs() + 1e-30


def expand_blocks_ref(scale: torch.Tensor, shape, block: int = 128) -> torch.Tensor:
    out = torch.empty(shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = scale[i, j]
    return out


def fp8_config(**kw) -> ModelConfig:
    """Projection shapes that are not multiples of 128: dense [200,150]/[150,200], experts [136,150]/[150,136]."""
    base = dict(hidden_size=150, num_attention_heads=2, intermediate_size=200, moe_intermediate_size=136,
                num_experts=4, top_k=2, n_group=None, topk_group=None, q_lora_rank=None, rope_scaling=None)
    return deepseek_config(**{**base, **kw})


@torch.no_grad()
def fp8_model(seed: int = 7, num_mtp_layers: int = 0) -> MoETransformer:
    """Magnitudes differ by block (x50 in row block 1, /20 in column block 1), so one scale per block matters."""
    model = build(fp8_config(num_mtp_layers=num_mtp_layers), seed)
    for name, t in model.state_dict().items():
        if t.dim() >= 2 and "embed" not in name and "lm_head" not in name:
            t[..., 128:, :] *= 50.0
            t[..., :, 128:] /= 20.0
    return model


def is_quantized_key(key: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3 releases in FP8: 2-D projections, not the router, norms, embeddings or heads."""
    return t.dim() == 2 and key.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def check_fp8_reload(loaded: MoETransformer, source: MoETransformer, folder: Path, scales: dict) -> None:
    """Each loaded weight within the FP8 bound of its source; unquantized tensors bit-identical."""
    loaded_hub = hub_view(loaded, folder / "reloaded")
    source_hub = hub_view(source, folder / "source")
    checked_big, worst = False, 0.0
    for key, w in source_hub.items():
        got = loaded_hub[key]
        if key in scales:
            s = scales[key]
            assert s.dtype == torch.float32 and tuple(s.shape) == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
            err = (got - w).abs()
            ratio = (err / fp8_bound(w, expand_blocks_ref(s, w.shape))).max().item()
            assert ratio <= 1.0, f"{key}: error {ratio:.3g} x the E4M3 bound"
            worst = max(worst, ratio)
            assert err.max() > 0, f"{key}: not quantized at all"
            checked_big |= w.shape == (200, 150)
        else:
            assert torch.equal(got, w), key
    assert checked_big
    assert worst > 0.5  # the bound is tight: round-to-nearest gets close to half a step somewhere


def hub_view(model: MoETransformer, folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors under hub keys (fp32, per expert), via a plain fp32 export."""
    to_hf(model, folder)
    return load_file(str(folder / "model.safetensors"))


def test_synthetic_fp8_checkpoint_dequantizes_within_e4m3_rounding(tmp_path):
    source = fp8_model()
    src = to_hf(source, tmp_path / "fp32")
    tensors = load_file(str(src / "model.safetensors"))
    quantized, scales = {}, {}
    for key, w in tensors.items():
        if is_quantized_key(key, w):
            q, s = quantize_blockwise(w)
            # The scale is the block amax over E4M3's max, 448 (independent recomputation).
            amax = torch.stack([torch.stack([blk.abs().max() for blk in row.split(128, 1)]) for row in w.split(128, 0)])
            assert torch.allclose(s, amax / 448.0, rtol=1e-6, atol=0)
            quantized[key], quantized[key + "_scale_inv"], scales[key] = q, s, s
        else:
            quantized[key] = w
    assert any(tuple(w.shape) == (200, 150) for k, w in tensors.items() if k in scales)
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(quantized, str(out / "model.safetensors"))
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(hf_config))
    with safe_open(str(out / "model.safetensors"), framework="pt") as h:
        assert h.get_slice("model.layers.0.mlp.gate_proj.weight").get_dtype() == "F8_E4M3"

    loaded = from_hf(out)
    # Dequantization is exactly q * scale per block ...
    exact = hub_view(loaded, tmp_path / "exact")
    for key in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.2.down_proj.weight"):
        ref = quantized[key].float() * expand_blocks_ref(scales[key], quantized[key].shape)
        assert torch.equal(exact[key], ref), key
    # ... and within E4M3 rounding of the source weights.
    check_fp8_reload(loaded, source, tmp_path, scales)


def test_fp8_key_without_scale_is_an_error(tmp_path):
    source = fp8_model()
    src = to_hf(source, tmp_path / "fp32")
    tensors = load_file(str(src / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = quantize_blockwise(tensors[key])[0]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        from_hf(src)
    assert repr(key) in str(err.value) and "model.safetensors" in str(err.value)


def test_fp8_scale_of_wrong_shape_names_the_key(tmp_path):
    source = fp8_model()
    src = to_hf(source, tmp_path / "fp32")
    tensors = load_file(str(src / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    q, s = quantize_blockwise(tensors[key])
    tensors[key], tensors[key + "_scale_inv"] = q, s[:1]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        from_hf(src)
    assert key in str(err.value) and "model.safetensors" in str(err.value)


def test_to_hf_fp8_writes_block_scales_and_reloads_within_rounding(tmp_path):
    source = fp8_model(num_mtp_layers=1)
    folder = to_hf(source, tmp_path / "fp8", fp8=True)
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["fmt"] == "e4m3" and quant["weight_block_size"] == [128, 128]
    scales, n_fp8 = {}, 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as h:
        keys = set(h.keys())
        for key in keys:
            if key.endswith("_scale_inv"):
                continue
            dtype = h.get_slice(key).get_dtype()
            if is_quantized_key(key, h.get_tensor(key)):
                assert dtype == "F8_E4M3", key
                assert key + "_scale_inv" in keys, key
                scales[key] = h.get_tensor(key + "_scale_inv")
                n_fp8 += 1
            else:
                assert dtype == "F32", key  # norms, router, expert bias, embeddings, heads stay fp32
                assert key + "_scale_inv" not in keys, key
    assert n_fp8 >= 30 and "model.layers.0.mlp.gate_proj.weight" in scales
    assert "model.layers.2.eh_proj.weight" in scales  # the MTP projection too
    check_fp8_reload(from_hf(folder, mtp="require"), source, tmp_path, scales)


def test_power_of_two_scales():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 150, generator=g)
    w[128:] *= 37.0
    w[:, 128:] /= 9.0
    q, s = quantize_blockwise(w, power_of_two=True)
    assert s.shape == (2, 2) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # exact powers of two
    amax = torch.stack([torch.stack([blk.abs().max() for blk in row.split(128, 1)]) for row in w.split(128, 0)])
    assert torch.all(s >= amax / 448.0) and torch.all(s < 2 * amax / 448.0)  # the smallest such power
    full = expand_blocks_ref(s, w.shape)
    assert ((q.float() * full - w).abs() <= fp8_bound(w, full)).all()
