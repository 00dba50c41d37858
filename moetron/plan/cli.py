"""`moetron plan`: pick the parallel layout for a model on a cluster (docs/planning.md).

    moetron plan --recipe deepseek-v3-671b --gpus 2048 --gpu h800
    moetron plan --recipe qwen3-moe-30b-a3b --gpus 16 --gpu h100 --explain "pp=2 ep=8 schedule=interleaved vpp=2"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetron.bridge.hf_config import config_from_hf
from moetron.plan.candidate import SCHEDULES, Candidate
from moetron.plan.gpus import GPUS, get_gpu
from moetron.plan.report import explain, header, table, to_json
from moetron.plan.search import Planner, PlanInputs, Pruned
from moetron.recipes import get_recipe
from moetron.recipes.toml_io import load_recipe


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank parallel layouts for a model on a cluster (memory and throughput)",
                              description="Enumerate tp/cp/ep/etp/pp/vpp/schedule/micro-batch/recompute layouts, "
                                          "prune the invalid ones, print the best with per-GPU memory and step "
                                          "time broken down (docs/planning.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", help="a shipped recipe name (`moetron recipes`)")
    src.add_argument("--config", metavar="FILE.toml", help="a recipe file")
    src.add_argument("--hf", metavar="config.json", help="a Hugging Face config.json (or its folder)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU preset (moetron/plan/gpus.py)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per NVLink domain (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the recipe's, else 4096)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: the recipe's micro_batch_size x grad_accum x its dp)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="parameter / activation dtype")
    p.add_argument("--fp8", choices=["tensorwise", "delayed", "blockwise"], default=None, help="FP8 GEMM recipe")
    p.add_argument("--fp8-weight-cache", action="store_true",
                   help="FP8 weight copies quantised once per step under delayed scaling too (Transformer "
                        "Engine); moetron does so for tensorwise and blockwise, per micro-batch for delayed")
    p.add_argument("--fp8-activation-cache", action="store_true",
                   help="DeepSeek-V3's low-precision activation storage (SwiGLU input and attention output in "
                        "FP8, routed rows received in FP8 without a regroup copy); not moetron's (docs/planning.md)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), metavar="LIST",
                   help="pipeline schedules the search may use, comma-separated (default: all: "
                        f"{','.join(SCHEDULES)}); e.g. 1f1b,interleaved for what Megatron-Core offers")
    p.add_argument("--no-fb-overlap", action="store_true",
                   help="never hide the EP all-to-all behind another micro-batch (parallel.fb_overlap=off)")
    p.add_argument("--fb-overlap-schedules", default="dualpipev", metavar="LIST",
                   help="schedules under which the search also tries fb_overlap (default dualpipev; add interleaved "
                        "to price Megatron-Core's A2A overlap, moe_a2a_overlap)")
    p.add_argument("--zero-stages", default="1,2,3", metavar="LIST",
                   help="parallel.zero_stage values the search may use (default 1,2,3; 3 only data-parallel-only)")
    p.add_argument("--dispatcher", choices=["alltoall", "flex"], default="alltoall",
                   help="parallel.dispatcher priced: alltoall (every routed row travels) or flex (DeepEP: one "
                        "copy per destination rank and node)")
    p.add_argument("--activations", choices=["moetron", "megatron"], default="moetron",
                   help="whose activation storage the memory follows: moetron's, or Megatron-Core with Transformer "
                        "Engine (to compare with runs published from it; docs/planning.md)")
    p.add_argument("--top", type=int, default=10, help="how many layouts to print")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--explain", metavar="LAYOUT", default=None,
                   help='evaluate one layout, e.g. "tp=2 pp=8 vpp=4 ep=64 recompute=mla_up_proj,moe_act"')
    p.set_defaults(func=run)


def _model(args):
    """(name, ModelConfig, seq_len, default global batch) from --recipe / --config / --hf."""
    if args.hf:
        path = Path(args.hf)
        path = path / "config.json" if path.is_dir() else path
        try:
            cfg = config_from_hf(json.loads(path.read_text()), source=str(path))
        except OSError as exc:
            raise ValueError(f"--hf {args.hf}: cannot read it ({exc})") from None
        return path.parent.name or str(path), cfg, 4096, None
    recipe = load_recipe(args.config) if args.config else get_recipe(args.recipe)
    t, p = recipe.train, recipe.parallel
    return recipe.name, recipe.model, t.seq_len, (t.micro_batch_size, t.grad_accum, p.tp * p.cp * p.pp)


def inputs_from_args(args) -> tuple[str, PlanInputs]:
    name, cfg, seq, batch = _model(args)
    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be >= 1")
    gpu = get_gpu(args.gpu)
    if (args.fp8_weight_cache or args.fp8_activation_cache) and not args.fp8:
        raise ValueError("--fp8-weight-cache / --fp8-activation-cache describe FP8 training: add --fp8 RECIPE")
    seq = args.seq_len or seq
    schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
    bad = [x for x in schedules if x not in SCHEDULES]
    if bad or not schedules:
        raise ValueError(f"--schedules {args.schedules!r}: choose from {', '.join(SCHEDULES)} (comma-separated)")
    overlap_scheds = tuple(x.strip() for x in args.fb_overlap_schedules.split(",") if x.strip())
    bad = [x for x in overlap_scheds if x not in SCHEDULES or x == "zb1p"]
    if bad:
        raise ValueError(f"--fb-overlap-schedules {args.fb_overlap_schedules!r}: choose from 1f1b, interleaved, "
                         "dualpipev (zb1p's split backward is never paired)")
    try:
        zeros = tuple(int(x) for x in args.zero_stages.split(",") if x.strip())
    except ValueError:
        zeros = (0,)
    if not zeros or any(z not in (1, 2, 3) for z in zeros):
        raise ValueError(f"--zero-stages {args.zero_stages!r}: a comma-separated list of 1, 2, 3")
    if args.global_batch:
        global_batch = args.global_batch
    elif batch:
        mbs, accum, model_parallel = batch
        global_batch = mbs * accum * max(1, args.gpus // model_parallel)
    else:
        global_batch = 8 * args.gpus
    return name, PlanInputs(cfg, args.gpus, gpu, args.gpus_per_node or min(gpu.nvlink_domain, args.gpus), seq,
                            global_batch, args.dtype, args.fp8, "cpu" if gpu.name == "cpu" else "cuda",
                            reserve_gib=0.5 if gpu.name == "cpu" else 4.0, fp8_weight_cache=args.fp8_weight_cache,
                            fp8_cache=args.fp8_activation_cache, schedules=schedules,
                            fb_overlap=not args.no_fb_overlap, fb_overlap_schedules=overlap_scheds,
                            zero_stages=zeros, dispatcher=args.dispatcher, activations=args.activations)


def run(args) -> int:
    name, inputs = inputs_from_args(args)
    planner = Planner(inputs)
    if args.explain:
        cand = Candidate.parse(args.explain)
        try:
            ev = planner.evaluate(cand, simulated=True, check_memory=False)
        except Pruned as exc:
            raise ValueError(f"--explain {args.explain!r}: this layout cannot run: {exc}") from None
        print(to_json(inputs, name, [ev], {}) if args.json else header(inputs, name) + "\n" +
              explain(ev, planner.capacity))
        return 0
    evals = planner.search(args.top)
    pruned = dict(planner.pruned.most_common())
    if args.json:
        print(to_json(inputs, name, evals, pruned))
        return 0
    print(header(inputs, name))
    if not evals:
        print("no layout fits; pruned: " + "; ".join(f"{n} x {r}" for r, n in planner.pruned.most_common(5)))
        return 1
    print(table(evals))
    print(f"\npruned {sum(pruned.values())} candidates; the commonest reasons:")
    for reason, n in planner.pruned.most_common(5):
        print(f"  {n:>6} x {reason}")
    print("\nthe best, in full:\n" + explain(evals[0], planner.capacity))
    return 0


def main(argv: list[str] | None = None) -> int:  # `python -m moetron.plan.cli`
    parser = argparse.ArgumentParser(prog="moetron")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
