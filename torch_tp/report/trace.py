"""The dry-run report's trace: the unparallelized model's forward, run once on meta tensors,
followed tensor by tensor to predict the parallel model's collectives.

Each tensor is given the form it would have in the parallelized model (a local tensor of a
known layout, or a DTensor). At each module of the plan, the style's contract
(:class:`torch_tp.contract.StyleContract`) says how its inputs and outputs cross the
module's boundary (the layout they arrive in, the layout they are moved to, whether the
receiver gets a plain tensor, the gradient a local computation gives back) and which
parameters' gradients are partial; the trace turns that into the collectives the forward
issues now and the backward will issue. Between the plan's modules, a
:class:`~torch.overrides.TorchFunctionMode` carries each tensor's form through the ops, and
flags layouts that do not chain.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from torch_tp import _names
from torch_tp._torch_compat import StridedShard, tree_leaves
from torch_tp.contract import Boundary, Layout, StyleContract
from torch_tp.plan import PlanEntry
from torch_tp.plan_checks import replicated_unsummed, summing_style
from torch_tp.report.adapters import (
    adapter_layouts,
    adapter_partials,
    hosted_forward,
    with_adapters,
)
from torch_tp.report.render import (
    BACKWARD,
    FORWARD,
    REPLICATED_PARAMETERS,
    Collective,
    Problem,
)
from torch_tp.runtime import normalize
from torch_tp.shapes import VALUE_READS, VALUE_TESTS, meta_value, on_meta

__all__: list[str] = []  # private to torch_tp.report

# ------------------------------------------------------------------------------------------
# Layouts and the collectives that move between them
# ------------------------------------------------------------------------------------------


def _neg(layout: Placement, ndim: int) -> Placement:
    """``Shard(d)`` counted from the end, so that it survives ops that add leading dims."""
    if isinstance(layout, Shard) and layout.dim >= 0:
        return Shard(layout.dim - ndim)
    if isinstance(layout, StridedShard) and layout.dim >= 0:
        return StridedShard(layout.dim - ndim, split_factor=layout.split_factor)
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
    """The collective that moves a tensor of global ``shape`` from ``src`` to ``dst`` (none
    over one rank)."""
    if n == 1:
        return None
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
    # whole, but its gradient is a partial sum, summed where it was entered (a block's input
    # under PrepareModuleInput's partial_input_gradients)
    partial_gradient: bool = False


@dataclass(eq=False)
class _DTensorAfterOps:
    """A DTensor that went through code outside the plan's modules: placement unknown."""

    where: str


class _Broken:
    """Downstream of an error already reported: followed no further."""


@dataclass(eq=False)
class DTensorNode:
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
    parent: DTensorNode | None = None
    origin: Placement | None = None
    grads: list[Placement] = field(default_factory=list)
    # nodes of one group send their gradients back in one collective (Boundary.coalesced)
    group: int | None = None
    # its gradient goes back as this rank's partial sum, summed further back: no collective
    handed_back: bool = False


_State = _Local | DTensorNode | _DTensorAfterOps | _Broken

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten}
# ops whose second input gives only a shape: the output is the first's data (expand_as is
# not one: a mask expanded to a sharded tensor's shape is that tensor's local shape, as a
# broadcast in any elementwise op)
_LIKE = {torch.Tensor.view_as, torch.Tensor.reshape_as}
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
# ops that view a tensor or take part of it: on a replicated DTensor, DTensor makes a
# replicated one without communicating, and their backward hands a gradient on in the
# placement it arrives in (a partial sum stays one, to be summed where the DTensor was made)
_PARTS = _VIEWS | _LIKE | {torch.Tensor.__getitem__, torch.Tensor.narrow, torch.narrow}


def generalize_path(path: str) -> str:
    """``layers.3.attention`` -> ``layers.*.attention``: one row for all layers."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


class Trace:
    """Follows the unparallelized model's forward and predicts the parallel one's collectives."""

    def __init__(
        self,
        entries: list[PlanEntry],
        n: int,
        cpu: bool,
        mesh_shape: Mapping[str, int] | None = None,
    ) -> None:
        self.n = n
        self.cpu = cpu
        # the mesh's dimensions (None: a 1-D mesh of n ranks, unnamed); the layouts the trace
        # follows are over the last one, which the 1-D styles run on
        self.mesh_shape = dict(mesh_shape) if mesh_shape is not None else None
        self.dim = None if mesh_shape is None else list(mesh_shape)[-1]  # tp, or cp alone
        self.entry_of = {id(e.module): e for e in entries}
        self.states: dict[int, _State] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the trace runs
        self.nodes: list[DTensorNode] = []
        # (phase, kind, where, bytes, mesh dimension)
        self.events: list[tuple[str, str, str, int, str | None]] = []
        self.partial_params: dict[int, nn.Parameter] = {}
        self.local_depth = 0
        self.scope: list[str] = []
        self.saved: list[list[tuple[torch.Tensor, _State | None]]] = []
        self.colwise_outputs: dict[int, str] = {}
        self.heads: dict[str, tuple[int, int]] = {}
        self.called: set[int] = set()
        # local tensors already entered into a column-parallel region, as at run time
        # (runtime.boundaries._shared_entry): q, k and v reading one tensor share one entry
        self.entered: set[tuple[int, Placement]] = set()
        self.problems: dict[tuple[str, str], Problem] = {}
        # (how many nodes existed then, kind, where, bytes, mesh dimension) of the backward's
        # own transfers
        self.backward_transfers: list[tuple[int, str, str, int, str | None]] = []
        # parameters no style of the plan distributes, and tensors computed from them
        # alone: id -> the parameter's name
        self.unplanned: dict[int, str] = {}
        self.from_unplanned: dict[int, str] = {}
        # of those, the ones a style replicates without summing their gradients: name ->
        # entry; and every parameter found computing on a shard (for the plan-level check)
        self.unsummed: dict[str, PlanEntry] = {}
        self.partial_found: set[str] = set()
        # the entries running now whose attention calls issue transfers (context
        # parallelism's ring), innermost last; and the bytes those calls save for backward
        # per rank (q, k, v, output, log-sum-exp), and their number
        self.attention: list[PlanEntry] = []
        self.attention_saved = 0
        self.attention_calls = 0
        # the LoRA factors (lora_A, lora_B) a hosted PEFT layer computes with in the call of
        # its base layer running now (torch_tp.style.adapters): id(base) -> factors
        self.adapters: dict[int, list[tuple[nn.Module, nn.Module]]] = {}
        # what the plan splits, per block (torch_tp.report.quality), fed every op
        self.quality: Any = None

    def is_shard(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is, in the parallel model, this rank's shard of a larger tensor."""
        state = self.states.get(id(t))
        if isinstance(state, _Local):
            return isinstance(state.layout, (Shard, StridedShard))
        return isinstance(state, DTensorNode) and isinstance(state.placement, Shard)

    def watch_unplanned(self, model: nn.Module) -> None:
        """Watch the parameters no entry's style places: one that computes on a sharded
        local tensor gets a partial gradient nothing sums (a silent wrong gradient)."""
        planned = set()
        for entry in self.entry_of.values():
            contract = style_contract(entry)
            placed = contract.parameters(entry.style, entry.module) if contract else None
            if contract is not None and contract.local_forward(entry.style, entry.module):
                placed = dict(entry.module.named_parameters())  # computed inside, not traced
            for name in placed or ():
                param = entry.module.get_parameter(name)
                planned.add(id(param))
            # a hosted PEFT layer's adapters: laid out and computed by the base's style
            for module in adapter_layouts(entry):
                planned.update(id(p) for p in module.parameters(recurse=False))
        self.unplanned = {
            id(p): name
            for name, p in model.named_parameters()
            if id(p) not in planned and p.requires_grad
        }
        # a parameter a style replicates without summing its gradient, on a module whose
        # forward the trace follows, must not compute on a shard either
        for entry in self.entry_of.values():
            if self.local_forward(entry):
                continue
            for name in replicated_unsummed(entry):
                full = f"{entry.path}.{name}" if entry.path else name
                self.unplanned[id(entry.module.get_parameter(name))] = full
                self.unsummed[full] = entry

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
            self.events.append((phase, move[0], where, move[1], self.dim))

    def move(self, src: Placement, dst: Placement, t: torch.Tensor) -> tuple[str, int] | None:
        return _collective(src, dst, tuple(t.shape), t.element_size(), self.n, self.cpu)

    def node(
        self,
        placement: Placement,
        t: torch.Tensor,
        where: str,
        *,
        parent: DTensorNode | None = None,
        origin: Placement | None = None,
    ) -> DTensorNode:
        """A DTensor made from ``parent`` (or from a local tensor laid out ``origin``), moved
        to ``placement``: the forward collective is issued now."""
        ndim = t.ndim
        placement = normalize(placement, ndim)
        source = parent.placement if parent is not None else normalize(origin, ndim)
        self.emit(FORWARD, where, self.move(source, placement, t))
        node = DTensorNode(
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

    def redistribute(self, state: DTensorNode, target: Placement, t: torch.Tensor, where: str):
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
        if isinstance(state, DTensorNode):
            node = self.redistribute(
                state, state.placement if layout.to is None else target, t, entry.key
            )
        elif isinstance(state, _Local):
            if layout.local and not moved and grad == target:
                return _Local(_neg(target, ndim), entry.key, ndim)  # used as it is
            if isinstance(grad, Partial) and isinstance(given, (Replicate, Shard)):
                # read whole by a local computation: one entry per tensor for all its readers
                # (runtime.boundaries._shared_entry); a leaf is never shared
                if not (t.requires_grad and t.is_leaf):
                    if (id(t), given) in self.entered:
                        return _Local(_neg(target, ndim), entry.key, ndim)
                    self.entered.add((id(t), given))
                    self.alive.append(t)
            node = self.node(target, t, entry.key, origin=given)
            # a whole value inside a partial-gradient region, read whole again: its
            # gradient goes back as it is, to be summed where the region began
            node.handed_back = (
                state.partial_gradient and isinstance(grad, Partial) and given == target
            )
        else:
            return state
        if not layout.local:
            if opaque:  # nothing inside the module is followed: its gradient is as declared
                node.grads.append(grad)
            return node
        node.grads.append(grad if node.placement == target else node.placement)
        partial = isinstance(grad, Partial) and isinstance(node.placement, Replicate)
        return _Local(_neg(node.placement, ndim), entry.key, ndim, partial_gradient=partial)

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
        first = len(self.nodes)
        for what, value, layout in crossing:
            new = self.cross(entry, value, layout, what, opaque and not inputs, opaque and inputs)
            if new is not None:
                crossed.append((value, new))
        if boundary.coalesced:
            for node in self.nodes[first:]:
                node.group = first
        return crossed

    def local_forward(self, entry: PlanEntry) -> bool:
        contract = style_contract(entry)
        return contract is not None and bool(contract.local_forward(entry.style, entry.module))

    # -- hooks -----------------------------------------------------------------------------

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        entry = self.entry_of.get(id(module))
        if entry is None:
            return
        self.called.add(id(module))
        style, contract = entry.style, style_contract(entry)
        if getattr(style, "_attention_transfers", None) is not None:
            self.attention.append(entry)
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
            try:  # a dotted name: a parameter of a submodule (inside a partial-sum region)
                param = module.get_parameter(name)
            except AttributeError:
                continue
            if isinstance(param, nn.Parameter) and param.requires_grad:
                self.partial_params[id(param)] = param
        for param in adapter_partials(entry, contract, self.adapters.get(id(module), [])):
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
        style, contract = entry.style, style_contract(entry)
        if self.attention and self.attention[-1] is entry:
            self.attention.pop()
        if contract is None:
            return
        computed = self.local_forward(entry)
        if computed:
            self.local_depth -= 1
        boundary = contract.outputs(style, module)
        if boundary is None:
            boundary = Boundary()
        outputs = output if isinstance(output, tuple) else (output,)
        # a hosted PEFT layer's output carries its adapters' gradient, and a row-parallel
        # one's reduction their partial sums too: the base's output crosses, widened
        crossing = with_adapters(boundary, outputs, self.adapters.get(id(module), []))
        real = {id(c): o for c, o in zip(crossing, outputs, strict=True)}
        for value, state in self.boundary(entry, boundary, crossing, {}, "output"):
            value = real.get(id(value), value)
            self.set_state(value, state)
            if computed and isinstance(state, _Local) and state.layout == Shard(-1):
                # a column-parallel output: a view of it as (..., heads, head_dim) is checked
                self.colwise_outputs[id(value)] = entry.key
        # what the module sends itself (tokens to their experts), forward and backward
        self.add_transfers(entry, contract.transfers(style, module, args, self.degree(entry)))

    def degree(self, entry: PlanEntry) -> int | tuple[int, ...]:
        """The size of the mesh ``entry``'s style runs on (a tuple of sizes, N-D)."""
        dims = self.style_dims(entry)
        if self.mesh_shape is None:
            return self.n
        sizes = tuple(self.mesh_shape[d] for d in dims)
        return sizes[0] if len(sizes) == 1 else sizes

    def add_transfers(self, entry: PlanEntry, transfers: Sequence[Any] | None) -> None:
        """What ``entry``'s module sends itself (tokens to their experts, a ring's key/value
        blocks), forward now and backward when the backward gets here."""
        dims = self.style_dims(entry)
        for transfer in transfers or ():
            dim = dims[-1] if len(dims) == 1 else _over(dims, transfer.mesh_dim)
            if self.mesh_shape is not None and self.mesh_shape.get(dim) == 1:
                continue  # nothing moves over one rank
            if transfer.phase == BACKWARD:  # issued when the backward gets here
                self.backward_transfers.append(
                    (len(self.nodes), transfer.kind, entry.key, transfer.nbytes, dim)
                )
            else:
                self.events.append((transfer.phase, transfer.kind, entry.key, transfer.nbytes, dim))

    def on_attention(self, args: tuple, kwargs: dict, out: Any) -> None:
        """A ``F.scaled_dot_product_attention`` call inside a module whose style turns it into
        transfers of its own (context parallelism's ring): those, for this rank's query, key
        and value (its tokens, as traced; its heads, divided over tp where they arrive
        sharded), and the bytes the call saves for backward."""
        entry = self.attention[-1]
        names = ("query", "key", "value")
        q, k, v = [*args[:3], *(kwargs[name] for name in names[len(args[:3]) :])]
        rest = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:], strict=False))
        rest.update((name, value) for name, value in kwargs.items() if name not in names)
        local = [self.local_heads(t) for t in (q, k, v)]
        transfers = entry.style._attention_transfers(entry.module, *local, rest, self.degree(entry))
        self.add_transfers(entry, transfers)
        # saved for backward (the ring's, flash-attention style): q, k, v and the output as
        # given (the output: one row of v's width per query), and the log-sum-exp of each
        # query (float32, float64 for float64)
        rows = local[0].numel() // local[0].shape[-1]
        saved = sum(t.numel() * t.element_size() for t in local)
        saved += rows * v.shape[-1] * out.element_size() + rows * max(out.element_size(), 4)
        self.attention_saved += saved
        self.attention_calls += 1

    def local_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``(..., heads, tokens, head_dim)``) as one rank holds it: its heads divided
        by the TP degree where it is a sharded local tensor or DTensor (a column-parallel
        projection's heads)."""
        state = self.states.get(id(t))
        sharded = (
            isinstance(state, _Local) and isinstance(state.layout, (Shard, StridedShard))
        ) or (isinstance(state, DTensorNode) and isinstance(state.placement, (Shard, StridedShard)))
        if not sharded or self.n == 1 or t.ndim < 3:
            return t
        shape = list(t.shape)
        shape[-3] //= self.n
        return t.new_empty(shape, device="meta")

    def style_dims(self, entry: PlanEntry) -> list[str | None]:
        """The mesh dimensions ``entry``'s style runs on (:func:`style_dims`; ``[None]``: the
        one unnamed dimension of a 1-D report)."""
        if self.mesh_shape is None:
            return [None]
        return style_dims(entry, self.mesh_shape)

    # -- ops between the plan's modules ----------------------------------------------------

    def check_unplanned(
        self,
        func: Callable,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        states: list,
        where: str,
    ) -> None:
        """A parameter the plan leaves alone (or a value computed from it alone, such as
        ``softplus(alpha)``), computing with a local shard: each rank's gradient of it would
        cover its shard only, and nothing would sum them."""
        names = [self.unplanned.get(id(t)) or self.from_unplanned.get(id(t)) for t in inputs]
        found = [n for n in names if n is not None]
        if not found:
            return
        sharded = [
            s
            for s in states
            if isinstance(s, _Local) and isinstance(s.layout, (Shard, StridedShard))
        ]
        if not any(states):
            # computed from unplanned parameters (and constants) only: follow it
            for t in outputs:
                self.from_unplanned[id(t)] = found[0]
                self.alive.append(t)
            return
        if not sharded:
            return
        self.partial_found.add(found[0])
        name = generalize_path(found[0])
        entry = self.unsummed.get(found[0])
        if entry is not None:
            own = found[0][len(entry.path) + 1 :] if entry.path else found[0]
            self.problem(
                "error",
                name,
                f"the replicated parameter {name}, which {_names.describe(entry.style)} on "
                f"{entry.key} replicates without summing its gradient, computes "
                f"({_op_name(func)}) with a local tensor laid out {_described(sharded[0])}: "
                "each rank's gradient of it would cover that shard only, and the ranks would "
                "train on different, partial gradients. Plan it "
                f"{summing_style(entry, (own,))}, which sums them at "
                "the end of backward",
                dedupe=f"unplanned {name}",
            )
            return
        self.problem(
            "error",
            name,
            f"the parameter {name}, which no plan entry lays out, computes "
            f"({_op_name(func)}) with a local tensor laid out {_described(sharded[0])}: "
            "each rank's gradient of it would cover that shard only and nothing would sum "
            "them (a silently wrong gradient). Give its module ReplicateParallel("
            "sum_gradients=True) if it acts on every feature alike, or a style that "
            "shards it with the features",
            dedupe=f"unplanned {name}",
        )

    def on_op(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _LIKE:
            inputs = inputs[:1]  # the other gives only the shape
        if func in _VIEWS and inputs and id(inputs[0]) in self.colwise_outputs:
            # a column-parallel output viewed as (..., heads, head_dim): remember the heads
            x, y = inputs[0], outputs[0]
            key = self.colwise_outputs[id(x)]
            if y.ndim == x.ndim + 1 and y.shape[-2] * y.shape[-1] == x.shape[-1]:
                self.heads.setdefault(key, (y.shape[-2], y.shape[-1]))
        states = [self.states.get(id(t)) for t in inputs]
        where = generalize_path(self.scope[-1] if self.scope else "")
        self.check_unplanned(func, inputs, outputs, states, where)
        if not any(states):
            return
        if any(isinstance(s, _Broken) for s in states):
            new: _State = _Broken()  # downstream of a reported error: nothing more to say
            for t in outputs:
                self.set_state(t, new)
            return
        dtensors = [s for s in states if s is not None and not isinstance(s, _Local)]
        if func in _PARTS and len(inputs) == 1 and dtensors and _replicated_node(dtensors[0]):
            # the final norm's gathered output sliced for lm_head: the part stands for the
            # whole, whose gradient its readers give (lm_head's partial sum, reduce-scattered)
            for t in outputs:
                self.set_state(t, dtensors[0])
            return
        if dtensors:
            for state in dtensors:
                if isinstance(state, DTensorNode):
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
            local = _broadcast_dropped(inputs, states, outputs)
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
                if func in _SPLITS and isinstance(new.layout, StridedShard):
                    new = _Local(Shard(new.layout.dim), new.origin, new.ndim)
        for t in outputs:
            if not any(t is i for i in inputs):  # an in-place op keeps its state
                self.set_state(t, new)


def _replicated_node(state: _State) -> bool:
    return isinstance(state, DTensorNode) and isinstance(state.placement, Replicate)


def _broadcast_dropped(
    inputs: list[torch.Tensor], states: list[_State | None], outputs: list[torch.Tensor]
) -> list[_Local]:
    """The local states of an op's inputs that take part in its layout, leaving out the
    replicated tensors broadcast to the output's shape beside a sharded one (gpt-fast's
    rotary table ``(1, T, 1, D/2, 2)`` times a head-sharded query, DistilBERT's mask
    expanded to the per-head scores): each rank uses them whole against its shard. Whether
    the broadcast dimensions are the sharded ones is a question of shapes, which the shape
    check (:func:`torch_tp.shapes.check_shapes`) answers op by op."""
    local = [(t, s) for t, s in zip(inputs, states, strict=True) if isinstance(s, _Local)]
    if not any(isinstance(s.layout, (Shard, StridedShard)) for _, s in local):
        return [s for _, s in local]
    shape = outputs[0].shape

    def broadcast(t: torch.Tensor) -> bool:
        if t.shape == shape:
            return False
        try:
            return torch.broadcast_shapes(t.shape, shape) == shape
        except RuntimeError:
            return False

    return [s for t, s in local if not (isinstance(s.layout, Replicate) and broadcast(t))]


def mesh_ndim(entry: PlanEntry) -> int:
    """The dimensions of the mesh ``entry``'s style runs on (its contract's ``mesh_ndim``)."""
    return getattr(style_contract(entry), "mesh_ndim", 1)


def style_dims(entry: PlanEntry, mesh_shape: Mapping[str, int]) -> list[str]:
    """The dimensions of the mesh of shape ``mesh_shape`` that ``entry``'s style runs on: the
    last ``mesh_ndim`` (the 1-D styles on the last, ``tp``). The one place the report maps a
    style to its dimensions. A style whose contract names its dimensions (``mesh_dims``:
    ``("cp",)``) runs on those."""
    named = getattr(style_contract(entry), "mesh_dims", None)
    if named is not None:
        return list(named)
    return list(mesh_shape)[-mesh_ndim(entry) :]


def style_contract(entry: PlanEntry) -> StyleContract | None:
    """The contract of ``entry``'s style (``None``: it declares none, or is duck-typed)."""
    return getattr(entry.style, "contract", None)


def _described(state: _Local) -> str:
    """``Shard(2) (from layers.*.attention.wq)``: the layout as its producer made it."""
    return f"{_show(state.layout, state.ndim or None)} (from {state.origin})"


def _op_name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


class _LayoutMode(TorchFunctionMode):
    """Hands every torch op to the trace (ops inside local-compute styles are replaced)."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # a forward that reads a value (``.item()``, ``if mask.any():``) or makes a CPU
        # scalar that meets meta activations: traced as the shape check traces it
        if func in VALUE_READS and args and isinstance(args[0], torch.Tensor):
            if args[0].is_meta:
                return meta_value(func, args[0])
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in VALUE_TESTS and any(t.is_meta for t in leaves):
            return VALUE_TESTS[func]
        if any(t.is_meta for t in leaves) and not all(t.is_meta for t in leaves):
            args, kwargs = on_meta((args, kwargs))
        out = func(*args, **kwargs)
        if self.trace.quality is not None:
            scope = self.trace.scope
            self.trace.quality.on_op(func, args, kwargs, out, scope[-1] if scope else "")
        if self.trace.local_depth == 0:
            if func is F.scaled_dot_product_attention and self.trace.attention:
                self.trace.on_attention(args, kwargs, out)
            self.trace.on_op(func, args, kwargs, out)
        return out


def trace_forward(
    model: nn.Module,
    trace: Trace,
    inputs: tuple[tuple, dict],
    input_layout: Placement | None = None,
    refused: Sequence[PlanEntry] = (),
) -> Any:
    """The forward of ``model`` on ``inputs``, followed by ``trace``. The modules of the
    ``refused`` entries (not traced: the plan cannot apply their styles) still run as their
    style's ``_meta_output`` says, where it says."""
    handles = []
    refused_of = {id(e.module): e for e in refused}
    for path, module in model.named_modules():
        entry = trace.entry_of.get(id(module)) or refused_of.get(id(module))
        meta_output = None if entry is None else getattr(entry.style, "_meta_output", None)
        if meta_output is not None:
            # a forward that reads its inputs' values (routing): its output's shapes instead
            module.forward = functools.partial(_meta_forward, meta_output, module)
            handles.append(_Restore(module))
        if entry is not None and entry.adapters is not None:
            # a PEFT layer on it: its base layer's style computes the adapters (a refused
            # entry: the base alone, as PEFT's adapters would meet a plan that does not apply)
            wrapper = entry.adapters
            hosted = id(module) in trace.entry_of
            wrapper.forward = (
                functools.partial(hosted_forward, trace, entry) if hosted else module.__call__
            )
            handles.append(_Restore(wrapper))

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
            layout = input_layout or Replicate()
            if isinstance(layout, Shard) and layout.dim >= 0:  # counted from the end
                layout = Shard(layout.dim - t.ndim)
            trace.set_state(t, _Local(layout, "the model input", t.ndim))
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


def _meta_forward(meta_output: Callable, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    output = meta_output(module, args, kwargs)
    # made, not computed (``empty_like`` of the tokens): it still carries a gradient back
    # where the forward would have (the collectives of its consumers' backward depend on it)
    leaves = [*tree_leaves((args, kwargs)), *module.parameters()]
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in leaves
    ):
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.is_leaf:
                t.requires_grad_(True)
    return output


class _Restore:
    """Removes the forward :func:`trace_forward` put on a module's instance, like a hook handle."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        del self.module.forward


def trace_backward(trace: Trace) -> None:
    """Each DTensor's gradient goes back to the placement it was made from (latest first)."""
    grouped: dict[int, int] = {}  # group -> index of its one event
    transfers = list(trace.backward_transfers)

    def transfers_after(position: int) -> None:
        # a module's own backward transfers run once the nodes made after it are done
        while transfers and transfers[-1][0] > position:
            _, kind, where, size, dim = transfers.pop()
            trace.events.append((BACKWARD, kind, where, size, dim))

    for index in reversed(range(len(trace.nodes))):
        transfers_after(index)
        node = trace.nodes[index]
        if not node.requires_grad or not node.grads or node.handed_back:
            continue
        grad = node.grads[0]
        source = node.parent.placement if node.parent is not None else node.origin
        # DTensor sends the gradient of a Partial source back as Replicate
        target = Replicate() if isinstance(source, Partial) else source
        move = _collective(grad, target, node.shape, node.itemsize, trace.n, trace.cpu)
        if move is not None and node.group is not None and node.group in grouped:
            # summed with the group's other gradients, in the same collective
            phase, kind, where, size, dim = trace.events[grouped[node.group]]
            trace.events[grouped[node.group]] = (phase, kind, where, size + move[1], dim)
        else:
            if move is not None and node.group is not None:
                grouped[node.group] = len(trace.events)
            trace.emit(BACKWARD, node.where, move)
        if node.parent is not None:
            node.parent.grads.append(target)
    transfers_after(-1)
    if trace.partial_params and trace.n > 1:  # summed over tp (nothing to sum over one rank)
        params = list(trace.partial_params.values())
        size = sum(p.numel() * p.element_size() for p in params)
        trace.events.append((BACKWARD, "all_reduce", REPLICATED_PARAMETERS, size, trace.dim))


def _over(dims: list[str | None], mesh_dim: int | None) -> str | None:
    """The name of the dimension a transfer of a style on ``dims`` runs over (all of them,
    joined, for one that names none)."""
    if mesh_dim is None:
        return ",".join(str(d) for d in dims)
    return dims[mesh_dim]


def group_collectives(events: list[tuple[str, str, str, int, str | None]]) -> list[Collective]:
    """Events counted per (phase, kind, generalized plan key, bytes, mesh dimension),
    forward first."""
    counts = Counter(  # insertion-ordered: in the order of the first occurrence
        (phase, kind, generalize_path(where), size, dim) for phase, kind, where, size, dim in events
    )
    return [
        Collective(phase, kind, where, count, size, dim)
        for wanted in (FORWARD, BACKWARD)
        for (phase, kind, where, size, dim), count in counts.items()
        if phase == wanted
    ]
