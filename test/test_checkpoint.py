"""torch_tp.checkpoint: full state dicts (memory, safetensors) and distributed checkpoints.

Full state dicts are compared with the single-device model exactly. Distributed checkpoints
are saved on a (dp=2, tp=2) mesh and loaded on tp=4, on tp=2 and on a single device, where
training continues with the losses of the run that never stopped.
"""

from __future__ import annotations

import os
import pickle
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import (
    adamw,
    checkpoint_llama,
    meta_llama,
    parallelize_dp_tp,
    safetensors_reads,
    saved_then_trained_on,
    sgd,
    tp_mesh,
    train_llama,
)
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp import checkpoint
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _assert_equal_state(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert not isinstance(actual[name], DTensor), name
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------ full_state_dict


def _gather(dp: int, tp: int, sequence_parallel: bool) -> None:
    reference = checkpoint_llama()
    expected = reference.state_dict()
    model, _ = parallelize_dp_tp(checkpoint_llama(), dp, tp, sequence_parallel)
    _assert_equal_state(checkpoint.full_state_dict(model), expected)

    # rank0_only: the other ranks drop each gathered tensor before the next one is gathered
    gathered: list[weakref.ref] = []
    most_alive = 0
    full_tensor = torch_tp.checkpoint.full.full_tensor  # DTensor.full_tensor, or by pieces

    def spy(value):
        nonlocal most_alive
        most_alive = max(most_alive, sum(ref() is not None for ref in gathered))
        out = full_tensor(value)
        gathered.append(weakref.ref(out))
        return out

    with mock.patch.object(torch_tp.checkpoint.full, "full_tensor", spy):
        state = checkpoint.full_state_dict(model, rank0_only=True)
    assert len(gathered) == sum(isinstance(v, DTensor) for v in model.state_dict().values())
    if dist.get_rank() == 0:
        _assert_equal_state(state, expected)
    else:
        assert state == {} and most_alive == 0, most_alive


@pytest.mark.four_ranks
@pytest.mark.parametrize("dp, tp, sequence_parallel", [(2, 2, True), (2, 2, False), (1, 4, False)])
def test_full_state_dict(dp, tp, sequence_parallel):
    run_distributed(_gather, dp * tp, dp, tp, sequence_parallel)


# ------------------------------------------------------------------- load_full_state_dict


def _load_full(path: str, dp: int, tp: int, sequence_parallel: bool) -> None:

    reference = checkpoint_llama()
    expected = reference.state_dict()
    tokens = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(0))
    expected_out = reference(tokens)

    def check(model):
        _assert_equal_state(checkpoint.full_state_dict(model), expected)
        torch.testing.assert_close(model(tokens), expected_out)  # FSDP2 sees the values

    # from the file: each rank reads only its own slices
    model = meta_llama(dp, tp, sequence_parallel)
    with safetensors_reads() as reads:
        result = checkpoint.load_full_state_dict(model, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    local = sum(
        v.to_local().numel() if isinstance(v, DTensor) else v.numel()
        for v in model.state_dict().values()
    )
    read = sum(sum(sizes) for sizes in reads.values())
    assert read == local, (read, local)
    check(model)

    # from a dict every rank holds, and from rank 0 only
    model = meta_llama(dp, tp, sequence_parallel)
    checkpoint.load_full_state_dict(model, expected)
    check(model)
    model = meta_llama(dp, tp, sequence_parallel)
    source = expected if dist.get_rank() == 0 else None
    checkpoint.load_full_state_dict(model, source, broadcast_from_rank0=True)
    check(model)


@pytest.mark.four_ranks
@pytest.mark.parametrize("dp, tp, sequence_parallel", [(2, 2, True), (1, 4, False)])
def test_load_full_state_dict(tmp_path, dp, tp, sequence_parallel):
    path = tmp_path / "model.safetensors"
    save_file(checkpoint_llama().state_dict(), str(path))
    run_distributed(_load_full, dp * tp, str(path), dp, tp, sequence_parallel)


def _load_errors(path: str, evil: str, marker: str) -> None:
    model = meta_llama(1, 2)
    good = checkpoint_llama().state_dict()
    checkpoint.load_full_state_dict(model, checkpoint_llama(seed=3).state_dict())  # defined values
    before = checkpoint.full_state_dict(model)

    bad = dict(good)
    del bad["layers.0.attention.wq.weight"]
    del bad["norm.weight"]
    bad["layers.0.attention.extra"] = torch.zeros(3)
    bad["output.weight"] = torch.zeros(1000, 64)
    with pytest.raises(RuntimeError) as info:
        checkpoint.load_full_state_dict(model, bad)
    message = str(info.value)
    for text in (
        "Missing key(s) in state_dict: 'layers.0.attention.wq.weight', 'norm.weight'.",
        "Unexpected key(s) in state_dict: 'layers.0.attention.extra'.",
        "output.weight: the checkpoint has shape [1000, 64], the model [1001, 64]",
    ):
        assert text in message, message
    # the same error on every rank when only rank 0 holds the dict
    with pytest.raises(RuntimeError, match="Missing key"):
        checkpoint.load_full_state_dict(
            model, bad if dist.get_rank() == 0 else None, broadcast_from_rank0=True
        )
    _assert_equal_state(checkpoint.full_state_dict(model), before)  # nothing was loaded

    # strict=False loads what is there and reports the rest; shapes are still checked
    partial = {k: v for k, v in good.items() if k != "norm.weight"}
    partial["extra"] = torch.zeros(1)
    result = checkpoint.load_full_state_dict(model, partial, strict=False)
    assert result.missing_keys == ["norm.weight"] and result.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match="output.weight"):
        checkpoint.load_full_state_dict(model, {"output.weight": torch.zeros(2, 2)}, strict=False)

    # from a file: the shapes come from the header
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: 'norm.weight'"):
        checkpoint.load_full_state_dict(model, path)
    # a pickle is never unpickled
    with pytest.raises(Exception) as info:
        checkpoint.load_full_state_dict(model, evil)
    assert not os.path.exists(marker), "a pickled payload ran"
    with pytest.raises(TypeError, match="mapping of tensors or the path"):
        checkpoint.load_full_state_dict(model, 42)
    with pytest.raises(FileNotFoundError):
        checkpoint.load_full_state_dict(model, path + ".missing")
    # rank 0 fails to open its file: every rank raises (nobody waits for a broadcast)
    with pytest.raises(FileNotFoundError):
        missing = path + ".missing" if dist.get_rank() == 0 else None
        checkpoint.load_full_state_dict(model, missing, broadcast_from_rank0=True)


def _meta_sequence_parallel_tp_only() -> None:
    model = meta_llama(1, 2, sequence_parallel=True)
    reference = checkpoint_llama()  # one device, the same config
    # nothing is left on meta, and every parameter is laid out as parallelizing a real model
    # lays it out
    expected, _ = parallelize_dp_tp(checkpoint_llama(), 1, 2, sequence_parallel=True)
    expected_params = dict(expected.named_parameters())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.is_meta, f"{name} is still on meta"
    for name, param in model.named_parameters():
        want = expected_params[name]
        assert isinstance(param, DTensor), name
        assert param.placements == want.placements, (name, param.placements, want.placements)
        assert param.to_local().shape == want.to_local().shape, name
    # loaded, it trains like one device
    checkpoint.load_full_state_dict(model, reference.state_dict())
    steps = range(2)
    losses = train_llama(model, None, sgd(model.parameters()), steps)
    ref_losses = train_llama(reference, None, sgd(reference.parameters()), steps)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    full = checkpoint.full_state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_meta_init_of_a_sequence_parallel_tp_model():
    # (with FSDP2 on top it works: FSDP2 replaces the parameters before to_empty)
    run_distributed(_meta_sequence_parallel_tp_only, 2)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_load_full_state_dict_errors(tmp_path):
    path = tmp_path / "partial.safetensors"
    save_file(
        {k: v for k, v in checkpoint_llama().state_dict().items() if k != "norm.weight"}, path
    )
    evil, marker = tmp_path / "evil.safetensors", tmp_path / "marker"
    evil.write_bytes(pickle.dumps({"norm.weight": _Evil(str(marker))}))
    run_distributed(_load_errors, 2, str(path), str(evil), str(marker))
    assert not marker.exists()


# ---------------------------------------------------------------- distributed checkpoints


def _train_and_save(ckpt_dir: str, dropout: float) -> list[float]:
    model, mesh = parallelize_dp_tp(checkpoint_llama(dropout=dropout), 2, 2, sequence_parallel=True)
    torch_tp.random.manual_seed(7, mesh)
    optim = adamw(model.parameters())
    losses = train_llama(model, mesh, optim, range(2))
    checkpoint.save(ckpt_dir, model, optim, step=2)
    return losses + train_llama(model, mesh, optim, range(2, 4))


def _resume(ckpt_dir: str, dp: int, tp: int, dropout: float, rng: bool) -> list[float]:
    # another init and another seed: everything must come from the checkpoint
    model, mesh = parallelize_dp_tp(checkpoint_llama(seed=1, dropout=dropout), dp, tp, tp > 1)
    if mesh is not None:
        torch_tp.random.manual_seed(123, mesh)
    optim = adamw(model.parameters())
    assert checkpoint.load(ckpt_dir, model, optim, rng=rng) == 2
    return train_llama(model, mesh, optim, range(2, 4))


@pytest.mark.four_ranks
def test_save_on_2d_load_on_other_layouts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_train_and_save, 4, ckpt, 0.0)[0]
    assert checkpoint.latest_step(ckpt) == 2
    for dp, tp in [(1, 4), (1, 2)]:
        resumed = run_distributed(_resume, dp * tp, ckpt, dp, tp, 0.0, False)
        for losses in resumed:
            torch.testing.assert_close(losses, uninterrupted[2:], **LOSS_TOL)
    # a single device: this process, without a process group
    torch.testing.assert_close(_resume(ckpt, 1, 1, 0.0, False), uninterrupted[2:], **LOSS_TOL)
    # the RNG streams belong to the layout they were saved on
    with pytest.raises(Exception, match="pass rng=False"):
        run_distributed(_resume, 4, ckpt, 1, 4, 0.0, True)


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_resume_restores_rng_streams(tmp_path):
    # sequence-parallel dropout draws from the default stream: the resumed run must draw
    # the masks the uninterrupted one drew
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_train_and_save, 4, ckpt, 0.1)[0]
    resumed = run_distributed(_resume, 4, ckpt, 2, 2, 0.1, True)[0]
    assert resumed == uninterrupted[2:]
    without_rng = run_distributed(_resume, 4, ckpt, 2, 2, 0.1, False)[0]
    assert without_rng != uninterrupted[2:]


def _failed_save(ckpt_dir: str) -> None:
    model, mesh, optim, saved = saved_then_trained_on(ckpt_dir)

    write_data = dcp.FileSystemWriter.write_data

    def crash(self, plan, planner):
        out = write_data(self, plan, planner)  # some shards are on disk ...
        if dist.get_rank() == 1:
            raise OSError("disk full")  # ... and this rank fails
        return out

    with mock.patch.object(dcp.FileSystemWriter, "write_data", crash):
        # DCP raises its CheckpointException (a BaseException) on every rank; torch_tp
        # turns it into an Exception that says what was lost: nothing
        with pytest.raises(checkpoint.CheckpointError, match="disk full") as info:
            checkpoint.save(ckpt_dir, model, optim, step=2)
    assert isinstance(info.value, Exception)
    assert isinstance(info.value.__cause__, dcp.api.CheckpointException)
    assert "latest complete checkpoint" in str(info.value)
    assert "is step 1, intact" in str(info.value)
    assert checkpoint.latest_step(ckpt_dir) == 1
    if dist.get_rank() == 0:  # the save's rank 0 removed its own staging directory
        assert not list(Path(ckpt_dir).glob("step-2*.partial"))

    model, mesh = parallelize_dp_tp(checkpoint_llama(seed=1), 2, 2)
    optim = adamw(model.parameters())
    assert checkpoint.load(ckpt_dir, model, optim) == 1
    _assert_equal_state(checkpoint.full_state_dict(model), saved)
    with pytest.raises(FileNotFoundError, match="step 2"):
        checkpoint.load(ckpt_dir, model, optim, step=2)
    # saving step 2 again works and replaces the leftover
    checkpoint.save(ckpt_dir, model, optim, step=2)
    assert checkpoint.latest_step(ckpt_dir) == 2
    assert not list(Path(ckpt_dir).glob("step-2*.partial"))


@pytest.mark.four_ranks
def test_failed_save_keeps_previous_checkpoint(tmp_path):
    run_distributed(_failed_save, 4, str(tmp_path / "ckpt"))


def test_load_without_checkpoint(tmp_path):
    model = checkpoint_llama()
    assert checkpoint.latest_step(tmp_path / "nothing") is None
    # a mistyped directory is an error, not a silent fresh start ...
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        checkpoint.load(tmp_path / "nothing", model)
    # ... while an existing one with no checkpoint yet is a fresh start
    (tmp_path / "empty").mkdir()
    assert checkpoint.load(tmp_path / "empty", model) is None
    with pytest.raises(ValueError, match="step"):
        checkpoint.save(tmp_path, model, step=-1)
    # the model alone, in one process without a process group
    assert checkpoint.save(tmp_path / "solo", model, step=5) == tmp_path / "solo" / "step-5"
    other = checkpoint_llama(seed=1)
    assert checkpoint.load(tmp_path / "solo", other, rng=False) == 5
    _assert_equal_state(other.state_dict(), model.state_dict())


# ------------------------------------------------------------------------- peak memory

# 112 MB of float32 weights; on 4 TP ranks a shard is 28 MB and the largest tensor 32 MB
BIG = {
    "dim": 512,
    "n_layers": 4,
    "n_heads": 8,
    "n_kv_heads": 4,
    "vocab_size": 16384,
    "max_seq_len": 64,
}


def _memory() -> dict[str, float]:
    """This process's resident memory and its peak since the last reset, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _reset_peak() -> float:
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    return _memory()["VmRSS"]


def _load_peak_memory(path: str) -> dict[str, float]:
    mesh = tp_mesh()
    with torch.device("meta"):
        model = Llama(tiny_config(**BIG))
    torch_tp.parallelize_module(model, mesh, llama_plan())
    model.to_empty(device=device_type())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    shard = sum(t.numel() * t.element_size() for t in local) / 2**20
    largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20

    base = _reset_peak()
    checkpoint.load_full_state_dict(model, path)  # the shard's pages are first touched here
    load_peak = _memory()["VmHWM"] - base

    base = _reset_peak()
    state = checkpoint.full_state_dict(model, rank0_only=True)
    gather_peak = _memory()["VmHWM"] - base
    del state
    return {"shard": shard, "largest": largest, "load": load_peak, "gather": gather_peak}


@pytest.mark.slow  # the quick run stays under 2 minutes
@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable VmHWM"
)
def test_peak_memory_of_loading_and_gathering(tmp_path):
    path = tmp_path / "big.safetensors"
    torch.manual_seed(0)
    save_file(Llama(tiny_config(**BIG)).state_dict(), str(path))
    size = path.stat().st_size / 2**20
    results = run_distributed(_load_peak_memory, 4, str(path))
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: checkpoint {size:.0f} MB, shard {r['shard']:.1f} MB, peak RSS "
            f"increase while loading {r['load']:.1f} MB, while gathering (rank0_only) "
            f"{r['gather']:.1f} MB"
        )
        # loading: the shard itself plus at most one tensor's pages of the file
        assert r["load"] < r["shard"] + r["largest"] + 8, r
        assert r["load"] < size / 2, r
        if rank != 0:
            # gathering to rank 0: one full tensor at a time elsewhere, which DTensor's
            # all-gather stages through a second buffer of the same size
            assert r["gather"] < 3 * r["largest"], r


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_single_device_names_without_compile_wrapper():
    linear = torch.nn.Linear(3, 2)
    compiled = torch.compile(linear)  # nothing is compiled before the first call
    assert list(compiled.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]
    assert list(checkpoint.full_state_dict(compiled)) == ["weight", "bias"]
    state = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    checkpoint.load_full_state_dict(compiled, state)
    assert torch.equal(linear.weight, torch.ones(2, 3))
