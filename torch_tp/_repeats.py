"""Repeated blocks: the siblings of a model's layer list that compute alike, so that a trace
of the model on the meta device may run the first of them and replay its output for the rest.

A model of 22 decoder layers runs the same code 22 times on the same shapes; the shape check
(:func:`torch_tp.shapes.check_shapes`) traces each op of it through torch's meta kernels, so
its cost grows with the depth while what it learns does not. This module finds which layers
are alike and replays a layer's output where a layer alike was already traced with the same
inputs.

Two siblings of an ``nn.ModuleList`` or ``nn.Sequential`` are *alike* when everything their
forward could read a shape from is the same:

* the classes and paths of all their submodules, and the style the plan gives each;
* each parameter's and buffer's shape, dtype and ``requires_grad``;
* every attribute of every submodule: plain values (numbers, strings, dtypes and tuples or
  lists of them) by value, tensors by shape and dtype, any other object by identity (a shared
  config is one object; a function set on one layer is not another layer's). An int that
  differs between the two by exactly their distance in the list is a position (``layer_idx``):
  it is allowed to differ, and every list of the objects the block refers to (a config) that
  has one entry per sibling (``config.layer_types``) adds its entry at that position.

A layer is replayed only when it is called with inputs alike to the ones its representative
was traced with (tensors of the same shape, stride, dtype and ``requires_grad``, the same
other values, the same objects) and the representative's output is tensors in tuples or lists
(nothing else is replayed). A replayed output is new meta tensors of the same shapes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from torch_tp import _torch_compat as compat

__all__: list[str] = []

# the attributes every nn.Module has (its own bookkeeping), left out of a block's signature
# but for ``training``
_MODULE_STATE = frozenset(vars(nn.Module())) - {"training"}
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def repeated_blocks(model: nn.Module, styles: Mapping[int, Any] | None = None) -> dict[str, str]:
    """The blocks of ``model`` alike to an earlier sibling: path -> the first sibling's path.

    Blocks are the children of every ``nn.ModuleList`` and ``nn.Sequential`` in ``model``;
    nested lists (the experts of each layer) are covered inside their block's own replay.
    ``styles`` (``id(module) -> style``, a plan's) are part of what must be alike: two layers
    planned differently are not."""
    styles = styles or {}
    repeats: dict[str, str] = {}
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or any(
            path.startswith(f"{r}.") or path == r for r in repeats
        ):
            continue
        children = list(container.named_children())
        count = len(children)
        firsts: list[tuple[str, list[tuple]]] = []  # the first of each kind, with its signature
        for index, (name, child) in enumerate(children):
            signature = _signature(child, index, count, styles)
            for first, first_signature in firsts:
                if _alike(first_signature, signature):
                    repeats[f"{path}.{name}" if path else name] = first
                    break
            else:
                firsts.append((f"{path}.{name}" if path else name, signature))
    return repeats


def _signature(block: nn.Module, index: int, count: int, styles: Mapping[int, Any]) -> list[tuple]:
    """Everything the forward of ``block`` (at ``index`` of ``count`` siblings) could read a
    shape from, its submodules' styles included, as a list of comparable entries."""
    entries: list[tuple] = []
    for path, sub in block.named_modules():
        style = styles.get(id(sub))
        entries.append(("module", path, type(sub), type(style), repr(style)))
        for name, t in compat.direct_parameters(sub).items():  # None slots (bias=False) too
            entries.append(("param", path, name, _tensor(t)))
        for name, t in sub.named_buffers(recurse=False):
            entries.append(("buffer", path, name, _tensor(t)))
        for name, value in vars(sub).items():
            if name in _MODULE_STATE:
                continue
            entries.append(("attr", path, name, _value(value, index, sub)))
            for key, per_layer in _per_sibling(value, count):
                # by value: an entry per sibling is not a position
                entries.append(("per-sibling", path, name, key, _plain(per_layer[index])))
    return entries


def _tensor(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (type(t), tuple(t.shape), t.dtype, t.requires_grad)


def _value(value: Any, index: int, owner: nn.Module | None = None) -> Any:
    """``value`` (an attribute of ``owner``) as a signature entry: ints as (value, value -
    index), so that a position can be told from a size; a ``functools.partial`` by its
    function and arguments, a method of ``owner`` by its function (activations keep them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return ("int", value, value - index)
    if isinstance(value, _PLAIN):
        return ("plain", type(value), value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return ("seq", type(value), tuple(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", *_tensor(value))
    if isinstance(value, functools.partial):
        arguments = [*value.args, *value.keywords.values()]
        if all(isinstance(v, _PLAIN) for v in arguments):
            return ("partial", id(value.func), value.args, tuple(sorted(value.keywords.items())))
    if inspect.ismethod(value) and owner is not None and value.__self__ is owner:
        return ("own method", id(value.__func__))
    return ("object", id(value))


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return ("plain", type(value), value)
    return _value(value, 0)


def _per_sibling(value: Any, count: int) -> list[tuple[str, list | tuple]]:
    """The lists of the object ``value`` (a config) with one entry per sibling."""
    if count < 2 or isinstance(value, (nn.Module, torch.Tensor, *_PLAIN, tuple, list, dict)):
        return []
    try:
        fields = vars(value)
    except TypeError:  # no __dict__
        return []
    return [
        (key, v) for key, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == count
    ]


def _alike(a: list[tuple], b: list[tuple]) -> bool:
    """Two signatures are the same but for ints that differ by the blocks' distance (a
    position: the same ``value - index`` in both)."""
    if len(a) != len(b):
        return False
    return all(x == y or _positions(x, y) for x, y in zip(a, b, strict=True))


def _positions(x: tuple, y: tuple) -> bool:
    """``x`` and ``y`` are the same int attribute, equal or the same position."""
    if x[0] != "attr" or x[:3] != y[:3]:
        return False
    vx, vy = x[3], y[3]
    return (
        isinstance(vx, tuple)
        and isinstance(vy, tuple)
        and vx[0] == vy[0] == "int"
        and (vx[1] == vy[1] or vx[2] == vy[2])
    )


# ------------------------------------------------------------------------------------------
# Replaying a block's output
# ------------------------------------------------------------------------------------------


class Replays:
    """The outputs of each representative block, by the key of its inputs, for one trace.

    ``state`` gives what a trace keeps of a tensor beyond its shape (the rank trace: the
    placement of a tensor that stands for a DTensor), and ``adopt`` hands a replayed
    tensor's state on to it; ``make`` creates tensors without tracing them."""

    def __init__(
        self,
        repeats: dict[str, str],
        state: Callable[[torch.Tensor], Any],
        adopt: Callable[[torch.Tensor, torch.Tensor], None],
        make: Callable[[Callable[[], Any]], Any],
    ) -> None:
        self.repeats = repeats
        self.representatives = set(repeats.values())
        self.outputs: dict[str, dict[Any, Any]] = {}
        self.state, self.adopt, self.make = state, adopt, make
        self.replayed = 0

    def install(self, path: str, module: nn.Module) -> None:
        """Wrap the forward of ``module`` (at ``path``) if it is a block of a kind: it replays
        the output of the first block of its kind called with inputs alike, and otherwise runs
        and records its output for the rest."""
        kind = self.repeats.get(path, path if path in self.representatives else None)
        if kind is not None:
            module.forward = self._replaying(kind, module.forward)

    def _replaying(self, kind: str, forward: Callable) -> Callable:
        def replaying(*args: Any, **kwargs: Any) -> Any:
            key = self._key((args, kwargs))
            recorded = self.outputs.setdefault(kind, {})
            if key is not None and key in recorded:
                self.replayed += 1
                return self.make(lambda: self._fresh(recorded[key]))
            output = forward(*args, **kwargs)
            if key is not None and _replayable(output):
                recorded[key] = output
            return output

        return replaying

    def _key(self, value: Any) -> Any:
        """What a block's forward could read a shape from in its inputs (``None``: an input
        that cannot be compared)."""
        if isinstance(value, torch.Tensor):
            return (
                "tensor",
                type(value),
                tuple(value.shape),
                value.stride(),
                value.dtype,
                value.device.type,
                value.requires_grad,
                self.state(value),
            )
        if isinstance(value, _PLAIN):
            return (type(value), value)
        if type(value) in (tuple, list):
            keys = [self._key(v) for v in value]
            return None if None in keys else (type(value), tuple(keys))
        if type(value) is dict:
            keys = [(k, self._key(v)) for k, v in value.items()]
            return None if any(k is None for _, k in keys) else ("dict", tuple(keys))
        return ("object", id(value))

    def _fresh(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            fresh = torch.empty_strided(
                output.shape, output.stride(), dtype=output.dtype, device=output.device
            )
            if output.requires_grad:
                fresh = fresh.requires_grad_().clone()  # not a leaf: in-place ops may follow
            self.adopt(output, fresh)
            return fresh
        if isinstance(output, (tuple, list)):
            return type(output)(self._fresh(v) for v in output)
        return output


def _replayable(output: Any) -> bool:
    """Only tensors (on meta) and plain values, in plain tuples and lists."""
    if isinstance(output, torch.Tensor):
        return output.is_meta and type(output) is torch.Tensor
    if type(output) in (tuple, list):
        return all(_replayable(v) for v in output)
    return isinstance(output, _PLAIN)
