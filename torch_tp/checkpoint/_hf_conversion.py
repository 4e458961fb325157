"""Checkpoint layouts as transformers defines them, read a rank's slices at a time.

transformers 5.x loads a Hub checkpoint through the model's *conversion mapping*
(``transformers.conversion_mapping.get_model_conversion_mapping``): renamings of checkpoint
keys (``block_sparse_moe.`` to ``mlp.``, ``embed_out.`` to ``lm_head.``) and weight converters
whose operations turn several checkpoint tensors into one parameter or one into several
(``MergeModulelist`` stacks per-expert tensors, ``Concatenate`` joins gate and up, ``Chunk``
splits a fused tensor, ``Transpose``, ``Interleave``). :class:`CheckpointLayout` applies that
mapping with transformers' own objects to the checkpoint's *names and shapes* only: which
checkpoint keys hold each parameter, the shape each conversion produces (its operations run
on meta tensors), and every conversion that cannot be applied, before anything is read.

:meth:`CheckpointLayout.copy_to` then reads a rank's slices of a converted parameter without
reading the rest: the indices this rank holds along each dim of the parameter are pushed back
through the operations, last to first (a ``Concatenate`` splits them between its sources, a
``MergeModulelist`` turns the expert dim into a choice of checkpoint keys, a ``Chunk`` offsets
them, a ``Transpose`` swaps two dims, an ``Interleave`` maps them through the permutation
transformers' own operation applies to an ``arange``), so a rank reads exactly the elements
of its shard, and only the experts it holds. An operation without such a rule is applied as
transformers applies it, to whole tensors, by a rank that needs part of its result (a warning
names it).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

__all__: list[str] = []

# A region of the parameter and where it goes in the rank's buffer (see _staging.Piece).
_Piece = tuple[tuple[slice, ...], tuple[slice, ...]]
# One dim of a request: the indices wanted along a dim of the tensor at some stage of the
# conversion, the buffer dim they are copied to, and the positions there.
_Dim = tuple[Tensor, int, Tensor]
# Where a tensor sits at a stage of the conversion: its key, and its position in a list of
# tensors (the per-expert checkpoint tensors of one pattern) or None for a single tensor.
_Address = tuple[str, int | None]


@dataclass
class _Request:
    """The elements wanted from one tensor of the conversion: along each of its dims
    (``dims``), and the buffer positions already decided by a merge (``fixed``)."""

    dims: list[_Dim]
    fixed: dict[int, int] = field(default_factory=dict)


class _NoRule(Exception):
    """An operation whose slices cannot be pushed back to its inputs."""


@dataclass
class _Conversion:
    """A parameter made by a weight converter from checkpoint keys."""

    target: str  # the model's name
    converter: Any  # transformers' WeightConverter (a private copy)
    layer_name: str  # the group's name as transformers names it (its first target)
    output: str  # the key of ``target`` among the converter's outputs
    sources: dict[str, list[str]]  # source pattern -> checkpoint keys, in transformers' order
    stages: list[dict[str, Any]]  # the meta tensors before each operation, and after the last

    @property
    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]

    def describe(self, key: Callable[[str], str] = repr) -> str:
        keys = self.keys
        shown = ", ".join(map(key, keys[:4]))
        more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
        return f"{shown}{more} by {_converter_name(self.converter)}"


def _converter_name(converter: Any) -> str:
    ops = ", ".join(repr(op) for op in converter.operations)
    return (
        f"transformers' WeightConverter({converter.source_patterns} -> "
        f"{converter.target_patterns}, [{ops}])"
    )


def conversion_mapping(model: nn.Module) -> list[Any] | None:
    """transformers' conversion mapping for ``model``, or ``None`` for a model that is not a
    transformers ``PreTrainedModel`` (or without transformers installed)."""
    if not _is_transformers(model):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model)


class CheckpointLayout:
    """The model's parameters as a checkpoint's keys hold them, under ``mapping``.

    Args:
        model: the model (parallelized or not: only names and global shapes are used).
        targets: the model's state dict by single-device names (global shapes).
        shapes, dtypes: the checkpoint's keys, their shapes and dtypes (from the headers).
        mapping: transformers' conversion mapping for the model (``None``: names as they are).
        files: the file holding each key, to name it in errors.

    After construction, ``shapes``/``dtypes`` hold the checkpoint by the model's names (the
    converted shapes, or the checkpoint's key where no model name reads it, to be reported as
    unexpected), and ``errors`` every conversion that cannot be applied, by key and converter.
    """

    def __init__(
        self,
        model: nn.Module,
        targets: Mapping[str, Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, torch.dtype | str],
        mapping: list[Any] | None,
        files: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model
        self.mapping = mapping
        self._files = files or {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype | str] = {}
        self.errors: list[str] = []
        self.plain: dict[str, str] = {}  # model name -> checkpoint key
        self.converted: dict[str, _Conversion] = {}
        self._warned: set[str] = set()
        if not mapping:
            for key in shapes:
                self.plain[key] = key
            self.shapes, self.dtypes = dict(shapes), dict(dtypes)
            return
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
        # the routing transformers' convert_and_load_state_dict_in_model applies, on names
        for key in sorted(shapes, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, targets)
            if name not in targets and key in targets:  # a renaming that leaves the model
                name, pattern = rename_source_key(key, [], [], prefix, targets)
            if pattern is None:
                if name not in targets:  # read by nothing: unexpected, by its own name
                    name = key
                if name in self.plain:
                    self.errors.append(
                        f"{self._key(self.plain[name])} and {self._key(key)} are both read as "
                        f"{name!r}"
                    )
                    continue
                self.plain[name] = key
                self.shapes[name], self.dtypes[name] = tuple(shapes[key]), dtypes[key]
                continue
            converter, sources = groups.setdefault(name, (by_pattern[pattern], {}))
            sources.setdefault(pattern, []).append(key)
        for layer_name, (converter, sources) in groups.items():
            self._convert_meta(layer_name, copy.deepcopy(converter), sources, shapes, dtypes,
                               targets)  # fmt: skip

    def _convert_meta(
        self,
        layer_name: str,
        converter: Any,
        sources: dict[str, list[str]],
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, torch.dtype | str],
        targets: Mapping[str, Tensor],
    ) -> None:
        """Run the converter's operations on meta tensors: the shapes it makes, or why not."""
        keys = [key for group in sources.values() for key in group]
        shown = ", ".join(map(self._key, keys[:2])) + (
            f" and {len(keys) - 2} more" if len(keys) > 2 else ""
        )
        what = f"checkpoint key(s) {shown} by {_converter_name(converter)}"
        sources = {p: sources[p] for p in converter.source_patterns if p in sources}
        problem = (
            _numbering(sources)
            or _odd_one(keys, lambda k: str(dtypes[k]), "dtype", self._key)
            or next(
                (
                    found
                    for group in sources.values()
                    if (found := _odd_one(group, lambda k: list(shapes[k]), "shape", self._key))
                ),
                None,
            )
        )
        if problem:
            self.errors.append(f"cannot convert {what}: {problem}")
            return
        dtype = dtypes[keys[0]]
        stage = {
            p: [torch.empty(shapes[k], dtype=dtype, device="meta") for k in group]
            for p, group in sources.items()
        }
        try:
            stages = _forward(converter, stage, layer_name, self.model)
        except Exception as exc:  # noqa: BLE001 - transformers' ops raise various types
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.errors.append(f"cannot convert {what}: {message}")
            return
        outputs = _output_names(layer_name, stages[-1])
        if not any(name in targets for name in outputs.values()):
            for key in keys:  # read by nothing in the model: unexpected, by their own names
                self.shapes[key], self.dtypes[key] = tuple(shapes[key]), dtypes[key]
            return
        for output, name in outputs.items():
            value = stages[-1][output]
            value = value[0] if isinstance(value, list) else value
            self.converted[name] = _Conversion(name, converter, layer_name, output, sources, stages)
            self.shapes[name], self.dtypes[name] = tuple(value.shape), dtype

    def _key(self, key: str) -> str:
        return f"{key!r} ({self._files[key]})" if key in self._files else repr(key)

    def used(self) -> list[Any]:
        """The transforms that matched a checkpoint key (transformers keeps these as the
        model's ``_weight_conversions``, to revert them on save)."""
        return [t for t in self.mapping or [] if t.was_used()]

    def describe(self, name: str) -> str:
        """How ``name`` is read: its checkpoint key, or the keys and conversion."""
        if name in self.converted:
            return f"converted from {self.converted[name].describe(self._key)}"
        key = self.plain.get(name, name)
        if key != name:
            return f"checkpoint key {self._key(key)}"
        return f"in {self._files[key]}" if key in self._files else ""

    def copy_to(
        self,
        name: str,
        pieces: list[_Piece],
        dst: Tensor,
        read: Callable[[str, tuple[slice, ...]], Tensor],
    ) -> None:
        """``dst[mine] = name[whole]`` for each piece, reading with ``read(key, slices)``
        (``slices`` of the checkpoint tensor ``key``; ``()`` for all of it)."""
        conversion = self.converted[name]
        try:
            reads = [_pull(conversion, _request(piece, dst.shape)) for piece in pieces]
        except _NoRule as exc:
            self._convert_whole(conversion, pieces, dst, read, str(exc))
            return
        for per_key in reads:
            for (pattern, entry), request in per_key.items():
                key = conversion.sources[pattern][entry or 0]
                for region, at, order in _regions(request, dst.ndim):
                    dst[at].copy_(read(key, region).permute(order))

    def _convert_whole(
        self,
        conversion: _Conversion,
        pieces: list[_Piece],
        dst: Tensor,
        read: Callable[[str, tuple[slice, ...]], Tensor],
        why: str,
    ) -> None:
        """Apply the conversion as transformers does, to whole tensors, and copy the pieces."""
        if conversion.layer_name not in self._warned:
            self._warned.add(conversion.layer_name)
            warnings.warn(
                f"reading {conversion.target!r} ({conversion.describe(self._key)}) whole: "
                f"{why}; this rank reads every tensor it is made from, not only its slices",
                stacklevel=5,
            )
        stage = {p: [read(k, ()) for k in keys] for p, keys in conversion.sources.items()}
        result = _forward(conversion.converter, stage, conversion.layer_name, self.model)[-1]
        value = result[conversion.output]
        value = value[0] if isinstance(value, list) else value
        for whole, mine in pieces:
            dst[mine].copy_(value[whole])


def _numbering(sources: dict[str, list[str]]) -> str | None:
    """transformers stacks per-expert keys in the order it sorts them: check that they are
    numbered 0, 1, ... with none missing, so that position and number agree."""
    for pattern, keys in sources.items():
        if "*" not in pattern:
            continue
        shape = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        found = [shape.search(k) for k in keys]
        numbers = [int(m[1]) if m else None for m in found]
        if numbers != list(range(len(keys))) and None not in numbers:
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
            first = found[0]
            named = [
                repr(keys[0][: first.start(1)] + str(n) + keys[0][first.end(1) :])
                for n in missing[:4]
            ]
            return f"the {pattern!r} keys are numbered {numbers}, not 0 to {len(keys) - 1}" + (
                f": {', '.join(named)}{' and more' if len(missing) > 4 else ''} missing"
                if missing
                else ""
            )
    return None


def _odd_one(
    keys: list[str], value: Callable[[str], Any], what: str, name: Callable[[str], str]
) -> str | None:
    """The keys whose ``value`` differs from the most common one's, named, or ``None``.

    A dtype that is not a torch dtype (safetensors' ``F4``) is named even when alone."""
    if what == "dtype" and any(value(k).startswith("torch.") is False for k in keys):
        bad = [k for k in keys if not value(k).startswith("torch.")]
        return f"{name(bad[0])} has the dtype {value(bad[0])}, which cannot be loaded"
    counts: dict[str, int] = {}
    for key in keys:
        counts[repr(value(key))] = counts.get(repr(value(key)), 0) + 1
    if len(counts) == 1:
        return None
    common = max(counts, key=counts.__getitem__)
    odd = [k for k in keys if repr(value(k)) != common]
    return (
        f"the tensors it makes one parameter of must have one {what}: "
        + ", ".join(f"{name(k)} has {value(k)}" for k in odd[:4])
        + (f" and {len(odd) - 4} more differ" if len(odd) > 4 else "")
        + f", the others {common.strip(chr(39))}"
    )


def _forward(converter: Any, stage: dict[str, Any], layer_name: str, model: Any) -> list[dict]:
    """The converter's operations applied in turn, as transformers applies them: the input
    and the output of each (each operation gets its own copy of the dict it may empty)."""
    stages = [stage]
    config = getattr(model, "config", None)
    for op in converter.operations:
        given = {k: list(v) if isinstance(v, list) else v for k, v in stages[-1].items()}
        stages.append(
            op.convert(
                given,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=layer_name,
                model=model,
                config=config,
                missing_keys=None,
            )
        )
    return stages


def _output_names(layer_name: str, outputs: dict[str, Any]) -> dict[str, str]:
    """The model names of a converter's outputs: each output pattern with the prefix and the
    suffix of the group's name around it, as ``WeightConverter.convert`` names them."""
    full = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    for key in outputs:
        if key in full:
            before, _, after = full.partition(key)
            return {k: before + k + after for k in outputs}
    return {k: k for k in outputs}


def _request(piece: _Piece, shape: torch.Size) -> _Request:
    whole, mine = piece
    dims = []
    for d, (w, m) in enumerate(zip(whole, mine, strict=True)):
        start, stop, _ = m.indices(shape[d])
        dims.append((torch.arange(w.start, w.stop), d, torch.arange(start, stop)))
    return _Request(dims)


def _one(value: Any) -> Tensor:
    return value[0] if isinstance(value, list) else value


def _only_input(before: dict[str, Any], op: Any) -> _Address:
    """The input of an operation that reads one tensor (the first, if given a list)."""
    if len(before) != 1:
        raise _NoRule(f"{op!r} has {len(before)} inputs")
    ((key, value),) = before.items()
    return key, 0 if isinstance(value, list) else None


def _pull(conversion: _Conversion, request: _Request) -> dict[_Address, _Request]:
    """Push ``request`` on the converted parameter back to the checkpoint tensors: the
    elements of each that it needs, and where they go."""
    from transformers.core_model_loading import (
        Chunk,
        Concatenate,
        Interleave,
        MergeModulelist,
        Split,
        Transpose,
    )

    ops = conversion.converter.operations
    current: dict[_Address, _Request] = {(conversion.output, None): request}
    for i in reversed(range(len(ops))):
        op, before, after = ops[i], conversion.stages[i], conversion.stages[i + 1]
        pulled: dict[_Address, _Request] = {}
        for (key, entry), wanted in current.items():
            if entry is not None or isinstance(after[key], list):
                raise _NoRule(f"{op!r} gives a list of tensors")
            kind = type(op)
            if kind is MergeModulelist:
                source = key if len(before) > 1 else next(iter(before))
                if not isinstance(before[source], list):  # passed through
                    pulled[(source, None)] = wanted
                    continue
                dim = op.dim % after[key].ndim
                src, bdim, pos = wanted.dims[dim]
                rest = wanted.dims[:dim] + wanted.dims[dim + 1 :]
                for e, p in zip(src.tolist(), pos.tolist(), strict=True):
                    pulled[(source, e)] = _Request(rest, {**wanted.fixed, bdim: p})
            elif kind is Concatenate:
                dim = op.dim % after[key].ndim
                src, bdim, pos = wanted.dims[dim]
                offset = 0
                inputs = [
                    (p, e)
                    for p in conversion.converter.source_patterns
                    if p in before
                    for e in (range(len(before[p])) if isinstance(before[p], list) else [None])
                ]
                for p, e in inputs:
                    size = (before[p] if e is None else before[p][e]).shape[dim]
                    held = (src >= offset) & (src < offset + size)
                    if held.any():
                        dims = list(wanted.dims)
                        dims[dim] = (src[held] - offset, bdim, pos[held])
                        pulled[(p, e)] = _Request(dims, wanted.fixed)
                    offset += size
            elif kind in (Chunk, Split):
                dim = op.dim % after[key].ndim
                offset = 0
                for other, value in after.items():
                    if other == key:
                        break
                    offset += _one(value).shape[dim]
                src, bdim, pos = wanted.dims[dim]
                dims = list(wanted.dims)
                dims[dim] = (src + offset, bdim, pos)
                pulled[_only_input(before, op)] = _Request(dims, wanted.fixed)
            elif kind is Transpose:
                address = _only_input(before, op)
                source = before[address[0]]
                source = source[address[1]] if address[1] is not None else source
                dims = list(wanted.dims)
                if after[key] is not source:  # transposed (check_dims may leave it as it is)
                    a, b = op.dim0 % len(dims), op.dim1 % len(dims)
                    dims[a], dims[b] = dims[b], dims[a]
                pulled[address] = _Request(dims, wanted.fixed)
            elif kind is Interleave:
                dim = op.dim % after[key].ndim
                size = after[key].shape[dim]
                probe = torch.arange(size).reshape([1] * dim + [size])
                moved = op.convert({"probe": probe}, ["probe"], ["probe"])["probe"].flatten()
                src, bdim, pos = wanted.dims[dim]
                dims = list(wanted.dims)
                dims[dim] = (moved[src], bdim, pos)  # element i of the output is moved[i]
                pulled[_only_input(before, op)] = _Request(dims, wanted.fixed)
            else:
                raise _NoRule(f"torch_tp has no slice rule for {op!r}")
        current = pulled
    return current


def _runs(src: Tensor, pos: Tensor) -> list[tuple[slice, slice]]:
    """``src`` and ``pos`` as pairs of slices, each pair a stretch where both advance by a
    constant positive step (sorted by source first, so that reads go forward)."""
    if len(src) > 1:  # the common case, one stretch, found without a loop in Python
        step_s, step_p = src[1:] - src[:-1], pos[1:] - pos[:-1]
        if bool((step_s == step_s[0]).all() and (step_p == step_p[0]).all()):
            if step_s[0] > 0 and step_p[0] > 0:
                first, last = int(src[0]), int(src[-1])
                at, end = int(pos[0]), int(pos[-1])
                return [
                    (slice(first, last + 1, int(step_s[0])), slice(at, end + 1, int(step_p[0])))
                ]
    order = torch.argsort(src, stable=True)
    src, pos = src[order].tolist(), pos[order].tolist()
    out, i = [], 0
    while i < len(src):
        j = i + 1
        if j < len(src) and src[j] > src[i] and pos[j] > pos[i]:
            step_s, step_p = src[j] - src[i], pos[j] - pos[i]
            while (
                j + 1 < len(src) and src[j + 1] - src[j] == step_s and pos[j + 1] - pos[j] == step_p
            ):
                j += 1
            j += 1
        else:
            step_s = step_p = 1
        out.append((slice(src[i], src[j - 1] + 1, step_s), slice(pos[i], pos[j - 1] + 1, step_p)))
        i = j
    return out


def _regions(request: _Request, ndim: int):
    """The reads of one checkpoint tensor: its region, where in the buffer it goes, and the
    order of its dims there (a transposed tensor's dims are the buffer's in another order)."""
    per_dim = [[(s, bdim, p) for s, p in _runs(src, pos)] for src, bdim, pos in request.dims]
    bdims = [bdim for _, bdim, _ in request.dims]
    order = tuple(sorted(range(len(bdims)), key=bdims.__getitem__))
    for combo in itertools.product(*per_dim):
        at: list[Any] = [None] * ndim
        for bdim, p in request.fixed.items():
            at[bdim] = p
        for _, bdim, p in combo:
            at[bdim] = p
        yield tuple(s for s, _, _ in combo), tuple(at), order


def save_groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """The model's names grouped as transformers' reverse conversion converts them (a group's
    parameters make checkpoint keys together: Chunk's reverse concatenates two parameters),
    in the order of each group's first name; one name per group for a model transformers does
    not convert."""
    groups: dict[str, list[str]] = {}
    converters = _reverse_converters(model)
    if converters:
        from transformers.core_model_loading import apply_converters
    for name in names:
        key = name
        if converters:
            renamed, pattern = apply_converters(name, converters)
            key = renamed if pattern is not None else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


@contextlib.contextmanager
def conversions_chosen(model: nn.Module) -> Iterator[None]:
    """Within, ``model._weight_conversions`` holds the conversions transformers'
    ``revert_weight_conversion`` reverts, chosen once rather than at each call; the model is
    left as it was."""
    if not _is_transformers(model) or getattr(model, "_weight_conversions", None) is not None:
        yield
        return
    model._weight_conversions = _chosen_conversions(model)
    try:
        yield
    finally:
        del model._weight_conversions


def _chosen_conversions(model: nn.Module) -> list[Any]:
    """The conversions ``revert_weight_conversion`` reverts, chosen as it chooses them: those
    the load applied, else the model's mapping without legacy renamings and prefix changes."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is not None:
        return conversions
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    mapping = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in mapping if not isinstance(c, PrefixChange)]


def _is_transformers(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _reverse_converters(model: nn.Module) -> list[Any]:
    """The weight converters transformers' ``revert_weight_conversion`` applies on save."""
    if not _is_transformers(model):
        return []
    from transformers.core_model_loading import WeightConverter

    reverse = [c.reverse_transform() for c in _chosen_conversions(model)[::-1]]
    return [c for c in reverse if isinstance(c, WeightConverter)]


def revert(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the model's names) as transformers' ``save_pretrained`` writes it: its own
    ``revert_weight_conversion``, or ``state`` for a model it does not convert."""
    if not _is_transformers(model):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)
