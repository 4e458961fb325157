"""More small models written the way widely copied public codebases write them (part 2).

As in :mod:`foreign_models`, each model is our own code, written from what a public codebase
looks like (module tree, attribute names, the idioms of ``forward``), not copied from it;
tiny configs, random weights, float64 (the originals' casts to float32 left out), no
dropout. This part holds the layouts outside the usual attention/MLP pair:

* StableLM-2 (transformers' ``modeling_stablelm``): a per-head LayerNorm of q and k that is
  an ``nn.ModuleList`` of one norm per head, zipped with the heads; parallel residual, GQA;
* StarCoder2 (``modeling_starcoder2``): grouped-query attention with biases, ``c_fc`` /
  ``c_proj`` MLP (the plain case, for contrast);
* Jais / BTLM (Cerebras' ``modeling_jais.py``): GPT-2 ``Conv1D`` projections split by
  ``self.split_size``, SwiGLU over two ``Conv1D``, and ALiBi built by a module of the
  model from the head count (slopes ``(heads, 1)``), passed to every block;
* Whisper's text decoder (openai/whisper ``model.py``): ``Linear``/``LayerNorm`` subclasses
  with their own forward, cross-attention reading the audio features, the MLP an
  ``nn.Sequential``, logits against the token embedding's weight;
* diffusers' ``Transformer2DModel`` with ``BasicTransformerBlock``: ``Attention`` whose work
  is done by a processor object, ``to_out`` an ``nn.ModuleList`` (``to_out.0``), the head
  count named ``heads``, cross-attention on ``encoder_hidden_states``, and ``FeedForward``
  whose ``net`` holds a ``GEGLU`` (``ff.net.0.proj``) and the output Linear (``ff.net.2``);
* DiT (facebookresearch/DiT ``models.py``): adaLN-Zero, ``adaLN_modulation`` a
  ``Sequential(SiLU, Linear(h, 6h))`` chunked in six, timm's attention and MLP;
* vit-pytorch (lucidrains): each block an ``nn.ModuleList([Attention, FeedForward])``,
  ``to_out`` an ``nn.Sequential``, the head count named ``heads``;
* PaLM-pytorch (lucidrains): the model one ``nn.Sequential(embedding, *blocks, norm, head)``;
  each block fuses q, a single key/value head and the SwiGLU input in one projection split by
  sizes, with ``attn_out`` and ``ff_out`` right in the block;
* gemma_pytorch (google): its own ``Linear`` and ``Embedding`` (a weight Parameter and
  ``F.linear`` / ``F.embedding``), ``qkv_proj`` split ``[q_size, kv_size, kv_size]``;
* Gemma's Flax modules ported to PyTorch (google-deepmind/gemma): ``Einsum`` layers, the
  projections as ``torch.einsum`` against a parameter (``'BTD,SNDH->SBTNH'``);
* BEiT (timm ``beit.py``): the q/v biases and a relative-position bias table (one value per
  head) held by the attention, its qkv computed as ``F.linear(x, self.qkv.weight, bias)``,
  layer scale ``gamma_1``/``gamma_2`` on the block;
* ChatGLM2 (THUDM's ``modeling_chatglm.py``): Megatron's names
  (``num_attention_heads_per_partition``, ``hidden_size_per_attention_head``), grouped-query
  ``query_key_value`` split by products of them, ``(seq, batch, hidden)`` layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from foreign_models import (
    BATCH,
    DIM,
    HEADS,
    LAYERS,
    SEQ,
    VOCAB,
    Foreign,
    Mlp,
    PatchEmbed,
    TimmAttention,
    _built,
    _generator,
    _images,
    _tokens,
)
from foreign_models_more import (
    MAX_POS,
    _additive_mask,
    _apply_rotary,
    _causal_inputs,
    _init_normal,
    _positions,
    _RotaryTables,
    repeat_kv,
)
from torch import nn

__all__ = ["MORE_MODELS"]


def _ids() -> tuple[tuple, dict]:
    return (_tokens(),), {}


# ==========================================================================================
# StableLM-2: per-head q/k LayerNorms as a ModuleList, parallel residual
# ==========================================================================================


@dataclass
class StableLmConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    intermediate_size: int = 3 * DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    num_key_value_heads: int = 2
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = MAX_POS
    layer_norm_eps: float = 1e-5
    use_qkv_bias: bool = False
    qk_layernorm: bool = True
    use_parallel_residual: bool = True


class StableLmLayerNormPerHead(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.norms = nn.ModuleList(
            [nn.LayerNorm(dim, eps=eps, bias=bias) for _ in range(num_heads)]
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [batch, heads, seq, head_dim] -> heads x [batch, 1, seq, head_dim], one norm each
        states_per_heads = torch.split(hidden_states, 1, dim=1)
        return torch.cat(
            [norm(states) for norm, states in zip(self.norms, states_per_heads, strict=False)],
            dim=1,
        )


class StableLmAttention(nn.Module):
    def __init__(self, config: StableLmConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.partial_rotary_factor = config.partial_rotary_factor
        bias = config.use_qkv_bias
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias
        )
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            eps = config.layer_norm_eps
            self.q_layernorm = StableLmLayerNormPerHead(self.head_dim, self.num_heads, eps=eps)
            self.k_layernorm = StableLmLayerNormPerHead(
                self.head_dim, self.num_key_value_heads, eps=eps
            )
        self.attention_dropout = nn.Dropout(0.0)
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
        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        rot = self.rotary_emb.dim
        query_rot, query_pass = query_states[..., :rot], query_states[..., rot:]
        key_rot, key_pass = key_states[..., :rot], key_states[..., rot:]
        query_rot, key_rot = _apply_rotary(query_rot, key_rot, cos, sin, position_ids)
        query_states = torch.cat((query_rot, query_pass), dim=-1)
        key_states = torch.cat((key_rot, key_pass), dim=-1)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        attn_weights = attn_weights / math.sqrt(self.head_dim) + attention_mask
        attn_weights = self.attention_dropout(F.softmax(attn_weights, dim=-1))
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class StableLmMLP(nn.Module):
    def __init__(self, config: StableLmConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: StableLmConfig) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.self_attn = StableLmAttention(config)
        self.mlp = StableLmMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = None  # (a LayerNorm without the parallel residual)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        self_attn_output = self.self_attn(hidden_states, attention_mask, position_ids)
        # use_parallel_residual: x = x + attn(ln1(x)) + mlp(ln1(x))
        mlp_output = self.dropout(self.mlp(hidden_states))
        return residual + self_attn_output + mlp_output


class StableLmForCausalLM(nn.Module):
    def __init__(self, config: StableLmConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or StableLmConfig()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            [StableLmDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.model.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init_normal(self)
        for module in self.modules():  # per-head norms that differ from head to head
            if isinstance(module, StableLmLayerNormPerHead):
                for norm in module.norms:
                    nn.init.uniform_(norm.weight, 0.5, 1.5)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask):
        hidden_states = self.model.embed_tokens(input_ids)
        mask = _additive_mask(attention_mask, hidden_states.dtype)
        position_ids = _positions(input_ids)
        for layer in self.model.layers:
            hidden_states = layer(hidden_states, mask, position_ids)
        return self.lm_head(self.model.norm(hidden_states))


# ==========================================================================================
# StarCoder2: grouped-query attention with biases, c_fc / c_proj
# ==========================================================================================


@dataclass
class Starcoder2Config:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    intermediate_size: int = 4 * DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    num_key_value_heads: int = 2
    max_position_embeddings: int = MAX_POS
    norm_epsilon: float = 1e-5
    use_bias: bool = True


class Starcoder2Attention(nn.Module):
    def __init__(self, config: Starcoder2Config) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.use_bias = config.use_bias
        kv_width = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(
            self.hidden_size, self.num_heads * self.head_dim, bias=self.use_bias
        )
        self.k_proj = nn.Linear(self.hidden_size, kv_width, bias=self.use_bias)
        self.v_proj = nn.Linear(self.hidden_size, kv_width, bias=self.use_bias)
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, self.hidden_size, bias=self.use_bias
        )
        self.rotary_emb = _RotaryTables(self.head_dim, config.max_position_embeddings)
        self.residual_dropout = 0.0

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        key_states = self.k_proj(hidden_states).view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        )
        value_states = self.v_proj(hidden_states).view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        )
        query_states, key_states, value_states = (
            s.transpose(1, 2) for s in (query_states, key_states, value_states)
        )
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states, key_states = _apply_rotary(query_states, key_states, cos, sin, position_ids)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask
        )
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)
        return F.dropout(attn_output, p=self.residual_dropout, training=self.training)


class Starcoder2MLP(nn.Module):
    def __init__(self, config: Starcoder2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.use_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.use_bias)
        self.act = nn.GELU(approximate="tanh")
        self.residual_dropout = 0.0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.c_proj(self.act(self.c_fc(hidden_states)))
        return F.dropout(hidden_states, p=self.residual_dropout, training=self.training)


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: Starcoder2Config) -> None:
        super().__init__()
        self.self_attn = Starcoder2Attention(config)
        self.mlp = Starcoder2MLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Starcoder2ForCausalLM(nn.Module):
    def __init__(self, config: Starcoder2Config | None = None) -> None:
        super().__init__()
        self.config = config = config or Starcoder2Config()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.embedding_dropout = 0.0
        self.model.layers = nn.ModuleList(
            [Starcoder2DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.model.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init_normal(self)
        self.lm_head.weight = self.model.embed_tokens.weight  # tie_word_embeddings

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask):
        hidden_states = self.model.embed_tokens(input_ids)
        mask = _additive_mask(attention_mask, hidden_states.dtype)
        position_ids = _positions(input_ids)
        for layer in self.model.layers:
            hidden_states = layer(hidden_states, mask, position_ids)
        return self.lm_head(self.model.norm(hidden_states))


# ==========================================================================================
# Jais / BTLM (Cerebras): GPT-2 Conv1D, SwiGLU, ALiBi from a module of the model
# ==========================================================================================


class Conv1D(nn.Module):
    """GPT-2's projection: a Linear with its weight transposed (``(nx, nf)``)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


@dataclass
class JAISConfig:
    vocab_size: int = VOCAB
    n_embd: int = DIM
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_inner: int = 2 * DIM
    layer_norm_epsilon: float = 1e-5
    mup_scale_qk_dot_by_d: bool = True
    mup_embeddings_scale: float = 1.5
    mup_output_alpha: float = 0.8
    mup_width_scale: float = 0.5


class SwiGLUActivation(nn.Module):
    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return x1 * F.silu(x2)


class AlibiPositionEmbeddingLayer(nn.Module):
    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        slopes = torch.tensor(AlibiPositionEmbeddingLayer._get_alibi_slopes(num_heads))
        self.slopes = nn.Parameter(slopes.unsqueeze(-1), requires_grad=False)

    def forward(self, seq_length: int, key_length: int, cached_qk_len: int) -> torch.Tensor:
        device = self.slopes.device
        context_position = torch.arange(cached_qk_len, cached_qk_len + seq_length, device=device)
        memory_position = torch.arange(key_length + cached_qk_len, device=device)[None, :]
        relative_position = memory_position - context_position[:, None]
        relative_position = torch.abs(relative_position).unsqueeze(0)
        relative_position = relative_position.expand(self.num_heads, -1, -1)
        return (self.slopes * -1.0).unsqueeze(1) * relative_position  # (heads, q, k)

    @staticmethod
    def _get_alibi_slopes(n: int) -> list[float]:
        def get_slopes_power_of_2(n: int) -> list[float]:
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]

        assert math.log2(n).is_integer()  # (Jais interleaves more slopes for other counts)
        return get_slopes_power_of_2(n)


class JAISAttention(nn.Module):
    def __init__(self, config: JAISConfig) -> None:
        super().__init__()
        max_positions = MAX_POS
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.attn_scale_power = 1.0 if config.mup_scale_qk_dot_by_d else 0.5
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)

    def _attn(self, query, key, value, attention_mask, position_bias):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** self.attn_scale_power, dtype=attn_weights.dtype
        )
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        if position_bias is not None:
            attn_weights += position_bias.type_as(attn_weights).unsqueeze(0)
        attn_weights = self.attn_dropout(F.softmax(attn_weights + attention_mask, dim=-1))
        return torch.matmul(attn_weights, value)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)  # (batch, head, seq, head_features)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))

    def forward(self, hidden_states, attention_mask, position_bias):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output = self._attn(query, key, value, attention_mask, position_bias)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        return self.resid_dropout(self.c_proj(attn_output))


class JAISMLP(nn.Module):
    def __init__(self, intermediate_size: int, config: JAISConfig) -> None:
        super().__init__()
        embed_dim = config.n_embd
        self.c_fc = Conv1D(intermediate_size, embed_dim)
        self.c_fc2 = Conv1D(intermediate_size, embed_dim)
        self.c_proj = Conv1D(embed_dim, intermediate_size)
        self.act = SwiGLUActivation()
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states2 = self.c_fc2(hidden_states)
        hidden_states = self.act(self.c_fc(hidden_states), hidden_states2)
        return self.dropout(self.c_proj(hidden_states))


class JAISBlock(nn.Module):
    def __init__(self, config: JAISConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = JAISAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = JAISMLP(config.n_inner, config)

    def forward(self, hidden_states, attention_mask, position_bias):
        residual = hidden_states
        attn_output = self.attn(self.ln_1(hidden_states), attention_mask, position_bias)
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class JAISLMHeadModel(nn.Module):
    def __init__(self, config: JAISConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or JAISConfig()
        self.transformer = nn.Module()
        self.transformer.embeddings_scale = config.mup_embeddings_scale
        self.transformer.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.transformer.drop = nn.Dropout(0.0)
        self.transformer.h = nn.ModuleList([JAISBlock(config) for _ in range(config.n_layer)])
        self.transformer.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.transformer.relative_pe = AlibiPositionEmbeddingLayer(config.n_head)
        self.output_logits_scale = config.mup_output_alpha * config.mup_width_scale
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        _init_normal(self)
        self.lm_head.weight = self.transformer.wte.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def forward(self, input_ids, attention_mask):
        t = self.transformer
        hidden_states = t.drop(t.wte(input_ids) * t.embeddings_scale)
        extended = attention_mask[:, None, None, :].to(hidden_states.dtype)
        extended = (1.0 - extended) * torch.finfo(hidden_states.dtype).min
        seq = input_ids.shape[1]
        position_bias = t.relative_pe(seq, seq, 0)
        for block in t.h:
            hidden_states = block(hidden_states, extended, position_bias)
        return self.lm_head(t.ln_f(hidden_states)) * self.output_logits_scale


# ==========================================================================================
# Whisper's text decoder (openai/whisper model.py): cross-attention on the audio features
# ==========================================================================================


@dataclass
class ModelDimensions:
    n_vocab: int = VOCAB
    n_text_ctx: int = MAX_POS
    n_text_state: int = DIM
    n_text_head: int = HEADS
    n_text_layer: int = LAYERS
    n_audio_ctx: int = 6


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).type(x.dtype)  # whisper: super().forward(x.float())


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(
            x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


class MultiHeadAttention(nn.Module):
    use_sdpa = False  # the eager path: whisper takes SDPA where torch has it

    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        q = self.query(x)
        if kv_cache is None or xa is None or self.key not in kv_cache:
            # hooks, if installed (i.e. kv_cache is not None), prepend the cached kv tensors;
            # otherwise, perform key/value projections for self- or cross-attention as usual
            k = self.key(x if xa is None else xa)
            v = self.value(x if xa is None else xa)
        else:
            k, v = kv_cache[self.key], kv_cache[self.value]
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q, k, v, mask=None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        w = F.softmax(qk, dim=-1).to(q.dtype)
        out = (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)
        return out, qk.detach()


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        n_mlp = n_state * 4
        self.mlp = nn.Sequential(Linear(n_state, n_mlp), nn.GELU(), Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        x = x + self.attn(self.attn_ln(x), mask=mask, kv_cache=kv_cache)[0]
        if self.cross_attn:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]
        return x + self.mlp(self.mlp_ln(x))


class TextDecoder(nn.Module):
    def __init__(self, dims: ModelDimensions | None = None) -> None:
        super().__init__()
        dims = dims or ModelDimensions()
        n_vocab, n_ctx, n_state = dims.n_vocab, dims.n_text_ctx, dims.n_text_state
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.randn(n_ctx, n_state) * 0.02)
        self.blocks = nn.ModuleList(
            [
                ResidualAttentionBlock(n_state, dims.n_text_head, cross_attention=True)
                for _ in range(dims.n_text_layer)
            ]
        )
        self.ln = LayerNorm(n_state)
        mask = torch.empty(n_ctx, n_ctx).fill_(-math.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, xa: torch.Tensor, kv_cache=None) -> torch.Tensor:
        offset = next(iter(kv_cache.values())).shape[1] if kv_cache else 0
        x = self.token_embedding(x) + self.positional_embedding[offset : offset + x.shape[-1]]
        x = x.to(xa.dtype)
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, kv_cache=kv_cache)
        x = self.ln(x)
        return x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)  # .float()


def _whisper_inputs() -> tuple[tuple, dict]:
    audio = torch.randn(BATCH, 6, DIM, generator=_generator(), dtype=torch.float64)
    return (_tokens(), audio), {}


# ==========================================================================================
# diffusers: Transformer2DModel, BasicTransformerBlock, Attention + processor, GEGLU
# ==========================================================================================


class AttnProcessor2_0:
    """diffusers' default processor: the attention's computation, outside the module."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)  # linear proj
        return attn.to_out[1](hidden_states)  # dropout


class Attention(nn.Module):
    def __init__(
        self,
        query_dim: int,
        cross_attention_dim: int | None = None,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        bias: bool = False,
        out_bias: bool = True,
    ) -> None:
        super().__init__()
        self.inner_dim = dim_head * heads
        self.query_dim = query_dim
        self.is_cross_attention = cross_attention_dim is not None
        self.cross_attention_dim = cross_attention_dim or query_dim
        self.scale = dim_head**-0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_out = nn.ModuleList([])
        self.to_out.append(nn.Linear(self.inner_dim, query_dim, bias=out_bias))
        self.to_out.append(nn.Dropout(dropout))
        self.processor = AttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        return self.processor(
            self,
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=attention_mask,
        )


class GEGLU(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias)

    def gelu(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states, gate = self.proj(hidden_states).chunk(2, dim=-1)
        return hidden_states * self.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, dim_out: int | None = None, mult: int = 4) -> None:
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = dim_out if dim_out is not None else dim
        self.net = nn.ModuleList([])
        self.net.append(GEGLU(dim, inner_dim))  # project in
        self.net.append(nn.Dropout(0.0))
        self.net.append(nn.Linear(inner_dim, dim_out))  # project out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


class BasicTransformerBlock(nn.Module):
    def __init__(
        self, dim: int, num_attention_heads: int, attention_head_dim: int, cross_attention_dim: int
    ) -> None:
        super().__init__()
        self.only_cross_attention = False
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=True, eps=1e-5)
        self.attn1 = Attention(dim, heads=num_attention_heads, dim_head=attention_head_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=True, eps=1e-5)
        self.attn2 = Attention(
            dim,
            cross_attention_dim=cross_attention_dim,
            heads=num_attention_heads,
            dim_head=attention_head_dim,
        )
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=True, eps=1e-5)
        self.ff = FeedForward(dim)

    def forward(self, hidden_states, encoder_hidden_states=None):
        norm_hidden_states = self.norm1(hidden_states)
        attn_output = self.attn1(
            norm_hidden_states,
            encoder_hidden_states=encoder_hidden_states if self.only_cross_attention else None,
        )
        hidden_states = attn_output + hidden_states
        norm_hidden_states = self.norm2(hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states)
        hidden_states = attn_output + hidden_states
        ff_output = self.ff(self.norm3(hidden_states))
        return ff_output + hidden_states


class Transformer2DModel(nn.Module):
    """Continuous input with a linear projection in and out (``use_linear_projection``)."""

    def __init__(
        self,
        num_attention_heads: int = HEADS,
        attention_head_dim: int = DIM // HEADS,
        in_channels: int = 8,
        num_layers: int = LAYERS,
        cross_attention_dim: int = 24,
        norm_num_groups: int = 4,
    ) -> None:
        super().__init__()
        inner_dim = num_attention_heads * attention_head_dim
        self.in_channels = in_channels
        self.norm = nn.GroupNorm(norm_num_groups, in_channels, eps=1e-6, affine=True)
        self.proj_in = nn.Linear(in_channels, inner_dim)
        self.transformer_blocks = nn.ModuleList(
            [
                BasicTransformerBlock(
                    inner_dim, num_attention_heads, attention_head_dim, cross_attention_dim
                )
                for _ in range(num_layers)
            ]
        )
        self.proj_out = nn.Linear(inner_dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states):
        batch, _, height, width = hidden_states.shape
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        inner_dim = hidden_states.shape[1]
        hidden_states = hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
        hidden_states = self.proj_in(hidden_states)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, encoder_hidden_states=encoder_hidden_states)
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch, height, width, inner_dim).permute(0, 3, 1, 2)
        return hidden_states.contiguous() + residual


def _latents_and_text() -> tuple[tuple, dict]:
    g = _generator()
    latents = torch.randn(BATCH, 8, 4, 4, generator=g, dtype=torch.float64)
    text = torch.randn(BATCH, 5, 24, generator=g, dtype=torch.float64)
    return (latents,), {"encoder_hidden_states": text}


# ==========================================================================================
# DiT (facebookresearch/DiT models.py): adaLN-Zero, chunk(6)
# ==========================================================================================


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_embedding_size: int = 16) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float64) / half
        ).to(device=t.device)
        args = t[:, None].double() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: torch.Tensor, train: bool) -> torch.Tensor:
        return self.embedding_table(labels)  # (label dropout off)


class DiTBlock(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = TimmAttention(hidden_size, num_heads=num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(in_features=hidden_size, hidden_features=int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(
            nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True)
        )

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(
            nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True)
        )

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def _sincos_2d(embed_dim: int, grid_size: int) -> torch.Tensor:
    def one_d(dim: int, pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
        out = torch.outer(pos.reshape(-1), omega)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    grid = torch.arange(grid_size, dtype=torch.float64)
    grid_w, grid_h = torch.meshgrid(grid, grid, indexing="xy")  # here w goes first
    return torch.cat([one_d(embed_dim // 2, grid_w), one_d(embed_dim // 2, grid_h)], dim=1)


class DiT(nn.Module):
    def __init__(
        self,
        input_size: int = 8,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = DIM,
        depth: int = LAYERS,
        num_heads: int = HEADS,
        num_classes: int = 10,
        learn_sigma: bool = True,
    ) -> None:
        super().__init__()
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, 0.0)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.pos_embed.data.copy_(_sincos_2d(hidden_size, int(num_patches**0.5)).unsqueeze(0))
        # (DiT zeroes the adaLN modulations and the final layer: random here, so that the
        # blocks' work shows in the outputs)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D)
        c = self.t_embedder(t) + self.y_embedder(y, self.training)  # (N, D)
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))


def _dit_inputs() -> tuple[tuple, dict]:
    g = _generator()
    x = torch.randn(BATCH, 4, 8, 8, generator=g, dtype=torch.float64)
    t = torch.randint(0, 1000, (BATCH,), generator=g).double()
    y = torch.randint(0, 10, (BATCH,), generator=g)
    return (x, t, y), {}


# ==========================================================================================
# vit-pytorch (lucidrains): blocks as ModuleList([Attention, FeedForward]), `heads`
# ==========================================================================================


class ViTAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 8, dim_head: int = 64, dropout: float = 0.0):
        super().__init__()
        inner_dim = dim_head * heads
        project_out = not (heads == 1 and dim_head == dim)
        self.heads = heads
        self.scale = dim_head**-0.5
        self.norm = nn.LayerNorm(dim)
        self.attend = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = (
            nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))
            if project_out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        b, n = x.shape[:2]
        # rearrange(t, 'b n (h d) -> b h n d', h=self.heads)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in qkv)
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        attn = self.dropout(self.attend(dots))
        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class ViTFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ViTTransformer(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, dim_head: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(
                nn.ModuleList(
                    [
                        ViTAttention(dim, heads=heads, dim_head=dim_head),
                        ViTFeedForward(dim, mlp_dim),
                    ]
                )
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)


class LucidrainsViT(nn.Module):
    def __init__(self, image_size: int = 16, patch_size: int = 4, num_classes: int = 10):
        super().__init__()
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        patch_dim = 3 * patch_size * patch_size
        # Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)') in vit-pytorch, done in forward
        self.to_patch_embedding = nn.Sequential(
            nn.LayerNorm(patch_dim), nn.Linear(patch_dim, DIM), nn.LayerNorm(DIM)
        )
        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, DIM))
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM))
        self.dropout = nn.Dropout(0.0)
        self.transformer = ViTTransformer(DIM, LAYERS, HEADS, DIM // HEADS, 4 * DIM)
        self.pool = "cls"
        self.to_latent = nn.Identity()
        self.mlp_head = nn.Linear(DIM, num_classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        b, c, hp, wp = img.shape
        p = self.patch_size
        patches = img.view(b, c, hp // p, p, wp // p, p).permute(0, 2, 4, 3, 5, 1)
        x = self.to_patch_embedding(patches.reshape(b, (hp // p) * (wp // p), p * p * c))
        n = x.shape[1]
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        x = self.dropout(x + self.pos_embedding[:, : (n + 1)])
        x = self.transformer(x)
        x = x.mean(dim=1) if self.pool == "mean" else x[:, 0]
        return self.mlp_head(self.to_latent(x))


# ==========================================================================================
# PaLM-pytorch (lucidrains): nn.Sequential(embedding, *blocks, norm, head), fused MQA + FF
# ==========================================================================================


class PaLMLayerNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) + x


class PaLMRotaryEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len: int, *, device) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def palm_apply_rotary_pos_emb(pos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (t * pos.cos()) + (_rotate_half_palm(t) * pos.sin())


def _rotate_half_palm(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # rearrange(x, '... (j d) -> ... j d', j=2).unbind(-2)
    return torch.cat((-x2, x1), dim=-1)


class PaLMSwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class ParallelTransformerBlock(nn.Module):
    def __init__(self, dim: int, dim_head: int = 64, heads: int = 8, ff_mult: int = 4) -> None:
        super().__init__()
        self.norm = PaLMLayerNorm(dim)
        attn_inner_dim = dim_head * heads
        ff_inner_dim = dim * ff_mult
        self.fused_dims = (attn_inner_dim, dim_head, dim_head, (ff_inner_dim * 2))
        self.heads = heads
        self.scale = dim_head**-0.5
        self.rotary_emb = PaLMRotaryEmbedding(dim_head)
        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(attn_inner_dim, dim, bias=False)
        self.ff_out = nn.Sequential(PaLMSwiGLU(), nn.Linear(ff_inner_dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, device, h = x.shape[1], x.device, self.heads
        x = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)
        b = q.shape[0]
        q = q.view(b, n, h, -1).transpose(1, 2)  # rearrange(q, 'b n (h d) -> b h n d', h=h)
        positions = self.rotary_emb(n, device=device)
        q, k = (palm_apply_rotary_pos_emb(positions, t) for t in (q, k))
        q = q * self.scale
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k)
        causal_mask = torch.ones((n, n), device=device, dtype=torch.bool).triu(1)
        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.attn_out(out) + self.ff_out(ff)


def PaLM(*, dim: int, num_tokens: int, depth: int, dim_head: int, heads: int, ff_mult: int = 4):
    net = nn.Sequential(
        nn.Embedding(num_tokens, dim),
        *[
            Residual(
                ParallelTransformerBlock(dim=dim, dim_head=dim_head, heads=heads, ff_mult=ff_mult)
            )
            for _ in range(depth)
        ],
        PaLMLayerNorm(dim),
        nn.Linear(dim, num_tokens, bias=False),
    )
    net[-1].weight = net[0].weight  # they used embedding weight tied projection out to logits
    nn.init.normal_(net[0].weight, std=0.02)
    return net


def _palm() -> nn.Module:
    return PaLM(
        dim=DIM, num_tokens=VOCAB, depth=LAYERS, dim_head=DIM // HEADS, heads=HEADS
    ).double()


# ==========================================================================================
# gemma_pytorch (google): its own Linear and Embedding, qkv_proj split by sizes
# ==========================================================================================


@dataclass
class GemmaConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    intermediate_size: int = 3 * DIM
    num_hidden_layers: int = LAYERS
    num_attention_heads: int = HEADS
    num_key_value_heads: int = 2
    head_dim: int = DIM // HEADS
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = MAX_POS


class GemmaLinear(nn.Module):
    """gemma_pytorch's ``Linear`` (its int8 path left out)."""

    def __init__(self, in_features: int, out_features: int, quant: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((out_features, in_features)).normal_(std=0.02))
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        return F.linear(x, weight)


class GemmaEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, quant: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((num_embeddings, embedding_dim)).normal_(std=0.02))
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, add_unit_offset: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x)
        if self.add_unit_offset:
            return (output * (1 + self.weight)).type_as(x)
        return (output * self.weight).type_as(x)


def gemma_precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def gemma_apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    return x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = GemmaLinear(hidden_size, intermediate_size)
        self.up_proj = GemmaLinear(hidden_size, intermediate_size)
        self.down_proj = GemmaLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class GemmaAttention(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = GemmaLinear(
            self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        )
        self.o_proj = GemmaLinear(self.num_heads * self.head_dim, self.hidden_size)

    def forward(self, hidden_states, freqs_cis, mask):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = gemma_apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = gemma_apply_rotary_emb(xk, freqs_cis=freqs_cis)
        key, value = xk, xv  # gemma_pytorch writes them to its KV cache and reads it back
        if self.num_kv_heads != self.num_heads:
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)
        q = xq.transpose(1, 2) * self.scaling
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) + mask
        scores = F.softmax(scores, dim=-1).type_as(q)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return self.o_proj(output)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), freqs_cis, mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: GemmaConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GemmaConfig()
        self.embedder = GemmaEmbedding(config.vocab_size, config.hidden_size)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            [GemmaDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.model.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        freqs_cis = gemma_precompute_freqs_cis(config.head_dim, config.max_position_embeddings * 2)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, input_token_ids: torch.Tensor) -> torch.Tensor:
        seq = input_token_ids.shape[1]
        freqs_cis = self.freqs_cis.index_select(0, torch.arange(seq, device=input_token_ids.device))
        hidden_states = self.embedder(input_token_ids)
        hidden_states = hidden_states * (self.config.hidden_size**0.5)
        mask = torch.full((1, 1, seq, seq), -2.3819763e38, dtype=hidden_states.dtype).triu(1)
        for layer in self.model.layers:
            hidden_states = layer(hidden_states, freqs_cis, mask)
        hidden_states = self.model.norm(hidden_states)
        return torch.matmul(hidden_states, self.embedder.weight.t())  # the sampler's logits


# ==========================================================================================
# Gemma's Flax modules (google-deepmind/gemma) ported to PyTorch: Einsum layers
# ==========================================================================================


class Einsum(nn.Module):
    """A parameter multiplied in by ``torch.einsum`` (Flax's ``Einsum(shape)``)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape) * 0.1)

    def forward(self, eqn: str, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum(eqn, x, self.w)


class FlaxRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        normed_inputs = x * torch.rsqrt(var + 1e-06)
        return normed_inputs * (1 + self.scale)


class Embedder(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int) -> None:
        super().__init__()
        self.input_embedding = nn.Parameter(torch.randn(vocab_size, embed_dim) * 0.02)
        self.embed_dim = embed_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_embedding[(x,)] * math.sqrt(self.embed_dim)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.input_embedding.T


class FlaxAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, features: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.attn_vec_einsum = Einsum((num_heads, head_dim, features))
        if num_kv_heads == num_heads:
            self.qkv_einsum = Einsum((3, num_heads, features, head_dim))
        else:
            self.q_einsum = Einsum((num_heads, features, head_dim))
            self.kv_einsum = Einsum((2, num_kv_heads, features, head_dim))

    @property
    def use_qkv_einsum(self) -> bool:
        return self.num_kv_heads == self.num_heads

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask: torch.Tensor):
        if self.use_qkv_einsum:
            query_proj, key_proj, value_proj = self.qkv_einsum("BTD,SNDH->SBTNH", x)
        else:
            query_proj = self.q_einsum("BTD,NDH->BTNH", x)
            key_proj, value_proj = self.kv_einsum("BSD,CKDH->CBSKH", x)
        query_proj = gemma_apply_rotary_emb(query_proj, freqs_cis) * self.head_dim**-0.5
        key_proj = gemma_apply_rotary_emb(key_proj, freqs_cis)
        b, t, k, h = key_proj.shape
        query_scaled = query_proj.reshape(b, t, k, self.num_heads // k, h)  # grouped queries
        logits = torch.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
        logits = logits.reshape(b, t, self.num_heads, -1)
        padded_logits = torch.where(attn_mask[:, :, None, :], logits, -2.3819763e38)
        probs = F.softmax(padded_logits, dim=-1).reshape(b, t, k, self.num_heads // k, -1)
        encoded = torch.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
        encoded = encoded.reshape(b, t, self.num_heads, h)
        return self.attn_vec_einsum("BTNH,NHD->BTD", encoded)


class FlaxFeedForward(nn.Module):
    def __init__(self, features: int, hidden_dim: int) -> None:
        super().__init__()
        self.gating_einsum = Einsum((2, hidden_dim, features))
        self.linear = Einsum((hidden_dim, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ff_gate = torch.einsum("...F,HF->...H", x, self.gating_einsum.w[0])
        gate_value = F.gelu(ff_gate, approximate="tanh")
        ff1 = torch.einsum("...F,HF->...H", x, self.gating_einsum.w[1])
        return self.linear("...H,HF->...F", gate_value * ff1)


class FlaxBlock(nn.Module):
    def __init__(self, num_heads, num_kv_heads, embed_dim, head_dim, hidden_dim) -> None:
        super().__init__()
        self.pre_attention_norm = FlaxRMSNorm(embed_dim)
        self.attn = FlaxAttention(num_heads, num_kv_heads, embed_dim, head_dim)
        self.pre_ffw_norm = FlaxRMSNorm(embed_dim)
        self.mlp = FlaxFeedForward(embed_dim, hidden_dim)

    def forward(self, x, freqs_cis, attn_mask):
        inputs_normalized = self.pre_attention_norm(x)
        attn_output = x + self.attn(inputs_normalized, freqs_cis, attn_mask)
        return attn_output + self.mlp(self.pre_ffw_norm(attn_output))


class FlaxTransformer(nn.Module):
    def __init__(self, num_kv_heads: int = 2) -> None:
        super().__init__()
        self.embedder = Embedder(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            [FlaxBlock(HEADS, num_kv_heads, DIM, DIM // HEADS, 3 * DIM) for _ in range(LAYERS)]
        )
        self.final_norm = FlaxRMSNorm(DIM)
        self.register_buffer(
            "freqs_cis", gemma_precompute_freqs_cis(DIM // HEADS, MAX_POS), persistent=False
        )

    def forward(self, last_tokens: torch.Tensor) -> torch.Tensor:
        seq = last_tokens.shape[1]
        x = self.embedder.encode(last_tokens)
        attn_mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=x.device))[None]
        for block in self.blocks:
            x = block(x, self.freqs_cis[:seq], attn_mask)
        return self.embedder.decode(self.final_norm(x))


# ==========================================================================================
# BEiT (timm beit.py): q/v biases and relative-position bias held by the attention
# ==========================================================================================


def gen_relative_position_index(window_size: tuple[int, int]) -> torch.Tensor:
    num_relative_distance = (2 * window_size[0] - 1) * (2 * window_size[1] - 1) + 3
    window_area = window_size[0] * window_size[1]
    coords = torch.stack(
        torch.meshgrid(torch.arange(window_size[0]), torch.arange(window_size[1]), indexing="ij")
    )  # 2, Wh, Ww
    coords_flatten = torch.flatten(coords, 1)  # 2, Wh*Ww
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()  # Wh*Ww, Wh*Ww, 2
    relative_coords[:, :, 0] += window_size[0] - 1
    relative_coords[:, :, 1] += window_size[1] - 1
    relative_coords[:, :, 0] *= 2 * window_size[1] - 1
    relative_position_index = torch.zeros(size=(window_area + 1,) * 2, dtype=relative_coords.dtype)
    relative_position_index[1:, 1:] = relative_coords.sum(-1)
    relative_position_index[0, 0:] = num_relative_distance - 3
    relative_position_index[0:, 0] = num_relative_distance - 2
    relative_position_index[0, 0] = num_relative_distance - 1
    return relative_position_index


class BeitAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, window_size: tuple[int, int]) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        all_head_dim = head_dim * self.num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, all_head_dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.randn(all_head_dim) * 0.02)
        self.register_buffer("k_bias", torch.zeros(all_head_dim), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(all_head_dim) * 0.02)
        self.window_size = window_size
        self.num_relative_distance = (2 * window_size[0] - 1) * (2 * window_size[1] - 1) + 3
        self.relative_position_bias_table = nn.Parameter(
            torch.randn(self.num_relative_distance, num_heads) * 0.02
        )
        self.register_buffer(
            "relative_position_index", gen_relative_position_index(window_size), persistent=False
        )
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(all_head_dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def _get_rel_pos_bias(self) -> torch.Tensor:
        area = self.window_size[0] * self.window_size[1] + 1
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(area, area, -1).permute(2, 0, 1).contiguous()  # heads, Wh*Ww, Wh*Ww
        return bias.unsqueeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # B, num_heads, N, head_dim
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class BeitBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, window_size, init_values: float = 0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = BeitAttention(dim, num_heads, window_size)
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=4 * dim)
        self.drop_path2 = nn.Identity()
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.gamma_1 * self.attn(self.norm1(x)))
        return x + self.drop_path2(self.gamma_2 * self.mlp(self.norm2(x)))


class Beit(nn.Module):
    def __init__(self, img_size: int = 16, patch_size: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.num_prefix_tokens = 1
        self.patch_embed = PatchEmbed(img_size, patch_size, 3, DIM)
        grid = img_size // patch_size
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList([BeitBlock(DIM, HEADS, (grid, grid)) for _ in range(LAYERS)])
        self.norm = nn.Identity()
        self.fc_norm = nn.LayerNorm(DIM, eps=1e-6)  # use_mean_pooling
        self.head = nn.Linear(DIM, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        x = x[:, self.num_prefix_tokens :].mean(dim=1)
        return self.head(self.fc_norm(x))


# ==========================================================================================
# ChatGLM2 (THUDM modeling_chatglm.py): Megatron's per-partition names, (seq, batch, hidden)
# ==========================================================================================


@dataclass
class ChatGLMConfig:
    padded_vocab_size: int = VOCAB
    hidden_size: int = DIM
    ffn_hidden_size: int = 3 * DIM
    num_layers: int = LAYERS
    num_attention_heads: int = HEADS
    kv_channels: int = DIM // HEADS
    multi_query_attention: bool = True
    multi_query_group_num: int = 2
    seq_length: int = MAX_POS
    layernorm_epsilon: float = 1e-5
    add_qkv_bias: bool = True


class CoreAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_number: int) -> None:
        super().__init__()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = projection_size
        self.hidden_size_per_attention_head = projection_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.layer_number = max(1, layer_number)

    def forward(self, query_layer, key_layer, value_layer):
        # [sq, b, np, hn] -> [b, np, sq, hn]
        query_layer, key_layer, value_layer = (
            k.permute(1, 2, 0, 3) for k in (query_layer, key_layer, value_layer)
        )
        context_layer = F.scaled_dot_product_attention(
            query_layer, key_layer, value_layer, is_causal=True
        )
        context_layer = context_layer.permute(2, 0, 1, 3)  # [sq, b, np, hn]
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        return context_layer.reshape(*new_context_layer_shape)


def apply_rotary_pos_emb_glm(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    # x: [sq, b, np, hn]; rope_cache: [sq, 1, rot_dim // 2, 2]
    sq, np_ = x.size(0), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np_, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = self.projection_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.multi_query_attention = config.multi_query_attention
        self.qkv_hidden_size = 3 * self.projection_size
        if self.multi_query_attention:
            self.num_multi_query_groups_per_partition = config.multi_query_group_num
            self.qkv_hidden_size = (
                self.projection_size
                + 2 * self.hidden_size_per_attention_head * config.multi_query_group_num
            )
        self.query_key_value = nn.Linear(
            config.hidden_size, self.qkv_hidden_size, bias=config.add_qkv_bias
        )
        self.core_attention = CoreAttention(config, self.layer_number)
        self.dense = nn.Linear(self.projection_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, rotary_pos_emb):
        # hidden_states: [sq, b, h]
        mixed_x_layer = self.query_key_value(hidden_states)
        heads, head_size = (
            self.num_attention_heads_per_partition,
            self.hidden_size_per_attention_head,
        )
        groups = self.num_multi_query_groups_per_partition
        query_layer, key_layer, value_layer = mixed_x_layer.split(
            [heads * head_size, groups * head_size, groups * head_size], dim=-1
        )
        query_layer = query_layer.view(query_layer.size()[:-1] + (heads, head_size))
        key_layer = key_layer.view(key_layer.size()[:-1] + (groups, head_size))
        value_layer = value_layer.view(value_layer.size()[:-1] + (groups, head_size))
        query_layer = apply_rotary_pos_emb_glm(query_layer, rotary_pos_emb)
        key_layer = apply_rotary_pos_emb_glm(key_layer, rotary_pos_emb)
        if self.multi_query_attention:
            key_layer = key_layer.unsqueeze(-2).expand(-1, -1, -1, heads // groups, -1)
            key_layer = key_layer.contiguous().view(key_layer.size()[:2] + (heads, head_size))
            value_layer = value_layer.unsqueeze(-2).expand(-1, -1, -1, heads // groups, -1)
            value_layer = value_layer.contiguous().view(value_layer.size()[:2] + (heads, head_size))
        context_layer = self.core_attention(query_layer, key_layer, value_layer)
        return self.dense(context_layer)


class GLMMLP(nn.Module):
    def __init__(self, config: ChatGLMConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size * 2, bias=False)

        def swiglu(x):
            x = torch.chunk(x, 2, dim=-1)
            return F.silu(x[0]) * x[1]

        self.activation_func = swiglu
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation_func(self.dense_h_to_4h(hidden_states)))


class GLMBlock(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, layer_number)
        self.hidden_dropout = 0.0
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = GLMMLP(config)

    def forward(self, hidden_states, rotary_pos_emb):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(layernorm_output, rotary_pos_emb)
        residual = hidden_states
        layernorm_input = residual + F.dropout(attention_output, p=self.hidden_dropout)
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        mlp_output = self.mlp(layernorm_output)
        return layernorm_input + F.dropout(mlp_output, p=self.hidden_dropout)


class ChatGLMModel(nn.Module):
    def __init__(self, config: ChatGLMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ChatGLMConfig()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            [GLMBlock(config, i + 1) for i in range(config.num_layers)]
        )
        self.encoder.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        rot_dim = config.kv_channels // 2  # rotary on half of each head (ChatGLM2)
        theta = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
        idx_theta = torch.outer(torch.arange(config.seq_length, dtype=torch.float64), theta)
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("rotary_cache", cache, persistent=False)  # [seq, rot_dim // 2, 2]
        _init_normal(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.embedding.word_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_length = input_ids.shape[1]
        inputs_embeds = self.embedding.word_embeddings(input_ids).transpose(0, 1)  # [s, b, h]
        rotary_pos_emb = self.rotary_cache[:seq_length].unsqueeze(1)  # [s, 1, rot / 2, 2]
        hidden_states = inputs_embeds
        for layer in self.encoder.layers:
            hidden_states = layer(hidden_states, rotary_pos_emb)
        hidden_states = self.encoder.final_layernorm(hidden_states)
        return self.output_layer(hidden_states).transpose(0, 1).contiguous()


# ==========================================================================================
# the list
# ==========================================================================================


MORE_MODELS: dict[str, Foreign] = {
    m.name: m
    for m in (
        Foreign("stablelm", _built(StableLmForCausalLM), _causal_inputs),
        Foreign("starcoder2", _built(Starcoder2ForCausalLM), _causal_inputs),
        Foreign("jais", _built(JAISLMHeadModel), _causal_inputs),
        Foreign("whisper_decoder", _built(TextDecoder), _whisper_inputs),
        Foreign("diffusers_transformer2d", _built(Transformer2DModel), _latents_and_text),
        Foreign("dit", _built(DiT), _dit_inputs),
        Foreign("vit_pytorch", _built(LucidrainsViT), _images),
        Foreign("palm_pytorch", _palm, _ids),
        Foreign("gemma_pytorch", _built(GemmaForCausalLM), _ids),
        Foreign("gemma_flax_port", _built(FlaxTransformer), _ids),
        Foreign("beit", _built(Beit), _images),
        Foreign("chatglm2", _built(ChatGLMModel), _ids),
    )
}

assert SEQ <= MAX_POS
