"""The plans of the reference mixture-of-experts Llama (:class:`torch_tp.models.MoELlama`).

Attention, embeddings, norms and the output projection are planned as in
:func:`torch_tp.plans.llama.llama_plan`; each block's feed-forward is a router, stacked
experts and an optional shared expert, planned in one of two ways:

``experts="tp"``: tensor-parallel experts (:class:`~torch_tp.TensorParallelExperts`)
    Every rank holds a slice of every expert's hidden dimension. The router is replicated
    (it sees every token). One all-reduce forward and one backward per MoE layer, as a dense
    MLP costs. With ``sequence_parallel`` the block's sequence shard is gathered before the
    feed-forward, the experts' and the shared expert's outputs are left partial sums, added,
    and the block's output reduce-scattered back to the sequence shard: one all-gather and
    one reduce-scatter forward, the same backward (the output's gradient gathered, the
    input's partial gradient reduce-scattered). The router then sees every token but its
    gradients are partial sums (summed at the end of backward with the norms'), and the
    load-balancing loss, computed alike on every rank, reaches it once: rank 0 hands its
    whole gradient back, the others zeros (``ReplicateParallel(whole_gradient_outputs=(0,))``).

``experts="ep"``: expert parallelism (:class:`~torch_tp.ExpertParallel`)
    Each rank holds whole experts (``n_experts`` must divide by the degree). Without
    sequence parallelism every rank has every token: each computes its experts on the tokens
    routed to them, and one all-reduce sums the results (one backward too). With
    ``sequence_parallel`` each rank routes its own sequence shard, and the tokens go to their
    experts' ranks and back by all-to-all (two forward, two backward), the router's
    gradients being partial sums, summed at the end of backward.

The shared expert, where the model has one, is a tensor-parallel SwiGLU (column-parallel
``w1``/``w3``, row-parallel ``w2``); under ``experts="ep"`` with sequence parallelism it
gathers the block's tokens (flattened, on dim 0) and reduce-scatters its output back.

The load-balancing loss (:meth:`~torch_tp.models.MoELlama.aux_loss`) is computed from each
rank's router outputs: with every token on every rank (no sequence parallelism) it is the
single-device loss exactly; on a sequence shard it is that shard's loss.
"""

from __future__ import annotations

from typing import Literal

from torch.distributed.tensor import Partial, Replicate, Shard

from torch_tp.plans.llama import llama_plan
from torch_tp.style import (
    ColwiseParallel,
    ExpertParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    ReplicateParallel,
    RowwiseParallel,
    TensorParallelExperts,
)

__all__ = ["moe_llama_plan"]


def moe_llama_plan(
    *,
    experts: Literal["tp", "ep"] = "tp",
    shared_expert: bool = False,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The plan for :class:`torch_tp.models.MoELlama`, for :func:`torch_tp.parallelize_module`.

    Keyword Args:
        experts (str, optional): ``"tp"``, every expert sharded on its hidden dimension over
            the ranks, or ``"ep"``, whole experts split over the ranks. Default: ``"tp"``.
        shared_expert (bool, optional): plan each block's shared expert (the model's
            ``config.shared_expert_hidden_dim`` is set). Default: ``False``.
        sequence_parallel (bool, optional): shard activations between blocks, norms and
            dropouts on the sequence dimension. Default: ``False``.
        loss_parallel (bool, optional): return the logits as a DTensor sharded on the
            vocabulary. Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the layers) to styles.

    Raises:
        ValueError: ``experts`` is neither ``"tp"`` nor ``"ep"``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.models import MoEConfig, MoELlama
        >>> from torch_tp.plans.moe import moe_llama_plan
        >>> model = MoELlama(MoEConfig(n_experts=8, top_k=2))
        >>> parallelize_module(model, tp_mesh, moe_llama_plan(experts="ep"))
    """
    if experts not in ("tp", "ep"):
        raise ValueError(
            f"experts must be 'tp' (tensor-parallel experts) or 'ep' (expert parallelism), "
            f"found {experts!r}"
        )
    plan = {
        path: style
        for path, style in llama_plan(
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        ).items()
        if not path.startswith("layers.*.feed_forward")
    }
    ff = "layers.*.feed_forward"
    dispatch = experts == "ep" and sequence_parallel
    # tensor-parallel experts under sequence parallelism or beside a shared expert: the
    # block's output is a partial sum (the experts' and the shared expert's together),
    # reduced once: reduce-scattered onto the sequence, or all-reduced (a region whose input
    # gradients are partial, reduced once too)
    region = experts == "tp" and (sequence_parallel or shared_expert)
    if experts == "tp":
        plan[f"{ff}.experts"] = TensorParallelExperts(
            output_layouts=Partial() if region else Replicate()
        )
    else:
        plan[f"{ff}.experts"] = ExpertParallel(
            input_layouts=Shard(0) if sequence_parallel else Replicate()
        )
    # a router on a sequence shard sees part of the tokens: its gradients are partial sums;
    # in the region, so are they (its routing weights' from the experts), but the gradient of
    # its probabilities (output 0, the load-balancing loss's) is whole on every rank
    if region:
        plan[f"{ff}.router"] = ReplicateParallel(sum_gradients=True, whole_gradient_outputs=(0,))
    else:
        plan[f"{ff}.router"] = ReplicateParallel(sum_gradients=dispatch)
    if region:
        # under sequence parallelism, gather the sequence before the feed-forward (its
        # gradient reduce-scattered back) and reduce-scatter the block's partial output onto
        # the sequence after it; without, all-reduce both. On [batch, seq, dim]: the
        # experts' flattened tokens are not a sequence shard when batch > 1
        between = Shard(1) if sequence_parallel else Replicate()
        plan[ff] = PrepareModuleInputOutput(
            input_layouts=between,
            desired_input_layouts=Replicate(),
            use_local_input=True,
            partial_input_gradients=True,
            output_layouts=Partial(),
            desired_output_layouts=between,
        )
    if not shared_expert:
        return plan
    # the shared expert's tokens: flattened [tokens, dim], this rank's (dispatch) or all;
    # in the region, its output is left a partial sum and its input's gradient too
    tokens = Shard(0) if dispatch else Replicate()
    plan[f"{ff}.shared_expert"] = PrepareModuleInput(
        input_layouts=tokens, desired_input_layouts=Replicate(), partial_input_gradients=region
    )
    plan[f"{ff}.shared_expert.w1"] = ColwiseParallel()
    plan[f"{ff}.shared_expert.w3"] = ColwiseParallel()
    plan[f"{ff}.shared_expert.w2"] = RowwiseParallel(output_layouts=Partial() if region else tokens)
    return plan
