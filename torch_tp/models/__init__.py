"""Reference models in plain PyTorch, for the demo, the tests and the benchmarks.

They know nothing about parallelism: ``torch_tp.plans`` holds the plans that split them.

Example::

    >>> from torch_tp.models import Llama, tiny_config
    >>> model = Llama(tiny_config())
"""

from torch_tp.models.llama import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    tiny_config,
)

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "tiny_config",
]
