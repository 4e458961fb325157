"""torch_tp.plans.auto: a plan inferred from a model's structure.

The inferred plan must lay out every parameter as the ready plan does (the reference Llama,
transformers' Llama, Mistral, Qwen2 and GPT-2, all built on the meta device), train at
single-device parity at TP=2, print as plain data, and refuse what it cannot be sure of.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_tp.plans
from torch_tp import (
    AttentionHeads,
    ColwiseParallel,
    LocalParamsParallel,
    MLAKVAProjParallel,
    PackedColwiseParallel,
    PartialSumParallel,
    ReplicateParallel,
    RowwiseParallel,
    TensorParallelExperts,
)
from torch_tp.models import Llama, tiny_config
from torch_tp.plan import from_dict, planned_placement, resolve_plan, to_dict
from torch_tp.plans.auto import ReplicatedModulesWarning, auto
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import check_parity, run_distributed

# the _Stack test models hold blocks but no forward: auto() says it cannot shape-check their
# plans (UncheckedPlanWarning), which is right and not what these tests are about
pytestmark = pytest.mark.filterwarnings("ignore::torch_tp.plans.auto.UncheckedPlanWarning")

try:
    import transformers
except ImportError:  # the transformers tests are skipped, the others run
    transformers = None

needs_transformers = pytest.mark.skipif(
    transformers is None,
    reason="the Hugging Face model tests need transformers (pip install -e '.[test]')",
)

VOCAB = 256


def _placements(model: nn.Module, plan) -> dict[str, object]:
    """Every parameter path (tied ones under each name) -> the placement the plan gives it."""
    by_path = {entry.path: entry for entry in resolve_plan(model, plan)}
    placements = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, _ in module.named_parameters(recurse=False):
            entry = by_path.get(path)
            full = f"{path}.{name}" if path else name
            placements[full] = None if entry is None else planned_placement(entry, name)
    return placements


# --------------------------------------------------------------------------- the plans


def test_reference_llama_matches_ready_plan():
    with torch.device("meta"):
        model = Llama(tiny_config())
    plan = auto(model, tp_degree=2)
    assert _placements(model, plan) == _placements(model, llama_plan())
    # the head counts come from model.config (the attention module has none)
    assert plan["layers.*.attention"] == AttentionHeads(4, 2)
    assert list(plan)[0] == "tok_embeddings" and list(plan)[-1] == "output"


def _hf_config(family: str):
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[family]
    return config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def _hf_model(family: str) -> nn.Module:
    model_class = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[family]
    return model_class(_hf_config(family))


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_transformers_models_match_ready_plans(family):
    from torch_tp.plans.hf import plan_for

    with torch.device("meta"):
        model = _hf_model(family)
    plan = auto(model, tp_degree=2)
    placements = _placements(model, plan)
    assert placements == _placements(model, plan_for(model))
    assert any(p is not None for p in placements.values())
    if family == "gpt2":
        # the fused q/k/v: GPT2Attention.forward splits it by split_size, made per-rank
        assert plan["transformer.h.*.attn"] == AttentionHeads("num_heads", divide=("split_size",))
        assert plan["transformer.h.*.attn.c_attn"] == PackedColwiseParallel(3)
    else:
        assert plan["model.layers.*.self_attn"] == AttentionHeads(
            "config.num_attention_heads", "config.num_key_value_heads"
        )


@needs_transformers
def test_per_head_norms_sum_their_gradients():
    # Qwen3's q_norm/k_norm normalize each head: they see this rank's heads only
    with torch.device("meta"):
        config = _hf_config("llama").to_dict()
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    plan = auto(model, tp_degree=2)
    assert plan["model.layers.*.self_attn.q_norm"] == ReplicateParallel(sum_gradients=True)
    assert plan["model.layers.*.self_attn.k_norm"] == ReplicateParallel(sum_gradients=True)


def test_plan_is_plain_data():
    with torch.device("meta"):
        model = Llama(tiny_config())
    plan = auto(model)
    data = json.loads(json.dumps(to_dict(plan)))
    assert from_dict(data) == plan
    # torch_tp.plans.auto is the package, called as its function; its modules stay reachable
    assert torch_tp.plans.auto(model) == plan and torch_tp.plans.auto.infer.auto is auto
    assert data["layers.*.attention.wo"] == "rowwise"
    assert data["output"] == "colwise_gather_output"


@needs_transformers
def test_gpt2_plan_is_plain_data():
    with torch.device("meta"):
        model = _hf_model("gpt2")
    plan = auto(model)
    data = json.loads(json.dumps(to_dict(plan)))
    assert from_dict(data) == plan
    assert data["transformer.h.*.attn.c_attn"] == {"style": "PackedColwiseParallel", "parts": 3}


# --------------------------------------------------------------------------- parity at TP=2


def _reference_llama_parity() -> None:
    mesh = tp_mesh()
    torch.manual_seed(0)
    model = Llama(tiny_config(vocab_size=1001, max_seq_len=16))
    tokens = torch.randint(0, 1001, (2, 8))
    targets = torch.randint(0, 1001, (2, 8))
    tp, _ = check_parity(
        model,
        mesh,
        auto(model, tp_degree=mesh.size()),
        (tokens,),
        loss_fn=lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5),
        rtol=1e-5,
        atol=1e-5,
    )
    assert isinstance(tp.layers[0].attention.wq.weight, DTensor)


def test_reference_llama_parity():
    run_distributed(_reference_llama_parity, 2)


def _gpt2_parity() -> None:
    mesh = tp_mesh()
    torch.manual_seed(0)
    model = _hf_model("gpt2").float()
    with torch.no_grad():  # GPT-2 zeroes biases and sets norm weights to one: randomize
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
            elif ".ln_" in name:
                param.uniform_(0.5, 1.5)
    ids = torch.randint(0, VOCAB, (2, 12))
    tp, _ = check_parity(
        model,
        mesh,
        auto(model, tp_degree=mesh.size()),
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
        loss_fn=lambda out: out.loss,
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.05),
    )
    attention = tp.transformer.h[0].attn
    assert attention.split_size == 64 // mesh.size()
    assert tp.lm_head.weight is tp.transformer.wte.weight  # still tied


@needs_transformers
def test_gpt2_parity():
    run_distributed(_gpt2_parity, 2)


# --------------------------------------------------------------------------- refusals


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, down_in: int | None = None) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden if down_in is None else down_in, dim)


class _Stack(nn.Module):
    def __init__(self, *blocks: nn.Module, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, 32)


def test_refuses_model_without_repeated_blocks():
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32), nn.Linear(32, 8))
    with pytest.raises(ValueError, match=r"no repeated blocks in Sequential"):
        auto(model)


def test_blocks_that_differ_are_planned_kind_by_kind():
    # alike styles over blocks of different sizes: one '*' key each
    plan = auto(_Stack(_MLP(8, 16), _MLP(8, 24)), tp_degree=2)
    assert plan["layers.*.up"] == ColwiseParallel() and plan["layers.*.down"] == RowwiseParallel()
    # a size that divides in one kind only: refused naming that kind's first block
    with pytest.raises(ValueError, match=r"'layers.1.up': 12 output features do not divide"):
        auto(_Stack(_MLP(8, 16), _MLP(8, 12)), tp_degree=8)


def test_refuses_shapes_that_do_not_chain():
    # up writes 24 features, down reads 16
    model = _Stack(_MLP(8, 24, down_in=16), _MLP(8, 24, down_in=16))
    with pytest.raises(
        ValueError,
        match=r"shapes in the block 'layers.\*' do not chain: the row-parallel down reads 16",
    ):
        auto(model)


def test_refuses_heads_that_do_not_divide():
    with torch.device("meta"):
        model = Llama(tiny_config(n_heads=4, n_kv_heads=2))
    auto(model, tp_degree=2)
    with pytest.raises(
        ValueError, match=r"'layers.\*.attention': 2 key/value heads do not divide by tp_degree 4"
    ):
        auto(model, tp_degree=4)
    with pytest.raises(
        ValueError, match=r"'layers.\*.attention': 4 query heads do not divide by tp_degree 3"
    ):
        auto(model, tp_degree=3)


def test_refuses_features_that_do_not_divide():
    model = _Stack(_MLP(8, 12), _MLP(8, 12))
    assert auto(model, tp_degree=2)["layers.*.up"] == ColwiseParallel()
    with pytest.raises(
        ValueError, match=r"'layers.\*.up': 12 output features do not divide by tp_degree 8"
    ):
        auto(model, tp_degree=8)


class _FusedAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


def test_refuses_fused_attention_without_head_count():
    model = _Stack(_FusedAttention(8), _FusedAttention(8))
    with pytest.raises(
        ValueError, match=r"the block 'layers.\*' has a fused q/k/v projection .*no head count"
    ):
        auto(model)


def test_refuses_fused_attention_without_source():
    # a class defined from a string has no source to read its forward's attributes from
    namespace: dict = {"nn": nn}
    exec(
        "class Attention(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.n_heads = 2\n"
        "        self.qkv = nn.Linear(8, 24)\n"
        "        self.out = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.out(self.qkv(x).split(8, -1)[0])\n",
        namespace,
    )
    model = _Stack(namespace["Attention"](), namespace["Attention"]())
    with pytest.raises(ValueError, match=r"the block 'layers.\*' .*source is unavailable"):
        auto(model)


class _WindowAttention(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.n_heads = 2
        self.window = dim  # equal to the query width by chance: a size, or not?
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x)[..., -self.window :] + self.k(x) + self.v(x))


def test_refuses_ambiguous_attribute():
    model = _Stack(_WindowAttention(), _WindowAttention(), dim=16)
    with pytest.raises(
        ValueError,
        match=r"the block 'layers.\*': forward reads self.window = 16, which equals the width "
        r"of the query heads; auto\(\) cannot tell",
    ):
        auto(model)


class _Gated(_MLP):
    def __init__(self) -> None:
        super().__init__(8, 16)
        self.mix = nn.Parameter(torch.ones(8, 8))  # a 2-D parameter auto() knows nothing of


def test_refuses_unknown_parameters():
    with pytest.raises(ValueError, match=r"'layers.\*' \(_Gated\) holds parameters .*mix \[8, 8\]"):
        auto(_Stack(_Gated(), _Gated()))


@needs_transformers
def test_refuses_fused_qkv_interleaved_per_head():
    # GPT-NeoX reshapes its fused projection to (..., heads, 3 * head_size): not [q | k | v]
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(
            transformers.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
            )
        )
    with pytest.raises(
        ValueError,
        match=r"'gpt_neox.layers.\*.attention': cannot tell how forward splits the fused "
        r"'gpt_neox.layers.\*.attention.query_key_value'",
    ):
        auto(model)


# --------------------------------------------------------------------------- the zoo's kinds


def _zoo_model(model_type: str, **fields) -> nn.Module:
    """The tiny model test_zoo.py builds for ``model_type``, on the meta device."""
    from test_zoo import _meta_model

    return _meta_model(model_type, **fields)


@needs_transformers
def test_mixture_of_experts_with_a_dense_layer():
    # Qwen3-MoE, layer 0 dense: the dense MLP's keys name layer 0's only, with '*'
    model = _zoo_model("qwen3_moe")
    plan = auto(model, tp_degree=2)
    assert plan["model.layers.*.mlp.gate_proj"] == ColwiseParallel()
    assert plan["model.layers.*.mlp.down_proj"] == RowwiseParallel()
    assert plan["model.layers.*.mlp.experts"] == TensorParallelExperts()
    assert not any("mlp.gate" == k.rpartition("layers.*.")[2] for k in plan)  # router: whole
    # every parameter of the experts sharded, the router's replicated
    placements = _placements(model, plan)
    assert placements["model.layers.1.mlp.experts.gate_up_proj"] is not None
    assert placements["model.layers.1.mlp.gate.weight"] is None
    assert placements["model.layers.0.mlp.gate_proj.weight"] == Shard(0)
    # shared experts: planned as MLPs inside the mixture of experts (DeepSeek-V3)
    plan = auto(_zoo_model("deepseek_v3"), tp_degree=2)
    assert plan["model.layers.*.mlp.shared_experts.gate_proj"] == ColwiseParallel()
    assert plan["model.layers.*.mlp.shared_experts.down_proj"] == RowwiseParallel()
    # the experts' hidden size must divide
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts': the experts' hidden"):
        auto(_zoo_model("qwen3_moe", moe_intermediate_size=6, num_key_value_heads=4), tp_degree=4)


class _Experts(nn.Module):
    def __init__(self, gate_up: tuple, down: tuple) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(gate_up))
        self.down_proj = nn.Parameter(torch.zeros(down))


class _MoE(nn.Module):
    def __init__(self, gate_up: tuple = (4, 32, 8), down: tuple = (4, 8, 16)) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = _Experts(gate_up, down)


class _MoEBlock(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.mlp = _MLP(8, 16)
        self.moe = moe


def test_stacked_experts():
    plan = auto(_Stack(_MoEBlock(_MoE()), _MoEBlock(_MoE())), tp_degree=2)
    assert plan["layers.*.moe.experts"] == TensorParallelExperts()
    assert "layers.*.moe.router" not in plan
    # shapes that are not SwiGLU experts: refused
    bad = _MoE(gate_up=(4, 24, 8))
    with pytest.raises(ValueError, match=r"'layers.\*.moe.experts' \(_Experts: gate_up_proj"):
        auto(_Stack(_MoEBlock(bad), _MoEBlock(bad)))


class _Ungated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(4, 16, 8))  # [E, I, H]
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 16))  # [E, H, I]


class _SharedStacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(2, 16, 8))  # [n, I, H]
        self.up_proj = nn.Parameter(torch.zeros(2, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(2, 8, 16))  # [n, H, I]
        self.act = nn.SiLU()


def test_ungated_experts_and_stacked_shared_experts():
    # Nemotron-H's ungated experts; Inkling's shared experts stacked beside the routed ones:
    # one partial sum, their parameters sharded on the hidden dimension
    moe = _MoE()
    moe.experts = _Ungated()
    moe.shared_experts = _SharedStacked()
    plan = auto(_Stack(_MoEBlock(moe), _MoEBlock(copy.deepcopy(moe))), tp_degree=2)
    assert plan["layers.*.moe.experts"] == TensorParallelExperts()
    assert plan["layers.*.moe.shared_experts"] == PartialSumParallel(
        {"gate_proj": Shard(1), "up_proj": Shard(1), "down_proj": Shard(2)}
    )
    # other stacked parameters beside the experts are still refused
    moe.shared_experts.down_proj = nn.Parameter(torch.zeros(2, 16, 16))
    with pytest.raises(
        ValueError, match=r"'layers.\*.moe.shared_experts' \(_SharedStacked\) holds"
    ):
        auto(_Stack(_MoEBlock(moe), _MoEBlock(copy.deepcopy(moe))), tp_degree=2)


class _GatedAttention(nn.Module):
    """An attention whose output is gated, per feature (``gate_proj``) or per head
    (``g_proj``), the gate registered after the output projection (AFMoE, Laguna)."""

    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = 4, 2
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(8, 8)
        self.o_proj = nn.Linear(16, 8)
        if per_head:
            self.g_proj = nn.Linear(8, 4)
        else:
            self.gate_proj = nn.Linear(8, 16)


class _GatedBlock(nn.Module):
    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.self_attn = _GatedAttention(per_head)
        self.mlp = _MLP(8, 16)


@pytest.mark.parametrize("per_head", [False, True])
def test_attention_output_gates_shard_with_the_heads(per_head):
    plan = auto(_Stack(_GatedBlock(per_head), _GatedBlock(per_head)), tp_degree=2)
    gate = "g_proj" if per_head else "gate_proj"
    assert plan[f"layers.*.self_attn.{gate}"] == ColwiseParallel()
    assert plan["layers.*.self_attn.o_proj"] == RowwiseParallel()
    assert plan["layers.*.self_attn.q_proj"] == ColwiseParallel()


@needs_transformers
def test_hybrid_blocks_leave_mixers_replicated():
    # Qwen3-Next: a gated delta net (linear attention) then softmax attention with a gated
    # query; the mixer is left whole, with a warning naming it
    model = _zoo_model("qwen3_next")
    with pytest.warns(ReplicatedModulesWarning, match=r"'model.layers.\*.linear_attn'") as got:
        plan = auto(model, tp_degree=2)
    assert got[0].message.modules == ("model.layers.*.linear_attn",)
    assert not any(".linear_attn" in key for key in plan)
    assert plan["model.layers.*.self_attn.q_proj"] == ColwiseParallel()
    assert plan["model.layers.*.self_attn.q_norm"] == ReplicateParallel(sum_gradients=True)
    assert isinstance(plan["model.layers.*.self_attn"], AttentionHeads)


@needs_transformers
def test_norm_over_all_heads_keeps_attention_whole():
    # OLMo-2's q_norm/k_norm normalize the whole projection: the attention runs with every
    # head on every rank, its projections' weights sharded (transformers' plan does this)
    plan = auto(_zoo_model("olmo2"), tp_degree=2)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert plan[f"model.layers.*.self_attn.{name}"] == ColwiseParallel(
            output_layouts=Replicate()
        )
    assert plan["model.layers.*.self_attn.o_proj"] == RowwiseParallel(input_layouts=Replicate())
    assert "model.layers.*.self_attn" not in plan and "model.layers.*.self_attn.q_norm" not in plan


@needs_transformers
def test_attention_sinks_shard_with_the_heads():
    plan = auto(_zoo_model("granite_swa"), tp_degree=2)
    assert plan["model.layers.*.self_attn"] == LocalParamsParallel({"sinks": Shard(0)})
    # MiMo-V2-Flash: sinks in one kind of layer only
    plan = auto(_zoo_model("mimo_v2_flash"), tp_degree=2)
    assert plan["model.layers.1.self_attn"] == LocalParamsParallel({"sinks": Shard(0)})
    assert isinstance(plan["model.layers.0.self_attn"], AttentionHeads)


@needs_transformers
def test_multi_head_latent_attention():
    plan = auto(_zoo_model("deepseek_v3"), tp_degree=2)
    attention = "model.layers.*.self_attn"
    assert plan[f"{attention}.kv_a_proj_with_mqa"] == MLAKVAProjParallel(4)
    assert plan[f"{attention}.q_b_proj"] == ColwiseParallel()
    assert plan[f"{attention}.kv_b_proj"] == ColwiseParallel()
    assert plan[f"{attention}.o_proj"] == RowwiseParallel()
    assert f"{attention}.q_a_proj" not in plan  # whole: its output feeds a norm
    assert f"{attention}.kv_a_layernorm" not in plan
    # MiniCPM3 too
    plan = auto(_zoo_model("minicpm3"), tp_degree=2)
    assert plan[f"{attention}.kv_a_proj_with_mqa"] == MLAKVAProjParallel(4)


@needs_transformers
def test_learned_activation_sums_its_gradient():
    # Apertus's xIELU activation has single-value parameters, applied to this rank's slice
    plan = auto(_zoo_model("apertus"), tp_degree=2)
    assert plan["model.layers.*.mlp.act_fn"] == ReplicateParallel(sum_gradients=True)


class _SinkAttention(nn.Module):
    def __init__(self, sinks: int) -> None:
        super().__init__()
        self.n_heads = 2
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.sinks = nn.Parameter(torch.zeros(sinks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) + self.k(x) + self.v(x))


class _SinkBlock(nn.Module):
    def __init__(self, sinks: int) -> None:
        super().__init__()
        self.attn = _SinkAttention(sinks)
        self.mlp = _MLP(8, 16)


def test_refuses_attention_parameters_other_than_sinks():
    plan = auto(_Stack(_SinkBlock(2), _SinkBlock(2)), tp_degree=2)
    assert plan["layers.*.attn"] == LocalParamsParallel({"sinks": Shard(0)})
    with pytest.raises(ValueError, match=r"holds parameters of its own \(sinks \[3\]\)"):
        auto(_Stack(_SinkBlock(3), _SinkBlock(3)))


@needs_transformers
@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_next",  # a linear-attention mixer left whole, MoE with a shared expert, gated q
        "olmo2",  # q/k norms over all heads: attention computed whole
        "deepseek_v3",  # multi-head latent attention, a dense layer then MoE
        "granite_swa",  # attention sinks
        "apertus",  # a learned activation inside the MLP
    ],
)
def test_new_capabilities_parity(model_type):
    # test_zoo's parity check (logits, loss, every gradient, greedy generate) at TP=2, with
    # auto()'s plan
    from test_zoo_auto import _check

    result = run_distributed(_check, 2, model_type, timeout=120.0)[0]
    assert result["status"] == "pass", result
