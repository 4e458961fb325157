"""Planning one attention or MLP group: its heads, and what its ``forward`` reads.

:func:`plan_group` plans a group that :func:`~torch_tp.plans.auto.groups.assign_styles` found to be
an attention or MLP: an attention gets ``AttentionHeads`` (head counts found on the module or
the config, checked against the shapes, and the attributes its ``forward`` reads that must
become per-rank), ``LocalParamsParallel`` for attention sinks, or is computed whole, its
weights sharded (a norm over all the heads, heads no attribute can make per-rank, or a group
the shape check sends back); a fused gate/up MLP has its ``forward`` checked. The sources of
``forward`` and the methods it calls are read here (:func:`_source`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp.plans.auto.groups import OUTPUT_GATE_NAME, BlockPlan, LinearGroup, describe_group
from torch_tp.style import (
    AttentionHeads,
    ColwiseParallel,
    LocalParamsParallel,
    RowwiseParallel,
)

__all__: list[str] = []


# where head counts are looked up: the attention module's own attributes first, then the
# model's config (the attention module's ``config``, then ``model.config``)
# (Meta's Llama and llama2.c name theirs ``n_local_heads`` / ``n_local_kv_heads``: the heads of
# one model-parallel rank, all of them at model_parallel_size 1)
_HEAD_NAMES = ("num_heads", "n_heads", "num_attention_heads", "n_head", "n_local_heads")


_KV_HEAD_NAMES = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "kv_heads",
    "n_local_kv_heads",
)


_SELF_ATTRIBUTE = re.compile(r"\bself\.([A-Za-z_]\w*)")


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
        "rotary_ndims",
        "rotary_emb_dim",
        "rope_dim",
        # multi-head latent attention: per-head sizes and latent ranks
        "qk_head_dim",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "kv_lora_rank",
        "q_lora_rank",
    )
)


def plan_group(
    model: nn.Module,
    members: list[nn.Module],
    group: LinearGroup,
    result: BlockPlan,
    whole: dict[str, str],
) -> None:
    if group.key in whole and group.kind in ("attention", "mlp"):
        # the shape check found that its sizes cannot be made per-rank: computed whole
        _gather_attention(group)
        result.whole[group.parent] = f"computed whole, its weights sharded: {whole[group.key]}"
    elif group.kind in ("attention", "mla"):
        attention = members[0].get_submodule(group.parent)
        full_width = group.kind == "attention" and _full_width_norms(model, attention, group)
        unsplittable = None
        if group.kind == "attention" and not full_width:
            unsplittable = _unsplittable_heads(model, attention, group)
        if full_width:
            _gather_attention(group)
        elif unsplittable is not None:
            # its heads cannot be made per-rank: computed whole on every rank, its projections'
            # weights sharded (q, k and v gathered, the output projection split)
            _gather_attention(group)
            result.whole[group.parent] = (
                f"an attention computed whole, its projections' weights sharded: {unsplittable}"
            )
        else:
            heads = _attention_heads(model, members, group)
            sinks = _sinks(attention, group)
            if sinks:
                if heads is not None and heads.divide:
                    raise ValueError(
                        f"{describe_group(group)} has attention sinks and reads sizes that must "
                        f"become per-rank ({', '.join(heads.divide)}): no style does both; write "
                        "the plan by hand"
                    )
                result.styles[group.parent] = LocalParamsParallel({"sinks": Shard(0)})
            elif heads is not None:
                result.styles[group.parent] = heads
    elif any(layer.parts > 1 for layer in group.columns):
        _check_fused_mlp(members, group)
    for layer in group.layers:
        if layer.style is not None:
            result.styles[layer.name] = layer.style
    result.groups.append(group)


def _attention_heads(
    model: nn.Module, blocks: nn.ModuleList, group: LinearGroup
) -> AttentionHeads | None:
    attention = blocks[0].get_submodule(group.parent)
    where = describe_group(group)
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
        # a key/value count that was not found is taken as the query count: say so if wrong
        assumed = None if kv_heads is not None else ", ".join(_KV_HEAD_NAMES)
        _check_heads(group, where, *counts, assumed)
        group.heads = counts
    source = _source(type(attention), where, "attention")
    if group.kind == "mla":
        _check_rope(model, attention, group, where)
    if any(layer.gated for layer in group.columns) and not re.search(
        r"self\.head_dim\s*\*\s*2\b", source
    ):
        raise ValueError(
            f"{where}: the query projection writes twice the query heads' width (a gated "
            "query), and forward does not view it per head as '(..., heads, self.head_dim * "
            "2)' before splitting query and gate: cannot tell that whole heads stay "
            "together; write the plan by hand"
        )
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


def _check_rope(model: nn.Module, attention: nn.Module, group: LinearGroup, where: str) -> None:
    """The key/value latent's last ``group.rope`` features must be its rotary part, as the
    attention (or the config) names it (``qk_rope_head_dim``), else refuse."""
    found = _count(model, attention, ("qk_rope_head_dim",))
    if found is None or found[1] != group.rope:
        raise ValueError(
            f"{where} looks like multi-head latent attention with a rotary part of {group.rope} "
            "features in its key/value down-projection, but "
            + (
                "no qk_rope_head_dim was found"
                if found is None
                else f"qk_rope_head_dim is {found[1]}"
            )
            + "; write the plan by hand"
        )


def _full_width_norms(model: nn.Module, attention: nn.Module, group: LinearGroup) -> bool:
    """Whether a norm inside the attention normalizes all the heads at once (OLMo-2's
    ``q_norm`` over the whole query width): it needs every head on every rank."""
    heads = _count(model, attention, _HEAD_NAMES)
    wide = group.row.in_features
    head_dim = wide // heads[1] if heads and heads[1] and wide % heads[1] == 0 else None
    widths = {layer.out_features for layer in group.columns} | {wide}
    planned = {layer.name.rpartition(".")[2] for layer in group.layers}
    for name, module in attention.named_modules():
        if not name or name in planned:
            continue
        params = list(module.parameters(recurse=False))
        if params and all(
            p.ndim == 1 and p.shape[0] in widths and p.shape[0] != head_dim for p in params
        ):
            return True
    return False


def _gather_attention(group: LinearGroup) -> None:
    """Attention computed whole on every rank, its projections' weights sharded (as
    transformers plans OLMo-2): q, k and v gather their outputs, o splits its input. A fused
    q/k/v is gathered whole too: its output on every rank is the single-device one, whatever
    its layout."""
    group.kind = "gathered"
    for layer in group.columns:
        layer.style = ColwiseParallel(output_layouts=Replicate())
    group.row.style = RowwiseParallel(input_layouts=Replicate())


def _sinks(attention: nn.Module, group: LinearGroup) -> bool:
    """Whether the attention has sinks (one learned logit per head, ``sinks [heads]``), which
    shard with the heads; other parameters of its own are refused."""
    own = dict(attention.named_parameters(recurse=False))
    if not own:
        return False
    heads = None if group.heads is None else group.heads[0]
    if list(own) != ["sinks"] or heads is None or tuple(own["sinks"].shape) != (heads,):
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in own.items())
        raise ValueError(
            f"{describe_group(group)} ({type(attention).__name__}) holds parameters of its own "
            f"({shapes}): auto() knows attention sinks there (sinks [heads], with the head "
            "count found); write the plan by hand"
        )
    return True


def _unsplittable_heads(model: nn.Module, attention: nn.Module, group: LinearGroup) -> str | None:
    """Why the heads of this attention cannot be split over the ranks by a per-rank attribute
    (:class:`AttentionHeads` ``divide``), or ``None``.

    * forward reads the width of an input and uses it (nanoGPT's ``B, T, C = x.size()``, then
      ``view(B, T, self.n_head, C // self.n_head)`` and ``view(B, T, C)``; fairseq's
      ``assert embed_dim == self.embed_dim``): that width is the full one on every rank, and
      no attribute can make it per-rank;
    * the attention holds tensors (buffers, or plain tensor attributes that forward reads)
      with a dimension of the head count (Meta's KV cache ``cache_k [B, S, kv_heads, D]``):
      no style reshapes them.
    """
    where = describe_group(group)
    source = _source(type(attention), where, "attention")
    width = _input_width(type(attention), source)
    if width is not None:
        return (
            f"its forward reads the width of its input ({width}) and computes with it, which "
            "stays the full width on every rank"
        )
    heads = _count(model, attention, _HEAD_NAMES)
    kv_heads = _count(model, attention, _KV_HEAD_NAMES)
    counts = {c[1] for c in (heads, kv_heads) if c is not None and c[1] > 1}
    read = set(_SELF_ATTRIBUTE.findall(source))
    tensors = [
        *((n, v) for n, v in vars(attention).items() if isinstance(v, torch.Tensor)),
        *attention.named_buffers(recurse=False),
    ]
    sized = [
        name
        for name, value in tensors
        if name in read and value.ndim > 1 and any(n in counts for n in value.shape[:-1])
    ]
    if sized:
        return (
            f"it holds tensors sized by the heads ({', '.join(sorted(set(sized)))}) that no style "
            "makes per-rank"
        )
    per_head = _modules_per_head(attention, counts)
    if per_head:
        return (
            f"it holds one module per head ({', '.join(per_head)}), which forward pairs with "
            "the heads it has: a rank would pair its own heads with the first modules"
        )
    return None


def _modules_per_head(attention: nn.Module, counts: set[int]) -> list[str]:
    """The containers inside ``attention`` holding as many modules with parameters or buffers
    as it has heads (StableLM's per-head q and k norms, ``q_layernorm.norms``), as
    ``"path: n modules"``."""
    found = []
    for path, sub in attention.named_modules():
        if not isinstance(sub, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = list(sub.children())
        stateful = all(
            next(c.parameters(), None) is not None or next(c.buffers(), None) is not None
            for c in children
        )
        if len(children) in counts and stateful:
            found.append(f"{path}: {len(children)} modules")
    return found


# a use of a name, not as an attribute (self.dim) nor as a keyword argument (dim=-1)
def _used(name: str, source: str) -> bool:
    return bool(re.search(rf"(?<![\w.]){re.escape(name)}\b(?!\s*=(?!=))", source))


def _input_width(kind: type, source: str) -> str | None:
    """How ``kind.forward`` reads the width (last dimension) of one of its inputs and uses it
    (``"C from x.size()"``), or ``None``."""
    try:
        inputs = set(list(inspect.signature(kind.forward).parameters)[1:])
    except (TypeError, ValueError):
        return None
    unpack = re.compile(
        r"^[ \t]*(?:\w+[ \t]*,[ \t]*)+(\w+)[ \t]*=[ \t]*(\w+)\.(size\(\)|shape)[ \t]*(?:#.*)?$",
        re.M,
    )
    for match in unpack.finditer(source):
        name, tensor, how = match.groups()
        if tensor in inputs and name != "_" and _used(name, source):
            return f"{name} from {tensor}.{how}"
    direct = re.compile(r"\b(\w+)\.(size\(\s*-1\s*\)|shape\[\s*-1\s*\])")
    for match in direct.finditer(source):
        if match.group(1) in inputs:
            return f"{match.group(1)}.{match.group(2)}"
    return None


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


def _check_heads(
    group: LinearGroup, where: str, heads: int, kv_heads: int, assumed: str | None = None
) -> None:
    """Raise unless the projections' sizes split into ``heads`` query and ``kv_heads``
    key/value heads (``assumed``: the names looked for when no key/value count was found and
    the query count stands in for it)."""
    wide = group.row.in_features
    problem = None
    if heads < 1 or kv_heads < 1 or wide % heads or heads % kv_heads:
        problem = f"{wide} features of the row-parallel {group.row.name} do not split into them"
    elif group.kind == "mla":
        if kv_heads != heads:
            problem = "multi-head latent attention has a key/value head per query head"
        for layer in group.columns:
            if layer.out_features % heads:
                problem = f"{layer.name} writes {layer.out_features} features"
    else:
        head_dim = wide // heads
        for layer in group.columns:
            if layer.gated and layer.out_features == 2 * wide:
                continue
            if OUTPUT_GATE_NAME.search(layer.name) and layer.out_features == heads:
                continue  # an output gate per head
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
    if problem is not None and assumed is not None:
        raise ValueError(
            f"{where}: found {heads} query heads but no key/value head count (looked for "
            f"{assumed} on the attention and the config), so took {kv_heads}, which does not "
            f"fit its shapes: {problem}; write the plan by hand"
        )
    if problem is not None:
        raise ValueError(
            f"the head counts found for {where} ({heads} query, {kv_heads} key/value heads) do "
            f"not fit its shapes: {problem}"
        )


def _fused_split_sizes(
    attention: nn.Module, group: LinearGroup, source: str, where: str
) -> set[str]:
    """The attributes by which forward splits a fused q/k/v (to be divided), or refuse.

    Only two layouts are recognized as ``[q | k | v]`` blocks (what
    :class:`PackedColwiseParallel` shards): a split by an attribute equal to one part's width
    (GPT-2's ``.split(self.split_size, dim=2)``), and ``self.<fused>(x).chunk(n, ...)``. A
    reshape to ``(..., heads, 3, head_dim)`` first (GPT-NeoX, Bloom) interleaves the parts
    per head, which this style would shard wrongly.
    """
    width = group.row.in_features
    names = set(re.findall(r"\.split\(\s*self\.(\w+)", source))
    # gpt-fast: .split([self.dim, kv_size, kv_size], dim=-1), the query's width first
    names |= set(re.findall(r"\.split\(\s*\[\s*self\.(\w+)\s*,", source))
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
    group: LinearGroup,
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


def _check_fused_mlp(blocks: nn.ModuleList, group: LinearGroup) -> None:
    """A fused gate/up must be split in two halves by forward, with no size read from an
    attribute (no style makes an MLP's attributes per-rank)."""
    where = describe_group(group)
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
