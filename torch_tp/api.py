"""``parallelize_module``: resolve a plan, check all of it, then apply it."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torch_tp import _forward_errors, _state_dict, runtime
from torch_tp import _torch_compat as compat
from torch_tp._forward_check import disable_overlapping_checks, forward_check
from torch_tp.plan import is_style, mark_applied, resolve_plan, styled_modules
from torch_tp.plan_checks import validate_plan
from torch_tp.random import _ensure_tracker
from torch_tp.shapes import check_shapes
from torch_tp.style import adapters as _adapters
from torch_tp.style.base import ParallelStyle, planning

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
    strict: bool = True,
    example_inputs: Any = None,
    check_forward: bool = True,
) -> nn.Module:
    """Apply tensor parallelism to ``module`` and its submodules according to a plan.

    The plan is one :class:`ParallelStyle`, applied to ``module`` itself, or a dict from
    module paths (dotted, :mod:`fnmatch` wildcards per segment, ``""`` for ``module``) to
    styles or style names (:mod:`torch_tp.plan`). All of it is checked before the first
    module changes: after an error the model is as it was. See the guide's "Plans" and
    "Strict plans and the errors you can get" (docs/guide.md).

    Args:
        module (:class:`nn.Module`): the module to parallelize, in place.
        device_mesh (:class:`DeviceMesh`, optional): the 1-D tensor-parallel mesh (of an N-D
            mesh, ``mesh["tp"]``), or a named N-D mesh for a plan with a style on dimensions of
            its own (:class:`ExpertTensorParallel`, :class:`ContextParallel`: the guide's
            "Device meshes"). If not given, the call must be inside ``with device_mesh:``.
        parallelize_plan (Union[:class:`ParallelStyle`, Dict[str, :class:`ParallelStyle`]],
            optional): the plan. If not given, nothing happens (with a warning).

    Keyword Args:
        src_data_rank (int, optional): the rank whose values are scattered or broadcast when
            parameters become DTensors; ``None`` keeps each rank's own values and skips that
            communication (the guide's "src_data_rank"). Default: 0.
        strict (bool, optional): raise ``ValueError`` for a plan key that matches no
            submodule and for a style that would untie a tied weight; ``False`` warns, skips
            such keys and unties such weights, as upstream (the guide's "strict=False").
            Default: ``True``.
        example_inputs (optional): inputs of ``module``'s forward (a tensor, a tuple of
            positional or a dict of keyword inputs; only shapes and dtypes are used): the
            plan is checked by :func:`torch_tp.shapes.check_shapes` before anything changes.
            Default: ``None`` (only the first forward is checked: ``check_forward``).
        check_forward (bool, optional): shape-check the first call of the returned module
            with each new input signature before it runs, refusing a plan under which a rank
            computes another shape than one device (what it costs and skips: the guide's
            "Shape checks"; ``TORCH_TP_FORWARD_CHECK=0`` turns it off). Default: ``True``.

    Returns:
        The parallelized :class:`nn.Module` (``module`` itself, or what a single style's
        ``_apply`` returns).

    Raises:
        TypeError: the plan is not a style or a dict, or a plan value is not a style.
        ValueError: a key matches no submodule or a tied weight would come apart (when
            ``strict``), two keys match one module, a module was parallelized before, a
            style name is unknown, the mesh is not 1-D (for a style that is not N-D, or
            unnamed), ``TORCH_TP_RUNTIME`` (read once per call: the guide's "Runtimes")
            names no runtime, or (with ``example_inputs``) the shape check finds a problem
            (the message names each module, source line, op and both shapes).
        ShapeCheckError: (with ``example_inputs``) the forward cannot be traced on the meta
            device; the message says where and why.
        NotImplementedError: a style does not support the type of the module it names, a
            style name has no torch_tp style yet, or ``example_inputs`` are given for a plan
            on an N-D mesh (the shape check reads 1-D styles).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, ColwiseParallel, RowwiseParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # with "w1" and "w2" nn.Linear submodules
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> m = parallelize_module(m, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    """
    compat.log_api_usage_once("torch_tp.parallelize_module")
    device_mesh = _resolve_mesh(device_mesh)
    if parallelize_plan is None:
        warnings.warn(
            "No parallelize_plan is provided, so this parallelize_module call does nothing.",
            stacklevel=2,
        )
        return module

    entries = resolve_plan(module, parallelize_plan, strict=strict)
    meshes = _entry_meshes(entries, device_mesh)
    # styles that read the model's config find it; a partial-sum region, the modules the
    # plan gives a style (and the adapters of PEFT's layers, which their base's style hosts)
    styled = styled_modules(entries)
    with planning(module, styled):
        validate_plan(entries, meshes, module, strict=strict)
    runtime.runtime_mode()  # an unknown TORCH_TP_RUNTIME fails before anything changes
    if example_inputs is not None:
        if device_mesh.ndim != 1:
            raise NotImplementedError(
                "the shape check (example_inputs) takes plans on a 1-D mesh; this plan is on "
                f"a {device_mesh.ndim}-D mesh: leave example_inputs out and check it with "
                "torch_tp.testing.check_parity"
            )
        _check_shapes(module, parallelize_plan, device_mesh.size(), example_inputs)
    # a meta copy of the model as it is now, traced at the first forward (None: not checked)
    disable_overlapping_checks(module)
    check = (
        forward_check(module, parallelize_plan, entries, device_mesh.size())
        if check_forward and device_mesh.ndim == 1
        else None
    )
    # dropout in a fork() region works out of the box; this never reseeds the default stream
    # (on an N-D mesh, its last dimension: each expert's matrices are split over it)
    _ensure_tracker(device_mesh if device_mesh.ndim == 1 else _last_dim(device_mesh))

    # PEFT may wrap a layer of this plan later (get_peft_model after parallelize_module)
    _adapters.install()
    result = module
    # every style of this call gets the runtime TORCH_TP_RUNTIME selects now
    with runtime.applying(), planning(module, styled):
        for entry, mesh in zip(entries, meshes, strict=True):
            entry.style.src_data_rank = src_data_rank
            applied = entry.style._apply(entry.module, mesh)
            if entry.adapters is not None:  # PEFT's LoRA on it (torch_tp.style.adapters)
                entry.style._host_adapters(entry.adapters, entry.module, mesh)
            mark_applied(entry)
            if is_style(parallelize_plan):
                result = applied
    returned = result if isinstance(result, nn.Module) else module
    # an exception escaping the forward names the module, its style and the layouts
    _forward_errors.install(returned, entries, device_mesh.size(device_mesh.ndim - 1))
    if check is not None:
        check.install(returned)
    # model.load_state_dict(torch.load(...)) takes the single-device state dict
    for sub in module.modules():
        _state_dict.accept_full_tensors(sub)
    return result


def _check_shapes(module: nn.Module, plan: Any, degree: int, example_inputs: Any) -> None:
    """Refuse a plan under which a rank computes a shape one device would not."""
    problems = check_shapes(module, plan, degree, example_inputs=example_inputs)
    if problems:
        listed = "\n".join(f"  {problem}" for problem in problems)
        raise ValueError(
            f"the plan's shape check failed at {degree} ranks (nothing was changed):\n{listed}"
        )


_HOW_TO_START = (
    "start one process per rank with `torchrun --nproc-per-node N your_script.py` (or, in "
    "a test, run a function on every rank with torch_tp.testing.run_distributed), then "
    "build the mesh in each: mesh = init_device_mesh(device_type, (N,)) and pass it, or "
    "call parallelize_module inside `with mesh:`"
)


def _resolve_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    if device_mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "parallelize_module needs a DeviceMesh: none was passed, and no process "
                f"group is running (this process was not started as one of several ranks): "
                f"{_HOW_TO_START}"
            )
        try:
            device_mesh = compat.current_mesh()
        except RuntimeError as err:  # torch: "No device mesh is currently active!"
            raise RuntimeError(
                "parallelize_module needs a DeviceMesh: none was passed and no `with mesh:` "
                f"block is active; {_HOW_TO_START}"
            ) from err
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, found {type(device_mesh)}")
    return device_mesh


def _entry_meshes(entries: list, device_mesh: DeviceMesh) -> list[DeviceMesh]:
    """The mesh each entry's style is applied on: ``device_mesh`` itself when it is 1-D, or
    when every style takes a mesh of its dimensions (:class:`~torch_tp.ExpertTensorParallel`
    on ``(ep, tp)``); on an N-D mesh with a plan that has a style naming its own dimensions
    or taking fewer than all of them, each style's dimensions of it (its contract's
    ``mesh_dims``, or else the mesh's last ``mesh_ndim``: the 1-D tensor-parallel styles on
    the last, ``tp``). A plan of 1-D styles alone takes a 1-D mesh."""
    contracts = [getattr(e.style, "contract", None) for e in entries]
    ndims = [getattr(c, "mesh_ndim", 1) for c in contracts]
    named = [getattr(c, "mesh_dims", None) for c in contracts]
    own = [n > 1 or dims is not None for n, dims in zip(ndims, named, strict=True)]
    if device_mesh.ndim == 1:
        if any(own) and not all(own):  # e.g. ContextParallel with tensor-parallel styles
            mixed = next(e for e, o in zip(entries, own, strict=True) if o)
            raise ValueError(
                f"{type(mixed.style).__name__} on {mixed.path or '<root>'!r} runs on a mesh "
                "dimension of its own, beside the plan's tensor-parallel styles: pass the mesh "
                'with both dimensions (e.g. mesh_dim_names=("cp", "tp")), not a 1-D mesh'
            )
        return [device_mesh] * len(entries)
    if not entries or not any(own):
        raise ValueError(
            f"parallelize_module takes a 1-D tensor-parallel mesh, found {device_mesh.ndim}-D "
            f"mesh with dims {device_mesh.mesh_dim_names}: pass its tensor-parallel dimension, "
            'e.g. mesh["tp"]'
            + (
                " (only a plan with styles that take their own dimensions, such as "
                "ExpertTensorParallel on (ep, tp) or ContextParallel on cp, takes it)"
                if entries
                else ""
            )
        )
    names = device_mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"a {device_mesh.ndim}-D mesh must name its dimensions, e.g. "
            'init_device_mesh(device, (ep, tp), mesh_dim_names=("ep", "tp"))'
        )
    if all(n == device_mesh.ndim and dims is None for n, dims in zip(ndims, named, strict=True)):
        return [device_mesh] * len(entries)
    meshes = []
    for entry, n, dims in zip(entries, ndims, named, strict=True):
        where = f"{type(entry.style).__name__} on {entry.path or '<root>'!r}"
        if dims is None:
            if n > len(names):
                raise ValueError(f"{where} takes a {n}-D mesh; the mesh has dims {names}")
            dims = names[-n:]
            if n == 1 and dims[0] != "tp":
                raise ValueError(
                    f"{where}: the tensor-parallel styles of a plan on a mesh of several "
                    f"dimensions run on its last, which must be named 'tp'; the mesh has dims "
                    f"{names}"
                )
        missing = [d for d in dims if d not in names]
        if missing:
            raise ValueError(
                f"{where} runs on the mesh dimension(s) {tuple(dims)}; the mesh has dims "
                f"{names}, without {missing}"
            )
        meshes.append(device_mesh[dims[0]] if len(dims) == 1 else device_mesh[tuple(dims)])
    return meshes


def _last_dim(device_mesh: DeviceMesh) -> DeviceMesh:
    return device_mesh[device_mesh.mesh_dim_names[-1]]
