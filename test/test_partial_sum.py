"""Partial-sum regions: transformers' ``"all_reduce"`` (5.x) and ``"gather"`` with the
``"local_*"`` styles inside (4.x), as :class:`PartialSumParallel`,
:class:`LocalLinearParallel` and :class:`LocalParamsParallel`.

A module whose forward, on this rank's shards, gives a part of its output: the parts are
summed as it leaves (one all-reduce), the gradients of its inputs and of the replicated
parameters inside it in the backward (one all-reduce each). The model here is Llama 4's
mixture-of-experts feed-forward, op by op, under the plan transformers 4.x shipped for it; the
same plan on transformers' own Llama 4 (and Inkling's shared experts under its 5.x
``"all_reduce"``, in the zoo) is checked against one device too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import sgd, tp_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import LocalLinearParallel, PartialSumParallel, parallelize_module
from torch_tp._torch_compat import StridedShard
from torch_tp.report import plan_report
from torch_tp.testing import check_parity, collective_counts, run_distributed

DIM, HIDDEN, EXPERTS = 8, 12, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Llama 4's experts: stacked, transposed, on tokens routed and weighted already."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * HIDDEN) / DIM**0.5)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(EXPERTS, -1, DIM)
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj).view(-1, DIM)


class Router(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(x)
        top, index = torch.topk(logits, 2, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
        return torch.sigmoid(scores), logits


class MoE(nn.Module):
    """Llama 4's ``Llama4TextMoe``: the shared expert's output and the routed experts', both
    partial under the plan, added in place; the router's logits returned too."""

    def __init__(self, in_place: bool = True) -> None:
        super().__init__()
        self.experts = Experts()
        self.router = Router(DIM, EXPERTS, bias=False)
        self.shared_expert = MLP()
        # CommDebugMode's module hooks make the shared expert's output a view that refuses
        # an in-place add (on one device too)
        self.in_place = in_place

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden.reshape(-1, DIM)
        scores, logits = self.router(hidden)
        routed = hidden.repeat(EXPERTS, 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = self.shared_expert(hidden)
        routed_out = self.experts(routed).view(EXPERTS, -1, DIM).sum(dim=0)
        out = out.add_(routed_out) if self.in_place else out + routed_out
        return out, logits


class Model(nn.Module):
    """A dense feed-forward, then the mixture of experts."""

    def __init__(self, in_place: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"feed_forward": MLP()}), MoELayer(in_place)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.layers[0]["feed_forward"](x)
        out, logits = self.layers[1].feed_forward(x)
        return x + out.view_as(x), logits


class MoELayer(nn.Module):
    def __init__(self, in_place: bool = True) -> None:
        super().__init__()
        self.feed_forward = MoE(in_place)


# transformers 4.51's base_model_tp_plan for Llama 4's feed-forward, exactly
LLAMA4_4X_PLAN = {
    "layers.*.feed_forward.shared_expert.gate_proj": "local_colwise",
    "layers.*.feed_forward.shared_expert.up_proj": "local_colwise",
    "layers.*.feed_forward.shared_expert.down_proj": "local_rowwise",
    "layers.*.feed_forward.experts.gate_up_proj": "local_packed_rowwise",  # row: not linear
    "layers.*.feed_forward.experts.down_proj": "local_colwise",  # col: not linear
    "layers.*.feed_forward.experts": "local",
    "layers.*.feed_forward.gate_proj": "local_colwise",
    "layers.*.feed_forward.up_proj": "local_colwise",
    "layers.*.feed_forward.down_proj": "local_rowwise",
    "layers.*.feed_forward": "gather",
}


def _parity() -> None:
    torch.manual_seed(0)
    # float64: two SGD steps of float32 rounding would make the second step's gradients
    # differ by more than float32's tolerance, through the routing's scores
    x = torch.randn(2, 5, DIM, dtype=torch.float64)

    def loss_fn(output):  # the router's logits too (an auxiliary loss)
        out, logits = output
        return out.pow(2).sum() + 0.1 * logits.pow(2).sum()

    tp, _ = check_parity(
        Model().double(),
        tp_mesh(),
        LLAMA4_4X_PLAN,
        (x,),
        loss_fn=loss_fn,
        optimizer_fn=sgd,
        steps=2,
    )
    moe = tp.layers[1].feed_forward
    # each rank its slice of every expert's gate columns and of its up columns, its rows of
    # down_proj; the router replicated, its gradient whole on every rank
    assert moe.experts.gate_up_proj.placements == (StridedShard(2, split_factor=2),)
    assert moe.experts.down_proj.placements == (Shard(1),)
    assert moe.shared_expert.gate_proj.weight.placements == (Shard(0),)
    assert moe.shared_expert.down_proj.weight.placements == (Shard(1),)
    assert moe.router.weight.placements == (Replicate(),)
    assert moe.router.weight.grad.placements == (Replicate(),)


def test_llama4_feed_forward_under_transformers_4x_plan_matches_one_device():
    run_distributed(_parity, 2)


def _collectives() -> tuple[dict, dict, dict, dict]:
    torch.manual_seed(0)
    model = Model(in_place=False)
    with torch.device("meta"):
        meta = Model(in_place=False)
    report = plan_report(
        meta,
        LLAMA4_4X_PLAN,
        2,
        batch_size=2,
        seq_len=5,
        example_inputs=(torch.randn(2, 5, DIM, device="meta"),),
    )
    parallelize_module(model, tp_mesh(), LLAMA4_4X_PLAN)
    moe = model.layers[1].feed_forward
    x = torch.randn(10, DIM, requires_grad=True)
    with CommDebugMode() as forward:
        out, _ = moe(x * 1.0)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    return (
        collective_counts(forward),
        collective_counts(backward),
        dict(report.counts("forward")),
        dict(report.counts("backward")),
    )


@pytest.mark.fast_runtime  # plain DTensor sums the router's gradient apart
def test_one_all_reduce_each_way_and_one_for_the_router():
    forward, backward, predicted_forward, predicted_backward = run_distributed(_collectives, 2)[0]
    # the shared expert's and the routed experts' parts summed together
    assert forward == {"all_reduce": 1}
    # the input's gradient, then the router's (the replicated parameters, at the end)
    assert backward == {"all_reduce": 2}
    # the report predicts the whole model: the dense feed-forward's region sums its output
    # too, and its input (the model's) needs no gradient
    assert predicted_forward == {"all_reduce": 2}
    assert predicted_backward == {"all_reduce": 2}


def test_names_and_parameter_entries():
    assert LocalLinearParallel("colwise") != LocalLinearParallel("rowwise")
    with pytest.raises(ValueError, match="shard must be one of 'colwise', 'rowwise'"):
        LocalLinearParallel("column")
    with pytest.raises(TypeError, match="placements must map parameter names"):
        PartialSumParallel({"weight": "Shard(0)"})


def _refused(plan: dict, message: str) -> None:
    model = Model()
    with pytest.raises(ValueError, match=message):
        parallelize_module(model, tp_mesh(), plan)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing changed


def _refusals() -> None:
    # a part of a sum with nothing summing it
    plan = {k: v for k, v in LLAMA4_4X_PLAN.items() if k != "layers.*.feed_forward"}
    _refused(
        plan,
        r"plan key 'layers.\*.feed_forward.shared_expert.gate_proj' \(LocalLinearParallel\("
        r"shard='colwise'\)\) on 'layers.1.feed_forward.shared_expert.gate_proj' computes one "
        r"part of a sum with no collective of its own: it must be inside a module planned "
        r"'gather' or 'all_reduce'",
    )
    # a style with a collective of its own inside the region: counted once per rank
    plan = {**LLAMA4_4X_PLAN, "layers.*.feed_forward.down_proj": "rowwise"}
    _refused(
        plan,
        r"plan key 'layers.\*.feed_forward.down_proj' \(RowwiseParallel.*\) on "
        r"'layers.0.feed_forward.down_proj' is inside 'layers.0.feed_forward', whose style "
        r"PartialSumParallel\(placements=None\) \(plan key 'layers.\*.feed_forward'\) sums",
    )
    # ... and the styles a region may hold are named, read from the registry (where styles a
    # test registered follow the built-in ones)
    _refused(
        plan,
        r"with no collective of its own \('replicated_with_grad_allreduce', 'local_params', "
        r"'local', 'local_colwise', 'local_rowwise',? (or )?'local_packed_rowwise'[^)]*\), or",
    )
    # a row-parallel part with a bias: added once per rank
    model = Model()
    model.layers[0]["feed_forward"].down_proj.bias = nn.Parameter(torch.zeros(DIM))
    with pytest.raises(ValueError, match="takes no bias: each rank would add it to its part"):
        parallelize_module(model, tp_mesh(), LLAMA4_4X_PLAN)
    # a region inside a region
    plan = {**LLAMA4_4X_PLAN, "layers.*.feed_forward.shared_expert": "all_reduce"}
    _refused(plan, r"'layers.1.feed_forward.shared_expert' is inside 'layers.1.feed_forward'")


def test_refused_before_anything_changes():
    run_distributed(_refusals, 2)


class _ReturnsADict(MLP):
    def forward(self, x: torch.Tensor) -> dict:
        return {"out": super().forward(x)}


def _no_partial_sum_returned() -> None:
    model = nn.ModuleDict({"mlp": _ReturnsADict()})
    plan = {"mlp": "gather", "mlp.gate_proj": "local_colwise", "mlp.up_proj": "local_colwise"}
    parallelize_module(model, tp_mesh(), {**plan, "mlp.down_proj": "local_rowwise"})
    with pytest.raises(TypeError, match=r"on 'mlp' \(_ReturnsADict\): expected the module to "):
        model["mlp"](torch.randn(3, DIM))


def test_a_region_must_return_its_partial_sum():
    run_distributed(_no_partial_sum_returned, 2)


def _llama4_under_4x_plan(model_type: str) -> dict:
    import test_zoo

    def plan(model: nn.Module) -> dict:
        return {
            **{f"model.{key}": name for key, name in LLAMA4_4X_TEXT_PLAN.items()},
            "lm_head": "colwise_rep",
        }

    return test_zoo._check(model_type, plan)


# transformers 4.51's whole base_model_tp_plan for Llama 4's text model
LLAMA4_4X_TEXT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    **LLAMA4_4X_PLAN,
}


@pytest.mark.slow
def test_transformers_llama4_under_its_4x_plan_matches_one_device():
    pytest.importorskip("transformers")
    result = run_distributed(_llama4_under_4x_plan, 2, "llama4_text", timeout=120)[0]
    # logits, loss, every gradient, greedy and sampled generate
    assert result["status"] == "pass", result
