"""``torch_tp.loss``: loss parallelism: cross-entropy on vocabulary-sharded logits.

The public path of :mod:`torch_tp.features.loss`, which holds the code.
"""

from torch_tp.features import loss as _impl
from torch_tp.features.loss import *  # noqa: F403

__all__ = _impl.__all__
