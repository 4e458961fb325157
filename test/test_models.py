"""Single-process tests of the reference Llama in ``torch_tp.models``.

The model knows nothing of parallelism, but it must be *splittable*: the tests that shard
attention by hand check the properties the tensor-parallel plans rely on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from torch_tp.models import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    tiny_config,
)
from torch_tp.models.llama import apply_rotary_emb, precompute_rope


def _tokens(config: LlamaConfig, bsz: int = 2, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (bsz, seqlen), generator=gen)


def _perturb_norms(model: nn.Module) -> None:
    # Norm weights start at ones, which would hide a norm that ignores its weight.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (RMSNorm, nn.RMSNorm)):
                module.weight.uniform_(0.5, 1.5)


def test_module_names_match_the_plans() -> None:
    model = Llama(tiny_config())
    names = {name for name, _ in model.named_modules()}
    expected = {
        "tok_embeddings",
        "layers.0.attention_norm",
        "layers.0.attention",
        "layers.0.attention.wq",
        "layers.0.attention.wk",
        "layers.0.attention.wv",
        "layers.0.attention.wo",
        "layers.0.attention_dropout",
        "layers.0.ffn_norm",
        "layers.0.feed_forward",
        "layers.0.feed_forward.w1",
        "layers.0.feed_forward.w2",
        "layers.0.feed_forward.w3",
        "layers.0.ffn_dropout",
        "layers.1.attention.wq",
        "norm",
        "output",
    }
    assert expected <= names
    assert isinstance(model.tok_embeddings, nn.Embedding)
    assert isinstance(model.layers, nn.ModuleList)
    assert isinstance(model.layers[0], TransformerBlock)
    assert isinstance(model.layers[0].attention, Attention)
    assert isinstance(model.layers[0].feed_forward, FeedForward)
    assert isinstance(model.layers[0].attention_dropout, nn.Dropout)
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.bias is None for m in linears)


def test_logits_shape_dtype_and_init() -> None:
    config = tiny_config()
    torch.manual_seed(0)
    model = Llama(config)
    logits = model(_tokens(config, bsz=3, seqlen=10))
    assert logits.shape == (3, 10, config.vocab_size)
    assert logits.dtype == torch.float32
    # N(0, 0.02) init: logits are small but not degenerate.
    assert 1e-3 < logits.std().item() < 10.0
    assert torch.isfinite(logits).all()


def test_defaults_and_derived_sizes() -> None:
    config = LlamaConfig()
    assert (config.dim, config.n_layers, config.n_heads, config.vocab_size) == (64, 2, 4, 1001)
    assert config.kv_heads == 4
    assert config.head_dim == 16
    # 2/3 of 4 * 64 = 170, rounded up to a multiple of 16.
    assert config.ffn_hidden_dim == 176
    assert LlamaConfig(ffn_dim_multiplier=1.5).ffn_hidden_dim == 256
    assert LlamaConfig(hidden_dim=100).ffn_hidden_dim == 100
    assert tiny_config(n_layers=1).n_layers == 1


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dim": 64, "n_heads": 5}, "divisible by n_heads"),
        ({"dim": 48, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 8}, None),
        ({"dim": 12, "n_heads": 4}, "must be even"),
        ({"n_heads": 4, "n_kv_heads": 3}, "must divide n_heads"),
        ({"norm": "layernorm"}, "norm must be one of"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_config_validation(fields: dict[str, object], message: str | None) -> None:
    if message is None:
        LlamaConfig(**fields)  # valid
        return
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**fields)


def test_causal() -> None:
    config = tiny_config()
    model = Llama(config).eval()
    tokens = _tokens(config, seqlen=12)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % config.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert_close(after[:, :7], before[:, :7])
    assert not torch.allclose(after[:, 7:], before[:, 7:])


@pytest.mark.parametrize("n_kv_heads", [None, 4, 2, 1])
def test_gqa_equals_mha_with_repeated_kv(n_kv_heads: int | None) -> None:
    # A GQA model is an MHA model whose k/v projections repeat each kv head over its group of
    # query heads: check that the grouping is the contiguous one (what sharding assumes).
    config = tiny_config(n_heads=4, n_kv_heads=n_kv_heads)
    mha_config = tiny_config(n_heads=4, n_kv_heads=None)
    torch.manual_seed(0)
    gqa = Llama(config).eval()
    mha = Llama(mha_config).eval()
    n_rep = config.n_heads // config.kv_heads
    state = gqa.state_dict()
    for key in list(state):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = state[key].unflatten(0, (config.kv_heads, config.head_dim))
            state[key] = heads.repeat_interleave(n_rep, dim=0).flatten(0, 1)
    mha.load_state_dict(state)
    assert gqa.layers[0].attention.wk.out_features == config.kv_heads * config.head_dim
    tokens = _tokens(config)
    with torch.no_grad():
        assert_close(gqa(tokens), mha(tokens))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_attention_runs_on_local_heads(n_kv_heads: int) -> None:
    # What column-sharding q/k/v and row-sharding wo does: each "rank" keeps a contiguous
    # block of heads, attends over them alone, and the partial outputs sum to the full one.
    config = tiny_config(n_heads=4, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    full = Attention(config)
    x = torch.randn(2, 10, config.dim)
    rope = precompute_rope(config.head_dim, 10, config.rope_theta)
    world = 2
    partial_sum = torch.zeros_like(x)
    for rank in range(world):
        shard = Attention(config)
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                weight = getattr(full, name).weight.chunk(world, dim=0)[rank]
                setattr(shard, name, nn.Linear(config.dim, weight.shape[0], bias=False))
                getattr(shard, name).weight.copy_(weight)
            wo = full.wo.weight.chunk(world, dim=1)[rank]
            shard.wo = nn.Linear(wo.shape[1], config.dim, bias=False)
            shard.wo.weight.copy_(wo)
            partial_sum += shard(x, rope)
    with torch.no_grad():
        assert_close(partial_sum, full(x, rope))


def test_rope_is_a_rotation() -> None:
    head_dim, seqlen = 16, 9
    rope = precompute_rope(head_dim, seqlen)
    assert rope.shape == (seqlen, head_dim // 2, 2)
    x = torch.randn(2, seqlen, 3, head_dim)
    rotated = apply_rotary_emb(x, rope)
    # Position 0 is not rotated; every position keeps the norm of each pair.
    assert_close(rotated[:, 0], x[:, 0])
    assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    # Scores depend on relative positions only: q at i+s with k at j+s scores like q at i
    # with k at j.
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    qs = apply_rotary_emb(q.expand(1, seqlen, 1, head_dim), rope)[0, :, 0]
    ks = apply_rotary_emb(k.expand(1, seqlen, 1, head_dim), rope)[0, :, 0]
    assert_close(qs[5] @ ks[2], qs[7] @ ks[4])
    assert rotated.dtype == x.dtype


def test_rope_table_is_a_non_persistent_buffer() -> None:
    model = Llama(tiny_config())
    assert "rope_cache" in dict(model.named_buffers())
    assert not any("rope" in key for key in model.state_dict())


def test_rmsnorm_matches_torch_rmsnorm() -> None:
    torch.manual_seed(0)
    ours = RMSNorm(32, eps=1e-5)
    theirs = nn.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 7, 32)
    assert_close(ours(x), theirs(x))
    # Low-precision input: computed in float32, returned in the input dtype.
    out = ours(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_close(out, ours(x).bfloat16(), atol=1e-2, rtol=1e-2)


def test_both_norm_types_give_the_same_model() -> None:
    torch.manual_seed(0)
    ours = Llama(tiny_config(norm="rmsnorm"))
    _perturb_norms(ours)
    theirs = Llama(tiny_config(norm="torch_rmsnorm"))
    assert isinstance(theirs.norm, nn.RMSNorm)
    assert isinstance(ours.norm, RMSNorm)
    theirs.load_state_dict(ours.state_dict())
    tokens = _tokens(ours.config)
    with torch.no_grad():
        assert_close(theirs(tokens), ours(tokens))


def test_dropout_makes_train_and_eval_differ() -> None:
    config = tiny_config(dropout=0.2)
    model = Llama(config)
    tokens = _tokens(config)
    with torch.no_grad():
        model.train()
        train_a, train_b = model(tokens), model(tokens)
        model.eval()
        eval_a, eval_b = model(tokens), model(tokens)
    assert not torch.allclose(train_a, eval_a)
    assert not torch.allclose(train_a, train_b)
    assert_close(eval_a, eval_b)
    assert model.layers[0].attention_dropout.p == 0.2
    assert model.layers[0].ffn_dropout.p == 0.2


def test_longer_than_max_seq_len_raises() -> None:
    config = tiny_config(max_seq_len=8)
    model = Llama(config)
    model(_tokens(config, seqlen=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(config, seqlen=9))


def test_init_weights_after_meta_device() -> None:
    config = tiny_config()
    torch.manual_seed(0)
    reference = Llama(config)
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    assert_close(model.rope_cache, reference.rope_cache)
    tokens = _tokens(config)
    assert torch.isfinite(model(tokens)).all()
    # Same shapes and names as an eagerly built model, so state dicts move between them.
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert_close(model(tokens), reference(tokens))


def test_training_reduces_loss() -> None:
    # Learnable synthetic task: every sequence counts up modulo 50, so each next token is
    # determined by the current one.
    torch.manual_seed(0)
    config = tiny_config(n_layers=1, vocab_size=101)
    model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(15):
        start = torch.randint(0, 50, (8, 1), generator=gen)
        tokens = (start + torch.arange(17)) % 50
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
