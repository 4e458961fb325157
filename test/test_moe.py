"""Mixture-of-experts layers under tensor parallelism: ``TensorParallelExperts``
(transformers' ``moe_tp_experts``) on the reference MoE Llama, against one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import adamw, tp_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import ReplicateParallel, TensorParallelExperts, parallelize_module
from torch_tp.models import Experts, MoEConfig, MoELlama
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import check_parity, collective_counts, run_distributed


def _moe_plan() -> dict:
    """The Llama plan for attention and embeddings; the router replicated (it sees whole
    tokens), the experts tensor-parallel."""
    plan = {k: v for k, v in llama_plan().items() if "feed_forward" not in k}
    # the block's tokens are replicated local tensors (the attention's row-parallel output)
    plan["layers.*.feed_forward.router"] = ReplicateParallel()
    plan["layers.*.feed_forward.experts"] = TensorParallelExperts()
    return plan


def _config(**fields) -> MoEConfig:
    base = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "n_experts": 4}
    return MoEConfig(**{**base, **fields})


def _llama_parity(skewed: bool, shared: bool) -> None:
    torch.manual_seed(0)
    config = _config(expert_hidden_dim=16, shared_expert_hidden_dim=16 if shared else None)
    # float64: a sum split over ranks rounds differently from one sum, and the router's
    # softmax and top-k normalization amplify it to ~1e-5 in float32; in float64 the
    # comparison is tight enough to catch any wrong slice
    model = MoELlama(config).double()
    if skewed:  # every token routed to experts 0 and 1: experts 2 and 3 get none
        with torch.no_grad():
            for layer in model.layers:
                layer.feed_forward.router.weight[2:] = -1.0
                layer.feed_forward.router.weight[:2] = 1.0
    plan = _moe_plan()
    if shared:
        plan["layers.*.feed_forward.shared_expert.w1"] = "colwise"
        plan["layers.*.feed_forward.shared_expert.w3"] = "colwise"
        plan["layers.*.feed_forward.shared_expert.w2"] = "rowwise"
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    check_parity(model, tp_mesh(), plan, (tokens,), optimizer_fn=adamw, steps=3)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("skewed", "shared"), [(False, False), (True, False), (False, True)])
def test_tensor_parallel_experts_match_one_device(world_size, skewed, shared):
    run_distributed(_llama_parity, world_size, skewed, shared)


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
    assert collective_counts(forward) == {"all_reduce": 1}
    assert collective_counts(backward) == {"all_reduce": 1}
    assert experts.gate_up_proj.placements[0].dim == 1
    assert experts.down_proj.placements == (Shard(2),)


@pytest.mark.fast_runtime  # plain DTensor reduces the two input gradients apart
def test_one_reduction_forward_and_one_backward():
    run_distributed(_one_reduction_each_way, 2)


def _refusals() -> None:
    mesh = tp_mesh()
    with pytest.raises(NotImplementedError, match="stacked parameters"):
        parallelize_module(nn.Linear(4, 4), mesh, TensorParallelExperts())
    with pytest.raises(ValueError, match="does not divide by the 2 ranks"):
        parallelize_module(Experts(n_experts=2, dim=4, hidden_dim=3), mesh, {"": "moe_tp_experts"})


def test_modules_it_cannot_shard_are_refused():
    run_distributed(_refusals, 2)
