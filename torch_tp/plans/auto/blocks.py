"""The repeated blocks: how they are found, grouped into kinds, and planned unit by unit.

:func:`find_blocks` finds the stack of repeated blocks; :func:`block_kinds` groups the
blocks by structure, each kind planned once by :func:`plan_block`, which walks a block's
children (its *units*) and sends each to its planner: a mixture of experts to
:mod:`~torch_tp.plans.auto.experts`, a mixer it cannot split to
:mod:`~torch_tp.plans.auto.mixers` (left whole), a router beside experts stays whole, and
anything else is planned group by group (:mod:`~torch_tp.plans.auto.groups`, then
:func:`~torch_tp.plans.auto.attention.plan_group`). :func:`_other_parameters` lays out (or
refuses) the parameters outside the planned layers, :func:`merged_paths` and :func:`merged_styles`
turn the kinds' plans into plan keys (``*`` where all blocks agree), and
:func:`check_tp_degree` checks the sizes against a TP degree.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from torch_tp.plans.auto.attention import plan_group
from torch_tp.plans.auto.experts import (
    STACKED_SHARED_PLACEMENTS,
    expert_count,
    stacked_experts,
    stacked_experts_unchecked,
)
from torch_tp.plans.auto.groups import (
    BlockPlan,
    LinearGroup,
    assign_styles,
    describe_group,
    has_linear,
    join_dotted,
    linear_groups,
)
from torch_tp.plans.auto.mixers import has_conv, mixer_reason
from torch_tp.style import (
    ParallelStyle,
    PartialSumParallel,
    ReplicateParallel,
    TensorParallelExperts,
)

__all__: list[str] = []


# ------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------


def find_blocks(model: nn.Module) -> tuple[str, list[str], list[nn.Module]]:
    """``(path, names, blocks)`` of the repeated blocks: the largest container of them."""
    lists = [(path, module) for path, module in model.named_modules() if _is_stack(module)]
    mixed = None if lists else _mixed_stack(model)
    if mixed is not None:
        path, kind, others = mixed
        where = f"'{path}'" if path else f"the root module ({type(model).__qualname__})"
        raise ValueError(
            f"{where} holds repeated blocks ({kind}) beside other modules ({others}): auto() "
            "plans a container whose children are all blocks of one class (an nn.ModuleList, "
            "or an nn.Sequential or nn.ModuleDict of them); keep the blocks in one of their "
            "own, or write the plan by hand"
        )
    if not lists:
        raise ValueError(
            f"no repeated blocks in {type(model).__qualname__}: auto() plans the layers of the "
            "largest nn.ModuleList (or nn.Sequential or nn.ModuleDict of blocks of one class), "
            "and the model has none; write the plan by hand"
        )
    path, blocks = max(lists, key=lambda item: _numel(item[1]))
    where = f"'{path}'" if path else "the root module"
    for other_path, other in lists:
        inside = other_path.startswith(f"{path}.") or path.startswith(f"{other_path}.")
        if other is blocks or inside or not has_linear(other):
            continue
        raise ValueError(
            f"two stacks of blocks: '{other_path}' ({len(other)} x "
            f"{type(_first(other)).__name__}) beside {where} ({len(blocks)} x "
            f"{type(_first(blocks)).__name__}); auto() plans one stack: call it on the submodule "
            "holding each and prefix the keys, or write the plan by hand"
        )
    names = [name for name, _ in blocks.named_children()]
    return path, names, [module for _, module in blocks.named_children()]


def _is_stack(module: nn.Module) -> bool:
    """A container of repeated blocks: a non-empty ``nn.ModuleList``, or an ``nn.Sequential``
    or ``nn.ModuleDict`` of two or more blocks of one class (timm's and torchvision's ViT,
    mistral-inference and torchtitan), blocks being modules with children of their own."""
    if isinstance(module, nn.ModuleList):
        return len(module) > 0
    if not isinstance(module, (nn.Sequential, nn.ModuleDict)):
        return False
    children = list(module.children())
    return (
        len(children) > 1
        and len({type(child) for child in children}) == 1
        and all(any(True for _ in child.children()) for child in children)
    )


def _mixed_stack(model: nn.Module) -> tuple[str, str, str] | None:
    """``(path, "n x Block", the other children)`` of an ``nn.Sequential`` or
    ``nn.ModuleDict`` holding two or more blocks of one class beside other modules
    (``nn.Sequential(embedding, *blocks, norm, head)``), or ``None``."""
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleDict)):
            continue
        children = list(module.children())
        blocks = [c for c in children if any(True for _ in c.children())]
        kinds = Counter(type(c) for c in blocks)
        if not kinds:
            continue
        kind, count = kinds.most_common(1)[0]
        if count > 1 and count < len(children):
            others = sorted({type(c).__name__ for c in children if type(c) is not kind})
            return path, f"{count} x {kind.__name__}", ", ".join(others)
    return None


def _first(stack: nn.Module) -> nn.Module:
    return next(iter(stack.children()))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _structure(block: nn.Module) -> list[tuple[str, str, tuple]]:
    return [
        (
            path,
            type(module).__qualname__,
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)),
        )
        for path, module in block.named_modules()
    ]


# ------------------------------------------------------------------------------------------
# kinds of blocks, and one plan for each
# ------------------------------------------------------------------------------------------


def block_kinds(blocks: list[nn.Module]) -> list[list[int]]:
    """The indices of the blocks, grouped by structure (types, paths, parameter shapes)."""
    kinds: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        signature = tuple(_structure(block))
        kinds.setdefault(signature, []).append(i)
    return list(kinds.values())


def kind_prefix(blocks_path: str, names: list[str], kinds: list[list[int]], k: int) -> str:
    """How errors name a kind of block: ``layers.*`` when all are alike, else its first
    block's name."""
    return join_dotted(blocks_path, "*" if len(kinds) == 1 else names[kinds[k][0]])


def _has_path(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def merged_paths(
    blocks_path: str,
    names: list[str],
    blocks: list[nn.Module],
    planned: list[BlockPlan],
    what: str,
) -> list[tuple[str, str]]:
    """``(path inside the block, plan key)`` of each entry of the kinds' ``what``: a ``*`` key
    where every block holding that path gives it the same entry, else one key per block."""
    order: dict[str, None] = {}
    for block_plan in planned:
        entries = getattr(block_plan, what)
        order.update(dict.fromkeys(entries))
    merged = []
    for path in order:
        owners = [bp for bp in planned if path in getattr(bp, what)]
        values = [bp.styles[path] if what == "styles" else True for bp in owners]
        covered = sorted(i for bp in owners for i in bp.indices)
        holding = [i for i, block in enumerate(blocks) if _has_path(block, path)]
        if all(v == values[0] for v in values) and covered == holding:
            merged.append((path, join_dotted(join_dotted(blocks_path, "*"), path)))
        else:
            merged += [
                (path, join_dotted(join_dotted(blocks_path, names[i]), path)) for i in covered
            ]
    return merged


def merged_styles(
    blocks_path: str, names: list[str], blocks: list[nn.Module], planned: list[BlockPlan]
) -> dict[str, ParallelStyle]:
    styles = {}
    for path, key in merged_paths(blocks_path, names, blocks, planned, "styles"):
        name = key[len(blocks_path) :].lstrip(".").partition(".")[0]
        owner = next(
            bp
            for bp in planned
            if path in bp.styles and (name == "*" or names.index(name) in bp.indices)
        )
        styles[key] = owner.styles[path]
    return styles


def plan_block(
    model: nn.Module,
    members: list[nn.Module],
    hidden: int,
    prefix: str,
    whole: dict[str, str],
) -> BlockPlan:
    """The plan of one kind of block (``members``, alike), as paths inside the block.

    Each child of the block holding Linear layers is planned on its own: a mixer auto()
    cannot split (state space, linear attention, convolution) is left replicated, a
    mixture of experts gets its stacked experts sharded and its shared experts planned as
    MLPs (its routers stay whole), and an attention or MLP is planned as before.
    """
    block = members[0]
    groups = linear_groups(block, prefix)
    # the units: the children of the block (and the block itself, for Linear layers right
    # in it) holding Linear layers or stacked experts, in registration order
    names = ["", *(name for name, _ in block.named_children())]
    units = {name: [g for g in groups if g.parent.partition(".")[0] == name] for name in names}
    moe = {name for name in names if name and stacked_experts_unchecked(block, name)}
    units = {
        name: found
        for name, found in units.items()
        if found or name in moe or name and has_conv(block.get_submodule(name))
    }
    result = BlockPlan({}, {}, [], [], prefix)
    counts = {
        expert_count(block.get_submodule(path))
        for name in moe
        for path in stacked_experts_unchecked(block, name)
    }
    routers: set[str] = set()
    for name, unit_groups in units.items():
        unit = block.get_submodule(name)
        if name in moe:
            experts, shared = stacked_experts(unit, name, prefix, hidden)
            result.experts += experts
            for path in shared:  # stacked shared experts: one partial sum
                result.styles[path] = PartialSumParallel(STACKED_SHARED_PLACEMENTS)
            for group in unit_groups:
                try:
                    assign_styles(group, hidden, block.get_submodule(group.parent))
                except ValueError:
                    continue  # a router or a gate: whole, on the replicated tokens
                if group.kind != "mlp":
                    raise ValueError(
                        f"{describe_group(group)} inside the mixture of experts "
                        f"'{join_dotted(prefix, name)}' looks like an {group.kind}: auto() knows "
                        "shared-expert MLPs there; write the plan by hand"
                    )
                plan_group(model, members, group, result, whole)
            for path in experts:
                result.styles[path] = TensorParallelExperts()
            continue
        if (
            name
            and unit_groups
            and all(layer.out_features in counts for g in unit_groups for layer in g.layers)
        ):
            routers.add(name)  # a router beside experts (Gemma 4): whole, on whole tokens
            continue
        mixer = mixer_reason(unit) if name else None
        if mixer:
            result.replicated[name] = (
                f"a token mixer (attention or other) auto() cannot split ({mixer})"
            )
            continue
        if not name and len(units) > 1 and any(_holds_mlp(block, n) for n in units if n):
            # Linear layers right in a block that has its own MLP (Gemma's per-layer input
            # gate): what forward combines them with is unknown; every rank computes them
            for group in unit_groups:
                for layer in group.layers:
                    result.replicated[layer.name] = (
                        "a Linear layer right in a block beside its MLP, whose use only forward "
                        "knows"
                    )
            continue
        for group in unit_groups:
            try:
                assign_styles(group, hidden, block.get_submodule(group.parent))
            except ValueError:
                _refuse_spread(unit_groups, name, join_dotted(prefix, name))
                raise
            plan_group(model, members, group, result, whole)
    skipped = set(result.replicated) | moe | routers
    result.styles.update(_other_parameters(block, result.groups, hidden, prefix, skipped))
    return result


def _holds_mlp(block: nn.Module, name: str) -> bool:
    """Whether the child ``name`` of the block is a mixture of experts or names itself an MLP
    (``mlp``, ``feed_forward``, ``ffn``)."""
    child = block.get_submodule(name)
    words = f"{name} {type(child).__name__}".lower()
    return bool(stacked_experts_unchecked(block, name)) or any(
        w in words for w in ("mlp", "feed_forward", "feedforward", "ffn", "moe")
    )


def _refuse_spread(groups: list[LinearGroup], name: str, key: str) -> None:
    """Refuse the child ``name`` of a block whose Linear layers all sit in several children of
    its own (transformers' BERT: q/k/v in ``attention.self``, the output projection in
    ``attention.output``), when they do not make a plan group by group: the real reason."""
    parents = list(dict.fromkeys(g.parent for g in groups))
    if len(parents) < 2 or name in parents:
        return
    spread = " and ".join(
        f"'{g.parent}' ({', '.join(x.name.rpartition('.')[2] for x in g.layers)})" for g in groups
    )
    raise ValueError(
        f"'{key}' spreads its Linear layers over its children {spread}: auto() plans the "
        "column-parallel layers of an attention or MLP and the row-parallel layer they feed "
        "under one parent module (what flows between the children only forward knows); write "
        "the plan by hand"
    )


# ------------------------------------------------------------------------------------------
# the other parameters of a block
# ------------------------------------------------------------------------------------------


def _other_parameters(
    block: nn.Module, groups: list[LinearGroup], hidden: int, prefix: str, skipped: set[str]
) -> dict[str, ParallelStyle]:
    """Styles for the parameters of a block outside its planned Linear layers (as paths
    inside the block), or refuse.

    The children named in ``skipped`` (mixers left replicated, mixtures of experts) compute
    on whole activations: their parameters stay out of the plan, but for the shared-expert
    MLPs planned inside them. Outside the planned groups, a module whose parameters are 1-D
    of the hidden size (a norm) or scalars sees whole activations: it stays out of the plan
    (replicated). Inside a sharded attention or MLP:

    * 1-D parameters of the head size (per-head ``q_norm``/``k_norm``) and single-value
      parameters of an element-wise module (a learned activation) see this rank's share:
      ``ReplicateParallel(sum_gradients=True)`` sums their gradient over the ranks;
    * attention sinks on the attention itself are sharded with the heads (its style);
    * in multi-head latent attention, 1-D parameters of a latent width (the norms between
      the down- and up-projections) see whole latents: replicated;
    * in an attention computed whole (``"gathered"``), everything is replicated.

    Anything else is refused.
    """
    planned = {layer.name for group in groups for layer in group.layers}
    parents = [group for group in groups if group.parent]
    styles: dict[str, ParallelStyle] = {}
    for path, module in block.named_modules():
        params = list(module.named_parameters(recurse=False))
        if path in planned or not params:
            continue
        key = join_dotted(prefix, path)
        shapes = ", ".join(f"{name} {list(p.shape)}" for name, p in params)
        inside = next(
            (g for g in parents if path == g.parent or path.startswith(f"{g.parent}.")), None
        )
        if inside is None:
            if path.partition(".")[0] in skipped:
                continue
            if all(p.ndim == 0 or tuple(p.shape) == (hidden,) for _, p in params):
                continue
            raise ValueError(
                f"'{key}' ({type(module).__name__}) holds parameters auto() does not know how "
                f"to lay out ({shapes}): outside the Linear layers it leaves only 1-D "
                f"parameters of the hidden size {hidden} (norms) and scalars replicated; write "
                "the plan by hand"
            )
        if inside.kind == "gathered":
            continue
        if path == inside.parent:
            if inside.kind == "attention" and [n for n, _ in params] == ["sinks"]:
                continue  # sharded with the heads by the attention's own style
        else:
            heads = inside.heads
            head_dim = None if heads is None else inside.row.in_features // heads[0]
            shapes_1d = [tuple(p.shape) for _, p in params]
            if (
                inside.kind == "attention"
                and head_dim is not None
                and all(shape == (head_dim,) for shape in shapes_1d)
            ):
                styles[path] = ReplicateParallel(sum_gradients=True)
                continue
            if inside.kind == "mla" and all(
                len(shape) == 1 and shape[0] in inside.latents for shape in shapes_1d
            ):
                continue
            if not list(module.children()) and all(p.numel() == 1 for _, p in params):
                styles[path] = ReplicateParallel(sum_gradients=True)
                continue
            if (
                inside.kind == "mlp"
                and all(shape == (hidden,) for shape in shapes_1d)
                and all(x.out_features // x.parts != hidden for x in inside.columns)
            ):
                # a norm of the hidden size inside an MLP (torchaudio's feed-forward module
                # starts with one): the MLP's only activations of that width are its input and
                # its output, both whole
                continue
            if heads is not None and any(heads[0] in p.shape for _, p in params):
                raise ValueError(
                    f"'{key}' ({type(module).__name__}, {shapes}) holds one value per head "
                    f"({heads[0]} heads) inside the attention {describe_group(inside)} (a "
                    "relative-position bias, say): its heads would have to be split with the "
                    "attention's, and auto() does not know how it is used; write the plan by "
                    "hand"
                )
        raise ValueError(
            f"'{key}' ({type(module).__name__}, {shapes}) is inside the {inside.kind} "
            f"{describe_group(inside)}, whose activations are split over the ranks: auto() only "
            "knows per-head norms, attention sinks, latent norms and single-value parameters "
            "there; write the plan by hand"
        )
    return styles


# ------------------------------------------------------------------------------------------
# the TP degree
# ------------------------------------------------------------------------------------------


def check_tp_degree(block_plan: BlockPlan, block: nn.Module, n: int) -> None:
    for group in block_plan.groups:
        if group.heads is not None:
            for what, count in zip(("query heads", "key/value heads"), group.heads, strict=True):
                if count % n:
                    raise ValueError(
                        f"'{group.key}': {count} {what} do not divide by tp_degree {n} (each "
                        "rank must hold whole heads)"
                    )
            attention = block.get_submodule(group.parent)
            style = block_plan.styles.get(group.parent)
            for name in getattr(style, "divide", ()):
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
    for path in block_plan.experts:
        experts = block.get_submodule(path)
        down = experts.down_proj.shape
        gate_up = getattr(experts, "gate_up_proj", None)
        # [E, H, I], or transposed [E, I, H] beside a gate_up_proj [E, H, 2I]
        transposed = gate_up is not None and gate_up.shape[1] != 2 * down[2]
        width = down[1] if transposed else down[2]
        if width % n:
            raise ValueError(
                f"'{join_dotted(block_plan.prefix, path)}': the experts' hidden size {width} "
                f"does not divide by tp_degree {n}"
            )
