"""The runtime a style computes with: layouts at module boundaries, and the two runtimes
that change them. Public: it is the style kit, the built-in styles' and a user style's alike
(``docs/guide.md``, "The style kit").

A value crosses a module boundary in one of two forms: a local :class:`torch.Tensor` whose
layout the plan declares (``Shard(-1)``, ``Replicate()``, ...), or a :class:`DTensor` that
carries its layout with it. A *runtime* converts between the two and moves data between
layouts for the styles; it is the only place where styles touch DTensor's layout machinery,
so that the styles (:mod:`torch_tp.style`) read as a list of contracts rather than as
plumbing. There are two, with the same methods and the same results:

* :class:`DTensorRuntime` (``TORCH_TP_RUNTIME=dtensor``): every layout change is plain
  DTensor (``DTensor.from_local``, ``to_local``, ``redistribute``), with no cache, no region
  Function and no deferred reduction. It is the reference: a result that differs between the
  two runtimes is a bug of the fast one.
* :class:`FastRuntime` (``TORCH_TP_RUNTIME=fast``, the default): the common boundaries of a
  tensor-parallel block go through Megatron's regions (:mod:`torch_tp._regions`), column-
  parallel layers reading one tensor share one entry into the region, the partial gradients
  of replicated parameters are summed in one all-reduce at the end of backward
  (:class:`PartialGradientReduction`), and the hot paths build DTensors with DTensor's C++
  constructor. Everything else falls back to :class:`DTensorRuntime`.

:func:`torch_tp.parallelize_module` reads ``TORCH_TP_RUNTIME`` once per call; every style it
applies binds the runtime of that mode (:func:`for_mesh`) into the module, so a model keeps the
runtime it was parallelized with.

Caches (the fast runtime's; the DTensor runtime has none):

* ``_torch_tp_region_entry``, on a plain tensor (its ``__dict__``): the alias of it that
  entered a column-parallel region
  (:func:`~torch_tp._regions.copy_to_tensor_parallel_region`), keyed by the mesh, the
  tensor's ``_version``, grad mode and, under grad mode, the tensor's ``grad_fn``. An
  in-place change of the tensor, another mesh, grad mode or a new graph (the next step)
  invalidate it.
* ``_last_gathered`` (this module): the latest all-gathered sequence-sharded input, with a weak
  reference to the shard it came from, keyed likewise. The next gather replaces it, so that
  no gathered activation outlives the next one (it keeps its autograd graph, and with it the
  parameters of the model that made it, until then).
* ``_torch_tp_partial_local``, on a replicated DTensor: its local view that column-parallel
  readers share (their input gradients add up locally and cross back once), keyed by the
  DTensor's ``_version``; an in-place change invalidates it.
* ``_torch_tp_respec``, on a parameter's ``DTensorSpec``: the same spec with another placement.
  Specs are immutable; the entry lives as long as the spec.
* ``_torch_tp_replicated_specs``, on a :class:`DeviceMesh` (:func:`_replicated_spec`): the
  replicated spec of an activation on that mesh object, by shape, stride and dtype (at most
  256). Immutable; not by the mesh's value, which an earlier mesh with other process groups
  may share.
* ``_regions._SIZES``: the size of each mesh, by ``id(mesh)``; dropped with the mesh.
* ``_torch_tp_partial_gradients``, on a :class:`DeviceMesh`: not a cache but the mesh's
  :class:`PartialGradientReduction`, made by the first fast runtime on the mesh.
* ``_torch_tp_distributed_as`` (set by :func:`torch_tp.style.base.distribute_parameters`, both
  runtimes): on an original parameter, the DTensor parameter that replaced it, so that the
  other modules a tied weight belongs to register the same object; used only when the mesh
  and placement match.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torch_tp import _regions
from torch_tp import _torch_compat as compat
from torch_tp._torch_compat import DTensorSpec, StridedShard, TensorMeta
from torch_tp.contract import Layout

# the style kit: what a style's _apply and forward call (the rest serves parallelize_module)
__all__ = [
    "RUNTIME_ENV",
    "DTensorRuntime",
    "FastRuntime",
    "ShardDimError",
    "chunk_range",
    "flag_device",
    "for_mesh",
    "gradient_on_rank_zero",
    "normalize",
    "raise_agreed",
    "replicated_from_local",
    "runtime_mode",
    "shard_range",
]

# ------------------------------------------------------------------------------------------
# Choosing the runtime
# ------------------------------------------------------------------------------------------

RUNTIME_ENV = "TORCH_TP_RUNTIME"

# the mode of the parallelize_module call being applied (None outside one)
_applying: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "torch_tp_runtime_mode", default=None
)


def runtime_mode() -> str:
    """The runtime ``TORCH_TP_RUNTIME`` selects: ``"fast"`` (unset) or ``"dtensor"``.

    Raises:
        ValueError: any other value.
    """
    mode = os.environ.get(RUNTIME_ENV, "fast")
    if mode not in _RUNTIMES:
        raise ValueError(
            f"{RUNTIME_ENV}={mode!r} names no torch_tp runtime: expected 'fast' (the default: "
            "regions, shared entries and one end-of-backward reduction) or 'dtensor' (every "
            "layout change through plain DTensor)"
        )
    return mode


@contextlib.contextmanager
def applying() -> Iterator[str]:
    """Read ``TORCH_TP_RUNTIME`` once for one :func:`torch_tp.parallelize_module` call: the
    styles it applies inside this context all get that mode's runtime."""
    token = _applying.set(runtime_mode())
    try:
        yield _applying.get()
    finally:
        _applying.reset(token)


def for_mesh(mesh: DeviceMesh) -> DTensorRuntime:
    """The runtime a style's ``_apply`` binds into its module, on the 1-D ``mesh``: that of
    the :func:`torch_tp.parallelize_module` call applying it, or (a style applied by hand)
    the mode ``TORCH_TP_RUNTIME`` selects now."""
    mode = _applying.get() or runtime_mode()
    return _RUNTIMES[mode](mesh)


# ------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------


def annotate(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """View a local tensor as a DTensor with ``layout`` (no communication).

    A DTensor passes through unchanged: it already knows its layout.
    """
    if isinstance(value, DTensor):
        return value
    return DTensor.from_local(value, mesh, (layout,), run_check=False)


class ShardDimError(ValueError):
    """A sharded layout names a dimension the tensor it lays out does not have.

    Raised by :func:`normalize`, which knows neither the module nor the style: the styles
    catch it where they call in and add both to the message.
    """


def normalize(layout: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` and ``Shard(ndim - 1)`` are the same layout; make them compare equal.

    Raises:
        ShardDimError: ``layout`` shards a dimension outside ``[-ndim, ndim)``. Collectives
            would otherwise wrap it (``Shard(99)`` of a 3-D tensor gathering dim 0).
    """
    if isinstance(layout, (Shard, StridedShard)):
        dim = layout.dim
        if not -ndim <= dim < ndim:
            raise ShardDimError(
                f"{layout!r} does not fit the {ndim}-D tensor it lays out: a Shard dim must be "
                f"in [{-ndim}, {ndim})"
            )
        if dim < 0:
            if isinstance(layout, StridedShard):
                return StridedShard(dim + ndim, split_factor=layout.split_factor)
            return Shard(dim + ndim)
    return layout


def redistribute(value: DTensor, layout: Placement) -> DTensor:
    """Move ``value`` to ``layout``; free when it is already there."""
    layout = normalize(layout, value.ndim)
    if value.placements == (layout,):
        return value
    return value.redistribute(placements=(layout,), async_op=False)


def shard_range(size: int, mesh: DeviceMesh) -> tuple[int, int]:
    """The ``[start, stop)`` of this rank's rows when ``size`` rows are ``Shard``-ed."""
    return chunk_range(size, mesh.size(), mesh.get_local_rank())


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of ``size`` items split as DTensor's ``Shard``
    (and :func:`torch.chunk`) split them: ``ceil(size / n)`` each, the tail ones shorter or
    empty."""
    chunk = -(-size // num_chunks)  # ceil, in integers
    start = index * chunk
    if not isinstance(start, int):
        # a rank that differs per simulated rank (a SymInt under LocalTensorMode): min()
        # would compare it as one value
        start = torch.sym_min(start, size)
        return start, torch.sym_min(start + chunk, size)
    start = min(start, size)
    return start, min(start + chunk, size)


def _on_rank_zero(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``local`` on rank 0 of the 1-D ``mesh``, zeros of its shape on the others: a whole
    value as a partial sum, exactly (unlike dividing it by the mesh size)."""
    rank = mesh.get_local_rank()
    if isinstance(rank, int):
        return local if rank == 0 else torch.zeros_like(local)
    # a SymInt under LocalTensorMode (every rank simulated in one process), where a branch
    # on the rank would take one side for all ranks: multiply by 1 on rank 0, 0 elsewhere
    return local * (1 - torch.sym_min(rank, 1))


def gradient_on_rank_zero(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``value`` itself, whose gradient, whole on every rank, goes back on rank 0 of ``mesh``
    and as zeros on the others: so that a sum of the gradients over the ranks (a partial-sum
    region's, a replicated parameter's partial gradient) counts it once."""
    return _GradientOnRankZero.apply(value, mesh)


class _GradientOnRankZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _on_rank_zero(grad, ctx.mesh), None


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


# ------------------------------------------------------------------------------------------
# The reference runtime: plain DTensor
# ------------------------------------------------------------------------------------------


class DTensorRuntime:
    """Every layout change through plain DTensor (``TORCH_TP_RUNTIME=dtensor``).

    ``from_local`` to annotate, ``redistribute`` to move, ``to_local`` to unwrap (with the
    gradient placements that say what each rank's gradient is), and each partial gradient of
    a replicated parameter reduced as it arrives. No cache, no region Function, no private
    DTensor API: the reference :class:`FastRuntime` is checked against. A local result is
    handed on as one its reader may modify in place, without a copy (:func:`_modifiable_local`).

    Args:
        mesh (DeviceMesh): the 1-D mesh the module is parallelized on.
    """

    mode = "dtensor"

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mesh})"

    def annotate(self, value: torch.Tensor, layout: Placement) -> DTensor:
        """View a local tensor as a DTensor laid out ``layout`` (a DTensor passes through)."""
        return annotate(value, self.mesh, layout)

    def redistribute(self, value: DTensor, layout: Placement) -> DTensor:
        """Move ``value`` to ``layout``; free when it is already there."""
        return redistribute(value, layout)

    def prepare(
        self, value: Any, layout: Placement | None, desired: Placement | None, use_local: bool
    ) -> Any:
        """Annotate one input or output with ``layout``, move it to ``desired``, maybe unwrap:
        what :class:`~torch_tp.PrepareModuleInput` and :class:`~torch_tp.PrepareModuleOutput`
        do to one value. ``layout`` ``None``: leave it alone; ``desired`` ``None``: annotate
        only."""
        if layout is None:
            return value
        if not isinstance(value, DTensor):
            # checked here, where DTensor would either wrap the dim or fail in its internals
            normalize(layout, value.ndim)
            if desired is not None:
                normalize(desired, value.ndim)
        dt = moved = self.annotate(value, layout)
        if desired is not None:
            moved = self.redistribute(dt, desired)
        if not use_local:
            return moved
        return _modifiable_local(dt, moved, None if isinstance(value, DTensor) else value)

    def enter(self, value: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The local tensor a computation reads for one input, as a contract states it.

        ``layout`` is the input's :class:`~torch_tp.contract.Layout` in the style's contract,
        so that what the style declares is what its forward does: ``to=Replicate()`` with
        ``grad=Partial()`` is the whole input, whose gradients come back as partial sums
        (:meth:`enter_replicated`); a ``to`` that shards is this rank's shard
        (:meth:`enter_sharded`). ``given`` is the layout of a plain-tensor ``value``.

        Raises:
            ValueError: ``layout`` describes no local computation's input (a whole input
                whose gradient is not a partial sum, say).
            ShardDimError: a sharded layout names a dimension ``value`` does not have.
        """
        to = layout.to
        if isinstance(to, Replicate) and isinstance(layout.grad, Partial):
            return self.enter_replicated(value, layout.given)
        if isinstance(to, (Shard, StridedShard)) and layout.grad in (None, to):
            ndim = value.ndim
            return self.enter_sharded(value, normalize(layout.given, ndim), normalize(to, ndim))
        raise ValueError(
            f"{layout} is not the input of a local computation: it enters whole "
            "(to=Replicate(), grad=Partial()) or as this rank's shard (to=Shard(d))"
        )

    def exit(self, local: torch.Tensor, layout: Layout, global_shape: torch.Size) -> torch.Tensor:
        """A local computation's result as the module's output, as a contract states it.

        ``layout`` is the output's :class:`~torch_tp.contract.Layout` in the style's
        contract: ``given=Partial()`` sums the partial results into ``to``
        (:meth:`reduce_partial`); any other ``given`` is the layout ``local`` was computed
        in, moved to ``to`` (:meth:`leave`). ``layout.local``: return a plain tensor.
        ``global_shape`` is the output's shape on one device.

        Raises:
            ShardDimError: a sharded layout names a dimension ``local`` does not have.
        """
        ndim = local.ndim
        to = normalize(layout.to, ndim)
        if isinstance(layout.given, Partial):
            return self.reduce_partial(local, to, layout.local)
        given = normalize(layout.given, ndim)
        return self.leave(local, given, to, layout.local, global_shape)

    def enter_replicated(self, value: torch.Tensor, layout: Placement) -> torch.Tensor:
        """The whole input of a column-parallel computation, as a local tensor.

        Every rank computes with the whole input, so each rank's input gradient is only its
        own contribution: the backward sums them (all-reduce, or reduce-scatter when the
        input came in sharded).
        """
        if not isinstance(value, DTensor):
            normalize(layout, value.ndim)
        whole = self.redistribute(self.annotate(value, layout), Replicate())
        return whole.to_local(grad_placements=(Partial(),))

    def enter_replicated_many(self, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """:meth:`enter_replicated` for several replicated local inputs of one computation."""
        return tuple(self.enter_replicated(value, Replicate()) for value in values)

    def enter_sharded(
        self, value: torch.Tensor, layout: Placement, want: Placement
    ) -> torch.Tensor:
        """The local shard (on ``want``) of a row-parallel computation's input."""
        return self.redistribute(self.annotate(value, layout), want).to_local()

    def reduce_partial(
        self, partial: torch.Tensor, layout: Placement, use_local: bool
    ) -> torch.Tensor:
        """Sum the partial results of a row-parallel computation into ``layout``."""
        # a partial sum has the global shape on every rank
        dt = DTensor.from_local(
            partial, self.mesh, (Partial(),), shape=partial.shape, stride=partial.stride()
        )
        moved = self.redistribute(dt, layout)
        return _modifiable_local(dt, moved, partial) if use_local else moved

    def leave(
        self,
        local: torch.Tensor,
        computed: Placement,
        layout: Placement,
        use_local: bool,
        global_shape: torch.Size,
    ) -> torch.Tensor:
        """Turn a locally computed result laid out ``computed`` into the module's output.

        ``global_shape`` is passed explicitly because shards need not be even (a vocabulary
        of 1001 over two ranks), which DTensor cannot infer from one rank's local shape.
        """
        dt = DTensor.from_local(
            local,
            self.mesh,
            (computed,),
            run_check=False,
            shape=global_shape,
            stride=contiguous_stride(global_shape),
        )
        moved = self.redistribute(dt, layout)
        return _modifiable_local(dt, moved, local) if use_local else moved

    def local_parameter(
        self, module: nn.Module, name: str, *, partial: bool = False
    ) -> torch.Tensor | None:
        """The local value of ``module``'s DTensor parameter ``name``, for its own computation.

        Its gradient is a DTensor laid out like the parameter. With ``partial`` the parameter
        is replicated and the computation sees only this rank's share of the data: each
        rank's gradient is then a partial sum, which :meth:`sum_partial_gradients` makes
        whole.
        """
        param = _parameter(module, name)
        if not isinstance(param, DTensor):
            return param
        if not partial:
            return param.to_local()
        # the sum happens here, in from_local's backward (Partial to the parameter's
        # Replicate), not in a hook: module.to() would lose a hook
        whole = DTensor.from_local(param.to_local(), param.device_mesh, param.placements)
        return whole.to_local(grad_placements=(Partial(),))

    def sum_partial_gradients(self, param: nn.Parameter) -> None:
        """Make ``param``'s partial gradients whole (replicated), wherever it is used."""
        # a strong reference (a weak one would make the parameter unswappable by module.to())
        param.register_hook(_replicate_partial)


def _modifiable_local(
    annotated: DTensor, moved: DTensor, local: torch.Tensor | None
) -> torch.Tensor:
    """``moved.to_local()``, handed on as one device would hand the value on: as a tensor its
    reader may modify in place (Llama 4's MoE adds its routed experts' output to its shared
    expert's output with ``out.add_(...)``), and without a copy.

    ``to_local()`` returns a view made inside a custom autograd Function, which autograd
    refuses to modify in place. So the value handed on is:

    * not moved (``moved is annotated``): ``local``, the plain tensor ``annotated`` was made
      from, which the round trip ``from_local`` / ``to_local`` returns as it is, forward and
      backward (``None`` when ``annotated`` came in as a DTensor: then its ``to_local()``);
    * moved by a collective (from a ``Partial`` or ``Shard`` layout, on more than one rank):
      the collective's fresh result, which no other tensor reads, as the output of a non-view
      op (:func:`torch_tp._torch_compat.own_alias`: the same memory, no copy);
    * otherwise (a local slice of a replicated value, or a one-rank mesh, where DTensor's
      result may share the memory of the value it came from): the ``to_local()`` view, which
      autograd keeps refusing to modify in place rather than let a change go unseen.
    """
    if moved is annotated:
        return moved.to_local() if local is None else local
    result = moved.to_local()
    if isinstance(annotated.placements[0], (Partial, Shard)) and annotated.device_mesh.size() > 1:
        return compat.own_alias(result)
    return result


def _parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    params = compat.direct_parameters(module)
    # not registered under its name when parametrized: then the computed tensor
    return params[name] if name in params else getattr(module, name)


def _replicate_partial(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and grad.placements == (Partial(),):
        return grad.redistribute(placements=(Replicate(),))
    return grad


# ------------------------------------------------------------------------------------------
# The fast runtime
# ------------------------------------------------------------------------------------------


class FastRuntime(DTensorRuntime):
    """The default runtime (``TORCH_TP_RUNTIME=fast``): regions, shared entries, one
    end-of-backward reduction, DTensor's C++ constructor on the hot paths; plain DTensor
    (:class:`DTensorRuntime`) for everything else.

    Args:
        mesh (DeviceMesh): the 1-D mesh the module is parallelized on.
    """

    mode = "fast"

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__(mesh)
        self.reduction = PartialGradientReduction.of(mesh)

    def prepare(
        self, value: Any, layout: Placement | None, desired: Placement | None, use_local: bool
    ) -> Any:
        if layout is None or isinstance(value, DTensor):
            return super().prepare(value, layout, desired, use_local)
        mesh = self.mesh
        normalize(layout, value.ndim)
        if desired is not None:
            normalize(desired, value.ndim)
        if use_local and desired in (None, layout):
            return value  # annotate and unwrap: nothing happens, forward or backward
        if not use_local and isinstance(desired or layout, Replicate):
            # the common boundaries of a tensor-parallel block, without DTensor's
            # redistribution: whoever consumes the replicated DTensor may hand back a partial
            # or a replicated gradient; labelled Partial, both are summed by the region
            if isinstance(layout, Replicate):
                local = (
                    _regions.copy_to_tensor_parallel_region(value, mesh)
                    if value.requires_grad
                    else value
                )
                return replicated_from_local(local, mesh)
            if isinstance(layout, Shard):
                dim = normalize(layout, value.ndim).dim
                local = _regions.gather_from_sequence_parallel_region(value, mesh, dim)
                return replicated_from_local(local, mesh)
        return super().prepare(value, layout, desired, use_local)

    def enter_replicated(self, value: torch.Tensor, layout: Placement) -> torch.Tensor:
        mesh = self.mesh
        if isinstance(value, DTensor):
            if value.placements != _REPLICATED:
                value = self.redistribute(value, Replicate())
            return _partial_local(value)
        if isinstance(layout, Replicate):
            if not value.requires_grad:
                return value  # nothing to gather now, no gradient to reduce later
            return _shared_entry(
                value, mesh, None, lambda: _regions.copy_to_tensor_parallel_region(value, mesh)
            )
        if isinstance(layout, Shard):
            dim = normalize(layout, value.ndim).dim
            return _shared_entry(
                value,
                mesh,
                dim,
                lambda: _regions.gather_from_sequence_parallel_region(value, mesh, dim),
            )
        return _partial_local(self.redistribute(self.annotate(value, layout), Replicate()))

    def enter_replicated_many(self, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if any(isinstance(v, DTensor) for v in values) or not any(v.requires_grad for v in values):
            return super().enter_replicated_many(values)
        # their input gradients are summed in one all-reduce
        return _regions.copy_many_to_tensor_parallel_region(values, self.mesh)

    def enter_sharded(
        self, value: torch.Tensor, layout: Placement, want: Placement
    ) -> torch.Tensor:
        if not isinstance(value, DTensor) and layout == want:
            return value  # already the local shard; its gradient is the local shard too
        return super().enter_sharded(value, layout, want)

    def reduce_partial(
        self, partial: torch.Tensor, layout: Placement, use_local: bool
    ) -> torch.Tensor:
        if use_local and isinstance(layout, Replicate):
            return _regions.reduce_from_tensor_parallel_region(partial, self.mesh)
        if use_local and isinstance(layout, Shard):
            return _regions.reduce_scatter_to_sequence_parallel_region(
                partial, self.mesh, layout.dim
            )
        return super().reduce_partial(partial, layout, use_local)

    def leave(
        self,
        local: torch.Tensor,
        computed: Placement,
        layout: Placement,
        use_local: bool,
        global_shape: torch.Size,
    ) -> torch.Tensor:
        if computed == layout and use_local:
            return local  # the common case pays for no DTensor at all
        if (
            use_local
            and isinstance(computed, Shard)
            and isinstance(layout, Replicate)
            and global_shape[computed.dim] % self.mesh.size() == 0
        ):
            return _regions.gather_from_tensor_parallel_region(local, self.mesh, computed.dim)
        return super().leave(local, computed, layout, use_local, global_shape)

    def local_parameter(
        self, module: nn.Module, name: str, *, partial: bool = False
    ) -> torch.Tensor | None:
        """``param.to_local()``, with the same value and the same gradient, for the hot path:
        every Linear, every step. A partial gradient joins the parameters that
        :class:`PartialGradientReduction` sums at the end of backward, in one all-reduce.

        The gradient's spec is the parameter's own, known at forward time, instead of being
        rebuilt and checked in every backward: a third of ``to_local()``'s cost (80 against
        230 us for a forward and backward on CPU). Without grad it is the local tensor itself.

        (A view kept across steps would save the autograd Function too, but not correctly:
        its node would keep the sequence number of the step that made it, so the engine would
        run it after every node of later steps, and FSDP2's post-backward would find no
        gradient.)
        """
        param = _parameter(module, name)
        if not isinstance(param, DTensor) or torch.compiler.is_compiling():
            # compiled graphs have no per-op cost to save (and a compiled backward cannot
            # schedule the reduction of a partial gradient: the parameter's hook does it)
            return super().local_parameter(module, name, partial=partial)
        local = compat.local_tensor(param)
        if not (param.requires_grad and torch.is_grad_enabled()):
            return local  # nothing flows back
        if partial:
            return _PartialLocal.apply(param, self.reduction)
        return _LocalValue.apply(param)

    def sum_partial_gradients(self, param: nn.Parameter) -> None:
        """Make ``param``'s partial gradients whole at the end of every backward.

        The gradient still arrives on ``param.grad`` as on one device, and accumulates across
        backward passes (micro-batches) without extra communication. This hook covers the
        parameter wherever it is used; it is lost when ``module.to()`` or ``to_empty()``
        swaps the parameter's contents, which is why the styles' own local paths use
        :meth:`local_parameter` instead, which needs no hook.
        """
        # a strong reference (a weak one would make the parameter unswappable by module.to())
        param.register_hook(functools.partial(self.reduction.add, param))


_RUNTIMES: dict[str, type[DTensorRuntime]] = {"fast": FastRuntime, "dtensor": DTensorRuntime}
_REPLICATED = (Replicate(),)


# ------------------------------------------------------------------------------------------
# The fast runtime's shared entries and replicated DTensors
# ------------------------------------------------------------------------------------------


def _shared_entry(value: torch.Tensor, mesh: DeviceMesh, dim: int | None, enter) -> torch.Tensor:
    """``enter()``, once per local tensor for all the column-parallel layers that read it.

    q, k and v (or gate and up) read the same activation: sharing one entry into the region
    makes their input gradients add up locally and be reduced once, and a sequence-sharded
    activation be gathered once, as if the plan had declared the block's input with
    ``PrepareModuleInput``.

    An entry is reused only for the same tensor, mesh and dim, the same version of the
    tensor (no in-place change since), and the same autograd graph: under grad mode the
    entry's backward must feed the tensor's current ``grad_fn``, which a tensor reused across
    steps would not have (leaves are never shared). A replicated entry is an alias of the
    tensor (no memory) kept on the tensor itself, without a reference back to it. A gathered
    entry is a whole activation: only the latest one is kept, so that consecutive readers
    share it and no gathered tensor outlives the next gather (a tensor kept alive for
    longer, such as a checkpointed block's input, must not keep its gathered copy too).

    Sharing needs the very same tensor object. Modules with full backward hooks (and
    ``CommDebugMode``'s module tracker, which installs them) receive a fresh alias of their
    input on every call: their layers then reduce one by one, still exactly. A plan that
    declares the block's input with ``PrepareModuleInput`` shares the reduction in every case.
    """
    if torch.compiler.is_compiling() or value.is_inference():
        # a compiled graph keeps no Python state between calls; inference tensors have no
        # version counter to check
        return enter()
    grad = torch.is_grad_enabled() and value.requires_grad
    if grad and value.grad_fn is None:
        return enter()
    key = (dim, compat.version(value), grad)
    if dim is None:
        cached = value.__dict__.get(_ENTRY)
    else:
        cached = _last_gathered[0]
        if cached is not None and cached[3]() is not value:
            cached = None
    if cached is not None and cached[0] is mesh and cached[1] == key:
        entered = cached[2]
        if not grad or entered.grad_fn.next_functions[0][0] is value.grad_fn:
            return entered
    entered = enter()
    if dim is None:
        value.__dict__[_ENTRY] = (mesh, key, entered)
    else:
        _last_gathered[0] = (mesh, key, entered, weakref.ref(value))
    return entered


_ENTRY = "_torch_tp_region_entry"
# the latest gathered entry: (mesh, key, gathered tensor, weak reference to its input)
_last_gathered: list[tuple | None] = [None]


def _partial_local(value: DTensor) -> torch.Tensor:
    """The local tensor of a replicated DTensor, for a computation whose gradients are
    partial sums; several column-parallel layers reading the same DTensor (q, k and v) share
    it, so that their gradients add up locally and are reduced once."""
    if torch.compiler.is_compiling():
        # compiled graphs have no per-op overhead to save (and the cache is Python state)
        return value.to_local(grad_placements=(Partial(),))
    if not torch.is_grad_enabled():
        return compat.local_tensor(value)  # no graph to join
    if value.is_inference():
        return _LocalOfReplicated.apply(value)  # no version counter to check
    # never share a view made before an in-place change of the DTensor: its graph would miss
    # the change (the DTensor's own version counts it; its local tensor's does not)
    version = compat.version(value)
    cached = value.__dict__.get(_PARTIAL_LOCAL)
    if cached is not None and cached[1] == version:
        return cached[0]
    local = _LocalOfReplicated.apply(value)
    value.__dict__[_PARTIAL_LOCAL] = (local, version)
    return local


_PARTIAL_LOCAL = "_torch_tp_partial_local"


# The two ends of a replicated DTensor that only carries a block's input to its column-parallel
# layers (PrepareModuleInput's common case). They do what ``DTensor.from_local(...,
# grad_placements=(Partial(),))`` and ``to_local(grad_placements=(Partial(),))`` do, without
# DTensor's autograd and dispatch on the way back: the layers' local gradients add up as plain
# tensors, and one partial sum crosses back (measured on CPU: about 4 ms of a 12 ms step of
# the "tiny" benchmark model went to those two DTensor round trips).


# DTensor's C++ constructor, for the hot paths (one per parameter per step)
_dtensor = compat.dtensor_from_spec


def replicated_from_local(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``local`` (the same on every rank) as a replicated DTensor whose gradient the caller
    sums over the ranks: the backward hands back this rank's share of the gradient."""
    if torch.compiler.is_compiling():
        return DTensor.from_local(local, mesh, (Replicate(),), grad_placements=(Partial(),))
    value = _ReplicatedFromLocal.apply(local, mesh)
    if torch.is_grad_enabled() and not value.is_inference():
        # its partial local value (what a column-parallel reader computes with) is ``local``
        # itself: the readers' gradients then reach ``local`` directly, no DTensor between
        value.__dict__[_PARTIAL_LOCAL] = (local, compat.version(value))
    return value


class _ReplicatedFromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        ctx.mesh = mesh
        spec = _replicated_spec(mesh, local.shape, local.stride(), local.dtype)
        return _dtensor(local.view_as(local), spec, local.requires_grad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not isinstance(grad, DTensor):
            return grad, None
        if grad.placements != (Partial(),):
            # a whole gradient on every rank: rank 0 holds it, the others zeros, so that the
            # sum over ranks (the caller's reduction) is exact
            grad = grad.redistribute(placements=(Replicate(),))
            return _on_rank_zero(compat.local_tensor(grad), ctx.mesh), None
        return compat.local_tensor(grad), None


def _replicated_spec(
    mesh: DeviceMesh, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype
) -> DTensorSpec:
    # a model has a handful of activation shapes: build each spec once (specs are immutable),
    # remembered on the mesh object itself. Not by the mesh's value: meshes compare equal by
    # their ranks and names, and a spec of an earlier, equal mesh would carry that mesh's
    # process groups (destroyed, or another model's)
    cache = mesh.__dict__.setdefault(_REPLICATED_SPECS, {})
    key = (shape, stride, dtype)
    spec = cache.get(key)
    if spec is None:
        if len(cache) >= 256:
            cache.clear()
        spec = cache[key] = DTensorSpec(
            mesh, (Replicate(),), tensor_meta=TensorMeta(shape, stride, dtype)
        )
    return spec


_REPLICATED_SPECS = "_torch_tp_replicated_specs"


class _LocalOfReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: DTensor) -> torch.Tensor:
        spec = compat.dtensor_spec(value)
        ctx.partial = DTensorSpec(spec.mesh, (Partial(),), tensor_meta=spec.tensor_meta)
        local = compat.local_tensor(value)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        # each reader computed with the whole input: its input gradient is a partial sum
        spec = ctx.partial
        if grad.stride() != spec.tensor_meta.stride:
            meta = TensorMeta(grad.shape, grad.stride(), grad.dtype)
            spec = DTensorSpec(spec.mesh, (Partial(),), tensor_meta=meta)
        return _dtensor(grad, spec, False)


# ------------------------------------------------------------------------------------------
# Gradients of replicated parameters
#
# A replicated parameter used on shards (a norm on a sequence shard, the bias of a row-wise
# layer whose output is sharded) gets a *partial* gradient on each rank: each rank saw only
# its part of the tokens. DTensor labels it Partial; the full gradient is the sum over ranks.
# Reducing each one as it arrives costs a collective per parameter. The fast runtime keeps
# them Partial during backward and sums them at its end in one flat all-reduce per mesh:
# Megatron's coalesced all-reduce of sequence-parallel norm gradients, done automatically.
# ------------------------------------------------------------------------------------------


class PartialGradientReduction:
    """The end-of-backward reduction of the partial gradients of replicated parameters on one
    mesh.

    One per :class:`DeviceMesh`, made by the first fast runtime on it and kept on the mesh
    object itself (:meth:`of`), so that every module parallelized on that mesh, in one
    :func:`~torch_tp.parallelize_module` call or in many (one per block), shares one
    all-reduce per backward pass; it goes away with the mesh. The parameters it covers
    reference it from their hooks and autograd Functions. It holds parameters only between
    the first partial gradient of a backward pass and the reduction at the pass's end; a pass
    that raised never runs its reduction, and its pending gradients are summed at the end of
    the next pass, with that pass's own.
    """

    _ATTRIBUTE = "_torch_tp_partial_gradients"

    def __init__(self) -> None:
        self._pending: dict[int, nn.Parameter] = {}
        self._queued_for = -1  # the backward pass whose end runs the reduction

    @classmethod
    def of(cls, mesh: DeviceMesh) -> PartialGradientReduction:
        """The reduction of ``mesh`` (made on first use)."""
        found = mesh.__dict__.get(cls._ATTRIBUTE)
        if found is None:
            found = mesh.__dict__[cls._ATTRIBUTE] = cls()
        return found

    @property
    def pending(self) -> int:
        """How many parameters' gradients await the reduction."""
        return len(self._pending)

    def add(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """Defer ``param``'s gradient ``grad`` to the end of the backward pass if it is
        partial (a tensor hook: returns the gradient to accumulate)."""
        if not isinstance(grad, DTensor) or grad.placements != (Partial(),):
            return grad
        previous = param.grad
        if isinstance(previous, DTensor) and previous.placements == _REPLICATED:
            # accumulation onto a full gradient: express it as a partial sum (rank 0 holds it,
            # the others zeros — exact, unlike dividing by the mesh size) so that the new
            # partial adds locally and the single reduction at the end sums both
            mesh = previous.device_mesh
            local = _on_rank_zero(previous.to_local(), mesh)
            param.grad = DTensor.from_local(
                local, mesh, (Partial(),), shape=grad.shape, stride=grad.stride()
            )
        self._pending[id(param)] = param
        # one callback per backward pass
        task = compat.current_graph_task_id()
        if task != self._queued_for:
            self._queued_for = task
            compat.queue_callback(self._reduce)
        return grad

    def _reduce(self) -> None:
        params = [p for p in self._pending.values() if isinstance(p.grad, DTensor)]
        self._pending.clear()
        by_mesh: dict[DeviceMesh, list[nn.Parameter]] = {}
        for param in params:
            if param.grad.placements == (Partial(),):
                by_mesh.setdefault(param.grad.device_mesh, []).append(param)
        for mesh, group in by_mesh.items():
            locals_ = [p.grad.to_local() for p in group]
            flat = _regions.all_reduce(torch.cat([t.reshape(-1) for t in locals_]), mesh)
            sizes = [t.numel() for t in locals_]
            for param, piece in zip(group, flat.split(sizes), strict=True):
                grad = param.grad
                local = piece.view_as(compat.local_tensor(grad))
                param.grad = _dtensor(local, _respec(compat.dtensor_spec(grad), Replicate()), False)


class _LocalValue(torch.autograd.Function):
    """The local tensor of a DTensor parameter; its gradient is a DTensor with the parameter's
    own spec (known at forward time, instead of being rebuilt and checked in every backward).
    It relies on two DTensor internals, ``_local_tensor`` and ``_spec``, and on its
    constructor; the parity tests exercise it on every torch version we pin."""

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.spec = compat.dtensor_spec(param)
        local = compat.local_tensor(param)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        # the parameter's local shard is contiguous; so must its gradient be, to share its spec
        return _dtensor(grad.contiguous(), ctx.spec, False)


class _PartialLocal(torch.autograd.Function):
    """The local tensor of a replicated DTensor parameter read on a shard of the data: its
    gradient is labelled Partial and summed over the ranks at the end of backward."""

    @staticmethod
    def forward(ctx, param: DTensor, reduction: PartialGradientReduction) -> torch.Tensor:
        ctx.param, ctx.reduction = param, reduction
        local = compat.local_tensor(param)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        param = ctx.param
        partial = _dtensor(grad.contiguous(), _respec(compat.dtensor_spec(param), Partial()), False)
        return ctx.reduction.add(param, partial), None


def _respec(spec: DTensorSpec, placement: Placement) -> DTensorSpec:
    """``spec`` (a parameter's, on a 1-D mesh) with another placement; remembered on the
    spec itself (specs are immutable, and a parameter keeps its own across steps)."""
    cache = spec.__dict__.setdefault(_RESPEC, {})
    new = cache.get(placement)
    if new is None:
        new = cache[placement] = DTensorSpec(spec.mesh, (placement,), tensor_meta=spec.tensor_meta)
    return new


_RESPEC = "_torch_tp_respec"


# ------------------------------------------------------------------------------------------
# Agreeing on an error before a collective
# ------------------------------------------------------------------------------------------


def raise_agreed(error: Exception | None, groups: list[dist.ProcessGroup]) -> None:
    """Raise on every rank of ``groups``, which agreed that some rank found an error.

    A check that guards a collective is made on each rank from its own data; a rank that
    raised alone would leave the others waiting in the collective. So the callers agree
    first, folding each rank's verdict into a collective they make anyway or into one
    all-reduce of one number (over several groups in turn, the dimensions of a mesh, every
    rank of the mesh learns it), and call this only when some rank found an error. Every
    rank then raises the same exception, of the type the lowest such rank found, naming
    each such rank (its global rank) and its message. The messages are gathered over each
    group in turn (the error path only).
    """
    found: list[tuple[int, type, str]] = []
    if error is not None:
        found.append((dist.get_rank(), type(error), str(error)))
    for group in groups:
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, found, group=group)
        found = sorted({entry for part in parts for entry in part}, key=lambda e: e[0])
    kind = found[0][1]
    # one message when every rank found the same, else each rank's
    if len({text for _, _, text in found}) == 1:
        ranks = ", ".join(str(rank) for rank, _, _ in found)
        text = f"{found[0][2]} (on rank {ranks})"
    else:
        text = "; ".join(f"rank {rank}: {text}" for rank, _, text in found)
    try:
        agreed = kind(text)
    except TypeError:  # an exception type that takes other arguments
        agreed = RuntimeError(f"{kind.__name__}: {text}")
    raise agreed


def flag_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s collectives take a tensor: the current GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
