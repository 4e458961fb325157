"""Tests of torch_tp.testing: the multi-process harness and the parity helper.

The functions run on the ranks live at module level so that the workers can unpickle them.
Pools are spawned once per world size and shared with the rest of the session; only the tests
that must break a pool (a hang, a rank stuck after another failed, a dead worker) pay for a
new one. The shutdown test comes last for the same reason.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from torch_tp import ColwiseParallel, RowwiseParallel
from torch_tp.testing import (
    RankError,
    RankTimeout,
    _harness,
    check_parity,
    device_type,
    gather_full,
    run_distributed,
    shutdown,
)

SHORT_TIMEOUT = 3.0
REPO_ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- functions run on the ranks ------------------------------------------------------------


def _rank_info(scale: float, *, offset: float = 0.0) -> tuple[int, int, float, int]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), scale * t.item() + offset, os.getpid()


def _pid() -> int:
    return os.getpid()


def _pid_of(_: object) -> int:
    return os.getpid()


def _raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is broken")
    return dist.get_rank()


def _raise_on_rank_1_while_rank_0_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 left before the all_reduce")
    dist.all_reduce(torch.ones(1))


def _rank_1_sleeps_forever() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)


def _rank_1_dies() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _environment_variable(name: str) -> str | None:
    return os.environ.get(name)


def _unpicklable_result_on_rank_0() -> object:
    return threading.Lock() if dist.get_rank() == 0 else None


def _gather_uneven_shards() -> list[float]:
    # 5 rows over 2 ranks, split as torch.chunk (and so DTensor) splits them: 3 + 2.
    mesh = init_device_mesh(device_type(), (2,))
    rows = [torch.arange(0, 3), torch.arange(3, 5)][dist.get_rank()]
    local = rows.float().unsqueeze(1).repeat(1, 2).requires_grad_()
    full = gather_full(local, mesh, Shard(0))
    (full * torch.arange(5.0).unsqueeze(1)).sum().backward()
    # Each rank gets the gradient of its own rows only.
    torch.testing.assert_close(local.grad, rows.float().unsqueeze(1).repeat(1, 2))
    return full[:, 0].tolist()


def _gather_on_2d_mesh() -> None:
    mesh = init_device_mesh(device_type(), (2, 2))
    full = torch.arange(4 * 6.0).reshape(4, 6)
    blocks = [row.tensor_split(2, dim=1) for row in full.tensor_split(2, dim=0)]
    i, j = mesh.get_coordinate()
    local = blocks[i][j]
    torch.testing.assert_close(gather_full(local, mesh, [Shard(0), Shard(1)]), full)
    # read as [Shard(1), Shard(0)], rank (i, j) holds column block i of row block j: the
    # gathered tensor has the blocks transposed
    swapped = torch.cat([torch.cat([blocks[c][r] for c in (0, 1)], dim=1) for r in (0, 1)])
    torch.testing.assert_close(gather_full(local, mesh, [Shard(1), Shard(0)]), swapped)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _mlp_parity() -> None:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    tp_model, reference = check_parity(
        _mlp(),
        mesh,
        {"0": ColwiseParallel(), "2": RowwiseParallel()},
        (x,),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        steps=2,
    )
    if not isinstance(tp_model[0].weight, DTensor) or isinstance(reference[0].weight, DTensor):
        raise AssertionError("expected a parallelized model and a plain reference")


def _sharded_output_parity(output_placements: object) -> None:
    # Column-parallel with a local output: each rank holds a slice of the last dimension, of
    # uneven sizes (5 columns over 2 ranks).
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(0)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    check_parity(
        nn.Linear(8, 5), mesh, ColwiseParallel(), (x,), output_placements=output_placements
    )


class _GradDoubledUnderTP(nn.Module):
    """Same output with or without TP, but doubles the gradient of ``up`` once parallelized."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if isinstance(self.up.weight, DTensor):
            h = 2 * h - h.detach()  # exactly h in value, twice its gradient
        return self.down(torch.relu(h))


def _wrong_gradient_parity() -> None:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    check_parity(_GradDoubledUnderTP(), mesh, plan, (x,))


# ---- the harness ---------------------------------------------------------------------------


def test_results_come_back_per_rank() -> None:
    results = run_distributed(_rank_info, 2, 10.0, offset=0.5)
    assert [r[:3] for r in results] == [(0, 2, 10.5), (1, 2, 10.5)]
    assert len({r[3] for r in results} | {os.getpid()}) == 3
    assert run_distributed(device_type, 2) == [device_type()] * 2


def test_pool_is_reused() -> None:
    first = run_distributed(_pid, 2)
    assert run_distributed(_pid, 2) == first
    assert _harness._POOLS[2].pids == first


@pytest.mark.four_ranks
def test_world_sizes_2_and_4() -> None:
    pids_2 = run_distributed(_pid, 2)
    results = run_distributed(_rank_info, 4, 1.0)
    assert [r[:3] for r in results] == [(r, 4, 6.0) for r in range(4)]
    assert run_distributed(_pid, 2) == pids_2
    run_distributed(_gather_on_2d_mesh, 4)


def test_rank_error_carries_the_traceback() -> None:
    pids = run_distributed(_pid, 2)
    with pytest.raises(RankError) as info:
        run_distributed(_raise_on_rank_1, 2)
    err = info.value
    assert err.rank == 1
    assert isinstance(err.exception, ValueError) and err.__cause__ is err.exception
    assert "_raise_on_rank_1" in err.traceback
    assert "ValueError: rank 1 is broken" in err.traceback
    assert str(err).startswith("rank 1 of 2 failed in test_testing._raise_on_rank_1")
    assert err.traceback.strip() in str(err)
    # Rank 0 finished, so the pool is intact and kept.
    assert run_distributed(_pid, 2) == pids


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_rank_error_while_other_ranks_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_FAILURE_GRACE", 1.0)
    pids = run_distributed(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 left before the all_reduce") as info:
        run_distributed(_raise_on_rank_1_while_rank_0_waits, 2)
    assert info.value.rank == 1
    assert "ranks [0] did not finish" in str(info.value)
    assert time.monotonic() - start < 30
    assert not any(_alive(pid) for pid in pids)
    assert [r[:3] for r in run_distributed(_rank_info, 2, 1.0)] == [(0, 2, 1.0), (1, 2, 1.0)]


@pytest.mark.slow
def test_hang_times_out_and_the_pool_is_replaced() -> None:
    pids = run_distributed(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] did not finish") as info:
        run_distributed(_rank_1_sleeps_forever, 2, timeout=SHORT_TIMEOUT)
    assert SHORT_TIMEOUT <= time.monotonic() - start < SHORT_TIMEOUT + 20
    assert info.value.ranks == [1] and info.value.timeout == SHORT_TIMEOUT
    assert not any(_alive(pid) for pid in pids)
    new_pids = run_distributed(_pid, 2)
    assert set(new_pids).isdisjoint(pids)


def _make_groups(n: int) -> int:
    for _ in range(n):
        dist.new_group(backend="gloo")
    return os.getpid()


def test_a_pool_holding_many_process_groups_is_replaced_after_the_call() -> None:
    # each gloo group's threads cost CPU while idle; the harness starts a fresh pool once the
    # ranks hold more than a few (a call's own groups last as long as the call)
    run_distributed(_make_groups, 2, 10)  # whatever ran before: a fresh pool next
    pids = run_distributed(_pid, 2)
    assert run_distributed(_make_groups, 2, 2) == pids
    assert run_distributed(_pid, 2) == pids  # few groups: the same pool
    assert run_distributed(_make_groups, 2, 10) == pids  # the call itself runs in it
    new_pids = run_distributed(_pid, 2)
    assert set(new_pids).isdisjoint(pids)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_dead_worker_fails_the_call_and_the_pool_is_replaced() -> None:
    pids = run_distributed(_pid, 2)
    with pytest.raises(RankError, match="exited with code 3") as info:
        run_distributed(_rank_1_dies, 2)
    assert info.value.rank == 1
    assert set(run_distributed(_pid, 2)).isdisjoint(pids)


def test_unpicklable_values() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda: None, 2)
    pids = run_distributed(_pid, 2)
    with pytest.raises(RankError, match="could not be pickled") as info:
        run_distributed(_unpicklable_result_on_rank_0, 2)
    assert info.value.rank == 0 and "lock" in str(info.value)
    assert run_distributed(_pid, 2) == pids


def test_argument_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_pid, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_pid, 2, timeout=0)
    monkeypatch.setenv("TORCH_TP_TEST_TIMEOUT", "7.5")
    assert _harness._resolve_timeout(None) == 7.5
    assert _harness._resolve_timeout(3.0) == 3.0
    monkeypatch.setenv("TORCH_TP_TEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TORCH_TP_TEST_TIMEOUT"):
        _harness._resolve_timeout(None)
    monkeypatch.delenv("TORCH_TP_TEST_TIMEOUT")
    assert _harness._resolve_timeout(None) == 120.0


def test_a_new_pool_gets_the_parents_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # as of now, not as of when the first pool started (forked workers inherit that one)
    run_distributed(_pid, 2)
    monkeypatch.setenv("TORCH_TP_TEST_MARKER", "set in the parent")
    try:
        found = run_distributed(_environment_variable, 1, "TORCH_TP_TEST_MARKER")
    finally:
        _harness._drop_pool(1)
    assert found == ["set in the parent"]


# ---- functions the workers cannot import: refused in the parent, before any worker runs ----

_WHY = "by its module and qualified name"
_WHAT_TO_DO = 'if __name__ == "__main__":'


def _no_pool_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def get_pool(world_size: int) -> None:
        raise AssertionError(f"a pool of {world_size} workers was asked for")

    monkeypatch.setattr(_harness, "_get_pool", get_pool)


def test_a_lambda_is_refused_before_any_worker_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_pool_may_start(monkeypatch)
    with pytest.raises(TypeError, match="a lambda has no name") as info:
        run_distributed(lambda: None, 2)
    message = str(info.value)
    assert _WHY in message and _WHAT_TO_DO in message and "module-level function" in message


def test_a_nested_function_is_refused_before_any_worker_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def on_rank() -> int:
        return dist.get_rank()

    _no_pool_may_start(monkeypatch)
    with pytest.raises(TypeError, match="defined inside test_a_nested_function_is_refused") as info:
        run_distributed(on_rank, 2)
    message = str(info.value)
    assert "on_rank" in message and _WHY in message and _WHAT_TO_DO in message


def test_a_function_of_an_interactive_main_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a notebook, the REPL or `python -c` has: a __main__ with no file a worker could run.
    main = types.ModuleType("__main__")
    exec("def on_rank():\n    return 1\n\nclass Config:\n    pass\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    _no_pool_may_start(monkeypatch)
    with pytest.raises(TypeError, match=r"__main__\.on_rank") as info:
        run_distributed(main.on_rank, 2)
    message = str(info.value)
    assert "interactive" in message and _WHY in message and _WHAT_TO_DO in message
    # an argument of a class defined there cannot be unpickled by the workers either
    with pytest.raises(TypeError, match=r"__main__\.Config"):
        run_distributed(_pid_of, 2, main.Config())


def _python(
    args: list[str], cwd: Path, stdin: str | None = None, preload: str | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TORCH_TP_TESTING_PRELOAD", None)  # the suite's own (test/conftest.py)
    if preload is not None:
        env["TORCH_TP_TESTING_PRELOAD"] = preload
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


_MAIN_PROGRAM = textwrap.dedent(
    """
    import multiprocessing
    import torch.distributed as dist
    from torch_tp.testing import run_distributed

    def on_rank():
        return dist.get_rank()

    try:
        run_distributed(on_rank, 2)
    except TypeError as err:
        print("TypeError:", err)
    print("workers started:", len(multiprocessing.active_children()))
    """
)

# A script run as a file: the workers re-run it as __mp_main__ and find on_rank.
_SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist
    from torch_tp.testing import run_distributed

    def on_rank():
        return dist.get_rank()

    if __name__ == "__main__":
        print("ranks:", run_distributed(on_rank, 2))
    """
)

# Which of two modules the ranks hold before they import anything: those the fork server
# preloaded (TORCH_TP_TESTING_PRELOAD; a module that does not exist is skipped).
_PRELOADED = textwrap.dedent(
    """
    import sys
    from torch_tp.testing import run_distributed

    def on_rank():
        return [m for m in ("xml.dom.minidom", "no_such_module_here") if m in sys.modules]

    if __name__ == "__main__":
        print("preloaded:", run_distributed(on_rank, 2))
    """
)

# Code read from stdin may run functions of importable modules.
_STDIN_PROGRAM = (
    "import torch.distributed as dist\nfrom torch_tp.testing import run_distributed\n"
    "print('ranks:', run_distributed(dist.get_rank, 2))\n"
)


@pytest.fixture(scope="module")
def python_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The fresh interpreters of the tests below, by name, each run in a directory of its own
    (the two preload runs share their script's).

    Each spends seconds importing torch, mostly on one core: they are all started when the
    first of these tests runs, side by side, and each test waits for its own and checks it.
    """
    script = tmp_path_factory.mktemp("script") / "script.py"
    script.write_text(_SCRIPT)
    preloaded = tmp_path_factory.mktemp("preload") / "preloaded.py"
    preloaded.write_text(_PRELOADED)
    run = tmp_path_factory.mktemp
    runs = {  # the arguments of _python
        "-c": (["-c", _MAIN_PROGRAM], run("run")),
        "stdin": (["-"], run("run"), _MAIN_PROGRAM),
        "script": ([str(script)], script.parent),
        "stdin, module function": (["-"], run("run"), _STDIN_PROGRAM),
        "preload": (
            [str(preloaded)],
            preloaded.parent,
            None,
            "xml.dom.minidom, no_such_module_here",
        ),
        "no preload": ([str(preloaded)], preloaded.parent),
    }
    with ThreadPoolExecutor(len(runs)) as executor:
        yield {name: executor.submit(_python, *arguments) for name, arguments in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_a_function_of_python_c_or_stdin_is_refused(
    how: str, python_runs: dict[str, Future]
) -> None:
    proc = python_runs[how].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TypeError: run_distributed cannot run __main__.on_rank" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    assert "workers started: 0" in proc.stdout
    assert _WHY in proc.stdout and _WHAT_TO_DO in proc.stdout


@pytest.mark.slow
def test_main_of_a_script_file_and_module_functions_from_stdin_still_run(
    python_runs: dict[str, Future],
) -> None:
    proc = python_runs["script"].result()
    assert proc.returncode == 0 and "ranks: [0, 1]" in proc.stdout, proc.stdout + proc.stderr
    proc = python_runs["stdin, module function"].result()
    assert proc.returncode == 0 and "ranks: [0, 1]" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_fork_server_preloads_the_modules_named_by_the_environment(
    python_runs: dict[str, Future],
) -> None:
    proc = python_runs["preload"].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preloaded: [['xml.dom.minidom'], ['xml.dom.minidom']]" in proc.stdout, proc.stdout
    proc = python_runs["no preload"].result()
    assert proc.returncode == 0 and "preloaded: [[], []]" in proc.stdout, proc.stdout + proc.stderr


# ---- the parity helper ---------------------------------------------------------------------


def test_gather_full_uneven_shards() -> None:
    assert run_distributed(_gather_uneven_shards, 2) == [[0.0, 1.0, 2.0, 3.0, 4.0]] * 2


def test_parity_passes_for_a_tensor_parallel_mlp() -> None:
    run_distributed(_mlp_parity, 2)


def test_parity_gathers_a_local_sharded_output() -> None:
    run_distributed(_sharded_output_parity, 2, Shard(-1))


def test_parity_fails_on_a_wrong_output_placement() -> None:
    with pytest.raises(
        RankError, match=r"step 0: output differs: The values for attribute 'shape'"
    ):
        run_distributed(_sharded_output_parity, 2, None)


def test_parity_names_the_first_wrong_gradient() -> None:
    with pytest.raises(RankError, match=r"step 0: gradient of 'up.weight' differs: ") as info:
        run_distributed(_wrong_gradient_parity, 2)
    assert isinstance(info.value.exception, AssertionError)


# ---- last: shutdown ------------------------------------------------------------------------


def test_shutdown_terminates_every_pool() -> None:
    run_distributed(_pid, 2)
    pids = [pid for pool in _harness._POOLS.values() for pid in pool.pids]
    shutdown()
    assert not _harness._POOLS
    assert not any(_alive(pid) for pid in pids)
