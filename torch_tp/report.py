"""``torch_tp.report``: the dry-run report: what a plan costs and what is wrong with it,
before anything runs.

The public path of :mod:`torch_tp.tools.report` (the trace in
:mod:`torch_tp.tools.report.trace`, the result and its table in
:mod:`torch_tp.tools.report.render`).
"""

from torch_tp.tools import report as _impl
from torch_tp.tools.report import *  # noqa: F403

__all__ = _impl.__all__
