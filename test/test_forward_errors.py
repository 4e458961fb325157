"""Errors from the forward of a plan whose layouts do not chain, the first-forward check off.

(With it on, the default, such a plan is refused before it runs: test_forward_check.py.)

A hand-written plan that ``parallelize_module`` accepts can still be wrong about what flows
between its modules: two row-parallel layers in a row (an MLP with its styles swapped), or a
column-parallel layer fed by another. Without torch_tp's check, the first forward fails in
aten (``mat1 and mat2 shapes cannot be multiplied``) from inside the style; with it, the
error names the module, its style, both sizes and the layout to change, keeps the type
(``RuntimeError``) and chains aten's error. Each case runs on two ranks, and every rank
raises it (no collective runs before the projection that fails).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import torch_tp
from torch_tp import ColwiseParallel, RowwiseParallel
from torch_tp.testing import device_type, run_distributed


class _MLP(nn.Module):
    """An MLP as public codebases write it (nanoGPT's ``c_fc`` / ``c_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(32, 64)
        self.c_proj = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.nn.functional.gelu(self.c_fc(x)))


def _first_forward_error(plan: dict) -> RuntimeError:
    mesh = init_device_mesh(device_type(), (2,))
    torch.manual_seed(0)
    # the first-forward check refuses such plans before they run (test_forward_check.py);
    # this is what the forward itself says where the check is off
    model = torch_tp.parallelize_module(_MLP(), mesh, plan, check_forward=False)
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8, 32))
    return info.value


def _swapped_styles() -> None:
    err = _first_forward_error({"c_fc": RowwiseParallel(), "c_proj": ColwiseParallel()})
    message = str(err)
    assert "RowwiseParallel" in message and "on 'c_fc' (Linear)" in message, message
    assert "has 32 features" in message and "takes 16 (of 32)" in message, message
    assert "ColwiseParallel" in message and "input_layouts=Replicate()" in message, message
    assert isinstance(err.__cause__, RuntimeError)
    assert "cannot be multiplied" in str(err.__cause__)


def _two_column_parallel_layers() -> None:
    err = _first_forward_error({"c_fc": ColwiseParallel(), "c_proj": ColwiseParallel()})
    message = str(err)
    assert "ColwiseParallel" in message and "on 'c_proj' (Linear)" in message, message
    assert "has 32 features" in message and "takes 64 (of 64)" in message, message
    assert "RowwiseParallel" in message and "input_layouts=Shard(-1)" in message, message


def _other_errors_pass_through() -> None:
    # the sizes match and the plan chains: aten's own error (here a dtype) stays as it is
    mesh = init_device_mesh(device_type(), (2,))
    model = torch_tp.parallelize_module(
        _MLP(), mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    )
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8, 32, dtype=torch.float64))
    assert "dtype" in str(info.value) and "torch_tp" not in str(info.value)
    assert "features" not in str(info.value)


def test_swapped_mlp_styles_name_the_module_and_the_fix():
    run_distributed(_swapped_styles, 2)


def test_column_after_column_names_the_module_and_the_fix():
    run_distributed(_two_column_parallel_layers, 2)


def test_other_errors_in_a_chained_plan_are_left_alone():
    run_distributed(_other_errors_pass_through, 2)
