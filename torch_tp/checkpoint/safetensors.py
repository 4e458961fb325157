"""Reading a full state dict from a ``safetensors`` file (or from tensors in memory): a
:class:`_Source` knows every shape and dtype up front (only the file's header is read) and
reads a rank's slices in runs. Private: no public names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from torch_tp.checkpoint._staging import (
    CheckpointError,
    _first_line,
    _Piece,
)

__all__: list[str] = []


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
