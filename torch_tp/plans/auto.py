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
    ReplicateParallel,
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
       refused (a group without a layer writing the hidden size, layers reading another
       width, shapes that do not chain), and so is a block holding a nested
       ``nn.ModuleList`` of Linear layers (mixture of experts).
    3. **Heads.** An attention group's parent gets ``AttentionHeads(...)`` when the head
       counts can be found: attributes of the attention module (``num_heads``, ``n_heads``,
       ``num_key_value_heads``, ...), of its ``config``, or of ``model.config``
       (``num_attention_heads``/``n_head``, ``num_key_value_heads``), named by attribute
       where the module has one and as numbers otherwise. They must fit the shapes (q writes
       heads x head size, k and v kv-heads x head size), else refuse. The integer attributes
       that the attention's ``forward`` (or a method of its class that forward calls) reads
       as ``self.<name>``, found from the source (refused if it is unavailable), and that
       equal the query width or a head count are divided by the TP degree
       (``divide=...``) when their name says they are such a size (``num_heads``,
       ``split_size``, ``embed_dim``, ...) or forward splits by them; ignored when their name
       says otherwise (``head_dim``, ``layer_idx``, ...) or their value differs between
       blocks; refused otherwise (a ``self.window`` equal to the width by chance).
       A name saying "attention" or "attn" on a group shaped like an MLP is refused.
    4. **Fused projections.** A fused q/k/v needs head counts, as many key/value heads as
       query heads, and a ``forward`` that splits it into ``[q | k | v]`` blocks: by an
       attribute equal to one part's width (GPT-2's ``.split(self.split_size, dim=2)``,
       that attribute is divided) or by ``self.<fused>(x).chunk(3, ...)``; a reshape per
       head first (GPT-NeoX, Bloom) is refused. A fused gate/up needs a ``forward`` that
       calls ``.chunk(2, ...)`` and reads no attribute equal to one half's width.
    5. **Embedding and head.** The input embedding (``model.get_input_embeddings()``, else
       the ``nn.Embedding`` outside the blocks whose vocabulary is the head's output size)
       is ``RowwiseParallel(input_layouts=Replicate())``; the output head (the one Linear
       outside the blocks reading the embedding's width, the hidden size, and writing its
       vocabulary; several candidates are refused) is
       ``ColwiseParallel(output_layouts=Replicate())``. Tied embedding and head weights are
       fine (both ``Shard(0)``; torch_tp keeps them tied). Other embeddings (positions) stay
       out of the plan, as do all other modules outside the blocks.
    6. **Everything else** in a block stays out of the plan (replicated): norms, dropouts,
       any module whose parameters are scalars or 1-D of the hidden size, outside the
       attention and MLP modules. Inside an attention, a module whose parameters are 1-D of
       the head size (per-head ``q_norm``/``k_norm``, as in Qwen3) sees only this rank's
       heads: ``ReplicateParallel(sum_gradients=True)``. Any other parameter in a block is
       refused (a router, 3-D expert weights, a bias of per-head values).

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
        block's groups in registration order (then its per-head norms), then the head.

    Raises:
        ValueError: the structure is ambiguous or unsupported, or a size does not divide by
            ``tp_degree``; the message names the module path and what was found.

    Example::
        >>> import torch
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
    head = _output_head(model, blocks_path, embedding)
    if head is not None:
        embedding = embedding or head[2]
    hidden = _hidden_size(groups, embedding, prefix)

    plan: dict[str, ParallelStyle] = {}
    if embedding is not None:
        plan[embedding[0]] = RowwiseParallel(input_layouts=Replicate())
    for group in groups:
        _assign(group, hidden, block.get_submodule(group.parent))
        if group.kind == "attention":
            heads = _attention_heads(model, blocks, group)
            if heads is not None:
                plan[group.key] = heads
        elif any(layer.parts > 1 for layer in group.columns):
            _check_fused_mlp(blocks, group)
        for layer in group.layers:
            plan[layer.key] = layer.style
    plan.update(_other_parameters(block, groups, hidden, prefix))
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


def _assign(group: _Group, hidden: int, module: nn.Module) -> None:
    """Give each layer of ``group`` (whose parent is ``module``) its style and find the
    group's kind, or refuse."""
    where = _where(group)

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
    elif parts in (1, 2) and not narrow and not _named_like_attention(group, module):
        group.kind = "mlp"
    else:
        raise ValueError(
            f"cannot tell what {where} is: its column-parallel layers {shapes(columns)} "
            f"feed the row-parallel {row.name} ({row.in_features}->{row.out_features}); "
            "auto() knows attention (q, k and v, or a fused q/k/v of equal parts) and MLPs "
            "(one or two projections, or a fused gate/up)"
        )
    for layer in columns:
        layer.style = ColwiseParallel() if layer.parts == 1 else PackedColwiseParallel(layer.parts)
    row.style = RowwiseParallel()
    group.row, group.columns = row, columns


def _named_like_attention(group: _Group, module: nn.Module) -> bool:
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


# ------------------------------------------------------------------------------------------
# attention heads, and what forward reads
# ------------------------------------------------------------------------------------------

# attributes that name a per-rank size when forward reads them: divided by the TP degree
_SIZE_NAMES = frozenset(
    _HEAD_NAMES
    + _KV_HEAD_NAMES
    + (
        "num_attention_heads",
        "hidden_size",
        "embed_dim",
        "n_embd",
        "d_model",
        "dim",
        "split_size",
        "all_head_size",
        "inner_dim",
    )
)
# attributes that stay as they are, even when their value happens to equal a size
_KEEP_NAMES = frozenset(
    (
        "head_dim",
        "head_size",
        "attention_head_size",
        "attn_head_size",
        "num_key_value_groups",
        "n_rep",
        "rotary_dim",
        "layer_idx",
        "layer_id",
    )
)


def _attention_heads(
    model: nn.Module, blocks: nn.ModuleList, group: _Group
) -> AttentionHeads | None:
    attention = blocks[0].get_submodule(group.parent)
    where = _where(group)
    heads = _count(model, attention, _HEAD_NAMES)
    kv_heads = _count(model, attention, _KV_HEAD_NAMES)
    fused = [layer for layer in group.columns if layer.parts > 1]
    if heads is None and fused:
        raise ValueError(
            f"{where} has a fused q/k/v projection ('{fused[0].key}') but auto() found no "
            f"head count (looked for {', '.join(_HEAD_NAMES)} on {type(attention).__name__} "
            "and num_attention_heads, n_head, n_heads on the config): the module's sizes "
            "cannot be made per-rank safely; write the plan by hand"
        )
    counts = None
    if heads is not None:
        counts = (heads[1], (kv_heads or heads)[1])
        _check_heads(group, where, *counts)
        group.heads = counts
    source = _source(type(attention), where, "attention")
    split = _fused_split_sizes(attention, group, source, where) if fused else set()
    divide = _sizes_to_divide(blocks, group, source, counts, split, where)
    if heads is None:
        if divide:
            raise ValueError(
                f"{where}: forward reads self.{divide[0]}, a size that must become per-rank, "
                "but auto() found no head count to check it against; write the plan by hand"
            )
        return None
    return AttentionHeads(heads[0], None if kv_heads is None else kv_heads[0], divide=divide)


def _where(group: _Group) -> str:
    return f"'{group.key}'" if group.parent else f"the block '{group.key}'"


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
            elif layer.parts > 1 and kv_heads != heads:
                problem = (
                    f"the fused {layer.name} has {layer.parts} equal parts, which needs as many "
                    "key/value heads as query heads"
                )
    if problem is not None:
        raise ValueError(
            f"the head counts found for {where} ({heads} query, {kv_heads} key/value heads) do "
            f"not fit its shapes: {problem}"
        )


def _fused_split_sizes(attention: nn.Module, group: _Group, source: str, where: str) -> set[str]:
    """The attributes by which forward splits a fused q/k/v (to be divided), or refuse.

    Only two layouts are recognized as ``[q | k | v]`` blocks (what
    :class:`PackedColwiseParallel` shards): a split by an attribute equal to one part's width
    (GPT-2's ``.split(self.split_size, dim=2)``), and ``self.<fused>(x).chunk(n, ...)``. A
    reshape to ``(..., heads, 3, head_dim)`` first (GPT-NeoX, Bloom) interleaves the parts
    per head, which this style would shard wrongly.
    """
    width = group.row.in_features
    names = set(re.findall(r"\.split\(\s*self\.(\w+)", source))
    names |= set(re.findall(r"torch\.split\([^,()]+,\s*self\.(\w+)", source))
    split = {name for name in names if getattr(attention, name, None) == width}
    chunked = all(
        re.search(
            rf"self\.{re.escape(layer.name.rpartition('.')[2])}\([^()]*\)\s*\.chunk\(\s*"
            rf"{layer.parts}\b",
            source,
        )
        for layer in group.columns
        if layer.parts > 1
    )
    if not split and not chunked:
        fused = next(layer for layer in group.columns if layer.parts > 1)
        raise ValueError(
            f"{where}: cannot tell how forward splits the fused '{fused.key}' into q, k and "
            f"v: auto() recognizes a split by an attribute equal to {width} (GPT-2's "
            f"'.split(self.split_size, dim=2)') or 'self.{fused.name.rpartition('.')[2]}(x)"
            f".chunk({fused.parts}, ...)'; a layout interleaved per head (GPT-NeoX, Bloom) "
            "needs a different plan: write it by hand"
        )
    return split


def _sizes_to_divide(
    blocks: nn.ModuleList,
    group: _Group,
    source: str,
    counts: tuple[int, int] | None,
    split: set[str],
    where: str,
) -> tuple[str, ...]:
    """The integer attributes forward reads that hold the query width or a head count."""
    attentions = [block.get_submodule(group.parent) for block in blocks]
    sizes = {group.row.in_features: "the width of the query heads"}
    if counts is not None:
        sizes.setdefault(counts[1], "the key/value head count")
        sizes[counts[0]] = "the head count"
    divide = []
    for name in sorted(set(_SELF_ATTRIBUTE.findall(source))):
        values = [getattr(a, name, None) for a in attentions]
        value = values[0]
        if not _is_int(value) or value not in sizes:
            continue
        if name in split:
            divide.append(name)
        elif name in _KEEP_NAMES or any(other != value for other in values):
            continue  # a head size, a ratio, a per-block index (layer_idx)
        elif name in _SIZE_NAMES:
            divide.append(name)
        else:
            raise ValueError(
                f"{where}: forward reads self.{name} = {value}, which equals {sizes[value]}; "
                "auto() cannot tell whether it is a size that must become per-rank (divided "
                "by the TP degree) or not: write the plan by hand"
            )
    return tuple(divide)


def _check_fused_mlp(blocks: nn.ModuleList, group: _Group) -> None:
    """A fused gate/up must be split in two halves by forward, with no size read from an
    attribute (no style makes an MLP's attributes per-rank)."""
    where = _where(group)
    module = blocks[0].get_submodule(group.parent)
    source = _source(type(module), where, "MLP")
    fused = next(layer for layer in group.columns if layer.parts > 1)
    if not re.search(r"\.chunk\(\s*2\b|torch\.chunk\([^,()]+,\s*2\b", source):
        raise ValueError(
            f"{where}: cannot tell how forward splits the fused '{fused.key}': auto() "
            "recognizes '.chunk(2, ...)' into two contiguous halves; write the plan by hand"
        )
    width = group.row.in_features
    for name in sorted(set(_SELF_ATTRIBUTE.findall(source))):
        if name not in _KEEP_NAMES and getattr(module, name, None) == width:
            raise ValueError(
                f"{where}: forward reads self.{name} = {width}, the width of each half of the "
                f"fused '{fused.key}', which would have to become per-rank: write the plan by "
                "hand"
            )


def _source(kind: type, where: str, what: str) -> str:
    """The source of ``kind.forward`` and of the methods of ``kind`` it calls (transitively;
    torch.nn's own methods excluded), or refuse."""
    seen: set[str] = set()
    todo = ["forward"]
    sources = []
    while todo:
        method = todo.pop()
        seen.add(method)
        function = inspect.getattr_static(kind, method)
        try:
            source = inspect.getsource(getattr(function, "__func__", function))
        except (OSError, TypeError) as err:
            raise ValueError(
                f"{where} ({kind.__qualname__}): auto() reads the {what}'s forward to find "
                "the sizes it takes from attributes (which must become per-rank), but its "
                f"source is unavailable ({err}); write the plan by hand"
            ) from None
        sources.append(source)
        for name in _SELF_ATTRIBUTE.findall(source):
            found = inspect.getattr_static(kind, name, None)
            if (
                name not in seen
                and name not in todo
                and isinstance(found, (Callable, staticmethod, classmethod))
                and not hasattr(nn.Module, name)
            ):
                todo.append(name)
    return "\n".join(sources)


# ------------------------------------------------------------------------------------------
# the other parameters of a block
# ------------------------------------------------------------------------------------------


def _other_parameters(
    block: nn.Module, groups: list[_Group], hidden: int, prefix: str
) -> dict[str, ParallelStyle]:
    """Styles for the parameters of a block outside its Linear layers, or refuse.

    Outside the attention and MLP modules, a module whose parameters are 1-D of the hidden
    size (a norm) or scalars sees whole activations: it stays out of the plan (replicated).
    Inside an attention, a module whose parameters are 1-D of the head size (per-head
    ``q_norm``/``k_norm``) sees this rank's heads: ``ReplicateParallel(sum_gradients=True)``
    sums its gradient over the ranks. Anything else is refused.
    """
    planned = {layer.name for group in groups for layer in group.layers}
    parents = [group for group in groups if group.parent]
    styles: dict[str, ParallelStyle] = {}
    for path, module in block.named_modules():
        params = list(module.named_parameters(recurse=False))
        if path in planned or not params:
            continue
        key = _join(prefix, path)
        shapes = ", ".join(f"{name} {list(p.shape)}" for name, p in params)
        inside = next(
            (g for g in parents if path == g.parent or path.startswith(f"{g.parent}.")), None
        )
        if inside is None:
            if all(p.ndim == 0 or tuple(p.shape) == (hidden,) for _, p in params):
                continue
            raise ValueError(
                f"'{key}' ({type(module).__name__}) holds parameters auto() does not know how "
                f"to lay out ({shapes}): outside the Linear layers it leaves only 1-D "
                f"parameters of the hidden size {hidden} (norms) and scalars replicated; write "
                "the plan by hand"
            )
        heads = inside.heads
        head_dim = None if heads is None else inside.row.in_features // heads[0]
        if (
            inside.kind == "attention"
            and path != inside.parent
            and head_dim is not None
            and all(tuple(p.shape) == (head_dim,) for _, p in params)
        ):
            styles[key] = ReplicateParallel(sum_gradients=True)
            continue
        raise ValueError(
            f"'{key}' ({type(module).__name__}, {shapes}) is inside the {inside.kind} "
            f"{_where(inside)}, whose activations are split over the ranks: auto() only "
            "knows per-head norms there (1-D parameters of the head size"
            + (f" {head_dim}" if head_dim else ", and no head count was found")
            + "); write the plan by hand"
        )
    return styles


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
    model: nn.Module, blocks_path: str, embedding: tuple | None
) -> tuple[str, nn.Module, tuple | None] | None:
    """``(path, head, embedding found by it)``: the Linear outside the blocks from the input
    embedding's width to its vocabulary, if there is one. Without ``embedding``, the
    embeddings outside the blocks are tried, each with the Linear layers that match it."""
    linears = [
        (path, module, _linear_shape(module))
        for path, module in model.named_modules()
        if _outside(path, blocks_path) and _linear_shape(module) is not None
    ]
    if embedding is not None:
        embeddings = [embedding]
    else:
        embeddings = [
            (path, m)
            for path, m in model.named_modules()
            if isinstance(m, nn.Embedding) and _outside(path, blocks_path)
        ]
    found = [
        (path, m, None if embedding is not None else emb)
        for path, m, shape in linears
        for emb in embeddings
        if shape == (emb[1].embedding_dim, emb[1].num_embeddings)
    ]
    if len(found) > 1:
        pairs = ", ".join(
            f"'{path}'" + (f" (with '{emb[0]}')" if emb is not None else "")
            for path, _, emb in found
        )
        raise ValueError(
            f"several Linear layers outside the blocks look like the output head: {pairs}; "
            "cannot tell which is the head (and which embedding is the input): give the "
            "model a get_input_embeddings() or write the plan by hand"
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
