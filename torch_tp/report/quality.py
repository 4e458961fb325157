"""How much of a model a plan really splits: per block, the fraction of the linear parameters
and of the matmul FLOPs that are sharded over the ranks, and each module computed whole.

A plan can be valid, at parity with one device and still do little: ``auto()`` keeps an
attention whole when it cannot make its heads per-rank (q, k and v gathered, every rank
computing every head), and a hand-written plan can leave a layer out. The dry-run report's
trace (:mod:`torch_tp.report.trace`) hands every op of the unparallelized forward to
:class:`Quality`, which counts the FLOPs of each matrix product (``F.linear``, ``matmul``,
``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``einsum``, ``F.scaled_dot_product_attention``) at
the model's global shapes and decides whether the ranks split it: one of its operands is a
parameter (or a view of one) the plan shards, or a local tensor the trace knows to be this
rank's shard (a head-sharded query in the attention). A parameter a matrix product reads is
a *linear parameter*; it is sharded when the plan gives it a ``Shard`` placement. Each
module with a matrix product that no rank splits is listed, with why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Placement, Shard

from torch_tp._torch_compat import StridedShard, tree_leaves
from torch_tp.report.render import OUTSIDE, BlockQuality

__all__: list[str] = []  # private to torch_tp.report

_T = torch.Tensor


def _linear(args: tuple, kwargs: dict, out: _T) -> int:
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    return 2 * out.numel() * weight.shape[-1]


def _product(args: tuple, kwargs: dict, out: _T) -> int:
    return 2 * out.numel() * args[0].shape[-1] if args[0].ndim else 0


def _added_product(args: tuple, kwargs: dict, out: _T) -> int:
    return 2 * out.numel() * args[1].shape[-1]


def _einsum(args: tuple, kwargs: dict, out: _T) -> int:
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation:
        return 2 * out.numel()  # not worth parsing: counted as one multiply-add per output
    sizes: dict[str, int] = {}
    for letters, operand in zip(equation.split("->")[0].split(","), operands, strict=False):
        sizes.update(zip(letters.strip(), operand.shape, strict=False))
    return 2 * math.prod(sizes.values())


def _attention(args: tuple, kwargs: dict, out: _T) -> int:
    query, key, value = args[:3]
    scores = query.numel() // query.shape[-1] * key.shape[-2]
    return 2 * scores * query.shape[-1] + 2 * scores * value.shape[-1]


# the FLOPs of each matrix product, from its (global) shapes
_FLOPS: dict[Callable, Callable[[tuple, dict, _T], int]] = {
    F.linear: _linear,
    torch.matmul: _product,
    _T.matmul: _product,
    _T.__matmul__: _product,
    torch.mm: _product,
    _T.mm: _product,
    torch.bmm: _product,
    _T.bmm: _product,
    torch.addmm: _added_product,
    _T.addmm: _added_product,
    torch.baddbmm: _added_product,
    _T.baddbmm: _added_product,
    torch.einsum: _einsum,
    F.scaled_dot_product_attention: _attention,
}
# ops whose output is a view or a copy of one input's values (a weight transposed, an
# expert's slice of stacked weights): a product reading it reads the parameter
_VIEWS = {
    _T.t,
    _T.T.__get__,
    _T.mT.__get__,
    torch.t,
    _T.transpose,
    torch.transpose,
    _T.permute,
    torch.permute,
    _T.view,
    _T.reshape,
    torch.reshape,
    _T.__getitem__,
    _T.narrow,
    _T.unflatten,
    _T.contiguous,
    _T.to,
    _T.type_as,
    _T.float,
    _T.chunk,
    _T.split,
    torch.chunk,
    torch.split,
    _T.unbind,
}


def block_of(path: str) -> str:
    """The block a module path belongs to: up to its first layer number, as ``*``
    (``model.layers.3.mlp`` -> ``model.layers.*``); outside any repeated layers,
    ``"(outside the blocks)"``."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join([*parts[:i], "*"])
    return OUTSIDE


def _general(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


class Quality:
    """Counts, during the report's trace, what each block's matrix products split.

    Args:
        model (nn.Module): the model the trace runs.
        placements (Mapping[int, tuple[str, Placement | None, str]]): by ``id`` of each
            parameter a style of the plan lays out, its path, its placement and the style
            (by its short form).
        is_shard (Callable): ``is_shard(tensor)``: whether the trace knows ``tensor`` to be
            a rank's shard of a larger tensor (a local tensor laid out ``Shard``).
    """

    def __init__(
        self,
        model: nn.Module,
        placements: Mapping[int, tuple[str, Placement | None, str]],
        is_shard: Callable[[torch.Tensor], bool],
    ) -> None:
        self.placements = placements
        self.is_shard = is_shard
        self.names = {
            id(p): _general(name) for name, p in model.named_parameters(remove_duplicate=False)
        }
        self.sizes = {id(p): p.numel() for p in model.parameters()}
        # id of a view of a parameter -> the parameter's id; the tensors kept alive meanwhile
        self.views: dict[int, int] = {}
        self.alive: list[torch.Tensor] = []
        self.counted: set[int] = set()  # parameters already counted (a tied one once)
        self.blocks: dict[str, BlockQuality] = {}

    def on_op(self, func: Callable, args: tuple, kwargs: dict, out: Any, path: str) -> None:
        """Account one op of the trace, run inside the module at ``path``."""
        if func in _VIEWS:
            leaves = tree_leaves((args, kwargs))
            found = (self._parameter(t) for t in leaves if isinstance(t, torch.Tensor))
            source = next((p for p in found if p is not None), None)
            if source is not None:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self.views[id(t)] = source
                        self.alive.append(t)
            return
        count = _FLOPS.get(func)
        if count is None or not isinstance(out, torch.Tensor):
            return
        # the operands multiplied (a bias added is no linear parameter: a row-parallel
        # layer's is whole by design)
        inputs = _multiplied(func, args, kwargs)
        params = [self._parameter(t) for t in inputs]
        block = block_of(path)
        quality = self.blocks.setdefault(block, BlockQuality(block))
        sharded = False
        for pid in {p for p in params if p is not None}:
            placement = self.placements.get(pid, ("", None, ""))[1]
            shards = isinstance(placement, (Shard, StridedShard)) or (
                isinstance(placement, tuple)
                and any(isinstance(p, (Shard, StridedShard)) for p in placement)
            )
            sharded = sharded or shards
            if pid not in self.counted:
                self.counted.add(pid)
                numel = self.sizes.get(pid, 0)
                quality.linear_parameters += numel
                quality.sharded_parameters += numel if shards else 0
        if not sharded:
            sharded = any(self.is_shard(t) for t in inputs)
        flops = count(args, kwargs, out)
        quality.flops += flops
        quality.sharded_flops += flops if sharded else 0
        if not sharded:
            quality.whole.setdefault(_general(path) or "(the model)", self._why(params))

    def _parameter(self, t: torch.Tensor) -> int | None:
        if isinstance(t, nn.Parameter):
            return id(t)
        return self.views.get(id(t))

    def _why(self, params: list[int | None]) -> str:
        found = [p for p in params if p is not None]
        if not found:
            return "its inputs are whole on every rank: every rank computes all of it"
        name, placement, style = self.placements.get(
            found[0], (self.names.get(found[0], "?"), None, "")
        )
        if placement is None:
            return f"no style shards {name}: every rank holds and computes all of it"
        return f"its style, {style}, keeps {name} whole ({placement!r}) on every rank"

    def result(self) -> list[BlockQuality]:
        """The blocks, those outside the repeated layers last."""
        return sorted(self.blocks.values(), key=lambda q: (q.block == OUTSIDE, q.block))


def _multiplied(func: Callable, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if func is F.linear:
        found = [args[0] if args else kwargs.get("input"), args[1] if len(args) > 1 else None]
        found[1] = found[1] if found[1] is not None else kwargs.get("weight")
    elif func in (torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm):
        found = list(args[1:3])  # (bias, mat1, mat2), the method's self the bias
    elif func is F.scaled_dot_product_attention:
        found = list(args[:3])
    else:
        found = list(tree_leaves((args, kwargs)))
    return [t for t in found if isinstance(t, torch.Tensor)]
