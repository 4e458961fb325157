"""Session-wide fixtures for the torch_tp test suite."""

import os
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

# The first forward of every parallelized model is shape-checked (torch_tp._forward_check);
# where the trace itself fails on a model the suite builds, fail the test rather than warn
# and run unchecked, as a user's run does. (The workers get this environment too.)
os.environ.setdefault("TORCH_TP_FORWARD_CHECK", "strict")

# The workers of torch_tp.testing are forked from a server that imports these first (when the
# first pool starts): without them each of the session's ~35 workers imports transformers and
# the models the tests build again: a fifth of the quick run's processor time.
os.environ.setdefault(
    "TORCH_TP_TESTING_PRELOAD",
    ",".join(
        [
            "transformers",
            "transformers.models.auto.modeling_auto",
            *(
                f"transformers.models.{name}.modeling_{name}"
                for name in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gpt2")
            ),
            "peft",
        ]
    ),
)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_worker_pools() -> Iterator[None]:
    """Terminate the run_distributed worker pools when the session ends (atexit is a backup)."""
    yield
    from torch_tp.testing import shutdown

    shutdown()


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marks added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``four_ranks`` test is also ``slow``: the quick run starts no 4-rank worker pool (about
    7 s of its time), while CI's passes on the newest torch and under the plain-DTensor runtime
    select them back with ``-m "not slow or four_ranks"``.

    Under ``TORCH_TP_RUNTIME=dtensor`` skip the tests of the fast runtime's own mechanics
    (coalesced reductions, shared region entries, its collective counts): the parity tests
    run in both runtimes, these describe only one."""
    for item in items:
        if item.get_closest_marker("four_ranks"):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("TORCH_TP_RUNTIME", "fast") == "fast":
        return
    skip = pytest.mark.skip(reason="checks the fast runtime's mechanics (TORCH_TP_RUNTIME=dtensor)")
    for item in items:
        if item.get_closest_marker("fast_runtime"):
            item.add_marker(skip)
