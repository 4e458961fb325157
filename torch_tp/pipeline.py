"""``torch_tp.pipeline``: pipeline stages from one model, for ``torch.distributed.pipelining``.

The public path of :mod:`torch_tp.features.pipeline`, which holds the code.
"""

from torch_tp.features import pipeline as _impl
from torch_tp.features.pipeline import *  # noqa: F403

__all__ = _impl.__all__
