"""Counting collectives by kind, whichever API issued them."""

from __future__ import annotations

from collections import Counter

from torch.distributed.tensor.debug import CommDebugMode

__all__ = ["collective_counts"]

# c10d's in-place ops and the functional collectives, by the kind of collective they are
_KINDS = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}


def collective_counts(mode: CommDebugMode) -> Counter[str]:
    """The collectives a :class:`CommDebugMode` saw, counted by kind.

    ``CommDebugMode`` keys its counts by operator, so the same all-reduce is
    ``c10d.allreduce_`` when issued by ``torch.distributed.all_reduce`` and
    ``c10d_functional.all_reduce`` when issued by DTensor. This folds both into one kind:
    ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"broadcast"`` or
    ``"all_to_all"`` (other operators keep their own name).

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> with CommDebugMode() as comm:
        ...     model(tokens).sum().backward()
        >>> collective_counts(comm)
        Counter({'all_reduce': 18, 'all_gather': 1})
    """
    counts: Counter[str] = Counter()
    for op, n in mode.get_comm_counts().items():
        name = getattr(op, "__name__", None) or str(op).rsplit(".", 1)[-1]
        counts[_KINDS.get(name, name)] += n
    return counts
