"""Session-wide fixtures for the torch_tp test suite."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Test the working tree's torch_tp even under plain `pytest` (which, unlike `python -m pytest`,
# does not put the current directory on sys.path). pytest itself puts test/ on sys.path (its
# "prepend" import mode), which is how the test files import helpers.py. The workers of
# torch_tp.testing receive this sys.path too.
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_worker_pools() -> Iterator[None]:
    """Terminate the run_distributed worker pools when the session ends (atexit is a backup)."""
    yield
    from torch_tp.testing import shutdown

    shutdown()
