"""Named process groups built from the two rank grids of a ParallelConfig.

`rank_groups` and `named_rank_groups` are pure (no processes) so layouts can be tested on their
own; `ParallelState` turns them into torch.distributed groups, or into size-1 stand-ins when
running in one process without torch.distributed at all.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetron.parallel.config import ParallelConfig, ParallelSizes

# name -> (grid, order names that vary inside one group). Creation follows this order on every
# rank, which torch.distributed.new_group requires.
GROUP_DIMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("attention", ("tp",)),
    "cp": ("attention", ("cp",)),
    "dp": ("attention", ("dp",)),
    "pp": ("attention", ("pp",)),
    "dp_cp": ("attention", ("cp", "dp")),  # gradient reduction for non-expert parameters
    "tp_cp": ("attention", ("tp", "cp")),
    "mp": ("attention", ("tp", "pp")),  # model parallel: grad-norm reduction
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "edp": ("expert", ("dp",)),  # gradient reduction for expert parameters
    "tp_ep": ("expert", ("tp", "ep")),  # ETP x EP as one group (flex dispatcher)
    "tp_ep_pp": ("expert", ("tp", "ep", "pp")),  # expert model parallel: grad-norm reduction
    "world": ("attention", ("tp", "cp", "dp", "pp")),
}


def rank_groups(
    sizes: Mapping[str, int], order: Sequence[str], dims: Sequence[str]
) -> list[list[int]]:
    """Partition range(prod(sizes)) into groups whose members differ only along `dims`.

    Ranks are laid out with order[0] varying fastest (Megatron-Core's RankGenerator). Groups are
    listed with the earliest fixed dimension varying fastest, members with the earliest varying
    dimension fastest, so group index and in-group rank follow the order string too.
    """
    strides, stride = {}, 1
    for name in order:
        strides[name] = stride
        stride *= sizes[name]
    fixed = [n for n in order if n not in dims]
    varying = [n for n in order if n in dims]

    def coords(names):  # all coordinate tuples, first name fastest
        ranges = [range(sizes[n]) for n in reversed(names)]
        return [tuple(reversed(c)) for c in itertools.product(*ranges)]

    groups = []
    for base in coords(fixed):
        start = sum(c * strides[n] for n, c in zip(fixed, base))
        groups.append(
            [start + sum(c * strides[n] for n, c in zip(varying, off)) for off in coords(varying)]
        )
    return groups


def named_rank_groups(sizes: ParallelSizes) -> dict[str, list[list[int]]]:
    """Every named group of the layout as global-rank lists, in creation order."""
    grids = {"attention": sizes.attention_grid(), "expert": sizes.expert_grid()}
    return {
        name: rank_groups(grids[grid], sizes.order, dims)
        for name, (grid, dims) in GROUP_DIMS.items()
    }


@dataclass(frozen=True)
class Group:
    """One named group as seen from this rank.

    handle is None only in single-process mode (no torch.distributed); collectives on a group of
    size 1 never communicate, so they never need it.
    """

    name: str
    ranks: tuple[int, ...]  # global ranks, in order of group rank
    rank: int  # this process's index in ranks
    handle: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)


class ParallelState:
    """Owns every named group of a layout; modules receive it (or a Group) explicitly."""

    tp: Group
    cp: Group
    dp: Group
    pp: Group
    dp_cp: Group
    tp_cp: Group
    mp: Group
    ep: Group
    etp: Group
    edp: Group
    tp_ep: Group
    tp_ep_pp: Group
    world: Group

    def __init__(self, sizes: ParallelSizes, rank: int, groups: Mapping[str, Group]):
        self.sizes = sizes
        self.rank = rank
        self.groups = dict(groups)
        for name, group in self.groups.items():
            setattr(self, name, group)

    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    @property
    def vpp(self) -> int:
        return self.sizes.vpp

    @property
    def sequence_parallel(self) -> bool:
        return self.sizes.sp

    def group(self, name: str) -> Group:
        try:
            return self.groups[name]
        except KeyError:
            raise KeyError(f"no process group named {name!r}; have {sorted(self.groups)}") from None

    @classmethod
    def single(cls, config: ParallelConfig | None = None) -> ParallelState:
        """One process, no torch.distributed: every group is this rank alone."""
        sizes = (config or ParallelConfig()).resolve(1)
        groups = {name: Group(name, (0,), 0, None) for name in GROUP_DIMS}
        return cls(sizes, 0, groups)

    @classmethod
    def build(cls, config: ParallelConfig) -> ParallelState:
        """Create every group on an initialised torch.distributed world (collective: all ranks)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call init_from_env() or use "
                "ParallelState.single() for one process"
            )
        sizes = config.resolve(dist.get_world_size())  # raises before any group is created
        rank = dist.get_rank()
        handles: dict[tuple[int, ...], dist.ProcessGroup] = {
            tuple(range(sizes.world_size)): dist.group.WORLD
        }
        groups = {}
        for name, rank_lists in named_rank_groups(sizes).items():
            for ranks in map(tuple, rank_lists):
                if ranks not in handles:  # identical rank lists share one communicator
                    handles[ranks] = dist.new_group(list(ranks))
                if rank in ranks:
                    groups[name] = Group(name, ranks, ranks.index(rank), handles[ranks])
        return cls(sizes, rank, groups)


def init_from_env(
    config: ParallelConfig, backend: str | None = None, timeout: timedelta | None = None
) -> ParallelState:
    """Initialise torch.distributed from torchrun's environment and build the groups.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun sets them for every
    node after rendezvous, so multi-node needs nothing more). Without WORLD_SIZE, or with
    WORLD_SIZE=1, it returns the single-process state and leaves torch.distributed alone.
    backend defaults to nccl when CUDA is available, else gloo.
    """
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return ParallelState.single(config)
        config.resolve(world_size)  # fail on a bad layout before touching the network
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    return ParallelState.build(config)
