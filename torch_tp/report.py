"""The dry-run report: what a plan costs and what is wrong with it, before anything runs.

:func:`plan_report` takes a model built on the meta device, a plan and a TP degree, and needs
no process group and no memory for weights. It reports, per plan key, the parameters' global
and per-rank shapes and bytes; the collectives one training step (forward and backward of the
model) issues, by kind, count and bytes; and the problems a plan has: dimensions that do not
divide by the TP degree, ``nn.Linear``/``nn.Embedding`` layers left unsharded, and layouts that
do not chain from one module to the next.

How the collectives are predicted: the *unparallelized* model runs once on meta tensors, with
hooks on the plan's modules and a :class:`~torch.overrides.TorchFunctionMode` that follows every
tensor between them. Each tensor is given the form it would have in the parallelized model (a
local tensor of a known layout, or a DTensor), and each style's rules (its input layout, the
layout it computes with, its output layout, whether it hands on a local tensor) say which
collective it issues in the forward and which its backward will issue. Those rules mirror
:mod:`torch_tp.style` exactly: for instance the column-parallel layers that read one replicated
DTensor made by a ``PrepareModuleInput(use_local_output=False)`` share one backward reduction,
and the partial gradients of replicated parameters used on shards (sequence-parallel norms, the
bias of a row-parallel layer with a sharded output) are summed by one coalesced all-reduce at the
end of the backward.

Example::

    >>> import torch
    >>> from torch_tp.models import Llama, LlamaConfig
    >>> from torch_tp.plans.llama import llama_plan
    >>> with torch.device("meta"):
    ...     model = Llama(LlamaConfig(n_layers=2))
    >>> report = plan_report(model, llama_plan(), 2, batch_size=2, seq_len=16)
    >>> report.counts("forward")
    {'all_reduce': 5, 'all_gather_into_tensor': 1}
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from torch_tp import _names
from torch_tp._layouts import normalize
from torch_tp.contract import Boundary, Layout
from torch_tp.plan import (
    PlanEntry,
    parameter_owners,
    planned_placements,
    resolve_plan,
    tied_parameters,
)
from torch_tp.style import ParallelStyle

__all__ = ["Collective", "ParameterGroup", "PlanReport", "Problem", "plan_report"]

FORWARD, BACKWARD = "forward", "backward"
# where the end-of-backward reduction of partial parameter gradients is reported
REPLICATED_PARAMETERS = "(replicated parameters)"
_SEVERITIES = ("error", "warning", "note")


# ------------------------------------------------------------------------------------------
# What the report holds
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterGroup:
    """Parameters with one name pattern, placement and shape (the layers of a wildcard key).

    Attributes:
        name: the plan key (or the module path, with layer numbers as ``*``) and the
            parameter name, e.g. ``"layers.*.attention.wq.weight"``.
        count: how many parameters the group holds.
        placement: ``"Shard(0)"``, ``"Replicate()"`` (a DTensor), or ``None`` for a parameter
            no style touches (a plain tensor, whole on every rank).
        global_shape: the shape of one parameter.
        local_shape: the shape of its largest shard (``torch.chunk`` convention).
        itemsize: bytes per element.
    """

    name: str
    count: int
    placement: str | None
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    itemsize: int

    @property
    def global_bytes(self) -> int:
        """Bytes of the whole group, unsharded."""
        return self.count * math.prod(self.global_shape) * self.itemsize

    @property
    def local_bytes(self) -> int:
        """Bytes of the whole group on the rank with the largest shards."""
        return self.count * math.prod(self.local_shape) * self.itemsize


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind, issued ``count`` times per step at one plan key.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        kind: the functional collective, as :class:`~torch.distributed.tensor.debug.CommDebugMode`
            names it: ``"all_reduce"``, ``"all_gather_into_tensor"``,
            ``"reduce_scatter_tensor"``, or ``"shard_dim_alltoall"`` (a shard moved to another
            dimension; on CPU, DTensor does that with ``"all_gather_into_tensor"``).
        where: the plan key whose style issues it, or ``"(replicated parameters)"`` for the
            one coalesced all-reduce of partial parameter gradients.
        count: how many per step.
        bytes: the size of one: the whole tensor reduced or gathered (an all-gather's output,
            a reduce-scatter's input), with DTensor's padding of uneven shards.
    """

    phase: str
    kind: str
    where: str
    count: int
    bytes: int


@dataclass(frozen=True)
class Problem:
    """Something in the plan that fails, is wasteful, or could not be predicted.

    Attributes:
        severity: ``"error"`` (the plan fails or computes something else), ``"warning"``
            (it works, unevenly) or ``"note"``.
        where: the plan key or module path.
        message: what is wrong and how to fix it.
    """

    severity: str
    where: str
    message: str


@dataclass(frozen=True)
class PlanEntryRow:
    """One key of the plan: its style (name or short form) and how many modules it matched."""

    key: str
    style: str
    modules: int


@dataclass
class PlanReport:
    """The result of :func:`plan_report`; ``str(report)`` is a table.

    Attributes:
        model: the model's class name.
        num_parameters: the number of parameters of the model.
        tp_degree: the TP degree.
        batch_size: the batch size the collectives are sized for.
        seq_len: the sequence length the collectives are sized for.
        dtype: the parameters' floating-point dtype.
        plan: the plan's keys, styles and matched module counts.
        parameters: the parameters, grouped.
        collectives: the collectives of one step, grouped.
        problems: the problems found, errors first.
    """

    model: str
    num_parameters: int
    tp_degree: int
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    plan: list[PlanEntryRow]
    parameters: list[ParameterGroup]
    collectives: list[Collective]
    problems: list[Problem] = field(default_factory=list)

    @property
    def per_rank_bytes(self) -> int:
        """Parameter bytes on the rank with the largest shards."""
        return sum(group.local_bytes for group in self.parameters)

    @property
    def unsharded_bytes(self) -> int:
        """Parameter bytes of the whole model."""
        return sum(group.global_bytes for group in self.parameters)

    @property
    def errors(self) -> list[Problem]:
        """The problems of severity ``"error"``."""
        return [p for p in self.problems if p.severity == "error"]

    def counts(self, phase: str | None = None) -> dict[str, int]:
        """Collectives per kind, in one phase (``"forward"``/``"backward"``) or in both."""
        counts: Counter[str] = Counter()
        for c in self.collectives:
            if phase is None or c.phase == phase:
                counts[c.kind] += c.count
        return dict(counts)

    def bytes(self, phase: str | None = None) -> dict[str, int]:
        """Bytes per kind of collective, in one phase or in both."""
        total: Counter[str] = Counter()
        for c in self.collectives:
            if phase is None or c.phase == phase:
                total[c.kind] += c.count * c.bytes
        return dict(total)

    def __str__(self) -> str:
        lines = [
            f"Plan report: {self.model}, {_count(self.num_parameters)} parameters, "
            f"TP degree {self.tp_degree}, batch {self.batch_size} x {self.seq_len} tokens, "
            f"{str(self.dtype).removeprefix('torch.')}",
            "",
            "Plan",
        ]
        lines += _table(
            ["key", "modules", "style"],
            [[row.key or '""', str(row.modules), row.style] for row in self.plan],
            right={1},
        )
        lines += ["", "Parameters (per rank: the largest shard, torch.chunk convention)"]
        rows = [
            [
                g.name,
                str(g.count),
                g.placement or "-",
                _shape(g.global_shape),
                _shape(g.local_shape),
                _size(g.local_bytes),
                _size(g.global_bytes),
            ]
            for g in self.parameters
        ]
        share = self.per_rank_bytes / self.unsharded_bytes if self.unsharded_bytes else 1.0
        rows.append(
            [
                f"total per rank ({share:.1%} of unsharded)",
                str(sum(g.count for g in self.parameters)),
                "",
                "",
                "",
                _size(self.per_rank_bytes),
                _size(self.unsharded_bytes),
            ]
        )
        lines += _table(
            ["parameter", "count", "placement", "global", "per rank", "bytes/rank", "unsharded"],
            rows,
            right={1, 5, 6},
        )
        lines += [
            "",
            f"Collectives per step (model forward and backward, batch {self.batch_size} x "
            f"{self.seq_len}; the loss is not included)",
        ]
        rows = []
        for phase in (FORWARD, BACKWARD):
            mine = [c for c in self.collectives if c.phase == phase]
            for c in mine:
                rows.append(
                    [
                        phase,
                        c.kind,
                        str(c.count),
                        _size(c.bytes),
                        _size(c.count * c.bytes),
                        c.where or '""',
                    ]
                )
            count = sum(c.count for c in mine)
            total = sum(c.count * c.bytes for c in mine)
            rows.append([phase, "total", str(count), "", _size(total), ""])
        lines += _table(
            ["pass", "collective", "count", "bytes each", "bytes total", "from"],
            rows,
            right={2, 3, 4},
        )
        lines += ["", "Problems"]
        if not self.problems:
            lines.append("  none found")
        for p in self.problems:
            lines.append(f"  {p.severity:<8} {p.where or '(root)'}: {p.message}")
        return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return ("  " + "  ".join(cells)).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(str(s) for s in shape) if shape else "scalar"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# ------------------------------------------------------------------------------------------
# Layouts and the collectives that move between them
# ------------------------------------------------------------------------------------------


def _neg(layout: Placement, ndim: int) -> Placement:
    """``Shard(d)`` counted from the end, so that it survives ops that add leading dims."""
    if isinstance(layout, Shard) and layout.dim >= 0:
        return Shard(layout.dim - ndim)
    if isinstance(layout, _StridedShard) and layout.dim >= 0:
        return _StridedShard(layout.dim - ndim, split_factor=layout.split_factor)
    return layout


def _show(layout: Placement, ndim: int | None = None) -> str:
    if ndim is not None:
        layout = normalize(layout, ndim)
    return _names.placement_to_str(layout)


def _padded_numel(shape: Sequence[int], dim: int, n: int) -> int:
    """Elements of ``shape`` with ``dim`` padded to a multiple of ``n`` (DTensor pads uneven
    shards to the largest before an all-gather or a reduce-scatter)."""
    size = shape[dim]
    return math.prod(shape) // size * (math.ceil(size / n) * n) if size else 0


def _collective(
    src: Placement, dst: Placement, shape: Sequence[int], itemsize: int, n: int, cpu: bool
) -> tuple[str, int] | None:
    """The collective that moves a tensor of global ``shape`` from ``src`` to ``dst``."""
    ndim = len(shape)
    src, dst = normalize(src, ndim), normalize(dst, ndim)
    if src == dst or isinstance(src, Replicate):
        return None  # Replicate -> Shard is a local slice, Replicate -> Partial a local zeroing
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce", math.prod(shape) * itemsize
        if isinstance(dst, Shard):
            return "reduce_scatter_tensor", _padded_numel(shape, dst.dim, n) * itemsize
        return None
    if isinstance(src, Shard) and isinstance(dst, Shard) and not cpu:
        return "shard_dim_alltoall", math.prod(shape) * itemsize
    if isinstance(src, Shard):  # to Replicate; to another Shard on CPU (gloo has no all-to-all)
        return "all_gather_into_tensor", _padded_numel(shape, src.dim, n) * itemsize
    return None


# ------------------------------------------------------------------------------------------
# The trace
# ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Local:
    """A plain tensor in the parallel model: this rank's part of a tensor laid out ``layout``
    (``Shard`` dims counted from the end)."""

    layout: Placement
    origin: str
    ndim: int  # of the tensor the layout was given to, to show it as its producer made it


@dataclass(eq=False)
class _DTensorAfterOps:
    """A DTensor that went through code outside the plan's modules: placement unknown."""

    where: str


class _Broken:
    """Downstream of an error already reported: followed no further."""


@dataclass(eq=False)
class _Node:
    """A DTensor in the parallel model, and how it was made.

    Either ``parent`` is the DTensor it was redistributed from, or ``origin`` is the layout of
    the local tensor it was annotated from. ``grads`` are the placements its consumers give its
    gradient; the backward moves that gradient to the placement it came from.
    """

    placement: Placement
    shape: tuple[int, ...]
    itemsize: int
    requires_grad: bool
    where: str
    parent: _Node | None = None
    origin: Placement | None = None
    grads: list[Placement] = field(default_factory=list)


_State = _Local | _Node | _DTensorAfterOps | _Broken

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten}
# ops that cut a packed output into its parts: each part is a plain shard (q_r, k_r, v_r)
_SPLITS = {
    torch.split,
    torch.Tensor.split,
    torch.chunk,
    torch.Tensor.chunk,
    torch.tensor_split,
    torch.Tensor.tensor_split,
    torch.unbind,
    torch.Tensor.unbind,
}


def _generalize(path: str) -> str:
    """``layers.3.attention`` -> ``layers.*.attention``: one row for all layers."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


class _Trace:
    """Follows the unparallelized model's forward and predicts the parallel one's collectives."""

    def __init__(self, entries: list[PlanEntry], n: int, cpu: bool) -> None:
        self.n = n
        self.cpu = cpu
        self.entry_of = {id(e.module): e for e in entries}
        self.states: dict[int, _State] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the trace runs
        self.nodes: list[_Node] = []
        self.events: list[tuple[str, str, str, int]] = []
        self.partial_params: dict[int, nn.Parameter] = {}
        self.local_depth = 0
        self.scope: list[str] = []
        self.saved: list[list[tuple[torch.Tensor, _State | None]]] = []
        self.colwise_outputs: dict[int, str] = {}
        self.heads: dict[str, tuple[int, int]] = {}
        self.called: set[int] = set()
        # local tensors already entered into a column-parallel region, as at run time
        # (_layouts._shared_entry): q, k and v reading one tensor share one entry
        self.entered: set[tuple[int, Placement]] = set()
        self.problems: dict[tuple[str, str], Problem] = {}

    # -- bookkeeping -----------------------------------------------------------------------

    def problem(self, severity: str, where: str, message: str, dedupe: str = "") -> None:
        self.problems.setdefault((where, dedupe or message), Problem(severity, where, message))

    def set_state(self, tensor: torch.Tensor, state: _State | None) -> None:
        if state is None:
            self.states.pop(id(tensor), None)
            return
        self.states[id(tensor)] = state
        self.alive.append(tensor)

    def state(self, tensor: torch.Tensor) -> _State:
        # a tensor nothing laid out (a buffer, a constant) is whole on every rank
        return self.states.get(id(tensor)) or _Local(Replicate(), "a constant", 0)

    def emit(self, phase: str, where: str, move: tuple[str, int] | None) -> None:
        if move is not None:
            self.events.append((phase, move[0], where, move[1]))

    def move(self, src: Placement, dst: Placement, t: torch.Tensor) -> tuple[str, int] | None:
        return _collective(src, dst, tuple(t.shape), t.element_size(), self.n, self.cpu)

    def node(
        self,
        placement: Placement,
        t: torch.Tensor,
        where: str,
        *,
        parent: _Node | None = None,
        origin: Placement | None = None,
    ) -> _Node:
        """A DTensor made from ``parent`` (or from a local tensor laid out ``origin``), moved
        to ``placement``: the forward collective is issued now."""
        ndim = t.ndim
        placement = normalize(placement, ndim)
        source = parent.placement if parent is not None else normalize(origin, ndim)
        self.emit(FORWARD, where, self.move(source, placement, t))
        node = _Node(
            placement,
            tuple(t.shape),
            t.element_size(),
            t.requires_grad,
            where,
            parent,
            None if parent is not None else normalize(origin, ndim),
        )
        self.nodes.append(node)
        return node

    def redistribute(self, state: _Node, target: Placement, t: torch.Tensor, where: str):
        """The DTensor ``state`` moved to ``target``: itself when it is there already."""
        target = normalize(target, t.ndim)
        if state.placement == target:
            return state
        return self.node(target, t, where, parent=state)

    # -- what a style receives -------------------------------------------------------------

    def arrive(
        self,
        entry: PlanEntry,
        t: torch.Tensor,
        declared: Placement | None,
        what: str,
        annotated: bool = True,
    ) -> _State:
        """The state of ``t`` as the style receives it. A local tensor must be laid out as the
        style declares (it cannot know otherwise) and, when the style makes a DTensor of it
        (``annotated``), sharded evenly: its global shape is inferred from the local one."""
        state = self.state(t)
        if isinstance(state, _Local) and declared is not None:
            expected = _neg(declared, t.ndim)
            if state.layout != expected:
                self.problem(
                    "error",
                    entry.key,
                    f"{what} arrives as a local tensor laid out {_described(state)}, but "
                    f"{_names.describe(entry.style)} takes it as "
                    f"{_show(declared, t.ndim)}: the layouts do not chain; change this "
                    "style's input layout or the producer's output layout",
                    dedupe=f"chain {what}",
                )
            elif annotated:
                self.check_even(entry, t, declared, what)
        return state

    def check_even(self, entry: PlanEntry, t: torch.Tensor, layout: Placement, what: str):
        layout = normalize(layout, t.ndim)
        if isinstance(layout, Shard) and t.shape[layout.dim] % self.n:
            size = t.shape[layout.dim]
            self.problem(
                "error",
                entry.key,
                f"{what} is a local tensor sharded on dim {layout.dim} of size {size}, which "
                f"does not divide by the TP degree {self.n}: local shards are taken to be "
                f"even; make it a multiple of {self.n} (e.g. {math.ceil(size / self.n) * self.n}"
                "; for sequence parallelism, the sequence length)",
                dedupe=f"even {what}",
            )

    def cross(
        self,
        entry: PlanEntry,
        t: Any,
        layout: Layout | None,
        what: str,
        computed: bool,
        opaque: bool,
    ) -> _State | None:
        """``t`` crossing the boundary of ``entry``'s module as ``layout`` declares: the
        collectives that issues, and the state of what the receiver gets (``None``: the
        value is left alone).

        ``computed``: ``t`` is an output of a module whose forward the trace does not follow
        (its contract's ``local_forward``), laid out as ``layout.given`` says; otherwise the
        state ``t`` arrives in is checked against it. ``opaque``: ``t`` is an input of such a
        module, whose gradient it gives back as ``layout.grad`` says.
        """
        if layout is None or layout.given is None or not isinstance(t, torch.Tensor):
            return None
        ndim = t.ndim
        given = normalize(layout.given, ndim)
        target = given if layout.to is None else normalize(layout.to, ndim)
        moved = target != given
        if computed:
            state: _State = _Local(_neg(given, ndim), entry.key, ndim)
            if moved and layout.local:  # a reduce-scatter's local output, annotated downstream
                self.check_even(entry, t, target, what)
        else:
            # a local tensor becomes a DTensor (even shards assumed) when it is moved or given
            # to the module as a DTensor
            annotated = moved or not layout.local
            state = self.arrive(entry, t, layout.given, what, annotated=annotated)
        grad = target if layout.grad is None else normalize(layout.grad, ndim)
        if isinstance(state, _Node):
            node = self.redistribute(
                state, state.placement if layout.to is None else target, t, entry.key
            )
        elif isinstance(state, _Local):
            if layout.local and not moved and grad == target:
                return _Local(_neg(target, ndim), entry.key, ndim)  # used as it is
            if isinstance(grad, Partial) and isinstance(given, (Replicate, Shard)):
                # read whole by a local computation: one entry per tensor for all its readers
                # (_layouts._shared_entry); a leaf is never shared
                if not (t.requires_grad and t.is_leaf):
                    if (id(t), given) in self.entered:
                        return _Local(_neg(target, ndim), entry.key, ndim)
                    self.entered.add((id(t), given))
                    self.alive.append(t)
            node = self.node(target, t, entry.key, origin=given)
        else:
            return state
        if not layout.local:
            if opaque:  # nothing inside the module is followed: its gradient is as declared
                node.grads.append(grad)
            return node
        node.grads.append(grad if node.placement == target else node.placement)
        return _Local(_neg(node.placement, ndim), entry.key, ndim)

    def boundary(
        self, entry: PlanEntry, boundary: Boundary, values: tuple, kwargs: dict, side: str
    ) -> list[tuple[Any, _State]]:
        """Every value of one side of a module crossing it: ``(value, new state)`` pairs."""
        inputs = side == "input"
        if boundary.exact and len(values) != len(boundary.args):
            self.problem(
                "error",
                entry.key,
                f"the module {'is called with' if inputs else 'returns'} {len(values)} "
                f"{'positional inputs' if inputs else 'outputs'}, but "
                f"{_names.describe(entry.style)} lays out {len(boundary.args)}",
            )
        single = len(boundary.args) == 1 and not boundary.exact
        crossing = [
            (f"the {side}" if single else f"{side} {i}", value, layout)
            for i, (value, layout) in enumerate(zip(values, boundary.args, strict=False))
        ]
        crossing += [
            (f"keyword {side} {name!r}", value, boundary.kwargs.get(name))
            for name, value in kwargs.items()
        ]
        opaque = self.local_forward(entry)
        crossed = []
        for what, value, layout in crossing:
            new = self.cross(entry, value, layout, what, opaque and not inputs, opaque and inputs)
            if new is not None:
                crossed.append((value, new))
        return crossed

    def local_forward(self, entry: PlanEntry) -> bool:
        contract = entry.style.contract
        return contract is not None and bool(contract.local_forward(entry.style, entry.module))

    # -- hooks -----------------------------------------------------------------------------

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        entry = self.entry_of.get(id(module))
        if entry is None:
            return
        self.called.add(id(module))
        style, contract = entry.style, entry.style.contract
        saved: list[tuple[torch.Tensor, _State | None]] = []
        self.saved.append(saved)
        if contract is None:
            self.problem(
                "note",
                entry.key,
                f"the collectives of {style!r} (a style that declares no contract) are not "
                "predicted",
            )
            return
        if self.local_forward(entry):
            self.local_depth += 1
        caveat = contract.caveat(style, module)
        if caveat:
            self.problem("note", entry.key, caveat)
        for name in contract.partial_gradients(style, module) or ():
            param = getattr(module, name, None)
            if isinstance(param, nn.Parameter) and param.requires_grad:
                self.partial_params[id(param)] = param
        boundary = contract.inputs(style, module)
        if boundary is None:
            return
        for value, state in self.boundary(entry, boundary, args, kwargs, "input"):
            # the module sees the value so laid out; its caller keeps the original
            saved.append((value, self.states.get(id(value))))
            self.set_state(value, state)

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        entry = self.entry_of.get(id(module))
        if entry is None:
            return
        for value, state in reversed(self.saved.pop()):
            self.set_state(value, state)
        style, contract = entry.style, entry.style.contract
        if contract is None:
            return
        computed = self.local_forward(entry)
        if computed:
            self.local_depth -= 1
        boundary = contract.outputs(style, module)
        if boundary is None:
            return
        outputs = output if isinstance(output, tuple) else (output,)
        for value, state in self.boundary(entry, boundary, outputs, {}, "output"):
            self.set_state(value, state)
            if computed and isinstance(state, _Local) and state.layout == Shard(-1):
                # a column-parallel output: a view of it as (..., heads, head_dim) is checked
                self.colwise_outputs[id(value)] = entry.key

    # -- ops between the plan's modules ----------------------------------------------------

    def on_op(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _VIEWS and inputs and id(inputs[0]) in self.colwise_outputs:
            # a column-parallel output viewed as (..., heads, head_dim): remember the heads
            x, y = inputs[0], outputs[0]
            key = self.colwise_outputs[id(x)]
            if y.ndim == x.ndim + 1 and y.shape[-2] * y.shape[-1] == x.shape[-1]:
                self.heads.setdefault(key, (y.shape[-2], y.shape[-1]))
        states = [self.states.get(id(t)) for t in inputs]
        if not any(states):
            return
        if any(isinstance(s, _Broken) for s in states):
            new: _State = _Broken()  # downstream of a reported error: nothing more to say
            for t in outputs:
                self.set_state(t, new)
            return
        where = _generalize(self.scope[-1] if self.scope else "")
        dtensors = [s for s in states if s is not None and not isinstance(s, _Local)]
        if dtensors:
            for state in dtensors:
                if isinstance(state, _Node):
                    state.grads.append(state.placement)
            plain = [t for t, s in zip(inputs, states, strict=True) if t.ndim and s not in dtensors]
            if plain:
                self.problem(
                    "error",
                    where,
                    f"{_op_name(func)} gets a DTensor (from {dtensors[0].where}) and a plain "
                    f"tensor of shape {tuple(plain[0].shape)}, which DTensor refuses: give "
                    "this module a style, or hand it local tensors (use_local_output=True)",
                    dedupe="dtensor mix",
                )
                new = _Broken()
            else:
                self.problem(
                    "note",
                    where,
                    f"DTensors go through code outside the plan's modules ({_op_name(func)}): "
                    "collectives DTensor issues there are not predicted",
                    dedupe="dtensor ops",
                )
                new = _DTensorAfterOps(dtensors[0].where)
        else:
            local = [s for s in states if s is not None]
            layouts = list(dict.fromkeys(s.layout for s in local))
            if len(layouts) > 1:
                described = " and ".join(
                    _described(next(s for s in local if s.layout == layout)) for layout in layouts
                )
                self.problem(
                    "error",
                    where,
                    f"{_op_name(func)} combines local tensors laid out {described}: the "
                    "layouts do not chain",
                    dedupe=f"mix {described}",
                )
                new = _Broken()
            else:
                new = local[0]
                if func in _SPLITS and isinstance(new.layout, _StridedShard):
                    new = _Local(Shard(new.layout.dim), new.origin, new.ndim)
        for t in outputs:
            if not any(t is i for i in inputs):  # an in-place op keeps its state
                self.set_state(t, new)


def _described(state: _Local) -> str:
    """``Shard(2) (from layers.*.attention.wq)``: the layout as its producer made it."""
    return f"{_show(state.layout, state.ndim or None)} (from {state.origin})"


def _op_name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


class _LayoutMode(TorchFunctionMode):
    """Hands every torch op to the trace (ops inside local-compute styles are replaced)."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.trace.local_depth == 0:
            self.trace.on_op(func, args, kwargs, out)
        return out


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------


def plan_report(
    model: nn.Module,
    plan: ParallelStyle | Mapping[str, ParallelStyle | str],
    tp_degree: int,
    *,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype | None = None,
    example_inputs: Any = None,
    device_type: str = "cuda",
) -> PlanReport:
    """Report what ``plan`` would do to ``model`` at ``tp_degree``, without running it.

    Nothing is communicated and no process group is needed: ``model`` is built on the meta
    device (``with torch.device("meta"): model = MyModel(config)``), and its unparallelized
    forward runs once on meta tensors to find the activations' shapes and which tensor flows
    where. The model is left as it was.

    Args:
        model (:class:`nn.Module`): the model, on the meta device.
        plan: the plan, as for :func:`torch_tp.parallelize_module` (styles or style names).
        tp_degree (int): the number of ranks each layer is split over.

    Keyword Args:
        batch_size (int): the batch size the collectives are sized for.
        seq_len (int): the sequence length the collectives are sized for.
        dtype (:class:`torch.dtype`, optional): cast the floating-point parameters (of a
            copy) to this dtype first. Default: the model's own dtypes.
        example_inputs (optional): the forward's inputs on the meta device: a tensor, a
            tuple of positional inputs, a dict of keyword inputs, or a callable
            ``(batch_size, seq_len) -> inputs`` called under ``torch.device("meta")``.
            Default: token ids of shape ``(batch_size, seq_len)``.
        device_type (str, optional): the device the plan will run on. It matters for one
            thing: on ``"cpu"`` (gloo has no all-to-all) DTensor moves a shard to another
            dimension with an all-gather. Default: ``"cuda"``.

    Returns:
        A :class:`PlanReport`; ``print(report)`` shows the tables. The collectives are those
        of one training step of the model: its forward, and the backward of a loss on its
        output (the loss's own collectives, e.g. under ``loss_parallel``, are not included).

    Raises:
        ValueError: the model is not on the meta device, ``tp_degree`` is not positive, or
            the plan is invalid (as :func:`parallelize_module` would raise; a key that
            matches no module is reported as a problem instead).
        NotImplementedError: the plan names a style torch_tp does not have yet.
        RuntimeError: the forward fails on the meta device.

    Example::
        >>> # xdoctest: +SKIP("prints a table")
        >>> from torch_tp.models import Llama, LlamaConfig
        >>> from torch_tp.plans.llama import llama_plan
        >>> with torch.device("meta"):
        ...     model = Llama(LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8))
        >>> report = plan_report(
        ...     model, llama_plan(sequence_parallel=True), 8, batch_size=1, seq_len=4096
        ... )
        >>> print(report)
    """
    if not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be a positive int, found {tp_degree!r}")
    not_meta = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != "meta"
    ]
    if not_meta:
        raise ValueError(
            f"plan_report takes a model on the meta device; {not_meta[0]!r} is on "
            f"{dict([*model.named_parameters(), *model.named_buffers()])[not_meta[0]].device}. "
            'Build it under `with torch.device("meta"):`'
        )
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = resolve_plan(model, plan, strict=False)
    # what parallelize_module would raise for, reported all at once
    matched = Counter(e.key for e in entries)
    unmatched = iter(str(w.message) for w in caught if "matches no submodule" in str(w.message))
    keys = list(plan) if isinstance(plan, Mapping) else [""]
    problems = [
        Problem("error", key, next(unmatched).removesuffix("; skipping it (strict=False)"))
        for key in keys
        if not matched[key]
    ]
    invalid, refused = _validate(model, entries, tp_degree)
    problems += refused
    valid = [e for e in entries if id(e.module) not in invalid]

    inputs = _inputs(example_inputs, batch_size, seq_len)
    trace = _Trace(valid, tp_degree, cpu=device_type == "cpu")
    with torch.enable_grad():
        output = _run(model, trace, inputs)
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and isinstance(trace.states.get(id(t)), _Node):
            node = trace.states[id(t)]
            node.grads.append(node.placement)  # the loss takes the output as it is
    _backward(trace)

    parameters = _parameter_groups(model, valid, tp_degree)
    problems += list(trace.problems.values())
    problems += _divisibility(model, parameters, trace, tp_degree)
    problems += _unsharded(model, valid)
    problems += [
        Problem("note", e.key, f"module {e.path!r} is not called by the forward")
        for e in valid
        if id(e.module) not in trace.called
    ]
    order = {severity: i for i, severity in enumerate(_SEVERITIES)}
    problems.sort(key=lambda p: order[p.severity])

    styles = _names.resolve_names(plan) if isinstance(plan, Mapping) else {"": plan}
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return PlanReport(
        model=type(model).__name__,
        num_parameters=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        tp_degree=tp_degree,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=Counter(floating).most_common(1)[0][0] if floating else torch.get_default_dtype(),
        plan=[PlanEntryRow(key, _names.describe(styles[key]), matched[key]) for key in keys],
        parameters=parameters,
        collectives=_group(trace.events),
        problems=problems,
    )


def _inputs(example_inputs: Any, batch_size: int, seq_len: int) -> tuple[tuple, dict]:
    """The forward's positional and keyword inputs."""
    if example_inputs is None:
        return (torch.zeros((batch_size, seq_len), dtype=torch.long, device="meta"),), {}
    if callable(example_inputs):
        with torch.device("meta"):
            example_inputs = example_inputs(batch_size, seq_len)
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)), {}


def _run(model: nn.Module, trace: _Trace, inputs: tuple[tuple, dict]) -> Any:
    handles = []
    for path, module in model.named_modules():

        def pre(module, args, kwargs, path=path):
            trace.scope.append(path)
            trace.pre_hook(module, args, kwargs)

        def post(module, args, kwargs, output):
            trace.post_hook(module, args, kwargs, output)
            trace.scope.pop()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            trace.set_state(t, _Local(Replicate(), "the model input", t.ndim))
    args, kwargs = inputs
    try:
        with _LayoutMode(trace):
            return model(*args, **kwargs)
    except Exception as err:
        raise RuntimeError(
            f"the forward of {type(model).__name__} failed on the meta device ({err}); pass "
            "example_inputs that it takes, and avoid data-dependent code (.item(), nonzero) "
            "in the forward"
        ) from err
    finally:
        for handle in handles:
            handle.remove()


def _backward(trace: _Trace) -> None:
    """Each DTensor's gradient goes back to the placement it was made from (latest first)."""
    for node in reversed(trace.nodes):
        if not node.requires_grad or not node.grads:
            continue
        grad = node.grads[0]
        source = node.parent.placement if node.parent is not None else node.origin
        # DTensor sends the gradient of a Partial source back as Replicate
        target = Replicate() if isinstance(source, Partial) else source
        move = _collective(grad, target, node.shape, node.itemsize, trace.n, trace.cpu)
        trace.emit(BACKWARD, node.where, move)
        if node.parent is not None:
            node.parent.grads.append(target)
    if trace.partial_params:
        params = list(trace.partial_params.values())
        size = sum(p.numel() * p.element_size() for p in params)
        trace.events.append((BACKWARD, "all_reduce", REPLICATED_PARAMETERS, size))


def _group(events: list[tuple[str, str, str, int]]) -> list[Collective]:
    """Events counted per (phase, kind, generalized plan key, bytes), forward first."""
    counts = Counter(  # insertion-ordered: in the order of the first occurrence
        (phase, kind, _generalize(where), size) for phase, kind, where, size in events
    )
    return [
        Collective(phase, kind, where, count, size)
        for wanted in (FORWARD, BACKWARD)
        for (phase, kind, where, size), count in counts.items()
        if phase == wanted
    ]


class _MeshOfSize:
    """What a style's ``_validate`` may ask of the mesh, with no process group: its size."""

    ndim = 1

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self, mesh_dim: int | None = None) -> int:
        return self.n


def _validate(model: nn.Module, entries: list[PlanEntry], n: int) -> tuple[set[int], list[Problem]]:
    """The checks of :func:`torch_tp.plan.validate_plan` that need no mesh: the modules
    refused, and why."""
    invalid: set[int] = set()
    problems = []
    owners = parameter_owners(model)
    by_path = {entry.path: entry for entry in entries}
    for entry in entries:
        tied = tied_parameters(entry, owners, by_path)
        if tied is not None:
            invalid.add(id(entry.module))
            problems.append(Problem("error", entry.key, tied))
        validate = getattr(entry.style, "_validate", None)
        if validate is None or id(entry.module) in invalid:
            continue
        try:
            validate(entry.module, _MeshOfSize(n))
        except (NotImplementedError, ValueError, TypeError) as err:
            invalid.add(id(entry.module))
            problems.append(
                Problem(
                    "error",
                    entry.key,
                    f"cannot apply {_names.describe(entry.style)} on {entry.path!r} "
                    f"({type(entry.module).__name__}): {err}",
                )
            )
        except Exception:  # noqa: BLE001 - a user style that needs a real mesh
            pass
    return invalid, problems


def _placements(entry: PlanEntry) -> dict[str, Placement]:
    """How the entry's style lays out its module's own parameters (none: left plain)."""
    placements = planned_placements(entry)
    return {
        name: placements[name]
        for name, _ in entry.module.named_parameters(recurse=False)
        if name in placements
    }


def _largest_shard(shape: tuple[int, ...], placement: Placement | None, n: int):
    if not isinstance(placement, (Shard, _StridedShard)):
        return shape
    local = list(shape)
    local[placement.dim] = math.ceil(shape[placement.dim] / n)
    return tuple(local)


def _parameter_groups(model: nn.Module, entries: list[PlanEntry], n: int):
    entry_of = {id(e.module): e for e in entries}
    groups: Counter[tuple] = Counter()
    seen: set[int] = set()
    for path, module in model.named_modules():
        entry = entry_of.get(id(module))
        placements = _placements(entry) if entry is not None else {}
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            placement = placements.get(name)
            if entry is not None:
                full = f"{entry.key}.{name}" if entry.key else name
            else:
                full = _generalize(f"{path}.{name}" if path else name)
            shape = tuple(param.shape)
            key = (
                full,
                _names.placement_to_str(placement) if placement is not None else None,
                shape,
                _largest_shard(shape, placement, n),
                param.element_size(),
            )
            groups[key] += 1
    return [
        ParameterGroup(name, count, placement, shape, local, itemsize)
        for (name, placement, shape, local, itemsize), count in groups.items()
    ]


def _divisibility(
    model: nn.Module,
    parameters: list[ParameterGroup],
    trace: _Trace,
    n: int,
) -> list[Problem]:
    problems = []
    for key, (heads, head_dim) in trace.heads.items():
        if heads % n:
            fits = [d for d in range(1, n + 1) if heads % d == 0]
            problems.append(
                Problem(
                    "error",
                    key,
                    f"its output is viewed as {heads} heads of {head_dim}, and {heads} heads "
                    f"do not divide by the TP degree {n}: a rank would hold part of a head. "
                    f"Use a TP degree that divides {heads}, such as {fits[-1]}",
                )
            )
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for group in parameters:
        if group.placement is None or not group.placement.startswith("Shard"):
            continue
        dim = _names.placement_from_str(group.placement).dim
        size = group.global_shape[dim]
        key = group.name.rpartition(".")[0]
        if size % n == 0 or key in trace.heads:
            continue
        what = "the vocabulary" if size in vocab else f"dim {dim}"
        chunk = math.ceil(size / n)
        empty = n - math.ceil(size / chunk) if chunk else n
        emptiness = f"; {empty} rank(s) hold nothing" if empty > 0 else ""
        problems.append(
            Problem(
                "warning",
                group.name,
                f"{what} ({size}) does not divide by the TP degree {n}: shards of "
                f"{chunk} and fewer (torch.chunk){emptiness}; the largest is reported. "
                f"Pad it to {chunk * n} for even shards",
            )
        )
    return problems


def _unsharded(model: nn.Module, entries: list[PlanEntry]) -> list[Problem]:
    sharded = {
        id(e.module)
        for e in entries
        if any(isinstance(p, (Shard, _StridedShard)) for p in _placements(e).values())
    }
    groups: dict[str, list[int]] = {}
    shapes: dict[str, str] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or id(module) in sharded:
            continue
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        name = _generalize(path)
        groups.setdefault(name, []).append(sum(p.numel() * p.element_size() for p in params))
        weight = module.weight
        shapes[name] = f"{type(module).__name__} {_shape(tuple(weight.shape))}"
    return [
        Problem(
            "note",
            name,
            f"{shapes[name]} is not sharded: every rank holds all of it "
            f"({len(sizes)} x {_size(sizes[0])})"
            if len(sizes) > 1
            else f"{shapes[name]} is not sharded: every rank holds all of it ({_size(sizes[0])})",
        )
        for name, sizes in groups.items()
    ]
