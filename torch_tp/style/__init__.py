"""Parallel styles: one class per way of parallelizing a module.

A style is a contract with the module it is applied to. It owns the whole story: which
module types it accepts (:meth:`ParallelStyle._validate`), how their parameters become
DTensors, and how inputs and outputs are laid out around the module
(:meth:`ParallelStyle._apply`). The semantics, arguments and defaults are those of
``torch.distributed.tensor.parallel``.

Linear and Embedding layers compute on their local shards: DTensor is used only at the
boundaries, to annotate and move layouts, while the matmul or the lookup runs on plain
tensors. Parameters stay DTensors, so optimizers, FSDP2 and checkpoints see one kind of
parameter.

The package, one module per family of styles, each class whole in one place with its
contract beside it:

* :mod:`torch_tp.style.base`: :class:`ParallelStyle` (the base class and its contract
  machinery) and the helpers every family uses: argument checks, ``short_repr`` for error
  messages, the plan being applied (``planning``), distributing parameters, running a
  module's forward on local views of them, what a stock Linear, Conv1D or Embedding computes;
* :mod:`torch_tp.style.linear`: :class:`ColwiseParallel`, :class:`RowwiseParallel`,
  :class:`PackedColwiseParallel`, :class:`PackedRowwiseParallel`;
* :mod:`torch_tp.style.sequence`: the styles that replicate a module's parameters,
  :class:`SequenceParallel` and :class:`ReplicateParallel`, and those that only move layouts,
  :class:`PrepareModuleInput`, :class:`PrepareModuleOutput`, :class:`PrepareModuleInputOutput`;
* :mod:`torch_tp.style.experts`: :class:`TensorParallelExperts`, :class:`ExpertParallel`,
  :class:`IdentityExpertParallel`, :class:`ExpertTensorParallel` (on a 2-D mesh);
* :mod:`torch_tp.style.attention`: :class:`MLAKVAProjParallel`, :class:`LocalParamsParallel`,
  :class:`AttentionHeads`;
* :mod:`torch_tp.style.regions`: :class:`PartialSumParallel` and its parts,
  :class:`LocalLinearParallel`;
* :mod:`torch_tp.style.context`: :class:`ContextParallel` (a sequence split over a ``cp``
  mesh, attention by a ring of key/value blocks) and its inputs' helpers.

The family modules import from :mod:`~torch_tp.style.base` only, never from each other. To add
a built-in style, write its class in the module of its family (or a new module beside them),
name it in that module's ``__all__``, and import it here and name it in ``__all__`` below:
``torch_tp`` exports what that ``__all__`` lists, and the class registers its plan names
itself when it is defined.

The families are imported below in a fixed order, not sorted: a class registers its plan names
when it is defined, and the registry keeps that order, which is the order plan names are
listed in and tried in (the first name that states a placement is the one a hint suggests).
"""

# isort: off
from torch_tp.style.base import ParallelStyle
from torch_tp.style.linear import (
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    RowwiseParallel,
)
from torch_tp.style.sequence import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    ReplicateParallel,
    SequenceParallel,
)
from torch_tp.style.experts import (
    ExpertParallel,
    ExpertTensorParallel,
    IdentityExpertParallel,
    TensorParallelExperts,
)
from torch_tp.style.attention import AttentionHeads, LocalParamsParallel, MLAKVAProjParallel
from torch_tp.style.regions import LocalLinearParallel, PartialSumParallel
from torch_tp.style.context import ContextParallel

# isort: on

# ParallelStyle and every style of the package (test_contract.py checks that none is missing);
# torch_tp.__all__ re-exports them all
__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "TensorParallelExperts",
    "ExpertParallel",
    "IdentityExpertParallel",
    "ExpertTensorParallel",
    "MLAKVAProjParallel",
    "LocalParamsParallel",
    "LocalLinearParallel",
    "PartialSumParallel",
    "AttentionHeads",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "ContextParallel",
]
