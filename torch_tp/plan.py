"""``torch_tp.plan``: resolving and checking plans, and their plain-data form.

The public path of :mod:`torch_tp.core.plan`, which holds the code.
"""

from torch_tp.core import plan as _impl
from torch_tp.core.plan import *  # noqa: F403

__all__ = _impl.__all__
