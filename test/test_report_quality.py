"""The dry-run report's plan quality (torch_tp.report.quality): per block, the fractions of the
linear parameters and of the matmul FLOPs a plan shards, and each module computed whole with
why; auto()'s ReplicatedModulesWarning carries the same. The expected numbers are computed
here from the model's shapes, apart from the report's trace."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from foreign_models import MODELS as FOREIGN

from torch_tp import ColwiseParallel, ReplicateParallel, RowwiseParallel
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans import auto
from torch_tp.plans.auto import ReplicatedModulesWarning
from torch_tp.plans.llama import llama_plan
from torch_tp.report import plan_report
from torch_tp.report.quality import block_of

BATCH, SEQ = 2, 16


def _llama() -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig(n_layers=2))


def _blocks(report) -> dict:
    return {q.block: q for q in report.quality}


def _linear_flops(layer: nn.Linear) -> int:
    return 2 * BATCH * SEQ * layer.in_features * layer.out_features


def _attention_flops(model: Llama) -> int:
    # q @ k^T and the scores @ v, over every query head (key/value heads repeated)
    attention = model.layers[0].attention
    heads, head_dim = model.config.n_heads, attention.wq.out_features // model.config.n_heads
    return 2 * 2 * BATCH * heads * SEQ * SEQ * head_dim


def test_the_reference_plan_shards_every_block_whole():
    report = plan_report(_llama(), llama_plan(), 2, batch_size=BATCH, seq_len=SEQ)
    blocks = _blocks(report)
    assert set(blocks) == {"layers.*", "(outside the blocks)"}
    for quality in blocks.values():
        assert quality.parameter_fraction == 1.0 and quality.flop_fraction == 1.0
        assert quality.whole == {}
    model = _llama()
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    # every layer of the block
    assert blocks["layers.*"].linear_parameters == sum(m.weight.numel() for m in linears)
    attention = len(model.layers) * _attention_flops(model)
    assert blocks["layers.*"].flops == sum(map(_linear_flops, linears)) + attention
    assert "Plan quality" in str(report) and "computed whole" not in str(report)


def test_an_attention_left_out_is_counted_and_named():
    plan = {k: v for k, v in llama_plan().items() if ".attention" not in k}
    report = plan_report(_llama(), plan, 2, batch_size=BATCH, seq_len=SEQ)
    quality = _blocks(report)["layers.*"]
    model = _llama()
    layers = list(model.layers)
    mlp = [m for layer in layers for m in layer.feed_forward.modules() if isinstance(m, nn.Linear)]
    attn = [m for layer in layers for m in layer.attention.modules() if isinstance(m, nn.Linear)]
    assert len(attn) == 4 * len(layers)  # wq, wk, wv, wo
    params = [m.weight.numel() for m in attn + mlp]
    assert quality.linear_parameters == sum(params)
    assert quality.sharded_parameters == sum(m.weight.numel() for m in mlp)
    sharded = sum(_linear_flops(m) for m in mlp)
    assert quality.sharded_flops == sharded
    whole = sum(map(_linear_flops, attn)) + len(layers) * _attention_flops(model)
    assert quality.flops == sharded + whole
    assert 0 < quality.flop_fraction < 1 and 0 < quality.parameter_fraction < 1
    assert quality.whole["layers.*.attention.wq"] == (
        "no style shards layers.*.attention.wq.weight: every rank holds and computes all of it"
    )
    assert "inputs are whole on every rank" in quality.whole["layers.*.attention"]
    text = str(report)
    assert "computed whole on every rank:" in text and "layers.*.attention.wo: no style" in text


class _OwnLinear(nn.Module):
    """A linear layer of its own, as reference implementations write it: F.linear on its own
    Parameter, no nn.Linear."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {"own": _OwnLinear(8, 8), "up": nn.Linear(8, 32), "down": nn.Linear(32, 8)}
            )
            for _ in range(3)
        )
        self.gate = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer["down"](layer["up"](layer["own"](x)).relu())
        return self.gate(x)


def test_linear_layers_of_any_kind_and_replicated_ones():
    with torch.device("meta"):
        model = _Blocks()
    plan = {
        "layers.*.up": ColwiseParallel(),
        "layers.*.down": RowwiseParallel(),
        "gate": ReplicateParallel(),
    }
    inputs = torch.empty(BATCH, SEQ, 8, device="meta")
    report = plan_report(model, plan, 2, batch_size=BATCH, seq_len=SEQ, example_inputs=inputs)
    blocks = _blocks(report)
    layer = blocks["layers.*"]
    own, planned = 3 * 8 * 8, 3 * (8 * 32 + 32 * 8)  # the three layers' weights
    assert (layer.linear_parameters, layer.sharded_parameters) == (own + planned, planned)
    # every product reads the same tokens: the FLOPs split as the weights do
    assert layer.flop_fraction == planned / (own + planned)
    assert layer.whole == {
        "layers.*.own": "no style shards layers.*.own.weight: every rank holds and computes "
        "all of it"
    }
    outside = blocks["(outside the blocks)"]
    assert outside.parameter_fraction == 0.0 and outside.flop_fraction == 0.0
    assert outside.whole == {
        "gate": 'its style, "replicate", keeps gate.weight whole (Replicate()) on every rank'
    }


def test_blocks_are_the_repeated_layers():
    assert block_of("model.layers.3.self_attn.q_proj") == "model.layers.*"
    assert block_of("encoder.block.0.layer.1.DenseReluDense") == "encoder.block.*"
    assert block_of("lm_head") == "(outside the blocks)"


@pytest.mark.parametrize("name", ["nanogpt", "timm_vit"])
def test_autos_warning_carries_the_quality(name):
    """A foreign model whose attention auto() computes whole: the warning says how much of
    each block is split, and names the attention."""
    foreign = FOREIGN[name]
    model = foreign.build()
    args, kwargs = foreign.inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto(model, tp_degree=2, example_inputs=args or None, example_kwargs=kwargs or None)
    (warning,) = [w.message for w in caught if isinstance(w.message, ReplicatedModulesWarning)]
    (block,) = [q for q in warning.quality if q.block != "(outside the blocks)"]
    assert block.parameter_fraction == 1.0  # the projections' weights are sharded
    assert 0 < block.flop_fraction < 1  # the attention's own products are not
    (attention,) = warning.modules
    assert (
        block.whole[attention]
        == "its inputs are whole on every rank: every rank computes all of it"
    )
    assert f"{block.block}: 100% of its linear parameters and {block.flop_fraction:.0%}" in str(
        warning
    )
