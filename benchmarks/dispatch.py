"""Token dispatch: permute/unpermute beside a plain copy, and dispatch+combine on gloo at EP 2 and 4.

    python benchmarks/dispatch.py                  # T=4096 H=1024 E=64 k=8 bf16; EP 2 and 4, 512 tokens/rank
    python benchmarks/dispatch.py --quick          # tiny sizes, a few seconds
    python benchmarks/dispatch.py --skip-dist      # the single-process permute part only
    python benchmarks/dispatch.py --device cuda --skip-dist   # permute part on the GPU (triton included)
    python benchmarks/dispatch.py --impls torch,cpp --dispatchers alltoall,flex --ep 2,4,8 --dist-tokens 4096
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/dispatch.py   # torch's CPU allocations >= 2 MiB on huge pages

Part 1, one process (`--device`, cpu by default): `permute` and `unpermute`
(moetron/dispatch/permute.py) of T tokens routed to k of E experts, once per permute
implementation (moetron/dispatch/permute.py): "torch" (the reference), "cpp" (the C++ CPU
kernel, moetron/csrc/permute_cpu.cpp, built on first use) and on CUDA "triton" (on CPU Triton runs
only under its interpreter, so it is left out unless named in --impls with TRITON_INTERPRET=1).
Baseline, timed in the same interleaved rounds: `copy_` of the permuted buffer's bytes into a
reused buffer ([T*k, H], what a gather of the same rows must at least move) and `clone` (which,
like permute, allocates its output). GB/s counts the bytes an op must move (read + write of rows,
N = T*k rows, dropless): permute 2NH, unpermute (N+T)H, both 3N+T rows; the round trip with
backward (7N+2T)H. "% copy_" = the op's GB/s over copy_'s in the same rounds. The issue's target:
the fused CPU permute (cpp) at >= 50% of copy bandwidth. The "routing plan" rows (part of
permute: where every slot goes) move no rows; they show how much of permute is not copying.

Reading part 1 on CPU: permute returns a fresh [N,H] tensor, and with glibc's malloc every
allocation over 32 MiB is a new mmap whose first touch page-faults once per 4 KiB page; that,
not the row copies, dominates permute and clone (compare them with copy_ into a reused buffer).
`THP_MEM_ALLOC_ENABLE=1` (read by torch's CPU allocator when torch is imported) backs such
allocations with 2 MiB transparent huge pages, 512 times fewer faults; `MALLOC_MMAP_MAX_=0`
keeps them on the heap. On CUDA the caching allocator has no such cost, so clone equals copy_.

Part 2, `--ep` gloo process groups on this CPU (spawned here, `--dist-threads` threads each, rank
0 prints): each rank routes `--dist-tokens` tokens of its own (random top-k over E experts, random
gate weights), dispatches them, runs identity experts and combines, once per dispatcher and
permute implementation (`set_permute_impl`, process-wide, as the dispatchers take no impl):
allgather (AllGatherDispatcher), alltoall (AllToAllDispatcher), flex (FlexTokenDispatcher, torch
backend), flex-fp8 (the same with FP8 rows on the wire) and flex-ll (FlexBuffer's low-latency
mode, forward only, no permute, on the first `--ll-tokens` tokens: it moves fixed buffers sized
experts x tokens, meant for decoding batches). Reference rows in the same rounds: "local" (LocalDispatcher: the
same permute+unpermute with every expert in the process, no communication: the permute-only bound)
and "a2a floor" (two equal-split all_to_all_single of the T*k rows: the communication alone).
Forward runs under no_grad; fwd+bwd also backpropagates a random gradient to x and the gate weights.
Times are per call, the slowest rank's (a collective ends when the last rank does); "eff GB/s" =
token bytes a call delivers, 2*T*k*H*bytes per rank (each token row to its k experts and back;
doubled with backward), over the time: the same numerator for every row, so it is an inverse time.
Outputs are checked first (identity experts: combine(dispatch(x)) = x * sum of its gate weights).

Timing: `--warmup` calls, then `--repeats` rounds interleaved round-robin (benchmarks/_timing.py);
medians. On a machine whose cores are shared with other work, read the ratios, and run twice.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import format_table, time_interleaved  # noqa: E402

from moetron.dispatch import permute as permute_kernels  # noqa: E402
from moetron.dispatch.permute import permute, routing_plan, unpermute  # noqa: E402

QUICK = dict(tokens=256, hidden=128, experts=16, topk=4, dist_tokens=128, ll_tokens=32, repeats=3, warmup=1)
DISPATCHERS = ("allgather", "alltoall", "flex", "flex-fp8", "flex-ll")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:]))
    p.add_argument("--tokens", type=int, default=4096, help="tokens T of the single-process permute part")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cpu", help="device of the permute part (cpu, cuda); part 2 is gloo on CPU")
    p.add_argument("--impls", default=None, metavar="A,B",
                   help="permute implementations; default: torch and cpp on CPU, torch and triton on CUDA "
                        "(those that are available here)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the permute part (default: torch's)")
    p.add_argument("--inner", type=int, default=None,
                   help="calls per timed sample (default 1 on CPU, 20 on CUDA, where one call is microseconds)")
    p.add_argument("--ep", default="2,4", metavar="N,M", help="expert-parallel sizes of part 2 (gloo processes)")
    p.add_argument("--dist-tokens", type=int, default=512, help="tokens per rank in part 2")
    p.add_argument("--ll-tokens", type=int, default=128,
                   help="tokens per rank of flex-ll (num_max_dispatch_tokens_per_rank): the low-latency mode "
                        "moves fixed [experts x tokens] buffers, sized for decoding batches")
    p.add_argument("--dist-threads", type=int, default=1, help="torch threads per rank in part 2")
    p.add_argument("--dispatchers", default=",".join(DISPATCHERS), metavar="A,B",
                   help=f"part 2 dispatchers, of {', '.join(DISPATCHERS)}")
    p.add_argument("--no-backward", action="store_true", help="part 2: forward only")
    p.add_argument("--skip-local", action="store_true", help="leave out part 1")
    p.add_argument("--skip-dist", action="store_true", help="leave out part 2")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help=f"small sizes ({', '.join(f'{k}={v}' for k, v in QUICK.items())}); explicit flags win")
    a = p.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if a.quick:
        for k, v in QUICK.items():
            flag = "--" + k.replace("_", "-")
            if not any(g == flag or g.startswith(flag + "=") for g in given):
                setattr(a, k, v)
    a.device = torch.device(a.device)
    a.ep = [int(n) for n in a.ep.split(",") if n]
    a.dispatchers = [d for d in a.dispatchers.split(",") if d]
    bad = sorted(set(a.dispatchers) - set(DISPATCHERS))
    if bad:
        p.error(f"--dispatchers: unknown {bad}; choose from {DISPATCHERS}")
    for n in a.ep:
        if n < 2 or a.experts % n:
            p.error(f"--ep {n}: needs 2 or more ranks that divide --experts={a.experts}")
    if a.inner is None:
        a.inner = 20 if a.device.type == "cuda" else 1
    return a


def choose_impls(spec: str | None, device: torch.device) -> tuple[list[str], list[str]]:
    """Implementations to time on `device`, and one line per left-out one saying why."""
    status = {name: (ok, why) for name, ok, why in permute_kernels.impl_status(device, build=True)}
    notes = []
    if spec:
        impls = [s for s in spec.split(",") if s]
        for impl in impls:
            if impl not in status:
                sys.exit(f"--impls: {impl!r} is unknown; choose from {list(status)}")
            if not status[impl][0]:
                sys.exit(f"--impls: {impl!r} cannot run on {device.type} here: {status[impl][1]}")
        return impls, notes
    impls = ["torch"]
    for name in ("cpp", "triton"):
        ok, why = status[name]
        if name == "triton" and device.type == "cpu":
            notes.append("triton: left out on CPU (the interpreter is not a kernel; name it in --impls "
                         "with TRITON_INTERPRET=1 to time it anyway)")
        elif ok:
            impls.append(name)
        elif not (name == "cpp" and device.type != "cpu"):
            notes.append(f"{name}: unavailable ({why})")
    return impls, notes


def random_routing(T: int, E: int, K: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token, uniform at random, and positive gate weights summing to 1."""
    idx = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=gen) + 0.1
    return idx.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.2f}"


# --- part 1: permute / unpermute against a copy, one process -------------------------------------

def local_part(a, dtype) -> None:
    dev = a.device
    if a.threads:
        torch.set_num_threads(a.threads)
    impls, notes = choose_impls(a.impls, dev)
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    gen = torch.Generator().manual_seed(a.seed)
    idx, w = random_routing(T, E, K, gen, dev)
    x = torch.randn(T, H, generator=gen).to(dev, dtype)
    N, b = T * K, x.element_size()
    g_TH = torch.randn(T, H, generator=gen).to(dev, dtype)

    # every implementation gives the same rows, and sums them back to x * (sum of its gate weights)
    ref_rows, ref_state = permute(x, idx, E, impl="torch")
    want = (x.float() * w.sum(-1, keepdim=True)).to(dtype)  # independent of permute/unpermute
    # fp32: rounding only; bf16/fp16: the torch reference sums k rounded products in the low precision
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    states = {}
    for impl in impls:
        rows, st = permute(x, idx, E, impl=impl)
        assert torch.equal(rows, ref_rows), f"{impl}: permute differs from the torch reference"
        torch.testing.assert_close(unpermute(rows, st, w), want, **tol, msg=f"{impl}: unpermute")
        states[impl] = st
    x_g, w_g = x.clone().requires_grad_(), w.clone().requires_grad_()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn):
        def run():
            for _ in range(a.inner):
                fn()
            sync()
        return run

    def ops_for(impl):
        st = states[impl]

        def plan():
            if impl == "cpp":
                return permute_kernels.kernels_for("cpp").routing_plan(idx, E)
            return routing_plan(idx, E)  # torch ops on the tensors' device (triton uses it too)

        def perm():
            return permute(x, idx, E, impl=impl)

        def unperm():
            return unpermute(ref_rows, st, w)

        def both():
            rows, s = permute(x, idx, E, impl=impl)
            return unpermute(rows, s, w)

        def round_trip():
            rows, s = permute(x_g, idx, E, impl=impl)
            unpermute(rows, s, w_g).backward(g_TH)

        return {"routing plan": plan, "permute": perm, "unpermute": unperm, "permute+unpermute": both,
                "round trip fwd+bwd": round_trip}

    row_bytes = H * b
    op_bytes = {"routing plan": 0, "permute": 2 * N * row_bytes, "unpermute": (N + T) * row_bytes,
                "permute+unpermute": (3 * N + T) * row_bytes, "round trip fwd+bwd": (7 * N + 2 * T) * row_bytes}
    copy_src = ref_rows.clone()
    copy_dst = torch.empty_like(copy_src)
    baselines = {"copy_": lambda: copy_dst.copy_(copy_src), "clone": copy_src.clone}
    cands = {impl: ops_for(impl) for impl in impls}
    table, pct = [], {}
    copy_bytes = 2 * N * row_bytes
    for op, nbytes in op_bytes.items():
        group = {impl: timed(cands[impl][op]) for impl in impls}
        if nbytes:  # the copy baselines in the same rounds
            group.update({name: timed(fn) for name, fn in baselines.items()})
        t = time_interleaved(group, warmup=a.warmup, repeats=a.repeats)
        med = {n: t[n].median / a.inner for n in group}
        low = {n: t[n].min / a.inner for n in group}
        for name in group:
            vs_torch = f"{med['torch'] / med[name]:.2f}x" if name in impls and "torch" in med else "-"
            label = f"{op} [{name}]" if name in impls else f"  {name} of [N,H], same rounds"
            if not nbytes:  # the routing plan moves no rows
                table.append([label, _fmt_ms(med[name]), _fmt_ms(low[name]), "-", "-", "-", vs_torch])
                continue
            copy_gbs, clone_gbs = copy_bytes / med["copy_"] / 1e9, copy_bytes / med["clone"] / 1e9
            gbs = (nbytes if name in impls else copy_bytes) / med[name] / 1e9
            if name in impls:
                pct[(name, op)] = (gbs / copy_gbs, gbs / clone_gbs)
            table.append([label, _fmt_ms(med[name]), _fmt_ms(low[name]), f"{gbs:.1f}",
                          f"{100 * gbs / copy_gbs:.0f}%", f"{100 * gbs / clone_gbs:.0f}%", vs_torch])

    print(f"== part 1: permute / unpermute, one process on {dev.type}: T={T} H={H} E={E} k={K} {a.dtype}, "
          f"N=T*k={N} rows of {row_bytes} B ({N * row_bytes / 2**20:.0f} MiB); "
          f"{torch.get_num_threads()} threads; median of {a.repeats} rounds x {a.inner} calls")
    for n in notes:
        print(f"   {n}")
    print(format_table(["op [impl]", "ms", "min ms", "GB/s", "% copy_", "% clone", "vs torch"], table))
    for impl in impls:
        if impl == "torch":
            continue
        (p_copy, p_clone), (r_copy, r_clone) = pct[(impl, "permute")], pct[(impl, "permute+unpermute")]
        verdict = ""
        if impl == "cpp":
            verdict = f"; target >= 50% of copy_: {'met' if min(p_copy, r_copy) >= 0.5 else 'MISSED'}"
        print(f"{impl}: permute at {100 * p_copy:.0f}% of copy_ bandwidth ({100 * p_clone:.0f}% of clone), "
              f"permute+unpermute at {100 * r_copy:.0f}% ({100 * r_clone:.0f}%){verdict}")


# --- part 2: dispatch + combine on gloo ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(name, group, E, rank, ws):
    from moetron.dispatch.allgather import AllGatherDispatcher
    from moetron.dispatch.alltoall import AllToAllDispatcher
    from moetron.dispatch.flex import FlexBuffer, FlexTokenDispatcher

    L = E // ws
    if name == "allgather":
        return AllGatherDispatcher(group, E, range(rank * L, (rank + 1) * L))
    if name == "alltoall":
        return AllToAllDispatcher(group, E)
    if name in ("flex", "flex-fp8"):
        return FlexTokenDispatcher(group, E, backend="torch", fp8=name == "flex-fp8")
    if name == "flex-ll":
        return FlexBuffer(group, E, backend="torch")
    raise ValueError(name)


def _dist_worker(rank, ws, port, a, dtype, impls):
    import torch.distributed as dist

    from moetron.dispatch.base import LocalDispatcher
    from moetron.dispatch.routing import Routing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(a.dist_threads)
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        T, H, E, K = a.dist_tokens, a.hidden, a.experts, a.topk
        gen = torch.Generator().manual_seed(a.seed + 1000 * rank + 1)
        idx, w = random_routing(T, E, K, gen, "cpu")
        x = torch.randn(T, H, generator=gen).to(dtype)
        g = torch.randn(T, H, generator=gen).to(dtype)
        routing = Routing.from_topk(idx, w, E)
        want = (x.float() * routing.topk_weights.sum(-1, keepdim=True)).to(dtype)
        x_g = x.clone().requires_grad_()
        w_g = routing.topk_weights.clone().requires_grad_()
        routing_g = Routing(idx, w_g, routing.tokens_per_expert, E)
        dispatchers = {name: _build(name, group, E, rank, ws) for name in a.dispatchers}
        dispatchers["local"] = LocalDispatcher(E)

        def fwd(d):
            with torch.no_grad():
                rows, _, h = d.dispatch(x, routing)
                return d.combine(rows, h)  # identity experts

        def fwd_bwd(d):
            rows, _, h = d.dispatch(x_g, routing_g)
            d.combine(rows, h).backward(g)

        Tl = min(a.ll_tokens, T)  # a decoding batch: the first Tl tokens, num_max_dispatch_tokens_per_rank=Tl
        want_ll = want[:Tl]

        def ll_fwd(d):
            with torch.no_grad():
                recv, _, h, _, _ = d.low_latency_dispatch(x[:Tl], idx[:Tl], Tl)
                out, _, _ = d.low_latency_combine(recv, idx[:Tl], routing.topk_weights[:Tl], h)
                return out

        tokens_of = {"flex-ll": Tl}  # tokens per call per rank, T unless named here
        send = torch.empty(T * K, H, dtype=dtype)
        recv = torch.empty_like(send)

        def a2a_floor():
            for _ in range(2):  # dispatch and combine, equal splits
                dist.all_to_all_single(recv, send, group=group)

        def with_impl(impl, fn, d):
            def run():
                permute_kernels.set_permute_impl(impl)
                return fn(d)
            return run

        # correctness first, on every rank
        fp8_tol = dict(rtol=0.07, atol=0.07 * float(x.abs().max()))
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
        for impl in impls:
            for name, d in dispatchers.items():
                out = with_impl(impl, ll_fwd if name == "flex-ll" else fwd, d)()
                torch.testing.assert_close(out, want_ll if name == "flex-ll" else want,
                                           **(fp8_tol if name == "flex-fp8" else tol),
                                           msg=f"rank {rank}: {name} [{impl}] dispatch+combine")

        passes = [("fwd", fwd)] + ([] if a.no_backward else [("fwd+bwd", fwd_bwd)])
        results = {}
        for pass_name, fn in passes:
            cands = {}
            for name, d in dispatchers.items():
                if name == "flex-ll":
                    if pass_name == "fwd":  # no permute inside, no backward: one line
                        cands[(name, "-")] = with_impl("torch", ll_fwd, d)
                    continue
                for impl in impls:
                    cands[(name, impl)] = with_impl(impl, fn, d)
            if pass_name == "fwd":
                cands[("a2a floor", "-")] = a2a_floor
            dist.barrier()
            t = time_interleaved(cands, warmup=a.warmup, repeats=a.repeats)
            results[pass_name] = {k: v.samples for k, v in t.items()}
        gathered = [None] * ws
        dist.gather_object(results, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            _print_dist(a, ws, gathered, tokens_of, K * H * x.element_size())
    finally:
        dist.destroy_process_group()


def _print_dist(a, ws, gathered, tokens_of, bytes_per_token) -> None:
    print(f"\n== part 2: dispatch + combine, EP={ws} gloo processes x {a.dist_threads} thread(s): "
          f"{a.dist_tokens} tokens/rank, H={a.hidden} E={a.experts} ({a.experts // ws}/rank) k={a.topk} "
          f"{a.dtype}; identity experts; median of {a.repeats} rounds, slowest rank per round")
    for pass_name, res0 in gathered[0].items():
        mult = 1 if pass_name == "fwd" else 2
        med = {}
        for key in res0:
            per_round = [max(r[pass_name][key][i] for r in gathered) for i in range(len(res0[key]))]
            med[key] = statistics.median(per_round)
        rows = []
        for (name, impl), t in med.items():
            tokens = tokens_of.get(name, a.dist_tokens)
            label = f"{name} [{impl}]" + (f" ({tokens} tok/rank)" if tokens != a.dist_tokens else "")
            local = med.get(("local", impl)) if tokens == a.dist_tokens else None
            base = med.get(("alltoall", impl)) if tokens == a.dist_tokens else None
            rows.append([label, _fmt_ms(t), f"{mult * 2 * tokens * bytes_per_token / t / 1e9:.2f}",
                         f"{t / local:.2f}x" if local and name != "local" else "-",
                         f"{t / base:.2f}x" if base else "-"])
        print(f"-- {pass_name}" + (" (no_grad)" if pass_name == "fwd" else ", gradients to x and gate weights"))
        print(format_table(["dispatcher [permute impl]", "ms/call", "eff GB/s", "vs local", "vs alltoall"], rows))


def dist_part(a, dtype) -> None:
    import torch.multiprocessing as mp

    impls, notes = choose_impls(a.impls if a.impls and a.device.type == "cpu" else None, torch.device("cpu"))
    for n in notes:
        print(f"   part 2: {n}")
    for ws in a.ep:
        start = time.perf_counter()
        mp.start_processes(_dist_worker, args=(ws, _free_port(), a, dtype, impls), nprocs=ws,
                           join=True, start_method="spawn")
        print(f"(EP={ws}: {time.perf_counter() - start:.0f}s including process start-up)")


def main(argv=None) -> None:
    a = parse_args(argv)
    dtype = DTYPES[a.dtype]
    begin = time.perf_counter()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, MALLOC_MMAP_MAX_={os.environ.get('MALLOC_MMAP_MAX_', 'unset')}")
    if not a.skip_local:
        local_part(a, dtype)
    if not a.skip_dist:
        dist_part(a, dtype)
    print(f"\ntotal {time.perf_counter() - begin:.0f}s, load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
