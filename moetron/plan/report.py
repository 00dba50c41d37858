"""The planner's output: a table of the best layouts with memory and step-time breakdowns, or JSON."""

from __future__ import annotations

import json

from moetron.plan.memory import GiB
from moetron.plan.search import Evaluation, PlanInputs

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "fp8 weights", "buffers", "imbalance")
TIME_PARTS = ("compute", "recompute", "tp comm", "cp comm", "ep comm", "ep hidden", "pp bubble+p2p", "dp comm",
              "optimizer")


def header(inputs: PlanInputs, name: str) -> str:
    g = inputs.gpu
    return (f"moetron plan: {name} on {inputs.gpus} x {g.name} ({g.memory_gib:g} GiB, {g.bf16_tflops:g} BF16 "
            f"TFLOPS, NVLink {g.nvlink_gbps:g} GB/s, NIC {g.scaleout_gbps:g} GB/s, {inputs.per_node} GPUs per "
            f"NVLink domain), seq {inputs.seq}, global batch {inputs.global_batch} sequences, {inputs.dtype}"
            + (f", fp8 {inputs.fp8}" if inputs.fp8 else ""))


def table(evals: list[Evaluation]) -> str:
    w = max([9] + [len(e.cand.recompute_label) for e in evals])
    head = (f"{'#':>2} {'tp':>2} {'cp':>2} {'ep':>3} {'etp':>3} {'pp':>3} {'vpp':>3} {'schedule':<11} {'mbs':>3} "
            f"{'m':>4} {'recompute':<{w}} {'zero':>4} {'cp comm':<9} {'GiB':>6} {'step s':>7} {'tok/s/GPU':>9} "
            f"{'TFLOPS':>6} {'MFU':>5}")
    rows = [head]
    for n, e in enumerate(evals, 1):
        c = e.cand
        vpp = c.chunks if c.schedule in ("interleaved", "dualpipev") and c.pp > 1 else 1
        rows.append(f"{n:>2} {c.tp:>2} {c.cp:>2} {c.ep:>3} {c.etp:>3} {c.pp:>3} {vpp:>3} {c.schedule:<11} "
                    f"{c.mbs:>3} {e.microbatches:>4} {c.recompute_label:<{w}} {c.zero_stage:>4} "
                    f"{c.cp_comm_type if c.cp > 1 else '-':<9} {e.memory_total / GiB:>6.1f} "
                    f"{e.step_s:>7.2f} {e.tokens_per_s_gpu:>9.0f} {e.tflops:>6.0f} {e.mfu:>5.1%}")
    return "\n".join(rows)


def explain(e: Evaluation, capacity: float) -> str:
    """One layout in full: its pipeline layout string, memory per part, step time per part."""
    lines = [f"layout: {e.cand.describe()}  (dp derived; {e.microbatches} micro-batches per step)",
             f"pipeline layout: {e.layout}", "memory on the fullest GPU:"]
    for k in MEMORY_PARTS:
        lines.append(f"  {k:<14} {e.memory[k] / GiB:8.2f} GiB")
    fits = "fits" if e.memory_total <= capacity else "DOES NOT FIT"
    lines.append(f"  {'total':<14} {e.memory_total / GiB:8.2f} GiB of {capacity / GiB:.1f} usable: {fits}")
    lines.append("step time (seconds; comm is inside the compute stream unless hidden):")
    for k in TIME_PARTS:
        lines.append(f"  {k:<14} {e.time[k]:8.3f}")
    lines.append(f"  {'step':<14} {e.step_s:8.3f}   -> {e.tokens_per_s_gpu:.0f} tokens/s/GPU, "
                 f"{e.tflops:.0f} TFLOPS/GPU, MFU {e.mfu:.1%} (of the BF16 peak)"
                 + ("" if e.simulated else "  [analytic bubble]"))
    return "\n".join(lines)


def to_json(inputs: PlanInputs, name: str, evals: list[Evaluation], pruned: dict[str, int]) -> str:
    def one(e: Evaluation) -> dict:
        c = e.cand
        return {"tp": c.tp, "cp": c.cp, "ep": c.ep, "etp": c.etp, "pp": c.pp, "vpp": c.chunks,
                "dp": c.dp(inputs.gpus), "schedule": c.schedule, "mbs": c.mbs, "microbatches": e.microbatches,
                "recompute": c.recompute_label, "fb_overlap": c.fb_overlap, "zero_stage": c.zero_stage,
                "cp_comm_type": c.cp_comm_type, "pipeline_layout": e.layout,
                "memory_bytes": {k: int(v) for k, v in e.memory.items()}, "time_s": e.time,
                "tokens_per_s_gpu": e.tokens_per_s_gpu, "tflops": e.tflops, "mfu": e.mfu}

    return json.dumps({"model": name, "gpus": inputs.gpus, "gpu": inputs.gpu.name, "seq_len": inputs.seq,
                       "global_batch": inputs.global_batch, "layouts": [one(e) for e in evals],
                       "pruned": pruned}, indent=2)
