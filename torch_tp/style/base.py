"""The base of every style: :class:`ParallelStyle`, and the helpers the style families share.

:class:`ParallelStyle` is the contract machinery: a subclass that declares a ``contract``
registers itself when it is defined, and ``repr`` and ``==`` read the contract's arguments.
Beside it:

* checking constructor arguments (``check_flag``, ``check_int``, ``check_layouts``, ...) and
  :func:`short_repr`, through which every error message echoes user values; ``style_at``
  names a style and the module it runs on;
* the plan being applied (:func:`planning`, :func:`plan_root`, :func:`plan_styled`);
* distributing a module's parameters (``distribute_parameters``, ``distribute_and_wrap``)
  and running its own forward on local views of them (``run_on_local_parameters``);
* what a stock ``nn.Linear``, ``Conv1D`` or ``nn.Embedding`` computes (``stock_projection``,
  ``uses_stock_forward``), which the shape check reads too;
* the replicated parameters of a module and of the unstyled modules inside it
  (``_ReplicatedParameters``, ``distribute_whole``, ``swap_in_local_parameters``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from torch_tp import _torch_compat as compat
from torch_tp import runtime
from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Layout, StyleContract, kind_name
from torch_tp.registry import STYLE_REGISTRY

# the base class and the part of the style kit that distributes a module's parameters
# (docs/guide.md, "The style kit"); the other helpers serve the built-in families
__all__ = [
    "ParallelStyle",
    "distribute_and_wrap",
    "distribute_parameters",
    "run_on_local_parameters",
]


class ParallelStyle(ABC):
    """The contract between :func:`parallelize_module` and one way of parallelizing a module.

    Subclasses implement :meth:`_apply`, which shards the parameters the style owns into
    DTensors and installs the input and output layout transforms around the module. They may
    also implement :meth:`_validate`, which :func:`parallelize_module` calls on every
    ``(module, style)`` pair of a plan before the first :meth:`_apply`, so that a bad plan
    fails before anything changes.

    What :meth:`_apply` does is declared once, as data, in the class attribute ``contract``
    (a :class:`~torch_tp.contract.StyleContract`): the module kinds the style accepts, each
    parameter's placement, the layouts of the inputs and outputs, the partial gradients, the
    constructor arguments and the plan names. ``repr``, ``==``, the plain-data form of plans,
    the tied-weight and chaining checks and the dry-run report read it. A class that
    declares a contract is registered under its name and plan names when it is defined.

    Styles are plain values: they compare equal when their arguments are equal and print as
    the call that builds them.

    Attributes:
        src_data_rank (int, optional): the rank whose values are scattered or broadcast when
            parameters are distributed; ``None`` means each rank keeps its local values.
            :func:`parallelize_module` sets it from its own ``src_data_rank`` argument.
        contract (StyleContract, optional): the style's declaration; ``None`` (a style that
            declares nothing): the report says it cannot predict it, and the style has no
            plain-data form.
    """

    src_data_rank: int | None = 0
    contract: ClassVar[StyleContract | None] = None

    # Hooks that only some styles need, beside the contract every style declares: None (the
    # default) where a style has none, a method where it has one. What each answers and who
    # asks: the guide's "Hooks beside the contract" (docs/guide.md).
    _parameter_entry: ClassVar[Callable[[torch.Tensor], Placement | None] | None] = None
    _with_parameter_entries: ClassVar[Callable[[Mapping[str, Placement]], Any] | None] = None
    _meta_output: ClassVar[Callable[[nn.Module, tuple, dict], Any] | None] = None
    _rank_attributes: ClassVar[Callable[[nn.Module, int], Mapping[str, Any]] | None] = None
    _sequence_chunks: ClassVar[Callable[[int], int] | None] = None
    _attention_transfers: ClassVar[Callable[..., Sequence[Any]] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("contract") is not None:
            STYLE_REGISTRY.register(cls)

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Parallelize ``module`` in place on ``device_mesh`` and return it."""

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """Raise if this style cannot be applied to ``module``; never modify anything.

        Raise ``NotImplementedError`` for an unsupported module type and ``ValueError`` or
        ``TypeError`` for anything else. :func:`parallelize_module` adds the module's path
        and the style to the message. The default checks the module kinds the contract
        lists.
        """
        self._check_kind(module)

    def _boundaries(self, module: nn.Module) -> tuple[Layout, Layout]:
        """The layouts of ``module``'s first input and its first output as the contract
        states them: a built-in style binds them into its forward at ``_apply`` and computes
        with them, so that they are stated once."""
        contract = type(self).contract
        return contract.inputs(self, module).args[0], contract.outputs(self, module).args[0]

    def _entry_and_exit(self, module: nn.Module) -> tuple[Any, Layout]:
        """The contract's input boundary of ``module`` (a ``Boundary``, or ``None``: its
        inputs are used as they come) and the layout of its first output, for a style whose
        forward enters several inputs: bound into the forward at ``_apply``, as
        :meth:`_boundaries` is."""
        contract = type(self).contract
        return contract.inputs(self, module), contract.outputs(self, module).args[0]

    def _check_kind(self, module: nn.Module) -> None:
        """Raise ``NotImplementedError`` unless the contract accepts ``module``'s kind."""
        contract = self.contract
        if contract is not None and not contract.accepts(module):
            raise NotImplementedError(
                f"{type(self).__name__} supports {contract.describe_modules()} (and their "
                f"subclasses), found {kind_name(type(module))}"
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in style_arguments(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return style_arguments(self) == style_arguments(other)

    __hash__ = None  # type: ignore[assignment]  # styles are mutable (src_data_rank)


def style_arguments(style: ParallelStyle) -> dict[str, Any]:
    """The constructor arguments of ``style``, as its contract reads them."""
    contract = style.contract or StyleContract()
    return contract.arguments(style)


# parallelize_module records on each module the path it was reached by, for runtime errors
MODULE_PATH_ATTR = "_torch_tp_path"


def style_at(style: ParallelStyle, module: nn.Module) -> str:
    """``ColwiseParallel(...) on 'layers.0.attention.wq' (Linear)``, for error messages."""
    path = getattr(module, MODULE_PATH_ATTR, None)
    place = f"'{path}'" if path else ("the root module" if path == "" else "a module")
    return f"{short_repr(style, STYLE_REPR_LIMIT)} on {place} ({type(module).__name__})"


# ------------------------------------------------------------------------------------------
# Checking arguments. Errors echo user values through short_repr: a plan is data a user may
# have generated, and an error message must stay readable whatever it holds.
# ------------------------------------------------------------------------------------------

# the most characters of one user value an error message shows (styles: a little more, so
# that every ordinary style prints whole)
REPR_LIMIT = 200


STYLE_REPR_LIMIT = 500


class _BoundedRepr(reprlib.Repr):
    """``reprlib`` with room for placements and names: a few items, a few levels deep."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 8
        self.maxdeque = self.maxarray = 8
        self.maxstring = self.maxother = self.maxlong = limit

    def repr_dict(self, x: dict, level: int) -> str:
        # in insertion order (reprlib sorts): a plan entry reads {'style': ..., arguments}
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = itertools.islice(x.items(), self.maxdict)
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in items]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"


_BOUNDED_REPRS: dict[int, _BoundedRepr] = {}


def short_repr(value: object, limit: int = REPR_LIMIT) -> str:
    """``repr(value)`` for an error message: at most ``limit`` characters of it, then
    ``... (N chars)`` or ``... (N items)``.

    Containers are walked only a few items wide and a few levels deep, so neither a huge nor
    a deeply nested (or self-referential) value is walked whole; a repr that fails is named
    instead of raising from inside an error message.
    """
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value)} chars)"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        bounded = _BOUNDED_REPRS.get(limit)
        if bounded is None:
            bounded = _BOUNDED_REPRS[limit] = _BoundedRepr(limit)
        text, size = bounded.repr(value), f"{len(value)} items"
    else:
        try:
            text = repr(value)
        except Exception as err:  # noqa: BLE001 - any repr may fail; the message must not
            return f"<{type(value).__name__} object (repr failed: {type(err).__name__})>"
        size = f"{len(text)} chars"
    if len(text) <= limit:
        return text if size.endswith("chars") or len(value) <= 8 else f"{text} ({size})"
    return f"{text[:limit]}... ({size})"


def check_flag(value: object, what: str) -> bool:
    """``value`` if it is a ``bool``; a string such as ``"false"`` would be taken as true."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{what} must be a bool (True or False), found {type(value).__name__} "
            f"{short_repr(value)}"
        )
    return value


def check_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, found {type(value).__name__} {short_repr(value)}")
    return value


def _check_placement(layout: object, what: str) -> None:
    """A :class:`Placement` whose own arguments are valid (DTensor does not check them)."""
    if not isinstance(layout, Placement):
        raise TypeError(
            f"{what} must hold Placements (or None), found {type(layout).__name__} "
            f"{short_repr(layout)}"
        )
    if isinstance(layout, StridedShard) and layout.split_factor < 1:
        raise ValueError(
            f"{what}: the split_factor of {layout!r} must be a positive int, found "
            f"{layout.split_factor}"
        )


def check_layouts(layouts: Placement | tuple[Placement | None, ...] | None, what: str):
    """Normalize a layouts argument to a tuple (or ``None``), checking every element."""
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        _check_placement(layouts, what)
        return (layouts,)
    if not isinstance(layouts, (tuple, list)):
        raise TypeError(
            f"{what} must be a Placement or a tuple of them, found {type(layouts).__name__} "
            f"{short_repr(layouts)}"
        )
    for layout in layouts:
        if layout is not None:
            _check_placement(layout, what)
    return tuple(layouts)


def check_kwarg_layouts(layouts: Mapping[str, Placement] | None, what: str) -> dict[str, Placement]:
    """Normalize a keyword-layouts argument to a dict, checking every entry."""
    if layouts is None:
        return {}
    if not isinstance(layouts, Mapping):
        raise TypeError(
            f"{what} must be a dict from keyword names to Placements, found "
            f"{type(layouts).__name__} {short_repr(layouts)}"
        )
    for name, layout in layouts.items():
        if not isinstance(name, str):
            raise TypeError(f"{what} must have str keys, found {short_repr(name)}")
        _check_placement(layout, f"{what}[{short_repr(name)}]")
    return dict(layouts)


def check_single_layout(
    layout: Placement | None, default: Placement, what: str
) -> tuple[Placement]:
    """The single-element layout tuples of Colwise/Rowwise (upstream keeps them as tuples)."""
    if layout is None:
        return (default,)
    if not isinstance(layout, Placement):
        raise TypeError(
            f"{what} must be a Placement, found {type(layout).__name__} {short_repr(layout)}"
        )
    _check_placement(layout, what)
    return (layout,)


def error_in_module(style: ParallelStyle, module: nn.Module, err: Exception) -> ValueError:
    """A layout error (:class:`runtime.ShardDimError`) again, as a ``ValueError`` naming
    the style and the module it runs on.

    The layout helpers raise without knowing either; the styles catch at their entry points
    (a ``try`` costs nothing until something raises).
    """
    return ValueError(f"{style_at(style, module)}: {err}")


# the root module of the parallelize_module call validating and applying styles: a style
# whose sizes live in the model's config, not on its module, reads them there
_plan_root: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar(
    "torch_tp_plan_root", default=None
)


# the modules the plan being applied gives a style (by id): a partial-sum region replicates
# the parameters of the other modules inside it
_plan_styled: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar(
    "torch_tp_plan_styled", default=None
)


@contextlib.contextmanager
def planning(root: nn.Module, styled: frozenset[int] | None = None):
    """The root of the plan being validated and applied, for :func:`plan_root`, and the ids
    of the modules it gives a style, for :func:`plan_styled`."""
    token = _plan_root.set(root)
    styled_token = _plan_styled.set(styled)
    try:
        yield
    finally:
        _plan_styled.reset(styled_token)
        _plan_root.reset(token)


def plan_root() -> nn.Module | None:
    """The root module of the :func:`parallelize_module` call running (``None``: a style
    applied by hand)."""
    return _plan_root.get()


def plan_styled() -> frozenset[int] | None:
    """The ids of the modules the plan being applied gives a style (``None``: a style
    applied by hand, or a plan that did not say)."""
    return _plan_styled.get()


def distribute_and_wrap(
    style: ParallelStyle,
    module: nn.Module,
    device_mesh: DeviceMesh,
    placements: Mapping[str, Placement | tuple[Placement, ...]],
    *bound: Any,
) -> nn.Module:
    """Distribute ``module``'s parameters as ``placements`` say, and run ``style._forward(
    module, runtime, own_forward, *bound, *inputs)`` in place of the module's forward (its
    class's own, unbound, passed on for the style to call)."""
    rt = runtime.for_mesh(device_mesh)
    distribute_parameters(module, rt, placements, style.src_data_rank)
    module.forward = functools.partial(style._forward, module, rt, type(module).forward, *bound)
    return module


def distribute_parameters(
    module: nn.Module,
    rt: runtime.DTensorRuntime,
    placements: Mapping[str, Placement | tuple[Placement, ...]],
    src_data_rank: int | None,
) -> None:
    """Replace each named direct parameter of ``module`` by a DTensor with that placement (a
    tuple of them on an N-D mesh), on the runtime's mesh.

    A parameter tied between modules (GPT-2's ``wte`` and ``lm_head``) is distributed once:
    the first module's style leaves the new DTensor parameter on the old one, and the
    others register that same object, so the weights stay tied. :func:`parallelize_module`
    has checked that every owner lays it out alike.
    """
    device_mesh = rt.mesh
    for name, placement in placements.items():
        param = getattr(module, name)
        if param is None:
            continue
        # one placement per mesh dimension (a tuple, on an N-D mesh)
        spec = tuple(placement) if isinstance(placement, tuple) else (placement,)
        tied = getattr(param, _DISTRIBUTED_AS, None)
        if tied is not None and tied.device_mesh == device_mesh and tied.placements == spec:
            module.register_parameter(name, tied)
            continue
        # src_data_rank=None keeps each rank's local values (no scatter or broadcast)
        dtensor = distribute_tensor(param.detach(), device_mesh, spec, src_data_rank=src_data_rank)
        new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        if isinstance(placement, Replicate) and new.requires_grad:
            # computing on shards (a sequence shard, a sharded output) leaves each rank with a
            # partial sum of a replicated parameter's gradient: sum it (once per backward for
            # all such parameters), so every rank holds the full gradient, as on one device
            rt.sum_partial_gradients(new)
        setattr(param, _DISTRIBUTED_AS, new)
        module.register_parameter(name, new)


_DISTRIBUTED_AS = "_torch_tp_distributed_as"


def conv1d_base(module: nn.Module) -> type | None:
    """transformers' ``Conv1D`` class if ``module`` is one (or a subclass), else ``None``.

    GPT-2's projections are ``Conv1D``: a Linear whose weight is stored transposed,
    ``(in_features, out_features)``, computing ``x @ weight + bias``. It is recognized by
    name and shape (``nx``/``nf`` attributes, a 2-D weight), so torch_tp needs no import of
    transformers.
    """
    for cls in type(module).__mro__:
        if cls.__name__ == "Conv1D":
            weight = getattr(module, "weight", None)
            shape = (getattr(module, "nx", None), getattr(module, "nf", None))
            if isinstance(weight, torch.Tensor) and tuple(weight.shape) == shape:
                return cls
            return None
    return None


def out_features_of(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.nf


def in_features_of(module: nn.Module) -> int:
    return module.in_features if isinstance(module, nn.Linear) else module.nx


def stock_projection(
    style: ParallelStyle,
    module: nn.Module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``module``'s own computation (Linear or Conv1D) with local ``weight`` and ``bias``.

    An input whose features do not match the local weight's is how a plan whose layouts do
    not chain first shows (two row-parallel layers in a row, a column-parallel layer after
    another): aten's ``mat1 and mat2 shapes cannot be multiplied`` becomes an error naming
    the module, its style, both sizes and the layout to change (same type, chained)."""
    try:
        if isinstance(module, nn.Linear):
            return F.linear(x, weight, bias)
        # Conv1D, as transformers computes it: addmm on the flattened tokens
        flat = x.reshape(-1, x.shape[-1])
        y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], weight.shape[-1])
    except RuntimeError as err:
        takes = weight.shape[-1] if isinstance(module, nn.Linear) else weight.shape[0]
        if x.ndim == 0 or x.shape[-1] == takes:
            raise
        raise LayoutsDoNotChain(_features_mismatch(style, module, x.shape[-1], takes)) from err


class LayoutsDoNotChain(RuntimeError):
    """A planned layer's input does not have the features its local weight takes: the plan's
    layouts do not chain (a ``RuntimeError``, as aten's error it replaces, which it chains)."""


def _features_mismatch(style: ParallelStyle, module: nn.Module, found: int, takes: int) -> str:
    whole = in_features_of(module)
    base = (
        f"{style_at(style, module)}: this rank's input has {found} features in its last "
        f"dimension, but its part of the weight takes {takes} (of {whole})"
    )
    if takes < whole and found == whole:
        return (
            f"{base}. The input arrives whole, while this style takes it sharded on the "
            "last dimension, as a column-parallel layer before it leaves it: make the layer "
            "that feeds it ColwiseParallel (the column-then-row pair), or say that its input "
            "is whole with input_layouts=Replicate() (each rank then keeps its slice)"
        )
    if takes == whole and found < whole:
        return (
            f"{base}. The input arrives sharded on the last dimension (a column-parallel "
            "layer before it leaves its output so), while this style takes it whole: make "
            "this layer RowwiseParallel (the column-then-row pair), or say that its input is "
            "sharded with input_layouts=Shard(-1) (it is then gathered first)"
        )
    return f"{base}: the layouts of the plan around this module do not chain"


def uses_stock_forward(module: nn.Module) -> bool:
    """True when ``module`` runs the forward of torch's Linear/Embedding, unchanged.

    Only then may a style replace the forward by an equivalent computation on local shards;
    a subclass with its own forward keeps it and runs on DTensors instead, or, for an
    Embedding subclass whose lookup gives whole features, with its lookups done by the style
    (:func:`_own_lookups`).
    """
    for base in (nn.Linear, nn.Embedding, conv1d_base(module)):
        if base is not None and isinstance(module, base):
            return type(module).forward is base.forward
    return False


def check_not_distributed(module: nn.Module) -> None:
    for name, param in module.named_parameters(recurse=False):
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name!r} is already a DTensor with placements "
                f"{param.placements}: the module was parallelized before"
            )


def check_placements_argument(placements: Mapping[str, Placement] | None) -> dict | None:
    """A ``placements`` argument checked (parameter names to Placements) and copied."""
    if placements is None:
        return None
    if not isinstance(placements, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Placement) for k, v in placements.items()
    ):
        raise TypeError(
            f"placements must map parameter names to Placements, found {short_repr(placements)}"
        )
    return dict(placements)


def check_direct_placements(
    module: nn.Module, placements: Mapping[str, Placement], device_mesh: DeviceMesh
) -> None:
    """Refuse placements naming no direct parameter of ``module``, or splitting one unevenly
    (a strided shard: into ``split_factor`` parts per rank)."""
    params = dict(module.named_parameters(recurse=False))
    missing = sorted(set(placements) - set(params))
    if missing:
        raise ValueError(f"{type(module).__name__} has no direct parameters {missing}")
    n = device_mesh.size()
    for name, placement in placements.items():
        param = params[name]
        if isinstance(placement, Shard):
            dim = runtime.normalize(placement, param.ndim).dim
            split = placement.split_factor if isinstance(placement, StridedShard) else 1
            if not 0 <= dim < param.ndim or param.shape[dim] % (n * split):
                raise ValueError(
                    f"parameter {name!r} {tuple(param.shape)} cannot be split evenly on "
                    f"dim {placement.dim} over {n} ranks"
                )


def run_on_local_parameters(
    module: nn.Module,
    rt: runtime.DTensorRuntime,
    partial: bool,
    forward,
    *inputs: Any,
    **kwargs: Any,
) -> Any:
    """Run ``forward`` (``module``'s own, unbound) with its DTensor parameters seen as local
    tensors.

    With ``partial`` the module computes on a shard of the data, so the gradient each rank
    gets for a parameter is a partial sum: it is labelled so, and summed at the end of
    backward. Without, each rank gets the full (replicated) gradient.
    """
    params = compat.direct_parameters(module)
    local = {name: rt.local_parameter(module, name, partial=partial) for name in params}
    compat.swap_direct_parameters(module, local)
    try:
        return forward(module, *inputs, **kwargs)
    finally:
        compat.swap_direct_parameters(module, params)


def unstyled_submodules(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` (not itself) that hold parameters of their own and that
    the plan being applied gives no style (every one, for a style applied by hand)."""
    styled = plan_styled() or frozenset()
    return [
        sub
        for path, sub in module.named_modules()
        if path and id(sub) not in styled and compat.direct_parameters(sub)
    ]


def replicate_parameters(
    modules: list[nn.Module], rt: runtime.DTensorRuntime, src_data_rank: int | None
) -> None:
    """Make every direct parameter of ``modules`` a replicated DTensor."""
    for sub in modules:
        placements = {name: Replicate() for name, _ in sub.named_parameters(recurse=False)}
        distribute_parameters(sub, rt, placements, src_data_rank)


def check_whole_not_distributed(module: nn.Module) -> None:
    """Refuse ``module`` or a submodule without a style in the plan that was parallelized
    before."""
    for sub in (module, *unstyled_submodules(module)):
        check_not_distributed(sub)


def distribute_whole(
    style: ParallelStyle,
    module: nn.Module,
    device_mesh: DeviceMesh,
    placements: Mapping[str, Placement | tuple[Placement, ...]],
    *bound: Any,
) -> nn.Module:
    """:func:`distribute_and_wrap` for a style that computes with its whole module: the
    parameters of the submodules without a style become replicated DTensors too, and the
    style's ``_forward`` gets those submodules before ``bound``."""
    rt = runtime.for_mesh(device_mesh)
    inner = unstyled_submodules(module)
    replicate_parameters(inner, rt, style.src_data_rank)
    return distribute_and_wrap(style, module, device_mesh, placements, inner, *bound)


def swap_in_local_parameters(
    modules: list[nn.Module], rt: runtime.DTensorRuntime, partial: bool
) -> list[tuple[nn.Module, dict]]:
    """Give ``modules`` local views of their DTensor parameters (see
    :func:`run_on_local_parameters`); returns what :func:`swap_back` puts back."""
    swapped = []
    try:
        for sub in modules:
            local = {
                name: rt.local_parameter(sub, name, partial=partial)
                for name in compat.direct_parameters(sub)
            }
            swapped.append((sub, compat.swap_direct_parameters(sub, local)))
    except BaseException:
        swap_back(swapped)
        raise
    return swapped


def swap_back(swapped: list[tuple[nn.Module, dict]]) -> None:
    for sub, original in reversed(swapped):
        compat.swap_direct_parameters(sub, original)


# The partial-gradient regions running now (PrepareModuleInput(partial_input_gradients=True)),
# innermost last: each the module and the whole inputs its input hook handed it. Held here,
# not as a marker on the tensors: torch.compile traces identity comparisons of tensors, a
# view's ``_base`` included, but an attribute set on a tensor inside a graph is not seen
# through the ``_base`` of a view of it (the flattened tokens of an experts block), and
# reading a tensor's ``__dict__`` does not trace at all. A frame lives while its module's
# forward runs: pushed by the input hook, popped by a forward hook that runs even when the
# forward raises, so nothing outlives the call.
_OPEN_REGIONS: list[tuple[nn.Module, list[torch.Tensor]]] = []


def open_partial_region(module: nn.Module) -> None:
    """Begin a call of ``module``, a partial-gradient region (its input hook)."""
    _OPEN_REGIONS.append((module, []))


def enter_partial_region(local: torch.Tensor) -> None:
    """Record ``local`` as a whole input of the region opened last."""
    _OPEN_REGIONS[-1][1].append(local)


def close_partial_region(module: nn.Module, *_: Any) -> None:
    """End a call of ``module`` (a forward hook, always called): its frame goes, if its input
    hook got as far as pushing it."""
    if _OPEN_REGIONS and _OPEN_REGIONS[-1][0] is module:
        _OPEN_REGIONS.pop()


def in_partial_region(value: Any) -> bool:
    """Whether ``value`` (or the tensor it is a view of) is a whole input of a region running
    now whose input gradients are partial sums, summed where the region began
    (``partial_input_gradients``)."""
    if not _OPEN_REGIONS:  # the common case, read first: no region is running
        return False
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return False
    base = compat.view_base(value)
    for _, entered in _OPEN_REGIONS:
        for tensor in entered:
            if value is tensor:
                return True
            # a view of it, or of what it is a view of, or that: the views share one base.
            # Both bases read here, together: torch.compile tells two reads of one base
            # apart when one of them was kept from an earlier read
            entered_base = compat.view_base(tensor)
            if base is not None and (base is tensor or base is entered_base):
                return True
            if entered_base is not None and value is entered_base:
                return True
    return False
