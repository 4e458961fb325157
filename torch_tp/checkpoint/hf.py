"""Hugging Face checkpoint directories in and out of a parallelized model, shard by shard.

:func:`load_pretrained` reads a ``save_pretrained`` directory (one ``model.safetensors``, or
shards listed by ``model.safetensors.index.json``), in any layout transformers reads, into a
model parallelized by torch_tp (TP, EP, FSDP2 x TP): each rank opens only the files holding
its tensors and reads only the bytes of its own slices, converted as transformers' own
conversion mapping says (``_hf_conversion``), with the all-or-nothing guarantees of
:func:`torch_tp.checkpoint.load_full_state_dict`. :func:`save_pretrained` writes the model
back as transformers writes it, one parameter gathered at a time, rank 0 writing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path, PureWindowsPath

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from torch_tp._buffers import put_buffers, stale_buffers
from torch_tp._torch_compat import IncompatibleKeys
from torch_tp.checkpoint._hf_conversion import (
    CheckpointLayout,
    conversion_mapping,
    conversions_chosen,
    revert,
    save_groups,
)
from torch_tp.checkpoint._publishing import (
    begin_save,
    end_save,
    old_name,
    publish,
    visible_checkpoint,
)
from torch_tp.checkpoint._staging import (
    CheckpointError,
    Piece,
    agree,
    agree_identity,
    check_keys,
    copy_staged,
    first_line,
    global_rank,
    is_distributed,
    load_failed,
    meta_error,
    model_tensors,
    raise_if_error,
    refuse_nested_packed,
    single_device_name,
    stage_local,
)
from torch_tp.checkpoint.safetensors import (
    SAFETENSORS_DTYPES,
    PinnedDirectory,
)

__all__ = ["load_pretrained", "save_pretrained"]

_INDEX = "model.safetensors.index.json"
# tensors read at a time: a read waits on the disk (or the page cache) with the GIL released
_READERS = min(4, os.cpu_count() or 1)
_SINGLE = "model.safetensors"
_PICKLED = ("pytorch_model.bin.index.json", "pytorch_model.bin")


def _complete(path: Path) -> bool:
    """A directory ``save_pretrained`` published (it publishes only whole ones)."""
    return (path / _SINGLE).is_file() or (path / _INDEX).is_file()


def _kind(value: object) -> str:
    """What a JSON value is, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {dict: "an object", list: "a list", str: "a string"}
    return names.get(type(value), "a number")


def _weight_map(data: bytes, where: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file's bytes, each entry a file inside the directory;
    anything else is refused naming the index and the keys at fault."""

    def refused(why: str) -> CheckpointError:
        return CheckpointError(f"{str(where)!r} is not a safetensors index: {why}")

    try:
        index = json.loads(data)
    except RecursionError as exc:
        raise refused("its JSON is nested too deeply") from exc
    except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8
        raise refused(first_line(exc)) from exc
    if not isinstance(index, dict):
        raise refused(f"it is {_kind(index)}, not an object holding a 'weight_map'")
    if "weight_map" not in index:
        raise refused("it has no 'weight_map'")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise refused(f"its 'weight_map' is {_kind(weight_map)}, not an object of key -> file")
    if not weight_map:
        raise refused("its 'weight_map' lists no tensors")
    bad = [f"{k!r} -> {v!r}" for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise refused("entries that are not file names: " + _shown(bad))
    outside: dict[str, list[str]] = {}
    for key, entry in weight_map.items():
        if _leaves(entry):
            outside.setdefault(entry, []).append(key)
    if outside:
        raise CheckpointError(
            f"{str(where)!r} names files outside the directory, which are not read: "
            + "; ".join(f"{e!r} for {_shown(list(map(repr, keys)))}" for e, keys in outside.items())
            + " (an entry is a path inside the index's directory; a symlink there may lead "
            "anywhere, as a Hugging Face cache's do)"
        )
    return weight_map


def _leaves(entry: str) -> bool:
    """Whether an index entry names a path outside its directory, as written: absolute
    (``/x``, ``C:x``, ``\\\\host\\x``) or going up (``..``)."""
    parts = entry.replace("\\", "/").split("/")
    return entry.startswith(("/", "\\")) or bool(PureWindowsPath(entry).drive) or ".." in parts


def _shown(items: list[str], most: int = 8) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _pin(directory: Path) -> PinnedDirectory:
    """The published version of ``directory`` (or, while it is being replaced, the ``.old``
    one), held open. Its rename between our look and our open is retried."""
    for _ in range(3):
        root = visible_checkpoint(directory, _complete)
        try:
            pinned = PinnedDirectory(root or directory)
        except (FileNotFoundError, NotADirectoryError):
            if root is None:
                break
            continue  # moved aside between the look and the open
        if root is None or pinned.exists(_SINGLE) or pinned.exists(_INDEX):
            return pinned
        pinned.close()  # deleted (an .old) between the look and the open
    raise FileNotFoundError(
        f"no {_SINGLE} or {_INDEX} in {str(directory)!r} (expected a save_pretrained directory)"
    )


class _PretrainedSource:
    """A Hugging Face checkpoint directory read as the model's full state dict.

    ``shapes``/``dtypes`` are by the model's names: the checkpoint's keys as transformers'
    conversion mapping for the model reads them (renamed, merged, split; see
    :class:`~torch_tp.checkpoint._hf_conversion.CheckpointLayout`), and under their own names
    the keys nothing in the model reads. Only the files' headers (and a fingerprint of
    each) are read up front; every file is opened then, and read through those handles
    until :meth:`close` (see :class:`PinnedDirectory`): one version of the directory, whole.

    As transformers' ``from_pretrained`` (5.23), ``model.safetensors`` is read where it
    exists, the index only without it.
    """

    def __init__(
        self, directory: str | os.PathLike, model: nn.Module, targets: dict[str, Tensor]
    ) -> None:
        # while a save_pretrained of this directory is published (or crashed doing so), the
        # checkpoint it replaces is whole under <directory>.old
        self._pinned = _pin(Path(directory))
        try:
            self._open(model, targets)
        except BaseException:
            self.close()
            raise

    def _open(self, model: nn.Module, targets: dict[str, Tensor]) -> None:
        from safetensors import safe_open

        pinned = self._pinned
        root = pinned.root
        self.description = f"the Hugging Face checkpoint {str(root)!r}"
        index: dict[str, str] = {}
        identity = hashlib.sha256()
        if pinned.exists(_SINGLE):  # transformers' precedence: the index is not read
            names = [_SINGLE]
            identity.update(b"single\0")
        elif pinned.exists(_INDEX):
            data = pinned.read(_INDEX)
            identity.update(b"index\0" + data)
            index = _weight_map(data, root / _INDEX)
            names = sorted(set(index.values()))
        else:
            pickled = [root / name for name in _PICKLED if (root / name).is_file()]
            if pickled:
                raise CheckpointError(
                    f"{str(root)!r} holds pickled weights only ({str(pickled[0])!r}), which "
                    "torch_tp does not read: unpickling a file can run any code in it. "
                    "Convert it once, on one device, from a source you trust: "
                    f"AutoModelForCausalLM.from_pretrained({str(root)!r}).save_pretrained("
                    "out_dir, safe_serialization=True) writes model.safetensors; then load "
                    "that directory."
                )
            raise FileNotFoundError(
                f"no {_SINGLE} or {_INDEX} in {str(root)!r} (expected a save_pretrained directory)"
            )
        for name in names:  # every file opened before anything is read
            pinned.open(name)
        # every file holding each key: (file, shape, dtype)
        found: dict[str, list[tuple[str, tuple[int, ...], torch.dtype | str]]] = {}
        for name in names:
            identity.update(pinned.fingerprint(name))
            try:
                with safe_open(pinned.path(name), framework="pt", device="cpu") as file:
                    for key in file.keys():
                        tensor_slice = file.get_slice(key)
                        dtype = tensor_slice.get_dtype()
                        found.setdefault(key, []).append(
                            (name, tuple(tensor_slice.get_shape()),
                             SAFETENSORS_DTYPES.get(dtype, dtype))
                        )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary
                raise CheckpointError(
                    f"{str(root / name)!r} is not a readable safetensors file: {first_line(exc)}"
                ) from exc
        self._identity = identity.hexdigest()
        self._check_files(index, found)
        # each key's file: the index's, or the one file holding a key the index does not list
        self._file = {key: index.get(key, holders[0][0]) for key, holders in found.items()}
        shapes = {key: holders[0][1] for key, holders in found.items()}
        dtypes = {key: holders[0][2] for key, holders in found.items()}
        self.layout = CheckpointLayout(
            model, targets, shapes, dtypes, conversion_mapping(model), dict(self._file)
        )
        if self.layout.errors:
            raise CheckpointError(
                f"cannot read {self.description} into {type(model).__name__} as transformers' "
                "conversion mapping for it says (nothing was changed):\n\t"
                + "\n\t".join(self.layout.errors)
            )
        self.shapes, self.dtypes = self.layout.shapes, self.layout.dtypes
        self.describe = self.layout.describe
        self.views: set[str] = set()  # the names read as views of their files (mapped)

    def _check_files(
        self,
        index: dict[str, str],
        found: dict[str, list[tuple[str, tuple[int, ...], torch.dtype | str]]],
    ) -> None:
        """Refuse a key held by several files (which one is read would be a guess: the
        index names one, the headers may say another's shape and dtype), and an index
        naming a file for a key it does not hold."""
        where = self._pinned.root / _INDEX
        errors = []
        unheld = sorted(k for k in index if k not in found)
        if unheld:
            errors.append(
                f"{str(where)!r} lists key(s) its files do not hold: "
                + _shown(list(map(repr, unheld)))
            )
        elsewhere = [
            f"{key!r} -> {index[key]} (held by {', '.join(h[0] for h in holders)})"
            for key, holders in found.items()
            if key in index and all(h[0] != index[key] for h in holders)
        ]
        if elsewhere:
            errors.append(
                f"{str(where)!r} names files that do not hold the keys: " + _shown(elsewhere)
            )
        several = []
        for key, holders in found.items():
            if len(holders) < 2:
                continue
            named = index.get(key)
            holders = sorted(holders, key=lambda h: (h[0] != named, h[0]))
            several.append(
                f"{key!r} is in more than one file: "
                + ", ".join(
                    f"{file} ({'the index' + chr(39) + 's; ' if file == named else ''}"
                    f"{dtype} {list(shape)})"
                    for file, shape, dtype in holders
                )
            )
        if several:
            errors.append("; ".join(several[:8]) + (
                f" and {len(several) - 8} more" if len(several) > 8 else ""
            ) + " (each key must be in one file only)")  # fmt: skip
        if errors:
            raise CheckpointError(
                f"cannot read {self.description} (nothing was changed): " + "; ".join(errors)
            )

    def identity(self) -> str:
        """A fingerprint of the version read (the index's bytes; each file's name, size,
        header and blocks of its data): the ranks compare theirs before the model changes."""
        return self._identity

    def verify(self) -> None:
        """After the reads: refuse a file read by path that was replaced meanwhile."""
        self._pinned.verify()

    def close(self) -> None:
        """Let the files go (a tensor mapped from one keeps its mapping)."""
        self._pinned.close()

    def _safe_open(self, key: str):
        from safetensors import safe_open

        return safe_open(self._pinned.path(self._file[key]), framework="pt", device="cpu")

    def _read(self, key: str, region: tuple[slice, ...]) -> Tensor:
        """``key[region]`` from its file (all of it for ``()``), reading only those bytes;
        the file is closed again, so its mapped pages are let go."""
        with self._safe_open(key) as file:
            tensor_slice = file.get_slice(key)
            if not tensor_slice.get_shape():
                return file.get_tensor(key)
            return tensor_slice[region] if region else tensor_slice[:]

    def copy_to(self, name: str, pieces: list[Piece] | None, dst: Tensor) -> None:
        """``dst[mine] = name[whole]`` for each piece (the whole tensor: ``pieces=None``),
        reading only those bytes."""
        if pieces is None:
            pieces = [(tuple(slice(0, s) for s in self.shapes[name]), (slice(None),) * dst.ndim)]
        if name in self.layout.converted:
            self.layout.copy_to(name, pieces, dst, self._read)
            return
        key = self.layout.plain[name]
        with self._safe_open(key) as file:
            if not self.shapes[name]:  # 0-d
                dst.copy_(file.get_tensor(key))
                return
            tensor_slice = file.get_slice(key)
            for whole, mine in pieces:
                dst[mine].copy_(tensor_slice[whole])

    def mapped(self, name: str, pieces: list[Piece] | None, local: Tensor) -> Tensor | None:
        """This rank's part of ``name`` as a view of its file, mapped copy-on-write (pages are
        read when first touched; a write copies the page, never reaching the file), where it
        is one piece of ``local``'s shape, dtype and strides as the file holds it: a
        replicated tensor, or a shard of rows. ``None`` elsewhere (a shard of columns, another
        dtype, a converted tensor): read it into a buffer."""
        if name in self.layout.converted or self.dtypes[name] != local.dtype:
            return None
        if pieces is None:
            pieces = [(tuple(slice(0, s) for s in self.shapes[name]), (slice(None),) * local.ndim)]
        if len(pieces) != 1 or not self.shapes[name]:
            return None
        whole, mine = pieces[0]
        shape = self.shapes[name]
        rows_only = all(
            w.indices(n) == (0, n, 1) for w, n in zip(whole[1:], shape[1:], strict=True)
        )
        if local[mine].shape != local.shape or not rows_only or not local.is_contiguous():
            return None  # checked before the read: a tensor is read once
        key = self.layout.plain[name]
        with self._safe_open(key) as file:
            view = file.get_slice(key)[whole]
        # the dtype too: a view of other bytes would reinterpret them
        if (view.dtype, view.shape, view.stride()) != (local.dtype, local.shape, local.stride()):
            return None
        self.views.add(name)
        return view

    def read(self, name: str) -> Tensor:
        out = torch.empty(self.shapes[name], dtype=self.dtypes[name])
        self.copy_to(name, None, out)
        return out


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict names whose tensor is an earlier name's (tied weights): alias -> name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, value in model.state_dict(keep_vars=True).items():
        name = single_device_name(name)
        if id(value) in first:
            aliases[name] = first[id(value)]
        else:
            first[id(value)] = name
    return aliases


def load_pretrained(
    model: nn.Module, directory: str | os.PathLike, *, strict: bool = True, mmap: bool = False
) -> IncompatibleKeys:
    """Load a Hugging Face ``save_pretrained`` directory into a parallelized model.

    The directory holds ``model.safetensors`` (read where it exists, as transformers 5.23
    does), or shards listed by ``model.safetensors.index.json``, as the Hub has it or as
    transformers writes it. Its keys are read through the model's conversion mapping, as
    transformers' ``from_pretrained`` reads them (renamings, per-expert keys merged into
    stacked experts, fused tensors chunked, tied weights saved once), so every layout
    transformers reads loads; the conversions applied are kept on the model
    (``model._weight_conversions``) and :func:`save_pretrained` reverts them. Each rank
    opens the files holding its tensors and reads only its slices of them. The load is all
    or nothing, as :func:`torch_tp.checkpoint.load_full_state_dict`'s, and reads one
    version of the directory (``<directory>.old`` while :func:`save_pretrained` replaces
    it), the same on every rank. See the guide's "Hugging Face checkpoints in and out" and
    "Hostile and replaced directories" (``docs/transformers.md``).

    Args:
        model (:class:`nn.Module`): the model, parallelized (and possibly FSDP2-sharded).
        directory: the ``save_pretrained`` directory.

    Keyword Args:
        strict (bool, optional): raise for missing and unexpected keys. Default: ``True``.
        mmap (bool, optional): as ``torch.load(mmap=True)`` and ``from_pretrained``: a
            tensor this rank holds as one range of its file (a replicated tensor or a shard
            of rows, of the checkpoint's dtype, not converted) becomes a copy-on-write view
            of the mapped file instead of a copy, read as the model touches it; nothing is
            ever written to the file. The files must then not be changed in place while the
            model lives (:func:`save_pretrained` writes new files, so it may replace the
            directory). Other tensors are copied. Default: ``False`` (every tensor copied
            into the model's own memory during the load).

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``.

    Raises:
        FileNotFoundError: the directory holds no checkpoint.
        CheckpointError: missing or unexpected keys, shapes or dtypes that do not fit, a
            conversion that cannot be applied (an expert missing, tensors of different
            shapes or dtypes to merge: named with the keys, their files and the
            conversion), a file that cannot be read, or a directory holding only pickled
            weights (``pytorch_model.bin``: named, with how to convert it); a key held by
            more than one file, a file that is not a regular one (a FIFO, a directory), an
            index entry outside the directory (absolute, or with ``..``; symlinks may lead
            anywhere), a malformed index; ranks that read different checkpoints. Raised on
            every rank, naming every key at fault and its file; the model is unchanged.
        ValueError: the model has tensors on the meta device (named): give it memory with
            :func:`torch_tp.materialize` first.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch.device("meta"):  # or build it whole
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> parallelize_module(model, tp_mesh, plan_for(model))
        >>> torch_tp.materialize(model)
        >>> torch_tp.checkpoint.load_pretrained(model, "path/to/checkpoint")
    """
    # the model's own tensors (not detached copies): a staged buffer becomes a tensor's memory
    # where nothing else sees it (see copy_staged)
    state = model.state_dict(keep_vars=True)
    targets = {single_device_name(k): v for k, v in state.items()}
    del state
    refuse_nested_packed(targets)  # on every rank, before any communication
    error: Exception | None = None
    result, staged = IncompatibleKeys([], []), {}
    source = None
    try:
        raise_if_error(meta_error(model, "load_pretrained"))  # before reading anything
        buffers = stale_buffers(model, "load_pretrained")  # what to_empty() left in them
        source = _PretrainedSource(directory, model, targets)
        aliases = _tied_aliases(model)
        wanted = {
            k: v
            for k, v in targets.items()
            if not (k in aliases and k not in source.shapes and aliases[k] in source.shapes)
        }
        result = check_keys(model, wanted, source, strict)
        mapped = source.mapped if mmap else None
        staged = stage_local(source, wanted, result, threads=_READERS, mapped=mapped)
        source.verify()
    except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = exc
    finally:
        if source is not None:
            source.close()  # everything is staged (a mapped tensor keeps its mapping)
    if is_distributed() and any(isinstance(t, DTensor) for t in targets.values()):
        agree(error, load_failed(f"loading {str(directory)!r}"))
        # the same version on every rank: paths that differ, or a directory replaced
        # between two ranks' opens, would load a mixture
        agree_identity(source.identity(), source.description)
    elif error is not None:
        raise error
    copy_staged(targets, staged, source.views if source is not None else ())
    put_buffers(buffers)
    if source is not None and source.layout.mapping is not None:
        # as transformers' from_pretrained: the conversions applied, reverted on save
        model._weight_conversions = source.layout.used()
    return result


_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "KI": 2**10, "MI": 2**20, "GI": 2**30}
_SIZE = re.compile(r"(?P<count>[0-9]+)(?P<unit>[KMGkmg](?:[Ii])?)(?P<b>[Bb])")


def _shard_bytes(max_shard_size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or transformers' strings (``"5GB"``: 10**9
    bytes; ``"5GiB"``: 2**30; ``K``/``M``/``G``; a lower-case final ``b`` after a decimal
    unit counts bits, ``"8Mb"`` being 10**6 bytes, as transformers reads it)."""
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = max_shard_size
    elif isinstance(max_shard_size, str) and (match := _SIZE.fullmatch(max_shard_size.strip())):
        unit = match["unit"].upper()
        size = int(match["count"]) * _UNITS[unit]
        if match["b"] == "b" and not unit.endswith("I"):
            size //= 8
    else:
        raise ValueError(
            "max_shard_size must be a number of bytes or a size such as '5GB', '500MB', "
            f"'100KB' or '5GiB' (transformers' forms), found {max_shard_size!r}"
        )
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, found {max_shard_size!r}")
    return size


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GiB",
    layout: str = "transformers",
) -> None:
    """Write a parallelized model as a Hugging Face directory ``from_pretrained`` loads.

    Every rank gathers one parameter at a time (``full_tensor()``, a collective); rank 0
    writes shards of at most ``max_shard_size`` bytes (``model-00001-of-0000N.safetensors``
    and ``model.safetensors.index.json``, or one ``model.safetensors``), holding at most one
    gathered parameter and the shard being filled, then the model's ``config.json`` (and
    ``generation_config.json`` where it has one). Tied weights are written once, under the
    first name. Must be called on every rank.

    The previous checkpoint is never lost: the directory is written whole beside it
    (``<directory>.<save id>.partial``, this save's alone), its files fsynced, and published
    as the DCP :func:`~torch_tp.checkpoint.save` publishes a step: an existing ``directory``
    is moved aside to ``<directory>.old`` and deleted only once the new one is in place. A
    crash at any point leaves ``directory`` whole (the old or the new one), or the old one
    whole as ``<directory>.old`` with ``directory`` missing, which :func:`load_pretrained`
    reads and the next :func:`save_pretrained` puts back. A save that fails raises
    :class:`~torch_tp.checkpoint.CheckpointError` on every rank, saying where the previous
    checkpoint is, intact (a rank that died makes the others' collectives fail: they raise
    it too, within moments). A failure to write any file (a full disk) names the file, and
    leaves nothing beside the directory. One save of a directory at a time: a save while
    another live one holds ``<directory>.claim`` is refused, naming that writer, as
    :func:`~torch_tp.checkpoint.save` refuses a second save of a step.

    Args:
        model (:class:`nn.Module`): a transformers model, parallelized (and possibly
            FSDP2-sharded).
        directory: where to write; an existing checkpoint there is replaced.

    Keyword Args:
        max_shard_size (int or str, optional): the most bytes per file, as an int or as
            transformers writes it (``"5GB"``, ``"100MB"``, ``"5GiB"``). Default: ``"5GiB"``.
        layout (str, optional): ``"transformers"``, the keys transformers'
            ``save_pretrained`` writes, or ``"model"``, the model's own state-dict names.
            Default: ``"transformers"``.

    Raises:
        ValueError: a ``max_shard_size`` that is not a size, a ``layout`` that is not one,
            or a model on the meta device (before anything is written, on every rank).
        CheckpointError: the save failed on some rank, or another save of the directory is
            in progress (raised on every rank); the previous checkpoint is intact.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> torch_tp.checkpoint.save_pretrained(model, "out", max_shard_size="2GB")
        >>> AutoModelForCausalLM.from_pretrained("out")  # on one device
    """
    with conversions_chosen(model):  # once, not at every parameter group
        _save_pretrained(model, directory, max_shard_size, layout)


def _save_pretrained(
    model: nn.Module, directory: str | os.PathLike, max_shard_size: int | str, layout: str
) -> None:
    final = Path(directory)
    writer = global_rank() == 0
    what = f"saving {str(final)!r}"
    state = model_tensors(model)  # gathered below one group at a time, adapters too

    def failed(cause: str) -> str:
        return _save_failed(what, final, cause)

    # every rank's checks, agreed before anything is written or gathered
    error: Exception | None = None
    limit = 0
    groups: list[list[str]] = []
    try:
        limit = _shard_bytes(max_shard_size)
        if layout not in _LAYOUTS:
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, _LAYOUTS))}, found {layout!r}"
            )
        raise_if_error(meta_error(model, "save_pretrained"))
        refuse_nested_packed(state)
        aliases = _tied_aliases(model)
        names = [n for n in map(single_device_name, state) if n not in aliases]
        groups = save_groups(model, names) if layout == "transformers" else [[n] for n in names]
        if layout == "transformers":
            _check_revert(model, state, groups)
    except (ValueError, NotImplementedError, CheckpointError) as exc:
        error = exc
    agree(error, failed)  # nothing is written unless every rank can go on
    # rank 0 claims the directory (refused while another save of it is in progress) and
    # writes into a staging directory of this save alone
    claim, partial = None, final
    if writer:
        try:
            claim, partial = begin_save(final, _complete, failed)
        except OSError as exc:
            error = CheckpointError(failed(f"cannot prepare a staging directory: {exc}"))
        except CheckpointError as exc:
            error = exc
    agree(error, failed)
    try:
        error = _write_pretrained(model, state, groups, layout, limit, partial, final, failed)
        if claim is not None:
            # before the last agreement: whoever saves next finds the directory free, and a
            # failed save leaves nothing behind
            end_save(claim, partial)
            claim = None
    finally:
        if claim is not None:  # a collective failed: nothing of this save is left behind
            end_save(claim, partial)
    agree(error, failed)


def _write_pretrained(
    model: nn.Module,
    state: dict[str, Tensor],
    groups: list[list[str]],
    layout: str,
    limit: int,
    partial: Path,
    final: Path,
    failed: Callable[[str], str],
) -> Exception | None:
    """Gather every group (every rank, in order) and, on rank 0, write it into ``partial``
    and publish that as ``final``. Rank 0 returns its error, for the caller to agree on: a
    :class:`CheckpointError` naming the file it could not write (a full disk, say). A failed
    gather raises on every rank (no rank is left to agree with)."""
    from safetensors.torch import save_file

    writer = global_rank() == 0
    error: Exception | None = None

    @contextlib.contextmanager
    def doing(what: str) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary
            raise CheckpointError(failed(f"cannot {what}: {first_line(exc)}")) from exc

    shard: dict[str, Tensor] = {}
    shard_bytes, files, weight_map, total = 0, [], {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            with doing(f"write {str(partial / name)!r}"):
                save_file(shard, str(partial / name), metadata={"format": "pt"})
            files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    def add(key: str, value: Tensor) -> None:
        nonlocal shard_bytes, total
        value = value.detach().cpu().contiguous()
        nbytes = value.numel() * value.element_size()
        if shard and shard_bytes + nbytes > limit:
            flush()
        shard[key] = value
        shard_bytes += nbytes
        total += nbytes

    values = {single_device_name(k): v for k, v in state.items()}
    for group in groups:
        gathered: dict[str, Tensor] = {}
        for name in group:
            value = values[name]
            if isinstance(value, DTensor):
                try:
                    value = value.full_tensor()  # a collective: every rank, in the same order
                except Exception as exc:  # noqa: BLE001 - a rank died, or the network failed
                    raise CheckpointError(
                        failed(f"gathering {name!r} failed, a rank has probably died "
                               f"({first_line(exc)})")
                    ) from exc  # fmt: skip
            if writer and error is None:
                gathered[name] = value
        if not writer or error is not None:
            continue
        try:
            written = revert(model, gathered) if layout == "transformers" else gathered
            del gathered
            for key, value in written.items():
                add(key, value)
        except Exception as exc:  # noqa: BLE001 - raised after the gathers
            error = exc
    if not writer or error is not None:
        return error
    try:
        flush()
        if len(files) == 1:
            with doing(f"write {str(partial / _SINGLE)!r}"):
                (partial / files[0][0]).rename(partial / _SINGLE)
        else:
            for i, (name, keys) in enumerate(files):
                renamed = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                with doing(f"write {str(partial / renamed)!r}"):
                    (partial / name).rename(partial / renamed)
                weight_map.update(dict.fromkeys(keys, renamed))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with doing(f"write {str(partial / _INDEX)!r}"):
                (partial / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        for attribute in ("config", "generation_config"):
            config = getattr(model, attribute, None)
            if config is not None and hasattr(config, "save_pretrained"):
                with doing(f"write {str(partial / (attribute + '.json'))!r}"):
                    config.save_pretrained(partial)
        with doing(f"publish {str(partial)!r} as {str(final)!r}"):
            publish(partial, final)
    except CheckpointError as exc:
        return exc
    return None


_LAYOUTS = ("transformers", "model")


def _check_revert(model: nn.Module, state: dict[str, Tensor], groups: list[list[str]]) -> None:
    """Revert every group on meta tensors of its global shapes, before anything is gathered:
    a conversion that cannot be reverted, or two that write one key, is refused by name."""
    values = {single_device_name(k): v for k, v in state.items()}
    written: dict[str, str] = {}
    for group in groups:
        meta = {
            n: torch.empty(values[n].shape, dtype=values[n].dtype, device="meta") for n in group
        }
        try:
            keys = revert(model, meta)
        except Exception as exc:  # noqa: BLE001 - transformers' ops raise various types
            raise CheckpointError(
                f"cannot write {', '.join(map(repr, group))} in transformers' layout: "
                f"{first_line(exc)} (layout='model' writes the model's own names)"
            ) from exc
        for key in keys:
            if key in written:
                raise CheckpointError(
                    f"{written[key]!r} and {group[0]!r} would both be written as {key!r} in "
                    "transformers' layout (layout='model' writes the model's own names)"
                )
            written[key] = group[0]


def _save_failed(what: str, final: Path, cause: str) -> str:
    """The message of a failed save_pretrained: what failed, and where the previous
    checkpoint is, intact (as the disk shows it now)."""
    old = old_name(final)
    if _complete(final):
        kept = (
            f"the checkpoint at {str(final)!r} is intact (the previous one, or this save's if it "
            "was published before the failure)"
        )
    elif _complete(old):
        kept = (
            f"the previous checkpoint is intact at {str(old)!r} (load_pretrained "
            f"({str(final)!r}) reads it there; the next save_pretrained puts it back)"
        )
    else:
        kept = f"there was no checkpoint at {str(final)!r} before"
    return f"{what} failed: {cause}. Nothing was lost: {kept}."
