"""Predicted vs reported throughput of published MoE runs, and the planner's own rank of each layout.

    python benchmarks/plan_validation.py [--skip-ranking]

For every run in benchmarks/published_runs.toml: the planner evaluates the published layout (the least
recompute that fits, as the planner would choose it), prints predicted tokens/s/GPU against the reported
figure, whether it fits, and where the published layout ranks among the planner's distinct layouts for
that model and cluster (vpp's value not compared: the planner tries vpp 2 and 4). The efficiency constants
in moetron/plan/cost.py were set once for all rows together, never per row (docs/planning.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path

from moetron.plan.candidate import Candidate
from moetron.plan.gpus import GPUS
from moetron.plan.memory import GiB
from moetron.plan.search import Planner, PlanInputs, Pruned
from moetron.recipes import get_recipe

DATA = Path(__file__).with_name("published_runs.toml")


def _planner(run: dict) -> Planner:
    cfg = get_recipe(run["recipe"]).model
    if run.get("set"):
        cfg = cfg.replace(**run["set"])
    gpu = GPUS[run["gpu"]]
    fp8 = None if run["precision"] == "bf16" else run["precision"]
    return Planner(PlanInputs(cfg, run["gpus"], gpu, min(gpu.nvlink_domain, run["gpus"]), run["seq_len"],
                              run["global_batch"], "bf16", fp8, moetron_only=False))


def _candidate(run: dict) -> Candidate:
    sched = run["schedule"]
    vpp = run["vpp"] if sched == "interleaved" else 1
    return Candidate(tp=run["tp"], cp=run.get("cp", 1), ep=run["ep"], etp=1, pp=run["pp"], vpp=vpp, schedule=sched,
                     mbs=run["mbs"], fb_overlap=run["ep"] > 1)


def _match(a: Candidate, b: Candidate) -> bool:
    return (a.tp, a.cp, a.ep, a.pp, a.schedule) == (b.tp, b.cp, b.ep, b.pp, b.schedule)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-ranking", action="store_true", help="only predicted vs reported (fast)")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)
    runs = tomllib.loads(DATA.read_text())["run"]
    rows, errors, hopper_errors, ranks, fits = [], [], [], [], []
    rankings: dict[tuple, list] = {}
    for run in runs:
        planner = _planner(run)
        cand = _candidate(run)
        try:
            ev = planner.best_variant(cand)
            ev = planner.evaluate(ev.cand, simulated=True, check_memory=False)
            fit = True
        except Pruned as exc:
            if not str(exc).startswith("out of memory"):
                print(f"{run['name']}: the published layout cannot run in the planner: {exc}")
                continue
            ev = planner.evaluate(replace(cand, full_recompute=True), simulated=True, check_memory=False)
            fit = False
        err = ev.tokens_per_s_gpu / run["tokens_per_s_gpu"] - 1
        errors.append(err)
        fits.append(fit)
        if run["gpu"] in ("h100", "h800"):
            hopper_errors.append(err)
        rank = "-"
        if not args.skip_ranking:
            key = (run["recipe"], str(run.get("set")), run["gpu"], run["gpus"], run["global_batch"], run["precision"])
            if key not in rankings:
                start = time.time()
                rankings[key] = planner.search(top=0, simulate_top=120)
                print(f"  (ranked {len(rankings[key])} layouts for {run['name'][:40]}... in {time.time() - start:.1f} s)",
                      file=sys.stderr)
            order = [e.cand for e in rankings[key]]
            pos = next((n for n, c in enumerate(order, 1) if _match(c, cand)), None)
            dims = list(dict.fromkeys((c.tp, c.cp, c.ep, c.pp) for c in order))  # best schedule of each
            dims_pos = dims.index((cand.tp, cand.cp, cand.ep, cand.pp)) + 1 if (cand.tp, cand.cp, cand.ep,
                                                                             cand.pp) in dims else None
            rank = (str(pos) if pos else f">{len(order)}") + "/" + (str(dims_pos) if dims_pos else f">{len(dims)}")
            ranks.append((pos, dims_pos))
        rows.append((run["name"], run["gpu"], run["gpus"], cand.describe().split(" schedule")[0], run["schedule"],
                     ev.cand.recompute_label, ev.memory_total / GiB, fit, ev.tokens_per_s_gpu, run["tokens_per_s_gpu"],
                     err, rank))
    print(f"{'run':<62} {'layout':<32} {'sched':<11} {'recompute':<28} {'GiB':>5} {'fit':>3} "
          f"{'pred':>6} {'rep':>6} {'err':>6} {'rank':>9}")
    for name, gpu, n, layout, sched, rec, gib, fit, pred, rep, err, rank in rows:
        layout = layout.replace(" etp=1", "")
        print(f"{name[:62]:<62} {layout[:32]:<32} {sched:<11} {rec[:28]:<28} {gib:5.1f} {'yes' if fit else 'NO':>3} "
              f"{pred:6.0f} {rep:6.0f} {err:+6.0%} {rank:>9}")
    print(f"\n{len(rows)} runs; fit in memory: {sum(fits)}/{len(fits)}")
    if hopper_errors:
        within = sum(abs(e) <= 0.25 for e in hopper_errors)
        print(f"H100/H800 runs: throughput error median {statistics.median(hopper_errors):+.0%}, "
              f"min {min(hopper_errors):+.0%}, max {max(hopper_errors):+.0%}, within +-25%: {within}/{len(hopper_errors)}")
    print(f"all runs: median error {statistics.median(errors):+.0%}, "
          f"within +-25%: {sum(abs(e) <= 0.25 for e in errors)}/{len(errors)}")
    if ranks:
        top = sum(1 for r, _ in ranks if r is not None and r <= args.top)
        dims = sum(1 for _, d in ranks if d is not None and d <= args.top)
        print(f"published layout (sizes and schedule) in the planner's top {args.top}: {top}/{len(ranks)}; "
              f"its sizes (tp, cp, ep, pp; best schedule each) in the top {args.top}: {dims}/{len(ranks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
