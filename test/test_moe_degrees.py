"""Expert parallelism of a degree chosen independently of tensor parallelism, against one
device, on four CPU ranks.

* ``ep4 x tp1``: no tensor parallelism. Four data-parallel ranks, each training on its own
  micro-batch, the experts split four ways over the same ranks (``ExpertParallel()``, 8
  experts: 2 per rank), each rank's tokens dispatched to their experts by all-to-all; with
  balanced routing, and with routing that gives two ranks' experts no token. The dense
  parameters are sharded by FSDP2 over the four ranks. With ``ep`` equal to the
  data-parallel degree, docs/moe.md's ``("dp", "ep") = (dp // ep, ep)`` mesh has a one-rank
  "dp" with nothing to shard the experts over: the recipe reduces to one "ep" dimension,
  the experts left out of FSDP2 and their gradient, which the all-to-all summed over the
  four ranks' tokens, divided by the four data-parallel ranks as FSDP2 divides the others.
  (FSDP2 over the one-rank "dp" with ``set_gradient_divide_factor(4)`` would do it in
  float32, but torch 2.13 divides a float64 gradient on a one-rank mesh by 16.)
* ``pp2 x ep2``: two pipeline stages (``torch_tp.pipeline``, ``torch.distributed.pipelining``'s
  1F1B and interleaved 1F1B), each over two ranks that are data-parallel for the stage's
  dense parameters (FSDP2 over the stage's "ep" dimension, as above) and split its experts
  by ``ExpertParallel()``; each "ep" rank steps the schedule on its own batch.

Each is trained three AdamW steps in float64; the loss, every gradient (gathered full) and
every parameter after each step equal the single-device model trained on the same
micro-batches with their gradients accumulated as the data-parallel mean.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import adamw, full_tensor
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp import ExpertParallel
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.testing import device_type, run_distributed

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-8}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-7}
EXPERTS = {"layers.*.feed_forward.experts": ExpertParallel()}


def _model(n_layers: int = 2) -> MoELlama:
    torch.manual_seed(0)
    config = MoEConfig(
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=4,
        n_experts=8,
        expert_hidden_dim=16,
        shared_expert_hidden_dim=16,
        vocab_size=128,
        max_seq_len=32,
    )
    # float64: parity to float64 rounding (routing amplifies float32 rounding, see test_moe)
    return MoELlama(config).double()


def _starve(model: MoELlama) -> None:
    """Route every token to experts 0 and 1 or to experts 2 and 3 (by the sign of the sum of
    its features): experts 4 to 7, ranks 2 and 3's at ep4, get no token at the first step."""
    with torch.no_grad():
        for block in model.layers:
            weight = block.feed_forward.router.weight
            weight.zero_()
            for e, c in enumerate([1.0, 0.5, -1.0, -0.5]):
                weight[e] = c


def _loss(model: MoELlama, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) + model.aux_loss()


def _check_grads_and_step(names, params, reference, optim, ref_optim) -> None:
    for name, p in zip(names, params, strict=True):
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        torch.testing.assert_close(
            full_tensor(p.grad),
            reference.get_parameter(name).grad,
            **GRAD_TOL,
            msg=lambda m, n=name: f"grad {n}: {m}",
        )
    optim.step()
    ref_optim.step()
    optim.zero_grad()
    ref_optim.zero_grad()
    for name, p in zip(names, params, strict=True):
        torch.testing.assert_close(
            full_tensor(p.detach()),
            reference.get_parameter(name).detach(),
            **PARAM_TOL,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def _shard_dense_over_ep(model: nn.Module, blocks, ep_mesh) -> None:
    """FSDP2 over ``ep_mesh`` for every parameter but the experts', which ``ExpertParallel``
    already split over ``ep_mesh``: their gradient, which the all-to-all summed over the
    ranks' tokens, is divided by the ranks, as FSDP2 divides the others."""
    experts = [p for block in blocks for p in block.feed_forward.experts.parameters()]
    ep = float(ep_mesh.size())
    for p in experts:
        p.register_hook(lambda grad: grad / ep)
    for block in blocks:
        fully_shard(
            block, mesh=ep_mesh, ignored_params=set(block.feed_forward.experts.parameters())
        )
    fully_shard(model, mesh=ep_mesh)  # the blocks hold every expert


def _ep4(starved: bool) -> None:
    """ep4 x tp1: the experts split over the 4 ranks, FSDP2 over the same ranks for the
    rest."""
    reference = _model()
    if starved:
        _starve(reference)
    model = copy.deepcopy(reference)
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type(), (world,), mesh_dim_names=("ep",))
    torch_tp.parallelize_module(model, mesh, EXPERTS)
    _shard_dense_over_ep(model, model.layers, mesh)
    names = [name for name, _ in reference.named_parameters()]
    params = list(model.parameters())
    assert names == [name for name, _ in model.named_parameters()]
    # 8 experts, 2 per rank: each rank holds experts 2r and 2r + 1
    local = model.layers[0].feed_forward.experts.gate_up_proj.to_local()
    assert local.shape[0] == 2
    torch.testing.assert_close(
        local, reference.layers[0].feed_forward.experts.gate_up_proj[2 * dist.get_rank() :][:2]
    )
    ref_optim, optim = adamw(reference.parameters()), adamw(params)
    rank, per_rank = dist.get_rank(), 2
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 128, (world * per_rank, 16), generator=gen)
        targets = torch.randint(0, 128, (world * per_rank, 16), generator=gen)
        # one device: the same micro-batches, gradients accumulated as their mean
        ref_losses = []
        for r in range(world):
            mine = slice(r * per_rank, (r + 1) * per_rank)
            ref_loss = _loss(reference, tokens[mine], targets[mine]) / world
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
        if starved and step == 0:  # experts 4 to 7 (ranks 2 and 3) saw no token
            for block in reference.layers:
                experts = block.feed_forward.experts
                assert experts.gate_up_proj.grad[4:].abs().sum() == 0
                assert experts.gate_up_proj.grad[:4].abs().sum() > 0
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = _loss(model, tokens[mine], targets[mine])
        loss.backward()
        torch.testing.assert_close(loss.detach() / world, ref_losses[rank])
        _check_grads_and_step(names, params, reference, optim, ref_optim)


@pytest.mark.four_ranks
@pytest.mark.parametrize("starved", [False, True], ids=["balanced", "starved"])
def test_ep4_tp1_fsdp2_matches_one_device(starved):
    run_distributed(_ep4, 4, starved)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pp2_ep2(schedule_name: str, stages_per_rank: int) -> None:
    """pp2 x ep2: the ("pp", "ep") = (2, 2) mesh; each stage's two ranks split its experts
    and are data-parallel for the rest (FSDP2 over "ep"), each its own batch of micro-batches.
    The pipeline's loss is the language-model loss only (the load-balancing loss lives in the
    blocks of both stages)."""
    from torch_tp.pipeline import build_schedule, pipeline_stages

    reference = _model(n_layers=4)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "ep"))
    stages = pipeline_stages(
        model, mesh["pp"], stages_per_rank=stages_per_rank, tp_mesh=mesh["ep"], plan=EXPERTS
    )
    for stage in stages:
        for block in stage.submod.layers.values():  # 8 experts, 4 per rank
            assert block.feed_forward.experts.gate_up_proj.to_local().shape[0] == 4
        _shard_dense_over_ep(stage.submod, stage.submod.layers.values(), mesh["ep"])
    batch, microbatches, ep = 4, 2, mesh["ep"].size()
    schedule = build_schedule(
        stages,
        schedule_name,
        n_microbatches=microbatches,
        batch_size=batch,
        loss_fn=_cross_entropy,
    )
    named = [(n, p) for stage in stages for n, p in stage.submod.named_parameters()]
    names, params = [n for n, _ in named], [p for _, p in named]
    # every parameter of the model is on exactly one stage
    counts = torch.tensor([len(params)])
    dist.all_reduce(counts, group=mesh["pp"].get_group())
    assert counts.item() == len(list(reference.parameters()))
    optim, ref_optim = adamw(params), adamw(reference.parameters())
    last = any(stage.is_last for stage in stages)
    replica, size = mesh["ep"].get_local_rank(), batch // microbatches
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 128, (ep * batch, 16), generator=gen)
        targets = torch.randint(0, 128, (ep * batch, 16), generator=gen)
        # one device: every replica's micro-batches, gradients accumulated as their mean
        ref_losses = []
        for r in range(ep):
            loss = torch.zeros((), dtype=torch.float64)
            for k in range(microbatches):
                rows = slice(r * batch + k * size, r * batch + (k + 1) * size)
                mb_loss = _cross_entropy(reference(tokens[rows]), targets[rows])
                (mb_loss / (ep * microbatches)).backward()
                loss += mb_loss.detach() / microbatches
            ref_losses.append(loss)
        mine = slice(replica * batch, (replica + 1) * batch)
        losses: list[torch.Tensor] = []
        schedule.step(tokens[mine], target=targets[mine], losses=losses)
        if last:  # the mean of this replica's micro-batch losses
            torch.testing.assert_close(torch.stack(losses).mean(), ref_losses[replica])
        _check_grads_and_step(names, params, reference, optim, ref_optim)


@pytest.mark.four_ranks
@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"), [("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2)]
)
def test_pp2_ep2_matches_one_device(schedule, stages_per_rank):
    run_distributed(_pp2_ep2, 4, schedule, stages_per_rank)
