"""Checkpoints of tensor-parallel and 2-D (FSDP2 + TP) models.

Two kinds, for two jobs:

* **Full state dicts** are ordinary ``{name: tensor}`` dicts with the names and values of the
  single-device model: to export weights, to share them, to start a TP job from a
  single-device checkpoint. :func:`full_state_dict` gathers one parameter at a time;
  :func:`load_full_state_dict` loads from memory or from a ``safetensors`` file, each rank
  reading only its own slices.
* **Distributed checkpoints** (:mod:`torch.distributed.checkpoint`, DCP) save each rank's
  shards in parallel, with the optimizer and the RNG streams, and load them on any other
  layout: :func:`save`, :func:`load`, :func:`latest_step`. A save writes a new directory and
  renames it when complete, so a save that fails leaves the previous checkpoint loadable.

Trust: a full state dict is read from ``safetensors`` (no code, only tensors) or from
tensors you pass in; nothing here unpickles a file for it. DCP directories are a different
matter: DCP pickles its metadata and the optimizer's hyperparameters, so load only DCP
checkpoints your own jobs wrote.

Packed parameters (:class:`~torch_tp.PackedColwiseParallel`,
:class:`~torch_tp.PackedRowwiseParallel`) are DTensors with DTensor's strided-shard
placement: each rank holds its slice of each of the packed parts, not one block. On a 1-D
tensor-parallel mesh every function here handles them exactly. Under FSDP2 (a mesh with
more than one dimension) their placements do not say what each rank holds, so every
function here refuses them with ``NotImplementedError`` rather than read or write wrong
values.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor import empty as dtensor_empty
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.modules.module import _IncompatibleKeys

from torch_tp import random as tp_random

__all__ = [
    "full_state_dict",
    "latest_step",
    "load",
    "load_full_state_dict",
    "save",
]

# ``torch.compile`` wraps a module as ``_orig_mod``; the single-device name has no such part
_WRAPPER_PARTS = ("_orig_mod",)


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
        NotImplementedError: a packed parameter under FSDP2 (see the module docstring);
            raised on every rank before anything is gathered.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> state = torch_tp.checkpoint.full_state_dict(model, rank0_only=True)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(state, "model.safetensors")
    """
    keep = not rank0_only or _rank() == 0
    out: dict[str, Tensor] = {}
    state = model.state_dict()
    _refuse_packed_on_nd_mesh(state)
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
) -> _IncompatibleKeys:
    """Load a full (single-device) state dict into a TP or 2-D model.

    Each rank copies only its own slice of each tensor into its shard; nothing is
    redistributed afterwards. The source is one of:

    * a ``safetensors`` file (a path): every rank opens it and reads only its slices
      (``safe_open(...).get_slice``), so no rank ever holds the whole checkpoint;
    * a dict of tensors on every rank (e.g. ``torch.load(path, weights_only=True,
      mmap=True)``): each rank slices it locally, without communication;
    * a dict on rank 0 only, with ``broadcast_from_rank0=True``: rank 0 broadcasts one
      tensor at a time and the other ranks may pass ``None``.

    Before anything is copied, the names and the global shapes are checked against the
    model: missing and unexpected keys (with ``strict``) and any shape mismatch raise
    ``RuntimeError`` naming every key at fault, and the model is left unchanged. Values are
    converted to each parameter's dtype. The model may have been built on the meta device
    and materialized with ``model.to_empty(device=...)``.

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
        RuntimeError: missing or unexpected keys (with ``strict``), or shape mismatches.
        TypeError: ``state_dict`` is neither a mapping nor a path, or holds non-tensors.
        FileNotFoundError: ``state_dict`` is a path with no file.
        NotImplementedError: a parameter whose local shard is not one block of the whole
            tensor (e.g. ``Partial``), or a packed parameter under FSDP2. A packed
            parameter on a 1-D mesh is loaded exactly: its shard is one block per part
            (one ``get_slice`` read each from a ``safetensors`` file).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch.device("meta"):
        ...     model = Llama(config)
        >>> parallelize_module(model, mesh["tp"], llama_plan())
        >>> model.to_empty(device="cuda")
        >>> torch_tp.checkpoint.load_full_state_dict(model, "llama.safetensors")
    """
    targets = {_single_device_name(k): v for k, v in model.state_dict().items()}
    _refuse_packed_on_nd_mesh(targets)  # on every rank, before any communication
    if broadcast_from_rank0:
        return _load_broadcast(model, targets, state_dict, strict)
    source = _Source(state_dict)
    result = _check_keys(model, targets, source.shapes, strict)
    with torch.no_grad():
        for name, target in targets.items():
            if name not in source.shapes:
                continue
            if isinstance(target, DTensor):
                source.copy_to(name, _local_pieces(name, target), target.to_local())
            else:
                source.copy_to(name, None, target)
    return result


def _load_broadcast(
    model: nn.Module,
    targets: dict[str, Tensor],
    state_dict: Mapping[str, Tensor] | str | os.PathLike | None,
    strict: bool,
) -> _IncompatibleKeys:
    rank = _rank()
    # rank 0 opens and checks; every rank then raises the same error, or none does
    verdict: list[Any] = [None]
    if rank == 0:
        try:
            source = _Source(state_dict)
            verdict[0] = _check_keys(model, targets, source.shapes, strict)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            verdict[0] = exc
    if _distributed():
        try:
            dist.broadcast_object_list(verdict, src=0)
        except Exception:  # an exception that does not pickle: send its message
            verdict = [RuntimeError(str(verdict[0]))] if rank == 0 else [None]
            dist.broadcast_object_list(verdict, src=0)
    if isinstance(verdict[0], BaseException):
        raise verdict[0]
    result = _IncompatibleKeys(*verdict[0])
    present = set(targets) - set(result.missing_keys)
    with torch.no_grad():
        for name, target in targets.items():
            if name not in present:
                continue
            local = target.to_local() if isinstance(target, DTensor) else target
            if rank == 0:
                full = source.read(name).to(device=local.device, dtype=local.dtype)
            else:
                full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
            if _distributed():
                dist.broadcast(full, src=0)  # one whole tensor at a time
            if isinstance(target, DTensor):
                for whole, mine in _local_pieces(name, target):
                    local[mine].copy_(full[whole])
            else:
                local.copy_(full)
            del full
    return result


def _check_keys(
    model: nn.Module,
    targets: Mapping[str, Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    strict: bool,
) -> _IncompatibleKeys:
    missing = [name for name in targets if name not in shapes]
    unexpected = [name for name in shapes if name not in targets]
    mismatched = [
        f"{name}: the checkpoint has shape {list(shapes[name])}, the model {list(target.shape)}"
        for name, target in targets.items()
        if name in shapes and tuple(shapes[name]) != tuple(target.shape)
    ]
    errors = []
    if strict and missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(map(repr, missing)) + ".")
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(map(repr, unexpected)) + ".")
    if mismatched:
        errors.append("Size mismatch: " + "; ".join(mismatched) + ".")
    if errors:
        raise RuntimeError(
            f"Error(s) in loading the full state dict into {type(model).__name__}:\n\t"
            + "\n\t".join(errors)
        )
    return _IncompatibleKeys(missing, unexpected)


# A piece: a region of the whole tensor and the region of the local shard it is copied to.
_Piece = tuple[tuple[slice, ...], tuple[slice, ...]]


def _local_pieces(name: str, target: DTensor) -> list[_Piece]:
    """The regions of the whole tensor that this rank's shard of ``target`` holds, and where.

    One piece for a shard that is one block of the whole tensor; for a packed parameter
    (a strided shard on a 1-D mesh), one piece per packed part.
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
    """The pieces of a strided shard on a 1-D mesh: the runs of consecutive indices along
    its dim that this rank holds, found the way DTensor itself splits (on an ``arange``), so
    that the shard equals ``distribute_tensor(full, mesh, [_StridedShard(d, k)])``'s."""
    (placement,) = target.placements
    mesh = target.device_mesh
    dim = placement.dim % target.ndim
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: nothing to hold
        return []
    along = _StridedShard(0, split_factor=placement.split_factor)
    chunks, _ = along._split_tensor(
        torch.arange(target.shape[dim]), mesh.size(), with_padding=False, contiguous=False
    )
    indices = chunks[coordinate[0]].tolist()
    if len(indices) != local_shape[dim]:
        raise NotImplementedError(
            f"{name}: the local shard of shape {list(local_shape)} does not match the "
            f"{list(target.shape)} tensor with placements {target.placements}"
        )
    pieces: list[_Piece] = []
    start = 0  # the local index where the current run begins
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] != indices[i - 1] + 1:
            whole = [slice(0, s) for s in target.shape]
            mine = [slice(0, s) for s in local_shape]
            whole[dim] = slice(indices[start], indices[i - 1] + 1)
            mine[dim] = slice(start, i)
            pieces.append((tuple(whole), tuple(mine)))
            start = i
    return pieces


def _packed_placement(value: DTensor) -> _StridedShard | None:
    """The strided-shard placement of a packed parameter, or ``None``.

    FSDP2 on top of tensor parallelism also uses strided shards: ``_StridedShard(d)`` on
    the data-parallel dim, followed by the tensor-parallel ``Shard(d)``; such a shard is one
    block of the whole tensor. A strided shard that no later ``Shard`` of its dim follows
    is a packed one: its rank holds one slice of each part.
    """
    placements = value.placements
    for i, placement in enumerate(placements):
        if not isinstance(placement, _StridedShard):
            continue
        dim = placement.dim % value.ndim
        if not any(
            type(later) is Shard and later.dim % value.ndim == dim for later in placements[i + 1 :]
        ):
            return placement
    return None


def _refuse_packed_on_nd_mesh(state: Any, path: str = "") -> None:
    """Raise ``NotImplementedError`` for a packed parameter on a mesh of more than one dim.

    Under FSDP2 a packed parameter's placements nest two strided shards that do not describe
    what each rank holds: global values read or written through them would be scrambled.
    """
    for name, value in _dtensors(state, path):
        if value.device_mesh.ndim > 1 and _packed_placement(value) is not None:
            raise NotImplementedError(
                f"{name}: a packed parameter (PackedColwiseParallel / PackedRowwiseParallel, "
                f"placements {value.placements}) on a {value.device_mesh.ndim}-D mesh: packed "
                "styles are not supported under FSDP2 yet, their placements do not describe "
                "what each rank holds; checkpoint the model without FSDP2 (a 1-D "
                "tensor-parallel mesh)"
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


class _Source:
    """A full state dict to read from: a mapping of tensors or a safetensors file.

    ``shapes`` (name to shape) is known up front; only the file's header is read for it.
    """

    def __init__(self, state_dict: Mapping[str, Tensor] | str | os.PathLike | None) -> None:
        self._dict: Mapping[str, Tensor] | None = None
        self._path: Path | None = None
        if isinstance(state_dict, (str, os.PathLike)):
            self._path = Path(state_dict)
            if not self._path.is_file():
                raise FileNotFoundError(f"no safetensors file at {str(self._path)!r}")
            with self._open() as file:  # a file that is not safetensors fails here
                self.shapes = {n: tuple(file.get_slice(n).get_shape()) for n in file.keys()}
        elif isinstance(state_dict, Mapping):
            bad = [k for k, v in state_dict.items() if not isinstance(v, Tensor)]
            if bad:
                raise TypeError(f"the full state dict must hold tensors, found others at {bad}")
            self._dict = state_dict
            self.shapes = {n: tuple(t.shape) for n, t in state_dict.items()}
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
_PARTIAL = ".partial"


def save(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
) -> Path:
    """Save a distributed checkpoint of the model, the optimizer and the RNG streams.

    Every rank writes its own shards in parallel (:func:`torch.distributed.checkpoint.save`)
    into ``checkpoint_dir/step-<step>.partial``; when all ranks are done, rank 0 renames it to
    ``checkpoint_dir/step-<step>``. A save that fails (an exception on any rank, a crash)
    leaves only a ``.partial`` directory, which :func:`load` and :func:`latest_step` ignore:
    the previous checkpoint stays the latest. The RNG streams (the default generator and
    the tensor-parallel stream of :mod:`torch_tp.random`) are saved per rank when a tracker
    is installed. Must be called on every rank. ``checkpoint_dir`` must be one directory
    shared by all ranks (one filesystem).

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
        NotImplementedError: a packed parameter under FSDP2 (nothing is written).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> if step % 1000 == 0:
        ...     torch_tp.checkpoint.save("checkpoints", model, optimizer, step=step)
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, found {step!r}")
    root = Path(checkpoint_dir)
    final = root / f"step-{step}"
    partial = root / f"step-{step}{_PARTIAL}"
    _refuse_packed_on_nd_mesh(model.state_dict())  # before anything is written
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # the leftover of a failed save
    _barrier()
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
        dcp.save(state, checkpoint_id=partial, no_dist=not _distributed())
    _barrier()  # every rank's shards are on disk (dcp.save wrote the metadata last)
    if _rank() == 0:
        if final.exists():  # saving the same step again: the new one wins
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()
    return final


def load(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    rng: bool = True,
) -> int | None:
    """Load a checkpoint written by :func:`save`, on any layout.

    The model (and optimizer) may be laid out differently from when it was saved: another
    tensor-parallel size, with or without FSDP2, or a single device. DCP reads each rank's
    new shards from the saved ones. The optimizer must hold the model's parameters (its
    state is created if it has none yet).

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

    Returns:
        The step loaded, or ``None`` when ``checkpoint_dir`` holds no complete checkpoint
        (nothing is changed then).

    A packed parameter (and its optimizer state) is read into a plain ``Shard`` DTensor and
    redistributed into it in place: one all-gather per such tensor, as for :func:`save`.

    Raises:
        FileNotFoundError: ``step`` was given and there is no complete checkpoint for it.
        ValueError: ``rng`` and the checkpoint has no RNG state for this layout.
        NotImplementedError: a packed parameter under FSDP2 (nothing is changed).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> start = torch_tp.checkpoint.load("checkpoints", model, optimizer) or 0
        >>> for step in range(start, total_steps): ...
    """
    root = Path(checkpoint_dir)
    if step is None:
        step = latest_step(root)
        if step is None:
            return None
    path = root / f"step-{step}"
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete checkpoint for step {step} in {str(root)!r}")
    _refuse_packed_on_nd_mesh(model.state_dict())
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optim"] = optim_state
    rng_key = None
    if rng:
        rng_key = _rng_key()
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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
    # packed tensors are read into plain Shard templates (the layout save wrote), then
    # redistributed into the packed tensors in place
    packed: dict[int, tuple[DTensor, DTensor]] = {}

    def template(name: str, value: DTensor) -> DTensor:
        if _packed_placement(value) is None:
            return value
        plain = dtensor_empty(
            value.shape,
            dtype=value.dtype,
            device_mesh=value.device_mesh,
            placements=_plain_placements(value),
        )
        packed[id(plain)] = (plain, value)
        return plain

    state = _map_dtensors(state, template)
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    with torch.no_grad():
        for plain, value in packed.values():  # in the same order on every rank
            value.to_local().copy_(
                plain.redistribute(value.device_mesh, value.placements).to_local()
            )
    state = _map_dtensors(state, lambda name, v: packed[id(v)][1] if id(v) in packed else v)
    set_state_dict(
        model,
        [] if optimizer is None else optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    if rng_key is not None:
        _restore_rng(state["rng"][rng_key])
    return step


def _plain_placements(value: DTensor) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim % value.ndim) if isinstance(p, _StridedShard) else p for p in value.placements
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
        The largest ``step`` with a complete ``step-<step>`` checkpoint, or ``None``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> torch_tp.checkpoint.latest_step("checkpoints")
        2000
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    steps = [
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _STEP_DIR.match(entry.name)) and (entry / ".metadata").is_file()
    ]
    return max(steps, default=None)


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


def _barrier() -> None:
    if _distributed():
        dist.barrier()
