"""Full tensors into DTensor parameters, through PyTorch's own ``load_state_dict``.

A parallelized model's parameters are DTensors, and ``nn.Module.load_state_dict`` copies
each saved tensor into its parameter with ``param.copy_(value)``: a plain tensor into a
DTensor is refused ("got mixed torch.Tensor and DTensor"). A PyTorch user's first instinct
after ``torch.load`` is to hand the model its single-device state dict, so every module that
holds a tensor of its own gets a load pre-hook (:func:`accept_full_tensors`) that turns such
a full tensor into this rank's part of it, laid out as the parameter is: each rank holds the
whole value, so no communication. A DTensor needs nothing (DTensor's ``copy_`` redistributes
one laid out otherwise), and a tensor of another shape is left to ``load_state_dict``, which
names the key and both shapes as it always does.

``model.state_dict()`` keeps returning the DTensors, as upstream does;
:func:`torch_tp.checkpoint.full_state_dict` gathers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["accept_full_tensors", "laid_out_like", "lay_out_entries"]

# set in a module's __dict__ once its load pre-hook is registered
_ACCEPTS = "_torch_tp_accepts_full_tensors"


def laid_out_like(value: Any, target: torch.Tensor) -> Any:
    """``value``, a full tensor of the DTensor ``target``'s shape, as this rank's part of it
    laid out as ``target`` is (each rank slices its own copy); anything else unchanged."""
    if (
        not isinstance(target, DTensor)
        or not isinstance(value, torch.Tensor)
        or isinstance(value, DTensor)
        or value.shape != target.shape
    ):
        return value
    return distribute_tensor(
        value.to(device=target.device, dtype=target.dtype),
        target.device_mesh,
        target.placements,
        src_data_rank=None,
    )


def lay_out_entries(
    state_dict: dict[str, Any], prefix: str, named: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Replace each entry ``prefix + name`` of ``state_dict`` by :func:`laid_out_like` its
    tensor in ``named``."""
    for name, target in named:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = laid_out_like(state_dict[key], target)


def _direct_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _lay_out_direct_entries(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    lay_out_entries(state_dict, prefix, _direct_tensors(module))


def accept_full_tensors(module: nn.Module) -> None:
    """Let ``module.load_state_dict`` (or its parent's) take full tensors for the DTensor
    parameters and buffers ``module`` holds itself. Whether a
    tensor is a DTensor is read at load time, so parameters FSDP2 shards later are
    covered too. Registered once per module."""
    if vars(module).get(_ACCEPTS) or not any(True for _ in _direct_tensors(module)):
        return
    module.register_load_state_dict_pre_hook(_lay_out_direct_entries)
    vars(module)[_ACCEPTS] = True
