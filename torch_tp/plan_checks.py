"""The checks a resolved plan must pass on its mesh, before anything is applied.

:func:`validate_plan` asks each style about its module on the mesh (its ``_validate``), and
refuses a module parallelized before, a weight the plan would untie from the other modules
holding it (:func:`tied_parameters`) and replicated parameters the plan would leave with a
different, partial gradient on each rank (:func:`unsummed_gradients`). The dry-run report
and the shape check ask the same questions. What needs no mesh (the keys, parameter entries,
partial-sum regions) is checked by :func:`torch_tp.plan.resolve_plan` as it resolves.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from torch_tp._torch_compat import StridedShard
from torch_tp.plan import (
    PlanEntry,
    applied_style,
    join_path,
    path_str,
    placement_str,
    planned_placement,
    planned_placements,
    style_str,
)
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.style import adapters as _adapters
from torch_tp.style.base import short_repr

__all__ = ["tied_parameters", "unsummed_gradients", "validate_plan"]


def validate_plan(
    entries: list[PlanEntry],
    device_mesh: DeviceMesh | Sequence[DeviceMesh],
    root: nn.Module,
    *,
    strict: bool = True,
) -> None:
    """Check every entry before any is applied; raise on the first that cannot apply.

    ``device_mesh`` is the mesh of every entry, or one mesh per entry (a plan over several
    dimensions of one mesh).

    Each style's :meth:`ParallelStyle._validate` is asked about its module; its error is
    re-raised with the same type and a message naming the module path and the style. A
    module that already carries a style from an earlier :func:`parallelize_module` call is
    refused, and so is a built-in style that would replace a parameter other modules share
    (tied weights would silently come apart): with ``strict=False`` that one only warns, and
    the weights come apart as with ``torch.distributed.tensor.parallel``. A module whose
    replicated parameters would get a different, partial gradient on each rank (see
    :func:`unsummed_gradients`) is refused too (``strict=False``: a warning).
    """
    owners = parameter_owners(root) if entries else {}
    by_path = {entry.path: entry for entry in entries}
    meshes = (
        [device_mesh] * len(entries) if isinstance(device_mesh, DeviceMesh) else list(device_mesh)
    )
    untying: list[str] = []  # warned about once the whole plan is known to apply
    for entry, mesh in zip(entries, meshes, strict=True):
        where = (
            f"{style_str(entry.style)} on {path_str(entry.path)} ({type(entry.module).__name__})"
        )
        previous = applied_style(entry.module)
        if previous is not None:
            raise ValueError(
                f"cannot apply {where}: the module was already parallelized with "
                f"{style_str(previous)}; a module takes one style"
            )
        untied = _untied_parameter(entry, owners, by_path)
        if untied is not None:
            untying.append(_refuse_untying(entry, where, untied, strict))
        validate = getattr(entry.style, "_validate", None)  # optional for duck-typed styles
        try:
            # the adapters first: PEFT's layer (a Conv2d's LoRA) is the more exact reason
            if entry.adapters is not None:
                _adapters.check(entry.style, entry.adapters, entry.module)
            if validate is not None:
                validate(entry.module, mesh)
        except (NotImplementedError, ValueError, TypeError) as err:
            raise type(err)(f"cannot apply {where}: {err}") from err
    for _, _, message in unsummed_gradients(entries):
        if strict:
            raise ValueError(message)
        untying.append(f"{message.removeprefix('cannot apply ')}; strict=False: applied as planned")
    for message in untying:
        warnings.warn(message, stacklevel=3)


# ------------------------------------------------------------------------------------------
# Gradient agreement: a replicated parameter must end every backward with the same gradient on
# every rank
# ------------------------------------------------------------------------------------------


def unsummed_gradients(entries: list[PlanEntry]) -> list[tuple[PlanEntry, tuple[str, ...], str]]:
    """The modules whose replicated parameters the plan leaves with a partial gradient on each
    rank: ``(entry, parameter names, why)`` for each, read from the styles' contracts alone.

    The rule. A style that replicates some of its module's own parameters, does not list them
    among its partial gradients (it does not sum them over the ranks), and declares no input
    layout (the module computes on its inputs as they come: ``ReplicateParallel()``) gets the
    same gradient on every rank only if the module is handed the same, whole activation on
    every rank. What its parent hands it is read off the modules planned beside it (the
    parent's other children with a style): when one of their styles declares that it is given
    an input as a local shard (``given`` a ``Shard``) that none of the others declares it
    produces, that shard comes from the parent's caller, and the parent computes on a shard
    of the data (dispatch expert parallelism, ``ExpertParallel()`` with its ``Shard(0)``
    tokens, under sequence parallelism: the router sees this rank's tokens only). A shard
    that a planned sibling produces (a column-parallel output taken by a row-parallel layer)
    says nothing about the parent's input, so a module next to such a pair is not refused.
    Where no sibling says, the parent's own siblings are asked, up to an ancestor whose own
    style declares the layout of its inputs (which then fixes what arrives below it).

    Each rank's gradient of such a parameter would cover its own shard of the data only, and
    nothing would sum them: the ranks would train on different, partial gradients. The fix
    named is the first registered style that replicates the same parameters, takes its
    inputs as they come and sums their gradients (``ReplicateParallel(sum_gradients=True)``,
    ``"replicated_with_grad_allreduce"``). This is a plan-level check: the dry-run report
    (:func:`torch_tp.report.plan_report`) follows the tensors themselves and also finds a
    replicated parameter computing on a shard that no sibling reveals.

    Example::
        >>> from torch_tp import ReplicateParallel
        >>> from torch_tp.models import MoEConfig, MoELlama
        >>> from torch_tp.plans.moe import moe_llama_plan
        >>> plan = moe_llama_plan(experts="ep", sequence_parallel=True)
        >>> plan["layers.*.feed_forward.router"] = ReplicateParallel()  # not summed
        >>> model = MoELlama(MoEConfig(n_layers=1))
        >>> [(e.path, names) for e, names, _ in unsummed_gradients(resolve_plan(model, plan))]
        [('layers.0.feed_forward.router', ('weight',))]
    """
    found = []
    for entry in entries:
        names = replicated_unsummed(entry)
        if not names:
            continue
        evidence = _sharded_arrival(entries, entry)
        if evidence is None:
            continue
        found.append((entry, names, _unsummed_message(entry, names, evidence)))
    return found


def _contract_answer(call: Any, *args: Any) -> Any:
    """A contract's answer, or ``None`` for a module it does not describe (the style's own
    validation says why)."""
    try:
        return call(*args)
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        return None


def _input_layouts(entry: PlanEntry) -> list[tuple[str, Any]]:
    """``(what, Layout)`` for each input layout ``entry``'s style declares."""
    contract = getattr(entry.style, "contract", None)
    boundary = (
        None if contract is None else _contract_answer(contract.inputs, entry.style, entry.module)
    )
    if boundary is None:
        return []
    layouts = [(f"input {i}", layout) for i, layout in enumerate(boundary.args)]
    layouts += [(f"keyword input {name!r}", layout) for name, layout in boundary.kwargs.items()]
    return [(what, layout) for what, layout in layouts if layout is not None]


def _output_placements(entry: PlanEntry) -> list[Placement]:
    """Where ``entry``'s style leaves each output it declares."""
    contract = getattr(entry.style, "contract", None)
    boundary = (
        None if contract is None else _contract_answer(contract.outputs, entry.style, entry.module)
    )
    if boundary is None:
        return []
    layouts = [*boundary.args, *boundary.kwargs.values()]
    return [
        layout.given if layout.to is None else layout.to
        for layout in layouts
        if layout is not None and (layout.given is not None or layout.to is not None)
    ]


def replicated_unsummed(entry: PlanEntry) -> tuple[str, ...]:
    """The parameters ``entry``'s style replicates without summing their gradients (as its
    contract names them: a submodule's dotted), on a module that computes on its inputs as
    they come (its style declares none); a style in a partial-sum region is accounted for
    by the region."""
    contract = getattr(entry.style, "contract", None)
    if contract is None or _input_layouts(entry) or contract.partial_sum(entry.style) is not None:
        return ()
    placements = _contract_answer(contract.parameters, entry.style, entry.module) or {}
    partial = set(_contract_answer(contract.partial_gradients, entry.style, entry.module) or ())
    trained = {name for name, p in entry.module.named_parameters() if p.requires_grad}
    return tuple(
        name
        for name, placement in placements.items()
        if isinstance(placement, Replicate) and name not in partial and name in trained
    )


def _is_shard(placement: Placement | None) -> bool:
    return isinstance(placement, (Shard, StridedShard))


def _may_be_same_layout(made: Placement, taken: Placement) -> bool:
    """Whether a tensor left ``made`` may be the one taken as ``taken`` (``Shard(-1)`` and
    ``Shard(2)`` may be the same dim: the rank of the tensor is not known here)."""
    if type(made) is not type(taken):
        return False
    return made.dim == taken.dim or (made.dim < 0) != (taken.dim < 0)


def _sharded_arrival(
    entries: list[PlanEntry], entry: PlanEntry
) -> tuple[PlanEntry, str, Placement, str] | None:
    """``(sibling, which input, its layout, parent path)``: a module planned beside
    ``entry``'s (or beside an ancestor's without an input layout of its own) whose style takes
    an input as a local shard that no other module planned there produces."""
    by_path = {e.path: e for e in entries}
    path = entry.path
    while path:
        parent = path.rpartition(".")[0]
        siblings = [
            e for e in entries if e.path and e.path != path and e.path.rpartition(".")[0] == parent
        ]
        for sibling in siblings:
            made = [
                m for other in siblings if other is not sibling for m in _output_placements(other)
            ]
            for what, layout in _input_layouts(sibling):
                taken = layout.given
                if _is_shard(taken) and not any(
                    _may_be_same_layout(m, taken) for m in made if _is_shard(m)
                ):
                    return sibling, what, taken, parent
        owner = by_path.get(parent)
        if owner is not None and _input_layouts(owner):
            return None  # the parent's style lays out what arrives below it
        path = parent
    return None


def summing_style(entry: PlanEntry, names: tuple[str, ...]) -> str:
    """The first registered style that replicates ``names`` alike, takes its inputs as they
    come and sums their gradients, as plans write it."""
    for plan_name in STYLE_REGISTRY.names():
        style = _contract_answer(STYLE_REGISTRY.style, plan_name)
        contract = getattr(style, "contract", None)
        if contract is None or not contract.accepts(entry.module):
            continue
        candidate = PlanEntry(entry.key, entry.path, entry.module, style)
        if _input_layouts(candidate):
            continue
        placements = _contract_answer(contract.parameters, style, entry.module) or {}
        partial = set(_contract_answer(contract.partial_gradients, style, entry.module) or ())
        if all(isinstance(placements.get(n), Replicate) and n in partial for n in names):
            return f"{style_str(style)} ({plan_name!r})"
    return "a style that sums these gradients over the ranks"


def _unsummed_message(
    entry: PlanEntry,
    names: tuple[str, ...],
    evidence: tuple[PlanEntry, str, Placement, str],
) -> str:
    sibling, what, taken, parent = evidence
    where = f"{style_str(entry.style)} on {path_str(entry.path)} ({type(entry.module).__name__})"
    params = ", ".join(repr(join_path(entry.path, n)) for n in names)
    plural = len(names) > 1
    return (
        f"cannot apply {where}: it replicates {'parameters' if plural else 'parameter'} "
        f"{params} without summing {'their gradients' if plural else 'its gradient'} over the "
        f"ranks, and the module computes on what {path_str(parent)} hands it, which arrives "
        f"sharded: {style_str(sibling.style)} on {path_str(sibling.path)} (plan key "
        f"{short_repr(sibling.key)}) takes its {what} as a local {placement_str(taken)} that no "
        "module planned beside it produces. Each rank's gradient would cover its own shard of "
        "the data only, and the ranks would train on different, partial gradients. Plan it "
        f"{summing_style(entry, names)} instead, which sums them at the end of backward (if "
        "the module computes on whole, replicated activations only, strict=False applies the "
        "plan with a warning)"
    )


def _refuse_untying(entry: PlanEntry, where: str, untied: _Untied, strict: bool) -> str:
    """Raise (``strict``) or return the warning that applying ``entry`` unties the weight
    ``untied``.

    Upstream distributes each module's parameters on its own, so code written for it
    parallelizes tied modules in separate calls and ties the weights again afterwards
    (PyTorch's test ``Transformer.parallelize``); ``strict=False`` lets that code run.
    """
    name, _, layouts = untied
    here = join_path(entry.path, name)
    paths = list(dict.fromkeys([entry.path, *(other.rpartition(".")[0] for other in layouts)]))
    modules = " and ".join(
        filter(None, [", ".join(map(path_str, paths[:-1])), path_str(paths[-1])])
    )
    retie = "; ".join(
        f"{_parameter_expression(other)} = {_parameter_expression(here)}" for other in layouts
    )
    if strict:
        raise ValueError(
            f"cannot apply {where}: {_untied_message(untied)}. Two ways out: parallelize "
            f"{modules} in one parallelize_module call with such styles, which keeps the "
            "weight tied (one DTensor parameter); or pass strict=False to parallelize them in "
            "separate calls with such styles, as code written for "
            "torch.distributed.tensor.parallel does, and re-tie the weights after the last "
            f"call ({retie})"
        )
    names = ", ".join(map(repr, layouts))
    return (
        f"{where}: {_shared_with(untied)}. strict=False: {name!r} is distributed as this "
        f"style lays it out and {names} no longer {'shares' if len(layouts) == 1 else 'share'} "
        "it (the weights are untied, as with torch.distributed.tensor.parallel). A later "
        f"parallelize_module call that gives {names} the same layout on the same mesh shares "
        f"this parameter again, and re-tying by hand after the last call ({retie}) is then a "
        "no-op; weights laid out differently cannot be re-tied (each style computes on the "
        "local shard of the layout it gave the weight)"
    )


def _parameter_expression(parameter_path: str) -> str:
    """Python that names the parameter at ``parameter_path`` of a root called ``model``."""
    module, _, name = parameter_path.rpartition(".")
    if not module:
        return f"model.{name}"
    if all(part.isidentifier() for part in module.split(".")):
        return f"model.{module}.{name}"
    return f"model.get_submodule({module!r}).{name}"  # e.g. "layers.0"


def refuse_multi_dimensional(entries: list[PlanEntry], what: str) -> None:
    """Raise ``NotImplementedError`` naming each entry whose style is applied on an N-D mesh
    (:class:`~torch_tp.ExpertTensorParallel`): ``what`` (the shape check, the dry-run report)
    reads 1-D styles only."""
    found = [
        f"{path_str(e.path)} ({type(e.style).__name__}, on a {e.style.contract.mesh_ndim}-D mesh)"
        for e in entries
        if getattr(getattr(e.style, "contract", None), "mesh_ndim", 1) != 1
    ]
    if found:
        raise NotImplementedError(
            f"{what} takes styles on a 1-D mesh only; the plan puts {', '.join(found)}: "
            "check it with torch_tp.testing.check_parity"
        )


# a parameter a style would untie: its name, its placement under the style, and every other
# path it is reachable by, with the placement the plan gives it there (None: not in the plan)
_Untied = tuple[str, Placement, dict[str, Placement | None]]


def tied_parameters(
    entry: PlanEntry, owners: dict[int, list[str]], by_path: Mapping[str, PlanEntry]
) -> str | None:
    """Why ``entry`` would untie a weight shared with another module (``None`` if it would
    not); ``owners`` is :func:`parameter_owners` of the root, ``by_path`` the plan's entries
    by module path.

    A tied weight may be distributed when every module holding it is in the plan with a
    style that lays it out the same way (GPT-2's vocabulary-sharded ``wte`` and
    column-parallel ``lm_head``, both ``Shard(0)``): it is then distributed once and stays
    tied.
    """
    untied = _untied_parameter(entry, owners, by_path)
    return None if untied is None else _untied_message(untied)


def _untied_parameter(
    entry: PlanEntry, owners: dict[int, list[str]], by_path: Mapping[str, PlanEntry]
) -> _Untied | None:
    """The first parameter of ``entry``'s module that applying it would untie, if any."""
    placements = planned_placements(entry)
    for name, param in entry.module.named_parameters(recurse=False):
        placement = placements.get(name)
        if placement is None:
            continue
        others = [p for p in owners[id(param)] if p != join_path(entry.path, name)]
        if not others:
            continue
        layouts = {}
        for other in others:
            path, _, other_name = other.rpartition(".")
            other_entry = by_path.get(path)
            layouts[other] = (
                None if other_entry is None else planned_placement(other_entry, other_name)
            )
        if all(layout == placement for layout in layouts.values()):
            continue
        return name, placement, layouts
    return None


def _shared_with(untied: _Untied) -> str:
    name, placement, layouts = untied
    found = ", ".join(
        f"{other!r} ({'not in the plan' if layout is None else repr(layout)})"
        for other, layout in layouts.items()
    )
    return f"its parameter {name!r} ({placement!r} here) is shared with {found} (tied weights)"


def _untied_message(untied: _Untied) -> str:
    return (
        f"{_shared_with(untied)}; sharding it differently, or in one place only, would untie "
        "them: give every module holding it a style that lays it out alike"
    )


def parameter_owners(root: nn.Module) -> dict[int, list[str]]:
    """Every path each parameter object is reachable by (several for tied weights)."""
    owners: dict[int, list[str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(join_path(path, name))
    return owners
