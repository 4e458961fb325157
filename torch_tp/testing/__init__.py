"""Test tools for tensor-parallel code: a multi-process harness and a parity checker.

:func:`run_distributed` runs a function on every rank of a process group kept alive across
calls; :func:`check_parity` trains a tensor-parallel model and a single-device copy of it side
by side and fails on the first output, loss, gradient or parameter that differs.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch_tp import ColwiseParallel
    >>> from torch_tp.testing import check_parity, device_type, run_distributed
    >>> def linear_parity() -> None:  # at module level, e.g. in a test file
    ...     torch.manual_seed(0)
    ...     mesh = init_device_mesh(device_type(), (2,))
    ...     check_parity(nn.Linear(8, 4), mesh, ColwiseParallel(), (torch.randn(3, 8),))
    >>> run_distributed(linear_parity, 2)  # doctest: +SKIP
    [None, None]
"""

from torch_tp.testing._comm import collective_counts
from torch_tp.testing._harness import (
    RankError,
    RankTimeout,
    device_type,
    run_distributed,
    shutdown,
)
from torch_tp.testing._parity import check_parity, gather_full

__all__ = [
    "RankError",
    "RankTimeout",
    "check_parity",
    "collective_counts",
    "device_type",
    "gather_full",
    "run_distributed",
    "shutdown",
]
