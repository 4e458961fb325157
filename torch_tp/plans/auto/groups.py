"""The Linear-like layers of a block, grouped by their parent module, and what each group is.

:func:`linear_groups` collects a block's ``nn.Linear`` (and transformers' ``Conv1D``) layers
as :class:`_Layer` records in :class:`LinearGroup` s (one per parent module);
:func:`find_hidden_size` finds the residual width every group reads and writes;
:func:`assign_styles` matches a group's column-parallel layers to its row-parallel one by their
shapes and gives each its style, telling an attention (q, k and v, fused or grouped-query, a
gated query), multi-head latent attention and an MLP apart, or refuses. The rest of ``auto``
builds on these records; this module imports none of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from torch_tp.style import (
    ColwiseParallel,
    MLAKVAProjParallel,
    PackedColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

__all__: list[str] = []


# ------------------------------------------------------------------------------------------
# Linear-like layers and their groups
# ------------------------------------------------------------------------------------------


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` or transformers' ``Conv1D``.

    ``Conv1D`` (GPT-2's projections) is recognized as torch_tp's styles recognize it: by
    class name and by a weight of shape ``(nx, nf)``, with no import of transformers.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if any(cls.__name__ == "Conv1D" for cls in type(module).__mro__):
        weight = getattr(module, "weight", None)
        shape = (getattr(module, "nx", None), getattr(module, "nf", None))
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == shape:
            return shape
    return None


def has_linear(module: nn.Module) -> bool:
    return any(linear_shape(m) is not None for m in module.modules())


@dataclass(eq=False)
class _Layer:
    name: str  # path inside the block
    key: str  # plan key
    in_features: int
    out_features: int
    style: ParallelStyle | None = None
    parts: int = 1
    gated: bool = False  # a query projection writing [q | gate] per head (2 x the heads)


@dataclass
class LinearGroup:
    parent: str  # path of the parent module inside the block ("" for the block itself)
    key: str  # plan key of the parent
    layers: list[_Layer]
    kind: str = ""  # "attention", "gathered" (attention computed whole), "mla" or "mlp"
    row: _Layer | None = None
    columns: list[_Layer] = field(default_factory=list)
    heads: tuple[int, int] | None = None  # (query, key/value) head counts, if found
    latents: tuple[int, ...] = ()  # multi-head latent attention: the latent widths
    rope: int = 0  # multi-head latent attention: the rotary width of the key/value latent


def linear_groups(block: nn.Module, prefix: str) -> list[LinearGroup]:
    groups: dict[str, LinearGroup] = {}
    for path, module in block.named_modules():
        if (
            path
            and isinstance(module, nn.ModuleList)
            and has_linear(module)
            and len({type(child) for child in module}) == 1
        ):
            # (sublayers of different classes in a list, as T5's block.layer, are planned as
            # any other children)
            raise ValueError(
                f"'{join_dotted(prefix, path)}' is a nn.ModuleList of Linear layers inside the "
                "repeated blocks (experts, or several attentions): auto() plans experts "
                "stacked in 3-D parameters only; write the plan by hand"
            )
        shape = linear_shape(module)
        if shape is None:
            continue
        parent = path.rpartition(".")[0]
        group = groups.setdefault(parent, LinearGroup(parent, join_dotted(prefix, parent), []))
        group.layers.append(_Layer(path, join_dotted(prefix, path), *shape))
    if not groups:
        matrices = [n for n, p in block.named_parameters() if p.ndim >= 2]
        shown = ", ".join(matrices[:4]) + (", ..." if len(matrices) > 4 else "")
        why = (
            f"; their matrices ({shown}) are multiplied some other way (a module's own weight "
            "in F.linear, an einsum), which auto() does not follow: write the plan by hand"
            if matrices
            else ": nothing to shard"
        )
        raise ValueError(
            f"the blocks '{prefix}' hold no nn.Linear (or Conv1D) layer, the layers auto() "
            f"shards{why}"
        )
    return list(groups.values())


def find_hidden_size(groups: list[LinearGroup], embedding: tuple | None, prefix: str) -> int:
    """The width every group both reads and writes (the residual stream)."""
    candidates: set[int] | None = None
    for group in groups:
        ins = {layer.in_features for layer in group.layers}
        outs = {layer.out_features for layer in group.layers}
        candidates = (ins & outs) if candidates is None else candidates & ins & outs
    candidates = candidates or set()
    width = None if embedding is None else embedding[1].embedding_dim
    if width in candidates or any(
        width in {x.in_features for x in g.layers} and width in {x.out_features for x in g.layers}
        for g in groups
    ):
        return width  # the embedding's width, read and written by a group (routers neither)
    if len(candidates) == 1:
        return next(iter(candidates))
    found = "; ".join(
        f"'{g.key or '(the block)'}': "
        + ", ".join(f"{layer.name} {layer.in_features}->{layer.out_features}" for layer in g.layers)
        for g in groups
    )
    what = "no width" if not candidates else f"several widths {sorted(candidates)}"
    own = ""
    if not candidates and all(
        {x.in_features for x in g.layers} & {x.out_features for x in g.layers} for g in groups
    ):
        own = (
            "; each group reads and writes a width of its own (an MLP over another axis, as "
            "MLP-Mixer's token mixing), and auto() plans blocks around one residual width"
        )
    raise ValueError(
        f"cannot tell the hidden size of the blocks '{prefix}': {what} both read and written "
        f"by every group of Linear layers ({found}){own}"
    )


def assign_styles(group: LinearGroup, hidden: int, module: nn.Module) -> None:
    """Give each layer of ``group`` (whose parent is ``module``) its style and find the
    group's kind, or refuse."""
    where = describe_group(group)

    def shapes(layers: list[_Layer]) -> str:
        return ", ".join(f"{x.name} ({x.in_features}->{x.out_features})" for x in layers)

    writers = [layer for layer in group.layers if layer.out_features == hidden]
    if not writers:
        raise ValueError(
            f"the Linear layers of {where} ({shapes(group.layers)}) read the hidden size "
            f"{hidden} but none writes it back: cannot find the row-parallel (output) "
            "projection of the group"
        )
    attention_like = _named_like_attention(group, module)
    # an attention's output gate (AFMoE's gate_proj, Laguna's per-head g_proj) may come after
    # its output projection: the row-parallel layer is the last writer that is no gate
    gates = [x for x in group.layers if attention_like and OUTPUT_GATE_NAME.search(x.name)]
    row = ([w for w in writers if w not in gates] or writers)[-1]
    columns = [layer for layer in group.layers if layer is not row]
    strangers = [layer for layer in columns if layer.in_features != hidden]
    if strangers and _assign_mla(group, hidden, row, columns, strangers):
        return
    if strangers and not group.parent and len(writers) > 1:
        # q, k, v, o and the MLP's layers all children of the block (OLMo's Llama block)
        raise ValueError(
            f"the Linear layers of {where} are its own children ({shapes(group.layers)}), "
            f"{len(writers)} of them writing the hidden size {hidden} "
            f"({', '.join(w.name for w in writers)}): auto() pairs column- and row-parallel "
            "layers within one submodule (an attention, an MLP) and cannot tell the pairs "
            "here; write the plan by hand"
        )
    if strangers:
        raise ValueError(
            f"in {where}, {shapes(strangers)} do not read the hidden size {hidden} and are not "
            f"the row-parallel projection ({row.name}): not a column/row-parallel pair"
        )
    if not columns:
        raise ValueError(
            f"{where} holds only {shapes([row])}: a row-parallel layer without a "
            "column-parallel layer feeding it"
        )
    # a gate of the attention's output, per feature (as wide as the output projection reads)
    # or per head (a width dividing it): column-parallel, each rank its heads' gates
    gates = [x for x in gates if x in columns and row.in_features % x.out_features == 0]
    if len(columns) == len(gates):
        gates = []
    _assign_columns(group, [x for x in columns if x not in gates], row, attention_like, shapes)
    if gates and group.kind != "attention":
        raise ValueError(
            f"{where}: {shapes(gates)} look like gates of an attention's output, but the "
            "other layers are no attention"
        )
    for layer in gates:
        layer.style = ColwiseParallel()
    group.columns = [*group.columns, *gates]


# the name of an attention's output gate: gate_proj, g_proj, gate, o_gate, ...
OUTPUT_GATE_NAME = re.compile(r"(^|[._])(g|gate|o_gate|g_proj|gate_proj|output_gate)$")


def _assign_columns(
    group: LinearGroup, columns: list[_Layer], row: _Layer, named: bool, shapes: Callable
) -> None:
    """Find what the column-parallel ``columns`` feeding ``row`` are (an attention, by its
    shapes, or by its name as well, ``named``; or an MLP), and give each its style."""
    where = describe_group(group)
    square = row.in_features == row.out_features
    wide = row.in_features
    for layer in columns:
        layer.parts = 1
        if layer.out_features == 3 * wide and square:
            layer.parts = 3
        elif layer.out_features == 2 * wide:
            layer.parts = 2
    if (
        len(columns) == 3
        and columns[0].out_features == 2 * wide
        and columns[1].out_features == columns[2].out_features
        and wide % columns[1].out_features == 0
        and named
    ):
        # a gated query (Qwen3-Next): q_proj writes [q | gate] per head, beside k and v
        for layer in columns:
            layer.parts = 1
        columns[0].gated = True
    parts = sum(layer.parts for layer in columns)
    exact = [layer for layer in columns if layer.parts > 1 or layer.out_features == wide]
    narrow = [layer for layer in columns if layer not in exact]
    if not exact and not columns[0].gated:
        raise ValueError(
            f"the shapes in {where} do not chain: the row-parallel {row.name} reads "
            f"{wide} features, but the column-parallel layers write "
            f"{[x.out_features for x in columns]} ({shapes(columns)}); expected one of them "
            f"to write {wide} (or {2 * wide} or {3 * wide} for fused projections)"
        )
    if columns[0].gated or parts == 3 and _kv_like(narrow, exact, wide):
        group.kind = "attention"
    elif parts in (1, 2) and not narrow and not named:
        group.kind = "mlp"
    else:
        own = (
            "; these are the block's own children: an attention's and an MLP's layers side by "
            "side cannot be told apart"
            if not group.parent
            else ""
        )
        raise ValueError(
            f"cannot tell what {where} is: its column-parallel layers {shapes(columns)} "
            f"feed the row-parallel {row.name} ({row.in_features}->{row.out_features}); "
            "auto() knows attention (q, k and v, or a fused q/k/v of equal parts) and MLPs "
            f"(one or two projections, or a fused gate/up){own}"
        )
    for layer in columns:
        layer.style = ColwiseParallel() if layer.parts == 1 else PackedColwiseParallel(layer.parts)
    row.style = RowwiseParallel()
    group.row, group.columns = row, columns


def _assign_mla(
    group: LinearGroup, hidden: int, row: _Layer, columns: list[_Layer], ups: list[_Layer]
) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3), or ``False``.

    Down-projections read the hidden size; each up-projection reads what one of them writes
    (``q_a_proj`` -> ``q_b_proj``, through a norm) or all of it but a rotary part
    (``kv_a_proj_with_mqa`` -> ``kv_b_proj``). The query's down-projection stays whole (its
    output's gradient is reduced by the column-parallel ``q_b_proj``), the key/value one is
    ``MLAKVAProjParallel`` (its rotary part, read by every rank's heads, gets its gradient
    summed), the up-projections (or a plain ``q_proj``) are column-parallel, ``o_proj``
    row-parallel."""
    downs = [layer for layer in columns if layer.in_features == hidden]
    if len(downs) + len(ups) != len(columns) or len(ups) > 2:
        return False
    matches = {m for m in (_match_mla(downs, ups), _match_mla(downs, ups[::-1])) if m}
    if len(matches) > 1:  # q_b and kv_b read latents of one width: kv_b is named so
        matches = {m for m in matches if "kv" in m[3].name.rpartition(".")[2]}
    if len(matches) != 1:
        return False
    query, q_down, kv_down, kv_up = matches.pop()
    group.kind = "mla"
    group.rope = kv_down.out_features - kv_up.in_features
    group.latents = tuple(up.in_features for up in ups)
    for layer in columns:
        layer.parts = 1
    query.style = ColwiseParallel()
    kv_up.style = ColwiseParallel()
    kv_down.style = MLAKVAProjParallel(group.rope)
    row.style = RowwiseParallel()
    group.row, group.columns = row, [query, kv_up]
    return True


def _match_mla(downs: list[_Layer], ups: list[_Layer]) -> tuple | None:
    """``(query, its down-projection or None, key/value down, key/value up)``, pairing each
    up-projection (in this order) with an unused down-projection: the one writing exactly
    its input (the query's), else the one writing more (the key/value's, with the rotary
    part); ``None`` where that does not pair them all."""
    query = kv_down = kv_up = q_down = None
    used: list[_Layer] = []
    for up in ups:
        free = [d for d in downs if all(d is not u for u in used)]
        exact = [d for d in free if d.out_features == up.in_features]
        wider = [d for d in free if d.out_features > up.in_features]
        if len(exact) == 1 and query is None:
            q_down, query = exact[0], up
            used.append(exact[0])
        elif not exact and len(wider) == 1 and kv_up is None:
            kv_down, kv_up = wider[0], up
            used.append(wider[0])
        else:
            return None
    if kv_up is None:
        return None
    rest = [d for d in downs if all(d is not u for u in used)]
    if query is None:
        if len(rest) != 1:
            return None
        query = rest[0]
    elif rest:
        return None
    return query, q_down, kv_down, kv_up


def _named_like_attention(group: LinearGroup, module: nn.Module) -> bool:
    """An attention by its name, though not by its shapes (a fused q/k/v with grouped-query
    heads can write 2 x the output projection's input, like a fused gate/up)."""
    if not group.parent:
        return False  # Linear layers right in the block (OPT's fc1/fc2): the block's name
    name = group.parent.rpartition(".")[2].lower()
    return "attention" in type(module).__name__.lower() or "attn" in name or "attention" in name


def _kv_like(narrow: list[_Layer], exact: list[_Layer], wide: int) -> bool:
    """Narrow column layers are k and v of grouped-query attention: two of equal width
    dividing the query's, beside exactly one layer writing the query."""
    if not narrow:
        return True
    return (
        len(narrow) == 2
        and len(exact) == 1
        and exact[0].parts == 1
        and narrow[0].out_features == narrow[1].out_features
        and wide % narrow[0].out_features == 0
    )


def describe_group(group: LinearGroup) -> str:
    return f"'{group.key}'" if group.parent else f"the block '{group.key}'"


def join_dotted(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name


@dataclass
class BlockPlan:
    """The plan of one kind of block: its styles and what it leaves replicated, and why."""

    styles: dict[str, ParallelStyle]  # path inside the block -> style, in plan order
    replicated: dict[str, str]  # paths inside the block of mixers left replicated -> why
    groups: list[LinearGroup]  # the planned groups (for the TP degree check)
    experts: list[str]  # paths of stacked experts
    prefix: str = ""  # how errors name this kind of block
    indices: list[int] = field(default_factory=list)
    # attentions computed whole (weights sharded, outputs gathered) -> why their heads are not
    # split (for the warning)
    whole: dict[str, str] = field(default_factory=dict)
