"""Context parallelism is never silently wrong: what the ring cannot follow is refused, on
every rank alike, and what it can follow matches one device.

- Sliding windows (and chunks, and other layer types), wherever transformers keeps them: the
  config's ``sliding_window`` that the model reads for every layer's mask (Mistral, Mixtral,
  Starcoder 2: their attention modules hold no window), ``use_sliding_window`` with
  ``max_window_layers`` (Qwen 2/3: the window applies from that layer on, and only when
  true), ``config.layer_types`` per layer (Gemma 2), the module's own ``sliding_window``.
  Refused when the plan is applied (``parallelize_module`` by hand, ``plan_for(...,
  cp_degree=2)``, ``auto(..., cp_degree=2)``), a ValueError naming the module, the style, the
  window and the fix, with the model untouched. A window over a sequence no longer than the
  window is refused too (the length is unknown when the plan is applied; the fix says so).
- The same families without a window are accepted, and their logits match one device.
- A forward whose length does not split over ``2 * cp`` names the length and the divisor.
- A plain module that passes an attention mask (or dropout) on one rank only: the same error
  on every rank, none left waiting in the ring (the verdict travels with the ring's blocks).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import torch_tp
from torch_tp import ContextParallel, sequence_positions, shard_sequence, unshard_sequence
from torch_tp.testing import device_type, run_distributed

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 16, 2, 128
LAYERS = "model.layers.*"
TOL = {"rtol": 1e-7, "atol": 1e-9}
# Gemma 2 has no sdpa attention in transformers: eager, whose softmax is float32
_ATTENTION = {"gemma2": "eager"}
EAGER_TOL = {"rtol": 1e-4, "atol": 1e-6}
# a hung ring fails the test instead of hanging the run
TIMEOUT = 120


def _model(family: str, heads: tuple[int, int], **window) -> nn.Module:
    config_class, model_class = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
    }[family]
    extra = {}
    if family == "mixtral":  # (grouped_mm takes no float64)
        extra = {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "experts_implementation": "eager",
        }
    if family == "gemma2":  # the ring cannot cap the scores: compare without capping
        extra = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    config = config_class(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=_ATTENTION.get(family, "sdpa"),
        **extra,
        **window,
    )
    torch.manual_seed(0)
    return model_class(config).double()


def _plan(model: nn.Module, how: str) -> dict:
    from torch_tp.plans.auto import auto
    from torch_tp.plans.hf import plan_for

    if how == "by hand":
        return {LAYERS: ContextParallel()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto's notes on what it inferred
        return (plan_for if how == "plan_for" else auto)(model, cp_degree=2)


def _refused(family: str, heads: tuple[int, int], window: dict, how: str) -> str:
    """The plan applied to a windowed model: refused before anything changes."""
    model = _model(family, heads, **window)
    before = copy.deepcopy(model.state_dict())
    attention = model.model.layers[0].self_attn
    config = attention.config
    mesh = init_device_mesh(device_type(), (2, 1), mesh_dim_names=("cp", "tp"))
    plan = _plan(model, how)
    with pytest.raises(ValueError) as caught:
        torch_tp.parallelize_module(model, mesh if how != "by hand" else mesh["cp"], plan)
    assert attention.config is config  # nothing changed
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not model._forward_pre_hooks and not model.model.layers[0]._forward_pre_hooks
    return str(caught.value)


def _accepted(family: str, heads: tuple[int, int], window: dict, how: str) -> None:
    """The plan applied to a model without a window: the logits are one device's."""
    reference = _model(family, heads, **window)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 1), mesh_dim_names=("cp", "tp"))
    plan = _plan(model, how)
    torch_tp.parallelize_module(model, mesh if how != "by hand" else mesh["cp"], plan)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    cp = mesh["cp"]
    positions = sequence_positions(SEQ, cp)[None].expand(BATCH, -1)
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        logits = model(input_ids=shard_sequence(tokens, cp), position_ids=positions).logits
    tol = EAGER_TOL if family in _ATTENTION else TOL
    torch.testing.assert_close(unshard_sequence(logits, cp), expected, **tol)


def _check_refusal(message: str, path: str, what: str) -> None:
    assert "cannot apply ContextParallel" in message and "on 'model.layers.0'" in message, message
    assert f"the attention module {path!r}" in message, message
    assert what in message, message
    assert "sliding_window=None" in message and "no cp_degree" in message, message


# each case: family, head layouts (two: the grouped-query path and the one without it), the
# window's config, what the error says of it; then a config of the family without a window
WINDOWED = [
    ("mistral", {"sliding_window": 10}, "a sliding window of 10 tokens (config.sliding_window"),
    ("mistral", {"sliding_window": 4}, "a sliding window of 4 tokens (config.sliding_window"),
    ("mixtral", {"sliding_window": 10}, "a sliding window of 10 tokens (config.sliding_window"),
    ("starcoder2", {"sliding_window": 8}, "a sliding window of 8 tokens (config.sliding_window"),
    (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 0},
        "a sliding window of 10 tokens (config.layer_types[0] = 'sliding_attention')",
    ),
    (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 0},
        "a sliding window of 10 tokens (config.layer_types[0] = 'sliding_attention')",
    ),
    (
        "gemma2",
        {"sliding_window": 10, "layer_types": ["sliding_attention", "full_attention"]},
        "a sliding window of 10 tokens (config.layer_types[0] = 'sliding_attention')",
    ),
    (
        "olmo3",
        {"sliding_window": 10, "layer_types": ["sliding_attention", "full_attention"]},
        "a sliding window of 10 tokens (config.layer_types[0] = 'sliding_attention')",
    ),
]
HEADS = [(4, 2), (4, 4)]
WITHOUT = {
    "mistral": {"sliding_window": None},
    "mixtral": {"sliding_window": None},
    "starcoder2": {"sliding_window": None},
    # the window applies only when use_sliding_window is true
    "qwen2": {"use_sliding_window": False, "sliding_window": 10, "max_window_layers": 0},
    "qwen3": {"use_sliding_window": False, "sliding_window": 10, "max_window_layers": 0},
    "gemma2": {"sliding_window": 10, "layer_types": ["full_attention", "full_attention"]},
    "olmo3": {"sliding_window": 10, "layer_types": ["full_attention", "full_attention"]},
}


def _windows(family: str, window: dict, how: str) -> list[str]:
    messages = [_refused(family, heads, window, how) for heads in HEADS]
    for heads in HEADS:
        _accepted(family, heads, WITHOUT[family], how)
    return messages


@pytest.mark.parametrize(
    ("family", "window", "what"), WINDOWED, ids=[f"{f}-{list(w.values())}" for f, w, _ in WINDOWED]
)
def test_sliding_windows_are_refused_when_the_plan_is_applied(family, window, what):
    """Refused on every rank (both head layouts), naming the module, the style, the window and
    the fix; the same family without a window matches one device."""
    for messages in run_distributed(_windows, 2, family, window, "by hand", timeout=TIMEOUT):
        for message in messages:
            _check_refusal(message, "self_attn", what)


@pytest.mark.parametrize("how", ["plan_for", "auto"])
@pytest.mark.parametrize(
    ("family", "window", "what"),
    # the number-valued windows in the quick run, the per-layer ones (layer_types) in the full
    # one: their plans take seconds to make
    [
        *(WINDOWED[i] for i in (0, 4)),
        *(pytest.param(*WINDOWED[i], marks=pytest.mark.slow) for i in (6, 7)),
    ],
)
def test_the_plans_with_cp_degree_refuse_windows_too(how, family, window, what):
    for messages in run_distributed(_windows, 2, family, window, how, timeout=TIMEOUT):
        for message in messages:
            _check_refusal(message, "self_attn", what)


def _qwen2_window_from_a_later_layer() -> tuple[str, str]:
    """max_window_layers=1 of 2: the window starts at layer 1 (layer 0 is accepted alone);
    max_window_layers=2: no layer slides, accepted whole and exact."""
    window = {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1}
    model = _model("qwen2", (4, 2), **window)
    mesh = init_device_mesh(device_type(), (2,), mesh_dim_names=("cp",))
    with pytest.raises(ValueError) as caught:
        torch_tp.parallelize_module(model, mesh, {LAYERS: ContextParallel()})
    model = _model("qwen2", (4, 2), **window)
    torch_tp.parallelize_module(model, mesh, {"model.layers.0": ContextParallel()})
    _accepted("qwen2", (4, 2), {**window, "max_window_layers": 2}, "by hand")
    return str(caught.value), type(caught.value).__name__


def test_qwen2_max_window_layers_is_followed():
    for message, kind in run_distributed(_qwen2_window_from_a_later_layer, 2, timeout=TIMEOUT):
        assert kind == "ValueError", message
        assert "on 'model.layers.1'" in message, message
        assert "config.layer_types[1] = 'sliding_attention'" in message, message


# --------------------------------------------------------------------------- the length


def _odd_length() -> list[str]:
    model = _model("mistral", (4, 2), sliding_window=None)
    mesh = init_device_mesh(device_type(), (2,), mesh_dim_names=("cp",))
    torch_tp.parallelize_module(model, mesh, {LAYERS: ContextParallel()})
    errors = []
    tokens = torch.randint(0, VOCAB, (BATCH, 7))  # 14 tokens in all: not in 4 chunks
    with pytest.raises(ValueError) as caught:
        model(input_ids=tokens, position_ids=torch.arange(7)[None])
    errors.append(str(caught.value))
    # a different length on each rank: refused alike, naming both
    tokens = torch.randint(0, VOCAB, (BATCH, 4 if mesh.get_local_rank() == 0 else 8))
    with pytest.raises(ValueError) as caught:
        model(input_ids=tokens, position_ids=torch.arange(tokens.shape[1])[None])
    errors.append(str(caught.value))
    return errors


def test_a_length_that_does_not_split_names_the_length_and_the_divisor():
    for odd, uneven in run_distributed(_odd_length, 2, timeout=TIMEOUT):
        assert "7 tokens per rank" in odd and "a sequence of 14 tokens" in odd, odd
        assert "must be divisible by 4 (2 * cp" in odd, odd
        assert "position_ids" not in odd, odd
        assert "sequences of 4 to 8 tokens" in uneven, uneven


# --------------------------------------------------------------------------- one rank's call


class _Attention(nn.Module):
    """A plain attention whose mask (or dropout) depends on its rank's data."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48, dtype=torch.float64)
        self.mask = False
        self.dropout = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.mask:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        return out.transpose(1, 2).flatten(2)


def _one_rank_only(rotation: str) -> list[str]:
    cp = torch.distributed.get_world_size()
    mesh = init_device_mesh(device_type(), (cp,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(), _Attention())
    reference = copy.deepcopy(model)
    torch_tp.parallelize_module(model, mesh, {"*": ContextParallel(rotation=rotation)})
    rank = mesh.get_local_rank()
    x = torch.randn(2, SEQ, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    errors = []
    for attribute, value in (("mask", True), ("dropout", 0.5)):
        setattr(model[1], attribute, value if rank == 1 else getattr(model[1], attribute))
        with pytest.raises(NotImplementedError) as caught:
            model(shard_sequence(x, mesh))
        errors.append(str(caught.value))
        setattr(model[1], attribute, getattr(reference[1], attribute))
    # and the ring runs on as before
    out = unshard_sequence(model(shard_sequence(x, mesh)).detach(), mesh)
    torch.testing.assert_close(out, reference(x).detach(), **TOL)
    return errors


@pytest.mark.parametrize("rotation", ["p2p", "allgather"])
def test_a_mask_on_one_rank_only_is_the_same_error_on_every_rank(rotation):
    ranks = run_distributed(_one_rank_only, 2, rotation, timeout=TIMEOUT)
    assert ranks[0] == ranks[1], ranks
    mask, dropout = ranks[0]
    assert "ContextParallel" in mask and "on '1'" in mask, mask
    assert "an attention mask (attn_mask) cannot be followed" in mask and "(on rank 1)" in mask
    assert "dropout inside attention (dropout_p=0.5)" in dropout and "(on rank 1)" in dropout


@pytest.mark.four_ranks
def test_a_mask_on_one_rank_only_at_cp4():
    ranks = run_distributed(_one_rank_only, 4, "p2p", timeout=TIMEOUT)
    assert all(r == ranks[0] for r in ranks), ranks
    assert "(on rank 1)" in ranks[0][0]
