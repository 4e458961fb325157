"""Gradient clipping for models whose parameters live on several meshes.

A tensor-parallel model mixes kinds of parameters: DTensors on the TP mesh and plain tensors
(a norm that no style touched). Under FSDP2 on a 2-D mesh, the TP parameters become DTensors
on the ``(dp, tp)`` mesh and the others DTensors on the ``dp`` mesh.
:func:`torch.nn.utils.clip_grad_norm_` stacks the per-tensor norms into one tensor, which
DTensor refuses for such a mix ("got mixed torch.Tensor and DTensor", "must have the same
mesh"). Here each group of gradients that shares a mesh gets its own norm, made whole over
its mesh, and the groups' norms are combined as plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

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
    mesh; each group's norm is computed by DTensor and made whole over its mesh (one small
    collective per group); plain tensors count once, as replicated values (the same on every
    rank, as a TP model's unsharded parameters are). Call it on every rank.

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

    # every rank sees the parameters in the same order, so the groups (and their
    # collectives) come in the same order too
    groups: dict[DeviceMesh | None, list[Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    device = grads[0].device
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, False, foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the shards' partial norms, reduced over the mesh
        norms.append(norm.to(device))
    total_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if pp_mesh is not None:
        total_norm = _over_stages(total_norm, norm_type, pp_mesh)

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


def _over_stages(norm: Tensor, norm_type: float, pp_mesh: DeviceMesh) -> Tensor:
    """The norm over every pipeline stage's gradients, from each stage's own."""
    if pp_mesh.ndim != 1:
        raise ValueError(f"pp_mesh must be a 1-D mesh, found dims {pp_mesh.mesh_dim_names}")
    group = pp_mesh.get_group()
    if math.isinf(norm_type):
        norm = norm.clone()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.pow(norm_type)
    dist.all_reduce(powered, group=group)
    return powered.pow(1.0 / norm_type)
