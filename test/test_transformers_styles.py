"""transformers models whose own plans use the styles of their special parts, at TP=2
against one device (logits, loss, every gradient, greedy ``generate``):

* multi-head latent attention (DeepSeek-V2, MiniCPM3): ``kv_a_proj_with_mqa`` is
  ``"mla_kv_a_proj"`` (:class:`torch_tp.MLAKVAProjParallel`), a replicated projection whose
  rotary part, read by every rank's own heads, has its gradient summed;
* attention sinks (Granite-SWA): ``"self_attn.sinks": "colwise"`` next to ``"self_attn":
  "local_params"`` (:class:`torch_tp.LocalParamsParallel`), each rank computing with its own
  heads' sinks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import tp_mesh
from torch import nn
from torch.distributed.tensor import Shard

from torch_tp import LocalParamsParallel, MLAKVAProjParallel, parallelize_module
from torch_tp.plan import resolve_plan
from torch_tp.report import plan_report
from torch_tp.testing import check_parity, run_distributed

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face model tests need transformers (pip install -e '.[test]')",
)

VOCAB = 128
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "attn_implementation": "eager",
    # multi-head latent attention's sizes
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
SINKS = {
    "granite_swa": (
        "GraniteSWAForCausalLM",
        "GraniteSWAConfig",
        {"intermediate_size": 64, "sliding_window": 4, "num_key_value_heads": 2},
    ),
}
MODELS = {
    "minicpm3": ("MiniCPM3ForCausalLM", "MiniCPM3Config", {"intermediate_size": 64}),
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,  # layer 0 dense, so that the dense-MLP keys match
            "experts_implementation": "eager",
        },
    ),
}


def _model(family: str) -> nn.Module:
    causal_lm, config_class, fields = {**MODELS, **SINKS}[family]
    common = (
        _COMMON
        if family in MODELS
        else {k: v for k, v in _COMMON.items() if not k.startswith(("kv_", "q_", "qk_", "v_"))}
    )
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**common, **fields})
    model = getattr(transformers, causal_lm)(config)
    with torch.no_grad():  # norms at one hide a wrongly sliced norm: make them random
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("sinks"):  # sinks start at zero
                param.uniform_(0.5, 1.5)
    return model.double()


def _plan(model: nn.Module) -> dict[str, str]:
    """``model._tp_plan``, but its ``q_proj`` key: the plan covers both forms of the query
    (``q_proj``, or ``q_a_proj`` -> ``q_b_proj`` with ``q_lora_rank``), and these configs
    have the second."""
    if getattr(model.config, "q_lora_rank", None) is None:
        return dict(model._tp_plan)
    return {k: v for k, v in model._tp_plan.items() if not k.endswith("self_attn.q_proj")}


def _parity(family: str) -> None:
    model = _model(family)
    ids = torch.randint(2, VOCAB, (2, 12))
    tp, reference = check_parity(
        model,
        tp_mesh(),
        _plan(model),
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
        loss_fn=lambda out: out.loss,
        # Granite-SWA scales by its sinks in float32 whatever the model's dtype
        **({"rtol": 1.3e-6, "atol": 1e-5} if family in SINKS else {}),
    )
    attention = tp.model.layers[0].self_attn
    if family in SINKS:  # each rank: its heads' sinks
        assert attention.sinks.placements == (Shard(0),)
        assert attention.sinks.to_local().shape == (4 // dist.get_world_size(),)
    else:
        assert attention.kv_a_proj_with_mqa.weight.placements[0].is_replicate()
    prompt = ids[:, :5]
    generated = tp.generate(prompt, do_sample=False, max_new_tokens=8)
    expected = reference.generate(prompt, do_sample=False, max_new_tokens=8)
    assert torch.equal(generated, expected), (generated, expected)


@pytest.mark.parametrize(
    "family",
    # the quick run (-m "not slow") keeps one
    [
        f if f == "deepseek_v2" else pytest.param(f, marks=pytest.mark.slow)
        for f in [*MODELS, *SINKS]
    ],
)
def test_model_matches_single_device(family):
    run_distributed(_parity, 2, family)


def _without_the_rotary_reduction() -> None:
    """The check is not vacuous: the projection replicated without summing its rotary
    part's gradient gives wrong gradients (its own and, through its input, upstream)."""
    model = _model("minicpm3")
    plan = _plan(model)
    plan["model.layers.*.self_attn.kv_a_proj_with_mqa"] = "replicate"
    ids = torch.randint(2, VOCAB, (2, 12))
    with pytest.raises(AssertionError, match="step 0: gradient of"):
        check_parity(
            model,
            tp_mesh(),
            plan,
            kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
            loss_fn=lambda out: out.loss,
        )
    dist.barrier()


def test_replicating_the_projection_alone_is_wrong():
    run_distributed(_without_the_rotary_reduction, 2)


def _rope_dim_errors() -> None:
    with pytest.raises(ValueError, match="no qk_rope_head_dim"):
        parallelize_module(nn.Sequential(nn.Linear(8, 8)), tp_mesh(), {"0": "mla_kv_a_proj"})
    with pytest.raises(ValueError, match="leaves nothing"):
        parallelize_module(nn.Sequential(nn.Linear(8, 4)), tp_mesh(), {"0": MLAKVAProjParallel(4)})


def test_the_rotary_width_is_found_or_refused():
    run_distributed(_rope_dim_errors, 2)


def test_local_params_takes_its_placements_from_the_entries():
    with torch.device("meta"):
        model = _model("granite_swa")
    entries = resolve_plan(model, dict(model._tp_plan))
    styles = {e.path: e.style for e in entries if e.path.endswith("self_attn")}
    assert styles == {
        f"model.layers.{i}.self_attn": LocalParamsParallel({"sinks": Shard(0)}) for i in range(2)
    }


def _unplaced_parameter_refused() -> None:
    model = _model("granite_swa")
    plan = {k: v for k, v in model._tp_plan.items() if not k.endswith("sinks")}
    with pytest.raises(ValueError, match=r"no placement is given for \['sinks'\]"):
        parallelize_module(model, tp_mesh(), plan)
    assert not any(hasattr(p, "placements") for p in model.parameters())


def test_local_params_refuses_a_parameter_without_an_entry():
    run_distributed(_unplaced_parameter_refused, 2)


# --------------------------------------------------------------------------- apertus


def _apertus() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ApertusConfig(
        **{k: v for k, v in _COMMON.items() if not k.startswith(("kv_", "q_", "qk_", "v_"))},
        intermediate_size=64,
    )
    model = transformers.ApertusForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "alpha" in name:
                param.uniform_(0.5, 1.5)
    return model.double()


def test_apertus_learned_activation_is_reported():
    """apertus' plan leaves its xIELU activation's alpha_p/alpha_n out, though they compute
    on the up projection's column shard: a silently wrong gradient, which the dry-run report
    names before anything runs."""
    with torch.device("meta"):
        model = _apertus()
    report = plan_report(model, dict(model._tp_plan), 2, batch_size=2, seq_len=8)
    assert sorted(p.where for p in report.errors) == [
        "model.layers.*.mlp.act_fn.alpha_n",
        "model.layers.*.mlp.act_fn.alpha_p",
    ]
    assert "from model.layers.*.mlp.up_proj" in report.errors[0].message


def _apertus_parity() -> None:
    model = _apertus()
    plan = {**model._tp_plan, "model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}
    ids = torch.randint(2, VOCAB, (2, 12))
    check_parity(
        model,
        tp_mesh(),
        plan,
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
        loss_fn=lambda out: out.loss,
    )


def test_apertus_with_the_reported_fix_matches_one_device():
    run_distributed(_apertus_parity, 2)


# --------------------------------------------------------------------------- sampling


def _sampling(family: str) -> list[int]:
    """``generate(do_sample=True, top_p=0.9)`` after the same seed: the same tokens on every
    rank (transformers #36634 saw them differ) and as on one device."""
    model = _model(family)
    reference = copy.deepcopy(model)
    plan = _plan(model)
    parallelize_module(model, tp_mesh(), plan)
    prompt = torch.randint(2, VOCAB, (2, 5))
    torch.manual_seed(1234)
    sampled = model.generate(prompt, do_sample=True, top_p=0.9, max_new_tokens=8)
    torch.manual_seed(1234)
    expected = reference.generate(prompt, do_sample=True, top_p=0.9, max_new_tokens=8)
    assert torch.equal(sampled, expected), (sampled, expected)
    return sampled.flatten().tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", [*MODELS, *SINKS])
def test_sampling_is_the_same_on_every_rank_and_as_on_one_device(family):
    tokens = run_distributed(_sampling, 2, family)
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0][5:])) > 3  # really sampled, not one repeated token
