"""Mixture-of-experts layers against one device: tensor-parallel experts
(``TensorParallelExperts``, transformers' ``moe_tp_experts``: every expert sharded on its
hidden dimension) and expert parallelism (``ExpertParallel``: whole experts per rank, tokens
dispatched by all-to-all when each rank has its own, computed where they are when replicated),
through the reference MoE Llama's ready plans."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import adamw, full_tensor, tp_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import (
    ExpertParallel,
    PrepareModuleInput,
    ReplicateParallel,
    TensorParallelExperts,
    parallelize_module,
)
from torch_tp.models import Experts, MoEConfig, MoEFeedForward, MoELlama
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.testing import check_parity, collective_counts, run_distributed

# the benchmark's counter and minima (not a package: imported from its directory, where the
# tests that use it need it; the test ranks import this module too, so they get the same path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _config(**fields) -> MoEConfig:
    base = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "n_experts": 4}
    return MoEConfig(**{**base, **fields})


def _skew(model: nn.Module, experts: int) -> None:
    """Route every token to the first ``experts`` experts: the others (and, under expert
    parallelism, whole ranks) get none."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoEFeedForward):
                module.router.weight[experts:] = -1.0
                module.router.weight[:experts] = 1.0


def _prefixed(plan: dict) -> dict:
    """``plan`` for the model wrapped by :class:`WithAuxLoss` (its ``model``)."""
    return {f"model.{path}".rstrip("."): style for path, style in plan.items()}


class WithAuxLoss(nn.Module):
    """The MoE Llama returning its logits and its load-balancing loss, so that the parity
    check's loss covers the router's auxiliary gradient too."""

    def __init__(self, model: MoELlama) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(tokens)
        return logits, self.model.aux_loss()


def _llama_parity(experts: str, sequence_parallel: bool, skewed: bool, shared: bool) -> None:
    torch.manual_seed(0)
    n = dist.get_world_size()
    config = _config(
        n_experts=2 * n, expert_hidden_dim=16, shared_expert_hidden_dim=16 if shared else None
    )
    # float64: a sum split over ranks rounds differently from one sum, and the router's
    # softmax and top-k normalization amplify it to ~1e-5 in float32; in float64 the
    # comparison is tight enough to catch any wrong slice
    model = MoELlama(config).double()
    if skewed:  # tokens only for experts 0 and 1 (under EP, the first rank's): the others none
        _skew(model, 2)
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    if sequence_parallel and experts == "ep":
        # each rank's routing covers only its own tokens: the load-balancing loss is the
        # shard's (see docs/moe.md), so it is left out of the comparison here
        check_parity(
            model,
            tp_mesh(),
            moe_llama_plan(experts=experts, shared_expert=shared, sequence_parallel=True),
            (tokens,),
            optimizer_fn=adamw,
            steps=3,
        )
    else:
        check_parity(
            WithAuxLoss(model),
            tp_mesh(),
            _prefixed(
                moe_llama_plan(
                    experts=experts, shared_expert=shared, sequence_parallel=sequence_parallel
                )
            ),
            (tokens,),
            optimizer_fn=adamw,
            steps=3,
        )


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("experts", ["tp", "ep"])
@pytest.mark.parametrize(
    "sequence_parallel",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the quick run keeps one
    ids=["replicated", "sp"],
)
@pytest.mark.parametrize(
    ("skewed", "shared"),
    [(False, False), (True, False), (False, True)],
    ids=["balanced", "skewed", "shared_expert"],
)
def test_moe_llama_matches_one_device(world_size, experts, sequence_parallel, skewed, shared):
    run_distributed(_llama_parity, world_size, experts, sequence_parallel, skewed, shared)


def _data_parallel_parity(skewed: bool) -> None:
    """Each rank its own tokens (data parallelism), the experts split over the same ranks:
    every rank's output and input gradient are its tokens' on one device, and the experts'
    and router's gradients are those of all the tokens."""
    torch.manual_seed(0)
    n, rank = dist.get_world_size(), dist.get_rank()
    config = _config(n_experts=2 * n, expert_hidden_dim=8)
    reference = MoEFeedForward(config).double()
    nn.init.normal_(reference.experts.gate_up_proj, std=0.2)
    nn.init.normal_(reference.experts.down_proj, std=0.2)
    if skewed:
        _skew(reference, 2)
    ff = MoEFeedForward(config).double()
    ff.load_state_dict(reference.state_dict())
    parallelize_module(
        ff,
        tp_mesh(),
        {"router": ReplicateParallel(sum_gradients=True), "experts": ExpertParallel()},
    )
    # a different number of tokens on each rank
    batches = [torch.randn(3 + r, config.dim, dtype=torch.float64) for r in range(n)]
    x = torch.cat(batches).requires_grad_()
    reference(x).pow(2).sum().backward()
    mine = batches[rank].clone().requires_grad_()
    out = ff(mine)
    out.pow(2).sum().backward()
    first = sum(b.shape[0] for b in batches[:rank])
    torch.testing.assert_close(out, reference(x).detach()[first : first + mine.shape[0]])
    torch.testing.assert_close(mine.grad, x.grad[first : first + mine.shape[0]])
    for name, param in reference.named_parameters():
        torch.testing.assert_close(full_tensor(ff.get_parameter(name).grad), param.grad, msg=name)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
def test_data_parallel_tokens_dispatched_to_their_experts(world_size, skewed):
    run_distributed(_data_parallel_parity, world_size, skewed)


def _one_reduction_each_way() -> None:
    torch.manual_seed(0)
    experts = Experts(n_experts=4, dim=8, hidden_dim=4)
    parallelize_module(experts, tp_mesh(), TensorParallelExperts())
    hidden = torch.randn(6, 8, requires_grad=True)
    weights = torch.rand(6, 2, requires_grad=True)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    with CommDebugMode() as forward:
        out = experts(hidden * 1.0, index, weights * 1.0)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    # the partial outputs, and one number: whether any rank's expert ids are out of range
    assert collective_counts(forward) == {"all_reduce": 2}
    assert collective_counts(backward) == {"all_reduce": 1}
    assert experts.gate_up_proj.placements[0].dim == 1
    assert experts.down_proj.placements == (Shard(2),)


@pytest.mark.fast_runtime  # plain DTensor reduces the two input gradients apart
def test_tensor_parallel_experts_one_reduction_each_way():
    run_distributed(_one_reduction_each_way, 2)


def _collectives(replicated: bool) -> tuple[dict, dict]:
    torch.manual_seed(0)
    experts = Experts(n_experts=4, dim=8, hidden_dim=4)
    layout = Replicate() if replicated else Shard(0)
    parallelize_module(experts, tp_mesh(), ExpertParallel(input_layouts=layout))
    hidden = torch.randn(6, 8, requires_grad=True)
    weights = torch.rand(6, 2, requires_grad=True)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    with CommDebugMode() as forward:
        out = experts(hidden * 1.0, index, weights * 1.0)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    assert experts.gate_up_proj.placements == (Shard(0),)
    assert experts.down_proj.placements == (Shard(0),)
    return collective_counts(forward), collective_counts(backward)


def test_all_to_alls_with_sharded_tokens():
    # the counts, then the tokens out and back; the backward sends the gradients both ways
    forward, backward = run_distributed(_collectives, 2, False)[0]
    assert forward == {"all_to_all": 3}
    assert backward == {"all_to_all": 2}


@pytest.mark.fast_runtime  # plain DTensor reduces the two input gradients apart
def test_one_reduction_each_way_with_replicated_tokens():
    forward, backward = run_distributed(_collectives, 2, True)[0]
    # the partial outputs, and one number: the count of expert ids out of range, agreed
    assert forward == {"all_reduce": 2}
    assert backward == {"all_reduce": 1}


def _out_of_range(style: str) -> None:
    torch.manual_seed(0)
    root = nn.ModuleDict({"experts": Experts(n_experts=4, dim=8, hidden_dim=4)})
    styles = {
        "tp": TensorParallelExperts(),
        "ep": ExpertParallel(input_layouts=Replicate()),
        "ep_dispatch": ExpertParallel(),
    }
    parallelize_module(root, tp_mesh(), {"experts": styles[style]})
    experts = root["experts"]
    index = torch.tensor([[0, 1], [1, 2]])
    if dist.get_rank() == 1:
        index = torch.tensor([[0, 4], [1, -1]])
    # only rank 1's router misbehaves (replicated routing that is not the same on every rank,
    # or its own dispatched tokens): every rank raises, none waits in a collective
    with pytest.raises(
        ValueError, match=r"on 'experts' \(Experts\): .*expert ids outside \[0, 4\).*\(on rank 1\b"
    ):
        experts(torch.randn(2, 8), index, torch.rand(2, 2))
    # and the group still works
    dist.barrier()


@pytest.mark.parametrize("style", ["tp", "ep", "ep_dispatch"])
def test_expert_ids_out_of_range_raise_on_every_rank(style):
    run_distributed(_out_of_range, 2, style)


class _ExpertsWithIdentity(nn.Module):
    """LongCat-Flash's experts: routed SwiGLU experts, then identity ("zero") experts that
    return the token itself (``gate_up_proj`` stacks rows for them too, unused)."""

    def __init__(self, routed: int, zero: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.routed = routed
        self.gate_up_proj = nn.Parameter(torch.randn(routed + zero, 2 * hidden, dim) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(routed, dim, hidden) * 0.2)
        self.identity_expert = nn.Identity()

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for slot in range(top_k_index.shape[-1]):
            for expert in top_k_index[:, slot].unique().tolist():
                token = (top_k_index[:, slot] == expert).nonzero().squeeze(-1)
                x = hidden[token]
                if expert >= self.routed:
                    y = self.identity_expert(x)
                else:
                    gate, up = (x @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
                    y = (torch.nn.functional.silu(gate) * up) @ self.down_proj[expert].T
                out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class _MoEWithIdentityExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 6, bias=False)
        self.experts = _ExpertsWithIdentity(routed=4, zero=2, dim=16, hidden=8)

    def forward(self, x):
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, index, weights)


def _identity_experts_parity() -> None:
    torch.manual_seed(0)
    model = _MoEWithIdentityExperts().double()
    x = torch.randn(24, 16, dtype=torch.float64)
    # some tokens do go to the identity experts (ids 4 and 5)
    assert (model.router(x).topk(2, dim=-1).indices >= 4).any()
    plan = {
        "router": "replicate",
        "experts": "moe_tp_experts",
        "experts.identity_expert": "moe_identity_expert",
    }
    check_parity(model, tp_mesh(), plan, (x,), optimizer_fn=adamw, steps=2)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_identity_experts_match_one_device(world_size):
    run_distributed(_identity_experts_parity, world_size)


def _refusals() -> None:
    mesh = tp_mesh()
    with pytest.raises(NotImplementedError, match="stacked parameters"):
        parallelize_module(nn.Linear(4, 4), mesh, TensorParallelExperts())
    with pytest.raises(ValueError, match="does not divide by the 2 ranks"):
        parallelize_module(Experts(n_experts=2, dim=4, hidden_dim=3), mesh, {"": "moe_tp_experts"})
    with pytest.raises(ValueError, match="experts must be 'tp'"):
        moe_llama_plan(experts="dp")
    with pytest.raises(ValueError, match="3 experts do not split over 2 ranks"):
        parallelize_module(Experts(n_experts=3, dim=4, hidden_dim=2), mesh, ExpertParallel())
    with pytest.raises(NotImplementedError, match="has none"):
        parallelize_module(nn.ReLU(), mesh, ExpertParallel())
    with pytest.raises(ValueError, match="input_layouts must be Shard"):
        ExpertParallel(input_layouts=Shard(1))


def test_bad_input_is_refused():
    run_distributed(_refusals, 2)


# --- minimal collectives per MoE layer ------------------------------------------------------
# Every layout of moe_llama_plan counted per MoE layer against the minimum
# (benchmarks/bench_moe.py's expected_moe, with its counter): tp+sp gathers the sequence once
# and reduce-scatters the block's partial output once (the experts' and the shared expert's
# outputs left partial sums), and the router's load-balancing gradient, whole on every rank,
# is counted once.

_LAYOUTS = {
    # name: (experts, sequence_parallel, bench_moe's minimum)
    "tp": ("tp", False, "tp"),
    "tp+sp": ("tp", True, "tp+sp"),
    "ep": ("ep", False, "ep-replicated"),
    "ep+sp": ("ep", True, "ep-dispatch"),
}


def _small_config(shared: bool) -> MoEConfig:
    return MoEConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=128,
        n_experts=4,
        expert_hidden_dim=16,
        shared_expert_hidden_dim=16 if shared else None,
    )


def _counts(names: list[str], shared: bool) -> dict[str, dict]:
    """On each rank: one forward and backward of the MoE Llama (batch 2: the experts'
    flattened tokens are not a sequence shard) in each layout, its collectives by pass inside
    the MoE layers (bench_moe's split) and their total against CommDebugMode's."""
    import bench_moe

    torch.manual_seed(0)
    config = _small_config(shared)
    reference = MoELlama(config)
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    result = {}
    for name in names:
        experts, sp, _ = _LAYOUTS[name]
        model = MoELlama(config)
        model.load_state_dict(reference.state_dict())
        plan = moe_llama_plan(experts=experts, shared_expert=shared, sequence_parallel=sp)
        parallelize_module(model, tp_mesh(), plan)

        def step(model=model) -> None:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            (loss + model.aux_loss()).backward()

        with bench_moe.MoECounter() as counter:
            step()
        with CommDebugMode() as comm:
            step()
        split = bench_moe.split_records(counter.records)
        result[name] = {
            "fwd": {k: c for k, (c, _) in split["fwd"].items()},
            "bwd": {k: c for k, (c, _) in split["bwd"].items()},
            "all": len(counter.records),
            "comm_debug": comm.get_total_counts(),
        }
    return result


def _check(names: list[str], shared: bool) -> None:
    import bench_moe

    result = run_distributed(_counts, 2, names, shared)[0]
    for name in names:
        fwd, bwd = bench_moe.expected_moe(_LAYOUTS[name][2], _small_config(shared).n_layers)
        got = result[name]
        assert (got["fwd"], got["bwd"]) == (fwd, bwd), (name, got)
        # the counter misses no collective CommDebugMode sees
        assert got["all"] == got["comm_debug"], (name, got)


@pytest.mark.fast_runtime  # plain DTensor reduces gradients apart, as they arrive
def test_tp_sp_issues_the_minimal_collectives():
    # the sequence gathered once, the experts' partial output reduce-scattered once
    _check(["tp+sp"], shared=False)


@pytest.mark.slow
@pytest.mark.fast_runtime
def test_every_moe_layout_issues_the_minimal_collectives():
    _check(list(_LAYOUTS), shared=False)


@pytest.mark.slow
@pytest.mark.fast_runtime
def test_minimal_collectives_with_a_shared_expert():
    # the shared expert's partial output joins the experts' before the one reduce-scatter
    # (tp+sp) or all-reduce (tp); under ep+sp it gathers and scatters its tokens: not
    # expected_moe's minima
    _check(["tp", "tp+sp"], shared=True)


def _tp_sp_parity(batch: int, shared: bool) -> None:
    torch.manual_seed(0)
    config = _small_config(shared)
    model = MoELlama(config).double()
    tokens = torch.randint(0, config.vocab_size, (batch, 8))

    plan = moe_llama_plan(experts="tp", shared_expert=shared, sequence_parallel=True)
    model.config.router_aux_loss_coef = 10.0  # a gradient counted once per rank would show
    check_parity(
        WithAuxLoss(model),
        tp_mesh(),
        {f"model.{path}".rstrip("."): style for path, style in plan.items()},
        (tokens,),
        optimizer_fn=adamw,
        steps=2,
    )


@pytest.mark.parametrize(
    ("batch", "shared"),
    [(2, False), pytest.param(3, True, marks=pytest.mark.slow)],
    ids=["batch2", "batch3_shared_expert"],
)
def test_tp_sp_reduce_scatter_matches_one_device(batch, shared):
    run_distributed(_tp_sp_parity, 2, batch, shared)


def _refusals() -> None:
    with pytest.raises(ValueError, match="output_layouts must be Replicate"):
        TensorParallelExperts(output_layouts=Shard(0))
    with pytest.raises(ValueError, match="needs sum_gradients=True"):
        ReplicateParallel(whole_gradient_outputs=(0,))
    with pytest.raises(TypeError, match="whole_gradient_outputs must be a tuple"):
        ReplicateParallel(sum_gradients=True, whole_gradient_outputs=0)
    with pytest.raises(ValueError, match="desired Replicate"):
        PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), partial_input_gradients=True
        )
    with pytest.raises(ValueError, match="use_local_output"):
        PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), partial_input_gradients=True
        )
    with pytest.raises(ValueError, match=r"Replicate\(\) or Shard\(d\)"):
        PrepareModuleInput(
            input_layouts=Partial(),
            desired_input_layouts=Replicate(),
            use_local_output=True,
            partial_input_gradients=True,
        )


def test_bad_options_are_refused():
    _refusals()
    assert dist.is_available()


def _whole_experts_in_the_region() -> None:
    torch.manual_seed(0)
    model = MoELlama(_small_config(shared=False))
    plan = moe_llama_plan(experts="tp", sequence_parallel=True)
    # the old default: the experts' output reduced inside a block that reduce-scatters it
    plan["layers.*.feed_forward.experts"] = TensorParallelExperts()
    parallelize_module(model, tp_mesh(), plan)
    with pytest.raises(ValueError, match=r"must leave their output partial"):
        model(torch.randint(0, 128, (2, 8)))
    dist.barrier()  # every rank raised, none waits


def test_replicated_experts_inside_the_reduce_scattered_block_are_refused():
    run_distributed(_whole_experts_in_the_region, 2)
