"""Run a function in N gloo processes on this machine, failing (not hanging) on any error.

Each spawn costs seconds, so a test should pass one function that runs many checks. Workers are
forked from a forkserver that has already imported torch and the package (PRELOAD), which makes
every spawn after the first much cheaper than a fresh interpreter per rank, and is safe because the
server itself never runs torch code (unlike forking the pytest process).
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the one forkserver of a test session imports before it forks any worker: torch (~4 CPU-s per
# process on 2 cores), and what nearly every test module imports (~1 s more). conftest.py sets it at
# start-up, so that it holds whichever test starts the server (the list is read only then).
PRELOAD = ["torch", "torch.distributed", "pytest", "moetron.cli", "moetron.train.trainer"]


def forkserver_context():
    """The "forkserver" context of every test that forks workers (run_distributed or its own)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(fn, rank, world_size, port, args, init, timeout, results):
    # The same variables torchrun sets, so code under test can use init_from_env.
    os.environ.update(
        CUDA_VISIBLE_DEVICES="",  # gloo ranks on the CPU, also on a GPU machine (train.device=auto)
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share a few cores
    try:
        if init:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init: bool = True,
) -> list[Any]:
    """Call fn(rank, world_size, *args) on every rank and return the results in rank order.

    fn must be a module-level (picklable) function. With init=True the gloo world is initialised
    first; with init=False only torchrun's environment variables are set. Raises AssertionError
    with the traceback of every failing rank, or when a rank dies or the run exceeds timeout.
    """
    ctx = forkserver_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(fn, rank, world_size, port, args, init, timeout, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
                (outputs if ok else failures)[rank] = value
                continue
            except queue.Empty:
                pass
            if failures:  # the others are probably blocked in a collective with the failed rank
                break
            dead = [
                r for r, p in enumerate(procs)
                if p.exitcode is not None and r not in outputs and results.empty()
            ]
            if dead:
                time.sleep(0.5)  # a result may still be in flight
                if results.empty():
                    for r in dead:
                        failures[r] = f"process exited with code {procs[r].exitcode} and no result"
                    break
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outputs]
                raise AssertionError(
                    f"ranks {missing} did not finish within {timeout:.0f}s (hang in a collective?)"
                )
        if failures:
            time.sleep(0.5)  # collect a root-cause failure that arrives just after the first
            while not results.empty():
                rank, ok, value = results.get_nowait()
                if not ok:
                    failures[rank] = value
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in failures and r not in outputs:
                    failures[r] = f"process exited with code {p.exitcode} and no result"
            # arrival order: the first failure is usually the cause, the rest its echoes
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
            raise AssertionError(
                f"{len(failures)} of {world_size} ranks failed (first reported first):\n{report}"
            )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    return [outputs[r] for r in range(world_size)]
