"""Non-persistent buffers computed again from their module's configuration.

Non-persistent buffers (``register_buffer(..., persistent=False)``: rotary ``inv_freq``
tables, causal masks, position ids) are in no checkpoint: the module's constructor derives
them from its configuration. A model built on the meta device has none, and one given
memory by ``model.to_empty()`` has uninitialised memory in their place. Two callers need
them computed again, the same way:

* :func:`torch_tp.materialize` (``torch_tp/meta.py``) computes the ones on the meta device;
* the loaders of :mod:`torch_tp.checkpoint` compare every other one with its computed value
  (:func:`stale_buffers`): a load would otherwise give a model that came through
  ``to_empty()`` the checkpoint's weights and garbage rotary tables, with no error.

The nearest module owning a buffer (or an ancestor of it) that keeps its configuration as
``.config`` is constructed once more as ``type(owner)(owner.config)`` on the CPU, with its
parameters on the meta device (see :func:`_build`). Private: no public names.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from torch_tp import _torch_compat as compat

__all__: list[str] = []

# (owner, buffer name, dotted name in the model, the buffer, its value computed again)
_Computed = tuple[nn.Module, str, str, Tensor, Tensor]


def recompute(
    module: nn.Module, select: Callable[[Tensor], bool]
) -> tuple[list[_Computed], list[str]]:
    """Every non-persistent buffer of ``module`` that ``select`` picks, computed again on the
    CPU with the buffer's dtype; and, for each that cannot be, ``"'name' (Owner): why"``."""
    parents: dict[int, tuple[str, nn.Module] | None] = {id(module): None}
    for path, owner in module.named_modules():
        for _, child in owner.named_children():
            parents.setdefault(id(child), (path, owner))
    built: dict[tuple[type, int], nn.Module | Exception] = {}
    values, refused = [], []
    for path, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in compat.non_persistent_buffers(owner) or not select(buffer):
                continue  # a persistent buffer: a checkpoint fills it
            full_name = f"{path}.{name}" if path else name
            try:
                value = _recompute(owner, path, name, buffer, parents, built)
            except ValueError as exc:
                refused.append(f"{full_name!r} ({type(owner).__name__}): {exc}")
                continue
            values.append((owner, name, full_name, buffer, value))
    return values, refused


def stale_buffers(module: nn.Module, what: str) -> list[tuple[Tensor, Tensor]]:
    """The non-persistent buffers of ``module`` whose values are not what their modules
    compute from their configuration, each with its value computed again (on the buffer's
    device): what a loader copies in with the checkpoint (:func:`put_buffers`), after
    warning once, naming them.

    A buffer cannot be told uninitialised by its value; it can be told different from what
    its constructor computes. A floating-point buffer within a few units in the last place
    of that (computed on another device, say) is left alone. One that differs more came
    through ``to_empty()`` (or was changed on purpose: the warning says to set it again).
    Such a buffer is evidence that the model came through ``to_empty()``: then a
    non-persistent buffer that cannot be computed again (no owner with a ``config``, a
    DTensor buffer) holds uninitialised memory too, as far as anyone can tell, and the load
    is refused (``ValueError``, naming each, before anything changes). Without that
    evidence such buffers are left alone.
    """
    computed, refused = recompute(module, lambda buffer: not buffer.is_meta)
    stale = [
        (full, buffer, value) for _, _, full, buffer, value in computed if not _close(buffer, value)
    ]
    if not stale:
        return []
    names = ", ".join(repr(full) for full, _, _ in stale)
    if refused:
        raise ValueError(
            f"{what}: the non-persistent buffers {names} differ from what their modules "
            "compute from their config, as in a model built on the meta device and given "
            "memory by to_empty(), which leaves them uninitialised; these others cannot be "
            "computed again, so they are uninitialised too as far as anyone can tell: "
            + "; ".join(refused)
            + ". Nothing was read or changed. Give the model memory with "
            "torch_tp.materialize(model) instead of to_empty() (it computes them again, "
            "and refuses those it cannot compute), or give those buffers values first."
        )
    warnings.warn(
        f"{what}: the non-persistent buffers {names} differ from what their modules compute "
        "from their config, as in a model built on the meta device and given memory by "
        "to_empty(), which leaves them uninitialised: they are computed again, as "
        "torch_tp.materialize (the route to use instead of to_empty()) computes them. If "
        "you set them on purpose, set them again after loading.",
        stacklevel=3,
    )
    return [(buffer, value.to(device=buffer.device)) for _, buffer, value in stale]


def put_buffers(values: list[tuple[Tensor, Tensor]]) -> None:
    """Copy each value of :func:`stale_buffers` into its buffer (in place: a tensor that
    aliases the buffer sees it too)."""
    with torch.no_grad():
        for buffer, value in values:
            buffer.copy_(value)


def _close(buffer: Tensor, value: Tensor) -> bool:
    """Whether ``buffer`` holds ``value`` (floating point: within 4 units in the last place,
    relative to the largest magnitude, as a computation on another device may round)."""
    current = buffer.detach().cpu()
    if current.is_floating_point() or current.is_complex():
        eps = torch.finfo(current.dtype).eps
        scale = float(value.abs().max()) if value.numel() else 0.0
        return bool(torch.allclose(current, value, rtol=4 * eps, atol=4 * eps * scale))
    return torch.equal(current, value)


def _recompute(
    owner: nn.Module,
    path: str,
    name: str,
    buffer: Tensor,
    parents: dict[int, tuple[str, nn.Module] | None],
    built: dict[tuple[type, int], nn.Module | Exception],
) -> Tensor:
    if isinstance(buffer, DTensor):
        raise ValueError("a DTensor buffer: its sharding cannot be recomputed")
    # the nearest module, the owner or an ancestor, that keeps its configuration
    builder, builder_path, relative = owner, path, name
    while getattr(builder, "config", None) is None:
        parent = parents.get(id(builder))
        if parent is None:
            raise ValueError(
                "neither its module nor any module above it keeps a `config` to build it again from"
            )
        parent_path, parent_module = parent
        child_name = builder_path[len(parent_path) + 1 :] if parent_path else builder_path
        builder, builder_path, relative = parent_module, parent_path, f"{child_name}.{relative}"
    key = (type(builder), id(builder.config))
    if key not in built:
        built[key] = _build(type(builder), builder.config, empty_on_meta=True)
    fresh = built[key]
    if not isinstance(fresh, Exception) and _meta_or_missing(fresh, relative):
        # a buffer made from torch.empty: build it again with only the parameters on meta
        built[key] = fresh = _build(type(builder), builder.config, empty_on_meta=False)
    where = f"{type(builder).__name__}(config)"
    if isinstance(fresh, Exception):
        raise ValueError(f"building {where} again failed: {type(fresh).__name__}: {fresh}")
    try:
        value = fresh.get_buffer(relative)
    except AttributeError as exc:
        raise ValueError(f"{where} built again has no buffer {relative!r}") from exc
    if value is None or value.is_meta or tuple(value.shape) != tuple(buffer.shape):
        found = None if value is None else ("meta" if value.is_meta else list(value.shape))
        raise ValueError(
            f"{where} built again gives {relative!r} as {found}, not a tensor of shape "
            f"{list(buffer.shape)}"
        )
    return value.detach().to(dtype=buffer.dtype)


def _build(cls: type, config: object, *, empty_on_meta: bool) -> nn.Module | Exception:
    """``cls(config)`` on the CPU with its parameters on the meta device (and, with
    ``empty_on_meta``, every ``torch.empty`` result: parameters are made so, and never
    allocating them keeps a large freed block from changing how the allocator serves the
    loads that follow), under a forked RNG; or the exception it raised."""
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_parameters_on_meta())
            stack.enter_context(torch.device("cpu"))
            stack.enter_context(torch.random.fork_rng(devices=[]))
            if empty_on_meta:
                stack.enter_context(_EmptyOnMeta())
            return cls(config)
    except Exception as exc:  # noqa: BLE001 - reported with the buffer
        return exc


def _meta_or_missing(module: nn.Module, name: str) -> bool:
    try:
        value = module.get_buffer(name)
    except AttributeError:
        return False  # reported as missing by the caller
    return value is not None and value.is_meta


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` (how ``nn.Linear``, ``nn.Embedding`` and most modules allocate their
    parameters) gives meta tensors; everything else runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with every parameter moved to the meta device as it is registered,
    while buffers and everything else are computed for real (so a copy of a module costs
    its buffers and, for a moment, one parameter). Patches ``nn.Module.register_parameter``
    for the duration (every assignment of a parameter goes through it)."""
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original
