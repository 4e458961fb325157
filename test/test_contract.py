"""Style contracts (``torch_tp.contract``): one declaration per style, read by everything
that reasons about a plan without running it.

A user-defined style that declares a contract gets a plan name, ``repr`` and ``==``, a
plain-data form and a place in the dry-run report; the report's predictions for such a style
are checked against a measured run in ``test_report.py`` (the ``net_user_style`` case).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import tp_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torch_tp import (
    ColwiseParallel,
    LocalLinearParallel,
    ParallelStyle,
    PartialSumParallel,
    RowwiseParallel,
    SequenceParallel,
    StyleContract,
    TensorParallelExperts,
    parallelize_module,
)
from torch_tp.contract import Boundary, Layout
from torch_tp.models import Experts
from torch_tp.plan import from_dict, to_dict
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.report import plan_report
from torch_tp.testing import check_parity, run_distributed

ROOT = Path(__file__).resolve().parents[1]


class GatheredLinear(ParallelStyle):
    """A user style in plain DTensor: a column-parallel ``nn.Linear`` whose output is gathered.

    Keyword Args:
        use_local_output (bool): hand on a local tensor rather than a replicated DTensor.
    """

    contract = StyleContract(
        names={"test_gathered_linear": {}},
        arguments=lambda s: {"use_local_output": s.use_local_output},
        modules=(nn.Linear,),
        parameters=lambda s, m: {"weight": Shard(0), "bias": Shard(0)},
        inputs=lambda s, m: Boundary(
            (Layout(Replicate(), Replicate(), local=False, grad=Partial()),)
        ),
        outputs=lambda s, m: Boundary((Layout(Shard(-1), Replicate(), s.use_local_output),)),
        local_forward=lambda s, m: True,
    )

    def __init__(self, *, use_local_output: bool = True) -> None:
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded))
        module.register_forward_pre_hook(
            lambda m, args: (DTensor.from_local(args[0], device_mesh, [Replicate()]), *args[1:])
        )
        module.register_forward_hook(lambda m, args, out: self._leave(out, device_mesh))
        return module

    def _leave(self, output: DTensor, mesh) -> torch.Tensor | DTensor:
        output = output.redistribute(mesh, [Replicate()])
        return output.to_local() if self.use_local_output else output


def test_user_style_round_trips_through_plain_data_under_its_name():
    plan = {"up": GatheredLinear(), "down": GatheredLinear(use_local_output=False)}
    data = to_dict(plan)
    assert data == {
        "up": "test_gathered_linear",
        "down": {"style": "GatheredLinear", "use_local_output": False},
    }
    assert from_dict(data) == plan
    assert from_dict({"x": "test_gathered_linear"}) == {"x": GatheredLinear()}


def test_repr_and_eq_read_the_contract():
    assert repr(GatheredLinear(use_local_output=False)) == "GatheredLinear(use_local_output=False)"
    assert GatheredLinear() == GatheredLinear(use_local_output=True)
    assert GatheredLinear() != GatheredLinear(use_local_output=False)
    assert repr(RowwiseParallel(output_layouts=Shard(1))) == (
        "RowwiseParallel(input_layouts=Shard(dim=-1), output_layouts=Shard(dim=1), "
        "use_local_output=True)"
    )


def test_the_contract_says_which_modules_a_style_accepts():
    style = GatheredLinear()
    with pytest.raises(
        NotImplementedError, match=r"GatheredLinear supports nn\.Linear .*Embedding"
    ):
        style._validate(nn.Embedding(4, 4), None)
    style._validate(nn.Linear(4, 4), None)  # accepted
    # class-name patterns: transformers' Conv1D, hand-written norms
    assert ColwiseParallel.contract.accepts(type("Conv1D", (nn.Module,), {})())
    norm = type("MyRMSNorm", (nn.Module,), {})()
    assert torch_tp_style("SequenceParallel").contract.accepts(norm)
    assert not torch_tp_style("SequenceParallel").contract.accepts(nn.Linear(2, 2))


def torch_tp_style(name: str) -> type[ParallelStyle]:
    cls = STYLE_REGISTRY.cls(name)
    assert cls is not None
    return cls


def test_registry_refuses_a_name_that_stands_for_another_style():
    with pytest.raises(ValueError, match="'colwise' already stands for ColwiseParallel"):

        class _Thief(ParallelStyle):
            contract = StyleContract(names={"colwise": {}})

            def _apply(self, module, device_mesh):
                return module

    with pytest.raises(ValueError, match="a style class named 'ColwiseParallel' is registered"):
        type(
            "ColwiseParallel",
            (ParallelStyle,),
            {"contract": StyleContract(), "_apply": lambda self, m, d: m},
        )
    with pytest.raises(TypeError, match="must be a torch_tp.contract.StyleContract"):

        class _Wrong(ParallelStyle):
            contract = {"names": ["x"]}  # type: ignore[assignment]

            def _apply(self, module, device_mesh):
                return module

    assert STYLE_REGISTRY.style("colwise") == ColwiseParallel()


def test_user_style_in_the_report():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    report = plan_report(
        model,
        {"0": "test_gathered_linear", "2": RowwiseParallel(input_layouts=Replicate())},
        2,
        batch_size=2,
        seq_len=4,
        example_inputs=torch.empty(2, 4, 8, device="meta", requires_grad=True),
    )
    assert not report.errors
    assert report.counts("forward") == {"all_gather_into_tensor": 1, "all_reduce": 1}
    # the gradient of the slice the row-parallel layer takes of its replicated input is
    # gathered; the first layer's input gradient (partial sums) is all-reduced
    assert report.counts("backward") == {"all_gather_into_tensor": 1, "all_reduce": 1}
    sharded = {g.name: g.placement for g in report.parameters}
    assert sharded["0.weight"] == "Shard(0)" and sharded["2.weight"] == "Shard(1)"


def _user_style_parity() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plan = {"0": "test_gathered_linear", "2": "rowwise_split_input"}
    check_parity(model, tp_mesh(), plan, (torch.randn(2, 4, 8, requires_grad=True),))


def test_user_style_parity():
    run_distributed(_user_style_parity, 2)


# ------------------------------------------- the linear styles compute what their contract says


class _ContractGathersColumns(ColwiseParallel):
    """ColwiseParallel whose contract alone says the output is gathered (its output_layouts
    stay Shard(-1)): the forward computes the contract's layouts, not its attributes."""

    contract = dataclasses.replace(
        ColwiseParallel.contract,
        names={"test_contract_gathers_columns": {}},
        outputs=lambda s, m: Boundary((Layout(Shard(-1), Replicate(), s.use_local_output),)),
    )


class _ContractScattersRows(RowwiseParallel):
    """RowwiseParallel whose contract alone says the partial sums are reduce-scattered on
    the sequence (dim 1; its output_layouts stay Replicate())."""

    contract = dataclasses.replace(
        RowwiseParallel.contract,
        names={"test_contract_scatters_rows": {}},
        outputs=lambda s, m: Boundary((Layout(Partial(), Shard(1), s.use_local_output),)),
    )


def _forwards_follow_contracts() -> None:
    mesh = tp_mesh()
    rank, n = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    x = torch.randn(2, 4, 8)
    expected = model(x)
    whole = model[0](x)
    parallelize_module(model, mesh, {"0": _ContractGathersColumns(), "1": _ContractScattersRows()})
    # a ColwiseParallel's forward would hand on its 8 columns of 16, a RowwiseParallel's the
    # whole sum: each hands on what its contract says instead
    torch.testing.assert_close(model[0](x), whole)
    out = model[1](whole.chunk(n, dim=-1)[rank])
    torch.testing.assert_close(out, expected.chunk(n, dim=1)[rank])
    # and the report, which reads only the contracts, predicts the collectives they issue
    assert plan_report(
        nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)).to("meta"),
        {"0": _ContractGathersColumns(), "1": _ContractScattersRows()},
        n,
        batch_size=2,
        seq_len=4,
        example_inputs=(torch.empty(2, 4, 8, device="meta"),),
    ).counts("forward") == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


def test_the_linear_styles_compute_the_layouts_their_contract_states():
    run_distributed(_forwards_follow_contracts, 2)


class _ContractGathersSequence(SequenceParallel):
    """SequenceParallel whose contract alone says its output is gathered (its output_layouts
    stay the sequence shard)."""

    contract = dataclasses.replace(
        SequenceParallel.contract,
        names={"test_contract_gathers_sequence": {}},
        outputs=lambda s, m: Boundary((Layout(Shard(1), Replicate(), s.use_local_output),)),
    )


class _ContractScattersSum(PartialSumParallel):
    """PartialSumParallel whose contract alone says its sum is reduce-scattered on the
    sequence (dim 1) rather than all-reduced."""

    contract = dataclasses.replace(
        PartialSumParallel.contract,
        names={"test_contract_scatters_sum": {}},
        outputs=lambda s, m: Boundary((Layout(Partial(), Shard(1)),)),
    )


class _ContractStatesNoInput(PartialSumParallel):
    """PartialSumParallel whose contract states none of the module's inputs."""

    contract = dataclasses.replace(
        PartialSumParallel.contract,
        names={"test_contract_states_no_input": {}},
        inputs=lambda s, m: Boundary((), coalesced=True),
    )


class _ExtraInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor, **named: torch.Tensor):
        return self.down(self.up(sum(named.values(), sum(extra, x))))


def _region_forwards_follow_contracts() -> None:
    mesh = tp_mesh()
    rank, n = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    norm = nn.LayerNorm(8)
    whole = norm(x)
    parallelize_module(norm, mesh, _ContractGathersSequence(use_local_output=True))
    # SequenceParallel's forward would hand on its shard of the positions
    torch.testing.assert_close(norm(x.chunk(n, dim=1)[rank]), whole)

    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8, bias=False)))
    expected = model(x)
    plan = {
        "0": _ContractScattersSum(),
        "0.0": LocalLinearParallel("colwise"),
        "0.2": LocalLinearParallel("rowwise"),
    }
    parallelize_module(model, mesh, plan)
    # PartialSumParallel's forward would hand on the whole sum on every rank
    torch.testing.assert_close(model(x), expected.chunk(n, dim=1)[rank])

    # an input its contract does not state is refused: nothing would sum its gradient
    parts = {"0.up": LocalLinearParallel("colwise"), "0.down": LocalLinearParallel("rowwise")}
    cases = (
        (_ContractStatesNoInput(), (x,), {}, "input 0"),
        (PartialSumParallel(), (x, x), {}, "input 1"),
        (PartialSumParallel(), (x,), {"shift": x}, "'shift'"),
    )
    for style, args, kwargs, where in cases:
        model = nn.Sequential(_ExtraInputs())
        parallelize_module(model, mesh, {"0": style, **parts})
        with pytest.raises(ValueError, match=f"the floating-point {where} is not an input"):
            model[0](*args, **kwargs)


def test_sequence_parallel_and_partial_sums_compute_the_layouts_their_contract_states():
    run_distributed(_region_forwards_follow_contracts, 2)


class _ContractLeavesExpertsPartial(TensorParallelExperts):
    """TensorParallelExperts whose contract alone says the tokens are used as they come and
    the output left a partial sum (its output_layouts stay Replicate())."""

    contract = dataclasses.replace(
        TensorParallelExperts.contract,
        names={"test_contract_leaves_experts_partial": {}},
        inputs=lambda s, m: None,
        outputs=lambda s, m: Boundary((Layout(Partial(), Partial()),)),
    )


def _experts_follow_their_contract() -> None:
    torch.manual_seed(0)
    experts = Experts(n_experts=4, dim=8, hidden_dim=4)
    hidden, weights = torch.randn(6, 8), torch.rand(6, 2)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    expected = experts(hidden, index, weights)
    parallelize_module(experts, tp_mesh(), _ContractLeavesExpertsPartial())
    partial = experts(hidden, index, weights)
    # TensorParallelExperts' forward would sum the ranks' parts: this one hands on its own
    assert not torch.allclose(partial, expected)
    summed = partial.clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(summed, expected)


def test_experts_compute_the_layouts_their_contract_states():
    run_distributed(_experts_follow_their_contract, 2)


# the modules that read contracts instead of style classes
_READERS = (
    "torch_tp/report/plan.py",
    "torch_tp/report/trace.py",
    "torch_tp/plan.py",
    "torch_tp/_names.py",
)


@pytest.mark.parametrize("path", _READERS)
def test_no_reader_names_a_concrete_style_class(path):
    """The report, the plan checks and the plain-data form dispatch on contracts only."""
    builtin = {
        cls.__name__
        for cls in STYLE_REGISTRY.classes()
        if cls.__module__.startswith("torch_tp.style.")
    }
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    named = sorted(
        {
            f"{node.id} (line {node.lineno})"
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id in builtin
        }
        | {
            f"import of {alias.name} (line {node.lineno})"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if alias.name in builtin
        }
    )
    assert not named, f"{path} names built-in style classes: {named}"


def test_every_built_in_style_is_exported():
    """``torch_tp.style.__all__`` (which ``torch_tp`` re-exports) lists every style the
    module defines: the one line a new style adds there, beside its class."""
    import torch_tp
    from torch_tp import style

    defined = [
        cls.__name__
        for cls in STYLE_REGISTRY.classes()
        if cls.__module__.startswith(f"{style.__name__}.")
    ]
    assert sorted(style.__all__) == sorted(["ParallelStyle", *defined])
    assert set(style.__all__) <= set(torch_tp.__all__)


# --------------------------------------------------------------------------- hooks beside it
# What only some styles need is a method of the style (the guide's "Hooks beside the
# contract"); a user's style that defines one is served like a built-in one.


class _SelectedRows(nn.Module):
    """Keeps the rows whose first feature is positive: a shape meta tensors cannot know."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[torch.nonzero(x[:, 0] > 0).squeeze(1)]


class _WholeRows(ParallelStyle):
    """A user style computing its module whole on every rank, no collective."""

    contract = StyleContract(
        names={"test_whole_rows": {}},
        inputs=lambda s, m: Boundary((Layout(Replicate(), Replicate()),)),
        outputs=lambda s, m: Boundary((Layout(Replicate(), Replicate()),)),
        local_forward=lambda s, m: True,
    )

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return module


class _WholeRowsWithHooks(_WholeRows):
    contract = StyleContract(
        names={"test_whole_rows_hooked": {}},
        inputs=_WholeRows.contract.inputs,
        outputs=_WholeRows.contract.outputs,
        local_forward=_WholeRows.contract.local_forward,
    )

    def _meta_output(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        return torch.empty_like(args[0])  # every row, as balanced data would keep

    def _parameter_entry(self, parameter: torch.Tensor) -> Shard:
        return Shard(parameter.ndim - 1)


def test_a_user_styles_hooks_are_called_like_a_built_in_ones():
    from torch_tp.plan import parameter_entry_placement
    from torch_tp.shapes import ShapeCheckError, check_shapes

    x = torch.randn(4, 8)
    # without the hook the trace cannot run the data-dependent forward on meta tensors
    with pytest.raises(ShapeCheckError):
        check_shapes(_SelectedRows(), {"": _WholeRows()}, 2, example_inputs=(x,))
    # with it, the trace takes the style's meta output in place of the forward
    assert check_shapes(_SelectedRows(), {"": _WholeRowsWithHooks()}, 2, example_inputs=(x,)) == []
    # a plan entry naming a parameter states what the style's hook says, not a Linear's
    weight = torch.empty(3, 5)
    assert parameter_entry_placement(_WholeRowsWithHooks(), weight) == Shard(1)
    assert parameter_entry_placement(_WholeRows(), weight) is None
