"""``cp_degree=`` of the plans that :func:`~torch_tp.plans.hf.plan_for` and
:func:`~torch_tp.plans.auto.auto` make: :class:`~torch_tp.ContextParallel` on the model's
blocks, beside its tensor-parallel plan, for one ``parallelize_module`` call on a mesh with
dimensions ``("cp", "tp")``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from torch_tp import ContextParallel

__all__ = ["with_context_parallel"]


def with_context_parallel(
    model: nn.Module, plan: Mapping[str, Any], cp_degree: int | None
) -> dict[str, Any]:
    """``plan`` with ``ContextParallel()`` on every block of ``model`` (the largest stack of
    blocks, ``"model.layers.*"``) when ``cp_degree`` is over 1; ``plan`` as it is otherwise.

    Raises:
        ValueError: ``cp_degree`` is not a positive int, or the plan already gives the blocks
            a style (a block takes one).
    """
    if cp_degree is None:
        return dict(plan)
    if isinstance(cp_degree, bool) or not isinstance(cp_degree, int) or cp_degree < 1:
        raise ValueError(f"cp_degree must be a positive int, found {cp_degree!r}")
    if cp_degree == 1:
        return dict(plan)
    from torch_tp.plans.auto.blocks import find_blocks  # (auto imports this module)

    path, names, _ = find_blocks(model)
    prefix = f"{path}." if path else ""
    blocks = {f"{prefix}*", *(f"{prefix}{name}" for name in names)}
    taken = sorted(key for key in plan if key in blocks)
    if taken:
        raise ValueError(
            f"cp_degree={cp_degree}: context parallelism goes on the blocks ({prefix}*), and "
            f"the plan already gives them a style ({taken}); write the plan by hand, with "
            "ContextParallel on a module around each attention that has no style"
        )
    return {**plan, f"{prefix}*": ContextParallel()}
