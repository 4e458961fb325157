"""Gradient clipping for models whose parameters live on several meshes.

A tensor-parallel model mixes kinds of parameters: DTensors on the TP mesh and plain tensors
(a norm that no style touched). Under FSDP2 on a 2-D mesh, the TP parameters become DTensors
on the ``(dp, tp)`` mesh and the others DTensors on the ``dp`` mesh.
:func:`torch.nn.utils.clip_grad_norm_` stacks the per-tensor norms into one tensor, which
DTensor refuses for such a mix ("got mixed torch.Tensor and DTensor", "must have the same
mesh"). Here each group of gradients that shares a mesh gets its own partial norm (this
rank's shards), and the partial norms are made whole with one all-reduce per process group
that any of them is partial over: on a ``(dp, tp)`` mesh, one over ``dp`` (for both groups)
and one over ``tp``. Asking DTensor for each group's full norm instead would reduce the 2-D
group's norm over ``dp`` and then over ``tp`` (and warn that two sequential all-reduces are
suboptimal), and the ``dp`` group's once more: three collectives instead of two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from torch_tp import _torch_compat as compat

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> Tensor:
    """Clip the gradient norm of parameters that may be DTensors on different meshes.

    The arguments and the result are those of :func:`torch.nn.utils.clip_grad_norm_`: the
    norm is taken over all gradients as if they were one vector, and when it exceeds
    ``max_norm`` every gradient is scaled in place by ``max_norm / (norm + 1e-6)``. Unlike
    it, the parameters may mix plain tensors and DTensors on several meshes (a TP model, or
    FSDP2 on a ``(dp, tp)`` mesh with parameters no style sharded). Gradients are grouped by
    mesh and by the mesh dimensions that shard them; each group's norm is computed over this
    rank's shards (local tensors), and all groups' are made whole together (one small
    all-reduce per process group some of them is partial over: two on a ``(dp, tp)`` mesh);
    plain tensors count once, as replicated values (the same on every rank, as a TP model's
    unsharded parameters are). Call it on every rank.

    Args:
        parameters (Iterable[Tensor] or Tensor): the parameters whose ``.grad`` to clip.
        max_norm (float): the largest norm allowed.
        norm_type (float, optional): the p of the p-norm; ``inf`` for the max norm.
            Default: 2.0.
        error_if_nonfinite (bool, optional): raise if the total norm is ``nan`` or ``inf``.
            Default: ``False``.
        foreach (bool, optional): use the foreach kernels (``None``: where supported).
            Default: ``None``.

    Keyword Args:
        pp_mesh (DeviceMesh, optional): the 1-D pipeline-parallel mesh, when ``parameters``
            are this rank's pipeline stages' (:mod:`torch_tp.pipeline`): the norm is then
            taken over every stage's gradients (one more small all-reduce). Default:
            ``None``.

    Returns:
        The total norm of the gradients before clipping, a plain (not DTensor) scalar
        tensor with the same value on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the total norm is not finite.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> loss.backward()
        >>> norm = torch_tp.clip_grad_norm_(model.parameters(), max_norm=1.0)
        >>> optimizer.step()
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)

    # Each gradient's local values (this rank's shard), grouped by mesh and by the mesh
    # dimensions that shard it: a group's norm is partial over those dimensions' process
    # groups. Every rank sees the parameters in the same order, so the groups (and their
    # collectives) come in the same order too.
    groups: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[Tensor]] = {}
    for grad in grads:
        key: tuple[DeviceMesh | None, tuple[int, ...]] = (None, ())
        if isinstance(grad, DTensor):
            placements = grad.placements
            if any(placement.is_partial() for placement in placements):  # not yet reduced
                placements = [Replicate() if p.is_partial() else p for p in placements]
                grad = grad.redistribute(grad.device_mesh, placements)
            # a Shard, or a _StridedShard (FSDP2 over TP), which is no Shard subclass
            sharded = tuple(dim for dim, p in enumerate(placements) if not p.is_replicate())
            key = (grad.device_mesh, sharded)
            grad = grad.to_local()
        groups.setdefault(key, []).append(grad)
    device = grads[0].device
    norms, partial_over = [], []
    for (mesh, dims), group in groups.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type, False, foreach)
        norms.append(norm.to(device))
        partial_over.append([mesh.get_group(dim) for dim in dims] if mesh is not None else [])
    total_norm = _total_norm(torch.stack(norms), partial_over, norm_type, pp_mesh)

    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    # scaling every shard by the same number scales the whole gradient: locals suffice
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad  # no_grad: no copy
        by_device.setdefault(local.device, []).append(local)
    for dev, locals_ in by_device.items():
        coef = clip_coef.to(dev)
        if foreach is False:
            for local in locals_:
                local.mul_(coef)
        else:
            compat.foreach_mul_(locals_, coef)
    return total_norm


def _total_norm(
    norms: Tensor,
    partial_over: list[list[dist.ProcessGroup]],
    norm_type: float,
    pp_mesh: DeviceMesh | None,
) -> Tensor:
    """The norm of all gradients from each group's partial norm ``norms[i]``.

    ``norms[i]`` is partial over the process groups ``partial_over[i]``. A p-norm is made
    whole as DTensor makes it (``x ** p``, summed, ``** (1 / p)``), the max norm with a max;
    every group's entry partial over the same process group goes in the same all-reduce.
    """
    if pp_mesh is not None and pp_mesh.ndim != 1:
        raise ValueError(f"pp_mesh must be a 1-D mesh, found dims {pp_mesh.mesh_dim_names}")
    powered = math.isfinite(norm_type) and norm_type != 0
    if powered:
        op = dist.ReduceOp.SUM
        norms = norms.pow(norm_type)
    elif norm_type == 0:
        op = dist.ReduceOp.SUM  # 0-"norms" count nonzero values: counts add up
    else:
        op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
    # one all-reduce per process group, in the order of first use (the same on every rank
    # of that group: its ranks hold the same kinds of parameters, in the same order)
    entries: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
    for index, process_groups in enumerate(partial_over):
        for group in process_groups:
            entries.setdefault(group.group_name, (group, []))[1].append(index)
    for group, indices in entries.values():
        index = torch.tensor(indices, device=norms.device)
        part = norms.index_select(0, index)
        dist.all_reduce(part, op=op, group=group)
        norms = norms.index_copy(0, index, part)
    if powered:
        total = norms.sum()
    else:
        total = torch.linalg.vector_norm(norms, norm_type)
    if pp_mesh is not None:  # every stage's gradients
        total = total.clone()
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
    return total.pow(1.0 / norm_type) if powered else total
