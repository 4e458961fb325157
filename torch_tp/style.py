"""``torch_tp.style``: the parallel styles.

The public path of :mod:`torch_tp.core.style`, which holds the code.
"""

from torch_tp.core import style as _impl
from torch_tp.core.style import *  # noqa: F403

__all__ = _impl.__all__
