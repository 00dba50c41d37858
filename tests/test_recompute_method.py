"""`model.recompute_method` = uniform | block with `model.recompute_num_layers` (Megatron-Core's names).

block recomputes the first N decoder layers of each block (the model, or each pipeline stage);
uniform recomputes every layer. Checked: which layers rerun their forward in backward (counted by a
hook on each layer's attention), and that the gradients are bit-identical to no recomputation.
"""

import pytest
import torch

from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.pipeline.layout import parse_layout
from moetron.pipeline.schedules import build_schedule
from moetron.pipeline.stage import build_stage_modules

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TINY = dict(family="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_kv_heads=2,
            head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=4, top_k=2)


def _grads_and_calls(**recompute):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**TINY, **recompute))
    calls = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 12), generator=gen)
    model(x, labels=torch.randint(0, 64, (2, 12), generator=gen)).total_loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


@pytest.mark.parametrize("recompute,reruns", [
    (dict(recompute_method="block", recompute_num_layers=2), [2, 2, 1, 1]),
    (dict(recompute_method="block", recompute_num_layers=9), [2, 2, 2, 2]),
    (dict(recompute_method="uniform", recompute_num_layers=2), [2, 2, 2, 2]),
])
def test_recompute_method_reruns_the_right_layers_with_identical_gradients(recompute, reruns):
    want, calls = _grads_and_calls()
    assert calls == [1, 1, 1, 1]
    got, calls = _grads_and_calls(**recompute)
    assert calls == reruns
    assert sorted(got) == sorted(want) and len(want) > 10
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_block_counts_layers_per_pipeline_stage():
    """pp=2, two decoder layers per stage, N=1: the first layer of each stage (0 and 2)."""
    model = MoETransformer(ModelConfig(**TINY, recompute_method="block", recompute_num_layers=1))
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    layout = parse_layout("Ett|ttL", num_layers=4, mtp_layers=0, pp=2)
    for rank in (0, 1):
        build_stage_modules(model, layout, schedule, rank)
    assert [layer.recompute.full for layer in model.layers] == [True, False, True, False]


@pytest.mark.parametrize("fields,match", [
    (dict(recompute_method="every"), "choose uniform or block"),
    (dict(recompute_method="block"), "needs an integer >= 1"),
    (dict(recompute_num_layers=2), "needs model.recompute_method"),
    (dict(recompute_method="uniform", recompute_num_layers=1, recompute_every_n_layers=2), "set one of them"),
])
def test_recompute_method_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**TINY, **fields)
