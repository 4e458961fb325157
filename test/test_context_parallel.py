"""ContextParallel: the reference Llama with its sequence split over a ``cp`` mesh.

Each rank holds its part of every sequence (``shard_sequence``, load-balanced: a head chunk
and a tail chunk) and the tokens' true positions (``sequence_positions``); the attention of
each block is a ring of key/value blocks over the ``cp`` ranks. FSDP2 over ``cp`` sums the
parameters' gradients (each rank's is its tokens' part). Everything is compared with one
device on the whole sequence, float64: the logits gathered back in sequence order, the loss,
every gradient and every parameter after AdamW steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import adamw, check_step, perturb_norms
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp import ContextParallel, sequence_positions, shard_sequence, unshard_sequence
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

TOL = {"rtol": 1e-7, "atol": 1e-9}
SEQ = 16


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(tiny_config(n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)).double()
    perturb_norms(model)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 1001, (2, SEQ), generator=gen)
    return tokens, torch.randint(0, 1001, (2, SEQ), generator=gen)


def _train(cp: int, tp: int, rotation: str, load_balance: bool, target: str) -> None:
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (cp, tp), mesh_dim_names=("cp", "tp"))
    if tp > 1:
        torch_tp.parallelize_module(model, mesh["tp"], llama_plan())
    style = ContextParallel(rotation=rotation, load_balance=load_balance)
    torch_tp.parallelize_module(model, mesh["cp"], {target: style})
    for layer in model.layers:  # the gradients summed (averaged) over cp
        fully_shard(layer, mesh=mesh["cp"])
    fully_shard(model, mesh=mesh["cp"])
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    positions = sequence_positions(SEQ, mesh["cp"], load_balance=load_balance)
    for step in range(2):
        tokens, targets = _batch(step)
        ref_logits = reference(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
        mine = shard_sequence(tokens, mesh["cp"], load_balance=load_balance)
        logits = model(mine, positions=positions)
        whole = unshard_sequence(logits.detach(), mesh["cp"], load_balance=load_balance)
        torch.testing.assert_close(whole, ref_logits.detach(), **TOL)
        local_targets = shard_sequence(targets, mesh["cp"], load_balance=load_balance)
        # each rank's mean over its tokens; FSDP2 averages over cp: the mean over all of them
        F.cross_entropy(logits.flatten(0, 1), local_targets.flatten()).backward()
        check_step(model, reference, optim, ref_optim, grad_tol=TOL, param_tol=TOL)


@pytest.mark.parametrize(
    ("rotation", "load_balance", "target"),
    [
        ("p2p", True, "layers.*.attention"),
        ("allgather", False, "layers.*"),
    ],
    ids=["p2p-balanced-attention", "allgather-contiguous-block"],
)
def test_cp2_matches_one_device(rotation, load_balance, target):
    run_distributed(_train, 2, 2, 1, rotation, load_balance, target)


@pytest.mark.four_ranks
@pytest.mark.parametrize("rotation", ["p2p", "allgather"])
def test_cp4_matches_one_device(rotation):
    run_distributed(_train, 4, 4, 1, rotation, True, "layers.*.attention")


@pytest.mark.four_ranks
@pytest.mark.parametrize("rotation", ["p2p", "allgather"])
def test_cp2_tp2_matches_one_device(rotation):
    """Tensor-parallel attention (its heads over tp) on a split sequence: each rank's ring
    carries its local heads. The attention module has a tensor-parallel style: the context-
    parallel one goes on the block around it."""
    run_distributed(_train, 4, 2, 2, rotation, True, "layers.*")
