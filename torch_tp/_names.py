"""Style names and the plain-data form of styles.

A plan value may be a name instead of a style object: the names that Hugging Face transformers
writes in its ``tp_plan`` / ``base_model_tp_plan`` (``"colwise"``, ``"rowwise"``, ...) map to the
torch_tp style that does exactly what transformers does with that name. Each style declares
its names in its contract (:class:`torch_tp.contract.StyleContract`), and they are looked up
in :data:`torch_tp.registry.STYLE_REGISTRY`. Names whose meaning no torch_tp style expresses
yet are known here too, so that they fail with ``NotImplementedError`` saying what is
missing, rather than as a typo.

Styles also have a JSON-able form, so that a plan can be printed, diffed and stored
(:func:`torch_tp.plan.to_dict` / :func:`torch_tp.plan.from_dict`): a name when the style equals
a named one, else ``{"style": class name, argument: value, ...}`` with the arguments (as the
style's contract reads them) that differ from the defaults, placements written
``"Shard(1)"``, ``"Replicate()"``, ``"Partial()"``.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_tp._torch_compat import StridedShard
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.style.base import ParallelStyle, short_repr, style_arguments

__all__: list[str] = []  # private module: the public entry points are in torch_tp.plan

# names transformers uses whose meaning needs a style torch_tp does not have (yet), with why:
# none today (transformers 4.x's "local_*" and "gather" are LocalLinearParallel,
# LocalParamsParallel and PartialSumParallel); a name added here fails with
# NotImplementedError saying what is missing, rather than as a typo
UNSUPPORTED_NAMES: dict[str, str] = {}


def style_from_name(name: str, key: str | None = None) -> ParallelStyle:
    """The style a name stands for, as a new object.

    Raises:
        NotImplementedError: a transformers name whose meaning no torch_tp style has yet.
        ValueError: an unknown name; the message lists the valid ones.
    """
    where = _where(key)
    style = STYLE_REGISTRY.style(name)
    if style is not None:
        return style
    if name in UNSUPPORTED_NAMES:
        raise NotImplementedError(
            f"{where}style name {name!r} is not supported: "
            f"{UNSUPPORTED_NAMES[name]}. Leave the module out of the plan, or write a "
            "ParallelStyle for it"
        )
    names = STYLE_REGISTRY.names()
    close = difflib.get_close_matches(name[:100], [*names, *UNSUPPORTED_NAMES], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"{where}unknown style name {short_repr(name)}{hint}; valid names: {', '.join(names)}"
    )


def _where(key: object) -> str:
    """``"plan key 'layers.*.wq': "``, the start of an error about one plan entry."""
    return f"plan key {short_repr(key)}: " if key is not None else ""


def name_of(style: object) -> str | None:
    """The first name whose style equals ``style`` (aliases come later), or ``None``."""
    return STYLE_REGISTRY.name_of(style)


def resolve_names(plan: Mapping[Any, Any]) -> dict[Any, Any]:
    """``plan`` with every ``str`` value replaced by the style it names (the hook of
    :func:`torch_tp.plan.resolve_plan`)."""
    return {
        key: style_from_name(value, key) if isinstance(value, str) else value
        for key, value in plan.items()
    }


# ------------------------------------------------------------------------------------------
# Placements as strings
# ------------------------------------------------------------------------------------------

# ASCII digits only (\d takes any script's), and few of them: no tensor has more dims
_SHARD = re.compile(r"Shard\((-?[0-9]{1,9})\)")
_STRIDED = re.compile(r"StridedShard\((-?[0-9]{1,9}), split_factor=([0-9]{1,9})\)")
_PARTIAL = re.compile(r"Partial\((\w{0,32})\)")


def placement_to_str(placement: Placement) -> str:
    """``"Shard(1)"``, ``"Replicate()"``, ``"Partial()"`` (``"Partial(avg)"`` for other ops),
    ``"StridedShard(1, split_factor=3)"`` (a packed weight)."""
    if type(placement) is Shard:
        return f"Shard({placement.dim})"
    if type(placement) is StridedShard:  # a packed weight: each rank's slice of each part
        return f"StridedShard({placement.dim}, split_factor={placement.split_factor})"
    if type(placement) is Replicate:
        return "Replicate()"
    if type(placement) is Partial:
        op = placement.reduce_op
        return "Partial()" if op == "sum" else f"Partial({op})"
    raise TypeError(f"no plain-data form for the placement {placement!r}")


def placement_from_str(text: str) -> Placement:
    """The inverse of :func:`placement_to_str`.

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: ``text`` is no placement, or a ``StridedShard`` whose ``split_factor`` is
            not positive. Whether a ``Shard`` dim fits its tensor is checked where the
            tensor is known (the parameter at validation, the activation at forward).
    """
    if not isinstance(text, str):
        raise TypeError(
            f"expected a placement string such as 'Shard(1)' or 'Replicate()', found "
            f"{type(text).__name__} {short_repr(text)}"
        )
    if text == "Replicate()":
        return Replicate()
    if match := _SHARD.fullmatch(text):
        return Shard(int(match.group(1)))
    if match := _STRIDED.fullmatch(text):
        split_factor = int(match.group(2))
        if split_factor < 1:
            raise ValueError(
                f"the split_factor of {text!r} must be a positive int, found {split_factor}"
            )
        return StridedShard(int(match.group(1)), split_factor=split_factor)
    if match := _PARTIAL.fullmatch(text):
        return Partial(match.group(1) or "sum")
    raise ValueError(
        f"cannot read {short_repr(text)} as a placement: expected 'Shard(d)', 'Replicate()', "
        "'Partial()' or 'StridedShard(d, split_factor=k)'"
    )


# ------------------------------------------------------------------------------------------
# Styles as plain data
# ------------------------------------------------------------------------------------------


def _minimal_arguments(style: ParallelStyle) -> dict[str, Any]:
    """The arguments of ``style`` that differ from the defaults (still rebuilding it)."""
    cls = type(style)
    arguments = style_arguments(style)
    signature = inspect.signature(cls.__init__).parameters
    for name in list(arguments):
        if signature[name].default is inspect.Parameter.empty:
            continue  # required
        rest = {k: v for k, v in arguments.items() if k != name}
        try:
            rebuilt = cls(**rest)
        except (AssertionError, TypeError, ValueError):
            continue  # needed together with another argument
        if rebuilt == style:
            arguments = rest
    return arguments


# the arguments that hold placements (the others are bools, ints, strings and their tuples)
def _is_layouts(argument: str) -> bool:
    return argument.endswith("layouts")


def _encode(argument: str, value: Any) -> Any:
    if not _is_layouts(argument):
        return list(value) if isinstance(value, tuple) else value
    if isinstance(value, Placement):
        return placement_to_str(value)
    if isinstance(value, (tuple, list)):
        return [None if v is None else placement_to_str(v) for v in value]
    if isinstance(value, dict):
        return {k: placement_to_str(v) for k, v in value.items()}
    return value  # None


def _decode(argument: str, value: Any) -> Any:
    if not _is_layouts(argument):
        return tuple(value) if isinstance(value, list) else value
    try:
        if isinstance(value, str):
            return placement_from_str(value)
        if isinstance(value, list):
            return tuple(None if v is None else placement_from_str(v) for v in value)
        if isinstance(value, dict):
            return {k: placement_from_str(v) for k, v in value.items()}
    except (TypeError, ValueError) as err:
        raise type(err)(f"{argument}: {err}") from None
    if value is not None:
        raise TypeError(
            f"{argument} must be a placement string such as 'Shard(1)', a list of them, a dict "
            f"of them (keyword layouts) or null, found {type(value).__name__} "
            f"{short_repr(value)}"
        )
    return value


# how deep a style's data may nest (a list of layouts in a dict in a plan is 3 deep): a
# bound, so that a value nested a million deep (or holding itself) fails clearly, without
# exhausting the stack
MAX_DEPTH = 32


def _check_depth(value: Any, where: str) -> None:
    """Raise ``ValueError`` if lists and dicts in ``value`` nest deeper than ``MAX_DEPTH``.

    The walk is iterative, and stops at the first path that goes too deep.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            raise ValueError(
                f"{where}the style's data nests lists and dicts deeper than {MAX_DEPTH} "
                "levels; a style is a dict of arguments, each a name, number, placement "
                "string, or a flat list or dict of them"
            )
        stack.extend((child, depth + 1) for child in children)


def style_to_data(style: object, key: str | None = None) -> str | dict[str, Any]:
    """A style's name, or ``{"style": class name, **non-default arguments}``."""
    name = name_of(style)
    if name is not None:
        return name
    if not isinstance(style, ParallelStyle) or STYLE_REGISTRY.cls(type(style).__name__) is not type(
        style
    ):
        raise TypeError(
            f"{_where(key)}{short_repr(style)} has no plain-data form: only registered styles "
            f"(those declaring a contract: {_class_names()}) can be written as data"
        )
    arguments = {k: _encode(k, v) for k, v in _minimal_arguments(style).items()}
    return {"style": type(style).__name__, **arguments}


# what a plan value may be, for the error about one that is not
_PLAN_VALUE = (
    "a style name or a dict with a 'style' entry (a str such as 'colwise', or a dict naming "
    "a style class and its arguments such as {'style': 'RowwiseParallel', 'output_layouts': "
    "'Shard(1)'})"
)


def style_from_data(value: str | Mapping[str, Any], key: str | None = None) -> ParallelStyle:
    """The inverse of :func:`style_to_data`.

    The data is checked as strictly as a style object's arguments: flags must be ``bool``
    (``"false"`` is not false), placements must be strings that read as one, and every
    error names the plan key and the style, and shows a bounded prefix of the value.

    Raises:
        TypeError: ``value`` is neither a name nor a dict with a ``"style"`` entry naming a
            class, or an argument has the wrong type.
        ValueError: an unknown name or class, an unreadable placement, an argument out of
            range, or data nested deeper than ``MAX_DEPTH``.
        NotImplementedError: a transformers style name no torch_tp style expresses yet.
        AssertionError: layouts of different lengths (as the style objects raise).
    """
    if isinstance(value, str):
        return style_from_name(value, key)
    where = _where(key)
    if not isinstance(value, Mapping) or "style" not in value:
        raise TypeError(
            f"{where}expected {_PLAN_VALUE}, found {type(value).__name__} {short_repr(value)}"
        )
    _check_depth(value, where)
    arguments = dict(value)
    name = arguments.pop("style")
    if not isinstance(name, str):
        raise TypeError(
            f"{where}expected {_PLAN_VALUE}, found a 'style' entry that is a "
            f"{type(name).__name__}, {short_repr(name)}; the classes are {_class_names()}"
        )
    cls = STYLE_REGISTRY.cls(name)
    if cls is None:
        raise ValueError(
            f"{where}unknown style class {short_repr(name)}; expected one of {_class_names()}"
        )
    for argument in arguments:
        if not isinstance(argument, str):
            raise TypeError(
                f"{where}the arguments of {cls.__name__} are named by strings, found "
                f"{type(argument).__name__} {short_repr(argument)}"
            )
    try:
        return cls(**{k: _decode(k, v) for k, v in arguments.items()})
    except (TypeError, ValueError, AssertionError) as err:
        raise type(err)(
            f"{where}cannot build {cls.__name__} from {short_repr(value)}: {err}"
        ) from err


def _class_names() -> str:
    return ", ".join(cls.__name__ for cls in STYLE_REGISTRY.classes())


def describe(style: object) -> str:
    """A short form for tables: the name, else the call with its non-default arguments."""
    try:
        data = style_to_data(style)
    except TypeError:
        return repr(style)
    if isinstance(data, str):
        return f'"{data}"'
    arguments = dict(data)
    cls = arguments.pop("style")

    def show(value: Any) -> str:
        if isinstance(value, list):
            inner = ", ".join("None" if v is None else str(v) for v in value)
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in value.items()) + "}"
        return str(value)

    return f"{cls}(" + ", ".join(f"{k}={show(v)}" for k, v in arguments.items()) + ")"
