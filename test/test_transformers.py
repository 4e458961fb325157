"""Hugging Face transformers' Llama, Mistral, Qwen2 and GPT-2 under :mod:`torch_tp.plans.hf`.

Tiny models built from configs with random weights (nothing is downloaded) are trained for
two steps under tensor parallelism at TP=2 and TP=4 and compared with a single-device copy
(:func:`torch_tp.testing.check_parity`: logits, loss, every gradient and every parameter after
an optimizer step), then greedy ``generate`` must give exactly the single-device tokens. The
ready plans must communicate the Megatron minimum, and refuse heads that do not split.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

from torch_tp import AttentionHeads, PrepareModuleOutput, parallelize_module
from torch_tp.plan import from_dict, resolve_plan
from torch_tp.plans.hf import PLANS, gpt2_plan, llama_plan, mistral_plan, plan_for, qwen2_plan
from torch_tp.report import plan_report
from torch_tp.testing import check_parity, collective_counts, run_distributed

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face model tests need transformers (pip install -e '.[test]')",
)

VOCAB = 256  # divisible by every TP degree tested: the embedding and lm_head split evenly
LAYERS = 2

# (config class, causal LM class, base model class) by model_type
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, transformers.LlamaModel),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        transformers.MistralModel,
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, transformers.Qwen2Model),
}


def _config(family: str, kv_heads: int) -> transformers.PreTrainedConfig:
    config_class = FAMILIES[family][0]
    extra = {"sliding_window": 6} if family == "mistral" else {}  # shorter than the sequence
    return config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        # larger than the default 0.02, so that greedy decoding has clear winners
        initializer_range=0.1,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        eos_token_id=None,  # generate exactly max_new_tokens tokens
        pad_token_id=0,
        attn_implementation="sdpa",
        **extra,
    )


def _model(family: str, kv_heads: int, base_model: bool = False) -> nn.Module:
    """A float32 model with random weights, the same on every rank (same seed)."""
    torch.manual_seed(0)
    _, causal_lm, base = FAMILIES[family]
    model = (base if base_model else causal_lm)(_config(family, kv_heads))
    with torch.no_grad():
        # transformers zeroes biases (Qwen2's q/k/v) and sets norm weights to one: make both
        # random, so that one sliced or broadcast wrongly shows
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.float()


def _gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_head=4,
        n_layer=LAYERS,
        n_positions=64,
        # larger still than Llama's: with the embedding tied to the head, smaller weights make
        # greedy decoding repeat the prompt's last token, which would hide a broken KV cache
        initializer_range=0.25,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,  # generate exactly max_new_tokens tokens
        pad_token_id=0,
        attn_implementation="sdpa",
    )


def _gpt2(base_model: bool = False) -> nn.Module:
    """A float32 GPT-2 with random weights (tied wte/lm_head), the same on every rank."""
    torch.manual_seed(0)
    model_class = transformers.GPT2Model if base_model else transformers.GPT2LMHeadModel
    model = model_class(_gpt2_config())
    with torch.no_grad():
        # zero biases and unit LayerNorm weights would hide a wrongly sliced or added one
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
            elif ".ln_" in name or name.startswith("ln_"):
                param.uniform_(0.5, 1.5)
    return model.float()


def _sgd(params):
    # small steps: at lr 0.5 two steps collapse greedy decoding to one repeated token
    return torch.optim.SGD(params, lr=0.05)


# --------------------------------------------------------------------------- parity


def _train_and_generate(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Two SGD steps under TP with ``plan_for(model)`` equal to single device, then greedy
    decoding with the KV cache (each rank caches its own heads) gives the same tokens."""
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = torch.randint(0, VOCAB, (2, 12))
    tp, reference = check_parity(
        model,
        tp_mesh(),
        plan_for(model),
        kwargs={"input_ids": ids, "labels": labels, "use_cache": False},
        # compares the logits and the loss (both outputs), every gradient, every parameter
        loss_fn=lambda out: out.loss,
        optimizer_fn=_sgd,
        steps=2,
    )
    for name, param in tp.named_parameters():
        if isinstance(param, DTensor):
            assert param.grad.placements == param.placements, name

    prompt = ids[:, :5]
    generated = tp.generate(prompt, do_sample=False, max_new_tokens=8)
    expected = reference.generate(prompt, do_sample=False, max_new_tokens=8)
    assert expected.shape == (2, 13), expected.shape
    # a decoding that repeats one token would hide a broken KV cache
    assert len(set(expected[:, 5:].flatten().tolist())) > 4, expected
    assert torch.equal(generated, expected), (generated, expected)
    return tp, reference


def _causal_lm_parity(family: str, kv_heads: int) -> None:
    world_size = dist.get_world_size()
    tp, _ = _train_and_generate(_model(family, kv_heads))
    # the heads and the vocabulary really are split
    attention = tp.model.layers[0].self_attn
    assert attention.q_proj.weight.placements == (Shard(0),)
    assert attention.q_proj.weight.to_local().shape[0] == 64 // world_size
    assert attention.k_proj.weight.to_local().shape[0] == 16 * kv_heads // world_size
    if family == "qwen2":
        assert attention.q_proj.bias.placements == (Shard(0),)
    assert tp.model.embed_tokens.weight.placements == (Shard(0),)
    assert tp.lm_head.weight.to_local().shape[0] == VOCAB // world_size


# TP=4 in the full run only: the quick run stays under 2 minutes
_WORLD_SIZES = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("world_size", _WORLD_SIZES)
def test_causal_lm_matches_single_device(family, world_size):
    # grouped-query attention at TP=2 (2 KV heads, 1 per rank); TP=4 needs 4 KV heads
    kv_heads = 2 if world_size == 2 else 4
    run_distributed(_causal_lm_parity, world_size, family, kv_heads)


def _gpt2_parity() -> None:
    world_size = dist.get_world_size()
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    tp, reference = _train_and_generate(model)
    # the tied weight is one vocabulary-sharded parameter, trained once with both gradients
    wte = tp.transformer.wte.weight
    assert tp.lm_head.weight is wte
    assert wte.placements == (Shard(0),)
    assert wte.to_local().shape == (VOCAB // world_size, 64)
    assert reference.lm_head.weight is reference.transformer.wte.weight
    # q, k and v are sharded part by part: rank r holds its heads of each
    attention = tp.transformer.h[0].attn
    assert attention.c_attn.weight.placements == (_StridedShard(1, split_factor=3),)
    assert attention.c_attn.weight.to_local().shape == (64, 3 * 64 // world_size)
    assert attention.c_proj.weight.placements == (Shard(0),)
    assert (attention.num_heads, attention.split_size) == (4 // world_size, 64 // world_size)
    assert attention.head_dim == 16
    assert tp.transformer.h[0].mlp.c_fc.weight.placements == (Shard(1),)
    assert not isinstance(tp.transformer.wpe.weight, DTensor)  # not in the plan


@pytest.mark.parametrize("world_size", _WORLD_SIZES)
def test_gpt2_matches_single_device(world_size):
    run_distributed(_gpt2_parity, world_size)


def _verbatim_base_model_plan() -> None:
    # transformers' own base-model plan, style names and all, on transformers' own model
    model = _model("llama", kv_heads=2, base_model=True)
    ids = torch.randint(0, VOCAB, (2, 12))
    check_parity(
        model,
        tp_mesh(),
        dict(transformers.LlamaConfig.base_model_tp_plan),
        kwargs={"input_ids": ids, "use_cache": False},
        loss_fn=lambda out: out.last_hidden_state.pow(2).mean(),
        optimizer_fn=_sgd,
    )


def test_transformers_base_model_tp_plan_verbatim():
    run_distributed(_verbatim_base_model_plan, 2)


# --------------------------------------------------------------------------- communication


def _collectives_per_step(family: str) -> tuple[dict[str, int], dict[str, int]]:
    model = _gpt2() if family == "gpt2" else _model(family, kv_heads=2)
    parallelize_module(model, tp_mesh(), plan_for(model))
    ids = torch.randint(0, VOCAB, (2, 12))
    with CommDebugMode() as forward:
        out = model(input_ids=ids, labels=ids, use_cache=False)
    with CommDebugMode() as backward:
        out.loss.backward()
    return dict(collective_counts(forward)), dict(collective_counts(backward))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_collectives_are_megatron_minimum(family):
    # under CommDebugMode each module call sees a fresh alias of its input, so only the
    # replicated DTensor handed out by the norms lets q/k/v (gate/up) share one reduction
    forward, backward = run_distributed(_collectives_per_step, 2, family)[0]
    # embedding: 1 all-reduce, and 1 of two numbers (the ids agreed in range on every rank);
    # per layer: attention and MLP 1 each; lm_head: 1 all-gather
    assert forward == {"all_reduce": 2 + 2 * LAYERS, "all_gather": 1}, forward
    # per layer: one for the attention input's gradient, one for the MLP's; lm_head's input: 1
    assert backward == {"all_reduce": 2 * LAYERS + 1}, backward


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_report_predicts_the_collectives(family):
    """The dry-run report on the meta model predicts what the run above measures."""
    forward, backward = run_distributed(_collectives_per_step, 2, family)[0]
    with torch.device("meta"):
        model = _gpt2() if family == "gpt2" else _model(family, kv_heads=2)
    # GPT-2 looks for padding in the ids (data-dependent) when it has a pad token
    model.config.pad_token_id = None
    report = plan_report(model, plan_for(model), 2, batch_size=2, seq_len=12, device_type="cpu")
    kinds = {"all_gather_into_tensor": "all_gather"}
    assert {kinds.get(k, k): n for k, n in report.counts("forward").items()} == forward
    assert {kinds.get(k, k): n for k, n in report.counts("backward").items()} == backward
    assert not report.errors


# --------------------------------------------------------------------------- refusal


def _refuse_indivisible_kv_heads() -> None:
    model = _model("llama", kv_heads=1)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        parallelize_module(model, tp_mesh(), plan_for(model))
    message = str(info.value)
    assert "'model.layers.0.self_attn'" in message, message
    assert "AttentionHeads" in message, message
    assert "1 key/value heads do not split over 2 ranks" in message, message
    # refused before anything changed: no DTensor, the same values, sizes untouched
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert model.config.num_key_value_heads == 1


def test_indivisible_kv_heads_are_refused():
    run_distributed(_refuse_indivisible_kv_heads, 2)


# --------------------------------------------------------------------------- plans (no ranks)


def _replicated_norm() -> PrepareModuleOutput:
    return PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("base_model", [False, True])
def test_plan_is_transformers_plan_plus_embedding(family, base_model):
    config_class, causal_lm, base = FAMILIES[family]
    with torch.device("meta"):
        model = (base if base_model else causal_lm)(_config(family, kv_heads=2))
    plan = plan_for(model)
    assert plan == PLANS[family](base_model=base_model)
    # every key names modules of the real model (resolve_plan raises on a key matching none)
    entries = resolve_plan(model, plan)
    assert len(entries) == 1 + 10 * LAYERS + (0 if base_model else 1)
    # the decoder layers exactly as transformers' base_model_tp_plan says, embedding and
    # head as transformers' names for those layouts say
    prefix = "" if base_model else "model."
    expected = {prefix + k: v for k, v in config_class.base_model_tp_plan.items()}
    expected[prefix + "embed_tokens"] = "embedding_rowwise"
    if not base_model:
        expected.update(causal_lm._tp_plan)
    expected = from_dict(expected)
    # plus what transformers' plan has no name for: the head check, the shared reductions
    layer = f"{prefix}layers.*"
    expected[f"{layer}.self_attn"] = AttentionHeads(
        "config.num_attention_heads", "config.num_key_value_heads"
    )
    expected[f"{layer}.input_layernorm"] = _replicated_norm()
    expected[f"{layer}.post_attention_layernorm"] = _replicated_norm()
    assert plan == expected


@pytest.mark.parametrize("base_model", [False, True])
def test_gpt2_plan(base_model):
    with torch.device("meta"):
        model = _gpt2(base_model)
    plan = plan_for(model)
    assert plan == gpt2_plan(base_model=base_model)
    entries = resolve_plan(model, plan)
    assert len(entries) == 1 + 7 * LAYERS + (0 if base_model else 1)
    prefix = "" if base_model else "transformer."
    assert {key: plan[key] for key in (f"{prefix}wte", f"{prefix}h.*.ln_1")} == {
        f"{prefix}wte": from_dict({"wte": "embedding_rowwise"})["wte"],
        f"{prefix}h.*.ln_1": _replicated_norm(),
    }
    assert plan[f"{prefix}h.*.attn"] == AttentionHeads(
        "num_heads", divide=("num_heads", "split_size")
    )
    assert not any("wpe" in key for key in plan)  # position embeddings stay replicated
    if not base_model:
        assert plan["lm_head"] == from_dict({"lm_head": "colwise_gather_output"})["lm_head"]


def test_family_functions_and_table():
    assert PLANS == {
        "gpt2": gpt2_plan,
        "llama": llama_plan,
        "mistral": mistral_plan,
        "qwen2": qwen2_plan,
    }
    assert llama_plan() == mistral_plan() == qwen2_plan()
    for make_plan, prefix in ((llama_plan, "model."), (gpt2_plan, "transformer.")):
        assert set(make_plan()) == {f"{prefix}{key}" for key in make_plan(base_model=True)} | {
            "lm_head"
        }
        # a fresh dict (and fresh styles) per call: parallelize_module mutates styles
        assert make_plan()["lm_head"] is not make_plan()["lm_head"]


def test_plan_for_unsupported_model():
    class Bert(nn.Module):  # stands for any transformers model without a plan here
        config = transformers.BertConfig()

    supported = "supported types: gpt2, llama, mistral, qwen2"
    with pytest.raises(ValueError, match=rf"model_type 'bert' .*{supported}"):
        plan_for(Bert())
    with pytest.raises(ValueError, match="Linear: it has no config.model_type"):
        plan_for(nn.Linear(2, 2))
