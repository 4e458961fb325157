"""Gradient agreement: a replicated parameter that computes on a shard of the data must have
its gradient summed over the ranks, or each rank trains on its own partial gradient.

Under dispatch expert parallelism (``ExpertParallel()``, each rank's own tokens, with sequence
parallelism) the router sees this rank's tokens only: ``moe_llama_plan`` plans it
``ReplicateParallel(sum_gradients=True)``. A hand-written plan that writes
``ReplicateParallel()`` instead is refused by ``parallelize_module`` before anything changes,
and reported by ``plan_report``; so is the same mistake on another module that computes on the
dispatched tokens (a shared expert's gate), while plans whose replicated modules see whole
activations are accepted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import tp_mesh
from torch.distributed.tensor import DTensor, Shard

from torch_tp import (
    ColwiseParallel,
    ExpertParallel,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.models import Experts, MoEConfig, MoELlama
from torch_tp.plan import resolve_plan
from torch_tp.plan_checks import unsummed_gradients
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.report import plan_report
from torch_tp.testing import run_distributed

CONFIG = MoEConfig(
    dim=16, n_layers=2, n_heads=2, n_kv_heads=2, n_experts=4, top_k=2, expert_hidden_dim=8
)


def _wrong_router_plan() -> dict:
    plan = moe_llama_plan(experts="ep", sequence_parallel=True)
    plan["layers.*.feed_forward.router"] = ReplicateParallel()  # should be sum_gradients=True
    return plan


class SparseMoeBlock(nn.Module):
    """A mixture of experts written the way transformers' Qwen2-MoE writes one: a norm, a
    router ``gate`` that is a plain ``nn.Linear``, stacked experts, and a shared expert (an
    MLP, replicated whole here) whose output a one-logit ``shared_expert_gate`` scales; on
    ``[batch, seq, dim]``."""

    def __init__(self, dim: int = 16, n_experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, 8)
        self.shared_expert = nn.Sequential(nn.Linear(dim, 8), nn.SiLU(), nn.Linear(8, dim))
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(x).flatten(0, 1)
        weights, index = self.gate(tokens).softmax(-1).topk(2, dim=-1)
        out = self.experts(tokens, index, weights)
        shared = torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return (out + shared).view_as(x)


# each rank its sequence shard; the shared expert's gate replicated, its gradient not summed
SPARSE_MOE_PLAN = {
    "norm": SequenceParallel(use_local_output=True),
    "gate": "replicated_with_grad_allreduce",
    "experts": ExpertParallel(),
    "shared_expert": "replicated_with_grad_allreduce",
    "shared_expert_gate": "replicate",
}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert not any(hasattr(m, "_torch_tp_style") for m in model.modules())


def _refusals() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    model = MoELlama(CONFIG)
    before = _state(model)
    with pytest.raises(ValueError) as raised:
        parallelize_module(model, mesh, _wrong_router_plan())
    message = str(raised.value)
    for part in (
        "cannot apply ReplicateParallel(sum_gradients=False) on 'layers.0.feed_forward.router'",
        "parameter 'layers.0.feed_forward.router.weight' without summing its gradient",
        "ExpertParallel(input_layouts=Shard(dim=0)) on 'layers.0.feed_forward.experts'",
        "Plan it ReplicateParallel(sum_gradients=True) ('replicated_with_grad_allreduce')",
    ):
        assert part in message, message
    _assert_unchanged(model, before)
    # the plan that sums the router's gradients is accepted (its parity: test_moe.py)
    parallelize_module(model, mesh, moe_llama_plan(experts="ep", sequence_parallel=True))

    # the same mistake on another module computing on the dispatched tokens
    block = SparseMoeBlock()
    before = _state(block)
    with pytest.raises(ValueError, match=r"'shared_expert_gate.weight' without summing") as raised:
        parallelize_module(block, mesh, SPARSE_MOE_PLAN)
    assert "Plan it ReplicateParallel(sum_gradients=True)" in str(raised.value)
    _assert_unchanged(block, before)
    parallelize_module(
        block, mesh, {**SPARSE_MOE_PLAN, "shared_expert_gate": "replicated_with_grad_allreduce"}
    )


def test_replicated_parameters_on_dispatched_tokens_are_refused():
    run_distributed(_refusals, 2)


def _router_gradient(plan: dict, strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's gradient of layer 0 after one step, this rank's and one device's."""
    torch.manual_seed(0)
    model = MoELlama(CONFIG).double()
    reference = MoELlama(CONFIG).double()
    reference.load_state_dict(model.state_dict())
    parallelize_module(model, tp_mesh(), plan, strict=strict)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    model(tokens).pow(2).mean().backward()
    reference(tokens).pow(2).mean().backward()
    grad = model.layers[0].feed_forward.router.weight.grad
    return grad.to_local(), reference.layers[0].feed_forward.router.weight.grad


def _the_refusal_was_real() -> None:
    with pytest.warns(UserWarning, match="strict=False: applied as planned"):
        mine, one_device = _router_gradient(_wrong_router_plan(), strict=False)
    # this rank's tokens only: a partial gradient, different on each rank
    assert not torch.allclose(mine, one_device)
    others = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(others, mine)
    assert not torch.equal(others[0], others[1])
    # summed, it is one device's
    mine, one_device = _router_gradient(moe_llama_plan(experts="ep", sequence_parallel=True), True)
    torch.testing.assert_close(mine, one_device)


def test_the_refused_router_trains_on_partial_gradients():
    run_distributed(_the_refusal_was_real, 2)


# --------------------------------------------------------------------------- the report


def _errors(report) -> list[tuple[str, str]]:
    return [(p.where, p.message) for p in report.problems if p.severity == "error"]


def test_the_report_finds_the_router_computing_on_dispatched_tokens():
    with torch.device("meta"):
        model = MoELlama(CONFIG)
    errors = _errors(plan_report(model, _wrong_router_plan(), 2, batch_size=2, seq_len=8))
    assert errors == [
        (
            "layers.*.feed_forward.router.weight",
            'the replicated parameter layers.*.feed_forward.router.weight, which "replicate" '
            "on layers.*.feed_forward.router replicates without summing its gradient, computes "
            "(linear) with a local tensor laid out Shard(1) (from layers.*.ffn_norm): each "
            "rank's gradient of it would cover that shard only, and the ranks would train on "
            "different, partial gradients. Plan it ReplicateParallel(sum_gradients=True) "
            "('replicated_with_grad_allreduce'), which sums them at the end of backward",
        )
    ]
    plan = moe_llama_plan(experts="ep", sequence_parallel=True, shared_expert=True)
    with torch.device("meta"):
        model = MoELlama(dataclasses.replace(CONFIG, shared_expert_hidden_dim=8))
    assert not _errors(plan_report(model, plan, 2, batch_size=2, seq_len=8))


def _sparse_moe_report(plan: dict):
    with torch.device("meta"):
        block = SparseMoeBlock()
    return plan_report(
        block,
        plan,
        2,
        batch_size=2,
        seq_len=8,
        example_inputs=lambda b, s: torch.empty(b, s, 16),
        input_layout=Shard(1),
    )


def test_the_report_finds_a_shared_expert_gate_computing_on_dispatched_tokens():
    errors = _errors(_sparse_moe_report(SPARSE_MOE_PLAN))
    assert [where for where, _ in errors] == ["shared_expert_gate.weight"]
    assert "Plan it ReplicateParallel(sum_gradients=True)" in errors[0][1]
    fixed = {**SPARSE_MOE_PLAN, "shared_expert_gate": "replicated_with_grad_allreduce"}
    assert not _errors(_sparse_moe_report(fixed))


class GatedAttention(nn.Module):
    """A gate on the whole input and a per-head norm on column-parallel queries, between a
    column- and a row-parallel projection."""

    def __init__(self, dim: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm(head_dim)
        self.o_proj = nn.Linear(dim, dim)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x * torch.sigmoid(self.gate(x)))
        q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return self.o_proj(q)


def test_only_replicated_modules_on_shards_are_refused():
    """A replicated module on the whole input (the gate) beside a column- and row-parallel pair
    is accepted; one on the column-parallel output's heads (q_norm) is refused by the report,
    which follows the tensors (the plan-level check cannot see which activation it gets)."""
    with torch.device("meta"):
        model = GatedAttention()
    plan = {
        "gate": "replicate",
        "q_proj": ColwiseParallel(),
        "q_norm": "replicated_with_grad_allreduce",
        "o_proj": RowwiseParallel(),
    }
    assert not unsummed_gradients(resolve_plan(model, plan))

    def report(plan):
        return plan_report(
            model,
            plan,
            2,
            batch_size=2,
            seq_len=3,
            example_inputs=lambda b, s: torch.empty(b, s, 16),
        )

    assert not _errors(report(plan))
    errors = _errors(report({**plan, "q_norm": "replicate"}))
    assert [where for where, _ in errors] == ["q_norm.weight"]  # (and its bias, in one op)
    assert "laid out Shard(2) (from q_proj)" in errors[0][1]


def test_plan_for_refuses_a_transformers_plan_that_replicates_on_shards():
    # Qwen3's own plan sums the per-head q_norm's gradient; planned "replicate" instead, its
    # gradient would be each rank's heads' part only: plan_for refuses, naming it and the fix
    transformers = pytest.importorskip("transformers")
    from torch_tp.plans.hf import plan_for

    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attn_implementation="eager",
    )
    with torch.device("meta"):
        assert plan_for(transformers.AutoModelForCausalLM.from_config(config))
    config.base_model_tp_plan = {
        **config.base_model_tp_plan,
        "layers.*.self_attn.q_norm": "replicate",
    }
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError,
        match=r"the replicated parameter model\.layers\.\*\.self_attn"
        r"\.q_norm\.weight.*replicated_with_grad_allreduce",
    ):
        plan_for(model)
