"""Checkpoints of tensor-parallel and 2-D (FSDP2 + TP) models.

Two kinds, for two jobs:

* **Full state dicts** are ordinary ``{name: tensor}`` dicts with the names and values of the
  single-device model: to export weights, to share them, to start a TP job from a
  single-device checkpoint. :func:`full_state_dict` gathers one parameter at a time;
  :func:`load_full_state_dict` loads from memory or from a ``safetensors`` file, each rank
  reading only its own slices.
* **Distributed checkpoints** (:mod:`torch.distributed.checkpoint`, DCP) save each rank's
  shards in parallel, with the optimizer and the RNG streams, and load them on any other
  layout: :func:`save`, :func:`load`, :func:`latest_step`.

Failures: a save writes a new directory and publishes it with an atomic rename once every
rank is done, so a crash at any point leaves the previous or the new checkpoint loadable
(every writer, DCP and Hugging Face directories, publishes through one routine below).
Every load checks the whole checkpoint against the model, reads into staging buffers and
copies into the model (and optimizer) only once every rank has read everything, so a load
completes or changes nothing. Errors are :class:`CheckpointError` (an ``Exception``, unlike
DCP's ``CheckpointException``), raised on every rank, naming the files and keys at fault.

Trust: a full state dict is read from ``safetensors`` (no code, only tensors) or from
tensors you pass in; nothing here unpickles a file for it. DCP directories are a different
matter: DCP pickles its metadata and the optimizer's hyperparameters, so load only DCP
checkpoints your own jobs wrote.

Packed parameters (:class:`~torch_tp.PackedColwiseParallel`,
:class:`~torch_tp.PackedRowwiseParallel`, and :class:`~torch_tp.TensorParallelExperts`'
``gate_up_proj``) are DTensors with DTensor's strided-shard placement: each rank holds its
slice of each of the packed parts (of every expert's gate rows and of its up rows), not one
block. Every function here handles them exactly, on a 1-D tensor-parallel mesh and under
FSDP2 where FSDP2 shards another dim than the packed one (tensor-parallel experts: FSDP2
splits the experts, dim 0, the packed dim is 1; a packed row-parallel weight). Where FSDP2
shards the packed dim too (a packed column-parallel weight or bias: both dim 0) the
placements do not say what each rank holds, so every function here refuses it with
``NotImplementedError`` rather than read or write wrong values.

Expert parallelism (:class:`~torch_tp.ExpertParallel`) places every stacked expert parameter
as ``Shard(0)``, whole experts per rank: one block of the whole tensor, like any other
shard. A safetensors load reads only this rank's experts (or, for tensor-parallel experts,
one slice per part, each over every expert this rank holds).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor import empty as dtensor_empty

from torch_tp import _torch_compat as compat
from torch_tp import random as tp_random
from torch_tp._torch_compat import (
    IncompatibleKeys,
    StridedShard,
    compute_local_shape_and_global_offset,
)
from torch_tp.checkpoint._publish import (
    _OLD,
    _publish,
    _recover_one,
    _staged_name,
    _staging,
    _visible,
)

__all__ = [
    "CheckpointError",
    "full_state_dict",
    "latest_step",
    "load",
    "load_full_state_dict",
    "load_pretrained",
    "save",
    "save_pretrained",
]

# ``torch.compile`` wraps a module and holds it under this name; the single-device name has no
# such part
_WRAPPER_PARTS = (compat.COMPILED_MODULE_NAME,)


# ------------------------------------------------------------------------------------------
# Full state dicts
# ------------------------------------------------------------------------------------------


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = True
) -> dict[str, Tensor]:
    """Gather the state of a TP or 2-D model into an ordinary, single-device state dict.

    The names are those of the single-device model (what ``model.state_dict()`` would give
    before parallelization) and the values are whole tensors. Parameters are gathered one
    at a time (an all-gather each): a rank holds at most one gathered tensor beyond what it
    returns, so a rank that returns nothing (``rank0_only``) never holds more than one whole
    parameter (the all-gather stages it through a second buffer of its size). Must be
    called on every rank.

    Args:
        model (:class:`nn.Module`): the model, parallelized by
            :func:`torch_tp.parallelize_module` and possibly sharded by FSDP2 on top.

    Keyword Args:
        rank0_only (bool, optional): return the full dict on global rank 0 only and an
            empty dict elsewhere. Default: ``False`` (every rank gets it).
        cpu_offload (bool, optional): move every gathered tensor to the CPU as soon as it is
            gathered. Default: ``True``.

    Returns:
        ``{name: tensor}`` with plain (not DTensor) tensors, or ``{}`` on ranks other than 0
        with ``rank0_only``.

    Raises:
        NotImplementedError: a packed parameter whose packed dim FSDP2 shards too (see the
            module docstring); raised on every rank before anything is gathered.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> state = torch_tp.checkpoint.full_state_dict(model, rank0_only=True)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(state, "model.safetensors")
    """
    keep = not rank0_only or _rank() == 0
    out: dict[str, Tensor] = {}
    state = model.state_dict()
    _refuse_nested_packed(state)
    # agreed before any gather (it must be called on every rank): one rank's model on the
    # meta device fails every rank alike
    error = _meta_error(model, "full_state_dict")
    if _distributed() and any(isinstance(t, DTensor) for t in state.values()):
        _agree(error, lambda cause: f"full_state_dict failed: {cause}")
    else:
        _raise(error)
    for name, value in state.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank, in the same order
        if not keep:
            continue
        if isinstance(value, Tensor):
            value = value.detach()
            if cpu_offload:
                value = value.cpu()
        out[_single_device_name(name)] = value
    return out


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Tensor] | str | os.PathLike | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> IncompatibleKeys:
    """Load a full (single-device) state dict into a TP or 2-D model, all or nothing.

    Each rank copies only its own slice of each tensor into its shard; nothing is
    redistributed afterwards. The source is one of:

    * a ``safetensors`` file (a path): every rank opens it and reads only its slices
      (``safe_open(...).get_slice``), so no rank ever holds the whole checkpoint;
    * a dict of tensors on every rank (e.g. ``torch.load(path, weights_only=True,
      mmap=True)``): each rank slices it locally, without communication;
    * a dict on rank 0 only, with ``broadcast_from_rank0=True``: rank 0 broadcasts one
      tensor at a time and the other ranks may pass ``None``.

    A load either completes or changes nothing. The names, the global shapes and the dtypes
    (readable, and convertible to the parameter's) are checked against the model first;
    then each rank reads its slices into staging buffers (as much memory as its shard);
    the ranks agree that every one of them read everything (one small collective); and
    only then are the buffers copied into the model, each freed as soon as it is copied.
    Any failure raises the same exception on every rank (every error listed under
    ``Raises``), and the model is left bit-identical. Values are
    converted to each parameter's dtype; a lossy conversion (e.g. integer to floating
    point, ``float64`` to ``float16``) warns once per call, naming the keys. The model may
    have been built on the meta device, parallelized, and given memory for its shards by
    :func:`torch_tp.materialize` (which also computes non-persistent buffers such as rotary
    tables again; ``model.to_empty`` leaves them uninitialised). A model with tensors still
    on the meta device is refused before anything is read.

    With a process group, a model holding DTensors must be loaded on every rank (the
    agreement is a collective over every rank of the default group); a model without
    DTensors is loaded by each rank on its own.

    Args:
        model (:class:`nn.Module`): the parallelized model (and possibly FSDP2-sharded).
        state_dict (Mapping[str, Tensor] or str or os.PathLike or None): the full state
            dict, or the path of a ``.safetensors`` file; ``None`` on ranks other than 0 with
            ``broadcast_from_rank0``.

    Keyword Args:
        strict (bool, optional): raise for missing and unexpected keys, as
            :meth:`nn.Module.load_state_dict` does. Default: ``True``.
        broadcast_from_rank0 (bool, optional): only global rank 0 holds ``state_dict``
            (in memory, or a file only rank 0 can read). Default: ``False``.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``, as
        :meth:`nn.Module.load_state_dict` returns.

    Raises:
        CheckpointError: missing or unexpected keys (with ``strict``), shape mismatches,
            dtypes that cannot be read or converted, a file that is not a readable
            ``safetensors`` file, or a read that failed; the message names the file and
            every offending key. It derives from ``RuntimeError``.
        TypeError: ``state_dict`` is neither a mapping nor a path, or holds non-tensors.
        FileNotFoundError: ``state_dict`` is a path with no file.
        NotImplementedError: a parameter whose local shard is not one block of the whole
            tensor (e.g. ``Partial``), or a packed parameter whose packed dim FSDP2 shards
            too. Other packed parameters are loaded exactly: their shard is one block per
            part (one ``get_slice`` read each from a ``safetensors`` file).
        ValueError: the model has tensors on the meta device (named; on every rank).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch.device("meta"):
        ...     model = Llama(config)
        >>> parallelize_module(model, mesh["tp"], llama_plan())
        >>> torch_tp.materialize(model)
        >>> torch_tp.checkpoint.load_full_state_dict(model, "llama.safetensors")
    """
    targets = {_single_device_name(k): v for k, v in model.state_dict().items()}
    _refuse_nested_packed(targets)  # on every rank, before any communication
    if broadcast_from_rank0:
        result, staged = _stage_broadcast(model, targets, state_dict, strict)
    else:
        result, staged, error = None, {}, None
        try:
            _raise(_meta_error(model, "load_full_state_dict"))  # before reading anything
            source = _Source(state_dict)
            result = _check_keys(model, targets, source, strict)
            staged = _stage_local(source, targets, result)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
        if _distributed() and any(isinstance(t, DTensor) for t in targets.values()):
            _agree(error, _load_failed("loading a full state dict"))
        elif error is not None:
            raise error
    _copy_staged(targets, staged)
    return result


def _stage_local(
    source: _Source,
    targets: Mapping[str, Tensor],
    result: IncompatibleKeys,
    threads: int = 1,
) -> dict[str, Tensor]:
    """Read this rank's part of every present tensor into new buffers; raise naming every
    tensor that could not be read. With ``threads`` > 1, that many tensors are read at a
    time (for a source whose ``copy_to`` may run in several threads at once: reads from
    files release the GIL)."""
    skip = set(result.missing_keys)
    work = []
    for name, target in targets.items():
        if name in skip:
            continue
        local = target.to_local() if isinstance(target, DTensor) else target
        pieces = _local_pieces(name, target) if isinstance(target, DTensor) else None
        work.append((name, pieces, torch.empty_like(local)))

    def read(item: tuple[str, list[_Piece] | None, Tensor]) -> str | None:
        name, pieces, buffer = item
        try:
            source.copy_to(name, pieces, buffer)
        except Exception as exc:  # noqa: BLE001 - collected, raised below with every key
            found = getattr(source, "describe", lambda name: "")(name)
            return f"{name!r}{f' ({found})' if found else ''}: {_first_line(exc)}"
        return None

    if threads > 1 and len(work) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=threads) as pool:
            outcomes = list(pool.map(read, work))
    else:
        outcomes = [read(item) for item in work]
    failed = [outcome for outcome in outcomes if outcome is not None]
    if failed:
        raise CheckpointError(
            f"could not read from {source.description}: " + "; ".join(failed) + ". The "
            "model is unchanged."
        )
    return {name: buffer for name, _, buffer in work}


def _copy_staged(targets: Mapping[str, Tensor], staged: dict[str, Tensor]) -> None:
    """Put every staged buffer into the model, freeing each once in (so that the peak stays
    near one copy of the shard when the model's memory is untouched).

    A buffer becomes the model's memory itself (``set_``, no copy) where ``targets`` holds
    the model's own tensors (``state_dict(keep_vars=True)``) and the tensor's memory is its
    alone, of the buffer's layout: nothing else can see the memory swapped out (no view of
    it, no FSDP2 shard inside a padded flat buffer). Elsewhere it is copied."""
    with torch.no_grad():
        for name in list(staged):
            target = targets[name]
            local = compat.local_tensor(target) if isinstance(target, DTensor) else target
            buffer = staged.pop(name)
            if _alone(local) and _alone(buffer) and local.stride() == buffer.stride():
                local.set_(buffer)
            else:
                local.copy_(buffer)


def _alone(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its memory, and spans all of it."""
    storage = tensor.untyped_storage()
    return (
        tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and compat.sole_owner(tensor)
    )


def _stage_broadcast(
    model: nn.Module,
    targets: dict[str, Tensor],
    state_dict: Mapping[str, Tensor] | str | os.PathLike | None,
    strict: bool,
) -> tuple[IncompatibleKeys, dict[str, Tensor]]:
    rank = _rank()
    what = "loading a full state dict broadcast from rank 0"
    # rank 0 opens and checks the source; every rank checks its model; every rank then
    # raises the same error, or none does (one small collective)
    error, verdict = None, None
    try:
        _raise(_meta_error(model, "load_full_state_dict"))
        if rank == 0:
            source = _Source(state_dict)
            verdict = tuple(_check_keys(model, targets, source, strict))
    except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = exc
    # the broadcasts below follow each rank's own names: they must be the same everywhere
    layout = hashlib.sha256(
        repr([(k, tuple(v.shape), str(v.dtype)) for k, v in targets.items()]).encode()
    ).hexdigest()
    values = _agree(error, _load_failed(what), value=(layout, verdict))
    differ = [r for r, (other, _) in enumerate(values) if other != values[0][0]]
    if differ:
        raise CheckpointError(
            _load_failed(what)(
                f"the model's names, shapes or dtypes on rank(s) {differ} differ from rank 0's"
            )
        )
    result = IncompatibleKeys(*values[0][1])
    present = set(targets) - set(result.missing_keys)
    # Rank 0 reads and broadcasts one whole tensor at a time. A read that fails on rank 0
    # must not leave the others waiting in a broadcast: rank 0 keeps the protocol going
    # (broadcasting empty buffers) and the failure is agreed on at the end.
    error: Exception | None = None
    staged: dict[str, Tensor] = {}
    for name, target in targets.items():
        if name not in present:
            continue
        local = target.to_local() if isinstance(target, DTensor) else target
        full = None
        if rank == 0 and error is None:
            try:
                full = source.read(name).to(device=local.device, dtype=local.dtype)
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = CheckpointError(
                    f"could not read {name!r} from {source.description}: {_first_line(exc)}. "
                    "The model is unchanged."
                )
        if full is None:
            full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
        if _distributed():
            # one whole tensor at a time
            group = _group() if full.device.type == "cpu" else None  # gloo moves CPU tensors
            _coordinate(dist.broadcast, full, src=0, group=group, failed=_load_failed(what))
        buffer = torch.empty_like(local)
        if isinstance(target, DTensor):
            for whole, mine in _local_pieces(name, target):
                buffer[mine].copy_(full[whole])
        else:
            buffer.copy_(full)
        staged[name] = buffer
        del full
    if _distributed():
        _agree(error, _load_failed(what))
    elif error is not None:
        raise error
    return result, staged


def _check_keys(
    model: nn.Module, targets: Mapping[str, Tensor], source: _Source, strict: bool
) -> IncompatibleKeys:
    """Compare the names, shapes and dtypes of ``source`` with the model's; raise naming
    every key at fault, warn once for lossy conversions."""
    shapes = source.shapes
    describe = getattr(source, "describe", lambda name: "")

    def where(name: str) -> str:
        found = describe(name)
        return f"{name} ({found})" if found else name

    missing = [name for name in targets if name not in shapes]
    unexpected = [name for name in shapes if name not in targets]
    mismatched, unreadable, lossy = [], [], []
    for name, target in targets.items():
        if name not in shapes:
            continue
        if tuple(shapes[name]) != tuple(target.shape):
            mismatched.append(
                f"{where(name)}: the checkpoint has shape {list(shapes[name])}, the model "
                f"{list(target.shape)}"
            )
            continue
        dtype = source.dtypes[name]
        if isinstance(dtype, str):
            unreadable.append(
                f"{where(name)}: the checkpoint's dtype {dtype!r} cannot be loaded into "
                f"{target.dtype}"
            )
        elif not _convertible(dtype, target.dtype):
            unreadable.append(f"{where(name)}: {dtype} cannot be converted to {target.dtype}")
        elif _lossy(dtype, target.dtype):
            lossy.append(f"{name} ({dtype} to {target.dtype})")
    errors = []
    if strict and missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(map(repr, missing)) + ".")
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(map(repr, unexpected)) + ".")
    if mismatched:
        errors.append("Size mismatch: " + "; ".join(mismatched) + ".")
    if unreadable:
        errors.append("Unreadable dtype: " + "; ".join(unreadable) + ".")
    _raise_or_warn(errors, lossy, source.description, type(model).__name__)
    return IncompatibleKeys(missing, unexpected)


def _raise_or_warn(errors: list[str], lossy: list[str], source: str, model_name: str) -> None:
    """Raise one error naming everything wrong with ``source``, or warn once of the lossy
    conversions it needs."""
    if errors:
        raise CheckpointError(
            f"Error(s) in loading {source} into {model_name} (nothing was changed):\n\t"
            + "\n\t".join(errors)
        )
    if lossy:
        warnings.warn(
            f"loading {source} converts with a loss of precision or range: " + ", ".join(lossy),
            stacklevel=4,
        )


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    try:
        torch.empty(1, dtype=src).to(dst)
    except (RuntimeError, TypeError):
        return False
    return True


def _lossy(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting ``src`` values to ``dst`` can lose precision or range."""
    if src == dst or src == torch.bool:
        return False
    if dst == torch.bool or (src.is_complex and not dst.is_complex):
        return True
    if not (src.is_floating_point or src.is_complex):  # integers
        if dst.is_floating_point or dst.is_complex:
            return True  # large integers do not survive
        s, d = torch.iinfo(src), torch.iinfo(dst)
        return d.min > s.min or d.max < s.max
    if not (dst.is_floating_point or dst.is_complex):
        return True  # floating point to integer
    s = torch.finfo(src.to_real() if src.is_complex else src)
    d = torch.finfo(dst.to_real() if dst.is_complex else dst)
    return d.eps > s.eps or d.max < s.max or d.tiny > s.tiny


# A piece: a region of the whole tensor and the region of the local shard it is copied to.
_Piece = tuple[tuple[slice, ...], tuple[slice, ...]]


def _local_pieces(name: str, target: DTensor) -> list[_Piece]:
    """The regions of the whole tensor that this rank's shard of ``target`` holds, and where.

    One piece for a shard that is one block of the whole tensor; for a packed parameter
    (a strided shard, e.g. a packed part's slice or each expert's gate and up slices), one
    piece per block of the index sets it holds along each dim (see :func:`_strided_pieces`).
    """
    if any(isinstance(p, Partial) for p in target.placements):
        raise NotImplementedError(
            f"{name}: cannot load a full tensor into a Partial DTensor ({target.placements})"
        )
    local_shape = tuple(target.to_local().shape)
    everything = tuple(slice(0, s) for s in local_shape)
    if _packed_placement(target) is not None:
        return _strided_pieces(name, target, local_shape)
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    if tuple(shape) != local_shape:
        raise NotImplementedError(
            f"{name}: the local shard of shape {list(local_shape)} is not one block of the "
            f"{list(target.shape)} tensor with placements {target.placements}"
        )
    return [(tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True)), everything)]


def _strided_pieces(name: str, target: DTensor, local_shape: tuple[int, ...]) -> list[_Piece]:
    """The pieces of a shard with a packed (strided) placement.

    Along each tensor dim, the indices this rank holds are found the way DTensor itself
    splits: each mesh dim's placement on that tensor dim, in mesh order, applied to an
    ``arange`` (so that the shard equals ``distribute_tensor(full, mesh, placements)``'s).
    The shard is the product of those index sets (each dim's split is independent of the
    others': :func:`_refuse_nested_packed` refuses a packed dim that another mesh dim splits
    too), so its pieces are the products of each dim's runs of consecutive indices: for
    tensor-parallel experts' ``gate_up_proj`` ``[E, 2I, H]``, one for its slice of every
    expert's gate rows and one for its slice of their up rows, each over this rank's experts
    (all of them, or its FSDP2 shard).
    """
    mesh = target.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: nothing to hold
        return []
    held = [torch.arange(size) for size in target.shape]
    for mesh_dim, placement in enumerate(target.placements):
        if not isinstance(placement, (Shard, StridedShard)):
            continue  # Replicate (a Partial was refused by the caller)
        dim = placement.dim % target.ndim
        along = (
            StridedShard(0, split_factor=placement.split_factor)
            if isinstance(placement, StridedShard)
            else Shard(0)
        )
        chunks = compat.shard_split_tensor(along, held[dim], mesh.size(mesh_dim), contiguous=False)
        held[dim] = chunks[coordinate[mesh_dim]]
    runs_per_dim: list[list[tuple[slice, slice]]] = []
    for dim, indices in enumerate(held):
        indices = indices.tolist()
        if len(indices) != local_shape[dim]:
            raise NotImplementedError(
                f"{name}: the local shard of shape {list(local_shape)} does not match the "
                f"{list(target.shape)} tensor with placements {target.placements}"
            )
        runs_per_dim.append(_runs(indices))
    return [
        (tuple(whole for whole, _ in runs), tuple(mine for _, mine in runs))
        for runs in itertools.product(*runs_per_dim)
    ]


def _runs(indices: list[int]) -> list[tuple[slice, slice]]:
    """The runs of consecutive values in ``indices``: ``(whole, mine)`` slices, ``whole`` of
    the values and ``mine`` of their positions."""
    runs = []
    start = 0  # the position where the current run begins
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] != indices[i - 1] + 1:
            if i > start:
                runs.append((slice(indices[start], indices[i - 1] + 1), slice(start, i)))
            start = i
    return runs  # none for an empty shard: nothing to read


def _packed_mesh_dim(value: DTensor) -> int | None:
    """The mesh dim of a packed parameter's strided-shard placement, or ``None``.

    FSDP2 on top of tensor parallelism also uses strided shards: ``StridedShard(d)`` on
    the data-parallel dim, followed by the tensor-parallel ``Shard(d)``; such a shard is one
    block of the whole tensor. A strided shard that no later ``Shard`` of its dim follows
    is a packed one: its rank holds one slice of each part.
    """
    placements = value.placements
    for i, placement in enumerate(placements):
        if not isinstance(placement, StridedShard):
            continue
        dim = placement.dim % value.ndim
        if not any(
            type(later) is Shard and later.dim % value.ndim == dim for later in placements[i + 1 :]
        ):
            return i
    return None


def _packed_placement(value: DTensor) -> StridedShard | None:
    """The strided-shard placement of a packed parameter, or ``None``."""
    mesh_dim = _packed_mesh_dim(value)
    return None if mesh_dim is None else value.placements[mesh_dim]


def _refuse_nested_packed(state: Any, path: str = "") -> None:
    """Raise ``NotImplementedError`` for a packed parameter whose packed dim another mesh dim
    splits too.

    FSDP2 shards dim 0 of each tensor-parallel shard. Where the packed dim is another one
    (tensor-parallel experts' ``gate_up_proj``, strided on dim 1; a packed row-parallel
    weight, on dim 1), each mesh dim splits its own tensor dim and the placements say what
    each rank holds. Where it is dim 0 too (a packed column-parallel weight), the
    placements nest two strided shards that do not describe what each rank holds: values
    read or written through them would be scrambled.
    """
    for name, value in _dtensors(state, path):
        packed = _packed_mesh_dim(value)
        if packed is None:
            continue
        dim = value.placements[packed].dim % value.ndim
        others = [
            i
            for i, p in enumerate(value.placements)
            if i != packed and isinstance(p, (Shard, StridedShard)) and p.dim % value.ndim == dim
        ]
        if others:
            raise NotImplementedError(
                f"{name}: a packed parameter (PackedColwiseParallel, PackedRowwiseParallel, "
                f"TensorParallelExperts; placements {value.placements}) on a "
                f"{value.device_mesh.ndim}-D mesh whose packed dim {dim} is split by mesh "
                f"dim(s) {others} as well: a packed dim also sharded by FSDP2 is not "
                "supported under FSDP2 yet, the placements do not describe what each rank "
                "holds; checkpoint the model without FSDP2 (a 1-D tensor-parallel mesh)"
            )


def _dtensors(state: Any, path: str = "") -> Iterator[tuple[str, DTensor]]:
    """Every DTensor in a nested state dict (dicts and lists), with its dotted path."""
    if isinstance(state, DTensor):
        yield path, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _dtensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _dtensors(value, f"{path}.{i}" if path else str(i))


# The dtype names of the safetensors format, as torch reads them.
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Source:
    """A full state dict to read from: a mapping of tensors or a safetensors file.

    ``shapes`` and ``dtypes`` (by name) are known up front; only the file's header is read
    for them. A dtype this torch cannot read is kept as the file's name for it (a ``str``).
    """

    def __init__(self, state_dict: Mapping[str, Tensor] | str | os.PathLike | None) -> None:
        self._dict: Mapping[str, Tensor] | None = None
        self._path: Path | None = None
        self.dtypes: dict[str, torch.dtype | str]
        if isinstance(state_dict, (str, os.PathLike)):
            self._path = Path(state_dict)
            self.description = f"the safetensors file {str(self._path)!r}"
            if not self._path.is_file():
                raise FileNotFoundError(f"no safetensors file at {str(self._path)!r}")
            try:
                with self._open() as file:  # a file that is not safetensors fails here
                    slices = {n: file.get_slice(n) for n in file.keys()}
                    self.shapes = {n: tuple(s.get_shape()) for n, s in slices.items()}
                    self.dtypes = {
                        n: _SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype())
                        for n, s in slices.items()
                    }
            except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary
                raise CheckpointError(
                    f"{str(self._path)!r} is not a readable safetensors file: {_first_line(exc)}"
                ) from exc
        elif isinstance(state_dict, Mapping):
            self.description = "the state dict"
            bad = [k for k, v in state_dict.items() if not isinstance(v, Tensor)]
            if bad:
                raise TypeError(f"the full state dict must hold tensors, found others at {bad}")
            self._dict = state_dict
            self.shapes = {n: tuple(t.shape) for n, t in state_dict.items()}
            self.dtypes = {n: t.dtype for n, t in state_dict.items()}
        else:
            raise TypeError(
                "state_dict must be a mapping of tensors or the path of a .safetensors file, "
                f"found {type(state_dict).__name__}"
            )

    def _open(self):
        from safetensors import safe_open

        return safe_open(str(self._path), framework="pt", device="cpu")

    def copy_to(self, name: str, pieces: list[_Piece] | None, dst: Tensor) -> None:
        """Copy the whole tensor ``name`` (``pieces=None``) into ``dst``, or just some
        regions of it (each ``(whole, mine)`` piece: ``dst[mine] = name[whole]``)."""
        if self._dict is not None:
            value = self._dict[name]
            if pieces is None:
                dst.copy_(value)
            for whole, mine in pieces or ():
                dst[mine].copy_(value[whole])
            return
        # Open the file for each tensor: safetensors maps the file, and the pages a read
        # touches stay resident in this process while the mapping lives. Closing it after
        # each tensor keeps that to one tensor's pages (all of them for a column slice).
        with self._open() as file:
            if pieces is None or (len(pieces) == 1 and not pieces[0][0]):  # whole, or 0-d
                value = file.get_tensor(name)
                dst.copy_(value)
                del value
                return
            tensor_slice = file.get_slice(name)
            for whole, mine in pieces:
                value = tensor_slice[whole]  # reads only these bytes
                dst[mine].copy_(value)
                del value

    def read(self, name: str) -> Tensor:
        """The whole tensor ``name``."""
        if self._dict is not None:
            return self._dict[name]
        with self._open() as file:
            return file.get_tensor(name).clone()


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded.

    Raised on every rank, with a message that names the files and every offending key.
    Unlike DCP's ``CheckpointException`` (a ``BaseException``), ``except Exception``
    catches it; DCP's exception, when there is one, is its ``__cause__``. A failed save
    never removes the previous checkpoint; a failed load leaves the model and optimizer
    as they were.
    """


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 500 characters (a DCP exception holds
    every rank's traceback; only its first failure is worth repeating)."""
    if isinstance(exc, dcp.api.CheckpointException) and exc.failures:
        rank, (inner, _) = next(iter(sorted(exc.failures.items())))
        return f"on rank {rank}, {_first_line(inner)}"
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= 500 else line[:500] + "..."


def _agree(
    error: Exception | None,
    failed: Callable[[str], str],
    *,
    value: Any = None,
    same: str | None = None,
) -> list[Any]:
    """Raise, on every rank, the first rank's error if any rank has one (one small
    collective). On the rank that failed the original exception is raised, elsewhere a copy
    of it (or a :class:`CheckpointError` with its message when it does not pickle).
    ``failed(cause)`` words the error if the collective itself fails.

    Each rank's ``value`` (picklable) travels with it; every rank's is returned. With
    ``same`` (what the values are, for the message), values that differ between ranks are a
    :class:`CheckpointError` on every rank: a check that guards a collective is agreed over
    every rank that will enter it, so one rank's bad input is the same error everywhere."""
    if not _distributed():
        if error is not None:
            raise error
        return [value]
    mine = (None if error is None else _sendable(error), value)
    every: list[Any] = [None] * dist.get_world_size()
    _coordinate(dist.all_gather_object, every, mine, failed=failed, group=_group())
    if error is not None:
        raise error
    for other, _ in every:
        if other is not None:
            raise other
    values = [v for _, v in every]
    if same is not None and any(v != values[0] for v in values):
        found = ", ".join(f"rank {rank}: {v!r}" for rank, v in enumerate(values))
        raise CheckpointError(failed(f"the ranks do not agree on {same} ({found})"))
    return values


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _meta_error(model: nn.Module, what: str) -> ValueError | None:
    """The error for a model with tensors on the meta device (nothing to read into or
    write from), naming the first few, or ``None``."""
    seen: set[int] = set()
    names = []
    for name, value in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers()
    ):
        if value.is_meta and id(value) not in seen:
            seen.add(id(value))
            names.append(_single_device_name(name))
    if not names:
        return None
    shown = ", ".join(map(repr, names[:4])) + (
        f" and {len(names) - 4} more" if len(names) > 4 else ""
    )
    return ValueError(
        f"{what}: {len(names)} of the model's parameters and buffers are on the meta device "
        f"({shown}), which holds no data. Give this rank's shards memory first, after "
        "parallelize_module: torch_tp.materialize(model) (it also computes non-persistent "
        "buffers such as rotary inv_freq again). Nothing was read or written."
    )


def _sendable(error: Exception) -> Exception:
    """``error``, or a :class:`CheckpointError` with its message if it does not pickle."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - send what can be sent
        return CheckpointError(f"{type(error).__name__}: {error}")
    return error


# ------------------------------------------------------------------------------------------
# The coordination group. Saves and loads coordinate over a gloo group of their own (DCP's
# plans and results, our agreements, CPU broadcasts), created by the first call that needs
# it, on every rank, and reused while it lives. Being ours alone, it can be torn down when
# one of its collectives fails: a rank blocked on a survivor that has given up would
# otherwise wait for the group's timeout (30 minutes by default), while destroying the group
# closes its connections, so that every rank blocked in it fails within moments. The user's
# process groups are never touched. This is the one piece of state this module keeps.
# ------------------------------------------------------------------------------------------

_coordination: dict[str, dist.ProcessGroup] = {}


def _group() -> dist.ProcessGroup:
    """The coordination group (every rank of the default group; a collective to create)."""
    group = _coordination.get("group")
    if group is not None:
        try:
            dist.get_backend(group)  # raises once the group was destroyed (or the world was)
            return group
        except (ValueError, RuntimeError, KeyError):
            _coordination.clear()
    group = dist.new_group(backend="gloo")
    _coordination["group"] = group
    return group


def _coordinate(
    collective: Callable[..., Any], *args: Any, failed: Callable[[str], str], **kwargs: Any
) -> Any:
    """Run ``collective`` (a collective, or DCP's save or load) over the coordination group;
    if a collective in it fails (a rank died, the network broke), tear that group down and
    raise :class:`CheckpointError` (``failed(cause)``). DCP's own ``CheckpointException``,
    which it raises on every rank alike, becomes a :class:`CheckpointError` too."""
    try:
        return collective(*args, **kwargs)
    except dcp.api.CheckpointException as exc:  # agreed on every rank: the group is fine
        raise CheckpointError(failed(_first_line(exc))) from exc
    except Exception as exc:  # noqa: BLE001 - any failure of the collectives themselves
        if not _distributed():
            raise CheckpointError(failed(_first_line(exc))) from exc
        cause = _first_line(exc)
        # the traceback's frames (DCP's among them) hold the group: let them go first
        exc.__traceback__ = None
        _drop_group()
        raise CheckpointError(
            failed(
                f"a collective failed, so a rank has probably died ({cause}); the job cannot "
                "go on in this process group: restart it"
            )
        ) from exc


def _drop_group() -> None:
    group = _coordination.pop("group", None)
    if group is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
        del group


def _single_device_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# ------------------------------------------------------------------------------------------
# Distributed checkpoints (DCP)
# ------------------------------------------------------------------------------------------

_STEP_DIR = re.compile(r"^step-(\d+)$")


def save(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
) -> Path:
    """Save a distributed checkpoint of the model, the optimizer and the RNG streams.

    Every rank writes its own shards in parallel (:func:`torch.distributed.checkpoint.save`,
    each file flushed and fsynced) into ``checkpoint_dir/step-<step>.partial``. When every
    rank is done, rank 0 fsyncs the directory and publishes it with one atomic rename to
    ``checkpoint_dir/step-<step>``. Saving a step that already exists moves the old one
    aside to ``step-<step>.old`` first and deletes it only once the new one is published;
    :func:`load` and :func:`latest_step` read ``step-<step>.old`` while ``step-<step>`` is
    missing, and the next save restores or deletes it. So a crash at any point (a rank
    killed while writing, during the renames, between saves) leaves the previous or the new
    checkpoint loadable, never neither.

    A save that fails raises :class:`CheckpointError` on every rank, saying what failed and
    which step is the latest complete one (the previous checkpoint is intact). When a rank
    dies mid-save the others see a collective fail: they tear down the gloo group that
    saves and loads coordinate over (torch_tp's own, created by the first call, on every
    rank, of any of them that needs one), so that none of them waits for the dead rank, and
    raise within moments. Your process groups are not touched, but a job that lost a rank
    must be restarted.

    The RNG streams (the default generator and the tensor-parallel stream of
    :mod:`torch_tp.random`) are saved per rank when a tracker is installed. Must be called
    on every rank. ``checkpoint_dir`` must be one directory shared by all ranks (one
    filesystem).

    A packed parameter (and its optimizer state) is saved as the plain ``Shard`` DTensor
    with the same global value, so the checkpoint holds the single-device tensor and loads on
    any layout. The conversion all-gathers each such tensor once (DTensor redistributes a
    strided shard through a replicated one): a few tensors per layer, each whole for a
    moment on every rank.

    Args:
        checkpoint_dir (str or os.PathLike): the directory holding the checkpoints.
        model (:class:`nn.Module`): the model (TP, 2-D or single-device).
        optimizer (:class:`torch.optim.Optimizer`, optional): its optimizer.

    Keyword Args:
        step (int): the training step, which names the checkpoint.

    Returns:
        The path of the completed checkpoint.

    Raises:
        CheckpointError: the save failed on some rank (raised on every rank); the previous
            checkpoint is intact.
        ValueError: ``step`` is not a non-negative int, or the model has tensors on the
            meta device (on every rank: the ranks agree on their checks, and on ``step``,
            before anything is written).
        NotImplementedError: a packed parameter whose packed dim FSDP2 shards too (nothing
            is written).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> if step % 1000 == 0:
        ...     torch_tp.checkpoint.save("checkpoints", model, optimizer, step=step)
    """
    root = Path(checkpoint_dir)
    final = root / f"step-{step}"
    what = f"saving step {step} to {str(final)!r}"
    # every rank's checks, agreed before anything is written or gathered
    error = None
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, found {step!r}")
        _raise(_meta_error(model, "save"))
        _refuse_nested_packed(model.state_dict())
    except (ValueError, NotImplementedError) as exc:
        error = exc
    failed = lambda cause: _save_failed(what, root, cause)  # noqa: E731
    _agree(error, failed, value=repr(step), same="the step")
    partial = _staged_name(final)
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _recover(root)
            _staging(final)
        except OSError as exc:
            error = CheckpointError(_save_failed(what, root, f"cannot prepare it: {exc}"))
    _agree(error, failed)
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optim"] = optim_state
    with torch.no_grad():
        state = _map_dtensors(state, _as_plain_shard)  # packed: the same values, as Shard
    rng = _rng_state()
    if rng is not None:
        state["rng"] = rng
    with _single_process_is_intended():
        _coordinate(
            dcp.save,
            state,
            storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
            process_group=_group() if _distributed() else None,
            no_dist=not _distributed(),
            failed=lambda cause: _save_failed(what, root, cause),
        )
    if _rank() == 0:
        try:
            _publish(partial, final)
        except OSError as exc:
            error = CheckpointError(_save_failed(what, root, f"publishing it: {exc}"))
    _agree(error, lambda cause: _save_failed(what, root, cause))
    return final


def _save_failed(what: str, root: Path, cause: str) -> str:
    latest = latest_step(root)
    kept = (
        f"the latest complete checkpoint in {str(root)!r} is step {latest}, intact"
        if latest is not None
        else f"there is no complete checkpoint in {str(root)!r} (there was none before)"
    )
    return f"{what} failed: {cause}. Nothing was lost: {kept}."


def _recover(root: Path) -> None:
    """Finish what DCP saves that crashed while publishing left in ``root``."""
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name.removesuffix(_OLD))
        if entry.name.endswith(_OLD) and match is not None:
            _recover_one(root / match.group(0), _complete)


def _complete(path: Path) -> bool:
    # DCP writes .metadata last, fsynced, by renaming a temporary file into place
    return (path / ".metadata").is_file()


def _step_dir(root: Path, step: int) -> Path | None:
    """The complete checkpoint of ``step``: ``step-<step>``, or, while a save of the same
    step is being published (or crashed while publishing), the ``.old`` one it replaces."""
    return _visible(root / f"step-{step}", _complete)


def load(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    rng: bool = True,
    strict: bool = True,
) -> int | None:
    """Load a checkpoint written by :func:`save`, on any layout, all or nothing.

    The model (and optimizer) may be laid out differently from when it was saved: another
    tensor-parallel size, with or without FSDP2, or a single device. DCP reads each rank's
    new shards from the saved ones. The optimizer must hold the model's parameters (its
    state is created if it has none yet).

    A load either completes or changes nothing. The checkpoint's metadata is checked
    against the model and optimizer first (names, global shapes, dtypes, and that every
    data file holds the bytes the metadata points at); every rank then reads into staging
    tensors (as much memory again as its shards of the model and optimizer state); and only
    when every rank has read everything are the model, the optimizer and the RNG streams
    updated. Any failure (every error listed under ``Raises``) raises on every rank and
    leaves them as they were (an optimizer that had no state is given none).

    Args:
        checkpoint_dir (str or os.PathLike): the directory :func:`save` wrote to.
        model (:class:`nn.Module`): the model to load into, already parallelized.
        optimizer (:class:`torch.optim.Optimizer`, optional): the optimizer to load into.

    Keyword Args:
        step (int, optional): the step to load. Default: the latest complete checkpoint.
        rng (bool, optional): restore each rank's RNG streams. They can only continue on the
            layout they were saved on (the same world size and tensor-parallel size);
            pass ``False`` to keep the current streams, e.g. when changing layouts.
            Default: ``True``.
        strict (bool, optional): raise for checkpoint entries that the model and optimizer
            do not have (e.g. a checkpoint of a deeper model). Entries the checkpoint lacks
            are always an error. Default: ``True``.

    Returns:
        The step loaded, or ``None`` when ``checkpoint_dir`` exists but holds no complete
        checkpoint (nothing is changed then).

    A packed parameter (and its optimizer state) is read into a plain ``Shard`` DTensor and
    redistributed into its packed layout: one all-gather per such tensor, as for
    :func:`save`.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist, or ``step`` was given and
            there is no complete checkpoint for it.
        CheckpointError: the checkpoint does not match the model or optimizer, or cannot
            be read; the message names the files and every offending key.
        ValueError: ``rng`` and the checkpoint has no RNG state for this layout, or the
            model has tensors on the meta device (named).
        NotImplementedError: a packed parameter whose packed dim FSDP2 shards too (nothing
            is changed).

    Every check above is agreed over every rank before any rank reads: a rank that cannot
    see the directory, or sees another latest step than the others, makes every rank raise
    the same error.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> os.makedirs("checkpoints", exist_ok=True)  # a missing directory is an error
        >>> start = torch_tp.checkpoint.load("checkpoints", model, optimizer) or 0
        >>> for step in range(start, total_steps): ...
    """
    root = Path(checkpoint_dir)
    # every rank's own checks and its view of the directory, agreed before any collective:
    # a rank that cannot see the checkpoint, or sees another step, fails every rank alike
    error, path = None, None
    try:
        _raise(_meta_error(model, "load"))
        _refuse_nested_packed(model.state_dict())
        if not root.is_dir():
            raise FileNotFoundError(
                f"no checkpoint directory {str(root)!r} (to start from scratch where there is "
                "no checkpoint yet, create the directory first, or check latest_step())"
            )
        if step is None:
            step = latest_step(root)
        if step is not None:
            path = _step_dir(root, step)
            if path is None:
                raise FileNotFoundError(f"no complete checkpoint for step {step} in {str(root)!r}")
    except (ValueError, NotImplementedError, OSError) as exc:
        error = exc
    _agree(
        error,
        _load_failed(f"loading from {str(root)!r}"),
        value=step,
        same="the step to load (the latest complete checkpoint each rank sees)",
    )
    if step is None:
        return None
    had_state = optimizer is not None and bool(optimizer.state)
    try:
        _load_dcp(path, model, optimizer, rng, strict)
    except BaseException:
        if optimizer is not None and not had_state:
            optimizer.state.clear()  # get_state_dict created it (a step with lr 0)
        raise
    return step


def _load_dcp(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rng: bool,
    strict: bool,
) -> None:
    what = f"loading {str(path)!r}"
    error, staged, rng_key = None, {}, None
    packed: dict[int, DTensor] = {}  # id(plain template) -> the packed tensor it stands for
    try:
        metadata = _read_metadata(path)
        saved = metadata.state_dict_metadata
        model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        if rng:
            rng_key = _rng_key()
            wanted = f"rng.{rng_key}.tp_state"
            if rng_key is None or wanted not in saved:
                layouts = sorted({k.split(".")[1] for k in saved if k.startswith("rng.")})
                raise ValueError(
                    f"the checkpoint at {str(path)!r} has RNG streams for the layouts "
                    f"{layouts or 'none'} (world size x tensor-parallel size), not for this "
                    f"one ({_layout() or 'no RNG tracker'}): the streams cannot continue on "
                    "another layout; pass rng=False to keep the current ones"
                )
            state["rng"] = {rng_key: _empty_rng_entry()}

        def stage(value: Tensor) -> Tensor:
            # packed tensors are read into plain Shard DTensors (the layout save wrote)
            if isinstance(value, DTensor) and _packed_placement(value) is not None:
                plain = dtensor_empty(
                    value.shape,
                    dtype=value.dtype,
                    device_mesh=value.device_mesh,
                    placements=_plain_placements(value),
                )
                packed[id(plain)] = value
                return plain
            return torch.empty_like(value)

        staged = _copy_structure(state, stage)
        flat = _flat_for_dcp(staged, metadata)
    except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
        error, flat = exc, {}
    # A key is unexpected when no rank loads it: the stages of a pipeline each load theirs
    # (one small collective of the names, on every rank, failed or not)
    loaded = _loaded_anywhere(set(flat))
    if error is None:
        try:
            parts = tuple(f"{part}." for part in staged if part != "rng")
            _check_metadata(path, metadata, flat, parts, strict, type(model).__name__, loaded)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
    _agree(error, _load_failed(what))  # one small collective: nobody reads unless all can
    with _single_process_is_intended():
        _coordinate(
            dcp.load,
            staged,
            storage_reader=dcp.FileSystemReader(path),
            process_group=_group() if _distributed() else None,
            no_dist=not _distributed(),
            failed=_load_failed(what),
        )
    # every rank has read everything (DCP gathered every rank's result): apply it
    with torch.no_grad():
        staged = _map_dtensors(
            staged,
            lambda name, v: (
                v.redistribute(packed[id(v)].device_mesh, packed[id(v)].placements)
                if id(v) in packed
                else v
            ),
        )
    set_state_dict(
        model,
        [] if optimizer is None else optimizer,
        model_state_dict=staged["model"],
        optim_state_dict=staged.get("optim", {}),
    )
    if rng_key is not None:
        _restore_rng(staged["rng"][rng_key])


def _load_failed(what: str) -> Callable[[str], str]:
    return lambda cause: f"{what} failed: {cause}. Nothing was changed."


def _read_metadata(path: Path) -> Any:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - unpickling a damaged file fails many ways
        raise CheckpointError(
            f"{str(path / '.metadata')!r} is not a readable DCP metadata file: "
            f"{_first_line(exc)}. Nothing was changed."
        ) from exc


def _copy_structure(state: Any, fn) -> Any:
    """A copy of the nested dicts and lists of ``state`` with every tensor replaced by
    ``fn(tensor)`` and every other leaf kept: DCP loads into it, not into the model."""
    if isinstance(state, Tensor):
        return fn(state)
    if isinstance(state, Mapping):
        return {k: _copy_structure(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_structure(v, fn) for v in state]
    return state


def _flat_for_dcp(state: dict[str, Any], metadata: Any) -> dict[str, Any]:
    """``state`` flattened as ``dcp.load`` flattens it (``{"model.layers.0.wq.weight": ...}``)."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata)
    return dict(planner.state_dict)


def _loaded_anywhere(keys: set[str]) -> set[str]:
    """The keys some rank loads (this rank's alone without a process group)."""
    if not _distributed():
        return keys
    every: list[Any] = [None] * dist.get_world_size(_group())
    dist.all_gather_object(every, sorted(keys), group=_group())
    return {key for part in every for key in part}


def _check_metadata(
    path: Path,
    metadata: Any,
    flat: Mapping[str, Any],
    parts: tuple[str, ...],
    strict: bool,
    model_name: str,
    loaded: set[str],
) -> None:
    """Check this rank's flattened state (:func:`_flatten`) against a checkpoint's metadata
    before reading anything: the names, the global shapes, the dtypes, and the data files'
    sizes. A saved key is unexpected when no rank loads it (``loaded``: every rank's keys),
    so the stages of a pipeline, each holding part of the model, load strictly; entries of
    parts not being loaded (``parts``: ``"model."``, ``"optim."``; the optimizer's, when
    there is none) are not extra."""
    saved = metadata.state_dict_metadata
    missing = [k for k in flat if k not in saved]
    unexpected = [k for k in saved if k not in loaded and k.startswith(parts)]
    mismatched, lossy = [], []
    for key, value in flat.items():
        entry = saved.get(key)
        if entry is None:
            continue
        if isinstance(entry, TensorStorageMetadata) != isinstance(value, Tensor):
            kind = "a tensor" if isinstance(entry, TensorStorageMetadata) else "an object"
            mismatched.append(f"{key}: the checkpoint holds {kind}, the model does not")
        elif isinstance(value, Tensor):
            if tuple(entry.size) != tuple(value.shape):
                mismatched.append(
                    f"{key}: the checkpoint has shape {list(entry.size)}, the model "
                    f"{list(value.shape)}"
                )
            elif _lossy(entry.properties.dtype, value.dtype):
                lossy.append(f"{key} ({entry.properties.dtype} to {value.dtype})")
    errors = []
    if missing:
        errors.append("Missing key(s) in the checkpoint: " + ", ".join(map(repr, missing)) + ".")
    if strict and unexpected:
        errors.append(
            "Unexpected key(s) in the checkpoint (strict=False ignores them): "
            + ", ".join(map(repr, unexpected))
            + "."
        )
    if mismatched:
        errors.append("Size mismatch: " + "; ".join(mismatched) + ".")
    errors += _unreadable_data(path, metadata, set(flat))
    _raise_or_warn(errors, lossy, f"the checkpoint {str(path)!r}", model_name)


def _unreadable_data(path: Path, metadata: Any, keys: set[str]) -> list[str]:
    """The data files that are missing or shorter than the metadata says, with the keys
    that would be read from them."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return []
    needed: dict[str, int] = {}
    readers: dict[str, set[str]] = {}
    for index, info in storage.items():
        fqn, file = getattr(index, "fqn", None), getattr(info, "relative_path", None)
        if fqn not in keys or file is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0) or 0)
        needed[file] = max(needed.get(file, 0), end)
        readers.setdefault(file, set()).add(fqn)
    errors = []
    for file, end in sorted(needed.items()):
        try:
            size = (path / file).stat().st_size
        except OSError:
            size = None
        if size is None or size < end:
            found = "missing" if size is None else f"truncated: {size} of {end} bytes"
            errors.append(
                f"Unreadable data file {str(path / file)!r} ({found}), holding "
                + ", ".join(map(repr, sorted(readers[file])))
                + "."
            )
    return errors


def _plain_placements(value: DTensor) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim % value.ndim) if isinstance(p, StridedShard) else p for p in value.placements
    )


def _as_plain_shard(name: str, value: DTensor) -> DTensor:
    """A packed DTensor as the plain ``Shard`` DTensor with the same global value, which DCP
    can save: DCP takes each rank's shard for one block, which a strided shard is not."""
    if _packed_placement(value) is None:
        return value
    return value.redistribute(value.device_mesh, _plain_placements(value))


def _map_dtensors(state: Any, fn, path: str = "") -> Any:
    """``state`` with each DTensor replaced by ``fn(path, dtensor)``, in a deterministic
    order (every rank calls ``fn`` for the same tensors in the same order). Containers with
    nothing replaced are returned as they are."""
    if isinstance(state, DTensor):
        return fn(path, state)
    if isinstance(state, Mapping):
        out = {k: _map_dtensors(v, fn, f"{path}.{k}" if path else str(k)) for k, v in state.items()}
        if all(out[k] is v for k, v in state.items()):
            return state
        return out
    if isinstance(state, list):
        items = [
            _map_dtensors(v, fn, f"{path}.{i}" if path else str(i)) for i, v in enumerate(state)
        ]
        return state if all(a is b for a, b in zip(items, state, strict=True)) else items
    return state


def latest_step(checkpoint_dir: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint in ``checkpoint_dir``, or ``None``.

    Args:
        checkpoint_dir (str or os.PathLike): the directory :func:`save` writes to.

    Returns:
        The largest ``step`` with a complete checkpoint (``step-<step>``, or the previous
        checkpoint of that step while a new save of it is being published), or ``None``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> torch_tp.checkpoint.latest_step("checkpoints")
        2000
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    steps = {
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _STEP_DIR.match(entry.name.removesuffix(_OLD)))
    }
    return max((step for step in steps if _step_dir(root, step) is not None), default=None)


# The RNG streams are saved per rank, under a key naming the layout and the rank, as
# tensors only (no pickled objects): ``rng.<world>x<tp>.rank<r>.{tp_state, ...}``.


def _layout() -> str | None:
    tracker = tp_random.get_rng_tracker()
    if tracker is None:
        return None
    world = dist.get_world_size() if _distributed() else 1
    tp_size = tracker.tp_size
    return f"{world}x{tp_size}"


def _rng_key() -> str | None:
    layout = _layout()
    return None if layout is None else f"{layout}.rank{_rank()}"


def _rng_state() -> dict[str, dict[str, Tensor]] | None:
    tracker = tp_random.get_rng_tracker()
    key = _rng_key()
    if tracker is None or key is None:
        return None
    state = tracker.state_dict()
    seed = state["seed"] % 2**64
    return {
        key: {
            "tp_state": state["tp_state"],
            "default_state": state["default_state"],
            # int64 holds the bits of a seed in [0, 2**64)
            "seed": torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64),
            "tp_rank": torch.tensor(state["tp_rank"], dtype=torch.int64),
        }
    }


def _empty_rng_entry() -> dict[str, Tensor]:
    tracker = tp_random.get_rng_tracker()
    state = tracker.state_dict()
    return {
        "tp_state": torch.empty_like(state["tp_state"]),
        "default_state": torch.empty_like(state["default_state"]),
        "seed": torch.zeros((), dtype=torch.int64),
        "tp_rank": torch.zeros((), dtype=torch.int64),
    }


def _restore_rng(entry: dict[str, Tensor]) -> None:
    tracker = tp_random.get_rng_tracker()
    tracker.load_state_dict(
        {
            "seed": int(entry["seed"]) % 2**64,
            "tp_rank": int(entry["tp_rank"]),
            "device_type": tracker.device_type,
            "tp_state": entry["tp_state"],
            "default_state": entry["default_state"],
        }
    )


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: so do we."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


# Hugging Face directories, built on the pieces above (imported last: it imports them)
from torch_tp.checkpoint.hf import load_pretrained, save_pretrained  # noqa: E402
