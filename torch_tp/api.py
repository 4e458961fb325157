"""``torch_tp.api``: applying a plan: :func:`parallelize_module`.

The public path of :mod:`torch_tp.core.api`, which holds the code.
"""

from torch_tp.core import api as _impl
from torch_tp.core.api import *  # noqa: F403

__all__ = _impl.__all__
