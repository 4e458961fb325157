"""The tensor-parallel plan of the reference Llama (:class:`torch_tp.models.Llama`).

Megatron's layout: in each block the q/k/v and gate/up projections are column-parallel (each
rank holds whole heads and a slice of the FFN), the output and down projections are
row-parallel, so a block costs one reduction for attention and one for the MLP. The block's
input is declared once per attention and per MLP (``PrepareModuleInput``) and handed to the
projections as a DTensor, so the three q/k/v (or two gate/up) input gradients are summed
locally and reduced once, not once per projection.

With ``sequence_parallel`` the activations between blocks are sharded on the sequence
(dim 1): norms and dropouts run on a sequence shard, the all-reduces become an all-gather
before each block half and a reduce-scatter after it.

Each rank must hold whole heads, so the numbers of query and key/value heads must divide by
the TP degree. The attention modules read their head counts from tensor shapes and already
carry a ``PrepareModuleInput`` (a module takes one style), so the check sits on the root
module, which holds the counts in its ``config``: :class:`~torch_tp.AttentionHeads` refuses
the plan before anything changes, where a column-parallel ``wk`` alone would be split into
part-heads and fail mid-forward.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from torch_tp.style import (
    AttentionHeads,
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["llama_plan"]


def llama_plan(
    *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The plan for :class:`torch_tp.models.Llama`, for :func:`torch_tp.parallelize_module`.

    Keyword Args:
        sequence_parallel (bool, optional): shard activations between blocks, norms and
            dropouts on the sequence dimension. Default: ``False``.
        loss_parallel (bool, optional): return the logits as a DTensor sharded on the
            vocabulary (for a vocabulary-parallel loss) instead of a replicated local
            tensor. Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the layers) to styles. Its ``""`` entry,
        :class:`~torch_tp.AttentionHeads` reading ``config.n_heads`` and ``config.kv_heads``
        of the root, makes :func:`~torch_tp.parallelize_module` raise ``ValueError`` before
        anything changes when the TP degree does not divide both head counts.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.models import Llama, LlamaConfig
        >>> from torch_tp.plans.llama import llama_plan
        >>> model = Llama(LlamaConfig())
        >>> parallelize_module(model, tp_mesh, llama_plan(sequence_parallel=True))
    """
    # the layout of the residual stream between blocks
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        # whole heads on every rank, or refuse the plan before anything changes
        "": AttentionHeads("config.n_heads", "config.kv_heads"),
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(stream, None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=stream),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=stream),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "output": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan.update(
            {
                # local outputs: the next boundary (a PrepareModuleInput, the output
                # projection) knows their layout, and local tensors cross it cheapest
                "layers.*.attention_norm": SequenceParallel(use_local_output=True),
                "layers.*.attention_dropout": SequenceParallel(use_local_output=True),
                "layers.*.ffn_norm": SequenceParallel(use_local_output=True),
                "layers.*.ffn_dropout": SequenceParallel(use_local_output=True),
                "norm": SequenceParallel(use_local_output=True),
            }
        )
    return plan
