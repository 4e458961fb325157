"""Plans as data: resolving a plan to ``(path, module, style)`` and checking it whole.

A plan is one :class:`ParallelStyle` (applied to the module itself) or a dict from module
paths to styles. A path is dotted; each segment is matched against the names of the
children at that level with :mod:`fnmatch` wildcards (``layers.*.attention.wq``), and the
empty path ``""`` names the module itself. Nothing here touches a module: resolution and
validation only read, so a plan can be checked before anything changes.

A key whose last segment names *parameters* of the modules the rest names (transformers'
``"layers.*.mlp.experts.gate_up_proj": "packed_colwise"``, next to ``"layers.*.mlp.experts":
"moe_tp_experts"``) states how a parameter is laid out, not a style to apply: the module's
own style places it. Such an entry is checked against that style's contract and then has
nothing left to do; one that disagrees, or whose module has no style placing the parameter,
is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Placement, Shard

from torch_tp import _names, runtime
from torch_tp._torch_compat import StridedShard
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.style import adapters as _adapters
from torch_tp.style.base import (
    MODULE_PATH_ATTR,
    STYLE_REPR_LIMIT,
    ParallelStyle,
    short_repr,
)

__all__ = ["PlanEntry", "from_dict", "resolve_plan", "to_dict"]

# set on every module a style was applied to; a second style on it is refused
_APPLIED_STYLE = "_torch_tp_style"


@dataclass(frozen=True)
class PlanEntry:
    """One module a plan applies a style to.

    Attributes:
        key: the plan key that matched (may hold wildcards).
        path: the module's dotted path from the root (``""`` for the root itself).
        module: the module.
        style: the style to apply.
        adapters: the PEFT layer wrapping ``module`` (its ``base_layer``), whose LoRA
            adapters the style hosts; ``None`` for a module PEFT did not wrap. A key naming
            the wrapper (``q_proj``) gives the base layer as ``module``.
    """

    key: str
    path: str
    module: nn.Module
    style: ParallelStyle
    adapters: nn.Module | None = None


def is_style(value: object) -> bool:
    """A :class:`ParallelStyle`, or an object honouring the same contract.

    The duck-typed case (an ``_apply`` method and a ``src_data_rank`` attribute) admits styles
    written against ``torch.distributed.tensor.parallel``'s own ``ParallelStyle`` base, so
    that switching the import is the whole migration. Modules (which have an unrelated
    ``_apply``) and classes are not styles.
    """
    if isinstance(value, ParallelStyle):
        return True
    if isinstance(value, (type, nn.Module)):
        return False
    return callable(getattr(value, "_apply", None)) and hasattr(value, "src_data_rank")


def path_str(path: str) -> str:
    """A module path as error messages show it (``''`` is the root module)."""
    return f"'{path}'" if path else "the root module ('')"


def style_str(style: object) -> str:
    """A style as error messages show it: its repr, bounded (a user's may be anything)."""
    return short_repr(style, STYLE_REPR_LIMIT)


def _check_keys(plan: Mapping[Any, Any]) -> None:
    for key in plan:
        if not isinstance(key, str):
            raise TypeError(
                f"plan key {short_repr(key)}: module paths must be str, found {type(key).__name__}"
            )


def _match(root: nn.Module, key: str) -> tuple[list[tuple[str, nn.Module]], str | None]:
    """All ``(path, module)`` that ``key`` names, or why it names none."""
    if key == "":
        return [("", root)], None
    frontier = [("", root)]
    for segment in key.split("."):
        found = [
            (f"{path}.{name}" if path else name, child)
            for path, module in frontier
            for name, child in module.named_children()
            if fnmatchcase(name, segment)
        ]
        if not found:
            path, module = frontier[0]
            children = [name for name, _ in module.named_children()]
            shown = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
            return [], (
                f"segment {short_repr(segment)} matches no child of {path_str(path)} "
                f"(children: {shown or 'none'})"
            )
        frontier = found
    return frontier, None


def resolve_plan(
    module: nn.Module,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle],
    *,
    strict: bool = True,
) -> list[PlanEntry]:
    """Resolve a plan's keys to the modules they name, in plan order.

    Args:
        module: the root module the plan's paths are relative to.
        parallelize_plan: a :class:`ParallelStyle` for ``module`` itself, or a dict from
            module paths (with ``fnmatch`` wildcards per dotted segment) to styles.
        strict: raise for a key that matches no submodule; when ``False``, warn and skip it.

    Returns:
        One :class:`PlanEntry` per matched module, in the order of the plan's keys and, for
        a wildcard key, of :meth:`nn.Module.named_children`.

    A key whose last segment names parameters of the modules the rest of it names (a
    parameter entry, as transformers writes ``"layers.*.mlp.experts.gate_up_proj":
    "packed_colwise"``) yields no entry of its own: it must agree with the placement the
    style of the parameter's module gives that parameter (see :func:`parameter_entry_placement`
    for what a style on a parameter means), and is refused otherwise, whatever ``strict``.

    Raises:
        TypeError: the plan is neither a style nor a dict, a key is not a string, or a value
            is not a :class:`ParallelStyle`.
        ValueError: a key matches no submodule (``strict=True``), two keys name the same
            module, a value is an unknown style name, or a parameter entry names a parameter
            that no style of the plan places, or places otherwise.
        NotImplementedError: a value is a transformers style name that no torch_tp style
            expresses yet.
    """
    if is_style(parallelize_plan):
        return [PlanEntry("", "", module, parallelize_plan)]
    if not isinstance(parallelize_plan, Mapping):
        raise TypeError(
            "Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for parallelize_plan, "
            f"{type(parallelize_plan)} found!"
        )
    _check_keys(parallelize_plan)
    parallelize_plan = _names.resolve_names(parallelize_plan)
    for key, style in parallelize_plan.items():
        if not is_style(style):
            raise TypeError(
                f"plan key {short_repr(key)}: expected a ParallelStyle (e.g. ColwiseParallel()) "
                f"or a style name (e.g. 'colwise'), found {type(style).__name__} "
                f"{short_repr(style)}"
            )

    entries: list[PlanEntry] = []
    owner: dict[int, PlanEntry] = {}
    # (key, style, (module path, module, parameter name)...): checked once every module's
    # style is known, since transformers writes a parameter's key before its module's
    parameter_entries: list[tuple[str, ParallelStyle, list[tuple[str, nn.Module, str]]]] = []
    for key, style in parallelize_plan.items():
        matches, why = _match(module, key)
        # a wildcard that names modules names only them (not also a direct parameter that
        # happens to match); a plain name is both where it is both (a child here, a
        # parameter there), so that no part of an entry goes unchecked
        wildcard = any(c in key.rpartition(".")[2] for c in "*?[")
        parameters = [] if matches and wildcard else _match_parameters(module, key)
        if parameters:
            parameter_entries.append((key, style, parameters))
        if not matches and parameters:
            continue
        if not matches:
            message = f"parallelize_plan key {short_repr(key)} matches no submodule: {why}"
            if strict:
                raise ValueError(message)
            warnings.warn(message + "; skipping it (strict=False)", stacklevel=3)
            continue
        for path, submodule in matches:
            # a PEFT wrapper stands for its base layer, whose style hosts its adapters
            path, submodule, wrapper = _adapters.host_of(path, submodule, module)
            if id(submodule) in owner:
                first = owner[id(submodule)]
                raise ValueError(
                    f"module {path_str(path)} is matched by plan keys {short_repr(first.key)} "
                    f"({style_str(first.style)}) and {short_repr(key)} ({style_str(style)}); a "
                    "module takes one style"
                )
            entry = PlanEntry(key, path, submodule, style, wrapper)
            owner[id(submodule)] = entry
            entries.append(entry)
    # styles that take their placements from the entries (local_params) get them first
    stated: dict[int, dict[str, Placement]] = {}
    for key, style, parameters in parameter_entries:
        for path, submodule, name in parameters:
            entry = owner.get(id(submodule))
            if entry is not None and _takes_entries(entry.style):
                found = parameter_entry_placement(style, getattr(submodule, name))
                if found is None:
                    raise ValueError(
                        f"plan key {short_repr(key)} ({style_str(style)}) names the parameter "
                        f"{name!r} of {path_str(path)}, whose style {style_str(entry.style)} "
                        "takes its placement from this entry, but the entry states none: use "
                        "a style that lays out a Linear weight ('colwise', 'rowwise', ...)"
                    )
                stated.setdefault(id(submodule), {})[name] = found
    for i, entry in enumerate(entries):
        if _takes_entries(entry.style):
            style = entry.style._with_parameter_entries(stated.get(id(entry.module), {}))
            entries[i] = owner[id(entry.module)] = replace(entry, style=style)
    for key, style, parameters in parameter_entries:
        for path, submodule, name in parameters:
            _check_parameter_entry(key, style, path, submodule, name, owner.get(id(submodule)))
    _check_partial_sum_regions(entries)
    return entries


def _partial_sum(style: object) -> str | None:
    contract = getattr(style, "contract", None)
    return None if contract is None else contract.partial_sum(style)


def _region_parts() -> str:
    """The plan names of the styles a partial-sum region may hold (those that compute on
    local shards with no collective of their own), read from the registry."""
    names = []
    for name in STYLE_REGISTRY.names():
        style = STYLE_REGISTRY.style(name)
        if _partial_sum(style) in ("part", "either"):
            names.append(repr(name))
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def _check_partial_sum_regions(entries: list[PlanEntry]) -> None:
    """Refuse a style inside a partial-sum region (``"all_reduce"``, ``"gather"``) that
    issues collectives of its own, and a style that computes one part of a sum
    (``"local_colwise"``, ...) outside every region: either way the result would be wrong
    (counted once per rank, or never summed)."""
    regions = [e for e in entries if _partial_sum(e.style) == "region"]
    if not regions and not any(_partial_sum(e.style) == "part" for e in entries):
        return
    for entry in entries:
        role = _partial_sum(entry.style)
        around = [
            r
            for r in regions
            if r is not entry and (r.path == "" or entry.path.startswith(r.path + "."))
        ]
        here = (
            f"plan key {short_repr(entry.key)} ({style_str(entry.style)}) on {path_str(entry.path)}"
        )
        if around and role not in ("part", "either"):
            region = around[0]
            raise ValueError(
                f"{here} is inside {path_str(region.path)}, whose style {style_str(region.style)} "
                f"(plan key {short_repr(region.key)}) sums what is computed inside it: a style "
                "there must compute on its shards with no collective of its own "
                f"({_region_parts()}), or the sum would count its results once per rank"
            )
        if not around and role == "part":
            raise ValueError(
                f"{here} computes one part of a sum with no collective of its own: it must be "
                "inside a module planned 'gather' or 'all_reduce' (PartialSumParallel), which "
                "sums the parts, and none of the modules around it is"
            )


def _takes_entries(style: object) -> bool:
    """Whether ``style`` takes its placements from the plan's parameter entries under its
    module (its ``_with_parameter_entries`` hook)."""
    return getattr(style, "_with_parameter_entries", None) is not None


def _match_parameters(root: nn.Module, key: str) -> list[tuple[str, nn.Module, str]]:
    """Every ``(module path, module, parameter name)`` that ``key`` names as a parameter: its
    last segment matched against the direct parameters of the modules the rest names."""
    parent, _, pattern = key.rpartition(".")
    if not pattern:
        return []
    modules, _ = _match(root, parent)
    # a PEFT wrapper's parameters are its base layer's (q_proj.weight: q_proj.base_layer.weight)
    modules = [_adapters.host_of(path, module, root)[:2] for path, module in modules]
    return [
        (path, module, name)
        for path, module in modules
        for name, _ in module.named_parameters(recurse=False)
        if fnmatchcase(name, pattern)
    ]


def parameter_entry_placement(style: object, parameter: torch.Tensor) -> Placement | None:
    """The placement a plan entry ``style`` states for ``parameter`` when its key names a
    parameter rather than a module (``None``: the style lays out no Linear weight).

    As in transformers' plans, the parameter is taken as a Linear's weight whose last two
    dims are ``(out_features, in_features)``, any leading dims batching it (stacked experts
    ``[n_experts, out, in]``), or, when 1-D, as a Linear's bias: ``"colwise"`` shards dim
    -2 (a bias: dim -1), ``"rowwise"`` dim -1 (a bias is replicated), ``"packed_colwise"``
    strides dim -2. What the style does to a Linear is read from its contract's
    ``parameters``, unless the style says what it states about a parameter itself (its
    ``_parameter_entry`` hook: ``"grouped_gemm"`` splits stacked experts on dim 0).
    """
    contract = getattr(style, "contract", None)
    if contract is None or parameter.ndim == 0:
        return None
    stated = getattr(style, "_parameter_entry", None)
    if stated is not None:
        return stated(parameter)
    stand_in = nn.Linear(1, 1, device="meta")  # meta: nothing is allocated
    if not contract.accepts(stand_in):
        return None
    try:
        placements = contract.parameters(style, stand_in) or {}
    except (AttributeError, NotImplementedError):
        return None
    placement = placements.get("weight" if parameter.ndim >= 2 else "bias")
    if isinstance(placement, (Shard, StridedShard)) and parameter.ndim >= 2:
        # a dim of the 2-D weight, counted from the end, is the same dim of the parameter
        placement = runtime.normalize(placement, 2)
        dim = placement.dim - 2 + parameter.ndim
        if isinstance(placement, StridedShard):
            return StridedShard(dim, split_factor=placement.split_factor)
        return Shard(dim)
    return placement


def _same_placement(a: Placement | None, b: Placement) -> bool:
    # a strided shard is a Shard subclass: compare the kinds too
    return type(a) is type(b) and a == b


def placement_str(placement: Placement) -> str:
    """``Shard(1)``, ``StridedShard(1, split_factor=2)``: as plans write placements."""
    try:
        return _names.placement_to_str(placement)
    except TypeError:
        return repr(placement)


def _check_parameter_entry(
    key: str,
    style: ParallelStyle,
    path: str,
    module: nn.Module,
    name: str,
    owner: PlanEntry | None,
) -> None:
    """Refuse a parameter entry unless the style of the parameter's module places the
    parameter as the entry states."""
    parameter = getattr(module, name)
    where = (
        f"plan key {short_repr(key)} ({style_str(style)}) names the parameter {name!r} of "
        f"{path_str(path)} ({type(module).__name__}), not a module"
    )
    if owner is None:
        raise ValueError(
            f"{where}; a parameter entry states how the style of the parameter's module lays "
            f"it out, and no plan key gives {path_str(path)} a style: add one that places "
            f"{name!r} (for stacked experts, 'moe_tp_experts'), or name a module"
        )
    expected = planned_placement(owner, name)
    module_style = f"{style_str(owner.style)} (plan key {short_repr(owner.key)})"
    if expected is None:
        raise ValueError(
            f"{where}; the style of that module, {module_style}, does not place {name!r}, so "
            "the entry would do nothing: remove it, or give the module a style that places it"
        )
    found = parameter_entry_placement(style, parameter)
    expected = runtime.normalize(expected, parameter.ndim)
    if found is None:
        raise ValueError(
            f"{where}; {module_style} places it {placement_str(expected)}, and {style_str(style)} "
            "lays out no Linear weight, so it states no placement for a parameter: use a style "
            "that does, or remove the key"
        )
    if not _same_placement(found, expected):
        # the first name that states it (a name's aliases come after it)
        names = [
            n
            for n in STYLE_REGISTRY.names()
            if _same_placement(
                parameter_entry_placement(STYLE_REGISTRY.style(n), parameter), expected
            )
        ]
        hint = f" (as {names[0]!r} does)" if names else ""
        raise ValueError(
            f"{where}; it would place it {placement_str(found)}, but {module_style} places it "
            f"{placement_str(expected)}: the entry must state that placement{hint}, or be removed"
        )


def planned_placements(entry: PlanEntry) -> Mapping[str, Placement]:
    """The placement ``entry``'s style gives each of its module's own parameters, as its
    contract declares (empty: the style distributes none, or declares no contract)."""
    contract = getattr(entry.style, "contract", None)
    if contract is None:
        return {}
    try:
        return contract.parameters(entry.style, entry.module) or {}
    except (AttributeError, NotImplementedError):
        return {}  # a module type the style refuses: its own validation says so


def planned_placement(entry: PlanEntry, name: str) -> Placement | None:
    """The placement ``entry``'s style gives its module's parameter ``name`` (``None``: the
    style leaves it alone)."""
    return planned_placements(entry).get(name)


def join_path(path: str, name: str) -> str:
    """The path of ``name`` (a parameter, a submodule) inside the module at ``path``."""
    return f"{path}.{name}" if path else name


def styled_modules(entries: list[PlanEntry]) -> frozenset[int]:
    """The ids of the modules a plan gives a style: each entry's module, and the adapters of
    the PEFT layer wrapping it, which its style hosts (:mod:`torch_tp.style.adapters`)."""
    return frozenset(id(entry.module) for entry in entries) | frozenset(
        id(m)
        for entry in entries
        if entry.adapters is not None
        for m in _adapters.adapter_modules(entry.adapters)
    )


def applied_style(module: nn.Module) -> Any:
    """The style an earlier :func:`torch_tp.parallelize_module` call applied to ``module``
    (``None``: none)."""
    return getattr(module, _APPLIED_STYLE, None)


def mark_applied(entry: PlanEntry) -> None:
    """Record on the module that ``entry.style`` was applied to it, and by which path."""
    setattr(entry.module, _APPLIED_STYLE, entry.style)
    setattr(entry.module, MODULE_PATH_ATTR, entry.path)


# ------------------------------------------------------------------------------------------
# Style names and plans as plain data
# ------------------------------------------------------------------------------------------


def to_dict(plan: ParallelStyle | Mapping[str, ParallelStyle | str]) -> dict[str, str | dict]:
    """Write a plan as plain, JSON-able data: to print, diff or store it.

    Each style becomes its name when it equals a named style (``"colwise"``, ``"rowwise"``,
    ``"sequence_parallel"``, ...: the table is in the "Writing plans" guide), else a dict of
    its class and the arguments that differ from their defaults, with placements as strings
    (``"Shard(1)"``, ``"Replicate()"``, ``"Partial()"``). A plan that is one style becomes
    ``{"": ...}``. Name values are checked and written under their canonical name.

    Args:
        plan: a style, or a dict from module paths to styles or style names.

    Returns:
        A dict from module paths to names or dicts, which :func:`from_dict` turns back into an
        equal plan (``from_dict(to_dict(plan)) == plan``).

    Raises:
        TypeError: a value is not a built-in style (a user-defined style has no data form).
        ValueError: a value is an unknown style name.

    Example::
        >>> from torch_tp.plans.llama import llama_plan
        >>> data = to_dict(llama_plan())
        >>> data["layers.*.attention.wq"], data["output"]
        ('colwise', 'colwise_gather_output')
        >>> import json
        >>> from_dict(json.loads(json.dumps(data))) == llama_plan()
        True
    """
    if is_style(plan):
        plan = {"": plan}
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"expected a ParallelStyle or a dict of them, found {type(plan).__name__} "
            f"{short_repr(plan)}"
        )
    _check_keys(plan)
    return {
        key: _names.style_to_data(style, key) for key, style in _names.resolve_names(plan).items()
    }


def from_dict(data: Mapping[str, str | Mapping[str, Any]]) -> dict[str, ParallelStyle]:
    """Read a plan written by :func:`to_dict` (or by hand, or a transformers ``tp_plan``).

    Args:
        data: a dict from module paths to style names (``"colwise"``) or to dicts
            ``{"style": "RowwiseParallel", "output_layouts": "Shard(1)", ...}``.

    Returns:
        A dict from module paths to style objects, for :func:`parallelize_module`.

    The data is checked as strictly as the styles' own arguments: flags must be JSON
    booleans (``"false"`` is not false), placements must read as one, and every error names
    the plan key and the style and shows a bounded prefix of the offending value. Whether a
    ``Shard`` dim exists is checked where the tensor is known: parameters when
    :func:`parallelize_module` validates the plan, activations at the forward.

    Raises:
        ValueError: an unknown style name, class or placement string, a ``StridedShard``
            whose ``split_factor`` is not positive, or data nested deeper than 32 levels.
        NotImplementedError: a transformers style name that no torch_tp style expresses yet.
        TypeError: a key is not a string, a value is neither a name nor a dict whose
            ``"style"`` entry is a class name, or its arguments do not fit the style (a flag
            that is not a ``bool``, a dim that is not an ``int``, an unknown argument).

    Example::
        >>> wo = {"style": "RowwiseParallel", "output_layouts": "Shard(1)"}
        >>> plan = from_dict({"wq": "colwise", "wo": wo})
        >>> plan["wq"] == ColwiseParallel(), plan["wo"] == RowwiseParallel(output_layouts=Shard(1))
        (True, True)
    """
    if not isinstance(data, Mapping):
        raise TypeError(
            f"expected a dict from module paths to styles, found {type(data).__name__} "
            f"{short_repr(data)}"
        )
    _check_keys(data)
    return {key: _names.style_from_data(value, key) for key, value in data.items()}


def key_matches_any(key: str, paths: list[list[str]]) -> bool:
    """Whether the plan key (``fnmatch`` wildcards per dotted segment) names one of
    ``paths`` (module and parameter paths, split into segments)."""
    if key == "":  # the model itself
        return True
    segments = key.split(".")
    return any(
        len(path) == len(segments)
        and all(fnmatchcase(name, pattern) for name, pattern in zip(path, segments, strict=True))
        for path in paths
    )
