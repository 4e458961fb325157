"""torch_tp.checkpoint with packed parameters (PackedColwiseParallel, PackedRowwiseParallel).

A packed parameter is a DTensor with DTensor's strided-shard placement: rank r holds its
slice of each packed part, not one block. On a 1-D TP mesh, loading a full state dict (from
memory, a safetensors file or rank 0) must give each rank exactly what
``distribute_tensor(full, mesh, placements)`` gives, and DCP checkpoints must move between
TP sizes and a single device. Under FSDP2 packed column-parallel parameters (whose packed
dimension FSDP2 shards again) are refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import full_tensor, safetensors_reads, tp_mesh
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from torch_tp import (
    AttentionHeads,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    RowwiseParallel,
    checkpoint,
    parallelize_module,
)
from torch_tp.testing import device_type, run_distributed

DIM, HEADS, HIDDEN = 16, 4, 32  # every packed size divides by parts x 4 ranks


class Conv1D(nn.Module):
    """transformers' ``Conv1D``: ``x @ weight + bias`` with ``weight`` of shape (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.nf,))


def _linear(in_features: int, out_features: int, conv1d: bool) -> nn.Module:
    return Conv1D(out_features, in_features) if conv1d else nn.Linear(in_features, out_features)


class Attention(nn.Module):
    """GPT-2's attention: one fused q/k/v projection, split by ``split_size``."""

    def __init__(self, conv1d: bool) -> None:
        super().__init__()
        self.num_heads, self.split_size = HEADS, DIM
        self.c_attn = _linear(DIM, 3 * DIM, conv1d)
        self.c_proj = _linear(DIM, DIM, conv1d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.split_size, dim=-1)
        shape = (*x.shape[:-1], self.num_heads, -1)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class MLP(nn.Module):
    """A fused gate/up projection (two parts) and a down projection reading both parts."""

    def __init__(self, conv1d: bool) -> None:
        super().__init__()
        self.c_fc = _linear(DIM, 2 * HIDDEN, conv1d)
        self.c_proj = _linear(2 * HIDDEN, DIM, not conv1d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, conv1d: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(conv1d), MLP(conv1d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _model(seed: int = 0) -> nn.Sequential:
    """Two blocks: nn.Linear attention in the first, Conv1D attention in the second."""
    torch.manual_seed(seed)
    return nn.Sequential(Block(conv1d=False), Block(conv1d=True))


PLAN = {
    "*.attn": AttentionHeads("num_heads", divide=("num_heads", "split_size")),
    "*.attn.c_attn": PackedColwiseParallel(3),
    "*.attn.c_proj": RowwiseParallel(),
    "*.mlp.c_fc": PackedColwiseParallel(2),
    "*.mlp.c_proj": PackedRowwiseParallel(2),
}
PACKED = [
    f"{i}.{m}.{p}" for i in "01" for m in ("attn.c_attn", "mlp.c_fc") for p in ("weight", "bias")
]
PACKED += ["0.mlp.c_proj.weight", "1.mlp.c_proj.weight"]


def _tp(seed: int = 0) -> nn.Module:
    model = _model(seed)
    parallelize_module(model, tp_mesh(), PLAN)
    return model


def _input() -> torch.Tensor:
    return torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(0))


def _assert_shards(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """Each rank holds what distribute_tensor of the full tensor gives it, and the packed
    parameters are the strided shards under test."""
    state = model.state_dict()
    assert list(state) == list(expected)
    packed = [
        n
        for n, v in state.items()
        if isinstance(v, DTensor) and isinstance(v.placements[0], _StridedShard)
    ]
    assert sorted(packed) == sorted(PACKED), packed
    for name, value in state.items():
        if isinstance(value, DTensor):
            want = distribute_tensor(expected[name], value.device_mesh, value.placements)
            torch.testing.assert_close(value.to_local(), want.to_local(), rtol=0, atol=0, msg=name)
        else:
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------ full state dicts


def _full_state_dicts(path: str) -> None:

    reference = _model()
    expected = reference.state_dict()
    x = _input()
    expected_out = reference(x)

    # gather: the single-device state dict
    gathered = checkpoint.full_state_dict(_tp())
    assert list(gathered) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(gathered[name], value, rtol=0, atol=0, msg=name)

    def check(model):
        _assert_shards(model, expected)
        torch.testing.assert_close(model(x), expected_out)
        for name, value in checkpoint.full_state_dict(model).items():  # and back
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)

    # from a dict on every rank, and from rank 0 only (other weights before: seed 1)
    model = _tp(seed=1)
    checkpoint.load_full_state_dict(model, expected)
    check(model)
    model = _tp(seed=1)
    source = expected if dist.get_rank() == 0 else None
    checkpoint.load_full_state_dict(model, source, broadcast_from_rank0=True)
    check(model)

    # from a file: one slice per part of a packed tensor, nothing beyond the shard
    model = _tp(seed=1)
    with safetensors_reads() as reads:
        checkpoint.load_full_state_dict(model, path)
    check(model)
    for name, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert sum(reads[name]) == local.numel(), (name, reads[name])
        if name in PACKED:
            parts = 3 if "c_attn" in name else 2
            assert len(reads[name]) == parts, (name, reads[name])


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.four_ranks)])
def test_full_state_dicts(tmp_path, world_size):
    path = tmp_path / "model.safetensors"
    save_file(_model().state_dict(), str(path))
    run_distributed(_full_state_dicts, world_size, str(path))


# ---------------------------------------------------------------- distributed checkpoints


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(_input()).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    _, state = get_state_dict(model, optim)
    return {
        f"{fqn}.{key}": full_tensor(value)
        for fqn, entry in state["state"].items()
        for key, value in entry.items()
    }


def _snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    with torch.no_grad():
        out = model(_input())
    return {
        "model": checkpoint.full_state_dict(model),
        "optim": _full_optim_state(model, optim),
        "out": out,
    }


def _assert_same(actual: dict, expected: dict) -> None:
    for part in ("model", "optim"):
        assert list(actual[part]) == list(expected[part]), part
        for name, value in expected[part].items():
            torch.testing.assert_close(actual[part][name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(actual["out"], expected["out"])


def _dcp_save(ckpt_dir: str, step: int) -> dict:
    """Train one step at this TP size and save."""
    model = _tp() if dist.is_initialized() else _model()
    optim = _adamw(model)
    _train_step(model, optim)
    checkpoint.save(ckpt_dir, model, optim, step=step)
    return _snapshot(model, optim)


def _dcp_load(ckpt_dir: str, step: int) -> dict:
    """Load into another init at this TP size (a plain model without a process group)."""
    model = _tp(seed=1) if dist.is_initialized() else _model(seed=1)
    optim = _adamw(model)
    _train_step(model, optim)  # optimizer state to be overwritten
    assert checkpoint.load(ckpt_dir, model, optim, step=step, rng=False) == step
    if dist.is_initialized():
        _assert_shards(model, checkpoint.full_state_dict(model))
    return _snapshot(model, optim)


@pytest.mark.four_ranks
def test_dcp_across_tp_sizes_and_a_single_device(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_dcp_save, 2, ckpt, 1)[0]
    assert saved["model"].keys() == _model().state_dict().keys()
    for world_size in (4, 2):
        for loaded in run_distributed(_dcp_load, world_size, ckpt, 1):
            _assert_same(loaded, saved)
    # a single device, in this process without a process group; then saved there and
    # loaded back at TP=2
    _assert_same(_dcp_load(ckpt, 1), saved)
    single = _dcp_save(ckpt, 2)
    for loaded in run_distributed(_dcp_load, 2, ckpt, 2):
        _assert_same(loaded, single)


# ------------------------------------------------------------------------------ FSDP2


def _fsdp2_refused(ckpt_dir: str) -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    state = copy.deepcopy(model.state_dict())
    parallelize_module(model, mesh["tp"], PLAN)
    fully_shard(model, mesh=mesh["dp"])
    optim = _adamw(model)
    match = r"0\.attn\.c_attn\.weight: a packed parameter .* not supported under FSDP2 yet"
    with pytest.raises(NotImplementedError, match=match):
        checkpoint.full_state_dict(model)
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(NotImplementedError, match=match):
        checkpoint.load_full_state_dict(model, state)
    with pytest.raises(NotImplementedError, match=match):
        checkpoint.load_full_state_dict(
            model, state if dist.get_rank() == 0 else None, broadcast_from_rank0=True
        )
    with pytest.raises(NotImplementedError, match=match):
        checkpoint.save(ckpt_dir, model, optim, step=1)
    assert not Path(ckpt_dir).exists()
    with pytest.raises(NotImplementedError, match=match):
        checkpoint.load(ckpt_dir + "-existing", model, optim, step=1)
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.to_local(), old)


@pytest.mark.four_ranks
def test_packed_under_fsdp2_is_refused(tmp_path):
    # a complete checkpoint to attempt loading from (any model's will do)
    _dcp_save(str(tmp_path / "ckpt-existing"), 1)
    run_distributed(_fsdp2_refused, 4, str(tmp_path / "ckpt"))
