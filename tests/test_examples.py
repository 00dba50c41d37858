"""The example scripts run as a user runs them (subprocesses, tiny sizes) and train.

`train_moe_from_scratch.py` draws its weights at full size from one seed and splits one global
batch over the ranks, so the 2-process expert-parallel run must print the same losses as the
single-process run: a check of the example's explicit gradient reduction, not only that it ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--hidden", "32", "--layers", "1",
        "--experts", "4", "--top-k", "2", "--data-bytes", "65536"]


def run(args: list[str], timeout: float = 240) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def losses(stdout: str) -> list[float]:
    values = [float(v) for v in re.findall(r"^step\s+\d+\s+loss\s+([0-9.]+)", stdout, re.MULTILINE)]
    assert len(values) == 6, stdout
    return values


def assert_trains(values: list[float]) -> None:
    assert values[-1] < values[0] - 0.2, f"loss did not decrease: {values}"


def test_train_from_scratch_single_process_and_expert_parallel():
    script = str(EXAMPLES / "train_moe_from_scratch.py")
    single = run([script, *TINY, "--ffn", "32"])
    assert "1 process(es): experts 0..3 of 4" in single
    assert_trains(losses(single))
    ep = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *TINY, "--ffn", "32"])
    assert "2 process(es): experts 0..1 of 4" in ep
    assert losses(ep) == pytest.approx(losses(single), abs=2e-3)


def test_patch_hf_model(tmp_path):
    pytest.importorskip("transformers")
    out = run([str(EXAMPLES / "patch_hf_model.py"), *TINY, "--save", str(tmp_path / "ckpt")])
    change = float(re.search(r"logits max relative change ([0-9.e+-]+)", out).group(1))
    assert change < 1e-5
    assert_trains(losses(out))
    assert (tmp_path / "ckpt" / "config.json").exists()
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
