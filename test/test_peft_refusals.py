"""PEFT adapters a tensor-parallel plan cannot host are refused by name, with nothing changed.

torch_tp hosts PEFT's LoRA on ``nn.Linear`` (and transformers' ``Conv1D``) under the linear
styles (``torch_tp.style.adapters``). Everything else PEFT can place on a planned layer is
refused when the plan is applied (``get_peft_model`` first, then ``parallelize_module``),
before anything changes: an embedding LoRA on the row-parallel vocabulary of the Llama plan,
LoRA on a convolution, other tuners (IA3, LoHa, LoKr), a LoRA variant (DoRA), and PEFT's
``modules_to_save`` copy of a planned layer. Each error names the module, PEFT's layer (the
tuner) and what is supported; the model's state dict, parameter types and forwards are as
before. In the other order (``parallelize_module`` first) ``get_peft_model`` is refused by
name on every rank, before PEFT's own set-up meets the sharded weights: DoRA (whose weight
norm would mix DTensors and tensors), an embedding LoRA (which would run unhosted), and
``modules_to_save`` on ``lm_head`` (whose deep copy recursed).
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_llama, tp_mesh
from torch import nn

from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.testing import run_distributed

peft = pytest.importorskip("peft", reason="the adapter tests need peft (pip install -e '.[peft]')")
pytest.importorskip("transformers", reason="the adapter tests need transformers")

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers)

_SUPPORTED = "torch_tp hosts PEFT's LoRA (peft.tuners.lora.Linear) on nn.Linear"


class _ConvNet(nn.Module):
    """A convolution feeding two linear layers: a plan can name the convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).mean(dim=(2, 3))
        return self.down(torch.relu(self.up(h)))


def _config(case: str):
    if case == "embedding":
        return peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])
    if case == "conv":
        return peft.LoraConfig(r=4, target_modules=["conv", "up"])
    if case == "ia3":
        return peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[])
    if case == "loha":
        return peft.LoHaConfig(r=4, target_modules=["q_proj"])
    if case == "lokr":
        return peft.LoKrConfig(r=4, target_modules=["q_proj"])
    if case == "dora":
        return peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], use_dora=True)
    if case == "modules_to_save":
        return peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    raise AssertionError(case)


# what each refusal names: the module's path, PEFT's layer (the tuner), what is supported
_NAMED = {
    "embedding": (
        "'model.embed_tokens.base_layer'",
        "peft.tuners.lora.layer.Embedding",
        "lora_embedding_A is looked up by token id",
        _SUPPORTED,
    ),
    "conv": ("'conv.base_layer'", "peft.tuners.lora.layer.Conv2d", _SUPPORTED),
    "ia3": (
        "'model.layers.0.self_attn.q_proj.base_layer'",
        "the tuner peft.tuners.ia3.layer.Linear, not LoRA",
        _SUPPORTED,
    ),
    "loha": ("'model.layers.0.self_attn.q_proj.base_layer'", "peft.tuners.loha.layer.Linear"),
    "lokr": ("'model.layers.0.self_attn.q_proj.base_layer'", "peft.tuners.lokr.layer.Linear"),
    "dora": (
        "'model.layers.0.self_attn.q_proj.base_layer'",
        "DoraLinearVariant",
        "use_dora=True",
        "Plain LoRA and rsLoRA (use_rslora=True) are supported",
    ),
    "modules_to_save": ("'lm_head'", "ModulesToSaveWrapper", "supports nn.Linear"),
}


def _snapshot(model: nn.Module) -> tuple[dict, dict, dict]:
    """The state dict (cloned), each parameter's type, and which modules have a forward of
    their own instance (a style replaces it)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    types = {name: type(p) for name, p in model.named_parameters()}
    forwards = {name: "forward" in vars(m) for name, m in model.named_modules()}
    return state, types, forwards


def _assert_unchanged(before: tuple[dict, dict, dict], model: nn.Module) -> None:
    state, types, forwards = before
    after_state, after_types, after_forwards = _snapshot(model)
    assert after_types == types  # no parameter became a DTensor
    assert after_forwards == forwards
    assert after_state.keys() == state.keys()
    for key, value in state.items():
        assert type(after_state[key]) is type(value), key
        torch.testing.assert_close(after_state[key], value, rtol=0, atol=0, msg=key)


def _assert_named(messages: list[str], parts: tuple[str, ...]) -> None:
    """Every rank raised the same error, naming each of ``parts``."""
    assert messages[0] == messages[1]
    for part in parts:
        assert part in messages[0], (part, messages[0])


def _refused_when_applied(case: str) -> str:
    """On each rank: the PEFT model of ``case`` parallelized, which must raise; the model is
    left as it was. Returns the message."""
    if case == "conv":
        torch.manual_seed(0)
        model = peft.get_peft_model(_ConvNet(), _config(case))
        base = model.base_model.model
        plan = {"conv": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    else:
        model = peft.get_peft_model(tiny_hf_llama(), _config(case))
        base = model.base_model.model
        plan = plan_for(base)
    before = _snapshot(model)
    with pytest.raises(NotImplementedError) as caught:
        parallelize_module(base, tp_mesh(), plan)
    _assert_unchanged(before, model)
    return str(caught.value)


@pytest.mark.parametrize("case", list(_NAMED))
def test_unhostable_adapters_are_refused_by_name_and_nothing_changes(case):
    _assert_named(run_distributed(_refused_when_applied, 2, case), _NAMED[case])


# order 2: what each refusal from get_peft_model names
_NAMED_AFTER = {
    "dora": (
        "the LoRA layer 'model.layers.0.self_attn.q_proj' wraps a layer parallelized with "
        "ColwiseParallel",
        "DoraLinearVariant",
        "Plain LoRA and rsLoRA (use_rslora=True) are supported",
    ),
    "embedding": ("'model.embed_tokens'", "peft.tuners.lora.layer.Embedding", _SUPPORTED),
    "modules_to_save": ("'lm_head'", "ModulesToSaveWrapper", "modules_to_save"),
}


def _refused_after_the_plan(case: str) -> str:
    """On each rank: the Llama parallelized, then ``get_peft_model``, which must raise by
    name (before PEFT's own set-up meets the sharded weights: DoRA's weight norm,
    ``modules_to_save``'s deep copy). Returns the message."""
    model = tiny_hf_llama()
    parallelize_module(model, tp_mesh(), plan_for(model))
    with pytest.raises(NotImplementedError) as caught:
        peft.get_peft_model(model, _config(case))
    return str(caught.value)


@pytest.mark.parametrize("case", list(_NAMED_AFTER))
def test_unhostable_adapters_added_after_the_plan_are_refused_by_name_on_every_rank(case):
    _assert_named(run_distributed(_refused_after_the_plan, 2, case), _NAMED_AFTER[case])
