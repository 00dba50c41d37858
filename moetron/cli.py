"""The `moetron` command: train, list recipes, convert checkpoints, and report the environment."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import textwrap
import time

import torch

from moetron.backends import backend_status
from moetron.bridge.convert import format_summary, hf_to_moetron, moetron_to_hf
from moetron.checkpoint.verify import verify_command
from moetron.config import ModelConfig, Recipe, TrainConfig, apply_overrides
from moetron.data.packed import PreparedCorpus
from moetron.data.prepare import prepare
from moetron.dispatch.permute import impl_status
from moetron.model.size import model_size
from moetron.parallel import init_from_env
from moetron.parallel.config import ParallelConfig
from moetron.plan import cli as plan_cli
from moetron.pipeline.simulator import main as simulate_main
from moetron.recipes import RECIPES, get_recipe
from moetron.recipes.catalog import DEFAULT_RECIPE
from moetron.recipes.toml_io import dump_recipe, load_recipe
from moetron.train.model_source import resolve_model
from moetron.train.trainer import train


def _recipe(args) -> Recipe:
    """`--config FILE.toml` or `--recipe NAME`, then the `--set` overrides on top. A run that starts
    from a checkpoint (`--hf DIR`, train.init_hf, train.resume) takes its model section from it;
    `--set model.*` may then change only training-time options (train/model_source.py)."""
    if args.config and args.recipe:
        raise ValueError("give either --recipe NAME or --config FILE.toml, not both")
    base = load_recipe(args.config) if args.config else get_recipe(args.recipe or DEFAULT_RECIPE)
    sets = list(args.set or [])
    if getattr(args, "hf", None):
        sets.append(f"train.init_hf={args.hf}")
    model_sets = [item for item in sets if item.split("=", 1)[0].strip().startswith("model.")]
    return resolve_model(apply_overrides(base, [item for item in sets if item not in model_sets]), model_sets)


def _fields_help() -> str:
    """Every `--set` field with its default, by section (the epilog of `moetron train --help`)."""
    sections = (("model", ModelConfig, get_recipe(DEFAULT_RECIPE).model), ("train", TrainConfig, TrainConfig()),
                ("parallel", ParallelConfig, ParallelConfig()))
    lines = ["fields (--set SECTION.FIELD=VALUE; the model section's defaults are the default recipe's):"]
    for name, cls, obj in sections:
        items = [f"{f.name}={json.dumps(getattr(obj, f.name), default=str)}" for f in dataclasses.fields(cls)]
        lines += textwrap.wrap(" ".join(items), width=110, initial_indent=f"  {name}: ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines)

RANK_ERROR_GRACE_S = 10.0  # how long a rank > 0 lets rank 0 report a shared configuration error


def _cmd_train(args) -> int:
    recipe = _recipe(args)
    if args.print_config:
        print(dump_recipe(recipe, full=True), end="")
        return 0
    history = train(recipe)
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        torch.distributed.destroy_process_group()
        if rank:
            return 0
    if not history:
        print("done: nothing to do, the checkpoint already covers train.steps")
        return 0
    first, last = history[0], history[-1]
    print(f"done: loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(history)} steps"
          f" ({last.get('skipped_steps', 0)} skipped)")
    return 0


def _cmd_recipes(args) -> int:
    if args.dump:
        recipe = load_recipe(args.dump) if args.dump.endswith(".toml") else get_recipe(args.dump)
        print(dump_recipe(recipe, full=args.full), end="")
        return 0
    print(f"{'recipe':<22} {'params':>9} {'active':>9}  {'layout':<28} description")
    for name, build in RECIPES.items():
        r = build()
        size = model_size(r.model)
        p = r.parallel
        layout = f"tp{p.tp} cp{p.cp} ep{p.ep} etp{p.etp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else "")
        print(f"{name:<22} {_human(size.total):>9} {_human(size.active):>9}  {layout:<28} {r.description}")
    return 0


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_env() -> str:
    """`moetron env`: every optional backend and permute implementation, available or why not."""
    rows = [f"{'backend':<20} {'available':<10} reason"]
    rows += [f"{s.name:<20} {'yes' if s.available else 'no':<10} {s.reason}" for s in backend_status()]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows += [f"{'permute:' + name:<20} {'yes' if ok else 'no':<10} {why}"
             for name, ok, why in impl_status(device, build=False)]
    return "\n".join(rows)


def _cmd_env(args) -> int:
    print(format_env())
    return 0


def _cmd_data(args) -> int:
    """`moetron data prepare ...` and `moetron data info FOLDER`."""
    try:
        if args.data_command == "info":
            c = PreparedCorpus(args.folder)
            m = c.meta
            print(f"{c.path}: {c.num_documents:,} documents, {c.num_tokens:,} tokens ({m['dtype']}), vocabulary "
                  f"{c.vocab_size:,}, separator {m['separator']!r} = {c.separator_id}, "
                  f"{len(m.get('sources', []))} source file(s), prepared {m.get('created', '?')}")
            return 0
        summary = prepare(args.inputs, args.tokenizer, args.output, text_key=args.text_key, text_mode=args.text_mode,
                          input_fmt=args.format, separator=args.separator, overwrite=args.overwrite,
                          errors=args.errors, batch_docs=args.batch_docs)
        print(summary.format())
        return 0
    except (ImportError, OSError, ValueError) as exc:
        print(f"moetron data {args.data_command}: error: {exc}", file=sys.stderr)
        return 2


def _add_data_parser(sub) -> None:
    p_data = sub.add_parser("data", help="prepare real training data (tokenize text/JSONL into a packed token file)")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p_prep = data_sub.add_parser(
        "prepare", help="tokenize text / JSONL files with a Hugging Face tokenizer.json into a prepared folder",
        description="Tokenize text and JSONL files (optionally .gz; folders are searched recursively) into "
                    "FOLDER/tokens.bin + doc_index.bin + meta.json, streaming, written atomically. "
                    "Train on it with --set train.data=FOLDER.")
    p_prep.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders (.jsonl/.ndjson/.json = JSONL)")
    p_prep.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json (or a folder holding one)")
    p_prep.add_argument("--output", "-o", required=True, help="the folder to create")
    p_prep.add_argument("--text-key", default="text", help="JSONL field holding the text (default: text)")
    p_prep.add_argument("--text-mode", choices=["file", "line", "paragraph"], default="file",
                        help="what a document is in a text file: the whole file (default), each line, "
                             "or each blank-line-separated paragraph")
    p_prep.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto",
                        help="input format (default: by file suffix)")
    p_prep.add_argument("--separator", help="end-of-document token (default: the tokenizer's <|endoftext|>, </s>, ...)")
    p_prep.add_argument("--errors", choices=["strict", "replace"], default="strict",
                        help="invalid UTF-8: fail naming file and line (default), or replace with U+FFFD")
    p_prep.add_argument("--batch-docs", type=int, default=1024, help="documents tokenized per batch (default 1024)")
    p_prep.add_argument("--overwrite", action="store_true", help="replace an existing prepared folder")
    p_info = data_sub.add_parser("info", help="summarize a prepared folder")
    p_info.add_argument("folder")
    p_data.set_defaults(func=_cmd_data)


def _size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[:-len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 1048576)")


def _cmd_convert(args) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.direction == "moetron-to-hf":
        if world > 1:
            raise ValueError("moetron-to-hf runs in one process (the checkpoint is layout-independent and is "
                             "streamed tensor by tensor); run it without torchrun")
        summary = moetron_to_hf(args.src, args.dst, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                fused_experts=args.fused_experts, overwrite=args.overwrite, progress=not args.quiet)
        print(format_summary(summary))
        return 0
    parallel = ParallelConfig(tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp, vpp=args.vpp, layout=args.layout,
                              schedule=args.schedule)
    ps = init_from_env(parallel) if world > 1 else None
    rank = 0
    try:
        summary = hf_to_moetron(args.src, args.dst, parallel=parallel, dtype=args.dtype, overwrite=args.overwrite,
                                allow_nonfinite=args.allow_nonfinite,
                                progress=not args.quiet, file_bytes=args.file_size, parallel_state=ps)
    finally:
        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            torch.distributed.destroy_process_group()
    if rank:
        return 0
    print(format_summary(summary))
    if world == 1 and math.prod((args.tp, args.ep, args.etp, args.pp)) > 1:
        print("  (one process: the layout was validated; the checkpoint is layout-independent, and "
              "`moetron train` loads it under any layout)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moetron", description="Train Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a recipe (default: the tiny Qwen3-MoE proxy on built-in data)",
                             epilog=_fields_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p_train.add_argument("--recipe", default=None, help=f"recipe name (default {DEFAULT_RECIPE}; `moetron recipes`)")
    p_train.add_argument("--config", metavar="FILE.toml", help="a recipe file (e.g. recipes/qwen3-moe-tiny.toml)")
    p_train.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                         help="override a field, e.g. --set train.steps=20 --set model.num_layers=2")
    p_train.add_argument("--hf", metavar="DIR", help="start from this Hugging Face folder: its config.json is the "
                         "model (short for --set train.init_hf=DIR)")
    p_train.add_argument("--print-config", action="store_true", help="print the resolved recipe as TOML and exit")
    p_train.set_defaults(func=_cmd_train)
    p_rec = sub.add_parser("recipes", help="list recipes with sizes and default layouts, or print one as TOML")
    p_rec.add_argument("--dump", metavar="NAME|FILE.toml", help="print this recipe as TOML (a file to edit)")
    p_rec.add_argument("--full", action="store_true", help="with --dump: every field, not only the set ones")
    p_rec.set_defaults(func=_cmd_recipes)
    sub.add_parser("env", help="show which backends are available and why not").set_defaults(func=_cmd_env)
    p_conv = sub.add_parser("convert", help="convert checkpoints between Hugging Face and moetron")
    directions = p_conv.add_subparsers(dest="direction", required=True)
    h2m = directions.add_parser(
        "hf-to-moetron", help="a Hugging Face folder -> a moetron checkpoint (SAVE_DIR) that `moetron train` "
        "resumes from (--set train.save_dir=DST --set train.resume=true); under torchrun each rank converts "
        "its own shards of the layout")
    h2m.add_argument("src", help="Hugging Face folder (config.json + safetensors)")
    h2m.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    for flag in ("tp", "ep", "etp", "pp", "vpp"):
        h2m.add_argument(f"--{flag}", type=int, default=1, help=f"parallel.{flag} of the layout")
    h2m.add_argument("--layout", default=None, help="pipeline layout string (parallel.layout)")
    h2m.add_argument("--schedule", default="1f1b", help="pipeline schedule (parallel.schedule)")
    h2m.add_argument("--dtype", choices=["keep", "fp32", "bf16"], default="keep",
                     help="stored dtype (keep: as in the source; FP8 sources are dequantized to bf16)")
    h2m.add_argument("--file-size", type=_size, default=None, help="largest output file per rank, e.g. 4GB")
    h2m.add_argument("--allow-nonfinite", action="store_true", help="convert weights holding NaN/inf (refused otherwise)")
    m2h = directions.add_parser("moetron-to-hf", help="a moetron checkpoint (any layout) -> a Hugging Face folder")
    m2h.add_argument("src", help="checkpoint folder (with meta.json) or a save_dir (uses its latest)")
    m2h.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    m2h.add_argument("--dtype", choices=["keep", "fp32", "bf16", "fp8"], default="keep",
                     help="fp8: E4M3 projections with 128x128 block scales, the rest bf16")
    m2h.add_argument("--max-shard-size", type=_size, default=5 * 1024**3, help="largest output shard (default 5GiB)")
    m2h.add_argument("--fused-experts", action="store_true", help="write experts as 3-D fused tensors")
    for p in (h2m, m2h):
        p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    p_conv.set_defaults(func=_cmd_convert)
    _add_data_parser(sub)
    plan_cli.add_parser(sub)
    sub.add_parser("simulate", add_help=False, help="simulate a pipeline schedule, draw its timeline (--png)")
    p_ck = sub.add_parser("checkpoint", help="checkpoint tools").add_subparsers(dest="checkpoint_command", required=True)
    p_ver = p_ck.add_parser("verify", help="check meta.json and every file's checksum (a checkpoint or a save_dir)")
    p_ver.add_argument("path")
    p_ver.set_defaults(func=lambda args: verify_command(args.path))
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:  # its own parser (moetron/pipeline/simulator.py)
        simulate_main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return args.func(args)
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops training at the next step boundary)
        if rank == 0:
            print(f"moetron {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, NotImplementedError, FileNotFoundError, FileExistsError) as exc:
        # Under torchrun every rank reaches the same configuration error: rank 0 says it, once. An
        # error raised after the process group is up may be one rank's own: the others say it too.
        if rank == 0:
            print(f"moetron {args.command}: error: {exc}", file=sys.stderr)
        else:
            if not torch.distributed.is_initialized():
                # The same error on rank 0 ends the job (torchrun stops this rank) once rank 0 has said
                # it; exiting first would let torchrun stop rank 0 before it could. Only an error of this
                # rank's own (a file missing on its node) outlives the wait, and is said by this rank.
                time.sleep(RANK_ERROR_GRACE_S)
            print(f"moetron {args.command}: error (rank {rank}): {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
