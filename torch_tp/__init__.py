"""torch_tp: tensor parallelism for PyTorch, on DTensor.

The public API is that of ``torch.distributed.tensor.parallel`` (same names, arguments and
semantics), with plans that are checked whole before anything changes.

The package is laid out as its architecture: :mod:`torch_tp.core` applies plans (the API,
plans, styles and their contracts, the layout runtimes, the RNG tracker);
:mod:`torch_tp.features` adds what training needs (loss parallelism, checkpoints, gradient
clipping); :mod:`torch_tp.tools` helps to write and check plans (the dry-run report, the
command line, the demo). Dependencies point one way: tools to features to core. The public
module paths (``torch_tp.plan``, ``torch_tp.checkpoint``, ...) re-export one module each.
"""

from torch_tp import api, checkpoint, contract, loss, pipeline, plan, random, report, style
from torch_tp.core import style as _styles
from torch_tp.core.api import parallelize_module
from torch_tp.core.contract import StyleContract
from torch_tp.core.style import *  # noqa: F403 - ParallelStyle and every built-in style
from torch_tp.features.clip import clip_grad_norm_
from torch_tp.features.loss import loss_parallel, vocab_parallel_cross_entropy
from torch_tp.features.meta import materialize

__version__ = "0.1.0"

__all__ = [
    "StyleContract",
    "api",
    "checkpoint",
    "clip_grad_norm_",
    "contract",
    "loss",
    "loss_parallel",
    "materialize",
    "parallelize_module",
    "pipeline",
    "plan",
    "random",
    "report",
    "style",
    "vocab_parallel_cross_entropy",
]
# ParallelStyle and every built-in style, as torch_tp.core.style lists them
__all__ += _styles.__all__
