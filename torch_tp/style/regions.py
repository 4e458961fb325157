"""Partial-sum regions: :class:`PartialSumParallel`, a module whose forward, run on this
rank's shards as local tensors, gives each rank a part of its first output, summed as it
leaves; and :class:`LocalLinearParallel`, a Linear inside such a region computing on its shard
with no collective (:class:`~torch_tp.style.attention.LocalParamsParallel` is the other part).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_tp import _torch_compat as compat
from torch_tp import runtime
from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Boundary, Layout, StyleContract
from torch_tp.style.base import (
    ParallelStyle,
    check_direct_placements,
    check_not_distributed,
    check_placements_argument,
    check_whole_not_distributed,
    distribute_and_wrap,
    distribute_whole,
    run_on_local_parameters,
    short_repr,
    style_at,
    swap_back,
    swap_in_local_parameters,
    unstyled_submodules,
)

__all__ = ["LocalLinearParallel", "PartialSumParallel"]


# what LocalLinearParallel's kinds do to a Linear: (weight, bias) placements
_LOCAL_LINEAR = {
    "colwise": (Shard(0), Shard(0)),
    "rowwise": (Shard(1), Replicate()),
    "packed_rowwise": (StridedShard(1, split_factor=2), Replicate()),
}


class LocalLinearParallel(ParallelStyle):
    """An ``nn.Linear`` sharded as a column- or row-parallel layer, computing on this rank's
    shard with no collective: one part of a :class:`PartialSumParallel` region.

    Its input and output are local tensors, used as they are: ``"colwise"`` takes the whole
    input and gives this rank's output features; ``"rowwise"`` takes this rank's input
    features and gives a partial sum; ``"packed_rowwise"`` is ``"rowwise"`` for input
    features packed as two blocks (each rank its slice of each, as
    :class:`PackedRowwiseParallel`). The region around it sums what must be summed: its
    first output in the forward, its inputs' gradients in the backward. Outside a region the
    style is refused, since nothing would sum the partial results. These are transformers
    4.x's ``local_colwise``, ``local_rowwise`` and ``local_packed_rowwise``; in a plan entry
    naming a parameter (stacked experts ``[n_experts, out, in]``) they state
    ``Shard(-2)``, ``Shard(-1)`` and a packed ``Shard(-1)``.

    Args:
        shard (str): ``"colwise"`` (weight and bias split by output feature),
            ``"rowwise"`` (weight split by input feature) or ``"packed_rowwise"``. A
            row-parallel layer takes no bias: each rank would add it to its part of the sum.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {  # transformers 4.x's plan for Llama 4's dense feed-forward
        ...     "layers.*.feed_forward.gate_proj": "local_colwise",
        ...     "layers.*.feed_forward.up_proj": "local_colwise",
        ...     "layers.*.feed_forward.down_proj": "local_rowwise",
        ...     "layers.*.feed_forward": "gather",
        ... }
    """

    contract = StyleContract(
        names={
            "local_colwise": {"shard": "colwise"},
            "local_rowwise": {"shard": "rowwise"},
            "local_packed_rowwise": {"shard": "packed_rowwise"},
        },
        arguments=lambda s: {"shard": s.shard},
        modules=(nn.Linear,),
        parameters=lambda s, m: s._parameter_placements(m),
        local_forward=lambda s, m: True,
        partial_sum=lambda s: "part",
    )

    def __init__(self, shard: str) -> None:
        super().__init__()
        if shard not in _LOCAL_LINEAR:
            raise ValueError(
                f"shard must be one of {', '.join(map(repr, _LOCAL_LINEAR))}, found "
                f"{short_repr(shard)}"
            )
        self.shard = shard

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        weight, bias = _LOCAL_LINEAR[self.shard]
        placements = {"weight": weight}
        if getattr(module, "bias", None) is not None:
            placements["bias"] = bias
        return placements

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        n = device_mesh.size()
        if self.shard == "colwise":
            size, what = module.out_features, "output features"
        else:
            size, what = module.in_features, "input features"
            if module.bias is not None:
                raise ValueError(
                    f"a {self.shard} layer computing one part of a sum takes no bias: each "
                    "rank would add it to its part, and the sum would hold it once per rank"
                )
        parts = 2 * n if self.shard == "packed_rowwise" else n
        if size % parts:
            raise ValueError(f"its {size} {what} do not split evenly into {parts} parts")
        check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        return distribute_and_wrap(self, module, device_mesh, self._parameter_placements(module))

    def _forward(
        self, module: nn.Module, rt: runtime.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        return run_on_local_parameters(module, rt, False, own_forward, *inputs, **kwargs)


def _forward_inputs(module: nn.Module) -> tuple[list[str], list[str]]:
    """The names of ``module``'s forward's positional inputs, and of its keyword-only ones."""
    positional, keyword = [], []
    for param in inspect.signature(type(module).forward).parameters.values():
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            positional.append(param.name)
        elif param.kind is param.KEYWORD_ONLY:
            keyword.append(param.name)
    return positional[1:], keyword  # less self


class PartialSumParallel(ParallelStyle):
    """A module whose forward, run on this rank's shards as local tensors, gives each rank
    a part of its first output: summed over the ranks as it leaves.

    The module's own parameters are sharded as the plan's parameter entries under it say
    (Inkling's shared experts: stacked ``gate_proj``/``up_proj`` ``"colwise"``,
    ``down_proj`` ``"rowwise"``); the modules inside it compute with no collective of their
    own (:class:`LocalLinearParallel`, :class:`LocalParamsParallel`, or no style). Every
    other parameter inside it (its own without an entry, those of its submodules without a
    style: Llama 4's router) is replicated, and, since it computes toward a partial sum, its
    gradient is one too, summed over the ranks. In the forward, the first output (or the
    module's only one) is summed in one all-reduce; in the backward, the gradients of its
    floating-point inputs (those its forward names: one passed through ``*args`` or
    ``**kwargs`` is refused), partial sums too, are summed in one all-reduce. Its other outputs
    are replicated: their gradient counts on one rank, so that the sums hold it once. A
    style that issues collectives of its own inside the region is refused (the sum would
    count its results once per rank), and so is a replicated parameter added to the output
    directly, which no check can see: the module's forward must compute every term of its
    first output from this rank's shards.

    This is transformers' ``all_reduce`` (5.x) and ``gather`` (4.x, around ``local_*``
    layers): Llama 4's feed-forward sums its shared expert and its routed experts, both
    partial, in one all-reduce.

    Args:
        placements (Mapping[str, Placement], optional): the placement of each of the
            module's own parameters. Default: ``None``, taken from the plan's parameter
            entries under the module; the others are replicated.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {  # transformers 5.x's plan for Inkling's shared experts
        ...     "layers.*.mlp.shared_experts.gate_proj": "colwise",  # Shard(-2)
        ...     "layers.*.mlp.shared_experts.up_proj": "colwise",
        ...     "layers.*.mlp.shared_experts.down_proj": "rowwise",  # Shard(-1)
        ...     "layers.*.mlp.shared_experts": "all_reduce",
        ... }
    """

    contract = StyleContract(
        names={"all_reduce": {}, "gather": {}},
        arguments=lambda s: {"placements": s.placements},
        parameters=lambda s, m: s._parameter_placements(m),
        partial_gradients=lambda s, m: tuple(
            ".".join(key) if isinstance(key, tuple) else key for key, _ in s._replicated(m)
        ),
        inputs=lambda s, m: s._input_boundary(m),
        outputs=lambda s, m: Boundary((Layout(Partial(), Replicate()),)),
        local_forward=lambda s, m: True,
        partial_sum=lambda s: "region",
    )

    def _with_parameter_entries(self, placements: Mapping[str, Placement]) -> PartialSumParallel:
        """The style the plan's parameter entries under its module make of it (transformers'
        ``"...experts.gate_up_proj": "local_colwise"`` inside a ``"gather"`` region)."""
        return type(self)({**(self.placements or {}), **placements})

    def __init__(self, placements: Mapping[str, Placement] | None = None) -> None:
        super().__init__()
        # no entries: the default
        self.placements = check_placements_argument(placements) or None

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Each direct parameter's placement: its entry's, else replicated."""
        placements = self.placements or {}
        return {
            name: placements.get(name, Replicate())
            for name, _ in module.named_parameters(recurse=False)
        }

    def _replicated(self, module: nn.Module) -> list[tuple[Any, nn.Module]]:
        """The replicated parameters the region sums the gradients of: ``(name, module)``
        for its own, ``((path, name), submodule)`` for those of submodules the plan gives no
        style (all of them, for a style applied by hand)."""
        placements = self._parameter_placements(module)
        found: list[tuple[Any, nn.Module]] = [
            (name, module) for name, p in placements.items() if isinstance(p, Replicate)
        ]
        paths = {id(sub): path for path, sub in module.named_modules()}
        for sub in unstyled_submodules(module):
            found += [((paths[id(sub)], n), sub) for n, _ in sub.named_parameters(recurse=False)]
        return found

    def _input_boundary(self, module: nn.Module) -> Boundary:
        whole = Layout(Replicate(), Replicate(), grad=Partial())
        positional, keyword = _forward_inputs(module)
        return Boundary(
            tuple(whole for _ in positional),
            {n: whole for n in [*positional, *keyword]},
            coalesced=True,
        )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        check_direct_placements(module, self.placements or {}, device_mesh)
        check_whole_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        placements = self._parameter_placements(module)
        # its own replicated parameters: partial gradients, like those of the inner modules
        replicated = frozenset(n for n, p in placements.items() if isinstance(p, Replicate))
        layouts = self._entry_and_exit(module)  # the contract's, which the forward computes
        return distribute_whole(self, module, device_mesh, placements, replicated, layouts)

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        inner: list[nn.Module],
        replicated: frozenset[str],
        layouts: tuple[Boundary, Layout],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        entry, exit = layouts
        names = list(range(len(args))) + list(kwargs)
        values = self._enter(module, rt, entry, list(args), kwargs)
        args = tuple(values[: len(args)])
        kwargs = dict(zip(names[len(args) :], values[len(args) :], strict=True))
        # the replicated parameters inside, as local tensors with partial gradients
        swapped = swap_in_local_parameters(inner, rt, True)
        try:
            params = compat.direct_parameters(module)
            local = {
                name: rt.local_parameter(module, name, partial=name in replicated)
                for name in params
            }
            compat.swap_direct_parameters(module, local)
            try:
                output = own_forward(module, *args, **kwargs)
            finally:
                compat.swap_direct_parameters(module, params)
        finally:
            swap_back(swapped)
        return self._leave(module, rt, exit, output)

    def _enter(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        entry: Boundary,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> list[Any]:
        """The inputs, then the keyword inputs, as ``entry`` (the contract's input layouts)
        states them: each floating-point one read whole, its gradient a partial sum that the
        region sums (the whole ones together, in one all-reduce, as ``entry.coalesced``
        says). A floating-point input the contract does not state (passed through
        ``*args`` or ``**kwargs``) is refused: nothing would sum its gradient."""
        values = [*args, *kwargs.values()]
        stated = [entry.args[i] if i < len(entry.args) else None for i in range(len(args))]
        stated += [entry.kwargs.get(name) for name in kwargs]
        floating = [
            i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        unstated = [i for i in floating if stated[i] is None]
        if unstated:
            where = [
                f"input {i}" if i < len(args) else repr(list(kwargs)[i - len(args)])
                for i in unstated
            ]
            raise ValueError(
                f"{style_at(self, module)}: the floating-point {', '.join(where)} is not an "
                "input the contract states (the forward's named inputs: "
                f"{', '.join(entry.kwargs) or 'none'}), and the region sums the gradients of "
                "those only: pass it by one of them"
            )
        whole = [
            i
            for i in floating
            if entry.coalesced
            and isinstance(stated[i].to, Replicate)
            and isinstance(stated[i].grad, Partial)
        ]
        if whole:
            entered = rt.enter_replicated_many(tuple(values[i] for i in whole))
            for i, value in zip(whole, entered, strict=True):
                values[i] = value
        for i in floating:
            if i not in whole:
                values[i] = rt.enter(values[i], stated[i])
        return values

    def _leave(
        self, module: nn.Module, rt: runtime.DTensorRuntime, exit: Layout, output: Any
    ) -> Any:
        """The first output summed into ``exit`` (the contract's layout of it); the others'
        gradients kept on one rank."""
        if isinstance(output, torch.Tensor):
            return rt.exit(output, exit, output.shape)
        if not isinstance(output, tuple) or not output or not isinstance(output[0], torch.Tensor):
            raise TypeError(
                f"{style_at(self, module)}: expected the module to return a tensor, or a tuple "
                f"whose first element is one (the partial sum), found {short_repr(output)}"
            )
        first, *rest = output
        rest = [
            runtime.gradient_on_rank_zero(t, rt.mesh)
            if isinstance(t, torch.Tensor) and t.requires_grad
            else t
            for t in rest
        ]
        items = (rt.exit(first, exit, first.shape), *rest)
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
