"""``python -m torch_tp.testing.gpu_check``: its table, its exit codes, its plumbing on CPU.

The checks themselves need CUDA; here ``--dry-run`` runs every one of them on CPU with gloo at
tiny sizes (the same rank functions, meshes and comparisons), and the table must list each
check with PASS. Without CUDA and without ``--dry-run`` nothing runs and the exit code is 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from torch_tp.testing import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def _rows(out: str) -> dict[str, tuple[str, str]]:
    """The table's rows: check name -> (result, detail)."""
    rows = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.split(" | ")]
        if len(cells) == 4 and cells[0] in gpu_check.CHECKS:
            rows[cells[0]] = (cells[1], cells[3])
    return rows


def test_without_cuda_nothing_is_checked_and_the_exit_code_is_0(capsys):
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device was found" in out and "nothing was checked" in out
    assert _rows(out) == {}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs the checks")
def test_the_command_without_cuda_exits_0():
    """As run from a shell: ``python -m`` (the ranks import the checks by the module's name)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch_tp.testing.gpu_check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "nothing was checked" in done.stdout


@pytest.mark.slow
def test_dry_run_lists_every_check_with_pass(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == list(gpu_check.CHECKS), out
    failed = {name: row for name, row in rows.items() if row[0] != "PASS"}
    assert not failed, out
    assert "0 failed" in out


def _broken_check(device_type: str) -> str:
    raise ValueError(f"deliberately broken on {device_type}\nsecond line of the message")


@pytest.mark.slow
def test_a_failing_check_is_a_fail_row_with_its_last_line_and_exit_code_1(capsys):
    broken = (2, _broken_check, lambda d, _: (d,), lambda d: None)
    with mock.patch.dict(gpu_check.CHECKS, {"broken": broken}):
        code = gpu_check.main(["--dry-run", "--only", "rng_tracker", "--only", "broken"])
        out = capsys.readouterr().out
        rows = _rows(out)
    assert code == 1, out
    assert rows["rng_tracker"][0] == "PASS"
    assert rows["broken"] == (
        "FAIL",
        "ValueError: deliberately broken on cpu ... second line of the message",
    ), out
    assert all(rows[name] == ("SKIP", "not selected (--only)") for name in rows if name not in {
        "rng_tracker", "broken"}), out  # fmt: skip
    assert "1 failed" in out


def test_an_unknown_check_name_is_refused():
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--only", "no_such_check"])
    assert info.value.code == 2
