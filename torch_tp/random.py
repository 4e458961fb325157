"""``torch_tp.random``: the tensor-parallel RNG tracker and sequence-parallel dropout.

The public path of :mod:`torch_tp.core.random`, which holds the code.
"""

from torch_tp.core import random as _impl
from torch_tp.core.random import *  # noqa: F403

__all__ = _impl.__all__
