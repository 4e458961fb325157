"""Every built-in style and every argument that changes behaviour, at single-device parity.

Each ``_case`` function runs on every rank (via :func:`torch_tp.testing.run_distributed`);
:func:`torch_tp.testing.check_parity` builds the single-device reference from the TP model's
full state dict and compares output, loss and every gradient (and parameters after an
optimizer step) on gathered full tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import FAST_RUNTIME, sgd, tp_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing import assert_close

from torch_tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.models.llama import RMSNorm
from torch_tp.testing import check_parity, collective_counts, run_distributed

WORLD_SIZES = [2, pytest.param(4, marks=pytest.mark.four_ranks)]


def _local(x: torch.Tensor, mesh, placement) -> torch.Tensor:
    """This rank's piece of ``x`` under ``placement`` (the input a TP module expects)."""
    return distribute_tensor(x.detach(), mesh, [placement]).to_local()


def _assert_grads_are_shards(model: nn.Module) -> None:
    """Every gradient is laid out like its parameter: no rank holds a full-size gradient
    of a sharded parameter (nor a partial sum of a replicated one)."""
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            assert isinstance(param.grad, DTensor), name
            assert param.grad.placements == param.placements, (name, param.grad.placements)
            assert param.grad.to_local().shape == param.to_local().shape, name


# --------------------------------------------------------------------------- Linear


def _colwise_linear(bias: bool, output_layout, use_local_output: bool, input_layout) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(4, 6, 16)
    style = ColwiseParallel(
        input_layouts=input_layout, output_layouts=output_layout, use_local_output=use_local_output
    )
    tp_x = x if input_layout in (None, Replicate()) else _local(x, mesh, input_layout)
    # 33 output features: the shards are uneven at every world size
    tp, _ = check_parity(
        nn.Linear(16, 33, bias=bias),
        mesh,
        style,
        (x,),
        tp_args=(tp_x,),
        output_placements=output_layout or Shard(-1),
        optimizer_fn=sgd,
    )
    _assert_grads_are_shards(tp)
    out = tp(tp_x)
    assert isinstance(out, DTensor) != use_local_output


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bias", [True, False])
def test_colwise_linear(world_size, bias):
    run_distributed(_colwise_linear, world_size, bias, None, True, None)


@pytest.mark.parametrize(
    "output_layout,use_local_output,input_layout",
    [
        (Replicate(), True, None),
        (Shard(-1), False, None),
        (Replicate(), False, Shard(0)),
        (Shard(-1), True, Shard(1)),
    ],
)
def test_colwise_linear_layouts(output_layout, use_local_output, input_layout):
    run_distributed(_colwise_linear, 2, True, output_layout, use_local_output, input_layout)


def _rowwise_linear(bias: bool, input_layout, output_layout, use_local_output: bool) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(4, 6, 33)
    style = RowwiseParallel(
        input_layouts=input_layout, output_layouts=output_layout, use_local_output=use_local_output
    )
    tp_x = x if input_layout == Replicate() else _local(x, mesh, input_layout or Shard(-1))
    tp, _ = check_parity(
        nn.Linear(33, 16, bias=bias),
        mesh,
        style,
        (x,),
        tp_args=(tp_x,),
        output_placements=output_layout or Replicate(),
        optimizer_fn=sgd,
    )
    _assert_grads_are_shards(tp)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bias", [True, False])
def test_rowwise_linear(world_size, bias):
    run_distributed(_rowwise_linear, world_size, bias, None, None, True)


@pytest.mark.parametrize(
    "input_layout,output_layout,use_local_output",
    [
        (Replicate(), Replicate(), True),
        (None, Shard(1), True),  # reduce-scatter onto the sequence (sequence parallel)
        (None, Shard(0), False),
        (Shard(-1), Replicate(), False),
    ],
)
def test_rowwise_linear_layouts(input_layout, output_layout, use_local_output):
    run_distributed(_rowwise_linear, 2, True, input_layout, output_layout, use_local_output)


class _OwnForwardLinear(nn.Linear):
    """A Linear subclass with its own forward: it must keep it (and run on DTensors)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 2.0


def _linear_subclass() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(3, 16)
    model = nn.Sequential(_OwnForwardLinear(16, 12), nn.ReLU(), _OwnForwardLinear(12, 16))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    check_parity(model, mesh, plan, (x,), optimizer_fn=sgd)


def test_linear_subclass_keeps_its_forward():
    run_distributed(_linear_subclass, 2)


# --------------------------------------------------------------------------- Embedding


def _embedding(style_name: str, vocab: int, dim: int, padding_idx, output_layout) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    ids = torch.randint(0, vocab, (3, 10))
    ids[0, :3] = torch.tensor([0, vocab - 1, vocab // 2])  # first, last and middle rows
    if padding_idx is not None:
        ids[1, 2] = padding_idx
    if style_name == "rowwise":
        # the ids are replicated, as in a real model (the default input is Shard(-1))
        style = RowwiseParallel(input_layouts=Replicate(), output_layouts=output_layout)
        placement = output_layout or Replicate()
    else:
        style = ColwiseParallel(output_layouts=output_layout)
        placement = output_layout or Shard(-1)
    tp, _ = check_parity(
        nn.Embedding(vocab, dim, padding_idx=padding_idx),
        mesh,
        style,
        (ids,),
        output_placements=placement,
        optimizer_fn=sgd,
    )
    _assert_grads_are_shards(tp)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("style_name", ["rowwise", "colwise"])
def test_embedding_odd_vocab(world_size, style_name):
    run_distributed(_embedding, world_size, style_name, 1001, 16, None, None)


@pytest.mark.four_ranks
def test_embedding_gpt2_vocab_tp4():
    run_distributed(_embedding, 4, "rowwise", 50257, 8, None, None)


@pytest.mark.parametrize("style_name", ["rowwise", "colwise"])
def test_embedding_padding_idx(style_name):
    # 700 falls on rank 1's vocabulary shard at TP=2
    run_distributed(_embedding, 2, style_name, 1001, 16, 700, None)


@pytest.mark.parametrize(
    "style_name,output_layout", [("rowwise", Shard(1)), ("colwise", Replicate())]
)
def test_embedding_output_layouts(style_name, output_layout):
    run_distributed(_embedding, 2, style_name, 1001, 15, None, output_layout)


@pytest.mark.four_ranks
def test_embedding_tiny_vocab_with_empty_shard():
    # 5 rows over 4 ranks are chunked 2, 2, 1, 0: the last rank owns nothing
    run_distributed(_embedding, 4, "rowwise", 5, 8, None, None)


# --------------------------------------------------------------------------- SequenceParallel


class _Residual(nn.Module):
    """norm -> linear pair, with the norm sequence-parallel (a Llama block in miniature)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _sequence_parallel(norm_kind: str) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    norm = {
        "layernorm": lambda: nn.LayerNorm(16),
        "torch_rmsnorm": lambda: nn.RMSNorm(16),
        "rmsnorm": lambda: RMSNorm(16),
    }[norm_kind]()
    with torch.no_grad():  # non-one weights: they must be broadcast, not assumed
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    x = torch.randn(2, 8, 16)
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    tp, _ = check_parity(
        _Residual(norm),
        mesh,
        plan,
        (x,),
        tp_args=(_local(x, mesh, Shard(1)),),
        output_placements=Shard(1),
        optimizer_fn=sgd,
        steps=2,
    )
    _assert_grads_are_shards(tp)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("norm_kind", ["layernorm", "torch_rmsnorm", "rmsnorm"])
def test_sequence_parallel_norms(world_size, norm_kind):
    run_distributed(_sequence_parallel, world_size, norm_kind)


def _sequence_parallel_gathered(use_local_output: bool) -> None:
    """``output_layouts=Replicate()``: the norm runs on the shard and hands the whole
    sequence on, gathered once; the column-parallel layer reads it and its partial input
    gradient is reduce-scattered back (a DTensor), or all-reduced by the layer (local)."""
    torch.manual_seed(0)
    mesh = tp_mesh()
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 8, 16)
    plan = {
        "norm": SequenceParallel(output_layouts=Replicate(), use_local_output=use_local_output),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    tp, _ = check_parity(
        _Residual(norm),
        mesh,
        plan,
        (x,),
        tp_args=(_local(x, mesh, Shard(1)),),
        output_placements=Shard(1),
        optimizer_fn=sgd,
        steps=2,
    )
    seen = []
    tp.up.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        tp(_local(x, mesh, Shard(1)))
    assert isinstance(seen[0], DTensor) != use_local_output
    assert seen[0].shape == (2, 8, 16)  # the whole sequence
    if not FAST_RUNTIME:
        return  # plain DTensor reduces each partial gradient apart, as it arrives
    local = _local(x, mesh, Shard(1))
    with CommDebugMode() as comm:
        tp(local).sum().backward()
    # forward: the norm's gather, the down projection's reduce-scatter; backward: down's
    # gather, then the norm's and down's bias gradients summed at the end (one all-reduce);
    # and up's partial input gradient: reduce-scattered back through the gathered DTensor,
    # or, handed a plain tensor, all-reduced by up itself (the gather's backward a slice)
    if use_local_output:
        expected = {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 2}
    else:
        expected = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}
    assert dict(collective_counts(comm)) == expected


@pytest.mark.parametrize("use_local_output", [False, True])
def test_sequence_parallel_gathered_output(use_local_output):
    run_distributed(_sequence_parallel_gathered, 2, use_local_output)


class _GatedRMSNorm(nn.Module):
    """A norm named so, with a gate in a submodule (transformers' AXK2GatedRMSNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        return self.norm(x) * self.gate(x).sigmoid()


def _gated_norm_refused() -> str:
    model = nn.Sequential(_GatedRMSNorm())
    with pytest.raises(NotImplementedError) as caught:
        parallelize_module(model, tp_mesh(), {"0": SequenceParallel()})
    assert not isinstance(model[0].gate.weight, DTensor)  # nothing changed
    return str(caught.value)


def test_sequence_parallel_refuses_a_norm_with_unplanned_submodule_parameters():
    """Its own parameters are replicated and their gradients summed; a submodule's would
    compute on the shard unsummed: silently wrong, so refused before anything changes."""
    for message in run_distributed(_gated_norm_refused, 2):
        assert "found parameters of submodules no style plans: ['norm.weight', 'gate.weight'," in (
            message
        ), message
    with pytest.raises(ValueError, match=r"sequence \(Shard\(dim=1\)\) or gathered"):
        SequenceParallel(output_layouts=Shard(2))


def _sequence_parallel_alone(sequence_dim: int, use_local_output: bool) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(4, 6, 16)
    norm = nn.LayerNorm(16)
    with torch.no_grad():
        norm.weight.uniform_()
    style = SequenceParallel(sequence_dim=sequence_dim, use_local_output=use_local_output)
    tp, _ = check_parity(
        norm,
        mesh,
        style,
        (x,),
        tp_args=(_local(x, mesh, Shard(sequence_dim)),),
        output_placements=Shard(sequence_dim),
    )
    out = tp(_local(x, mesh, Shard(sequence_dim)))
    assert isinstance(out, DTensor) != use_local_output
    # a DTensor input that is not sequence-sharded is moved onto the sequence
    out = tp(distribute_tensor(x, mesh, [Replicate()]))
    expected = F.layer_norm(x, (16,), norm.weight.full_tensor(), norm.bias.full_tensor())
    if use_local_output:
        assert_close(out, _local(expected, mesh, Shard(sequence_dim)))
    else:
        assert out.placements == (Shard(sequence_dim),)
        assert_close(out.full_tensor(), expected)


@pytest.mark.parametrize("sequence_dim,use_local_output", [(1, False), (0, True)])
def test_sequence_parallel_arguments(sequence_dim, use_local_output):
    run_distributed(_sequence_parallel_alone, 2, sequence_dim, use_local_output)


def _sequence_parallel_dropout() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(2, 8, 16)
    dropout = parallelize_module(nn.Dropout(0.5), mesh, SequenceParallel(use_local_output=True))
    local = _local(x, mesh, Shard(1))
    dropout.eval()
    assert_close(dropout(local), local)  # eval: the identity, on the sequence shard
    dropout.train()
    out = dropout(local)
    assert out.shape == local.shape
    kept = out != 0
    # training: every element is dropped or scaled by 1 / (1 - p); that the mask is the
    # single-device one is checked in test_random.py
    assert_close(out[kept], local[kept] * 2.0)
    assert 0 < kept.float().mean() < 1


def test_sequence_parallel_dropout():
    run_distributed(_sequence_parallel_dropout, 2)


# --------------------------------------------------------------------------- PrepareModule*


class _TwoInputs(nn.Module):
    """Records the layouts it receives, then computes on local tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: dict[str, object] = {}

    def forward(self, x, mask=None, *, scale=None, bias=None):
        self.seen = {
            name: value.placements[0] if isinstance(value, DTensor) else type(value).__name__
            for name, value in (("x", x), ("mask", mask), ("scale", scale), ("bias", bias))
        }
        local = [v.to_local() if isinstance(v, DTensor) else v for v in (x, mask, scale, bias)]
        x, mask, scale, bias = local
        out = self.proj(x)
        if mask is not None:
            out = out * mask
        if scale is not None:
            out = out * scale
        if bias is not None:
            out = out + bias
        return out


def _prepare_module_input() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    ws = dist.get_world_size()
    x, mask = torch.randn(2 * ws, 8), torch.rand(2 * ws, 8)
    scale, bias = torch.rand(8), torch.randn(8)

    # positional args with a None placeholder: x arrives sharded on dim 0 and is replicated
    # (an all-gather), mask is left alone
    style = PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)
    )
    tp, _ = check_parity(
        _TwoInputs(), mesh, style, (x, mask), tp_args=(_local(x, mesh, Shard(0)), mask)
    )
    assert tp.seen == {"x": Replicate(), "mask": "Tensor", "scale": "NoneType", "bias": "NoneType"}

    # keyword inputs: scale is annotated only (same layout), bias is sharded -> replicated;
    # positional inputs are untouched because input_layouts is None
    style = PrepareModuleInput(
        input_kwarg_layouts={"scale": Replicate(), "bias": Shard(0)},
        desired_input_kwarg_layouts={"scale": Replicate(), "bias": Replicate()},
    )
    tp, _ = check_parity(
        _TwoInputs(),
        mesh,
        style,
        (x,),
        {"scale": scale, "bias": bias},
        tp_kwargs={"scale": scale, "bias": _local(bias, mesh, Shard(0))},
    )
    assert tp.seen == {"x": "Tensor", "mask": "NoneType", "scale": Replicate(), "bias": Replicate()}

    # use_local_output=True hands the module local tensors; a kwarg not in the layouts
    # passes through
    style = PrepareModuleInput(
        input_layouts=(Shard(0), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"bias": Replicate()},
        desired_input_kwarg_layouts={"bias": Replicate()},
        use_local_output=True,
    )
    tp, _ = check_parity(
        _TwoInputs(),
        mesh,
        style,
        (x, mask),
        {"scale": scale},
        tp_args=(_local(x, mesh, Shard(0)), mask),
    )
    assert tp.seen == {"x": "Tensor", "mask": "Tensor", "scale": "Tensor", "bias": "NoneType"}

    # a wrong number of positional inputs is a ValueError, as upstream
    module = parallelize_module(
        _TwoInputs(),
        mesh,
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
    )
    with pytest.raises(ValueError, match="input_layouts should have same length"):
        module(x, mask)


def test_prepare_module_input():
    run_distributed(_prepare_module_input, 2)


class _TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return y, y.sum(-1), "aux"


def _prepare_module_output() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(4, 8)
    # the first output is replicated and returned sharded on dim 0 (a local shard); the
    # second stays a DTensor (use_local_output=False); the third is not a tensor (None)
    style = PrepareModuleOutput(
        output_layouts=(Replicate(), Replicate(), None),
        desired_output_layouts=(Shard(0), Replicate(), None),
        use_local_output=True,
    )
    tp, _ = check_parity(_TupleOut(), mesh, style, (x,), output_placements=(Shard(0), None, None))
    y, s, aux = tp(x)
    assert type(y) is torch.Tensor and y.shape == (4 // dist.get_world_size(), 8)
    assert aux == "aux"

    single = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    model = parallelize_module(nn.Linear(8, 8), mesh, single)
    out = model(x)
    assert type(out) is torch.Tensor and out.shape[0] == 4 // dist.get_world_size()

    as_dtensor = PrepareModuleOutput(
        output_layouts=(Replicate(), Replicate(), None),
        desired_output_layouts=(Shard(0), Replicate(), None),
        use_local_output=False,
    )
    y, s, _ = parallelize_module(_TupleOut(), mesh, as_dtensor)(x)
    assert y.placements == (Shard(0),) and s.placements == (Replicate(),)


def test_prepare_module_output():
    run_distributed(_prepare_module_output, 2)


def _prepare_module_input_output(use_local_input: bool) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(4, 8)
    style = PrepareModuleInputOutput(
        input_layouts=(Shard(0),),
        desired_input_layouts=(Replicate(),),
        use_local_input=use_local_input,
        output_layouts=Replicate(),
        desired_output_layouts=Shard(0),
    )
    tp, _ = check_parity(
        _TwoInputs(),
        mesh,
        style,
        (x,),
        tp_args=(_local(x, mesh, Shard(0)),),
        output_placements=Shard(0),
    )
    assert tp.seen["x"] == ("Tensor" if use_local_input else Replicate())


@pytest.mark.parametrize("use_local_input", [False, True])
def test_prepare_module_input_output(use_local_input):
    run_distributed(_prepare_module_input_output, 2, use_local_input)


# --------------------------------------------------------------------------- src_data_rank


def _src_data_rank(src_data_rank) -> None:
    mesh = tp_mesh()
    torch.manual_seed(dist.get_rank())  # every rank initializes differently
    model = nn.Linear(8, 8)
    local_weight = model.weight.detach().clone()
    parallelize_module(model, mesh, ColwiseParallel(), src_data_rank=src_data_rank)
    full = model.weight.full_tensor()
    gathered = [torch.empty_like(local_weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local_weight)
    if src_data_rank is None:
        # each rank keeps its own rows of its own initialization
        expected = torch.cat([w.chunk(dist.get_world_size())[r] for r, w in enumerate(gathered)])
    else:
        expected = gathered[src_data_rank]
    assert_close(full, expected)


@pytest.mark.parametrize("src_data_rank", [0, 1, None])
def test_src_data_rank(src_data_rank):
    run_distributed(_src_data_rank, 2, src_data_rank)


def _gradient_accumulation() -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    mesh = tp_mesh()
    norm = nn.LayerNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    reference = _Residual(norm)
    model = copy.deepcopy(reference)
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, mesh, plan)
    for micro_batch in range(3):  # gradients accumulate over micro-batches, no zero_grad
        x = torch.randn(2, 8, 16)
        reference(x).pow(2).sum().backward()
        with CommDebugMode() as comm:
            model(_local(x, mesh, Shard(1))).pow(2).sum().backward()
        if FAST_RUNTIME:
            # the partial gradients of norm.weight, norm.bias and down.bias are summed in one
            # all-reduce at the end of backward, not one per parameter
            assert collective_counts(comm)["all_reduce"] == 1, comm.get_comm_counts()
        for name, param in model.named_parameters():
            want = dict(reference.named_parameters())[name].grad
            assert param.grad.placements == param.placements, (micro_batch, name)
            assert_close(param.grad.full_tensor(), want, msg=f"{micro_batch} {name}")
    # torch.autograd.grad sees correct (if partial) gradients and leaves .grad alone
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, 8, 16)
    (g,) = torch.autograd.grad(model(_local(x, mesh, Shard(1))).pow(2).sum(), model.norm.weight)
    (want,) = torch.autograd.grad(reference(x).pow(2).sum(), reference.norm.weight)
    assert_close(g.full_tensor(), want)
    assert model.norm.weight.grad is None


def _partial_gradients_after_module_to() -> None:
    # module.to() swaps a DTensor parameter's contents (and drops its hooks): the partial
    # gradients of replicated parameters must still be summed
    torch.manual_seed(0)
    mesh = tp_mesh()
    reference = _Residual(nn.LayerNorm(16))
    model = copy.deepcopy(reference)
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, mesh, plan)
    model.to(torch.float64)
    reference.to(torch.float64)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    reference(x).pow(2).sum().backward()
    model(_local(x, mesh, Shard(1))).pow(2).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad.placements == param.placements, name
        assert_close(param.grad.full_tensor(), dict(reference.named_parameters())[name].grad)


def test_partial_gradients_after_module_to():
    run_distributed(_partial_gradients_after_module_to, 2)


def test_gradient_accumulation_of_replicated_parameters():
    run_distributed(_gradient_accumulation, 2)
