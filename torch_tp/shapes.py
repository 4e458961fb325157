"""The shape check: a plan's model traced on the meta device as one device and as one rank.

A plan can be valid, name every module right, chain its layouts, and still compute something
else than one device: the model's own code reads a size from its input (nanoGPT's
``B, T, C = x.size()``) or from an attribute a style divided (``self.n_head``), and reshapes a
rank's shard with it. :func:`check_shapes` finds these before anything runs. It traces the
forward twice on the meta device (no process group, no memory for weights):

* as one device: a meta copy of the model, unchanged;
* as one rank of the plan: a meta copy with every change a style makes at apply time, as the
  styles' contracts (:class:`~torch_tp.contract.StyleContract`) declare them: each parameter
  at this rank's shard of its placement, the attributes the style sets (``AttentionHeads``'
  ``divide``), and each input and output of a planned module at the shape the style hands on
  (this rank's part of a local tensor; the whole shape of a DTensor, whose ops see it so).

A :class:`~torch.overrides.TorchFunctionMode` records every op of both traces with its
output shapes, the module it runs in and the user's source line (the innermost Python frame
outside torch and torch_tp), and the two records are paired op by op. A rank's tensor may
differ from one device's in one dimension only, divided by the degree (heads, features, the
sequence under sequence parallelism); any other shape, or a rank trace that raises, is a
:class:`ShapeProblem`. Only the first op of a chain of wrong shapes is reported.

Models that read values run too: ``.item()``, ``bool()`` and the like on a meta tensor give
``1`` (an int), ``1.0`` (a float) or ``False`` in both traces alike, and a CPU tensor that
meets a meta tensor in an op (a scalar a forward makes with ``torch.tensor``) is moved to
meta. A forward whose shapes depend on values (``nonzero``, ``masked_select``) cannot be
traced on meta; :class:`ShapeCheckError` then says where and why.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from torch_tp import _torch_compat as compat
from torch_tp._repeats import Replays, repeated_blocks
from torch_tp._torch_compat import StridedShard, tree_leaves
from torch_tp.contract import Layout
from torch_tp.plan import PlanEntry, planned_placements, resolve_plan
from torch_tp.plan_checks import refuse_multi_dimensional
from torch_tp.runtime import normalize
from torch_tp.style.base import (
    LayoutsDoNotChain,
    ParallelStyle,
    planning,
    short_repr,
    stock_projection,
    uses_stock_forward,
)

__all__ = ["ShapeCheckError", "ShapeProblem", "check_shapes"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeProblem:
    """One place where a rank of the plan computes a shape one device would not.

    Attributes:
        module (str): the path of the module the op runs in (``""``: the root module).
        source (str, optional): the user's source line, ``file:line``.
        op (str, optional): the op (``"view"``); ``None`` when the code itself raised (an
            ``assert``).
        expected (tuple, optional): the single-device shape (of the op's output; for an op
            that raises on the rank, of what it gives on one device).
        found (tuple, optional): the rank's shape (of the op's output; for an op that
            raises, of its input).
        message (str): what is wrong, in words.
    """

    module: str
    source: str | None
    op: str | None
    expected: Shape | None
    found: Shape | None
    message: str

    def __str__(self) -> str:
        return self._described()

    def _described(self, style: str | None = None) -> str:
        """The problem in words; ``style``, when given, in parentheses after the module."""
        where = repr(self.module) if self.module else "the root module"
        styled = f" ({style})" if style is not None else ""
        at = f" at {self.source}" if self.source else ""
        return f"{where}{styled}{at}: {self.message}"


class ShapeCheckError(RuntimeError):
    """The model cannot be traced on the meta device as one device, so no plan can be checked
    (not a problem of the plan): the message names the op, the module, the source line and
    why."""


def check_shapes(
    module: nn.Module,
    plan: ParallelStyle | Mapping[str, ParallelStyle | str],
    degree: int,
    *,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> list[ShapeProblem]:
    """Trace ``module`` on the meta device as one device and as one rank of ``plan`` over
    ``degree`` ranks, and return where their shapes disagree.

    ``module`` is left as it is (both traces run on meta copies of it; it may be on any
    device). Nothing is communicated and no process group is needed.

    Args:
        module (:class:`nn.Module`): the model, before it is parallelized.
        plan: the plan, as for :func:`torch_tp.parallelize_module`.
        degree (int): the number of ranks (the tensor-parallel mesh's size).

    Keyword Args:
        example_inputs (optional): the forward's inputs: a tensor, a tuple of positional
            inputs or a dict of keyword inputs (tensors on any device; only their shapes and
            dtypes are used). Default: token ids of shape ``(2, 8)``, unless
            ``example_kwargs`` are given.
        example_kwargs (Mapping[str, Any], optional): keyword inputs, beside positional
            ``example_inputs``.

    Returns:
        The problems, in the order the forward meets them (empty: every rank's shapes are
        one device's with at most the planned dimension divided by ``degree``).

    Raises:
        ValueError: ``degree`` is not a positive int, or the plan does not apply to the
            model at this degree (as :func:`torch_tp.parallelize_module` would refuse it).
        ShapeCheckError: the model's forward fails on the meta device as one device.

    Example::
        >>> import torch
        >>> from torch_tp.models import Llama, LlamaConfig
        >>> from torch_tp.plans.llama import llama_plan
        >>> model = Llama(LlamaConfig(dim=64, n_layers=1, n_heads=4, vocab_size=64))
        >>> check_shapes(model, llama_plan(), 2, example_inputs=torch.zeros(2, 8, dtype=torch.long))
        []
    """
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"degree must be a positive int, found {short_repr(degree)}")
    args, kwargs = _inputs(example_inputs, example_kwargs)
    # each repeated layer traced once: the answer when it finds nothing; otherwise every op
    # is traced, so that what is reported (and the error) is the whole model's
    repeats = repeated_blocks(module, {id(e.module): e.style for e in _entries(module, plan)})
    if repeats:
        problems = _traced(module, plan, degree, args, kwargs, repeats)
        if problems == []:
            return problems
    problems = _traced(module, plan, degree, args, kwargs, {})
    if problems is None:
        # the forward failed as one device: traced again to report it
        _traced(module, plan, degree, args, kwargs, {}, raise_single=True)
    return [_with_fix(problem, module, degree) for problem in problems or []]


def _traced(
    module: nn.Module,
    plan: Any,
    degree: int,
    args: tuple,
    kwargs: dict,
    repeats: dict[str, str],
    raise_single: bool = False,
) -> list[ShapeProblem] | None:
    """Both traces and their problems, each block in ``repeats`` replayed from its first
    sibling where its inputs are alike (``None``: the single-device forward failed; with
    ``raise_single``, :class:`ShapeCheckError` says why)."""
    rank_model = meta_copy(module)
    rank_entries = _entries(rank_model, plan)
    refuse_multi_dimensional(rank_entries, "check_shapes")
    _check_applies(rank_model, rank_entries, degree)

    single = _Tracer(degree, rank=False, repeats=repeats)
    single_model = meta_copy(module)
    single_entries = _entries(single_model, plan)
    _stock_forwards(single_model, single_entries)
    error = single.run(single_model, single_entries, args, kwargs)
    if error is not None:
        if raise_single:
            raise ShapeCheckError(single.cannot_trace(type(module).__name__, error)) from error
        return None

    rank = _Tracer(degree, rank=True, repeats=repeats)
    _stock_forwards(rank_model, rank_entries)
    _as_one_rank(rank_model, rank_entries, degree, rank.uneven)
    error = rank.run(rank_model, rank_entries, args, kwargs)
    problems = _pair(single, rank, degree)
    if error is not None:
        problems.append(_failure(single, rank, error, degree))
    return problems


# ------------------------------------------------------------------------------------------
# The model as one rank sees it
# ------------------------------------------------------------------------------------------


def _inputs(example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> tuple[tuple, dict]:
    kwargs = dict(example_kwargs or {})
    if example_inputs is None and not kwargs:
        example_inputs = torch.zeros(2, 8, dtype=torch.long)
    if example_inputs is None:
        args = ()
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), {**example_inputs, **kwargs}
    elif isinstance(example_inputs, tuple):
        args = example_inputs
    else:
        args = (example_inputs,)
    return _map(_to_meta, args), _map(_to_meta, kwargs)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
    return value


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts."""
    if isinstance(value, tuple) and type(value) is not tuple and hasattr(value, "_fields"):
        return type(value)(*(_map(fn, v) for v in value))  # a named tuple
    if isinstance(value, (tuple, list)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (no memory)."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if isinstance(tensor, DTensor):
            raise ValueError(
                "check_shapes takes a model before it is parallelized; it holds DTensors"
            )
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    for sub in module.modules():  # tensors kept as attributes (a forward's cached aux loss)
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value.detach(), device="meta")
    return copy.deepcopy(module, memo)


def _entries(model: nn.Module, plan: Any) -> list[PlanEntry]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # keys that match nothing: not a shape problem
        return resolve_plan(model, plan, strict=False)


class MeshOfSize:
    """What a style's ``_validate`` may ask of the mesh, with no process group: its size."""

    ndim = 1

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self, mesh_dim: int | None = None) -> int:
        return self.n


def _check_applies(model: nn.Module, entries: list[PlanEntry], n: int) -> None:
    refused = []
    with planning(model, frozenset(id(e.module) for e in entries)):
        for entry in entries:
            try:
                entry.style._validate(entry.module, MeshOfSize(n))
            except (NotImplementedError, ValueError, TypeError) as err:
                refused.append(f"{entry.path!r} ({type(entry.module).__name__}): {err}")
            except Exception:  # noqa: BLE001 - a user style that needs a real mesh
                pass
    if refused:
        raise ValueError(
            f"the plan does not apply at degree {n}, so its shapes cannot be checked: "
            + "; ".join(refused)
        )


def _shard_dim(placement: Placement | None, ndim: int) -> int | None:
    """The dimension ``placement`` splits (``None``: it splits none)."""
    if isinstance(placement, (Shard, StridedShard)):
        return normalize(placement, ndim).dim
    return None


def _local(
    shape: Shape, placement: Placement | None, n: int, uneven: dict[int, int] | None = None
) -> Shape:
    """This rank's part of a tensor of ``shape`` (rank 0's: the largest, as torch.chunk).
    A size that does not divide is recorded in ``uneven`` (part -> whole)."""
    dim = _shard_dim(placement, len(shape))
    if dim is None:
        return tuple(shape)
    part = math.ceil(shape[dim] / n)
    if uneven is not None and shape[dim] % n:
        uneven[part] = shape[dim]
    return tuple(part if d == dim else s for d, s in enumerate(shape))


def _whole(
    shape: Shape, placement: Placement | None, n: int, uneven: dict[int, int] | None = None
) -> Shape:
    """The whole tensor whose part of ``shape`` a rank holds: even, unless the part is one
    of an uneven size sharded before (a vocabulary of 1001 over two ranks: 501 of 1001)."""
    dim = _shard_dim(placement, len(shape))
    if dim is None:
        return tuple(shape)
    whole = (uneven or {}).get(shape[dim], shape[dim] * n)
    return tuple(whole if d == dim else s for d, s in enumerate(shape))


def _stock_forwards(model: nn.Module, entries: list[PlanEntry]) -> None:
    """A Linear, Conv1D or Embedding with torch's (or transformers') own forward, under a
    style that computes on local shards, runs the style's computation instead, as after
    ``parallelize_module`` (not its own forward, which may read sizes from attributes, as
    Conv1D's ``nf``); in both traces, so that their ops pair."""
    with planning(model, frozenset(id(e.module) for e in entries)):
        for entry in entries:
            if entry.adapters is not None:
                # PEFT's LoRA layer: its adapter adds a term of its base layer's shape,
                # computed by the base's style (torch_tp.style.adapters): the base alone here
                entry.adapters.forward = entry.module.__call__
            contract = getattr(entry.style, "contract", None)
            if contract is None or not uses_stock_forward(entry.module):
                continue
            meta_output = getattr(entry.style, "_meta_output", None)
            if contract.local_forward(entry.style, entry.module) and meta_output is None:
                entry.module.forward = _local_computation(entry.style, entry.module)


def _local_computation(style: Any, module: nn.Module) -> Callable:
    def forward(input: torch.Tensor) -> torch.Tensor:
        if isinstance(module, nn.Embedding):
            return torch.nn.functional.embedding(input, module.weight)
        return stock_projection(style, module, input, module.weight, module.bias)

    return forward


def _as_one_rank(
    model: nn.Module, entries: list[PlanEntry], n: int, uneven: dict[int, int]
) -> None:
    """Make the meta ``model`` what one rank holds after ``parallelize_module``: its
    parameters at their shards' shapes, and the attributes the styles set."""
    local: dict[int, nn.Parameter] = {}
    with planning(model, frozenset(id(e.module) for e in entries)):
        for entry in entries:
            for name, placement in planned_placements(entry).items():
                try:
                    param = entry.module.get_parameter(name)
                except AttributeError:
                    continue
                dim = _shard_dim(placement, param.ndim)
                if dim is None or id(param) in local:
                    continue
                shape = _local(tuple(param.shape), placement, n, uneven)
                meta = torch.empty(shape, dtype=param.dtype, device="meta")
                local[id(param)] = nn.Parameter(meta, param.requires_grad)
            rank_attributes = getattr(entry.style, "_rank_attributes", None)
            if rank_attributes is not None:
                for name, value in rank_attributes(entry.module, n).items():
                    setattr(entry.module, name, value)
    for sub in model.modules():  # tied weights: every owner gets the same shard
        params = compat.direct_parameters(sub)
        for name, param in list(params.items()):
            if param is not None and id(param) in local:
                params[name] = local[id(param)]


# ------------------------------------------------------------------------------------------
# The traces
# ------------------------------------------------------------------------------------------

# the frames of torch and torch_tp, and of code with no file: not the user's
_NOT_USER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep, "<")

# reading a value of a meta tensor: answered with a stand-in, alike in both traces
VALUE_READS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
}
# tests of meta tensors' values that answer a bool: answered so (nn.TransformerEncoder's
# check of its padding mask, before its inference fast path: not taken)
VALUE_TESTS = {
    test: False for test in (compat.nested_tensor_from_mask_left_aligned,) if test is not None
}
# ops whose output's shape depends on the input's values
_DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",
    "repeat_interleave",
    "where",
    "nonzero_static",
}


def _user_frame(frames: list[tuple[str, int]]) -> str | None:
    """``file:line`` of the innermost frame outside torch and torch_tp (``frames``
    innermost first)."""
    for filename, line in frames:
        if not filename.startswith(_NOT_USER):
            return f"{_shown(filename, os.getcwd())}:{line}"
    return None


@functools.lru_cache(maxsize=1024)
def _shown(filename: str, cwd: str) -> str:
    try:
        relative = os.path.relpath(filename, cwd)
    except ValueError:  # another drive
        return filename
    return filename if relative.startswith("..") else relative


def _stack_source() -> str | None:
    """The running op's :func:`_user_frame`, walking its stack only that far."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{_shown(frame.f_code.co_filename, os.getcwd())}:{frame.f_lineno}"


def _traceback_source(err: BaseException) -> str | None:
    frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(err.__traceback__)]
    return _user_frame(frames[::-1])


def _op_name(func: Callable) -> str:
    return getattr(func, "__name__", None) or str(func)


def _shapes(tensors: list[torch.Tensor]) -> list[Shape]:
    return [tuple(t.shape) for t in tensors]


@dataclass(eq=False)
class _Op:
    name: str
    module: str
    source: str | None
    inputs: list[Shape]
    outputs: list[Shape]
    in_ids: list[int]
    out_ids: list[int]

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.module


@dataclass(eq=False)
class _Failure:
    error: BaseException
    module: str
    op: str | None  # the op that raised (None: the code itself)
    inputs: list[Shape] = field(default_factory=list)


class _Recorder(TorchFunctionMode):
    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.tracer.call(func, args, kwargs or {})


class _Tracer:
    """One trace: every op with its shapes, module and source line."""

    def __init__(self, n: int, rank: bool, repeats: dict[str, str] | None = None) -> None:
        self.n = n
        self.rank = rank
        self.replays = Replays(repeats or {}, self._state, self._adopt, self._untraced)
        self.ops: list[_Op] = []
        self.scope: list[str] = [""]
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the trace runs
        # rank trace: tensors a DTensor would be, held at their whole shape (DTensor's ops
        # see that), with their placement
        self.dtensors: dict[int, Placement] = {}
        self.paused = 0
        self.running: tuple[str, list[Shape]] | None = None
        self.failure: _Failure | None = None
        self.faked: list[str] = []
        # sizes that do not divide by n, by the part rank 0 holds (501 -> 1001 over 2 ranks)
        self.uneven: dict[int, int] = {}

    # -- ops ---------------------------------------------------------------------------------

    def call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if self.paused:
            return func(*args, **kwargs)
        if func in VALUE_READS and args and isinstance(args[0], torch.Tensor):
            if args[0].is_meta:
                return self.stand_in(func, args[0])
        if func in VALUE_TESTS and any(
            isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs))
        ):
            self.faked.append(f"{_op_name(func)} at {_stack_source() or 'an unknown line'}")
            return VALUE_TESTS[func]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in inputs) and not all(t.is_meta for t in inputs):
            # a CPU tensor meets meta ones (a scalar the forward made, a CPU buffer): on meta
            args, kwargs = on_meta((args, kwargs))
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.running = (_op_name(func), _shapes(inputs))
        out = func(*args, **kwargs)
        self.running = None
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs:
            self.record(func, inputs, outputs)
        return out

    def record(self, func: Callable, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        self.ops.append(
            _Op(
                _op_name(func),
                self.scope[-1],
                _stack_source(),
                _shapes(inputs),
                _shapes(outputs),
                [id(t) for t in inputs],
                [id(t) for t in outputs],
            )
        )
        self.alive += inputs + outputs
        if self.rank:
            placed = [(t, self.dtensors[id(t)]) for t in inputs if id(t) in self.dtensors]
            if placed:  # DTensor in, DTensor out
                t, placement = placed[0]
                for out in outputs:
                    if id(out) not in self.dtensors:
                        same = out.ndim == t.ndim
                        self.dtensors[id(out)] = placement if same else Replicate()

    def stand_in(self, func: Callable, t: torch.Tensor) -> Any:
        """What a value read of a meta tensor gives: 1, 1.0 or False."""
        self.faked.append(f"{_op_name(func)} at {_stack_source() or 'an unknown line'}")
        return meta_value(func, t)

    # -- the run -----------------------------------------------------------------------------

    def run(
        self, model: nn.Module, entries: list[PlanEntry], args: tuple, kwargs: dict
    ) -> BaseException | None:
        """Run the forward, recording it; the error it raised (``None``: it ran)."""
        handles: list[Any] = []
        entry_of = {id(e.module): e for e in entries}
        for path, sub in model.named_modules():
            handles.append(sub.register_forward_pre_hook(self._enter(path)))
            handles.append(sub.register_forward_hook(self._leave))
            entry = entry_of.get(id(sub))
            contract = None if entry is None else getattr(entry.style, "contract", None)
            meta_output = None if entry is None else getattr(entry.style, "_meta_output", None)
            if meta_output is not None:
                # a forward that reads its inputs' values (routing): its output's shapes
                sub.forward = _meta_forward(meta_output, sub)
            self.replays.install(path, sub)
            if contract is not None and self.rank:
                handles.append(
                    sub.register_forward_pre_hook(self._inputs_of(entry), with_kwargs=True)
                )
                handles.append(sub.register_forward_hook(self._outputs_of(entry)))
        try:
            with (
                warnings.catch_warnings(),
                torch.enable_grad(),  # as training runs (no inference-only fast paths)
                planning(model, frozenset(entry_of)),
                _Recorder(self),
            ):
                warnings.simplefilter("ignore")
                model(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - reported with where it happened
            op, inputs = self.running if self.running is not None else (None, [])
            self.failure = _Failure(err, self.scope[-1], op, inputs)
            return err
        finally:
            for handle in handles:
                handle.remove()
        return None

    def _state(self, t: torch.Tensor) -> Placement | None:
        return self.dtensors.get(id(t))

    def _adopt(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` replays ``old``: it stands for what ``old`` stood for."""
        if id(old) in self.dtensors:
            self.dtensors[id(new)] = self.dtensors[id(old)]
        self.alive.append(new)

    def _untraced(self, make: Callable[[], Any]) -> Any:
        self.paused += 1
        try:
            return make()
        finally:
            self.paused -= 1

    def _enter(self, path: str) -> Callable:
        def enter(module: nn.Module, args: tuple) -> None:
            self.scope.append(path)

        return enter

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.scope.pop()

    # -- what a style hands on, as one rank --------------------------------------------------

    def _inputs_of(self, entry: PlanEntry) -> Callable:
        def inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            contract = entry.style.contract
            boundary = contract.inputs(entry.style, module)
            if boundary is None:
                return args, kwargs
            # a module computing on this rank's data gets it as a local tensor's shape
            local = bool(contract.local_forward(entry.style, module))
            new_args = tuple(
                self.cross(value, boundary.args[i] if i < len(boundary.args) else None, local)
                for i, value in enumerate(args)
            )
            new_kwargs = {
                k: self.cross(v, boundary.kwargs.get(k), local) for k, v in kwargs.items()
            }
            return new_args, new_kwargs

        return inputs

    def _outputs_of(self, entry: PlanEntry) -> Callable:
        def outputs(module: nn.Module, args: tuple, output: Any) -> Any:
            contract = entry.style.contract
            boundary = contract.outputs(entry.style, module)
            if boundary is None:
                return output
            layouts = boundary.args
            # computed on this rank's data: this rank's part of the output's given layout
            computed = bool(contract.local_forward(entry.style, module))
            if isinstance(output, torch.Tensor):
                return self.cross(output, layouts[0] if layouts else None, computed=computed)
            if isinstance(output, tuple):
                values = [
                    self.cross(v, layouts[i] if i < len(layouts) else None, computed=computed)
                    for i, v in enumerate(output)
                ]
                if type(output) is not tuple and hasattr(output, "_fields"):
                    return type(output)(*values)
                return type(output)(values)
            return output

        return outputs

    def cross(
        self, t: Any, layout: Layout | None, local: bool = False, computed: bool = False
    ) -> Any:
        """``t`` as the receiver gets it when it crosses a boundary laid out ``layout``.

        ``local``: the receiver computes on this rank's data (a ``local_forward`` module),
        whatever ``layout.local`` says. ``computed``: ``t`` is the output of such a module,
        this rank's part of ``layout.given``."""
        if layout is None or layout.given is None or not isinstance(t, torch.Tensor):
            return t
        ndim = t.ndim
        source = None if computed else self.dtensors.get(id(t))
        if source is not None:  # a DTensor: its whole shape, moved where the style says
            whole = tuple(t.shape)
            target = source if layout.to is None else layout.to
        else:  # a local tensor: this rank's part of the layout the style declares
            whole = _whole(tuple(t.shape), layout.given, self.n, self.uneven)
            target = layout.given if layout.to is None else layout.to
        if layout.local or local:
            shape, state = _local(whole, target, self.n, self.uneven), None
        else:
            shape, state = whole, normalize(target, ndim)
        if shape == tuple(t.shape) and state == self.dtensors.get(id(t)):
            return t
        self.paused += 1
        try:
            new = torch.empty(shape, dtype=t.dtype, device="meta")
        finally:
            self.paused -= 1
        if state is not None:
            self.dtensors[id(new)] = state
        self.alive.append(new)
        return new

    # -- when the single-device trace fails --------------------------------------------------

    def cannot_trace(self, model_name: str, err: BaseException) -> str:
        failure = self.failure
        assert failure is not None  # run() sets it with the error  # noqa: S101
        where = repr(failure.module) if failure.module else "the root module"
        source = _traceback_source(err)
        at = f" at {source}" if source else ""
        what = f"{failure.op} of {_listed(failure.inputs)}" if failure.op else "its code"
        why = ""
        if failure.op in _DATA_DEPENDENT:
            why = (
                f" {failure.op}'s output shape depends on the values of its input, which "
                "meta tensors do not hold."
            )
        elif failure.op == "__getitem__" and "nonzero" in str(err):
            why = (
                " Indexing with a boolean mask gives a shape that depends on the mask's "
                "values, which meta tensors do not hold."
            )
        if self.faked:
            why += (
                f" The forward read values of meta tensors ({', '.join(self.faked[:3])}), "
                "taken as 1 (False for a bool) on the meta device."
            )
        return (
            f"check_shapes cannot run {model_name} on the meta device: {what} in {where}{at} "
            f"raised {type(err).__name__}: {_short(err).rstrip('.')}.{why} Its plan cannot "
            "be checked this way; check it with torch_tp.testing.check_parity instead"
        )


def _meta_forward(meta_output: Callable, module: nn.Module) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return meta_output(module, args, kwargs)

    return forward


def meta_value(func: Callable, t: torch.Tensor) -> Any:
    """The stand-in for a value read (``func`` in :data:`VALUE_READS`) of the meta tensor
    ``t``: 1, 1.0 or ``False`` (a list of them for ``tolist``), the same in every trace, so
    that a forward that reads a value (``.item()``, ``if mask.any():``) can be traced."""
    value: Any
    if t.dtype == torch.bool:
        value = False
    elif t.is_floating_point() or t.is_complex():
        value = 1.0
    else:
        value = 1
    if func is torch.Tensor.tolist:
        if t.numel() > 1 << 20:
            raise RuntimeError(f"tolist of a meta tensor of shape {tuple(t.shape)}")
        return torch.full(t.shape, value).tolist()
    if func is torch.Tensor.__float__:
        return float(value)
    if func in (torch.Tensor.__int__, torch.Tensor.__index__):
        return int(value)
    return value


def on_meta(value: Any) -> Any:
    """``value`` with every tensor in it (nested tuples, lists and dicts) that is not on
    the meta device moved there: a CPU scalar the forward made, meeting meta activations."""
    return _map(_one_on_meta, value)


def _one_on_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) and not value.is_meta else value


def _short(err: BaseException) -> str:
    """The first sentence of ``err``'s message (at most about 300 characters)."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    end = text.find(". ", 0, 300)
    return text[: end + 1] if end > 0 else text[:300]


def _listed(shapes: list[Shape]) -> str:
    return " and ".join(str(s) for s in shapes) if shapes else "no tensor"


# ------------------------------------------------------------------------------------------
# Pairing the traces
# ------------------------------------------------------------------------------------------


def _fits(single: Shape, rank: Shape, n: int) -> bool:
    """``rank`` is ``single`` with at most one dimension divided by ``n``."""
    if len(single) != len(rank):
        return False
    differ = [(s, r) for s, r in zip(single, rank, strict=True) if s != r]
    if not differ:
        return True
    if len(differ) > 1:
        return False
    s, r = differ[0]
    return r in (s // n, math.ceil(s / n))


_VIEWS = {"view", "reshape", "unflatten"}


def _splits_inner(one: _Op, ours: _Op, n: int) -> bool:
    """A view that splits a rank's divided dimension into several (features into heads and
    head dims) and divides the innermost of them: a rank's block of features viewed as every
    head with a part of each (4 heads of 4 where one device has 4 heads of 8 and a rank
    should hold 2 of them)."""
    if one.name not in _VIEWS or not one.inputs or not ours.inputs or not one.outputs:
        return False
    before, after = one.inputs[0], one.outputs[0]
    local_before, local_after = ours.inputs[0], ours.outputs[0]
    if len(after) <= len(before) or len(local_before) != len(before):
        return False
    divided_in = [d for d, (s, r) in enumerate(zip(before, local_before, strict=True)) if s != r]
    divided_out = [e for e, (s, r) in enumerate(zip(after, local_after, strict=False)) if s != r]
    if len(divided_in) != 1 or len(divided_out) != 1:
        return False
    d, e = divided_in[0], divided_out[0]
    start, stop = math.prod(before[:d]), math.prod(before[: d + 1])
    group = [
        i
        for i in range(len(after))
        if math.prod(after[:i]) >= start and math.prod(after[: i + 1]) <= stop
    ]
    return len(group) > 1 and e == group[-1] and after[e] > 1


def _pair(single: _Tracer, rank: _Tracer, n: int) -> list[ShapeProblem]:
    """The first wrong shape of each chain of wrong shapes, in the rank trace's order."""
    a = [op.key for op in single.ops]
    b = [op.key for op in rank.ops]
    if a == b:
        pairs = list(zip(single.ops, rank.ops, strict=True))
    else:
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        pairs = [
            (single.ops[block.a + i], rank.ops[block.b + i])
            for block in matcher.get_matching_blocks()
            for i in range(block.size)
        ]
    problems = []
    tainted: set[int] = set()
    for one, ours in pairs:
        if tainted.intersection(ours.in_ids):
            tainted.update(ours.out_ids)
            continue
        inner = _splits_inner(one, ours, n)
        for expected, found in zip(one.outputs, ours.outputs, strict=False):
            if inner or not _fits(expected, found, n):
                problems.append(
                    ShapeProblem(
                        ours.module,
                        ours.source,
                        ours.name,
                        expected,
                        found,
                        f"{ours.name} gives {found} on each of {n} ranks where one device "
                        f"gives {expected} (from {_listed(ours.inputs)}; one device: "
                        f"{_listed(one.inputs)}): "
                        + (
                            "a rank's features are split with the innermost dimension "
                            "divided (a part of every head) rather than the outer one (its "
                            "own heads)"
                            if inner
                            else "a rank's tensor may differ from one device's only in the "
                            f"planned dimension, divided by {n}"
                        ),
                    )
                )
                tainted.update(ours.out_ids)
                break
    return problems


def _counterpart(single: _Tracer, rank: _Tracer, key: tuple[str, str]) -> _Op | None:
    """The single-device op that the rank's next op with ``key`` would be paired with."""
    seen = sum(1 for op in rank.ops if op.key == key)
    same = [op for op in single.ops if op.key == key]
    return same[seen] if seen < len(same) else None


def _failure(single: _Tracer, rank: _Tracer, err: BaseException, n: int) -> ShapeProblem:
    failure = rank.failure
    assert failure is not None  # noqa: S101 - run() sets it with the error
    source = _traceback_source(err)
    # a style's own account of layouts that do not chain holds the fix: kept whole
    error = (
        f"RuntimeError: {err}"
        if isinstance(err, LayoutsDoNotChain)
        else (f"{type(err).__name__}: {_short(err)}")
    )
    if failure.op is not None:
        one = _counterpart(single, rank, (failure.op, failure.module))
        expected = one.outputs[0] if one is not None and one.outputs else None
        found = failure.inputs[0] if failure.inputs else None
        on_one = (
            f"; on one device it takes {_listed(one.inputs)} and gives {_listed(one.outputs)}"
            if one is not None
            else ""
        )
        message = f"{failure.op} of {_listed(failure.inputs)} raises on a rank ({error}){on_one}"
        return ShapeProblem(failure.module, source, failure.op, expected, found, message)
    # the code itself raised (an assert on a size): the last op before it, as context
    last = next((op for op in reversed(rank.ops) if op.module == failure.module), None)
    expected = found = None
    context = ""
    if last is not None:
        index = rank.ops.index(last)
        seen = sum(1 for op in rank.ops[:index] if op.key == last.key)
        same = [op for op in single.ops if op.key == last.key]
        one = same[seen] if seen < len(same) else None
        found = last.inputs[0] if last.inputs else None
        if one is not None and one.inputs:
            expected = one.inputs[0]
        context = (
            f"; the last op before it, {last.name} at {last.source}, takes {found} on a rank"
            + (f" and {expected} on one device" if expected is not None else "")
        )
    message = f"the forward raises on a rank of {n} ({error}){context}"
    return ShapeProblem(failure.module, source, None, expected, found, message)


# ------------------------------------------------------------------------------------------
# The fix a problem suggests
# ------------------------------------------------------------------------------------------

_RESHAPES = frozenset({"view", "reshape", "unflatten", "_unsafe_view", "expand"})


def _with_fix(problem: ShapeProblem, model: nn.Module, n: int) -> ShapeProblem:
    """``problem`` with the likely fix added to its message, where one can be read."""
    if problem.op not in _RESHAPES or problem.expected is None or problem.found is None:
        return problem
    try:
        module = model.get_submodule(problem.module)
    except AttributeError:
        return problem
    pairs = zip(problem.expected, problem.found, strict=False)
    common = next((i for i, (one, ours) in enumerate(pairs) if one != ours), len(problem.found))
    fix = _head_count_fix(module, problem.module, set(problem.expected[common:]), n, problem.op)
    if fix is None:
        return problem
    message = f"{problem.message}. Likely fix: {fix}"
    return ShapeProblem(
        problem.module, problem.source, problem.op, problem.expected, problem.found, message
    )


def _head_count_fix(module: nn.Module, path: str, sizes: set, n: int, op: str) -> str | None:
    """The fix of a view one of whose ``sizes`` is ``module``'s count of the model's heads."""
    counts = [
        name
        for name, value in _int_attributes(module)
        if value in sizes
        and value % n == 0
        and "head" in name.lower()
        and not any(word in name.lower() for word in ("dim", "size"))
    ]
    if not counts:
        return None
    name = counts[0]
    if "." in name:  # read from the config, which every module shares: not to be divided
        return (
            f"the head count is read from {name}, the whole model's: pass -1 in its place "
            f"({op}(..., -1, head_dim)) so that each rank's own heads fill it"
        )
    return (
        f"the head count is read from {name} ({getattr(module, name)}), the whole "
        f"model's: pass -1 in its place ({op}(..., -1, head_dim)), or plan "
        f"{path!r} with AttentionHeads({name!r}, divide=({name!r},)) so that "
        f"each rank's {name} is its own {getattr(module, name) // n}"
    )


def _int_attributes(module: nn.Module) -> list[tuple[str, int]]:
    """The module's public int attributes, then its config's (``"config.name"``)."""
    owners = [("", module), ("config.", getattr(module, "config", None))]
    return [
        (prefix + name, value)
        for prefix, owner in owners
        for name, value in getattr(owner, "__dict__", {}).items()
        if isinstance(value, int) and not isinstance(value, bool) and not name.startswith("_")
    ]
