"""The dry-run report of a tensor-parallel plan: what it costs and what is wrong with it, before
anything runs.

:func:`plan_report` takes a model built on the meta device, a plan and a TP degree (or a
mesh's shape, ``{"ep": 2, "tp": 2}``, for a plan with styles on several dimensions), and needs
no process group and no memory for weights. It reports, per plan key, the parameters' global
and per-rank shapes and bytes; the collectives one training step (forward and backward of the
model) issues, by kind, count and bytes; and the problems a plan has: dimensions that do not
divide by the TP degree, ``nn.Linear``/``nn.Embedding`` layers left unsharded, and layouts that
do not chain from one module to the next.

How the collectives are predicted (:mod:`torch_tp.report.trace`): the *unparallelized*
model runs once on meta tensors, with hooks on the plan's modules and a
:class:`~torch.overrides.TorchFunctionMode` that follows every tensor between them. Each tensor
is given the form it would have in the parallelized model (a local tensor of a known layout,
or a DTensor), and each style's contract (:class:`torch_tp.contract.StyleContract`: the
layout an input arrives in and the one it is moved to, the layout an output is computed in
and handed on in, whether the receiver gets a local tensor, the partial gradients) says which
collective it issues in the forward and which its backward will issue. The tests compare the
predictions with measured runs: for instance the column-parallel layers that read one
replicated DTensor made by a ``PrepareModuleInput(use_local_output=False)`` share one backward
reduction, and the partial gradients of replicated parameters used on shards
(sequence-parallel norms, the bias of a row-parallel layer with a sharded output) are summed
by one coalesced all-reduce at the end of the backward. The result and its printed form are
in :mod:`torch_tp.report.render`.

Example::

    >>> import torch
    >>> from torch_tp.models import Llama, LlamaConfig
    >>> from torch_tp.plans.llama import llama_plan
    >>> from torch_tp.report import plan_report
    >>> with torch.device("meta"):
    ...     model = Llama(LlamaConfig(n_layers=2))
    >>> report = plan_report(model, llama_plan(), 2, batch_size=2, seq_len=16)
    >>> report.counts("forward")
    {'all_reduce': 5, 'all_gather_into_tensor': 1}
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Placement, Replicate, Shard

from torch_tp import _names
from torch_tp._torch_compat import StridedShard, tree_leaves
from torch_tp.plan import (
    PlanEntry,
    planned_placements,
    resolve_plan,
    styled_modules,
)
from torch_tp.plan_checks import (
    parameter_owners,
    refuse_multi_dimensional,
    tied_parameters,
    unsummed_gradients,
)
from torch_tp.report.adapters import adapter_layouts
from torch_tp.report.quality import Quality
from torch_tp.report.render import (
    SEVERITIES,
    ParameterGroup,
    PlanEntryRow,
    PlanReport,
    Problem,
    format_bytes,
    format_shape,
)
from torch_tp.report.trace import (
    DTensorNode,
    Trace,
    generalize_path,
    group_collectives,
    mesh_ndim,
    style_contract,
    style_dims,
    trace_backward,
    trace_forward,
)
from torch_tp.shapes import MeshOfSize, ShapeCheckError, check_shapes
from torch_tp.style import adapters as _adapters
from torch_tp.style.base import ParallelStyle, planning, short_repr

__all__ = ["plan_report"]

# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------


def plan_report(
    model: nn.Module,
    plan: ParallelStyle | Mapping[str, ParallelStyle | str],
    tp_degree: int | Mapping[str, int],
    *,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype | None = None,
    example_inputs: Any = None,
    device_type: str = "cuda",
    input_layout: Placement | None = None,
) -> PlanReport:
    """Report what ``plan`` would do to ``model`` at ``tp_degree``, without running it.

    No process group is needed: the unparallelized forward of ``model``, built on the meta
    device, runs once on meta tensors, and the model is left as it was. What the report holds,
    its options and N-D meshes: the guide's "The dry-run report" (``docs/plans.md``).

    Args:
        model (:class:`nn.Module`): the model, on the meta device.
        plan: the plan, as for :func:`torch_tp.parallelize_module` (styles or style names);
            on a mesh of several dimensions, one plan for all of them.
        tp_degree (int or Mapping[str, int]): the number of ranks each layer is split over,
            or the mesh's shape: its dimensions' names and sizes in the mesh's order, the
            last named ``"tp"``, each used by some style (``{"ep": 2, "tp": 2}``).

    Keyword Args:
        batch_size (int): the batch size the collectives are sized for (of one ``tp`` group).
        seq_len (int): the sequence length the collectives are sized for.
        dtype (:class:`torch.dtype`, optional): cast the floating-point parameters (of a
            copy) to this dtype first. Default: the model's own dtypes.
        example_inputs (optional): the forward's inputs on the meta device: a tensor, a tuple
            of positional inputs, a dict of keyword inputs, or a callable ``(batch_size,
            seq_len) -> inputs``. Default: token ids of shape ``(batch_size, seq_len)``.
        device_type (str, optional): the device the plan will run on; on ``"cpu"`` DTensor
            moves a shard with an all-gather (gloo has no all-to-all). Default: ``"cuda"``.
        input_layout (Placement, optional): the layout of the example inputs each rank gets
            as local tensors (``Shard(1)``: a sequence shard). Default: ``Replicate()``.

    Returns:
        A :class:`PlanReport` (``print(report)`` shows the tables) of one training step, the
        model's forward and backward, without the loss's own collectives.

    Raises:
        ValueError: the model is not on the meta device, ``tp_degree`` is neither positive nor a
            mesh shape as above with every dimension a style needs, or the plan is invalid (as
            in :func:`parallelize_module`; a key that matches no module is a reported problem).
        NotImplementedError: the plan names a style torch_tp does not have yet, or, with an
            int ``tp_degree``, a style on an N-D mesh or on a named dimension (``cp``).
        RuntimeError: the forward fails on the meta device.

    Example::
        >>> # xdoctest: +SKIP("prints a table")
        >>> from torch_tp import ExpertTensorParallel
        >>> from torch_tp.models import Llama, LlamaConfig, MoEConfig, MoELlama
        >>> from torch_tp.plans.llama import llama_plan
        >>> from torch_tp.plans.moe import moe_llama_plan
        >>> from torch_tp.report import plan_report
        >>> with torch.device("meta"):
        ...     model = Llama(LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8))
        >>> plan = llama_plan(sequence_parallel=True)
        >>> report = plan_report(model, plan, 8, batch_size=1, seq_len=4096)
        >>> print(report)
        >>> # experts over (ep, tp), the dense layers over tp
        >>> plan = moe_llama_plan(experts="tp")
        >>> plan["layers.*.feed_forward.experts"] = ExpertTensorParallel()
        >>> with torch.device("meta"):
        ...     model = MoELlama(MoEConfig())
        >>> report = plan_report(model, plan, {"ep": 2, "tp": 2}, batch_size=1, seq_len=64)
        >>> report.counts("forward", mesh_dim="ep")  # 2 layers x (counts, tokens out, back)
        {'all_to_all': 6}
    """
    mesh_shape = _mesh_shape(tp_degree)
    n = tp_degree if mesh_shape is None else mesh_shape.get("tp", 1)
    _refuse_off_meta(model)
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = resolve_plan(model, plan, strict=False)
    _check_mesh(entries, tp_degree, mesh_shape)
    # under context parallelism, each rank runs the whole model on its part of the sequence
    local_seq_len, split = _sequence_split(entries, mesh_shape, seq_len)
    keys = list(plan) if isinstance(plan, Mapping) else [""]
    matched = Counter(e.key for e in entries)
    problems = _unmatched_keys(keys, matched, caught)
    # as parallelize_module: the modules of the plan, and the adapters their styles host
    styled = styled_modules(entries)
    with planning(model, styled):  # styles that read the model's config find it
        invalid, refused = _validate(model, entries, n, mesh_shape)
    problems += refused
    valid = [e for e in entries if id(e.module) not in invalid]

    inputs = _inputs(example_inputs, batch_size, local_seq_len)
    trace = Trace(valid, n, cpu=device_type == "cpu", mesh_shape=mesh_shape)
    trace.watch_unplanned(model)
    trace.quality = Quality(model, _parameter_styles(valid), trace.is_shard)
    with torch.enable_grad(), planning(model, styled):
        refused_entries = [e for e in entries if id(e.module) in invalid]
        _train_step(model, trace, inputs, input_layout, refused_entries)

    parameters = _parameter_groups(model, valid, n, mesh_shape)
    problems += list(trace.problems.values())
    problems += _sequence_split_notes(split, trace)
    problems += _unsummed_gradients(valid, trace)
    problems += _divisibility(model, parameters, trace, n)
    problems += _unsharded(model, valid)
    problems += _own_code_problems(model, plan, valid, n, inputs, input_layout, problems)
    problems += [
        Problem("note", e.key, f"module {e.path!r} is not called by the forward")
        for e in valid
        if id(e.module) not in trace.called
    ]
    order = {severity: i for i, severity in enumerate(SEVERITIES)}
    problems.sort(key=lambda p: order[p.severity])

    styles = _names.resolve_names(plan) if isinstance(plan, Mapping) else {"": plan}
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return PlanReport(
        model=type(model).__name__,
        num_parameters=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        tp_degree=n,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=Counter(floating).most_common(1)[0][0] if floating else torch.get_default_dtype(),
        plan=[PlanEntryRow(key, _names.describe(styles[key]), matched[key]) for key in keys],
        parameters=parameters,
        collectives=group_collectives(trace.events),
        problems=problems,
        quality=trace.quality.result(),
        mesh_shape=mesh_shape,
        tokens_per_rank=local_seq_len if split else None,
        attention_activations=(
            (trace.attention_saved, trace.attention_saved * math.prod(split.values()))
            if split and trace.attention_calls
            else None
        ),
    )


def _refuse_off_meta(model: nn.Module) -> None:
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    not_meta = [name for name, t in tensors.items() if t.device.type != "meta"]
    if not_meta:
        raise ValueError(
            f"plan_report takes a model on the meta device; {not_meta[0]!r} is on "
            f"{tensors[not_meta[0]].device}. "
            'Build it under `with torch.device("meta"):`'
        )


def _check_mesh(
    entries: list[PlanEntry], tp_degree: int | Mapping[str, int], mesh_shape: dict | None
) -> None:
    """Refuse, with an int degree, styles that need more mesh than a TP degree says."""
    if mesh_shape is not None:
        _check_mesh_shape(entries, mesh_shape)
        return
    try:
        refuse_multi_dimensional(entries, "plan_report")
    except NotImplementedError as err:
        raise NotImplementedError(
            f"{err}; or give plan_report the mesh's shape as tp_degree, e.g. {{'ep': 2, 'tp': 2}}"
        ) from None
    named = [e for e in entries if getattr(style_contract(e), "mesh_dims", None) is not None]
    if named:
        dims = style_contract(named[0]).mesh_dims
        raise NotImplementedError(
            f"{_names.describe(named[0].style)} on {named[0].path!r} runs on the mesh "
            f"dimension(s) {list(dims)} beside tp: give plan_report the mesh's shape as "
            f"tp_degree, e.g. {dict.fromkeys(dims, 2) | {'tp': tp_degree}}, not the TP "
            f"degree {tp_degree}"
        )


def _unmatched_keys(
    keys: list[str], matched: Counter, caught: list[warnings.WarningMessage]
) -> list[Problem]:
    """The plan keys parallelize_module would refuse as matching nothing, all at once."""
    unmatched = [str(w.message) for w in caught if "matches no submodule" in str(w.message)]
    return [
        Problem("error", key, message.removesuffix("; skipping it (strict=False)"))
        for key in keys
        if not matched[key]
        # a key without entries matched nothing, or names parameters its module's style places
        for message in unmatched
        if message.startswith(f"parallelize_plan key {short_repr(key)} matches no submodule")
    ]


def _train_step(
    model: nn.Module,
    trace: Trace,
    inputs: Any,
    input_layout: Placement | None,
    refused_entries: list[PlanEntry],
) -> None:
    """Trace one forward, then the backward of a loss that takes the output as it is."""
    output = trace_forward(model, trace, inputs, input_layout, refused_entries)
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and isinstance(trace.states.get(id(t)), DTensorNode):
            node = trace.states[id(t)]
            node.grads.append(node.placement)
    trace_backward(trace)


def _own_code_problems(
    model: nn.Module,
    plan: Any,
    valid: list[PlanEntry],
    n: int,
    inputs: Any,
    input_layout: Placement | None,
    problems: list[Problem],
) -> list[Problem]:
    """What a rank's own code computes (the shape check), once the plan has no error of its
    own: a shape downstream of a layout that does not chain is that error again."""
    wide = [e for e in valid if mesh_ndim(e) > 1]
    if wide:
        return [
            Problem(
                "note",
                "",
                "the shape check (torch_tp.shapes.check_shapes) takes styles on one mesh "
                f"dimension only; it is not run for a plan with {_names.describe(wide[0].style)} "
                f"on {wide[0].key}: check it with torch_tp.testing.check_parity",
            )
        ]
    errors = any(p.severity == "error" for p in problems)
    if not errors and (input_layout is None or isinstance(input_layout, Replicate)):
        return _shape_problems(model, plan, n, inputs)
    return []


def _sequence_split(
    entries: list[PlanEntry], mesh_shape: Mapping[str, int] | None, seq_len: int
) -> tuple[int, dict[str, int]]:
    """The sequence length each rank runs the model on, and the mesh dimensions the plan's
    styles split the sequence over (context parallelism), with their sizes; ``seq_len``
    checked against each such style's chunks."""
    split: dict[str, int] = {}
    for entry in entries:
        chunks_of = getattr(entry.style, "_sequence_chunks", None)
        if chunks_of is None or mesh_shape is None:
            continue
        dim = style_dims(entry, mesh_shape)[0]
        size = mesh_shape[dim]
        chunks = chunks_of(size)
        if seq_len % chunks:
            raise ValueError(
                f"{_names.describe(entry.style)} on {entry.path!r} splits the sequence over "
                f"the {size} ranks of {dim!r} in {chunks} equal chunks, but seq_len={seq_len} "
                f"does not divide by {chunks} (seq_len % {chunks} = {seq_len % chunks}); use "
                f"a multiple of {chunks}, e.g. {math.ceil(seq_len / chunks) * chunks}"
            )
        split[dim] = size
    return seq_len // math.prod(split.values()), split


def _sequence_split_notes(split: dict[str, int], trace: Trace) -> list[Problem]:
    """What a report under context parallelism says once: what the numbers are per rank."""
    if not split:
        return []
    over = " x ".join(f"{dim} {size}" for dim, size in split.items())
    notes = [
        Problem(
            "note",
            "",
            f"the sequence is split over {over}: each rank runs the model on 1/"
            f"{math.prod(split.values())} of the tokens, and the collectives above are those "
            "of its tokens. Parameters are not sharded over "
            f"{', '.join(split)}: each rank holds them as above, and their gradients are "
            f"summed over {', '.join(split)} as over data parallelism (FSDP2 over it), which "
            "is not reported",
        )
    ]
    if not trace.attention_calls:
        notes.append(
            Problem(
                "note",
                "",
                "no F.scaled_dot_product_attention call was traced inside a context-parallel "
                "module: the ring's transfers are not reported (the run refuses such a "
                "module)",
            )
        )
    return notes


def _mesh_shape(tp_degree: Any) -> dict[str, int] | None:
    """``tp_degree`` checked: ``None`` for a positive int, else the mesh's shape as a dict."""
    if isinstance(tp_degree, Mapping):
        shape = dict(tp_degree)
        bad = [
            f"{dim!r}: {size!r}"
            for dim, size in shape.items()
            if not isinstance(dim, str) or not isinstance(size, int) or size < 1
        ]
        if not shape or bad:
            raise ValueError(
                "tp_degree, as a mesh's shape, maps dimension names to positive ints "
                f"({{'ep': 2, 'tp': 2}}), found {tp_degree!r}"
            )
        if "tp" in shape and list(shape)[-1] != "tp":
            raise ValueError(
                f"the mesh's shape {shape} must end with the dimension 'tp', the one the "
                "1-D styles of the plan run on (and the last of an N-D style's), as in "
                "{'ep': 2, 'tp': 2}"
            )
        return shape
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(
            f"tp_degree must be a positive int or a mesh's shape ({{'ep': 2, 'tp': 2}}), "
            f"found {tp_degree!r}"
        )
    return None


def _check_mesh_shape(entries: list[PlanEntry], shape: dict[str, int]) -> None:
    """Every style finds the dimensions it runs on (the mesh's last ``mesh_ndim``), and every
    dimension is used by some style."""
    dims = list(shape)
    if "tp" not in shape:
        tp_styles = [e for e in entries if getattr(style_contract(e), "mesh_dims", None) is None]
        if tp_styles:
            raise ValueError(
                f"the mesh's shape {shape} must end with the dimension 'tp', the one the "
                f"1-D styles of the plan run on ({_names.describe(tp_styles[0].style)} on "
                f"{tp_styles[0].path!r}), as in {dict(shape) | {'tp': 2}}"
            )
    missing = {
        dim: e
        for e in entries
        for dim in getattr(style_contract(e), "mesh_dims", None) or ()
        if dim not in shape
    }
    if missing:
        dim, e = next(iter(missing.items()))
        raise ValueError(
            f"the mesh's shape {shape} has no dimension {dim!r}, which "
            f"{_names.describe(e.style)} on {e.path!r} runs on: give its size too, e.g. "
            f"{dict.fromkeys(missing, 2) | shape}"
        )
    too_few = [
        f"{e.path!r} ({type(e.style).__name__}, on a {mesh_ndim(e)}-D mesh)"
        for e in entries
        if mesh_ndim(e) > len(dims)
    ]
    if too_few:
        raise ValueError(
            f"the mesh's shape {shape} has {len(dims)} dimension(s), but the plan puts "
            f"{', '.join(too_few)}: give the dimensions it runs on too, e.g. "
            f"{dict(**{'ep': 2}, **shape) if len(dims) == 1 else shape}"
        )
    used = {dim for e in entries for dim in style_dims(e, shape)} or {dims[-1]}
    unused = [dim for dim in dims if dim not in used]
    if unused:
        raise ValueError(
            f"no style of the plan runs on the dimension(s) {unused} of the mesh's shape "
            f"{shape}: each style runs on the mesh's last dimensions, as many as its "
            "contract's mesh_ndim, and data parallelism is not reported; leave them out: "
            f"{ {dim: size for dim, size in shape.items() if dim in used} }"
        )


class _MeshOfShape:
    """What an N-D style's ``_validate`` may ask of the mesh, with no process group: its
    dimensions' names and sizes (a dimension, by name, is a :class:`MeshOfSize`)."""

    def __init__(self, shape: Mapping[str, int]) -> None:
        self.shape = dict(shape)
        self.ndim = len(self.shape)
        self.mesh_dim_names = tuple(self.shape)

    def size(self, mesh_dim: int | None = None) -> int:
        if mesh_dim is None:
            return math.prod(self.shape.values())
        return list(self.shape.values())[mesh_dim]

    def __getitem__(self, dim: str) -> MeshOfSize:
        return MeshOfSize(self.shape[dim])


def _shape_problems(model: nn.Module, plan: Any, n: int, inputs: tuple[tuple, dict]):
    """The shape check's problems (:func:`torch_tp.shapes.check_shapes`): a rank's
    shape that is not one device's with the planned dimension divided, or a rank's forward
    that raises, as errors; a model the check cannot trace, as a note saying why."""
    try:
        found = check_shapes(model, plan, n, example_inputs=inputs[0], example_kwargs=inputs[1])
    except ShapeCheckError as err:
        return [Problem("note", "", str(err))]
    except ValueError:  # the plan does not apply: the problems above say why
        return []
    return [Problem("error", generalize_path(p.module), str(p)) for p in found]


def _inputs(example_inputs: Any, batch_size: int, seq_len: int) -> tuple[tuple, dict]:
    """The forward's positional and keyword inputs."""
    if example_inputs is None:
        return (torch.zeros((batch_size, seq_len), dtype=torch.long, device="meta"),), {}
    if callable(example_inputs):
        with torch.device("meta"):
            example_inputs = example_inputs(batch_size, seq_len)
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)), {}


def _validate(
    model: nn.Module,
    entries: list[PlanEntry],
    n: int,
    mesh_shape: Mapping[str, int] | None = None,
) -> tuple[set[int], list[Problem]]:
    """The checks of :func:`torch_tp.plan_checks.validate_plan` that need no mesh: the modules
    refused, and why."""
    invalid: set[int] = set()
    problems = []
    owners = parameter_owners(model)
    by_path = {entry.path: entry for entry in entries}
    for entry in entries:
        tied = tied_parameters(entry, owners, by_path)
        if tied is not None:
            invalid.add(id(entry.module))
            problems.append(Problem("error", entry.key, tied))
        validate = getattr(entry.style, "_validate", None)
        if id(entry.module) in invalid:
            continue
        if validate is None:
            validate = _accept
        try:
            if mesh_ndim(entry) == 1:
                dims = style_dims(entry, mesh_shape) if mesh_shape is not None else ["tp"]
                mesh: Any = MeshOfSize(mesh_shape[dims[0]] if mesh_shape is not None else n)
            else:
                mesh = _MeshOfShape({d: mesh_shape[d] for d in style_dims(entry, mesh_shape)})
            if entry.adapters is not None:  # PEFT's layer on it, as validate_plan checks it
                _adapters.check(entry.style, entry.adapters, entry.module)
            validate(entry.module, mesh)
        except (NotImplementedError, ValueError, TypeError) as err:
            invalid.add(id(entry.module))
            problems.append(
                Problem(
                    "error",
                    entry.key,
                    f"cannot apply {_names.describe(entry.style)} on {entry.path!r} "
                    f"({type(entry.module).__name__}): {err}",
                )
            )
        except Exception:  # noqa: BLE001 - a user style that needs a real mesh
            pass
    return invalid, problems


def _accept(module: nn.Module, mesh: Any) -> None:
    """The check of a style that has none."""


def _unsummed_gradients(entries: list[PlanEntry], trace: Trace) -> list[Problem]:
    """What :func:`torch_tp.plan_checks.validate_plan` refuses as replicated parameters left with
    partial gradients (:func:`~torch_tp.plan_checks.unsummed_gradients`), where the trace did
    not already find those parameters computing on a shard (it says more: the op and where
    the shard came from)."""
    problems: dict[str, Problem] = {}
    for entry, names, message in unsummed_gradients(entries):
        if any(_join(entry.path, name) in trace.partial_found for name in names):
            continue
        problems.setdefault(entry.key, Problem("error", entry.key, message))
    return list(problems.values())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _placements(entry: PlanEntry) -> dict[str, Placement]:
    """How the entry's style lays out its module's own parameters (none: left plain)."""
    placements = planned_placements(entry)
    return {
        name: placements[name]
        for name, _ in entry.module.named_parameters(recurse=False)
        if name in placements
    }


def _parameter_styles(entries: list[PlanEntry]) -> dict[int, tuple[str, Placement, str]]:
    """By ``id``, each parameter the plan's styles lay out: its path, its placement, and
    the style (its short form)."""
    found = {}
    for entry in entries:
        for name, placement in planned_placements(entry).items():
            try:  # a dotted name: a parameter of a submodule the style computes with
                param = entry.module.get_parameter(name)
            except AttributeError:
                continue
            path = generalize_path(_join(entry.path, name))
            found[id(param)] = (path, placement, _names.describe(entry.style))
    return found


def _largest_shard(shape: tuple[int, ...], placement: Any, n: int | tuple[int, ...]):
    """The largest shard of ``shape`` laid out ``placement`` (a tuple of them on an N-D mesh
    of sizes ``n``, each splitting what the ones before left)."""
    if isinstance(placement, tuple):
        for one, size in zip(placement, n, strict=True):
            shape = _largest_shard(shape, one, size)
        return shape
    if not isinstance(placement, (Shard, StridedShard)):
        return shape
    local = list(shape)
    local[placement.dim] = math.ceil(shape[placement.dim] / n)
    return tuple(local)


def _placement_str(placement: Any) -> str:
    if isinstance(placement, tuple):
        return f"({', '.join(_names.placement_to_str(p) for p in placement)})"
    return _names.placement_to_str(placement)


def _parameter_groups(
    model: nn.Module,
    entries: list[PlanEntry],
    n: int,
    mesh_shape: Mapping[str, int] | None = None,
):
    entry_of = {id(e.module): e for e in entries}
    # a hosted PEFT layer's factors (lora_A, lora_B), laid out by its base layer's style
    adapter_of = {
        id(part): (entry, placements)
        for entry in entries
        for part, placements in adapter_layouts(entry).items()
    }
    groups: Counter[tuple] = Counter()
    seen: set[int] = set()
    for path, module in model.named_modules():
        entry = entry_of.get(id(module))
        placements = _placements(entry) if entry is not None else {}
        adapter = adapter_of.get(id(module))
        if adapter is not None:
            entry, placements = adapter
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            placement = placements.get(name)
            if adapter is not None:  # model.layers.*.self_attn.q_proj.lora_A.default.weight
                full = generalize_path(f"{path}.{name}")
            elif entry is not None:
                full = f"{entry.key}.{name}" if entry.key else name
            else:
                full = generalize_path(f"{path}.{name}" if path else name)
            shape = tuple(param.shape)
            if entry is not None and mesh_ndim(entry) > 1:
                sizes: Any = tuple(mesh_shape[d] for d in style_dims(entry, mesh_shape))
            else:
                sizes = n
            key = (
                full,
                _placement_str(placement) if placement is not None else None,
                shape,
                _largest_shard(shape, placement, sizes),
                param.element_size(),
                adapter is not None,
            )
            groups[key] += 1
    return [
        ParameterGroup(name, count, placement, shape, local, itemsize, adapter)
        for (name, placement, shape, local, itemsize, adapter), count in groups.items()
    ]


def _divisibility(
    model: nn.Module,
    parameters: list[ParameterGroup],
    trace: Trace,
    n: int,
) -> list[Problem]:
    problems = []
    for key, (heads, head_dim) in trace.heads.items():
        if heads % n:
            fits = [d for d in range(1, n + 1) if heads % d == 0]
            problems.append(
                Problem(
                    "error",
                    key,
                    f"its output is viewed as {heads} heads of {head_dim}, and {heads} heads "
                    f"do not divide by the TP degree {n}: a rank would hold part of a head. "
                    f"Use a TP degree that divides {heads}, such as {fits[-1]}",
                )
            )
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for group in parameters:
        if group.placement is None or not group.placement.startswith("Shard"):
            continue
        dim = _names.placement_from_str(group.placement).dim
        size = group.global_shape[dim]
        key = group.name.rpartition(".")[0]
        if size % n == 0 or key in trace.heads:
            continue
        what = "the vocabulary" if size in vocab else f"dim {dim}"
        chunk = math.ceil(size / n)
        empty = n - math.ceil(size / chunk) if chunk else n
        emptiness = f"; {empty} rank(s) hold nothing" if empty > 0 else ""
        problems.append(
            Problem(
                "warning",
                group.name,
                f"{what} ({size}) does not divide by the TP degree {n}: shards of "
                f"{chunk} and fewer (torch.chunk){emptiness}; the largest is reported. "
                f"Pad it to {chunk * n} for even shards",
            )
        )
    return problems


def _unsharded(model: nn.Module, entries: list[PlanEntry]) -> list[Problem]:
    sharded = {
        id(e.module)
        for e in entries
        if any(isinstance(p, (Shard, StridedShard)) for p in _placements(e).values())
    }
    # a hosted PEFT layer's factors: laid out with their base layer (lora_A whole by design)
    sharded |= {id(part) for e in entries for part in adapter_layouts(e)}
    groups: dict[str, list[int]] = {}
    shapes: dict[str, str] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or id(module) in sharded:
            continue
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        name = generalize_path(path)
        groups.setdefault(name, []).append(sum(p.numel() * p.element_size() for p in params))
        weight = module.weight
        shapes[name] = f"{type(module).__name__} {format_shape(tuple(weight.shape))}"
    return [
        Problem(
            "note",
            name,
            f"{shapes[name]} is not sharded: every rank holds all of it "
            f"({len(sizes)} x {format_bytes(sizes[0])})"
            if len(sizes) > 1
            else f"{shapes[name]} is not sharded: every rank holds all of it "
            f"({format_bytes(sizes[0])})",
        )
        for name, sizes in groups.items()
    ]
