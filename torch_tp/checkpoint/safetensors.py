"""Reading a full state dict from a ``safetensors`` file (or from tensors in memory): a
:class:`StateDictSource` knows every shape and dtype up front (only the file's header is read) and
reads a rank's slices in runs. Private: no public names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from torch_tp.checkpoint._staging import (
    CheckpointError,
    Piece,
    consecutive_runs,
    first_line,
)

__all__: list[str] = []


# The dtype names of the safetensors format, as torch reads them.
SAFETENSORS_DTYPES = {
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


class StateDictSource:
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
                        n: SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype())
                        for n, s in slices.items()
                    }
            except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary
                raise CheckpointError(
                    f"{str(self._path)!r} is not a readable safetensors file: {first_line(exc)}"
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

    def copy_to(self, name: str, pieces: list[Piece] | None, dst: Tensor) -> None:
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

    def identity(self) -> str:
        """A fingerprint of the tensors this source holds, for the ranks of a load to compare
        (every rank must be given the same state dict): a hash of every name, shape and
        dtype and of a few elements of each tensor, its first and last 16 and 16 spread
        evenly between (row-major positions; only those bytes are read from a file). It is
        the same for a file and a dict holding the same tensors, and for copies of one file
        at other paths or with other times (each host's own copy); the weights of two
        trainings, or two steps of one, differ in nearly every element, so in these too."""

        def positions(numel: int) -> list[int]:
            spread = {numel * k // 16 for k in range(16)} if numel else set()
            return sorted({*range(min(numel, 16)), *range(max(numel - 16, 0), numel), *spread})

        digest = hashlib.sha256()
        with contextlib.ExitStack() as stack:
            if self._path is not None:
                file = stack.enter_context(open(self._path, "rb"))
                (length,) = struct.unpack("<Q", file.read(8))
                header, start = json.loads(file.read(length)), 8 + length
            for name in sorted(self.shapes):
                shape, dtype = tuple(self.shapes[name]), self.dtypes[name]
                digest.update(repr((name, shape, str(dtype))).encode())
                at = positions(math.prod(shape))
                if self._dict is not None:
                    value = self._dict[name].detach()
                    if isinstance(value, DTensor) or value.is_meta or not at:
                        continue  # no local data to sample (the key check refuses it)
                    picked = value.reshape(1) if value.dim() == 0 else value
                    picked = picked[torch.unravel_index(torch.tensor(at), picked.shape)]
                    digest.update(bytes(picked.cpu().contiguous().view(torch.uint8).numpy()))
                    continue
                begin = start + header[name]["data_offsets"][0]
                size = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
                for run, _ in consecutive_runs(at):  # consecutive positions: one read each
                    file.seek(begin + run.start * size)
                    digest.update(file.read((run.stop - run.start) * size))
        return digest.hexdigest()

    def read(self, name: str) -> Tensor:
        """The whole tensor ``name``."""
        if self._dict is not None:
            return self._dict[name]
        with self._open() as file:
            return file.get_tensor(name).clone()


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# opening a FIFO for reading waits for a writer, unless non-blocking: then fstat refuses it
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
_SAMPLES, _SAMPLE_BYTES = 16, 4096  # blocks of each file's data in its fingerprint


class PinnedDirectory:
    """One version of a checkpoint directory, held open for the whole load.

    The directory is opened once and every file relative to that handle (``dir_fd``), so a
    directory renamed or replaced after it was opened is still the one read; each file is
    opened once, checked to be a regular file, and read again through its own handle
    (``/proc/self/fd/N``) rather than by name. Where the platform offers neither, files are
    opened by path and :meth:`verify` compares each path's identity with the handle's after
    the reads: a file replaced meanwhile is refused.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dir: int | None = None
        if os.open in os.supports_dir_fd:
            self._dir = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        elif not root.is_dir():
            raise FileNotFoundError(str(root))
        self._fds: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        self._by_path: list[str] = []  # files read by path: verified after the reads

    def exists(self, name: str) -> bool:
        try:
            os.stat(self._name(name), dir_fd=self._dir)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _name(self, name: str) -> str:
        return name if self._dir is not None else str(self.root / name)

    def open(self, name: str) -> int:
        """Open ``name`` (once), refusing anything but a regular file."""
        if name in self._fds:
            return self._fds[name]
        where = str(self.root / name)
        try:
            fd = os.open(self._name(name), os.O_RDONLY | _NONBLOCK | _CLOEXEC, dir_fd=self._dir)
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"{where!r} is missing (if the directory was being replaced, load again)"
            ) from exc
        except OSError as exc:
            raise CheckpointError(f"{where!r} cannot be opened: {first_line(exc)}") from exc
        self._fds[name] = fd
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a file")
            raise CheckpointError(
                f"{where!r} is not a regular file ({kind}): only regular files are read"
            )
        self._paths[name] = self._handle_path(fd) or where
        if self._paths[name] == where:
            self._by_path.append(name)
        return fd

    @staticmethod
    def _handle_path(fd: int) -> str | None:
        """A path that opens the file ``fd`` holds, whatever its name is now, or ``None``."""
        held = os.fstat(fd)
        for folder in ("/proc/self/fd", "/dev/fd"):
            path = f"{folder}/{fd}"
            try:
                found = os.stat(path)
            except OSError:
                continue
            if (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino):
                return path
        return None

    def read(self, name: str) -> bytes:
        fd = self.open(name)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)

    def path(self, name: str) -> str:
        """The path safetensors opens for ``name``: the handle's own where there is one."""
        return self._paths[name]

    def fingerprint(self, name: str) -> bytes:
        """``name``'s size, safetensors header and :data:`_SAMPLES` blocks spread over its
        data, hashed: equal for two copies of one file (any inode, any time), different for
        two saves of one model with other values (each block differs)."""
        fd = self.open(name)
        size = os.fstat(fd).st_size
        digest = hashlib.sha256(f"{name}\0{size}\0".encode())
        head = _pread(fd, 8, 0)
        start = 8 + (int.from_bytes(head, "little") if len(head) == 8 else 0)
        start = min(start, size)
        digest.update(_pread(fd, start, 0))
        span = max(size - start - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            digest.update(_pread(fd, _SAMPLE_BYTES, start + span * i // (_SAMPLES - 1)))
        return digest.digest()

    def verify(self) -> None:
        """Refuse a file read by path that is no longer the one opened."""
        for name in self._by_path:
            held = os.fstat(self._fds[name])
            try:
                now = os.stat(self.root / name)
            except OSError:
                now = None
            same = now is not None and (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) == (
                held.st_dev, held.st_ino, held.st_size, held.st_mtime_ns
            )  # fmt: skip
            if not same:
                raise CheckpointError(
                    f"{str(self.root / name)!r} was replaced while it was read: load again"
                )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None


def _pread(fd: int, size: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, size, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, size)
