"""docs/megatron_switches.md covers Megatron-Core's MoE guide, and names only fields that exist.

The flags are every `--name` in megatron/core/transformer/moe/README.md of NVIDIA/Megatron-LM at
commit d98e8a64 (2026-08-22), the guide a Megatron user tunes from.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from moetron.config import ModelConfig, TrainConfig
from moetron.parallel.config import ParallelConfig

TABLE = Path(__file__).resolve().parents[1] / "docs" / "megatron_switches.md"
GUIDE_FLAGS = (
    "--attention-dropout", "--auto-detect-ckpt-format", "--bf16", "--ckpt-format", "--clip-grad",
    "--context-parallel-size", "--cross-entropy-fusion-impl", "--cross-entropy-loss-fusion",
    "--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-scope", "--data-path",
    "--delay-wgrad-compute", "--disable-bias-linear", "--eval-interval", "--eval-iters", "--exp-avg-dtype",
    "--exp-avg-sq-dtype", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--external-cuda-graph", "--fake-init-process-group", "--ffn-hidden-size",
    "--fine-grained-activation-offloading", "--fp8", "--fp8-format", "--fp8-param-gather", "--fp8-recipe",
    "--global-batch-size", "--grad-reduce-in-fp32", "--group-query-attention", "--hidden-dropout",
    "--hidden-size", "--inference-cuda-graph-scope", "--init-method-std", "--load", "--log-interval",
    "--lr", "--lr-decay-iters", "--lr-decay-style", "--lr-warmup-iters", "--manual-gc",
    "--manual-gc-interval", "--master", "--max-position-embeddings", "--micro-batch-size", "--min-lr",
    "--moe-aux-loss-coeff", "--moe-enable-deepep", "--moe-expert-capacity-factor", "--moe-ffn-hidden-size",
    "--moe-flex-dispatcher-backend", "--moe-grouped-gemm", "--moe-input-jitter-eps", "--moe-layer-freq",
    "--moe-layer-recompute", "--moe-pad-expert-input-to-capacity", "--moe-per-layer-logging",
    "--moe-permute-fusion", "--moe-router-bias-update-rate", "--moe-router-dtype",
    "--moe-router-enable-expert-bias", "--moe-router-force-load-balancing", "--moe-router-fusion",
    "--moe-router-group-topk", "--moe-router-load-balancing-type", "--moe-router-num-groups",
    "--moe-router-padding-for-fp8", "--moe-router-pre-softmax", "--moe-router-score-function",
    "--moe-router-topk", "--moe-shared-expert-intermediate-size", "--moe-shared-expert-overlap",
    "--moe-token-dispatcher-type", "--moe-token-drop-policy", "--moe-upcycling-granularity",
    "--moe-use-upcycling", "--moe-z-loss-coeff", "--mtp-num-layers", "--nnodes",
    "--no-masked-softmax-fusion", "--no-position-embedding", "--node", "--normalization", "--nproc",
    "--num-attention-heads", "--num-distributed-optimizer-instances", "--num-experts", "--num-layers",
    "--num-layers-per-virtual-pipeline-stage", "--num-query-groups", "--offload-modules",
    "--optimizer-cpu-offload", "--overlap-grad-reduce", "--overlap-moe-expert-parallel-comm",
    "--overlap-p2p-comm", "--overlap-param-gather", "--pipeline-model-parallel-layout",
    "--pipeline-model-parallel-size", "--position-embedding-type", "--recompute-granularity",
    "--recompute-modules", "--reuse-grad-buf-for-mxfp8-param-ag", "--save", "--save-interval",
    "--seq-length", "--sequence-parallel", "--split", "--swiglu", "--te-rng-track",
    "--tensor-model-parallel-size", "--tensorboard-dir", "--tokenizer-model", "--tokenizer-type",
    "--tp-comm-overlap", "--train-iters", "--untie-embeddings-and-output-weights",
    "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--weight-decay",
)
SECTIONS = {"model": ModelConfig, "train": TrainConfig, "parallel": ParallelConfig}


def _rows() -> list[tuple[str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-"):
            rows.append((cells[0], cells[1]))
    return rows


def test_every_flag_of_megatrons_moe_guide_has_a_row():
    named = " ".join(megatron for megatron, _ in _rows())
    missing = [f for f in GUIDE_FLAGS if not re.search(re.escape(f) + r"(?![a-z0-9-])", named)]
    assert not missing, f"add rows to {TABLE.name} for {missing}"


def test_every_moetron_field_in_the_table_exists():
    fields = {s: {f.name for f in dataclasses.fields(c)} for s, c in SECTIONS.items()}
    named = re.findall(r"`(?:[^`]*?\b)?(model|train|parallel)\.([a-z0-9_]+)", " ".join(m for _, m in _rows()))
    assert len(named) > 40  # the parser found the fields
    unknown = sorted({f"{s}.{f}" for s, f in named if f not in fields[s]})
    assert not unknown, f"{TABLE.name} names fields that do not exist: {unknown}"
