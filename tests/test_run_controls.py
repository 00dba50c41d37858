"""Run controls of issue 18: Ctrl-C saves and prints the resume command, keep_last prunes,
validation loss on held-out data, greedy samples, Weights & Biases (a fake module: wandb is
optional), and one error line from a misconfigured 4-rank torchrun launch."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moetron import cli
from moetron.data.builtin import stdlib_corpus
from moetron.recipes import apply_overrides, get_recipe
from moetron.train import trainer
from moetron.train.setup import build_run
from moetron.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["model.num_layers=2", "train.seq_len=32", "train.micro_batch_size=2", "train.warmup_steps=1"]


def test_a_signal_saves_the_step_and_prints_the_resume_command(tmp_path):
    """SIGINT during step 4 of 6: step 4 is saved, the run stops with the resume command; with
    save_every=1 and keep_last=2 only steps 3 and 4 remain; resuming runs steps 5 and 6."""
    save = tmp_path / "ck"
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"),
                             SMALL + ["train.steps=6", f"train.save_dir={save}", "train.save_every=1", "train.keep_last=2"])
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("step    4/6"):
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: handled at the step boundary

    history = train(recipe, log=log)
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    stop = next(line for line in lines if line.startswith("stopped by SIGINT"))
    assert "after step 4/6" in stop and "resume with: moetron train" in stop and "train.resume=true" in stop
    assert sorted(p.name for p in save.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert (save / "latest").read_text().strip() == "step-00000004"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    resumed = train(apply_overrides(recipe, ["train.resume=true"]), log=lambda s: None)
    assert [h["step"] for h in resumed] == [4, 5]
    assert sorted(p.name for p in save.glob("step-*")) == ["step-00000005", "step-00000006"]


def _fake_wandb(monkeypatch, calls):
    fake = types.ModuleType("wandb")

    class Run:
        def log(self, data, step=None):
            calls.append(("log", step, dict(data)))

        def finish(self):
            calls.append(("finish",))

    def init(project=None, config=None, resume=None, **kw):
        calls.append(("init", project, config, os.environ.get("WANDB_MODE")))
        return Run()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)


def test_eval_sample_and_wandb_on_builtin_data(tmp_path, monkeypatch):
    runs, calls = [], []
    monkeypatch.setattr(trainer, "build_run", lambda recipe, log: runs.append(build_run(recipe, log)) or runs[-1])
    monkeypatch.setenv("WANDB_MODE", "offline")
    _fake_wandb(monkeypatch, calls)
    metrics = tmp_path / "m.jsonl"
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), SMALL + [
        "train.steps=4", "train.eval_every=2", "train.eval_batches=3", "train.sample_every=4",
        "train.wandb_project=first-hour", f"train.metrics_file={metrics}"])
    lines = []
    history = train(recipe, log=lines.append)
    evals = [line for line in lines if line.startswith("eval")]
    assert [e.split("|")[0].strip() for e in evals] == ["eval    2/4", "eval    4/4"]
    assert "val_loss" in history[1] and "val_loss" in history[3] and "val_loss" not in history[0]
    # The reference: the final model on the corpus's last tokens, as consecutive windows.
    t = recipe.train
    need = t.eval_batches * t.micro_batch_size * t.seq_len + 1
    tail = stdlib_corpus()[-need:]
    model = runs[0].model.eval()
    with torch.no_grad():
        losses = []
        for i in range(t.eval_batches * t.micro_batch_size):
            w = tail[i * t.seq_len: i * t.seq_len + t.seq_len + 1].unsqueeze(0)
            losses.append(float(model(w[:, :-1], labels=w[:, 1:]).loss))
    assert history[3]["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r and "loss" not in r] == [2, 4]  # logged like the loss
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]  # counted as the console counts
    sample = next(line for line in lines if line.startswith("sample 4/4: "))
    assert sample.startswith("sample 4/4: 'import os\\n\\n\\ndef ") and len(sample) > 40
    # wandb: offline mode, the recipe as config, every step's scalars, the eval too, then finish.
    assert calls[0][:2] == ("init", "first-hour") and calls[0][3] == "offline"
    assert calls[0][2]["train"]["eval_every"] == 2
    logged = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logged if "loss" in c[2]] == [1, 2, 3, 4]
    assert logged[0][2]["loss"] == pytest.approx(history[0]["loss"])
    assert [c[1] for c in logged if "val_loss" in c[2]] == [2, 4] and calls[-1] == ("finish",)


def test_missing_wandb_is_one_line(monkeypatch, capsys):
    from moetron.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["train", "--set", "train.steps=1", "--set", "train.wandb_project=x", *sum(
        (["--set", s] for s in SMALL), [])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pip install wandb" in err


def test_eval_and_sample_on_prepared_data(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from moetron.data.packed import PreparedCorpus
    from moetron.data.prepare import prepare

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    rng = random.Random(0)
    words = "the of meaning model expert router token layer loss step".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(300)]
    trainer_ = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"], show_progress=False,
                                              initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer_)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    prepare([tmp_path / "docs.jsonl"], tmp_path / "tokenizer.json", tmp_path / "data", log=lambda s: None)
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), SMALL + [
        f"train.data={tmp_path / 'data'}", "train.steps=2", "train.eval_every=2", "train.eval_batches=2",
        "train.sample_every=2", "model.vocab_size=320"])
    lines = []
    history = train(recipe, log=lines.append)
    assert 0 < history[-1]["val_loss"] < 8
    sample = next(line for line in lines if line.startswith("sample 2/2: "))
    assert sample.startswith("sample 2/2: 'The meaning of")
    from moetron.train.evaluation import build_data

    data, held = build_data(recipe, None, 1)  # the held-out documents are not trained on
    assert data.corpus.num_tokens + held.tokens.numel() == PreparedCorpus(tmp_path / "data").num_tokens
    assert held.tokens.numel() >= 2 * 2 * 32 + 1


def test_four_rank_misconfiguration_is_one_error_line(tmp_path):
    """torchrun, 4 ranks, parallel.ep=3 with 8 experts: one `moetron train: error:` line (rank 0),
    rank 0 exits 2 (torchrun stops the others), no Python traceback from moetron (torchrun adds its
    own failure summary and exits 1)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    torchrun = Path(sys.executable).parent / "torchrun"
    with socket.socket() as s:  # a free port: other test runs may share the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "4", "--master-port", str(port), "-m", "moetron", "train",
                           "--set", "parallel.ep=3"], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert [line for line in out.splitlines() if "moetron train: error" in line] == [
        "moetron train: error: parallel.ep=3 does not divide model.num_experts=8"], out
    assert proc.returncode != 0 and "exitcode  : 2" in out
    assert "moetron/cli.py" not in out and "moetron/train/" not in out  # no traceback from moetron


def test_an_error_only_a_later_rank_meets_is_said_by_that_rank(monkeypatch, capsys):
    """A rank > 0 waits RANK_ERROR_GRACE_S for rank 0 to report a shared error (torchrun stops it
    then); an error of its own (rank 0 never meets it) is then said with its rank."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "RANK_ERROR_GRACE_S", 0.0)
    assert cli.main(["train", "--set", "parallel.ep=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "moetron train: error (rank 1): parallel.ep=3 does not divide model.num_experts=8")
