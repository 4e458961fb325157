"""A small Llama-style decoder in plain PyTorch.

This is the reference model that the demo, the tests and the benchmarks parallelize. It knows
nothing about tensor parallelism; the plan in ``torch_tp.plans.llama`` says how it is split.
It is written so that it *can* be split by a plan without edits:

* Module names follow Meta's Llama (``tok_embeddings``, ``layers.N.attention.wq``, ...), so plans
  and state dicts written for that family apply unchanged.
* :class:`Attention` never reads the number of heads from the config. It infers how many heads
  it holds from the width of ``wq``/``wk``/``wv`` outputs, so the same code runs the full model
  and a column-sharded one that holds only ``n_heads / tp`` heads per rank.
* Rotary embeddings use real cos/sin tables instead of complex numbers (DTensor and
  ``torch.compile`` handle real ops everywhere). The table is computed once by :class:`Llama`
  and passed to every block as a plain positional tensor, sliced to the *full* sequence length
  taken from the token tensor: under sequence parallelism the activations entering a block are
  sequence-sharded, but attention sees the full sequence again, and so must the table.

Example::

    >>> from torch_tp.models import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2))
    >>> tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    >>> model(tokens).shape
    torch.Size([2, 16, 1001])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rotary_emb",
    "precompute_rope",
    "tiny_config",
]

# The norm implementations a config may name; see ``LlamaConfig.norm``.
_NORMS = ("rmsnorm", "torch_rmsnorm")


@dataclass
class LlamaConfig:
    """Hyperparameters of :class:`Llama`.

    The defaults describe a tiny model that trains in seconds on a CPU. ``vocab_size`` is odd
    on purpose: it cannot be split evenly between ranks, so every vocabulary-sharded code path
    is exercised with uneven shards.

    Args:
        dim: Model (embedding) width.
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads. ``dim`` must be divisible by it.
        n_kv_heads: Number of key/value heads for grouped-query attention; ``None`` means
            ``n_heads`` (plain multi-head attention). Must divide ``n_heads``.
        vocab_size: Number of token ids.
        multiple_of: The SwiGLU hidden width is rounded up to a multiple of this.
        ffn_dim_multiplier: Optional factor applied to the default SwiGLU hidden width.
        hidden_dim: Explicit SwiGLU hidden width; overrides the two fields above.
        norm_eps: Epsilon of the RMS norms.
        max_seq_len: Longest sequence the rotary table is precomputed for.
        rope_theta: Base of the rotary frequencies.
        dropout: Dropout probability on each residual branch (attention and feed-forward).
        norm: ``"rmsnorm"`` for the hand-written :class:`RMSNorm`, ``"torch_rmsnorm"`` for
            :class:`torch.nn.RMSNorm`.
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 1001
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    dropout: float = 0.0
    norm: str = "rmsnorm"

    def __post_init__(self) -> None:
        # Fail at construction, with the field named, rather than deep inside a view() later.
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(
                f"head_dim (dim // n_heads = {self.dim // self.n_heads}) must be even for "
                "rotary embeddings"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})")
        if self.norm not in _NORMS:
            raise ValueError(f"norm must be one of {_NORMS}, found {self.norm!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), found {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads, resolving ``n_kv_heads=None`` to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden width of the SwiGLU feed-forward, computed the way Meta's Llama does."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        # SwiGLU has three matrices instead of two, so 2/3 of the usual 4 * dim keeps the
        # parameter count of a classic MLP.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def tiny_config(**overrides: Any) -> LlamaConfig:
    """Return a config small enough for unit tests, with grouped-query attention on.

    ``dim=64, n_layers=2, n_heads=4, n_kv_heads=2`` gives a hidden width of 176 and head, kv-head
    and hidden counts that split evenly across 1, 2 or 4 ranks; the vocabulary (1001) does not.

    Example::

        >>> tiny_config(n_layers=1).n_layers
        1
    """
    fields: dict[str, Any] = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
    fields.update(overrides)
    return LlamaConfig(**fields)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 (or wider) and cast back to the input
    dtype.

    Args:
        dim: Size of the last dimension.
        eps: Added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Low-precision inputs lose too much in the mean of squares: do it in float32 at
        # least (a float64 model stays float64).
        xf = x.to(_at_least_float32(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(xf.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if it is float32 or wider, else float32."""
    return torch.promote_types(dtype, torch.float32)


def _make_norm(config: LlamaConfig) -> nn.Module:
    if config.norm == "torch_rmsnorm":
        return nn.RMSNorm(config.dim, eps=config.norm_eps)
    return RMSNorm(config.dim, eps=config.norm_eps)


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float = 10000.0, device: torch.device | None = None
) -> torch.Tensor:
    """Precompute the rotary table for positions ``0 .. max_seq_len - 1``.

    Returns:
        A float32 tensor of shape ``(max_seq_len, head_dim // 2, 2)`` holding ``cos`` in
        ``[..., 0]`` and ``sin`` in ``[..., 1]`` for each position and frequency. Keeping both in
        one tensor lets a block take a single positional ``rope`` argument.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(max_seq_len, device=device).float()
    angles = torch.outer(positions, freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` by the position-dependent angles in ``rope``.

    Pairs are adjacent channels ``(2i, 2i + 1)``, as in Meta's Llama, which treats them as one
    complex number; this is the same rotation written with real arithmetic.

    Args:
        x: Tensor of shape ``(bsz, seqlen, n_heads, head_dim)``.
        rope: Table of shape ``(seqlen, head_dim // 2, 2)`` from :func:`precompute_rope`.
    """
    xf = x.to(_at_least_float32(x.dtype)).unflatten(-1, (-1, 2))
    x_even, x_odd = xf[..., 0], xf[..., 1]
    # Broadcast the (seqlen, head_dim // 2) tables over batch and heads.
    cos = rope[..., 0].unsqueeze(1)
    sin = rope[..., 1].unsqueeze(1)
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query attention.

    The number of heads is read from tensor shapes at run time, never from the config: after
    column-sharding ``wq``/``wk``/``wv`` a rank holds only its local heads, and the same code
    must run unchanged. Only ``head_dim`` is fixed.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(bsz, seqlen, dim)``; ``rope`` covers ``seqlen``."""
        bsz, seqlen, _ = x.shape
        # -1: however many heads this rank holds (all of them without tensor parallelism).
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, rope)
        k = apply_rotary_emb(k, rope)

        # (bsz, heads, seqlen, head_dim) for SDPA. Grouped-query attention (enable_gqa): each
        # kv head serves a contiguous group of query heads, without copies of k and v (a
        # context-parallel ring then carries the kv heads only). Sharding keeps whole groups
        # together on a rank (contiguous head blocks), so the local ratio equals the global
        # one. No dropout on the attention weights: that would draw different masks per head
        # shard; the block applies dropout to the branch output instead.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``.

    Args:
        dim: Input and output width.
        hidden_dim: Width of the gated hidden layer.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, with dropout on
    each branch output before the residual add."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = _make_norm(config)
        self.attention = Attention(config)
        self.attention_dropout = nn.Dropout(config.dropout)
        self.ffn_norm = _make_norm(config)
        self.feed_forward = self._make_feed_forward(config)
        self.ffn_dropout = nn.Dropout(config.dropout)

    def _make_feed_forward(self, config: LlamaConfig) -> nn.Module:
        """The block's feed-forward (a mixture-of-experts block builds another kind)."""
        return FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention_dropout(self.attention(self.attention_norm(x), rope))
        return h + self.ffn_dropout(self.feed_forward(self.ffn_norm(h)))


class Llama(nn.Module):
    """A Llama-style decoder-only language model.

    Args:
        config: The hyperparameters; defaults to ``LlamaConfig()``.

    Example::

        >>> model = Llama(tiny_config())
        >>> logits = model(torch.randint(0, 1001, (2, 8)))
        >>> logits.shape, logits.dtype
        (torch.Size([2, 8, 1001]), torch.float32)
    """

    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__()
        self.config = config = config if config is not None else LlamaConfig()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(self._make_block(config) for _ in range(config.n_layers))
        self.norm = _make_norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Non-persistent: it is derived from the config, so it stays out of state dicts and
        # checkpoints, and parallelize_module leaves plain buffers alone.
        self.register_buffer("rope_cache", self._rope_table(), persistent=False)
        self.init_weights()

    def _make_block(self, config: LlamaConfig) -> nn.Module:
        """One transformer block (a mixture-of-experts model builds another kind)."""
        return TransformerBlock(config)

    def _rope_table(self, device: torch.device | None = None) -> torch.Tensor:
        c = self.config
        return precompute_rope(c.head_dim, c.max_seq_len, c.rope_theta, device=device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter and the rotary table.

        Linear and embedding weights are drawn from ``N(0, 0.02)`` so that logits are neither
        zero nor saturated at init; norm weights are ones. Call it after materializing a model
        built on the meta device (``buffer_device`` says where the rotary table goes).
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (RMSNorm, nn.RMSNorm)):
                module.reset_parameters()
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_table(device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Map token ids ``(bsz, seqlen)`` to logits ``(bsz, seqlen, vocab_size)``, float32 or
        wider (float64 for a float64 model).

        ``positions`` (``(seqlen,)`` int64, optional) are the tokens' positions for the rotary
        embeddings: those of a part of a longer sequence under context parallelism
        (:func:`torch_tp.sequence_positions`). Default: ``0 .. seqlen - 1``.
        """
        seqlen = tokens.shape[1]
        if positions is None and seqlen > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} exceeds max_seq_len {self.config.max_seq_len}"
            )
        if positions is not None:
            if positions.shape != (seqlen,):
                raise ValueError(
                    f"positions must be of shape ({seqlen},), one per token, found "
                    f"{tuple(positions.shape)}"
                )
        # Sliced from the tokens, not from h: with sequence parallelism the embedding output
        # is already split along the sequence, but attention works on the full sequence.
        rope = self.rope_cache[:seqlen] if positions is None else self.rope_cache[positions]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope)
        logits = self.output(self.norm(h))
        return logits.to(_at_least_float32(logits.dtype))
