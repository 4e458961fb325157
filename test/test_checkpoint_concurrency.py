"""torch_tp.checkpoint under concurrent writers: two saves into one checkpoint location never
both report success for a checkpoint that is not whole and theirs.

A save claims its target (``step-N``, a Hugging Face directory) before it writes, and stages
under a name of its own. These tests force a second save in at each stage of a first one
(while it writes, once it has staged everything, between its two publishing renames), kill
a first save holding its claim, save two steps at once, and let two independent jobs (two
2-rank gloo groups, two processes) race for the same step again and again. After each, a
job told success finds exactly its own tensors in the checkpoint, and the other was told
who holds it. Disk-full failures anywhere in ``save_pretrained`` are injected on every rank:
a ``CheckpointError`` naming the file, the previous checkpoint intact, nothing left behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import checkpoint_llama, tiny_hf_llama, tp_mesh

import torch_tp
from torch_tp import checkpoint
from torch_tp.checkpoint import CheckpointError
from torch_tp.checkpoint import dcp as tp_dcp
from torch_tp.checkpoint import hf as tp_hf
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import run_distributed

# --------------------------------------------------------------------------- helpers


def _offset(model: torch.nn.Module, value: float) -> torch.nn.Module:
    """Add ``value`` to every tensor of the model: each job's checkpoint is told apart by it."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(value)
    return model


def _llama(job: int) -> torch.nn.Module:
    return _offset(checkpoint_llama(seed=job), 10.0 * job)


def _assert_holds(root: Path, expected: torch.nn.Module, step: int = 1) -> None:
    """``step`` in ``root`` loads whole, with exactly ``expected``'s tensors."""
    model = checkpoint_llama(seed=7)
    assert checkpoint.load(root, model, step=step, rng=False) == step
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=0, atol=0)


def _hf_llama(seed: int) -> torch.nn.Module:
    return _offset(tiny_hf_llama(seed), 10.0 * seed)


def _assert_hf_holds(path: Path, expected: torch.nn.Module) -> None:
    model = _hf_llama(seed=9)
    tp_hf.load_pretrained(model, path)
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=0, atol=0)


def _names_the_writer(message: str, pid: int) -> None:
    assert "another save of it is in progress" in message, message
    assert f"host {socket.gethostname()!r}, pid {pid}," in message, message
    assert "wrote nothing" in message, message


class _Paused:
    """Run ``fn`` in thread "A" and stop it at the first call of the patched point, until
    :meth:`resume`; other threads pass through the point untouched."""

    def __init__(self, fn):
        self.at, self.go = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.result = None

        def run():
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - checked by the test
                self.error = exc
            finally:
                self.at.set()  # a save that failed before the point

        self.thread = threading.Thread(target=run, name="A", daemon=True)

    def hook(self, real):
        def wrapped(*args, **kwargs):
            if threading.current_thread() is self.thread and not self.go.is_set():
                self.at.set()
                assert self.go.wait(60)
            return real(*args, **kwargs)

        return wrapped

    def start(self) -> None:
        self.thread.start()
        assert self.at.wait(60), "A never reached the point"
        assert self.error is None, self.error

    def resume(self) -> None:
        self.go.set()
        self.thread.join(60)
        if self.error is not None:
            raise self.error


def _patched_point(point: str, paused: _Paused, final: Path):
    """A patch that stops thread A at ``point`` of a DCP save of ``final``."""
    if point == "writing":  # claimed and staging, no data written yet
        return mock.patch.object(
            dcp.FileSystemWriter, "write_data", paused.hook(dcp.FileSystemWriter.write_data)
        )
    if point == "staged":  # every file written, not yet published
        return mock.patch.object(tp_dcp, "publish", paused.hook(tp_dcp.publish))
    # between the two renames: the old step-N moved aside, the new one not yet in place
    rename = os.rename

    def second_rename(src, dst):
        if threading.current_thread() is paused.thread and os.fspath(dst) == str(final):
            return paused.hook(rename)(src, dst)
        return rename(src, dst)

    return mock.patch.object(os, "rename", second_rename)


# ------------------------------------------------ a second save forced in at each stage


@pytest.mark.parametrize("point", ["writing", "staged", "publishing"])
def test_second_save_of_a_step_is_refused_at_each_stage(tmp_path, point):
    root = tmp_path / "ckpt"
    checkpoint.save(root, _llama(0), step=1)  # the checkpoint A replaces
    a, b = _llama(1), _llama(2)
    paused = _Paused(lambda: checkpoint.save(root, a, step=1))
    with _patched_point(point, paused, root / "step-1"):
        paused.start()
        # B, another job saving the same step now, is told who holds it and writes nothing
        with pytest.raises(CheckpointError) as info:
            checkpoint.save(root, b, step=1)
        message = str(info.value)
        assert message.startswith(f"saving step 1 to {str(root / 'step-1')!r} failed: "), message
        _names_the_writer(message, os.getpid())
        paused.resume()  # A was not disturbed: it publishes its own checkpoint, whole
    _assert_holds(root, a)
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    # the claim is gone with A's save: B may save now, and replaces A's checkpoint
    checkpoint.save(root, b, step=1)
    _assert_holds(root, b)


def test_second_save_pretrained_is_refused(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "hf"
    tp_hf.save_pretrained(_hf_llama(0), path)
    a, b = _hf_llama(1), _hf_llama(2)
    paused = _Paused(lambda: tp_hf.save_pretrained(a, path, max_shard_size="20KB"))
    with mock.patch.object(tp_hf, "publish", paused.hook(tp_hf.publish)):
        paused.start()  # A's shards, index and config are staged
        with pytest.raises(CheckpointError) as info:
            tp_hf.save_pretrained(b, path)
        message = str(info.value)
        assert message.startswith(f"saving {str(path)!r} failed: "), message
        _names_the_writer(message, os.getpid())
        paused.resume()
    _assert_hf_holds(path, a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---------------------------------------- a writer that died holding its claim, and others


def _die_before_publishing(root: str, record: str) -> None:
    def die(partial, final):
        Path(record).write_text(str(partial))  # where this job's files are
        os._exit(17)  # every file written, claim held, nothing published

    with mock.patch.object(tp_dcp, "publish", die):
        checkpoint.save(root, _llama(1), step=1)


def _context():
    """Processes started as the harness starts its workers (a fork of torch in a process
    whose threads have run torch ops can hang)."""
    method = "forkserver" if sys.platform.startswith("linux") else "spawn"
    return multiprocessing.get_context(method)


def _started(target, *args) -> multiprocessing.Process:
    process = _context().Process(target=target, args=args)
    process.start()
    return process


def _save_with_a_late_write(root: Path, model: torch.nn.Module, late: Path) -> None:
    """Save ``model`` as step 1 while a rank of a dead job, which has not noticed its rank 0
    die, writes its shard file late into ``late``, where that job staged."""
    publish = tp_dcp.publish

    def late_write_then_publish(partial, final):
        with pytest.raises(FileNotFoundError):  # removed with the dead job's claim
            (late / "__0_0.distcp").write_bytes(b"rank 1 of the dead job, late")
        return publish(partial, final)

    with mock.patch.object(tp_dcp, "publish", late_write_then_publish):
        checkpoint.save(root, model, step=1)


def test_a_dead_writers_claim_is_broken_and_its_files_stay_its_own(tmp_path):
    root = tmp_path / "ckpt"
    checkpoint.save(root, _llama(0), step=1)
    # what a save killed before publishing leaves: its claim, locked while it lived (this
    # process is alive: the free lock, not the process id, says the writer is gone), and
    # its staging directory
    _claim_file(root / "step-1", pid=os.getpid(), locked=True)
    staged = root / "step-1.0123456789ab.partial"
    staged.mkdir()
    (staged / ".metadata").write_bytes(b"the dead job's")
    b = _llama(2)
    _save_with_a_late_write(root, b, staged)
    _assert_holds(root, b)
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]  # its litter is gone too


@pytest.mark.slow  # a process of its own
def test_a_killed_save_leaves_its_claim_to_be_broken(tmp_path):
    root, record = tmp_path / "ckpt", tmp_path / "a-staged-at.txt"
    checkpoint.save(root, _llama(0), step=1)
    dead = _started(_die_before_publishing, str(root), str(record))
    dead.join(120)
    assert dead.exitcode == 17
    b = _llama(2)
    _save_with_a_late_write(root, b, Path(record.read_text()))
    _assert_holds(root, b)
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]


def _claim_file(final: Path, **writer) -> Path:
    boot = Path("/proc/sys/kernel/random/boot_id")
    identity = {
        "host": socket.gethostname(),
        "boot": boot.read_text().strip() if boot.exists() else "",
        "save": "0123456789ab",
        "purpose": "save",
        "since": "2025-01-01 00:00:00 +0000",
        "locked": False,  # as on a filesystem without flock: judged by the process id
        **writer,
    }
    path = final.with_name(final.name + ".claim")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity) if writer.get("pid") is not None else "")
    return path


def test_claims_without_a_lock_are_judged_by_their_process(tmp_path, monkeypatch):
    with contextlib.suppress(ImportError):  # a claim being filled in is waited for 0.2 s
        from torch_tp.checkpoint import _publishing

        monkeypatch.setattr(_publishing, "_TIDYING_WAIT_S", 0.2)
    root, model = tmp_path / "ckpt", _llama(3)
    # a live process on this machine (this one), another machine's writer: refused
    for writer in ({"pid": os.getpid()}, {"pid": 1, "host": "elsewhere", "boot": "x"}):
        claim = _claim_file(root / "step-1", **writer)
        with pytest.raises(CheckpointError, match="another save of it is in progress") as info:
            checkpoint.save(root, model, step=1)
        assert f"pid {writer['pid']}, save 0123456789ab" in str(info.value)
        assert f"remove {str(claim)!r}" in str(info.value)
        assert not (root / "step-1").exists()
    # a claim being filled in right now: refused once it stays empty; an old empty one is
    # a writer that died creating it
    claim = _claim_file(root / "step-1")
    with pytest.raises(CheckpointError, match="another save of it is starting"):
        checkpoint.save(root, model, step=1)
    os.utime(claim, (time.time() - 3600,) * 2)
    checkpoint.save(root, model, step=1)
    _assert_holds(root, model)
    # a process of this machine that has ended: its claim is broken
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    _claim_file(root / "step-1", pid=ended.pid)
    checkpoint.save(root, _llama(4), step=1)
    _assert_holds(root, _llama(4))
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]


def test_two_steps_saved_at_once(tmp_path):
    root = tmp_path / "ckpt"
    checkpoint.save(root, _llama(0), step=1)
    a, b = _llama(1), _llama(2)
    paused = _Paused(lambda: checkpoint.save(root, a, step=1))
    with _patched_point("publishing", paused, root / "step-1"):
        paused.start()  # step-1 is moved aside as step-1.old, A's new one not in place yet
        # B saves step 2 meanwhile; its tidying of the root leaves step 1 to its live writer
        checkpoint.save(root, b, step=2)
        assert (root / "step-1.old").is_dir()
        assert checkpoint.latest_step(root) == 2
        paused.resume()
    _assert_holds(root, a, step=1)
    _assert_holds(root, b, step=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]


# ------------------------------------------------------------ unforced races, repeated


_REPEATS = 5  # each a race; 12 in a row held when written, 5 keep the slow run short


def _race_job(job: int, rank: int, store: str, root: str, barrier, results) -> None:
    """One rank of one of two 2-rank jobs, saving step 1 into the same directory as the
    other job at the same moment, ``_REPEATS`` times."""
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        model = _llama(job)
        torch_tp.parallelize_module(model, tp_mesh(), llama_plan())
        for repeat in range(_REPEATS):
            _offset(model, 1.0)  # each repeat saves other values
            barrier.wait(60)
            try:
                checkpoint.save(os.path.join(root, f"r{repeat}"), model, step=1)
                outcome = None
            except CheckpointError as exc:
                outcome = str(exc)
            results.put((job, rank, repeat, os.getpid(), outcome))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((job, rank, -1, os.getpid(), traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def _saved_at(model: torch.nn.Module, repeat: int) -> torch.nn.Module:
    """What a racing job saved at ``repeat``: its model, offset as the job offsets it."""
    for _ in range(repeat + 1):
        _offset(model, 1.0)
    return model


def _check_race(root: Path, outcomes: dict, pids: dict, state, load) -> None:
    for repeat in range(_REPEATS):
        told = {job: outcomes[job, repeat] for job in (0, 1)}
        won = [job for job, error in told.items() if error is None]
        assert won, f"repeat {repeat}: neither job saved: {told}"
        holders = []
        for job in (0, 1):
            try:
                load(root / f"r{repeat}", state(job, repeat))
                holders.append(job)
            except (AssertionError, CheckpointError, FileNotFoundError):
                pass
        # whole, and exactly one job's tensors: a job that was told success
        assert len(holders) == 1 and holders[0] in won, (repeat, holders, told)
        for job, error in told.items():
            if error is not None:  # the other one held the claim, and is named
                _names_the_writer(error, pids[1 - job])


def _collect(results, procs, count: int) -> list:
    got = []
    deadline = time.monotonic() + 240
    while len(got) < count and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: are they still running?
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    failures = [r for r in got if r[2] == -1]
    assert not failures, failures[0][4]
    assert len(got) == count, f"{len(got)} of {count} results"
    return got


@pytest.mark.slow  # four processes of its own
def test_two_jobs_race_for_one_step(tmp_path):
    ctx = _context()
    barrier, results = ctx.Barrier(4), ctx.Queue()
    root = tmp_path / "ckpt"
    procs = [
        _started(_race_job, job, rank, str(tmp_path / f"store{job}"), str(root), barrier, results)
        for job in (0, 1)
        for rank in (0, 1)
    ]
    got = _collect(results, procs, 4 * _REPEATS)
    outcomes, pids = {}, {}
    for job, rank, repeat, pid, outcome in got:
        if rank == 0:
            pids[job] = pid
            outcomes[job, repeat] = outcome
    for job, rank, repeat, _, outcome in got:  # every rank of a job learnt the same
        assert outcome == outcomes[job, repeat], (job, rank, repeat)
    _check_race(root, outcomes, pids, lambda j, r: _saved_at(_llama(j), r), _assert_holds)


def _hf_race_job(job: int, root: str, barrier, results) -> None:
    try:
        model = _hf_llama(job)
        for repeat in range(_REPEATS):
            _offset(model, 1.0)
            barrier.wait(60)
            try:
                tp_hf.save_pretrained(
                    model, os.path.join(root, f"r{repeat}"), max_shard_size="20KB"
                )
                outcome = None
            except CheckpointError as exc:
                outcome = str(exc)
            results.put((job, 0, repeat, os.getpid(), outcome))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((job, 0, -1, os.getpid(), traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


@pytest.mark.slow  # two processes of their own
def test_two_processes_race_for_one_hf_directory(tmp_path):
    pytest.importorskip("transformers")
    ctx = _context()
    barrier, results = ctx.Barrier(2), ctx.Queue()
    root = tmp_path / "hf"
    procs = [_started(_hf_race_job, job, str(root), barrier, results) for job in (0, 1)]
    got = _collect(results, procs, 2 * _REPEATS)
    outcomes = {(job, repeat): outcome for job, _, repeat, _, outcome in got}
    pids = {job: pid for job, _, _, pid, _ in got}

    state = lambda job, repeat: _saved_at(_hf_llama(job), repeat)  # noqa: E731
    _check_race(root, outcomes, pids, state, _assert_hf_holds)
    for repeat in range(_REPEATS):
        assert not list(root.glob(f"r{repeat}.*")), "staging or claims left behind"


# ------------------------------------------------ disk full anywhere in save_pretrained


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")  # as write() raises it: no name


def _disk_full_patch(stage: str, path: Path):
    """A patch making ``stage`` of a save_pretrained of ``path`` fail as a full disk does,
    and the file the error must name."""
    import safetensors.torch
    import transformers

    if stage == "shard":  # the second shard file
        save_file, calls = safetensors.torch.save_file, []

        def second_fails(*args, **kwargs):
            calls.append(1)
            return _no_space() if len(calls) == 2 else save_file(*args, **kwargs)

        return mock.patch.object(safetensors.torch, "save_file", second_fails), "model-00002"
    if stage == "index":
        write_text = pathlib.Path.write_text

        def index_fails(self, *args, **kwargs):
            if self.name == "model.safetensors.index.json":
                _no_space()
            return write_text(self, *args, **kwargs)

        patch = mock.patch.object(pathlib.Path, "write_text", index_fails)
        return patch, "model.safetensors.index.json"
    if stage == "config":
        patch = mock.patch.object(transformers.PretrainedConfig, "to_json_file", _no_space)
        return patch, "config.json"
    if stage == "fsync":
        return mock.patch.object(os, "fsync", _no_space), ".safetensors"
    rename = os.rename

    def rename_fails(src, dst):
        if stage == "rename" and str(src).endswith("model-00001.safetensors"):
            _no_space()
        if stage == "publish" and str(src).endswith(".partial") and os.fspath(dst) == str(path):
            # the old checkpoint is aside as hf.old: put back after this
            _no_space()
        return rename(src, dst)

    return mock.patch.object(os, "rename", rename_fails), (
        "model-00001-of-" if stage == "rename" else str(path)
    )


_STAGES = ("shard", "index", "config", "fsync", "rename", "publish")


def _save_pretrained_on_a_full_disk(root: str) -> None:
    from helpers import tp_mesh

    from torch_tp.plans.hf import plan_for

    path = Path(root) / "hf"
    model = _hf_llama(seed=0)
    torch_tp.parallelize_module(model, tp_mesh(), plan_for(model))
    tp_hf.save_pretrained(model, path, max_shard_size="20KB")
    before = {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}
    _offset(model, 1.0)
    for stage in _STAGES:
        patch, named = _disk_full_patch(stage, path)
        with patch, pytest.raises(CheckpointError) as info:  # on every rank
            tp_hf.save_pretrained(model, path, max_shard_size="20KB")
        message = str(info.value)
        assert message.startswith(f"saving {str(path)!r} failed: cannot "), (stage, message)
        assert "No space left on device" in message and named in message, (stage, message)
        assert f"the checkpoint at {str(path)!r} is intact" in message, (stage, message)
        dist.barrier()
        # the previous checkpoint is in place, whole, and nothing else is left beside it
        assert sorted(p.name for p in Path(root).iterdir()) == ["hf"], stage
        reloaded = _hf_llama(seed=5)
        tp_hf.load_pretrained(reloaded, path)
        for name, value in reloaded.state_dict().items():
            torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
        dist.barrier()


def test_disk_full_anywhere_in_save_pretrained(tmp_path):
    pytest.importorskip("transformers")
    run_distributed(_save_pretrained_on_a_full_disk, 2, str(tmp_path), timeout=120)
