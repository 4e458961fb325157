"""More small models written the way widely copied public codebases write them (part 1).

As in :mod:`foreign_models`, each model is our own code, written from what a public codebase
looks like (its module tree, attribute names and the idioms of its ``forward``), not copied
from it; configs are tiny, weights random, everything runs in float64 (the originals' casts
to float32 left out), dropout is off. This part holds causal LMs, the fused q/k/v
projections first:

* GPT-NeoX / Pythia (transformers' ``modeling_gpt_neox``): q, k and v packed per head,
  ``view(..., heads, 3 * head_size)`` then sliced; parallel residual; partial rotary;
* BLOOM (``modeling_bloom``): ``view(..., heads, 3, head_dim)``, ALiBi built from the head
  count in the model and passed to every block, ``baddbmm`` over ``batch * heads``;
* Falcon-7B and Falcon-40B (``modeling_falcon``): multi-query (``heads + 2`` head slots) and
  the new decoder architecture packed per key/value group (``heads // kv_heads + 2`` slots),
  on ``FalconLinear`` (an ``nn.Linear`` with its own forward);
* GPTBigCode / SantaCoder (``modeling_gpt_bigcode``): multi-query, ``c_attn`` split by sizes
  ``(embed_dim, 2 * kv_dim)``, the query folded into ``(B, T * heads, head_dim)``;
* MPT in transformers' port (``modeling_mpt``): ``Wqkv`` clamped (``clip_qkv``) then
  ``chunk(3)``, ALiBi from the model's head count, the residual added inside the MLP;
* MPT as mosaicml/llm-foundry writes it: ``Wqkv`` split ``[d_model, kv_n_heads * head_dim,
  ...]``, the attention function an attribute taking the head counts as arguments, ALiBi as
  an ``attn_bias`` of shape ``(1, heads, 1, S)``, and a ``SharedEmbedding`` that is also the
  output head (``wte(x, unembed=True)``);
* OLMo (allenai/OLMo ``olmo/model.py``): a block whose projections are its direct children
  (``att_proj``, ``attn_out``, ``ff_proj``, ``ff_out``), ``qkv.clamp_`` then a split by
  ``self.fused_dims``, SwiGLU as a module that chunks; and its Llama block (``q_proj``,
  ``k_proj``, ``v_proj`` beside ``attn_out`` and the MLP, all in the block);
* Baichuan-13B / Baichuan2 (their ``modeling_baichuan.py``): ``W_pack`` unflattened
  ``(3, hidden_size)``, an ALiBi mask ``(heads, T, T)`` from the model, and ``NormHead``, an
  output head holding its own weight and calling ``F.linear``;
* Phi-1.5 / Phi-2 (transformers' ``modeling_phi``): attention and MLP in parallel off one
  norm, the output projection named ``dense``, partial rotary, a head with a bias;
* GPT-J (``modeling_gptj``): parallel block, rotary on the first ``rotary_dim`` features of
  each head (every two interleaved), the head count passed to ``_split_heads``;
* nanochat (karpathy/nanochat ``gpt.py``): grouped-query attention whose key/value head count
  is named ``n_kv_head``, a functional QK norm, logits soft-capped, the loss returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from foreign_models import DIM, HEADS, LAYERS, VOCAB, Foreign, _tokens
from torch import nn

__all__ = ["MORE_MODELS"]

MAX_POS = 16  # max_position_embeddings of every model here (a size no head count equals)


def _causal_inputs() -> tuple[tuple, dict]:
    """Token ids and a padding mask (1 for tokens, 0 for padding: the second sequence's last
    two positions), as transformers' causal LMs take them."""
    tokens = _tokens()
    mask = torch.ones_like(tokens)
    mask[1, -2:] = 0
    return (tokens, mask), {}


def _additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, 1, T, T)``: 0 where a query may attend, the dtype's minimum elsewhere (causal and
    padding)."""
    seq = attention_mask.shape[-1]
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device))
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class _RotaryTables(nn.Module):
    """cos/sin tables of the ``rotate_half`` rotary embedding (transformers' layout)."""

    def __init__(self, dim: int, max_position_embeddings: int = MAX_POS, base: float = 1e4):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def _apply_rotary(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # (B, 1, T, rot)
    sin = sin[position_ids].unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    seq = input_ids.shape[1]
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)


def _init_normal(model: nn.Module, std: float = 0.02) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.uniform_(module.bias, -0.1, 0.1)


# ==========================================================================================
# GPT-NeoX / Pythia: q, k, v packed per head, parallel residual, partial rotary
# ==========================================================================================


@dataclass
class GPTNeoXConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    intermediate_size: int = 4 * DIM
    rotary_pct: float = 0.5
    max_position_embeddings: int = MAX_POS
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.rotary_emb = _RotaryTables(self.rotary_ndims, max_positions)
        self.norm_factor = math.sqrt(self.head_size)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids):
        qkv = self.query_key_value(hidden_states)
        # [batch, seq, heads * 3 * head_size] -> [batch, seq, heads, 3 * head_size]
        new_qkv_shape = qkv.size()[:-1] + (self.num_attention_heads, 3 * self.head_size)
        qkv = qkv.view(*new_qkv_shape)
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)
        query_rot, query_pass = query[..., : self.rotary_ndims], query[..., self.rotary_ndims :]
        key_rot, key_pass = key[..., : self.rotary_ndims], key[..., self.rotary_ndims :]
        seq_len = key.shape[-2]
        cos, sin = self.rotary_emb(value, seq_len=seq_len)
        query, key = _apply_rotary(query_rot, key_rot, cos, sin, position_ids)
        query = torch.cat((query, query_pass), dim=-1)
        key = torch.cat((key, key_pass), dim=-1)
        attn_output = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_size)
        return self.dense(attn_output)

    @classmethod
    def _merge_heads(cls, tensor, num_attention_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size(0), tensor.size(1), num_attention_heads * attn_head_size)

    def _attn(self, query, key, value, attention_mask):
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        attn_scores = torch.matmul(query, key.transpose(-1, -2)) / self.norm_factor
        mask_value = torch.finfo(attn_scores.dtype).min
        attn_scores = torch.where(causal_mask, attn_scores, mask_value) + attention_mask
        return torch.matmul(F.softmax(attn_scores, dim=-1), value)


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = nn.GELU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(hidden_states)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_dropout = nn.Dropout(0.0)
        self.post_mlp_dropout = nn.Dropout(0.0)
        self.attention = GPTNeoXAttention(config)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, hidden_states, attention_mask, position_ids):
        attn_output = self.attention(
            self.input_layernorm(hidden_states), attention_mask, position_ids
        )
        attn_output = self.post_attention_dropout(attn_output)
        # use_parallel_residual: x = x + attn(ln1(x)) + mlp(ln2(x))
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        return self.post_mlp_dropout(mlp_output) + attn_output + hidden_states


class GPTNeoXModel(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.emb_dropout = nn.Dropout(0.0)
        self.layers = nn.ModuleList([GPTNeoXLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, attention_mask):
        hidden_states = self.emb_dropout(self.embed_in(input_ids))
        extended = attention_mask[:, None, None, :].to(hidden_states.dtype)
        extended = (1.0 - extended) * torch.finfo(hidden_states.dtype).min
        position_ids = _positions(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, extended, position_ids)
        return self.final_layer_norm(hidden_states)


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config: GPTNeoXConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTNeoXConfig()
        self.gpt_neox = GPTNeoXModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init_normal(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.gpt_neox.embed_in

    def forward(self, input_ids, attention_mask):
        return self.embed_out(self.gpt_neox(input_ids, attention_mask))


# ==========================================================================================
# BLOOM: fused qkv viewed (heads, 3, head_dim), ALiBi from the model's head count
# ==========================================================================================


@dataclass
class BloomConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    n_layer: int = LAYERS
    n_head: int = HEADS
    layer_norm_epsilon: float = 1e-5


def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype) -> torch.Tensor:
    """``(batch * heads, 1, T)``: each head's slope times the key's position (BLOOM's ALiBi,
    relying on softmax's shift invariance)."""
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(
        2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=attention_mask.device
    )
    powers = torch.arange(1, 1 + closest_power_of_2, device=attention_mask.device)
    slopes = torch.pow(base, powers)  # (BLOOM interleaves more slopes for other head counts)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def dropout_add(x, residual, prob: float, training: bool) -> torch.Tensor:
    return residual + F.dropout(x, p=prob, training=training)


class BloomAttention(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.hidden_dropout = 0.0
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(0.0)

    def _split_heads(self, fused_qkv: torch.Tensor):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim).permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, residual, alibi, attention_mask):
        fused_qkv = self.query_key_value(hidden_states)  # [batch, seq, 3 x hidden]
        query_layer, key_layer, value_layer = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape
        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, q_length, self.head_dim
        )
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(
            batch_size * self.num_heads, self.head_dim, q_length
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, q_length, self.head_dim
        )
        matmul_result = alibi.baddbmm(
            batch1=query_layer, batch2=key_layer, beta=self.beta, alpha=self.inv_norm_factor
        )
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, -1)
        attn_weights = torch.masked_fill(
            attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min
        )
        attention_probs = self.attention_dropout(F.softmax(attn_weights, dim=-1))
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, -1)
        context_layer = self._merge_heads(torch.bmm(attention_probs_reshaped, value_layer))
        output_tensor = self.dense(context_layer)
        return dropout_add(output_tensor, residual, self.hidden_dropout, self.training)


class BloomMLP(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.gelu_impl = nn.GELU(approximate="tanh")
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, residual):
        hidden_states = self.gelu_impl(self.dense_h_to_4h(hidden_states))
        return dropout_add(self.dense_4h_to_h(hidden_states), residual, 0.0, self.training)


class BloomBlock(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.num_heads = config.n_head
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )
        self.mlp = BloomMLP(config)

    def forward(self, hidden_states, alibi, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(
            layernorm_output, hidden_states, alibi, attention_mask
        )
        layernorm_output = self.post_attention_layernorm(attention_output)
        return self.mlp(layernorm_output, attention_output)


class BloomModel(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.num_heads = config.n_head
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size)
        self.h = nn.ModuleList([BloomBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask):
        hidden_states = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        alibi = build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)
        seq = input_ids.shape[1]
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device), 1)
        # True where masked: the future, and padded keys
        masked = causal[None, None] | ~attention_mask[:, None, None, :].bool()
        for block in self.h:
            hidden_states = block(hidden_states, alibi, masked)
        return self.ln_f(hidden_states)


class BloomForCausalLM(nn.Module):
    def __init__(self, config: BloomConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or BloomConfig()
        self.transformer = BloomModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init_normal(self)
        self.lm_head.weight = self.transformer.word_embeddings.weight  # tied

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.word_embeddings

    def forward(self, input_ids, attention_mask):
        return self.lm_head(self.transformer(input_ids, attention_mask))


# ==========================================================================================
# Falcon: multi-query (7B) and grouped packed per key/value group (40B), FalconLinear
# ==========================================================================================


@dataclass
class FalconConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    num_kv_heads: int | None = None
    multi_query: bool = True
    new_decoder_architecture: bool = False
    parallel_attn: bool = True
    bias: bool = False
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = MAX_POS


class FalconLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hidden_states = input @ self.weight.T
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias


class FalconAttention(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.rotary_emb = _RotaryTables(self.head_dim, config.max_position_embeddings)
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.new_decoder_architecture = config.new_decoder_architecture
        self.multi_query = config.multi_query
        if config.new_decoder_architecture:
            qkv_out_dim = (config.num_kv_heads * 2 + config.num_attention_heads) * self.head_dim
        else:  # multi_query (Falcon's third layout, per head as BLOOM's, is left out)
            qkv_out_dim = self.hidden_size + 2 * self.head_dim
        self.query_key_value = FalconLinear(self.hidden_size, qkv_out_dim, bias=config.bias)
        self.dense = FalconLinear(self.hidden_size, self.hidden_size, bias=config.bias)
        self.attention_dropout = nn.Dropout(0.0)
        self.num_kv_heads = config.num_kv_heads if config.new_decoder_architecture else 1

    def _split_heads(self, fused_qkv: torch.Tensor):
        if self.new_decoder_architecture:
            batch, seq_len, _ = fused_qkv.shape
            qkv = fused_qkv.view(
                batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim
            )
            query = qkv[:, :, :, :-2]
            key = torch.broadcast_to(qkv[:, :, :, [-2]], query.shape)
            value = torch.broadcast_to(qkv[:, :, :, [-1]], query.shape)
            return [x.flatten(2, 3) for x in (query, key, value)]
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
        return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]

    def forward(self, hidden_states, attention_mask, position_ids):
        fused_qkv = self.query_key_value(hidden_states)
        num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        query_layer, key_layer, value_layer = self._split_heads(fused_qkv)
        batch_size, query_length, _, _ = query_layer.shape
        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size, self.num_heads, query_length, self.head_dim
        )
        key_layer = key_layer.transpose(1, 2).reshape(
            batch_size, num_kv_heads, query_length, self.head_dim
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size, num_kv_heads, query_length, self.head_dim
        )
        cos, sin = self.rotary_emb(value_layer, seq_len=query_length)
        query_layer, key_layer = _apply_rotary(query_layer, key_layer, cos, sin, position_ids)
        if num_kv_heads != self.num_heads:  # one key/value head, broadcast over the queries
            key_layer = key_layer.expand(-1, self.num_heads, -1, -1)
            value_layer = value_layer.expand(-1, self.num_heads, -1, -1)
        attn_output = F.scaled_dot_product_attention(
            query_layer, key_layer, value_layer, attn_mask=attention_mask, dropout_p=0.0
        )
        attn_output = attn_output.transpose(1, 2).reshape(
            batch_size, query_length, self.num_heads * self.head_dim
        )
        return self.dense(attn_output)


class FalconMLP(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.dense_h_to_4h = FalconLinear(hidden_size, 4 * hidden_size, bias=config.bias)
        self.act = nn.GELU()
        self.dense_4h_to_h = FalconLinear(4 * hidden_size, hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.config = config
        self.self_attention = FalconAttention(config)
        self.mlp = FalconMLP(config)
        if config.new_decoder_architecture:
            self.ln_attn = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
            self.ln_mlp = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        else:
            self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        if self.config.new_decoder_architecture:
            attention_layernorm_out = self.ln_attn(hidden_states)
            mlp_layernorm_out = self.ln_mlp(hidden_states)
        else:
            attention_layernorm_out = self.input_layernorm(hidden_states)
            mlp_layernorm_out = attention_layernorm_out
        attention_output = self.self_attention(
            attention_layernorm_out, attention_mask, position_ids
        )
        mlp_output = self.mlp(mlp_layernorm_out)
        return mlp_output + attention_output + residual  # parallel attention and MLP


class FalconModel(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(
            [FalconDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask):
        hidden_states = self.word_embeddings(input_ids)
        mask = _additive_mask(attention_mask, hidden_states.dtype)
        position_ids = _positions(input_ids)
        for block in self.h:
            hidden_states = block(hidden_states, mask, position_ids)
        return self.ln_f(hidden_states)


class FalconForCausalLM(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = FalconModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init_normal(self)
        self.lm_head.weight = self.transformer.word_embeddings.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.word_embeddings

    def forward(self, input_ids, attention_mask):
        return self.lm_head(self.transformer(input_ids, attention_mask))


def _falcon_7b() -> nn.Module:
    return FalconForCausalLM(FalconConfig(multi_query=True)).double()


def _falcon_40b() -> nn.Module:
    config = FalconConfig(num_kv_heads=2, new_decoder_architecture=True, multi_query=True)
    return FalconForCausalLM(config).double()


# ==========================================================================================
# GPTBigCode / SantaCoder: multi-query, c_attn split by sizes
# ==========================================================================================


@dataclass
class GPTBigCodeConfig:
    vocab_size: int = VOCAB
    n_positions: int = MAX_POS
    n_embd: int = DIM
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_inner: int | None = None
    multi_query: bool = True
    layer_norm_epsilon: float = 1e-5


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config: GPTBigCodeConfig) -> None:
        super().__init__()
        self.multi_query = config.multi_query
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = 1 if self.multi_query else self.num_heads
        self.kv_dim = self.kv_heads * self.head_dim
        self.split_size = self.embed_dim
        self.scale_attn_weights = True
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)

    def _attn(self, query, key, value, attention_mask):
        scale_factor = 1.0 / self.head_dim**0.5 if self.scale_attn_weights else 1.0
        # multi-query: (batch, query_length, heads * head_dim) x (batch, head_dim, key_length)
        query_shape = query.shape
        batch_size = query_shape[0]
        key_length = key.size(-1)
        query_length = query_shape[1]
        attn_shape = (batch_size, query_length, self.num_heads, key_length)
        attn_view = (batch_size, query_length * self.num_heads, key_length)
        query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)
        attn_weights = torch.zeros(attn_view, device=query.device, dtype=query.dtype)
        attn_weights = torch.baddbmm(attn_weights, query, key, beta=0, alpha=scale_factor)
        attn_weights = attn_weights.view(attn_shape)
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(attention_mask, attn_weights, mask_value.to(query.device))
        attn_weights = self.attn_dropout(F.softmax(attn_weights, dim=-1))
        return torch.bmm(attn_weights.view(attn_view), value).view(query_shape)

    def forward(self, hidden_states, attention_mask):
        query, key_value = self.c_attn(hidden_states).split(
            (self.embed_dim, 2 * self.kv_dim), dim=2
        )
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)
        attn_output = self._attn(query, key.transpose(-1, -2), value, attention_mask)
        return self.resid_dropout(self.c_proj(attn_output))


class GPTBigCodeMLP(nn.Module):
    def __init__(self, intermediate_size: int, config: GPTBigCodeConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, intermediate_size)
        self.c_proj = nn.Linear(intermediate_size, config.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config: GPTBigCodeConfig) -> None:
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPTBigCodeMLP(inner_dim, config)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPTBigCodeForCausalLM(nn.Module):
    def __init__(self, config: GPTBigCodeConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTBigCodeConfig()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([GPTBigCodeBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        _init_normal(self)
        self.lm_head.weight = self.transformer.wte.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def forward(self, input_ids, attention_mask):
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq, device=input_ids.device)
        t = self.transformer
        hidden_states = t.drop(t.wte(input_ids) + t.wpe(position_ids))
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device))
        # (batch, query, 1, key) for the multi-query layout of the scores
        self_attention_mask = causal[None, :, None, :] & attention_mask[:, None, None, :].bool()
        for block in t.h:
            hidden_states = block(hidden_states, self_attention_mask)
        return self.lm_head(t.ln_f(hidden_states))


# ==========================================================================================
# MPT in transformers' port: clip_qkv clamp then chunk(3), ALiBi from the model
# ==========================================================================================


@dataclass
class MptConfig:
    d_model: int = DIM
    n_heads: int = HEADS
    n_layers: int = LAYERS
    expansion_ratio: int = 4
    max_seq_len: int = MAX_POS
    vocab_size: int = VOCAB
    clip_qkv: float | None = 0.5
    alibi_bias_max: int = 8
    layer_norm_epsilon: float = 1e-5


def build_mpt_alibi_tensor(num_heads: int, sequence_length: int, alibi_bias_max=8, device=None):
    """``(heads, 1, S)``: MPT's ALiBi (slopes from the head count, over the keys)."""
    alibi = torch.arange(1 - sequence_length, 1, dtype=torch.int32, device=device)
    alibi = alibi.view(1, 1, 1, sequence_length)
    num_heads_power_of_2 = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, num_heads_power_of_2 + 1, dtype=torch.int64, device=device).double()
    base = base * (alibi_bias_max / num_heads_power_of_2)
    slopes = (1.0 / torch.pow(2, base)).view(1, num_heads_power_of_2, 1, 1)  # (heads: 2^k)
    return (alibi * slopes).squeeze(0)


class MptAttention(nn.Module):
    def __init__(self, config: MptConfig) -> None:
        super().__init__()
        self.hidden_size = config.d_model
        self.n_heads = config.n_heads
        self.max_seq_length = config.max_seq_len
        self.head_dim = self.hidden_size // self.n_heads
        self.softmax_scale = 1 / math.sqrt(self.hidden_size / self.n_heads)
        self.attn_dropout_p = 0.0
        self.clip_qkv = config.clip_qkv
        self.Wqkv = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states, position_bias, attention_mask):
        batch_size, seq_length = hidden_states.shape[:2]
        mixed_qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query_states, key_states, value_states = mixed_qkv.chunk(3, dim=2)
        shape = (batch_size, seq_length, self.n_heads, self.head_dim)
        query_states = query_states.reshape(shape).transpose(1, 2)
        key_states = key_states.reshape(shape).transpose(1, 2)
        value_states = value_states.reshape(shape).transpose(1, 2)
        attention_scores = torch.matmul(query_states, key_states.transpose(-1, -2))
        attention_scores = attention_scores * self.softmax_scale
        key_length = key_states.shape[-2]
        position_bias = position_bias[:, max(0, position_bias.size(1) - seq_length) :]
        attention_scores = attention_scores + position_bias[:, :, -key_length:]
        attention_scores = attention_scores.masked_fill(
            attention_mask, torch.finfo(query_states.dtype).min
        )
        attn_weights = F.softmax(attention_scores, dim=-1)
        context_states = torch.matmul(attn_weights, value_states)
        context_states = context_states.permute(0, 2, 1, 3).contiguous()
        return self.out_proj(context_states.view(batch_size, seq_length, -1))


class MptMLP(nn.Module):
    def __init__(self, config: MptConfig) -> None:
        super().__init__()
        hidden_size = config.d_model
        self.up_proj = nn.Linear(hidden_size, config.expansion_ratio * hidden_size, bias=False)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(config.expansion_ratio * hidden_size, hidden_size, bias=False)
        self.hidden_dropout = 0.0

    def forward(self, hidden_states, residual):
        hidden_states = self.act(self.up_proj(hidden_states))
        output = F.dropout(self.down_proj(hidden_states), p=self.hidden_dropout)
        return output + residual


class MptBlock(nn.Module):
    def __init__(self, config: MptConfig) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)
        self.attn = MptAttention(config)
        self.norm_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)
        self.ffn = MptMLP(config)
        self.resid_attn_dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, position_bias, attention_mask):
        layernorm_output = self.norm_1(hidden_states)
        attn_outputs = self.attn(layernorm_output, position_bias, attention_mask)
        hidden_states = self.resid_attn_dropout(attn_outputs) + hidden_states
        return self.ffn(self.norm_2(hidden_states), hidden_states)


class MptForCausalLM(nn.Module):
    def __init__(self, config: MptConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or MptConfig()
        self.transformer = nn.Module()
        self.transformer.num_heads = config.n_heads
        self.transformer.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.transformer.blocks = nn.ModuleList([MptBlock(config) for _ in range(config.n_layers)])
        self.transformer.norm_f = nn.LayerNorm(config.d_model, bias=False)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        _init_normal(self)
        self.lm_head.weight = self.transformer.wte.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def forward(self, input_ids, attention_mask):
        t = self.transformer
        hidden_states = t.wte(input_ids)
        seq = input_ids.shape[1]
        alibi = build_mpt_alibi_tensor(
            t.num_heads, self.config.max_seq_len, self.config.alibi_bias_max, input_ids.device
        ).to(hidden_states.dtype)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device), 1)
        masked = causal[None, None] | ~attention_mask[:, None, None, :].bool()
        for block in t.blocks:
            hidden_states = block(hidden_states, alibi, masked)
        return self.lm_head(t.norm_f(hidden_states))


# ==========================================================================================
# MPT as mosaicml/llm-foundry writes it: Wqkv split by sizes, attn_bias, SharedEmbedding
# ==========================================================================================


def scaled_multihead_dot_product_attention(
    query, key, value, n_heads, kv_n_heads, softmax_scale=None, attn_bias=None, is_causal=False
):
    """llm-foundry's torch attention: ``(b, s, h * d)`` inputs, head counts as arguments."""
    b, s_q = query.shape[:2]
    q = query.view(b, s_q, n_heads, -1).transpose(1, 2)  # 'b s (h d) -> b h s d'
    k = key.view(b, key.shape[1], kv_n_heads, -1).permute(0, 2, 3, 1)  # 'b s (h d) -> b h d s'
    v = value.view(b, value.shape[1], kv_n_heads, -1).transpose(1, 2)
    if kv_n_heads < n_heads:
        k = k.repeat_interleave(n_heads // kv_n_heads, dim=1)
        v = v.repeat_interleave(n_heads // kv_n_heads, dim=1)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(q.size(-1))
    attn_weight = q.matmul(k) * softmax_scale
    s_k = k.size(-1)
    if attn_bias is not None:
        attn_bias = attn_bias[
            :, :, max(0, attn_bias.size(2) - s_q) :, max(0, attn_bias.size(3) - s_k) :
        ]
        attn_weight = attn_weight + attn_bias
    min_val = torch.finfo(q.dtype).min
    if is_causal:
        causal_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    return out.transpose(1, 2).reshape(b, s_q, -1)  # 'b h s d -> b s (h d)'


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, kv_n_heads: int, clip_qkv=None) -> None:
        super().__init__()
        self.clip_qkv = clip_qkv
        self.d_model = d_model
        self.n_heads = n_heads
        self.kv_n_heads = kv_n_heads
        self.head_dim = d_model // n_heads
        self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = 0.0
        self.Wqkv = nn.Linear(self.d_model, self.d_model + 2 * self.kv_n_heads * self.head_dim)
        self.attn_fn = scaled_multihead_dot_product_attention
        self.out_proj = nn.Linear(self.d_model, self.d_model)

    def forward(self, x, attn_bias=None, is_causal=True):
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = qkv.split(
            [self.d_model, self.kv_n_heads * self.head_dim, self.kv_n_heads * self.head_dim],
            dim=2,
        )
        context = self.attn_fn(
            query,
            key,
            value,
            self.n_heads,
            self.kv_n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            is_causal=is_causal,
        )
        return self.out_proj(context)


class MultiheadAttention(GroupedQueryAttention):
    def __init__(self, d_model: int, n_heads: int, clip_qkv=None) -> None:
        super().__init__(d_model, n_heads, n_heads, clip_qkv)


class MPTMLP(nn.Module):
    def __init__(self, d_model: int, expansion_ratio: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, expansion_ratio * d_model)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(expansion_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, expansion_ratio: int, clip_qkv) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(d_model)
        self.attn = MultiheadAttention(d_model, n_heads, clip_qkv)
        self.norm_2 = nn.LayerNorm(d_model)
        self.ffn = MPTMLP(d_model, expansion_ratio)
        self.resid_attn_dropout = nn.Dropout(0.0)
        self.resid_ffn_dropout = nn.Dropout(0.0)

    def forward(self, x, attn_bias=None):
        b = self.attn(self.norm_1(x), attn_bias=attn_bias, is_causal=True)
        x = x + self.resid_attn_dropout(b)
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


class SharedEmbedding(nn.Embedding):
    """The input embedding, and (``unembed=True``) the tied output head."""

    def forward(self, input: torch.Tensor, unembed: bool = False) -> torch.Tensor:
        if unembed:
            return F.linear(input, self.weight)
        return super().forward(input)


def build_alibi_bias(n_heads: int, seq_len: int, alibi_bias_max: int = 8, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32).view(1, 1, 1, seq_len)
    n_heads_power_of_2 = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, n_heads_power_of_2 + 1, dtype=torch.float64)
    m = m.mul(alibi_bias_max / n_heads_power_of_2)
    slopes = 1.0 / torch.pow(2, m)  # (interleaved for head counts that are no power of 2)
    return (alibi_bias * slopes.view(1, n_heads, 1, 1)).to(dtype=dtype)


@dataclass
class MPTConfig:
    d_model: int = DIM
    n_heads: int = HEADS
    n_layers: int = LAYERS
    expansion_ratio: int = 4
    max_seq_len: int = MAX_POS
    vocab_size: int = VOCAB
    clip_qkv: float | None = 0.5
    alibi: bool = True
    alibi_bias_max: int = 8


class MPTModel(nn.Module):
    def __init__(self, config: MPTConfig) -> None:
        super().__init__()
        self.config = config
        self.alibi = config.alibi
        self.wte = SharedEmbedding(config.vocab_size, config.d_model)
        self.emb_drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(
            [
                MPTBlock(config.d_model, config.n_heads, config.expansion_ratio, config.clip_qkv)
                for _ in range(config.n_layers)
            ]
        )
        self.norm_f = nn.LayerNorm(config.d_model)
        self.attn_bias_shape = (1, config.n_heads, 1, config.max_seq_len)

    def _attn_bias(self, dtype) -> torch.Tensor:
        attn_bias = torch.zeros(self.attn_bias_shape, dtype=dtype)
        if self.alibi:
            alibi = build_alibi_bias(
                self.config.n_heads, self.config.max_seq_len, self.config.alibi_bias_max, dtype
            )
            attn_bias = attn_bias.add(alibi)
        return attn_bias

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb_drop(self.wte(input_ids))
        attn_bias = self._attn_bias(x.dtype).to(x.device)
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias)
        return self.norm_f(x)


class MPTForCausalLM(nn.Module):
    def __init__(self, config: MPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or MPTConfig()
        self.transformer = MPTModel(config)
        _init_normal(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids)
        return self.transformer.wte(hidden, True)  # the tied head


# ==========================================================================================
# OLMo (allenai/OLMo olmo/model.py): projections right in the block, clip_qkv
# ==========================================================================================


@dataclass
class OLMoConfig:
    d_model: int = DIM
    n_heads: int = HEADS
    n_kv_heads: int | None = None
    n_layers: int = LAYERS
    mlp_ratio: int = 4
    vocab_size: int = VOCAB
    max_sequence_length: int = MAX_POS
    clip_qkv: float | None = 0.5
    include_bias: bool = False
    weight_tying: bool = True

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x

    @property
    def output_multiplier(self) -> float:
        return 0.5


class OLMoRotaryEmbedding(nn.Module):
    def __init__(self, config: OLMoConfig) -> None:
        super().__init__()
        self.tables = _RotaryTables(config.d_model // config.n_heads, config.max_sequence_length)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        query_len, key_len = q.shape[-2], k.shape[-2]
        cos, sin = self.tables(q, key_len)
        cos, sin = cos[None, None], sin[None, None]
        q_cos, q_sin = cos[:, :, key_len - query_len : key_len], sin[:, :, key_len - query_len :]
        q = q * q_cos + _rotate_half(q) * q_sin
        k = k * cos + _rotate_half(k) * sin
        return q, k


class OLMoBlock(nn.Module):
    """What OLMo's blocks share: the attention computation, its output projection, the
    feed-forward output projection, the activation and the rotary embedding."""

    def __init__(self, layer_id: int, config: OLMoConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.hidden_size = config.mlp_ratio * config.d_model
        self.dropout = nn.Dropout(0.0)
        self.act = SwiGLU()
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_out = nn.Linear(
            int(self.act.output_multiplier * self.hidden_size),
            config.d_model,
            bias=config.include_bias,
        )
        self.rotary_emb = OLMoRotaryEmbedding(config)

    def attention(self, q, k, v, attention_bias=None):
        B, T, C = q.size()  # batch size, sequence length, d_model
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        kv_heads = self.config.effective_n_kv_heads
        k = k.view(B, T, kv_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, kv_heads, C // self.config.n_heads).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        if kv_heads != self.config.n_heads:
            k = k.repeat_interleave(self.config.n_heads // kv_heads, dim=1)
            v = v.repeat_interleave(self.config.n_heads // kv_heads, dim=1)
        att = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_bias, is_causal=attention_bias is None
        )
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)


class OLMoSequentialBlock(OLMoBlock):
    def __init__(self, layer_id: int, config: OLMoConfig) -> None:
        super().__init__(layer_id, config)
        self.attn_norm = nn.LayerNorm(config.d_model, bias=False)
        self.ff_norm = nn.LayerNorm(config.d_model, bias=False)
        head_dim = config.d_model // config.n_heads
        self.fused_dims = (
            config.d_model,
            config.effective_n_kv_heads * head_dim,
            config.effective_n_kv_heads * head_dim,
        )
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, self.hidden_size, bias=config.include_bias)

    def forward(self, x: torch.Tensor, attention_bias=None) -> torch.Tensor:
        qkv = self.att_proj(self.attn_norm(x))
        if self.config.clip_qkv is not None:
            qkv.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        x = x + self.dropout(self.attention(q, k, v, attention_bias))
        og_x = x
        x = self.ff_out(self.act(self.ff_proj(self.ff_norm(x))))
        return og_x + self.dropout(x)


class OLMoLlamaBlock(OLMoBlock):
    def __init__(self, layer_id: int, config: OLMoConfig) -> None:
        super().__init__(layer_id, config)
        self.attn_norm = nn.RMSNorm(config.d_model)
        self.ff_norm = nn.RMSNorm(config.d_model)
        head_dim = config.d_model // config.n_heads
        q_proj_out_dim = config.d_model
        k_proj_out_dim = config.effective_n_kv_heads * head_dim
        self.q_proj = nn.Linear(config.d_model, q_proj_out_dim, bias=config.include_bias)
        self.k_proj = nn.Linear(config.d_model, k_proj_out_dim, bias=config.include_bias)
        self.v_proj = nn.Linear(config.d_model, k_proj_out_dim, bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, self.hidden_size, bias=config.include_bias)

    def forward(self, x: torch.Tensor, attention_bias=None) -> torch.Tensor:
        x_normed = self.attn_norm(x)
        q, k, v = self.q_proj(x_normed), self.k_proj(x_normed), self.v_proj(x_normed)
        if self.config.clip_qkv is not None:
            q.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            k.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            v.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        x = x + self.dropout(self.attention(q, k, v, attention_bias))
        og_x = x
        x = self.ff_out(self.act(self.ff_proj(self.ff_norm(x))))
        return og_x + self.dropout(x)


class OLMo(nn.Module):
    def __init__(self, config: OLMoConfig | None = None, block: type = OLMoSequentialBlock):
        super().__init__()
        self.config = config = config or OLMoConfig()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.d_model),
                emb_drop=nn.Dropout(0.0),
                ln_f=nn.LayerNorm(config.d_model, bias=False),
            )
        )
        self.transformer.update(
            {"blocks": nn.ModuleList([block(i, config) for i in range(config.n_layers)])}
        )
        if not config.weight_tying:
            self.transformer.update(
                {"ff_out": nn.Linear(config.d_model, config.vocab_size, bias=False)}
            )
        _init_normal(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.emb_drop(self.transformer.wte(input_ids))
        for block in self.transformer.blocks:
            x = block(x)
        x = self.transformer.ln_f(x)
        if self.config.weight_tying:
            return F.linear(x, self.transformer.wte.weight, None)
        return self.transformer.ff_out(x)


def _olmo_llama_block() -> nn.Module:
    return OLMo(OLMoConfig(n_kv_heads=2), OLMoLlamaBlock).double()


# ==========================================================================================
# Baichuan-13B / Baichuan2: W_pack unflattened (3, hidden), ALiBi mask, NormHead
# ==========================================================================================


@dataclass
class BaichuanConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    intermediate_size: int = 3 * DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    model_max_length: int = MAX_POS
    rms_norm_eps: float = 1e-6


class BaichuanRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.epsilon = epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.epsilon))


class BaichuanMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class BaichuanAttention(nn.Module):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        proj = self.W_pack(hidden_states)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states = proj[0].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = proj[1].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = proj[2].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        attn_weights = attn_weights + attention_mask
        attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class BaichuanLayer(nn.Module):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = BaichuanAttention(config)
        self.mlp = BaichuanMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = BaichuanRMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_attention_layernorm = BaichuanRMSNorm(
            config.hidden_size, epsilon=config.rms_norm_eps
        )

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def _get_interleave(n: int) -> list[float]:
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    assert math.log2(n).is_integer()  # (Baichuan interleaves more slopes for other counts)
    return power_of_2(n)


def _gen_alibi_mask(n_head: int, max_pos: int) -> torch.Tensor:
    """``(heads, max_pos, max_pos)``: causal mask plus each head's ALiBi."""
    slopes = torch.tensor(_get_interleave(n_head), dtype=torch.float64)
    position_point = torch.arange(max_pos, dtype=torch.float64) - max_pos + 1
    position_point = position_point.unsqueeze(0).unsqueeze(0).expand(n_head, -1, -1)
    diag = torch.diag(position_point[0])
    position_point = position_point - diag.unsqueeze(0).unsqueeze(0).transpose(-1, -2)
    alibi = slopes.unsqueeze(1).unsqueeze(1) * position_point
    alibi = alibi.view(n_head, 1, max_pos)
    future = torch.triu(torch.full([max_pos, max_pos], float("-inf"), dtype=torch.float64), 1)
    return future.unsqueeze(0) + alibi


class BaichuanModel(nn.Module):
    def __init__(self, config: BaichuanConfig) -> None:
        super().__init__()
        self.n_head = config.num_attention_heads
        self.max_cache_pos = config.model_max_length
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [BaichuanLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = BaichuanRMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def get_alibi_mask(self, tensor: torch.Tensor, seq_length: int) -> torch.Tensor:
        mask = _gen_alibi_mask(self.n_head, self.max_cache_pos).to(tensor)
        return mask[:, :seq_length, :seq_length]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        alibi_mask = self.get_alibi_mask(hidden_states, input_ids.shape[1])
        for layer in self.layers:
            hidden_states = layer(hidden_states, alibi_mask)
        return self.norm(hidden_states)


class NormHead(nn.Module):
    """Baichuan2's output head: its own weight, normalized per token, and ``F.linear``."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((vocab_size, hidden_size)))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norm_weight = F.normalize(self.weight)  # Baichuan2 caches it in eval mode
        return F.linear(hidden_states, norm_weight)


class BaichuanForCausalLM(nn.Module):
    def __init__(self, config: BaichuanConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or BaichuanConfig()
        self.model = BaichuanModel(config)
        self.lm_head = NormHead(config.hidden_size, config.vocab_size)
        _init_normal(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


# ==========================================================================================
# Phi-1.5 / Phi-2 (transformers' modeling_phi): parallel block, `dense`, partial rotary
# ==========================================================================================


@dataclass
class PhiConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    intermediate_size: int = 4 * DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    num_key_value_heads: int | None = None
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = MAX_POS
    layer_norm_eps: float = 1e-5


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class PhiAttention(nn.Module):
    def __init__(self, config: PhiConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads or self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.partial_rotary_factor = config.partial_rotary_factor
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim)
        self.dense = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=True)
        self.rotary_emb = _RotaryTables(
            int(self.partial_rotary_factor * self.head_dim), config.max_position_embeddings
        )

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        value_states = value_states.transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        # partial rotary embedding
        query_rot, query_pass = (
            query_states[..., : self.rotary_emb.dim],
            query_states[..., self.rotary_emb.dim :],
        )
        key_rot, key_pass = (
            key_states[..., : self.rotary_emb.dim],
            key_states[..., self.rotary_emb.dim :],
        )
        query_rot, key_rot = _apply_rotary(query_rot, key_rot, cos, sin, position_ids)
        query_states = torch.cat((query_rot, query_pass), dim=-1)
        key_states = torch.cat((key_rot, key_pass), dim=-1)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        attn_weights = F.softmax(attn_weights + attention_mask, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        return self.dense(attn_output)


class PhiMLP(nn.Module):
    def __init__(self, config: PhiConfig) -> None:
        super().__init__()
        self.activation_fn = nn.GELU(approximate="tanh")
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, config: PhiConfig) -> None:
        super().__init__()
        self.self_attn = PhiAttention(config)
        self.mlp = PhiMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.resid_dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_outputs = self.resid_dropout(
            self.self_attn(hidden_states, attention_mask, position_ids)
        )
        feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
        return attn_outputs + feed_forward_hidden_states + residual


class PhiForCausalLM(nn.Module):
    def __init__(self, config: PhiConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or PhiConfig()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.embed_dropout = nn.Dropout(0.0)
        self.model.layers = nn.ModuleList(
            [PhiDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.model.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        _init_normal(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask):
        m = self.model
        hidden_states = m.embed_dropout(m.embed_tokens(input_ids))
        mask = _additive_mask(attention_mask, hidden_states.dtype)
        position_ids = _positions(input_ids)
        for layer in m.layers:
            hidden_states = layer(hidden_states, mask, position_ids)
        return self.lm_head(m.final_layernorm(hidden_states))


# ==========================================================================================
# GPT-J (transformers' modeling_gptj): parallel block, rotary on part of each head
# ==========================================================================================


@dataclass
class GPTJConfig:
    vocab_size: int = VOCAB
    n_positions: int = MAX_POS
    n_embd: int = DIM
    n_layer: int = LAYERS
    n_head: int = HEADS
    rotary_dim: int = 4
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5


def create_sinusoidal_positions(num_pos: int, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    sinusoid_inp = torch.einsum(
        "i , j -> i j", torch.arange(num_pos, dtype=torch.int64).double(), inv_freq.double()
    )
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def gptj_apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.embed_dim = config.n_embd
        self.num_attention_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.scale_attn = math.sqrt(self.head_dim)
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.rotary_dim = config.rotary_dim
        pos_embd_dim = self.rotary_dim or self.embed_dim
        self.register_buffer(
            "embed_positions",
            create_sinusoidal_positions(max_positions, pos_embd_dim),
            persistent=False,
        )

    def _split_heads(self, tensor, num_attention_heads, attn_head_size, rotary):
        new_shape = tensor.size()[:-1] + (num_attention_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        if rotary:
            return tensor
        return tensor.permute(0, 2, 1, 3)  # (batch, head, seq_length, head_features)

    def _merge_heads(self, tensor, num_attention_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_attention_heads * attn_head_size,)
        return tensor.view(new_shape)

    def _attn(self, query, key, value, attention_mask):
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = attn_weights / self.scale_attn + attention_mask
        attn_weights = self.attn_dropout(F.softmax(attn_weights, dim=-1))
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, attention_mask, position_ids):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        query = self._split_heads(query, self.num_attention_heads, self.head_dim, True)
        key = self._split_heads(key, self.num_attention_heads, self.head_dim, True)
        value = self._split_heads(value, self.num_attention_heads, self.head_dim, False)
        embed_positions = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        repeated_position_ids = position_ids.unsqueeze(-1).repeat(1, 1, embed_positions.shape[-1])
        sincos = torch.gather(embed_positions, 1, repeated_position_ids)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        if self.rotary_dim is not None:
            k_rot, k_pass = key[:, :, :, : self.rotary_dim], key[:, :, :, self.rotary_dim :]
            q_rot, q_pass = query[:, :, :, : self.rotary_dim], query[:, :, :, self.rotary_dim :]
            k_rot = gptj_apply_rotary_pos_emb(k_rot, sin, cos)
            q_rot = gptj_apply_rotary_pos_emb(q_rot, sin, cos)
            key = torch.cat([k_rot, k_pass], dim=-1)
            query = torch.cat([q_rot, q_pass], dim=-1)
        else:
            key = gptj_apply_rotary_pos_emb(key, sin, cos)
            query = gptj_apply_rotary_pos_emb(query, sin, cos)
        key = key.permute(0, 2, 1, 3)
        query = query.permute(0, 2, 1, 3)
        attn_output = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_dim)
        return self.resid_dropout(self.out_proj(attn_output))


class GPTJMLP(nn.Module):
    def __init__(self, intermediate_size: int, config: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, config.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class GPTJBlock(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTJAttention(config)
        self.mlp = GPTJMLP(inner_dim, config)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(hidden_states, attention_mask, position_ids)
        feed_forward_hidden_states = self.mlp(hidden_states)
        return attn_output + feed_forward_hidden_states + residual


class GPTJForCausalLM(nn.Module):
    def __init__(self, config: GPTJConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTJConfig()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.transformer.drop = nn.Dropout(0.0)
        self.transformer.h = nn.ModuleList([GPTJBlock(config) for _ in range(config.n_layer)])
        self.transformer.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)
        _init_normal(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def forward(self, input_ids, attention_mask):
        t = self.transformer
        hidden_states = t.drop(t.wte(input_ids))
        extended = attention_mask[:, None, None, :].to(hidden_states.dtype)
        extended = (1.0 - extended) * torch.finfo(hidden_states.dtype).min
        position_ids = _positions(input_ids)
        for block in t.h:
            hidden_states = block(hidden_states, extended, position_ids)
        return self.lm_head(t.ln_f(hidden_states))


# ==========================================================================================
# nanochat (karpathy/nanochat gpt.py): grouped-query heads under n_kv_head, QK norm
# ==========================================================================================


@dataclass
class NanochatConfig:
    sequence_len: int = MAX_POS
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS  # number of query heads
    n_kv_head: int = 2  # number of key/value heads (MQA)
    n_embd: int = DIM


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))  # purely functional, no learnable parameters


def nanochat_apply_rotary_emb(x, cos, sin):
    assert x.ndim == 4  # multihead attention
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3).to(x.dtype)


class NanochatCausalSelfAttention(nn.Module):
    def __init__(self, config: NanochatConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.n_embd = config.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.c_q = nn.Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache):
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = nanochat_apply_rotary_emb(q, cos, sin), nanochat_apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)  # QK norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        nrep = self.n_head // self.n_kv_head
        k, v = repeat_kv(k, nrep), repeat_kv(v, nrep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class NanochatMLP(nn.Module):
    def __init__(self, config: NanochatConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class NanochatBlock(nn.Module):
    def __init__(self, config: NanochatConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn = NanochatCausalSelfAttention(config, layer_idx)
        self.mlp = NanochatMLP(config)

    def forward(self, x, cos_sin, kv_cache):
        x = x + self.attn(norm(x), cos_sin, kv_cache)
        return x + self.mlp(norm(x))


class NanochatGPT(nn.Module):
    def __init__(self, config: NanochatConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or NanochatConfig()
        h = nn.ModuleList([NanochatBlock(config, i) for i in range(config.n_layer)])
        wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.transformer = nn.ModuleDict([("wte", wte), ("h", h)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied
        head_dim = config.n_embd // config.n_head
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float64)
        inv_freq = 1.0 / (10000 ** (channel_range / head_dim))
        freqs = torch.outer(torch.arange(config.sequence_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", freqs.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin()[None, :, None, :], persistent=False)
        _init_normal(self)  # (nanochat zeroes lm_head and the c_proj layers)

    def forward(self, idx, targets=None, kv_cache=None):
        T = idx.size(1)
        cos_sin = self.cos[:, :T], self.sin[:, :T]
        x = norm(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, cos_sin, kv_cache)
        x = norm(x)
        softcap = 15
        logits = softcap * torch.tanh(self.lm_head(x) / softcap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _lm_targets() -> tuple[tuple, dict]:
    tokens = _tokens()
    return (tokens, torch.roll(tokens, -1, 1)), {}


# ==========================================================================================
# the list
# ==========================================================================================


def _built(cls: type, *args) -> callable:
    def build() -> nn.Module:
        return cls(*args).double()

    return build


def _ids() -> tuple[tuple, dict]:
    return (_tokens(),), {}


MORE_MODELS: dict[str, Foreign] = {
    m.name: m
    for m in (
        Foreign("gpt_neox", _built(GPTNeoXForCausalLM), _causal_inputs),
        Foreign("bloom", _built(BloomForCausalLM), _causal_inputs),
        Foreign("falcon_7b", _falcon_7b, _causal_inputs),
        Foreign("falcon_40b", _falcon_40b, _causal_inputs),
        Foreign("gpt_bigcode", _built(GPTBigCodeForCausalLM), _causal_inputs),
        Foreign("mpt", _built(MptForCausalLM), _causal_inputs),
        Foreign("llm_foundry_mpt", _built(MPTForCausalLM), _ids),
        Foreign("olmo", _built(OLMo), _ids),
        Foreign("olmo_llama_block", _olmo_llama_block, _ids),
        Foreign("baichuan", _built(BaichuanForCausalLM), _ids),
        Foreign("phi", _built(PhiForCausalLM), _causal_inputs),
        Foreign("gpt_j", _built(GPTJForCausalLM), _causal_inputs),
        Foreign("nanochat", _built(NanochatGPT), _lm_targets),
    )
}
