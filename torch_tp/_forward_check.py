"""The first forward of a plan, shape-checked: :class:`FirstForwardCheck`.

:func:`torch_tp.parallelize_module` takes a meta copy of the module before it applies the
plan (:func:`forward_check`) and installs a forward pre-hook on what it returns; the first
call with each new input signature traces that call's own inputs through the copy with
:func:`torch_tp.shapes.check_shapes`, before the forward runs and so before any collective,
and a plan the trace shows wrong is a ``ValueError`` on every rank. ``check_forward=False``
(per call) and ``TORCH_TP_FORWARD_CHECK=0`` (per process) turn it off;
``TORCH_TP_FORWARD_CHECK=strict`` (the test suite's) raises where the trace itself fails
instead of warning.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from torch_tp import _torch_compat as compat
from torch_tp import shapes
from torch_tp._torch_compat import StridedShard
from torch_tp.plan import PlanEntry
from torch_tp.style.base import uses_stock_forward

__all__ = ["FirstForwardCheck", "disable_overlapping_checks", "forward_check"]

# At most this many input signatures are checked per parallelize_module call, among its
# module's first _MAX_CALLS calls; then the hook goes (a loop whose every batch has a new
# length pays for eight traces, not for each; a decode loop, whose key-value cache the trace
# cannot take, stops paying for the hook).
_MAX_SIGNATURES = 8
_MAX_CALLS = 100
_ENV = "TORCH_TP_FORWARD_CHECK"
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
# every check not yet disabled, to disable those a later parallelize_module call overlaps
_CHECKS: weakref.WeakSet[FirstForwardCheck] = weakref.WeakSet()


class FirstForwardCheck:
    """The shape check of one :func:`~torch_tp.parallelize_module` call, run at the first
    call of its module with each new input signature (the shapes and dtypes of the tensors,
    the values of the rest; the first eight among the first hundred calls), before the
    forward and so before any collective.

    It traces that call's inputs through a meta copy of the module taken before the plan was
    applied (:func:`check_shapes`) and raises ``ValueError`` when a rank would compute a shape
    one device does not; the verdict depends only on the input shapes, which the ranks of a
    tensor-parallel group share, so every rank raises alike. Inputs the trace cannot take
    (an object such as a key-value cache) and a forward the meta device cannot run (shapes
    that depend on values) are let through unchecked.
    """

    def __init__(self, snapshot: nn.Module, plan: Any, degree: int, styles: dict[str, str]):
        self.snapshot, self.plan, self.degree, self.styles = snapshot, plan, degree, styles
        self.seen: set[tuple] = set()
        self.calls = 0
        self.root: weakref.ref[nn.Module] | None = None
        self.handle: Any = None

    def install(self, module: nn.Module) -> None:
        self.root = weakref.ref(module)
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)
        _CHECKS.add(self)

    def disable(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle = self.snapshot = None
        _CHECKS.discard(self)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or self.snapshot is None:
            return
        self.calls += 1
        if self.calls >= _MAX_CALLS:
            self.disable()
        key = _signature((args, kwargs))
        if key is None or key in self.seen:
            return
        self.seen.add(key)
        snapshot, plan = self.snapshot, self.plan
        if len(self.seen) >= _MAX_SIGNATURES:
            self.disable()
        try:
            with compat.without_global_module_hooks():
                problems = shapes.check_shapes(
                    snapshot, plan, self.degree, example_inputs=args, example_kwargs=kwargs
                )
        except shapes.ShapeCheckError:
            return  # the model itself cannot run on meta: nothing to tell of the plan
        except Exception as err:  # noqa: BLE001 - the check must never stop a model it misreads
            if os.environ.get(_ENV) == "strict":
                raise
            warnings.warn(
                f"torch_tp could not shape-check the first forward of {type(module).__name__} "
                f"under its plan ({type(err).__name__}: {shapes._short(err)}); it runs unchecked "
                f"(parallelize_module(..., check_forward=False) skips the check)",
                stacklevel=2,
            )
            return
        if problems:
            raise ValueError(self._message(module, problems))

    def _message(self, module: nn.Module, problems: list[shapes.ShapeProblem]) -> str:
        listed = "\n".join(f"  {p._described(self._styled(p.module))}" for p in problems)
        return (
            f"torch_tp's check of the first forward of {type(module).__name__} with these "
            f"inputs: under its plan, each of {self.degree} ranks would compute shapes one "
            "device does not, so the forward was not run (its input shapes were traced on the "
            f"meta device, as one device and as one rank):\n{listed}\nparallelize_module(..., "
            f"check_forward=False) or {_ENV}=0 turns this check off."
        )

    def _styled(self, path: str) -> str:
        """The style of the module at ``path``, or those of its planned children."""
        if path in self.styles:
            return self.styles[path]
        prefix = f"{path}." if path else ""
        children = [
            f"{p[len(prefix) :]}: {s}"
            for p, s in self.styles.items()
            if p.startswith(prefix) and "." not in p[len(prefix) :]
        ]
        return f"no style; planned inside it: {', '.join(children)}" if children else "no style"


def forward_check(
    module: nn.Module, plan: Any, entries: list[PlanEntry], degree: int
) -> FirstForwardCheck | None:
    """The first-forward check of a plan about to be applied to ``module`` (a meta copy of it
    taken now), or ``None`` where it cannot be checked: turned off by
    ``TORCH_TP_FORWARD_CHECK=0``, styles on a mesh of their own (N-D, context parallelism),
    PEFT adapters to host, a style that takes activations split over the sequence, a Linear
    or Embedding subclass with a forward of its own, a model that holds DTensors already
    (parallelized in parts by several calls) or that cannot be copied.

    Call :func:`disable_overlapping_checks` first."""
    if os.environ.get(_ENV, "1") in ("0", "off", "false"):
        return None
    for entry in entries:
        contract = getattr(entry.style, "contract", None)
        if entry.adapters is not None or contract is None:
            return None
        if getattr(contract, "mesh_ndim", 1) != 1 or getattr(contract, "mesh_dims", None):
            return None
        if _takes_split_activations(contract, entry) or _own_forward(entry.module):
            return None
    try:
        snapshot = shapes.meta_copy(module)
    except Exception:  # noqa: BLE001 - DTensors already, or a module deepcopy refuses
        return None
    styles = {e.path: type(e.style).__name__ for e in entries}
    return FirstForwardCheck(snapshot, plan, degree, styles)


def disable_overlapping_checks(module: nn.Module) -> None:
    """Disable the first-forward check of every earlier call that a plan applied to
    ``module`` overlaps (a module in, or around, this one): the plan now spans several calls,
    and no snapshot holds all of it."""
    for check in list(_CHECKS):
        root = check.root() if check.root is not None else None
        if root is None or root is module or _contains(root, module) or _contains(module, root):
            check.disable()


def _takes_split_activations(contract: Any, entry: PlanEntry) -> bool:
    """The style takes an input split over another dimension than the features (sequence
    parallelism, ``input_layouts=Shard(1)``). Such an input may come from outside the plan,
    each rank given its part: the trace, which reads the inputs it is given as one device's,
    cannot tell, so such plans are not checked. So is a sharded input of the module the plan
    is applied to (the call's own inputs, then each rank's part) or of an embedding (ids)."""
    try:
        boundary = contract.inputs(entry.style, entry.module)
    except Exception:  # noqa: BLE001 - a module type the style refuses: validation says so
        return True
    if boundary is None:
        return False
    sharded = [
        layout.given
        for layout in (*boundary.args, *boundary.kwargs.values())
        if layout is not None and isinstance(layout.given, (Shard, StridedShard))
    ]
    # the module parallelized itself, or an embedding (whose ids have no feature dimension):
    # a shard of its input is a part of the data each rank was given, whatever its dim
    if entry.path == "" or isinstance(entry.module, nn.Embedding):
        return bool(sharded)
    return any(given.dim != -1 for given in sharded)


def _own_forward(module: nn.Module) -> bool:
    """A planned Linear or Embedding subclass with a forward of its own: it runs on DTensors,
    whose ops see whole shapes where the trace gives it this rank's part."""
    return isinstance(module, (nn.Linear, nn.Embedding)) and not uses_stock_forward(module)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(sub is inner for sub in outer.modules())


def _signature(value: Any) -> tuple | None:
    """A hashable key of ``value``'s tensors' shapes and dtypes and its other leaves' values;
    ``None`` if it holds a leaf the trace cannot take (an object: a cache, a custom class)."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype)
    if isinstance(value, _PLAIN):
        return ("v", type(value), value)
    if isinstance(value, dict):
        keys = tuple(sorted(value, key=str))
        parts = [_signature(value[k]) for k in keys]
    elif isinstance(value, (tuple, list)):
        keys, parts = (), [_signature(v) for v in value]
    else:
        return None
    if any(p is None for p in parts):
        return None
    return (type(value).__name__, keys, tuple(parts))
