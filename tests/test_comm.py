"""Autograd collectives and process groups, checked in spawned gloo worlds.

Every rank draws the inputs of all group members from one shared seed, so it can compute the
single-process reference (plain torch on the concatenated/summed data) and compare its own output
and gradient with it. The objective is the sum of every rank's loss, the contract comm.py assumes.
"""

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.testing import assert_close

from moetron.parallel import comm
from moetron.parallel.config import ParallelConfig
from moetron.parallel.state import Group, ParallelState, init_from_env, named_rank_groups


def draw(seed, count, shape):
    """count random tensors, identical on every rank that uses the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(count)]


def loss(y, w):  # nonlinear, so gradients depend on the forward values too
    return (torch.sin(y) * w).sum()


def leaves(tensors):
    return [t.clone().requires_grad_() for t in tensors]


def check_all_reduce(group, seed):
    n, i = group.size, group.rank
    xs, (w,) = draw(seed, n, (3, 5)), draw(seed + 1, 1, (3, 5))
    x = xs[i].clone().requires_grad_()
    y = comm.all_reduce(x, group)
    loss(y, w).backward()  # consumer replicated: every rank holds the same loss, counted once
    ref = leaves(xs)
    ref_y = sum(ref)
    loss(ref_y, w).backward()
    assert_close(y, ref_y)
    assert_close(x.grad, ref[i].grad)
    assert torch.equal(x.detach(), xs[i]), "all_reduce wrote into its input"


def check_copy_to_group(group, seed):
    n, i = group.size, group.rank
    (x0,), ws = draw(seed, 1, (4, 3)), draw(seed + 1, n, (4, 3))
    x = x0.clone().requires_grad_()
    y = comm.copy_to_group(x, group)
    loss(y, ws[i]).backward()
    ref = x0.clone().requires_grad_()
    sum(loss(ref, w) for w in ws).backward()
    assert_close(y, x0)
    assert_close(x.grad, ref.grad)


def check_all_gather(group, seed, dim, reduce_grad):
    n, i = group.size, group.rank
    xs = draw(seed, n, (2, 3, 4))
    full_shape = torch.cat(xs, dim).shape
    ws = draw(seed + 1, n, full_shape) if reduce_grad else draw(seed + 1, 1, full_shape) * n
    x = xs[i].clone().requires_grad_()
    y = comm.all_gather(x, group, dim, reduce_grad=reduce_grad)
    loss(y, ws[i]).backward()
    ref = leaves(xs)
    ref_y = torch.cat(ref, dim)
    if reduce_grad:  # each rank's consumer differs: objective is the sum
        sum(loss(ref_y, w) for w in ws).backward()
    else:  # replicated consumer: counted once
        loss(ref_y, ws[0]).backward()
    assert_close(y, ref_y)
    assert_close(x.grad, ref[i].grad)


def check_reduce_scatter(group, seed, dim):
    n, i = group.size, group.rank
    shape = [3, 5, 2]
    shape[dim] = 2 * n
    xs = draw(seed, n, shape)
    shard_shape = xs[0].chunk(n, dim)[0].shape
    ws = draw(seed + 1, n, shard_shape)
    x = xs[i].clone().requires_grad_()
    y = comm.reduce_scatter(x, group, dim)
    loss(y, ws[i]).backward()
    ref = leaves(xs)
    ref_shards = sum(ref).chunk(n, dim)
    sum(loss(s, w) for s, w in zip(ref_shards, ws)).backward()
    assert_close(y, ref_shards[i])
    assert_close(x.grad, ref[i].grad)


def check_split(group, seed, dim):
    n, i = group.size, group.rank
    shape = [2, 3]
    shape[dim] = 3 * n
    (x0,) = draw(seed, 1, shape)
    ws = draw(seed + 1, n, x0.chunk(n, dim)[0].shape)
    x = x0.clone().requires_grad_()
    y = comm.split(x, group, dim)
    loss(y, ws[i]).backward()
    ref = x0.clone().requires_grad_()
    sum(loss(s, w) for s, w in zip(ref.chunk(n, dim), ws)).backward()
    assert_close(y, x0.chunk(n, dim)[i])
    assert_close(x.grad, ref.grad)


def check_all_to_all(group, seed, use_async, even=False):
    n, i = group.size, group.rank
    g = torch.Generator().manual_seed(seed)
    # sends[r][s]: rows rank r sends to rank s; zeros included, and rank 0 sends nothing at all
    sends = torch.full((n, n), 2) if even else torch.randint(0, 4, (n, n), generator=g)
    if not even:
        sends[0] = 0
    sends = sends.tolist()
    xs = [torch.randn(sum(sends[r]), 6, generator=g) for r in range(n)]
    recv = [[sends[s][r] for s in range(n)] for r in range(n)]
    ws = [torch.randn(sum(recv[r]), 6, generator=g) for r in range(n)]

    x = xs[i].clone().requires_grad_()
    splits = (None, None) if even else (recv[i], sends[i])
    if use_async:
        pending = comm.all_to_all_async(x, group, *splits)
        _ = torch.randn(64, 64) @ torch.randn(64, 64)  # work overlapped with the exchange
        y = pending.wait()
    else:
        y = comm.all_to_all(x, group, *splits)
    loss(y, ws[i]).backward()

    ref = leaves(xs)
    blocks = [r.split(s) for r, s in zip(ref, sends)]  # blocks[s][r]: from s to r
    ref_ys = [torch.cat([blocks[s][r] for s in range(n)]) for r in range(n)]
    sum(loss(y_r, w) for y_r, w in zip(ref_ys, ws)).backward()
    assert_close(y, ref_ys[i])
    assert_close(x.grad, ref[i].grad)


def check_group(group, seed):
    check_all_reduce(group, seed)
    check_copy_to_group(group, seed + 10)
    for k, (dim, reduce_grad) in enumerate([(0, True), (1, True), (-1, True), (1, False)]):
        check_all_gather(group, seed + 20 + 2 * k, dim, reduce_grad)
    check_reduce_scatter(group, seed + 40, 0)
    check_reduce_scatter(group, seed + 42, 2)
    check_split(group, seed + 50, 1)
    check_all_to_all(group, seed + 60, use_async=False)
    check_all_to_all(group, seed + 62, use_async=True)
    check_all_to_all(group, seed + 64, use_async=False, even=True)


def collectives_worker(rank, world_size):
    state = ParallelState.build(ParallelConfig(tp=2))  # world 4: tp pairs, dp pairs, pp singles
    assert state.tp.size == 2 and state.dp.size == 2 and state.pp.size == 1
    assert state.pp.handle is not None
    for k, group in enumerate([state.world, state.tp, state.dp, state.pp]):
        check_group(group, seed=1000 * k + group.ranks[0])  # same on every member
    # a raw ProcessGroup is accepted too
    raw = Group("raw", tuple(range(world_size)), rank, dist.group.WORLD)
    x = torch.randn(2, 3)
    assert_close(comm.all_reduce(x, dist.group.WORLD), comm.all_reduce(x, raw))
    # size-1 groups are identities even with torch.distributed up
    x = torch.randn(4, 2, requires_grad=True)
    for fn in (comm.all_reduce, comm.copy_to_group, comm.all_gather, comm.reduce_scatter,
               comm.split, comm.all_to_all):
        assert fn(x, state.pp) is x
    assert comm.all_to_all_async(x, state.pp, [4], [4]).wait() is x
    return True


def test_collectives_forward_and_backward_in_4_ranks():
    assert run_distributed(collectives_worker, 4) == [True] * 4


CONFIGS = [
    dict(tp=2, pp=2, ep=4, etp=1),
    dict(tp=2, cp=2, ep=2),
    dict(tp=2, ep=2, etp=1, order="dp-tp-cp-ep-pp"),
    dict(ep=8, etp=1),
]


def groups_worker(rank, world_size):
    state = init_from_env(ParallelConfig(**CONFIGS[0]))  # torchrun-style env set by dist_utils
    assert dist.get_backend() == "gloo" and state.world_size == world_size
    for k, kwargs in enumerate(CONFIGS):
        if k:
            state = ParallelState.build(ParallelConfig(**kwargs))
        for name, rank_lists in named_rank_groups(state.sizes).items():
            (ranks,) = [r for r in rank_lists if rank in r]
            g = state.group(name)
            assert g.ranks == tuple(ranks), (kwargs, name, g.ranks, ranks)
            assert g.rank == ranks.index(rank) == dist.get_rank(g.handle), (kwargs, name)
            assert g.size == dist.get_world_size(g.handle), (kwargs, name)
            # each member adds a one-hot at its global rank: the sum marks exactly the members
            members = torch.zeros(world_size)
            members[rank] = 1.0
            dist.all_reduce(members, group=g.handle)
            assert members.nonzero().flatten().tolist() == sorted(ranks), (kwargs, name)
            assert members.sum().item() == len(ranks)
            total = comm.all_reduce(torch.tensor([float(rank)]), g)
            assert total.item() == sum(ranks), (kwargs, name)
    return True


def test_parallel_state_groups_in_8_ranks():
    assert run_distributed(groups_worker, 8, init=False) == [True] * 8


def test_bad_layout_fails_before_distributed_init(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="world_size=6 is not divisible by tp"):
        init_from_env(ParallelConfig(tp=4))
    assert not dist.is_initialized()


def test_single_process_collectives_are_identities(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    state = init_from_env(ParallelConfig())  # no WORLD_SIZE: no torch.distributed at all
    assert not dist.is_initialized()
    x = torch.randn(4, 6, requires_grad=True)
    for fn in (comm.all_reduce, comm.copy_to_group, comm.all_gather, comm.reduce_scatter,
               comm.split, comm.all_to_all):
        assert fn(x, state.tp) is x
    assert comm.all_to_all_async(x, state.ep, [4], [4]).wait() is x
    with pytest.raises(ValueError, match="receives what it sends"):
        comm.all_to_all(x, state.ep, [3], [4])


def test_argument_errors_raise_before_communicating():
    pair = Group("pair", (0, 1), 0, None)  # never reaches torch.distributed
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"dim 0 of shape \(5, 3\) is not divisible by .* size 2"):
        comm.reduce_scatter(x, pair)
    with pytest.raises(ValueError, match="input_split_sizes sum to 4 but x has 5 rows"):
        comm.all_to_all(x, pair, [1, 1], [2, 2])
    with pytest.raises(ValueError, match="has 3 entries for a group of 2"):
        comm.all_to_all(x, pair, [1, 1, 1], [2, 3])
    with pytest.raises(ValueError, match="pass both"):
        comm.all_to_all(x, pair, None, [2, 3])
    with pytest.raises(ValueError, match="even splits need x.shape"):
        comm.all_to_all_async(x, pair)
    with pytest.raises(TypeError, match="expected a moetron Group"):
        comm.all_reduce(x, None)


def failing_worker(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # the other ranks wait on rank 1 and never finish


def hanging_worker(rank, world_size):
    if rank == 0:
        time.sleep(60)  # never joins the barrier
    dist.barrier()


def test_run_distributed_reports_errors_and_hangs():
    with pytest.raises(AssertionError, match=r"(?s)--- rank 1 ---.*ValueError: rank one is broken"):
        run_distributed(failing_worker, 2)
    with pytest.raises(AssertionError, match=r"did not finish within 2s"):
        run_distributed(hanging_worker, 2, timeout=2)
