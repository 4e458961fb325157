"""torch_tp against ``torch.distributed.tensor.parallel``, case by case.

Both libraries parallelize identical copies of a model with the same plan (built from each
library's own classes); outputs, gradients, and every parameter's placements and local
shard must agree, and so must the exception types of the errors upstream raises. Upstream
is imported here only, to compare against it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.tensor.parallel as upstream
import torch.nn as nn
from helpers import full_tensor, tp_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing import assert_close

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.testing import run_distributed


def _plan(lib, case: str):
    """The same plan written with ``lib``'s classes."""
    C, R, S = lib.ColwiseParallel, lib.RowwiseParallel, lib.SequenceParallel
    PI = lib.PrepareModuleInput
    if case == "mlp":
        return {"0": C(), "2": R()}
    if case == "mlp_dtensor_between":
        return {"0": C(use_local_output=False), "2": R(use_local_output=False)}
    if case == "mlp_sequence_parallel":
        return {"0": C(input_layouts=Shard(0)), "2": R(output_layouts=Shard(0))}
    if case == "llama":
        plan = {
            "tok_embeddings": R(input_layouts=Replicate()),
            "layers.*.attention.wq": C(),
            "layers.*.attention.wk": C(),
            "layers.*.attention.wv": C(),
            "layers.*.attention.wo": R(),
            "layers.*.feed_forward.w1": C(),
            "layers.*.feed_forward.w2": R(),
            "layers.*.feed_forward.w3": C(),
            "output": C(output_layouts=Replicate()),
        }
        return plan
    if case == "llama_sp":
        return {
            "tok_embeddings": R(input_layouts=Replicate(), output_layouts=Shard(1)),
            "layers.*.attention_norm": S(),
            "layers.*.attention": PI(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "layers.*.attention.wq": C(),
            "layers.*.attention.wk": C(),
            "layers.*.attention.wv": C(),
            "layers.*.attention.wo": R(output_layouts=Shard(1)),
            "layers.*.ffn_norm": S(),
            "layers.*.feed_forward": PI(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "layers.*.feed_forward.w1": C(),
            "layers.*.feed_forward.w2": R(output_layouts=Shard(1)),
            "layers.*.feed_forward.w3": C(),
            "norm": S(),
            "output": C(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    if case == "embeddings":
        return {"0": R(input_layouts=Replicate()), "1": C(output_layouts=Replicate())}
    raise ValueError(case)


def _model(case: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if case.startswith("mlp"):
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        return model, (torch.randn(4, 16),)
    if case.startswith("llama"):
        config = LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=16)
        return Llama(config), (torch.randint(0, 128, (2, 8)),)
    if case == "embeddings":
        model = nn.Sequential(nn.Embedding(128, 16), nn.Embedding(128, 8))
        return _Chain(model), (torch.randint(0, 128, (2, 8)),)
    raise ValueError(case)


class _Chain(nn.Module):
    """Two embeddings looked up with the same ids, outputs concatenated."""

    def __init__(self, pair: nn.Sequential) -> None:
        super().__init__()
        self.pair = pair

    def forward(self, ids):
        return torch.cat([self.pair[0](ids), self.pair[1](ids)], dim=-1)


def _same_as_upstream(case: str) -> None:
    mesh = tp_mesh()
    theirs, inputs = _model(case)
    ours = copy.deepcopy(theirs)
    root = "pair." if case == "embeddings" else ""
    up_plan = {root + k: v for k, v in _plan(upstream, case).items()}
    tp_plan = {root + k: v for k, v in _plan(torch_tp, case).items()}
    upstream.parallelize_module(theirs, mesh, up_plan)
    torch_tp.parallelize_module(ours, mesh, tp_plan)

    for (name, p_up), (_, p_tp) in zip(
        theirs.named_parameters(), ours.named_parameters(), strict=True
    ):
        assert type(p_up) is type(p_tp), name
        if isinstance(p_up, DTensor):
            assert p_up.placements == p_tp.placements, name
            assert_close(p_up.to_local(), p_tp.to_local(), msg=name)

    out_up, out_tp = theirs(*inputs), ours(*inputs)
    # (upstream's local outputs may be AsyncCollectiveTensor, a Tensor subclass)
    assert isinstance(out_up, DTensor) == isinstance(out_tp, DTensor)
    if isinstance(out_up, DTensor):
        assert out_up.placements == out_tp.placements
    assert_close(full_tensor(out_tp), full_tensor(out_up))
    weights = torch.randn(full_tensor(out_up).shape, generator=torch.Generator().manual_seed(1))
    (full_tensor(out_up) * weights).sum().backward()
    (full_tensor(out_tp) * weights).sum().backward()
    for (name, p_up), (_, p_tp) in zip(
        theirs.named_parameters(), ours.named_parameters(), strict=True
    ):
        # upstream leaves some gradients partial or replicated; the values must agree
        assert_close(full_tensor(p_tp.grad), full_tensor(p_up.grad), msg=name)


@pytest.mark.parametrize(
    "case",
    ["mlp", "mlp_dtensor_between", "mlp_sequence_parallel", "llama", "llama_sp", "embeddings"],
)
def test_same_as_upstream(case):
    run_distributed(_same_as_upstream, 2, case)


def _same_exceptions() -> None:
    mesh = tp_mesh()
    for lib in (upstream, torch_tp):
        # an unsupported module type
        with pytest.raises(NotImplementedError):
            lib.parallelize_module(nn.Conv1d(2, 2, 1), mesh, lib.ColwiseParallel())
        with pytest.raises(NotImplementedError):
            lib.parallelize_module(nn.Conv1d(2, 2, 1), mesh, lib.RowwiseParallel())
        # a plan that is neither a style nor a dict
        with pytest.raises(TypeError):
            lib.parallelize_module(nn.Linear(2, 2), mesh, [lib.ColwiseParallel()])
        # the wrong number of inputs for PrepareModuleInput, at run time
        style = lib.PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())
        module = lib.parallelize_module(nn.Bilinear(2, 2, 2), mesh, style)
        with pytest.raises(ValueError):
            module(torch.randn(2, 2), torch.randn(2, 2))
        # and wrong outputs for PrepareModuleOutput
        style = lib.PrepareModuleOutput(
            output_layouts=(Replicate(), Replicate()),
            desired_output_layouts=(Replicate(), Replicate()),
        )
        with pytest.raises(ValueError):
            lib.parallelize_module(nn.Linear(2, 2), mesh, style)(torch.randn(2, 2))
        # constructor argument errors
        with pytest.raises(AssertionError):
            lib.PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=None)
        with pytest.raises(AssertionError):
            lib.PrepareModuleOutput(
                output_layouts=(Shard(0), Shard(0)), desired_output_layouts=(Replicate(),)
            )


def test_same_exception_types_as_upstream():
    run_distributed(_same_exceptions, 2)


def _upstream_styles_in_our_plans() -> None:
    # a plan written with upstream's style objects (or a user style derived from upstream's
    # ParallelStyle) is accepted as is: changing the import of parallelize_module suffices
    mesh = tp_mesh()
    theirs, inputs = _model("mlp")
    ours = copy.deepcopy(theirs)
    upstream.parallelize_module(theirs, mesh, _plan(upstream, "mlp"))
    torch_tp.parallelize_module(ours, mesh, _plan(upstream, "mlp"))
    assert_close(ours(*inputs), theirs(*inputs))
    # modules and classes are still not styles
    with pytest.raises(TypeError, match="plan key '0'"):
        torch_tp.parallelize_module(ours, mesh, {"0": nn.Linear(2, 2)})
    with pytest.raises(TypeError, match="plan key '0'"):
        torch_tp.parallelize_module(ours, mesh, {"0": upstream.ColwiseParallel})


def test_upstream_styles_are_accepted():
    run_distributed(_upstream_styles_in_our_plans, 2)
