"""Training checkpoints: model, optimizer, step and RNG; saved by every rank, loaded under any layout.

    save_checkpoint(root, step, model, optimizer, recipe, parallel_state=ps, modules=stages)
    load_checkpoint(latest_checkpoint(root), model, optimizer, parallel_state=ps, modules=stages)

Design notes: docs/checkpoints.md (`moetron/checkpoint/training.py`).
"""

from __future__ import annotations

import warnings
import dataclasses
import json
import os
from pathlib import Path

import torch

from moetron.checkpoint.safetensors_io import CheckpointError
from moetron.precision.fp8_modules import fp8_state_dict, load_fp8_state_dict
from moetron.checkpoint.slices import SafetensorsFile, Entry, write_safetensors
from moetron.checkpoint.sharded import (
    FORMAT, META, VERSION, LocalTensor, RankWriter, StoreReader, _world, agree, all_gather_object, commit_folder,
    local_tensors, plan_writes, read_local, read_local_flat, read_meta, write_flat_range, write_local_boxes,
)
from moetron.checkpoint.commit import fault_point, write_durably
from moetron.checkpoint.dtensor import as_dtensor_like, local_part, local_shards
from moetron.checkpoint.save_dir import LATEST, mark_latest
from moetron.checkpoint.verify import nonfinite, seal_meta, verify_checkpoint
HYPER = ("lr", "betas", "eps", "weight_decay")
RNG_FILE = "rng.safetensors"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


# ---- optimizer adapters: torch AdamW (one process) and moetron's ZeRO-1 ---------------------


class _TorchOptimizer:
    """torch.optim.AdamW-like: per-parameter state with tensor slots and a `step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, local: dict[str, LocalTensor]):
        self.opt = optimizer
        self.name_of = {id(getattr(lt, "param", lt.tensor)): n for n, lt in local.items()}  # param: ZeRO-3's DTensor
        self.local = local
        self.slots = sorted({k for st in optimizer.state.values() for k, v in st.items()
                             if torch.is_tensor(v) and k != "step"})

    def params(self):
        for i, group in enumerate(self.opt.param_groups):
            for p in group["params"]:
                yield i, self.name_of[id(p)], p

    def ranges(self) -> dict[str, tuple[int, int]]:
        return {name: (0, self.local[name].tensor.numel()) for _, name, _ in self.params()}

    def slot_data(self, name: str) -> dict[str, tuple[torch.Tensor, int]]:
        lt = self.local[name]
        p = lt.tensor
        state = self.opt.state.get(getattr(lt, "param", p), {})
        return {s: ((local_part(state[s]) if s in state else torch.zeros_like(p)).detach().reshape(-1), 0) for s in self.slots}

    def meta(self) -> dict:
        groups, steps = [], {}
        for i, group in enumerate(self.opt.param_groups):
            names = [self.name_of[id(p)] for p in group["params"]]
            counts = [int(self.opt.state.get(p, {}).get("step", 0)) for p in group["params"]]
            step = max(counts, default=0)
            steps.update({n: c for n, c in zip(names, counts) if c != step})
            extras = {k: v for k, v in group.items() if k not in (*HYPER, "params") and _jsonable(v)}
            groups.append({**{k: _plain(group[k]) for k in HYPER}, "step": step, "params": names, "torch": extras})
        return {"param_groups": groups, "param_steps": steps}

    @torch.no_grad()
    def load(self, reader: StoreReader | None, saved: dict | None) -> None:
        if saved is None:
            self.opt.state.clear()  # a weights-only checkpoint: the optimizer starts fresh
            return
        member = _check_groups(saved, [(i, n) for i, n, _ in self.params()], len(self.opt.param_groups))
        for group, sg in zip(self.opt.param_groups, saved["param_groups"]):
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in sg.get("torch", {}).items()
                          if k in group})
            group.update({k: (tuple(sg[k]) if k == "betas" else sg[k]) for k in HYPER})
        self.opt.state.clear()
        steps = saved.get("param_steps", {})
        for i, name, p in self.params():
            step = steps.get(name, saved["param_groups"][member[name]]["step"])
            if not step:
                continue
            fused = any(g.get("fused") for g in self.opt.param_groups)  # fused AdamW keeps steps on the device
            state = {"step": torch.tensor(float(step), device=p.device if fused else "cpu")}
            for slot in reader.slots(name):
                if slot != "master":
                    value = read_local(reader, self.local[name], slot, dtype=p.dtype).to(p.device)
                    state[slot] = as_dtensor_like(value, p)
            self.opt.state[p] = state


class _ZeroOptimizer:
    """moetron.optim.DistributedOptimizer: this rank owns a flat range of some local parameters."""

    SLOTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer, local: dict[str, LocalTensor]):
        self.opt = optimizer
        by_id = {id(lt.tensor): n for n, lt in local.items()}
        self.name_of = {ddp_name: by_id[id(p)] for ddp_name, p in optimizer.ddp.named_parameters()}
        self.ddp_name = {n: d for d, n in self.name_of.items()}
        self.local = local
        self.state = optimizer.state_dict()  # this rank's pieces (cloned)

    def ranges(self) -> dict[str, tuple[int, int]]:
        return {self.name_of[d]: (pc["offset"], pc["offset"] + pc["numel"]) for d, pc in self.state["pieces"].items()}

    def slot_data(self, name: str) -> dict[str, tuple[torch.Tensor, int]]:
        piece = self.state["pieces"][self.ddp_name[name]]
        slots = list(self.SLOTS)
        if self.local[name].tensor.dtype != torch.float32:
            slots.append("master")
        return {s: (piece[s], piece["offset"]) for s in slots}

    def meta(self) -> dict:
        groups = [{**{k: _plain(g[k]) for k in HYPER}, "step": int(g["step"]),
                   "params": [self.name_of[d] for d in g["params"]]} for g in self.state["param_groups"]]
        return {"param_groups": groups, "param_steps": {}}

    @torch.no_grad()
    def load(self, reader: StoreReader | None, saved: dict | None) -> None:
        cur = self.state
        if saved is not None:
            pairs = [(i, self.name_of[d]) for i, g in enumerate(cur["param_groups"]) for d in g["params"]]
            _check_groups(saved, pairs, len(cur["param_groups"]))
            for g, sg in zip(cur["param_groups"], saved["param_groups"]):
                g.update({k: sg[k] for k in HYPER}, step=sg["step"])
        steps = [g["step"] for g in cur["param_groups"]]
        group_of = {self.name_of[d]: i for i, g in enumerate(cur["param_groups"]) for d in g["params"]}
        for ddp_name, piece in cur["pieces"].items():
            lt = self.local[self.name_of[ddp_name]]
            lo, hi = piece["offset"], piece["offset"] + piece["numel"]
            for slot in self.SLOTS:
                if saved is not None and reader.has(lt.name, slot):
                    piece[slot] = read_local_flat(reader, lt, lo, hi, slot, torch.float32)
                elif saved is None or not steps[group_of[lt.name]]:
                    piece[slot] = torch.zeros(hi - lo)  # no optimizer step taken yet
                else:
                    raise CheckpointError(f"{reader.folder}: no optimizer {slot!r} for {lt.name!r}, but its "
                                          f"param group has taken {steps[group_of[lt.name]]} steps")
            if saved is not None and reader.has(lt.name, "master"):
                piece["master"] = read_local_flat(reader, lt, lo, hi, "master", torch.float32)
            else:  # the parameter (just loaded) is the master weight
                piece["master"] = lt.tensor.detach().reshape(-1)[lo:hi].float()
        self.opt.load_state_dict(cur)


def _adapter(optimizer, local):
    if optimizer is None:
        return None
    if hasattr(optimizer, "ddp") and hasattr(optimizer, "shards"):
        return _ZeroOptimizer(optimizer, local)
    return _TorchOptimizer(optimizer, local)


def _check_groups(saved: dict, pairs: list[tuple[int, str]], count: int) -> dict[str, int]:
    groups = saved["param_groups"]
    if len(groups) != count:
        raise CheckpointError(f"checkpoint has {len(groups)} optimizer param groups, this optimizer {count}")
    member = {n: i for i, g in enumerate(groups) for n in g["params"]}
    wrong = [f"{n} (group {i} here, {member.get(n, 'none')} in the checkpoint)" for i, n in pairs if member.get(n) != i]
    if wrong:
        raise CheckpointError(f"optimizer param groups differ from the checkpoint's: {', '.join(wrong[:10])}")
    return member


def _plain(v):
    return list(v) if isinstance(v, tuple) else (float(v) if torch.is_tensor(v) else v)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


# ---- save -------------------------------------------------------------------------------------


def _layout(ps) -> dict:
    if ps is None:
        return {"world_size": 1}
    return {"world_size": ps.world_size, **{g: getattr(ps, g).size for g in ("tp", "cp", "dp", "pp", "ep", "etp")}}


def _recipe_json(recipe) -> dict | None:
    if recipe is None:
        return None
    return json.loads(json.dumps(dataclasses.asdict(recipe), default=str))


def _config_json(model) -> dict | None:
    cfg = getattr(model, "config", None)
    return None if cfg is None else json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer=None, recipe=None, *, parallel_state=None, modules=None,
                    extra_meta: dict | None = None) -> Path:
    """Write the state after `step` completed optimizer steps as `root/step-NNNNNNNN`; returns it.

    Collective when torch.distributed is initialised: every rank calls it with its own shards;
    `modules` are this rank's pipeline stage modules (default: the whole `model`).
    """
    root = Path(root)
    local = local_shards(local_tensors(modules or [model], parallel_state))
    opt = _adapter(optimizer, local)
    _refuse_nonfinite(local, opt, f"cannot save the checkpoint of step {step} to {root}")
    plan = plan_writes(local, None if opt is None else opt.ranges())
    rank, world = _world()

    def write(tmp: Path) -> dict:
        model_files = RankWriter(tmp, "model", rank, world)
        for name in plan.model:
            write_local_boxes(model_files, local[name])
        optim_files = RankWriter(tmp, "optimizer", rank, world)
        for name, lo, hi in plan.optimizer:
            for slot, (flat, flat_lo) in opt.slot_data(name).items():
                write_flat_range(optim_files, local[name], slot, flat, flat_lo, lo, hi)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        fp8 = _fp8_state(model)
        fp8_files, digests = [], {}
        if fp8:  # per-rank state (amax of this rank's shards and tokens): kept per rank
            fp8_files = ["fp8.safetensors" if world == 1 else f"fp8-{rank:05d}.safetensors"]
            digests[fp8_files[0]] = {}
            write_safetensors(tmp / fp8_files[0], [Entry(k, v.dtype, tuple(v.shape), lambda v=v: v)
                                                   for k, v in fp8.items()], digest=digests[fp8_files[0]])
        report = {"model": model_files.write(), "optimizer": optim_files.write(), "rng": rng, "fp8": fp8_files}
        report["checksums"] = {**digests, **model_files.digests, **optim_files.digests}
        return report

    def finish(tmp: Path, reports: list[dict]) -> None:
        rng = {k: torch.stack([r["rng"][k] for r in reports]) for k in reports[0]["rng"]}
        checksums = {name: d for r in reports for name, d in r["checksums"].items()}
        checksums[RNG_FILE] = {}
        write_safetensors(tmp / RNG_FILE, [Entry(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in rng.items()],
                          digest=checksums[RNG_FILE])
        meta = {"format": FORMAT, "version": VERSION, "step": step,
                "files": {"model": [f for r in reports for f in r["model"]],
                          "optimizer": [f for r in reports for f in r["optimizer"]],
                          "fp8": [f for r in reports for f in r["fp8"]], "rng": [RNG_FILE]},
                "tensors": plan.tensors, "optimizer": None if opt is None else opt.meta(),
                "layout": _layout(parallel_state), "model_config": _config_json(model),
                "recipe": _recipe_json(recipe), **(extra_meta or {}), "checksums": checksums}
        if opt is not None and world > 1:  # every rank's group lists hold only its own names
            meta["optimizer"] = _merge_groups([r["optimizer_meta"] for r in reports])
        write_durably(tmp / META, seal_meta(meta))

    def write_with_meta(tmp: Path) -> dict:
        report = write(tmp)
        if opt is not None and world > 1:
            report["optimizer_meta"] = opt.meta()
        return report

    target = _step_dir(root, step)

    def after() -> None:
        mark_latest(root, target.name)
        fault_point("latest")

    commit_folder(target, write_with_meta, finish, overwrite=True, after=after,
                  what=f"saving the checkpoint of step {step}")
    return target


def _refuse_nonfinite(local: dict[str, LocalTensor], opt, what: str) -> None:
    """Raise on every rank when any rank holds a NaN/inf parameter or optimizer state (named)."""
    named = [(name, lt.tensor) for name, lt in local.items()]
    if opt is not None:
        for name, lo, hi in [(n, lo, hi) for n, (lo, hi) in opt.ranges().items()]:
            for slot, (flat, flat_lo) in opt.slot_data(name).items():
                named.append((f"{name} (optimizer {slot})", flat[lo - flat_lo:hi - flat_lo]))
    bad = nonfinite(named)
    rank, world = _world()
    error = None
    if bad:
        error = (f"non-finite values (NaN/inf) in {len(bad)} tensor(s)" + (f" on rank {rank}" if world > 1 else "")
                 + f": {', '.join(bad[:8])}" + (" ..." if len(bad) > 8 else ""))
    agree(error, f"{what}; the previous checkpoint stays latest")


def _merge_groups(metas: list[dict]) -> dict:
    groups = [dict(g, params=[]) for g in metas[0]["param_groups"]]
    seen = [set() for _ in groups]
    for m in metas:
        for i, g in enumerate(m["param_groups"]):
            for n in g["params"]:
                if n not in seen[i]:
                    seen[i].add(n)
                    groups[i]["params"].append(n)
    return {"param_groups": groups, "param_steps": {}}


# ---- find and load ----------------------------------------------------------------------------


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    folder = Path(root) / marker.read_text().strip()
    if not (folder / META).exists():
        raise FileNotFoundError(f"{marker} points at {folder}, which is not a complete checkpoint")
    return folder


def load_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
                    parallel_state=None, modules=None, load_rng: bool = True, verify: bool = True) -> int:
    """Restore model, optimizer and RNG from `folder` (saved under any layout) into this rank's
    shards; returns the number of completed steps. Collective when torch.distributed is up.
    `verify`: check meta.json and every file's checksum first (`verify.verify_checkpoint`)."""
    folder = Path(folder)
    if not (folder / META).exists():
        raise FileNotFoundError(f"{folder}: checkpoint is incomplete, {META} is missing")
    meta = verify_checkpoint(folder) if verify else read_meta(folder)
    files = meta.get("files") or {"model": ["model.safetensors"], "optimizer": ["optimizer.safetensors"]}
    kinds = ["model"] + (["optimizer"] if optimizer is not None and meta.get("optimizer") else [])
    for kind in kinds:
        for name in files.get(kind, []):
            if not (folder / name).exists():
                raise FileNotFoundError(f"{folder}: checkpoint is incomplete, {name} is missing")
    reader = StoreReader(folder, {**meta, "files": files}, kinds)
    try:
        local = local_shards(local_tensors(modules or [model], parallel_state))
        load_model_tensors(reader, local, str(folder))
        opt = _adapter(optimizer, local)
        if opt is not None:
            error = None
            try:
                opt.load(reader, meta.get("optimizer"))
            except CheckpointError as exc:
                error = f"rank {_world()[0]}: {exc}"
                if _world()[1] == 1:
                    raise
            if _world()[1] > 1:
                agree(error, f"{folder}: the optimizer state does not fit")
            _refuse_nonfinite(local, _adapter(optimizer, local), f"{folder}: refusing the loaded optimizer state")
    finally:
        reader.close()
    if load_rng and (folder / RNG_FILE).exists():
        _restore_rng(folder / RNG_FILE)
    if files.get("fp8"):
        _restore_fp8(folder, files["fp8"], meta.get("layout"), _layout(parallel_state), model)
    return int(meta["step"])


def _fp8_state(model) -> dict[str, torch.Tensor]:
    """FP8 delayed-scaling amax histories (non-persistent buffers, so not in the state dict)."""

    return fp8_state_dict(model)


def _restore_fp8(folder: Path, names: list[str], saved_layout, layout, model) -> None:
    """Restore this rank's amax histories when the layout is unchanged; otherwise they restart
    (they are re-learned within one history length; the weights and optimizer are exact)."""
    if saved_layout != layout:
        warnings.warn(f"{folder}: FP8 amax histories were saved under layout {saved_layout} and are not "
                      f"restored under {layout}; delayed scaling restarts from fresh histories")
        return
    rank, world = _world()
    name = names[0] if world == 1 else f"fp8-{rank:05d}.safetensors"
    path = folder / name
    if not path.exists():
        raise FileNotFoundError(f"{folder}: checkpoint is incomplete, {name} is missing")
    f = SafetensorsFile(path)
    try:
        state = {k: f.read(k) for k in f.keys()}
    finally:
        f.close()

    load_fp8_state_dict(model, state)


def load_model_tensors(source, local: dict[str, LocalTensor], what: str) -> None:
    """Copy every local tensor's region out of `source` (a StoreReader, or anything with
    `names()`, `shape(name)` and `read(...)`), after checking that the names and full shapes of
    the model (over all ranks) and the source agree; one error lists every difference."""
    available = source.names()
    missing = sorted(n for n in local if n not in available)
    misshaped = [f"{n}: checkpoint {list(source.shape(n))}, model {list(lt.placement.global_shape)}"
                 for n, lt in local.items() if n in available and tuple(source.shape(n)) != lt.placement.global_shape]
    held = set().union(*all_gather_object(sorted(local)))
    unexpected = sorted(available - held)
    lines = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if items:
            more = " ..." if len(items) > 20 else ""
            lines.append(f"  {len(items)} {title} tensor(s): " + ", ".join(items[:20]) + more)
    rank, world = _world()
    error = None
    if lines:
        error = f"{what} does not fit this model" + (f" (rank {rank})" if world > 1 else "") + ":\n" + "\n".join(lines)
    if world == 1:
        if error:
            raise CheckpointError(error)
    else:
        agree(error, f"{what}: loading failed")
    error = None
    try:
        with torch.no_grad():
            for lt in local.values():
                lt.tensor.copy_(read_local(source, lt))
    except CheckpointError as exc:
        if world == 1:
            raise
        error = f"rank {rank}: {exc}"
    if world > 1:
        agree(error, f"{what}: reading failed")
    _refuse_nonfinite(local, None, f"{what}: refusing the loaded weights")


def _restore_rng(path: Path) -> None:
    f = SafetensorsFile(path)
    try:
        rank, world = _world()
        for key in f.keys():
            states = f.read(key)
            row = states[rank] if states.shape[0] == world else states[0]
            if key == "torch":
                torch.set_rng_state(row.clone())
            elif key == "cuda" and torch.cuda.is_available():
                torch.cuda.set_rng_state(row.clone())
    finally:
        f.close()
