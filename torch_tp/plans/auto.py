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
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp.style import (
    AttentionHeads,
    ColwiseParallel,
    LocalParamsParallel,
    MLAKVAProjParallel,
    PackedColwiseParallel,
    ParallelStyle,
    PartialSumParallel,
    ReplicateParallel,
    RowwiseParallel,
    TensorParallelExperts,
)

__all__ = ["ReplicatedModulesWarning", "UncheckedPlanWarning", "auto"]

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


def auto(
    model: nn.Module,
    *,
    tp_degree: int | None = None,
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
) -> dict[str, ParallelStyle]:
    """Infer a Megatron-style tensor-parallel plan for a transformer, from its structure.

    The model must be built from ``nn.Linear`` (or transformers' ``Conv1D``), ``nn.Embedding``
    and norm modules, with mixtures of experts stacked in 3-D parameters. Nothing is changed
    and nothing is computed: the plan is read from the module tree and the sources, then
    shape-checked on the meta device (below); a model on the meta device works, and no
    process group is needed. The rules, in order:

    1. **Blocks.** The repeated blocks are the ``nn.ModuleList`` holding the most parameters
       (or an ``nn.Sequential`` or ``nn.ModuleDict`` of two or more blocks of one class, as
       timm, torchvision, mistral-inference and torchtitan keep them); no other such stack
       outside it may hold Linear layers (an encoder and a decoder, a vision tower): else
       refuse. Blocks of the same structure (module paths, types and
       parameter shapes) are one *kind*, planned once. A key uses ``*`` for the block index
       when every block holding that path gets the same style (a dense MLP's keys in a model
       whose first layer only is dense: ``*`` names just it), else one key per block
       (``layers.0.self_attn``, ``layers.1.self_attn``).
    2. **Units.** Each child of a block holding Linear layers or stacked experts is planned on
       its own:

       * a *mixer auto() cannot split* (a convolution inside, parameters of its own such as a
         state space's ``A_log``/``D``, not attention sinks, or a class named for Mamba,
         linear attention, a delta rule, lightning attention, ...) is left out of the plan:
         every rank computes it whole on the replicated residual stream, which is correct
         but not sharded. :func:`auto` says so with a :class:`ReplicatedModulesWarning`
         naming the modules (its ``modules`` attribute). So are Linear layers right in a
         block that has an MLP child (Gemma's per-layer input gate), whose use forward
         alone knows.
       * a *mixture of experts* (a child holding ``gate_up_proj`` ``[E, 2I, H]`` and
         ``down_proj`` ``[E, H, I]``, or both transposed, or ungated ``up_proj`` ``[E, I, H]``
         and ``down_proj``): the experts get ``TensorParallelExperts()``; its routers and
         gates stay whole (replicated, on the replicated tokens); a shared expert inside it
         that is an MLP is planned as one (rule 3), one stacked as ``gate_proj``/``up_proj``
         ``[n, I, H]`` and ``down_proj`` ``[n, H, I]`` gets ``PartialSumParallel`` with those
         sharded on ``I``. Other stacked parameters, or experts of other shapes, are
         refused. A child whose Linear layers all write the expert count (a router beside
         the experts) stays whole too.
       * anything else is planned by its groups of Linear layers (rule 3), or refused.
    3. **Groups.** Inside a unit, the Linear-like layers are grouped by their parent module
       (the attention, the MLP). The hidden size is the input embedding's width when a group
       reads and writes it, else the width that every group both reads and writes. In a group,
       the last registered layer writing the hidden size is row-parallel
       (``RowwiseParallel()``); the other layers must read the hidden size, and are
       column-parallel. The shapes must chain: the row-parallel layer reads what a
       column-parallel sibling writes (``ColwiseParallel()``), or one part of a fused one:
       ``PackedColwiseParallel(3)`` for a fused q/k/v writing 3 x the row-parallel's input
       beside a square row-parallel layer (GPT-2's ``c_attn``), ``PackedColwiseParallel(2)``
       for a fused pair writing 2 x it (a fused gate/up). A group whose column-parallel
       layers make three parts (q, k and v: three layers, a fused one, or a query beside a
       fused key/value) is an attention; its k and v may be narrower (grouped-query
       attention), and its query may write twice the heads' width when forward views it per
       head as ``(..., heads, self.head_dim * 2)`` (Qwen3-Next's gated query). One or two
       parts, each writing exactly what the row-parallel layer reads, is an MLP.
       **Multi-head latent attention** (DeepSeek-V2/V3, MiniCPM3): down-projections reading
       the hidden size, each feeding an up-projection that reads all it writes (the query's
       ``q_a_proj`` -> ``q_b_proj``) or all but a rotary part (``kv_a_proj_with_mqa`` ->
       ``kv_b_proj``, the rotary width equal to ``qk_rope_head_dim``), and ``o_proj``: the
       query's down-projection stays whole, the key/value one is
       ``MLAKVAProjParallel(rope_dim)``, the up-projections (or a plain ``q_proj``) are
       column-parallel. Anything else is refused (a group without a layer writing the hidden
       size, layers reading another width, shapes that do not chain, a nested
       ``nn.ModuleList`` of alike modules holding Linear layers, experts run in a loop;
       an attention or MLP whose layers are spread over several children of its own, as
       transformers' BERT's ``attention.self`` and ``attention.output``). A list of
       sublayers of different classes (T5's ``block.layer``) is planned as other children.
    4. **Heads.** An attention group's parent gets ``AttentionHeads(...)`` when the head
       counts can be found: attributes of the attention module (``num_heads``, ``n_heads``,
       ``n_local_heads`` as Meta's Llama and llama2.c name them, ``num_key_value_heads``,
       ``n_local_kv_heads``, ...), of its ``config``, or of ``model.config``
       (``num_attention_heads``/``n_head``, ``num_key_value_heads``), named by attribute
       where the module has one and as numbers otherwise. They must fit the shapes (q writes
       heads x head size, k and v kv-heads x head size), else refuse. The integer attributes
       that the attention's ``forward`` (or a method of its class that forward calls) reads
       as ``self.<name>``, found from the source (refused if it is unavailable), and that
       equal the query width or a head count are divided by the TP degree
       (``divide=...``) when their name says they are such a size (``num_heads``,
       ``split_size``, ``embed_dim``, ...) or forward splits by them; ignored when their name
       says otherwise (``head_dim``, ``layer_idx``, ``rotary_ndims``, the latent sizes of
       multi-head latent attention, ...) or their value differs between blocks; refused
       otherwise (a ``self.window`` equal to the width by chance). A name saying "attention"
       or "attn" on a group shaped like an MLP is refused. **Attention sinks** (a parameter
       ``sinks [heads]`` of the attention itself) shard with the heads: the attention gets
       ``LocalParamsParallel({"sinks": Shard(0)})`` instead (refused if it also needs
       ``divide``). **A norm over all the heads** at once inside the attention (OLMo-2's
       ``q_norm`` of the whole query width) needs every head on every rank: q, k and v
       become ``ColwiseParallel(output_layouts=Replicate())`` and the output projection
       ``RowwiseParallel(input_layouts=Replicate())`` (weights sharded, attention computed
       whole, as transformers plans OLMo-2), and the attention gets no style. **Heads that
       no attribute can make per-rank** are computed whole the same way (a fused q/k/v
       gathered whole too), and the :class:`ReplicatedModulesWarning` says why: when forward
       reads the width of an input and computes with it (nanoGPT's and minGPT's
       ``B, T, C = x.size()`` then ``view(B, T, self.n_head, C // self.n_head)``, timm's
       ``B, N, C = x.shape``, fairseq's ``assert embed_dim == self.embed_dim``), or when the
       attention holds tensors with a dimension of the head count that forward reads (Meta's
       KV cache ``cache_k``).
    5. **Fused projections.** A fused q/k/v needs head counts, as many key/value heads as
       query heads, and a ``forward`` that splits it into ``[q | k | v]`` blocks: by an
       attribute equal to one part's width (GPT-2's ``.split(self.split_size, dim=2)``,
       that attribute is divided), by a list starting with it (gpt-fast's
       ``.split([self.dim, kv_size, kv_size], dim=-1)``) or by
       ``self.<fused>(x).chunk(3, ...)``; a reshape per
       head first (GPT-NeoX, Bloom) is refused. A fused gate/up needs a ``forward`` that
       calls ``.chunk(2, ...)`` and reads no attribute equal to one half's width.
    6. **Embedding and head.** The input embedding (``model.get_input_embeddings()``, else
       the ``nn.Embedding`` outside the blocks whose vocabulary is the head's output size)
       is ``RowwiseParallel(input_layouts=Replicate())``; the output head (the one Linear
       outside the blocks reading the embedding's width, the hidden size, and writing its
       vocabulary; several candidates are refused) is
       ``ColwiseParallel(output_layouts=Replicate())``. Tied embedding and head weights are
       fine (both ``Shard(0)``; torch_tp keeps them tied). Other embeddings (positions) stay
       out of the plan, as do all other modules outside the blocks.
    7. **Everything else** in a block stays out of the plan (replicated): norms, dropouts,
       any module whose parameters are scalars or 1-D of the hidden size, outside the
       planned groups. Inside a sharded attention or MLP, what sees only this rank's share
       sums its gradient over the ranks, ``ReplicateParallel(sum_gradients=True)``: a module
       whose parameters are 1-D of the head size (per-head ``q_norm``/``k_norm``, as in
       Qwen3) and an element-wise module with single-value parameters (Apertus's learned
       activation). The latent norms of multi-head latent attention see whole latents and
       stay replicated, as does a norm of the hidden size inside an MLP (its input or output,
       both whole). Any other parameter in a block is refused (a bias of per-head values on
       a module of its own, such as T5's relative-position bias, ...).

    **The shape check.** The plan is then traced on the meta device as one device and as one
    rank (:func:`torch_tp.shapes.check_shapes`, at ``tp_degree``, or 2 without one) with
    ``example_inputs`` (token ids of shape ``(2, 8)`` by default). An attention or MLP in
    which a rank's shapes are not one device's with the planned dimension divided is
    computed whole instead (weights sharded, as above; the warning gives the problem), and
    the plan checked again; a problem anywhere else is refused. Where the model does not run
    on the meta device with those inputs, an :class:`UncheckedPlanWarning` says so.

    With ``tp_degree``, the plan is refused when a head count, a column-parallel layer's
    output (per part), a row-parallel layer's input, the experts' hidden size or a divided
    attribute does not divide by it (vocabularies need not: uneven vocabulary shards are
    supported).

    The plan is communication-optimal in normal runs: column-parallel layers reading the same
    tensor (q, k and v; gate and up) share one backward all-reduce at run time, so no
    ``PrepareModuleInput`` is needed. The shape check finds a rank computing other shapes
    than one device, not other values of the same shapes: verify a new model with
    :func:`torch_tp.testing.check_parity` (``test/test_zoo_auto.py`` does so for every
    transformers causal LM with a tensor-parallel plan, ``test/test_foreign_models.py`` for
    models written as nanoGPT, Meta's Llama, timm and others write them).

    Args:
        model: the model to plan for (on any device, including meta).

    Keyword Args:
        tp_degree (int, optional): the tensor-parallel degree to check sizes against.
            Default: ``None`` (no check of the sizes; the shapes are checked at degree 2).
        example_inputs (optional): the model's inputs for the shape check: a tensor, a tuple
            of positional inputs or a dict of keyword inputs (only shapes and dtypes are
            used). Default: token ids of shape ``(2, 8)``.
        example_kwargs (dict, optional): keyword inputs beside positional ones.

    Returns:
        A dict from module paths (``*`` over the blocks, or block indices where kinds of
        blocks differ) to styles: the embedding, then each kind of block's units in
        registration order (a group's layers, then the block's other styled modules), then
        the head.

    Raises:
        ValueError: the structure is ambiguous or unsupported, a size does not divide by
            ``tp_degree``, or the plan fails the shape check outside an attention or MLP it
            can compute whole; the message names the module path and what was found.

    Warns:
        ReplicatedModulesWarning: some modules are left whole (mixers, rule 2; attentions
            whose heads cannot be split, rule 4, or that failed the shape check); the
            warning's ``modules`` lists their plan-key paths, its message the reasons.
        UncheckedPlanWarning: the shape check could not run.

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
    degree = tp_degree or 2
    whole: dict[str, str] = {}  # groups the shape check sends back, computed whole -> why
    while True:
        plan, reasons, groups = _infer(model, tp_degree, whole)
        problems = _shape_problems(
            model, plan, degree, tp_degree is None, example_inputs, example_kwargs
        )
        if not problems:
            break
        more = _fallbacks(model, problems, groups)
        if more is None or set(more) <= set(whole):
            raise ValueError(
                f"auto()'s plan fails the shape check at TP degree {degree} (a rank's shapes are "
                "not one device's with the planned dimension divided): "
                + "; ".join(str(problem) for problem in problems[:3])
                + "; write the plan by hand"
            )
        whole.update(more)
    if reasons:
        warnings.warn(
            ReplicatedModulesWarning(
                "auto() leaves modules whole on every rank (correct, but their work is not "
                "split): " + "; ".join(f"{key!r}: {reason}" for key, reason in reasons.items()),
                list(reasons),
            ),
            stacklevel=2,
        )
    return plan


def _infer(
    model: nn.Module, tp_degree: int | None, whole: dict[str, str]
) -> tuple[dict[str, ParallelStyle], dict[str, str], dict[str, str]]:
    """``(plan, why each module left whole is, by its plan key, concrete module path -> plan
    key of each planned group's parent)``; the groups named in ``whole`` (plan keys of
    their parents) are computed whole, their weights sharded."""
    blocks_path, names, blocks = _find_blocks(model)
    embedding = _input_embedding(model, blocks_path)
    head = _output_head(model, blocks_path, embedding)
    if head is not None:
        embedding = embedding or head[2]
    kinds = _block_kinds(blocks)
    first_prefix = _kind_prefix(blocks_path, names, kinds, 0)
    hidden = _hidden_size(
        _linear_groups(blocks[kinds[0][0]], first_prefix), embedding, first_prefix
    )

    planned: list[_BlockPlan] = []
    groups: dict[str, str] = {}
    for k, indices in enumerate(kinds):
        prefix = _kind_prefix(blocks_path, names, kinds, k)
        members = [blocks[i] for i in indices]
        block_plan = _plan_block(model, members, hidden, prefix, whole)
        block_plan.indices = indices
        if tp_degree is not None:
            _check_degree(block_plan, members[0], tp_degree)
        planned.append(block_plan)
        for group in block_plan.groups:
            if group.kind in ("attention", "mlp", "gathered"):
                for i in indices:
                    groups[_join(_join(blocks_path, names[i]), group.parent)] = group.key

    plan: dict[str, ParallelStyle] = {}
    if embedding is not None:
        plan[embedding[0]] = RowwiseParallel(input_layouts=Replicate())
    plan.update(_merge(blocks_path, names, blocks, planned))
    if head is not None:
        plan[head[0]] = ColwiseParallel(output_layouts=Replicate())
    reasons: dict[str, str] = {}
    for what in ("replicated", "whole"):
        for path, key in _merged_paths(blocks_path, names, blocks, planned, what):
            owner = next(bp for bp in planned if path in getattr(bp, what))
            reasons.setdefault(key, getattr(owner, what)[path])
    return plan, reasons, groups


def _defined_in(kind: type, source: str | None) -> bool:
    """Whether ``source`` (``file:line``) is a line of the class ``kind``'s own code."""
    if not source or kind.__module__.startswith("torch."):
        return False
    file, _, line = source.rpartition(":")
    try:
        lines, start = inspect.getsourcelines(kind)
        own = os.path.abspath(inspect.getsourcefile(kind) or "")
    except (OSError, TypeError):
        return False
    return (
        own == os.path.abspath(file) and line.isdigit() and start <= int(line) < start + len(lines)
    )


class UncheckedPlanWarning(UserWarning):
    """:func:`auto` could not run the shape check on the plan it returns (the model does not
    run on the meta device with the example inputs): check it with
    :func:`torch_tp.testing.check_parity`."""


def _shape_problems(
    model: nn.Module,
    plan: dict[str, ParallelStyle],
    degree: int,
    default_degree: bool,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None,
) -> list:
    """The shape check's problems with ``plan`` at ``degree`` (a warning and ``[]`` where it
    cannot run)."""
    from torch_tp.shapes import ShapeCheckError, check_shapes

    try:
        return check_shapes(
            model, plan, degree, example_inputs=example_inputs, example_kwargs=example_kwargs
        )
    except ValueError as err:
        if not default_degree:
            raise
        # no tp_degree given, and the plan does not apply at 2 (3 heads, say)
        warnings.warn(
            UncheckedPlanWarning(
                f"auto() could not check the shapes of its plan at degree {degree}: {err}; "
                "pass tp_degree"
            ),
            stacklevel=3,
        )
        return []
    except ShapeCheckError as err:
        given = example_inputs is not None or example_kwargs
        hint = "" if given else " (token ids of shape (2, 8) by default: pass example_inputs)"
        warnings.warn(
            UncheckedPlanWarning(
                f"auto() could not check the shapes of its plan: the model does not run on the "
                f"meta device with the example inputs{hint}: {err}"
            ),
            stacklevel=3,
        )
        return []


def _fallbacks(model: nn.Module, problems: list, groups: dict[str, str]) -> dict[str, str] | None:
    """The planned groups (plan keys of their parents) that the shape check's problems lie in,
    each with the first problem as the reason; ``None`` if a problem lies in no such group.

    A problem lies in a group when it is found in the group's parent module (or a module
    inside it), or on a source line of the parent's class (llama2.c calls
    ``self.attention.forward(...)``, which runs no module hooks: the check finds the
    problem in the block)."""
    found: dict[str, str] = {}
    for problem in problems:
        inside = [p for p in groups if problem.module == p or problem.module.startswith(f"{p}.")]
        inside = inside or [
            p for p in groups if _defined_in(type(model.get_submodule(p)), problem.source)
        ]
        if not inside:
            return None
        key = groups[max(inside, key=len)]
        found.setdefault(key, f"the shape check found {problem}")
    return found


class ReplicatedModulesWarning(UserWarning):
    """:func:`auto` left these modules (plan-key paths, in :attr:`modules`) whole: every rank
    computes them whole (mixers it cannot split are kept whole too; an attention whose heads
    cannot be made per-rank has its projections' weights sharded and gathered). The message
    gives each module's reason."""

    def __init__(self, message: str, modules: list[str]) -> None:
        super().__init__(message)
        self.modules = tuple(modules)


# ------------------------------------------------------------------------------------------
# kinds of blocks, and one plan for each
# ------------------------------------------------------------------------------------------


@dataclass
class _BlockPlan:
    styles: dict[str, ParallelStyle]  # path inside the block -> style, in plan order
    replicated: dict[str, str]  # paths inside the block of mixers left replicated -> why
    groups: list[_Group]  # the planned groups (for the TP degree check)
    experts: list[str]  # paths of stacked experts
    prefix: str = ""  # how errors name this kind of block
    indices: list[int] = field(default_factory=list)
    # attentions computed whole (weights sharded, outputs gathered) -> why their heads are not
    # split (for the warning)
    whole: dict[str, str] = field(default_factory=dict)


def _block_kinds(blocks: list[nn.Module]) -> list[list[int]]:
    """The indices of the blocks, grouped by structure (types, paths, parameter shapes)."""
    kinds: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        signature = tuple(_structure(block))
        kinds.setdefault(signature, []).append(i)
    return list(kinds.values())


def _kind_prefix(blocks_path: str, names: list[str], kinds: list[list[int]], k: int) -> str:
    """How errors name a kind of block: ``layers.*`` when all are alike, else its first
    block's name."""
    return _join(blocks_path, "*" if len(kinds) == 1 else names[kinds[k][0]])


def _has_path(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def _merged_paths(
    blocks_path: str,
    names: list[str],
    blocks: list[nn.Module],
    planned: list[_BlockPlan],
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
            merged.append((path, _join(_join(blocks_path, "*"), path)))
        else:
            merged += [(path, _join(_join(blocks_path, names[i]), path)) for i in covered]
    return merged


def _merge(
    blocks_path: str, names: list[str], blocks: list[nn.Module], planned: list[_BlockPlan]
) -> dict[str, ParallelStyle]:
    styles = {}
    for path, key in _merged_paths(blocks_path, names, blocks, planned, "styles"):
        name = key[len(blocks_path) :].lstrip(".").partition(".")[0]
        owner = next(
            bp
            for bp in planned
            if path in bp.styles and (name == "*" or names.index(name) in bp.indices)
        )
        styles[key] = owner.styles[path]
    return styles


def _plan_block(
    model: nn.Module,
    members: list[nn.Module],
    hidden: int,
    prefix: str,
    whole: dict[str, str],
) -> _BlockPlan:
    """The plan of one kind of block (``members``, alike), as paths inside the block.

    Each child of the block holding Linear layers is planned on its own: a mixer auto()
    cannot split (state space, linear attention, convolution) is left replicated, a
    mixture of experts gets its stacked experts sharded and its shared experts planned as
    MLPs (its routers stay whole), and an attention or MLP is planned as before.
    """
    block = members[0]
    groups = _linear_groups(block, prefix)
    # the units: the children of the block (and the block itself, for Linear layers right
    # in it) holding Linear layers or stacked experts, in registration order
    names = ["", *(name for name, _ in block.named_children())]
    units = {name: [g for g in groups if g.parent.partition(".")[0] == name] for name in names}
    moe = {name for name in names if name and _stacked_experts_quiet(block, name)}
    units = {
        name: found
        for name, found in units.items()
        if found or name in moe or name and _has_conv(block.get_submodule(name))
    }
    result = _BlockPlan({}, {}, [], [], prefix)
    counts = {
        _expert_count(block.get_submodule(path))
        for name in moe
        for path in _stacked_experts_quiet(block, name)
    }
    routers: set[str] = set()
    for name, unit_groups in units.items():
        unit = block.get_submodule(name)
        if name in moe:
            experts, shared = _stacked_experts(unit, name, prefix, hidden)
            result.experts += experts
            for path in shared:  # stacked shared experts: one partial sum
                result.styles[path] = PartialSumParallel(_STACKED_SHARED)
            for group in unit_groups:
                try:
                    _assign(group, hidden, block.get_submodule(group.parent))
                except ValueError:
                    continue  # a router or a gate: whole, on the replicated tokens
                if group.kind != "mlp":
                    raise ValueError(
                        f"{_where(group)} inside the mixture of experts '{_join(prefix, name)}' "
                        f"looks like an {group.kind}: auto() knows shared-expert MLPs there; "
                        "write the plan by hand"
                    )
                _plan_group(model, members, group, result, whole)
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
        mixer = _is_mixer(unit) if name else None
        if mixer:
            result.replicated[name] = f"a mixer auto() cannot split ({mixer})"
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
                _assign(group, hidden, block.get_submodule(group.parent))
            except ValueError:
                _refuse_spread(unit_groups, name, _join(prefix, name))
                raise
            _plan_group(model, members, group, result, whole)
    skipped = set(result.replicated) | moe | routers
    result.styles.update(_other_parameters(block, result.groups, hidden, prefix, skipped))
    return result


def _holds_mlp(block: nn.Module, name: str) -> bool:
    """Whether the child ``name`` of the block is a mixture of experts or names itself an MLP
    (``mlp``, ``feed_forward``, ``ffn``)."""
    child = block.get_submodule(name)
    words = f"{name} {type(child).__name__}".lower()
    return bool(_stacked_experts_quiet(block, name)) or any(
        w in words for w in ("mlp", "feed_forward", "feedforward", "ffn", "moe")
    )


def _plan_group(
    model: nn.Module,
    members: list[nn.Module],
    group: _Group,
    result: _BlockPlan,
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
                        f"{_where(group)} has attention sinks and reads sizes that must become "
                        f"per-rank ({', '.join(heads.divide)}): no style does both; write the "
                        "plan by hand"
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


# a token mixer that is not softmax attention, by the words of its class name
_MIXER_WORDS = ("mamba", "ssm", "lightning", "delta", "conv", "recurren", "rwkv", "retention")


_CONVOLUTIONS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def _has_conv(module: nn.Module) -> bool:
    return any(isinstance(m, _CONVOLUTIONS) for m in module.modules())


def _is_mixer(unit: nn.Module) -> str | None:
    """Why auto() leaves this child of a block replicated, or ``None``: a convolution inside,
    parameters of its own (a state space's ``A_log``, ``D``, ``dt_bias``; not attention
    sinks), or a class named for a mixer other than softmax attention."""
    if _has_conv(unit):
        return "a convolution inside"
    own = [name for name, _ in unit.named_parameters(recurse=False)]
    if own and own != ["sinks"]:
        return f"parameters of its own: {', '.join(own)}"
    words = [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", type(unit).__name__)]
    linear_attention = "linear attention" in " ".join(words)
    if linear_attention or any(w.startswith(_MIXER_WORDS) for w in words):
        return f"{type(unit).__name__}, by its name a mixer other than softmax attention"
    return None


def _refuse_spread(groups: list[_Group], name: str, key: str) -> None:
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


def _stacked(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(
        isinstance(getattr(module, p, None), torch.Tensor) and getattr(module, p).ndim == 3
        for p in names
    )


# the stacked weights of experts: SwiGLU (gate and up fused), or ungated (Nemotron-H)
_GATED, _UNGATED = ("gate_up_proj", "down_proj"), ("up_proj", "down_proj")
# shared experts stacked beside the routed ones (Inkling): gate_proj and up_proj [n, I, H]
# sharded on I, down_proj [n, H, I] too, computed in the module's own forward and summed once
_SHARED = ("gate_proj", "up_proj", "down_proj")
_STACKED_SHARED = {"gate_proj": Shard(1), "up_proj": Shard(1), "down_proj": Shard(2)}


def _is_experts(module: nn.Module) -> bool:
    return _stacked(module, _GATED) or (
        _stacked(module, _UNGATED)
        and getattr(module, "gate_up_proj", None) is None
        and getattr(module, "gate_proj", None) is None
    )


def _expert_count(module: nn.Module) -> int:
    return module.down_proj.shape[0]


def _stacked_experts_quiet(block: nn.Module, name: str) -> list[str]:
    unit = block.get_submodule(name)
    return [_join(name, path) for path, module in unit.named_modules() if _is_experts(module)]


def _stacked_experts(
    unit: nn.Module, name: str, prefix: str, hidden: int
) -> tuple[list[str], list[str]]:
    """The paths (inside the block) of the stacked experts in ``unit`` and of its stacked
    shared experts, checked: SwiGLU experts ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
    ``[E, H, I]`` (or both transposed), or ungated ones ``up_proj`` ``[E, I, H]`` and
    ``down_proj`` ``[E, H, I]``, with no other parameter; shared experts ``gate_proj`` and
    ``up_proj`` ``[n, I, H]`` and ``down_proj`` ``[n, H, I]``. Anything else stacked is
    refused."""
    found, shared = [], []
    for path, module in unit.named_modules():
        if not _is_experts(module):
            continue
        key = _join(prefix, _join(name, path))
        names = _GATED if _stacked(module, _GATED) else _UNGATED
        others = sorted(n for n, _ in module.named_parameters() if n not in names)
        first, down = getattr(module, names[0]), module.down_proj
        (e, a, b), (e2, c, d) = first.shape, down.shape
        if names == _UNGATED:
            fits = e == e2 and a == d and b == c
        else:
            plain = a == 2 * d and b == c and e == e2
            transposed = b == 2 * c and a == d and e == e2
            fits = plain or transposed
        if others or not fits:
            raise ValueError(
                f"'{key}' ({type(module).__name__}: {names[0]} {list(first.shape)}, "
                f"down_proj {list(down.shape)}{', ' + ', '.join(others) if others else ''}): "
                "auto() shards stacked experts (gate_up_proj [E, 2I, H] and down_proj "
                "[E, H, I], or both transposed, or ungated up_proj [E, I, H] and down_proj "
                "[E, H, I]) with no other parameter; write the plan by hand"
            )
        found.append(_join(name, path))
    for path, module in unit.named_modules():
        if _join(name, path) in found:
            continue
        stacked = [n for n, p in module.named_parameters(recurse=False) if p.ndim >= 3]
        if not stacked:
            continue
        has_more = any(True for c in module.children() for _ in c.parameters())
        if sorted(stacked) == sorted(_SHARED) and not has_more:
            (n, i, h), (n2, i2, h2), (n3, h3, i3) = (getattr(module, p).shape for p in _SHARED)
            if n == n2 == n3 and i == i2 == i3 and h == h2 == h3 == hidden:
                shared.append(_join(name, path))
                continue
        raise ValueError(
            f"'{_join(prefix, _join(name, path))}' ({type(module).__name__}) holds stacked "
            f"parameters {stacked} beside the experts: auto() knows stacked experts "
            "(gate_up_proj or up_proj, and down_proj) and stacked shared experts (gate_proj, "
            "up_proj, down_proj); write the plan by hand"
        )
    return found, shared


# ------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------


def _find_blocks(model: nn.Module) -> tuple[str, list[str], list[nn.Module]]:
    """``(path, names, blocks)`` of the repeated blocks: the largest container of them."""
    lists = [(path, module) for path, module in model.named_modules() if _is_stack(module)]
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
        if other is blocks or inside or not _has_linear(other):
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


def _first(stack: nn.Module) -> nn.Module:
    return next(iter(stack.children()))


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
class _Group:
    parent: str  # path of the parent module inside the block ("" for the block itself)
    key: str  # plan key of the parent
    layers: list[_Layer]
    kind: str = ""  # "attention", "gathered" (attention computed whole), "mla" or "mlp"
    row: _Layer | None = None
    columns: list[_Layer] = field(default_factory=list)
    heads: tuple[int, int] | None = None  # (query, key/value) head counts, if found
    latents: tuple[int, ...] = ()  # multi-head latent attention: the latent widths
    rope: int = 0  # multi-head latent attention: the rotary width of the key/value latent


def _linear_groups(block: nn.Module, prefix: str) -> list[_Group]:
    groups: dict[str, _Group] = {}
    for path, module in block.named_modules():
        if (
            path
            and isinstance(module, nn.ModuleList)
            and _has_linear(module)
            and len({type(child) for child in module}) == 1
        ):
            # (sublayers of different classes in a list, as T5's block.layer, are planned as
            # any other children)
            raise ValueError(
                f"'{_join(prefix, path)}' is a nn.ModuleList of Linear layers inside the "
                "repeated blocks (experts, or several attentions): auto() plans experts "
                "stacked in 3-D parameters only; write the plan by hand"
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
    attention_like = _named_like_attention(group, module)
    # an attention's output gate (AFMoE's gate_proj, Laguna's per-head g_proj) may come after
    # its output projection: the row-parallel layer is the last writer that is no gate
    gates = [x for x in group.layers if attention_like and _GATE_NAME.search(x.name)]
    row = ([w for w in writers if w not in gates] or writers)[-1]
    columns = [layer for layer in group.layers if layer is not row]
    strangers = [layer for layer in columns if layer.in_features != hidden]
    if strangers and _assign_mla(group, hidden, row, columns, strangers):
        return
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
_GATE_NAME = re.compile(r"(^|[._])(g|gate|o_gate|g_proj|gate_proj|output_gate)$")


def _assign_columns(
    group: _Group, columns: list[_Layer], row: _Layer, named: bool, shapes: Callable
) -> None:
    """Find what the column-parallel ``columns`` feeding ``row`` are (an attention, by its
    shapes, or by its name as well, ``named``; or an MLP), and give each its style."""
    where = _where(group)
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


def _assign_mla(
    group: _Group, hidden: int, row: _Layer, columns: list[_Layer], ups: list[_Layer]
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


def _check_rope(model: nn.Module, attention: nn.Module, group: _Group, where: str) -> None:
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


def _full_width_norms(model: nn.Module, attention: nn.Module, group: _Group) -> bool:
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


def _gather_attention(group: _Group) -> None:
    """Attention computed whole on every rank, its projections' weights sharded (as
    transformers plans OLMo-2): q, k and v gather their outputs, o splits its input. A fused
    q/k/v is gathered whole too: its output on every rank is the single-device one, whatever
    its layout."""
    group.kind = "gathered"
    for layer in group.columns:
        layer.style = ColwiseParallel(output_layouts=Replicate())
    group.row.style = RowwiseParallel(input_layouts=Replicate())


def _sinks(attention: nn.Module, group: _Group) -> bool:
    """Whether the attention has sinks (one learned logit per head, ``sinks [heads]``), which
    shard with the heads; other parameters of its own are refused."""
    own = dict(attention.named_parameters(recurse=False))
    if not own:
        return False
    heads = None if group.heads is None else group.heads[0]
    if list(own) != ["sinks"] or heads is None or tuple(own["sinks"].shape) != (heads,):
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in own.items())
        raise ValueError(
            f"{_where(group)} ({type(attention).__name__}) holds parameters of its own "
            f"({shapes}): auto() knows attention sinks there (sinks [heads], with the head "
            "count found); write the plan by hand"
        )
    return True


def _unsplittable_heads(model: nn.Module, attention: nn.Module, group: _Group) -> str | None:
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
    where = _where(group)
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
    return None


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
            if _GATE_NAME.search(layer.name) and layer.out_features == heads:
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
    block: nn.Module, groups: list[_Group], hidden: int, prefix: str, skipped: set[str]
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
        key = _join(prefix, path)
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
                    f"({heads[0]} heads) inside the attention {_where(inside)} (a "
                    "relative-position bias, say): its heads would have to be split with the "
                    "attention's, and auto() does not know how it is used; write the plan by "
                    "hand"
                )
        raise ValueError(
            f"'{key}' ({type(module).__name__}, {shapes}) is inside the {inside.kind} "
            f"{_where(inside)}, whose activations are split over the ranks: auto() only "
            "knows per-head norms, attention sinks, latent norms and single-value parameters "
            "there; write the plan by hand"
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


def _check_degree(block_plan: _BlockPlan, block: nn.Module, n: int) -> None:
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
                f"'{_join(block_plan.prefix, path)}': the experts' hidden size {width} does not "
                f"divide by tp_degree {n}"
            )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name
