"""A hand-written Megatron-style tensor-parallel Llama: the baseline of ``bench_tp.py``.

No DTensor anywhere: every rank holds its shards as ordinary tensors and every collective is
an explicit autograd function whose forward and backward are each other's conjugate, named
after the region the activation enters or leaves, as in Megatron-LM's
``core/tensor_parallel/mappings.py``:

===================================  ====================  ====================
region function                      forward               backward
===================================  ====================  ====================
``copy_to_region``                   identity              all-reduce
``reduce_from_region``               all-reduce            identity
``gather_from_sequence_region``      all-gather (seq)      reduce-scatter (seq)
``reduce_scatter_to_sequence_region``  reduce-scatter (seq)  all-gather (seq)
``gather_from_region``               all-gather (last)     split (last)
===================================  ====================  ====================

:class:`MegatronLlama` is built from a reference :class:`torch_tp.models.Llama` by slicing its
state dict, and runs the reference's own ``Attention``/``FeedForward``/norm code on the local
shards, so the math is the reference model's and only the communication around it is
hand-written. Each block half enters its tensor-parallel region once (one ``copy`` or one
sequence all-gather shared by q/k/v, or by the gate and up projections) and leaves it once
(one all-reduce or reduce-scatter after ``wo`` or ``w2``): the minimum for this layout. The
logits are all-gathered on the vocabulary, so the loss is the plain cross-entropy every
other variant uses. With sequence parallelism each rank's norm-weight gradients cover only
its sequence shard; :meth:`MegatronLlama.reduce_norm_grads` sums them across ranks in one
coalesced all-reduce per step, as Megatron does at the end of backward.

It is deliberately no faster than that: q/k/v and gate/up stay separate GEMMs (the
reference's compute, no fused weights), collectives are synchronous (no overlap of the
input-gradient all-reduce with the weight-gradient GEMM) and the gathered input of each
block half is saved for backward (Megatron can re-gather it instead, to save memory).

Example::

    >>> # xdoctest: +SKIP("distributed")
    >>> reference = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=1024))
    >>> model = MegatronLlama(reference, dist.group.WORLD, sequence_parallel=True)
    >>> loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    >>> loss.backward()
    >>> model.reduce_norm_grads()  # sequence parallel only: one all-reduce for all norms
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from torch_tp.models import Llama

__all__ = [
    "MegatronLlama",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence_region",
    "reduce_from_region",
    "reduce_scatter_to_sequence_region",
]

# The sequence dimension of the (batch, seq, dim) activations, as in the reference model and
# torch_tp's plan (Megatron itself keeps activations as (seq, batch, dim) and uses dim 0).
SEQ_DIM = 1


# ---------------------------------------------------------------------------------------------
# The primitives: plain torch.distributed calls, no autograd


def _all_reduce_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over the group, in place (``x`` must be a fresh buffer nobody else reads)."""
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    # gloo wants the output in concatenated form: (world * x.shape[0], *x.shape[1:])
    gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(gathered, x, group=group)
    stacked = gathered.view(world, *x.shape)
    # (world, ..., shard, ...) -> (..., world * shard, ...): a view when ``dim`` leads
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk of ``dim``."""
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide by {world} ranks")
    # the collective scatters along the leading dimension: bring ``dim``'s chunks there
    chunks = x.unflatten(dim, (world, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_single(out, chunks.flatten(0, 1), group=group)
    return out


def _split(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's chunk of ``dim`` (no communication)."""
    chunks = x.chunk(dist.get_world_size(group), dim)
    return chunks[dist.get_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------
# The regions: each forward's backward is its conjugate


class _CopyToRegion(torch.autograd.Function):
    """Enter a tensor-parallel region with a replicated input: identity / all-reduce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # each rank's gradient covers only its own columns (heads, hidden units): sum them.
        # In place: the incoming gradient is the fresh sum of the column-parallel GEMMs' input
        # gradients, owned by this node alone.
        return _all_reduce_(grad.contiguous(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Leave a tensor-parallel region by summing partial results: all-reduce / identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        # in place on the row-parallel GEMM's fresh output, which nothing saved for backward
        ctx.mark_dirty(x)
        return _all_reduce_(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Enter a region from a sequence shard: all-gather / reduce-scatter on the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Leave a region onto a sequence shard: reduce-scatter / all-gather on the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Leave a region by concatenating last-dim shards: all-gather / split (last dim)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, x.ndim - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, grad.ndim - 1, ctx.group), None


def copy_to_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce forward (in place), identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather on the sequence forward, reduce-scatter backward."""
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter on the sequence forward, all-gather backward."""
    return _ReduceScatterToSequenceRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather on the last dimension forward, split backward."""
    return _GatherFromRegion.apply(x, group)


# ---------------------------------------------------------------------------------------------
# The model


def _chunk(tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's even chunk of ``tensor`` on ``dim``, as a fresh parameter."""
    world = dist.get_world_size(group)
    if tensor.shape[dim] % world:
        raise ValueError(
            f"the baseline needs even shards: dim {dim} of size {tensor.shape[dim]} does not "
            f"divide by {world} ranks"
        )
    local = tensor.detach().chunk(world, dim)[dist.get_rank(group)]
    return nn.Parameter(local.clone(), requires_grad=tensor.requires_grad)


def _shard_linear(linear: nn.Linear, dim: int, group: ProcessGroup) -> None:
    """Keep only this rank's rows (``dim=0``, column-parallel) or columns (``dim=1``)."""
    if linear.bias is not None:
        raise ValueError("the baseline shards bias-free Linears only (as in the Llama model)")
    linear.weight = _chunk(linear.weight, dim, group)
    linear.out_features, linear.in_features = linear.weight.shape


class _Regions:
    """How a block half enters and leaves its region, with or without sequence parallelism."""

    def __init__(self, group: ProcessGroup, sequence_parallel: bool) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence_region(x, self.group)
        return copy_to_region(x, self.group)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(partial, self.group)
        return reduce_from_region(partial, self.group)


class _VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split across ranks."""

    def __init__(self, embedding: nn.Embedding, regions: _Regions) -> None:
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("the baseline supports plain embeddings only")
        group = regions.group
        self.regions = regions
        self.weight = _chunk(embedding.weight, 0, group)
        self.start = dist.get_rank(group) * self.weight.shape[0]
        self.stop = self.start + self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids of other ranks look up row 0 and are zeroed; the sum over ranks then holds
        # exactly one real row per id
        foreign = (ids < self.start) | (ids >= self.stop)
        local = F.embedding((ids - self.start).masked_fill(foreign, 0), self.weight)
        return self.regions.leave(local.masked_fill(foreign.unsqueeze(-1), 0.0))


class _Block(nn.Module):
    """The reference block on local shards, with one region entry and exit per half."""

    def __init__(self, block: nn.Module, regions: _Regions) -> None:
        super().__init__()
        group = regions.group
        self.regions = regions
        self.attention_norm = block.attention_norm
        self.attention = block.attention  # runs on its local heads: it infers their number
        for name in ("wq", "wk", "wv"):
            _shard_linear(getattr(self.attention, name), 0, group)
        _shard_linear(self.attention.wo, 1, group)
        self.attention_dropout = block.attention_dropout
        self.ffn_norm = block.ffn_norm
        self.feed_forward = block.feed_forward
        _shard_linear(self.feed_forward.w1, 0, group)
        _shard_linear(self.feed_forward.w3, 0, group)
        _shard_linear(self.feed_forward.w2, 1, group)
        self.ffn_dropout = block.ffn_dropout

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        enter, leave = self.regions.enter, self.regions.leave
        attn = leave(self.attention(enter(self.attention_norm(x)), rope))
        h = x + self.attention_dropout(attn)
        ffn = leave(self.feed_forward(enter(self.ffn_norm(h))))
        return h + self.ffn_dropout(ffn)


class MegatronLlama(nn.Module):
    """The reference Llama split across ``group`` by hand, Megatron-style.

    Args:
        reference: the model to split; it is copied, not modified. Every rank must pass the
            same weights (the shards are sliced locally, nothing is broadcast).
        group: the tensor-parallel process group.
        sequence_parallel: shard the activations between block halves (and the norms that
            run on them) on the sequence dimension.

    The head counts, the feed-forward width, the vocabulary and (with sequence parallelism)
    the sequence length must divide by the group size.
    """

    def __init__(
        self, reference: Llama, group: ProcessGroup, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        reference = copy.deepcopy(reference)
        self.config = reference.config
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.regions = _Regions(group, sequence_parallel)
        self.tok_embeddings = _VocabParallelEmbedding(reference.tok_embeddings, self.regions)
        self.layers = nn.ModuleList(_Block(block, self.regions) for block in reference.layers)
        self.norm = reference.norm
        self.output = reference.output
        _shard_linear(self.output, 0, group)  # vocabulary-parallel
        self.register_buffer("rope_cache", reference.rope_cache, persistent=False)
        norms = [self.norm]
        for layer in self.layers:
            norms += [layer.attention_norm, layer.ffn_norm]
        self._norm_params = [p for norm in norms for p in norm.parameters() if p.requires_grad]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(bsz, seqlen)`` to full float32 logits ``(bsz, seqlen, vocab)``."""
        rope = self.rope_cache[: tokens.shape[1]]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope)
        logits = self.output(self.regions.enter(self.norm(h)))
        return gather_from_region(logits, self.group).float()

    def reduce_norm_grads(self) -> None:
        """Sum the norm-weight gradients across ranks in one all-reduce (after backward).

        Only needed with sequence parallelism, where each rank's gradient covers its own
        sequence shard; a no-op without it.
        """
        if not self.sequence_parallel:
            return
        grads = [p.grad for p in self._norm_params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
