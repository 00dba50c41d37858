"""ParallelConfig validation and the pure rank grids (no processes)."""

import itertools

import pytest

from moetron.parallel.config import ParallelConfig, validate_for_model
from moetron.parallel.state import GROUP_DIMS, ParallelState, named_rank_groups, rank_groups


def groups(config, world, name):
    return named_rank_groups(config.resolve(world))[name]


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0), r"tp=0 must be an integer >= 1"),
        (dict(cp=-1), r"cp=-1 must be"),
        (dict(ep=1.5), r"ep=1.5 must be"),
        (dict(etp=0), r"etp=0 must be"),
        (dict(pp=True), r"pp=True must be"),
        (dict(vpp=2), r"vpp=2 needs pipeline parallelism"),
        (dict(order="tp-cp-ep-dp"), r"order='tp-cp-ep-dp' must name each of tp-cp-ep-dp-pp"),
        (dict(order="tp-cp-ep-dp-pp-tp"), r"must name each"),
        (dict(order="tp-cp-xp-dp-pp"), r"must name each"),
        (dict(order="tp,cp,ep,dp,pp"), r"must name each"),
    ],
)
def test_invalid_fields_raise_when_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, world, match",
    [
        (dict(tp=2, cp=2, pp=2), 12, r"world_size=12 is not divisible by tp\*cp\*pp = 2\*2\*2 = 8"),
        (dict(tp=3), 8, r"world_size=8 is not divisible by tp\*cp\*pp = 3\*1\*1 = 3"),
        (dict(ep=3, etp=1), 8, r"world_size=8 is not divisible by etp\*ep\*pp = 1\*3\*1 = 3"),
        (dict(tp=2, ep=4), 4, r"etp\*ep\*pp = 2\*4\*1 = 8"),  # etp defaults to tp
        (dict(tp=2, etp=1, pp=2, order="tp-pp-cp-ep-dp"), 8, r"put.* tp before pp.*2 ranks.*1"),
        (dict(), 0, r"world_size=0 must be"),
    ],
)
def test_invalid_world_raises(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs).resolve(world)


def test_resolve_derives_dp_and_edp():
    sizes = ParallelConfig(tp=2, cp=2, pp=2, ep=4, etp=1).resolve(32)
    assert (sizes.dp, sizes.edp) == (32 // 8, 32 // 8)
    sizes = ParallelConfig(tp=4, ep=2, etp=2).resolve(16)
    assert (sizes.tp, sizes.etp, sizes.dp, sizes.edp) == (4, 2, 4, 4)
    assert ParallelConfig(tp=2).etp == 2


def test_sequence_parallel_is_a_no_op_without_tp():
    assert not ParallelConfig(sp=True).sequence_parallel
    assert not ParallelConfig(sp=True).resolve(4).sp
    assert ParallelConfig(tp=2, sp=True).resolve(4).sp


@pytest.mark.parametrize(
    "parallel, model, match",
    [
        (dict(tp=3), dict(num_attention_heads=16), r"tp=3 does not divide num_attention_heads=16"),
        (dict(tp=4), dict(num_kv_heads=6), r"tp=4 and num_kv_heads=6"),
        (dict(ep=3), dict(num_experts=8), r"ep=3 does not divide num_experts=8"),
        (dict(tp=2, etp=4), dict(moe_ffn_hidden_size=6),
         r"etp=4 does not divide moe_ffn_hidden_size=6"),
        (dict(tp=4), dict(ffn_hidden_size=10), r"tp=4 does not divide ffn_hidden_size=10"),
        (dict(pp=2, vpp=2, schedule="interleaved"), dict(num_layers=6), r"pp\*vpp = 2\*2 = 4 does not divide num_layers=6"),
        (dict(cp=2), dict(seq_length=6), r"2\*cp = 4 does not divide seq_length=6"),
        (dict(tp=4, cp=2, sp=True), dict(seq_length=20),
         r"tp=4 does not divide the per-cp-rank sequence 20//2 = 10"),
    ],
)
def test_model_validation_names_the_rule(parallel, model, match):
    with pytest.raises(ValueError, match=match):
        validate_for_model(ParallelConfig(**parallel), **{"num_attention_heads": 16, **model})


def test_model_validation_accepts_good_shapes():
    # kv heads fewer than tp are replicated; uneven layers are fine with a layout string.
    validate_for_model(
        ParallelConfig(tp=4, ep=8, etp=1, pp=2, cp=2, sp=True), num_attention_heads=32,
        num_kv_heads=2, num_experts=64, moe_ffn_hidden_size=96, ffn_hidden_size=512,
        num_layers=7, seq_length=64, custom_pipeline_layout=True,
    )


# ---- rank grids ----------------------------------------------------------------------------------


def test_world8_tp2_pp2_ep4_by_hand():
    grids = named_rank_groups(ParallelConfig(tp=2, pp=2, ep=4, etp=1).resolve(8))
    # attention rank = tp + 2*dp + 4*pp; expert rank = ep + 4*pp (etp = edp = 1)
    assert grids["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grids["cp"] == [[r] for r in range(8)]
    assert grids["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grids["dp_cp"] == grids["dp"]
    assert grids["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grids["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grids["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grids["tp_ep"] == grids["ep"]
    assert grids["etp"] == [[r] for r in range(8)]
    assert grids["edp"] == [[r] for r in range(8)]
    assert grids["tp_ep_pp"] == [list(range(8))]
    assert grids["world"] == [list(range(8))]


def test_world8_tp2_cp2_ep2_by_hand():
    grids = named_rank_groups(ParallelConfig(tp=2, cp=2, ep=2).resolve(8))
    # attention rank = tp + 2*cp + 4*dp; expert rank = etp + 2*ep + 4*edp
    assert grids["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grids["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grids["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grids["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grids["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grids["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grids["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grids["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grids["tp_ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_world8_custom_order_by_hand():
    # order dp first: attention rank = dp + 4*tp; expert rank = edp + 4*ep
    grids = named_rank_groups(ParallelConfig(tp=2, ep=2, etp=1, order="dp-tp-cp-ep-pp").resolve(8))
    assert grids["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grids["tp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grids["edp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grids["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


LAYOUTS = [
    (16, dict(tp=2, cp=2, pp=2, ep=2, etp=1)),
    (16, dict(tp=2, pp=2, ep=8, etp=1)),
    (24, dict(tp=2, cp=3, ep=4, etp=2, order="tp-ep-cp-dp-pp")),
    (8, dict(tp=2, pp=2, order="pp-tp-cp-ep-dp", ep=2)),
]


@pytest.mark.parametrize("world, kwargs", LAYOUTS)
def test_groups_are_exactly_the_coordinate_slices(world, kwargs):
    """Independent check: decode every rank into grid coordinates by brute force, then a group is
    exactly the set of ranks that agree on every coordinate outside the group's dimensions."""
    sizes = ParallelConfig(**kwargs).resolve(world)
    grids = {"attention": sizes.attention_grid(), "expert": sizes.expert_grid()}
    coords = {}
    for grid, dim_sizes in grids.items():
        # enumerate coordinates with the first order name fastest -> rank = enumeration index
        names = sizes.order
        ranges = [range(dim_sizes[n]) for n in reversed(names)]
        coords[grid] = [dict(zip(reversed(names), c)) for c in itertools.product(*ranges)]
    named = named_rank_groups(sizes)
    for name, (grid, dims) in GROUP_DIMS.items():
        expected = {}
        for rank, c in enumerate(coords[grid]):
            key = tuple(c[n] for n in sizes.order if n not in dims)
            expected.setdefault(key, set()).add(rank)
        assert sorted(map(sorted, named[name])) == sorted(map(sorted, expected.values())), name
    # both grids place every rank on the same pipeline stage
    stages = [[c["pp"] for c in coords[g]] for g in grids]
    assert stages[0] == stages[1]


def test_rank_groups_member_order_follows_order_string():
    # members: first order name fastest, regardless of how dims are listed
    assert rank_groups({"a": 2, "b": 3}, ["a", "b"], ["b", "a"]) == [[0, 1, 2, 3, 4, 5]]
    assert rank_groups({"a": 2, "b": 3}, ["b", "a"], ["a"]) == [[0, 3], [1, 4], [2, 5]]


def test_single_process_state_needs_no_distributed():
    import torch.distributed as dist

    state = ParallelState.single(ParallelConfig(sp=True))
    assert not dist.is_initialized()
    for name in GROUP_DIMS:
        g = state.group(name)
        assert (g.ranks, g.rank, g.size, g.handle) == ((0,), 0, 1, None)
    assert state.tp is state.group("tp") and state.world_size == 1
    with pytest.raises(ValueError, match="world_size=1 is not divisible by tp"):
        ParallelState.single(ParallelConfig(tp=2))
    with pytest.raises(KeyError, match="no process group named 'xp'"):
        state.group("xp")
