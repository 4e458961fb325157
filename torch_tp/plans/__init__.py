"""Ready tensor-parallel plans for model families, as plain dicts of module paths to styles."""

# auto is the package (torch_tp.plans.auto.infer, ...), callable as its function: auto(model)
from torch_tp.plans import auto, hf, llama, moe

__all__ = ["auto", "hf", "llama", "moe"]
