"""The first forward of a plan is shape-checked, with no ``example_inputs``.

A hand-written plan that ``parallelize_module`` accepts can still be wrong where the model's
own code meets it: an attention that views its projections with the whole model's head count
(``q.view(B, T, self.n_heads, self.head_dim)`` with column-parallel q/k/v), or an MLP with its
styles swapped. Before the first forward with each new input signature runs, its inputs are
traced on the meta device through a copy of the model taken before the plan was applied; a
plan the trace shows wrong is a ``ValueError`` on every rank, before any collective, naming the
module, its style, the user's source line, both shapes and the likely fix. Correct plans pass
(every parity test of the suite runs through this check), plans spread over several calls are
left alone, and ``check_forward=False`` / ``TORCH_TP_FORWARD_CHECK=0`` turn it off.
"""

from __future__ import annotations

import copy
import inspect
import os
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import reference_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing import assert_close

import torch_tp
from torch_tp import AttentionHeads, ColwiseParallel, RowwiseParallel, shapes
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

B, T, DIM, HEADS = 2, 8, 64, 4


class Attention(nn.Module):
    """Attention as a user writes it first: the head count from an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, DIM // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # view: heads
        k = self.k(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Config:
    def __init__(self) -> None:
        self.num_heads = HEADS


class ConfigAttention(Attention):
    """The head count read from a config object the modules share."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        del self.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads = self.config.num_heads
        q = self.q(x).view(b, t, heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, attention: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.attn, self.mlp = attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


ATTENTION_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.c_fc": ColwiseParallel(),
    "mlp.c_proj": RowwiseParallel(),
}


def _line(marker: str) -> str:
    lines, start = inspect.getsourcelines(Attention)
    index = next(i for i, text in enumerate(lines) if marker in text)
    return f"test_forward_check.py:{start + index}"


def _refusal(model: nn.Module, plan: dict, **kwargs) -> str:
    mesh = init_device_mesh(device_type(), (2,))
    torch_tp.parallelize_module(model, mesh, plan, **kwargs)
    with pytest.raises(ValueError) as info:
        model(torch.randn(B, T, DIM))
    return str(info.value)


def _natural_attention() -> dict:
    torch.manual_seed(0)
    message = _refusal(Block(), ATTENTION_PLAN)
    # the raw error it replaces, with the check off
    torch.manual_seed(0)
    unchecked = Block()
    mesh = init_device_mesh(device_type(), (2,))
    torch_tp.parallelize_module(unchecked, mesh, copy.deepcopy(ATTENTION_PLAN), check_forward=False)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        unchecked(torch.randn(B, T, DIM))
    # the fix it names: each rank's own head count, and the forward matches one device
    torch.manual_seed(0)
    reference = Block()
    model = copy.deepcopy(reference)
    fixed = {"attn": AttentionHeads("n_heads", divide=("n_heads",)), **ATTENTION_PLAN}
    torch_tp.parallelize_module(model, mesh, copy.deepcopy(fixed))
    x = torch.randn(B, T, DIM)
    assert_close(model(x), reference(x))
    return {"message": message}


def test_natural_attention_view_is_refused_at_the_first_forward_with_the_fix():
    results = run_distributed(_natural_attention, 2)
    message = results[0]["message"]
    assert results[1]["message"] == message  # every rank alike
    assert "first forward of Block" in message and "'attn'" in message, message
    assert _line("# view: heads") in message, message
    # the rank's (2, 8, 32) where one device views (2, 8, 64) as (2, 8, 4, 16)
    assert "(2, 8, 32)" in message and "(2, 8, 4, 16)" in message, message
    assert "'attn' (no style; planned inside it: q: ColwiseParallel, k:" in message, message
    assert "AttentionHeads('n_heads', divide=('n_heads',))" in message, message
    assert "n_heads is its own 2" in message and "-1 in its place" in message, message
    assert "check_forward=False" in message, message


def _config_attention() -> str:
    torch.manual_seed(0)
    plan = {k: v for k, v in ATTENTION_PLAN.items() if k not in ("attn.k", "attn.v")}
    return _refusal(Block(ConfigAttention), plan)


def test_a_head_count_from_the_config_suggests_minus_one():
    message = run_distributed(_config_attention, 2)[0]
    assert "config.num_heads" in message and "-1 in its place" in message, message
    assert "AttentionHeads(" not in message, message  # a shared config is not divided


def _swapped_mlp() -> str:
    torch.manual_seed(0)
    plan = {"mlp.c_fc": RowwiseParallel(), "mlp.c_proj": ColwiseParallel()}
    return _refusal(Block(), plan)


def test_swapped_mlp_styles_are_refused_with_the_layout_to_change():
    message = run_distributed(_swapped_mlp, 2)[0]
    assert "'mlp.c_fc' (RowwiseParallel) at" in message, message
    assert "has 64 features" in message and "takes 32 (of 64)" in message, message
    assert "input_layouts=Replicate()" in message, message


def _shard_dim_out_of_range() -> str:
    torch.manual_seed(0)
    return _refusal(MLP(), {"c_fc": ColwiseParallel(output_layouts=Shard(99))})


def test_an_output_layout_that_fits_no_dimension_is_refused_before_it_runs():
    message = run_distributed(_shard_dim_out_of_range, 2)[0]
    assert "planned inside it: c_fc: ColwiseParallel" in message, message
    assert "Shard(dim=99) does not fit the 3-D tensor" in message, message


class Cache:
    """An object among the inputs (a key-value cache): not traced."""


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        return self.block(x)


def _once_per_signature() -> dict:
    mesh = init_device_mesh(device_type(), (2,))
    torch.manual_seed(0)
    reference = Cached()
    model = copy.deepcopy(reference)
    plan = {f"block.{k}": v for k, v in ATTENTION_PLAN.items()}
    plan["block.attn"] = AttentionHeads("n_heads", divide=("n_heads",))
    torch_tp.parallelize_module(model, mesh, plan)
    calls = []
    real = shapes.check_shapes

    def counted(*args, **kwargs):
        calls.append(tuple(kwargs["example_inputs"][0].shape))
        return real(*args, **kwargs)

    counts = {}
    with mock.patch.object(shapes, "check_shapes", counted):
        for _ in range(3):
            x = torch.randn(B, T, DIM)
            assert_close(model(x), reference(x))
        counts["same shape, 3 calls"] = len(calls)
        model(torch.randn(B, 2 * T, DIM))
        counts["a new length"] = len(calls)
        model(torch.randn(B, 3 * T, DIM), cache=Cache())
        counts["with a cache object"] = len(calls)
        for t in range(1, 12):
            model(torch.randn(1, t, DIM))
        counts["after many lengths"] = len(calls)
        counts["hooks left"] = len(model._forward_pre_hooks)
    with mock.patch.dict(os.environ, {"TORCH_TP_FORWARD_CHECK": "0"}):
        off = Block()
        torch_tp.parallelize_module(off, mesh, copy.deepcopy(ATTENTION_PLAN))
        counts["env off, hooks"] = len(off._forward_pre_hooks)
    return counts


def test_the_check_runs_once_per_input_signature_and_then_goes():
    counts = run_distributed(_once_per_signature, 2)[0]
    assert counts == {
        "same shape, 3 calls": 1,
        "a new length": 2,
        "with a cache object": 2,
        "after many lengths": 8,
        "hooks left": 0,
        "env off, hooks": 0,
    }, counts


def _plan_over_two_calls() -> None:
    # each call's snapshot holds half the plan: its check must not refuse the whole
    mesh = init_device_mesh(device_type(), (2,))
    torch.manual_seed(0)
    reference = MLP()
    model = copy.deepcopy(reference)
    torch_tp.parallelize_module(model, mesh, {"c_fc": ColwiseParallel()})
    torch_tp.parallelize_module(model, mesh, {"c_proj": RowwiseParallel()})
    x = torch.randn(B, T, DIM)
    assert_close(model(x), reference(x))
    # a block parallelized by a call of its own, inside a model checked as a whole later
    torch.manual_seed(0)
    reference = Block()
    model = copy.deepcopy(reference)
    torch_tp.parallelize_module(model.mlp, mesh, {"c_fc": ColwiseParallel()})
    torch_tp.parallelize_module(model, mesh, {"mlp.c_proj": RowwiseParallel()})
    assert_close(model(x), reference(x))


def test_a_plan_applied_over_several_calls_is_not_refused():
    run_distributed(_plan_over_two_calls, 2)


def _reference_llama_checked(sequence_parallel: bool) -> int:
    mesh = init_device_mesh(device_type(), (2,))
    reference = reference_llama()
    model = copy.deepcopy(reference)
    torch_tp.parallelize_module(model, mesh, llama_plan(sequence_parallel=sequence_parallel))
    calls = []
    real = shapes.check_shapes

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(shapes, "check_shapes", counted):
        ids = torch.randint(0, 100, (2, 16))
        assert_close(model(ids), reference(ids))
    return len(calls)


def test_a_correct_plan_is_checked_and_runs():
    assert run_distributed(_reference_llama_checked, 2, False) == [1, 1]
    # a plan that takes activations split over the sequence is not checked: such an input
    # may come from outside the plan, each rank given its part, which the trace cannot tell
    assert run_distributed(_reference_llama_checked, 2, True) == [0, 0]
