"""Parallel styles: one class per way of parallelizing a module.

A style is a contract with the module it is applied to. It owns the whole story: which
module types it accepts (:meth:`ParallelStyle._validate`), how their parameters become
DTensors, and how inputs and outputs are laid out around the module
(:meth:`ParallelStyle._apply`). The semantics, arguments and defaults are those of
``torch.distributed.tensor.parallel``.

Linear and Embedding layers compute on their local shards: DTensor is used only at the
boundaries, to annotate and move layouts, while the matmul or the lookup runs on plain
tensors. Parameters stay DTensors, so optimizers, FSDP2 and checkpoints see one kind of
parameter.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.overrides import TorchFunctionMode

from torch_tp import _layouts, _regions
from torch_tp import _torch_compat as compat
from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Boundary, Layout, StyleContract, Transfer, kind_name
from torch_tp.random import sequence_parallel_dropout
from torch_tp.registry import STYLE_REGISTRY

# ParallelStyle and every style defined here (test_contract.py checks that none is missing);
# torch_tp.__all__ re-exports them all
__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "TensorParallelExperts",
    "ExpertParallel",
    "IdentityExpertParallel",
    "MLAKVAProjParallel",
    "LocalParamsParallel",
    "LocalLinearParallel",
    "PartialSumParallel",
    "AttentionHeads",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
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

    def _check_kind(self, module: nn.Module) -> None:
        """Raise ``NotImplementedError`` unless the contract accepts ``module``'s kind."""
        contract = self.contract
        if contract is not None and not contract.accepts(module):
            raise NotImplementedError(
                f"{type(self).__name__} supports {contract.describe_modules()} (and their "
                f"subclasses), found {kind_name(type(module))}"
            )

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in _arguments(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return _arguments(self) == _arguments(other)

    __hash__ = None  # type: ignore[assignment]  # styles are mutable (src_data_rank)


def _arguments(style: ParallelStyle) -> dict[str, Any]:
    """The constructor arguments of ``style``, as its contract reads them."""
    contract = style.contract or StyleContract()
    return contract.arguments(style)


# parallelize_module records on each module the path it was reached by, for runtime errors
MODULE_PATH_ATTR = "_torch_tp_path"


def _where(style: ParallelStyle, module: nn.Module) -> str:
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


def _check_flag(value: object, what: str) -> bool:
    """``value`` if it is a ``bool``; a string such as ``"false"`` would be taken as true."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{what} must be a bool (True or False), found {type(value).__name__} "
            f"{short_repr(value)}"
        )
    return value


def _check_int(value: object, what: str) -> int:
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


def _as_tuple(layouts: Placement | tuple[Placement | None, ...] | None, what: str):
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


def _as_kwarg_layouts(layouts: Mapping[str, Placement] | None, what: str) -> dict[str, Placement]:
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


def _single(layout: Placement | None, default: Placement, what: str) -> tuple[Placement]:
    """The single-element layout tuples of Colwise/Rowwise (upstream keeps them as tuples)."""
    if layout is None:
        return (default,)
    if not isinstance(layout, Placement):
        raise TypeError(
            f"{what} must be a Placement, found {type(layout).__name__} {short_repr(layout)}"
        )
    _check_placement(layout, what)
    return (layout,)


def _in_module(style: ParallelStyle, module: nn.Module, err: Exception) -> ValueError:
    """A layout error (:class:`_layouts.ShardDimError`) again, as a ``ValueError`` naming
    the style and the module it runs on.

    The layout helpers raise without knowing either; the styles catch at their entry points
    (a ``try`` costs nothing until something raises).
    """
    return ValueError(f"{_where(style, module)}: {err}")


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


def _distribute_and_wrap(
    style: ParallelStyle,
    module: nn.Module,
    device_mesh: DeviceMesh,
    placements: Mapping[str, Placement],
    *bound: Any,
) -> nn.Module:
    """Distribute ``module``'s parameters as ``placements`` say, and run ``style._forward(
    module, runtime, own_forward, *bound, *inputs)`` in place of the module's forward (its
    class's own, unbound, passed on for the style to call)."""
    rt = _layouts.runtime(device_mesh)
    _distribute_parameters(module, rt, placements, style.src_data_rank)
    module.forward = functools.partial(style._forward, module, rt, type(module).forward, *bound)
    return module


def _distribute_parameters(
    module: nn.Module,
    rt: _layouts.DTensorRuntime,
    placements: dict[str, Placement],
    src_data_rank: int | None,
) -> None:
    """Replace each named direct parameter of ``module`` by a DTensor with that placement, on
    the runtime's mesh.

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
        tied = getattr(param, _DISTRIBUTED_AS, None)
        if tied is not None and tied.device_mesh == device_mesh and tied.placements == (placement,):
            module.register_parameter(name, tied)
            continue
        # src_data_rank=None keeps each rank's local values (no scatter or broadcast)
        dtensor = distribute_tensor(
            param.detach(), device_mesh, (placement,), src_data_rank=src_data_rank
        )
        new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        if isinstance(placement, Replicate) and new.requires_grad:
            # computing on shards (a sequence shard, a sharded output) leaves each rank with a
            # partial sum of a replicated parameter's gradient: sum it (once per backward for
            # all such parameters), so every rank holds the full gradient, as on one device
            rt.sum_partial_gradients(new)
        setattr(param, _DISTRIBUTED_AS, new)
        module.register_parameter(name, new)


_DISTRIBUTED_AS = "_torch_tp_distributed_as"


def _conv1d_base(module: nn.Module) -> type | None:
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


def _out_features(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.nf


def _project(
    module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``module``'s own computation (Linear or Conv1D) with local ``weight`` and ``bias``."""
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    # Conv1D, as transformers computes it: addmm on the flattened tokens
    flat = x.reshape(-1, x.shape[-1])
    y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[-1])


def _own_forward_caveat(style: ParallelStyle, module: nn.Module) -> str | None:
    if _uses_stock_forward(module) or _own_lookups(style, module):
        return None  # an embedding's own forward computes on local tensors (_OwnLookups)
    return (
        f"{type(module).__name__} overrides forward, which then runs on DTensors: the "
        "collectives inside it are not predicted"
    )


def _own_lookups(style: ParallelStyle, module: nn.Module) -> bool:
    """Whether ``module``, an ``nn.Embedding`` subclass with its own forward, runs it on local
    tensors with its lookups done by ``style`` (:class:`_OwnLookups`): when the lookup's
    output is a local tensor whole in its features (replicated, or a sequence shard), which
    whatever the forward does next (a norm) may read as on one device. Otherwise it runs on
    DTensors."""
    if not isinstance(module, nn.Embedding) or _uses_stock_forward(module):
        return False
    layout = style.output_layouts[0]
    whole = isinstance(layout, Replicate) or type(layout) is Shard and layout.dim in (0, 1)
    return whole and style.use_local_output


def _uses_stock_forward(module: nn.Module) -> bool:
    """True when ``module`` runs the forward of torch's Linear/Embedding, unchanged.

    Only then may a style replace the forward by an equivalent computation on local shards;
    a subclass with its own forward keeps it and runs on DTensors instead, or, for an
    Embedding subclass whose lookup gives whole features, with its lookups done by the style
    (:func:`_own_lookups`).
    """
    for base in (nn.Linear, nn.Embedding, _conv1d_base(module)):
        if base is not None and isinstance(module, base):
            return type(module).forward is base.forward
    return False


# what the contracts of ColwiseParallel and RowwiseParallel share: their arguments, the
# modules they take, their parameters, and a forward on local shards (unless the module has
# its own forward: then the caveat)
_LINEAR_EMBEDDING_CONTRACT: dict[str, Any] = {
    "arguments": lambda s: {
        "input_layouts": s.input_layouts[0],
        "output_layouts": s.output_layouts[0],
        "use_local_output": s.use_local_output,
    },
    "modules": (nn.Linear, nn.Embedding, "Conv1D"),
    "parameters": lambda s, m: s._parameter_placements(m),
    "local_forward": lambda s, m: True,
    "caveat": lambda s, m: _own_forward_caveat(s, m),
}


class _ShardLinearEmbedding(ParallelStyle):
    """What :class:`ColwiseParallel` and :class:`RowwiseParallel` share."""

    _default_input: Placement
    _default_output: Placement

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts = _single(input_layouts, self._default_input, "input_layouts")
        self.output_layouts = _single(output_layouts, self._default_output, "output_layouts")
        self.use_local_output = _check_flag(use_local_output, "use_local_output")

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_kind(module)
        if not isinstance(module, (nn.Linear, nn.Embedding)) and _conv1d_base(module) is None:
            raise NotImplementedError(
                f"{type(self).__name__}: {type(module).__qualname__} is named Conv1D but is "
                "not transformers' Conv1D (a 2-D weight of shape (nx, nf))"
            )
        if _uses_stock_forward(module):
            _check_not_distributed(module)
        else:
            _check_whole_not_distributed(module)
        _check_parameter_placements(module, self._parameter_placements(module))
        if isinstance(module, nn.Embedding):
            if module.sparse:
                raise ValueError("sparse embedding gradients are not supported")
            if module.max_norm is not None:
                raise ValueError(
                    "max_norm renormalizes whole rows in place, which a sharded weight "
                    "cannot do locally; remove max_norm"
                )

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        """The placement of each parameter of ``module`` this style shards or replicates."""
        raise NotImplementedError

    def _shard(self, dim: int) -> Placement:
        """How a sharded dimension of a parameter is split (the packed styles stride it)."""
        return Shard(dim)

    def _desired_input(self, module: nn.Module) -> Placement:
        """The layout ``module``'s own forward needs its input in (DTensor fallback path)."""
        return Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported type must not be half-applied
        rt = _layouts.runtime(device_mesh)
        params = self._parameter_placements(module)
        _distribute_parameters(module, rt, params, self.src_data_rank)
        if _uses_stock_forward(module):
            forward = self._embedding if isinstance(module, nn.Embedding) else self._linear
            module.forward = functools.partial(forward, module, rt)
        elif _own_lookups(self, module):
            # its own forward on local tensors, with the lookups of its weight done by the
            # style; the submodules it calls (a norm after the lookup: transformers' normed
            # embeddings) are replicated
            inner = _unstyled_submodules(module)
            _replicate_parameters(inner, rt, self.src_data_rank)
            module.forward = functools.partial(
                self._own_embedding_forward, module, rt, type(module).forward, inner
            )
        else:
            # its own forward runs on DTensors, and so do the submodules it calls: their
            # parameters become replicated DTensors, whose gradients DTensor computes
            _replicate_parameters(_unstyled_submodules(module), rt, self.src_data_rank)
            _hook_dtensor_forward(
                self,
                module,
                rt,
                self.input_layouts[0],
                self._desired_input(module),
                self.output_layouts[0],
                self.use_local_output,
            )
        return module

    def _own_embedding_forward(
        self,
        module: nn.Embedding,
        rt: _layouts.DTensorRuntime,
        own_forward,
        inner: list[nn.Module],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """An ``nn.Embedding`` subclass's own forward, on local tensors: each lookup of its
        weight is the style's own (as for a stock embedding), the submodules it calls
        compute on replicated parameters (whose gradients are partial sums when the lookup's
        output is sharded: a sequence shard)."""
        partial = not isinstance(self.output_layouts[0], Replicate)
        swapped = _swap_in_local_parameters(inner, rt, partial)
        try:
            with _OwnLookups(module, functools.partial(self._embedding, module, rt)):
                return own_forward(module, *args, **kwargs)
        finally:
            _swap_back(swapped)


class _OwnLookups(TorchFunctionMode):
    """``F.embedding`` of ``module``'s weight done by ``lookup(ids)``; every other call as it
    is. (An ``nn.Embedding`` subclass calls it through ``super().forward``, which no hook
    reaches.)"""

    def __init__(self, module: nn.Embedding, lookup) -> None:
        super().__init__()
        self.module = module
        self.lookup = lookup

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.module.weight:  # (the mode is off while this runs)
                return self.lookup(args[0] if args else kwargs["input"])
        return func(*args, **kwargs)


class ColwiseParallel(_ShardLinearEmbedding):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` by output column.

    ``nn.Linear``: ``weight`` and ``bias`` are sharded on the output features (``Shard(0)``).
    ``nn.Embedding``: ``weight`` is sharded on the embedding dimension (``Shard(1)``).
    transformers' ``Conv1D`` (GPT-2's projections, weight stored ``(in, out)``): ``weight`` is
    sharded on the output features (``Shard(1)``), ``bias`` too (``Shard(0)``).
    The module computes with the whole (replicated) input and produces its output sharded on
    the last dimension; that output is then moved to ``output_layouts``. Pair it with
    :class:`RowwiseParallel` to shard an MLP or an attention block with one reduction.

    Keyword Args:
        input_layouts (Placement, optional): the layout of the module's input when it arrives
            as a local :class:`torch.Tensor`, used to annotate it as a DTensor. A DTensor input
            carries its own layout. Default: ``Replicate()``.
        output_layouts (Placement, optional): the layout of the module's output.
            Default: ``Shard(-1)``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that shards the module column-wise.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, ColwiseParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # a module with an "w1" nn.Linear submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # input of "w1" is taken as replicated; its output is a local shard of the last dim
        >>> sharded_mod = parallelize_module(m, tp_mesh, {"w1": ColwiseParallel()})

    .. note:: The default output is sharded on the last dimension: code between this module
        and the paired :class:`RowwiseParallel` sees only the local columns (for attention,
        the local heads), so shapes must be derived from tensors, not from the config.
    """

    _default_input = Replicate()
    _default_output = Shard(-1)

    contract = StyleContract(
        names={
            # replicated input, output sharded on the last dim (an MLP's or attention's first half)
            "colwise": {},
            # the output all-gathered (an lm_head returning whole logits)
            "colwise_gather_output": {"output_layouts": Replicate()},
            "colwise_rep": {"output_layouts": Replicate()},
            # on an nn.Embedding: weight sharded on the embedding dim, output gathered
            "embedding_colwise": {"output_layouts": Replicate()},
        },
        **_LINEAR_EMBEDDING_CONTRACT,
        # every rank computes with the whole input: its input gradients are partial sums
        inputs=lambda s, m: Boundary((Layout(s.input_layouts[0], Replicate(), grad=Partial()),)),
        outputs=lambda s, m: Boundary(
            (Layout(s._shard(-1), s.output_layouts[0], s.use_local_output),)
        ),
    )

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        # the output features: dim 0 of a Linear's weight, dim 1 of a Conv1D's
        out_dim = 0 if isinstance(module, nn.Linear) else 1
        return {"weight": self._shard(out_dim), "bias": self._shard(0)}

    def _linear(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, input: torch.Tensor
    ) -> torch.Tensor:
        try:
            x = rt.enter_replicated(input, self.input_layouts[0])
            weight = rt.local_parameter(module, "weight")
            y = _project(module, x, weight, rt.local_parameter(module, "bias"))
            return self._leave(y, rt, _out_features(module))
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None

    def _embedding(
        self, module: nn.Embedding, rt: _layouts.DTensorRuntime, input: torch.Tensor
    ) -> torch.Tensor:
        try:
            ids = rt.enter_replicated(input, self.input_layouts[0])
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None
        try:
            # the whole vocabulary on every rank: F.embedding checks the ids itself (on a
            # GPU, with a device-side assert, as on one device)
            y = F.embedding(
                ids,
                rt.local_parameter(module, "weight"),
                module.padding_idx,
                scale_grad_by_freq=module.scale_grad_by_freq,
            )
        except IndexError as err:
            raise IndexError(
                f"{_where(self, module)}: {err}: token ids must be in [0, {module.num_embeddings})"
            ) from err
        try:
            return self._leave(y, rt, module.embedding_dim)
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None

    def _leave(self, y: torch.Tensor, rt: _layouts.DTensorRuntime, features: int) -> torch.Tensor:
        """``y``, computed sharded on its last dim (``features`` in all), as the output."""
        layout = self.output_layouts[0]
        if self.use_local_output and type(layout) is Shard and layout.dim in (-1, y.ndim - 1):
            return y  # the common case: as computed
        layout = _layouts.normalize(layout, y.ndim)
        shape = torch.Size((*y.shape[:-1], features))
        return rt.leave(y, Shard(y.ndim - 1), layout, self.use_local_output, shape)


class RowwiseParallel(_ShardLinearEmbedding):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` by input row.

    ``nn.Linear``: ``weight`` is sharded on the input features (``Shard(1)``) and ``bias`` is
    replicated; the input must be sharded on its last dimension. ``nn.Embedding``: ``weight``
    is sharded on the vocabulary (``Shard(0)``) and the input ids are replicated; each rank
    looks up the ids it owns. transformers' ``Conv1D`` (weight stored ``(in, out)``):
    ``weight`` is sharded on the input features (``Shard(0)``), ``bias`` is replicated. Either
    way every rank holds a partial sum, which is reduced to ``output_layouts`` (an all-reduce
    for ``Replicate()``, a reduce-scatter for ``Shard(d)``). Sizes need not divide by the mesh
    size.

    Keyword Args:
        input_layouts (Placement, optional): the layout of the module's input when it arrives
            as a local :class:`torch.Tensor`. Default: ``Shard(-1)``.
        output_layouts (Placement, optional): the layout of the module's output.
            Default: ``Replicate()``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that shards the module row-wise.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, RowwiseParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # a module with a "w2" nn.Linear submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # input of "w2" is a local shard of the last dim; its output is replicated
        >>> sharded_mod = parallelize_module(m, tp_mesh, {"w2": RowwiseParallel()})
    """

    _default_input = Shard(-1)
    _default_output = Replicate()

    contract = StyleContract(
        names={
            # input sharded on the last dim, partial sums all-reduced to a replicated output
            "rowwise": {},
            # a replicated input, of which each rank uses its slice
            "rowwise_split_input": {"input_layouts": Replicate()},
            "rowwise_rep": {"input_layouts": Replicate()},
            # on an nn.Embedding: vocabulary-parallel lookup of replicated ids, output all-reduced
            "embedding_rowwise": {"input_layouts": Replicate()},
        },
        **_LINEAR_EMBEDDING_CONTRACT,
        partial_gradients=lambda s, m: s._partial_gradients(m),
        # an Embedding's replicated ids: their least and greatest, agreed (see _check_ids)
        transfers=lambda s, m, inputs, degree: (
            (Transfer("forward", "all_reduce", 2 * inputs[0].element_size()),)
            if isinstance(m, nn.Embedding) and inputs and not isinstance(s.input_layouts[0], Shard)
            else ()
        ),
        # a Linear computes with its slice of the input features; an Embedding looks up
        # every id (ids carry no gradient)
        inputs=lambda s, m: Boundary(
            (Layout(s.input_layouts[0], Replicate(), grad=Partial()),)
            if isinstance(m, nn.Embedding)
            else (Layout(s.input_layouts[0], s._shard(-1)),)
        ),
        outputs=lambda s, m: Boundary(
            (Layout(Partial(), s.output_layouts[0], s.use_local_output),)
        ),
    )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
            raise ValueError(
                "scale_grad_by_freq counts ids over the whole vocabulary, which a "
                "vocabulary shard cannot do locally; remove scale_grad_by_freq"
            )
        if not isinstance(module, nn.Embedding) and module.bias is not None:
            layout = self.output_layouts[0]
            if not isinstance(layout, (Replicate, Shard)):
                raise ValueError(
                    f"a biased Linear needs output_layouts Replicate() or Shard(d), found "
                    f"{layout}: the bias would be added once per rank to a partial sum"
                )

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(0)}
        # the input features: dim 1 of a Linear's weight, dim 0 of a Conv1D's
        in_dim = 1 if isinstance(module, nn.Linear) else 0
        return {"weight": self._shard(in_dim), "bias": Replicate()}

    def _desired_input(self, module: nn.Module) -> Placement:
        return Replicate() if isinstance(module, nn.Embedding) else Shard(-1)

    def _partial_gradients(self, module: nn.Module) -> tuple[str, ...]:
        # the bias is added to a sharded output: each rank's gradient covers its shard only
        sharded = isinstance(self.output_layouts[0], Shard)
        biased = not isinstance(module, nn.Embedding) and getattr(module, "bias", None) is not None
        return ("bias",) if sharded and biased else ()

    def _linear(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, input: torch.Tensor
    ) -> torch.Tensor:
        layout, x = self.input_layouts[0], input
        last = type(layout) is Shard and layout.dim in (-1, x.ndim - 1)
        try:
            if isinstance(x, DTensor) or not last:  # else the local shard it computes with
                layout = _layouts.normalize(layout, x.ndim)
                x = rt.enter_sharded(x, layout, self._shard(x.ndim - 1))
            partial = _project(module, x, rt.local_parameter(module, "weight"), None)
            y = self._reduce(partial, rt, module)
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None
        if module.bias is None:
            return y
        # added after the reduction, so that it is added once
        if isinstance(y, DTensor):
            return y + module.bias
        # on a sharded output each rank's bias gradient sums over its shard only: partial
        if isinstance(self.output_layouts[0], Shard):
            return y + rt.local_parameter(module, "bias", partial=True)
        return y + rt.local_parameter(module, "bias")

    def _embedding(
        self, module: nn.Embedding, rt: _layouts.DTensorRuntime, input: torch.Tensor
    ) -> torch.Tensor:
        try:
            ids = rt.enter_replicated(input, self.input_layouts[0])
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None
        if not ids.is_meta and not torch.compiler.is_compiling():
            # Ids out of the vocabulary would be foreign to every rank: rows of zeros, where
            # one device raises. Ids gathered from sequence shards are the same on every
            # rank; ids given as replicated are meant to be, but one rank's bad batch must
            # not leave the others waiting in the reduction below: their least and greatest
            # are agreed over the mesh first (one all-reduce of two numbers). Reading them
            # back is a host sync on a GPU (one). Under torch.compile the check is left out:
            # a branch on data would break the graph (meta ids have no values to check).
            gathered = isinstance(self.input_layouts[0], Shard) and not isinstance(input, DTensor)
            self._check_ids(module, rt, ids, gathered)
        start, stop = _layouts.shard_range(module.num_embeddings, rt.mesh)
        weight = rt.local_parameter(module, "weight")
        # ids this rank does not own look up row 0 and are zeroed; the sum over ranks
        # (the reduction below) then holds exactly one real row per id
        foreign = (ids < start) | (ids >= stop)
        if stop > start:
            pad = module.padding_idx
            local_pad = pad - start if pad is not None and start <= pad < stop else None
            y = F.embedding((ids - start).masked_fill(foreign, 0), weight, local_pad)
            y = y.masked_fill(foreign.unsqueeze(-1), 0.0)
        else:  # an empty shard (tiny vocabulary): contribute zeros, keep the graph
            y = weight.sum() + weight.new_zeros((*ids.shape, module.embedding_dim))
        try:
            return self._reduce(y, rt, module)
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None

    def _check_ids(
        self, module: nn.Embedding, rt: _layouts.DTensorRuntime, ids: torch.Tensor, gathered: bool
    ) -> None:
        """Raise, on every rank, the error of one device's ``F.embedding`` if any rank's ids
        are outside the vocabulary (agreed over the mesh unless ``gathered``)."""
        size = module.num_embeddings
        if ids.numel():
            low, high = torch.aminmax(ids)
            bounds = torch.stack([low.neg(), high])  # both reduced by one maximum
        else:
            bounds = torch.zeros(2, dtype=torch.long, device=ids.device)
        if not gathered:
            group = rt.mesh.get_group()
            bounds = bounds.to(_regions._flag_device(group))
            torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=group)
        if not ((bounds[0] > 0) | (bounds[1] >= size)).item():
            return
        mine = bool(ids.numel()) and bool(((ids < 0) | (ids >= size)).any())
        error = self._ids_out_of_range(module, ids) if mine else None
        if gathered:
            raise error
        _regions.raise_agreed(error, [group])

    def _ids_out_of_range(self, module: nn.Embedding, ids: torch.Tensor) -> IndexError:
        """The error of one device's ``F.embedding``, naming the module and a few of the ids."""
        size = module.num_embeddings
        bad = ids[(ids < 0) | (ids >= size)]
        values = torch.unique(bad).tolist()
        shown = ", ".join(map(str, values[:5])) + (", ..." if len(values) > 5 else "")
        return IndexError(
            f"{_where(self, module)}: index out of range: token ids must be in [0, {size}), "
            f"found {shown} ({bad.numel()} of {ids.numel()} ids out of range)"
        )

    def _reduce(self, partial: torch.Tensor, rt: _layouts.DTensorRuntime, module: nn.Module):
        layout = self.output_layouts[0]
        if type(layout) is not Replicate:
            layout = _layouts.normalize(layout, partial.ndim)
        if (
            self.use_local_output
            and isinstance(layout, Shard)
            and partial.shape[layout.dim] % rt.mesh.size()
        ):
            # uneven local shards cannot be annotated back into a DTensor downstream (from a
            # local tensor alone the global size is unknown): fail here, clearly
            raise ValueError(
                f"{_where(self, module)}: the output is sharded on dim {layout.dim} of size "
                f"{partial.shape[layout.dim]}, which does not divide by the {rt.mesh.size()} "
                "ranks; make it divisible (e.g. the sequence length, for sequence "
                "parallelism) or pass use_local_output=False"
            )
        return rt.reduce_partial(partial, layout, self.use_local_output)


class _Packed:
    """What the packed styles share: a fused weight made of ``parts`` equal blocks."""

    parts: int

    def _check_parts(self, parts: int) -> int:
        if _check_int(parts, "parts") < 1:
            raise ValueError(f"parts must be a positive int, found {parts}")
        return parts

    def _shard(self, dim: int) -> Placement:
        # rank r holds block r of every part: DTensor's strided shard, so that the full
        # tensor (a checkpoint, full_tensor()) is the single-device one, parts in order
        return StridedShard(dim, split_factor=self.parts)

    def _check_module(self, module: nn.Module) -> None:
        self._check_kind(module)
        # a module with its own forward would run on DTensors, which have no rule for a
        # strided-shard weight in a matmul
        if (isinstance(module, nn.Linear) or _conv1d_base(module)) and not _uses_stock_forward(
            module
        ):
            raise NotImplementedError(
                f"{type(self).__name__} needs the stock forward of nn.Linear or Conv1D; "
                f"{type(module).__qualname__} overrides it"
            )

    def _validate_parts(self, size: int, what: str, device_mesh: DeviceMesh) -> None:
        n = device_mesh.size()
        if size % (self.parts * n):
            raise ValueError(
                f"{what} of size {size} holds {self.parts} packed parts, each to be split over "
                f"{n} ranks: the size must be a multiple of {self.parts} x {n} = "
                f"{self.parts * n}"
            )


class PackedColwiseParallel(_Packed, ColwiseParallel):
    """Shard a fused projection (``qkv_proj``, ``gate_up_proj``, GPT-2's ``c_attn``) by output
    column, part by part.

    The output features are ``parts`` equal blocks laid end to end (q, k and v; gate and up).
    :class:`ColwiseParallel` would give the first rank all of q; this style gives every rank
    its slice of each part, so that rank ``r`` computes ``[q_r, k_r, v_r]``: its own heads of
    q, k and v, which the module then splits locally. The weight (and bias) become DTensors
    with DTensor's strided-shard placement, so gathering them (``full_tensor()``,
    :mod:`torch_tp.checkpoint`) gives the single-device tensor. Supports ``nn.Linear`` and
    transformers' ``Conv1D``.

    .. note:: Not supported under FSDP2 yet: ``fully_shard`` on top of a strided shard gives
        placements that do not describe what each rank holds (training runs, but gathered
        values are scrambled), and :mod:`torch_tp.checkpoint` refuses such parameters.

    Args:
        parts (int, optional): the number of packed blocks. Default: 2 (``gate_up_proj``).

    Keyword Args:
        input_layouts (Placement, optional): as for :class:`ColwiseParallel`.
            Default: ``Replicate()``.
        output_layouts (Placement, optional): ``None`` keeps the packed local slices
            (``[q_r, k_r, v_r]``); ``Replicate()`` gathers the whole output. Default: ``None``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PackedColwiseParallel, AttentionHeads
        >>> # GPT-2: c_attn packs q, k and v; GPT2Attention splits it by its split_size
        >>> plan = {
        ...     "h.*.attn": AttentionHeads("num_heads", divide=("num_heads", "split_size")),
        ...     "h.*.attn.c_attn": PackedColwiseParallel(3),
        ...     "h.*.attn.c_proj": RowwiseParallel(),
        ... }
    """

    contract = dataclasses.replace(
        ColwiseParallel.contract,
        # a fused projection packing two parts along its outputs (gate_up_proj)
        names={"packed_colwise": {"parts": 2}},
        arguments=lambda s: {
            "parts": s.parts,
            "input_layouts": s.input_layouts[0],
            "output_layouts": s.output_layouts[0]
            if isinstance(s.output_layouts[0], Replicate)
            else None,
            "use_local_output": s.use_local_output,
        },
        modules=(nn.Linear, "Conv1D"),
    )

    def __init__(
        self,
        parts: int = 2,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        if output_layouts is not None and not isinstance(output_layouts, Replicate):
            raise ValueError(
                f"output_layouts of a packed projection must be None (packed local slices) "
                f"or Replicate(), found {short_repr(output_layouts)}"
            )
        self.parts = self._check_parts(parts)
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts or StridedShard(-1, split_factor=self.parts),
            use_local_output=use_local_output,
        )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_module(module)
        super()._validate(module, device_mesh)
        self._validate_parts(_out_features(module), "the output features", device_mesh)

    def _leave(self, y: torch.Tensor, rt: _layouts.DTensorRuntime, features: int) -> torch.Tensor:
        computed = StridedShard(y.ndim - 1, split_factor=self.parts)
        if isinstance(self.output_layouts[0], Replicate):
            layout = Replicate()
        elif self.use_local_output:
            return y  # the packed slices, as the module splits them
        else:
            layout = computed
        shape = torch.Size((*y.shape[:-1], features))
        return rt.leave(y, computed, layout, self.use_local_output, shape)


class PackedRowwiseParallel(_Packed, RowwiseParallel):
    """Shard a projection whose input features are ``parts`` packed blocks, part by part.

    The row-wise partner of :class:`PackedColwiseParallel`: the input arrives as this rank's
    slice of every part (``[a_r, b_r]``), and the weight is sharded on its input features
    the same way (DTensor's strided shard), so the partial sums are reduced as for
    :class:`RowwiseParallel`. Supports ``nn.Linear`` and transformers' ``Conv1D``.

    Args:
        parts (int, optional): the number of packed blocks. Default: 2.

    Keyword Args:
        output_layouts (Placement, optional): as for :class:`RowwiseParallel`.
            Default: ``Replicate()``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.
    """

    contract = dataclasses.replace(
        RowwiseParallel.contract,
        # the row-parallel partner of packed_colwise, its input features packed the same way
        names={"packed_rowwise": {"parts": 2}},
        arguments=lambda s: {
            "parts": s.parts,
            "output_layouts": s.output_layouts[0],
            "use_local_output": s.use_local_output,
        },
        modules=(nn.Linear, "Conv1D"),
    )

    def __init__(
        self,
        parts: int = 2,
        *,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        self.parts = self._check_parts(parts)
        super().__init__(output_layouts=output_layouts, use_local_output=use_local_output)
        # the input is this rank's slice of every part, as a packed column-parallel gives it
        self.input_layouts = (StridedShard(-1, split_factor=self.parts),)

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_module(module)
        super()._validate(module, device_mesh)
        in_features = module.in_features if isinstance(module, nn.Linear) else module.nx
        self._validate_parts(in_features, "the input features", device_mesh)


def _check_parameter_placements(module: nn.Module, placements: dict[str, Placement]) -> None:
    """Every placement a style gives a parameter names a dimension the parameter has."""
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if not isinstance(param, torch.Tensor) or not isinstance(placement, (Shard, StridedShard)):
            continue
        if not -param.ndim <= placement.dim < param.ndim:
            raise ValueError(
                f"the placement {placement!r} of parameter {name!r} names dim {placement.dim} "
                f"of a {param.ndim}-D tensor (shape {tuple(param.shape)}): a Shard dim must "
                f"be in [{-param.ndim}, {param.ndim})"
            )


def _check_not_distributed(module: nn.Module) -> None:
    for name, param in module.named_parameters(recurse=False):
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name!r} is already a DTensor with placements "
                f"{param.placements}: the module was parallelized before"
            )


class _ReplicatedParameters(ParallelStyle):
    """What :class:`SequenceParallel` and :class:`ReplicateParallel` share: the module's own
    parameters become replicated DTensors, and its own forward runs inside ``_forward``."""

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {name: Replicate() for name, _ in module.named_parameters(recurse=False)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute_and_wrap(self, module, device_mesh, self._parameter_placements(module))

    @abstractmethod
    def _forward(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        """The module's forward, given its own (unbound) ``own_forward``."""


class SequenceParallel(_ReplicatedParameters):
    """Run a normalization or dropout layer on a sequence shard of its input.

    The module's parameters are replicated (broadcast from ``src_data_rank``, so they need
    not be ones); its first input is taken as sharded on ``sequence_dim`` (a local tensor is
    annotated so, a DTensor is moved there), and so is its output. Gradients of the
    replicated parameters are summed over the sequence shards, so every rank holds the full
    gradient. This is the sequence parallelism of `Reducing Activation Recomputation in Large
    Transformer Models <https://arxiv.org/abs/2205.05198>`__.

    Supported modules: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Dropout``, and hand-written norms
    whose class name ends in ``RMSNorm`` or ``LayerNorm`` and whose parameters are 1-D (the
    per-feature scale and shift of Llama-style models). ``nn.Dropout`` draws the mask the
    single-device model would draw from the same seed and keeps this rank's slice of it.

    Keyword Args:
        sequence_dim (int, optional): the sequence dimension of the input. Default: 1.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``False``.

    Returns:
        A :class:`ParallelStyle` that runs the module sequence-parallel.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, SequenceParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # a module with a "norm" nn.LayerNorm submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # "norm" takes a sequence shard and returns a DTensor sharded on the sequence
        >>> sharded_mod = parallelize_module(m, tp_mesh, {"norm": SequenceParallel()})
    """

    contract = StyleContract(
        # a norm or dropout on a sequence shard (dim 1), handing on a local tensor
        names={"sequence_parallel": {"use_local_output": True}},
        arguments=lambda s: {
            "sequence_dim": s.sequence_sharding[0].dim,
            "use_local_output": s.use_local_output,
        },
        modules=(nn.LayerNorm, nn.RMSNorm, nn.Dropout, "*RMSNorm", "*LayerNorm"),
        parameters=lambda s, m: s._parameter_placements(m),
        # computed on a sequence shard: each rank's gradient covers its positions only
        partial_gradients=lambda s, m: tuple(n for n, _ in m.named_parameters(recurse=False)),
        inputs=lambda s, m: Boundary((Layout(s.sequence_sharding[0], s.sequence_sharding[0]),)),
        outputs=lambda s, m: Boundary(
            (Layout(s.sequence_sharding[0], s.sequence_sharding[0], s.use_local_output),)
        ),
        local_forward=lambda s, m: True,
    )

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding = (Shard(_check_int(sequence_dim, "sequence_dim")),)
        self.use_local_output = _check_flag(use_local_output, "use_local_output")

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_kind(module)
        stock = isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Dropout))
        if not stock and any(p.ndim != 1 for p in module.parameters(recurse=False)):
            raise NotImplementedError(
                f"SequenceParallel supports hand-written norms ({type(module).__qualname__}) "
                "whose parameters are per-feature scales and shifts (1-D), found "
                f"{[tuple(p.shape) for p in module.parameters(recurse=False)]}"
            )
        _check_not_distributed(module)

    def _forward(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            found = type(inputs[0]).__name__ if inputs else "no input"
            raise ValueError(
                f"{_where(self, module)}: expecting the first input to be a torch.Tensor or "
                f"DTensor, found {found}"
            )
        x = inputs[0]
        try:
            layout = _layouts.normalize(self.sequence_sharding[0], x.ndim)
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None
        global_shape = None  # a local input: even shards, as everywhere
        if isinstance(x, DTensor):
            x = rt.redistribute(x, layout)
            global_shape = x.shape
            x = x.to_local()
        if own_forward is nn.Dropout.forward:
            if not module.training or module.p == 0.0:
                out = x  # the identity, as nn.Dropout's
            else:
                # a mask of the local shape would be the same on every rank, and not the
                # single-device one: draw the full mask and keep this rank's slice
                out = sequence_parallel_dropout(
                    x,
                    module.p,
                    module.training,
                    module.inplace,
                    device_mesh=rt.mesh,
                    sequence_dim=layout.dim,
                    global_shape=global_shape,
                )
        else:
            # the module's own forward, on the local sequence shard: a norm treats every
            # position alike, so the shard's result is the shard of the whole result
            out = _run_on_local_parameters(module, rt, True, own_forward, x, *inputs[1:], **kwargs)
        if self.use_local_output or not isinstance(out, torch.Tensor):
            return out
        return DTensor.from_local(out, rt.mesh, (layout,))


class ReplicateParallel(_ReplicatedParameters):
    """Replicate a module's parameters as DTensors; the module computes on local tensors.

    Every rank keeps the whole module, and its parameters become ``Replicate()`` DTensors,
    like every other parameter of the model (one kind of parameter for the optimizer,
    gradient clipping and checkpoints). The module's own forward runs unchanged on local
    views of them, on whatever local tensors it is given; no input or output is moved.

    A module that sees the whole activation (a router, a norm in the replicated region)
    computes the whole gradient on every rank: keep ``sum_gradients=False``. A module that
    sees only this rank's share of it (per-head ``q_norm``/``k_norm`` after a column-parallel
    projection) gets a partial gradient on each rank: ``sum_gradients=True`` sums them over
    the ranks (in the one all-reduce at the end of backward that sums all partial gradients).
    So does a router under dispatch expert parallelism (``ExpertParallel()`` with sequence
    parallelism: each rank routes its own tokens). Without ``sum_gradients``,
    :func:`parallelize_module` refuses the module where the plan shows that it computes on a
    shard (a module planned beside it takes its input as a shard that nothing planned there
    produces: :func:`torch_tp.plan.unsummed_gradients`), and the dry-run report flags it
    wherever its trace finds it computing on one.

    Keyword Args:
        sum_gradients (bool, optional): sum the parameters' gradients over the ranks.
            Default: ``False``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {"layers.*.self_attn.q_norm": ReplicateParallel(sum_gradients=True)}
    """

    contract = StyleContract(
        names={
            # every rank keeps the whole module; parameters are replicated DTensors
            "replicate": {},
            # a module that sees this rank's share of the activation (per-head q_norm/k_norm)
            "replicated_with_grad_allreduce": {"sum_gradients": True},
            # transformers' router of expert-parallel experts: ExpertParallel selects each
            # rank's routing slots itself, so the router stays whole on every rank
            "ep_router": {},
        },
        arguments=lambda s: {"sum_gradients": s.sum_gradients},
        # the whole module: its own parameters and its unstyled submodules' (dotted names)
        parameters=lambda s, m: s._whole_placements(m),
        partial_gradients=lambda s, m: tuple(s._whole_placements(m)) if s.sum_gradients else (),
        # no boundary of its own: the report follows its ops, whose outputs are laid out
        # like the inputs it was given
        # no collective: inside a partial-sum region its gradients are partial sums
        partial_sum=lambda s: "either" if s.sum_gradients else None,
    )

    def __init__(self, *, sum_gradients: bool = False) -> None:
        super().__init__()
        self.sum_gradients = _check_flag(sum_gradients, "sum_gradients")

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        inner = {id(sub) for sub in _unstyled_submodules(module)}
        styled = [
            path
            for path, sub in module.named_modules()
            if path and id(sub) not in inner and compat.direct_parameters(sub)
        ]
        if styled:
            raise ValueError(
                "ReplicateParallel keeps the whole module on every rank, and its submodules "
                f"{styled} have styles of their own in the plan: remove their entries (they "
                "are replicated with the module), or give the module's own parameters a "
                "style that leaves its submodules alone"
            )
        _check_whole_not_distributed(module)

    def _whole_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Every parameter the style replicates: the module's own, and those of its
        submodules without a style of their own (``"w1.weight"``), which ``_apply``
        replicates with it."""
        placements = self._parameter_placements(module)
        inner = {id(sub) for sub in _unstyled_submodules(module)}
        for path, sub in module.named_modules():
            if path and id(sub) in inner:
                for name, _ in sub.named_parameters(recurse=False):
                    placements[f"{path}.{name}"] = Replicate()
        return placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        return _distribute_whole(self, module, device_mesh, self._parameter_placements(module))

    def _forward(
        self,
        module: nn.Module,
        rt: _layouts.DTensorRuntime,
        own_forward,
        inner: list[nn.Module],
        *inputs,
        **kwargs,
    ):
        swapped = _swap_in_local_parameters(inner, rt, self.sum_gradients)
        try:
            return _run_on_local_parameters(
                module, rt, self.sum_gradients, own_forward, *inputs, **kwargs
            )
        finally:
            _swap_back(swapped)


class TensorParallelExperts(ParallelStyle):
    """Shard every expert of a mixture-of-experts layer on its hidden dimension.

    For an experts module with stacked SwiGLU weights, as transformers' MoE models and
    :class:`torch_tp.models.moe.Experts` hold them: ``gate_up_proj`` ``[n_experts, 2 * hidden,
    dim]`` (each expert's gate rows, then its up rows) and ``down_proj`` ``[n_experts, dim,
    hidden]``, called as ``experts(hidden_states, top_k_index, top_k_weights)`` on replicated
    tokens. Rank ``r`` holds slice ``r`` of every expert's gate rows and of its up rows
    (DTensor's strided shard of dim 1, as :class:`PackedColwiseParallel`) and the matching
    columns of ``down_proj`` (``Shard(2)``). The module's own forward, run on those slices,
    gives every token a partial sum of its experts' outputs, summed over the ranks in one
    all-reduce; in the backward the gradients of the tokens and of the routing weights,
    partial sums too, are summed in one all-reduce. The routing itself (the indices) is the
    same on every rank. This is transformers' ``moe_tp_experts``.

    Experts stored transposed, ``gate_up_proj`` ``[n_experts, dim, 2 * hidden]`` and
    ``down_proj`` ``[n_experts, hidden, dim]`` (Llama 4's ``Llama4TextExperts``, which
    multiply ``x @ w`` and take the tokens already routed and weighted as their one input),
    are sharded alike on their hidden dimension: ``gate_up_proj`` strided on dim 2,
    ``down_proj`` on dim 1. The two layouts are told apart by the shapes, which no sizes
    make ambiguous. Experts without a gate, ``up_proj`` ``[n_experts, hidden, dim]`` and
    ``down_proj`` ``[n_experts, dim, hidden]`` (Nemotron-H), are sharded on the same
    dimension: ``up_proj`` ``Shard(1)``, ``down_proj`` ``Shard(2)``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "layers.*.feed_forward.router": ReplicateParallel(),
        ...     "layers.*.feed_forward.experts": TensorParallelExperts(),
        ... }
    """

    contract = StyleContract(
        names={"moe_tp_experts": {}},
        arguments=lambda s: {},
        parameters=lambda s, m: s._parameter_placements(m),
        # every rank computes with all the tokens and routing weights: partial gradients
        inputs=lambda s, m: Boundary(
            (
                Layout(Replicate(), Replicate(), grad=Partial()),
                None,
                Layout(Replicate(), Replicate(), grad=Partial()),
            ),
            coalesced=True,
        ),
        outputs=lambda s, m: Boundary((Layout(Partial(), Replicate()),)),
        local_forward=lambda s, m: True,
        # whether any rank's expert ids are out of range, agreed (see _check_expert_ids)
        transfers=lambda s, m, inputs, degree: (
            (Transfer("forward", "all_reduce", 4),) if len(inputs) >= 2 else ()
        ),
        meta_output=lambda s, m, args, kwargs: _tokens_like(args),
    )

    @staticmethod
    def _transposed(module: nn.Module) -> bool | None:
        """Whether the experts are stored transposed (``[E, H, 2I]``, ``[E, I, H]``), or not
        (``[E, 2I, H]``, ``[E, H, I]``); ``None``: neither (or no stacked weights)."""
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not all(isinstance(p, torch.Tensor) and p.ndim == 3 for p in (gate_up, down)):
            return None
        (e, a, b), (e2, c, d) = gate_up.shape, down.shape
        # gate_up_proj may stack more experts than down_proj: identity ("zero") experts
        # after the routed ones (LongCat-Flash), which use neither
        if a == 2 * d and b == c and e >= e2:
            return False
        if e != e2:
            return None
        if b == 2 * c and a == d:
            return True  # both at once would need hidden == 0
        return None

    @staticmethod
    def _ungated(module: nn.Module) -> bool:
        """Experts without a gate: ``up_proj`` ``[E, I, H]`` and ``down_proj`` ``[E, H, I]``
        (Nemotron-H's ``down(act(up(x)))``), and no ``gate_up_proj``."""
        up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
        if getattr(module, "gate_up_proj", None) is not None or not all(
            isinstance(p, torch.Tensor) and p.ndim == 3 for p in (up, down)
        ):
            return False
        (e, i, h), (e2, h2, i2) = up.shape, down.shape
        return e == e2 and i == i2 and h == h2

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        # each rank: its slice of every expert's gate rows and of its up rows (strided),
        # the matching slice of down_proj's hidden dimension
        if self._ungated(module):
            return {"up_proj": Shard(1), "down_proj": Shard(2)}
        if self._transposed(module):
            return {"gate_up_proj": StridedShard(2, split_factor=2), "down_proj": Shard(1)}
        return {"gate_up_proj": StridedShard(1, split_factor=2), "down_proj": Shard(2)}

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        if self._ungated(module):
            hidden = module.up_proj.shape[1]
            if hidden % device_mesh.size():
                raise ValueError(
                    f"the experts' hidden size {hidden} does not divide by the "
                    f"{device_mesh.size()} ranks"
                )
            _check_not_distributed(module)
            return
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        stacked = all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in (gate_up, down))
        if not stacked:
            raise NotImplementedError(
                "TensorParallelExperts supports experts modules with stacked parameters "
                "gate_up_proj [n_experts, 2 * hidden, dim] and down_proj [n_experts, dim, "
                "hidden] (or both transposed: [n_experts, dim, 2 * hidden] and [n_experts, "
                f"hidden, dim]), found {type(module).__qualname__} without them"
            )
        transposed = self._transposed(module)
        if transposed is None:
            raise ValueError(
                f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are "
                "not the stacked weights of SwiGLU experts ([E, 2I, H] and [E, H, I], or "
                "transposed [E, H, 2I] and [E, I, H])"
            )
        hidden = down.shape[1] if transposed else down.shape[2]
        n = device_mesh.size()
        if hidden % n:
            raise ValueError(
                f"the experts' hidden size {hidden} does not divide by the {n} ranks: "
                "each rank must hold the same slice of every expert's gate and up rows"
            )
        _check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported module must not be half-applied
        return _distribute_and_wrap(
            self, module, device_mesh, self.contract.parameters(self, module)
        )

    def _forward(
        self,
        module: nn.Module,
        rt: _layouts.DTensorRuntime,
        own_forward,
        hidden_states: torch.Tensor,
        *routing: torch.Tensor,
    ) -> torch.Tensor:
        if len(routing) not in (0, 2):
            raise TypeError(
                f"{_where(self, module)}: expected experts(hidden_states, top_k_index, "
                "top_k_weights), or experts(hidden_states) for tokens routed already, found "
                f"{1 + len(routing)} positional inputs"
            )
        if routing:  # (top_k_index, top_k_weights): the weights' gradient is partial too
            top_k_index, top_k_weights = routing
            stacked = module.up_proj if self._ungated(module) else module.gate_up_proj
            _check_expert_ids(self, module, rt, top_k_index, stacked.shape[0])
            hidden_states, top_k_weights = rt.enter_replicated_many((hidden_states, top_k_weights))
            routing = (top_k_index, top_k_weights)
        else:  # tokens routed and weighted already (Llama 4)
            (hidden_states,) = rt.enter_replicated_many((hidden_states,))
        partial = _run_on_local_parameters(module, rt, False, own_forward, hidden_states, *routing)
        return rt.reduce_partial(partial, Replicate(), True)


class ExpertParallel(ParallelStyle):
    """Split the experts of a mixture-of-experts layer over the ranks, whole experts per rank.

    For an experts module called as ``experts(hidden_states, top_k_index, top_k_weights)``
    on flattened tokens, whose parameters are stacked per expert on dim 0 (transformers' MoE
    models, :class:`torch_tp.models.moe.Experts`; biases such as ``gate_up_proj_bias [E, 2I]``
    too). With ``E`` experts over ``n`` ranks, rank ``r`` holds experts ``r * E / n`` to
    ``(r + 1) * E / n - 1``: every parameter is ``Shard(0)``. The module's own forward runs on
    those experts only, with the tokens routed to them; routing is dropless (no capacity, no
    token dropped; an expert or a rank that gets no token is fine).

    Where the tokens are:

    * ``input_layouts=Shard(0)`` (the default): each rank brings its own tokens (a
      data-parallel rank's batch, or this rank's sequence shard). Each (token, expert) pair
      is sent to the rank holding the expert by an all-to-all with data-dependent counts,
      computed there, and sent back by a second all-to-all; each rank then adds its tokens'
      results, times their routing weights, itself. Forward: one all-to-all of the counts and
      two of tokens; backward: the two reverse all-to-alls. The output is this rank's tokens',
      and the routing weights' gradient is local.
    * ``input_layouts=Replicate()``: every rank has all the tokens (expert parallelism over
      the tensor-parallel ranks, after a row-parallel attention). Nothing needs dispatching:
      each rank computes its experts on the tokens routed to them, and the partial outputs
      are summed in one all-reduce; in the backward the tokens' and routing weights' partial
      gradients are summed in one all-reduce. This is transformers' ``ep_dispatch_experts``
      plan (``grouped_gemm`` parameters).

    Expert ids outside ``[0, E)`` on any rank raise a ``ValueError`` naming the module on every
    rank, before any token moves: with ``Shard(0)`` the count of such ids travels with the
    exchanged counts; with ``Replicate()`` it is agreed in one all-reduce of one number. No
    rank is left waiting for another.

    Keyword Args:
        input_layouts (Placement, optional): ``Shard(0)`` (each rank its own tokens) or
            ``Replicate()`` (the same tokens on every rank). Default: ``None``, ``Shard(0)``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> # data parallel with experts split over the same ranks
        >>> plan = {
        ...     "layers.*.feed_forward.router": ReplicateParallel(sum_gradients=True),
        ...     "layers.*.feed_forward.experts": ExpertParallel(),
        ... }
    """

    contract = StyleContract(
        # transformers' expert-parallel plan: the same tokens on every rank; its parameter
        # entries ("grouped_gemm") state the experts' split
        names={
            "ep_dispatch_experts": {"input_layouts": Replicate()},
            "grouped_gemm": {"input_layouts": Replicate()},
        },
        arguments=lambda s: {"input_layouts": s.input_layouts},
        parameters=lambda s, m: {name: Shard(0) for name, _ in m.named_parameters(recurse=False)},
        inputs=lambda s, m: Boundary(
            (s._tokens_layout(), None, s._tokens_layout()), coalesced=True
        ),
        outputs=lambda s, m: Boundary(
            (
                Layout(Shard(0), Shard(0))
                if isinstance(s.input_layouts, Shard)
                else Layout(Partial(), Replicate()),
            )
        ),
        # computed on local tensors: the all-to-alls are declared as transfers
        local_forward=lambda s, m: True,
        transfers=lambda s, m, inputs, degree: s._transfers(m, inputs, degree),
        caveat=lambda s, m: (
            None
            if isinstance(s.input_layouts, Replicate)
            else "the all-to-alls' sizes follow the routing: shown for balanced routing (each "
            "rank receives as many routing slots as it sends; the mean over the ranks is that "
            "whatever the routing)"
        ),
        parameter_entry=lambda s, parameter: Shard(0),
        meta_output=lambda s, m, args, kwargs: _tokens_like(args),
    )

    def __init__(self, *, input_layouts: Placement | None = None) -> None:
        super().__init__()
        input_layouts = Shard(0) if input_layouts is None else input_layouts
        if not (isinstance(input_layouts, Replicate) or input_layouts == Shard(0)):
            raise ValueError(
                "input_layouts must be Shard(0) (each rank its own tokens) or Replicate() "
                f"(the same tokens on every rank), found {short_repr(input_layouts)}"
            )
        self.input_layouts = input_layouts

    def _transfers(self, module: nn.Module, inputs: tuple, degree: int) -> tuple[Transfer, ...]:
        """The all-to-alls of dispatched tokens (none for replicated ones), under balanced
        routing: each rank sends its tokens' routing slots out and receives as many back."""
        if isinstance(self.input_layouts, Replicate):
            # the count of expert ids out of range, agreed (one int64)
            return (Transfer("forward", "all_reduce", 8),) if len(inputs) >= 2 else ()
        if len(inputs) < 2:
            return ()
        hidden, top_k_index = inputs[0], inputs[1]
        rows = hidden.shape[0] // degree * top_k_index.shape[-1]
        tokens = rows * hidden.shape[-1] * hidden.element_size()
        n_experts = next(module.parameters()).shape[0]
        counts = degree * (n_experts // degree + 1) * top_k_index.element_size()
        return (
            Transfer("forward", "all_to_all", counts),
            Transfer("forward", "all_to_all", tokens),
            Transfer("forward", "all_to_all", tokens),
            Transfer("backward", "all_to_all", tokens),
            Transfer("backward", "all_to_all", tokens),
        )

    def _tokens_layout(self) -> Layout:
        if isinstance(self.input_layouts, Replicate):
            # every rank computes with all of them: their gradients are partial sums
            return Layout(Replicate(), Replicate(), grad=Partial())
        return Layout(Shard(0), Shard(0))

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        params = dict(module.named_parameters(recurse=False))
        if not params:
            raise NotImplementedError(
                f"ExpertParallel splits an experts module's own parameters, stacked per expert "
                f"on dim 0; {type(module).__qualname__} has none"
            )
        n_experts = {name: (p.shape[0] if p.ndim else None) for name, p in params.items()}
        if len(set(n_experts.values())) != 1 or None in n_experts.values():
            raise ValueError(
                "every parameter of an experts module must be stacked per expert on dim 0 "
                f"(the same leading size), found leading sizes {n_experts}"
            )
        experts, n = next(iter(n_experts.values())), device_mesh.size()
        if experts % n:
            raise ValueError(
                f"{experts} experts do not split over {n} ranks: each rank must hold the same "
                f"number of whole experts (use an expert-parallel degree that divides {experts})"
            )
        _check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported module must not be half-applied
        n_experts = next(module.parameters()).shape[0]
        return _distribute_and_wrap(
            self, module, device_mesh, self.contract.parameters(self, module), n_experts
        )

    def _forward(
        self,
        module: nn.Module,
        rt: _layouts.DTensorRuntime,
        own_forward,
        n_experts: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        mesh = rt.mesh
        n, rank = mesh.size(), mesh.get_local_rank()
        local_experts = n_experts // n
        replicated = isinstance(self.input_layouts, Replicate)
        if replicated:
            hidden_states, top_k_weights = rt.enter_replicated_many((hidden_states, top_k_weights))
        elif any(isinstance(t, DTensor) for t in (hidden_states, top_k_index, top_k_weights)):
            raise ValueError(
                f"{_where(self, module)}: expected this rank's tokens as local tensors, found a "
                "DTensor (give the module local tensors, e.g. with use_local_output=True)"
            )
        # the routing slots grouped by expert, ids out of range counted last
        slots = top_k_index.reshape(-1)
        in_range = (slots >= 0) & (slots < n_experts)
        slots = torch.where(in_range, slots, n_experts)
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=n_experts + 1)
        if replicated:
            # the same routing on every rank: each takes the slots of its own experts. The
            # ids out of range are agreed over the mesh (one all-reduce of one number), so
            # that one rank's bad routing is an error on all, not a wait in the reduction
            group = mesh.get_group()
            flag = counts[-1:].to(_regions._flag_device(group), copy=True)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            sent = torch.cat([counts, flag.to(counts.device)]).tolist()
            if sent[-1]:
                error = _bad_expert_ids(self, module, n_experts) if sent[-2] else None
                _regions.raise_agreed(error, [group])
            sent = sent[:-1]
            bad = ""
            first = sum(sent[: rank * local_experts])
            mine = sent[rank * local_experts : (rank + 1) * local_experts]
        else:
            # each rank's count per expert to the rank holding it, with the number of ids out
            # of range: every rank learns whether any rank must raise, before any token moves
            outgoing = torch.cat(
                [counts[:-1].view(n, local_experts), counts[-1:].expand(n, 1)], dim=1
            )
            incoming = _regions._all_to_all(
                outgoing.reshape(-1), mesh, [local_experts + 1] * n, [local_experts + 1] * n
            )
            both = torch.cat([counts[:-1], incoming]).tolist()
            sent, received = both[:n_experts], both[n_experts:]
            per_source = [
                received[r * (local_experts + 1) : (r + 1) * (local_experts + 1)] for r in range(n)
            ]
            bad_ranks = [str(r) for r, row in enumerate(per_source) if row[-1]]
            bad = bad_ranks and f" (on rank {', '.join(bad_ranks)} of the expert-parallel group)"
        if bad:
            raise ValueError(
                f"{_where(self, module)}: the router gave expert ids outside [0, {n_experts})"
                f"{bad}; top_k_index must hold ids of the module's experts"
            )
        top_k = top_k_index.shape[-1]
        routed = order[: sum(sent[:n_experts])]
        weights = top_k_weights.reshape(-1)[routed].unsqueeze(-1)
        token = routed // top_k
        if replicated:
            token = token[first : first + sum(mine)]
            weights = weights[first : first + sum(mine)]
            rows = hidden_states[token]
            out_rows = self._run_experts(module, rt, own_forward, rows, mine)
        else:
            to_rank = [sum(sent[r * local_experts : (r + 1) * local_experts]) for r in range(n)]
            from_rank = [sum(row[:-1]) for row in per_source]
            rows = _regions.all_to_all_expert_parallel_region(
                hidden_states[token], mesh, from_rank, to_rank
            )
            # rows from each source rank, by local expert within each
            out_rows = self._run_experts(
                module, rt, own_forward, rows, [c for row in per_source for c in row[:-1]]
            )
            out_rows = _regions.all_to_all_expert_parallel_region(
                out_rows, mesh, to_rank, from_rank
            )
        out = torch.zeros_like(hidden_states).index_add(0, token, out_rows * weights)
        if replicated:
            return rt.reduce_partial(out, Replicate(), True)
        return out

    @staticmethod
    def _run_experts(
        module: nn.Module,
        rt: _layouts.DTensorRuntime,
        own_forward,
        rows: torch.Tensor,
        counts: list[int],
    ) -> torch.Tensor:
        """The module's own forward on this rank's experts: ``rows`` are tokens, in runs of
        ``counts`` for local experts ``0, 1, ...`` (cycling when there are more runs than
        experts, one cycle per source rank); each row is its own token, of weight one."""
        local_experts = compat.local_tensor(next(module.parameters())).shape[0]
        expert = torch.arange(len(counts), device=rows.device) % local_experts
        ids = expert.repeat_interleave(
            torch.tensor(counts, device=rows.device), output_size=rows.shape[0]
        ).unsqueeze(-1)
        names = list(compat.direct_parameters(module))

        def compute(mod: nn.Module, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            # transformers' experts size their grouped matmul by their num_experts: this
            # rank's, while they compute
            with _attribute_as(mod, "num_experts", local_experts, only_if_int=True):
                out = own_forward(mod, rows, ids, rows.new_ones(ids.shape))
            if not rows.shape[0]:
                # no token for this rank's experts: keep its parameters and the rows in the
                # graph, so that the parameters get (zero) gradients as on one device and
                # the backward's collectives run on this rank as on the others
                anchor = rows.sum() + sum(getattr(mod, name).sum() for name in names)
                out = out + anchor * 0
            return out

        return _run_on_local_parameters(module, rt, False, compute, rows, ids)


class IdentityExpertParallel(ParallelStyle):
    """An identity ("zero") expert inside tensor-parallel experts: its output divided by the
    TP degree.

    LongCat-Flash routes some slots to experts that return the token itself. Under
    :class:`TensorParallelExperts` every rank computes those with the whole token, and the
    experts' output is summed over the ranks: each rank's identity output must be its
    ``1/n`` share of it. The gradients of the token and of the routing weight then come back
    ``1/n`` on each rank, and the experts' input reduction sums them whole. (With ``n`` a
    power of two, the division is exact.) This is transformers' ``moe_identity_expert``; it
    goes on the ``nn.Identity`` module next to the stacked weights.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "layers.*.mlp.experts": "moe_tp_experts",
        ...     "layers.*.mlp.experts.identity_expert": "moe_identity_expert",
        ... }
    """

    contract = StyleContract(
        names={"moe_identity_expert": {}},
        arguments=lambda s: {},
        modules=(nn.Identity,),
        local_forward=lambda s, m: True,
    )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        n = device_mesh.size()
        module.register_forward_hook(lambda mod, args, output: output / n)
        return module


class MLAKVAProjParallel(ParallelStyle):
    """Multi-head latent attention's joint key/value down-projection, replicated, with the
    gradient of its rotary part summed over the ranks.

    DeepSeek-V2/V3-style attention projects each token to ``[kv_lora_rank +
    qk_rope_head_dim]`` with ``kv_a_proj_with_mqa``, a plain Linear every rank keeps whole.
    The first part goes through a norm into ``kv_b_proj`` (column-parallel: its input
    gradient is reduced there); the last ``rope_dim`` columns, the rotary key shared by every
    head, go straight into attention, where each rank computes with its own heads only. Their
    gradient is therefore a partial sum on each rank: this style sums it (one all-reduce in
    the backward), so that the projection's weight gets the whole gradient. This is
    transformers' ``mla_kv_a_proj``.

    Args:
        rope_dim (int, optional): the width of the rotary part (``qk_rope_head_dim``).
            Default: ``None``: under :func:`parallelize_module`, the ``qk_rope_head_dim``
            attribute of the attention module holding the projection, else the model's
            config (its text config where it has one); or the module's own ``config``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        ...     "model.layers.*.self_attn.kv_b_proj": "colwise",
        ... }
    """

    contract = StyleContract(
        names={"mla_kv_a_proj": {}},
        arguments=lambda s: {"rope_dim": s.rope_dim},
        modules=(nn.Linear,),
        parameters=lambda s, m: {
            name: Replicate() for name, _ in m.named_parameters(recurse=False)
        },
        caveat=lambda s, m: (
            "the rotary part of its output has its gradient all-reduced in the backward (not "
            "predicted)"
        ),
    )

    def __init__(self, rope_dim: int | None = None) -> None:
        super().__init__()
        if rope_dim is not None and (
            not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim < 1
        ):
            raise ValueError(
                f"rope_dim must be a positive int or None, found {short_repr(rope_dim)}"
            )
        self.rope_dim = rope_dim

    def _rope_dim(self, module: nn.Module) -> int:
        if self.rope_dim is not None:
            return self.rope_dim
        # the attention module holding the projection knows its own width (per layer, where
        # layers differ); else the module's or the model's config
        root = plan_root()
        parent = next(
            (m for m in (root.modules() if root is not None else ()) if module in m.children()),
            None,
        )
        holders = [parent, getattr(module, "config", None)]
        root_config = getattr(root, "config", None)
        if root_config is not None:
            text = getattr(root_config, "get_text_config", None)
            holders += [text() if callable(text) else None, root_config]
        for holder in holders:
            try:
                value = getattr(holder, "qk_rope_head_dim", None)
            except Exception:  # a config with per-layer sizes refuses a global read
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        raise ValueError(
            "cannot find the rotary width: no qk_rope_head_dim in the module's or the model's "
            "config; pass it, MLAKVAProjParallel(rope_dim=...)"
        )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        rope = self._rope_dim(module)
        if rope >= module.out_features:
            raise ValueError(
                f"the rotary width {rope} leaves nothing of the {module.out_features} output "
                "features for the latent part"
            )
        _check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        rope = self._rope_dim(module)
        return _distribute_and_wrap(
            self, module, device_mesh, self.contract.parameters(self, module), rope
        )

    def _forward(
        self,
        module: nn.Module,
        rt: _layouts.DTensorRuntime,
        own_forward,
        rope: int,
        *inputs: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        out = _run_on_local_parameters(module, rt, False, own_forward, *inputs, **kwargs)
        latent, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
        # read by every rank's own heads: its gradient is a partial sum
        (rotary,) = rt.enter_replicated_many((rotary,))
        return torch.cat([latent, rotary], dim=-1)


def _placements_argument(placements: Mapping[str, Placement] | None) -> dict | None:
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


def _check_direct_placements(
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
            dim = _layouts.normalize(placement, param.ndim).dim
            split = placement.split_factor if isinstance(placement, StridedShard) else 1
            if not 0 <= dim < param.ndim or param.shape[dim] % (n * split):
                raise ValueError(
                    f"parameter {name!r} {tuple(param.shape)} cannot be split evenly on "
                    f"dim {placement.dim} over {n} ranks"
                )


class LocalParamsParallel(ParallelStyle):
    """A module's own parameters sharded as the plan's parameter entries say, and its
    forward run on this rank's shards as local tensors.

    For a bare parameter that has no module of its own to carry a style: attention sinks,
    one learned logit per head (``self_attn.sinks`` ``[n_heads]``). transformers' plans write
    ``"layers.*.self_attn.sinks": "colwise"`` (shard it with the heads) next to
    ``"layers.*.self_attn": "local_params"``; the attention then computes with its own heads'
    sinks, as its column-parallel projections give it its own heads. Each rank's gradient of
    such a shard is whole (only its heads use it). A direct parameter without an entry is
    refused: replicated, it would see only this rank's heads, and its gradient would be a
    part of the whole. This is transformers' ``local_params``.

    Args:
        placements (Mapping[str, Placement], optional): each direct parameter's placement.
            Default: ``None``, taken from the plan's parameter entries under the module.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "layers.*.self_attn.sinks": "colwise",  # Shard(0): each rank its heads'
        ...     "layers.*.self_attn": "local_params",
        ...     "layers.*.self_attn.q_proj": "colwise",
        ... }
    """

    contract = StyleContract(
        # "local": transformers 4.x's name for the same thing (Llama 4's experts inside a
        # "gather" region, next to "local_packed_rowwise"/"local_colwise" entries for their
        # stacked weights). transformers also divided the parameters no entry shards by the
        # TP degree, changing the model's values; here they are refused, as for local_params
        names={"local_params": {}, "local": {}},
        arguments=lambda s: {"placements": s.placements},
        parameters=lambda s, m: dict(s.placements or {}),
        with_parameter_entries=lambda s, placements: LocalParamsParallel(
            {**(s.placements or {}), **placements}
        ),
        local_forward=lambda s, m: True,
        partial_sum=lambda s: "either",
    )

    def __init__(self, placements: Mapping[str, Placement] | None = None) -> None:
        super().__init__()
        self.placements = _placements_argument(placements)

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        placements = self.placements or {}
        params = dict(module.named_parameters(recurse=False))
        unplaced = sorted(set(params) - set(placements))
        if unplaced:
            raise ValueError(
                f"local_params computes with this rank's shards of the module's parameters, "
                f"and no placement is given for {unplaced}: add a plan entry for each (e.g. "
                f"'<module>.{unplaced[0]}': 'colwise' to shard it with the heads)"
            )
        _check_direct_placements(module, placements, device_mesh)
        _check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        return _distribute_and_wrap(self, module, device_mesh, dict(self.placements or {}))

    def _forward(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        return _run_on_local_parameters(module, rt, False, own_forward, *inputs, **kwargs)


# what LocalLinearParallel's kinds do to a Linear: (weight, bias) placements
_LOCAL_LINEAR = {
    "colwise": (Shard(0), Shard(0)),
    "rowwise": (Shard(1), Replicate()),
    "packed_rowwise": (StridedShard(1, split_factor=2), Replicate()),
}


class LocalLinearParallel(ParallelStyle):
    """An ``nn.Linear`` sharded as a column- or row-parallel layer, computing on this rank's
    shard with no collective: one part of a :class:`PartialSumParallel` region.

    Its input and output are local tensors, used as they are: ``"colwise"`` takes the whole
    input and gives this rank's output features; ``"rowwise"`` takes this rank's input
    features and gives a partial sum; ``"packed_rowwise"`` is ``"rowwise"`` for input
    features packed as two blocks (each rank its slice of each, as
    :class:`PackedRowwiseParallel`). The region around it sums what must be summed: its
    first output in the forward, its inputs' gradients in the backward. Outside a region the
    style is refused, since nothing would sum the partial results. These are transformers
    4.x's ``local_colwise``, ``local_rowwise`` and ``local_packed_rowwise``; in a plan entry
    naming a parameter (stacked experts ``[n_experts, out, in]``) they state
    ``Shard(-2)``, ``Shard(-1)`` and a packed ``Shard(-1)``.

    Args:
        shard (str): ``"colwise"`` (weight and bias split by output feature),
            ``"rowwise"`` (weight split by input feature) or ``"packed_rowwise"``. A
            row-parallel layer takes no bias: each rank would add it to its part of the sum.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {  # transformers 4.x's plan for Llama 4's dense feed-forward
        ...     "layers.*.feed_forward.gate_proj": "local_colwise",
        ...     "layers.*.feed_forward.up_proj": "local_colwise",
        ...     "layers.*.feed_forward.down_proj": "local_rowwise",
        ...     "layers.*.feed_forward": "gather",
        ... }
    """

    contract = StyleContract(
        names={
            "local_colwise": {"shard": "colwise"},
            "local_rowwise": {"shard": "rowwise"},
            "local_packed_rowwise": {"shard": "packed_rowwise"},
        },
        arguments=lambda s: {"shard": s.shard},
        modules=(nn.Linear,),
        parameters=lambda s, m: s._parameter_placements(m),
        local_forward=lambda s, m: True,
        partial_sum=lambda s: "part",
    )

    def __init__(self, shard: str) -> None:
        super().__init__()
        if shard not in _LOCAL_LINEAR:
            raise ValueError(
                f"shard must be one of {', '.join(map(repr, _LOCAL_LINEAR))}, found "
                f"{short_repr(shard)}"
            )
        self.shard = shard

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        weight, bias = _LOCAL_LINEAR[self.shard]
        placements = {"weight": weight}
        if getattr(module, "bias", None) is not None:
            placements["bias"] = bias
        return placements

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        n = device_mesh.size()
        if self.shard == "colwise":
            size, what = module.out_features, "output features"
        else:
            size, what = module.in_features, "input features"
            if module.bias is not None:
                raise ValueError(
                    f"a {self.shard} layer computing one part of a sum takes no bias: each "
                    "rank would add it to its part, and the sum would hold it once per rank"
                )
        parts = 2 * n if self.shard == "packed_rowwise" else n
        if size % parts:
            raise ValueError(f"its {size} {what} do not split evenly into {parts} parts")
        _check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        return _distribute_and_wrap(self, module, device_mesh, self._parameter_placements(module))

    def _forward(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        return _run_on_local_parameters(module, rt, False, own_forward, *inputs, **kwargs)


class _FirstRankGradient(torch.autograd.Function):
    """Identity forward; the backward passes the gradient on one rank and zeros on the others
    (for a replicated output of a partial-sum region: the region sums its gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


def _forward_inputs(module: nn.Module) -> tuple[list[str], bool]:
    """The names of ``module``'s forward's positional inputs, and whether it takes more
    (``*args``)."""
    names, more = [], False
    for param in inspect.signature(type(module).forward).parameters.values():
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names.append(param.name)
        elif param.kind is param.VAR_POSITIONAL:
            more = True
    return names[1:], more  # less self


class PartialSumParallel(ParallelStyle):
    """A module whose forward, run on this rank's shards as local tensors, gives each rank
    a part of its first output: summed over the ranks as it leaves.

    The module's own parameters are sharded as the plan's parameter entries under it say
    (Inkling's shared experts: stacked ``gate_proj``/``up_proj`` ``"colwise"``,
    ``down_proj`` ``"rowwise"``); the modules inside it compute with no collective of their
    own (:class:`LocalLinearParallel`, :class:`LocalParamsParallel`, or no style). Every
    other parameter inside it (its own without an entry, those of its submodules without a
    style: Llama 4's router) is replicated, and, since it computes toward a partial sum, its
    gradient is one too, summed over the ranks. In the forward, the first output (or the
    module's only one) is summed in one all-reduce; in the backward, the gradients of its
    floating-point inputs, partial sums too, are summed in one all-reduce. Its other outputs
    are replicated: their gradient counts on one rank, so that the sums hold it once. A
    style that issues collectives of its own inside the region is refused (the sum would
    count its results once per rank), and so is a replicated parameter added to the output
    directly, which no check can see: the module's forward must compute every term of its
    first output from this rank's shards.

    This is transformers' ``all_reduce`` (5.x) and ``gather`` (4.x, around ``local_*``
    layers): Llama 4's feed-forward sums its shared expert and its routed experts, both
    partial, in one all-reduce.

    Args:
        placements (Mapping[str, Placement], optional): the placement of each of the
            module's own parameters. Default: ``None``, taken from the plan's parameter
            entries under the module; the others are replicated.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {  # transformers 5.x's plan for Inkling's shared experts
        ...     "layers.*.mlp.shared_experts.gate_proj": "colwise",  # Shard(-2)
        ...     "layers.*.mlp.shared_experts.up_proj": "colwise",
        ...     "layers.*.mlp.shared_experts.down_proj": "rowwise",  # Shard(-1)
        ...     "layers.*.mlp.shared_experts": "all_reduce",
        ... }
    """

    contract = StyleContract(
        names={"all_reduce": {}, "gather": {}},
        arguments=lambda s: {"placements": s.placements},
        parameters=lambda s, m: s._parameter_placements(m),
        partial_gradients=lambda s, m: tuple(
            ".".join(key) if isinstance(key, tuple) else key for key, _ in s._replicated(m)
        ),
        inputs=lambda s, m: s._input_boundary(m),
        outputs=lambda s, m: Boundary((Layout(Partial(), Replicate()),)),
        local_forward=lambda s, m: True,
        with_parameter_entries=lambda s, placements: PartialSumParallel(
            {**(s.placements or {}), **placements}
        ),
        partial_sum=lambda s: "region",
    )

    def __init__(self, placements: Mapping[str, Placement] | None = None) -> None:
        super().__init__()
        # no entries: the default
        self.placements = _placements_argument(placements) or None

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Each direct parameter's placement: its entry's, else replicated."""
        placements = self.placements or {}
        return {
            name: placements.get(name, Replicate())
            for name, _ in module.named_parameters(recurse=False)
        }

    def _replicated(self, module: nn.Module) -> list[tuple[Any, nn.Module]]:
        """The replicated parameters the region sums the gradients of: ``(name, module)``
        for its own, ``((path, name), submodule)`` for those of submodules the plan gives no
        style (all of them, for a style applied by hand)."""
        placements = self._parameter_placements(module)
        found: list[tuple[Any, nn.Module]] = [
            (name, module) for name, p in placements.items() if isinstance(p, Replicate)
        ]
        paths = {id(sub): path for path, sub in module.named_modules()}
        for sub in _unstyled_submodules(module):
            found += [((paths[id(sub)], n), sub) for n, _ in sub.named_parameters(recurse=False)]
        return found

    def _input_boundary(self, module: nn.Module) -> Boundary:
        whole = Layout(Replicate(), Replicate(), grad=Partial())
        names, _ = _forward_inputs(module)
        return Boundary(tuple(whole for _ in names), {n: whole for n in names}, coalesced=True)

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        _check_direct_placements(module, self.placements or {}, device_mesh)
        _check_whole_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        keep = device_mesh.get_local_rank() == 0  # the rank keeping the other outputs' grads
        placements = self._parameter_placements(module)
        # its own replicated parameters: partial gradients, like those of the inner modules
        replicated = frozenset(n for n, p in placements.items() if isinstance(p, Replicate))
        return _distribute_whole(self, module, device_mesh, placements, keep, replicated)

    def _forward(
        self,
        module: nn.Module,
        rt: _layouts.DTensorRuntime,
        own_forward,
        inner: list[nn.Module],
        keep: bool,
        replicated: frozenset[str],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # every floating-point input, read whole: its gradient is a partial sum
        names = list(range(len(args))) + list(kwargs)
        values = [*args, *kwargs.values()]
        entering = [
            i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        if entering:
            entered = rt.enter_replicated_many(tuple(values[i] for i in entering))
            for i, value in zip(entering, entered, strict=True):
                values[i] = value
        args = tuple(values[: len(args)])
        kwargs = dict(zip(names[len(args) :], values[len(args) :], strict=True))
        # the replicated parameters inside, as local tensors with partial gradients
        swapped = _swap_in_local_parameters(inner, rt, True)
        try:
            params = compat.direct_parameters(module)
            local = {
                name: rt.local_parameter(module, name, partial=name in replicated)
                for name in params
            }
            compat.swap_direct_parameters(module, local)
            try:
                output = own_forward(module, *args, **kwargs)
            finally:
                compat.swap_direct_parameters(module, params)
        finally:
            _swap_back(swapped)
        return self._leave(module, rt, output, keep)

    def _leave(
        self, module: nn.Module, rt: _layouts.DTensorRuntime, output: Any, keep: bool
    ) -> Any:
        """The first output summed; the others' gradients kept on one rank."""
        if isinstance(output, torch.Tensor):
            return rt.reduce_partial(output, Replicate(), True)
        if not isinstance(output, tuple) or not output or not isinstance(output[0], torch.Tensor):
            raise TypeError(
                f"{_where(self, module)}: expected the module to return a tensor, or a tuple "
                f"whose first element is one (the partial sum), found {short_repr(output)}"
            )
        first, *rest = output
        rest = [
            _FirstRankGradient.apply(t, keep)
            if isinstance(t, torch.Tensor) and t.requires_grad
            else t
            for t in rest
        ]
        items = (rt.reduce_partial(first, Replicate(), True), *rest)
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)


class AttentionHeads(ParallelStyle):
    """Check that an attention module's heads split evenly, and make its sizes per-rank.

    Column-parallel q/k/v projections give each rank whole heads only when the numbers of
    query and key/value heads divide by the TP degree; otherwise the model fails mid-forward
    (or worse, computes with half heads). This style goes on the attention module itself,
    next to the styles of its projections, and refuses such a plan before anything changes.
    It owns no parameters and moves no data.

    Some attention modules read their sizes from attributes in ``forward`` (GPT-2 splits its
    fused projection by ``split_size``): the attributes named in ``divide`` are divided by
    the TP degree, so that the module sees this rank's share.

    Args:
        num_heads (int or str): the number of query heads, or the dotted attribute of the
            module holding it (``"num_heads"``, ``"config.num_attention_heads"``).
        num_kv_heads (int or str, optional): the number of key/value heads (grouped-query
            attention), likewise. Default: ``None`` (as many as query heads).

    Keyword Args:
        divide (Sequence[str], optional): integer attributes of the module itself to divide
            by the TP degree. Default: ``()``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "model.layers.*.self_attn": AttentionHeads(
        ...         "config.num_attention_heads", "config.num_key_value_heads"
        ...     ),
        ...     "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        ...     # ...
        ... }
    """

    contract = StyleContract(
        arguments=lambda s: {
            "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "divide": s.divide,
        },
        # what _apply sets: each rank sees its share of the divided sizes
        attributes=lambda s, m, n: {name: getattr(m, name) // n for name in s.divide},
    )

    def __init__(
        self,
        num_heads: int | str,
        num_kv_heads: int | str | None = None,
        *,
        divide: tuple[str, ...] | list[str] = (),
    ) -> None:
        super().__init__()
        for what, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value is None or isinstance(value, str) and _is_attribute_path(value):
                continue
            if isinstance(value, str):
                raise ValueError(
                    f"{what} must be an int or the dotted name of a public attribute of the "
                    f"module ('num_heads', 'config.num_attention_heads'), found "
                    f"{short_repr(value)}"
                )
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"{what} must be an int or an attribute name, found "
                    f"{type(value).__name__} {short_repr(value)}"
                )
            if value < 1:
                raise ValueError(f"{what} must be a positive int, found {value}")
        if isinstance(divide, str) or not isinstance(divide, (tuple, list)):
            raise TypeError(
                f"divide must be a tuple or list of attribute names, found "
                f"{type(divide).__name__} {short_repr(divide)}"
            )
        for name in divide:
            if not isinstance(name, str) or not _is_attribute_path(name) or "." in name:
                raise ValueError(
                    f"divide names public attributes of the module itself, found "
                    f"{short_repr(name)} (a shared object such as the config must not be "
                    "changed per module)"
                )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.divide = tuple(divide)

    def _count(self, module: nn.Module, value: int | str | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        found = module
        for part in value.split("."):
            if not hasattr(found, part):
                raise ValueError(
                    f"{type(module).__name__} has no attribute {value!r} (found no {part!r})"
                )
            found = getattr(found, part)
        if not isinstance(found, int) or isinstance(found, bool):
            raise ValueError(f"attribute {value!r} is a {type(found).__name__}, not an int")
        return found

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        n = device_mesh.size()
        heads = self._count(module, self.num_heads)
        kv_heads = self._count(module, self.num_kv_heads)
        for what, count in (("query heads", heads), ("key/value heads", kv_heads)):
            if count is not None and count % n:
                # the TP degrees worth naming (a count from a plan file may be huge)
                divisors = [d for d in range(1, min(count, 1024) + 1) if count % d == 0]
                raise ValueError(
                    f"{count} {what} do not split over {n} ranks: each rank must hold whole "
                    f"heads. Use a TP degree that divides {count} ({', '.join(map(str, divisors))})"
                )
        for name in self.divide:
            value = self._count(module, name)
            if value % n:
                raise ValueError(f"attribute {name!r} = {value} does not divide by the {n} ranks")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # the divided sizes, as the contract states them (the shape check reads it too)
        for name, value in self.contract.attributes(self, module, device_mesh.size()).items():
            setattr(module, name, value)
        return module


def _is_attribute_path(text: str) -> bool:
    """``text`` is a dotted path of public attributes (``config.num_attention_heads``): not
    one that reaches into private or special ones (``forward.__globals__``)."""
    return len(text) <= REPR_LIMIT and all(
        part.isidentifier() and not part.startswith("_") for part in text.split(".")
    )


def _check_expert_ids(
    style: ParallelStyle,
    module: nn.Module,
    rt: _layouts.DTensorRuntime,
    top_k_index: torch.Tensor,
    n_experts: int,
) -> None:
    """Refuse expert ids outside ``[0, n_experts)``, on every rank if any rank has one. The
    routing is meant to be the same on every rank (replicated tokens); so that one rank's
    bad routing does not leave the others waiting in the experts' reduction, the verdict is
    agreed over the mesh first (one all-reduce of one number; one flag read back, a host
    sync on a GPU)."""
    if top_k_index.is_meta or torch.compiler.is_compiling():
        return
    bad = ((top_k_index < 0) | (top_k_index >= n_experts)).any().reshape(1)
    group = rt.mesh.get_group()
    flag = bad.to(device=_regions._flag_device(group), dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    if flag.item():
        error = _bad_expert_ids(style, module, n_experts) if bad.item() else None
        _regions.raise_agreed(error, [group])


def _bad_expert_ids(style: ParallelStyle, module: nn.Module, n_experts: int) -> ValueError:
    return ValueError(
        f"{_where(style, module)}: the router gave expert ids outside [0, {n_experts}); "
        "top_k_index must hold ids of the module's experts"
    )


@contextlib.contextmanager
def _attribute_as(module: nn.Module, name: str, value: Any, *, only_if_int: bool = False):
    """``module.<name>`` set to ``value`` inside the block (when it has an int such attribute,
    with ``only_if_int``), restored after it."""
    old = getattr(module, name, None)
    if only_if_int and (not isinstance(old, int) or isinstance(old, bool)):
        yield
        return
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _tokens_like(args: tuple) -> torch.Tensor:
    """An experts module's output for the dry-run report: like its tokens (its first input),
    without running its forward (which reads the routing)."""
    return torch.empty_like(args[0])


def _run_on_local_parameters(
    module: nn.Module,
    rt: _layouts.DTensorRuntime,
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


def _unstyled_submodules(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` (not itself) that hold parameters of their own and that
    the plan being applied gives no style (every one, for a style applied by hand)."""
    styled = plan_styled() or frozenset()
    return [
        sub
        for path, sub in module.named_modules()
        if path and id(sub) not in styled and compat.direct_parameters(sub)
    ]


def _replicate_parameters(
    modules: list[nn.Module], rt: _layouts.DTensorRuntime, src_data_rank: int | None
) -> None:
    """Make every direct parameter of ``modules`` a replicated DTensor."""
    for sub in modules:
        placements = {name: Replicate() for name, _ in sub.named_parameters(recurse=False)}
        _distribute_parameters(sub, rt, placements, src_data_rank)


def _check_whole_not_distributed(module: nn.Module) -> None:
    """Refuse ``module`` or a submodule without a style in the plan that was parallelized
    before."""
    for sub in (module, *_unstyled_submodules(module)):
        _check_not_distributed(sub)


def _distribute_whole(
    style: ParallelStyle,
    module: nn.Module,
    device_mesh: DeviceMesh,
    placements: Mapping[str, Placement],
    *bound: Any,
) -> nn.Module:
    """:func:`_distribute_and_wrap` for a style that computes with its whole module: the
    parameters of the submodules without a style become replicated DTensors too, and the
    style's ``_forward`` gets those submodules before ``bound``."""
    rt = _layouts.runtime(device_mesh)
    inner = _unstyled_submodules(module)
    _replicate_parameters(inner, rt, style.src_data_rank)
    return _distribute_and_wrap(style, module, device_mesh, placements, inner, *bound)


def _swap_in_local_parameters(
    modules: list[nn.Module], rt: _layouts.DTensorRuntime, partial: bool
) -> list[tuple[nn.Module, dict]]:
    """Give ``modules`` local views of their DTensor parameters (see
    :func:`_run_on_local_parameters`); returns what :func:`_swap_back` puts back."""
    swapped = []
    try:
        for sub in modules:
            local = {
                name: rt.local_parameter(sub, name, partial=partial)
                for name in compat.direct_parameters(sub)
            }
            swapped.append((sub, compat.swap_direct_parameters(sub, local)))
    except BaseException:
        _swap_back(swapped)
        raise
    return swapped


def _swap_back(swapped: list[tuple[nn.Module, dict]]) -> None:
    for sub, original in reversed(swapped):
        compat.swap_direct_parameters(sub, original)


def _hook_dtensor_forward(
    style: ParallelStyle,
    module: nn.Module,
    rt: _layouts.DTensorRuntime,
    input_layout: Placement,
    desired_input: Placement,
    output_layout: Placement,
    use_local_output: bool,
) -> None:
    """Run ``module``'s own forward on DTensors: annotate and move the first input to
    ``desired_input`` before it, move the output to ``output_layout`` after it."""

    def enter(mod: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            x = rt.prepare(inputs[0], input_layout, desired_input, False)
        except _layouts.ShardDimError as err:
            raise _in_module(style, mod, err) from None
        return (x, *inputs[1:])

    def leave(mod: nn.Module, inputs: Any, output: Any) -> Any:
        if not isinstance(output, DTensor):
            return output
        try:
            out = rt.redistribute(output, _layouts.normalize(output_layout, output.ndim))
        except _layouts.ShardDimError as err:
            raise _in_module(style, mod, err) from None
        return out.to_local() if use_local_output else out

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's inputs as DTensors before its forward runs.

    Each positional input with a layout in ``input_layouts`` (and each keyword input named
    in ``input_kwarg_layouts``) is annotated with that layout if it is a local tensor, then
    moved to the matching desired layout. ``None`` leaves an input untouched.

    Keyword Args:
        input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            positional inputs; ``None`` is a placeholder for an input to leave alone.
            Default: ``None`` (positional inputs are left alone).
        desired_input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts the
            module should receive; same length as ``input_layouts``. Default: ``None``.
        input_kwarg_layouts (Dict[str, Placement]): the layouts of keyword inputs.
            Default: ``None``.
        desired_input_kwarg_layouts (Dict[str, Placement]): the layouts the module should
            receive for keyword inputs. Default: ``None``.
        use_local_output (bool, optional): give the module local :class:`torch.Tensor` inputs
            instead of DTensors. Default: ``False``.

    Returns:
        A :class:`ParallelStyle` that prepares the module's inputs.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PrepareModuleInput
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> block = TransformerBlock(...)  # a module with an "attn" submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # the first input of "attn" arrives sharded on dim 0 and is replicated
        >>> parallelize_module(
        ...     block,
        ...     tp_mesh,
        ...     {"attn": PrepareModuleInput(
        ...         input_layouts=(Shard(0), None),
        ...         desired_input_layouts=(Replicate(), None),
        ...     )},
        ... )
    """

    contract = StyleContract(
        arguments=lambda s: {
            "input_layouts": s.input_layouts,
            "desired_input_layouts": s.desired_input_layouts,
            "input_kwarg_layouts": s.input_kwarg_layouts if s.with_kwargs else None,
            "desired_input_kwarg_layouts": s.desired_input_kwarg_layouts or None,
            "use_local_output": s.use_local_output,
        },
        inputs=lambda s, m: s._boundary(),
    )

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _as_tuple(input_layouts, "input_layouts")
        self.desired_input_layouts = _as_tuple(desired_input_layouts, "desired_input_layouts")
        self.use_local_output = _check_flag(use_local_output, "use_local_output")
        if self.input_layouts is not None:
            # AssertionError, as upstream raises: callers may catch it
            if self.desired_input_layouts is None:
                raise AssertionError("desired module inputs should not be None!")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise AssertionError(
                    "input_layouts and desired_input_layouts should have same length! "
                    f"found {len(self.input_layouts)} and {len(self.desired_input_layouts)}"
                )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = _as_kwarg_layouts(input_kwarg_layouts, "input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _as_kwarg_layouts(
            desired_input_kwarg_layouts, "desired_input_kwarg_layouts"
        )
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(
            self.desired_input_kwarg_layouts
        ):
            raise AssertionError(
                "input_kwarg_layouts and desired_input_kwarg_layouts should have same length!"
            )

    def _boundary(self) -> Boundary:
        local = self.use_local_output
        args = tuple(
            None if layout is None else Layout(layout, desired, local)
            for layout, desired in zip(
                self.input_layouts or (), self.desired_input_layouts or (), strict=True
            )
        )
        kwargs = {
            name: Layout(layout, self.desired_input_kwarg_layouts.get(name), local)
            for name, layout in self.input_kwarg_layouts.items()
        }
        return Boundary(args, kwargs, exact=self.input_layouts is not None)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rt = _layouts.runtime(device_mesh)
        if self.with_kwargs:
            module.register_forward_pre_hook(
                functools.partial(self._prepare_with_kwargs, rt), with_kwargs=True
            )
        else:
            module.register_forward_pre_hook(functools.partial(self._prepare_hook, rt))
        return module

    def _prepare_hook(
        self, rt: _layouts.DTensorRuntime, module: nn.Module, inputs: tuple[Any, ...]
    ):
        return self._prepare_args(rt, module, inputs)

    def _prepare_with_kwargs(
        self,
        rt: _layouts.DTensorRuntime,
        module: nn.Module,
        inputs: tuple[Any, ...],
        kwargs: dict,
    ):
        prepared = {
            key: self._prepare_one(
                module,
                key,
                value,
                rt,
                self.input_kwarg_layouts.get(key),
                self.desired_input_kwarg_layouts.get(key),
            )
            for key, value in kwargs.items()
        }
        return self._prepare_args(rt, module, inputs), prepared

    def _prepare_args(
        self, rt: _layouts.DTensorRuntime, module: nn.Module, inputs: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        if self.input_layouts is None:
            return inputs
        if len(inputs) != len(self.input_layouts):
            raise ValueError(
                f"{_where(self, module)}: module inputs and input_layouts should have same "
                f"length! found {len(inputs)} inputs for {len(self.input_layouts)} layouts"
            )
        return tuple(
            self._prepare_one(module, i, value, rt, layout, desired)
            for i, (value, layout, desired) in enumerate(
                zip(inputs, self.input_layouts, self.desired_input_layouts, strict=True)
            )
        )

    def _prepare_one(
        self,
        module: nn.Module,
        where: int | str,
        value: Any,
        rt: _layouts.DTensorRuntime,
        *layouts: Placement | None,
    ):
        """Prepare one input; ``where`` is its position, or its keyword (named on error only:
        this runs for every input of every call)."""
        if layouts[0] is not None and not isinstance(value, torch.Tensor):
            what = f"input {where}" if isinstance(where, int) else f"keyword input {where!r}"
            # AssertionError, as upstream raises
            raise AssertionError(
                f"{_where(self, module)}: expecting {what} to be a torch.Tensor for layout "
                f"{layouts[0]}, found {type(value).__name__}"
            )
        try:
            return rt.prepare(value, *layouts, self.use_local_output)
        except _layouts.ShardDimError as err:
            raise _in_module(self, module, err) from None


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs as DTensors after its forward runs.

    Each output with a layout in ``output_layouts`` is annotated with that layout if it is a
    local tensor, then moved to the matching desired layout; ``None`` leaves an output
    untouched. A module returning one tensor gets one tensor back.

    Keyword Args:
        output_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            outputs; ``None`` is a placeholder for an output to leave alone.
        desired_output_layouts (Union[Placement, Tuple[Placement]]): the layouts to return;
            same length as ``output_layouts``.
        use_local_output (bool, optional): return local :class:`torch.Tensor` outputs instead
            of DTensors. Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that prepares the module's outputs.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PrepareModuleOutput
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> block = TransformerBlock(...)
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # the block's replicated output is returned sharded on dim 0
        >>> parallelize_module(
        ...     block,
        ...     tp_mesh,
        ...     PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        ... )
    """

    contract = StyleContract(
        arguments=lambda s: {
            "output_layouts": s.output_layouts,
            "desired_output_layouts": s.desired_output_layouts,
            "use_local_output": s.use_local_output,
        },
        outputs=lambda s, m: Boundary(
            tuple(
                None if layout is None else Layout(layout, desired, s.use_local_output)
                for layout, desired in zip(s.output_layouts, s.desired_output_layouts, strict=True)
            ),
            exact=True,
        ),
    )

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts = _as_tuple(output_layouts, "output_layouts")
        self.desired_output_layouts = _as_tuple(desired_output_layouts, "desired_output_layouts")
        self.use_local_output = _check_flag(use_local_output, "use_local_output")
        if self.output_layouts is None or self.desired_output_layouts is None:
            raise AssertionError("output_layouts and desired_output_layouts must be given!")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise AssertionError(
                "output_layouts and desired_output_layouts should have same length! found "
                f"{len(self.output_layouts)} and {len(self.desired_output_layouts)}"
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rt = _layouts.runtime(device_mesh)
        module.register_forward_hook(functools.partial(self._prepare_hook, rt))
        return module

    def _prepare_hook(
        self, rt: _layouts.DTensorRuntime, module: nn.Module, inputs: Any, outputs: Any
    ):
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outputs) != len(self.output_layouts):
            raise ValueError(
                f"{_where(self, module)}: module outputs and output_layouts should have same "
                f"length! found {len(outputs)} outputs for {len(self.output_layouts)} layouts"
            )
        prepared = []
        for i, (value, layout, desired) in enumerate(
            zip(outputs, self.output_layouts, self.desired_output_layouts, strict=True)
        ):
            if layout is not None and not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{_where(self, module)}: expecting output {i} to be a torch.Tensor for "
                    f"layout {layout}, found {type(value).__name__}"
                )
            try:
                prepared.append(rt.prepare(value, layout, desired, self.use_local_output))
            except _layouts.ShardDimError as err:
                raise _in_module(self, module, err) from None
        return prepared[0] if len(prepared) == 1 else tuple(prepared)


class PrepareModuleInputOutput(ParallelStyle):
    """Lay out a module's inputs before and its outputs after its forward runs.

    The combination of :class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one
    module; see those for the meaning of each argument.

    Keyword Args:
        input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            positional inputs. Default: ``None``.
        desired_input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts the
            module should receive. Default: ``None``.
        input_kwarg_layouts (Dict[str, Placement]): the layouts of keyword inputs.
            Default: ``None``.
        desired_input_kwarg_layouts (Dict[str, Placement]): the layouts the module should
            receive for keyword inputs. Default: ``None``.
        use_local_input (bool, optional): give the module local tensors instead of DTensors.
            Default: ``False``.
        output_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            outputs.
        desired_output_layouts (Union[Placement, Tuple[Placement]]): the layouts to return.
        use_local_output (bool, optional): return local tensors instead of DTensors.
            Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that prepares the module's inputs and outputs.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PrepareModuleInputOutput
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> block = TransformerBlock(...)
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> parallelize_module(
        ...     block,
        ...     tp_mesh,
        ...     {"attn": PrepareModuleInputOutput(
        ...         input_layouts=(Shard(0), None),
        ...         desired_input_layouts=(Replicate(), None),
        ...         output_layouts=Replicate(),
        ...         desired_output_layouts=Shard(0),
        ...     )},
        ... )
    """

    contract = StyleContract(
        arguments=lambda s: {
            **{
                ("use_local_input" if k == "use_local_output" else k): v
                for k, v in _arguments(s.prepare_module_input).items()
            },
            **_arguments(s.prepare_module_output),
        },
        inputs=lambda s, m: s.prepare_module_input._boundary(),
        outputs=lambda s, m: PrepareModuleOutput.contract.outputs(s.prepare_module_output, m),
    )

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ) -> None:
        _check_flag(use_local_input, "use_local_input")
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module
