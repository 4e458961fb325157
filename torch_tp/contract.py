"""``torch_tp.contract``: style contracts: what a style declares, as data.

The public path of :mod:`torch_tp.core.contract`, which holds the code.
"""

from torch_tp.core import contract as _impl
from torch_tp.core.contract import *  # noqa: F403

__all__ = _impl.__all__
