"""torch_tp: tensor parallelism for PyTorch, on DTensor.

The public API is that of ``torch.distributed.tensor.parallel`` (same names, arguments and
semantics), with plans that are checked whole before anything changes.
"""

from torch_tp import api, checkpoint, contract, plan, random, report, style
from torch_tp._clip import clip_grad_norm_
from torch_tp.api import parallelize_module
from torch_tp.contract import StyleContract
from torch_tp.loss import loss_parallel, vocab_parallel_cross_entropy
from torch_tp.style import *  # noqa: F403 - ParallelStyle and every built-in style

__version__ = "0.1.0"

__all__ = [
    *style.__all__,  # ParallelStyle and every built-in style, as its contract registers it
    "StyleContract",
    "api",
    "checkpoint",
    "clip_grad_norm_",
    "contract",
    "loss_parallel",
    "parallelize_module",
    "plan",
    "random",
    "report",
    "style",
    "vocab_parallel_cross_entropy",
]
