"""2-D parallelism: TP on ``mesh["tp"]`` composed with FSDP2 on ``mesh["dp"]``.

Four CPU ranks as a (dp=2, tp=2) mesh train the reference Llama with AdamW, each dp rank on
its own half of the batch, and every step is compared with a single-device model trained on
the whole batch: the loss, every gradient, the gradient norm and every parameter.

Tolerances. The gradients agree to float rounding (relative ~1e-6). AdamW divides each
gradient by its running RMS, so for a gradient element near zero a rounding difference of
1e-9 becomes a parameter difference of order ``lr``. ``eps=1e-6`` (instead of 1e-8) caps that
amplification at ``lr * 1e-9 / eps``, which with ``lr=1e-3`` keeps the parameters within
``atol=1e-5`` (measured: 3e-6 after 3 steps; with ``eps=1e-8``, one element of 11264 in a
``w2`` weight was 3e-5 off). Adam is also blind to the scale of the gradients, so the
gradients themselves are compared at every step with tight tolerances: a gradient summed
instead of averaged over dp (or reduced twice over tp) fails there.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import adamw, full_tensor, reference_llama, tp_mesh
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp import clip_grad_norm_
from torch_tp.models import Llama
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-5}
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _parallelize_2d(model: Llama, mesh, sequence_parallel: bool, activation_checkpointing: bool):
    """The recipe: TP on mesh["tp"], then activation checkpointing, then FSDP2 per block
    and at the root on mesh["dp"]."""
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan(sequence_parallel=sequence_parallel))
    for block in model.layers:
        if activation_checkpointing:
            checkpoint(block, context_fn=torch_tp.random.checkpoint_contexts)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _train_2d_parity(
    sequence_parallel: bool, activation_checkpointing: bool, max_norm: float | None, steps: int
) -> list[float]:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    reference = reference_llama(max_seq_len=32)
    model = _parallelize_2d(
        copy.deepcopy(reference), mesh, sequence_parallel, activation_checkpointing
    )
    calls = []  # attention forwards: recomputation runs them again in backward
    model.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    names = [name for name, _ in reference.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()]
    norms = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 1001, (4, 16), generator=gen)
        targets = torch.randint(0, 1001, (4, 16), generator=gen)

        ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        # each dp rank trains on its own slice of the global batch
        mine = slice(dp_rank * 2, dp_rank * 2 + 2)
        loss = F.cross_entropy(model(tokens[mine]).flatten(0, 1), targets[mine].flatten())
        loss.backward()

        if max_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            norm = clip_grad_norm_(model.parameters(), max_norm)
            assert not isinstance(norm, DTensor)
            torch.testing.assert_close(norm, ref_norm, **LOSS_TOL)
            norms.append(ref_norm.item())

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=mesh["dp"].get_group())
        torch.testing.assert_close(global_loss / dp_size, ref_loss.detach(), **LOSS_TOL)
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
    assert len(calls) == steps * (2 if activation_checkpointing else 1)
    return norms


@pytest.mark.four_ranks
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fsdp2_tp_matches_single_device(sequence_parallel):
    run_distributed(_train_2d_parity, 4, sequence_parallel, False, None, 3)


@pytest.mark.four_ranks
def test_fsdp2_tp_activation_checkpointing():
    run_distributed(_train_2d_parity, 4, True, True, None, 3)


@pytest.mark.slow  # the quick run stays under 2 minutes
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fsdp2_tp_gradient_clipping_clipped(sequence_parallel):
    # without sequence parallelism the norms' parameters are DTensors on mesh["dp"] only,
    # beside the others on the (dp, tp) mesh: torch.nn.utils.clip_grad_norm_ refuses that mix
    norms = run_distributed(_train_2d_parity, 4, sequence_parallel, False, 0.5, 3)[0]
    assert min(norms) > 0.5, norms  # the norm is ~1.8: every step was clipped


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_fsdp2_tp_gradient_clipping_unclipped():
    norms = run_distributed(_train_2d_parity, 4, False, True, 100.0, 2)[0]
    assert max(norms) < 100.0, norms  # nothing was clipped


# ---------------------------------------------------------------------- clip_grad_norm_


def _clip_tp_only(sequence_parallel: bool, max_norm: float, norm_type: float) -> None:
    # plain tensors (norms without sequence parallelism) beside DTensors on the TP mesh,
    # which torch.nn.utils.clip_grad_norm_ refuses
    mesh = tp_mesh()
    reference = reference_llama(max_seq_len=32)
    model = torch_tp.parallelize_module(
        copy.deepcopy(reference), mesh, llama_plan(sequence_parallel=sequence_parallel)
    )
    kinds = {type(p) for p in model.parameters()}
    assert kinds == ({DTensor} if sequence_parallel else {DTensor, torch.nn.Parameter}), kinds
    tokens = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (reference, model):
        F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
    torch.testing.assert_close(norm, ref_norm)
    for p, ref_p in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(full_tensor(p.grad), ref_p.grad, **GRAD_TOL)


@pytest.mark.parametrize(
    "sequence_parallel, max_norm, norm_type",
    [(False, 0.5, 2.0), (True, 0.5, 2.0), (False, 1e-3, float("inf")), (False, 100.0, 2.0)],
)
def test_clip_grad_norm_tp_only(sequence_parallel, max_norm, norm_type):
    run_distributed(_clip_tp_only, 2, sequence_parallel, max_norm, norm_type)


def test_clip_grad_norm_plain_tensors_match_torch():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    params.append(torch.nn.Parameter(torch.randn(2)))  # without a gradient: skipped
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, c in zip(params[:3], copies[:3], strict=True):
        p.grad = torch.randn_like(p)
        c.grad = p.grad.clone()
    for foreach in (None, False):
        expected = torch.nn.utils.clip_grad_norm_(copies, 1.0, foreach=foreach)
        torch.testing.assert_close(clip_grad_norm_(params, 1.0, foreach=foreach), expected)
        for p, c in zip(params, copies, strict=True):
            torch.testing.assert_close(p.grad, c.grad)
    assert clip_grad_norm_([], 1.0).item() == 0.0
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
