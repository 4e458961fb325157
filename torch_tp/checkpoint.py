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
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
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

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> state = torch_tp.checkpoint.full_state_dict(model, rank0_only=True)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(state, "model.safetensors")
    """
    keep = not rank0_only or _rank() == 0
    out: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
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
            tensor (e.g. ``Partial``).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch.device("meta"):
        ...     model = Llama(config)
        >>> parallelize_module(model, mesh["tp"], llama_plan())
        >>> model.to_empty(device="cuda")
        >>> torch_tp.checkpoint.load_full_state_dict(model, "llama.safetensors")
    """
    targets = {_single_device_name(k): v for k, v in model.state_dict().items()}
    if broadcast_from_rank0:
        return _load_broadcast(model, targets, state_dict, strict)
    source = _Source(state_dict)
    result = _check_keys(model, targets, source.shapes, strict)
    with torch.no_grad():
        for name, target in targets.items():
            if name not in source.shapes:
                continue
            if isinstance(target, DTensor):
                source.copy_to(name, _local_region(name, target), target.to_local())
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
                full = full[_local_region(name, target)]
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


def _local_region(name: str, target: DTensor) -> tuple[slice, ...]:
    """The block of the whole tensor that this rank's shard of ``target`` holds."""
    if any(isinstance(p, Partial) for p in target.placements):
        raise NotImplementedError(
            f"{name}: cannot load a full tensor into a Partial DTensor ({target.placements})"
        )
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    local_shape = tuple(target.to_local().shape)
    if tuple(shape) != local_shape:
        raise NotImplementedError(
            f"{name}: the local shard of shape {list(local_shape)} is not one block of the "
            f"{list(target.shape)} tensor with placements {target.placements}"
        )
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


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

    def copy_to(self, name: str, region: tuple[slice, ...] | None, dst: Tensor) -> None:
        """Copy the whole tensor ``name`` (``region=None``), or just ``region`` of it, into
        ``dst``."""
        if self._dict is not None:
            value = self._dict[name]
            dst.copy_(value if region is None else value[region])
            return
        # Open the file for each tensor: safetensors maps the file, and the pages a read
        # touches stay resident in this process while the mapping lives. Closing it after
        # each tensor keeps that to one tensor's pages (all of them for a column slice).
        with self._open() as file:
            if not region:
                value = file.get_tensor(name)
            else:
                value = file.get_slice(name)[region]  # reads only these bytes
            dst.copy_(value)
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

    Args:
        checkpoint_dir (str or os.PathLike): the directory holding the checkpoints.
        model (:class:`nn.Module`): the model (TP, 2-D or single-device).
        optimizer (:class:`torch.optim.Optimizer`, optional): its optimizer.

    Keyword Args:
        step (int): the training step, which names the checkpoint.

    Returns:
        The path of the completed checkpoint.

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
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # the leftover of a failed save
    _barrier()
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optim"] = optim_state
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

    Raises:
        FileNotFoundError: ``step`` was given and there is no complete checkpoint for it.
        ValueError: ``rng`` and the checkpoint has no RNG state for this layout.

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
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    set_state_dict(
        model,
        [] if optimizer is None else optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    if rng_key is not None:
        _restore_rng(state["rng"][rng_key])
    return step


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
