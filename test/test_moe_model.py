"""The reference mixture-of-experts Llama (``torch_tp.models.moe``) on one device: routing,
experts, the load-balancing loss and the model around them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from torch_tp.models import Experts, MoEConfig, MoEFeedForward, MoELlama, TopKRouter
from torch_tp.models.moe import load_balancing_loss

CONFIG = MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2)


def _dense_experts(experts: Experts, hidden, index, weights) -> torch.Tensor:
    """The experts token by token, slot by slot: what :class:`Experts` must compute."""
    rows = []
    for t in range(hidden.shape[0]):
        row = torch.zeros_like(hidden[t])
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            gate, up = (experts.gate_up_proj[e] @ hidden[t]).chunk(2)
            row = row + weights[t, slot] * (experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("skewed", [False, True])
def test_experts_equal_the_token_by_token_computation(skewed):
    torch.manual_seed(0)
    experts = Experts(n_experts=4, dim=8, hidden_dim=6)
    hidden = torch.randn(10, 8)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    if skewed:  # experts 2 and 3 get no token
        index = torch.stack(
            [torch.tensor([0, 1]) if t % 2 else torch.tensor([1, 0]) for t in range(10)]
        )
    weights = torch.rand(10, 2)
    assert_close(experts(hidden, index, weights), _dense_experts(experts, hidden, index, weights))
    if skewed:
        experts(hidden, index, weights).sum().backward()
        assert experts.gate_up_proj.grad[2:].abs().sum() == 0  # idle experts: zero gradient
        assert experts.gate_up_proj.grad[:2].abs().sum() > 0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_takes_the_top_k_of_the_softmax(norm_topk_prob):
    torch.manual_seed(0)
    router = TopKRouter(dim=8, n_experts=5, top_k=2, norm_topk_prob=norm_topk_prob)
    hidden = torch.randn(6, 8)
    probs, weights, index = router(hidden)
    expected = F.linear(hidden, router.weight).softmax(-1)
    assert_close(probs, expected)
    top, top_index = expected.topk(2, dim=-1)
    assert torch.equal(index, top_index)
    want = top / top.sum(-1, keepdim=True) if norm_topk_prob else top
    assert_close(weights, want)


def test_load_balancing_loss():
    # even routing and uniform probabilities: exactly 1
    probs = torch.full((8, 4), 0.25, requires_grad=True)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    assert_close(load_balancing_loss(probs, index), torch.tensor(1.0))
    # all slots on expert 0 with probability 1 there: n_experts
    probs = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 3)
    assert_close(load_balancing_loss(probs, torch.zeros(3, 1, dtype=torch.long)), torch.tensor(4.0))


def test_feed_forward_adds_the_shared_expert_and_records_its_loss():
    torch.manual_seed(0)
    config = MoEConfig(
        dim=16, n_layers=1, n_heads=2, n_experts=3, top_k=1, shared_expert_hidden_dim=8
    )
    ffn = MoEFeedForward(config)
    x = torch.randn(2, 5, 16)
    tokens = x.reshape(-1, 16)
    probs, weights, index = ffn.router(tokens)
    routed = ffn.experts(tokens, index, weights)
    assert_close(ffn(x), (routed + ffn.shared_expert(tokens)).view_as(x))
    assert_close(ffn.aux_loss, load_balancing_loss(probs, index))


def test_model_forward_backward_and_aux_loss():
    torch.manual_seed(0)
    model = MoELlama(CONFIG)
    with pytest.raises(RuntimeError, match="run the model first"):
        model.aux_loss()
    logits = model(torch.randint(0, CONFIG.vocab_size, (2, 8)))
    assert logits.shape == (2, 8, CONFIG.vocab_size) and logits.dtype == torch.float32
    (logits.logsumexp(-1).mean() + model.aux_loss()).backward()
    router = model.layers[0].feed_forward.router
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    names = dict(model.named_parameters())
    assert names["layers.0.feed_forward.experts.gate_up_proj"].shape == (4, 2 * 32, 32)
    assert names["layers.0.feed_forward.experts.down_proj"].shape == (4, 32, 32)
    assert names["layers.1.feed_forward.router.weight"].shape == (4, 32)
    assert "layers.0.attention.wq.weight" in names  # the dense Llama's names, for its plans


def test_model_on_the_meta_device_then_materialized():
    with torch.device("meta"):
        model = MoELlama(CONFIG)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    experts = model.layers[0].feed_forward.experts
    assert 0.015 < experts.gate_up_proj.std() < 0.025
    assert torch.isfinite(model(torch.randint(0, CONFIG.vocab_size, (1, 4)))).all()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_experts": 0}, "n_experts must be positive"),
        ({"n_experts": 2, "top_k": 3}, "top_k must be in"),
        ({"expert_hidden_dim": 0}, "expert_hidden_dim must be positive"),
    ],
)
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**fields)
