"""A value crossing a module's boundary: the two runtimes :mod:`torch_tp.runtime` describes
and the regions beneath the fast one, forward and backward side by side. A style's forward
calls its runtime; following it from ``rt.enter``/``rt.exit`` down to a collective stays here.

==============================================  =====================  =====================
region                                          forward                backward
==============================================  =====================  =====================
``copy_to_tensor_parallel_region``              identity               all-reduce
``copy_many_to_tensor_parallel_region``         identities             one all-reduce
``reduce_from_tensor_parallel_region``          all-reduce             identity
``gather_from_tensor_parallel_region``          all-gather on dim      this rank's slice
``gather_from_sequence_parallel_region``        all-gather on dim      reduce-scatter on dim
``reduce_scatter_to_sequence_parallel_region``  reduce-scatter on dim  all-gather on dim
==============================================  =====================  =====================

The regions move plain tensors whose layout the caller knows: the hot path pays for no
DTensor construction or dispatch. Over a mesh of one rank they send nothing (as DTensor's
redistributions skip a mesh dimension of size 1); ``CommDebugMode`` sees them (as ``c10d``
ops). The mesh is 1-D. ``TORCH_TP_RUNTIME=dtensor`` uses none of them. The fast runtime's
caches are listed in :mod:`torch_tp.runtime`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torch_tp import _torch_compat as compat
from torch_tp._torch_compat import DTensorSpec, StridedShard, TensorMeta
from torch_tp.contract import Layout

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
# The regions: the fast runtime's collectives, each an autograd Function whose backward is
# the conjugate collective, named as in Megatron-LM (tensor_parallel/mappings.py)
# ------------------------------------------------------------------------------------------


def copy_to_tensor_parallel_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The replicated input of a column-parallel computation: every rank computes with all of
    it, so its gradient is summed over the ranks."""
    return _CopyToRegion.apply(x, mesh)


def copy_many_to_tensor_parallel_region(
    tensors: tuple[torch.Tensor, ...], mesh: DeviceMesh
) -> tuple[torch.Tensor, ...]:
    """:func:`copy_to_tensor_parallel_region` for several inputs of one computation (an
    experts layer's tokens and routing weights): their gradients are summed over the ranks in
    one all-reduce of a flat buffer."""
    return _CopyManyToRegion.apply(mesh, *tensors)


def reduce_from_tensor_parallel_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The partial sums leaving a row-parallel computation, summed: a replicated result."""
    return _ReduceFromRegion.apply(x, mesh)


def gather_from_tensor_parallel_region(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Even shards on ``dim`` leaving a computation, gathered into the replicated whole."""
    return _GatherFromRegion.apply(x, mesh, dim)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, mesh: DeviceMesh, dim: int
) -> torch.Tensor:
    """Even shards on ``dim`` (a sequence shard) entering a computation that needs them whole;
    each rank's gradient of the whole is a partial sum, reduce-scattered back."""
    return _GatherFromSequenceRegion.apply(x, mesh, dim)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, mesh: DeviceMesh, dim: int
) -> torch.Tensor:
    """The partial sums leaving a row-parallel computation, summed and sharded on ``dim``."""
    return _ReduceScatterToSequenceRegion.apply(x, mesh, dim)


class _CopyToRegion(torch.autograd.Function):
    """Replicated input of a column-parallel computation: identity, all-reduce backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        # an alias that holds no reference to x (a view would, through its _base): the
        # shared entry lives on x, and must not keep it alive
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.mesh), None


class _CopyManyToRegion(torch.autograd.Function):
    """Replicated inputs of one computation: identities, one coalesced all-reduce backward."""

    @staticmethod
    def forward(ctx, mesh: DeviceMesh, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mesh = mesh
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        present = [g for g in grads if g is not None]
        if not present:
            return None, *grads
        flat = all_reduce(torch.cat([g.reshape(-1) for g in present]), ctx.mesh)
        pieces = iter(flat.split([g.numel() for g in present]))
        summed = tuple(None if g is None else next(pieces).view_as(g) for g in grads)
        return None, *summed


class _ReduceFromRegion(torch.autograd.Function):
    """Partial sums leaving a row-parallel computation, replicated: all-reduce, identity
    backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        # out of place: the partial sums may be saved elsewhere (selective activation
        # checkpointing keeps matmul outputs), and must stay partial there
        return all_reduce(x, mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """Shards on ``dim`` leaving a computation, replicated: all-gather, and the backward
    keeps this rank's slice (the gradient of a replicated value is the same everywhere)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim
        return _all_gather(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the forward's shards are even; narrow, not chunk()[rank]: the rank may be symbolic
        size = grad.shape[ctx.dim] // ctx.mesh.size()
        piece = grad.narrow(ctx.dim, ctx.mesh.get_local_rank() * size, size)
        return piece.contiguous(), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Shards on ``dim`` entering a computation that needs them whole: all-gather,
    reduce-scatter backward (each rank's gradient of the whole is a partial sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim
        return _all_gather(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.mesh, ctx.dim), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Partial sums leaving a row-parallel computation, sharded on ``dim``: reduce-scatter,
    all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim
        return _reduce_scatter(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.mesh, ctx.dim), None, None


# The collectives are c10d's, called directly: on this path they cost about half of what the
# functional collectives' dispatch and wait machinery adds on top of them (measured on
# CPU/gloo: 0.7 ms against 1.2 ms for a small all-reduce). torch.compile traces them as
# functional collectives all the same.


def mesh_size(mesh: DeviceMesh) -> int:
    """``mesh.size()`` of a 1-D mesh, computed once per mesh (torch recomputes it from the
    mesh's layout on every call, some microseconds on every collective). Only the size is
    kept: a process group held here would outlive ``destroy_process_group`` and be torn down
    at interpreter exit, which can abort the process."""
    if torch.compiler.is_compiling():
        return mesh.size()  # traced once anyway; no Python state
    key = id(mesh)
    entry = _SIZES.get(key)
    if entry is None or entry[0]() is not mesh:
        forget = functools.partial(_SIZES.pop, key, None)
        entry = _SIZES[key] = (weakref.ref(mesh, lambda _: forget()), mesh.size())
    return entry[1]


# id(mesh) -> (weak reference to the mesh, its size); an entry goes with its mesh
_SIZES: dict[int, tuple[weakref.ref, int]] = {}


def all_reduce(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``mesh``, out of place (no autograd)."""
    out = x.contiguous().clone()  # out of place: autograd may still need x
    if mesh_size(mesh) > 1:  # over one rank: nothing to send (as DTensor skips it too)
        dist.all_reduce(out, group=mesh.get_group())
    return out


def _all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    # c10d concatenates along dim 0: gather whole shards, then put the rank index just
    # before ``dim`` and merge the two. One copy at most, none when ``dim`` leads (or the
    # dims before it have size 1); the result is contiguous either way, once here rather
    # than in every consumer (q, k and v would each copy it, and each save its own copy)
    n, dim = mesh_size(mesh), dim % x.ndim
    x = x.contiguous()
    if n == 1:
        return x
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=mesh.get_group())
    whole = out.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1)
    return whole.contiguous()


def _reduce_scatter(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    # c10d scatters along dim 0: bring the ranks' chunks of ``dim`` to the front (one copy,
    # none when ``dim`` leads); this rank's chunk then comes out contiguous
    n, dim = mesh_size(mesh), dim % x.ndim
    if n == 1:
        return x.contiguous()
    chunks = x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_single(out, chunks.flatten(0, 1), group=mesh.get_group())
    return out


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
        """The local tensor a computation reads for one input, as the style's contract
        states it (``layout``, a :class:`~torch_tp.contract.Layout`): whole for
        ``to=Replicate(), grad=Partial()`` (:meth:`enter_replicated`), else this rank's
        shard (:meth:`enter_sharded`). ``given`` is the layout of a plain-tensor ``value``.

        Raises:
            ValueError: ``layout`` is neither (a whole input whose gradient is not partial).
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
        """A local result as the module's output, as the style's contract states it
        (``layout``): partial sums (``given=Partial()``) reduced into ``to``
        (:meth:`reduce_partial`), else moved from ``given`` to ``to`` (:meth:`leave`); a
        plain tensor if ``layout.local``. ``global_shape``: the output's shape on one device.

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
                    copy_to_tensor_parallel_region(value, mesh) if value.requires_grad else value
                )
                return replicated_from_local(local, mesh)
            if isinstance(layout, Shard):
                dim = normalize(layout, value.ndim).dim
                local = gather_from_sequence_parallel_region(value, mesh, dim)
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
                value, mesh, None, lambda: copy_to_tensor_parallel_region(value, mesh)
            )
        if isinstance(layout, Shard):
            dim = normalize(layout, value.ndim).dim
            return _shared_entry(
                value,
                mesh,
                dim,
                lambda: gather_from_sequence_parallel_region(value, mesh, dim),
            )
        return _partial_local(self.redistribute(self.annotate(value, layout), Replicate()))

    def enter_replicated_many(self, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if any(isinstance(v, DTensor) for v in values) or not any(v.requires_grad for v in values):
            return super().enter_replicated_many(values)
        # their input gradients are summed in one all-reduce
        return copy_many_to_tensor_parallel_region(values, self.mesh)

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
            return reduce_from_tensor_parallel_region(partial, self.mesh)
        if use_local and isinstance(layout, Shard):
            return reduce_scatter_to_sequence_parallel_region(partial, self.mesh, layout.dim)
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
            return gather_from_tensor_parallel_region(local, self.mesh, computed.dim)
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
            flat = all_reduce(torch.cat([t.reshape(-1) for t in locals_]), mesh)
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
