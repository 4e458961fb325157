"""Regions: the collectives of tensor parallelism, each an autograd Function whose backward is
the conjugate collective, named as in Megatron-LM (``tensor_parallel/mappings.py``).

They move plain tensors whose layout the caller knows; DTensor is not involved, so the hot
path pays for no DTensor construction or dispatch. Over a mesh of one rank they send nothing
(as DTensor's redistributions skip a mesh dimension of size 1). ``CommDebugMode`` sees them
(as ``c10d`` ops). The mesh is 1-D.

==============================================  =====================  =====================
region                                          forward                backward
==============================================  =====================  =====================
``copy_to_tensor_parallel_region``              identity               all-reduce
``copy_many_to_tensor_parallel_region``         identities             one all-reduce
``reduce_from_tensor_parallel_region``          all-reduce             identity
``gather_from_tensor_parallel_region``          all-gather on dim      this rank's slice
``gather_from_sequence_parallel_region``        all-gather on dim      reduce-scatter on dim
``reduce_scatter_to_sequence_parallel_region``  reduce-scatter on dim  all-gather on dim
``all_to_all_expert_parallel_region``           all-to-all, uneven     the reverse all-to-all
==============================================  =====================  =====================

They are the fast path of :mod:`torch_tp.runtime` (``TORCH_TP_RUNTIME=fast``, the
default); ``TORCH_TP_RUNTIME=dtensor`` uses none of them, except the all-to-all: expert
parallelism sends each rank a data-dependent number of rows, which no DTensor placement
describes, so both runtimes dispatch tokens to their experts through it.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "all_reduce",
    "all_to_all_expert_parallel_region",
    "copy_many_to_tensor_parallel_region",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]


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


def all_to_all_expert_parallel_region(
    x: torch.Tensor, mesh: DeviceMesh, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Rows of ``x`` (``input_splits[r]`` of them, in order, for rank ``r``) sent to their
    ranks; this rank receives ``output_splits[r]`` rows from rank ``r``, stacked in rank
    order. The backward sends the rows' gradients back the same way reversed."""
    return _AllToAllRegion.apply(x, mesh, output_splits, input_splits)


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


class _AllToAllRegion(torch.autograd.Function):
    """Rows to the ranks that compute with them (tokens to their experts), uneven counts;
    the backward is the reverse all-to-all of their gradients."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, mesh: DeviceMesh, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        ctx.mesh, ctx.output_splits, ctx.input_splits = mesh, output_splits, input_splits
        return all_to_all(x, mesh, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = all_to_all(grad, ctx.mesh, ctx.input_splits, ctx.output_splits)
        return back, None, None, None


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


def all_to_all(
    x: torch.Tensor, mesh: DeviceMesh, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    x = x.contiguous()
    if mesh_size(mesh) == 1:
        return x
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=mesh.get_group())
    return out
