"""The dry-run report's view of PEFT's LoRA layers on a plan's modules.

A LoRA layer a style hosts (:mod:`torch_tp.style.adapters`) runs, in the parallel model, as
its base layer's style computes it: the base and the adapters in one pass. The trace
(:mod:`torch_tp.report.trace`) follows it so, not through PEFT's own forward: the wrapper's
forward is its base layer's, and the base's boundary says what the adapters add: their
output's gradient (the base may be frozen), their ``r`` features in a row-parallel base's
one reduction, and their partial gradients, summed at the end of backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Shard

from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Boundary, StyleContract
from torch_tp.plan import PlanEntry

__all__: list[str] = []  # private to torch_tp.report


def adapter_layouts(entry: PlanEntry) -> dict[nn.Module, dict[str, Placement]]:
    """The LoRA factors of the PEFT layer wrapping ``entry``'s module (``lora_A`` and
    ``lora_B`` of every adapter), each with its parameters' placements as the style hosts
    them; empty for a module PEFT did not wrap, or a style that hosts no adapters."""
    wrapper = entry.adapters
    placements_of = getattr(entry.style, "_adapter_placements", None)
    if wrapper is None or placements_of is None:
        return {}
    try:
        placements = placements_of(entry.module)
    except NotImplementedError:
        return {}
    return {
        part: placements[which]
        for which, parts in enumerate((wrapper.lora_A, wrapper.lora_B))
        for part in parts.values()
    }


def _active_adapters(wrapper: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """The factors a hosted layer's forward computes with (``adapters._forward``): its
    active adapters', none while adapters are disabled or merged."""
    if wrapper.disable_adapters or wrapper.merged:
        return []
    names = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    return [(wrapper.lora_A[name], wrapper.lora_B[name]) for name in names]


def hosted_forward(trace: Any, entry: PlanEntry, x: Any, *args: Any, **kwargs: Any) -> Any:
    """A hosted PEFT layer's forward in the trace: its base layer's, whose style computes the
    adapters with it (``style._linear``), on the adapters the real forward would use."""
    kwargs.pop("adapter_names", None)  # a mixed batch is refused by the run itself
    base = entry.module
    trace.adapters[id(base)] = _active_adapters(entry.adapters)
    try:
        return base(x, *args, **kwargs)
    finally:
        trace.adapters.pop(id(base), None)


def adapter_partials(
    entry: PlanEntry, contract: StyleContract, active: list[tuple[nn.Module, nn.Module]]
) -> list[nn.Parameter]:
    """The adapter parameters whose gradients are partial sums, summed at the end of
    backward with the other replicated parameters' (``adapters.column_terms`` and
    ``row_terms``): a whole ``lora_A`` feeding a ``lora_B`` sharded on the output (each
    rank's gradient is its columns' share), and a whole ``lora_B`` on an output sharded on
    the tokens (each rank's is its tokens' share) or left a partial sum (each rank's is its
    share of ``lora_A``'s output: the MLP's down projection under sequence parallelism)."""
    if not active:
        return []
    layouts = adapter_layouts(entry)
    outputs = contract.outputs(entry.style, entry.module)
    out = outputs.args[0] if outputs is not None and outputs.args else None
    final = None if out is None else (out.given if out.to is None else out.to)
    found = []
    for A, B in active:
        if isinstance(layouts[B].get("weight"), (Shard, StridedShard)):
            found.append(A.weight)
        elif isinstance(final, (Shard, Partial)):
            found += [p for p in (B.weight, B.bias) if p is not None]
    return [p for p in found if isinstance(p, nn.Parameter) and p.requires_grad]


def with_adapters(
    boundary: Boundary, outputs: tuple, active: list[tuple[nn.Module, nn.Module]]
) -> tuple:
    """A hosted layer's outputs as they cross its boundary: requiring a gradient where a
    trainable adapter computes them (the base may be frozen), and, where the base's output
    is a partial sum, as wide as the one reduction of the base's and the adapters' partial
    sums concatenated on the features (``adapters.reduce_with``: ``r`` more per adapter)."""
    out = outputs[0] if outputs else None
    if not active or not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return outputs
    trained = any(p.requires_grad for A, B in active for p in (*A.parameters(), *B.parameters()))
    if trained and torch.is_grad_enabled() and not out.requires_grad:
        out.requires_grad_(True)  # a leaf: made by a frozen layer
    layout = boundary.args[0] if boundary.args else None
    if layout is None or not isinstance(layout.given, Partial):
        return outputs
    features = sum(A.weight.shape[0] for A, _ in active)
    dtype = functools.reduce(torch.promote_types, [A.weight.dtype for A, _ in active], out.dtype)
    wide = torch.empty(
        (*out.shape[:-1], out.shape[-1] + features),
        dtype=dtype,
        device=out.device,
        requires_grad=out.requires_grad,
    )
    return (wide, *outputs[1:])
