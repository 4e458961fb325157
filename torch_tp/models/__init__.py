"""Reference models in plain PyTorch, for the demo, the tests and the benchmarks.

They know nothing about parallelism: ``torch_tp.plans`` holds the plans that split them.
:class:`Llama` is a dense Llama; :class:`MoELlama` the same with mixture-of-experts
feed-forwards (Mixtral / Qwen3-MoE style).

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
from torch_tp.models.moe import (
    Experts,
    MoEConfig,
    MoEFeedForward,
    MoELlama,
    MoETransformerBlock,
    TopKRouter,
)

__all__ = [
    "Attention",
    "Experts",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "MoEConfig",
    "MoEFeedForward",
    "MoELlama",
    "MoETransformerBlock",
    "RMSNorm",
    "TopKRouter",
    "TransformerBlock",
    "tiny_config",
]
