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

    Every field but ``names`` and ``modules`` is a function of the style object (and, for
    the layouts, of the module it is applied to), so that one declaration covers every
    argument the style takes.

    Args:
        names (Mapping[str, Mapping[str, Any]]): plan names that stand for this style, each
            with the constructor arguments it means (``{"colwise": {}, "colwise_rep":
            {"output_layouts": Replicate()}}``). The first name of each distinct style is the
            one :func:`torch_tp.plan.to_dict` writes; later ones are aliases.
        arguments (callable): ``style -> dict`` of constructor arguments that rebuild an
            equal style, in signature order; ``repr``, ``==`` and the plain-data form read
            it. Arguments named ``*layouts`` hold placements (written ``"Shard(1)"``).
            Default: the style's attributes, but ``src_data_rank``.
        modules (tuple): the module kinds the style accepts: classes (subclasses accepted)
            and class-name patterns (``"Conv1D"``, ``"*RMSNorm"``, matched against the
            names of the module's classes). Empty: every module. The style's ``_validate``
            checks the rest (sizes, flags).
        parameters (callable): ``(style, module) -> {name: Placement}``, the placement of
            each of the module's own parameters the style distributes (``None`` or ``{}``:
            it distributes none); a style that distributes its submodules' parameters too
            names them dotted (``"w1.weight"``: ``ReplicateParallel`` replicates the whole
            module).
        partial_gradients (callable): ``(style, module) -> names`` of parameters whose
            gradient each rank computes only a part of (a replicated parameter used on a
            shard of the data), summed over the ranks at the end of backward. A replicated
            parameter not listed here must see the same, whole data on every rank:
            :func:`torch_tp.plan.validate_plan` refuses a plan that shows otherwise, and
            the dry-run report flags one its trace finds computing on a shard.
        inputs (callable): ``(style, module) -> Boundary`` for the module's inputs.
        outputs (callable): ``(style, module) -> Boundary`` for its outputs.
        local_forward (callable): ``(style, module) -> bool``, whether the module's forward
            computes on this rank's data with no collective of its own (on local tensors, or
            on DTensors whose ops need none) and produces its outputs laid out as the
            outputs' ``given`` says. The report then does not follow the ops inside it, and
            takes each input's gradient to be as its ``grad`` says. Otherwise (the default)
            the report follows the forward's ops.
        caveat (callable): ``(style, module) -> str | None``, a note the report adds for this
            module (what it cannot predict).
        transfers (callable): ``(style, module, inputs, degree) -> [Transfer, ...]``, the
            collectives the module's forward issues itself, and those of their backward, that
            no layout describes, given its inputs (global shapes, as in the unparallelized
            model) and the mesh size (for a style on an N-D mesh, the tuple of its
            dimensions' sizes, each transfer naming its ``mesh_dim``); for data-dependent ones
            (routing), their sizes under balanced routing. Default: none.
        parameter_entry (callable): ``(style, parameter) -> Placement``, what a plan entry
            of this style states when its key names a parameter rather than a module
            (``"...experts.gate_up_proj": "grouped_gemm"``): the placement the parameter's
            module's style must give it. Default: ``None``, the parameter taken as a
            Linear's weight (or, 1-D, bias), placed as the style places those.
        with_parameter_entries (callable): ``(style, {name: Placement}) -> style``, for a
            style that takes its parameters' placements from the plan's parameter entries
            under its module (transformers' ``local_params`` next to ``"self_attn.sinks":
            "colwise"``): the style those entries make of it. Default: ``None``, the entries
            are checked against the style's own placements instead.
        meta_output (callable): ``(style, module, args, kwargs) -> output``, what the
            module returns, as meta tensors of the right shapes, for a module whose forward
            cannot run on the meta device (it reads its inputs' values: routing counts); the
            report calls it instead of the forward. Default: ``None``, run the forward.
        attributes (callable): ``(style, module, degree) -> {name: value}``, the attributes
            of the module that ``_apply`` sets on a mesh of ``degree`` ranks (the per-rank
            sizes :class:`~torch_tp.AttentionHeads` divides), for the shape check
            (:func:`torch_tp.shapes.check_shapes`), which runs the module as one rank
            sees it. Default: none.
        partial_sum (callable): ``style -> str | None``, the style's part in a partial-sum
            region (a module whose forward, run on this rank's shards as local tensors,
            gives each rank a part of its output, summed as it leaves: transformers'
            ``"all_reduce"``, and its 4.x ``"gather"`` with ``"local_*"`` styles inside).
            ``"region"``: the style is such a region. ``"part"``: the style computes on its
            shards with no collective, so it belongs inside a region and is refused outside
            one. ``"either"``: no collective either, right inside a region or outside.
            ``None`` (the default): the style issues collectives of its own, and is refused
            inside a region, whose sum would count them again.
        mesh_ndim (int): the dimensions of the mesh the style is applied on. Default: 1.
            A style on an N-D mesh (:class:`~torch_tp.ExpertTensorParallel`, on ``(ep,
            tp)``) gives each parameter a tuple of N placements in ``parameters``; its
            ``inputs`` and ``outputs`` are the layouts over its last dimension (the one the 1-D
            styles of the plan share: ``tp``), and the collectives over its other dimensions
            are ``transfers`` naming their ``mesh_dim``. The dry-run report, given the mesh's
            shape, places it on the mesh's last N dimensions; the shape check takes 1-D
            styles only, and refuses it by name.
        mesh_dims (tuple[str, ...], optional): the dimensions, by name, the style runs on
            (``("cp",)``: :class:`~torch_tp.ContextParallel`). Default: ``None``, the mesh's
            last ``mesh_ndim``. The dry-run report, given the mesh's shape, places the style
            on these, and refuses a plan with such a style given an int degree.
        sequence_chunks (callable, optional): ``(style, degree) -> int``, for a style that
            splits the whole model's sequence over its mesh dimension (context parallelism):
            the number of equal chunks the sequence is cut in on ``degree`` ranks. The report
            then traces the model with ``seq_len / degree`` tokens per rank, and refuses a
            ``seq_len`` the chunks do not divide. Default: ``None``, the sequence is whole.
        attention_transfers (callable, optional): ``(style, module, query, key, value,
            kwargs, degree) -> [Transfer, ...]``, the collectives (and point-to-point
            transfers, kind ``"send_recv"``) that each ``F.scaled_dot_product_attention``
            call inside the module issues, forward and backward, given the call's query, key
            and value as one rank holds them (meta tensors: its tokens, its heads) and its
            keyword arguments. Default: ``None``, the calls issue nothing.
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
    parameter_entry: Callable[[Any, Any], Placement | None] | None = None
    with_parameter_entries: Callable[[Any, Mapping[str, Placement]], Any] | None = None
    meta_output: Callable[[Any, nn.Module, tuple, dict], Any] | None = None
    partial_sum: Callable[[Any], str | None] = lambda style: None
    attributes: Callable[[Any, nn.Module, int], Mapping[str, Any] | None] = (
        lambda style, module, degree: None
    )
    mesh_ndim: int = 1
    mesh_dims: tuple[str, ...] | None = None
    sequence_chunks: Callable[[Any, int], int] | None = None
    attention_transfers: Callable[..., Sequence[Transfer] | None] | None = None

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
