"""Fused permute / unpermute on the CPU: the torch reference beside the C++ kernel, in one process.

    python benchmarks/permute.py                      # T=4096 H=1024 E=32 k=4 fp32
    MALLOC_MMAP_MAX_=0 python benchmarks/permute.py   # without mmap'd (page-faulting) 64 MiB buffers
    python benchmarks/permute.py --quick              # tiny sizes, a few seconds

Candidates (same routing, same tensors, outputs checked before timing):

- torch      `impl="torch"`, the original reference (index_select / index_copy / index_add, autograd by torch)
- torch det  `impl="torch", deterministic=True`: the fixed-order reference the fused kernels equal bit for bit
- cpp        `impl="cpp"`: moetron/csrc/permute_cpu.cpp (counting-sort plan, at::parallel_for row copies and
             per-token slot sums; deterministic)
- copy_ / clone  a plain copy of the permuted buffer's bytes, into a reused buffer / a new one: the
             bandwidth ceiling of a gather that moves the same bytes (permute allocates its output,
             so `clone` is the like-for-like ceiling; with glibc's default malloc a 64 MiB buffer
             is a fresh mmap whose first touch page-faults, see benchmarks/moe_layer.py)

Rows: the routing plan alone, each op's forward, forward + backward, and the whole round trip
(permute -> unpermute -> backward). GB/s counts the bytes an op must move (read + write of rows);
ratio = torch median / cpp median (> 1: cpp faster). Timing: warm-up, then repeats interleaved
round-robin (benchmarks/_timing.py); medians in milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import format_table, time_interleaved  # noqa: E402

from moetron.dispatch import permute as permute_kernels  # noqa: E402
from moetron.dispatch.permute import permute, routing_plan, unpermute  # noqa: E402
from moetron.kernels import cpp_build  # noqa: E402

QUICK = dict(tokens=256, hidden=128, experts=8, topk=2, repeats=3, warmup=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--pad-multiple", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def main(argv=None) -> None:
    a = parse_args(argv)
    start = time.perf_counter()
    ok, reason = cpp_build.cpp_status(build=True)
    if not ok:
        sys.exit(f"the C++ kernel is unavailable: {reason}")
    load_s = time.perf_counter() - start
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices  # distinct experts per token
    w = torch.rand(T, K, generator=gen)
    x = torch.randn(T, H, generator=gen)
    pad = {"pad_multiple": a.pad_multiple}
    impls = {"torch": dict(impl="torch"), "torch det": dict(impl="torch", deterministic=True),
             "cpp": dict(impl="cpp")}

    # correctness first: cpp equals the deterministic reference bit for bit, the original within rounding
    outs = {}
    for name, kw in impls.items():
        x_NH, st = permute(x, idx, E, **pad, **kw)
        outs[name] = (x_NH, unpermute(x_NH, st, w))
    assert torch.equal(outs["cpp"][0], outs["torch"][0]) and torch.equal(outs["cpp"][1], outs["torch det"][1])
    torch.testing.assert_close(outs["cpp"][1], outs["torch"][1], rtol=1e-5, atol=1e-5)
    N = outs["cpp"][0].shape[0]

    x_g = x.clone().requires_grad_()
    w_g = w.clone().requires_grad_()
    g_TH = torch.randn(T, H, generator=gen)
    states = {name: permute(x, idx, E, **pad, **kw)[1] for name, kw in impls.items()}
    y_NH = outs["cpp"][0].clone()
    y_g = y_NH.clone().requires_grad_()
    g_NH = torch.randn(N, H, generator=gen)

    def candidates(name):
        kw, st = impls[name], states[name]

        def plan():
            return (routing_plan(idx, E, **pad) if name != "cpp"
                    else permute_kernels.kernels_for("cpp").routing_plan(idx, E, **pad))

        def perm_fwd():
            return permute(x, idx, E, **pad, **kw)

        def perm_fwd_bwd():
            x_NH, _ = permute(x_g, idx, E, **pad, **kw)
            x_NH.backward(g_NH)

        def unperm_fwd():
            return unpermute(y_NH, st, w)

        def unperm_fwd_bwd():
            unpermute(y_g, st, w_g).backward(g_TH)

        def round_trip():
            x_NH, s = permute(x_g, idx, E, **pad, **kw)
            unpermute(x_NH * 1.0, s, w_g).backward(g_TH)

        return dict(plan=plan, perm_fwd=perm_fwd, perm_fwd_bwd=perm_fwd_bwd, unperm_fwd=unperm_fwd,
                    unperm_fwd_bwd=unperm_fwd_bwd, round_trip=round_trip)

    rows_bytes = N * H * 4
    copy_src = outs["cpp"][0]
    copy_dst = torch.empty_like(copy_src)
    copy_ms = clone_ms = float("nan")
    ops = [("routing plan", "plan", 0), ("permute fwd", "perm_fwd", 2 * rows_bytes),
           ("permute fwd+bwd", "perm_fwd_bwd", 2 * rows_bytes + rows_bytes + T * H * 4),
           ("unpermute fwd", "unperm_fwd", rows_bytes + T * H * 4),
           ("unpermute fwd+bwd", "unperm_fwd_bwd", rows_bytes + T * H * 4 + 3 * rows_bytes + T * H * 4),
           ("round trip fwd+bwd", "round_trip", 0)]
    cands = {n: candidates(n) for n in impls}
    table = []
    baselines = {"copy_": lambda: copy_dst.copy_(copy_src), "clone": copy_src.clone}
    for label, key, nbytes in ops:
        group = {n: cands[n][key] for n in impls}
        if key == "perm_fwd":  # the copy baselines interleaved with permute: same allocator and machine state
            group.update(baselines)
        t = time_interleaved(group, warmup=a.warmup, repeats=a.repeats)
        med = {n: t[n].median * 1e3 for n in group}
        if key == "perm_fwd":
            copy_ms, clone_ms = med["copy_"], med["clone"]
        gbs = f"{nbytes / (med['cpp'] * 1e-3) / 1e9:.1f}" if nbytes else "-"
        table.append([label, f"{med['torch']:.2f}", f"{med['torch det']:.2f}", f"{med['cpp']:.2f}",
                      f"{med['torch'] / med['cpp']:.2f}x", f"{med['torch det'] / med['cpp']:.2f}x", gbs])
    for label, ms in [("copy_ into a reused buffer", copy_ms), ("clone (allocate + copy)", clone_ms)]:
        table.append([label, "-", "-", f"{ms:.2f}", "-", "-", f"{2 * rows_bytes / (ms * 1e-3) / 1e9:.1f}"])

    print(f"T={T} H={H} E={E} k={K} pad_multiple={a.pad_multiple} fp32, rows N={N}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"C++ kernel ready in {load_s:.1f}s (build or cache load); median of {a.repeats}, ms")
    print(format_table(["op", "torch", "torch det", "cpp", "torch/cpp", "det/cpp", "cpp GB/s"], table))
    perm = float(table[1][3])
    print(f"cpp permute fwd: {100 * copy_ms / perm:.0f}% of copy_ bandwidth, "
          f"{100 * clone_ms / perm:.0f}% of clone (which, like permute, allocates its output)")


if __name__ == "__main__":
    main()
