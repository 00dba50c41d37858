import dataclasses
import itertools
import random
import struct
import zlib

import pytest

from moetron.pipeline.schedules import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    ScheduleError,
    build_schedule,
    validate_schedule,
)
from moetron.pipeline.simulator import main, simulate


def grid():
    """(name, pp, microbatches, vpp) for every size each schedule accepts, small enough to be fast."""
    for pp, m in itertools.product(range(1, 7), range(1, 15)):
        yield "1f1b", pp, m, None
        yield "zb1p", pp, m, None
        for v in (1, 2, 3):
            if v == 1 or m >= pp:
                yield "interleaved", pp, m, v
        if m >= 2 * pp:  # DualPipeV: odd counts too, as DeepSeek's reference
            yield "dualpipev", pp, m, None
        if m % 2 == 0 and m >= 2 * pp and pp % 2 == 0:
            yield "dualpipe", pp, m, None


def test_every_schedule_is_consistent_over_a_grid():
    seen = set()
    for name, pp, m, vpp in grid():
        schedule = build_schedule(name, pp=pp, microbatches=m, vpp=vpp)
        validate_schedule(schedule)
        seen.add(name)
        stages = schedule.num_stages
        # Independent count: each rank runs one F and one B per (micro-batch, stage) it holds.
        for rank, actions in enumerate(schedule.rank_actions):
            parts = [p for a in actions for p in a.parts()]
            held = len(schedule.stages_of_rank(rank)) * (m if name != "dualpipe" else m // 2)
            assert sum(p.kind == "F" for p in parts) == held
            assert sum(p.kind == "B" for p in parts) == held
            assert all(p.stage in schedule.stages_of_rank(rank) for p in parts if name != "dualpipe")
        assert stages == {"interleaved": pp * (vpp or 1), "dualpipev": 2 * pp}.get(name, pp)
    assert seen == set(SCHEDULES)


def test_one_f_one_b_action_order():
    schedule = build_schedule("1f1b", pp=3, microbatches=4)
    assert [str(a) for a in schedule.rank_actions[0]] == [
        "F0@s0", "F1@s0", "F2@s0", "B0@s0", "F3@s0", "B1@s0", "B2@s0", "B3@s0"]
    assert [str(a) for a in schedule.rank_actions[2]] == [
        "F0@s2", "B0@s2", "F1@s2", "B1@s2", "F2@s2", "B2@s2", "F3@s2", "B3@s2"]


def test_dualpipev_places_a_v_and_overlaps_pairs():
    schedule = build_schedule("dualpipev", pp=4, microbatches=10)
    assert schedule.stages_of_rank(1) == [1, 6]
    assert schedule.rank_of(6, 0) == 1 and schedule.chunk_of(6, 0) == 1
    kinds = {a.kind for actions in schedule.rank_actions for a in actions}
    assert kinds == {"F", "B", "W", "FB"}
    fb = next(a for a in schedule.rank_actions[0] if a.kind == "FB")
    forward, backward = fb.parts()
    assert forward.kind == "F" and backward.kind == "B" and not backward.split_backward
    assert (forward.microbatch, forward.stage) != (backward.microbatch, backward.stage)


def test_dualpipe_micro_batches_enter_from_both_ends():
    schedule = build_schedule("dualpipe", pp=4, microbatches=8)
    def entering(rank):
        parts = [p for a in schedule.rank_actions[rank] for p in a.parts()]
        return {p.microbatch for p in parts if p.kind == "F" and p.stage == 0}

    first, last = entering(0), entering(3)
    assert first == {0, 1, 2, 3} and last == {4, 5, 6, 7}
    assert schedule.stages_of_rank(1) == [1, 2]


@pytest.mark.parametrize(
    "name, pp, m, vpp, fragment",
    [
        ("dualpipe", 3, 12, None, "even pp"),
        ("dualpipe", 4, 7, None, "even number of micro-batches >= 2*pp"),
        ("dualpipe", 4, 6, None, "even number of micro-batches >= 2*pp"),
        ("dualpipev", 4, 6, None, "microbatches >= 2*pp"),
        ("dualpipev", 2, 3, None, "microbatches >= 2*pp"),
        ("interleaved", 4, 3, 2, "microbatches=3 must be >= pp=4"),
        ("interleaved", 4, 8, 0, "vpp=0 must be >= 1"),
        ("1f1b", 4, 8, 2, "only the interleaved schedule takes vpp"),
        ("1f1b", 0, 8, None, "must be >= 1"),
        ("gpipe", 4, 8, None, "unknown schedule 'gpipe'"),
    ],
)
def test_impossible_sizes_are_refused(name, pp, m, vpp, fragment):
    with pytest.raises(ScheduleError, match=fragment.replace("*", r"\*")):
        build_schedule(name, pp=pp, microbatches=m, vpp=vpp)


def replace_rank(schedule, rank, actions):
    lists = list(schedule.rank_actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(schedule, rank_actions=tuple(lists))


def test_validator_rejects_broken_lists():
    good = build_schedule("1f1b", pp=2, microbatches=2)
    rank1 = list(good.rank_actions[1])  # F0 B0 F1 B1
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(replace_rank(good, 1, [rank1[1], rank1[0], *rank1[2:]]))
    with pytest.raises(ScheduleError, match="no B for micro-batch 1 at stage 1"):
        validate_schedule(replace_rank(good, 1, rank1[:3]))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate_schedule(replace_rank(good, 1, rank1 + [rank1[0]]))
    with pytest.raises(ScheduleError, match="lives on rank 0"):
        validate_schedule(replace_rank(good, 1, rank1 + [Action("W", 0, 0, 0)]))
    split = [dataclasses.replace(a, split_backward=a.kind == "B") for a in rank1]
    with pytest.raises(ScheduleError, match="split backward and no W"):
        validate_schedule(replace_rank(good, 1, split))
    # An overlapped pair whose forward needs its own backward's input cannot run.
    pair = Action("FB", 1, 1, 0, backward_microbatch=1, backward_stage=1, backward_chunk=0)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(replace_rank(good, 1, [rank1[0], rank1[1], pair]))


# ---------------------------------------------------------------------------------- simulator


def costs(seed):
    rng = random.Random(seed)
    return rng.randint(1, 4), rng.randint(1, 4), rng.randint(0, 3)


def test_simple_timeline_by_hand():
    result = simulate("1f1b", pp=2, microbatches=2, F=1, B=2)
    assert result.to_text().splitlines()[:2] == ["rank  0 |F0F1....B0==..B1==", "rank  1 |..F0B0==F1B1=="]
    assert result.makespan == 9 and result.bubble == [3, 3] and result.busy == [6, 6]
    assert [(e.start, e.end, str(e.action)) for e in result.timeline if e.rank == 1] == [
        (1, 2, "F0@s1"), (2, 4, "B0@s1"), (4, 5, "F1@s1"), (5, 7, "B1@s1")]


@pytest.mark.parametrize("seed", range(4))
def test_1f1b_bubble_and_memory(seed):
    F, B, W = costs(seed)
    for pp, m in itertools.product([1, 2, 3, 4, 6], [1, 3, 4, 8, 13]):
        result = simulate("1f1b", pp=pp, microbatches=m, F=F, B=B, W=W)
        assert result.bubble == [(pp - 1) * (F + B + W)] * pp  # any m, B + W being the full backward
        assert result.bubble_fraction == pytest.approx((pp - 1) / m)
        assert result.peak_activations == [min(pp - r, m) for r in range(pp)]


def test_comm_delays_cross_rank_inputs_by_hand():
    result = simulate("1f1b", pp=2, microbatches=2, F=1, B=2, comm=0.5)
    assert [(e.start, e.end) for e in result.timeline if e.rank == 1] == [(1.5, 2.5), (2.5, 4.5), (4.5, 5.5), (5.5, 7.5)]
    assert [(e.start, e.end) for e in result.timeline if e.rank == 0] == [(0, 1), (1, 2), (5, 7), (8, 10)]
    assert result.makespan == 10 and result.bubble == [4, 4]


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_bubble(seed):
    """(1/v)(PP-1)/m, exact here for every m >= PP (per virtual stage costs F and B)."""
    F, B, W = costs(seed)
    for pp, m, v in itertools.product([2, 3, 4], [4, 5, 8, 9, 12], [1, 2, 3]):
        if m < pp:
            continue
        result = simulate("interleaved", pp=pp, microbatches=m, vpp=v, F=F, B=B, W=W)
        assert result.bubble == [(pp - 1) * (F + B + W)] * pp
        assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m))


@pytest.mark.parametrize("seed", range(6))
def test_zb1p_bubble(seed):
    """(PP-1)(F+B-2W) with B the full backward, when m >= PP and W <= min(F, input-grad B)."""
    rng = random.Random(seed)
    F, B = rng.randint(1, 4), rng.randint(1, 4)
    W = rng.randint(0, min(F, B))
    for pp, m in itertools.product([2, 3, 4, 6], [6, 8, 11]):
        result = simulate("zb1p", pp=pp, microbatches=m, F=F, B=B, W=W)
        assert result.bubble == [(pp - 1) * (F + (B + W) - 2 * W)] * pp
        assert result.peak_activations[0] == pp  # same memory as 1F1B
        one_f_one_b = simulate("1f1b", pp=pp, microbatches=m, F=F, B=B, W=W)
        assert result.makespan <= one_f_one_b.makespan


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("seed", range(4))
def test_dualpipe_bubble_and_memory(name, seed):
    """(PP/2-1)(F&B+B-3W), PP = stages, B full backward; exact when the forward and the
    input-grad backward cost the same, W <= F and F&B = F + B (no overlap gain)."""
    rng = random.Random(seed)
    F = rng.randint(1, 4)
    W = rng.randint(0, F)
    for pp, m in itertools.product([2, 4, 6], [12, 14, 18]):
        result = simulate(name, pp=pp, microbatches=m, F=F, B=F, W=W)
        stages = result.schedule.num_stages
        full_b = F + W
        assert result.bubble == [(stages // 2 - 1) * ((F + full_b) + full_b - 3 * W)] * pp
        assert result.peak_activations == [stages + 1] * pp


def test_overlap_makes_pairs_cheaper():
    plain = simulate("dualpipev", pp=4, microbatches=12, F=2, B=2, W=1)
    hidden = simulate("dualpipev", pp=4, microbatches=12, F=2, B=2, W=1, overlap=1.0)
    pairs = [e for e in hidden.timeline if e.action.kind == "FB"]
    assert pairs and all(e.end - e.start == max(2, 3) for e in pairs)
    assert hidden.makespan < plain.makespan
    explicit = simulate("dualpipev", pp=4, microbatches=12, F=2, B=2, W=1, FB=3.0)
    assert explicit.makespan == hidden.makespan


def test_simulator_respects_dependencies():
    result = simulate("interleaved", pp=3, microbatches=6, vpp=2, F=1.5, B=2.5, W=0.5, comm=0.25)
    finish = {}
    schedule = result.schedule
    for e in result.timeline:
        for part in e.action.parts():
            finish[(part.kind, part.microbatch, part.stage)] = (e.rank, e.end)
    for e in result.timeline:
        for part in e.action.parts():
            for dep in schedule.dependencies(part):
                rank, end = finish[dep]
                assert e.start >= end + (0.25 if rank != e.rank else 0) - 1e-9
    by_rank = {}
    for e in result.timeline:
        by_rank.setdefault(e.rank, []).append(e)
    for entries in by_rank.values():
        assert all(a.end <= b.start + 1e-9 for a, b in zip(entries, entries[1:]))


def test_png_is_a_valid_image(tmp_path):
    result = simulate("1f1b", pp=2, microbatches=2, F=1, B=2)
    path = tmp_path / "timeline.png"
    result.to_png(str(path), pixels_per_unit=10, row_height=12)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (92, 26)
    length = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41 : 41 + length])
    assert len(raw) == height * (1 + 3 * width)
    row = raw[(1 + 3 * width) * 2 : (1 + 3 * width) * 3]  # y=2, inside rank 0's row
    assert row[1 + 3 * 2 : 1 + 3 * 3] == bytes((70, 130, 220))  # F0 starts at x=1
    assert row[1 + 3 * 40 : 1 + 3 * 41] == b"\xff\xff\xff"  # rank 0 idles during [2, 4)


def test_command_line(capsys, tmp_path):
    png = tmp_path / "t.png"
    main(["--schedule", "zb1p", "--pp", "4", "--microbatches", "8", "--B", "1", "--W", "1", "--png", str(png)])
    out = capsys.readouterr().out
    assert "rank  3 |" in out and "bubble per rank: 3 3 3 3" in out and png.exists()


def test_command_line_states_the_rule(capsys):
    with pytest.raises(SystemExit):
        main(["--schedule", "dualpipev", "--pp", "4", "--microbatches", "6"])
    assert "microbatches >= 2*pp" in capsys.readouterr().err


def test_simulate_needs_sizes_for_a_name():
    with pytest.raises(ValueError, match="needs pp= and microbatches="):
        simulate("1f1b")
    schedule = build_schedule("1f1b", pp=2, microbatches=3)
    assert isinstance(schedule, PipelineSchedule)
    assert simulate(schedule).makespan == simulate("1f1b", pp=2, microbatches=3).makespan


# DualPipeV with odd micro-batch counts (DeepSeek's reference accepts any count >= 2 * devices), run by
# the pipeline runtime on 2 gloo ranks against the same model in one process (test_pipeline_runtime.py).
ODD_DUALPIPEV = {
    "deepseek_dualpipev_5": ("deepseek", "dualpipev", 5, None, "E|tt|t|mL", {"fb_overlap": "moe"}),
    "qwen_dualpipev_9": ("qwen", "dualpipev", 9, None, None, {}),
}


def test_dualpipev_odd_microbatches_match_one_process():
    from dist_utils import run_distributed
    from test_pipeline_runtime import _check_coverage, _run_cases

    for m in (5, 9):  # the per-rank order past the count check: every F and B of both stages, once
        schedule = build_schedule("dualpipev", pp=2, microbatches=m)
        validate_schedule(schedule)
    results = run_distributed(_run_cases, 2, ODD_DUALPIPEV, timeout=240)
    _check_coverage(results, ODD_DUALPIPEV)
