"""The runtime's shortcuts under the conditions that could break them.

Selective activation checkpointing (saved matmul outputs must stay partial sums), inference
mode (no version counters), negative sequence dims at module boundaries, an in-place change
between two readers of one tensor or of a prepared (DTensor) input, a reader without grad
before one with, the lifetime of a gathered activation, and a parametrized weight.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import full_tensor, reference_llama, tp_mesh
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import Replicate, Shard
from torch.testing import assert_close
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torch_tp import ColwiseParallel, PrepareModuleInput, parallelize_module
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import check_parity, gather_full, run_distributed


def _keep_matmuls(ctx, op, *args, **kwargs):
    # torchtitan's op-level selective checkpointing: matmul outputs are saved, not recomputed
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_checkpointing(sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    reference = Llama(tiny_config(max_seq_len=16))
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), llama_plan(sequence_parallel=sequence_parallel))
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    for block in model.layers:
        checkpoint(block, context_fn=context)
    ids, targets = torch.randint(0, 100, (2, 8)), torch.randint(0, 100, (2, 8))
    F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    for (name, param), expected in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert_close(full_tensor(param.grad), expected.grad, msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_selective_activation_checkpointing(sequence_parallel):
    run_distributed(_selective_checkpointing, 2, sequence_parallel)


def _inference_mode() -> None:
    torch.manual_seed(0)
    reference = Llama(tiny_config(max_seq_len=16))
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), llama_plan(sequence_parallel=True))
    ids = torch.randint(0, 100, (2, 8))
    with torch.inference_mode():
        assert_close(model(ids), reference(ids))


def test_inference_mode_with_sequence_parallel():
    run_distributed(_inference_mode, 2)


class _TwoReaders(nn.Module):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        a = self.q(h)
        if self.in_place:
            h.mul_(2)  # between the two readers: the second must see the new values
        return a + self.k(h)


def _negative_sequence_dim(dim: int) -> None:
    torch.manual_seed(0)
    model = _TwoReaders()
    reference = copy.deepcopy(model)
    prepare = PrepareModuleInput(input_layouts=Shard(dim), desired_input_layouts=Replicate())
    plan = {"": prepare, "q": ColwiseParallel(), "k": ColwiseParallel()}
    parallelize_module(model, tp_mesh(), plan)
    x = torch.randn(2, 4, 8)
    local = x.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]
    out = gather_full(model(local), tp_mesh(), Shard(-1))
    assert_close(out, reference(x))


@pytest.mark.parametrize("dim", [1, -2])
def test_sequence_sharded_input_with_a_negative_dim(dim):
    run_distributed(_negative_sequence_dim, 2, dim)


def _in_place_between_readers() -> None:
    torch.manual_seed(0)
    model = _TwoReaders(in_place=True)
    reference = copy.deepcopy(model)
    gathered = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, tp_mesh(), {"q": gathered, "k": copy.deepcopy(gathered)})
    x = torch.randn(2, 4, 8)
    local = x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
    with torch.no_grad():
        assert_close(model(local), reference(x))


def test_an_in_place_change_between_readers_is_seen():
    run_distributed(_in_place_between_readers, 2)


def _gathered_input_is_not_kept() -> None:
    from torch_tp.runtime import boundaries

    mesh = tp_mesh()
    plan = {name: ColwiseParallel(input_layouts=Shard(1)) for name in ("q", "k")}
    blocks = [parallelize_module(_TwoReaders(), mesh, copy.deepcopy(plan)) for _ in range(3)]
    inputs = [torch.randn(2, 4, 8, requires_grad=True) * 1.0 for _ in blocks]
    for block, x in zip(blocks, inputs, strict=True):
        block(x).sum().backward(retain_graph=True)
    # the inputs (kept alive here, as checkpointing keeps a block's input) hold no gathered
    # copy of themselves: only the latest gather is remembered, for its next readers
    for x in inputs:
        assert boundaries._ENTRY not in x.__dict__
    latest = boundaries._last_gathered[0]
    assert latest is not None and latest[3]() is not inputs[0]


@pytest.mark.fast_runtime
def test_a_gathered_activation_does_not_outlive_the_next_gather():
    run_distributed(_gathered_input_is_not_kept, 2)


class _NoGradThenGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gate = torch.sigmoid(self.q(x))  # a reader of x without a graph
        return gate * self.k(x)  # then one with


def _prepared_block_parity(block: str) -> None:
    torch.manual_seed(0)
    # ``0``'s gradient flows through the block's input, the replicated DTensor
    # PrepareModuleInput makes, to its readers q and k
    model = nn.Sequential(nn.Linear(8, 8), globals()[block]())
    prepare = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())
    plan = {"1": prepare, "1.q": ColwiseParallel(), "1.k": ColwiseParallel()}
    x = torch.randn(2, 4, 8)
    check_parity(model, tp_mesh(), plan, (x,), output_placements=Shard(-1))


def test_a_reader_without_grad_does_not_cut_the_graph_of_the_next():
    # only if k's read kept the graph
    run_distributed(_prepared_block_parity, 2, "_NoGradThenGrad")


class _InPlaceThenTwoReaders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # the readers must see the new values, and the gradient must go through it
        return self.q(x) + self.k(x)


def test_an_in_place_change_of_a_prepared_input_is_differentiated():
    # the readers use the local tensor under the DTensor directly, unless it changed since
    run_distributed(_prepared_block_parity, 2, "_InPlaceThenTwoReaders")


class _Double(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


def _parametrized_weight() -> None:
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model, reference = nn.Linear(8, 8), nn.Linear(8, 8)
    reference.load_state_dict(model.state_dict())
    parallelize_module(model, tp_mesh(), ColwiseParallel(output_layouts=Replicate()))
    for m in (model, reference):  # the weight is then computed, not registered as "weight"
        parametrize.register_parametrization(m, "weight", _Double())
    x = torch.randn(2, 4, 8)
    assert_close(model(x), reference(x))
    model(x).sum().backward()
    reference(x).sum().backward()
    original = model.parametrizations.weight.original
    assert_close(original.grad.full_tensor(), reference.parametrizations.weight.original.grad)


def test_a_parametrized_weight_is_read_as_computed():
    run_distributed(_parametrized_weight, 2)


# ----------------------------------------------------------------- reentrant checkpointing


def _close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(actual, expected, msg=lambda message: f"{what}: {message}")


def _reentrant_checkpointing(sequence_parallel: bool) -> None:
    reference = reference_llama(max_seq_len=16, dropout=0.1)
    model = copy.deepcopy(reference)
    parallelize_module(model, tp_mesh(), llama_plan(sequence_parallel=sequence_parallel))
    # TP, then checkpointing (torchtitan's order); the single-device reference runs without
    for block in model.layers:
        block.forward = functools.partial(
            torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=True
        )
    calls = []  # attention forwards: recomputation runs them again in backward
    model.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
    ids, targets = torch.randint(0, 1001, (2, 8)), torch.randint(0, 1001, (2, 8))
    optims = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    names = [name for name, _ in reference.named_parameters()]
    for step in range(2):
        outs, losses = [], []
        for m in (model, reference):
            torch.manual_seed(100 + step)  # the same dropout masks, replayed by recomputation
            out = m(ids)
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
            loss.backward()
            outs.append(out.detach())
            losses.append(loss.detach())
        _close(f"step {step}: output", *outs)
        _close(f"step {step}: loss", *losses)
        # reentrant checkpointing drops, without an error, the gradients of the parameters
        # in a region none of whose inputs requires grad
        params = list(zip(names, model.parameters(), reference.parameters(), strict=True))
        missing = [name for name, p, ref in params if p.grad is None or ref.grad is None]
        assert not missing, f"step {step}: no gradient of {missing}"
        for name, p, ref in params:
            _close(f"step {step}: gradient of {name}", full_tensor(p.grad), ref.grad)
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=True)
        for name, p, ref in params:
            _close(f"step {step}: {name} after the step", full_tensor(p.detach()), ref.detach())
    assert len(calls) == 4, "the blocks were not recomputed in backward"


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_reentrant_activation_checkpointing(sequence_parallel):
    # the blocks' input (the embedding's output) requires grad, as reentrant checkpointing
    # needs; outputs, losses, every gradient and every parameter after SGD match one device
    run_distributed(_reentrant_checkpointing, 2, sequence_parallel)
