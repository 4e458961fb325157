"""Linear and Embedding layers sharded on their features: :class:`ColwiseParallel`,
:class:`RowwiseParallel`, and their packed variants :class:`PackedColwiseParallel` and
:class:`PackedRowwiseParallel` (fused projections whose blocks are sharded one by one).

The layers compute on their local shards: DTensor is used only at the boundaries, to annotate
and move layouts, while the matmul or the lookup runs on plain tensors. A subclass with its own
forward runs it on DTensors instead (an ``nn.Embedding`` subclass whose lookup gives whole
features: with its lookups done by the style, ``_OwnLookups``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from torch_tp import runtime
from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Boundary, Layout, StyleContract, Transfer
from torch_tp.style import adapters as _adapters
from torch_tp.style.base import (
    ParallelStyle,
    check_flag,
    check_int,
    check_not_distributed,
    check_single_layout,
    check_whole_not_distributed,
    conv1d_base,
    distribute_parameters,
    error_in_module,
    in_features_of,
    in_partial_region,
    out_features_of,
    replicate_parameters,
    short_repr,
    stock_projection,
    style_at,
    swap_back,
    swap_in_local_parameters,
    unstyled_submodules,
    uses_stock_forward,
)

__all__ = ["ColwiseParallel", "RowwiseParallel", "PackedColwiseParallel", "PackedRowwiseParallel"]


def _own_forward_caveat(style: ParallelStyle, module: nn.Module) -> str | None:
    if uses_stock_forward(module) or _own_lookups(style, module):
        return None  # an embedding's own forward computes on local tensors (_OwnLookups)
    return (
        f"{type(module).__name__} overrides forward, which then runs on DTensors: the "
        "collectives inside it are not predicted"
    )


def _own_lookups(style: ParallelStyle, module: nn.Module) -> bool:
    """Whether ``module``, an ``nn.Embedding`` subclass with its own forward, runs it on local
    tensors with its lookups done by ``style`` (:class:`_OwnLookups`): when the lookup's
    output is a local tensor whole in its features (replicated, or a sequence shard), which
    whatever the forward does next (a norm) may read as on one device. Otherwise it runs on
    DTensors."""
    if not isinstance(module, nn.Embedding) or uses_stock_forward(module):
        return False
    layout = style.output_layouts[0]
    whole = isinstance(layout, Replicate) or type(layout) is Shard and layout.dim in (0, 1)
    return whole and style.use_local_output


# what the contracts of ColwiseParallel and RowwiseParallel share: their arguments, the
# modules they take, their parameters, and a forward on local shards (unless the module has
# its own forward: then the caveat)
_LINEAR_EMBEDDING_CONTRACT: dict[str, Any] = {
    "arguments": lambda s: {
        "input_layouts": s.input_layouts[0],
        "output_layouts": s.output_layouts[0],
        "use_local_output": s.use_local_output,
    },
    "modules": (nn.Linear, nn.Embedding, "Conv1D"),
    "parameters": lambda s, m: s._parameter_placements(m),
    "local_forward": lambda s, m: True,
    "caveat": lambda s, m: _own_forward_caveat(s, m),
}


class _ShardLinearEmbedding(ParallelStyle):
    """What :class:`ColwiseParallel` and :class:`RowwiseParallel` share."""

    _default_input: Placement
    _default_output: Placement

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts = check_single_layout(
            input_layouts, self._default_input, "input_layouts"
        )
        self.output_layouts = check_single_layout(
            output_layouts, self._default_output, "output_layouts"
        )
        self.use_local_output = check_flag(use_local_output, "use_local_output")

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_kind(module)
        if not isinstance(module, (nn.Linear, nn.Embedding)) and conv1d_base(module) is None:
            raise NotImplementedError(
                f"{type(self).__name__}: {type(module).__qualname__} is named Conv1D but is "
                "not transformers' Conv1D (a 2-D weight of shape (nx, nf))"
            )
        if uses_stock_forward(module):
            check_not_distributed(module)
        else:
            check_whole_not_distributed(module)
        _check_parameter_placements(module, self._parameter_placements(module))
        if isinstance(module, nn.Embedding):
            if module.sparse:
                raise ValueError("sparse embedding gradients are not supported")
            if module.max_norm is not None:
                raise ValueError(
                    "max_norm renormalizes whole rows in place, which a sharded weight "
                    "cannot do locally; remove max_norm"
                )

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        """The placement of each parameter of ``module`` this style shards or replicates."""
        raise NotImplementedError

    def _shard(self, dim: int) -> Placement:
        """How a sharded dimension of a parameter is split (the packed styles stride it)."""
        return Shard(dim)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported type must not be half-applied
        rt = runtime.for_mesh(device_mesh)
        params = self._parameter_placements(module)
        distribute_parameters(module, rt, params, self.src_data_rank)
        boundaries = self._boundaries(module)
        if uses_stock_forward(module):
            forward = self._embedding if isinstance(module, nn.Embedding) else self._linear
            module.forward = functools.partial(forward, module, rt, boundaries)
            if forward == self._linear:
                _adapters.remember(module, self, rt)  # if PEFT wraps it later
        elif _own_lookups(self, module):
            # its own forward on local tensors, with the lookups of its weight done by the
            # style; the submodules it calls (a norm after the lookup: transformers' normed
            # embeddings) are replicated
            inner = unstyled_submodules(module)
            replicate_parameters(inner, rt, self.src_data_rank)
            module.forward = functools.partial(
                self._own_embedding_forward, module, rt, boundaries, type(module).forward, inner
            )
        else:
            # its own forward runs on DTensors, and so do the submodules it calls: their
            # parameters become replicated DTensors, whose gradients DTensor computes
            replicate_parameters(unstyled_submodules(module), rt, self.src_data_rank)
            _hook_dtensor_forward(self, module, rt, *boundaries)
        return module

    def _adapter_placements(self, base: nn.Module) -> tuple[dict, dict]:
        """The placements of a LoRA adapter's ``lora_A`` and ``lora_B`` parameters on
        ``base`` (see :mod:`torch_tp.style.adapters`)."""
        raise NotImplementedError

    def _check_adapters(self, wrapper: nn.Module, base: nn.Module) -> None:
        """Raise unless this style can host ``wrapper``'s LoRA adapters on ``base``."""
        if isinstance(base, nn.Embedding) or not uses_stock_forward(base):
            raise NotImplementedError(
                f"{type(self).__name__} hosts LoRA adapters on a stock nn.Linear or Conv1D, "
                f"found {type(base).__qualname__}"
            )

    def _host_adapters(self, wrapper: nn.Module, base: nn.Module, device_mesh: DeviceMesh):
        """Lay out ``wrapper``'s LoRA adapters to match ``base`` (to which this style was
        applied) and compute them with it."""
        # the runtime bound into base's forward when this style was applied to it
        _adapters.host(self, wrapper, base, _adapters.remembered(base)[1])

    def _own_embedding_forward(
        self,
        module: nn.Embedding,
        rt: runtime.DTensorRuntime,
        boundaries: tuple[Layout, Layout],
        own_forward,
        inner: list[nn.Module],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """An ``nn.Embedding`` subclass's own forward, on local tensors: each lookup of its
        weight is the style's own (as for a stock embedding), the submodules it calls
        compute on replicated parameters (whose gradients are partial sums when the lookup's
        output is sharded: a sequence shard)."""
        partial = not isinstance(boundaries[1].to, Replicate)
        swapped = swap_in_local_parameters(inner, rt, partial)
        try:
            with _OwnLookups(module, functools.partial(self._embedding, module, rt, boundaries)):
                return own_forward(module, *args, **kwargs)
        finally:
            swap_back(swapped)


class _OwnLookups(TorchFunctionMode):
    """``F.embedding`` of ``module``'s weight done by ``lookup(ids)``; every other call as it
    is. (An ``nn.Embedding`` subclass calls it through ``super().forward``, which no hook
    reaches.)"""

    def __init__(self, module: nn.Embedding, lookup) -> None:
        super().__init__()
        self.module = module
        self.lookup = lookup

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.module.weight:  # (the mode is off while this runs)
                return self.lookup(args[0] if args else kwargs["input"])
        return func(*args, **kwargs)


def _check_parameter_placements(module: nn.Module, placements: dict[str, Placement]) -> None:
    """Every placement a style gives a parameter names a dimension the parameter has."""
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if not isinstance(param, torch.Tensor) or not isinstance(placement, (Shard, StridedShard)):
            continue
        if not -param.ndim <= placement.dim < param.ndim:
            raise ValueError(
                f"the placement {placement!r} of parameter {name!r} names dim {placement.dim} "
                f"of a {param.ndim}-D tensor (shape {tuple(param.shape)}): a Shard dim must "
                f"be in [{-param.ndim}, {param.ndim})"
            )


def _hook_dtensor_forward(
    style: ParallelStyle, module: nn.Module, rt: runtime.DTensorRuntime, entry: Layout, exit: Layout
) -> None:
    """Run ``module``'s own forward on DTensors: annotate the first input as ``entry.given``
    and move it to ``entry.to`` before it, move the output to ``exit.to`` after it."""
    output_layout, use_local_output = exit.to, exit.local

    def enter(mod: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            x = rt.prepare(inputs[0], entry.given, entry.to, False)
        except runtime.ShardDimError as err:
            raise error_in_module(style, mod, err) from None
        return (x, *inputs[1:])

    def leave(mod: nn.Module, inputs: Any, output: Any) -> Any:
        if not isinstance(output, DTensor):
            return output
        try:
            out = rt.redistribute(output, runtime.normalize(output_layout, output.ndim))
        except runtime.ShardDimError as err:
            raise error_in_module(style, mod, err) from None
        return out.to_local() if use_local_output else out

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


class ColwiseParallel(_ShardLinearEmbedding):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` by output column.

    ``nn.Linear``: ``weight`` and ``bias`` are sharded on the output features (``Shard(0)``).
    ``nn.Embedding``: ``weight`` is sharded on the embedding dimension (``Shard(1)``).
    transformers' ``Conv1D`` (GPT-2's projections, weight stored ``(in, out)``): ``weight`` is
    sharded on the output features (``Shard(1)``), ``bias`` too (``Shard(0)``).
    The module computes with the whole (replicated) input and produces its output sharded on
    the last dimension; that output is then moved to ``output_layouts``. Pair it with
    :class:`RowwiseParallel` to shard an MLP or an attention block with one reduction.

    Keyword Args:
        input_layouts (Placement, optional): the layout of the module's input when it arrives
            as a local :class:`torch.Tensor`, used to annotate it as a DTensor. A DTensor input
            carries its own layout. Default: ``Replicate()``.
        output_layouts (Placement, optional): the layout of the module's output.
            Default: ``Shard(-1)``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that shards the module column-wise.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, ColwiseParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # a module with an "w1" nn.Linear submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # input of "w1" is taken as replicated; its output is a local shard of the last dim
        >>> sharded_mod = parallelize_module(m, tp_mesh, {"w1": ColwiseParallel()})

    .. note:: The default output is sharded on the last dimension: code between this module
        and the paired :class:`RowwiseParallel` sees only the local columns (for attention,
        the local heads), so shapes must be derived from tensors, not from the config.
    """

    _default_input = Replicate()
    _default_output = Shard(-1)

    contract = StyleContract(
        names={
            # replicated input, output sharded on the last dim (an MLP's or attention's first half)
            "colwise": {},
            # the output all-gathered (an lm_head returning whole logits)
            "colwise_gather_output": {"output_layouts": Replicate()},
            "colwise_rep": {"output_layouts": Replicate()},
            # on an nn.Embedding: weight sharded on the embedding dim, output gathered
            "embedding_colwise": {"output_layouts": Replicate()},
        },
        **_LINEAR_EMBEDDING_CONTRACT,
        # every rank computes with the whole input: its input gradients are partial sums
        inputs=lambda s, m: Boundary((Layout(s.input_layouts[0], Replicate(), grad=Partial()),)),
        outputs=lambda s, m: Boundary(
            (Layout(s._shard(-1), s.output_layouts[0], s.use_local_output),)
        ),
    )

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        # the output features: dim 0 of a Linear's weight, dim 1 of a Conv1D's
        out_dim = 0 if isinstance(module, nn.Linear) else 1
        return {"weight": self._shard(out_dim), "bias": self._shard(0)}

    def _adapter_placements(self, base: nn.Module) -> tuple[dict, dict]:
        # lora_A whole; lora_B's output features (dim 0) split like the base's
        return {"weight": Replicate()}, {"weight": self._shard(0), "bias": self._shard(0)}

    def _linear(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        boundaries: tuple[Layout, Layout],
        input: torch.Tensor,
        adapters: list[_adapters.Lora] | None = None,
    ) -> torch.Tensor:
        entry, exit = boundaries  # the contract's layouts (_boundaries)
        try:
            if isinstance(entry.given, Replicate) and in_partial_region(input):
                # the whole input of a region that sums its input gradients where it began
                # (PrepareModuleInput(partial_input_gradients=True)): this rank's partial
                # gradient goes back as it is
                x = input
            else:
                x = rt.enter(input, entry)
            weight = rt.local_parameter(module, "weight")
            y = stock_projection(self, module, x, weight, rt.local_parameter(module, "bias"))
            if adapters:  # PEFT's LoRA (torch_tp.style.adapters): this rank's columns too
                y = _adapters.column_terms(adapters, x, y, rt)
            return _leave(y, rt, exit, out_features_of(module))
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None

    def _embedding(
        self,
        module: nn.Embedding,
        rt: runtime.DTensorRuntime,
        boundaries: tuple[Layout, Layout],
        input: torch.Tensor,
    ) -> torch.Tensor:
        entry, exit = boundaries
        try:
            ids = rt.enter(input, entry)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None
        try:
            # the whole vocabulary on every rank: F.embedding checks the ids itself (on a
            # GPU, with a device-side assert, as on one device)
            y = F.embedding(
                ids,
                rt.local_parameter(module, "weight"),
                module.padding_idx,
                scale_grad_by_freq=module.scale_grad_by_freq,
            )
        except IndexError as err:
            raise IndexError(
                f"{style_at(self, module)}: {err}: token ids must be in "
                f"[0, {module.num_embeddings})"
            ) from err
        try:
            return _leave(y, rt, exit, module.embedding_dim)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None


def _leave(
    y: torch.Tensor, rt: runtime.DTensorRuntime, exit: Layout, features: int
) -> torch.Tensor:
    """``y``, computed sharded on its last dim (``features`` in all), as the output ``exit``
    describes."""
    if exit.local and exit.to == exit.given:
        return y  # the common case: as computed
    return rt.exit(y, exit, torch.Size((*y.shape[:-1], features)))


# The bytes of a vocabulary-parallel embedding's agreed check of its replicated ids: two
# int64s (see RowwiseParallel._check_ids)
_AGREED_IDS_BYTES = 16


def _shape_code(shape: torch.Size) -> int:
    """``shape`` as an int in ``[0, 2**61)``, equal for two shapes exactly when they are for
    ids of up to four dims, each below ``2 ** (56 // ndim)`` (a batch of 2**28 sequences of
    2**28 tokens): the ndim and the dims packed. Other shapes (never seen as token ids):
    ``2**60`` plus a hash of the shape (ints' and tuples' hashes are not salted), equal for
    different shapes only by a collision."""
    ndim = len(shape)
    bits = 56 // ndim if ndim else 0
    if ndim <= 4 and all(dim < 1 << bits for dim in shape):
        code = ndim
        for dim in shape:
            code = code << bits | dim
        return code
    return 1 << 60 | hash(tuple(shape)) & ((1 << 60) - 1)


_FEATURE_SHARDED_ADAPTER = (
    "a LoRA adapter's partial sum rides in the base layer's reduction, concatenated on the "
    "features: the output cannot be sharded on its last dimension (output_layouts={layout})"
)


class RowwiseParallel(_ShardLinearEmbedding):
    """Shard an ``nn.Linear`` or ``nn.Embedding`` by input row.

    ``nn.Linear``: ``weight`` is sharded on the input features (``Shard(1)``) and ``bias`` is
    replicated; the input must be sharded on its last dimension. ``nn.Embedding``: ``weight``
    is sharded on the vocabulary (``Shard(0)``) and the input ids are replicated; each rank
    looks up the ids it owns. transformers' ``Conv1D`` (weight stored ``(in, out)``):
    ``weight`` is sharded on the input features (``Shard(0)``), ``bias`` is replicated. Either
    way every rank holds a partial sum, which is reduced to ``output_layouts`` (an all-reduce
    for ``Replicate()``, a reduce-scatter for ``Shard(d)``). Sizes need not divide by the mesh
    size.

    Keyword Args:
        input_layouts (Placement, optional): the layout of the module's input when it arrives
            as a local :class:`torch.Tensor`. Default: ``Shard(-1)``.
        output_layouts (Placement, optional): the layout of the module's output.
            Default: ``Replicate()``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that shards the module row-wise.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, RowwiseParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # a module with a "w2" nn.Linear submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # input of "w2" is a local shard of the last dim; its output is replicated
        >>> sharded_mod = parallelize_module(m, tp_mesh, {"w2": RowwiseParallel()})
    """

    _default_input = Shard(-1)
    _default_output = Replicate()

    contract = StyleContract(
        names={
            # input sharded on the last dim, partial sums all-reduced to a replicated output
            "rowwise": {},
            # a replicated input, of which each rank uses its slice
            "rowwise_split_input": {"input_layouts": Replicate()},
            "rowwise_rep": {"input_layouts": Replicate()},
            # on an nn.Embedding: vocabulary-parallel lookup of replicated ids, output all-reduced
            "embedding_rowwise": {"input_layouts": Replicate()},
        },
        **_LINEAR_EMBEDDING_CONTRACT,
        partial_gradients=lambda s, m: s._partial_gradients(m),
        # an Embedding's replicated ids: whether any is out of range and their shape, agreed
        # (see _check_ids)
        transfers=lambda s, m, inputs, degree: (
            (Transfer("forward", "all_reduce", _AGREED_IDS_BYTES),)
            if isinstance(m, nn.Embedding) and inputs and not isinstance(s.input_layouts[0], Shard)
            else ()
        ),
        # a Linear computes with its slice of the input features; an Embedding looks up
        # every id (ids carry no gradient)
        inputs=lambda s, m: Boundary(
            (Layout(s.input_layouts[0], Replicate(), grad=Partial()),)
            if isinstance(m, nn.Embedding)
            else (Layout(s.input_layouts[0], s._shard(-1)),)
        ),
        outputs=lambda s, m: Boundary(
            (Layout(Partial(), s.output_layouts[0], s.use_local_output),)
        ),
    )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
            raise ValueError(
                "scale_grad_by_freq counts ids over the whole vocabulary, which a "
                "vocabulary shard cannot do locally; remove scale_grad_by_freq"
            )
        if not isinstance(module, nn.Embedding) and module.bias is not None:
            layout = self.output_layouts[0]
            if not isinstance(layout, (Replicate, Shard)):
                raise ValueError(
                    f"a biased Linear needs output_layouts Replicate() or Shard(d), found "
                    f"{layout}: the bias would be added once per rank to a partial sum"
                )

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(0)}
        # the input features: dim 1 of a Linear's weight, dim 0 of a Conv1D's
        in_dim = 1 if isinstance(module, nn.Linear) else 0
        return {"weight": self._shard(in_dim), "bias": Replicate()}

    def _adapter_placements(self, base: nn.Module) -> tuple[dict, dict]:
        # lora_A's input features (dim 1) split like the base's; lora_B whole
        return {"weight": self._shard(1)}, {"weight": Replicate(), "bias": Replicate()}

    def _check_adapters(self, wrapper: nn.Module, base: nn.Module) -> None:
        super()._check_adapters(wrapper, base)
        layout = self.output_layouts[0]
        if isinstance(layout, Shard) and layout.dim == -1:
            raise NotImplementedError(_FEATURE_SHARDED_ADAPTER.format(layout=layout))
        biased = [name for name, B in wrapper.lora_B.items() if B.bias is not None]
        if isinstance(layout, Partial) and biased:
            raise NotImplementedError(
                f"adapter(s) {biased} have a bias (lora_bias=True), which a partial output "
                "(output_layouts=Partial()) would get once per rank: leave lora_bias off for "
                "this layer"
            )

    def _partial_gradients(self, module: nn.Module) -> tuple[str, ...]:
        # the bias is added to a sharded output: each rank's gradient covers its shard only
        sharded = isinstance(self.output_layouts[0], Shard)
        biased = not isinstance(module, nn.Embedding) and getattr(module, "bias", None) is not None
        return ("bias",) if sharded and biased else ()

    def _linear(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        boundaries: tuple[Layout, Layout],
        input: torch.Tensor,
        adapters: list[_adapters.Lora] | None = None,
    ) -> torch.Tensor:
        entry, exit = boundaries  # the contract's layouts (_boundaries)
        x = input
        try:
            if isinstance(x, DTensor) or entry.given != entry.to:
                x = rt.enter(x, entry)  # else the local shard it computes with
            partial = stock_projection(self, module, x, rt.local_parameter(module, "weight"), None)
            if adapters:
                # PEFT's LoRA (torch_tp.style.adapters): lora_A's partial sums, reduced with
                # the base's in its one collective
                out = exit.to
                if isinstance(out, Shard) and runtime.normalize(out, x.ndim).dim == x.ndim - 1:
                    raise ValueError(
                        f"{style_at(self, module)}: " + _FEATURE_SHARDED_ADAPTER.format(layout=out)
                    )
                shard = runtime.normalize(entry.to, x.ndim)
                inner = _adapters.row_inputs(adapters, x, rt, shard, in_features_of(module))
                reduce = functools.partial(self._reduce, rt=rt, module=module, exit=exit)
                y, inner = _adapters.reduce_with(partial, inner, reduce)
            else:
                y = self._reduce(partial, rt, module, exit)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None
        sharded = isinstance(exit.to, Shard)
        if module.bias is not None:
            # added after the reduction, so that it is added once
            if isinstance(y, DTensor):
                y = y + module.bias
            else:
                # on a sharded output each rank's bias gradient sums over its shard: partial
                y = y + rt.local_parameter(module, "bias", partial=sharded)
        if adapters:
            # each rank's lora_B gradient is a partial sum on a sharded output (its tokens)
            # and on a partial one (its share of lora_A's output: the MLP's down projection
            # under sequence parallelism, reduced after the MLP)
            partial_out = sharded or isinstance(exit.to, Partial)
            y = _adapters.row_terms(adapters, inner, y, rt, partial_out)
        return y

    def _embedding(
        self,
        module: nn.Embedding,
        rt: runtime.DTensorRuntime,
        boundaries: tuple[Layout, Layout],
        input: torch.Tensor,
    ) -> torch.Tensor:
        entry, exit = boundaries  # the contract's layouts (_boundaries)
        try:
            ids = rt.enter(input, entry)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None
        if not ids.is_meta and not torch.compiler.is_compiling():
            # Ids out of the vocabulary would be foreign to every rank: rows of zeros, where
            # one device raises. Ids gathered from sequence shards are the same on every
            # rank; ids given as replicated are meant to be, but one rank's bad batch must
            # not leave the others waiting in the reduction below, nor a batch of another
            # shape with as many ids be summed with theirs: whether any is out of range and
            # their shape are agreed over the mesh first (one all-reduce of two numbers).
            # Reading them back is a host sync on a GPU (one). Under torch.compile the check
            # is left out: a branch on data would break the graph (meta ids have no values).
            gathered = isinstance(entry.given, Shard) and not isinstance(input, DTensor)
            self._check_ids(module, rt, ids, gathered)
        start, stop = runtime.shard_range(module.num_embeddings, rt.mesh)
        weight = rt.local_parameter(module, "weight")
        # ids this rank does not own look up row 0 and are zeroed; the sum over ranks
        # (the reduction below) then holds exactly one real row per id
        foreign = (ids < start) | (ids >= stop)
        if stop > start:
            pad = module.padding_idx
            local_pad = pad - start if pad is not None and start <= pad < stop else None
            y = F.embedding((ids - start).masked_fill(foreign, 0), weight, local_pad)
            y = y.masked_fill(foreign.unsqueeze(-1), 0.0)
        else:  # an empty shard (tiny vocabulary): contribute zeros, keep the graph
            y = weight.sum() + weight.new_zeros((*ids.shape, module.embedding_dim))
        try:
            return self._reduce(y, rt, module, exit)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None

    def _check_ids(
        self, module: nn.Embedding, rt: runtime.DTensorRuntime, ids: torch.Tensor, gathered: bool
    ) -> None:
        """Raise, on every rank, the error of one device's ``F.embedding`` if any rank's ids
        are outside the vocabulary, or a ``ValueError`` naming each rank's shape if the
        ranks' ids differ in shape (agreed over the mesh unless ``gathered``)."""
        size = module.num_embeddings
        if ids.numel():
            low, high = torch.aminmax(ids)
            bad = (low < 0) | (high >= size)
        else:
            bad = torch.zeros((), dtype=torch.bool, device=ids.device)
        if gathered or runtime.mesh_size(rt.mesh) == 1:  # the same ids on every rank, or one rank
            if bad.item():
                raise self._ids_out_of_range(module, ids)
            return
        # [2 * shape + bad, -2 * shape + bad], reduced by one maximum (2 int64s, as the ids'
        # least and greatest were before): the two maxima sum to 0 exactly when every
        # rank's shape code is the same and no rank's ids are out of range (a rank with a
        # greater code raises the first, one with a lesser code the second)
        group = rt.mesh.get_group()
        device = runtime.flag_device(group)
        code = 2 * _shape_code(ids.shape)
        agreed = bad.to(device) + torch.tensor([code, -code], dtype=torch.long, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
        if not agreed.sum().item():  # (one read back: a host sync on a GPU)
            return
        # the error path: which it is, from every rank's shape and verdict
        mine = bool(bad.item())
        found: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(found, (tuple(ids.shape), mine), group=group)
        if len({shape for shape, _ in found}) > 1:
            raise self._shapes_differ(module, [shape for shape, _ in found], group)
        runtime.raise_agreed(self._ids_out_of_range(module, ids) if mine else None, [group])

    def _shapes_differ(
        self,
        module: nn.Embedding,
        shapes: list[tuple[int, ...]],
        group: torch.distributed.ProcessGroup,
    ) -> ValueError:
        """The error of ids of different shapes on the ranks of ``group`` (``shapes``, one
        per rank of the group in order), naming each rank's."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        ranks = torch.distributed.get_process_group_ranks(group)  # global ranks
        for rank, shape in zip(ranks, shapes, strict=True):
            by_shape.setdefault(shape, []).append(rank)
        found = "; ".join(
            f"{shape} on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}"
            for shape, on in by_shape.items()
        )
        return ValueError(
            f"{style_at(self, module)}: the ranks of its tensor-parallel group were given ids "
            f"of different shapes: {found}. The ids are replicated over the group: give each "
            "of its ranks the same batch (ranks of other mesh dimensions, data parallelism, "
            "may differ)"
        )

    def _ids_out_of_range(self, module: nn.Embedding, ids: torch.Tensor) -> IndexError:
        """The error of one device's ``F.embedding``, naming the module and a few of the ids."""
        size = module.num_embeddings
        bad = ids[(ids < 0) | (ids >= size)]
        values = torch.unique(bad).tolist()
        shown = ", ".join(map(str, values[:5])) + (", ..." if len(values) > 5 else "")
        return IndexError(
            f"{style_at(self, module)}: index out of range: token ids must be in [0, {size}), "
            f"found {shown} ({bad.numel()} of {ids.numel()} ids out of range)"
        )

    def _reduce(
        self, partial: torch.Tensor, rt: runtime.DTensorRuntime, module: nn.Module, exit: Layout
    ) -> torch.Tensor:
        """The partial sums ``partial`` reduced to the output ``exit`` describes."""
        layout = exit.to
        if type(layout) is not Replicate:
            layout = runtime.normalize(layout, partial.ndim)
        if exit.local and isinstance(layout, Shard) and partial.shape[layout.dim] % rt.mesh.size():
            # uneven local shards cannot be annotated back into a DTensor downstream (from a
            # local tensor alone the global size is unknown): fail here, clearly
            raise ValueError(
                f"{style_at(self, module)}: the output is sharded on dim {layout.dim} of size "
                f"{partial.shape[layout.dim]}, which does not divide by the {rt.mesh.size()} "
                "ranks; make it divisible (e.g. the sequence length, for sequence "
                "parallelism) or pass use_local_output=False"
            )
        return rt.exit(partial, exit, partial.shape)


class _Packed:
    """What the packed styles share: a fused weight made of ``parts`` equal blocks."""

    parts: int

    def _check_parts(self, parts: int) -> int:
        if check_int(parts, "parts") < 1:
            raise ValueError(f"parts must be a positive int, found {parts}")
        return parts

    def _shard(self, dim: int) -> Placement:
        # rank r holds block r of every part: DTensor's strided shard, so that the full
        # tensor (a checkpoint, full_tensor()) is the single-device one, parts in order
        return StridedShard(dim, split_factor=self.parts)

    def _check_module(self, module: nn.Module) -> None:
        self._check_kind(module)
        # a module with its own forward would run on DTensors, which have no rule for a
        # strided-shard weight in a matmul
        if (isinstance(module, nn.Linear) or conv1d_base(module)) and not uses_stock_forward(
            module
        ):
            raise NotImplementedError(
                f"{type(self).__name__} needs the stock forward of nn.Linear or Conv1D; "
                f"{type(module).__qualname__} overrides it"
            )

    def _validate_parts(self, size: int, what: str, device_mesh: DeviceMesh) -> None:
        n = device_mesh.size()
        if size % (self.parts * n):
            raise ValueError(
                f"{what} of size {size} holds {self.parts} packed parts, each to be split over "
                f"{n} ranks: the size must be a multiple of {self.parts} x {n} = "
                f"{self.parts * n}"
            )


class PackedColwiseParallel(_Packed, ColwiseParallel):
    """Shard a fused projection (``qkv_proj``, ``gate_up_proj``, GPT-2's ``c_attn``) by output
    column, part by part.

    The output features are ``parts`` equal blocks laid end to end (q, k and v; gate and up).
    :class:`ColwiseParallel` would give the first rank all of q; this style gives every rank
    its slice of each part, so that rank ``r`` computes ``[q_r, k_r, v_r]``: its own heads of
    q, k and v, which the module then splits locally. The weight (and bias) become DTensors
    with DTensor's strided-shard placement, so gathering them (``full_tensor()``,
    :mod:`torch_tp.checkpoint`) gives the single-device tensor. Supports ``nn.Linear`` and
    transformers' ``Conv1D``.

    .. note:: Not supported under FSDP2 yet: ``fully_shard`` on top of a strided shard gives
        placements that do not describe what each rank holds (training runs, but gathered
        values are scrambled), and :mod:`torch_tp.checkpoint` refuses such parameters.

    Args:
        parts (int, optional): the number of packed blocks. Default: 2 (``gate_up_proj``).

    Keyword Args:
        input_layouts (Placement, optional): as for :class:`ColwiseParallel`.
            Default: ``Replicate()``.
        output_layouts (Placement, optional): ``None`` keeps the packed local slices
            (``[q_r, k_r, v_r]``); ``Replicate()`` gathers the whole output. Default: ``None``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PackedColwiseParallel, AttentionHeads
        >>> # GPT-2: c_attn packs q, k and v; GPT2Attention splits it by its split_size
        >>> plan = {
        ...     "h.*.attn": AttentionHeads("num_heads", divide=("num_heads", "split_size")),
        ...     "h.*.attn.c_attn": PackedColwiseParallel(3),
        ...     "h.*.attn.c_proj": RowwiseParallel(),
        ... }
    """

    contract = dataclasses.replace(
        ColwiseParallel.contract,
        # a fused projection packing two parts along its outputs (gate_up_proj)
        names={"packed_colwise": {"parts": 2}},
        arguments=lambda s: {
            "parts": s.parts,
            "input_layouts": s.input_layouts[0],
            "output_layouts": s.output_layouts[0]
            if isinstance(s.output_layouts[0], Replicate)
            else None,
            "use_local_output": s.use_local_output,
        },
        modules=(nn.Linear, "Conv1D"),
    )

    def __init__(
        self,
        parts: int = 2,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        if output_layouts is not None and not isinstance(output_layouts, Replicate):
            raise ValueError(
                f"output_layouts of a packed projection must be None (packed local slices) "
                f"or Replicate(), found {short_repr(output_layouts)}"
            )
        self.parts = self._check_parts(parts)
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts or StridedShard(-1, split_factor=self.parts),
            use_local_output=use_local_output,
        )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_module(module)
        super()._validate(module, device_mesh)
        self._validate_parts(out_features_of(module), "the output features", device_mesh)


class PackedRowwiseParallel(_Packed, RowwiseParallel):
    """Shard a projection whose input features are ``parts`` packed blocks, part by part.

    The row-wise partner of :class:`PackedColwiseParallel`: the input arrives as this rank's
    slice of every part (``[a_r, b_r]``), and the weight is sharded on its input features
    the same way (DTensor's strided shard), so the partial sums are reduced as for
    :class:`RowwiseParallel`. Supports ``nn.Linear`` and transformers' ``Conv1D``.

    Args:
        parts (int, optional): the number of packed blocks. Default: 2.

    Keyword Args:
        output_layouts (Placement, optional): as for :class:`RowwiseParallel`.
            Default: ``Replicate()``.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``True``.
    """

    contract = dataclasses.replace(
        RowwiseParallel.contract,
        # the row-parallel partner of packed_colwise, its input features packed the same way
        names={"packed_rowwise": {"parts": 2}},
        arguments=lambda s: {
            "parts": s.parts,
            "output_layouts": s.output_layouts[0],
            "use_local_output": s.use_local_output,
        },
        modules=(nn.Linear, "Conv1D"),
    )

    def __init__(
        self,
        parts: int = 2,
        *,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        self.parts = self._check_parts(parts)
        super().__init__(output_layouts=output_layouts, use_local_output=use_local_output)
        # the input is this rank's slice of every part, as a packed column-parallel gives it
        self.input_layouts = (StridedShard(-1, split_factor=self.parts),)

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_module(module)
        super()._validate(module, device_mesh)
        self._validate_parts(in_features_of(module), "the input features", device_mesh)
