"""Mixtures of experts under FSDP2 on a (2, 2) mesh of four CPU ranks, against one device.

Two compositions, each trained three AdamW steps with each data-parallel rank on its own
slice of the global batch:

* ``(dp, tp)``: the MoE Llama's ready plan on ``mesh["tp"]``, tensor-parallel experts or
  experts split over the tensor-parallel ranks (expert-parallel degree = TP degree), then
  FSDP2 per block and at the root on ``mesh["dp"]``;
* ``(dp, ep)``: no tensor parallelism; four data-parallel ranks, the experts split over
  ``mesh["ep"]`` (expert parallelism borrowed from data parallelism, as torchtitan does),
  each rank's tokens dispatched to their experts by all-to-all. The experts are sharded by
  FSDP2 over ``mesh["dp"]`` and everything else over both dimensions (HSDP); the experts'
  gradients, which the all-to-all already sums over ``mesh["ep"]``, are divided by all four
  data-parallel ranks, as every other gradient is.

The loss includes the load-balancing loss. Each data-parallel rank computes it from its own
tokens' routing, as in any data-parallel MoE training: the reference is the single-device
model trained on the same micro-batches, accumulating their gradients (the mean of the
micro-batch losses), which for the language-model loss is the global batch's loss exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import adamw, full_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp import ExpertParallel
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.testing import device_type, run_distributed

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-8}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-7}


def _model() -> MoELlama:
    torch.manual_seed(0)
    config = MoEConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        n_experts=4,
        expert_hidden_dim=16,
        shared_expert_hidden_dim=16,
        vocab_size=128,
        max_seq_len=32,
    )
    # float64: parity to float64 rounding (routing amplifies float32 rounding, see test_moe)
    return MoELlama(config).double()


def _loss(model: MoELlama, tokens: torch.Tensor, targets: torch.Tensor, aux: bool):
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    return loss + model.aux_loss() if aux else loss


def _parallelize_dp_tp(model: MoELlama, experts: str, sequence_parallel: bool):
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    plan = moe_llama_plan(experts=experts, shared_expert=True, sequence_parallel=sequence_parallel)
    torch_tp.parallelize_module(model, mesh["tp"], plan)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"]


def _parallelize_dp_ep(model: MoELlama):
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "ep"))
    torch_tp.parallelize_module(
        model, mesh["ep"], {"layers.*.feed_forward.experts": ExpertParallel()}
    )
    for block in model.layers:
        experts = block.feed_forward.experts
        fully_shard(experts, mesh=mesh["dp"])
        # FSDP2 would divide by its 2 ranks; the gradient is a sum over all 4 ranks' tokens
        experts.set_gradient_divide_factor(float(dist.get_world_size()))
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(composition: str, experts: str, sequence_parallel: bool) -> None:
    reference = _model()
    model = copy.deepcopy(reference)
    if composition == "dp_tp":
        dp_mesh = _parallelize_dp_tp(model, experts, sequence_parallel)
        data_rank, data_ranks = dp_mesh.get_local_rank(), dp_mesh.size()
    else:
        _parallelize_dp_ep(model)
        data_rank, data_ranks = dist.get_rank(), dist.get_world_size()
    # the load-balancing loss is each rank's, as in training, except where a rank routes
    # only its sequence shard (its loss is then the shard's: see test_moe)
    aux = not (experts == "ep" and sequence_parallel)
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    names = [name for name, _ in reference.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()]
    per_rank = 2
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 128, (data_ranks * per_rank, 16), generator=gen)
        targets = torch.randint(0, 128, (data_ranks * per_rank, 16), generator=gen)
        # one device: the same micro-batches, gradients accumulated
        ref_losses = []
        for r in range(data_ranks):
            mine = slice(r * per_rank, (r + 1) * per_rank)
            ref_loss = _loss(reference, tokens[mine], targets[mine], aux) / data_ranks
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
        mine = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
        loss = _loss(model, tokens[mine], targets[mine], aux)
        loss.backward()
        torch.testing.assert_close(loss.detach() / data_ranks, ref_losses[data_rank])
        for name, p, ref_p in zip(names, model.parameters(), reference.parameters(), strict=True):
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
            torch.testing.assert_close(
                full_tensor(p.grad), ref_p.grad, **GRAD_TOL, msg=lambda m, n=name: f"grad {n}: {m}"
            )
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
        for name, p, ref_p in zip(names, model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(
                full_tensor(p.detach()),
                ref_p.detach(),
                **PARAM_TOL,
                msg=lambda m, n=name: f"{n}: {m}",
            )


@pytest.mark.parametrize(
    ("experts", "sequence_parallel"),
    # 4 ranks: the quick run leaves them all out; CI's quick passes keep one (four_ranks)
    [
        pytest.param("ep", True, marks=pytest.mark.four_ranks),
        *(
            pytest.param(*c, marks=pytest.mark.slow)
            for c in [("tp", False), ("ep", False), ("tp", True)]
        ),
    ],
)
def test_fsdp2_with_tp_or_ep_on_the_tp_ranks_matches_one_device(experts, sequence_parallel):
    run_distributed(_train, 4, "dp_tp", experts, sequence_parallel)


@pytest.mark.slow
def test_fsdp2_with_ep_borrowed_from_data_parallel_matches_one_device():
    run_distributed(_train, 4, "dp_ep", "ep", True)
