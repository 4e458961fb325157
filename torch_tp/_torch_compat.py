"""Every private torch API torch_tp uses, in one place.

A private torch name is anything reached through a ``_``-prefixed module or attribute of
torch. torch_tp uses a few, each because no public API does the same at the same cost; they
may move between releases, so every use goes through this module (``test/test_torch_compat.py``
fails on one anywhere else), and a release that moves one breaks this file only. Each entry
says what it is, why it is used, and where it falls back.

Checked on torch 2.13.0 (the pinned CPU build) and 2.15.0 (the newest release): CI runs the
whole test suite on both. ``SUPPORTED`` is the range ``setup.py`` declares; importing
torch_tp with a torch outside it warns. Every entry is at the same place in both releases
unless the table says otherwise:

==========================================  ==================================================
torch_tp name                               torch's (2.13.0 and 2.15.0)
==========================================  ==================================================
``StridedShard``                            ``torch.distributed.tensor.placement_types.``
                                            ``_StridedShard``
``DTensorSpec``, ``TensorMeta``             ``torch.distributed.tensor._dtensor_spec``
``compute_local_shape_and_global_offset``   ``torch.distributed.tensor._utils``
``local_tensor``, ``dtensor_spec``          ``DTensor._local_tensor``, ``DTensor._spec``
``dtensor_from_spec``                       ``torch.Tensor._dtensor__new__`` (falls back to
                                            ``DTensor(...)``)
``shard_split_tensor``                      ``Shard._split_tensor`` (``_StridedShard``'s too)
``current_mesh``                            ``torch.distributed.device_mesh._mesh_resources``
``process_groups``                          ``torch.distributed.distributed_c10d._world``
``without_global_module_hooks``             ``torch.nn.modules.module._global_*`` (the hooks
                                            of ``register_module_forward_hook`` and kin)
``current_graph_task_id``                   ``torch._C._current_graph_task_id``
``queue_callback``                          ``Variable._execution_engine.queue_callback``;
                                            public from 2.15 (``torch.autograd.graph``), used
                                            where it exists
``version``                                 ``torch.Tensor._version``
``sole_owner``                              ``torch._C._storage_Use_Count``
``IncompatibleKeys``                        ``torch.nn.modules.module._IncompatibleKeys``
``direct_parameters``,                      ``nn.Module._parameters``
``swap_direct_parameters``
``direct_children``,                        ``nn.Module._modules``
``copy_with_children``
``non_persistent_buffers``                  ``nn.Module._non_persistent_buffers_set``
``COMPILED_MODULE_NAME``                    ``OptimizedModule._orig_mod`` (``torch.compile``)
``log_api_usage_once``                      ``torch._C._log_api_usage_once``
``tree_leaves``                             ``torch.utils._pytree.tree_leaves``
``nested_tensor_from_mask_left_aligned``    ``torch._nested_tensor_from_mask_left_aligned``
``functional_collectives``                  ``torch.distributed._functional_collectives``
``legacy_reduction``                        ``torch.nn._reduction.legacy_get_string``
``foreach_mul_``                            ``torch._foreach_mul_``
``lazy_init``                               ``init()`` of the device module where it has one
                                            (public), else its ``_lazy_init``
``enabled_local_tensor_mode``,              ``torch.distributed._local_tensor`` (all of
``per_rank_rng_states``, ``per_rank_ints``  LocalTensorMode is private)
``recomputed_in_backward``                  ``torch.distributed._composable.checkpoint``'s
                                            state, ``CheckpointWrapper`` of
                                            ``torch.distributed.algorithms._checkpoint``
==========================================  ==================================================
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

__all__ = [
    "COMPILED_MODULE_NAME",
    "DTensorSpec",
    "IncompatibleKeys",
    "SUPPORTED",
    "StridedShard",
    "TORCH_VERSION",
    "TensorMeta",
    "check_version",
    "compute_local_shape_and_global_offset",
    "current_graph_task_id",
    "current_mesh",
    "copy_with_children",
    "direct_children",
    "direct_parameters",
    "dtensor_from_spec",
    "dtensor_spec",
    "enabled_local_tensor_mode",
    "foreach_mul_",
    "functional_collectives",
    "lazy_init",
    "legacy_reduction",
    "local_tensor",
    "log_api_usage_once",
    "nested_tensor_from_mask_left_aligned",
    "non_persistent_buffers",
    "own_alias",
    "per_rank_ints",
    "per_rank_rng_states",
    "queue_callback",
    "recomputed_in_backward",
    "shard_split_tensor",
    "swap_direct_parameters",
    "tree_leaves",
    "version",
]

#: The torch releases torch_tp supports, ``[first, past_last)`` as (major, minor); setup.py
#: states the same range.
SUPPORTED = ((2, 13), (2, 16))


def _parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


#: The installed torch's (major, minor).
TORCH_VERSION = _parse(torch.__version__)


def check_version(version: str) -> bool:
    """Whether torch ``version`` (a ``torch.__version__`` string) is in :data:`SUPPORTED`;
    warns when it is not. An unsupported torch is not an error: torch_tp may still work, but
    a private API it uses may have moved.

    Example::

        >>> check_version("2.15.0+cu132")
        True
    """
    if SUPPORTED[0] <= _parse(version) < SUPPORTED[1]:
        return True
    warnings.warn(
        f"torch_tp is tested with torch {SUPPORTED[0][0]}.{SUPPORTED[0][1]} to "
        f"{SUPPORTED[1][0]}.{SUPPORTED[1][1] - 1}, found {version}: the private torch "
        "APIs in torch_tp/_torch_compat.py may have moved",
        stacklevel=2,
    )
    return False


check_version(torch.__version__)


def _first(*candidates: tuple[str, str]) -> Any:
    """The first ``(module, name)`` that imports; the error names every place looked in."""
    for module, name in candidates:
        with contextlib.suppress(ImportError, AttributeError):
            return getattr(importlib.import_module(module), name)
    places = ", ".join(f"{module}.{name}" for module, name in candidates)
    raise ImportError(
        f"torch {torch.__version__} has none of {places}; see torch_tp/_torch_compat.py"
    )


# ------------------------------------------------------------------------------------------
# DTensor internals
# ------------------------------------------------------------------------------------------

#: DTensor's placement for "this rank's slice of each of ``split_factor`` parts" (a packed
#: projection's weight). The only placement that describes it; torch keeps it private.
StridedShard = _first(("torch.distributed.tensor.placement_types", "_StridedShard"))

#: A DTensor's layout and its global shape, stride and dtype: built once and reused on the
#: hot paths instead of letting DTensor rebuild and check one on every call.
DTensorSpec = _first(
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed._tensor.placement_types", "DTensorSpec"),
)
TensorMeta = _first(
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed._tensor.placement_types", "TensorMeta"),
)

#: The local shape and global offset of this rank's shard (checkpoint loads read exactly it);
#: no public API computes it without building the DTensor.
compute_local_shape_and_global_offset = _first(
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
)


def local_tensor(value: DTensor) -> torch.Tensor:
    """``value.to_local()`` without an autograd node (the fast runtime's own Functions make
    the gradient)."""
    return value._local_tensor


def dtensor_spec(value: DTensor) -> Any:
    """The :data:`DTensorSpec` of ``value`` (its public parts are ``device_mesh``,
    ``placements`` and the shape; reusing the whole spec spares DTensor rebuilding it)."""
    return value._spec


# DTensor's __init__ only calls Tensor.__init__ through a dynamo-disabling and an
# export-marking decorator, which cost as much as the construction itself; its __new__ is the
# C++ constructor, called directly when torch has it
_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)


def dtensor_from_spec(local: torch.Tensor, spec: Any, requires_grad: bool) -> DTensor:
    """``DTensor(local, spec, requires_grad=...)``, for the hot paths (one per parameter per
    step); falls back to the Python constructor where the C++ one is missing."""
    if _DTENSOR_NEW is None:
        return DTensor(local, spec, requires_grad=requires_grad)
    return _DTENSOR_NEW(DTensor, local, spec, requires_grad=requires_grad)


def shard_split_tensor(
    placement: Any, tensor: torch.Tensor, num_chunks: int, *, contiguous: bool = True
) -> list[torch.Tensor]:
    """The chunks DTensor's ``Shard`` (or strided shard) splits ``tensor`` into, unpadded: the
    only statement of how a strided shard orders the pieces of each part."""
    chunks, _ = placement._split_tensor(
        tensor, num_chunks, with_padding=False, contiguous=contiguous
    )
    return chunks


def current_mesh() -> Any:
    """The mesh of the enclosing ``with device_mesh:`` (``RuntimeError`` when there is none);
    torch has no public getter for it."""
    mesh_resources = _first(("torch.distributed.device_mesh", "_mesh_resources"))
    return mesh_resources.get_current_mesh()


@contextlib.contextmanager
def without_global_module_hooks() -> Any:
    """Run a block with no global module hook (``register_module_forward_pre_hook`` and
    kin), all of them back after it: the first-forward shape check traces meta copies of a
    model, which a tool that watches every module's calls (``ModTracker``, under
    ``CommDebugMode`` and the flop counter) must not take for modules of the model. torch
    has no public way to suspend them."""
    from torch.nn.modules import module as module_module

    hooks = [
        value
        for name, value in vars(module_module).items()
        if name.startswith("_global_") and isinstance(value, dict)
    ]
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:
        yield
    finally:
        for h, kept in zip(hooks, saved, strict=True):
            h.clear()
            h.update(kept)


def process_groups() -> list[Any]:
    """Every process group this process has and has not destroyed (the default one among
    them); torch has no public list of them. The test harness counts them to replace a pool
    of ranks that holds many: each gloo group keeps threads that wake up while it is idle."""
    world = _first(("torch.distributed.distributed_c10d", "_world"))
    return list(world.pg_map)


# ------------------------------------------------------------------------------------------
# Autograd internals
# ------------------------------------------------------------------------------------------


def current_graph_task_id() -> int:
    """The id of the backward pass running now (``-1`` outside one): one end-of-backward
    callback per pass. No public API identifies the running backward pass."""
    return torch._C._current_graph_task_id()


def _engine_queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass running now ends (not if it raises)."""
    Variable._execution_engine.queue_callback(callback)


# torch 2.15 made it public as torch.autograd.graph.queue_callback (the same engine call);
# 2.13 has only the engine's
queue_callback: Callable[[Callable[[], None]], None] = getattr(
    torch.autograd.graph, "queue_callback", _engine_queue_callback
)


def own_alias(value: torch.Tensor) -> torch.Tensor:
    """``value`` (same memory, no copy) as the output of a non-view op, so that autograd lets
    its reader modify it in place: ``aten._unsafe_view``, which torch's own ``matmul`` uses
    for the same purpose. Only for a ``value`` whose memory no other tensor reads (the fresh
    result of a collective): autograd no longer sees the two as aliases."""
    return torch.ops.aten._unsafe_view(value, value.shape)


_SOLE_USE_COUNT: list[int] = []


def view_base(value: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``value`` is a view of (``None``: it is not a view). Private
    (``Tensor._base``), and the only one."""
    return value._base


def sole_owner(value: torch.Tensor) -> bool:
    """Whether no other tensor shares ``value``'s memory (no view of it, no base it views):
    the use count of its storage is that of a fresh tensor's (measured once, so that a torch
    counting its own references otherwise stays right). Private, and the only one."""
    if not _SOLE_USE_COUNT:
        fresh = torch.empty(1)
        _SOLE_USE_COUNT.append(torch._C._storage_Use_Count(fresh.untyped_storage()._cdata))
    count = torch._C._storage_Use_Count(value.untyped_storage()._cdata)
    return count == _SOLE_USE_COUNT[0]


def version(value: torch.Tensor) -> int:
    """``value``'s version counter: it counts in-place changes (cache keys). Private, and
    the only one."""
    return value._version


# ------------------------------------------------------------------------------------------
# nn.Module internals
# ------------------------------------------------------------------------------------------

#: What ``load_state_dict`` returns (missing and unexpected keys), for the loads of
#: :mod:`torch_tp.checkpoint` to return the same; the namedtuple has no public name.
IncompatibleKeys = _first(("torch.nn.modules.module", "_IncompatibleKeys"))


def direct_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots by name (``None`` included), as registered: unlike
    ``getattr``, a parametrized parameter's slot, not the computed tensor. The public
    ``named_parameters(recurse=False)`` leaves out the ``None`` slots (``bias=False``) and
    builds a generator per call; this runs per module per step."""
    return module._parameters


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False`` (outside its
    ``state_dict``; torch keeps the set privately)."""
    return set(module._non_persistent_buffers_set)


def direct_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s own child slots by name (``None`` included), as registered."""
    return module._modules


def copy_with_children(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A shallow copy of ``module`` whose child slots are ``children``, in a dict of its own:
    ``module``'s are left as they are (``copy.copy`` alone would share them, and any public
    way of setting a child writes into that shared dict)."""
    clone = copy.copy(module)
    vars(clone)["_modules"] = dict(children)
    return clone


def swap_direct_parameters(
    module: nn.Module, values: dict[str, Any]
) -> dict[str, nn.Parameter | None]:
    """Replace ``module``'s own parameter slots by ``values`` (local tensors), so that its own
    forward computes with them unchanged; returns the slots to put back (by calling this
    again). A function, not a context manager: it runs for every norm of every step. No
    public API serves: ``setattr`` registers a parameter, which refuses a plain tensor."""
    params = module._parameters
    module.__dict__["_parameters"] = values
    return params


#: The name under which ``torch.compile(module)`` (an ``OptimizedModule``) holds ``module``,
#: so a part of every parameter name of a compiled model; checkpoints strip it to match the
#: uncompiled model's names. No public API names it.
COMPILED_MODULE_NAME = "_orig_mod"


# ------------------------------------------------------------------------------------------
# Odds and ends
# ------------------------------------------------------------------------------------------


def log_api_usage_once(event: str) -> None:
    """torch's API usage logging, as its own entry points do (it has no public one)."""
    torch._C._log_api_usage_once(event)


#: ``torch._nested_tensor_from_mask_left_aligned``: ``nn.TransformerEncoder``'s test of its
#: padding mask before its inference fast path, which the shape check answers on meta.
#: ``None`` on a release without it (the shape check then has nothing to answer).
nested_tensor_from_mask_left_aligned = getattr(torch, "_nested_tensor_from_mask_left_aligned", None)

#: ``torch.utils._pytree.tree_leaves``: the tensors in nested outputs (no public pytree).
tree_leaves = _first(("torch.utils._pytree", "tree_leaves"))

#: Collectives that autograd and torch.compile trace (``all_reduce`` with an op name,
#: ``all_gather_single``), which vocabulary-parallel cross-entropy uses: DTensor's own, out of
#: place and taking a mesh; the public ``torch.distributed`` ones work in place on a group.
functional_collectives = importlib.import_module("torch.distributed._functional_collectives")

#: ``size_average``/``reduce`` (the deprecated loss arguments) to a reduction name, as
#: ``F.cross_entropy`` reads them (the public losses do it inside, with no public function).
legacy_reduction = _first(("torch.nn._reduction", "legacy_get_string"))

#: The fused in-place multiply of a list of tensors by a scalar (gradient clipping). The
#: public ``torch.nn.utils.clip_grads_with_norm_`` calls it too, but on parameters, not on the
#: local shards of their gradients.
foreach_mul_ = torch._foreach_mul_


def lazy_init(device_module: Any) -> None:
    """Initialize a lazily initialized device module (``torch.cuda``) so that its default
    generators exist; a no-op for one that has nothing to initialize. The public ``init()``
    (``torch.cuda``, ``torch.xpu``, ``torch.mtia``) where the module has one, else its private
    ``_lazy_init``."""
    init = getattr(device_module, "init", None) or getattr(device_module, "_lazy_init", None)
    if callable(init):
        init()


# ------------------------------------------------------------------------------------------
# LocalTensorMode: one process simulating every rank (PyTorch's own distributed tests)
# ------------------------------------------------------------------------------------------


def enabled_local_tensor_mode() -> Any:
    """The enabled ``LocalTensorMode``, or ``None``."""
    return _first(("torch.distributed._local_tensor", "enabled_local_tensor_mode"))()


def per_rank_rng_states(mode: Any) -> dict[int, tuple[Any, ...]]:
    """The default random states of each simulated rank, ``{rank: (cpu_state,
    accelerator_states)}``, which the mode loads into the default generators before it runs
    an op for a rank and reads back afterwards."""
    return mode._per_rank_rng_states


def per_rank_ints(node: Any) -> dict[int, int] | None:
    """The per-rank values of an int the mode made per simulated rank (a ``LocalIntNode``),
    or ``None`` for one that is the same on every rank."""
    return getattr(node, "_local_ints", None)


def recomputed_in_backward(module: nn.Module) -> bool:
    """Whether activation checkpointing wraps ``module`` (its forward runs again in the
    backward): the composable ``checkpoint(module)`` or a ``CheckpointWrapper``. Used by
    the pipeline's exact dropout, which cannot redraw a recomputed dropout."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper) or checkpoint.state(module) is not None
