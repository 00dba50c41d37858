"""Checkpoint conversion at scale: throughput and peak resident memory against the shard size.

    python benchmarks/convert.py                    # ~4 GB bf16 Qwen3-MoE-shaped checkpoint, 1 GB shards
    python benchmarks/convert.py --gb 8 --shard-gb 2
    python benchmarks/convert.py --fp8-source       # also a DeepSeek-style FP8 source, dequantized on import
    python benchmarks/convert.py --ranks 2          # also hf-to-moetron under torchrun (ep2), per-rank peaks
    python benchmarks/convert.py --quick            # ~0.3 GB, a few seconds

The script writes a synthetic hub checkpoint (config.json, sharded safetensors, index) into a
temporary folder (random bf16 weights; the generator itself streams, one tensor at a time), then
runs each conversion in a fresh child process, which reports its wall time and its peak resident
set (VmHWM from /proc/self/status, cross-checked with getrusage's ru_maxrss) and the resident set
after imports (baseline: the interpreter and torch). Rows:

- hf-to-moetron         `moetron.bridge.convert.hf_to_moetron`, one process, whole tensors
- hf-to-moetron epN     the same under torchrun with N ranks (each rank reads only its slices)
- moetron-to-hf         `moetron_to_hf`, same dtype (bf16), shards of --shard-gb
- moetron-to-hf fp8     re-quantized to E4M3 with 128x128 block scales
- fp8 hf-to-moetron     (--fp8-source) FP8 source dequantized on the fly to bf16

GB counts the tensor bytes written. The target is peak RSS < 2x the largest shard (source shard for
imports, output shard for exports). The files just written are in the page cache, so reads run
at memory speed; writes are fsync'ed. After the table, a sample of keys is compared byte for
byte between the source and the round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---- the synthetic source -------------------------------------------------------------------------


def synthetic_config(gb: float) -> dict:
    """A Qwen3-MoE config whose bf16 weights take about `gb` GB."""
    hidden, inter, experts, vocab = 2048, 768, 64, 32000
    per_layer = 2 * (experts * 3 * inter * hidden + hidden * (2048 + 512 + 512 + 2048) + experts * hidden)
    layers = max(1, round((gb * 1e9 - 2 * 2 * vocab * hidden) / per_layer))
    if gb < 1:  # --quick: shrink everything
        hidden, inter, experts, vocab, layers = 512, 256, 16, 8000, max(1, round(gb * 1e9 / (2 * 16 * 3 * 256 * 512)))
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
            "num_key_value_heads": max(1, hidden // 512), "head_dim": 128, "intermediate_size": 4 * hidden,
            "moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_tok": 4,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def make_source(folder: Path, hf: dict, shard_bytes: int, fp8: bool) -> dict:
    """Write the hub folder tensor by tensor (random bf16, or FP8 + scales for 2-D projections)."""
    from moetron.bridge.hub import meta_model
    from moetron.bridge.hf_config import config_from_hf
    from moetron.bridge.keys import build_key_map
    from moetron.checkpoint.slices import Entry, write_safetensors
    from moetron.precision.blockwise import expected_scale_shape

    folder.mkdir(parents=True)
    cfg = config_from_hf(hf)
    state = meta_model(cfg).state_dict()
    pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).mul_(0.02).bfloat16()
    cursor = [0]

    def random_bf16(shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        out = torch.empty(n, dtype=torch.bfloat16)
        done = 0
        while done < n:
            take = min(n - done, pool.numel() - cursor[0])
            out[done:done + take] = pool[cursor[0]:cursor[0] + take]
            done += take
            cursor[0] = (cursor[0] + take + 7919) % (pool.numel() - 1)
        return out.view(shape)

    entries = []
    for m in build_key_map(cfg, list(state), fused_experts=False):
        for key, view in zip(m.sources, m.to_hf(state[m.target])):
            shape = tuple(view.shape)
            if fp8 and len(shape) == 2 and key.endswith("_proj.weight"):
                entries.append(Entry(key, torch.float8_e4m3fn, shape,
                                     lambda s=shape: random_bf16(s).float().mul(20).to(torch.float8_e4m3fn)))
                entries.append(Entry(key + "_scale_inv", torch.float32, expected_scale_shape(shape),
                                     lambda s=shape: torch.full(expected_scale_shape(s), 0.05)))
            else:
                entries.append(Entry(key, torch.bfloat16 if not key.endswith("bias") else torch.float32, shape,
                                     lambda s=shape, k=key: random_bf16(s) if not k.endswith("bias")
                                     else torch.zeros(s)))
    shards, size = [[]], 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, es in zip(names, shards):
        write_safetensors(folder / name, es, {"format": "pt"}, fsync=False)
    total = sum(e.nbytes for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": {e.key: n for n, es in zip(names, shards) for e in es}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if fp8:
        hf = dict(hf, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    return {"bytes": total, "tensors": len(entries), "files": len(names),
            "largest_shard": max((folder / n).stat().st_size for n in names)}


# ---- one conversion in a child process ----------------------------------------------------------


def child(args) -> None:
    from moetron.bridge.convert import hf_to_moetron, moetron_to_hf

    baseline = status_kb("VmRSS")
    start = time.perf_counter()
    if args.child == "hf-to-moetron":
        parallel = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from moetron.parallel import init_from_env
            from moetron.parallel.config import ParallelConfig

            parallel = ParallelConfig(ep=int(os.environ["WORLD_SIZE"]))
            init_from_env(parallel)
        summary = hf_to_moetron(args.src, args.dst, parallel=parallel, dtype=args.dtype, progress=False)
    else:
        summary = moetron_to_hf(args.src, args.dst, dtype=args.dtype, max_shard_bytes=args.shard_bytes,
                                progress=False)
    seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    out = Path(args.dst).parent / f".bench-{Path(args.dst).name}-{rank}.json"
    nbytes = summary.get("rank_bytes", [summary["bytes"]])[rank]
    tensors = summary.get("rank_tensors", [summary["tensors"]])[rank]
    maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.write_text(json.dumps({"rank": rank, "seconds": seconds, "bytes": nbytes, "tensors": tensors,
                               "hwm_kb": status_kb("VmHWM"), "maxrss_kb": maxrss_kb, "baseline_kb": baseline,
                               "files": summary["files"]}))


def run_child(direction: str, src: Path, dst: Path, dtype: str, shard_bytes: int, ranks: int = 1) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", direction, "--src", str(src), "--dst", str(dst), "--dtype", dtype,
           "--shard-bytes", str(shard_bytes)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cmd[1:]]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)
    results = []
    for r in range(ranks):
        path = dst.parent / f".bench-{dst.name}-{r}.json"
        results.append(json.loads(path.read_text()))
        path.unlink()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the synthetic checkpoint (bf16 GB)")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="source and output shard size")
    parser.add_argument("--fp8-source", action="store_true", help="also convert an FP8 (DeepSeek-style) source")
    parser.add_argument("--no-fp8-export", action="store_true", help="skip the FP8 export row")
    parser.add_argument("--ranks", type=int, default=1,
                        help="also run hf-to-moetron under torchrun with N ranks (ep=N)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one, removed after)")
    parser.add_argument("--quick", action="store_true", help="~0.3 GB, 100 MB shards")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="keep", help=argparse.SUPPRESS)
    parser.add_argument("--shard-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.gb, args.shard_gb = 0.3, 0.1
    shard_bytes = int(args.shard_gb * 1e9)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="moetron-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf = synthetic_config(args.gb)
        t = time.perf_counter()
        src = make_source(work / "hf", hf, shard_bytes, fp8=False)
        print(f"synthetic source: {src['bytes'] / 1e9:.2f} GB, {src['tensors']} tensors in {src['files']} shards "
              f"(largest {src['largest_shard'] / 1e9:.2f} GB), {hf['num_hidden_layers']} layers x "
              f"{hf['num_experts']} experts, made in {time.perf_counter() - t:.0f}s; in {work}", flush=True)
        rows = []

        def record(label: str, results: list[dict], shard: int) -> None:
            for res in results:
                name = label if len(results) == 1 else f"{label} rank {res['rank']}"
                rows.append((name, res, shard))
                print(f"  done: {name}", flush=True)

        record("hf-to-moetron", run_child("hf-to-moetron", work / "hf", work / "mt", "keep", shard_bytes),
               src["largest_shard"])
        if args.ranks > 1:
            record(f"hf-to-moetron ep{args.ranks}", run_child("hf-to-moetron", work / "hf", work / "mt-ranks", "keep",
                                                              shard_bytes, ranks=args.ranks), src["largest_shard"])
        out = run_child("moetron-to-hf", work / "mt", work / "back", "keep", shard_bytes)
        record("moetron-to-hf", out, max((work / "back" / f).stat().st_size for f in out[0]["files"]))
        if not args.no_fp8_export:
            out = run_child("moetron-to-hf", work / "mt", work / "back-fp8", "fp8", shard_bytes)
            record("moetron-to-hf fp8", out, max((work / "back-fp8" / f).stat().st_size for f in out[0]["files"]))
            shutil.rmtree(work / "back-fp8")
        if args.fp8_source:
            fsrc = make_source(work / "hf-fp8", hf, shard_bytes, fp8=True)
            out = run_child("hf-to-moetron", work / "hf-fp8", work / "mt-fp8", "keep", shard_bytes)
            record("fp8 hf-to-moetron", out, fsrc["largest_shard"])
        print()
        print(f"{'conversion':<26} {'GB':>6} {'s':>7} {'GB/s':>6} {'tensors/s':>10} {'peak RSS':>9} "
              f"{'baseline':>9} {'peak-base':>9} {'shard':>7} {'peak/shard':>10}")
        for name, r, shard in rows:
            gb = r["bytes"] / 1e9
            peak = max(r["hwm_kb"], r["maxrss_kb"]) * 1024
            base = r["baseline_kb"] * 1024
            print(f"{name:<26} {gb:6.2f} {r['seconds']:7.1f} {gb / r['seconds']:6.2f} "
                  f"{r['tensors'] / r['seconds']:10.0f} "
                  f"{peak / 1e9:8.2f}G {base / 1e9:8.2f}G {(peak - base) / 1e9:8.2f}G {shard / 1e9:6.2f}G "
                  f"{peak / shard:10.2f}")
        print("target: peak/shard < 2")
        verify(work / "hf", work / "back")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def verify(a: Path, b: Path, sample: int = 24) -> None:
    from moetron.bridge.hub import HubFolder

    ha, hb = HubFolder(a), HubFolder(b)
    keys = sorted(ha.keys())
    assert keys == sorted(hb.keys()), "round trip changed the key set"
    step = max(1, len(keys) // sample)
    for k in keys[::step]:
        x, y = ha.read(k), hb.read(k)
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k
    print(f"round trip: same {len(keys)} keys; {len(keys[::step])} sampled keys byte-identical")
    ha.close()
    hb.close()


if __name__ == "__main__":
    main()
