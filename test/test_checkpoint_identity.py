"""Every load checks, before anything changes, that it may: the RNG streams of a DCP
checkpoint belong to where each rank stood in the mesh (its dim names and coordinates), and
every rank loads the same checkpoint (DCP's save id; a fingerprint of a full state dict's
names, shapes, dtypes and values). Otherwise every rank raises the same ``CheckpointError``
and the model, the optimizer and the RNG streams are as they were.

Does not compare a parallelized model against one device (the loads are refused)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import adamw, checkpoint_llama, parallelize_dp_tp, tp_mesh, train_llama
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp import checkpoint
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _snapshot(model, optim=None) -> dict[str, torch.Tensor]:
    """Every tensor of the model (this rank's shards) and of the optimizer's state."""
    out = {f"model.{k}": _local(v).detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(() if optim is None else optim.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = _local(v).detach().clone()
    return out


def _assert_unchanged(before: dict[str, torch.Tensor], model, optim=None) -> None:
    after = _snapshot(model, optim)
    assert list(after) == list(before)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------ RNG streams and the mesh


def _tp_dp_model(names: tuple[str, str]):
    """The checkpoint Llama on a 2x2 mesh with dims ``names``: TP over "tp", FSDP2 over
    "dp", an RNG tracker seeded over the whole mesh, one step trained."""
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=names)
    model = checkpoint_llama(seed=1)
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan())
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    torch_tp.random.manual_seed(123, mesh)
    optim = adamw(model.parameters())
    model(torch.randint(0, 1001, (2, 8))).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _rng_on_another_arrangement(ckpt_dir: str) -> str:
    model, mesh = parallelize_dp_tp(checkpoint_llama(), 2, 2)
    torch_tp.random.manual_seed(7, mesh)
    optim = adamw(model.parameters())
    train_llama(model, mesh, optim, range(1))
    checkpoint.save(ckpt_dir, model, optim, step=1)

    # the same sizes, arranged (tp, dp): rank 1 is tp 0 of the group (1, 3), not tp 1 of (0, 1)
    model, optim = _tp_dp_model(("tp", "dp"))
    before = _snapshot(model, optim)
    streams = torch_tp.random.get_rng_tracker().state_dict()
    default = torch.get_rng_state()
    with pytest.raises(checkpoint.CheckpointError, match="another arrangement") as info:
        checkpoint.load(ckpt_dir, model, optim, rng=True)
    assert isinstance(info.value, ValueError)  # as load documented before
    message = str(info.value)
    assert "saved at dp=0/2,tp=1/2;tp-group=0,1, here at tp=0/2,dp=1/2;tp-group=1,3" in message
    assert "pass rng=False" in message and "Nothing was changed" in message
    _assert_unchanged(before, model, optim)
    after = torch_tp.random.get_rng_tracker().state_dict()
    assert (
        torch.equal(after["tp_state"], streams["tp_state"])
        and after["tp_rank"] == (streams["tp_rank"])
    )
    assert torch.equal(torch.get_rng_state(), default)

    # where every rank stands where it stood, the streams are restored
    model, optim = _tp_dp_model(("dp", "tp"))
    assert checkpoint.load(ckpt_dir, model, optim, rng=True) == 1
    return message


@pytest.mark.four_ranks
def test_rng_streams_on_another_arrangement_of_the_mesh_are_refused(tmp_path):
    messages = run_distributed(_rng_on_another_arrangement, 4, str(tmp_path / "ckpt"))
    assert all(m == messages[0] for m in messages)  # one error, every rank


# ------------------------------------------------------ the same checkpoint on every rank


def _tp_model(seed: int):
    model = checkpoint_llama(seed=seed)
    torch_tp.parallelize_module(model, tp_mesh(), llama_plan())
    return model


def _dcp_sources(root: str) -> list[str]:
    rank = dist.get_rank()
    a, b = f"{root}/a", f"{root}/b"
    for seed, where in ((0, a), (1, b)):  # same step, keys and shapes, other weights
        model = _tp_model(seed)
        optim = adamw(model.parameters())
        train_llama(model, None, optim, range(1))
        checkpoint.save(where, model, optim, step=1)
    saved = _snapshot(model)  # b's
    if rank == 0:
        shutil.copytree(f"{b}/step-1", f"{root}/copy/step-1")
    dist.barrier()

    model = _tp_model(2)
    optim = adamw(model.parameters())
    before = _snapshot(model, optim)
    with pytest.raises(checkpoint.CheckpointError, match="did not read the same") as info:
        checkpoint.load([a, b][rank], model, optim, rng=False)
    _assert_unchanged(before, model, optim)
    assert not optim.state  # it had none, and is given none

    # a copy of one save (each host's own, say) is the same checkpoint
    assert checkpoint.load([b, f"{root}/copy"][rank], model, optim, rng=False) == 1
    _assert_unchanged(saved, model)
    return str(info.value).split(" failed:")[1]


def test_dcp_checkpoints_differing_between_ranks_are_refused(tmp_path):
    first, second = run_distributed(_dcp_sources, 2, str(tmp_path))
    assert first == second


def _full_sources(paths: dict[str, str]) -> list[str]:
    rank = dist.get_rank()
    states = [checkpoint_llama(seed=0).state_dict(), checkpoint_llama(seed=1).state_dict()]
    messages = []
    for given in (
        [paths["a"], paths["b"]],  # two files, same names, shapes and dtypes
        [states[0], states[1]],  # two dicts
        [paths["a"], states[1]],  # a file and a dict
    ):
        model = _tp_model(2)
        before = _snapshot(model)
        with pytest.raises(checkpoint.CheckpointError, match="did not read the same") as info:
            checkpoint.load_full_state_dict(model, given[rank])
        _assert_unchanged(before, model)
        messages.append(str(info.value).split(" failed:")[1])

    # one content is one checkpoint: a copy at another path, or the same tensors in memory
    expected = _snapshot(_tp_model(0))
    for given in ([paths["a"], paths["copy"]], [paths["a"], states[0]]):
        model = _tp_model(2)
        checkpoint.load_full_state_dict(model, given[rank])
        _assert_unchanged(expected, model)
    return messages


def test_full_state_dicts_differing_between_ranks_are_refused(tmp_path):
    paths = {k: str(tmp_path / f"{k}.safetensors") for k in ("a", "b", "copy")}
    save_file(checkpoint_llama(seed=0).state_dict(), paths["a"])
    save_file(checkpoint_llama(seed=1).state_dict(), paths["b"])
    shutil.copyfile(paths["a"], paths["copy"])  # another path and time, the same bytes
    assert Path(paths["copy"]).stat().st_mtime_ns != Path(paths["a"]).stat().st_mtime_ns
    first, second = run_distributed(_full_sources, 2, paths)
    assert first == second
