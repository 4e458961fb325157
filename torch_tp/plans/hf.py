"""Tensor-parallel plans for Hugging Face transformers' Llama, Mistral and Qwen2.

The three families share one decoder layout (transformers 5.x module names): a vocabulary
embedding ``model.embed_tokens``, decoder layers ``model.layers.<i>`` with attention
projections ``self_attn.{q,k,v,o}_proj`` and a gated MLP ``mlp.{gate,up,down}_proj``, a final
norm and an ``lm_head``. Qwen2's q/k/v projections have biases, which a column-parallel
linear shards with the weight; nothing else differs.

The layout is Megatron's, built from transformers' own ``base_model_tp_plan`` (``"colwise"``
for q/k/v and gate/up, ``"rowwise"`` for o and down) plus the embedding and the head:

* ``embed_tokens``: row-parallel over the vocabulary (``"embedding_rowwise"``): every rank
  looks up the token ids that fall in its slice of the vocabulary, and one all-reduce sums
  the partial embeddings.
* in each decoder layer, q/k/v and gate/up are column-parallel (each rank holds whole heads
  and a slice of the MLP), o and down are row-parallel: one all-reduce for attention and one
  for the MLP in the forward, and as many in the backward.
* ``lm_head``: column-parallel with the logits all-gathered (``"colwise_gather_output"``),
  so the model returns whole logits and transformers' loss and ``generate`` work unchanged.

The attention code of these models reads the number of heads from the projected tensors, not
from the config, so it runs unchanged on each rank's heads. The number of attention heads
and of key/value heads must both be divisible by the tensor-parallel degree.

Example::
    >>> # xdoctest: +SKIP("distributed")
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from transformers import AutoModelForCausalLM
    >>> from torch_tp import parallelize_module
    >>> from torch_tp.plans.hf import plan_for
    >>> model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B")
    >>> tp_mesh = init_device_mesh("cuda", (8,))
    >>> parallelize_module(model, tp_mesh, plan_for(model))
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate

from torch_tp.style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["PLANS", "llama_plan", "mistral_plan", "plan_for", "qwen2_plan"]


def _decoder_plan(base_model: bool) -> dict[str, ParallelStyle]:
    """The Megatron plan of a Llama-like ``*ForCausalLM`` (or of its base model)."""
    prefix = "" if base_model else "model."
    layer = f"{prefix}layers.*"
    plan: dict[str, ParallelStyle] = {
        # vocabulary-parallel lookup of replicated ids, partial embeddings all-reduced
        f"{prefix}embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        # q, k and v read the same replicated input and each produce its rank's heads
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(),
    }
    if not base_model:
        # whole logits on every rank: transformers' loss and generate() run unchanged
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def llama_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``LlamaForCausalLM``.

    Keyword Args:
        base_model (bool, optional): return the plan of the base ``LlamaModel`` instead: the
            keys lose their ``model.`` prefix and there is no ``lm_head``. Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the decoder layers) to styles, for
        :func:`torch_tp.parallelize_module`.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import llama_plan
        >>> model = LlamaForCausalLM(LlamaConfig(num_attention_heads=32, num_key_value_heads=8))
        >>> parallelize_module(model, tp_mesh, llama_plan())
    """
    return _decoder_plan(base_model)


def mistral_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``MistralForCausalLM``.

    Keyword Args:
        base_model (bool, optional): return the plan of the base ``MistralModel`` instead:
            the keys lose their ``model.`` prefix and there is no ``lm_head``.
            Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the decoder layers) to styles, for
        :func:`torch_tp.parallelize_module`.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import MistralConfig, MistralForCausalLM
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import mistral_plan
        >>> model = MistralForCausalLM(MistralConfig())
        >>> parallelize_module(model, tp_mesh, mistral_plan())
    """
    return _decoder_plan(base_model)


def qwen2_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``Qwen2ForCausalLM``.

    The q/k/v biases are sharded with their weights (``Shard(0)``).

    Keyword Args:
        base_model (bool, optional): return the plan of the base ``Qwen2Model`` instead: the
            keys lose their ``model.`` prefix and there is no ``lm_head``. Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the decoder layers) to styles, for
        :func:`torch_tp.parallelize_module`.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import qwen2_plan
        >>> model = Qwen2ForCausalLM(Qwen2Config())
        >>> parallelize_module(model, tp_mesh, qwen2_plan())
    """
    return _decoder_plan(base_model)


#: ``config.model_type`` -> the function returning that family's plan. :func:`plan_for`
#: looks models up here; a new family is one more entry.
PLANS: dict[str, Callable[..., dict[str, ParallelStyle]]] = {
    "llama": llama_plan,
    "mistral": mistral_plan,
    "qwen2": qwen2_plan,
}


def plan_for(model: nn.Module) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a transformers model, chosen by ``model.config.model_type``.

    A ``*ForCausalLM`` model gets the full plan; a base model (``LlamaModel``, ...,
    recognised by having no ``model`` submodule) gets the plan with ``base_model=True``.
    Other heads (``*ForSequenceClassification``, ...) need their own entry for the head: take
    the base-model plan under ``model.`` and add it.

    Args:
        model: a transformers model of one of the supported families (see :data:`PLANS`).

    Returns:
        A dict from module paths to styles, for :func:`torch_tp.parallelize_module`.

    Raises:
        ValueError: the model has no ``config.model_type``, or it is not a supported one; the
            message lists the supported types.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import plan_for
        >>> model = Qwen2ForCausalLM(Qwen2Config())
        >>> parallelize_module(model, tp_mesh, plan_for(model))
    """
    supported = ", ".join(sorted(PLANS))
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise ValueError(
            f"cannot choose a plan for {type(model).__qualname__}: it has no "
            f"config.model_type (expected a transformers model; supported types: {supported})"
        )
    make_plan = PLANS.get(model_type)
    if make_plan is None:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r} "
            f"({type(model).__qualname__}); supported types: {supported}"
        )
    base_model = not isinstance(getattr(model, "model", None), nn.Module)
    return make_plan(base_model=base_model)
