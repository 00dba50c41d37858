"""Forward+backward time of `moetron.MoELayer` beside transformers' Qwen3-MoE block and a dense ceiling.

    python benchmarks/moe_layer.py                      # the issue's sizes: T=4096 H=1024 F=512 E=32 k=4
    MALLOC_MMAP_MAX_=0 python benchmarks/moe_layer.py   # glibc's mmap off, trimming on (see below)
    python benchmarks/moe_layer.py --quick              # tiny sizes, a few seconds
    python benchmarks/moe_layer.py --tokens 8192 --experts 64 --topk 8   # other sizes (--hidden, --ffn too)
    python benchmarks/moe_layer.py --skip "hf eager" --repeats 30        # leave out the slow loop, more samples
    python benchmarks/moe_layer.py --permute-impls torch,cpp             # one moetron line per permute impl
    python benchmarks/moe_layer.py --expert-backends cpp,torch_grouped_mm # one moetron line per expert GEMM
    python benchmarks/moe_layer.py --profile            # also: torch.profiler op tables of moetron and ceiling

Candidates, fp32 on the CPU by default (`torch.set_num_threads(--threads)`, 2 by default; `--device cuda
--dtype bf16` for a GPU), timed in one
process on the same random input, one random output gradient `dy` and the same weights (the
transformers blocks share moetron's parameter tensors: router `layer.router.weight [E,H]` is
`block.gate.weight`; `layer.experts.gate_up_proj [E,2F,H]` / `down_proj [E,H,F]` are
transformers' fused `block.experts.gate_up_proj` / `down_proj`, the same layout):

- moetron          `MoELayer(MoEConfig(..., norm_topk_prob=True))`, the Qwen3 routing.
- hf eager         `Qwen3MoeSparseMoeBlock` with `Qwen3MoeConfig(experts_implementation="eager")`:
                   `Qwen3MoeExperts.forward` as written in the model file, a Python loop over experts.
- hf grouped_mm    the same block with `experts_implementation="grouped_mm"`. transformers 5 wraps the
                   experts class in `@use_experts_implementation`, whose `forward` looks up
                   `config._experts_implementation` on every call; "grouped_mm" is
                   `integrations.moe.grouped_mm_experts_forward` (sort, `torch.nn.functional.grouped_mm`).
- ceiling          the same expert FLOPs as one dense chain with autograd: T*k rows through one
                   `[2F,H]` matrix, SwiGLU, one `[H,F]` matrix, input gradient included. No routing,
                   no permutation, no combine: what a perfect MoE layer could cost.
- router only      moetron's router alone (fp32 logits, softmax, top-k, renormalise), for scale.
- torchtitan       its `MoE` (models/common/moe.py) on moetron's weights, experts through
                   `torch._grouped_mm` in the input's dtype (benchmarks/peers.py: the shims, and why).
- megatron-core    its `MoELayer` (SequentialMLP experts, allgather dispatcher: what runs on a CPU).
                   Each peer is timed when it imports and builds here, after the same agreement check as
                   transformers'; otherwise the peer table says why (neither is a moetron dependency:
                   `pip install torchtitan megatron-core`, or `--no-deps` plus the few modules they import).

moetron's SwiGLU kernel is `--swiglu-impl` (default auto: the fused C++ kernel on CPU, Triton on CUDA,
built on first use); `--swiglu-impl torch` times the reference expression instead. Its router follows
`--fusion` as `train.fusion` (default auto, as the trainer: the C++ softmax top-k on CPU, the Triton one on
CUDA; `none` the eager router, the choice of the figures before 2026-11-27's ninth session). Its expert GEMMs are
`MoEConfig.expert_backend` "auto" (on CPU the C++ grouped GEMM, moetron/csrc/grouped_gemm_cpu.cpp: the
experts split over the threads once per call, one single-threaded BLAS call per piece);
`--expert-backends cpp,torch_grouped_mm` times one moetron line per backend in the same run.

Every call starts with the gradients set to None (as `zero_grad()` does) and runs forward and
`backward(dy)`, input gradient included. Before timing, the script checks which experts function
each transformers block really runs (by the ops it dispatches: `aten._grouped_mm` for grouped_mm,
no grouped op and no transformers fallback op for eager), and that moetron agrees with both
transformers paths: relative max error (max|a-b| / max|b|) < 1e-5 on the outputs, < 1e-4 on the
input, router and expert gradients — so the timings compare equal work.

Timing: `--warmup` calls, then `--repeats` calls of each candidate interleaved round-robin (the
first candidate rotating each round) so drift hits all alike. The table gives the median and min
wall time, the median's ratio to the ceiling and to moetron, and the median process CPU time (all
threads). The issue's target: moetron within 1.05x of the ceiling and faster than transformers'
grouped_mm path, in the same run.

Reading the numbers on a shared machine: other processes on the same cores stretch wall times,
and hurt candidates that run many short parallel regions (moetron's and transformers' grouped GEMMs
are one MKL call per expert on the CPU) more than the ceiling's six large GEMMs; OpenMP threads
spin while they wait, so the CPU column grows too. The script prints the load average before and
after; when it is well above `--threads`, trust the min column and repeat the run.

Allocator noise: with glibc's default malloc, every tensor over 32 MiB (the adaptive mmap
threshold's ceiling) is a fresh mmap whose first touch page-faults, and freeing it unmaps it —
15-20 % of run-to-run noise on this machine (the [T*k, H] fp32 buffers are 64 MiB, the expert
weight gradients 128 and 64 MiB). On the CPU the script first makes the setting `moetron train` makes
(moetron/train/host.py: mmap and trimming off, so freed memory is reused), for every candidate alike;
any MALLOC_* variable turns it off (`MALLOC_MMAP_MAX_=0` alone keeps large blocks on the heap, but
glibc still trims its top).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import format_table, time_interleaved  # noqa: E402
from peers import PEERS, build_peers, check_peers  # noqa: E402

from moetron import MoEConfig, MoELayer  # noqa: E402
from moetron.kernels.fused_swiglu import resolve as resolve_swiglu  # noqa: E402
from moetron.moe.config import EXPERT_BACKENDS  # noqa: E402
from moetron.moe.grouped_gemm import resolve_backend  # noqa: E402
from moetron.ops import resolve_fusion, set_fusion  # noqa: E402
from moetron.train.host import keep_freed_memory  # noqa: E402

QUICK = dict(tokens=256, hidden=128, ffn=64, experts=8, topk=2, repeats=3, warmup=1)
CANDIDATES = ("moetron", "hf eager", "hf grouped_mm", *PEERS, "ceiling", "router only")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512, help="expert FFN size F")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per candidate (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per candidate first")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (GPU runs synchronise after every call)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="timing dtype; the agreement check always runs in fp32 first, then everything is cast")
    p.add_argument("--quick", action="store_true",
                   help=f"small sizes that finish in seconds ({', '.join(f'{k}={v}' for k, v in QUICK.items())});"
                        " explicit flags still win")
    p.add_argument("--skip", nargs="*", default=[], metavar="NAME",
                   help=f"candidates to leave out, of: {', '.join(repr(c) for c in CANDIDATES if c != 'moetron')}"
                        " ('hf' = both transformers paths)")
    p.add_argument("--permute-impls", default=None, metavar="A,B",
                   help="time one moetron line per permute implementation (e.g. 'torch,cpp'), when this "
                        "moetron has moetron.dispatch.permute; default: the process default")
    p.add_argument("--expert-backends", default=None, metavar="A,B",
                   help="time one moetron line per expert GEMM backend (MoEConfig.expert_backend, e.g. "
                        "'cpp,torch_grouped_mm'); default: auto only")
    p.add_argument("--fusion", default="auto", choices=("auto", "none", "cpp", "triton"),
                   help="train.fusion for moetron's layer, which decides its router: auto (the trainer's default: "
                        "the C++ router on a CPU, the Triton one on a GPU) or none (the eager router)")
    p.add_argument("--swiglu-impl", default="auto", choices=("auto", "torch", "cpp", "triton"),
                   help="moetron's expert activation kernel (moetron/kernels/fused_swiglu.py)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, print torch.profiler op tables of moetron and the ceiling")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="with --profile: moetron's profiled call as a Chrome trace (gzip-compressed if FILE ends in .gz)")
    args = p.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if args.quick:
        for k, v in QUICK.items():
            if not any(a == f"--{k}" or a.startswith(f"--{k}=") for a in given):
                setattr(args, k, v)
    skip = set(args.skip)
    if "hf" in skip:
        skip |= {"hf eager", "hf grouped_mm"}
    unknown = skip - set(CANDIDATES) - {"hf"}
    if unknown or "moetron" in skip:
        p.error(f"--skip: cannot skip {sorted(unknown | ({'moetron'} & skip))}; choose from {CANDIDATES[1:]}")
    args.skip = skip
    return args


# --- candidates ------------------------------------------------------------------------

def build_hf_blocks(layer: MoELayer, cfg: MoEConfig) -> dict[str, torch.nn.Module]:
    """transformers' Qwen3-MoE block in each experts implementation, sharing `layer`'s parameters."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = {}
    for impl in ("eager", "grouped_mm"):
        hf_cfg = Qwen3MoeConfig(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.ffn_hidden_size,
                                num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                                norm_topk_prob=cfg.norm_topk_prob, hidden_act="silu",
                                experts_implementation=impl)
        assert hf_cfg._experts_implementation == impl, hf_cfg._experts_implementation
        with torch.device("meta"):  # no 200 MB of throw-away weights
            block = Qwen3MoeSparseMoeBlock(hf_cfg)
        block.gate.weight = layer.router.weight
        block.experts.gate_up_proj = layer.experts.gate_up_proj
        block.experts.down_proj = layer.experts.down_proj
        assert not any(t.is_meta for t in [*block.parameters(), *block.buffers()])
        blocks[f"hf {impl}"] = block
    return blocks


class _OpRecorder:
    """Names of the aten/custom ops run inside the block (a TorchDispatchMode, no profiler)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.add(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def check_hf_dispatch(blocks: dict[str, torch.nn.Module], x: torch.Tensor) -> dict[str, str]:
    """Run each block once and say which experts path actually ran (by the ops it dispatched)."""
    from transformers.integrations import moe as hf_moe

    found = {}
    for name, block in blocks.items():
        impl = block.experts.config._experts_implementation
        fn = hf_moe.ALL_EXPERTS_FUNCTIONS.get_interface(impl, None)
        with torch.no_grad(), _OpRecorder() as rec:
            block(x)
        grouped = any("grouped_mm" in op and "fallback" not in op for op in rec.ops)
        fallback = any("grouped_mm_fallback" in op for op in rec.ops)
        if impl == "eager":
            assert fn is None and not grouped and not fallback, (name, sorted(rec.ops))
            found[name] = "Qwen3MoeExperts.forward: per-expert loop of F.linear (aten.linear/mm)"
        else:
            assert fn is hf_moe.grouped_mm_experts_forward and grouped and not fallback, (name, sorted(rec.ops))
            found[name] = ("integrations.moe.grouped_mm_experts_forward: "
                           + ", ".join(sorted(op for op in rec.ops if "grouped_mm" in op)))
    return found


def make_step(module_fn, params, x, dy, before=None):
    """One forward+backward from scratch: gradients set to None first, as `zero_grad()` does.
    On a GPU the call waits for the device, so host timers measure the device work."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step():
        if before is not None:
            before()
        for p in params:
            p.grad = None
        x.grad = None
        module_fn(x).backward(dy)
        sync()
    return step


def build_ceiling(T, H, F_, K, dtype, seed, device="cpu"):
    """The expert FLOPs as one dense chain: [T*k,H] @ [2F,H]^T -> SwiGLU -> @ [H,F]^T, with input grad."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T * K, H, generator=g, dtype=dtype).to(device).requires_grad_()
    w1 = (0.02 * torch.randn(2 * F_, H, generator=g, dtype=dtype)).to(device).requires_grad_()
    w2 = (0.02 * torch.randn(H, F_, generator=g, dtype=dtype)).to(device).requires_grad_()
    dy = torch.randn(T * K, H, generator=g, dtype=dtype).to(device)

    def chain(x_):
        gate, up = F.linear(x_, w1).split(F_, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    return make_step(chain, [w1, w2], x, dy)


def build_router_step(layer, x, seed):
    """moetron's router alone, forward+backward through the top-k weights."""
    g = torch.Generator().manual_seed(seed + 2)
    dw = torch.randn(x.shape[0] * x.shape[1], layer.config.top_k, generator=g, dtype=x.dtype).to(x.device)

    def router(x_):
        return layer.route(x_.reshape(-1, x_.shape[-1])).topk_weights

    return make_step(router, [layer.router.weight], x, dw)


def permute_impl_setter(impl: str, device: str = "cpu"):
    """A callable that makes `impl` moetron's process-wide permute implementation."""
    try:
        from moetron.dispatch.permute import resolve, set_permute_impl
    except ImportError as e:
        raise SystemExit(f"--permute-impls: this moetron has no selectable permute implementations ({e})")
    set_permute_impl(impl)
    resolved = resolve(impl, None, torch.device(device))[0]  # fails here, not mid-timing, if impl cannot run
    return (lambda: set_permute_impl(impl)), resolved


def _backend_setter(layer: MoELayer, backend: str):
    """A callable that makes `backend` the layer's expert GEMM backend (checked here, not mid-timing)."""
    if backend not in EXPERT_BACKENDS:
        raise SystemExit(f"--expert-backends: {backend!r} is unknown; choose from {EXPERT_BACKENDS}")
    x = torch.zeros(1, layer.config.hidden_size, device=layer.router.weight.device)
    resolve_backend(backend, x, layer.experts.gate_up_proj)

    def use():
        layer.experts.backend = backend
    return use


def current_permute_impl() -> str:
    try:
        from moetron.dispatch.permute import permute_impl
    except ImportError:
        return "torch (no permute_kernels)"
    impl, deterministic = permute_impl()
    return f"{impl}{' deterministic' if deterministic else ''}"


# --- correctness -----------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|"""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_agreement(layer, blocks, x, dy) -> list[list[str]]:
    """Outputs and gradients of moetron vs each transformers path; raise if they disagree."""
    params = {"router": layer.router.weight, "gate_up": layer.experts.gate_up_proj,
              "down": layer.experts.down_proj}

    def run(fn):
        for p in params.values():
            p.grad = None
        x.grad = None
        y = fn(x)
        y.backward(dy)
        return y.detach().clone(), {"x": x.grad.clone(), **{k: p.grad.clone() for k, p in params.items()}}

    y_ref, g_ref = run(layer)
    if not (y_ref.abs().max() > 0 and all(g.abs().max() > 0 for g in g_ref.values())):
        raise AssertionError("moetron's output or a gradient is all zeros: the agreement check would be vacuous")
    rows = []
    for name, block in blocks.items():
        y, g = run(block)
        out_err = rel_err(y_ref, y)
        grad_errs = {k: rel_err(g_ref[k], g[k]) for k in g}
        rows.append([f"moetron vs {name}", f"{out_err:.2e}",
                     *(f"{grad_errs[k]:.2e}" for k in ("x", "router", "gate_up", "down"))])
        if not out_err < 1e-5:
            raise AssertionError(f"moetron and {name} outputs differ: relative max error {out_err:.3e} >= 1e-5")
        bad = {k: v for k, v in grad_errs.items() if not v < 1e-4}
        if bad:
            raise AssertionError(f"moetron and {name} gradients differ (relative max error): {bad}")
    for p in params.values():
        p.grad = None
    x.grad = None
    return rows


# --- profile ---------------------------------------------------------------------------

def profile_table(step, rows: int = 20, cuda: bool = False, trace: str | None = None) -> str:
    from torch.profiler import ProfilerActivity, profile

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
    if trace:
        from profile_step import write_trace
        write_trace(prof, trace)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


# --- main ------------------------------------------------------------------------------

def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def main(argv=None) -> dict[str, float]:
    """Run the benchmark; return the median wall seconds per candidate."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device(args.device)
    kept = keep_freed_memory(device, lambda line: None)
    T, H, F_, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    load_before = _load()

    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=K, norm_topk_prob=True)
    # Built in fp32 for the agreement check (bf16 routers would pick different experts for
    # near-tied tokens), then cast in place: the transformers blocks share the Parameters.
    layer = MoELayer(cfg).to(device)
    layer.experts.activation_impl = args.swiglu_impl
    try:
        fusion, _ = resolve_fusion(args.fusion, device, dtype=dtype)
    except ValueError as exc:
        raise SystemExit(f"--fusion {args.fusion}: {exc}") from None
    set_fusion(fusion)  # the router's kernel, as `moetron train` sets it
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(1, T, H, generator=g).to(device).requires_grad_()
    dy = torch.randn(1, T, H, generator=g).to(device)
    moe_params = [layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj]

    hf_wanted = {"hf eager", "hf grouped_mm"} - args.skip
    hf_version = None
    if hf_wanted:
        try:
            import transformers
            hf_version = transformers.__version__
        except ImportError:
            print("transformers is not installed: the hf candidates are left out")
    blocks = {k: v for k, v in build_hf_blocks(layer, cfg).items() if k in hf_wanted} if hf_version else {}

    print(f"MoE layer forward+backward: tokens={T} hidden={H} ffn={F_} experts={E} top_k={K} "
          f"{args.dtype} {device}{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}, "
          f"random inputs (seed {args.seed})")
    print(f"torch {torch.__version__}  transformers {hf_version or '-'}  threads {torch.get_num_threads()}  "
          f"python {platform.python_version()}  MALLOC_MMAP_MAX_={os.environ.get('MALLOC_MMAP_MAX_', 'unset')}  "
          f"freed memory kept (moetron train's glibc setting): {kept}")
    swiglu = resolve_swiglu(args.swiglu_impl, device)
    gemm = resolve_backend(layer.experts.backend, x.detach().reshape(-1, H), layer.experts.gate_up_proj)
    print(f"repeats {args.repeats} after {args.warmup} warm-up, round-robin; "
          f"moetron permute impl {current_permute_impl()}, swiglu impl {args.swiglu_impl} -> {swiglu}, "
          f"fusion (router) {args.fusion} -> {fusion}, "
          f"expert backend {layer.experts.backend} -> {gemm}")

    variants = {}  # moetron lines: name -> callable run before each call (selects the permute impl)
    if args.permute_impls and args.expert_backends:
        raise SystemExit("--permute-impls and --expert-backends: give one of them")
    if args.expert_backends:
        for backend in args.expert_backends.split(","):
            variants[f"moetron ({backend} experts)"] = _backend_setter(layer, backend)
    elif args.permute_impls:
        for impl in args.permute_impls.split(","):
            before, resolved = permute_impl_setter(impl, args.device)
            label = impl if impl == resolved else f"{impl}={resolved}"
            variants[f"moetron ({label} permute)"] = before
    else:
        variants["moetron"] = None

    peers, peer_status = build_peers(layer, args.skip)
    if blocks or peers:
        for name, what in (check_hf_dispatch(blocks, x.detach()) if blocks else {}).items():
            print(f"{name:<14} runs {what}")
        agree = []
        for name, before in variants.items():
            if before is not None:
                before()
            rows = check_agreement(layer, blocks, x, dy) + check_peers(layer, peers, x, dy, rel_err)
            agree += [[row[0].replace("moetron", name, 1), *row[1:]] for row in rows]
        print("\nagreement in fp32, relative max error (outputs must be < 1e-5, gradients < 1e-4)")
        print(format_table(["", "output", "dx", "d router", "d gate_up", "d down"], agree))
    if dtype != torch.float32:
        layer.to(dtype)
        for peer in peers.values():
            for p in peer.params:
                p.data = p.data.to(dtype)
        x = x.detach().to(dtype).requires_grad_()
        dy = dy.to(dtype)

    candidates = {name: make_step(layer, moe_params, x, dy, before) for name, before in variants.items()}
    for name, block in blocks.items():
        candidates[name] = make_step(block, moe_params, x, dy)
    for name, peer in peers.items():
        candidates[name] = make_step(peer.forward, peer.params, x, dy)
    if "ceiling" not in args.skip:
        candidates["ceiling"] = build_ceiling(T, H, F_, K, dtype, args.seed, device)
    if "router only" not in args.skip:
        candidates["router only"] = build_router_step(layer, x, args.seed)

    times = time_interleaved(candidates, warmup=args.warmup, repeats=args.repeats)
    moe_name = next(iter(candidates))
    moe = times[moe_name].median
    ceil = times["ceiling"].median if "ceiling" in times else None
    ceil_cpu = times["ceiling"].cpu_median if "ceiling" in times else None

    def ratio(a, b):
        return f"{a / b:.3f}x" if b else "-"

    rows = [[name, f"{t.median * 1e3:.1f}", f"{t.min * 1e3:.1f}", ratio(t.median, ceil), ratio(t.median, moe),
             f"{t.cpu_median * 1e3:.1f}", ratio(t.cpu_median, ceil_cpu)] for name, t in times.items()]
    print()
    print(format_table(["candidate", "median ms", "min ms", "vs ceiling", "vs moetron", "cpu ms", "cpu vs ceil"],
                       rows))
    print("(ratios are of medians; 'cpu ms' is the median process CPU time of one call, all threads, "
          "OpenMP spin-waits included)")

    verdicts = []
    for name, t in times.items():
        if not name.startswith("moetron"):
            continue
        parts = []
        if ceil:
            parts.append(f"{ratio(t.median, ceil)} of the ceiling "
                         f"(target <= 1.05x: {'met' if t.median <= 1.05 * ceil else 'MISSED'})")
        if "hf grouped_mm" in times:
            hg = times["hf grouped_mm"].median
            parts.append(f"{ratio(t.median, hg)} of hf grouped_mm (target < 1: {'met' if t.median < hg else 'MISSED'})")
        for peer in (p for p in PEERS if p in times):
            pt = times[peer].median
            parts.append(f"{ratio(t.median, pt)} of {peer} (target < 1: {'met' if t.median < pt else 'MISSED'})")
        if parts:
            verdicts.append(f"{name}: " + ", ".join(parts))
    print("\n".join(verdicts))
    print(format_table(["peer", "status"], peer_status))
    print(f"load average (1 min) before {load_before}, after {_load()} on {os.cpu_count()} CPUs "
          f"(this benchmark itself adds about {args.threads}); a higher load means other processes shared "
          "the CPUs and the wall times are noisy")

    if args.profile:
        by = "self CUDA time" if device.type == "cuda" else "self CPU time"
        print(f"\nprofile: {moe_name}, one forward+backward, by {by}")
        print(profile_table(candidates[moe_name], cuda=device.type == "cuda", trace=args.trace))
        if "ceiling" in candidates:
            print(f"profile: ceiling, one forward+backward, by {by}")
            print(profile_table(candidates["ceiling"], rows=10, cuda=device.type == "cuda"))
    return {name: t.median for name, t in times.items()}


if __name__ == "__main__":
    main()
