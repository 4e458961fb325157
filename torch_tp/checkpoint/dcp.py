"""Distributed checkpoints (:mod:`torch.distributed.checkpoint`, DCP): each rank saves its
shards in parallel, with the optimizer and the RNG streams, in ``step-N`` directories
published atomically; :func:`load` reads them on any other layout; :func:`latest_step`
finds the newest complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor import empty as dtensor_empty

from torch_tp import random as tp_random
from torch_tp._buffers import put_buffers, stale_buffers
from torch_tp._torch_compat import StridedShard, compute_local_shape_and_global_offset
from torch_tp.checkpoint._publishing import (
    OLD_SUFFIX,
    begin_save,
    end_save,
    publish,
    recover_if_idle,
    target_name,
    visible_checkpoint,
)
from torch_tp.checkpoint._staging import (
    CheckpointError,
    agree,
    agree_identity,
    coordination_group,
    first_line,
    global_rank,
    held_indices,
    is_distributed,
    is_lossy,
    load_failed,
    meta_error,
    model_tensors,
    named_dtensors,
    packed_mesh_dim,
    packed_placement,
    raise_if_error,
    raise_or_warn,
    refuse_nested_packed,
    run_coordinated,
)

__all__ = ["latest_step", "load", "save"]

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
    each file fsynced) into a staging directory of this save alone; once every rank is
    done, rank 0 publishes it with one atomic rename to ``checkpoint_dir/step-<step>``
    (an existing step is moved aside to ``step-<step>.old`` until then), so a crash at any
    point leaves the previous or the new checkpoint loadable, never neither. One save of a
    step at a time: rank 0 first claims it (``step-<step>.claim``); saves of other steps go
    on meanwhile. The RNG streams (:mod:`torch_tp.random`) are saved per rank when a
    tracker is installed; a packed parameter (and its optimizer state) is saved as the
    plain ``Shard`` DTensor with the same global value (one all-gather each), so the
    checkpoint loads on any layout. Must be called on every rank, with one
    ``checkpoint_dir`` shared by all ranks (one filesystem). See the guide's "Distributed
    checkpoints" and "Concurrent saves" (``docs/two_d_and_checkpoints.md``).

    Args:
        checkpoint_dir (str or os.PathLike): the directory holding the checkpoints.
        model (:class:`nn.Module`): the model (TP, 2-D or single-device).
        optimizer (:class:`torch.optim.Optimizer`, optional): its optimizer.

    Keyword Args:
        step (int): the training step, which names the checkpoint.

    Returns:
        The path of the completed checkpoint.

    Raises:
        CheckpointError: the save failed on some rank (saying what failed and which step is
            the latest complete one; when a rank dies mid-save the others raise within
            moments, and the job must be restarted), or another live save of the step, from
            this job or any other, holds it (naming that writer: host, process id, save id;
            nothing is written). Raised on every rank; the previous checkpoint is intact.
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
        raise_if_error(meta_error(model, "save"))
        own = model_tensors(model)  # no gather before the agreement (hosted adapters)
        refuse_nested_packed(own)
        _refuse_misplaced_chunks(own)
    except (ValueError, NotImplementedError) as exc:
        error = exc
    failed = lambda cause: _save_failed(what, root, cause)  # noqa: E731
    agree(error, failed, value=repr(step), same="the step")
    # rank 0 claims the step (refused while another save of it is in progress), and every
    # rank learns the staging directory of this save alone
    claim, partial = None, None
    if global_rank() == 0:
        try:
            claim, partial = begin_save(final, _complete, failed)
            _recover(root, final)
        except (OSError, CheckpointError) as exc:
            if claim is not None:
                end_save(claim, partial)
                claim = None
            error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(failed(f"cannot prepare it: {exc}"))
            )
    partial = root / agree(error, failed, value=partial and partial.name)[0]
    try:
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
            run_coordinated(
                dcp.save,
                state,
                storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
                process_group=coordination_group() if is_distributed() else None,
                no_dist=not is_distributed(),
                failed=failed,
            )
        if claim is not None:
            try:
                publish(partial, final)
            except OSError as exc:
                error = CheckpointError(failed(f"publishing it: {exc}"))
            finally:  # before the last agreement: whoever saves next finds the step free
                end_save(claim, partial)
                claim = None
        agree(error, failed)
    finally:
        if claim is not None:  # a collective failed: nothing of this save is left behind
            end_save(claim, partial)
    return final


def _save_failed(what: str, root: Path, cause: str) -> str:
    latest = latest_step(root)
    kept = (
        f"the latest complete checkpoint in {str(root)!r} is step {latest}, intact"
        if latest is not None
        else f"there is no complete checkpoint in {str(root)!r} (there was none before)"
    )
    return f"{what} failed: {cause}. Nothing was lost: {kept}."


def _recover(root: Path, final: Path) -> None:
    """Finish what crashed DCP saves of other steps than ``final`` (claimed) left in
    ``root``: a publication cut short, staging directories. A step another live job is
    saving now is left alone (see :func:`recover_if_idle`)."""
    steps = {target_name(entry.name) for entry in root.iterdir()} - {None, final.name}
    for name in sorted(steps):
        if _STEP_DIR.match(name):
            recover_if_idle(root / name, _complete)


def _complete(path: Path) -> bool:
    # DCP writes .metadata last, fsynced, by renaming a temporary file into place
    return (path / ".metadata").is_file()


def _step_dir(root: Path, step: int) -> Path | None:
    """The complete checkpoint of ``step``: ``step-<step>``, or, while a save of the same
    step is being published (or crashed while publishing), the ``.old`` one it replaces."""
    return visible_checkpoint(root / f"step-{step}", _complete)


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
    tensor-parallel size, with or without FSDP2, or a single device. The optimizer must
    hold the model's parameters (its state is created if it has none yet). The metadata is
    checked against the model and optimizer first, every rank reads into staging tensors
    (as much memory again as its shards), and the model, the optimizer and the RNG streams
    change only once every rank has read everything: any failure (every error below) raises
    on every rank and changes nothing. Every check is agreed over every rank before any
    rank reads. A packed parameter is read as a plain ``Shard`` DTensor and redistributed
    into its packed layout (one all-gather each). See the guide's "Distributed
    checkpoints" (``docs/two_d_and_checkpoints.md``).

    Args:
        checkpoint_dir (str or os.PathLike): the directory :func:`save` wrote to.
        model (:class:`nn.Module`): the model to load into, already parallelized.
        optimizer (:class:`torch.optim.Optimizer`, optional): the optimizer to load into.

    Keyword Args:
        step (int, optional): the step to load. Default: the latest complete checkpoint.
        rng (bool, optional): restore each rank's RNG streams. They continue only on the
            layout they were saved on: the same world size and tensor-parallel size, and
            every rank where it stood in the RNG tracker's mesh (compared from the metadata
            before anything is read); pass ``False`` to keep the current streams, e.g. when
            changing layouts. Default: ``True``.
        strict (bool, optional): raise for checkpoint entries that the model and optimizer
            do not have (e.g. a checkpoint of a deeper model). Entries the checkpoint lacks
            are always an error. Default: ``True``.

    Returns:
        The step loaded, or ``None`` when ``checkpoint_dir`` exists but holds no complete
        checkpoint (nothing is changed then).

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist, or ``step`` was given and
            there is no complete checkpoint for it.
        CheckpointError: the checkpoint does not match the model or optimizer, or cannot
            be read (the message names the files and every offending key); or the ranks
            were given different checkpoints (DCP's id of the save differs; copies of one
            checkpoint have the same). With ``rng``, a checkpoint with no RNG streams for
            this layout, or saved on another arrangement of the mesh: this one is a
            ``ValueError`` too, as it was before.
        ValueError: the model has tensors on the meta device (named), or non-persistent
            buffers that ``model.to_empty()`` left uninitialised and that cannot be computed
            again (named: use :func:`torch_tp.materialize`). Those that can be (rotary
            tables) are computed again, as :func:`torch_tp.materialize` does, with a warning.
        NotImplementedError: a packed parameter whose packed dim FSDP2 shards too (nothing
            is changed).

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
        raise_if_error(meta_error(model, "load"))
        own = model_tensors(model)  # no gather before the agreement (hosted adapters)
        refuse_nested_packed(own)
        _refuse_misplaced_chunks(own)
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
    agree(
        error,
        load_failed(f"loading from {str(root)!r}"),
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
    error, staged, rng_key, moved, identity, buffers = None, {}, None, None, "", []
    packed: dict[int, DTensor] = {}  # id(plain template) -> the packed tensor it stands for
    try:
        metadata = _read_metadata(path)
        saved = metadata.state_dict_metadata
        identity = _save_identity(metadata)
        buffers = stale_buffers(model, "load")  # what to_empty() left in non-persistent ones
        model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        if rng:
            rng_key = _rng_key()
            wanted = f"rng.{rng_key}.tp_state"
            if rng_key is None or wanted not in saved:
                layouts = sorted({k.split(".")[1] for k in saved if k.startswith("rng.")})
                raise _RNGLayoutError(
                    f"the checkpoint at {str(path)!r} has RNG streams for the layouts "
                    f"{layouts or 'none'} (world size x tensor-parallel size), not for this "
                    f"one ({_layout() or 'no RNG tracker'}): the streams cannot continue on "
                    "another layout; pass rng=False to keep the current ones"
                )
            moved = _moved_rank(saved, rng_key)
            state["rng"] = {rng_key: _empty_rng_entry()}

        def stage(value: Tensor) -> Tensor:
            # packed tensors are read into plain Shard DTensors (the layout save wrote)
            if isinstance(value, DTensor) and packed_placement(value) is not None:
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
    # one small collective: nobody reads unless all can
    moves = agree(error, load_failed(what), value=moved)
    # every rank reads the same save: ranks given different directories (or a step saved
    # again between two ranks' reads of its metadata) would load a mixture
    agree_identity(identity, repr(str(path)))
    # the RNG streams continue only where each rank stands where it stood when they were
    # saved; refused on every rank alike, before anything is read
    moves = [f"rank {rank}: {move}" for rank, move in enumerate(moves) if move is not None]
    if moves:
        raise _RNGLayoutError(
            load_failed(what)(
                "the RNG streams were saved on another arrangement of the mesh ("
                + "; ".join(moves)
                + "): they cannot continue here; pass rng=False to keep the current ones"
            )
        )
    with _single_process_is_intended():
        run_coordinated(
            dcp.load,
            staged,
            storage_reader=dcp.FileSystemReader(path),
            process_group=coordination_group() if is_distributed() else None,
            no_dist=not is_distributed(),
            failed=load_failed(what),
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
    put_buffers(buffers)
    if rng_key is not None:
        _restore_rng(staged["rng"][rng_key])


def _save_identity(metadata: Any) -> str:
    """What tells one save from another: the id DCP gives each save (a fresh UUID, kept in
    the metadata, so a copy of a checkpoint keeps it); failing that (a checkpoint written
    without one), a hash of every entry's name, shape, dtype and where its bytes are."""
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    if save_id:
        return f"save {save_id}"
    entries = sorted((str(k), repr(v)) for k, v in metadata.state_dict_metadata.items())
    storage = getattr(metadata, "storage_data", None) or {}
    places = sorted((repr(k), repr(v)) for k, v in storage.items())
    return "metadata " + hashlib.sha256(repr((entries, places)).encode()).hexdigest()


def _read_metadata(path: Path) -> Any:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - unpickling a damaged file fails many ways
        raise CheckpointError(
            f"{str(path / '.metadata')!r} is not a readable DCP metadata file: "
            f"{first_line(exc)}. Nothing was changed."
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
    if not is_distributed():
        return keys
    every: list[Any] = [None] * dist.get_world_size(coordination_group())
    dist.all_gather_object(every, sorted(keys), group=coordination_group())
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
            elif is_lossy(entry.properties.dtype, value.dtype):
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
    raise_or_warn(errors, lossy, f"the checkpoint {str(path)!r}", model_name)


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
    """The placements of a packed DTensor with its packed (strided) placement made a plain
    ``Shard``. FSDP2's strided shards (a strided shard that a later ``Shard`` of its dim
    follows) stay: with them each rank's shard is one block already."""
    packed = packed_mesh_dim(value)
    return tuple(
        Shard(p.dim % value.ndim) if i == packed else p for i, p in enumerate(value.placements)
    )


def _refuse_misplaced_chunks(state: Any) -> None:
    """Raise ``NotImplementedError`` for a DTensor whose shard on this rank DCP would place
    elsewhere in the whole tensor than the rank holds it.

    DCP reads and writes each rank's shard at the offset torch computes from the placements.
    For FSDP2's strided shards of an unevenly split dim (torch 2.13: a 1001-row embedding
    over ``tp=2`` and four FSDP2 ranks) that offset and size differ from what FSDP2 holds:
    saving would overlap chunks and loading would read the wrong rows. Called on every rank;
    the caller agrees the error.
    """
    for name, value in named_dtensors(state):
        if not any(isinstance(p, StridedShard) for p in value.placements):
            continue
        coordinate = value.device_mesh.get_coordinate()
        if coordinate is None:
            continue
        plain = _plain_placements(value)
        held = held_indices(value, coordinate)
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, plain)
        for dim, indices in enumerate(held):
            if len(indices) == 0:
                continue
            wanted = torch.arange(int(indices[0]), int(indices[0]) + len(indices))
            if not torch.equal(indices, wanted):
                continue  # a packed dim: saved through the plain placements
            if (offset[dim], shape[dim]) != (int(indices[0]), len(indices)):
                raise NotImplementedError(
                    f"{name}: rank {global_rank()} holds indices "
                    f"{int(indices[0])}..{int(indices[-1])} of dim {dim} of the "
                    f"{list(value.shape)} tensor (placements "
                    f"{value.placements}), but torch {torch.__version__} would save and load "
                    f"{shape[dim]} from index {offset[dim]}: a dim split unevenly by FSDP2 "
                    "on top of tensor parallelism is not placed right by DCP. Make its size "
                    "a multiple of the number of ranks that split it (e.g. pad the "
                    "vocabulary), or save a full state dict (full_state_dict)"
                )


def _as_plain_shard(name: str, value: DTensor) -> DTensor:
    """A packed DTensor as the plain ``Shard`` DTensor with the same global value, which DCP
    can save: DCP takes each rank's shard for one block, which a strided shard is not."""
    if packed_placement(value) is None:
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
        if (match := _STEP_DIR.match(entry.name.removesuffix(OLD_SUFFIX)))
    }
    return max((step for step in steps if _step_dir(root, step) is not None), default=None)


# The RNG streams are saved per rank, under a key naming the layout and the rank, as
# tensors only (no pickled objects): ``rng.<world>x<tp>.rank<r>.{tp_state, ...}``. Where the
# rank stood in the mesh is part of a key, so that a load reads it from the metadata alone,
# before anything: ``rng.<world>x<tp>.rank<r>.mesh.<where>`` (see _where).


class _RNGLayoutError(CheckpointError, ValueError):
    """The RNG streams of a checkpoint belong to another layout (a ``CheckpointError``,
    and a ``ValueError`` as :func:`load` raised before)."""


def _layout() -> str | None:
    tracker = tp_random.get_rng_tracker()
    if tracker is None:
        return None
    world = dist.get_world_size() if is_distributed() else 1
    tp_size = tracker.tp_size
    return f"{world}x{tp_size}"


def _rng_key() -> str | None:
    layout = _layout()
    return None if layout is None else f"{layout}.rank{global_rank()}"


def _where() -> str:
    """Where this rank stands in the mesh of the RNG tracker (``torch_tp.random``): the mesh's
    dim names and this rank's coordinate along each, of its size, and the global ranks of
    its tensor-parallel group in order, e.g. ``dp=0/2,tp=1/2;tp-group=0,1``."""
    tracker = tp_random.get_rng_tracker()
    mesh = tracker._mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    coordinate = mesh.get_coordinate()
    dims = ",".join(
        f"{name}={at}/{size}" for name, at, size in zip(names, coordinate, mesh.shape, strict=True)
    )
    return f"{dims};tp-group=" + ",".join(map(str, tracker._group[1]))


def _moved_rank(saved: Mapping[str, Any], rng_key: str) -> str | None:
    """How this rank stands elsewhere in the mesh than when its RNG streams were saved (from
    the metadata's keys alone), or ``None`` where it stands where it stood."""
    prefix = f"rng.{rng_key}.mesh."
    found = [key[len(prefix) :] for key in saved if key.startswith(prefix)]
    here = _where()
    if not found:
        return f"saved without where it stood in the mesh (by an older torch_tp), here {here}"
    return None if found[0] == here else f"saved at {found[0]}, here at {here}"


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
            # the key says where this rank stood (a load reads it from the metadata)
            "mesh": {_where(): torch.tensor(state["tp_rank"], dtype=torch.int64)},
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
