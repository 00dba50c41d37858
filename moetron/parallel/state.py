"""Named process groups built from the two rank grids of a ParallelConfig.

`rank_groups` and `named_rank_groups` are pure (no processes) so layouts can be tested on their
own; `ParallelState` turns them into torch.distributed groups, or into size-1 stand-ins when
running in one process without torch.distributed at all.

Failures: every group waits at most the world's timeout (`init_from_env(timeout=...)`), so a rank
that dies or hangs makes the others fail instead of waiting forever, and `collective_failures`
turns gloo's bare "Timed out waiting 3000ms for recv operation" into a `CollectiveError` that
names the collective, where it ran and the rank. (NCCL's watchdog aborts the process on a
timeout itself, logging the operation.)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetron.parallel.config import ParallelConfig, ParallelSizes

log = logging.getLogger(__name__)

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
    groups = {
        name: rank_groups(grids[grid], sizes.order, dims)
        for name, (grid, dims) in GROUP_DIMS.items()
    }
    if sizes.hierarchical_cp:  # cp_comm_type=a2a+p2p: all-to-all over consecutive CP ranks, a ring across
        a, p = sizes.hierarchical_cp
        groups["cp_a2a"] = [cp[o * a:(o + 1) * a] for cp in groups["cp"] for o in range(p)]
        groups["cp_p2p"] = [cp[r::a] for cp in groups["cp"] for r in range(a)]
    return groups


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
    def build(cls, config: ParallelConfig, timeout: timedelta | None = None) -> ParallelState:
        """Create every group on an initialised torch.distributed world (collective: all ranks).

        The groups' collectives give up after `timeout`, by default the world's (torch's
        `new_group` would otherwise fall back to its 30-minute default, whatever the world has).
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call init_from_env() or use "
                "ParallelState.single() for one process"
            )
        sizes = config.resolve(dist.get_world_size())  # raises before any group is created
        rank = dist.get_rank()
        timeout = timeout or group_timeout(dist.group.WORLD)
        handles: dict[tuple[int, ...], dist.ProcessGroup] = {
            tuple(range(sizes.world_size)): dist.group.WORLD
        }
        groups = {}
        for name, rank_lists in named_rank_groups(sizes).items():
            for ranks in map(tuple, rank_lists):
                if ranks not in handles:  # identical rank lists share one communicator
                    handles[ranks] = dist.new_group(list(ranks), timeout=timeout)
                if rank in ranks:
                    groups[name] = Group(name, ranks, ranks.index(rank), handles[ranks])
        return cls(sizes, rank, groups)

    def set_timeout(self, timeout: timedelta) -> None:
        """Make every group's later collectives give up after `timeout` (collective-free)."""
        handles = {id(g.handle): g.handle for g in self.groups.values() if g.handle is not None}
        for handle in handles.values():
            _set_group_timeout(handle, timeout)


def group_timeout(handle: dist.ProcessGroup) -> timedelta | None:
    """The timeout `handle` was created with, or None where torch does not expose it."""
    try:
        device = torch.device("cuda" if dist.get_backend(handle) == "nccl" else "cpu")
        return handle._get_backend(device).options._timeout  # private: torch has no public getter
    except Exception:  # noqa: BLE001 - an older/newer torch: fall back to torch's default
        return None


def _set_group_timeout(handle: dist.ProcessGroup, timeout: timedelta) -> None:
    setter = getattr(handle, "set_timeout", None)
    if setter is None:
        warnings.warn(f"this torch ({torch.__version__}) cannot change the timeout of a process group after it "
                      f"was created, so {timeout} does not apply to it; initialise torch.distributed with the "
                      "timeout, or let moetron do it (launch with torchrun)", stacklevel=3)
        return
    setter(timeout)


def init_process_group_from_env(
    config: ParallelConfig, backend: str | None = None, timeout: timedelta | None = None
) -> bool:
    """Initialise torch.distributed from torchrun's environment; False when this is one process.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun sets them for every
    node after rendezvous, so multi-node needs nothing more). backend defaults to nccl when CUDA
    is available, else gloo. `timeout` bounds every collective: a rank that dies or hangs makes
    the others fail after it instead of waiting forever. When torch.distributed is already
    initialised, only the world's timeout is changed (when given).
    """
    if dist.is_initialized():
        if timeout is not None:
            _set_group_timeout(dist.group.WORLD, timeout)
        return True
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return False
    config.resolve(world_size)  # fail on a bad layout before touching the network
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    return True


def init_from_env(
    config: ParallelConfig, backend: str | None = None, timeout: timedelta | None = None
) -> ParallelState:
    """`init_process_group_from_env`, then every named group (or the single-process state).

    Without WORLD_SIZE, or with WORLD_SIZE=1, it returns the single-process state and leaves
    torch.distributed alone. The groups inherit the world's timeout.
    """
    if not init_process_group_from_env(config, backend, timeout):
        return ParallelState.single(config)
    return ParallelState.build(config, timeout)


# ---- failures of collectives -------------------------------------------------------------------


class CollectiveError(RuntimeError):
    """A collective failed or timed out on this rank, most likely because another rank died or hangs."""


class _FailedCollectives(logging.Handler):
    """Catches torch's own record of a failing c10d call (function name, group size).

    torch.distributed logs every exception of a public collective (all_reduce, all_to_all_single,
    barrier, ...) to its c10d logger at debug level, whatever name the caller bound the function
    to; gloo's exception itself ("Timed out waiting 5000ms for recv operation") names neither.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last: dict | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and "func_name" in record.msg:
            self.last = record.msg

    def describe(self) -> str | None:
        if self.last is None:
            return None
        m = self.last
        size = f" over a group of {m['group_size']} ranks" if "group_size" in m else ""
        return f"the collective {m['func_name']}{size}"


def _c10d_logger() -> logging.Logger | None:
    try:
        from torch.distributed.c10d_logger import _c10d_logger  # private, hence optional
    except ImportError:
        return None
    return _c10d_logger if isinstance(_c10d_logger, logging.Logger) else None


def _is_communication_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return "gloo" in text or "nccl" in text


class _WaitLogger:
    """Logs every `interval` seconds that the block is still running (a collective waiting for a
    rank that died or hangs), naming the rank and `where`, until the block ends or times out."""

    def __init__(self, where: str, rank: int, interval: float, hint: str):
        self.where, self.rank, self.interval, self.hint = where, rank, interval, hint
        self.start = time.monotonic()
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()
        self._arm()

    def _arm(self) -> None:
        self.timer = threading.Timer(self.interval, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.timer is None:
                return
            log.warning("rank %d: still waiting after %.0f s %s: a collective is waiting for another rank (or "
                        "the work is unusually slow). %s", self.rank, time.monotonic() - self.start, self.where,
                        self.hint)
            self._arm()

    def stop(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None


@contextlib.contextmanager
def collective_failures(where: str, *, rank: int, hint: str = "", wait_log_s: float | None = None):
    """Re-raise a communication failure inside the block as a `CollectiveError` that says which
    collective failed (when torch reports it; else that an asynchronous one did), `where`
    (e.g. "in the forward/backward pass of step 3"), on which rank, and `hint`. With
    `wait_log_s`, a block still running after that many seconds logs so (once per interval).

    Other exceptions pass through unchanged.
    """
    seen = _FailedCollectives()
    logger = _c10d_logger()
    if logger is not None:
        logger.addHandler(seen)
    waiting = _WaitLogger(where, rank, wait_log_s, hint) if wait_log_s else None
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        if seen.last is None and not _is_communication_failure(exc):
            raise
        what = seen.describe() or "a collective or point-to-point transfer (awaited asynchronously)"
        raise CollectiveError(f"rank {rank}: {what} {where} failed: another rank has probably died or hangs "
                              f"(see its log). {hint + ' ' if hint else ''}[{type(exc).__name__}: {exc}]") from exc
    finally:
        if waiting is not None:
            waiting.stop()
        if logger is not None:
            logger.removeHandler(seen)
