"""Fault injection for checkpoints: no checkpoint is ever overwritten or lost, every damage is refused
with a named error, and the last good checkpoint always resumes.

The reference for "the right checkpoint resumed" is the state each step's model was built from
(`_state(seed)`, regenerated independently), compared bit for bit. Kills are real SIGKILLs at each
save phase (`MOETRON_CHECKPOINT_FAULT`), in forked children (one rank) and in a gloo group (two).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch

from dist_utils import forkserver_context, run_distributed
from moetron.checkpoint import slices, training
from moetron.checkpoint.commit import FAULT_ENV, StorageError
from moetron.checkpoint.save_dir import resume_point
from moetron.checkpoint.slices import CheckpointError
from moetron.checkpoint.training import load_checkpoint, save_checkpoint
from moetron.checkpoint.verify import verify_checkpoint
from moetron.cli import main
from moetron.model.model import MoETransformer
from moetron.optim.adamw import AdamW
from moetron.recipes import apply_overrides, get_recipe

RECIPE = apply_overrides(get_recipe("qwen3-moe-tiny"), ["model.num_layers=1"])
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "meta.json")


def _run(seed: int):
    """A model and AdamW (with state) whose every value is drawn from `seed`."""
    torch.manual_seed(seed)
    model = MoETransformer(RECIPE.model)
    opt = AdamW(model.parameters(), lr=1e-3)  # torch's, bit for bit, without its ~2 s torch._dynamo import
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _state(seed: int) -> dict:
    model, opt = _run(seed)
    out = {k: v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out[f"exp_avg.{i}"] = opt.state[p]["exp_avg"].clone()
    return out


def _loaded(folder: Path) -> dict:
    model, opt = _run(12345)  # other values everywhere, overwritten by the load
    load_checkpoint(folder, model, opt, load_rng=False)
    out = {k: v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out[f"exp_avg.{i}"] = opt.state[p]["exp_avg"].clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save(root, step: int, seed: int) -> Path:
    model, opt = _run(seed)
    return save_checkpoint(root, step, model, opt, RECIPE)


def _hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def _resumes(root: Path, step: int, seed: int, logs: list | None = None) -> None:
    """The save_dir resumes checkpoint `step`, which holds exactly the state of `seed`; no debris is left."""
    folder = resume_point(root, resume=True, log=(logs.append if logs is not None else lambda s: None))
    assert folder == root / f"step-{step:08d}", folder
    assert _same(_loaded(folder), _state(seed))
    assert _hidden(root) == [] and (root / "latest").read_text() == folder.name


# ---- kill -9 at every phase of a save -------------------------------------------------------------


def _killed_saves(jobs: list) -> list:
    """Each (root, step, seed, phase) saved in its own fork of this process, which imported everything
    once: returns the signal that ended each fork (or its exit code, negated as multiprocessing does)."""
    torch.set_num_threads(1)
    ends = []
    for root, step, seed, phase in jobs:
        pid = os.fork()
        if pid == 0:
            try:
                os.environ[FAULT_ENV] = phase
                _save(root, step, seed)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)  # not killed: fails the test
        _, status = os.waitpid(pid, 0)
        ends.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    return ends


def _run_killed_saves(jobs: list, results) -> None:
    results.put(_killed_saves(jobs))


def test_a_kill_at_any_save_phase_keeps_the_last_good_checkpoint(tmp_path):
    cases = {"mkdir": (2, 1, 1), "written": (2, 1, 1), "finished": (2, 1, 1), "renamed": (2, 2, 2),
             "latest": (2, 2, 2), "moved-old": (1, 1, 1)}  # phase: (step saved, step resumed, its seed)
    for phase in cases:
        _save(tmp_path / phase, 1, seed=1)
    ctx = forkserver_context()  # one child (one import of moetron) forks a saver per phase
    results = ctx.Queue()
    jobs = [(str(tmp_path / phase), step, 2 if step == 2 else 99, phase) for phase, (step, _, _) in cases.items()]
    child = ctx.Process(target=_run_killed_saves, args=(jobs, results))
    child.start()
    ends = results.get(timeout=120)
    child.join(10)
    for (phase, (step, want_step, want_seed)), end in zip(cases.items(), ends):
        root = tmp_path / phase
        assert end == -9, (phase, end)
        if phase in ("written", "finished", "moved-old"):
            assert _hidden(root), phase  # the crash left debris ...
        logs = []
        _resumes(root, want_step, want_seed, logs)  # ... which the next start cleans (or restores) in one line
        if phase in ("written", "finished", "moved-old"):
            assert len(logs) == 1 and ("removed" in logs[0] or "restored" in logs[0]), logs
        if phase == "moved-old":
            assert "restored step-00000001" in logs[0]


def _two_rank_saves(rank: int, world: int, root: str, phase: str, first: bool) -> None:
    if first:  # the last good checkpoint, saved by both ranks in the same group
        _save(root, 1, seed=1)
    os.environ[FAULT_ENV] = phase
    _save(root, 2, seed=2)


def test_a_rank_killed_while_two_save_keeps_the_last_good_checkpoint(tmp_path):
    root = tmp_path / "two"
    for phase in ("written@1", "finished@0"):
        with pytest.raises(AssertionError, match="rank"):
            run_distributed(_two_rank_saves, 2, str(root), phase, phase == "written@1", timeout=60)
        assert sorted(verify_checkpoint(root / "step-00000001")["files"]["model"]) == [
            "model-00000-000.safetensors", "model-00001-000.safetensors"]
        assert not (root / "step-00000002").exists()
        _resumes(root, 1, 1)  # saved by two ranks, resumed by one


# ---- damaged files, meta.json and latest -------------------------------------------------------------


def _flip(path: Path, at: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    _save(root, 1, seed=1)
    _save(root, 2, seed=2)
    return root


def test_every_damaged_file_is_refused_and_the_intact_one_resumes_when_asked(good, tmp_path, capsys):
    damages = {"truncated": lambda p: p.write_bytes(p.read_bytes()[:-1]),
               "header-bit": lambda p: _flip(p, 20, 3), "middle-bit": lambda p: _flip(p, p.stat().st_size // 2, 5),
               "last-bit": lambda p: _flip(p, -1, 0), "missing": lambda p: p.unlink()}
    for name in FILES:
        for how, damage in damages.items():
            root = tmp_path / f"{name}-{how}"
            shutil.copytree(good, root)
            damage(root / "step-00000002" / name)
            with pytest.raises(CheckpointError) as err:
                resume_point(root, resume=True, log=lambda s: None)
            message = str(err.value)
            assert name in message and "train.resume_from=step-00000001" in message, (name, how, message)
            if how == "middle-bit" and name.endswith(".safetensors"):
                assert "checksum mismatch in tensor(s)" in message, message
            logs = []
            assert resume_point(root, resume=True, resume_from="step-1", log=logs.append) == root / "step-00000001"
            assert [p.name for p in root.glob("superseded-*/*")] == ["step-00000002"]  # moved aside, not lost
            assert _same(_loaded(root / "step-00000001"), _state(1))
    # `moetron checkpoint verify` names the file and tensor of a flipped byte; exit 1.
    root = tmp_path / "verify"
    shutil.copytree(good, root)
    _flip(root / "step-00000002" / "model.safetensors", -5, 2)
    assert main(["checkpoint", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "ok      " in out and "step-00000001" in out
    assert "REFUSED" in out and "model.safetensors: checksum mismatch in tensor(s)" in out
    assert main(["checkpoint", "verify", str(good / "step-00000002")]) == 0


def test_meta_json_bit_flips_and_edits_are_refused_by_name(good, tmp_path):
    folder = tmp_path / "step-00000002"
    original = (good / "step-00000002" / "meta.json").read_bytes()
    rng = torch.Generator().manual_seed(0)
    for at in torch.randint(0, len(original), (40,), generator=rng).tolist():
        shutil.copytree(good / "step-00000002", folder, dirs_exist_ok=True)
        _flip(folder / "meta.json", at, int(torch.randint(0, 8, (1,), generator=rng)))
        with pytest.raises(CheckpointError, match="meta.json"):
            verify_checkpoint(folder)
    meta = json.loads(original)
    edits = {"step": ("step", 7), "shape": ("tensors", {**meta["tensors"], "norm.weight": {"dtype": "F32"}}),
             "files": ("files", {"model": ["../model.safetensors"]})}
    for what, (key, value) in edits.items():
        (folder / "meta.json").write_text(json.dumps({**meta, key: value}))
        with pytest.raises(CheckpointError, match=f"meta.json: .*'{key}"):
            verify_checkpoint(folder)
    # latest: missing, dangling or pointing back: the newest complete checkpoint resumes.
    for how in ("missing", "dangling", "older"):
        root = tmp_path / f"latest-{how}"
        shutil.copytree(good, root)
        if how == "missing":
            (root / "latest").unlink()
        else:
            (root / "latest").write_text("step-00000099" if how == "dangling" else "step-00000001")
        _resumes(root, 2, 2)


# ---- a full disk, NaN state ---------------------------------------------------------------------------


def test_a_full_disk_leaves_nothing_and_says_where(good, tmp_path, monkeypatch):
    root = tmp_path / "full"
    shutil.copytree(good, root)
    real, calls = slices._write_entry, []

    def full(f, e, path, *args):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, e, path, *args)

    monkeypatch.setattr(slices, "_write_entry", full)
    with pytest.raises(StorageError) as err:
        _save(root, 3, seed=3)
    message = str(err.value)
    assert "\n" not in message and err.value.errno == errno.ENOSPC
    for part in ("saving the checkpoint of step 3", str(root), "model.safetensors", "No space left", "free"):
        assert part in message, (part, message)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    monkeypatch.undo()
    _resumes(root, 2, 2)


def test_non_finite_state_is_never_saved_nor_exported(good, tmp_path, monkeypatch):
    from moetron.bridge.convert import hf_to_moetron, moetron_to_hf
    from moetron.bridge.hf import to_hf

    root = tmp_path / "nan"
    shutil.copytree(good, root)
    model, opt = _run(3)
    param_name, param = [(n, q) for n, q in model.named_parameters() if q.dim() == 2][-1]
    opt.state[param]["exp_avg"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=rf"(?s)step 3 .*stays latest.*non-finite .*{param_name} \(optimizer exp_avg\)"):
        save_checkpoint(root, 3, model, opt, RECIPE)
    assert not (root / "step-00000003").exists() and (root / "latest").read_text() == "step-00000002"
    model, opt = _run(3)
    with torch.no_grad():
        param = dict(model.named_parameters())[param_name]
        param[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=rf"(?s)non-finite .*{param_name}"):
        save_checkpoint(root, 3, model, opt, RECIPE)
    # A checkpoint with a NaN weight (as an older moetron could write) is neither loaded nor exported.
    monkeypatch.setattr(training, "_refuse_nonfinite", lambda *a: None)
    poisoned = save_checkpoint(tmp_path / "poisoned", 1, model, opt, RECIPE)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=rf"(?s)non-finite .*{param_name}"):
        _loaded(poisoned)
    with pytest.raises(CheckpointError, match=rf"tensor '{param_name}' holds NaN or inf"):
        moetron_to_hf(poisoned, tmp_path / "hf-out", progress=False)
    assert not (tmp_path / "hf-out").exists()
    # A Hugging Face source with an inf weight converts only when asked.
    hf = to_hf(model, tmp_path / "hf-src")
    with pytest.raises(CheckpointError, match=rf"{param_name}' holds NaN or inf.*--allow-nonfinite"):
        hf_to_moetron(hf, tmp_path / "mt", progress=False)
    assert not (tmp_path / "mt").exists()
    hf_to_moetron(hf, tmp_path / "mt", progress=False, allow_nonfinite=True)
    assert verify_checkpoint(tmp_path / "mt" / "step-00000000")["step"] == 0


# ---- a save_dir is never overwritten silently ----------------------------------------------------------


def test_an_earlier_run_is_refused_resumed_or_moved_aside_never_overwritten(tmp_path):
    from moetron.train.trainer import train

    save, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    base = ["model.num_layers=1", "train.seq_len=16", "train.micro_batch_size=2", "train.warmup_steps=1",
            "train.log_every=100", "train.save_every=1", f"train.save_dir={save}", f"train.metrics_file={metrics}"]

    def run(*extra, logs=None):
        recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), base + list(extra))
        return train(recipe, log=(logs.append if logs is not None else lambda s: None))

    first = run("train.steps=2")
    step2 = (save / "step-00000002" / "model.safetensors").read_bytes()
    (save / "latest").unlink()  # step folders copied to new storage without their marker
    with pytest.raises(FileExistsError, match=rf"{save} holds checkpoints .*train.resume=true.*train.overwrite=true"):
        run("train.steps=3")
    assert (save / "step-00000002" / "model.safetensors").read_bytes() == step2
    # An interrupted step 3 left its row in the metrics file: the resumed run writes it once.
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n" + '{"step": 4, "lo')
    logs = []
    resumed = run("train.steps=3", "train.resume=true", "train.micro_batch_size=4", logs=logs)
    assert [h["step"] for h in resumed] == [2] and (save / "latest").read_text() == "step-00000003"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] == resumed[0]["loss"]
    assert rows[0]["loss"] == first[0]["loss"]
    assert any("global batch changes from 2 sequences" in line and "to 4" in line for line in logs), logs
    # overwrite: the earlier run (and its metrics) are moved aside, intact; the new run starts at step 0.
    fresh = run("train.steps=1", "train.overwrite=true")
    assert [h["step"] for h in fresh] == [0]
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and (old[0] / "step-00000002" / "model.safetensors").read_bytes() == step2
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step-00000001"]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.old-")]) == 1
    with pytest.raises(ValueError, match="choose one"):
        apply_overrides(get_recipe("qwen3-moe-tiny"), base + ["train.overwrite=true", "train.resume=true"])
