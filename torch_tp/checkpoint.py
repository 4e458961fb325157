"""``torch_tp.checkpoint``: full state dicts, safetensors, DCP and Hugging Face directories;
atomic, all-or-nothing.

The public path of :mod:`torch_tp.features.checkpoint`, which holds the code.
"""

from torch_tp.features import checkpoint as _impl
from torch_tp.features.checkpoint import *  # noqa: F403

__all__ = _impl.__all__
