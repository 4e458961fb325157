"""A small mixture-of-experts Llama in plain PyTorch (Mixtral / Qwen3-MoE style).

The reference Llama (:mod:`torch_tp.models.llama`) with every feed-forward replaced by a
top-k routed mixture of SwiGLU experts, and optionally a shared expert that every token goes
through (Qwen2-MoE, DeepSeek). It knows nothing about parallelism. Its layout follows
transformers' MoE models, so that plans written for them apply:

* the router, ``feed_forward.router``, is a linear map to one logit per expert (``weight``
  ``[n_experts, dim]``) followed by a softmax and a top-k (:class:`TopKRouter`);
* the experts, ``feed_forward.experts``, are stacked: ``gate_up_proj`` ``[n_experts,
  2 * expert_hidden_dim, dim]`` (each expert's gate rows, then its up rows) and
  ``down_proj`` ``[n_experts, dim, expert_hidden_dim]``, and the module is called as
  transformers' experts modules are, ``experts(hidden, top_k_index, top_k_weights)`` on
  flattened tokens (:class:`Experts`);
* dropless routing: no capacity factor, no token dropped; an expert that gets no token is
  skipped.

The load-balancing loss of each block's last forward (Switch Transformer's, as Mixtral's:
``n_experts * sum_e f_e * P_e``, where ``f_e`` is the share of routing slots that went to
expert ``e`` and ``P_e`` the mean router probability of ``e``) is summed, times
``router_aux_loss_coef``, by :meth:`MoELlama.aux_loss`.

Example::

    >>> from torch_tp.models import MoEConfig, MoELlama
    >>> model = MoELlama(MoEConfig(dim=64, n_layers=2, n_heads=4, n_experts=4, top_k=2))
    >>> tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    >>> loss = model(tokens).logsumexp(-1).mean() + model.aux_loss()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch_tp.models.llama import FeedForward, Llama, LlamaConfig, TransformerBlock

__all__ = [
    "Experts",
    "MoEConfig",
    "MoEFeedForward",
    "MoELlama",
    "MoETransformerBlock",
    "TopKRouter",
    "load_balancing_loss",
]


@dataclass
class MoEConfig(LlamaConfig):
    """Hyperparameters of :class:`MoELlama`: those of :class:`LlamaConfig` and the experts'.

    Args:
        n_experts: Number of routed experts per block.
        top_k: Experts each token is routed to.
        expert_hidden_dim: Hidden width of each expert's SwiGLU.
        shared_expert_hidden_dim: Hidden width of a shared expert every token goes through,
            added to the routed experts' output; ``None``: no shared expert.
        norm_topk_prob: Renormalize each token's top-k routing weights to sum to one (Mixtral,
            Qwen3-MoE); otherwise they are the softmax probabilities as they are.
        router_aux_loss_coef: Factor of the load-balancing loss in :meth:`MoELlama.aux_loss`.
    """

    n_experts: int = 4
    top_k: int = 2
    expert_hidden_dim: int = 32
    shared_expert_hidden_dim: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be positive, found {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k must be in [1, n_experts = {self.n_experts}], found {self.top_k}"
            )
        if self.expert_hidden_dim < 1:
            raise ValueError(f"expert_hidden_dim must be positive, found {self.expert_hidden_dim}")


class TopKRouter(nn.Module):
    """One logit per expert for each token, a softmax, and the top ``top_k``.

    Args:
        dim: Token width.
        n_experts: Number of experts.
        top_k: Experts per token.
        norm_topk_prob: Renormalize the top-k weights to sum to one.

    Returns (of ``forward(hidden)``, ``hidden`` of shape ``[tokens, dim]``):
        ``(probs, top_k_weights, top_k_index)``: the softmax over all experts ``[tokens,
        n_experts]`` in float32 or wider (for the load-balancing loss), and each token's routing
        weights (in ``hidden``'s dtype) and expert indices, ``[tokens, top_k]``.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the softmax in float32 at least (float64 stays float64)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        probs = F.linear(hidden, self.weight).to(dtype).softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(hidden.dtype), index

    def extra_repr(self) -> str:
        experts, dim = self.weight.shape
        return f"dim={dim}, n_experts={experts}, top_k={self.top_k}"


class Experts(nn.Module):
    """``n_experts`` SwiGLU experts with stacked weights, each applied to its tokens only.

    ``gate_up_proj[e]`` ``[2 * hidden_dim, dim]`` holds expert ``e``'s gate rows, then its up
    rows; ``down_proj[e]`` is ``[dim, hidden_dim]``. Expert ``e`` computes
    ``down_proj[e] @ (silu(gate) * up)`` for the tokens routed to it, and each result is
    added to its token's output times the token's routing weight for ``e``.

    Args:
        n_experts: Number of experts.
        dim: Token width.
        hidden_dim: Hidden width of each expert.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=0.02)
        nn.init.normal_(self.down_proj, mean=0.0, std=0.02)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[tokens, dim]``; ``top_k_index`` and ``top_k_weights`` ``[tokens,
        top_k]``; returns ``[tokens, dim]``."""
        n_experts, top_k = self.gate_up_proj.shape[0], top_k_index.shape[-1]
        out = torch.zeros_like(hidden)
        # the routing slots grouped by expert: one sort, one count read back to the host
        slots = top_k_index.reshape(-1).argsort(stable=True)
        counts = torch.bincount(top_k_index.reshape(-1), minlength=n_experts).tolist()
        for expert, expert_slots in enumerate(slots.split(counts)):
            if not counts[expert]:
                continue  # dropless: an expert with no token is simply skipped
            token = expert_slots // top_k
            gate, up = F.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            weight = top_k_weights.reshape(-1)[expert_slots].unsqueeze(-1)
            out = out.index_add(0, token, y * weight)
        return out

    def extra_repr(self) -> str:
        experts, two_hidden, dim = self.gate_up_proj.shape
        return f"n_experts={experts}, dim={dim}, hidden_dim={two_hidden // 2}"


def load_balancing_loss(probs: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, as Mixtral computes it: ``n_experts *
    sum_e f_e * P_e``, with ``f_e`` the share of the routing slots (``top_k_index``) that
    went to expert ``e`` and ``P_e`` the mean of ``probs[:, e]``. It is 1 for perfectly even
    routing, and its gradient reaches the router through ``P_e``."""
    n_experts, slots = probs.shape[-1], top_k_index.reshape(-1)
    # a count per expert (a scatter, not bincount: shapes that do not depend on the values)
    counts = probs.new_zeros(n_experts).index_add_(0, slots, probs.new_ones(slots.shape))
    share = counts / top_k_index.numel()
    return n_experts * (share * probs.mean(dim=0)).sum()


class MoEFeedForward(nn.Module):
    """A router, its experts and an optional shared expert, on every token of ``x``.

    After each forward, :attr:`aux_loss` holds that forward's load-balancing loss.

    Args:
        config: The model's :class:`MoEConfig`.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = TopKRouter(config.dim, config.n_experts, config.top_k, config.norm_topk_prob)
        self.experts = Experts(config.n_experts, config.dim, config.expert_hidden_dim)
        self.shared_expert = (
            None
            if config.shared_expert_hidden_dim is None
            else FeedForward(config.dim, config.shared_expert_hidden_dim)
        )
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, weights, index = self.router(tokens)
        out = self.experts(tokens, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        self.aux_loss = load_balancing_loss(probs, index)
        return out.view_as(x)


class MoETransformerBlock(TransformerBlock):
    """:class:`~torch_tp.models.llama.TransformerBlock` with a :class:`MoEFeedForward` as its
    ``feed_forward``: the attention and norms keep their names, so their plans apply."""

    def _make_feed_forward(self, config: LlamaConfig) -> nn.Module:
        return MoEFeedForward(config)


class MoELlama(Llama):
    """:class:`~torch_tp.models.llama.Llama` whose feed-forwards are mixtures of experts.

    Args:
        config: The hyperparameters; defaults to ``MoEConfig()``.

    Example::

        >>> model = MoELlama(MoEConfig(n_experts=4, top_k=2))
        >>> model(torch.randint(0, 1001, (2, 8))).shape
        torch.Size([2, 8, 1001])
    """

    def __init__(self, config: MoEConfig | None = None) -> None:
        config = config if config is not None else MoEConfig()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoELlama takes a MoEConfig, found {type(config).__name__}")
        super().__init__(config)

    def _make_block(self, config: LlamaConfig) -> nn.Module:
        return MoETransformerBlock(config)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """:meth:`Llama.init_weights`, and the routers' and experts' ``N(0, 0.02)``."""
        super().init_weights(buffer_device)
        for module in self.modules():
            if isinstance(module, (TopKRouter, Experts)):
                module.reset_parameters()

    def aux_loss(self) -> torch.Tensor:
        """``router_aux_loss_coef`` times the sum of every block's load-balancing loss, from
        the last forward (add it to the training loss).

        Raises:
            RuntimeError: the model has not run forward yet.
        """
        losses = [layer.feed_forward.aux_loss for layer in self.layers]
        if any(loss is None for loss in losses):
            raise RuntimeError("aux_loss() reads the last forward's routing: run the model first")
        return self.config.router_aux_loss_coef * torch.stack(losses).sum()
