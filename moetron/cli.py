"""The `moetron` command: train, list recipes, and report the environment."""

from __future__ import annotations

import argparse
import sys

import torch

from moetron.recipes.catalog import DEFAULT_RECIPE


def _cmd_train(args) -> int:
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    recipe = apply_overrides(get_recipe(args.recipe), args.set or [])
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
    print(f"done: loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(history)} steps")
    return 0


def _cmd_recipes(args) -> int:
    from moetron.model.size import model_size
    from moetron.recipes import RECIPES

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


def _cmd_env(args) -> int:
    from moetron.backends import format_env

    print(format_env())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moetron", description="Train Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a recipe (default: the tiny Qwen3-MoE proxy on built-in data)")
    p_train.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe name (default {DEFAULT_RECIPE})")
    p_train.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                         help="override a field, e.g. --set train.steps=20 --set model.num_layers=2")
    p_train.set_defaults(func=_cmd_train)
    sub.add_parser("recipes", help="list recipes with sizes and default layouts").set_defaults(func=_cmd_recipes)
    sub.add_parser("env", help="show which backends are available and why not").set_defaults(func=_cmd_env)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"moetron {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
