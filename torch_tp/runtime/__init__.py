"""The runtime a style computes with: the style kit, the built-in styles' and a user style's
alike (``docs/guide.md``, "The style kit").

A value crosses a module boundary in one of two forms: a local :class:`torch.Tensor` whose
layout the plan declares (``Shard(-1)``, ``Replicate()``, ...), or a :class:`DTensor` that
carries its layout with it. A *runtime* converts between the two and moves data between
layouts for the styles; it is the only place where styles touch DTensor's layout machinery,
so that the styles (:mod:`torch_tp.style`) read as a list of contracts rather than as
plumbing. There are two, with the same methods and the same results, both in
:mod:`torch_tp.runtime.boundaries` with the regions beneath the fast one:

* :class:`DTensorRuntime` (``TORCH_TP_RUNTIME=dtensor``): every layout change is plain
  DTensor (``DTensor.from_local``, ``to_local``, ``redistribute``), with no cache, no region
  Function and no deferred reduction. It is the reference: a result that differs between the
  two runtimes is a bug of the fast one.
* :class:`FastRuntime` (``TORCH_TP_RUNTIME=fast``, the default): the common boundaries of a
  tensor-parallel block go through Megatron's regions, column-parallel layers reading one
  tensor share one entry into the region, the partial gradients of replicated parameters
  are summed in one all-reduce at the end of backward, and the hot paths build DTensors
  with DTensor's C++ constructor. Everything else falls back to :class:`DTensorRuntime`.

:func:`torch_tp.parallelize_module` reads ``TORCH_TP_RUNTIME`` once per call; every style it
applies binds the runtime of that mode (:func:`for_mesh`) into the module, so a model keeps the
runtime it was parallelized with. Beside the runtimes, this module holds what styles need
around them: the rows a rank holds (:func:`shard_range`), a gradient counted once
(:func:`gradient_on_rank_zero`), and an error raised on every rank alike (:func:`raise_agreed`).

Caches (the fast runtime's; the DTensor runtime has none):

* ``_torch_tp_region_entry``, on a plain tensor (its ``__dict__``): the alias of it that
  entered a column-parallel region
  (:func:`~torch_tp.runtime.boundaries.copy_to_tensor_parallel_region`), keyed by the mesh,
  the tensor's ``_version``, grad mode and, under grad mode, the tensor's ``grad_fn``. An
  in-place change of the tensor, another mesh, grad mode or a new graph (the next step)
  invalidate it.
* ``_last_gathered`` (in :mod:`~torch_tp.runtime.boundaries`): the latest all-gathered
  sequence-sharded input, with a weak reference to the shard it came from, keyed likewise.
  The next gather replaces it, so that no gathered activation outlives the next one (it
  keeps its autograd graph, and with it the parameters of the model that made it, until
  then).
* ``_torch_tp_partial_local``, on a replicated DTensor: its local view that column-parallel
  readers share (their input gradients add up locally and cross back once), keyed by the
  DTensor's ``_version``; an in-place change invalidates it.
* ``_torch_tp_respec``, on a parameter's ``DTensorSpec``: the same spec with another placement.
  Specs are immutable; the entry lives as long as the spec.
* ``_torch_tp_replicated_specs``, on a :class:`DeviceMesh` (:func:`_replicated_spec`): the
  replicated spec of an activation on that mesh object, by shape, stride and dtype (at most
  256). Immutable; not by the mesh's value, which an earlier mesh with other process groups
  may share.
* ``boundaries._SIZES``: the size of each mesh, by ``id(mesh)``; dropped with the mesh.
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
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torch_tp.runtime.boundaries import (
    _RUNTIMES,
    DTensorRuntime,
    FastRuntime,
    ShardDimError,
    gradient_on_rank_zero,
    mesh_size,
    normalize,
    replicated_from_local,
)

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
    "mesh_size",
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
# Shards, gradients counted once, errors agreed
# ------------------------------------------------------------------------------------------


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
