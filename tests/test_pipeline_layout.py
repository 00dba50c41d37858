import itertools
import random
import re

import pytest

from moetron.recipes import get_recipe
from moetron.pipeline.layout import (
    ItemCosts,
    LayoutError,
    balanced_layout,
    item_costs,
    format_layout,
    parse_layout,
)


def stage_strings(layout):
    return ["".join(str(i)[0] for i in s.items) for s in layout.stages]


def test_deepseek_v3_layout_places_every_item():
    layout = parse_layout("Et*3|(tt|)*29m|L", num_layers=61, mtp_layers=1, pp=16, vpp=2)
    assert layout.num_stages == 32 and layout.num_virtual_stages == 2
    assert stage_strings(layout) == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    layers = [i for s in layout.stages for i in s.decoder_layers]
    assert layers == list(range(61))
    mtp_stage = layout.stages[30]
    assert (mtp_stage.pp_rank, mtp_stage.virtual_rank, mtp_stage.mtp_layers) == (14, 1, [0])
    assert layout.stages[31].has_loss and layout.stages[31].pp_rank == 15
    rank0 = layout.stages_for_rank(0)
    assert [s.index for s in rank0] == [0, 16]
    assert rank0[0].has_embedding and rank0[0].decoder_layers == [0, 1, 2]
    assert rank0[1].decoder_layers == [33, 34]


def test_whitespace_nesting_and_empty_stages():
    layout = parse_layout(" E ( t ( t t ) * 2 | ) * 2 m L ", num_layers=10, mtp_layers=1, pp=3)
    assert stage_strings(layout) == ["Ettttt", "ttttt", "mL"]
    assert layout.stages[1].decoder_layers == [5, 6, 7, 8, 9]
    empty = parse_layout("Et||tL", num_layers=2, pp=3)
    assert stage_strings(empty) == ["Et", "", "tL"]
    assert empty.stages[1].describe() == "(empty)"


def test_table_lists_each_rank():
    layout = parse_layout("Ett|tt|t|tL", num_layers=6, pp=2, vpp=2)
    lines = layout.table().splitlines()
    assert "pp=2, vpp=2, 4 stages" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "0", "0"), ("0", "1", "2"), ("1", "0", "1"), ("1", "1", "3")]
    assert "embedding, layers 0-1" in lines[2] and "layers 5, loss" in lines[5]
    assert str(layout) == layout.table()


@pytest.mark.parametrize(
    "text, fragment, caret",
    [
        ("Ett|tx|L", "unknown character 'x'", 5),
        ("Et(t|L", "'(' is never closed", 2),
        ("Ett)|L", "')' without a matching '('", 3),
        ("Et*|tL", "'*' must be followed by a repeat count", 2),
        ("Et*0|ttL", "repeat count 0", 3),
        ("*t", "'*' must follow", 0),
        ("tE|tL", "'E' must be the first item", 1),
        ("|Ett|L", "'E' must be the first item", 1),
        ("Et|Et|L", "a second 'E'", 3),
        ("EtL|tL", "more than one 'L'", 2),
        ("Ett|L|", "'L' must be the last item", 4),
        ("Etm|tL", "'t' after an MTP layer", 4),
    ],
)
def test_errors_point_at_the_character(text, fragment, caret):
    with pytest.raises(LayoutError) as info:
        parse_layout(text, num_layers=2, mtp_layers=text.count("m"), pp=2)
    message = str(info.value)
    assert fragment in message
    shown, pointer = message.splitlines()[-2:]
    assert shown.strip() == text and pointer.index("^") - shown.index(text[0]) == caret


@pytest.mark.parametrize(
    "text, kwargs, fragment",
    [
        ("Ett|L", dict(num_layers=3, pp=2), "2 decoder layers 't' but the model has num_layers=3"),
        ("Ett|L", dict(num_layers=2, mtp_layers=1, pp=2), "0 MTP layers 'm' but the model has mtp_layers=1"),
        ("Et|t|L", dict(num_layers=2, pp=2), "3 stages, not a multiple of pp=2"),
        ("Et|tL", dict(num_layers=2, pp=2, vpp=2), "2 stages but pp=2 x vpp=2 needs 4"),
        ("tt|L", dict(num_layers=2, pp=2), "no 'E'"),
        ("Et|t", dict(num_layers=2, pp=2), "no 'L'"),
        ("|", dict(num_layers=0, pp=2), "holds no items"),
    ],
)
def test_count_errors(text, kwargs, fragment):
    with pytest.raises(LayoutError, match=re.escape(fragment)):
        parse_layout(text, **kwargs)


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_format_layout_round_trips():
    stages = ["Ettt", "tt", "tt", "tt", "", "", "tm", "L"]
    text = format_layout(stages)
    assert text == "Et*3|(tt|)*3||tm|L"
    assert stage_strings(parse_layout(text, num_layers=10, mtp_layers=1, pp=4)) == stages


def brute_force_max(values, num_stages):
    """Smallest possible slowest stage over all contiguous partitions (E first, L last)."""
    n, best = len(values), float("inf")
    for cuts in itertools.combinations_with_replacement(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(values[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_layout_is_optimal_and_parses(seed):
    rng = random.Random(seed)
    num_layers, mtp, pp, vpp = rng.randint(2, 7), rng.randint(0, 1), rng.choice([1, 2, 3]), rng.choice([1, 2])
    costs = ItemCosts(
        embedding=rng.uniform(0, 2), layers=tuple(rng.uniform(0.5, 3) for _ in range(num_layers)),
        mtp=tuple(rng.uniform(1, 4) for _ in range(mtp)), loss=rng.uniform(0, 3),
    )
    text = balanced_layout(costs, pp=pp, vpp=vpp)
    layout = parse_layout(text, num_layers=num_layers, mtp_layers=mtp, pp=pp, vpp=vpp)
    cost_of = {"embedding": lambda i: costs.embedding, "decoder": lambda i: costs.layers[i],
               "mtp": lambda i: costs.mtp[i], "loss": lambda i: costs.loss}
    slowest = max(sum(cost_of[i.kind](i.index) for i in s.items) for s in layout.stages)
    values = [costs.embedding, *costs.layers, *costs.mtp, costs.loss]
    assert slowest == pytest.approx(brute_force_max(values, pp * vpp))


def test_balanced_layout_uniform_layers():
    costs = ItemCosts(embedding=0.0, layers=(1.0,) * 8, loss=0.0)
    assert balanced_layout(costs, pp=4) == "Ett|(tt|)*2ttL"
    assert balanced_layout(costs, pp=1) == "Et*8L"


def test_estimated_costs_reproduce_deepseek_v3_layout():
    """DeepSeek-V3's published PP16xVPP2 layout (REFERENCE §3) balances the FLOP estimate."""
    costs = item_costs(get_recipe("deepseek-v3-671b").model, seq_len=4096)
    assert len(costs.layers) == 61 and len(costs.mtp) == 1
    assert costs.layers[3] > costs.layers[0]  # MoE layers do more work per token than dense ones
    assert balanced_layout(costs, pp=16, vpp=2) == "Et*3|(tt|)*29m|L"


def test_memory_weight_moves_cost_to_parameters():
    cfg = get_recipe("qwen3-moe-tiny").model.replace(vocab_size=1000)
    time_only = item_costs(cfg, seq_len=32)
    with_memory = item_costs(cfg, seq_len=32, memory_weight=1.0)
    assert time_only.embedding < 0.01 < with_memory.embedding  # a lookup is cheap, its table is not
