"""A style's contract, as data.

A :class:`~torch_tp.ParallelStyle` does two things: at :func:`~torch_tp.parallelize_module`
time it shards its module's parameters and installs the layout changes around it (its
``_apply``, the fast path), and it *promises* what those are. The promise is a
:class:`StyleContract`, declared once, as the class attribute ``contract`` of each style.
Everything that reasons about a plan without running it reads that declaration and nothing
else: ``repr`` and ``==`` of styles, their plain-data form (:func:`torch_tp.plan.to_dict` /
:func:`~torch_tp.plan.from_dict`) and their names in plans, the tied-weight check, the
chaining checks and the collectives predicted by the dry-run report
(:func:`torch_tp.report.plan_report`). The report's predictions are compared with measured
runs in the tests, which is what keeps a contract and its ``_apply`` in agreement.

A style class that declares a contract is registered (in
:data:`torch_tp.registry.STYLE_REGISTRY`) when it is defined, under its class name and
under the plan names the contract lists, so that ``{"mlp": "my_style"}`` and
``{"mlp": {"style": "MyStyle", ...}}`` build it.

Layouts are described from the module's point of view. For each value crossing the
module's boundary (its inputs, then its outputs), a :class:`Layout` says how the value is
laid out when it arrives (``given``), where the style moves it (``to``), whether the
receiver gets a plain tensor or a :class:`~torch.distributed.tensor.DTensor` (``local``),
and, for an input the module computes with locally, the placement of the gradient it sends
back (``grad``). A local tensor carries no layout of its own: ``given`` is what the plan
declares about it, and the report checks that it is what its producer made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.distributed.tensor import Placement

if TYPE_CHECKING:
    from torch_tp.style import ParallelStyle

__all__ = ["Boundary", "Layout", "StyleContract", "Transfer", "kind_name"]


@dataclass(frozen=True)
class Layout:
    """How one value crosses the boundary of a style's module.

    Args:
        given (Placement, optional): the layout the value has when it reaches the boundary.
            For an input, the layout a plain tensor is declared to have (a DTensor carries
            its own); for an output, the layout the module computes it in. ``None``: the
            value is left alone. Shard dims may count from the end (``Shard(-1)``).
        to (Placement, optional): the layout the style moves it to. ``None``: where it is.
        local (bool): the receiver (the module, for an input; the caller, for an output)
            gets this rank's plain tensor rather than a DTensor. Default: ``True``.
        grad (Placement, optional): for an input of a module whose forward the report does
            not follow (``local_forward``), the placement of the gradient the module's
            computation gives back: ``to`` (the default) when each rank computes with its
            own part, ``Partial()`` when each rank computes with the whole input against
            its shard of the weights (a column-parallel layer), so that the input gradients
            are summed. Plain-tensor inputs read whole this way share one entry per tensor
            (q, k and v reading one activation are gathered, and their input gradients
            reduced, once).
    """

    given: Placement | None
    to: Placement | None = None
    local: bool = True
    grad: Placement | None = None


@dataclass(frozen=True)
class Boundary:
    """The layouts of one side of a module: its positional and keyword inputs, or its outputs.

    Args:
        args (tuple): one :class:`Layout` (or ``None``: left alone) per positional input or
            per output, from the first; values beyond them are left alone.
        kwargs (Mapping[str, Layout]): keyword inputs, by name.
        exact (bool): the module must be called with exactly ``len(args)`` positional inputs
            (return exactly ``len(args)`` outputs); the report flags a mismatch.
        coalesced (bool): the inputs' gradients that come back as partial sums (``grad=
            Partial()``) are summed together, in one collective over one flat buffer, rather
            than one each (an experts module's tokens and routing weights).
    """

    args: tuple[Layout | None, ...] = ()
    kwargs: Mapping[str, Layout] = field(default_factory=dict)
    exact: bool = False
    coalesced: bool = False


@dataclass(frozen=True)
class Transfer:
    """A collective a module's forward issues itself, beyond what its layouts describe (tokens
    dispatched to their experts by all-to-all), for the report.

    Args:
        phase (str): ``"forward"`` or ``"backward"``.
        kind (str): the collective, as the report names them (``"all_to_all"``), or
            ``"send_recv"``: one point-to-point send (with as many receives).
        nbytes (int): the bytes of one, as the report counts them: the bytes this rank
            sends (an all-to-all, a send), the whole tensor gathered (an all-gather's
            output) or reduced (a reduce-scatter's input).
        mesh_dim (int, optional): for a style on an N-D mesh (``mesh_ndim > 1``), the
            dimension of its mesh the collective runs over (``0``: the first). Default:
            ``None``, the style's whole (1-D) mesh.
    """

    phase: str
    kind: str
    nbytes: int
    mesh_dim: int | None = None


def _nothing(style: ParallelStyle, module: nn.Module) -> Any:
    return None


def _own_arguments(style: ParallelStyle) -> dict[str, Any]:
    """The default ``arguments``: the attributes the constructor stored under its own names."""
    return {k: v for k, v in vars(style).items() if k != "src_data_rank"}


@dataclass(frozen=True)
class StyleContract:
    """What a style promises: declared once per style class, as its ``contract`` attribute.

    Every field but ``names``, ``modules``, ``mesh_ndim`` and ``mesh_dims`` is a function of
    the style object (and, for the layouts, of the module it is applied to), so that one
    declaration covers every argument the style takes. What each field means, its defaults
    and who reads it: the guide's "The fields of a contract", under "Writing your own style"
    (docs/guide.md). What only one kind of style needs besides (the placement a parameter
    entry states, a meta output for the report, ...) is a hook on that style instead: see
    :class:`torch_tp.ParallelStyle`.

    Args:
        names (Mapping[str, Mapping[str, Any]]): plan names for the style, each with its arguments.
        arguments (callable): ``style -> dict`` of the constructor arguments that rebuild it.
        modules (tuple): the module kinds it accepts (classes, class-name patterns); ``()``: any.
        parameters (callable): ``(style, module) -> {name: Placement}``, its parameters' placements.
        partial_gradients (callable): ``(style, module) -> names``, the partial-gradient parameters.
        inputs (callable): ``(style, module) -> Boundary`` for the module's inputs.
        outputs (callable): ``(style, module) -> Boundary`` for its outputs.
        local_forward (callable): ``(style, module) -> bool``: its forward has no collective.
        caveat (callable): ``(style, module) -> str | None``, a note for the dry-run report.
        transfers (callable): ``(style, module, inputs, degree) -> [Transfer]``, collectives.
        partial_sum (callable): ``style -> str | None``, its part in a partial-sum region.
        mesh_ndim (int): the dimensions of the mesh the style is applied on. Default: 1.
        mesh_dims (tuple[str, ...], optional): the mesh dimensions it runs on, by name.

    Example::
        >>> from torch.distributed.tensor import Replicate
        >>> contract = StyleContract(
        ...     names={"replicate_parameters": {}},  # {"mlp": "replicate_parameters"}
        ...     parameters=lambda style, module: {
        ...         name: Replicate() for name, _ in module.named_parameters(recurse=False)
        ...     },
        ... )
    """

    names: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    arguments: Callable[[Any], dict[str, Any]] = _own_arguments
    modules: tuple[type | str, ...] = ()
    parameters: Callable[[Any, nn.Module], Mapping[str, Placement] | None] = _nothing
    partial_gradients: Callable[[Any, nn.Module], tuple[str, ...] | None] = _nothing
    inputs: Callable[[Any, nn.Module], Boundary | None] = _nothing
    outputs: Callable[[Any, nn.Module], Boundary | None] = _nothing
    local_forward: Callable[[Any, nn.Module], bool] = _nothing
    caveat: Callable[[Any, nn.Module], str | None] = _nothing
    transfers: Callable[[Any, nn.Module, tuple, int], Sequence[Transfer] | None] = (
        lambda style, module, inputs, degree: None
    )
    partial_sum: Callable[[Any], str | None] = lambda style: None
    mesh_ndim: int = 1
    mesh_dims: tuple[str, ...] | None = None

    def accepts(self, module: nn.Module) -> bool:
        """Whether ``module`` is of a kind this contract lists (any, if it lists none)."""
        if not self.modules:
            return True
        names = [cls.__name__ for cls in type(module).__mro__]
        for kind in self.modules:
            if isinstance(kind, type):
                if isinstance(module, kind):
                    return True
            elif any(_matches(name, kind) for name in names):
                return True
        return False

    def describe_modules(self) -> str:
        """``nn.Linear, nn.Embedding and Conv1D``, for error messages."""
        shown = [kind_name(kind) if isinstance(kind, type) else kind for kind in self.modules]
        return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def kind_name(cls: type) -> str:
    """``nn.Linear`` for torch's own modules, the qualified name for others."""
    if cls.__module__.startswith("torch.nn."):
        return f"nn.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` is a class name, or ``*Suffix`` for every class name ending so."""
    if pattern.startswith("*"):
        return name.endswith(pattern[1:])
    return name == pattern
