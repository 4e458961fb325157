""":func:`auto`, the entry point: the plan of the whole model, and its shape check.

:func:`auto` runs :func:`_infer` (the blocks, from :mod:`~torch_tp.plans.auto.blocks`; the
input embedding and the output head outside them, found here), checks the plan's shapes on
the meta device (:func:`_shape_problems`), sends the attentions and MLPs the check finds a
problem in back to be computed whole (:func:`_fallbacks`), and warns of what it leaves whole
(:class:`ReplicatedModulesWarning`) or could not check (:class:`UncheckedPlanWarning`).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate

from torch_tp.plans._context import with_context_parallel
from torch_tp.plans._peft import prefixed, without_tuner_layers, wrapped_model
from torch_tp.plans.auto.blocks import (
    block_kinds,
    check_tp_degree,
    find_blocks,
    kind_prefix,
    merged_paths,
    merged_styles,
    plan_block,
)
from torch_tp.plans.auto.groups import (
    BlockPlan,
    find_hidden_size,
    join_dotted,
    linear_groups,
    linear_shape,
)
from torch_tp.style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["ReplicatedModulesWarning", "UncheckedPlanWarning", "auto"]


def auto(
    model: nn.Module,
    *,
    tp_degree: int | None = None,
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    cp_degree: int | None = None,
) -> dict[str, ParallelStyle]:
    """Infer a Megatron-style tensor-parallel plan for a transformer, from its structure.

    Nothing is changed and nothing is computed: the plan is read from the module tree and the
    sources (the repeated blocks, their groups of Linear layers, head counts, fused
    projections, experts, the embedding and the head), then traced on the meta device as one
    device and as one rank (:func:`torch_tp.shapes.check_shapes`); a model on the meta device
    works, and no process group is needed. An attention or MLP whose shapes a rank would get
    wrong is computed whole instead, with a :class:`ReplicatedModulesWarning`. The rules, in
    order, are in the guide's "The automatic planner" (``docs/plans.md``). The shape check
    finds other shapes than one device's, not other values: verify a new model with
    :func:`torch_tp.testing.check_parity`.

    Args:
        model: the model to plan for (on any device, including meta).

    Keyword Args:
        tp_degree (int, optional): the tensor-parallel degree to check sizes against.
            Default: ``None`` (no check of the sizes; the shapes are checked at degree 2).
        example_inputs (optional): the model's inputs for the shape check: a tensor, a tuple
            of positional inputs or a dict of keyword inputs (only shapes and dtypes are
            used). Default: token ids of shape ``(2, 8)``.
        example_kwargs (dict, optional): keyword inputs beside positional ones.
        cp_degree (int, optional): over 1, the plan also splits each sequence over a ``cp``
            mesh dimension: :class:`~torch_tp.ContextParallel` on every block (rule 1's
            stack), for a mesh with dimensions ``("cp", "tp")``. Default: ``None``.

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
    wrapped = wrapped_model(model)
    if wrapped is not None:  # a PeftModel: the plan of the model it wraps, under its path
        path, inner = wrapped
        kwargs = {"example_inputs": example_inputs, "example_kwargs": example_kwargs}
        return prefixed(auto(inner, tp_degree=tp_degree, cp_degree=cp_degree, **kwargs), path)
    # PEFT's tuner layers seen as the layers they wrap (their adapters are no Linear layers
    # of the block): the keys name the tuner layers, which the styles resolve to their bases
    model = without_tuner_layers(model)
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
        quality = _quality(model, plan, degree, example_inputs, example_kwargs)
        split = "".join(
            f"; {q.block}: {q.parameter_fraction:.0%} of its linear parameters and "
            f"{q.flop_fraction:.0%} of its matmul FLOPs sharded"
            for q in quality
        )
        warnings.warn(
            ReplicatedModulesWarning(
                "auto() leaves modules whole on every rank (correct, but their work is not "
                "split): "
                + "; ".join(f"{key!r}: {reason}" for key, reason in reasons.items())
                + split,
                list(reasons),
                quality,
            ),
            stacklevel=2,
        )
    return with_context_parallel(model, plan, cp_degree)


def _infer(
    model: nn.Module, tp_degree: int | None, whole: dict[str, str]
) -> tuple[dict[str, ParallelStyle], dict[str, str], dict[str, str]]:
    """``(plan, why each module left whole is, by its plan key, concrete module path -> plan
    key of each planned group's parent)``; the groups named in ``whole`` (plan keys of
    their parents) are computed whole, their weights sharded."""
    blocks_path, names, blocks = find_blocks(model)
    embedding = _input_embedding(model, blocks_path)
    head = _output_head(model, blocks_path, embedding)
    if head is not None:
        embedding = embedding or head[2]
    kinds = block_kinds(blocks)
    first_prefix = kind_prefix(blocks_path, names, kinds, 0)
    hidden = find_hidden_size(
        linear_groups(blocks[kinds[0][0]], first_prefix), embedding, first_prefix
    )

    planned: list[BlockPlan] = []
    groups: dict[str, str] = {}
    for k, indices in enumerate(kinds):
        prefix = kind_prefix(blocks_path, names, kinds, k)
        members = [blocks[i] for i in indices]
        block_plan = plan_block(model, members, hidden, prefix, whole)
        block_plan.indices = indices
        if tp_degree is not None:
            check_tp_degree(block_plan, members[0], tp_degree)
        planned.append(block_plan)
        for group in block_plan.groups:
            if group.kind in ("attention", "mlp", "gathered"):
                for i in indices:
                    groups[join_dotted(join_dotted(blocks_path, names[i]), group.parent)] = (
                        group.key
                    )

    plan: dict[str, ParallelStyle] = {}
    if embedding is not None:
        plan[embedding[0]] = RowwiseParallel(input_layouts=Replicate())
    plan.update(merged_styles(blocks_path, names, blocks, planned))
    if head is not None:
        plan[head[0]] = ColwiseParallel(output_layouts=Replicate())
    reasons: dict[str, str] = {}
    for what in ("replicated", "whole"):
        for path, key in merged_paths(blocks_path, names, blocks, planned, what):
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


def _quality(
    model: nn.Module, plan: dict, degree: int, example_inputs: Any, example_kwargs: Any
) -> list:
    """What ``plan`` splits in each block of ``model`` (the dry-run report's
    :attr:`~torch_tp.report.PlanReport.quality`, traced on a meta copy); empty where the
    report cannot trace the model with these inputs."""
    from torch_tp.report import plan_report
    from torch_tp.shapes import meta_copy, on_meta

    if example_kwargs:
        if example_inputs is not None:
            return []  # positional and keyword inputs together: the report takes one kind
        example_inputs = dict(example_kwargs)
    try:
        report = plan_report(
            meta_copy(model),
            plan,
            degree,
            batch_size=2,
            seq_len=8,  # the shape check's default inputs: token ids of shape (2, 8)
            example_inputs=on_meta(example_inputs),
        )
    except Exception:  # the report's own limits (a forward it cannot trace): no fractions
        return []
    return report.quality


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
    gives each module's reason, and what the plan still splits per block: :attr:`quality`,
    the dry-run report's (:class:`torch_tp.report.BlockQuality`; empty where the report
    cannot trace the model)."""

    def __init__(self, message: str, modules: list[str], quality: list | None = None) -> None:
        super().__init__(message)
        self.modules = tuple(modules)
        self.quality = tuple(quality or ())


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
        (path, module, linear_shape(module))
        for path, module in model.named_modules()
        if _outside(path, blocks_path) and linear_shape(module) is not None
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
