"""torch_tp.checkpoint under faults: nothing lost, nothing half-loaded, nobody left waiting.

Saves are killed at each point of the protocol (a rank dying while writing, between the two
renames that publish a re-saved step, right after them, and before the final agreement):
the previous or the new checkpoint must be loadable, never neither, and every surviving
rank must raise a ``CheckpointError`` saying so within seconds. Loads are fed files that
are damaged in every way we know (an unreadable dtype, a truncated file, a file that is not
a checkpoint, a checkpoint of a bigger model, a read failing on one rank only, rank 0
failing mid-broadcast): each must raise the same error on every rank, naming the file and
the keys, with the model and optimizer bit-identical to before.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
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
    saved_then_trained_on,
    tiny_hf_llama,
    train_llama,
)
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from torch_tp import checkpoint
from torch_tp.checkpoint import CheckpointError
from torch_tp.checkpoint import dcp as tp_dcp
from torch_tp.checkpoint import safetensors as tp_safetensors
from torch_tp.testing import RankError, run_distributed

# --------------------------------------------------------------------------- helpers


def _snapshot(model, optim=None) -> list[tuple[str, torch.Tensor]]:
    """Every local tensor of the model and the optimizer state, cloned."""
    out = []
    for name, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        out.append((name, local.detach().clone()))
    if optim is not None:
        for i, state in enumerate(optim.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if isinstance(value, DTensor) else value
                    out.append((f"optim.{i}.{key}", local.detach().clone()))
    return out


def _assert_unchanged(before, model, optim=None) -> None:
    after = _snapshot(model, optim)
    assert [n for n, _ in after] == [n for n, _ in before]
    for (name, old), (_, new) in zip(before, after, strict=True):
        assert torch.equal(old, new), f"{name} changed"


def _safetensors_with_dtype(path: Path, state: dict, name: str, dtype: str, nbytes: int) -> None:
    """A safetensors file of ``state`` whose tensor ``name`` is stored as ``dtype`` (same
    shape, ``nbytes`` bytes): a file torch can open and whose header is right."""
    save_file(state, str(path))
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    chunks, offset = [], 0
    for key, meta in sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"),
        key=lambda kv: kv[1]["data_offsets"][0],
    ):
        start, stop = meta["data_offsets"]
        data = body[start:stop] if key != name else bytes(nbytes)
        if key == name:
            meta["dtype"] = dtype
        meta["data_offsets"] = [offset, offset + len(data)]
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


# ------------------------------------------------------------ saves killed at each point


def _die() -> None:
    os._exit(17)


def _save_and_die(ckpt_dir: str, out_dir: str, point: str) -> None:
    """Save step 1, train a step, then save step 1 again, with one rank killed at ``point``."""
    model, _, optim, before = saved_then_trained_on(ckpt_dir)
    after = checkpoint.full_state_dict(model)
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"before": before, "after": after}, os.path.join(out_dir, "states.pt"))
    dist.barrier()

    patches = []
    if point == "write" and rank == 1:
        write_data = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()  # its files are on disk ...
            _die()  # ... and the rank is gone before it reports back

        patches.append(mock.patch.object(dcp.FileSystemWriter, "write_data", write_then_die))
    elif point in ("rename", "renamed") and rank == 0:
        rename = os.rename

        def rename_and_die(src, dst):
            if point == "rename" and str(src).endswith(".partial"):
                _die()  # the old step-1 is already moved aside to step-1.old
            rename(src, dst)
            if point == "renamed" and str(src).endswith(".partial"):
                _die()  # the new step-1 is published, step-1.old still there

        patches.append(mock.patch.object(os, "rename", rename_and_die))
    elif point == "agree" and rank == 3:
        agree = tp_dcp.agree
        calls = []

        def agree_or_die(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # after dcp.save, before the final agreement
                _die()
            return agree(*args, **kwargs)

        patches.append(mock.patch.object(tp_dcp, "agree", agree_or_die))
    try:
        for patch in patches:
            patch.start()
        checkpoint.save(ckpt_dir, model, optim, step=1)
    except CheckpointError as exc:
        Path(out_dir, f"rank{rank}.txt").write_text(str(exc))
        raise
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.parametrize(
    "point, victim, kept",
    [
        pytest.param("write", 1, "before", marks=pytest.mark.slow),
        # every kill replaces the pool of 4 ranks: in the full run only
        pytest.param("rename", 0, "before", marks=pytest.mark.slow),
        pytest.param("renamed", 0, "after", marks=pytest.mark.slow),
        pytest.param("agree", 3, "after", marks=pytest.mark.slow),
    ],
)
def test_killed_save_keeps_a_checkpoint(tmp_path, point, victim, kept):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankError) as info:
        run_distributed(_save_and_die, 4, str(ckpt), str(out), point)
    assert f"the worker process of rank {victim} exited with code 17" in str(info.value)

    # every survivor raised a torch_tp error saying what is intact, within the harness's
    # grace period after the death (seconds, not a collective's 30-minute timeout)
    for rank in sorted({0, 1, 2, 3} - {victim}):
        raised = (out / f"rank{rank}.txt").exists()
        assert raised, f"rank {rank} raised no CheckpointError in time:\n{info.value}"
        message = (out / f"rank{rank}.txt").read_text()
        assert message.startswith(f"saving step 1 to {str(ckpt / 'step-1')!r} failed"), message
        assert "a rank has probably died" in message, message
        assert f"the latest complete checkpoint in {str(ckpt)!r} is step 1, intact" in message

    # the old or the new checkpoint of step 1 is loadable, never neither
    assert checkpoint.latest_step(ckpt) == 1
    states = torch.load(out / "states.pt")
    model = checkpoint_llama(seed=5)
    assert checkpoint.load(ckpt, model, rng=False) == 1
    expected = states[kept]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)

    # the next save finishes what the crash left: no leftover, one step-1
    checkpoint.save(ckpt, model, step=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-1"]


# ------------------------------------------------------- load_full_state_dict under faults


def _load_damaged_files(paths: dict[str, str]) -> None:
    model = meta_llama(1, 2)
    checkpoint.load_full_state_dict(model, checkpoint_llama(seed=3).state_dict())  # defined values
    before = _snapshot(model)

    # one tensor's dtype cannot be converted: nothing is read, both names in the message
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_full_state_dict(model, paths["dtype"])
    assert repr(paths["dtype"]) in str(info.value)
    assert "norm.weight: the checkpoint's dtype 'F4' cannot be loaded" in str(info.value)
    _assert_unchanged(before, model)

    # files that are not safetensors at all name the file
    for kind in ("truncated", "empty", "junk"):
        with pytest.raises(CheckpointError, match="is not a readable safetensors file") as info:
            checkpoint.load_full_state_dict(model, paths[kind])
        assert repr(paths[kind]) in str(info.value)
        with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
            source = paths[kind] if dist.get_rank() == 0 else None
            checkpoint.load_full_state_dict(model, source, broadcast_from_rank0=True)
    _assert_unchanged(before, model)

    # a checkpoint of a deeper model: its extra layers are an error unless strict=False
    with pytest.raises(CheckpointError, match=r"Unexpected key\(s\).*'layers.2.attention"):
        checkpoint.load_full_state_dict(model, paths["deeper"])
    _assert_unchanged(before, model)
    checkpoint.load_full_state_dict(model, paths["deeper"], strict=False)
    torch.testing.assert_close(
        checkpoint.full_state_dict(model)["norm.weight"],
        checkpoint_llama(seed=4, n_layers=3).state_dict()["norm.weight"],
    )


def test_load_full_state_dict_from_damaged_files(tmp_path):
    state = checkpoint_llama().state_dict()
    paths = {k: tmp_path / f"{k}.safetensors" for k in ("dtype", "truncated", "empty", "junk")}
    # F4 packs two values per byte: 64 float4 values in 32 bytes, shape and names unchanged
    _safetensors_with_dtype(paths["dtype"], state, "norm.weight", "F4", 32)
    save_file(state, str(paths["truncated"]))
    paths["truncated"].write_bytes(paths["truncated"].read_bytes()[:-100])
    paths["empty"].write_bytes(b"")
    paths["junk"].write_bytes(b"PK\x03\x04 not a safetensors file at all")
    paths["deeper"] = tmp_path / "deeper.safetensors"
    save_file(checkpoint_llama(seed=4, n_layers=3).state_dict(), str(paths["deeper"]))
    run_distributed(_load_damaged_files, 2, {k: str(v) for k, v in paths.items()})


def _load_failing_on_one_rank(path: str) -> None:
    model = meta_llama(1, 2)
    checkpoint.load_full_state_dict(model, checkpoint_llama(seed=3).state_dict())
    before = _snapshot(model)
    copy_to = tp_safetensors.StateDictSource.copy_to

    def fail_on_rank_1(self, name, pieces, dst):
        if dist.get_rank() == 1 and name == "layers.1.feed_forward.w2.weight":
            raise OSError("Input/output error")
        return copy_to(self, name, pieces, dst)

    with mock.patch.object(tp_safetensors.StateDictSource, "copy_to", fail_on_rank_1):
        for source in (path, checkpoint_llama().state_dict()):
            # rank 0 read everything it needed, rank 1 did not: nobody copies anything
            with pytest.raises(CheckpointError, match="Input/output error") as info:
                checkpoint.load_full_state_dict(model, source)
            assert "'layers.1.feed_forward.w2.weight'" in str(info.value)
            _assert_unchanged(before, model)

    # rank 0 fails reading the third tensor it broadcasts: the others are not left waiting
    read, calls = tp_safetensors.StateDictSource.read, []

    def fail_third(self, name):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("Input/output error")
        return read(self, name)

    with mock.patch.object(tp_safetensors.StateDictSource, "read", fail_third):
        with pytest.raises(CheckpointError, match="Input/output error") as info:
            source = path if dist.get_rank() == 0 else None
            checkpoint.load_full_state_dict(model, source, broadcast_from_rank0=True)
    if dist.get_rank() == 0:  # the one that read, and knows the tensor it failed on
        assert f"could not read {calls[2]!r} from the safetensors file {path!r}" in str(info.value)
    _assert_unchanged(before, model)


def test_load_full_state_dict_failing_on_one_rank(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(checkpoint_llama().state_dict(), str(path))
    run_distributed(_load_failing_on_one_rank, 2, str(path), timeout=60)


def test_lossy_conversions_warn_once():
    model = checkpoint_llama().to(torch.float16)
    state = {k: v.double() for k, v in checkpoint_llama(seed=2).state_dict().items()}
    with pytest.warns(UserWarning, match="loss of precision or range") as record:
        checkpoint.load_full_state_dict(model, state)
    assert len([w for w in record if "loss of precision" in str(w.message)]) == 1
    assert "norm.weight (torch.float64 to torch.float16)" in str(record[0].message)
    # int to float loses large integers; float32 to float64 loses nothing
    with pytest.warns(UserWarning, match=r"x \(torch.int64 to torch.float32\)"):
        checkpoint.load_full_state_dict(
            torch.nn.ParameterDict({"x": torch.zeros(2)}), {"x": torch.ones(2, dtype=torch.int64)}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.load_full_state_dict(
            checkpoint_llama(), checkpoint_llama().double().float().state_dict()
        )


def test_lossy_conversions_of_a_distributed_checkpoint_warn_once(tmp_path):
    # in this process, without a process group: DCP's checks are the same
    checkpoint.save(tmp_path, checkpoint_llama().double(), step=1)
    model = checkpoint_llama(seed=1)
    with pytest.warns(UserWarning, match="loss of precision or range") as record:
        assert checkpoint.load(tmp_path, model, rng=False) == 1
    messages = [str(w.message) for w in record if "loss of precision" in str(w.message)]
    assert len(messages) == 1
    assert "model.norm.weight (torch.float64 to torch.float32)" in messages[0]
    torch.testing.assert_close(model.state_dict(), checkpoint_llama().state_dict())


# ---------------------------------------------------------------- DCP loads under faults


def _save_for_loads(ckpt_dir: str) -> None:
    model, mesh = parallelize_dp_tp(checkpoint_llama(), 2, 2)
    optim = adamw(model.parameters())
    train_llama(model, mesh, optim, range(1))
    checkpoint.save(ckpt_dir, model, optim, step=1)


def _load_damaged_dcp(good: str, truncated: str, corrupt: str, deeper: str, expected: str):
    model, mesh = parallelize_dp_tp(checkpoint_llama(seed=1), 2, 2)
    optim = adamw(model.parameters())
    train_llama(model, mesh, optim, range(3, 4))  # an optimizer with state of its own
    before = _snapshot(model, optim)

    with pytest.raises(CheckpointError) as info:
        checkpoint.load(truncated, model, optim)
    message = str(info.value)
    assert "Unreadable data file" in message and "truncated" in message, message
    assert "holding 'model." in message, message
    _assert_unchanged(before, model, optim)

    with pytest.raises(CheckpointError, match=r"\.metadata' is not a readable DCP metadata"):
        checkpoint.load(corrupt, model, optim)
    _assert_unchanged(before, model, optim)

    with pytest.raises(CheckpointError, match=r"Unexpected key\(s\).*'model.layers.2."):
        checkpoint.load(deeper, model, optim, rng=False)
    _assert_unchanged(before, model, optim)

    # a read that fails on one rank only, inside dcp.load: nobody applies anything
    read_data = dcp.FileSystemReader.read_data

    def fail_on_rank_2(self, plan, planner):
        if dist.get_rank() == 2:
            raise OSError("Input/output error")
        return read_data(self, plan, planner)

    with mock.patch.object(dcp.FileSystemReader, "read_data", fail_on_rank_2):
        with pytest.raises(CheckpointError, match="on rank 2, OSError: Input/output error"):
            checkpoint.load(good, model, optim)
    _assert_unchanged(before, model, optim)

    # an optimizer without state is given none by a failed load
    fresh = adamw(model.parameters())
    with pytest.raises(CheckpointError):
        checkpoint.load(truncated, model, fresh)
    assert not fresh.state

    # strict=False loads the layers the model has from the deeper checkpoint
    assert checkpoint.load(deeper, model, optim, rng=False, strict=False) == 1
    loaded = checkpoint.full_state_dict(model)
    for name, value in torch.load(expected).items():
        if name in loaded:
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    # and the good checkpoint still loads
    assert checkpoint.load(good, model, optim) == 1


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_load_dcp_from_damaged_checkpoints(tmp_path):
    good = tmp_path / "good"
    run_distributed(_save_for_loads, 4, str(good))
    truncated, corrupt = tmp_path / "truncated", tmp_path / "corrupt"
    for copy in (truncated, corrupt):
        (copy / "step-1").mkdir(parents=True)
        for file in (good / "step-1").iterdir():
            (copy / "step-1" / file.name).write_bytes(file.read_bytes())
    data = sorted((truncated / "step-1").glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    (corrupt / "step-1" / ".metadata").write_bytes(b"\x80\x04garbage")
    deeper, expected = tmp_path / "deeper", tmp_path / "deeper.pt"
    model = checkpoint_llama(seed=4, n_layers=3)
    optim = adamw(model.parameters())
    train_llama(model, None, optim, range(1))
    checkpoint.save(deeper, model, optim, step=1)  # in this process, without a group
    torch.save(model.state_dict(), expected)
    paths = (good, truncated, corrupt, deeper, expected)
    run_distributed(_load_damaged_dcp, 4, *map(str, paths))


# ---------------------------------------------- Hugging Face saves killed at each point


def _save_pretrained_and_die(path: str, out_dir: str, point: str) -> None:
    """Save a checkpoint to ``path``, change the model, then save it again to ``path``
    with one rank killed at ``point``."""
    import safetensors.torch
    from helpers import tp_mesh

    from torch_tp import parallelize_module
    from torch_tp.checkpoint import hf as hf_checkpoint
    from torch_tp.plans.hf import plan_for

    model = tiny_hf_llama(seed=0)
    parallelize_module(model, tp_mesh(), plan_for(model))
    hf_checkpoint.save_pretrained(model, path, max_shard_size="20KB")
    before = {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-2)
    after = {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"before": before, "after": after}, os.path.join(out_dir, "states.pt"))
    dist.barrier()

    patches = []
    if point == "write" and rank == 0:  # the second of several files is being written
        save_file, calls = safetensors.torch.save_file, []

        def write_and_die(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                _die()
            return save_file(*args, **kwargs)

        patches.append(mock.patch.object(safetensors.torch, "save_file", write_and_die))
    elif point == "gather" and rank == 1:  # mid-gather: rank 0 is left in a collective
        full_tensor, calls = DTensor.full_tensor, []

        def gather_or_die(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                _die()
            return full_tensor(self, *args, **kwargs)

        patches.append(mock.patch.object(DTensor, "full_tensor", gather_or_die))
    elif point in ("rename", "renamed") and rank == 0:
        rename = os.rename

        def rename_and_die(src, dst):
            if point == "rename" and str(src).endswith(".partial"):
                _die()  # the old checkpoint is already moved aside to <path>.old
            rename(src, dst)
            if point == "renamed" and str(src).endswith(".partial"):
                _die()  # the new one is published, <path>.old still there

        patches.append(mock.patch.object(os, "rename", rename_and_die))
    elif point == "agree" and rank == 1:
        agree, calls = hf_checkpoint.agree, []

        def agree_or_die(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # after rank 0 published, before the final agreement
                _die()
            return agree(*args, **kwargs)

        patches.append(mock.patch.object(hf_checkpoint, "agree", agree_or_die))
    try:
        for patch in patches:
            patch.start()
        hf_checkpoint.save_pretrained(model, path, max_shard_size="20KB")
    except CheckpointError as exc:
        Path(out_dir, f"rank{rank}.txt").write_text(str(exc))
        raise
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.slow  # each kill replaces the pool of 2 ranks
@pytest.mark.parametrize(
    "point, victim, kept",
    [
        ("write", 0, "before"),
        ("gather", 1, "before"),
        ("rename", 0, "before"),
        ("renamed", 0, "after"),
        ("agree", 1, "after"),
    ],
)
def test_killed_save_pretrained_keeps_a_checkpoint(tmp_path, point, victim, kept):
    pytest.importorskip("transformers")
    from torch_tp.checkpoint.hf import load_pretrained, save_pretrained

    path, out = tmp_path / "hf", tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankError) as info:
        run_distributed(_save_pretrained_and_die, 2, str(path), str(out), point)
    assert f"the worker process of rank {victim} exited with code 17" in str(info.value)

    # the survivor raised a torch_tp error saying the previous checkpoint is intact
    survivor = 1 - victim
    assert (out / f"rank{survivor}.txt").exists(), f"no CheckpointError in time:\n{info.value}"
    message = (out / f"rank{survivor}.txt").read_text()
    assert message.startswith(f"saving {str(path)!r} failed"), message
    assert "probably died" in message and "Nothing was lost" in message, message
    if point == "rename":
        assert f"the previous checkpoint is intact at {str(path) + '.old'!r}" in message
    else:
        assert f"the checkpoint at {str(path)!r} is intact" in message, message

    # the previous or the new checkpoint loads, never neither (mid-replacement: from .old)
    assert path.exists() != (point == "rename")
    expected = torch.load(out / "states.pt")[kept]
    model = tiny_hf_llama(seed=1)
    load_pretrained(model, path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)

    # the next save finishes what the crash left: no leftover beside the one directory
    save_pretrained(model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


# ------------------------------------------- one rank's bad input: every rank, same error


def _one_bad_rank(root: str) -> list[str]:
    """Each check that guards a collective of a save or load, failing on rank 1 only,
    raises the same error on every rank (no rank is left in a collective)."""
    from torch_tp.checkpoint import hf as hf_checkpoint

    bad = dist.get_rank() == 1
    model = meta_llama(1, 2)
    checkpoint.load_full_state_dict(model, checkpoint_llama().state_dict())
    messages = []

    def same_everywhere(error_type, call, match):
        with pytest.raises(error_type, match=match) as info:
            call()
        messages.append(str(info.value))

    ckpt, hf = os.path.join(root, "ckpt"), os.path.join(root, "hf")
    # save: a step that is not one on rank 1, or another step there
    same_everywhere(
        ValueError,
        lambda: checkpoint.save(ckpt, model, step=-1 if bad else 1),
        "step must be a non-negative int, found -1",
    )
    with pytest.raises(CheckpointError) as info:  # each rank names the step it was given
        checkpoint.save(ckpt, model, step=2 if bad else 1)
    assert "failed: the ranks do not agree on the step (rank 0: '1', rank 1: '2')" in str(
        info.value
    )
    assert not os.path.exists(ckpt)  # nothing written
    checkpoint.save(ckpt, model, step=1)
    # load: rank 1 cannot see the directory, or asks for another step
    missing = os.path.join(root, "elsewhere")
    same_everywhere(
        FileNotFoundError, lambda: checkpoint.load(missing if bad else ckpt, model), "elsewhere"
    )
    same_everywhere(
        FileNotFoundError, lambda: checkpoint.load(ckpt, model, step=7 if bad else 1), "step 7"
    )
    # save_pretrained: a shard size that is not one on rank 1: nothing written
    same_everywhere(
        ValueError,
        lambda: hf_checkpoint.save_pretrained(model, hf, max_shard_size="5XB" if bad else "5GB"),
        "max_shard_size",
    )
    assert not os.path.exists(hf) and not os.path.exists(hf + ".partial")
    # load_pretrained: rank 1 finds no checkpoint
    same_everywhere(
        FileNotFoundError,
        lambda: hf_checkpoint.load_pretrained(model, missing if bad else root),
        "no model.safetensors",
    )
    # load_full_state_dict from rank 0: rank 1's model is another one
    other = meta_llama(1, 2, n_layers=3) if bad else model
    path = os.path.join(root, "llama.safetensors")
    same_everywhere(
        CheckpointError,
        lambda: checkpoint.load_full_state_dict(
            other, path if not bad else None, broadcast_from_rank0=True
        ),
        r"on rank\(s\) \[1\] differ from rank 0's",
    )
    return messages


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_one_bad_rank_fails_every_rank_alike(tmp_path):
    save_file(checkpoint_llama().state_dict(), str(tmp_path / "llama.safetensors"))
    save_file(checkpoint_llama().state_dict(), str(tmp_path / "model.safetensors"))  # HF dir
    first, second = run_distributed(_one_bad_rank, 2, str(tmp_path), timeout=120)
    assert first == second
