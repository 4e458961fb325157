"""torch_tp: tensor parallelism for PyTorch, on DTensor.

The public API is that of ``torch.distributed.tensor.parallel`` (same names, arguments and
semantics), with plans that are checked whole before anything changes.
"""

from torch_tp import api, checkpoint, plan, random, report, style
from torch_tp._clip import clip_grad_norm_
from torch_tp.api import parallelize_module
from torch_tp.loss import loss_parallel, vocab_parallel_cross_entropy
from torch_tp.style import (
    AttentionHeads,
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionHeads",
    "ColwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "ReplicateParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "api",
    "checkpoint",
    "clip_grad_norm_",
    "loss_parallel",
    "parallelize_module",
    "plan",
    "random",
    "report",
    "style",
    "vocab_parallel_cross_entropy",
]
