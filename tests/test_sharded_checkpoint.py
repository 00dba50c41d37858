"""Sharded training checkpoints: saved under one layout, resumed under the same or another.

The reference for a resumed run is the uninterrupted run (bit-identical under the same layout;
under another layout the losses agree to summation order, as the layouts themselves do), and
for the store's geometry a brute-force enumeration of elements.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_distributed
from moetron.bridge import CheckpointError
from moetron.checkpoint.slices import SafetensorsFile, flat_range_boxes, numel, view_box
from moetron.model.model import MoETransformer
from moetron.recipes import apply_overrides, get_recipe
from moetron.checkpoint.training import load_checkpoint
from moetron.train.setup import build_optimizer
from moetron.checkpoint.sharded import Placement, StoreReader, read_meta
from moetron.train.trainer import train

BASE = ["model.num_layers=2", "train.seq_len=32", "train.micro_batch_size=2", "train.warmup_steps=1",
        "train.log_every=100", "train.steps=4"]


def recipe(*extra):
    return apply_overrides(get_recipe("deepseek-v3-tiny"), BASE + list(extra))


def losses(history):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in history]


# ---- geometry ------------------------------------------------------------------------------------


def test_flat_ranges_boxes_and_placements_cover_exactly_the_right_elements(tmp_path):
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        lo = rng.randint(0, numel(shape))
        hi = rng.randint(lo, numel(shape))
        t = torch.arange(numel(shape)).view(shape)
        pos = lo
        boxes = flat_range_boxes(shape, lo, hi)
        assert len(boxes) <= 2 * len(shape) - 1
        for start, (offs, sizes) in boxes:
            got = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
            assert start == pos and torch.equal(got, torch.arange(pos, pos + numel(sizes)))
            pos += numel(sizes)
        assert pos == hi
    # The ETP shard of gate_up [E=4, 2F=8, H=3] on EP rank 1, ETP rank 1 of 2: gate rows 2..3 and
    # up rows 6..7 of experts 2..3; element (e, r, h) of the local tensor lands where it belongs.
    full = torch.arange(4 * 8 * 3).view(4, 8, 3)
    local = torch.cat([full[2:4, 2:4], full[2:4, 6:8]], dim=1)
    p = Placement((4, 8, 3), (((0, 0, 0), (2, 2, 0), (2, 2, 3)), ((0, 2, 0), (2, 6, 0), (2, 2, 3))))
    for (lo, go, sizes) in p.pieces:
        sl = lambda o: tuple(slice(a, a + s) for a, s in zip(o, sizes))  # noqa: E731
        assert torch.equal(local[sl(lo)], full[sl(go)])
    hits = p.to_global(((1, 1, 0), (1, 2, 3)))  # local rows 1..2 of expert 1 straddle gate and up
    assert [(g[0], g[1]) for _, g in hits] == [((3, 3, 0), (1, 1, 3)), ((3, 6, 0), (1, 1, 3))]
    base = torch.empty(4, 8, 3, device="meta")
    assert view_box(base, base[2].chunk(2)[1]) == ((2, 4, 0), (1, 4, 3))
    assert view_box(base, base.transpose(1, 2)) is None
    # Positional reads of arbitrary boxes equal slicing the tensor (fp32, bf16 and fp8 files).
    tensors = {"a": torch.randn(7, 9, 5), "b": torch.randn(100, 3).bfloat16(),
               "c": torch.randn(3, 300).to(torch.float8_e4m3fn)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    f = SafetensorsFile(tmp_path / "t.safetensors")
    for _ in range(200):
        key = rng.choice(list(tensors))
        t = tensors[key]
        offs = [rng.randint(0, d - 1) for d in t.shape]
        sizes = [rng.randint(1, d - o) for d, o in zip(t.shape, offs)]
        want = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        got = f.read(key, offs, sizes)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    f.close()


# ---- layouts: save under ep2, resume under ep2 / pp2 / tp2 / one process -------------------------


def _failing_writes(*args, **kwargs):
    raise OSError("disk full (simulated on rank 1)")


def _save_and_resume(rank, world, root):
    import torch.distributed as dist

    import moetron.checkpoint.training as checkpoint

    root = Path(root)
    run = lambda *extra: losses(train(recipe(*extra), log=lambda s: None))  # noqa: E731
    out = {"straight": run("parallel.ep=2", "train.grad_accum=2")}
    out["first"] = run("parallel.ep=2", "train.grad_accum=2", "train.steps=2", f"train.save_dir={root / 'ep2'}")
    dist.barrier()
    if rank == 0:
        for name in ("pp2", "tp2", "one", "fail"):
            shutil.copytree(root / "ep2", root / name)
    dist.barrier()
    resume = ["train.resume=true", "train.grad_accum=4"]
    out["ep2"] = run("parallel.ep=2", "train.grad_accum=2", "train.resume=true", f"train.save_dir={root / 'ep2'}")
    out["pp2"] = run("parallel.pp=2", *resume, f"train.save_dir={root / 'pp2'}")
    out["tp2"] = run("parallel.tp=2", *resume, f"train.save_dir={root / 'tp2'}")
    out["from_one"] = run("parallel.ep=2", "train.grad_accum=2", "train.resume=true",
                          f"train.save_dir={root / 'saved-by-one'}")
    # A rank that fails while writing: every rank raises, nothing looks complete.
    if rank == 1:
        checkpoint.write_local_boxes = _failing_writes
    try:
        run("parallel.ep=2", "train.grad_accum=2", "train.resume=true", "train.steps=3",
            f"train.save_dir={root / 'fail'}")
        out["failed"] = None
    except Exception as exc:  # noqa: BLE001 - the message is checked by the test
        out["failed"] = f"{type(exc).__name__}: {exc}"
    return out


def test_resume_under_the_same_and_other_layouts(tmp_path):
    # A checkpoint written by one process, for the ep2 run to resume from.
    train(recipe("train.grad_accum=4", "train.steps=2", f"train.save_dir={tmp_path / 'saved-by-one'}"),
          log=lambda s: None)
    out = run_distributed(_save_and_resume, 2, str(tmp_path), init=False, timeout=300)
    for rank, o in enumerate(out):
        straight = o["straight"]
        assert o["first"] == straight[:2]
        assert o["ep2"] == straight[2:], f"rank {rank}: ep2 resume is not bit-identical"
        for layout in ("pp2", "tp2", "from_one"):
            got = o[layout]
            assert [s for s, _, _ in got] == [2, 3], layout
            for (_, loss, gnorm), (_, want, want_g), tol in zip(got, straight[2:], (1e-6, 1e-5)):
                assert math.isclose(loss, want, rel_tol=tol), (layout, loss, want)
                assert math.isclose(gnorm, want_g, rel_tol=1e-4), (layout, gnorm, want_g)
        assert "simulated on rank 1" in o["failed"]
    assert "writing failed on another rank" in out[0]["failed"]
    fail = tmp_path / "fail"
    assert (fail / "latest").read_text() == "step-00000002"
    assert sorted(p.name for p in fail.iterdir()) == ["latest", "step-00000002"]  # no step 3, no partial

    # One process resumes the ep2 checkpoint.
    one = losses(train(recipe("train.grad_accum=4", "train.resume=true", f"train.save_dir={tmp_path / 'one'}"),
                       log=lambda s: None))
    for (_, loss, _), (_, want, _), tol in zip(one, out[0]["straight"][2:], (1e-6, 1e-5)):
        assert math.isclose(loss, want, rel_tol=tol)

    # What ep2 wrote: each rank its own files, every region once, moments without fp32 masters.
    folder = tmp_path / "ep2" / "step-00000004"
    meta = read_meta(folder)
    assert meta["step"] == 4 and meta["layout"]["ep"] == 2 and meta["layout"]["world_size"] == 2
    assert sorted(meta["files"]["model"]) == ["model-00000-000.safetensors", "model-00001-000.safetensors"]
    reader = StoreReader(folder, meta)
    name = "layers.1.mlp.experts.gate_up_proj"
    assert reader.slots(name) == ["exp_avg", "exp_avg_sq"]
    keys = [k for f in reader.files for k in f.keys() if k.startswith(name + "@") or k == name]
    assert sorted(keys) == [f"{name}@0,0,0", f"{name}@4,0,0"]  # experts 0-3 by rank 0, 4-7 by rank 1
    reader.close()
    _check_corruptions(tmp_path)


def _check_corruptions(tmp_path: Path) -> None:
    """Damaged or mismatched checkpoints are refused with the file, key or tensor named."""
    r = recipe()
    model = MoETransformer(r.model)
    opt = build_optimizer(model, r)
    src = tmp_path / "ep2" / "step-00000004"

    def damaged(name: str) -> Path:
        folder = tmp_path / f"damaged-{name}"
        shutil.copytree(src, folder)
        return folder

    # The checksums in meta.json refuse every damage first; without them (verify=False, or a
    # checkpoint of an older moetron) the structural checks still name the file and key.
    folder = damaged("truncated")
    path = folder / "optimizer-00001-000.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="optimizer-00001-000.safetensors: .* bytes, .* were written"):
        load_checkpoint(folder, model, opt)
    with pytest.raises(CheckpointError, match="optimizer-00001-000.safetensors.*key"):
        load_checkpoint(folder, model, opt, verify=False)
    folder = damaged("missing")
    (folder / "model-00000-000.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00000-000.safetensors: missing"):
        load_checkpoint(folder, model, opt)
    with pytest.raises(FileNotFoundError, match="model-00000-000.safetensors is missing"):
        load_checkpoint(folder, model, opt, verify=False)
    folder = damaged("dropped-key")
    path = folder / "model-00001-000.safetensors"
    tensors = load_file(str(path))
    tensors.pop("layers.1.mlp.experts.down_proj@4,0,0")
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="model-00001-000.safetensors: .* bytes"):
        load_checkpoint(folder, model, opt)
    with pytest.raises(CheckpointError, match="layers.1.mlp.experts.down_proj.*incomplete or corrupt"):
        load_checkpoint(folder, model, opt, verify=False)
    other = MoETransformer(apply_overrides(r, ["model.num_layers=1", "model.num_experts=4"]).model)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(src, other)
    assert "unexpected tensor(s): layers.1." in str(err.value)
    assert " mis-shaped tensor(s): " in str(err.value)
    assert "mtp.0.layer.mlp.experts.down_proj: checkpoint [8, 64, 32], model [4, 64, 32]" in str(err.value)


def test_fp8_amax_histories_are_restored_under_the_same_layout(tmp_path):
    from moetron.precision import apply_fp8, get_fp8_recipe
    from moetron.precision.fp8_modules import fp8_state_dict
    from moetron.checkpoint.training import save_checkpoint

    r = apply_overrides(get_recipe("qwen3-moe-tiny"), ["model.num_layers=2"])

    def fp8_model(seed):
        torch.manual_seed(seed)
        model = MoETransformer(r.model)
        apply_fp8(model, get_fp8_recipe("delayed", backend="emulate"))
        return model

    model = fp8_model(0)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).total_loss.backward()  # records amax
    saved = fp8_state_dict(model)
    assert saved and any(v.abs().sum() > 0 for v in saved.values())
    folder = save_checkpoint(tmp_path, 1, model, build_optimizer(model, r), r)
    assert (folder / "fp8.safetensors").exists()
    other = fp8_model(1)
    load_checkpoint(folder, other, build_optimizer(other, r))
    restored = fp8_state_dict(other)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
