"""Materializing a model built on the meta device, after it was parallelized.

The route for a model too big to build whole on one device::

    with torch.device("meta"):
        model = build(config)                          # no memory at all
    parallelize_module(model, tp_mesh, plan)           # DTensors of meta shards
    torch_tp.materialize(model)                        # this rank's shards, on its device
    torch_tp.checkpoint.load_pretrained(model, path)   # or load_full_state_dict, load

:func:`materialize` allocates each tensor that is on the meta device on the device of the
model's mesh: a DTensor parameter's local shard only, so a rank holds its shards and never a
whole tensor. Parameters and persistent buffers are left uninitialised (a checkpoint load
fills them). Non-persistent buffers are not in any checkpoint: they are derived from the
configuration when the module is built (rotary ``inv_freq`` tables, causal masks, position
ids), so :func:`materialize` computes them again the way the module's own constructor does
(see :func:`materialize` for how, and what it refuses; the code is ``torch_tp/_buffers.py``).

``model.to_empty()`` instead of :func:`materialize` leaves those buffers uninitialised: the
loaders of :mod:`torch_tp.checkpoint` compare each with its value computed so, compute again
(with a warning) those that differ, and refuse a model that also holds such buffers they
cannot compute.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torch_tp._buffers import recompute

__all__ = ["materialize"]


def materialize(module: nn.Module, *, device: torch.device | str | None = None) -> nn.Module:
    """Allocate this rank's shards of a model built on the meta device, in place.

    Every parameter and buffer of ``module`` on the meta device is given memory on the
    mesh's device: a DTensor's local shard (the shape this rank holds after
    :func:`~torch_tp.parallelize_module`, or after FSDP2 as well), a plain tensor whole.
    Tensors that are not on the meta device are left as they are. Parameters stay the same
    ``nn.Parameter`` objects (tied weights stay tied; FSDP2 is told, as for
    :meth:`nn.Module.to_empty`), so build the optimizer afterwards or before, as you like.

    The values of parameters and persistent buffers are **uninitialised** afterwards: load
    a checkpoint next (:func:`torch_tp.checkpoint.load_pretrained`,
    :func:`~torch_tp.checkpoint.load_full_state_dict`, :func:`~torch_tp.checkpoint.load`),
    or initialise them yourself.

    Non-persistent buffers (``register_buffer(..., persistent=False)``: rotary ``inv_freq``
    tables, masks, position ids) are in no checkpoint, so they are computed again, exactly
    as the module's own constructor computes them: the nearest module owning the buffer (or
    an ancestor of it) that keeps its configuration as ``.config`` (transformers' rotary
    embeddings and models, torch_tp's reference models) is constructed once more as
    ``type(owner)(owner.config)`` on the CPU, with every parameter it creates moved to the
    meta device as soon as it is registered (so the copy costs at most its largest single
    parameter for a moment, and its buffers), under a forked RNG (the global random state
    is not consumed). Its buffer is then cast to the dtype of the meta one (as
    ``model.to(dtype)`` would have cast it) and moved to the device. Nothing else of the
    copy is kept.

    A non-persistent buffer on the meta device that cannot be computed so (no owner with a
    ``config``, a constructor that fails or builds another shape, a DTensor buffer) is
    refused before anything is allocated; give it a value (a real tensor, registered with
    ``persistent=False``) before calling :func:`materialize`, which then leaves it alone.

    Args:
        module (:class:`nn.Module`): the model, built on the meta device and parallelized
            (and possibly FSDP2-sharded).

    Keyword Args:
        device (torch.device or str, optional): where to allocate. Default: the device of
            the model's DTensors' mesh (``"cuda"`` means the current CUDA device); required
            when the model holds no DTensor, and must agree with the mesh when it does.

    Returns:
        ``module``, materialized.

    Raises:
        ValueError: a non-persistent buffer cannot be computed again (named, with the
            reason), the model holds no DTensor and no ``device`` was given, or ``device``
            disagrees with the mesh. Nothing is changed.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch.device("meta"):
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> parallelize_module(model, tp_mesh, plan_for(model))
        >>> torch_tp.materialize(model)
        >>> torch_tp.checkpoint.load_pretrained(model, "path/to/checkpoint")
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"materialize expects an nn.Module, found {type(module).__name__}")
    if not any(t.is_meta for t in _tensors(module)):
        return module
    target = _device(module, device)
    values = _recomputed_buffers(module)  # raises before anything is allocated
    module._apply(lambda t: torch.empty_like(t, device=target) if t.is_meta else t)
    with torch.no_grad():
        for owner, name, value in values:
            owner.register_buffer(name, value.to(device=target), persistent=False)
    return module


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    """The device to allocate on: the mesh's (its current device for an accelerator)."""
    kinds = {t.device_mesh.device_type for t in _tensors(module) if isinstance(t, DTensor)}
    if len(kinds) > 1:
        raise ValueError(f"the model's DTensors are on meshes of several device types: {kinds}")
    if device is not None:
        device = torch.device(device)
        if kinds and device.type not in kinds:
            raise ValueError(
                f"materialize(device={str(device)!r}) but the model's mesh is on "
                f"{kinds.pop()!r}: leave device out to use the mesh's"
            )
    elif not kinds:
        raise ValueError(
            "materialize: the model holds no DTensor (it was not parallelized), so there is no "
            "mesh to take the device from: pass device=..."
        )
    else:
        device = torch.device(kinds.pop())
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def _recomputed_buffers(module: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """Every non-persistent buffer on the meta device, computed again on the CPU: (owner,
    name, value) with the meta buffer's dtype; raise naming every one that cannot be."""
    computed, refused = recompute(module, lambda buffer: buffer.is_meta)
    if refused:
        raise ValueError(
            "materialize cannot compute these non-persistent buffers again (nothing was "
            "changed): " + "; ".join(refused) + ". Give each a value before materialize "
            "(module.register_buffer(name, tensor, persistent=False)); it then leaves it alone."
        )
    return [(owner, name, value) for owner, name, _, _, value in computed]
