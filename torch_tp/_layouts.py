"""The few layout helpers every parallel style shares.

A value crosses a module boundary in one of two forms: a local :class:`torch.Tensor` whose
layout the plan declares (``Shard(-1)``, ``Replicate()``, ...), or a :class:`DTensor` that
carries its layout with it. These helpers convert between the two and move data between
layouts; they are the only place where styles touch DTensor's layout machinery, so that
``style.py`` reads as a list of contracts rather than as plumbing.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

__all__: list[str] = []  # private module


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
    if isinstance(layout, (Shard, _StridedShard)):
        dim = layout.dim
        if not -ndim <= dim < ndim:
            raise ShardDimError(
                f"{layout!r} does not fit the {ndim}-D tensor it lays out: a Shard dim must be "
                f"in [{-ndim}, {ndim})"
            )
        if dim < 0:
            if isinstance(layout, _StridedShard):
                return _StridedShard(dim + ndim, split_factor=layout.split_factor)
            return Shard(dim + ndim)
    return layout


def redistribute(value: DTensor, layout: Placement) -> DTensor:
    """Move ``value`` to ``layout``; free when it is already there."""
    layout = normalize(layout, value.ndim)
    if value.placements == (layout,):
        return value
    return value.redistribute(placements=(layout,), async_op=False)


def prepare(
    value: Any,
    mesh: DeviceMesh,
    layout: Placement | None,
    desired: Placement | None,
    use_local: bool,
) -> Any:
    """Annotate one input/output with ``layout``, move it to ``desired``, maybe unwrap.

    This is the single-value core of :class:`PrepareModuleInput` and
    :class:`PrepareModuleOutput`. ``None`` as ``layout`` means "leave this value alone";
    ``None`` as ``desired`` means "annotate only".
    """
    if layout is None:
        return value
    if not isinstance(value, DTensor):
        # checked here, where DTensor would either wrap the dim or fail in its internals
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
                local = _CopyToRegion.apply(value, mesh) if value.requires_grad else value
                return _replicated(local, mesh)
            if isinstance(layout, Shard):
                dim = normalize(layout, value.ndim).dim
                local = _GatherFromSequenceRegion.apply(value, mesh, dim)
                return _replicated(local, mesh)
    dt = annotate(value, mesh, layout)
    if desired is not None:
        dt = redistribute(dt, desired)
    return dt.to_local() if use_local else dt


# ------------------------------------------------------------------------------------------
# Regions (Megatron's names): each collective is an autograd Function whose backward is the
# conjugate collective. They move local tensors of a known layout; DTensor is not involved,
# so the hot path pays for no DTensor construction. CommDebugMode sees them (as c10d ops).
# ------------------------------------------------------------------------------------------


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
        return _all_reduce(grad, ctx.mesh), None


class _ReduceFromRegion(torch.autograd.Function):
    """Partial sums leaving a row-parallel computation, replicated: all-reduce, identity
    backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        # out of place: the partial sums may be saved elsewhere (selective activation
        # checkpointing keeps matmul outputs), and must stay partial there
        return _all_reduce(x, mesh)

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


def _size(mesh: DeviceMesh) -> int:
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


def _all_reduce(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    out = x.contiguous().clone()  # out of place: autograd may still need x
    dist.all_reduce(out, group=mesh.get_group())
    return out


def _all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    # c10d concatenates along dim 0: gather whole shards, then put the rank index just
    # before ``dim`` and merge the two. One copy at most, none when ``dim`` leads (or the
    # dims before it have size 1); the result is contiguous either way, once here rather
    # than in every consumer (q, k and v would each copy it, and each save its own copy)
    n, dim = _size(mesh), dim % x.ndim
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=mesh.get_group())
    whole = out.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1)
    return whole.contiguous()


def _reduce_scatter(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    # c10d scatters along dim 0: bring the ranks' chunks of ``dim`` to the front (one copy,
    # none when ``dim`` leads); this rank's chunk then comes out contiguous
    n, dim = _size(mesh), dim % x.ndim
    chunks = x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_single(out, chunks.flatten(0, 1), group=mesh.get_group())
    return out


def enter_replicated(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """Make the full input of a column-parallel computation, as a local tensor.

    Every rank computes with the whole input, so each rank's input gradient is only its own
    contribution: the backward sums them (all-reduce, or reduce-scatter when the input came
    in sharded).
    """
    if isinstance(value, DTensor):
        if value.placements != _REPLICATED:
            value = redistribute(value, Replicate())
        return _partial_local(value)
    if isinstance(layout, Replicate):
        if not value.requires_grad:
            return value  # nothing to gather now, no gradient to reduce later
        return _shared_entry(value, mesh, None, lambda: _CopyToRegion.apply(value, mesh))
    if isinstance(layout, Shard):
        dim = normalize(layout, value.ndim).dim
        return _shared_entry(
            value, mesh, dim, lambda: _GatherFromSequenceRegion.apply(value, mesh, dim)
        )
    return _partial_local(redistribute(annotate(value, mesh, layout), Replicate()))


_REPLICATED = (Replicate(),)


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
    key = (dim, value._version, grad)
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
        return value._local_tensor  # no graph to join
    if value.is_inference():
        return _LocalOfReplicated.apply(value)  # no version counter to check
    # never share a view made before an in-place change of the DTensor: its graph would miss
    # the change (the DTensor's own version counts it; its local tensor's does not)
    version = value._version
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


def _dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """``DTensor(local, spec, requires_grad=...)``, for the hot paths (one per parameter per
    step): DTensor's ``__init__`` only calls ``Tensor.__init__`` through a dynamo-disabling
    and an export-marking decorator, which cost as much as the construction itself; its
    ``__new__`` is the C++ constructor, called here directly when torch has it."""
    if _DTENSOR_NEW is None:
        return DTensor(local, spec, requires_grad=requires_grad)
    return _DTENSOR_NEW(DTensor, local, spec, requires_grad=requires_grad)


_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)


def _replicated(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``local`` (the same on every rank) as a replicated DTensor whose gradient the caller
    sums over the ranks: the backward hands back this rank's share of the gradient."""
    if torch.compiler.is_compiling():
        return DTensor.from_local(local, mesh, (Replicate(),), grad_placements=(Partial(),))
    value = _ReplicatedFromLocal.apply(local, mesh)
    if torch.is_grad_enabled() and not value.is_inference():
        # its partial local value (what a column-parallel reader computes with) is ``local``
        # itself: the readers' gradients then reach ``local`` directly, no DTensor between
        value.__dict__[_PARTIAL_LOCAL] = (local, value._version)
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
            return _on_rank_zero(grad._local_tensor, ctx.mesh), None
        return grad._local_tensor, None


@functools.lru_cache(maxsize=256)
def _replicated_spec(
    mesh: DeviceMesh, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype
) -> DTensorSpec:
    # a model has a handful of activation shapes: build each spec once (specs are immutable)
    return DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(shape, stride, dtype))


class _LocalOfReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: DTensor) -> torch.Tensor:
        spec = value._spec
        ctx.partial = DTensorSpec(spec.mesh, (Partial(),), tensor_meta=spec.tensor_meta)
        local = value._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        # each reader computed with the whole input: its input gradient is a partial sum
        spec = ctx.partial
        if grad.stride() != spec.tensor_meta.stride:
            meta = TensorMeta(grad.shape, grad.stride(), grad.dtype)
            spec = DTensorSpec(spec.mesh, (Partial(),), tensor_meta=meta)
        return _dtensor(grad, spec, False)


def enter_sharded(value: torch.Tensor, mesh: DeviceMesh, layout: Placement, want: Shard):
    """Make the local shard (on ``want``) of a row-parallel computation's input."""
    if not isinstance(value, DTensor):
        if layout == want:
            return value  # already the local shard; its gradient is the local shard too
        value = annotate(value, mesh, layout)
    return redistribute(value, want).to_local()


def reduce_partial(
    partial: torch.Tensor, mesh: DeviceMesh, layout: Placement, use_local: bool
) -> torch.Tensor:
    """Sum the partial results of a row-parallel computation into ``layout``."""
    if use_local and isinstance(layout, Replicate):
        return _ReduceFromRegion.apply(partial, mesh)
    if use_local and isinstance(layout, Shard):
        return _ReduceScatterToSequenceRegion.apply(partial, mesh, layout.dim)
    # a partial sum has the global shape on every rank
    dt = DTensor.from_local(
        partial, mesh, (Partial(),), shape=partial.shape, stride=partial.stride()
    )
    dt = redistribute(dt, layout)
    return dt.to_local() if use_local else dt


def leave(
    local: torch.Tensor,
    mesh: DeviceMesh,
    computed: Placement,
    layout: Placement,
    use_local: bool,
    global_shape: torch.Size,
) -> torch.Tensor:
    """Turn a locally computed result with layout ``computed`` into the module's output.

    ``global_shape`` is passed explicitly because shards need not be even (a vocabulary of
    1001 over two ranks), which DTensor cannot infer from one rank's local shape.
    """
    if computed == layout and use_local:
        return local  # the common case pays for no DTensor at all
    if (
        use_local
        and isinstance(computed, Shard)
        and isinstance(layout, Replicate)
        and global_shape[computed.dim] % mesh.size() == 0
    ):
        return _GatherFromRegion.apply(local, mesh, computed.dim)
    dt = DTensor.from_local(
        local,
        mesh,
        (computed,),
        run_check=False,
        shape=global_shape,
        stride=contiguous_stride(global_shape),
    )
    dt = redistribute(dt, layout)
    return dt.to_local() if use_local else dt


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


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


# ------------------------------------------------------------------------------------------
# Gradients of replicated parameters
#
# A replicated parameter used on shards (a norm on a sequence shard, the bias of a row-wise
# layer whose output is sharded) gets a *partial* gradient on each rank: each rank saw only
# its part of the tokens. DTensor labels it Partial; the full gradient is the sum over ranks.
# Reducing each one as it arrives costs a collective per parameter. Instead the gradients
# stay Partial during backward and are summed at its end in one flat all-reduce per mesh:
# Megatron's coalesced all-reduce of sequence-parallel norm gradients, done automatically.
# ------------------------------------------------------------------------------------------

_pending: dict[int, nn.Parameter] = {}  # params whose partial gradient awaits the reduction


def sum_partial_gradient_at_end_of_backward(param: nn.Parameter) -> None:
    """Make ``param``'s partial gradients full (Replicate) at the end of every backward.

    The gradient still arrives on ``param.grad`` as on one device, and accumulates across
    backward passes (micro-batches) without extra communication. This hook covers the
    parameter wherever it is used; it is lost when ``module.to()`` or ``to_empty()`` swaps the
    parameter's contents, which is why the styles' own local paths use
    :func:`local_parameter` instead, which needs no hook.
    """
    # a strong reference (a weak one would make the parameter unswappable by module.to())
    param.register_hook(functools.partial(_on_partial_gradient, param))


def local_parameter(module: nn.Module, name: str, *, partial: bool = False) -> torch.Tensor | None:
    """The local value of ``module``'s DTensor parameter ``name``, for its own computation.

    ``param.to_local()``, with the same value and the same gradient (a DTensor laid out like
    the parameter), for the hot path: every Linear, every step. With ``partial`` the
    parameter is replicated and the computation sees only this rank's share of the data:
    each rank's gradient is then a partial sum, summed over the ranks at the end of
    backward, with every other such gradient, in one all-reduce.

    The gradient's spec is the parameter's own, known at forward time, instead of being
    rebuilt and checked in every backward: a third of ``to_local()``'s cost (80 against
    230 us for a forward and backward on CPU). Without grad it is the local tensor itself.

    (A view kept across steps would save the autograd Function too, but not correctly: its
    node would keep the sequence number of the step that made it, so the engine would run it
    after every node of later steps, and FSDP2's post-backward would find no gradient.)
    """
    params = module._parameters
    # not registered under its name when parametrized: then the computed tensor
    param = params[name] if name in params else getattr(module, name)
    if not isinstance(param, DTensor):
        return param
    if torch.compiler.is_compiling():
        # compiled graphs have no per-op cost to save (and a compiled backward cannot
        # schedule the reduction of a partial gradient: the parameter's hook does it)
        return param.to_local(grad_placements=(Partial(),) if partial else None)
    local = param._local_tensor
    if not (param.requires_grad and torch.is_grad_enabled()):
        return local  # nothing flows back
    return (_PartialLocal if partial else _LocalValue).apply(param)


class _LocalValue(torch.autograd.Function):
    """The local tensor of a DTensor parameter; its gradient is a DTensor with the parameter's
    own spec (known at forward time, instead of being rebuilt and checked in every backward).
    It relies on two DTensor internals, ``_local_tensor`` and ``_spec``, and on its
    constructor; the parity tests exercise it on every torch version we pin."""

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.spec = param._spec
        local = param._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        # the parameter's local shard is contiguous; so must its gradient be, to share its spec
        return _dtensor(grad.contiguous(), ctx.spec, False)


class _PartialLocal(torch.autograd.Function):
    """The local tensor of a replicated DTensor parameter read on a shard of the data: its
    gradient is labelled Partial and summed over the ranks at the end of backward."""

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.param = param
        local = param._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        param = ctx.param
        partial = _dtensor(grad.contiguous(), _respec(param._spec, Partial()), False)
        return _on_partial_gradient(param, partial)


def _respec(spec: DTensorSpec, placement: Placement) -> DTensorSpec:
    """``spec`` (a parameter's, on a 1-D mesh) with another placement; remembered on the
    spec itself (specs are immutable, and a parameter keeps its own across steps)."""
    cache = spec.__dict__.setdefault(_RESPEC, {})
    new = cache.get(placement)
    if new is None:
        new = cache[placement] = DTensorSpec(spec.mesh, (placement,), tensor_meta=spec.tensor_meta)
    return new


_RESPEC = "_torch_tp_respec"


def _on_partial_gradient(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    if not isinstance(grad, DTensor) or grad.placements != (Partial(),):
        return grad
    previous = param.grad
    if isinstance(previous, DTensor) and previous.placements == (Replicate(),):
        # accumulation onto a full gradient: express it as a partial sum (rank 0 holds it,
        # the others zeros — exact, unlike dividing by the mesh size) so that the new partial
        # adds locally and the single reduction at the end sums both
        mesh = previous.device_mesh
        local = _on_rank_zero(previous.to_local(), mesh)
        param.grad = DTensor.from_local(
            local, mesh, (Partial(),), shape=grad.shape, stride=grad.stride()
        )
    _pending[id(param)] = param
    # one callback per backward pass (a pass that raised never ran its callbacks; the next
    # one has another id)
    task = torch._C._current_graph_task_id()
    if task != _queued_for[0]:
        _queued_for[0] = task
        Variable._execution_engine.queue_callback(_reduce_pending)
    return grad


_queued_for = [-1]  # the backward pass whose end reduces the pending gradients


def _reduce_pending() -> None:
    if not _pending:
        return
    params = [p for p in _pending.values() if isinstance(p.grad, DTensor)]
    _pending.clear()
    by_mesh: dict[DeviceMesh, list[nn.Parameter]] = {}
    for param in params:
        if param.grad.placements == (Partial(),):
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    for mesh, group in by_mesh.items():
        locals_ = [p.grad.to_local() for p in group]
        flat = _all_reduce(torch.cat([t.reshape(-1) for t in locals_]), mesh)
        for param, piece in zip(group, flat.split([t.numel() for t in locals_]), strict=True):
            grad = param.grad
            local = piece.view_as(grad._local_tensor)
            param.grad = _dtensor(local, _respec(grad._spec, Replicate()), False)
