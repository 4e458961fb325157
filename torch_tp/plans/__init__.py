"""Ready tensor-parallel plans for model families, as plain dicts of module paths to styles."""

from torch_tp.plans import hf, llama, moe
from torch_tp.plans.auto import auto

__all__ = ["auto", "hf", "llama", "moe"]
