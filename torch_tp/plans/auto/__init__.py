"""An automatic tensor-parallel plan, inferred from a model's structure.

:func:`auto` reads the module tree (and the parameter shapes, which a model on the meta
device has too) and returns an ordinary plan dict: the one a person would write for a
Megatron-style layout, with ``*`` over the repeated blocks. Print it with
:func:`torch_tp.plan.to_dict`, edit it, and pass it to :func:`torch_tp.parallelize_module`.
Where the structure does not say clearly what to do, :func:`auto` refuses with a
``ValueError`` that names the module and what was ambiguous, rather than guess.

The package, in the order :func:`auto` walks a model (at run time each module imports only
modules listed below it):

* :mod:`~torch_tp.plans.auto.infer`: :func:`auto` itself (its docstring states the rules),
  the plan of the whole model (the blocks, then the input embedding and the output head
  outside them), the shape check on the meta device and the groups it sends back to be
  computed whole, and the two warnings;
* :mod:`~torch_tp.plans.auto.blocks`: the stack of repeated blocks, its kinds (blocks of one
  structure, planned once), and the walk over a block's children, each sent to its planner;
  then the block's other parameters, the merge into plan keys and the TP degree check;
* :mod:`~torch_tp.plans.auto.experts`: mixtures of experts stacked in 3-D parameters;
* :mod:`~torch_tp.plans.auto.mixers`: token mixers it cannot split (state spaces, linear
  attention, convolutions), left whole;
* :mod:`~torch_tp.plans.auto.attention`: one attention or MLP group planned: head counts,
  attention sinks, attentions computed whole, and the sizes its ``forward`` reads;
* :mod:`~torch_tp.plans.auto.groups`: the Linear-like layers of a block in groups, the hidden
  size, and the column/row-parallel matching that tells an attention, multi-head latent
  attention and an MLP apart.
"""

import sys
import types
from typing import Any

from torch_tp.plans.auto.infer import ReplicatedModulesWarning, UncheckedPlanWarning, auto

__all__ = ["ReplicatedModulesWarning", "UncheckedPlanWarning", "auto"]


class _CallablePackage(types.ModuleType):
    """This package, called as the function it is named for: ``torch_tp.plans.auto(model)``
    is :func:`auto`, and ``torch_tp.plans.auto.infer`` is still the module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return auto(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
