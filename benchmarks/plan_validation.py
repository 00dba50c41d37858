"""Predicted vs reported throughput of published MoE runs, and the planner's own rank of each layout.

    python benchmarks/plan_validation.py [--skip-ranking]

For every run in benchmarks/published_runs.toml: the planner evaluates the published layout (the least
recompute that fits, as the planner would choose it), prints predicted tokens/s/GPU against the reported
figure, whether it fits, and where the published layout ranks among the planner's distinct layouts for
that model and cluster (vpp's value not compared: the planner tries vpp 2 and 4): among all layouts, by
its sizes alone (best schedule each), and among the layouts the publisher's framework offered (the row's
framework_schedules, EP overlap where framework_fb_overlap allows it, ZeRO-1). The efficiency constants
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
args_no_cache = [False]  # --no-fp8-activation-cache: the rows' recorded FP8 activation storage ignored
args_activations = [None]  # --activations: one activation storage for every row instead of each row's own


def _planner(run: dict, framework: bool = False) -> Planner:
    """framework: the search restricted to what the publisher's framework offered (`framework_schedules`,
    EP overlap under `framework_fb_overlap`, ZeRO-1). The memory follows the row's `activations` storage."""
    cfg = get_recipe(run["recipe"]).model
    if run.get("set"):
        cfg = cfg.replace(**run["set"])
    gpu = GPUS[run["gpu"]]
    fp8 = None if run["precision"] == "bf16" else run["precision"]
    # the publishers' FP8 runs quantise each weight once per step (Transformer Engine's first-micro-batch
    # cache; DeepSeek's framework); a row may also record DeepSeek-V3's FP8 activation storage
    return Planner(PlanInputs(cfg, run["gpus"], gpu, min(gpu.nvlink_domain, run["gpus"]), run["seq_len"],
                              run["global_batch"], "bf16", fp8, moetron_only=False,
                              fp8_weight_cache=fp8 is not None,
                              fp8_cache=run.get("fp8_activation_cache", False) and not args_no_cache[0],
                              dispatcher=run.get("dispatcher", "alltoall"),
                              activations=args_activations[0] or run.get("activations", "moetron"),
                              overlap_grad_reduce=run.get("overlap_grad_reduce", True),
                              **({"schedules": tuple(run["framework_schedules"]), "zero_stages": (1,),
                                  "fb_overlap_schedules": tuple(run.get("framework_fb_overlap", ("dualpipev",)))}
                                 if framework else {})))


def _candidate(run: dict) -> Candidate:
    sched = run["schedule"]
    vpp = run["vpp"] if sched == "interleaved" else 1
    return Candidate(tp=run["tp"], cp=run.get("cp", 1), ep=run["ep"], etp=1, pp=run["pp"], vpp=vpp, schedule=sched,
                     mbs=run["mbs"], fb_overlap=run.get("fb_overlap", False) and run["ep"] > 1 and run["pp"] > 1 and sched != "zb1p")


def _rank(evals: list, cand: Candidate) -> tuple[int | None, int | None]:
    """(position of the published sizes and schedule, position of its sizes with the best schedule each)."""
    order = [e.cand for e in evals]
    pos = next((n for n, c in enumerate(order, 1) if _match(c, cand)), None)
    dims = list(dict.fromkeys((c.tp, c.cp, c.ep, c.pp) for c in order))
    sizes = (cand.tp, cand.cp, cand.ep, cand.pp)
    return pos, (dims.index(sizes) + 1 if sizes in dims else None)


def _fmt(pos: int | None, evals: list) -> str:
    return str(pos) if pos else f">{len(evals)}"


def _match(a: Candidate, b: Candidate) -> bool:
    return (a.tp, a.cp, a.ep, a.pp, a.schedule) == (b.tp, b.cp, b.ep, b.pp, b.schedule)


def _runs(data: dict) -> list[dict]:
    """The [[run]] rows, then each `release` entry: the row named by its `of` with the fields it gives replaced."""
    by_name = {run["name"]: run for run in data["run"]}
    unknown = [r["of"] for r in data.get("release", []) if r["of"] not in by_name]
    if unknown:
        raise SystemExit(f"{DATA}: release entries name no [[run]] row: {unknown}")
    return data["run"] + [{**by_name[r["of"]], **{k: v for k, v in r.items() if k != "of"}}
                          for r in data.get("release", [])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-ranking", action="store_true", help="only predicted vs reported (fast)")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--no-fp8-activation-cache", action="store_true",
                        help="plan every row with moetron's own FP8 activation storage (ignore fp8_activation_cache)")
    parser.add_argument("--activations", choices=["moetron", "megatron"], default=None,
                        help="price every row's memory with this activation storage (default: each row's own)")
    args = parser.parse_args(argv)
    args_no_cache[0] = args.no_fp8_activation_cache
    args_activations[0] = args.activations
    runs = _runs(tomllib.loads(DATA.read_text()))
    rows, errors, hopper_errors, ranks, fits = [], [], [], [], []
    rankings: dict[tuple, list] = {}
    spread: dict[tuple, list] = {}  # one layout (model, cluster, sizes, schedule, precision) published more than once
    for run in runs:
        planner = _planner(run)
        cand = _candidate(run)
        try:
            ev = planner.best_variant(cand, zero_stages=(1,))  # the publishers ran ZeRO-1 (distributed optimizer)
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
            key = (run["recipe"], str(run.get("set")), run["gpu"], run["gpus"], run["global_batch"], run["precision"],
                   run.get("dispatcher"))
            fkey = key + (tuple(run["framework_schedules"]),)
            for k, p in ((key, planner), (fkey, _planner(run, framework=True))):
                if k not in rankings:
                    start = time.time()
                    rankings[k] = p.search(top=0, simulate_top=120)
                    print(f"  (ranked {len(rankings[k])} layouts for {run['name'][:40]}... in "
                          f"{time.time() - start:.1f} s)", file=sys.stderr)
            pos, dims_pos = _rank(rankings[key], cand)
            fpos, _ = _rank(rankings[fkey], cand)
            rank = f"{_fmt(pos, rankings[key])}/{_fmt(dims_pos, rankings[key])}/{_fmt(fpos, rankings[fkey])}"
            ranks.append((pos, dims_pos, fpos))
        rows.append((run["name"], run["gpu"], run["gpus"], cand.describe().split(" schedule")[0], run["schedule"],
                     ev.cand.recompute_label, ev.memory_total / GiB, fit, ev.tokens_per_s_gpu, run["tokens_per_s_gpu"],
                     err, rank))
        layout_key = (run["recipe"], str(run.get("set")), run["gpu"], run["gpus"], rows[-1][3], run["schedule"],
                      run["precision"])
        spread.setdefault(layout_key, []).append((run["tokens_per_s_gpu"], ev.tokens_per_s_gpu))
    print(f"{'run':<62} {'layout':<32} {'sched':<11} {'recompute':<28} {'GiB':>5} {'fit':>3} "
          f"{'pred':>6} {'rep':>6} {'err':>6} {'rank all/sizes/framework':>14}")
    for name, gpu, n, layout, sched, rec, gib, fit, pred, rep, err, rank in rows:
        layout = layout.replace(" etp=1", "")
        print(f"{name[:62]:<62} {layout[:32]:<32} {sched:<11} {rec[:28]:<28} {gib:5.1f} {'yes' if fit else 'NO':>3} "
              f"{pred:6.0f} {rep:6.0f} {err:+6.0%} {rank:>14}")
    print("\nsame layout and precision, several rows (releases, publishers, batch differ): reported min-max, "
          "predicted min-max")
    for (recipe, _, gpu, n, layout, sched, precision), pairs in spread.items():
        if len(pairs) > 1:
            rep, pred = [p[0] for p in pairs], [p[1] for p in pairs]
            print(f"  {recipe} {n} {gpu} {precision} {layout.replace(' etp=1', '')} {sched}: {len(pairs)} rows, "
                  f"reported {min(rep):.0f}-{max(rep):.0f} ({max(rep) / min(rep):.2f}x), "
                  f"predicted {min(pred):.0f}-{max(pred):.0f}")
    print(f"\n{len(rows)} runs; fit in memory: {sum(fits)}/{len(fits)}")
    if hopper_errors:
        within = sum(abs(e) <= 0.25 for e in hopper_errors)
        print(f"H100/H800 runs: throughput error median {statistics.median(hopper_errors):+.0%}, "
              f"min {min(hopper_errors):+.0%}, max {max(hopper_errors):+.0%}, within +-25%: {within}/{len(hopper_errors)}")
    print(f"all runs: median error {statistics.median(errors):+.0%}, "
          f"within +-25%: {sum(abs(e) <= 0.25 for e in errors)}/{len(errors)}")
    if ranks:
        def count(j: int) -> int:
            return sum(1 for r in ranks if r[j] is not None and r[j] <= args.top)

        print(f"published layout (sizes and schedule) in the planner's top {args.top}: {count(0)}/{len(ranks)}; "
              f"its sizes (tp, cp, ep, pp; best schedule each) in the top {args.top}: {count(1)}/{len(ranks)}; "
              f"among the layouts the publisher's framework offered (framework_schedules, ZeRO-1): "
              f"{count(2)}/{len(ranks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
