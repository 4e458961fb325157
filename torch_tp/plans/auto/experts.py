"""Mixtures of experts: experts stacked in 3-D parameters, found and checked.

A child of a block holding stacked experts (``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]``, both transposed, or ungated ``up_proj`` and ``down_proj``) is a mixture of
experts: :func:`stacked_experts` finds them and any shared experts stacked beside them
(``gate_proj``/``up_proj``/``down_proj`` ``[n, ...]``), and refuses other stacked parameters.
:mod:`torch_tp.plans.auto.blocks` gives them their styles.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

from torch_tp.plans.auto.groups import join_dotted

__all__: list[str] = []


def _stacked(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(
        isinstance(getattr(module, p, None), torch.Tensor) and getattr(module, p).ndim == 3
        for p in names
    )


# the stacked weights of experts: SwiGLU (gate and up fused), or ungated (Nemotron-H)
_GATED, _UNGATED = ("gate_up_proj", "down_proj"), ("up_proj", "down_proj")


# shared experts stacked beside the routed ones (Inkling): gate_proj and up_proj [n, I, H]
# sharded on I, down_proj [n, H, I] too, computed in the module's own forward and summed once
_SHARED = ("gate_proj", "up_proj", "down_proj")


STACKED_SHARED_PLACEMENTS = {"gate_proj": Shard(1), "up_proj": Shard(1), "down_proj": Shard(2)}


def _is_experts(module: nn.Module) -> bool:
    return _stacked(module, _GATED) or (
        _stacked(module, _UNGATED)
        and getattr(module, "gate_up_proj", None) is None
        and getattr(module, "gate_proj", None) is None
    )


def expert_count(module: nn.Module) -> int:
    return module.down_proj.shape[0]


def stacked_experts_unchecked(block: nn.Module, name: str) -> list[str]:
    """The paths (inside the block) of the stacked experts in its child ``name``, unchecked
    (:func:`stacked_experts` checks them)."""
    unit = block.get_submodule(name)
    return [join_dotted(name, path) for path, module in unit.named_modules() if _is_experts(module)]


def stacked_experts(
    unit: nn.Module, name: str, prefix: str, hidden: int
) -> tuple[list[str], list[str]]:
    """The paths (inside the block) of the stacked experts in ``unit`` and of its stacked
    shared experts, checked: SwiGLU experts ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
    ``[E, H, I]`` (or both transposed), or ungated ones ``up_proj`` ``[E, I, H]`` and
    ``down_proj`` ``[E, H, I]``, with no other parameter; shared experts ``gate_proj`` and
    ``up_proj`` ``[n, I, H]`` and ``down_proj`` ``[n, H, I]``. Anything else stacked is
    refused."""
    found, shared = [], []
    for path, module in unit.named_modules():
        if not _is_experts(module):
            continue
        key = join_dotted(prefix, join_dotted(name, path))
        names = _GATED if _stacked(module, _GATED) else _UNGATED
        others = sorted(n for n, _ in module.named_parameters() if n not in names)
        first, down = getattr(module, names[0]), module.down_proj
        (e, a, b), (e2, c, d) = first.shape, down.shape
        if names == _UNGATED:
            fits = e == e2 and a == d and b == c
        else:
            plain = a == 2 * d and b == c and e == e2
            transposed = b == 2 * c and a == d and e == e2
            fits = plain or transposed
        if others or not fits:
            raise ValueError(
                f"'{key}' ({type(module).__name__}: {names[0]} {list(first.shape)}, "
                f"down_proj {list(down.shape)}{', ' + ', '.join(others) if others else ''}): "
                "auto() shards stacked experts (gate_up_proj [E, 2I, H] and down_proj "
                "[E, H, I], or both transposed, or ungated up_proj [E, I, H] and down_proj "
                "[E, H, I]) with no other parameter; write the plan by hand"
            )
        found.append(join_dotted(name, path))
    for path, module in unit.named_modules():
        if join_dotted(name, path) in found:
            continue
        stacked = [n for n, p in module.named_parameters(recurse=False) if p.ndim >= 3]
        if not stacked:
            continue
        has_more = any(True for c in module.children() for _ in c.parameters())
        if sorted(stacked) == sorted(_SHARED) and not has_more:
            (n, i, h), (n2, i2, h2), (n3, h3, i3) = (getattr(module, p).shape for p in _SHARED)
            if n == n2 == n3 and i == i2 == i3 and h == h2 == h3 == hidden:
                shared.append(join_dotted(name, path))
                continue
        raise ValueError(
            f"'{join_dotted(prefix, join_dotted(name, path))}' ({type(module).__name__}) holds "
            f"stacked parameters {stacked} beside the experts: auto() knows stacked experts "
            "(gate_up_proj or up_proj, and down_proj) and stacked shared experts (gate_proj, "
            "up_proj, down_proj); write the plan by hand"
        )
    return found, shared
