"""torch_tp: tensor parallelism for PyTorch, on DTensor.

The public API is that of ``torch.distributed.tensor.parallel`` (same names, arguments and
semantics), with plans that are checked whole before anything changes.

Each public module holds its code: :mod:`torch_tp.api` (:func:`parallelize_module`),
:mod:`torch_tp.plan` (resolving and checking plans, their plain-data form),
:mod:`torch_tp.style` (the styles, one module per family) with :mod:`torch_tp.contract` and
:mod:`torch_tp.registry`, :mod:`torch_tp.random`, :mod:`torch_tp.shapes`; then what training
needs beside them: :mod:`torch_tp.loss`, :mod:`torch_tp.clip`, :mod:`torch_tp.meta`,
:mod:`torch_tp.checkpoint`, :mod:`torch_tp.pipeline`; and the tools: :mod:`torch_tp.report`
and :mod:`torch_tp.cli`. Dependencies point one way, from the tools to the features to the
core (``test/test_layout.py`` checks it over every import, and that there are no cycles).
"""

from torch_tp import api, checkpoint, contract, loss, pipeline, plan, random, report, runtime, style
from torch_tp.api import parallelize_module
from torch_tp.clip import clip_grad_norm_
from torch_tp.contract import StyleContract
from torch_tp.loss import loss_parallel, vocab_parallel_cross_entropy
from torch_tp.meta import materialize
from torch_tp.style import *  # noqa: F403 - ParallelStyle and every built-in style
from torch_tp.style.context import sequence_positions, shard_sequence, unshard_sequence

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
    "runtime",
    "sequence_positions",
    "shard_sequence",
    "style",
    "unshard_sequence",
    "vocab_parallel_cross_entropy",
]
# ParallelStyle and every built-in style, as torch_tp.style lists them
__all__ += style.__all__
