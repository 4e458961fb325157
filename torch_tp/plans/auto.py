"""An automatic tensor-parallel plan, inferred from a model's structure.

:func:`auto` reads the module tree (and the parameter shapes, which a model on the meta
device has too) and returns an ordinary plan dict: the one a person would write for a
Megatron-style layout, with ``*`` over the repeated blocks. Print it with
:func:`torch_tp.plan.to_dict`, edit it, and pass it to :func:`torch_tp.parallelize_module`.
Where the structure does not say clearly what to do, :func:`auto` refuses with a
``ValueError`` that names the module and what was ambiguous, rather than guess.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from torch_tp.style import (
    AttentionHeads,
    ColwiseParallel,
    PackedColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

__all__ = ["auto"]

# where head counts are looked up: the attention module's own attributes first, then the
# model's config (the attention module's ``config``, then ``model.config``)
_HEAD_NAMES = ("num_heads", "n_heads", "num_attention_heads", "n_head")
_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")

_SELF_ATTRIBUTE = re.compile(r"\bself\.([A-Za-z_]\w*)")


def auto(model: nn.Module, *, tp_degree: int | None = None) -> dict[str, ParallelStyle]:
    """Infer a Megatron-style tensor-parallel plan for a transformer, from its structure.

    The model must be built from ``nn.Linear`` (or transformers' ``Conv1D``), ``nn.Embedding``
    and norm modules. Nothing is run and nothing is changed: a model on the meta device works,
    and no process group is needed. The rules, in order:

    1. **Blocks.** The repeated blocks are the ``nn.ModuleList`` holding the most parameters.
       All its children must have the same structure (module paths, types and parameter
       shapes), and no other ``nn.ModuleList`` outside it may hold Linear layers (an encoder
       and a decoder, a vision tower): else refuse. Plan keys use ``*`` for the block index.
    2. **Groups.** Inside a block, the Linear-like layers are grouped by their parent module
       (the attention, the MLP). The hidden size is the width that every group both reads
       and writes (the input embedding's width breaks a tie). In a group, the last
       registered layer writing the hidden size is row-parallel (``RowwiseParallel()``);
       the other layers must read the hidden size, and are column-parallel. The shapes must
       chain: the row-parallel layer reads what a column-parallel sibling writes
       (``ColwiseParallel()``), or one part of a fused one: ``PackedColwiseParallel(3)`` for a
       fused q/k/v writing 3 x the row-parallel's input beside a square row-parallel layer
       (GPT-2's ``c_attn``), ``PackedColwiseParallel(2)`` for a fused pair writing 2 x it
       (a fused gate/up). A group whose column-parallel layers make three parts (q, k and v:
       three layers, a fused one, or a query beside a fused key/value) is an attention;
       its k and v may be narrower (grouped-query attention). One or two parts, each
       writing exactly what the row-parallel layer reads, is an MLP. Anything else is
       refused, and so is a block holding a nested ``nn.ModuleList`` (mixture of experts).
    3. **Heads.** An attention group's parent gets ``AttentionHeads(...)`` when the head
       counts can be found: attributes of the attention module (``num_heads``, ``n_heads``,
       ``num_key_value_heads``, ...), of its ``config``, or of ``model.config``
       (``num_attention_heads``/``n_head``, ``num_key_value_heads``), named by attribute
       where the module has one and as numbers otherwise. They must fit the shapes (q writes
       heads x head size, k and v kv-heads x head size), else refuse. A fused q/k/v needs
       them (else refuse) and needs as many key/value heads as query heads; its module's
       integer attributes that ``forward`` (or a method of the class it calls) reads as
       ``self.<name>`` and that equal the hidden size or the head count are divided by the
       TP degree (``divide=...``), found from the source (refused if the source is
       unavailable, or if such a value also equals the head size). Attributes whose values
       differ between blocks (``layer_idx``) are ignored.
    4. **Embedding and head.** The input embedding (``model.get_input_embeddings()``, else
       the ``nn.Embedding`` outside the blocks whose vocabulary is the head's output size)
       is ``RowwiseParallel(input_layouts=Replicate())``; the output head (the Linear outside
       the blocks reading the embedding's width and writing its vocabulary) is
       ``ColwiseParallel(output_layouts=Replicate())``. Tied embedding and head weights are
       fine (both ``Shard(0)``; torch_tp keeps them tied). Other embeddings (positions) stay
       out of the plan.
    5. Norms, dropouts and everything else stay out of the plan (replicated).

    With ``tp_degree``, the plan is refused when a head count, a column-parallel layer's
    output (per part), a row-parallel layer's input or a divided attribute does not divide
    by it (vocabularies need not: uneven vocabulary shards are supported).

    The plan is communication-optimal in normal runs: column-parallel layers reading the same
    tensor (q, k and v; gate and up) share one backward all-reduce at run time, so no
    ``PrepareModuleInput`` is needed. It checks structure, not what ``forward`` computes:
    verify a new model with :func:`torch_tp.testing.check_parity`.

    Args:
        model: the model to plan for (on any device, including meta).

    Keyword Args:
        tp_degree (int, optional): the tensor-parallel degree to check sizes against.
            Default: ``None`` (no check).

    Returns:
        A dict from module paths (``*`` over the blocks) to styles: the embedding, then each
        block's groups in registration order, then the head.

    Raises:
        ValueError: the structure is ambiguous or unsupported, or a size does not divide by
            ``tp_degree``; the message names the module path and what was found.

    Example::
        >>> from torch_tp.models import Llama, tiny_config
        >>> from torch_tp.plan import to_dict
        >>> with torch.device("meta"):
        ...     model = Llama(tiny_config())
        >>> plan = to_dict(auto(model, tp_degree=2))
        >>> plan["layers.*.attention.wq"], plan["layers.*.feed_forward.w2"], plan["output"]
        ('colwise', 'rowwise', 'colwise_gather_output')
    """
    if tp_degree is not None and (
        not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1
    ):
        raise ValueError(f"tp_degree must be a positive int, found {tp_degree!r}")
    blocks_path, blocks = _find_blocks(model)
    prefix = f"{blocks_path}.*"
    block = blocks[0]
    groups = _linear_groups(block, prefix)
    embedding = _input_embedding(model, blocks_path)
    hidden = _hidden_size(groups, embedding, prefix)

    plan: dict[str, ParallelStyle] = {}
    head = _output_head(model, blocks_path, hidden, embedding)
    if head is not None:
        embedding = embedding or head[2]
    if embedding is not None:
        plan[embedding[0]] = RowwiseParallel(input_layouts=Replicate())
    for group in groups:
        _assign(group, hidden)
        if group.kind == "attention":
            heads = _attention_heads(model, blocks, group)
            if heads is not None:
                plan[_join(prefix, group.parent)] = heads
        for layer in group.layers:
            plan[layer.key] = layer.style
    if head is not None:
        plan[head[0]] = ColwiseParallel(output_layouts=Replicate())
    if tp_degree is not None:
        _check_degree(plan, groups, block, tp_degree)
    return plan


# ------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------


def _find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    lists = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if not lists:
        raise ValueError(
            f"no repeated blocks in {type(model).__qualname__}: auto() plans the layers of the "
            "largest nn.ModuleList, and the model has none; write the plan by hand"
        )
    path, blocks = max(lists, key=lambda item: _numel(item[1]))
    where = f"'{path}'" if path else "the root module"
    for other_path, other in lists:
        inside = other_path.startswith(f"{path}.") or path.startswith(f"{other_path}.")
        if other is blocks or inside or not _has_linear(other):
            continue
        raise ValueError(
            f"two stacks of blocks: '{other_path}' ({len(other)} x "
            f"{type(other[0]).__name__}) beside {where} ({len(blocks)} x "
            f"{type(blocks[0]).__name__}); auto() plans one stack: call it on the submodule "
            "holding each and prefix the keys, or write the plan by hand"
        )
    first = _structure(blocks[0])
    for i, child in enumerate(blocks):
        difference = _first_difference(first, _structure(child))
        if difference is not None:
            raise ValueError(
                f"the blocks of {where} differ: '{_join(path, str(i))}' has {difference[1]} "
                f"where '{_join(path, '0')}' has {difference[0]}; auto() needs identical "
                "blocks (one plan entry per layer with '*')"
            )
    return path, blocks


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _has_linear(module: nn.Module) -> bool:
    return any(_linear_shape(m) is not None for m in module.modules())


def _structure(block: nn.Module) -> list[tuple[str, str, tuple]]:
    return [
        (
            path,
            type(module).__qualname__,
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)),
        )
        for path, module in block.named_modules()
    ]


def _first_difference(a: list, b: list) -> tuple[str, str] | None:
    def show(entry: tuple | None) -> str:
        if entry is None:
            return "nothing"
        path, kind, params = entry
        shapes = ", ".join(f"{n} {list(s)}" for n, s in params)
        return f"'{path or '(the block)'}' ({kind}{': ' + shapes if shapes else ''})"

    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return show(x), show(y)
    return None


# ------------------------------------------------------------------------------------------
# Linear-like layers and their groups
# ------------------------------------------------------------------------------------------


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
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


@dataclass
class _Layer:
    name: str  # path inside the block
    key: str  # plan key
    in_features: int
    out_features: int
    style: ParallelStyle | None = None
    parts: int = 1


@dataclass
class _Group:
    parent: str  # path of the parent module inside the block ("" for the block itself)
    key: str  # plan key of the parent
    layers: list[_Layer]
    kind: str = ""  # "attention" or "mlp"
    row: _Layer | None = None
    columns: list[_Layer] = field(default_factory=list)
    heads: tuple[int, int] | None = None  # (query, key/value) head counts, if found


def _linear_groups(block: nn.Module, prefix: str) -> list[_Group]:
    groups: dict[str, _Group] = {}
    for path, module in block.named_modules():
        if path and isinstance(module, nn.ModuleList) and _has_linear(module):
            raise ValueError(
                f"'{_join(prefix, path)}' is a nn.ModuleList of Linear layers inside the "
                "repeated blocks (mixture of experts?): auto() does not plan experts; write "
                "the plan by hand"
            )
        shape = _linear_shape(module)
        if shape is None:
            continue
        parent = path.rpartition(".")[0]
        group = groups.setdefault(parent, _Group(parent, _join(prefix, parent), []))
        group.layers.append(_Layer(path, _join(prefix, path), *shape))
    if not groups:
        raise ValueError(
            f"the blocks '{prefix}' hold no nn.Linear (or Conv1D) layer: nothing to shard"
        )
    return list(groups.values())


def _hidden_size(groups: list[_Group], embedding: tuple | None, prefix: str) -> int:
    """The width every group both reads and writes (the residual stream)."""
    candidates: set[int] | None = None
    for group in groups:
        ins = {layer.in_features for layer in group.layers}
        outs = {layer.out_features for layer in group.layers}
        candidates = (ins & outs) if candidates is None else candidates & ins & outs
    candidates = candidates or set()
    width = None if embedding is None else embedding[1].embedding_dim
    if width in candidates:
        return width
    if len(candidates) == 1:
        return next(iter(candidates))
    found = "; ".join(
        f"'{g.key or '(the block)'}': "
        + ", ".join(f"{layer.name} {layer.in_features}->{layer.out_features}" for layer in g.layers)
        for g in groups
    )
    what = "no width" if not candidates else f"several widths {sorted(candidates)}"
    raise ValueError(
        f"cannot tell the hidden size of the blocks '{prefix}': {what} both read and written "
        f"by every group of Linear layers ({found})"
    )


def _assign(group: _Group, hidden: int) -> None:
    """Give each layer of ``group`` its style and find the group's kind, or refuse."""
    where = f"'{group.key}'" if group.parent else f"the block '{group.key}'"

    def shapes(layers: list[_Layer]) -> str:
        return ", ".join(f"{x.name} ({x.in_features}->{x.out_features})" for x in layers)

    writers = [layer for layer in group.layers if layer.out_features == hidden]
    if not writers:
        raise ValueError(
            f"the Linear layers of {where} ({shapes(group.layers)}) read the hidden size "
            f"{hidden} but none writes it back: cannot find the row-parallel (output) "
            "projection of the group"
        )
    row = writers[-1]
    columns = [layer for layer in group.layers if layer is not row]
    strangers = [layer for layer in columns if layer.in_features != hidden]
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
    square = row.in_features == row.out_features
    wide = row.in_features
    for layer in columns:
        layer.parts = 1
        if layer.out_features == 3 * wide and square:
            layer.parts = 3
        elif layer.out_features == 2 * wide:
            layer.parts = 2
    parts = sum(layer.parts for layer in columns)
    exact = [layer for layer in columns if layer.parts > 1 or layer.out_features == wide]
    narrow = [layer for layer in columns if layer not in exact]
    if not exact:
        raise ValueError(
            f"the shapes in {where} do not chain: the row-parallel {row.name} reads "
            f"{wide} features, but the column-parallel layers write "
            f"{[x.out_features for x in columns]} ({shapes(columns)}); expected one of them "
            f"to write {wide} (or {2 * wide} or {3 * wide} for fused projections)"
        )
    if parts == 3 and _kv_like(narrow, exact, wide):
        group.kind = "attention"
    elif parts in (1, 2) and not narrow:
        group.kind = "mlp"
    else:
        raise ValueError(
            f"cannot tell what {where} is: its column-parallel layers {shapes(columns)} "
            f"feed the row-parallel {row.name} ({row.in_features}->{row.out_features}); "
            "auto() knows attention (q, k and v, or a fused q/k/v) and MLPs (one or two "
            "projections, or a fused gate/up)"
        )
    for layer in columns:
        layer.style = ColwiseParallel() if layer.parts == 1 else PackedColwiseParallel(layer.parts)
    row.style = RowwiseParallel()
    group.row, group.columns = row, columns


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


# ------------------------------------------------------------------------------------------
# attention heads
# ------------------------------------------------------------------------------------------


def _attention_heads(
    model: nn.Module, blocks: nn.ModuleList, group: _Group
) -> AttentionHeads | None:
    attention = blocks[0].get_submodule(group.parent)
    heads = _count(model, attention, _HEAD_NAMES)
    kv_heads = _count(model, attention, _KV_HEAD_NAMES)
    fused = [layer for layer in group.columns if layer.parts > 1]
    where = f"'{group.key}'" if group.parent else f"the block '{group.key}'"
    if heads is None:
        if fused:
            raise ValueError(
                f"{where} has a fused q/k/v projection ('{fused[0].key}') but auto() found no "
                f"head count (looked for {', '.join(_HEAD_NAMES)} on {type(attention).__name__} "
                "and num_attention_heads, n_head, n_heads on the config): the module's sizes "
                "cannot be made per-rank safely; write the plan by hand"
            )
        return None
    n_heads, n_kv = heads[1], (kv_heads or heads)[1]
    _check_heads(group, where, n_heads, n_kv)
    group.heads = (n_heads, n_kv)
    divide: tuple[str, ...] = ()
    if fused:
        divide = _attributes_to_divide(blocks, group, where, n_heads)
    return AttentionHeads(heads[0], None if kv_heads is None else kv_heads[0], divide=divide)


def _count(
    model: nn.Module, attention: nn.Module, names: tuple[str, ...]
) -> tuple[int | str, int] | None:
    """``(how the plan names it, value)`` of the first head count found, or ``None``."""
    for name in names:
        if _is_int(getattr(attention, name, None)):
            return name, getattr(attention, name)
    own_config = getattr(attention, "config", None)
    for name in names:
        if _is_int(getattr(own_config, name, None)):
            return f"config.{name}", getattr(own_config, name)
    for name in names:
        value = getattr(getattr(model, "config", None), name, None)
        if _is_int(value):
            return value, value
    return None


def _check_heads(group: _Group, where: str, heads: int, kv_heads: int) -> None:
    wide = group.row.in_features
    problem = None
    if heads < 1 or kv_heads < 1 or wide % heads or heads % kv_heads:
        problem = f"{wide} features of the row-parallel {group.row.name} do not split into them"
    else:
        head_dim = wide // heads
        for layer in group.columns:
            if layer.parts == 1 and layer.out_features not in (wide, kv_heads * head_dim):
                problem = (
                    f"{layer.name} writes {layer.out_features} features, neither {heads} nor "
                    f"{kv_heads} heads of size {head_dim}"
                )
            elif layer.parts == 3 and kv_heads != heads:
                problem = (
                    f"the fused {layer.name} has three equal parts, which needs as many "
                    "key/value heads as query heads"
                )
            elif layer.parts == 2 and kv_heads != heads:
                problem = (
                    f"the fused key/value {layer.name} is split in two equal parts by "
                    f"{wide} features, which needs as many key/value heads as query heads"
                )
    if problem is not None:
        raise ValueError(
            f"the head counts found for {where} ({heads} query, {kv_heads} key/value heads) do "
            f"not fit its shapes: {problem}"
        )


def _attributes_to_divide(
    blocks: nn.ModuleList, group: _Group, where: str, heads: int
) -> tuple[str, ...]:
    attentions = [block.get_submodule(group.parent) for block in blocks]
    kind = type(attentions[0])
    try:
        names = _names_read(kind)
    except (OSError, TypeError) as err:
        raise ValueError(
            f"{where} ({kind.__qualname__}) has a fused q/k/v projection, and its forward may "
            "read sizes from attributes that must become per-rank, but its source is "
            f"unavailable ({err}); write the plan by hand (AttentionHeads(divide=...))"
        ) from None
    hidden, head_dim = group.row.out_features, group.row.in_features // heads
    divide = []
    for name in sorted(names):
        values = [getattr(a, name, None) for a in attentions]
        value = values[0]
        if not _is_int(value) or value not in (hidden, heads):
            continue
        if any(other != value for other in values):
            continue  # a per-block value (layer_idx): not a size
        if value == head_dim:
            raise ValueError(
                f"{where}: forward reads self.{name} = {value}, which is both the "
                f"{'hidden size' if value == hidden else 'head count'} (to divide by the TP "
                f"degree) and the head size (to keep): ambiguous; write the plan by hand"
            )
        divide.append(name)
    return tuple(divide)


def _names_read(kind: type) -> set[str]:
    """The ``self.<name>`` that ``kind.forward`` reads, and the methods of ``kind`` it calls
    (transitively; torch.nn's own methods excluded)."""
    seen: set[str] = set()
    todo = ["forward"]
    names: set[str] = set()
    while todo:
        method = todo.pop()
        seen.add(method)
        function = inspect.getattr_static(kind, method)
        source = inspect.getsource(getattr(function, "__func__", function))
        for name in _SELF_ATTRIBUTE.findall(source):
            names.add(name)
            found = inspect.getattr_static(kind, name, None)
            if (
                name not in seen
                and isinstance(found, (Callable, staticmethod, classmethod))
                and not hasattr(nn.Module, name)
            ):
                todo.append(name)
    return names


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------
# embedding and head
# ------------------------------------------------------------------------------------------


def _outside(path: str, blocks_path: str) -> bool:
    return not (path == blocks_path or path.startswith(f"{blocks_path}."))


def _path_of(model: nn.Module, module: nn.Module) -> str | None:
    for path, candidate in model.named_modules():
        if candidate is module:
            return path
    return None


def _input_embedding(model: nn.Module, blocks_path: str) -> tuple[str, nn.Embedding] | None:
    """``model.get_input_embeddings()``, if the model has it and it is an ``nn.Embedding``."""
    getter = getattr(model, "get_input_embeddings", None)
    if not callable(getter):
        return None
    try:
        embedding = getter()
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(embedding, nn.Embedding):
        return None
    path = _path_of(model, embedding)
    if path is None or not _outside(path, blocks_path):
        return None
    return path, embedding


def _output_head(
    model: nn.Module, blocks_path: str, hidden: int, embedding: tuple | None
) -> tuple[str, nn.Module, tuple | None] | None:
    """``(path, head, embedding found by it)``: the Linear outside the blocks from the
    embedding's width (the hidden size) to the vocabulary, if there is one."""
    linears = [
        (path, module, _linear_shape(module))
        for path, module in model.named_modules()
        if _outside(path, blocks_path) and _linear_shape(module) is not None
    ]
    if embedding is not None:
        emb = embedding[1]
        found = [
            (path, m, None)
            for path, m, (i, o) in linears
            if (i, o) == (emb.embedding_dim, emb.num_embeddings)
        ]
    else:
        embeddings = [
            (path, m)
            for path, m in model.named_modules()
            if isinstance(m, nn.Embedding) and _outside(path, blocks_path)
        ]
        found = []
        for path, m, (i, o) in linears:
            vocab = [e for e in embeddings if e[1].num_embeddings == o]
            if i != hidden or not vocab:
                continue
            if len(vocab) > 1:
                names = ", ".join(f"'{e[0]}'" for e in vocab)
                raise ValueError(
                    f"the output head '{path}' writes {o} features, the size of several "
                    f"embeddings ({names}): cannot tell which is the input embedding; give "
                    "the model a get_input_embeddings() or write the plan by hand"
                )
            found.append((path, m, vocab[0]))
    if len(found) > 1:
        names = ", ".join(f"'{path}'" for path, _, _ in found)
        raise ValueError(
            f"several Linear layers outside the blocks look like the output head ({names}): "
            "write the plan by hand"
        )
    return found[0] if found else None


# ------------------------------------------------------------------------------------------
# the TP degree
# ------------------------------------------------------------------------------------------


def _check_degree(
    plan: dict[str, ParallelStyle],
    groups: list[_Group],
    block: nn.Module,
    n: int,
) -> None:
    for group in groups:
        if group.heads is not None:
            for what, count in zip(("query heads", "key/value heads"), group.heads, strict=True):
                if count % n:
                    raise ValueError(
                        f"'{group.key}': {count} {what} do not divide by tp_degree {n} (each "
                        "rank must hold whole heads)"
                    )
            attention = block.get_submodule(group.parent)
            for name in plan[group.key].divide:
                value = getattr(attention, name)
                if value % n:
                    raise ValueError(
                        f"'{group.key}': attribute {name!r} = {value} does not divide by "
                        f"tp_degree {n}"
                    )
        for layer in group.columns:
            per_part = layer.out_features // layer.parts
            if per_part % n:
                fused = f" ({layer.parts} parts of {per_part})" if layer.parts > 1 else ""
                raise ValueError(
                    f"'{layer.key}': {layer.out_features} output features{fused} do not divide "
                    f"by tp_degree {n}"
                )
        if group.row.in_features % n:
            raise ValueError(
                f"'{group.row.key}': {group.row.in_features} input features do not divide by "
                f"tp_degree {n}"
            )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name
