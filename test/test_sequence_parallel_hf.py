"""Sequence parallelism for transformers' models: ``plan_for(model, sequence_parallel=True)``.

The residual stream between blocks is a DTensor sharded on the sequence (transformers computes
the positions and the causal mask from its length, which is the whole sequence's); each norm
runs on its shard, each attention and MLP gathers the sequence once and reduce-scatters its
output back, each MLP (dense or mixture-of-experts) one region of partial sums. Against one
device, float64: logits, loss (with the load-balancing loss where the model has one), every
gradient (the routers' too) and the parameters after an SGD step; Llama and Qwen2 (two head
layouts), the base model, and four MoE families (Mixtral, Qwen3-MoE with a dense first layer,
OLMoE with its gathered attention, Qwen2-MoE with a shared expert its plan leaves whole).
The experts over (ep, tp) under sequence parallelism are in ``test_moe_etp.py``.

Models written by others: eight architectures of ``test_zoo.py``'s zoo, planned right or
refused by name; ``python test/test_sequence_parallel_hf.py`` sweeps all of them (at this
writing: 42 of 100 pass, 58 are refused, none is planned wrong).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import tp_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import ColwiseParallel, ParallelStyle, parallelize_module
from torch_tp.testing import check_parity, collective_counts, run_distributed

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face model tests need transformers (pip install -e '.[test]')",
)

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers' models only to run)

VOCAB = 128
LAYERS = 2


def _dense(family: str, kv_heads: int, base_model: bool = False) -> torch.nn.Module:
    """test_transformers.py's Llama or Qwen2 (random norms and biases, the same on every
    rank), in float64."""
    from test_transformers import _model as dense

    return dense(family, kv_heads, base_model).double()


def _model(family: str, kv_heads: int = 2) -> torch.nn.Module:
    if family in ("llama", "qwen2"):
        return _dense(family, kv_heads)
    from test_transformers_moe import _model as moe_model

    return moe_model(family)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _trains_as_one_device(model, plan, ids, labels, **tolerance) -> torch.nn.Module:
    """``check_parity`` of a causal LM's loss: every output (logits, loss, router logits),
    every gradient, every parameter after an SGD step; the parallel model."""
    tp, _ = check_parity(
        model,
        tp_mesh(),
        plan,
        kwargs={"input_ids": ids, "labels": labels, "use_cache": False},
        loss_fn=lambda out: out.loss,
        optimizer_fn=_sgd,
        **tolerance,
    )
    return tp


def _parity(family: str, kv_heads: int) -> None:
    model = _model(family, kv_heads)
    plan = plan_for(model, sequence_parallel=True)
    ids = torch.randint(2, VOCAB, (2, 12))
    labels = torch.randint(2, VOCAB, (2, 12))
    tp = _trains_as_one_device(model, plan, ids, labels)
    if family == "qwen2_moe":  # transformers' plan leaves it whole; split here
        shared = tp.model.layers[1].mlp.shared_expert
        assert shared.down_proj.weight.placements == (Shard(1),)
    layer = tp.model.layers[0]
    # the norms run on sequence shards: replicated parameters, their gradients summed
    assert layer.input_layernorm.weight.placements == (Replicate(),)
    assert layer.self_attn.o_proj.weight.placements == (Shard(1),)
    # the stream between blocks is the sequence-sharded DTensor
    seen = []
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        tp(input_ids=ids, use_cache=False)
    handle.remove()
    assert isinstance(seen[0], DTensor) and seen[0].placements == (Shard(1),), seen[0]
    assert seen[0].to_local().shape[1] == 12 // 2


@pytest.mark.parametrize(
    "family, kv_heads",
    [
        ("llama", 2),
        ("mixtral", 2),
        pytest.param("llama", 4, marks=pytest.mark.slow),
        pytest.param("qwen2", 2, marks=pytest.mark.slow),
        pytest.param("qwen3_moe", 2, marks=pytest.mark.slow),
        pytest.param("olmoe", 2, marks=pytest.mark.slow),
        # its plan leaves the shared expert whole: made tensor-parallel here
        pytest.param("qwen2_moe", 2, marks=pytest.mark.slow),
    ],
)
def test_sequence_parallel_plan_matches_one_device(family, kv_heads):
    run_distributed(_parity, 2, family, kv_heads)


def _base_model_parity() -> None:
    """A base model's final norm hands on the whole sequence as a plain tensor."""
    model = _dense("llama", 2, base_model=True)
    ids = torch.randint(2, VOCAB, (2, 12))
    tp, _ = check_parity(
        model,
        tp_mesh(),
        plan_for(model, sequence_parallel=True),
        kwargs={"input_ids": ids, "use_cache": False},
        loss_fn=lambda out: out.last_hidden_state.square().sum(),
        optimizer_fn=_sgd,
    )
    with torch.no_grad():
        out = tp(input_ids=ids, use_cache=False).last_hidden_state
    assert type(out) is torch.Tensor and out.shape == (2, 12, 64), out


def test_base_model_matches_one_device():
    run_distributed(_base_model_parity, 2)


def _collectives(sequence_parallel: bool) -> tuple[dict[str, int], dict[str, int]]:
    model = _dense("llama", 2)
    parallelize_module(model, tp_mesh(), plan_for(model, sequence_parallel=sequence_parallel))
    ids = torch.randint(2, VOCAB, (2, 12))
    with CommDebugMode() as forward:
        out = model(input_ids=ids, labels=ids, use_cache=False)
    with CommDebugMode() as backward:
        out.loss.backward()
    return dict(collective_counts(forward)), dict(collective_counts(backward))


@pytest.mark.fast_runtime  # plain DTensor reduces the norms' gradients apart, as they arrive
def test_each_all_reduce_becomes_one_all_gather_and_one_reduce_scatter():
    """Megatron's sequence parallelism, counted (2 layers): where the plan without it
    all-reduces (the embedding, each attention and MLP, each way), it reduce-scatters onto
    the sequence and all-gathers off it; the final norm gathers for lm_head (one more each
    way); the norms' gradients, partial over the shards, are summed in one all-reduce at the
    end of backward."""
    (tp_fwd, tp_bwd), (sp_fwd, sp_bwd) = (
        run_distributed(_collectives, 2, sp)[0] for sp in (False, True)
    )
    blocks = 2 * LAYERS
    # without: the embedding's all-reduce, one per block, the ids' check; lm_head's gather
    assert tp_fwd == {"all_reduce": 1 + blocks + 1, "all_gather": 1}, tp_fwd
    assert tp_bwd == {"all_reduce": blocks + 1}, tp_bwd
    # with: the embedding's and each block's output reduce-scattered, each block's input and
    # lm_head's gathered (and its logits, as without); the ids' check
    assert sp_fwd == {"reduce_scatter": 1 + blocks, "all_gather": blocks + 2, "all_reduce": 1}
    # the gathers' gradients reduce-scattered, the reduce-scatters' gathered; one all-reduce
    assert sp_bwd == {"reduce_scatter": blocks + 1, "all_gather": blocks + 1, "all_reduce": 1}


def _moe_layer_collectives(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """One step of Mixtral at TP=2: the collectives inside its MoE layers (bench_moe's split,
    its agreed checks apart)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_moe

    model = _model("mixtral")
    parallelize_module(model, tp_mesh(), plan_for(model, sequence_parallel=sequence_parallel))
    ids = torch.randint(2, VOCAB, (2, 12))
    with bench_moe.MoECounter() as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    split = bench_moe.split_records(counter.records)
    return {part: {k: n for k, (n, _) in split[part].items()} for part in ("fwd", "bwd", "checks")}


@pytest.mark.fast_runtime  # plain DTensor reduces the router's gradient apart, as it arrives
def test_each_moe_layer_gathers_once_and_reduce_scatters_once():
    """Per MoE layer (Mixtral's 2): without sequence parallelism one all-reduce each way;
    with it one all-gather of the sequence and one reduce-scatter of the layer's output
    forward, the reverse backward; the agreed checks (the embedding's ids and each layer's
    expert ids) alike."""
    tp, sp = (run_distributed(_moe_layer_collectives, 2, flag)[0] for flag in (False, True))
    checks = {"all_reduce(check)": 1 + LAYERS}
    assert tp == {"fwd": {"all_reduce": LAYERS}, "bwd": {"all_reduce": LAYERS}, "checks": checks}
    gather_scatter = {"all_gather": LAYERS, "reduce_scatter": LAYERS}
    assert sp == {"fwd": gather_scatter, "bwd": gather_scatter, "checks": checks}, sp


# --------------------------------------------------------------------------- the zoo


def _zoo(model_type: str) -> str:
    """``plan_for(model, sequence_parallel=True)`` on test_zoo.py's tiny ``model_type``:
    refused by name, or one device's logits, loss and gradients after an SGD step."""
    import test_zoo

    model = test_zoo.build(model_type)
    try:
        plan = plan_for(model, sequence_parallel=True)
    except ValueError as error:
        return str(error)
    ids = torch.randint(2, test_zoo.VOCAB, (2, test_zoo.SEQ))
    # transformers' norms (and routers) compute in float32 whatever the model's dtype: sums
    # over the ranks in another order round differently there
    _trains_as_one_device(model, plan, ids, ids, rtol=1.3e-6, atol=1e-5)
    return "pass"


def _zoo_outcome(model_type: str) -> str:
    """``_zoo``'s outcome as one word: ``pass``, ``refused``, ``wrong`` or ``fails``."""
    import test_zoo

    try:
        result = _zoo(model_type)
    except AssertionError:
        return "wrong"
    except Exception as error:  # the tiny model does not build, or it fails to run
        return f"fails ({test_zoo._first_line(error)})"
    return "pass" if result == "pass" else "refused"


def sweep() -> dict[str, str]:
    """Every architecture of the zoo under ``plan_for(model, sequence_parallel=True)`` at
    TP=2 (a few minutes): ``python test/test_sequence_parallel_hf.py`` prints the outcomes
    and their counts."""
    import test_zoo

    return {name: run_distributed(_zoo_outcome, 2, name)[0] for name in sorted(test_zoo.zoo())}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, expected",
    [
        # written by others, laid out as Llama's: planned, and one device's results
        ("deepseek_v2", "pass"),  # latent attention, its down projections left whole
        ("glm4_moe", "pass"),  # shared experts, a dense first layer
        ("granite", "pass"),  # multipliers on the embedding, residuals and logits
        ("phi3", "pass"),  # packed q/k/v and gate/up projections
        # refused by name, before anything changes
        ("axk2", "'model.layers.0.input_layernorm': expected a norm"),  # a gated norm
        ("starcoder2", "'model.layers.0.mlp.c_proj': expected row-parallel layers without"),
        ("gemma2", "'model.layers.0.pre_feedforward_layernorm.weight': expected no parameter"),
        ("cohere", "'model.layers.0.post_attention_layernorm': expected a norm"),  # parallel
    ],
)
def test_zoo_models_are_planned_right_or_refused_by_name(model_type, expected):
    for result in run_distributed(_zoo, 2, model_type):
        assert expected in result, result


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "family, where, expected",
    [
        # DeepSeek-V3's plan leaves its latent attention replicated: nothing hands the
        # attention's output back onto the sequence
        ("deepseek_v3", "'model.layers.0.self_attn'", "one row-parallel output projection"),
        # Llama 4's layers hold a feed_forward, not an mlp
        ("llama4", "'model.layers.0.mlp'", "expected a module, found nothing"),
    ],
)
def test_models_it_cannot_plan_are_refused_by_name(family, where, expected):
    from test_transformers_moe import _model as moe_model

    with torch.device("meta"):
        model = moe_model(family)
    with pytest.raises(ValueError) as caught:
        plan_for(model, sequence_parallel=True)
    message = str(caught.value)
    assert f"sequence_parallel=True for {type(model).__name__}" in message, message
    assert where in message and expected in message, message


def test_gpt2_and_arguments_are_refused():
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB)
        )
        llama = _dense("llama", 2)
    with pytest.raises(ValueError, match=r"'transformer.embed_tokens': expected an nn.Embed"):
        plan_for(gpt2, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be a bool, found 'yes'"):
        plan_for(llama, sequence_parallel="yes")
    with pytest.raises(ValueError, match="sequence_parallel=True with cp_degree=2"):
        plan_for(llama, sequence_parallel=True, cp_degree=2)


def test_an_mlp_left_unplanned_is_refused():
    """An MLP computing whole outputs inside the region would have them summed over the
    ranks: a plan that leaves one unplanned is refused, naming it."""
    from torch_tp.plans._sequence import with_sequence_parallel

    with torch.device("meta"):
        model = _dense("llama", 2)
    plan: dict[str, ParallelStyle | str] = {
        k: v for k, v in plan_for(model).items() if ".mlp." not in k
    }
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj'.*found Linear unplanned"):
        with_sequence_parallel(model, plan, True)
    plan["lm_head"] = ColwiseParallel()  # the rest as it was: nothing else is refused
    plan.pop("model.embed_tokens")
    with pytest.raises(ValueError, match="'model.embed_tokens': expected a row- or column"):
        with_sequence_parallel(model, plan, True)


def _unplanned_inside_a_partial_sum(which: str) -> str:
    """A plan whose partial-sum region holds a module no style distributes: the MLP's
    ``down_proj`` of transformers' Llama, or the reference MoE's router."""
    if which == "llama":
        model = _dense("llama", 2)
        plan = plan_for(model, sequence_parallel=True)
        del plan["model.layers.*.mlp.down_proj"]
        inputs = {"input_ids": torch.randint(2, VOCAB, (2, 12)), "use_cache": False}
    else:
        from torch_tp.models import MoEConfig, MoELlama
        from torch_tp.plans.moe import moe_llama_plan

        model = MoELlama(MoEConfig(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, vocab_size=64))
        plan = moe_llama_plan(experts="tp", sequence_parallel=True)
        del plan["layers.*.feed_forward.router"]
        inputs = {"tokens": torch.randint(0, 64, (2, 8))}
    parallelize_module(model, tp_mesh(), plan)
    with pytest.raises(ValueError) as caught:
        model(**inputs)
    return str(caught.value)


@pytest.mark.parametrize(
    "which, where",
    [
        ("llama", "on 'model.layers.0.mlp' (LlamaMLP): its output is a partial sum over the 2 "
         "ranks, summed once at its end, but parameter 'down_proj.weight' (Linear)"),
        ("moe", "on 'layers.0.feed_forward' (MoEFeedForward): its output is a partial sum over "
         "the 2 ranks, summed once at its end, but parameter 'router.weight'"),
    ],
)  # fmt: skip
def test_a_module_left_unplanned_inside_a_partial_sum_is_refused_on_every_rank(which, where):
    """Computed whole on every rank, its share of the output would be counted twice (the
    router's gradient, from the experts' partial sums, left partial): silently wrong, so
    refused at the first call, naming it."""
    for message in run_distributed(_unplanned_inside_a_partial_sum, 2, which):
        assert where in message, message


def _odd_length() -> str:
    model = _dense("llama", 2)
    parallelize_module(model, tp_mesh(), plan_for(model, sequence_parallel=True))
    with pytest.raises(ValueError) as caught:
        model(input_ids=torch.randint(2, VOCAB, (2, 11)), use_cache=False)
    return str(caught.value)


def test_a_sequence_that_does_not_split_is_refused_on_every_rank():
    for message in run_distributed(_odd_length, 2):
        assert "'model.layers.0.input_layernorm' (LlamaRMSNorm)" in message, message
        assert "of length 11 does not split evenly over the 2 ranks" in message, message


if __name__ == "__main__":
    from collections import Counter

    outcomes = sweep()
    for name, outcome in outcomes.items():
        print(f"{name}: {outcome}")
    print(Counter(outcome.split(" ")[0] for outcome in outcomes.values()))
