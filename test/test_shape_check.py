"""The shape check (:mod:`torch_tp.shapes`): a plan's model traced on the meta device as
one device and as one rank, paired op by op; and where it runs (the report, ``plan_for``,
``parallelize_module(example_inputs=...)``)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_tp
from torch_tp import AttentionHeads, ColwiseParallel, PackedColwiseParallel, RowwiseParallel
from torch_tp.shapes import ShapeCheckError, check_shapes
from torch_tp.testing import run_distributed

EMBD, HEADS, B, T = 128, 4, 2, 16


class NanoAttention(nn.Module):
    """nanoGPT's ``CausalSelfAttention``: the width read from the input, the heads from an
    attribute. ``minus_one``: the common ``view(B, T, -1, C // n_head)`` variant."""

    def __init__(self, minus_one: bool = False) -> None:
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.n_head, self.n_embd, self.minus_one = HEADS, EMBD, minus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        if self.minus_one:
            q = q.view(B, T, -1, C // self.n_head).transpose(1, 2)  # view: minus one
            k = k.view(B, T, -1, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, -1, C // self.n_head).transpose(1, 2)
        else:
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # view: heads
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous()
        return self.c_proj(y.view(B, T, -1) if self.minus_one else y.view(B, T, C))


def nano_plan() -> dict:
    """What auto() proposed for nanoGPT (issue 23): the attributes divided, the packed
    projection split part by part."""
    return {
        "": AttentionHeads(num_heads="n_head", divide=("n_embd", "n_head")),
        "c_attn": PackedColwiseParallel(parts=3),
        "c_proj": RowwiseParallel(),
    }


def _line(marker: str) -> str:
    """``test_shape_check.py:<line>`` of the source line holding ``marker``."""
    lines, start = inspect.getsourcelines(NanoAttention)
    index = next(i for i, text in enumerate(lines) if marker in text)
    return f"test_shape_check.py:{start + index}"


def test_nanogpt_view_that_raises_on_a_rank_is_reported_with_its_source_line():
    problems = check_shapes(NanoAttention(), nano_plan(), 2, example_inputs=torch.randn(B, T, EMBD))
    assert len(problems) == 1
    (p,) = problems
    assert (p.module, p.op) == ("", "view")
    assert p.source.endswith(_line("# view: heads"))
    # one device: (B, T, 128) viewed as 4 heads of 32; a rank: its 64 features
    assert p.expected == (B, T, HEADS, EMBD // HEADS)
    assert p.found == (B, T, EMBD // 2)
    assert "raises on a rank" in str(p) and _line("# view: heads") in str(p)


def test_nanogpt_minus_one_view_is_caught_by_the_shapes_not_a_crash():
    model = NanoAttention(minus_one=True)
    problems = check_shapes(model, nano_plan(), 2, example_inputs=torch.randn(B, T, EMBD))
    assert problems, "the silently wrong variant was not reported"
    first = problems[0]
    assert first.op == "view" and first.source.endswith(_line("# view: minus one"))
    # 1 head of 64 on a rank where one device has 4 heads of 32 (2 per rank expected)
    assert (first.expected, first.found) == ((B, T, HEADS, 32), (B, T, 1, 64))
    assert "raises" not in first.message
    assert len(problems) == 3  # q, k and v; what follows from them is not reported again
    assert isinstance(model.c_attn.weight, nn.Parameter) and model.n_head == HEADS  # unchanged


def test_reference_llama_plans_report_nothing():
    from torch_tp.models import Llama, LlamaConfig
    from torch_tp.plans.llama import llama_plan

    llama = Llama(LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64))
    ids = torch.zeros(2, 8, dtype=torch.long)
    for sequence_parallel in (False, True):
        plan = llama_plan(sequence_parallel=sequence_parallel)
        assert check_shapes(llama, plan, 2, example_inputs=ids) == []


def test_transformers_llama_plan_reports_nothing():
    transformers = pytest.importorskip("transformers")
    from torch_tp.plans.hf import llama_plan as hf_llama_plan

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):  # any device: the check copies the model to meta
        hf = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert check_shapes(hf, hf_llama_plan(), 2, example_inputs={"input_ids": ids}) == []


class Block(nn.Module):
    """A layer of a stack (its ``layer_idx`` a position, as transformers' and Meta's layers
    keep it). ``reads_width``: it views its hidden features with the width it keeps as an
    attribute, which a column split does not divide (wrong on a rank); the same parameters
    either way."""

    calls = 0

    def __init__(self, layer_idx: int, reads_width: bool = False, config: object = None) -> None:
        super().__init__()
        self.layer_idx, self.reads_width, self.config = layer_idx, reads_width, config
        self.up = nn.Linear(EMBD, 4 * EMBD)
        self.down = nn.Linear(4 * EMBD, EMBD)
        self.hidden = 4 * EMBD
        self.act = F.gelu

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        type(self).calls += 1
        h = self.act(self.up(x))
        kinds = getattr(self.config, "kinds", None)
        if self.reads_width or wide or (kinds is not None and kinds[self.layer_idx] == "wide"):
            h = h.view(*h.shape[:-1], 4, self.hidden // 4).flatten(-2)  # view: width
        return x + self.down(h)


class Stack(nn.Module):
    """Layers in an ``nn.ModuleList``; ``wide_at``: the layer called with ``wide=True``."""

    def __init__(self, n: int, config: object = None, wide_at: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(i, config=config) for i in range(n))
        self.wide_at = wide_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, wide=i == self.wide_at)
        return x


def _wide_gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h).view(*h.shape[:-1], 4, EMBD).flatten(-2)  # view: width


STACK_PLAN = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}


def _check_stack(model: nn.Module) -> list:
    Block.calls = 0
    return check_shapes(model, STACK_PLAN, 2, example_inputs=torch.randn(B, T, EMBD))


def test_repeated_layers_are_traced_once_each_way():
    from torch_tp._repeats import repeated_blocks

    model = Stack(6)
    assert repeated_blocks(model) == {f"layers.{i}": "layers.0" for i in range(1, 6)}
    assert _check_stack(model) == []
    # as one device and as one rank: layers.0, and layers.1, the first whose input requires
    # grad (the example input does not); the other four replayed
    assert Block.calls == 4


def test_a_layer_unlike_the_first_is_traced_itself():
    """A layer whose attributes differ (``reads_width``; ``act``, another function), whose
    config entry at its position differs (``config.kinds``), or that is called with other
    inputs (``wide=True``) is traced: its problem is found, and named by its own path."""
    different = Stack(6)
    different.layers[4].reads_width = True
    other_function = Stack(4)
    other_function.layers[3].act = _wide_gelu
    config = type("Config", (), {})()
    config.kinds = ["plain", "plain", "plain", "wide", "plain"]
    by_config = Stack(5, config=config)
    by_input = Stack(6, wide_at=2)
    cases = (
        (different, "layers.4"),
        (other_function, "layers.3"),
        (by_config, "layers.3"),
        (by_input, "layers.2"),
    )
    for model, path in cases:
        problems = _check_stack(model)
        assert [(p.module, p.op) for p in problems] == [(path, "view")], path
        assert problems[0].found == (B, T, 2 * EMBD)  # a rank's half of the 512 features
        assert Block.calls > 4


def test_layers_planned_differently_are_not_alike():
    """Layers 1 and 2 are alike but for their plan (layer 2's ``down`` column-parallel, which
    cannot take the column-parallel ``up``'s shard): layer 2 is traced, not replayed from
    layer 1, so its problem is found."""
    from torch_tp._repeats import repeated_blocks
    from torch_tp.plan import resolve_plan

    model = Stack(3)
    plan = {"layers.*.up": ColwiseParallel(), "layers.[01].down": RowwiseParallel()}
    plan["layers.2.down"] = ColwiseParallel()
    styles = {id(e.module): e.style for e in resolve_plan(model, plan)}
    assert repeated_blocks(model, styles) == {"layers.1": "layers.0"}
    problems = check_shapes(model, plan, 2, example_inputs=torch.randn(B, T, EMBD))
    assert problems and problems[0].module == "layers.2.down", problems


class ReadsValues(nn.Module):
    """A forward that reads values (``.item()``, ``bool()``) and makes CPU scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.register_buffer("scale", torch.tensor(2.0))
        self.heads = 4

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = x[:, : int(lengths.max().item())] * torch.tensor(0.5) * self.scale
        if (x == 0).any():
            x = x + 1
        h = torch.relu(self.up(x))
        h = h.view(*h.shape[:-1], self.heads, -1)  # reads: heads
        return self.down(h.flatten(-2))


def test_models_that_read_values_or_hold_cpu_scalars_are_traced():
    inputs = (torch.randn(2, 8, 16), torch.tensor([8, 5]))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    # the attribute `heads` is not divided: 4 heads of 4 on a rank, where 2 of 8 are right
    (problem,) = check_shapes(ReadsValues(), plan, 2, example_inputs=inputs)
    assert problem.op == "view" and problem.found == (2, 1, 4, 4)
    plan[""] = AttentionHeads("heads", divide=("heads",))
    assert check_shapes(ReadsValues(), plan, 2, example_inputs=inputs) == []

    # nn.TransformerEncoder with a padding mask, in eval mode (its fast path reads the mask)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    mlp = {"layers.*.linear1": ColwiseParallel(), "layers.*.linear2": RowwiseParallel()}
    kwargs = {"src": torch.randn(2, 8, 64), "src_key_padding_mask": torch.zeros(2, 8).bool()}
    assert check_shapes(encoder, mlp, 2, example_inputs=kwargs) == []


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x[x.sum(-1) > 0])  # a shape that depends on the values


def test_a_forward_whose_shapes_depend_on_values_is_explained():
    with pytest.raises(ShapeCheckError) as caught:
        check_shapes(
            DataDependent(), {"up": ColwiseParallel()}, 2, example_inputs=torch.ones(2, 8, 16)
        )
    message = str(caught.value)
    line = inspect.getsourcelines(DataDependent.forward)[1] + 1
    assert f"test_shape_check.py:{line}" in message
    assert "boolean mask" in message and "check_parity" in message


def test_plan_report_includes_the_shape_problems():
    from torch_tp.report import plan_report

    with torch.device("meta"):
        model = NanoAttention(minus_one=True)
    report = plan_report(
        model,
        nano_plan(),
        2,
        batch_size=B,
        seq_len=T,
        example_inputs=torch.empty(B, T, EMBD, device="meta"),
    )
    shape_errors = [p for p in report.problems if p.severity == "error" and "view" in p.message]
    assert len(shape_errors) == 3
    assert _line("# view: minus one") in shape_errors[0].message


def test_plan_for_refuses_a_plan_that_fails_the_shape_check(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from torch_tp.plans import hf

    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config)
    assert hf.plan_for(model)  # its own plan passes
    right = hf.gpt2_plan

    def without_divide(*, base_model: bool = False) -> dict:
        plan = right(base_model=base_model)
        return {
            key: AttentionHeads("num_heads") if isinstance(style, AttentionHeads) else style
            for key, style in plan.items()
        }

    monkeypatch.setitem(hf.PLANS, "gpt2", without_divide)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn.*modeling_gpt2\.py:\d+"):
        hf.plan_for(model)


def _parallelize_checks_shapes_first():
    from helpers import tp_mesh

    model = NanoAttention(minus_one=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(B, T, EMBD)
    with pytest.raises(ValueError, match=r"(?s)shape check.*test_shape_check\.py:\d+.*view"):
        torch_tp.parallelize_module(model, tp_mesh(), nano_plan(), example_inputs=x)
    # nothing changed: plain parameters, the same values, the attributes undivided
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert (model.n_head, model.n_embd) == (HEADS, EMBD)
    # a plan that passes is applied
    mlp = nn.Sequential(nn.Linear(EMBD, 64), nn.ReLU(), nn.Linear(64, EMBD))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    torch_tp.parallelize_module(mlp, tp_mesh(), plan, example_inputs=x)
    assert mlp[0].weight.to_local().shape == (32, EMBD)


def test_parallelize_module_shape_check_refuses_before_anything_changes():
    run_distributed(_parallelize_checks_shapes_first, 2)
