"""moetron convert: Hugging Face <-> moetron checkpoints, streaming, sharded under any layout, FP8.

References: the source hub files themselves (round trips must give the same bytes), the
single-process bridge (`from_hf` / `to_hf`, tested against transformers in test_bridge.py) for
FP8 dequantization and quantization, the single-process conversion for every layout, and the
single-process training run for a model trained under ep2 x pp2. Models are re-drawn at random
(`test_bridge.build`), never left at their initialisation.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_distributed
from moetron.bridge import CheckpointError, from_hf, to_hf
from moetron.bridge.convert import hf_to_moetron, moetron_to_hf
from moetron.bridge.hub import HFSource
from moetron.cli import main
from moetron.model.model import MoETransformer
from moetron.checkpoint.sharded import StoreReader, read_meta
from test_bridge import EXPORTS, build, deepseek_config, fp8_model, is_quantized_key, qwen_config, randomize_

INDEX = "model.safetensors.index.json"


def hub_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} stored twice"
            out[k] = v
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def store_tensors(save_dir: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a moetron checkpoint, assembled whole (independently of its layout)."""
    folder = save_dir / (save_dir / "latest").read_text().strip()
    reader = StoreReader(folder, read_meta(folder), ("model",))
    try:
        return {n: reader.read(n, (0,) * len(reader.shape(n)), reader.shape(n)) for n in sorted(reader.names())}
    finally:
        reader.close()


def leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.partial")]


# ---- one process: exact round trips ------------------------------------------------------------


@pytest.mark.parametrize("name,layout", [("qwen", "sharded"), ("deepseek-mtp2-yarn", "fused"),
                                         ("qwen-tied-sparse2", "bf16")])
def test_hf_moetron_hf_is_byte_identical(name, layout, tmp_path):
    model = EXPORTS[name]()
    fused = layout == "fused"
    dtype = torch.bfloat16 if layout == "bf16" else None
    src = to_hf(model, tmp_path / "src", max_shard_bytes=16_000, fused_experts=fused, dtype=dtype)
    summary = hf_to_moetron(src, tmp_path / "mt", progress=False, chunk_bytes=4_000)  # big tensors in row-chunks
    assert (tmp_path / "mt" / "latest").read_text() == "step-00000000"
    assert summary["tensors"] > len(model.state_dict())  # some tensors were stored as several chunks
    # The moetron checkpoint holds exactly the model from_hf builds (and the source's dtype).
    stored, ref = store_tensors(tmp_path / "mt"), from_hf(src, dtype=dtype or torch.float32).state_dict()
    assert list(stored) == sorted(ref)
    for k, v in ref.items():
        assert same_bytes(stored[k], v), k
    out = moetron_to_hf(tmp_path / "mt", tmp_path / "out", fused_experts=fused, max_shard_bytes=20_000,
                        progress=False, chunk_bytes=4_000)
    a, b = hub_tensors(src), hub_tensors(tmp_path / "out")
    assert a.keys() == b.keys()
    for k in a:
        assert same_bytes(a[k], b[k]), k
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert set(index["weight_map"]) == set(b) and len(out["files"]) >= 3
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in b.values())
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["torch_dtype"] == ("bfloat16" if dtype else "float32")
    assert hf_config["model_type"] == model.config.family


def test_fp8_source_dequantizes_on_the_fly_and_fp8_export_requantizes(tmp_path):
    source = fp8_model(num_mtp_layers=1)
    plain = to_hf(source, tmp_path / "fp32")
    quantized = {}
    for key, w in load_file(str(plain / "model.safetensors")).items():
        if is_quantized_key(key, w):
            from moetron.precision.blockwise import quantize_blockwise
            quantized[key], quantized[key + "_scale_inv"] = quantize_blockwise(w)
        else:
            quantized[key] = w
    (tmp_path / "fp8").mkdir()
    save_file(quantized, str(tmp_path / "fp8" / "model.safetensors"))
    hf_config = json.loads((plain / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(hf_config))
    # Import: each region dequantized block by block equals from_hf's whole-tensor dequantization.
    summary = hf_to_moetron(tmp_path / "fp8", tmp_path / "mt", dtype="fp32", progress=False, chunk_bytes=30_000)
    assert summary["dequantized"] == sum(k.endswith("_scale_inv") for k in quantized) >= 30
    stored, ref = store_tensors(tmp_path / "mt"), from_hf(tmp_path / "fp8").state_dict()
    for k, v in ref.items():
        assert same_bytes(stored[k], v), k
    # keep: FP8 weights become bf16, the rest keeps its dtype.
    hf_to_moetron(tmp_path / "fp8", tmp_path / "mt16", progress=False)
    kept = store_tensors(tmp_path / "mt16")
    assert kept["layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(kept["layers.0.mlp.gate_proj.weight"], ref["layers.0.mlp.gate_proj.weight"].bfloat16())
    assert kept["embed_tokens.weight"].dtype == torch.float32
    # Export fp8 (in 128-row chunks): the same E4M3 bytes and scales as the one-process to_hf.
    hf_to_moetron(plain, tmp_path / "mt32", progress=False)
    moetron_to_hf(tmp_path / "mt32", tmp_path / "out8", dtype="fp8", progress=False, chunk_bytes=30_000)
    to_hf(from_hf(plain), tmp_path / "ref8", fp8=True)
    got, want = hub_tensors(tmp_path / "out8"), hub_tensors(tmp_path / "ref8")
    assert got.keys() == want.keys()
    n_fp8 = 0
    for k, w in want.items():
        if w.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv"):
            assert same_bytes(got[k], w), k
            n_fp8 += w.dtype == torch.float8_e4m3fn
        elif k.endswith("e_score_correction_bias"):
            assert same_bytes(got[k], w), k
        else:
            assert same_bytes(got[k], w.bfloat16()), k
    assert n_fp8 >= 30 and got["model.layers.0.mlp.gate_proj.weight"].shape == (200, 150)
    cfg = json.loads((tmp_path / "out8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["torch_dtype"] == "bfloat16"


# ---- corrupt input: clear errors, no output ----------------------------------------------------------


def _read_raw(path: Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _shards(folder):
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def _truncate(folder):
    path = folder / _shards(folder)[1]
    header, _ = _read_raw(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-64])
    return path.name, last


def _lie_about_shape(folder):
    path = folder / _shards(folder)[0]
    header, data = _read_raw(path)
    key = next(k for k in header if k.endswith("proj.weight"))
    header[key]["shape"][1] += 1
    _write_raw(path, header, data)
    return path.name, key


def _wrong_dtype(folder):
    index = json.loads((folder / INDEX).read_text())["weight_map"]
    key = "model.layers.0.self_attn.k_norm.weight"
    path = folder / index[key]
    tensors = load_file(str(path))
    tensors[key] = (tensors[key] * 1000).to(torch.int32)
    save_file(tensors, str(path))
    return path.name, key


def _missing_shard(folder):
    index = json.loads((folder / INDEX).read_text())["weight_map"]
    shard = _shards(folder)[-1]
    (folder / shard).unlink()
    return INDEX, next(k for k, v in index.items() if v == shard)


@pytest.mark.parametrize("corrupt", [_truncate, _lie_about_shape, _wrong_dtype, _missing_shard],
                         ids=["truncated", "header-lies", "dtype", "missing-shard"])
def test_corrupt_source_names_file_and_key_and_leaves_no_output(corrupt, tmp_path):
    src = to_hf(EXPORTS["qwen"](), tmp_path / "src", max_shard_bytes=60_000)
    assert len(list(src.glob("*.safetensors"))) >= 3
    file_name, key = corrupt(src)
    with pytest.raises(CheckpointError) as err:
        hf_to_moetron(src, tmp_path / "dst", progress=False)
    assert file_name in str(err.value) and repr(key) in str(err.value), str(err.value)
    assert leftovers(tmp_path, "dst") == []
    with pytest.raises(CheckpointError):  # and the trainer's direct path (init_hf) refuses it too
        HFSource(src)


def test_missing_and_unexpected_keys_in_one_error_and_cli(tmp_path, capsys):
    model = EXPORTS["qwen"]()
    src = to_hf(model, tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    tensors.pop(gone)
    tensors["model.layers.0.extra.weight"] = torch.randn(3)
    save_file(tensors, str(src / "model.safetensors"))
    assert main(["convert", "hf-to-moetron", str(src), str(tmp_path / "dst"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "1 missing key(s): " + gone in err and "1 unexpected key(s): model.layers.0.extra.weight" in err
    assert leftovers(tmp_path, "dst") == []
    # A good source through the command line, under a validated layout, with the progress bar.
    good = to_hf(model, tmp_path / "good")
    assert main(["convert", "hf-to-moetron", str(good), str(tmp_path / "mt"), "--ep", "2", "--pp", "2"]) == 0
    out, err = capsys.readouterr()
    assert "hf-to-moetron:" in out and "tensors/s" in err and " GB " in err
    assert main(["convert", "hf-to-moetron", str(good), str(tmp_path / "mt")]) == 2  # exists
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "hf-to-moetron", str(good), str(tmp_path / "x"), "--ep", "3"]) == 2
    assert "ep=3 does not divide num_experts=8" in capsys.readouterr().err
    assert main(["convert", "moetron-to-hf", str(tmp_path / "mt"), str(tmp_path / "hf"), "--quiet",
                 "--dtype", "bf16"]) == 0
    assert "moetron-to-hf:" in capsys.readouterr().out
    back = hub_tensors(tmp_path / "hf")
    for k, v in hub_tensors(good).items():
        assert same_bytes(back[k], v.bfloat16()), k


def test_train_starts_from_a_converted_checkpoint_or_the_hf_folder_alike(tmp_path):
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    recipe = apply_overrides(get_recipe("deepseek-v3-tiny"), TRAIN[:-1] + ["train.steps=1"])
    torch.manual_seed(3)
    to_hf(randomize_(MoETransformer(recipe.model), 3), tmp_path / "hf")
    assert main(["convert", "hf-to-moetron", str(tmp_path / "hf"), str(tmp_path / "mt"), "--quiet"]) == 0
    resumed = train(apply_overrides(recipe, [f"train.save_dir={tmp_path / 'mt'}", "train.resume=true"]),
                    log=lambda s: None)
    direct = train(apply_overrides(recipe, [f"train.init_hf={tmp_path / 'hf'}"]), log=lambda s: None)
    fresh = train(recipe, log=lambda s: None)
    assert [h["step"] for h in resumed] == [0]  # a converted checkpoint is step 0: fine-tuning starts
    assert resumed[0]["loss"] == direct[0]["loss"] and resumed[0]["grad_norm"] == direct[0]["grad_norm"]
    assert not math.isclose(resumed[0]["loss"], fresh[0]["loss"], rel_tol=1e-3)  # the weights were used


def test_failure_while_writing_leaves_no_output(tmp_path, monkeypatch):
    src = to_hf(EXPORTS["deepseek-mtp2-yarn"](), tmp_path / "src")
    hf_to_moetron(src, tmp_path / "mt", progress=False)
    import moetron.bridge.convert as convert

    real, calls = convert.write_safetensors, []

    def failing(path, entries, *args, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(path, entries, *args, **kw)

    monkeypatch.setattr(convert, "write_safetensors", failing)
    with pytest.raises(OSError, match="simulated"):
        moetron_to_hf(tmp_path / "mt", tmp_path / "out", max_shard_bytes=30_000, progress=False)
    assert len(calls) == 2 and leftovers(tmp_path, "out") == []


# ---- under torchrun: every layout converts to the same checkpoint ---------------------------------------


LAYOUTS = {"ep2pp2": dict(ep=2, pp=2), "ep2": dict(ep=2), "pp2": dict(pp=2), "ep4": dict(ep=4),
           "etp2ep2": dict(ep=2, etp=2), "tp2": dict(tp=2)}
TRAIN = ["model.num_layers=3", "train.seq_len=32", "train.micro_batch_size=2", "train.warmup_steps=1",
         "train.log_every=100", "train.steps=3"]


def _convert_and_train(rank, world, root):
    from moetron.parallel.config import ParallelConfig
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    root = Path(root)
    for name in ("qwen", "deepseek"):
        for tag, layout in LAYOUTS.items():
            hf_to_moetron(root / f"{name}-hf", root / f"{name}-{tag}", parallel=ParallelConfig(**layout),
                          progress=False, file_bytes=20_000)
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), TRAIN + [
        "parallel.ep=2", "parallel.pp=2", "train.grad_accum=2", f"train.init_hf={root / 'recipe-hf'}",
        f"train.save_dir={root / 'trained-ep2pp2'}"])
    return [(h["loss"], h["grad_norm"]) for h in train(recipe, log=lambda s: None)]


def test_layouts_convert_like_one_process_and_training_exports_like_one_process(tmp_path):
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    sources = {"qwen": build(qwen_config(vocab_size=96), 11),
               "deepseek": build(deepseek_config(vocab_size=96, num_mtp_layers=1), 12)}
    for name, model in sources.items():
        to_hf(model, tmp_path / f"{name}-hf", max_shard_bytes=30_000)
        hf_to_moetron(tmp_path / f"{name}-hf", tmp_path / f"{name}-one", progress=False)
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), TRAIN)
    torch.manual_seed(5)
    to_hf(randomize_(MoETransformer(recipe.model), 5), tmp_path / "recipe-hf")

    losses = run_distributed(_convert_and_train, 4, str(tmp_path), timeout=300)

    for name in sources:
        want = store_tensors(tmp_path / f"{name}-one")
        for tag in LAYOUTS:
            folder = tmp_path / f"{name}-{tag}"
            step = folder / "step-00000000"
            writers = {p.name.split("-")[1] for p in step.glob("model-*.safetensors")}
            assert writers == {"00000", "00001", "00002", "00003"}, (tag, writers)  # every rank wrote its part
            got = store_tensors(folder)
            assert got.keys() == want.keys(), tag
            for k in want:
                assert same_bytes(got[k], want[k]), (name, tag, k)
            assert read_meta(step)["layout"]["world_size"] == 4
        moetron_to_hf(tmp_path / f"{name}-ep2pp2", tmp_path / f"{name}-back", progress=False)
        a, b = hub_tensors(tmp_path / f"{name}-hf"), hub_tensors(tmp_path / f"{name}-back")
        assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a), name

    # The same 3 steps in one process (ep2 x pp2 in world 4 has dp=2: 2 x 2 micro-batches per step).
    one = train(apply_overrides(recipe, ["train.grad_accum=4", f"train.init_hf={tmp_path / 'recipe-hf'}",
                                         f"train.save_dir={tmp_path / 'trained-one'}"]), log=lambda s: None)
    for rank_losses in losses:
        for (loss, gnorm), h in zip(rank_losses, one):
            assert math.isclose(loss, h["loss"], rel_tol=1e-5) and math.isclose(gnorm, h["grad_norm"], rel_tol=1e-4)
    moetron_to_hf(tmp_path / "trained-ep2pp2", tmp_path / "trained-ep2pp2-hf", progress=False)
    moetron_to_hf(tmp_path / "trained-one", tmp_path / "trained-one-hf", progress=False)
    a, b = hub_tensors(tmp_path / "trained-ep2pp2-hf"), hub_tensors(tmp_path / "trained-one-hf")
    start = hub_tensors(tmp_path / "recipe-hf")
    assert a.keys() == b.keys() == start.keys()
    for k in a:
        # Equal up to summation order, measured against what training changed. (Adam turns the
        # rounding of a gradient near its eps into a visible difference in a few elements - one
        # element of a rare token's embedding row can outweigh the rest of the table - so the bound is
        # on the norm of all but the 4 largest differences, with a loose element-wise cap on those.)
        update, diff = b[k] - start[k], a[k] - b[k]
        assert update.norm() > 0, k  # trained, not stale or re-initialised
        rest = diff.abs().flatten().sort().values[:-4]
        assert rest.norm() <= 1e-3 * update.norm() and diff.abs().max() <= 0.1 * update.abs().max(), \
            (k, float(rest.norm() / update.norm()), float(diff.abs().max() / update.abs().max()))


def test_training_starts_from_and_exports_to_hf(tmp_path):
    """`--set init.hf=PATH` starts from a hub folder; `train.export_hf` writes the result as one."""
    transformers = pytest.importorskip("transformers")
    from moetron.bridge import from_hf, to_hf
    from moetron.model.model import MoETransformer
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    base = ["model.num_layers=2", "train.seq_len=16", "train.micro_batch_size=2", "train.warmup_steps=1"]
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), base)
    torch.manual_seed(7)
    start = MoETransformer(recipe.model)
    to_hf(start, tmp_path / "hf_in")
    recipe = apply_overrides(recipe, ["init.hf=" + str(tmp_path / "hf_in"), "train.steps=2",
                                      f"train.save_dir={tmp_path / 'ckpt'}", f"export.hf={tmp_path / 'hf_out'}"])
    train(recipe, log=lambda s: None)
    trained = from_hf(tmp_path / "hf_out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out")
    ids = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(trained(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
    moved = [n for n, p in trained.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
    assert moved  # the export holds the trained weights, not the starting ones
    with pytest.raises(ValueError, match="export_hf needs train.save_dir"):
        apply_overrides(get_recipe("qwen3-moe-tiny"), ["export.hf=/tmp/x"])
