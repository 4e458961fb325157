"""Publishing: the one routine every writer of :mod:`torch_tp.checkpoint` (DCP steps and
Hugging Face directories) goes through.

A save claims ``final`` (:func:`begin_save`: one live writer at a time, a crashed one's claim
broken), writes it whole into a staging directory of its own, its files and directories
fsynced, and makes it visible by one rename (:func:`publish`); a ``final`` it replaces is
first moved aside to ``final.old`` and deleted only once the new one is visible. So at any
point ``final``, or ``final.old`` while ``final`` is missing, is a complete checkpoint:
readers look there (:func:`visible_checkpoint`), and the next save finishes what a crash left
(:func:`_recover_one`).

A private module: its names without an underscore are what the writers of
:mod:`torch_tp.checkpoint` use, none of them torch_tp's API (``__all__`` is empty).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_tp.checkpoint._staging import CheckpointError

try:
    import fcntl
except ImportError:  # Windows: claims go by process ids alone
    fcntl = None

__all__: list[str] = []

# ------------------------------------------------------------------------------------------
# Publishing. One save of a checkpoint ``final`` (a DCP step, a Hugging Face directory) at a
# time: the save's rank 0 first claims ``final`` (:func:`begin_save`), writing
# ``<final>.claim`` exclusively, with its identity, and holding an ``flock`` on it until the
# save is over (:func:`end_save`), so that another writer learns who holds it and whether that
# writer still lives. Every save stages under a name of its own, ``<final>.<save id>.partial``
# (the ranks of the save agree on the id): a rank of a job whose rank 0 died, and that has
# not noticed yet, still writes only into its own job's directory, never into the next
# save's. A claim is broken only when its writer is provably gone, and the staging
# directories and crashed publications of ``final`` are tidied only by the claim's holder, so
# no save ever deletes or publishes another live save's work.
# ------------------------------------------------------------------------------------------

_PARTIAL = ".partial"  # a save in progress, or one that failed: never read
OLD_SUFFIX = ".old"  # the previous checkpoint being replaced, until the new one is in
_CLAIM = ".claim"  # who is saving the checkpoint now
# a claim file created but never filled in: its writer died within moments of creating it,
# once the file is this old (while it is younger, the writer may be filling it in now)
_UNFILLED_CLAIM_S = 30.0
# how long a save waits for a claim that another save's tidying holds (for moments)
_TIDYING_WAIT_S = 10.0
_SAVE_ID = re.compile(r"[0-9a-f]{12}")


def _staged_name(final: Path, save_id: str) -> Path:
    return final.with_name(f"{final.name}.{save_id}{_PARTIAL}")


def old_name(final: Path) -> Path:
    return final.with_name(final.name + OLD_SUFFIX)


def _claim_name(final: Path) -> Path:
    return final.with_name(final.name + _CLAIM)


def target_name(name: str) -> str | None:
    """The checkpoint an entry beside it belongs to (``step-3.old``, ``step-3.claim``,
    ``step-3.<id>.partial``, and this module's older ``step-3.partial``: ``step-3``), or
    ``None`` for the checkpoints themselves and any other entry."""
    for suffix in (OLD_SUFFIX, _CLAIM):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    if name.endswith(_PARTIAL):
        stem = name.removesuffix(_PARTIAL)
        target, _, save_id = stem.rpartition(".")
        return target if target and _SAVE_ID.fullmatch(save_id) else stem
    return None


@dataclasses.dataclass
class _Claim:
    """This process's claim on saving ``final``: ``fd`` is the claim file, locked."""

    final: Path
    save_id: str
    fd: int


def begin_save(
    final: Path, complete: Callable[[Path], bool], failed: Callable[[str], str]
) -> tuple[_Claim, Path]:
    """Claim ``final`` for one save and return the claim and the save's own, empty staging
    directory (one rank only; :func:`end_save` releases them). What a crashed save of ``final``
    left is finished first (:func:`_recover_one`), and every staging directory of ``final``
    removed: their writers are gone, or they would hold the claim.

    Raises:
        CheckpointError: another save of ``final`` is in progress (``failed(cause)``
            naming its host, process id, save id and start); nothing was written.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    claim = _claim(final, "save", failed)
    partial = _staged_name(final, claim.save_id)
    try:
        _tidy(final, complete)
        partial.mkdir()
    except BaseException:
        end_save(claim, partial)
        raise
    return claim, partial


def end_save(claim: _Claim, partial: Path) -> None:
    """Remove what is left of this save's staging directory (all of it, unless it was
    published) and release its claim on ``final`` (one rank only)."""
    try:
        shutil.rmtree(partial, ignore_errors=True)
    finally:
        _release(claim)


def recover_if_idle(final: Path, complete: Callable[[Path], bool]) -> None:
    """Finish what crashed saves of ``final`` left, unless a live writer is saving it now:
    another save's work in progress is never touched (one rank only)."""
    try:
        claim = _claim(final, "tidy", None)
    except CheckpointError:
        return  # a live writer holds it: its files are its own
    try:
        _tidy(final, complete)
    finally:
        _release(claim)


def _tidy(final: Path, complete: Callable[[Path], bool]) -> None:
    # holding the claim on ``final``: whoever wrote these is gone
    _recover_one(final, complete)
    for entry in final.parent.iterdir():
        if entry.name.endswith(_PARTIAL) and target_name(entry.name) == final.name:
            shutil.rmtree(entry, ignore_errors=True)


def _claim(final: Path, purpose: str, failed: Callable[[str], str] | None) -> _Claim:
    """Create ``<final>.claim`` exclusively, locked and naming this writer; break a claim
    whose writer is gone (:func:`_gone`). ``failed`` words the error for a live writer's
    claim; without it (tidying) another tidying's claim is not waited for either."""
    path = _claim_name(final)
    save_id = uuid.uuid4().hex[:12]
    deadline = time.monotonic() + _TIDYING_WAIT_S
    for _ in range(1000):  # each round breaks a claim or waits 50 ms: a bound, not a limit
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _CLOEXEC, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:
                continue  # gone (or broken here just now): try again
            busy = holder.get("purpose") != "save"  # being filled in, or tidying for moments
            if failed is not None and busy and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise CheckpointError((failed or str)(_claimed_by(final, path, holder))) from None
        try:
            locked = _lock(fd, wait=True)
            writer = {
                "host": socket.gethostname(),
                "boot": _boot_id(),
                "pid": os.getpid(),
                "save": save_id,
                "purpose": purpose,
                "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "locked": bool(locked),
            }
            os.write(fd, json.dumps(writer).encode())  # durable or not: see _gone
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()  # ours: unfilled, nobody can have broken it yet
            os.close(fd)
            raise
        return _Claim(final, save_id, fd)
    raise CheckpointError((failed or str)(f"cannot claim {str(path)!r}: it keeps changing"))


def _release(claim: _Claim) -> None:
    path = _claim_name(claim.final)
    try:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(claim.fd).st_ino:
                path.unlink()  # before the lock goes: no one sees it unlocked and ours
    finally:
        os.close(claim.fd)


def _holder(path: Path) -> dict[str, Any] | None:
    """Who holds the claim ``path``, if a live writer does: its identity (``{}`` while it
    is being filled in). ``None`` if the claim is gone, or its writer is (then the claim is
    removed here: the caller tries again)."""
    try:
        fd = os.open(path, os.O_RDWR | _CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        locked = _lock(fd, wait=False)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            return None  # released, or broken by someone else, since it was opened
        try:
            holder = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        except ValueError:
            holder = {}
        if not isinstance(holder, dict):
            holder = {}
        if locked is False or not _gone(holder, locked, os.fstat(fd).st_mtime):
            return holder
        # holding its lock (where locks work), so no one else breaks it at the same time
        path.unlink()
        return None
    finally:
        os.close(fd)


def _gone(holder: dict[str, Any], locked: bool | None, mtime: float) -> bool:
    """Whether the writer of a claim is provably gone, given whether this process could
    lock the claim (``None``: this filesystem has no ``flock``)."""
    if not holder:  # never filled in: its writer died creating it, or is filling it in now
        return time.time() - mtime > _UNFILLED_CLAIM_S
    if locked and holder.get("locked"):
        return True  # its writer held the lock for the whole save: only its exit frees it
    # no lock to go by: a writer on this machine (since its last boot) whose process ended
    return (
        holder.get("host") == socket.gethostname()
        and holder.get("boot") == _boot_id()
        and isinstance(holder.get("pid"), int)
        and not _alive(holder["pid"])
    )


def _claimed_by(final: Path, path: Path, holder: dict[str, Any]) -> str:
    if holder.get("purpose") == "save":
        who = (
            f"another save of it is in progress (host {holder.get('host')!r}, pid "
            f"{holder.get('pid')}, save {holder.get('save')}, since {holder.get('since')})"
        )
    elif holder:
        who = f"another job is tidying it (host {holder.get('host')!r}, pid {holder.get('pid')})"
    else:
        who = "another save of it is starting (its claim is not filled in yet)"
    return (
        f"{who}, which holds {str(path)!r}: two saves of one checkpoint at once would mix "
        "their files, so this one wrote nothing. Give each job its own checkpoint "
        "directory, or wait for that save to finish; if that writer is gone (its host is "
        f"down), remove {str(path)!r}"
    )


def _lock(fd: int, *, wait: bool) -> bool | None:
    """``flock`` ``fd`` exclusively: ``True``, ``False`` when another open of the file holds
    it, ``None`` when this filesystem (or platform) has no ``flock``."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise
    return True


_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


@functools.cache
def _boot_id() -> str:
    """This machine's boot (two containers may share a host name, not a kernel's boot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def publish(partial: Path, final: Path) -> None:
    """Make the complete checkpoint in ``partial`` visible as ``final`` (one rank only,
    holding the claim on ``final``).

    Every file under ``partial`` and every directory is fsynced first; then each step is
    atomic and made durable before the next: a crash between two of them leaves ``final``,
    or ``final.old`` with ``final`` missing, complete on disk. If the last rename fails (a
    full disk, say), the previous ``final`` is put back before the error is raised.
    """
    _fsync_tree(partial)
    old = old_name(final)
    moved = final.exists()
    if moved:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        _fsync_dir(final.parent)
    try:
        os.rename(partial, final)
    except OSError:
        if moved:
            with contextlib.suppress(OSError):
                os.rename(old, final)
                _fsync_dir(final.parent)
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _recover_one(final: Path, complete: Callable[[Path], bool]) -> None:
    """Finish what a save of ``final`` that crashed while publishing left (one rank, holding
    the claim on ``final``): an old checkpoint whose replacement never arrived goes back in
    place; one whose replacement did is deleted."""
    old = old_name(final)
    if not old.exists():
        return
    if complete(final):
        shutil.rmtree(old)
    elif not final.exists() and complete(old):
        os.rename(old, final)
        _fsync_dir(final.parent)


def visible_checkpoint(final: Path, complete: Callable[[Path], bool]) -> Path | None:
    """The complete checkpoint published as ``final``: ``final``, or, while a save of it is
    being published (or crashed while publishing), the ``.old`` one it replaces."""
    for path in (final, old_name(final)):
        if complete(path):
            return path
    return None


def _fsync_tree(path: Path) -> None:
    """Make every file under ``path``, and the entries of every directory, durable; a
    failure (a full disk) is an ``OSError`` naming the file."""
    for directory, _, files in os.walk(path):
        for name in files:
            file = os.path.join(directory, name)
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, file) from exc
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (where the platform allows); a
    failure other than a filesystem's refusal is an ``OSError`` naming it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
    finally:
        os.close(fd)
