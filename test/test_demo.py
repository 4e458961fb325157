"""Tests of ``python -m torch_tp demo``.

One test runs the real command in a subprocess (it spawns its own ranks); the others run the
demo's training on the ranks of the shared test pool (``torch_tp.testing``), which is much
cheaper than spawning ranks per test.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from torch_tp import __main__ as cli
from torch_tp.cli import demo as _demo
from torch_tp.testing import run_distributed

REPO_ROOT = Path(__file__).resolve().parents[1]

# "step 2/3 [....] loss tp 6.551574  single 6.551574  |diff| 0.00e+00"
_ROW = re.compile(
    r"^step\s+(\d+)/(\d+) \[[#.]+\] loss tp ([\d.]+)\s+single ([\d.]+)\s+\|diff\| (\S+)$",
    re.MULTILINE,
)


def _rows(output: str) -> list[tuple[int, float, float]]:
    return [(int(m[1]), float(m[3]), float(m[4])) for m in _ROW.finditer(output)]


def _demo_as_torchrun_rank(argv: list[str]) -> tuple[int, str]:
    """On a pool rank: run ``python -m torch_tp demo ARGV`` as if launched by torchrun."""
    env = {
        "RANK": str(torch.distributed.get_rank()),
        "WORLD_SIZE": str(torch.distributed.get_world_size()),
        "LOCAL_RANK": str(torch.distributed.get_rank()),
        "LOCAL_WORLD_SIZE": str(torch.distributed.get_world_size()),
    }
    out = io.StringIO()
    threads = torch.get_num_threads()  # the demo sets its own; leave the pool's as it was
    try:
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out):
            status = cli.main(["demo", *argv])
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue()


def run_demo_cli(python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch_tp demo --steps 3`` with every warning shown once per place, in
    the parent and (through the environment and the spawn flags) in its ranks."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "default"
    return subprocess.run(
        [python, "-W", "default", "-m", "torch_tp", "demo", "--steps", "3"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def cli_run() -> subprocess.CompletedProcess[str]:
    """One run of the real command, shared by the tests that read its output."""
    return run_demo_cli()


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_cli_spawns_ranks_and_losses_match(cli_run: subprocess.CompletedProcess[str]) -> None:
    proc = cli_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert [step for step, _, _ in rows] == [1, 2, 3], proc.stdout
    for _, tp_loss, ref_loss in rows:
        assert tp_loss == pytest.approx(ref_loss, rel=1e-4)
    assert "tensor parallel over 2 " in proc.stdout
    assert "sequence parallel on" in proc.stdout
    assert "OK: tensor-parallel training matches single-device training" in proc.stdout


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_cli_prints_no_warnings(cli_run: subprocess.CompletedProcess[str]) -> None:
    # The first thing a new user runs: a warning there (NumPy missing, a deprecated call in a
    # rank) reads as a broken install. Python's warnings name their category (UserWarning,
    # FutureWarning, ...); torch's C++ warnings and loggers say "warning" or "WARNING".
    output = cli_run.stdout + cli_run.stderr
    warnings = [line for line in output.splitlines() if "warn" in line.lower()]
    assert not warnings, "\n".join([*warnings, "--- the whole output:", output])


@pytest.mark.parametrize(
    ("sequence_parallel", "moe"),
    [
        (True, None),
        (False, None),
        (True, "ep"),
        pytest.param(False, "ep", marks=pytest.mark.slow),
        pytest.param(True, "tp", marks=pytest.mark.slow),
    ],
)
def test_demo_on_pool(sequence_parallel: bool, moe: str | None) -> None:
    flag = "--sequence-parallel" if sequence_parallel else "--no-sequence-parallel"
    argv = ["--steps", "4", "--layers", "1", flag, *(["--moe", moe] if moe else [])]
    results = run_distributed(_demo_as_torchrun_rank, 2, argv)
    # Every rank checks the result itself and exits with the same status; only rank 0 prints.
    assert [status for status, _ in results] == [0, 0]
    output, other = results[0][1], results[1][1]
    assert other == ""
    rows = _rows(output)
    assert [step for step, _, _ in rows] == [1, 2, 3, 4], output
    for _, tp_loss, ref_loss in rows:
        assert tp_loss == pytest.approx(ref_loss, rel=1e-4)
    # The model learns: the loss goes down even in four steps.
    assert rows[-1][2] < rows[0][2]
    assert f"sequence parallel {'on' if sequence_parallel else 'off'}" in output
    if moe is not None:
        assert "mixture-of-experts Llama" in output
        how = "whole experts split" if moe == "ep" else "every expert sharded"
        assert how in output
    assert "max |param diff|" in output
    assert output.rstrip().endswith("OK: tensor-parallel training matches single-device training")


def test_unsplittable_world_size_is_refused_before_spawning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with mock.patch.object(_demo, "_spawn_ranks") as spawn:
        assert cli.main(["demo", "--world-size", "3"]) == 2
    spawn.assert_not_called()
    err = capsys.readouterr().err
    assert "cannot be split over 3 ranks" in err
    assert "n_heads (8)" in err


def test_bad_step_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "--sequence-parallel" in capsys.readouterr().out


def test_losses_agree() -> None:
    assert _demo.losses_agree([6.9, 3.0], [6.9, 3.0], rtol=1e-4)
    assert _demo.losses_agree([6.9 * (1 + 5e-5)], [6.9], rtol=1e-4)
    assert not _demo.losses_agree([6.9 * (1 + 5e-4)], [6.9], rtol=1e-4)
    assert not _demo.losses_agree([float("nan")], [float("nan")], rtol=1e-4)
    assert not _demo.losses_agree([1.0], [1.0, 1.0], rtol=1e-4)
    # Near zero the tiny absolute slack applies.
    assert _demo.losses_agree([1e-7], [0.0], rtol=1e-4)


def test_successor_task_is_deterministic_and_follows_its_table() -> None:
    a, b = _demo.SuccessorTask(1001, seed=3), _demo.SuccessorTask(1001, seed=3)
    batch = a.batch(4, 9)
    assert torch.equal(batch, b.batch(4, 9))
    assert batch.shape == (4, 9)
    assert not torch.equal(batch, a.batch(4, 9))  # the stream moves on
    # Each token is the successor of the one before it.
    successor_of = {
        int(a.symbols[i]): int(a.symbols[a.successor[i]]) for i in range(len(a.symbols))
    }
    for row in batch.tolist():
        assert all(successor_of[x] == y for x, y in zip(row, row[1:], strict=False))
