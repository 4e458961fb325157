"""Style names in plans, and plans as plain data (``to_dict`` / ``from_dict``).

The names are those of Hugging Face transformers' ``tp_plan``; a plan copied verbatim from a
transformers config is checked at single-device parity on a small model laid out like
transformers' Llama.
"""

from __future__ import annotations

import functools
import json

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import tp_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp import (
    ColwiseParallel,
    LocalLinearParallel,
    LocalParamsParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ParallelStyle,
    PartialSumParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
)
from torch_tp._names import UNSUPPORTED_NAMES, describe
from torch_tp.models import Llama, tiny_config
from torch_tp.plan import from_dict, resolve_plan, to_dict
from torch_tp.plans.llama import llama_plan
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.testing import check_parity, run_distributed

# plan name -> a factory of the built-in style it stands for (other test files register
# styles of their own)
STYLE_NAMES = {
    name: functools.partial(STYLE_REGISTRY.style, name)
    for name in STYLE_REGISTRY.names()
    if type(STYLE_REGISTRY.style(name)).__module__.startswith("torch_tp.style.")
}

# The names transformers' Llama config and model use, exactly as there.
HF_LLAMA_BASE_MODEL_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
HF_LLAMA_TP_PLAN = {"lm_head": "colwise_gather_output"}


class NameTableTest(expecttest.TestCase):
    def test_every_name_and_its_style(self):
        table = "\n".join(f"{name:22} {describe(f())}" for name, f in STYLE_NAMES.items())
        self.assertExpectedInline(
            table,
            """\
colwise                "colwise"
colwise_gather_output  "colwise_gather_output"
colwise_rep            "colwise_gather_output"
embedding_colwise      "colwise_gather_output"
rowwise                "rowwise"
rowwise_split_input    "rowwise_split_input"
rowwise_rep            "rowwise_split_input"
embedding_rowwise      "rowwise_split_input"
packed_colwise         "packed_colwise"
packed_rowwise         "packed_rowwise"
sequence_parallel      "sequence_parallel"
replicate              "replicate"
replicated_with_grad_allreduce "replicated_with_grad_allreduce"
ep_router              "replicate"
moe_tp_experts         "moe_tp_experts"
ep_dispatch_experts    "ep_dispatch_experts"
grouped_gemm           "ep_dispatch_experts"
moe_identity_expert    "moe_identity_expert"
ep_tp_experts          "ep_tp_experts"
mla_kv_a_proj          "mla_kv_a_proj"
local_params           "local_params"
local                  "local_params"
local_colwise          "local_colwise"
local_rowwise          "local_rowwise"
local_packed_rowwise   "local_packed_rowwise"
all_reduce             "all_reduce"
gather                 "all_reduce"
context_parallel       "context_parallel\"""",
        )
        # and what those styles are, spelled out
        assert STYLE_NAMES["colwise"]() == ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True
        )
        assert STYLE_NAMES["rowwise"]() == RowwiseParallel(
            input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=True
        )
        assert STYLE_NAMES["colwise_rep"]() == ColwiseParallel(output_layouts=Replicate())
        assert STYLE_NAMES["embedding_rowwise"]() == RowwiseParallel(input_layouts=Replicate())
        assert STYLE_NAMES["sequence_parallel"]() == SequenceParallel(
            sequence_dim=1, use_local_output=True
        )
        assert STYLE_NAMES["all_reduce"]() == STYLE_NAMES["gather"]() == PartialSumParallel()
        assert STYLE_NAMES["local"]() == LocalParamsParallel()
        assert STYLE_NAMES["local_colwise"]() == LocalLinearParallel("colwise")
        assert STYLE_NAMES["local_rowwise"]() == LocalLinearParallel("rowwise")
        assert STYLE_NAMES["local_packed_rowwise"]() == LocalLinearParallel("packed_rowwise")
        assert STYLE_NAMES["packed_colwise"]() == PackedColwiseParallel(2)
        assert STYLE_NAMES["packed_rowwise"]() == PackedRowwiseParallel(2)
        assert STYLE_NAMES["replicate"]() == ReplicateParallel(sum_gradients=False)
        assert STYLE_NAMES["replicated_with_grad_allreduce"]() == ReplicateParallel(
            sum_gradients=True
        )

    def test_known_and_unsupported_names_do_not_overlap(self):
        assert not set(STYLE_NAMES) & set(UNSUPPORTED_NAMES)


def _llama():
    return Llama(tiny_config())


def test_plan_values_may_be_names():
    plan = {"layers.*.attention.wq": "colwise", "output": "colwise_gather_output"}
    entries = resolve_plan(_llama(), plan)
    assert [e.style for e in entries] == [ColwiseParallel()] * 2 + [
        ColwiseParallel(output_layouts=Replicate())
    ]
    # one fresh style per key (styles are mutable: parallelize_module sets src_data_rank)
    assert entries[0].style is entries[1].style
    assert entries[0].style is not resolve_plan(_llama(), plan)[0].style
    assert isinstance(entries[0].style, ParallelStyle)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        resolve_plan(_llama(), {"layers.*.attention.wq": "colwsie"})
    message = str(info.value)
    assert "plan key 'layers.*.attention.wq'" in message
    assert "'colwsie'" in message and "did you mean 'colwise'?" in message
    for name in STYLE_NAMES:
        assert name in message
    with pytest.raises(ValueError, match="unknown style name 'shard_it'; valid names: colwise"):
        resolve_plan(_llama(), {"output": "shard_it"})


def test_names_that_need_a_new_style_raise_not_implemented(monkeypatch):
    # every name transformers uses has a style today: the mechanism, with a made-up one
    assert not UNSUPPORTED_NAMES
    monkeypatch.setitem(UNSUPPORTED_NAMES, "ring_attention", "needs a ring of key/value blocks")
    with pytest.raises(NotImplementedError) as info:
        resolve_plan(_llama(), {"layers.*.feed_forward.w1": "ring_attention"})
    message = str(info.value)
    assert "plan key 'layers.*.feed_forward.w1': style name 'ring_attention' is not supported" in (
        message
    )
    assert "needs a ring of key/value blocks" in message
    with pytest.raises(NotImplementedError, match="'ring_attention' is not supported"):
        from_dict({"a": "ring_attention"})


def test_a_non_style_value_is_still_a_type_error():
    with pytest.raises(TypeError, match="plan key 'output'"):
        resolve_plan(_llama(), {"output": 3})


# --------------------------------------------------------------------------- plans as data


class ToDictTest(expecttest.TestCase):
    def test_llama_plan_as_json(self):
        data = to_dict(llama_plan(sequence_parallel=True))
        text = "\n".join(f"{key}: {json.dumps(value)}" for key, value in data.items())
        self.assertExpectedInline(
            text,
            """\
: {"style": "AttentionHeads", "num_heads": "config.n_heads", "num_kv_heads": "config.kv_heads"}
tok_embeddings: {"style": "RowwiseParallel", "input_layouts": "Replicate()", "output_layouts": "Shard(1)"}
layers.*.attention: {"style": "PrepareModuleInput", "input_layouts": ["Shard(1)", null], "desired_input_layouts": ["Replicate()", null]}
layers.*.attention.wq: "colwise"
layers.*.attention.wk: "colwise"
layers.*.attention.wv: "colwise"
layers.*.attention.wo: {"style": "RowwiseParallel", "output_layouts": "Shard(1)"}
layers.*.feed_forward: {"style": "PrepareModuleInput", "input_layouts": ["Shard(1)"], "desired_input_layouts": ["Replicate()"]}
layers.*.feed_forward.w1: "colwise"
layers.*.feed_forward.w2: {"style": "RowwiseParallel", "output_layouts": "Shard(1)"}
layers.*.feed_forward.w3: "colwise"
output: {"style": "ColwiseParallel", "input_layouts": "Shard(1)", "output_layouts": "Replicate()"}
layers.*.attention_norm: "sequence_parallel"
layers.*.attention_dropout: "sequence_parallel"
layers.*.ffn_norm: "sequence_parallel"
layers.*.ffn_dropout: "sequence_parallel"
norm: "sequence_parallel\"""",  # noqa: E501
        )


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("loss_parallel", [False, True])
def test_llama_plans_round_trip_through_json(sequence_parallel, loss_parallel):
    plan = llama_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    data = json.loads(json.dumps(to_dict(plan)))
    assert from_dict(data) == plan


STYLES = [
    ColwiseParallel(),
    ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
    RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    SequenceParallel(),
    SequenceParallel(sequence_dim=0, use_local_output=True),
    PrepareModuleInput(),
    PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
    PrepareModuleInput(
        input_layouts=(Shard(1), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"mask": Shard(1)},
        desired_input_kwarg_layouts={"mask": Replicate()},
        use_local_output=True,
    ),
    PrepareModuleInput(input_kwarg_layouts={}, desired_input_kwarg_layouts={}),
    PrepareModuleOutput(
        output_layouts=(Partial("avg"), None), desired_output_layouts=(Shard(2), None)
    ),
    PrepareModuleInputOutput(
        input_layouts=Shard(1),
        desired_input_layouts=Replicate(),
        use_local_input=True,
        output_layouts=Partial(),
        desired_output_layouts=Replicate(),
        use_local_output=False,
    ),
]


@pytest.mark.parametrize("style", STYLES, ids=repr)
def test_every_style_round_trips_through_json(style):
    data = json.loads(json.dumps(to_dict({"m": style})))
    assert from_dict(data) == {"m": style}
    assert repr(from_dict(data)["m"]) == repr(style)


def test_to_dict_of_a_single_style_and_of_names():
    assert to_dict(ColwiseParallel()) == {"": "colwise"}
    # names are checked and written under the canonical name of their style
    assert to_dict({"lm_head": "colwise_rep", "embed": "embedding_rowwise"}) == {
        "lm_head": "colwise_gather_output",
        "embed": "rowwise_split_input",
    }
    assert to_dict({"m": SequenceParallel(sequence_dim=0)}) == {
        "m": {"style": "SequenceParallel", "sequence_dim": 0}
    }
    with pytest.raises(ValueError, match="plan key 'm'"):
        to_dict({"m": "nope"})


class _MyStyle(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


class _MyColwise(ColwiseParallel):
    pass


def test_user_styles_have_no_data_form():
    with pytest.raises(TypeError, match="plan key 'x': .*registered styles"):
        to_dict({"x": _MyStyle()})
    with pytest.raises(TypeError, match="plan key 'x'"):
        to_dict({"x": _MyColwise(output_layouts=Shard(0))})


def test_from_dict_errors_name_the_key():
    with pytest.raises(ValueError, match="plan key 'a': unknown style class 'Colwise'"):
        from_dict({"a": {"style": "Colwise"}})
    with pytest.raises(ValueError, match="cannot read 'S\\(1\\)' as a placement"):
        from_dict({"a": {"style": "ColwiseParallel", "input_layouts": "S(1)"}})
    with pytest.raises(TypeError, match="plan key 'a': cannot build ColwiseParallel"):
        from_dict({"a": {"style": "ColwiseParallel", "sequence_dim": 1}})
    with pytest.raises(TypeError, match="plan key 'a': expected a style name or a dict"):
        from_dict({"a": 3})


# --------------------------------------------------------------------------- transformers


class HFAttention(nn.Module):
    """Attention with transformers' Llama module names and shape conventions."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)  # heads read from tensors
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1))


class HFMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFDecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = HFAttention(hidden, heads, kv_heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = HFMLP(hidden, intermediate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class HFModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            HFDecoderLayer(hidden, heads, kv_heads, 3 * hidden) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class HFForCausalLM(nn.Module):
    """The base model under ``model``, as transformers nests it, and ``lm_head``."""

    def __init__(self, vocab=1001, hidden=64, layers=2, heads=4, kv_heads=2) -> None:
        super().__init__()
        self.model = HFModel(vocab, hidden, layers, heads, kv_heads)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def hf_llama_plan() -> dict[str, str]:
    """The transformers plans of a Llama causal LM, verbatim, with the base model's keys
    under ``model.`` (as transformers itself prefixes them)."""
    plan = {f"model.{key}": value for key, value in HF_LLAMA_BASE_MODEL_TP_PLAN.items()}
    return {**plan, **HF_LLAMA_TP_PLAN}


def _hf_plan_parity() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    model = HFForCausalLM()
    ids = torch.randint(0, 1001, (2, 8))
    labels = torch.randint(0, 1001, (2, 8))
    tp, _ = check_parity(
        model,
        mesh,
        hf_llama_plan(),
        (ids,),
        loss_fn=lambda logits: F.cross_entropy(logits.flatten(0, 1), labels.flatten()),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        steps=2,
        rtol=1e-4,
        atol=1e-4,
    )
    attention = tp.model.layers[0].self_attn
    assert isinstance(attention.q_proj.weight, DTensor)
    assert attention.q_proj.weight.placements == (Shard(0),)
    assert attention.o_proj.weight.placements == (Shard(1),)
    assert tp.lm_head.weight.placements == (Shard(0),)


def test_transformers_plan_verbatim_matches_single_device():
    run_distributed(_hf_plan_parity, 2)
