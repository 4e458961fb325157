"""Errors raised inside a parallelized module's forward, told with the plan around them.

:func:`torch_tp.parallelize_module` wraps the forward of the module it returns
(:func:`install`). An exception that escapes it is raised again, of the same type and with
aten's message first, followed by what torch_tp knows of the place: the module whose forward
raised and the user's source line, the style of that module or of the planned modules inside
it with the layouts each takes and hands on, and, where the error's sizes and the plan's
layouts tell it, the likely cause (:data:`_CAUSES`). The original exception is chained as
the new one's ``__cause__``; a type whose constructor takes more than a message keeps its
own object and gets the context as a note (PEP 678).

Nothing runs on the happy path but one call frame and a ``try``: the traceback is read only
once an exception has been raised. Under ``torch.compile`` the wrapper steps aside.
"""

from __future__ import annotations

import dis
import functools
import linecache
import math
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Shard

from torch_tp.contract import Boundary, Layout
from torch_tp.plan import PlanEntry
from torch_tp.shapes import _head_count_fix
from torch_tp.style.base import conv1d_base

__all__ = ["ForwardContext", "install"]

# exceptions raised again as a new one of the same type, the original chained; any other
# type keeps its object and gets the context as a note
_RETYPED = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)
_RAISE = dis.opmap["RAISE_VARARGS"]
# the most planned modules listed for one site (a block's forward holds a dozen)
_LISTED = 8
# the frames of these packages are not the user's code
_ROOTS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))


@dataclass
class _Site:
    """Where an exception was raised: the innermost module of the tree whose code was
    running, and the innermost line of the user's code (outside torch and torch_tp)."""

    path: str
    module: nn.Module
    source: str | None


class ForwardContext:
    """The plan one module was parallelized with, told when its forward raises.

    Args:
        degree (int): the number of ranks the plan splits over.
    """

    def __init__(self, degree: int) -> None:
        self.degree = degree
        self.styles: dict[str, Any] = {}  # module path -> style, over every call on the root

    def add(self, entries: list[PlanEntry]) -> None:
        self.styles.update((entry.path, entry.style) for entry in entries)

    def annotated(self, root: nn.Module, err: Exception) -> Exception:
        """``err`` again, its message followed by the plan's context (the same object where
        its type is not one of ``_RETYPED``)."""
        if _raised_by_torch_tp(err.__traceback__):
            return err  # torch_tp's own errors name their module and style already
        site = _site(root, err.__traceback__)
        if site is None:
            return err
        context = self._context(root, site, err)
        if type(err) in _RETYPED:
            again = type(err)(f"{err}\n\n{context}")
            again._torch_tp_context = True  # type: ignore[attr-defined]
            return again
        err.add_note(context)
        err._torch_tp_context = True  # type: ignore[attr-defined]
        return err

    def _context(self, root: nn.Module, site: _Site, err: Exception) -> str:
        where = f"'{site.path}'" if site.path else "the root module"
        lines = [
            f"torch_tp: raised in the forward of {where} ({type(site.module).__name__})"
            + (f" at {site.source}" if site.source else "")
            + f", in a model parallelized over {self.degree} ranks.",
        ]
        planned = self._planned(root, site.path)
        if site.path in self.styles:
            lines.append(f"Its style: {_style_layouts(self.styles[site.path], site.module)}.")
        elif planned:
            lines.append("It has no style; the planned modules inside it:")
        else:
            lines.append("Neither it nor any module inside it is planned.")
        inner = [(p, m) for p, m in planned if p != site.path]
        for path, module in inner[:_LISTED]:
            lines.append(f"  {path}: {_style_layouts(self.styles[path], module)}")
        if len(inner) > _LISTED:
            lines.append(f"  ... and {len(inner) - _LISTED} more")
        for cause in _CAUSES:
            found = cause(str(err), site, planned, self)
            if found:
                lines.append(f"Likely cause: {found}")
                break
        return "\n".join(lines)

    def _planned(self, root: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
        """The planned modules at and under ``path``, with their module objects, the nearest
        to it first (a model's head before its layers' projections)."""
        prefix = f"{path}." if path else ""
        found = [
            (sub_path, module)
            for sub_path, module in root.named_modules()
            if sub_path in self.styles and (sub_path == path or sub_path.startswith(prefix))
        ]
        return sorted(found, key=lambda item: item[0].count("."))


def install(result: nn.Module, entries: list[PlanEntry], degree: int) -> None:
    """Wrap ``result``'s forward so that an exception escaping it carries the context of
    ``entries`` (their paths from ``result``). A second call on the same module adds its
    entries to the first's."""
    current = result.__dict__.get("forward")
    if isinstance(getattr(current, "context", None), ForwardContext):
        current.context.add(entries)
        return
    context = ForwardContext(degree)
    context.add(entries)
    forward = result.forward
    # _forward is the first frame torch.compile compiles of every wrapped model, and it
    # caches what it compiles per code object (8 entries at most): each model gets a copy
    # with a code object of its own, as its own forward had
    own = types.FunctionType(_forward.__code__.replace(), _forward.__globals__, "_forward")
    wrapper = functools.partial(own, context, result, forward)
    wrapper.context = context  # type: ignore[attr-defined]
    # inspect.signature (Trainer's column filter, generate's keyword checks) reads the
    # module's own forward through this
    wrapper.__wrapped__ = forward  # type: ignore[attr-defined]
    result.forward = wrapper


def _forward(context: ForwardContext, root: nn.Module, forward: Callable, *args, **kwargs):
    if torch.compiler.is_compiling():
        return forward(*args, **kwargs)
    try:
        return forward(*args, **kwargs)
    except Exception as err:
        if getattr(err, "_torch_tp_context", False):
            raise
        again = context.annotated(root, err)
        if again is err:
            raise
        raise again from err


def _raised_by_torch_tp(tb: TracebackType | None) -> bool:
    """The exception was raised by a ``raise`` statement of torch_tp's (rather than by a call
    that torch_tp's code made: aten's errors from a style's computation get the context)."""
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return code.co_filename.startswith(_ROOTS[1]) and code.co_code[tb.tb_lasti] == _RAISE


def _site(root: nn.Module, tb: TracebackType | None) -> _Site | None:
    paths = {id(module): path for path, module in root.named_modules()}
    site: _Site | None = None
    source = None
    while tb is not None:
        frame = tb.tb_frame
        for name in ("self", "module"):
            value = frame.f_locals.get(name)
            if isinstance(value, nn.Module) and id(value) in paths:
                site = _Site(paths[id(value)], value, None)
                break
        filename = frame.f_code.co_filename
        if not filename.startswith(_ROOTS):
            line = linecache.getline(filename, tb.tb_lineno).strip()
            source = f"{os.path.basename(filename)}:{tb.tb_lineno}" + (
                f": `{line}`" if line else ""
            )
        tb = tb.tb_next
    if site is not None:
        site.source = source
    return site


# ------------------------------------------------------------------------------------------
# The layouts a style gives its module, as the error names them
# ------------------------------------------------------------------------------------------


def _placement(placement: Placement) -> str:
    return f"Shard({placement.dim})" if isinstance(placement, Shard) else repr(placement)


def _layout(layout: Layout | None, output: bool) -> str:
    if layout is None or (layout.given is None and layout.to is None):
        return "as it comes"
    if layout.given is None:
        text = f"moved to {_placement(layout.to)}"
    elif layout.to is None or layout.to == layout.given:
        text = _placement(layout.given)
    else:
        text = f"{_placement(layout.given)} -> {_placement(layout.to)}"
    final = layout.given if layout.to is None else layout.to
    if not layout.local:
        return f"{text} (a DTensor)"
    if output and isinstance(final, Shard):
        return f"{text} (this rank's part, a plain tensor)"
    return text


def _side(boundary: Boundary | None, output: bool) -> str:
    if boundary is None or not (boundary.args or boundary.kwargs):
        return "as it comes"
    parts = [_layout(layout, output) for layout in boundary.args]
    parts += [f"{name}={_layout(layout, output)}" for name, layout in boundary.kwargs.items()]
    return ", ".join(parts)


def _style_layouts(style: Any, module: nn.Module) -> str:
    """``ColwiseParallel: in Replicate(); out Shard(-1) (this rank's part, a plain tensor)``."""
    contract = getattr(style, "contract", None)
    name = type(style).__name__
    try:
        inputs, outputs = contract.inputs(style, module), contract.outputs(style, module)
    except Exception:  # noqa: BLE001 - a style without a contract: its name alone
        return name
    taken, given = _side(inputs, False), _side(outputs, True)
    if taken == given == "as it comes":
        return f"{name}: moves no data"
    return f"{name}: in {taken}; out {given}"


def _outputs(style: Any, module: nn.Module) -> list[Layout]:
    try:
        boundary = style.contract.outputs(style, module)
    except Exception:  # noqa: BLE001 - no contract: nothing to read
        return []
    return [layout for layout in getattr(boundary, "args", ()) if layout is not None]


def _local_shard(layout: Layout) -> bool:
    final = layout.given if layout.to is None else layout.to
    return layout.local and isinstance(final, Shard)


# ------------------------------------------------------------------------------------------
# Likely causes: each reads aten's message, the site and the plan, and says what it can
# ------------------------------------------------------------------------------------------

_VIEW = re.compile(r"shape '\[([-\d, ]*)\]' is invalid for input of size (\d+)")
_BROADCAST = re.compile(
    r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at "
    r"non-singleton dimension (\d+)"
)
_TARGET = re.compile(r"Target (-?\d+) is out of bounds")
_BATCH = re.compile(r"Expected input batch_size \((\d+)\) to match target batch_size \((\d+)\)")

Planned = list[tuple[str, nn.Module]]


def _dtensor_mixed(message: str, site: _Site, planned: Planned, ctx: ForwardContext) -> str:
    if "mixed torch.Tensor and DTensor" not in message:
        return ""
    handing = [p for p, m in planned if any(not lay.local for lay in _outputs(ctx.styles[p], m))]
    if handing:
        return (
            f"{_hand_on(handing)} a DTensor (use_local_output=False), and the code "
            "of this module computes with it and plain tensors together: keep "
            "use_local_output=True (the default) to hand on this rank's plain tensor, or turn "
            "the other operands into DTensors (DTensor.from_local)"
        )
    return (
        "a planned module's parameters are DTensors: code that reads one directly (a tied "
        "weight, F.linear(h, self.wte.weight)) computes with it and plain tensors together. "
        "Give that computation a module of its own in the plan, or read the parameter's "
        "local part (.to_local()) where each rank's part is what the code means"
    )


def _reshape(message: str, site: _Site, planned: Planned, ctx: ForwardContext) -> str:
    match = _VIEW.search(message)
    if match is None:
        return ""
    sizes = [int(s) for s in match.group(1).split(",") if s.strip()]
    n = ctx.degree
    fix = _head_count_fix(site.module, site.path, set(sizes), n, "view")
    if fix is not None:
        return fix
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        share = int(match.group(2)) / known if known else 0
        if share and share != int(share):
            return (
                f"this rank's part holds {share:g} of the units the view counts (heads of "
                f"{sizes[-1]}, say): a head count that does not divide over {n} ranks (a "
                "grouped-query attention's key/value heads) leaves a part of a head on a "
                "rank. Choose a tensor-parallel size that divides every head count, or leave "
                "those projections whole (ReplicateParallel)"
            )
    return ""


def _broadcast(message: str, site: _Site, planned: Planned, ctx: ForwardContext) -> str:
    match = _BROADCAST.search(message)
    if match is None:
        return ""
    a, b, _ = (int(g) for g in match.groups())
    n = ctx.degree
    if a * n != b and b * n != a:
        return ""
    whole = max(a, b)
    own = [
        (name, tuple(t.shape))
        for name, t in [*site.module.named_parameters(), *site.module.named_buffers()]
        if "." not in name and whole in t.shape and not isinstance(t, DTensor)
    ]
    text = (
        f"one operand has {min(a, b)} where the other has {whole}, {n} times as many: this "
        "rank's part of a split dimension (its heads, its features) meets a tensor the plan "
        "leaves whole"
    )
    if own:
        name, shape = own[0]
        text += (
            f", such as {name!r} {list(shape)}, sized by the whole model. Split it with the "
            f"heads: plan {_key(site.path)} with "
            f"LocalParamsParallel({{{name!r}: Shard({shape.index(whole)})}})"
            if isinstance(getattr(site.module, name, None), nn.Parameter)
            else f", such as the buffer {name!r} {list(shape)}: compute it from this rank's "
            "own heads"
        )
    return text


def _vocabulary(message: str, site: _Site, planned: Planned, ctx: ForwardContext) -> str:
    """A loss given a head's part of the vocabulary: a target beyond it, or (logits viewed
    with the whole vocabulary's size) fewer rows than targets."""
    batch = _BATCH.search(message)
    if batch is not None:
        rows, targets = int(batch.group(1)), int(batch.group(2))
        if rows * ctx.degree != targets:
            return ""
    parts = [(p, m) for p, m in planned if _hands_on_part(ctx, p, m)]
    target = _TARGET.search(message)
    if target is not None:  # the heads whose part ends before the target and whole does not
        t = int(target.group(1))
        parts = [(p, m) for p, m in parts if _features(m) // ctx.degree <= t < _features(m)]
    elif batch is None:
        return ""
    if not parts:
        return ""
    # the nearest to the module that raised (a model's head, not its layers' projections)
    depth = min(p.count(".") for p, _ in parts)
    parts = [(p, m) for p, m in parts if p.count(".") == depth]
    return (
        f"{_hand_on([p for p, _ in parts])} this rank's part of its output features (for a "
        "head, a part of the vocabulary) as a plain tensor, and the code that follows takes "
        "it as the whole: give the head output_layouts=Replicate() to gather its logits, or keep "
        "them sharded (use_local_output=False) and compute the loss inside "
        "torch_tp.loss_parallel()"
    )


def _hands_on_part(ctx: ForwardContext, path: str, module: nn.Module) -> bool:
    return any(_local_shard(layout) for layout in _outputs(ctx.styles[path], module))


def _features(module: nn.Module) -> int:
    """A linear-like module's output features (its weight's first dimension), else 0."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return 0
    return weight.shape[1] if conv1d_base(module) is not None else weight.shape[0]


def _key(path: str) -> str:
    """The plan key of the module at ``path``, as a message names it."""
    return repr(path) if path else "'' (the module itself)"


def _hand_on(paths: list[str]) -> str:
    """``'lm_head' hands on``, ``'a', 'b' (and 2 more) hand on``."""
    shown = ", ".join(repr(p) for p in paths[:3])
    more = f" (and {len(paths) - 3} more)" if len(paths) > 3 else ""
    return f"{shown}{more} {'hands' if len(paths) == 1 else 'hand'} on"


_CAUSES: tuple[Callable[[str, _Site, Planned, ForwardContext], str], ...] = (
    _dtensor_mixed,
    _reshape,
    _broadcast,
    _vocabulary,
)
