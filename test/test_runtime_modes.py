"""The two runtimes (``TORCH_TP_RUNTIME``) and the end-of-backward reduction of partial
gradients.

``fast`` (the default) and ``dtensor`` (plain DTensor) must give the same results: CI runs
every parity test file once more under ``TORCH_TP_RUNTIME=dtensor``. This file checks the
switch itself, and that :class:`torch_tp.runtime.PartialGradientReduction` belongs to
its mesh, is shared by separately parallelized models, survives a backward that raised (the
gradients then accumulate as on one device), and keeps a backward run inside another apart;
that both runtimes hand layer outputs on as tensors that can be modified in place; and that
``.ci/run`` runs every parity file under ``dtensor``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import re
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from helpers import tp_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing import assert_close

from torch_tp import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.runtime import DTensorRuntime, FastRuntime
from torch_tp.runtime.boundaries import PartialGradientReduction
from torch_tp.testing import run_distributed


@contextlib.contextmanager
def _runtime_env(value: str | None) -> Iterator[None]:
    """``TORCH_TP_RUNTIME`` set to ``value`` (unset: ``None``) for the block; the pooled
    workers outlive a test, so it is put back."""
    saved = os.environ.get("TORCH_TP_RUNTIME")
    if value is None:
        os.environ.pop("TORCH_TP_RUNTIME", None)
    else:
        os.environ["TORCH_TP_RUNTIME"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_TP_RUNTIME", None)
        else:
            os.environ["TORCH_TP_RUNTIME"] = saved


class _Block(nn.Module):
    """A sequence-parallel norm, then a column- and a row-parallel layer: partial gradients
    (the norm's parameters, the biased row-parallel layer's bias) and every region."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


_PLAN = {
    "norm": SequenceParallel(use_local_output=True),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
}


def _shard(x: torch.Tensor) -> torch.Tensor:
    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return x.chunk(n, dim=1)[rank].contiguous()


def _check_grads(model: nn.Module, reference: nn.Module) -> None:
    for name, param in model.named_parameters():
        want = dict(reference.named_parameters())[name].grad
        assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements
        assert_close(param.grad.full_tensor(), want, msg=name)


def _region_nodes(t: torch.Tensor) -> set[str]:
    """The names of the region Functions' nodes in ``t``'s autograd graph."""
    seen, found, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Region" in type(node).__name__:
            found.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _modes() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    reference = _Block()
    x = torch.randn(2, 8, 16)
    reference(x).pow(2).sum().backward()
    for mode, runtime in (("fast", FastRuntime), ("dtensor", DTensorRuntime), (None, FastRuntime)):
        with _runtime_env(mode):
            model = parallelize_module(copy.deepcopy(reference), mesh, copy.deepcopy(_PLAN))
        model.zero_grad()
        # the mode is the one read at parallelize_module time, whatever the variable says now
        with _runtime_env("dtensor" if runtime is FastRuntime else "fast"):
            assert type(model.up.forward.args[1]) is runtime
            out = model(_shard(x))
            regions = _region_nodes(out)
            out.pow(2).sum().backward()
        if runtime is FastRuntime:
            assert regions >= {"_GatherFromSequenceRegionBackward"}, regions
        else:
            assert not regions, regions  # plain DTensor: no region Function anywhere
        _check_grads(model, reference)


def test_the_runtime_is_chosen_at_parallelize_time_and_both_agree():
    run_distributed(_modes, 2)


def _unknown_runtime() -> None:
    model = _Block()
    with _runtime_env("turbo"), pytest.raises(ValueError, match="'fast'.*'dtensor'"):
        parallelize_module(model, tp_mesh(), _PLAN)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing applied


def test_an_unknown_runtime_is_refused_before_anything_changes():
    run_distributed(_unknown_runtime, 2)


def _shared_reduction() -> None:
    """Two models parallelized in separate calls on one mesh: one reduction object, one
    all-reduce per backward for both, even with their passes interleaved."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    mesh = tp_mesh()
    references = [_Block(), _Block()]
    with _runtime_env("fast"):
        models = [
            parallelize_module(copy.deepcopy(r), mesh, copy.deepcopy(_PLAN)) for r in references
        ]
    assert models[0].up.forward.args[1].reduction is models[1].up.forward.args[1].reduction
    reduction = PartialGradientReduction.of(mesh)
    xs = [torch.randn(2, 8, 16) for _ in references]
    losses = [m(_shard(x)).pow(2).sum() for m, x in zip(models, xs, strict=True)]
    for reference, x in zip(references, xs, strict=True):
        reference(x).pow(2).sum().backward()
    for loss in reversed(losses):  # backward passes in the other order than the forwards
        with CommDebugMode() as comm:
            loss.backward()
        assert reduction.pending == 0
        # the region backwards (reduce-scatter, all-gather) and one all-reduce of the
        # partial gradients (norm.weight, norm.bias, down.bias)
        assert comm.get_comm_counts()[torch.ops.c10d.allreduce_] == 1, comm.get_comm_counts()
    for model, reference in zip(models, references, strict=True):
        _check_grads(model, reference)


def test_models_parallelized_apart_share_one_reduction():
    run_distributed(_shared_reduction, 2)


class _Boom(RuntimeError):
    pass


def _backward_that_raises() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    reference = _Block()
    with _runtime_env("fast"):
        model = parallelize_module(copy.deepcopy(reference), mesh, copy.deepcopy(_PLAN))
    reduction = model.up.forward.args[1].reduction

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise _Boom

    x = torch.randn(2, 8, 16, requires_grad=True)
    local = _shard(x.detach()).requires_grad_()
    local.register_hook(boom)  # the very end of backward: every partial gradient is in
    with pytest.raises(_Boom):
        model(local).pow(2).sum().backward()
    assert reduction.pending > 0  # the pass that raised never ran its reduction
    model.zero_grad(set_to_none=True)
    y = torch.randn(2, 8, 16)
    model(_shard(y)).pow(2).sum().backward()
    reference(y).pow(2).sum().backward()
    assert reduction.pending == 0
    _check_grads(model, reference)


def test_a_backward_that_raised_does_not_change_the_next():
    run_distributed(_backward_that_raises, 2)


def _reduction_keeps_nothing_alive() -> None:
    """The reduction lives on its mesh (as long as torch keeps the mesh), and holds a model's
    parameters only during a backward pass: a model it served is freed with its last
    reference (once the next gather has replaced the latest gathered entry, which keeps its
    autograd graph, and so the parameters' gradient accumulators, until then)."""
    mesh = tp_mesh()
    with _runtime_env("fast"):
        model, other = (parallelize_module(_Block(), mesh, copy.deepcopy(_PLAN)) for _ in "ab")
    model(_shard(torch.randn(2, 8, 16))).sum().backward()
    assert PartialGradientReduction.of(mesh).pending == 0
    assert model.up.forward.args[1].reduction is PartialGradientReduction.of(mesh)
    param = weakref.ref(model.norm.weight)
    del model
    other(_shard(torch.randn(2, 8, 16))).sum().backward()
    gc.collect()
    assert param() is None


def test_the_reduction_keeps_no_model_alive():
    run_distributed(_reduction_keeps_nothing_alive, 2)


def _by_hand() -> None:
    mesh = tp_mesh()
    with _runtime_env("dtensor"):
        layer = ColwiseParallel()._apply(nn.Linear(4, 4), mesh)
    assert type(layer.forward.args[1]) is DTensorRuntime


def test_a_style_applied_by_hand_reads_the_variable_then():
    run_distributed(_by_hand, 2)


def _accumulating_after_a_raise() -> None:
    """A backward that raised, then another without ``zero_grad``: the gradients are what one
    device accumulates over the same two passes (the partial gradients the failed pass left
    are made whole with the next pass's), in both runtimes."""
    for mode in ("fast", "dtensor"):
        torch.manual_seed(0)
        mesh = tp_mesh()
        reference = _Block()
        with _runtime_env(mode):
            model = parallelize_module(copy.deepcopy(reference), mesh, copy.deepcopy(_PLAN))

        def boom(grad: torch.Tensor) -> torch.Tensor:
            raise _Boom

        x, y = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
        # the hook on the input is the very end of both backward passes: every parameter's
        # gradient is in when it raises, on one device as on several
        for net, value in ((model, _shard(x)), (reference, x)):
            value = value.clone().requires_grad_()
            value.register_hook(boom)
            with pytest.raises(_Boom):
                net(value).pow(2).sum().backward()
        model(_shard(y)).pow(2).sum().backward()
        reference(y).pow(2).sum().backward()
        _check_grads(model, reference)


def test_gradients_accumulate_exactly_across_a_backward_that_raised():
    run_distributed(_accumulating_after_a_raise, 2)


def _nested_backward() -> None:
    """Two models parallelized apart, one's backward run inside the other's (a hook in the
    middle of it): each pass's partial gradients are summed at its own end, and both models
    get their single-device gradients, in both runtimes."""
    for mode in ("fast", "dtensor"):
        _nested_backward_in(mode)


def _nested_backward_in(mode: str) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    references = [_Block(), _Block()]
    with _runtime_env(mode):
        outer, inner = (
            parallelize_module(copy.deepcopy(r), mesh, copy.deepcopy(_PLAN)) for r in references
        )
    xs = [torch.randn(2, 8, 16) for _ in references]
    inner_loss = inner(_shard(xs[1])).pow(2).sum()
    ran = []

    def run_inner(grad: torch.Tensor) -> None:
        # between down's partial bias gradient and the norm's: the outer pass has partial
        # gradients pending when the inner one starts, and gets more after it ends
        if mode == "fast":
            assert outer.up.forward.args[1].reduction.pending > 0
        inner_loss.backward()
        ran.append(True)

    def watch_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        args[0].register_hook(run_inner)

    outer.down.register_forward_pre_hook(watch_input)
    outer(_shard(xs[0])).pow(2).sum().backward()
    assert ran == [True]
    for reference, x in zip(references, xs, strict=True):
        reference(x).pow(2).sum().backward()
    _check_grads(outer, references[0])
    _check_grads(inner, references[1])


def test_a_backward_nested_in_another_gets_its_own_gradients():
    run_distributed(_nested_backward, 2)


class _InPlace(nn.Module):
    """Modifies, in place, a column-parallel layer's gathered output, a row-parallel layer's
    all-reduced one, a sequence-parallel row-parallel layer's reduce-scattered one and a
    column-parallel layer's own shard (as Llama 4's MoE does ``out.add_(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered = nn.Linear(16, 32, bias=False)
        self.reduced = nn.Linear(32, 16, bias=False)
        self.up = nn.Linear(16, 32, bias=False)
        self.scattered = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gathered(x)
        h.mul_(2.0)
        y = self.reduced(h)
        y.add_(x)
        u = self.up(y)
        u.mul_(u.detach().sign())
        z = self.scattered(u)
        z.add_(1.0)
        return z


def _in_place_outputs() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    reference = _InPlace().double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    reference(x).pow(2).sum().backward()
    plan = {
        "gathered": ColwiseParallel(output_layouts=Replicate()),
        "reduced": RowwiseParallel(input_layouts=Replicate()),
        "up": ColwiseParallel(),
        "scattered": RowwiseParallel(output_layouts=Shard(1)),
    }
    for mode in ("fast", "dtensor"):
        with _runtime_env(mode):
            model = parallelize_module(copy.deepcopy(reference), mesh, copy.deepcopy(plan))
        model.zero_grad()
        out = model(x)
        assert_close(out, _shard(reference(x)), rtol=1e-12, atol=1e-12, msg=mode)
        out.pow(2).sum().backward()
        _check_grads(model, reference)


def test_layer_outputs_can_be_modified_in_place_in_both_runtimes():
    """Every layer's local output is a tensor its reader may modify in place, as on one
    device: under ``dtensor`` not ``to_local()``'s view, which autograd refuses to modify."""
    run_distributed(_in_place_outputs, 2)


def test_ci_runs_every_test_file_under_dtensor_or_says_why_not():
    """``.ci/run``'s ``TORCH_TP_RUNTIME=dtensor`` step lists every test file, but those its
    comment names as left out (none compares a model parallelized by torch_tp with one device):
    a new test file must join one or the other."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = (root / ".ci" / "run").read_text()
    start = script.index('step "parity tests again with TORCH_TP_RUNTIME=dtensor')
    step = script[start : script.index("\nstep ", start + 1)]
    comment = "\n".join(line for line in step.splitlines() if line.startswith("#"))
    command = step[step.index("TORCH_TP_RUNTIME=dtensor python -m pytest") :]
    run = set(re.findall(r"test/(test_\w+)\.py", command))
    left_out = set(re.findall(r"\b(test_\w+)\b(?!\.py)", comment))  # not a path
    files = {path.stem for path in (root / "test").glob("test_*.py")}
    assert not run & left_out, run & left_out
    assert run <= files, run - files
    assert files <= run | left_out, sorted(files - run - left_out)
