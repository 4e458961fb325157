"""``clip_grad_norm_(..., pp_mesh=...)``: the norm of every pipeline stage's gradients.

Each rank of a 1-D ``pp`` mesh holds one stage's parameters (their number and sizes differ
per stage, and so do their gradients). The norm must be the norm over all stages' gradients,
the same on every rank, and the clipped gradients those of one process clipping all stages'
parameters together with :func:`torch.nn.utils.clip_grad_norm_`. Two ranks, plain tensors:
the pipeline's own all-reduce and nothing else (the 8-rank pp x dp x tp case is in
``test_pipeline.py``, slow).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing import assert_close

from torch_tp import clip_grad_norm_
from torch_tp.testing import device_type, run_distributed

# each stage's parameter shapes: stage 1's gradients are larger and more numerous
STAGES = (((4, 3), (3,)), ((5, 4), (4, 2), (2,)))


def _stage_parameters(stage: int) -> list[torch.nn.Parameter]:
    """Stage ``stage``'s parameters with their gradients, the same on every rank that asks."""
    gen = torch.Generator().manual_seed(10 + stage)
    params = []
    for shape in STAGES[stage]:
        param = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
        # a scale per stage: the stages' shares of the norm differ
        param.grad = (stage + 1) * torch.randn(shape, generator=gen, dtype=torch.float64)
        params.append(param)
    return params


def _clip_over_stages(norm_type: float, max_norm: float) -> None:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("pp",))
    stage = mesh.get_local_rank()
    # one process with every stage's parameters: the expectation
    everything = [p for s in range(len(STAGES)) for p in _stage_parameters(s)]
    expected_norm = torch.nn.utils.clip_grad_norm_(everything, max_norm, norm_type)
    assert expected_norm > max_norm  # it clips
    mine = []
    for local in _stage_parameters(stage):  # this rank's stage only, on its device
        param = torch.nn.Parameter(local.detach().to(device_type()))
        param.grad = local.grad.to(device_type())
        mine.append(param)
    # stage 0's own norm (unclipped, regenerated) is not the total: a rank that left out
    # the other stages shows
    own_norm = torch.nn.utils.get_total_norm([p.grad for p in _stage_parameters(0)], norm_type)
    assert not torch.allclose(own_norm, expected_norm)

    norm = clip_grad_norm_(mine, max_norm, norm_type, pp_mesh=mesh["pp"])

    assert_close(norm.cpu(), expected_norm)
    norms: list = [None] * dist.get_world_size()
    dist.all_gather_object(norms, norm.item())
    assert norms == [norm.item()] * len(norms), norms  # the same on every rank
    start = sum(len(STAGES[s]) for s in range(stage))
    for index, param in enumerate(mine):
        assert_close(param.grad.cpu(), everything[start + index].grad, msg=f"stage {stage}")


@pytest.mark.parametrize(("norm_type", "max_norm"), [(2.0, 1.0), (1.0, 2.0), (math.inf, 0.5)])
def test_clip_grad_norm_over_pipeline_stages(norm_type: float, max_norm: float):
    run_distributed(_clip_over_stages, 2, norm_type, max_norm)
