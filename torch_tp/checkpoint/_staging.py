"""Staging and agreeing: what every reader and writer of :mod:`torch_tp.checkpoint` shares
(publishing, the one routine every writer goes through, is
:mod:`torch_tp.checkpoint._publishing`'s).

* **Staging**: a load reads into buffers (:func:`stage_local`) after checking every key,
  shape and dtype (:func:`check_keys`), and copies them into the model
  (:func:`copy_staged`) only once every rank has read everything.
* **Pieces**: the regions of a whole tensor a rank's shard holds (:func:`local_pieces`),
  strided-shard (packed) placements included.
* **Agreement**: :class:`CheckpointError`, and :func:`agree`, by which every rank learns
  whether any failed before anything changes, over a gloo group of the checkpoints' own.

A private module: its names without an underscore are what the other modules of
:mod:`torch_tp.checkpoint` use, none of them torch_tp's API (``__all__`` is empty).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import pickle
import warnings
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Shard

from torch_tp import _torch_compat as compat
from torch_tp._torch_compat import (
    IncompatibleKeys,
    StridedShard,
)

__all__: list[str] = []


class Source(Protocol):
    """What staging reads a full state dict from (a mapping of tensors, a safetensors file:
    :class:`torch_tp.checkpoint.safetensors.StateDictSource`)."""

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype | str]
    description: str

    def copy_to(self, name: str, pieces: list[Piece] | None, dst: Tensor) -> None:
        """Copy the tensor ``name`` (only ``pieces`` of it, if given) into ``dst``."""


# ``torch.compile`` wraps a module and holds it under this name; the single-device name has no
# such part
_WRAPPER_PARTS = (compat.COMPILED_MODULE_NAME,)


def stage_local(
    source: Source,
    targets: Mapping[str, Tensor],
    result: IncompatibleKeys,
    threads: int = 1,
    mapped: Callable[[str, list[Piece] | None, Tensor], Tensor | None] | None = None,
) -> dict[str, Tensor]:
    """Read this rank's part of every present tensor into new buffers; raise naming every
    tensor that could not be read. With ``threads`` > 1, that many tensors are read at a
    time (for a source whose ``copy_to`` may run in several threads at once: reads from
    files release the GIL). ``mapped(name, pieces, local)``, where given, is tried first: a
    tensor of ``local``'s shape, dtype and strides that views the source's memory (a file
    mapped copy-on-write), or ``None`` (then it is read into a buffer)."""
    skip = set(result.missing_keys)
    work = []
    for name, target in targets.items():
        if name in skip:
            continue
        local = target.to_local() if isinstance(target, DTensor) else target
        pieces = local_pieces(name, target) if isinstance(target, DTensor) else None
        work.append((name, pieces, local))
    staged: dict[str, Tensor] = {}

    def read(item: tuple[str, list[Piece] | None, Tensor]) -> str | None:
        name, pieces, local = item
        try:
            view = None if mapped is None else mapped(name, pieces, local)
            if view is None:
                view = torch.empty_like(local)
                source.copy_to(name, pieces, view)
            staged[name] = view
        except Exception as exc:  # noqa: BLE001 - collected, raised below with every key
            found = getattr(source, "describe", lambda name: "")(name)
            return f"{name!r}{f' ({found})' if found else ''}: {first_line(exc)}"
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
    return {name: staged[name] for name, _, _ in work}


def copy_staged(
    targets: Mapping[str, Tensor], staged: dict[str, Tensor], mapped: Container[str] = ()
) -> None:
    """Put every staged tensor into the model, freeing each once in (so that the peak stays
    near one copy of the shard when the model's memory is untouched).

    A staged tensor's memory becomes the model tensor's (``set_``, no copy) where ``targets``
    holds the model's own tensors (``state_dict(keep_vars=True)``), the model tensor's memory
    is its alone, and the staged tensor, of the same strides, is a buffer no other tensor
    shares or, by name in ``mapped``, a view of a file mapped copy-on-write for this load
    (which only the reader that made it also holds, and never writes): nothing else can see
    the memory swapped out (no view of it, no FSDP2 shard inside a padded flat buffer).
    Elsewhere it is copied."""
    with torch.no_grad():
        for name in list(staged):
            target = targets[name]
            local = compat.local_tensor(target) if isinstance(target, DTensor) else target
            tensor = staged.pop(name)
            mine = name in mapped or _alone(tensor)
            if mine and _alone(local) and local.stride() == tensor.stride():
                local.set_(
                    tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
                )
            else:
                local.copy_(tensor)


def _alone(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its memory, and spans all of it."""
    storage = tensor.untyped_storage()
    return (
        tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and compat.sole_owner(tensor)
    )


def check_keys(
    model: nn.Module, targets: Mapping[str, Tensor], source: Source, strict: bool
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
        elif is_lossy(dtype, target.dtype):
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
    raise_or_warn(errors, lossy, source.description, type(model).__name__)
    return IncompatibleKeys(missing, unexpected)


def raise_or_warn(errors: list[str], lossy: list[str], source: str, model_name: str) -> None:
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


def is_lossy(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting ``src`` values to ``dst`` can lose precision or range."""
    if src == dst or src == torch.bool:
        return False
    if dst == torch.bool or (src.is_complex and not dst.is_complex):
        return True
    if not (src.is_floating_point or src.is_complex):  # integers
        s = torch.iinfo(src)
        if dst.is_floating_point or dst.is_complex:
            # exact while every integer fits the significand (int16 into float32, not int32):
            # eps = 2**(1 - digits)
            d = torch.finfo(dst.to_real() if dst.is_complex else dst)
            digits = round(-math.log2(d.eps)) + 1
            return max(-s.min, s.max) > 2**digits or d.max < s.max
        d = torch.iinfo(dst)
        return d.min > s.min or d.max < s.max
    if not (dst.is_floating_point or dst.is_complex):
        return True  # floating point to integer
    s = torch.finfo(src.to_real() if src.is_complex else src)
    d = torch.finfo(dst.to_real() if dst.is_complex else dst)
    return d.eps > s.eps or d.max < s.max or d.tiny > s.tiny


# A piece: a region of the whole tensor and the region of the local shard it is copied to.
Piece = tuple[tuple[slice, ...], tuple[slice, ...]]


def local_pieces(name: str, target: DTensor) -> list[Piece]:
    """The regions of the whole tensor that this rank's shard of ``target`` holds, and where.

    One piece for a shard that is one block of the whole tensor; for a packed parameter
    (a strided shard, e.g. a packed part's slice or each expert's gate and up slices), one
    piece per block of the index sets it holds along each dim (see :func:`held_indices`).
    """
    if any(isinstance(p, Partial) for p in target.placements):
        raise NotImplementedError(
            f"{name}: cannot load a full tensor into a Partial DTensor ({target.placements})"
        )
    local_shape = tuple(target.to_local().shape)
    coordinate = target.device_mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: nothing to hold
        return []
    held = held_indices(target, coordinate)
    runs_per_dim: list[list[tuple[slice, slice]]] = []
    for dim, indices in enumerate(held):
        if len(indices) != local_shape[dim]:
            raise NotImplementedError(
                f"{name}: the local shard of shape {list(local_shape)} does not match the "
                f"{list(target.shape)} tensor with placements {target.placements}"
            )
        runs_per_dim.append(consecutive_runs(indices.tolist()))
    return [
        (tuple(whole for whole, _ in runs), tuple(mine for _, mine in runs))
        for runs in itertools.product(*runs_per_dim)
    ]


def held_indices(target: DTensor, coordinate: list[int]) -> list[Tensor]:
    """The indices of the whole tensor, along each dim, that the rank at ``coordinate`` of
    ``target``'s mesh holds: its shard is their product.

    Each dim's indices are found the way DTensor and FSDP2 split it, on an ``arange``, so that
    the shard equals ``distribute_tensor(full, mesh, placements)``'s, uneven sizes included:

    * a ``Shard`` splits the indices as ``torch.chunk`` does, in mesh order;
    * FSDP2's strided shard (``StridedShard(d, sf)`` that later ``Shard(d)`` of ``sf``
      ranks in all follow) chunks what those later shards leave, so it is applied after them
      (FSDP2 shards each tensor-parallel shard);
    * any other strided shard (a packed parameter's) is applied in mesh order as DTensor
      splits it: one slice of each of its ``sf`` parts.

    Each dim's split is independent of the others' (:func:`refuse_nested_packed` refuses a
    packed dim that another mesh dim splits too).
    """
    mesh = target.device_mesh
    placements = target.placements
    held = [torch.arange(size) for size in target.shape]
    deferred: list[int] = []  # FSDP2's strided shards, each applied after its dim's shards
    order = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, StridedShard) and _is_fsdp_strided(target, mesh_dim):
            deferred.append(mesh_dim)
        elif isinstance(placement, (Shard, StridedShard)):
            order.append(mesh_dim)
    for mesh_dim in order + deferred[::-1]:
        placement = placements[mesh_dim]
        dim = placement.dim % target.ndim
        along = (
            StridedShard(0, split_factor=placement.split_factor)
            if isinstance(placement, StridedShard) and mesh_dim not in deferred
            else Shard(0)
        )
        chunks = compat.shard_split_tensor(along, held[dim], mesh.size(mesh_dim), contiguous=False)
        held[dim] = chunks[coordinate[mesh_dim]]
    return held


def _is_fsdp_strided(target: DTensor, mesh_dim: int) -> bool:
    """Whether ``target.placements[mesh_dim]``, a strided shard, is FSDP2's: later plain
    shards of its dim follow it, over ``split_factor`` ranks in all."""
    placements = target.placements
    dim = placements[mesh_dim].dim % target.ndim
    later = [
        target.device_mesh.size(i)
        for i in range(mesh_dim + 1, len(placements))
        if type(placements[i]) is Shard and placements[i].dim % target.ndim == dim
    ]
    return bool(later) and placements[mesh_dim].split_factor == math.prod(later)


def full_tensor(value: DTensor) -> Tensor:
    """``value.full_tensor()`` (a collective over ``value``'s mesh), gathered here where a
    placement is a strided shard.

    torch's redistribution cannot gather every strided layout (torch 2.13: experts split
    over ``ep`` and sharded by FSDP2 over ``dp`` fail its unpadding check), so each rank's
    shard is all-gathered over each mesh dim that splits the tensor and put in place by the
    indices it holds (:func:`held_indices`): what ``distribute_tensor`` would have given it.
    """
    placements = value.placements
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if (
        coordinate is None
        or not any(isinstance(p, StridedShard) for p in placements)
        or any(isinstance(p, Partial) for p in placements)
    ):
        return value.full_tensor()
    local = value.to_local()
    split = [isinstance(p, (Shard, StridedShard)) for p in placements]
    # every coordinate along the mesh dims that split the tensor (its own along the others)
    ranges = [range(mesh.size(d)) if split[d] else [coordinate[d]] for d in range(mesh.ndim)]
    coordinates = [list(c) for c in itertools.product(*ranges)]
    held = [[ix.to(local.device) for ix in held_indices(value, c)] for c in coordinates]
    padded = [max(len(h[dim]) for h in held) for dim in range(value.ndim)]
    gathered = local.new_zeros(padded)
    gathered[tuple(slice(0, n) for n in local.shape)] = local
    for mesh_dim in reversed(range(mesh.ndim)):
        if not split[mesh_dim]:
            gathered = gathered.unsqueeze(0)
            continue
        parts = [torch.empty_like(gathered) for _ in range(mesh.size(mesh_dim))]
        dist.all_gather(parts, gathered.contiguous(), group=mesh.get_group(mesh_dim))
        gathered = torch.stack(parts)
    full = local.new_empty(value.shape)
    for c, indices in zip(coordinates, held, strict=True):
        at = tuple(c[d] if is_split else 0 for d, is_split in enumerate(split))
        shard = gathered[at][tuple(slice(0, len(ix)) for ix in indices)]
        full[torch.meshgrid(*indices, indexing="ij")] = shard
    return full


def consecutive_runs(indices: list[int]) -> list[tuple[slice, slice]]:
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


def packed_mesh_dim(value: DTensor) -> int | None:
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


def packed_placement(value: DTensor) -> StridedShard | None:
    """The strided-shard placement of a packed parameter, or ``None``."""
    mesh_dim = packed_mesh_dim(value)
    return None if mesh_dim is None else value.placements[mesh_dim]


def refuse_nested_packed(state: Any, path: str = "") -> None:
    """Raise ``NotImplementedError`` for a packed parameter whose packed dim another mesh dim
    splits too.

    FSDP2 shards dim 0 of each tensor-parallel shard. Where the packed dim is another one
    (tensor-parallel experts' ``gate_up_proj``, strided on dim 1; a packed row-parallel
    weight, on dim 1), each mesh dim splits its own tensor dim and the placements say what
    each rank holds. Where it is dim 0 too (a packed column-parallel weight), the
    placements nest two strided shards that do not describe what each rank holds: values
    read or written through them would be scrambled.
    """
    for name, value in named_dtensors(state, path):
        packed = packed_mesh_dim(value)
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


def named_dtensors(state: Any, path: str = "") -> Iterator[tuple[str, DTensor]]:
    """Every DTensor in a nested state dict (dicts and lists), with its dotted path."""
    if isinstance(state, DTensor):
        yield path, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from named_dtensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from named_dtensors(value, f"{path}.{i}" if path else str(i))


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded.

    Raised on every rank, with a message that names the files and every offending key.
    Unlike DCP's ``CheckpointException`` (a ``BaseException``), ``except Exception``
    catches it; DCP's exception, when there is one, is its ``__cause__``. A failed save
    never removes the previous checkpoint; a failed load leaves the model and optimizer
    as they were.
    """


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 500 characters (a DCP exception holds
    every rank's traceback; only its first failure is worth repeating)."""
    if isinstance(exc, dcp.api.CheckpointException) and exc.failures:
        rank, (inner, _) = next(iter(sorted(exc.failures.items())))
        return f"on rank {rank}, {first_line(inner)}"
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= 500 else line[:500] + "..."


def agree(
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
    if not is_distributed():
        if error is not None:
            raise error
        return [value]
    mine = (None if error is None else _sendable(error), value)
    every: list[Any] = [None] * dist.get_world_size()
    run_coordinated(dist.all_gather_object, every, mine, failed=failed, group=coordination_group())
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


def agree_identity(identity: str, source: str, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`CheckpointError` on every rank of ``group`` (default: every rank) unless
    all read the same checkpoint: ``identity`` is what this rank opened (a fingerprint of
    its bytes), ``source`` names it. One small collective, before anything changes."""
    if not is_distributed():
        return
    group = coordination_group() if group is None else group
    failed = load_failed(f"loading {source}")
    every: list[Any] = [None] * dist.get_world_size(group)
    run_coordinated(dist.all_gather_object, every, identity, failed=failed, group=group)
    if any(other != identity for other in every):
        found = ", ".join(f"rank {rank}: {str(other)[:16]}" for rank, other in enumerate(every))
        raise CheckpointError(
            failed(
                f"the ranks did not read the same checkpoint ({found}): give every rank the "
                "same one, unchanged while they load (not different paths, nor a checkpoint "
                "replaced between two ranks' reads)"
            )
        )


def raise_if_error(error: Exception | None) -> None:
    if error is not None:
        raise error


def meta_error(model: nn.Module, what: str) -> ValueError | None:
    """The error for a model with tensors on the meta device (nothing to read into or
    write from), naming the first few, or ``None``."""
    seen: set[int] = set()
    names = []
    for name, value in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers()
    ):
        if value.is_meta and id(value) not in seen:
            seen.add(id(value))
            names.append(single_device_name(name))
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


def coordination_group() -> dist.ProcessGroup:
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


def run_coordinated(
    collective: Callable[..., Any], *args: Any, failed: Callable[[str], str], **kwargs: Any
) -> Any:
    """Run ``collective`` (a collective, or DCP's save or load) over the coordination group;
    if a collective in it fails (a rank died, the network broke), tear that group down and
    raise :class:`CheckpointError` (``failed(cause)``). DCP's own ``CheckpointException``,
    which it raises on every rank alike, becomes a :class:`CheckpointError` too."""
    try:
        return collective(*args, **kwargs)
    except dcp.api.CheckpointException as exc:  # agreed on every rank: the group is fine
        raise CheckpointError(failed(first_line(exc))) from exc
    except Exception as exc:  # noqa: BLE001 - any failure of the collectives themselves
        if not is_distributed():
            raise CheckpointError(failed(first_line(exc))) from exc
        cause = first_line(exc)
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


def model_tensors(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with the model's own tensors: ``state_dict(keep_vars=True)``,
    each tensor detached as ``state_dict()`` detaches it (so it shares the model's memory).

    The two differ where a module's state-dict post-hook replaces its entries for other
    readers: a PEFT adapter that torch_tp hosts gives its full tensors in ``state_dict()``
    (gathered, what PEFT saves) and its DTensor parameters here. A load must copy into the
    parameters (a gathered copy would take the values and drop them), a save gathers them
    one at a time as any other DTensor, and a check reads them without communicating."""
    return {
        name: value.detach() if isinstance(value, Tensor) else value
        for name, value in model.state_dict(keep_vars=True).items()
    }


def single_device_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def load_failed(what: str) -> Callable[[str], str]:
    return lambda cause: f"{what} failed: {cause}. Nothing was changed."
