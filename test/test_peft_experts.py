"""PEFT's LoRA on the stacked expert weights (``target_parameters=``) under torch_tp.

A tiny transformers Mixtral in float64 (the experts' eager loop: torch's ``grouped_mm`` has
no float64 kernel; the router's softmax in float64, see :func:`_router_in_float64`), LoRA on
``q_proj``/``v_proj`` and on the experts' ``gate_up_proj`` and ``down_proj`` (PEFT's nested
``ParamWrapper``), planned by ``plan_for`` (the experts ``TensorParallelExperts``: every
expert sharded on its hidden dimension), at TP=2 and TP=4, in both orders and with the
``PeftModel``'s own plan, against the same PEFT model on one device: logits, loss (the
load-balancing loss in it), every adapter gradient (the base frozen, without gradients),
every parameter after two AdamW steps, the state dict's full adapter tensors; and
``merge_and_unload()``. The experts' adapters add no collective.
:class:`~torch_tp.ExpertParallel` refuses them by name, with the model unchanged."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from helpers import FAST_RUNTIME, adamw, check_step, full_tensor, tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp
from torch_tp._torch_compat import StridedShard
from torch_tp.testing import run_distributed

peft = pytest.importorskip("peft", reason="the adapter tests need peft (pip install -e '.[peft]')")
transformers = pytest.importorskip("transformers", reason="the adapter tests need transformers")

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers)

_EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_IDS_SEED, _ADAPTER_SEED, VOCAB = 3, 1, 64


def _mixtral(kv_heads: int = 2) -> nn.Module:
    """A tiny Mixtral (4 experts, top 2, the load-balancing loss in the loss), the same on
    every rank; ``kv_heads=4`` gives each of 4 ranks a whole key/value head."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.1, initializer_range=0.2,
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).double()
    for layer in model.model.layers:
        layer.mlp.gate.forward = functools.partial(_router_in_float64, layer.mlp.gate)
    return model


def _router_in_float64(router: nn.Module, hidden_states: torch.Tensor) -> tuple:
    """Mixtral's router (``MixtralTopKRouter.forward``) with its softmax in the model's dtype.

    transformers computes it in float32 whatever the dtype: the routing weights' gradient,
    a sum over the ranks' partial expert outputs, is then rounded to float32 on each rank
    before it is summed, which differs from one device's by float32's rounding (6e-8 in the
    adapters' gradients, amplified by AdamW to 3e-7 in the logits of the next step) and
    would hide float64 differences."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dim=-1)
    top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
    top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return logits, top_value, top_index


def _config(targets: list[str] = _EXPERT_WEIGHTS) -> object:
    # adapters drawn at random: PEFT's default zero lora_B would hide a wrong lora_A
    return peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=targets,
        init_lora_weights=False,
    )  # fmt: skip


def _peft_model(base: nn.Module, config: object) -> nn.Module:
    torch.manual_seed(_ADAPTER_SEED)
    return peft.get_peft_model(base, config)


def _parallel(route: str, reference: nn.Module, config: object, kv_heads: int) -> nn.Module:
    """The PEFT model of ``reference`` parallelized by ``route``, with its values."""
    mesh = tp_mesh()
    if route in ("peft_first", "plan_for_peft"):
        model = _peft_model(_mixtral(kv_heads), config)
        model.load_state_dict(reference.state_dict())
        # the inner model's plan, or the PeftModel's own (its keys under base_model.model)
        inner = model.base_model.model if route == "peft_first" else model
        torch_tp.parallelize_module(inner, mesh, plan_for(inner))
        return model
    base = _mixtral(kv_heads)
    torch_tp.parallelize_module(base, mesh, plan_for(base))
    model = _peft_model(base, config)
    adapters = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    result = model.load_state_dict(adapters, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return model


def _step(model: nn.Module, ids: torch.Tensor) -> object:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def _parity(route: str, kv_heads: int = 2) -> None:
    config = _config()
    reference = _peft_model(_mixtral(kv_heads), config)
    model = _parallel(route, reference, config, kv_heads)
    lora = [n for n, p in model.named_parameters() if "lora_" in n]
    assert any("experts" in n for n in lora)
    hosted = [n for n in lora if isinstance(model.get_parameter(n), DTensor)]
    assert hosted == lora, sorted(set(lora) - set(hosted))  # every adapter laid out
    # laid out like the weight each adapts: gate_up_proj's rows strided, down_proj's columns
    experts = model.base_model.model.model.layers[0].mlp.experts
    outer, inner = experts, experts.base_layer
    by_name = {w.parameter_name: w for w in (outer, inner)}
    gate_up, down = by_name["gate_up_proj"], by_name["down_proj"]
    assert gate_up.lora_A["default"].weight.placements == (Replicate(),)
    assert gate_up.lora_B["default"].weight.placements == (StridedShard(0, split_factor=2),)
    assert down.lora_A["default"].weight.placements == (Shard(1),)
    assert down.lora_B["default"].weight.placements == (Replicate(),)

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(_IDS_SEED))
    optim = adamw([p for p in model.parameters() if p.requires_grad])
    ref_optim = adamw([p for p in reference.parameters() if p.requires_grad])
    for _ in range(2):
        expected, actual = _step(reference, ids), _step(model, ids)
        torch.testing.assert_close(full_tensor(actual.logits), expected.logits)
        torch.testing.assert_close(full_tensor(actual.loss), expected.loss)
        # every gradient (the frozen base's: None on both) and parameter after the step
        check_step(model, reference, optim, ref_optim, grad_tol={}, param_tol={})
    # the state dict holds the full factors, as PEFT saves them
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        if "lora_" in key:
            assert not isinstance(state[key], DTensor), key
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")


def _merged(route: str) -> None:
    """``merge_and_unload()`` under TP: the single-device merged weights, still laid out as
    planned, and the same logits."""
    config = _config()
    reference = _peft_model(_mixtral(), config)
    model = _parallel(route, reference, config, 2)
    merged, expected = model.merge_and_unload(), reference.merge_and_unload()
    experts = merged.model.layers[0].mlp.experts
    assert type(experts).__name__ == "MixtralExperts"
    assert experts.gate_up_proj.placements == (StridedShard(1, split_factor=2),)
    assert experts.down_proj.placements == (Shard(2),)
    for name, param in expected.named_parameters():
        torch.testing.assert_close(
            full_tensor(merged.get_parameter(name).detach()), param.detach(), msg=name
        )
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(_IDS_SEED))
    with torch.no_grad():
        actual, wanted = merged(input_ids=ids).logits, expected(input_ids=ids).logits
    torch.testing.assert_close(full_tensor(actual), wanted)


@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
def test_merge_and_unload_of_expert_lora(route: str) -> None:
    run_distributed(_merged, 2, route)


@pytest.mark.parametrize("route", ["peft_first", "plan_first", "plan_for_peft"])
def test_expert_lora_matches_one_device(route: str) -> None:
    run_distributed(_parity, 2, route)


@pytest.mark.four_ranks
@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
def test_expert_lora_matches_one_device_at_four_ranks(route: str) -> None:
    run_distributed(_parity, 4, route, kv_heads=4)


class _Collectives(TorchDispatchMode):
    """Counts the collectives dispatched inside it, by name (torch's ``CommDebugMode`` cannot
    be used: its module tracker fails on the tiny Mixtral under torch_tp, adapters or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        collective = any(k in name for k in ("reduce", "gather", "scatter", "all_to_all"))
        if func.namespace in ("c10d", "_c10d_functional") and collective:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _collectives(targets: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """The collectives of one forward and one backward with LoRA on q/v and on the experts'
    ``targets``."""
    model = _peft_model(_mixtral(), _config(targets))
    inner = model.base_model.model
    torch_tp.parallelize_module(inner, tp_mesh(), plan_for(inner))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(_IDS_SEED))
    with _Collectives() as forward:
        loss = model(input_ids=ids, labels=ids).loss
    with _Collectives() as backward:
        loss.backward()
    return dict(forward.counts), dict(backward.counts)


def test_expert_adapters_add_no_collective() -> None:
    (plain_fwd, plain_bwd), (lora_fwd, lora_bwd) = (
        run_distributed(_collectives, 2, targets)[0] for targets in ([], _EXPERT_WEIGHTS)
    )
    assert plain_fwd and plain_bwd  # the experts' and attention's reductions are counted
    assert lora_fwd == plain_fwd, (lora_fwd, plain_fwd)
    if FAST_RUNTIME:
        # the whole factors' partial gradients join the one end-of-backward all-reduce
        assert lora_bwd == plain_bwd, (lora_bwd, plain_bwd)
    else:  # plain DTensor: one all-reduce per whole factor (2 per layer, 2 layers)
        assert lora_bwd == {**plain_bwd, "all_reduce": plain_bwd["all_reduce"] + 4}, lora_bwd


def _expert_parallel_refuses(route: str) -> None:
    plan = {"model.layers.*.mlp.experts": torch_tp.ExpertParallel(input_layouts=Replicate())}
    if route == "peft_first":
        model = _peft_model(_mixtral(), _config())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        inner = model.base_model.model
        with pytest.raises(NotImplementedError) as info:
            torch_tp.parallelize_module(inner, tp_mesh(), plan)
        # nothing changed: no parameter distributed, the same values
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        after = model.state_dict()
        assert after.keys() == before.keys()
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    else:
        base = _mixtral()
        torch_tp.parallelize_module(base, tp_mesh(), plan)
        with pytest.raises(NotImplementedError) as info:
            _peft_model(base, _config())
    # the tuner and the module (and, where the plan is checked, the style) by name
    message = str(info.value)
    assert "ParamWrapper" in message and "model.layers.0.mlp.experts" in message, message
    assert route == "plan_first" or "ExpertParallel" in message, message


@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
def test_expert_parallel_refuses_lora_on_expert_weights(route: str) -> None:
    run_distributed(_expert_parallel_refuses, 2, route)


def _linear_weight_refused() -> None:
    """LoRA on a Linear's weight as a parameter (``target_parameters=["...q_proj.weight"]``)
    is PEFT's ParamWrapper too: the linear styles do not host it, and say so by name."""
    config = peft.LoraConfig(
        r=2, target_modules=[], target_parameters=["self_attn.q_proj.weight"],
        init_lora_weights=False,
    )  # fmt: skip
    model = _peft_model(_mixtral(), config)
    inner = model.base_model.model
    with pytest.raises(NotImplementedError) as info:
        torch_tp.parallelize_module(inner, tp_mesh(), plan_for(inner))
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    message = str(info.value)
    assert "ParamWrapper" in message and "ColwiseParallel" in message, message
    assert "model.layers.0.self_attn.q_proj" in message, message


def test_linear_styles_refuse_lora_on_a_weight_parameter() -> None:
    run_distributed(_linear_weight_refused, 2)
