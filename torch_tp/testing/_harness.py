"""A pool of worker processes that runs a function on every rank of a process group.

Spawning ranks and initialising a process group costs seconds, a test costs milliseconds. So
the pool for a world size is spawned once per process (once per pytest session) and reused by
every :func:`run_distributed` call of that size. A failure on one rank comes back as a
:class:`RankError` carrying that rank's traceback; a hang is killed at a timeout and the pool is
dropped, so the next call gets a fresh one.

Messages between the parent and the workers are pickled explicitly before they are queued: a
value that cannot be pickled then fails where we can report it, instead of in a queue's feeder
thread where the error would be lost. For the same reason a function the workers could not
import (a lambda, a nested function, one defined in the ``__main__`` of a notebook or of
``python -c``) is refused in the parent, before any worker runs.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import multiprocessing.process
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torch_tp import _torch_compat as compat

__all__ = ["RankError", "RankTimeout", "device_type", "run_distributed", "shutdown"]

T = TypeVar("T")

_DEFAULT_TIMEOUT = 120.0
# Spawning a pool (importing torch in every rank, rendezvous) is not charged to a call's timeout.
_STARTUP_TIMEOUT = 300.0
# After a rank fails, how long the others get to finish before the pool is replaced.
_FAILURE_GRACE = 3.0
# How often the parent checks for dead workers while it waits for results.
_POLL_INTERVAL = 0.2

# Workers start with nothing of the parent's state (CUDA, threads). On Linux they are forked
# from multiprocessing's fork server: a process started fresh once, which imports the torch
# modules below (no CUDA call; not torch_tp, which the workers import from the parent's
# sys.path like any test file) and then only forks. A pool then starts in well under a second
# instead of every rank importing torch for seconds, which counts because a pool is replaced
# after every hang or death. Elsewhere (macOS, where forking after importing system frameworks
# is unsafe; Windows) they are spawned: fresh interpreters. Either way a worker gets the
# parent's sys.path, __main__ (re-run as __mp_main__ where possible) and environment.
_START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.debug",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
]
# More modules for the fork server to import, comma-separated: those the functions run on the
# ranks import (``transformers``, a model's module), which every worker would otherwise import
# again. A module that is not installed is skipped (as multiprocessing's preload skips it).
_PRELOAD_VARIABLE = "TORCH_TP_TESTING_PRELOAD"


def _preload() -> list[str]:
    extra = os.environ.get(_PRELOAD_VARIABLE, "")
    return _FORKSERVER_PRELOAD + [name.strip() for name in extra.split(",") if name.strip()]


# Tags of the messages a worker sends to the parent: (tag, task id, rank, pickled result or
# exception, traceback), except that an _OK message ends with the number of process groups
# the rank holds instead.
_READY, _INIT_FAILED, _OK, _FAILED = "ready", "init_failed", "ok", "failed"
# A pool whose ranks hold more process groups than this after a call is closed, and the next
# call starts a new one (well under a second). Tests make groups (each 2-D mesh one per
# dimension, checkpoints one to coordinate) that nothing destroys: DTensor's caches keep the
# meshes that name them, so a worker cannot destroy them itself. Each gloo group keeps three
# threads that wake up every few milliseconds, idle or not: a pool of four ranks that has
# run a few hundred tests spends a core on them (measured: 100 groups, 10% of a core per
# rank; 19 groups, 2%), and replacing a pool costs under half a second.
_MAX_GROUPS = 8


class RankError(RuntimeError):
    """A rank raised (or its worker process died) while running a function.

    Attributes:
        rank (int): the rank that failed first.
        traceback (str): that rank's formatted traceback.
        exception (BaseException | None): the exception raised on that rank, if it could be
            sent back to the parent; it is also the ``__cause__`` of this error.
    """

    def __init__(
        self, message: str, rank: int, traceback: str, exception: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.exception = exception

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.rank, self.traceback, self.exception))


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout.

    Attributes:
        ranks (list[int]): the ranks that did not finish.
        timeout (float): the timeout in seconds.
    """

    def __init__(self, message: str, ranks: list[int], timeout: float) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.ranks, self.timeout))


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------

# Set in a worker process: it may not start pools of its own, and device_type() reads the
# device its process group was initialised for.
_IN_WORKER = False
_WORKER_DEVICE_TYPE: str | None = None


def device_type() -> str:
    """Return the device type the ranks of :func:`run_distributed` compute on.

    ``"cuda"`` when the pool's process group uses NCCL (there is one GPU per rank), else
    ``"cpu"`` (gloo). Outside a worker, returns ``"cuda"`` if CUDA is available, else ``"cpu"``.

    Example::

        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> def build_mesh() -> int:
        ...     mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
        ...     return mesh.size()
        >>> run_distributed(build_mesh, 2)  # doctest: +SKIP
        [2, 2]
    """
    if _WORKER_DEVICE_TYPE is not None:
        return _WORKER_DEVICE_TYPE
    return "cuda" if torch.cuda.is_available() else "cpu"


def _exit_when_orphaned() -> None:
    # A SIGKILLed parent runs no atexit handler; this thread makes sure the worker goes too. It
    # waits on multiprocessing's sentinel of the process that started the worker (not on the
    # parent process id: a forked worker's is the fork server's, which the workers keep alive).
    multiprocessing.parent_process().join()  # returns once that process has exited
    os._exit(1)


def _apply_sys_path(parent_path: list[str]) -> None:
    # The parent's entries first, in its order, so that its modules (test files) are the ones
    # the worker imports when it unpickles a function.
    extra = [p for p in sys.path if p not in parent_path]
    sys.path[:] = list(parent_path) + extra


def _init_worker(rank: int, world_size: int, init_file: str) -> None:
    global _WORKER_DEVICE_TYPE
    torch.set_num_threads(1)
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        torch.cuda.set_device(rank)
        # gloo next to NCCL so that CPU tensors can still be communicated.
        backend, _WORKER_DEVICE_TYPE = "cpu:gloo,cuda:nccl", "cuda"
    else:
        backend, _WORKER_DEVICE_TYPE = "gloo", "cpu"
        if sys.platform.startswith("linux"):
            # All ranks run on this machine: keep gloo off interfaces that may not resolve.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )


def _failure_message(exc: BaseException) -> tuple[bytes | None, str]:
    tb = traceback.format_exc()
    try:
        return pickle.dumps(exc), tb
    except Exception:
        return None, tb


def _run_task(rank: int, task_id: int, parent_path: list[str], payload: bytes) -> tuple:
    _apply_sys_path(parent_path)
    default_dtype, grad_enabled = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - pytest's skip/fail derive from BaseException
        return (_FAILED, task_id, rank, *_failure_message(exc))
    finally:
        # Cheap hygiene so that one test's global settings do not leak into the next.
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(grad_enabled)
    try:
        return (_OK, task_id, rank, pickle.dumps(result), len(compat.process_groups()))
    except Exception as exc:
        text = (
            f"the return value of rank {rank} could not be pickled "
            f"({type(exc).__name__}: {exc}); its repr is:\n{_short_repr(result)}\n"
        )
        return (_FAILED, task_id, rank, None, text)


def _short_repr(obj: object, limit: int = 2000) -> str:
    try:
        text = repr(obj)
    except Exception as exc:
        text = f"<repr failed: {type(exc).__name__}: {exc}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _worker_main(
    rank: int,
    world_size: int,
    init_file: str,
    tasks: multiprocessing.Queue,
    results: multiprocessing.Queue,
    parent_environ: dict[str, str],
) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    # A forked worker has the fork server's environment: give it the parent's, as spawn would
    # (what the server's imports set, the parent's own import of this module set too).
    os.environ.clear()
    os.environ.update(parent_environ)
    # Ctrl-C reaches the whole process group; the parent handles it by killing the pool, so
    # idle workers should not die noisily on their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    try:
        _init_worker(rank, world_size, init_file)
    except BaseException:  # noqa: BLE001 - report anything, the parent decides
        results.put((_INIT_FAILED, -1, rank, None, traceback.format_exc()))
        return
    results.put((_READY, -1, rank, None, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        results.put(_run_task(rank, *task))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # Skip the interpreter's teardown of torch, which takes seconds; flush what matters first.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------

_POOLS: dict[int, _Pool] = {}
_LOCK = threading.RLock()
_next_task_id = 0


class _Pool:
    """``world_size`` spawned workers sharing one process group, and the queues to reach them."""

    def __init__(self, world_size: int) -> None:
        ctx = multiprocessing.get_context(_START_METHOD)
        if _START_METHOD == "forkserver":
            ctx.set_forkserver_preload(_preload())  # read when the server starts
        self.world_size = world_size
        self.groups = 1  # the most process groups a rank holds (see _MAX_GROUPS)
        self.tmpdir = tempfile.mkdtemp(prefix=f"torch_tp_pool{world_size}_")
        self.results: multiprocessing.Queue = ctx.Queue()
        self.tasks: list[multiprocessing.Queue] = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    os.path.join(self.tmpdir, "store"),
                    self.tasks[rank],
                    self.results,
                    dict(os.environ),
                ),
                name=f"torch_tp-rank{rank}-of-{world_size}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            with _main_workers_can_start_with():
                for proc in self.procs:
                    proc.start()
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self.procs]

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while len(ready) < self.world_size:
            msg = self._get(deadline)
            if msg is None:
                dead = self._dead_ranks(ready)
                if dead:
                    raise RuntimeError(
                        f"could not start a pool of {self.world_size} ranks: the workers of "
                        f"ranks {sorted(dead)} exited during startup (exit codes {dead})"
                    )
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(self.world_size)) - ready)
                    raise RuntimeError(
                        f"could not start a pool of {self.world_size} ranks: ranks {missing} "
                        f"did not initialise their process group within {_STARTUP_TIMEOUT:g} s"
                    )
                continue
            tag, _, rank, _, text = msg
            if tag == _INIT_FAILED:
                raise RuntimeError(
                    f"rank {rank} of a pool of {self.world_size} failed to initialise its "
                    f"process group:\n{text}"
                )
            ready.add(rank)

    def _get(self, deadline: float) -> tuple | None:
        wait = min(_POLL_INTERVAL, max(deadline - time.monotonic(), 0.0))
        try:
            return self.results.get(timeout=wait)
        except queue.Empty:
            return None

    def _dead_ranks(self, done: set[int]) -> dict[int, int]:
        return {
            rank: proc.exitcode
            for rank, proc in enumerate(self.procs)
            if rank not in done and proc.exitcode is not None
        }

    def submit(self, task_id: int, payload: bytes) -> None:
        parent_path = list(sys.path)
        for tasks in self.tasks:
            tasks.put((task_id, parent_path, payload))

    def close(self, timeout: float = 5.0) -> None:
        """Ask the workers to leave their process group and exit; kill those that do not."""
        for tasks in self.tasks:
            try:
                tasks.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
        self.kill()

    def kill(self) -> None:
        """Kill every worker now and release the queues and the store directory."""
        for proc in self.procs:
            if proc.pid is not None and proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(5.0)
        for q in [*self.tasks, self.results]:
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _get_pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is not None and any(proc.exitcode is not None for proc in pool.procs):
        # A worker died between calls (killed from outside, say): its group is unusable.
        _drop_pool(world_size)
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool


def _drop_pool(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.kill()


def _resolve_timeout(timeout: float | None) -> float:
    if timeout is not None:
        value, source = timeout, "timeout"
    elif "TORCH_TP_TEST_TIMEOUT" in os.environ:
        source = "TORCH_TP_TEST_TIMEOUT"
        try:
            value = float(os.environ[source])
        except ValueError:
            raise ValueError(
                f"TORCH_TP_TEST_TIMEOUT must be a number of seconds, found {os.environ[source]!r}"
            ) from None
    else:
        return _DEFAULT_TIMEOUT
    if not value > 0:
        raise ValueError(f"{source} must be a positive number of seconds, found {value!r}")
    return float(value)


def _qualname(fn: Callable[..., Any]) -> str:
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:  # a callable object (a functools.partial, say): its repr says more
        return repr(fn)
    return f"{getattr(fn, '__module__', None) or '?'}.{qualname}"


# --------------------------------------------------------------------------------------------
# What the workers can import
#
# The workers start fresh (see _START_METHOD): they receive fn (and any function or class in
# its arguments) as a module name and a qualified name, and import it. Before starting, each
# worker re-runs the parent's __main__ as "__mp_main__" when it can: by module name after
# `python -m module`, by path after `python script.py`. Anything else defined in __main__ does
# not exist in a worker, and unpickling it there fails with a bare AttributeError, so it is
# refused here, with the reason and the fix.
# --------------------------------------------------------------------------------------------

_IMPORT_BY_NAME = (
    "The ranks are worker processes started fresh: they import fn, and every function "
    "or class in its arguments, by its module and qualified name"
)
_WHAT_TO_DO = (
    "Define it with def at the top level of a module file and import it from there (from a "
    "notebook: a .py file beside the notebook), or run your code as a script file with the "
    'run_distributed call under `if __name__ == "__main__":`. Pass the values it needs as '
    "arguments: run_distributed(fn, world_size, *args, **kwargs)."
)


def _main_file(main: types.ModuleType | None) -> str | None:
    """The file a spawned worker would re-run as ``__mp_main__``, as multiprocessing finds it
    (``None`` for a ``__main__`` with no ``__file__``; the path may not exist)."""
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    origin = multiprocessing.process.ORIGINAL_DIR
    return path if os.path.isabs(path) or origin is None else os.path.join(origin, path)


def _why_main_is_not_importable() -> str | None:
    """Why the workers cannot import what the parent's ``__main__`` defines (``None``: they
    can), following what ``multiprocessing``'s spawn does before a worker starts."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return (
                f"__main__ is {name}, a package's __main__.py run with python -m, which the "
                "workers do not re-run"
            )
        return None  # `python -m module`: the workers import it by that name
    path = _main_file(main)
    if path is None:
        return (
            "__main__ is an interactive session (a notebook, the Python prompt, python -c or "
            "python -) with no file the workers could re-run"
        )
    if not os.path.isfile(path):
        return f"__main__ was read from {main.__file__!r} (python -), which no worker can re-run"
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return "__main__ is an IPython session, which the workers do not re-run"
    return None


@contextlib.contextmanager
def _main_workers_can_start_with() -> Iterator[None]:
    """Hide a ``__main__.__file__`` that names no file while workers are started.

    A spawned worker re-runs the parent's main file before anything else, and ``python -``
    names it ``'<stdin>'``: every worker would die opening it, even for a function that lives in
    a proper module. Without the name the workers leave their ``__main__`` alone.
    """
    main = sys.modules.get("__main__")
    path = _main_file(main)
    if path is None or os.path.isfile(path):
        yield
        return
    name = main.__file__
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = name


class _TaskPickler(pickle.Pickler):
    """A pickler that records the functions and classes it pickles by reference to
    ``__main__`` (workers can import them only if they can re-run the parent's main)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.from_main: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)) and obj.__module__ == "__main__":
            self.from_main.append(f"__main__.{obj.__qualname__}")
        return NotImplemented  # pickle it as usual


def _pickle_task(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], name: str) -> bytes:
    """Pickle ``(fn, args, kwargs)`` for the workers, or raise ``TypeError`` saying why they
    could not unpickle it and what to do."""
    if isinstance(fn, types.FunctionType):
        if fn.__name__ == "<lambda>":
            what = "a lambda has no name"
        elif "<locals>" in fn.__qualname__:
            outer = fn.__qualname__.split(".<locals>.")[0]
            what = f"a function defined inside {outer} has no name"
        else:
            what = None
        if what is not None:
            raise TypeError(
                f"run_distributed cannot run {name}: {what} the workers could import it by. "
                f"{_IMPORT_BY_NAME}, so fn must be a module-level function. {_WHAT_TO_DO}"
            )
    buffer = io.BytesIO()
    pickler = _TaskPickler(buffer)
    try:
        pickler.dump((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_distributed could not pickle {name} or its arguments ({exc}). "
            f"{_IMPORT_BY_NAME}, so fn must be a module-level function and its arguments "
            f"picklable. {_WHAT_TO_DO}"
        ) from exc
    why = _why_main_is_not_importable() if pickler.from_main else None
    if why is not None:
        found = list(dict.fromkeys(pickler.from_main))
        subject = "it is" if found == [name] else f"it needs {', '.join(found)},"
        raise TypeError(
            f"run_distributed cannot run {name}: {subject} defined in __main__, and {why}. "
            f"{_IMPORT_BY_NAME}. {_WHAT_TO_DO}"
        )
    return buffer.getvalue()


def run_distributed(
    fn: Callable[..., T],
    world_size: int = 2,
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` process group.

    The ranks are worker processes spawned on the first call for a given ``world_size`` and
    reused by every later call of that size, each with the default process group initialised
    (gloo on CPU; NCCL, with ``torch.cuda.set_device(rank)``, when there is a GPU per rank; see
    :func:`device_type`). Each worker runs with ``torch.set_num_threads(1)``.

    ``fn``, ``args``, ``kwargs`` and the return values are pickled. The workers start with
    nothing of the parent's state, and they import ``fn``, and any function or class in its
    arguments, by its module and qualified name: ``fn`` must be a function defined at module
    level (in a test file, say), not a lambda or a nested function. The caller's ``sys.path``
    is applied in the workers before ``fn`` is unpickled, so the workers find the module
    ``fn`` lives in.
    A function defined in a script run as a file (``python script.py``) or as a module
    (``python -m script``) works as long as the script keeps its top-level code under
    ``if __name__ == "__main__":``: the workers re-run the script to find it. The ``__main__``
    of a notebook, of the Python prompt, of ``python -c`` or of ``python -`` cannot be re-run;
    a function defined there is refused, before any worker runs: put it in a module file and
    import it. Workers are daemonic processes, so ``fn`` cannot start processes of its own
    (e.g. a ``DataLoader`` with ``num_workers > 0``).

    On Linux the workers are forked from a server process that imports torch once. Modules
    that every rank would otherwise import again (``transformers``, a model's module) can be
    imported there too: name them, comma-separated, in the ``TORCH_TP_TESTING_PRELOAD``
    environment variable before the first call (a module that is not installed is skipped).

    Args:
        fn: the function to run on every rank.
        world_size: the number of ranks.
        *args: positional arguments for ``fn``.
        timeout: seconds to wait for all ranks. Default: the ``TORCH_TP_TEST_TIMEOUT``
            environment variable if set, else 120. Spawning a new pool is not counted.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The return value of ``fn`` on each rank, indexed by rank.

    Raises:
        RankError: a rank raised, or its worker died. The message holds that rank's full
            traceback. If other ranks do not finish within a few seconds (they are often
            waiting in a collective for the failed rank), the pool is replaced.
        RankTimeout: some ranks did not finish within ``timeout``; the pool is killed and the
            next call spawns a fresh one.
        TypeError: ``fn`` or its arguments cannot be pickled, or the workers could not import
            them: ``fn`` is a lambda or a nested function, or it (or a function or class in
            its arguments) is defined in a ``__main__`` the workers cannot re-run. Raised
            before any worker runs; the message says why and what to do.

    Example::

        >>> import torch
        >>> import torch.distributed as dist
        >>> def all_reduce_rank() -> float:  # at module level
        ...     t = torch.tensor([float(dist.get_rank())])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> run_distributed(all_reduce_rank, 2)  # doctest: +SKIP
        [1.0, 1.0]
    """
    global _next_task_id
    if _IN_WORKER:
        raise RuntimeError("run_distributed cannot be called from inside a rank of another call")
    if not callable(fn):
        raise TypeError(f"fn must be callable, found {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, found {world_size!r}")
    timeout = _resolve_timeout(timeout)
    name = _qualname(fn)
    payload = _pickle_task(fn, args, kwargs, name)  # before any worker starts

    with _LOCK:
        pool = _get_pool(world_size)
        _next_task_id += 1
        try:
            results, error, pool_ok = _collect(pool, _next_task_id, payload, name, timeout)
        except BaseException:
            # Interrupted in the middle of a call (Ctrl-C): the ranks' state is unknown.
            _drop_pool(world_size)
            raise
        if not pool_ok:
            _drop_pool(world_size)
        elif pool.groups > _MAX_GROUPS:
            _POOLS.pop(world_size)
            pool.close()
        if error is not None:
            raise error
        return results


def _collect(
    pool: _Pool, task_id: int, payload: bytes, name: str, timeout: float
) -> tuple[list[Any], Exception | None, bool]:
    """Run one task on the pool; return (results by rank, error to raise, pool still usable)."""
    pool.submit(task_id, payload)
    world_size = pool.world_size
    results: dict[int, Any] = {}
    failures: dict[int, tuple[bytes | None, str]] = {}  # rank -> (pickled exception, traceback)
    died: set[int] = set()
    deadline = time.monotonic() + timeout

    def fail(rank: int, data: bytes | None, text: str) -> None:
        nonlocal deadline
        if not failures:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
        failures[rank] = (data, text)

    while len(results) + len(failures) < world_size and time.monotonic() < deadline:
        msg = pool._get(deadline)
        if msg is None:
            for rank, code in pool._dead_ranks(set(results) | set(failures)).items():
                died.add(rank)
                fail(rank, None, f"the worker process of rank {rank} exited with code {code}\n")
            continue
        tag, msg_task, rank, data, last = msg
        if msg_task != task_id:
            continue  # cannot happen with a fresh or clean pool; be safe anyway
        if tag != _OK:
            fail(rank, data, last)  # last: the traceback
            continue
        pool.groups = max(pool.groups, last)  # last: the rank's number of process groups
        try:
            results[rank] = pickle.loads(data)
        except Exception:
            fail(
                rank,
                None,
                f"the return value of rank {rank} could not be unpickled:\n"
                + traceback.format_exc(),
            )

    unfinished = sorted(set(range(world_size)) - set(results) - set(failures))
    if failures:
        # A failed rank whose peers all finished leaves the group usable; a dead worker or
        # peers stuck in a collective do not.
        error = _rank_error(pool, name, failures, unfinished)
        return [], error, not unfinished and not died
    if unfinished:
        error = RankTimeout(
            f"{name} timed out after {timeout:g} s on {world_size} ranks: ranks {unfinished} "
            f"did not finish. The pool of {world_size} ranks was killed; the next call spawns "
            "a new one.",
            ranks=unfinished,
            timeout=timeout,
        )
        return [], error, False
    return [results[rank] for rank in range(world_size)], None, True


def _rank_error(
    pool: _Pool, name: str, failures: dict[int, tuple[bytes | None, str]], unfinished: list[int]
) -> RankError:
    # Dicts keep insertion order: the first failure reported is most likely the root cause.
    rank = next(iter(failures))
    data, tb = failures[rank]
    exception = None
    if data is not None:
        try:
            exception = pickle.loads(data)
        except Exception:
            pass
    lines = [f"rank {rank} of {pool.world_size} failed in {name}:", tb.rstrip()]
    others = sorted(set(failures) - {rank})
    if others:
        lines.append(f"ranks {others} failed too:")
        lines += [f"  rank {r}: {_exception_line(failures[r][1])}" for r in others]
    if unfinished:
        lines.append(
            f"ranks {unfinished} did not finish within {_FAILURE_GRACE:g} s of the failure "
            f"(probably waiting in a collective); the pool of {pool.world_size} was replaced."
        )
    error = RankError("\n".join(lines), rank=rank, traceback=tb, exception=exception)
    if isinstance(exception, BaseException):
        error.__cause__ = exception
    return error


def _exception_line(tb: str) -> str:
    """The first line of the exception at the end of a formatted traceback."""
    lines = tb.rstrip().splitlines() or ["<no traceback>"]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[frames[-1] + 1 :] if frames else lines
    return next((line for line in after if line and not line[0].isspace()), lines[-1])


def shutdown() -> None:
    """Terminate every worker pool started by :func:`run_distributed`.

    Called automatically at interpreter exit. A later :func:`run_distributed` call spawns a
    new pool.

    Example::

        >>> run_distributed(all_reduce_rank, 2)  # doctest: +SKIP
        [1.0, 1.0]
        >>> shutdown()  # the two worker processes exit
    """
    with _LOCK:
        while _POOLS:
            _, pool = _POOLS.popitem()
            pool.close()


def _at_exit() -> None:
    shutdown()
    # Then kill the fork server, unless a process it forked still runs: its own exit (torch's
    # finalization) takes seconds, all the while holding this process's stdout and stderr, which
    # whoever reads them through a pipe (subprocess.run(capture_output=True)) waits for.
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None and not multiprocessing.active_children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


atexit.register(_at_exit)
