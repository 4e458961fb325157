"""Staging and publishing checkpoints: the one routine every writer of
:mod:`torch_tp.checkpoint` (DCP steps, Hugging Face directories) publishes through.

A checkpoint ``final`` is written whole into ``final.partial``, its files and directories
fsynced, and made visible by one rename; a ``final`` it replaces is first moved aside to
``final.old`` and deleted only once the new one is visible. So at any point ``final``, or
``final.old`` while ``final`` is missing, is a complete checkpoint: readers look there
(:func:`_visible`), and the next save finishes what a crash left (:func:`_recover_one`).
Private: no public names.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

__all__: list[str] = []

_PARTIAL = ".partial"  # a save in progress, or one that failed: never read
_OLD = ".old"  # the previous checkpoint being replaced, until the new one is in


def _staged_name(final: Path) -> Path:
    return final.with_name(final.name + _PARTIAL)


def _old_name(final: Path) -> Path:
    return final.with_name(final.name + _OLD)


def _staging(final: Path) -> Path:
    """An empty staging directory for ``final``, the leftover of a failed save removed (one
    rank only; call :func:`_recover_one` first)."""
    partial = _staged_name(final)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _publish(partial: Path, final: Path) -> None:
    """Make the complete checkpoint in ``partial`` visible as ``final`` (one rank only).

    Every file under ``partial`` and every directory is fsynced first; then each step is
    atomic and made durable before the next: a crash between two of them leaves ``final``,
    or ``final.old`` with ``final`` missing, complete on disk.
    """
    _fsync_tree(partial)
    old = _old_name(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        _fsync_dir(final.parent)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _recover_one(final: Path, complete: Callable[[Path], bool]) -> None:
    """Finish what a save of ``final`` that crashed while publishing left (one rank, before
    the next save): an old checkpoint whose replacement never arrived goes back in place;
    one whose replacement did is deleted."""
    old = _old_name(final)
    if not old.exists():
        return
    if complete(final):
        shutil.rmtree(old)
    elif not final.exists() and complete(old):
        os.rename(old, final)
        _fsync_dir(final.parent)


def _visible(final: Path, complete: Callable[[Path], bool]) -> Path | None:
    """The complete checkpoint published as ``final``: ``final``, or, while a save of it is
    being published (or crashed while publishing), the ``.old`` one it replaces."""
    for path in (final, _old_name(final)):
        if complete(path):
            return path
    return None


def _fsync_tree(path: Path) -> None:
    """Make every file under ``path``, and the entries of every directory, durable."""
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (where the platform allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)
