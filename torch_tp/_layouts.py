"""The few layout helpers every parallel style shares.

A value crosses a module boundary in one of two forms: a local :class:`torch.Tensor` whose
layout the plan declares (``Shard(-1)``, ``Replicate()``, ...), or a :class:`DTensor` that
carries its layout with it. These helpers convert between the two and move data between
layouts; they are the only place where styles touch DTensor's layout machinery, so that
``style.py`` reads as a list of contracts rather than as plumbing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

__all__: list[str] = []  # private module


def annotate(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """View a local tensor as a DTensor with ``layout`` (no communication).

    A DTensor passes through unchanged: it already knows its layout.
    """
    if isinstance(value, DTensor):
        return value
    return DTensor.from_local(value, mesh, (layout,), run_check=False)


def normalize(layout: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` and ``Shard(ndim - 1)`` are the same layout; make them compare equal."""
    if isinstance(layout, Shard) and layout.dim < 0:
        return Shard(layout.dim + ndim)
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
    dt = annotate(value, mesh, layout)
    if desired is not None:
        dt = redistribute(dt, desired)
    return dt.to_local() if use_local else dt


def enter_replicated(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """Make the full input of a column-parallel computation, as a local tensor.

    Every rank computes with the whole input, so each rank's input gradient is only its own
    contribution: the backward sums them (all-reduce, or reduce-scatter when the input came
    in sharded). Megatron calls the forward half "copy to tensor-parallel region".
    """
    if not isinstance(value, DTensor):
        if layout == Replicate() and not value.requires_grad:
            return value  # nothing to gather now, no gradient to reduce later
        value = annotate(value, mesh, layout)
    return redistribute(value, Replicate()).to_local(grad_placements=(Partial(),))


def enter_sharded(value: torch.Tensor, mesh: DeviceMesh, layout: Placement, want: Shard):
    """Make the local shard (on ``want``) of a row-parallel computation's input."""
    if not isinstance(value, DTensor):
        if layout == want:
            return value  # already the local shard; its gradient is the local shard too
        value = annotate(value, mesh, layout)
    return redistribute(value, want).to_local()


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
    dt = DTensor.from_local(
        local, mesh, (computed,), run_check=False, shape=global_shape, stride=_stride(global_shape)
    )
    dt = redistribute(dt, layout)
    return dt.to_local() if use_local else dt


def shard_range(size: int, mesh: DeviceMesh) -> tuple[int, int]:
    """The ``[start, stop)`` of this rank's rows when ``size`` rows are ``Shard``-ed.

    DTensor follows :func:`torch.chunk`: every shard has ``ceil(size / n)`` rows except the
    tail ones, which may be shorter or empty.
    """
    n = mesh.size()
    rank = mesh.get_local_rank()
    chunk = math.ceil(size / n)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def _stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= dim
    return tuple(reversed(stride))
