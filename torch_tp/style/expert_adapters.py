"""PEFT's LoRA on the stacked weights of mixture-of-experts layers, under
:class:`~torch_tp.TensorParallelExperts`.

PEFT adapts a parameter rather than a layer when a config names it in
``target_parameters`` (``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``): the
experts module is wrapped in a ``peft.tuners.lora.layer.ParamWrapper`` per parameter (nested:
the second wraps the first), each with a ``lora_A`` ``(r * E, in)`` and a ``lora_B`` ``(out,
r * E)`` per adapter. Its forward registers a torch parametrization for the call, so that the
experts' own forward reads ``W + delta``, with expert ``e``'s delta
``scaling * B[:, :, e] @ A[e]`` (``A`` read as ``(E, r, in)``, ``B`` as ``(out, r, E)``).

Hosted by :class:`~torch_tp.TensorParallelExperts`, the delta is laid out like the weight it
adds to, and the experts' own forward runs on ``W_local + delta_local``: no collective beyond
the experts' own.

* ``gate_up_proj`` ``[E, 2I, H]`` (each rank a strided slice of every expert's gate and up
  rows): ``lora_B`` strided like it on its output rows, ``lora_A`` whole.
* ``down_proj`` ``[E, H, I]`` (each rank a slice of the hidden columns): ``lora_A`` sharded on
  its input columns, ``lora_B`` whole.

The same holds for the transposed layouts (the delta's dimensions follow PEFT's reading of
the parameter). A factor kept whole gets a partial gradient on each rank (its share of the
delta's rows or columns), summed with the other partial gradients at the end of backward.

Entries in the state dict are the full factors, as for :mod:`torch_tp.style.adapters`. Other
styles of experts (:class:`~torch_tp.ExpertParallel`, ``ExpertTensorParallel``) refuse such
adapters by name. PEFT's own ``merge_and_unload`` works as it is: its delta of the DTensor
factors is a DTensor laid out like the weight, added in place (the merged experts keep the
plan's layout and their style's forward).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from torch_tp import _torch_compat as compat
from torch_tp import runtime
from torch_tp._torch_compat import StridedShard
from torch_tp.style import adapters as _adapters
from torch_tp.style.base import MODULE_PATH_ATTR, distribute_parameters

__all__: list[str] = []


class ParameterLora(NamedTuple):
    """One active adapter of one hosted parameter, as the experts' forward reads it."""

    parameter: str
    A: nn.Linear
    B: nn.Linear
    scaling: float
    experts: int
    swapped: bool  # PEFT's reading: the parameter is (experts, out, in), else (.., in, out)
    whole: str  # "A" or "B": the factor every rank holds whole (a partial gradient)


def chain(wrapper: nn.Module) -> list[nn.Module]:
    """``wrapper`` and the PEFT layers nested inside it, outermost first (one per parameter)."""
    out = []
    module = wrapper
    while _adapters.tuner_layer(module):
        out.append(module)
        module = module.base_layer
    return out


def factor_placements(weight: Placement, swapped: bool) -> tuple[dict, dict]:
    """The placements of ``lora_A`` and ``lora_B`` for a parameter placed ``weight``: the
    factor whose dimension is the weight's sharded one is sharded alike (strided alike);
    the other is whole."""
    dim = weight.dim
    if dim not in (1, 2):
        raise NotImplementedError(f"a stacked expert weight sharded on dim {dim}")
    # the delta is (E, out, in) when PEFT swapped its features, else (E, in, out): out is
    # lora_B's dim 0, in is lora_A's dim 1
    on_b = (dim == 1) == swapped
    factor_dim = 0 if on_b else 1
    if isinstance(weight, StridedShard):
        sharded = StridedShard(factor_dim, split_factor=weight.split_factor)
    else:
        sharded = Shard(factor_dim)
    if on_b:
        return {"weight": Replicate()}, {"weight": sharded}
    return {"weight": sharded}, {"weight": Replicate()}


def check(style: Any, wrapper: nn.Module, base: nn.Module) -> None:
    """Raise ``NotImplementedError`` unless every PEFT layer of ``wrapper``'s chain is LoRA on
    one of ``base``'s stacked expert weights that ``style`` shards (``ValueError`` for an
    adapter already distributed). Nothing changes."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    cls = getattr(layer, "ParamWrapper", None)
    placements = style._parameter_placements(base)
    for w in chain(wrapper):
        if _adapters.hosting(w) is not None:
            continue  # hosted already (parallelize_module, then get_peft_model: the inner)
        tuner = _adapters._tuner_name(w)
        if cls is None or not isinstance(w, cls) or type(w).forward is not cls.forward:
            raise NotImplementedError(
                f"the experts are wrapped in {tuner} next to LoRA on their parameters: "
                f"{type(style).__name__} hosts PEFT's LoRA on stacked expert weights "
                "(target_parameters=, peft.tuners.lora.layer.ParamWrapper) only"
            )
        name = w.parameter_name
        if name not in placements:
            raise NotImplementedError(
                f"{tuner}: LoRA on the parameter {name!r}, which {type(style).__name__} does "
                f"not shard; it hosts LoRA on {sorted(placements)}"
            )
        if getattr(base, name).ndim != 3 or w.num_experts != getattr(base, name).shape[0]:
            raise NotImplementedError(
                f"{tuner}: LoRA on {name!r} reads it as {w.num_experts} experts; "
                f"{type(style).__name__} hosts LoRA on 3-D stacked expert weights"
            )
        if w.fan_in_fan_out or getattr(w, "lora_variant", None):
            raise NotImplementedError(
                f"{tuner}: fan_in_fan_out or a LoRA variant on {name!r} is not supported"
            )
        for adapter, A in w.lora_A.items():
            parts = [A, w.lora_B[adapter]] if adapter in w.lora_B else [A]
            for part in parts:
                if type(part) is not nn.Linear or (part is not A and part.bias is not None):
                    raise NotImplementedError(
                        f"{tuner}: adapter {adapter!r}: {type(part).__name__} factors with a "
                        "bias are not supported (PEFT's bias-free nn.Linear factors are)"
                    )
                if isinstance(part.weight, DTensor):
                    raise ValueError(
                        f"{tuner}: adapter {adapter!r}: its factor is already a DTensor with "
                        f"placements {part.weight.placements}: the adapter was parallelized "
                        "before"
                    )


def placements_of(style: Any, wrapper: nn.Module, base: nn.Module) -> tuple[dict, dict]:
    """``(lora_A placements, lora_B placements)`` of ``wrapper``'s parameter on ``base``."""
    weight = style._parameter_placements(base)[wrapper.parameter_name]
    return factor_placements(weight, wrapper._did_swap_in_out_features)


def host(style: Any, wrapper: nn.Module, base: nn.Module, rt: runtime.DTensorRuntime) -> None:
    """Lay out the adapters of ``wrapper`` and of every PEFT layer nested in it to match
    ``base``'s weights, and compute them in the experts' forward (``style`` applied to
    ``base``; :func:`check` passed)."""
    for w in chain(wrapper):
        if _adapters.hosting(w) is not None:
            continue
        A_places, B_places = placements_of(style, w, base)
        for name in list(w.lora_A):
            distribute_parameters(w.lora_A[name], rt, A_places, style.src_data_rank)
            distribute_parameters(w.lora_B[name], rt, B_places, style.src_data_rank)
        _adapters.mark_hosted(w, style, base, rt)
        # the factor every rank holds whole: its gradient is a partial sum
        whole = "A" if isinstance(A_places["weight"], Replicate) else "B"
        w.forward = functools.partial(_forward, w, base, whole)


def _where(base: nn.Module) -> str:
    path = getattr(base, MODULE_PATH_ATTR, None)
    return f"the experts {path!r}" if path else "an experts module"


def _forward(
    wrapper: nn.Module,
    base: nn.Module,
    whole: str,
    x: torch.Tensor,
    *args: Any,
    adapters: list[ParameterLora] | None = None,
    **kwargs: Any,
) -> Any:
    """PEFT's ParamWrapper forward, handing this layer's active adapters (with those of the
    layers around it, ``adapters``) on to the layer it wraps, down to the experts' style,
    instead of a parametrization of the distributed weight."""
    if kwargs.pop("adapter_names", None) is not None:
        raise ValueError(f"{_where(base)}: LoRA on parameters does not support mixed batches")
    adapters = list(adapters or ())
    if wrapper.disable_adapters and wrapper.merged:
        wrapper.unmerge()
    if not (wrapper.disable_adapters or wrapper.merged):
        for name in wrapper.active_adapters:
            if name not in wrapper.lora_A:
                continue
            A, B = wrapper.lora_A[name], wrapper.lora_B[name]
            if not isinstance(A.weight, DTensor):
                raise RuntimeError(
                    f"{_where(base)}: adapter {name!r} on {wrapper.parameter_name!r} was added "
                    "without torch_tp laying it out; add adapters through PEFT's API"
                )
            adapters.append(
                ParameterLora(
                    wrapper.parameter_name, A, B, wrapper.scaling[name], wrapper.num_experts,
                    wrapper._did_swap_in_out_features, whole,
                )
            )  # fmt: skip
    if adapters:
        kwargs["adapters"] = adapters
    # through the inner layer's __call__, as PEFT's forward does (its hooks run)
    return wrapper.base_layer(x, *args, **kwargs)


def _delta(lora: ParameterLora, rt: runtime.DTensorRuntime, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of ``lora``'s delta weight, laid out like the weight's local slice
    (PEFT's ``get_delta_weight`` on the local factors)."""
    A = rt.local_parameter(lora.A, "weight", partial=lora.whole == "A")
    B = rt.local_parameter(lora.B, "weight", partial=lora.whole == "B")
    A = A.reshape(lora.experts, -1, A.shape[-1])  # (experts, rank, in)
    B = B.reshape(B.shape[0], -1, lora.experts)  # (out, rank, experts)
    spec = "o r e, e r i -> e o i" if lora.swapped else "o r e, e r i -> e i o"
    return (torch.einsum(spec, B, A) * lora.scaling).to(dtype)


def adapted_forward(
    own_forward, rt: runtime.DTensorRuntime, adapters: list[ParameterLora], module, *inputs
) -> Any:
    """The experts' own forward with each adapted weight's local slice plus its delta (run
    inside the style's swap of the parameters for their local slices)."""
    local = compat.direct_parameters(module)
    adapted = dict(local)
    for lora in adapters:
        weight = adapted[lora.parameter]
        adapted[lora.parameter] = weight + _delta(lora, rt, weight.dtype)
    compat.swap_direct_parameters(module, adapted)
    try:
        return own_forward(module, *inputs)
    finally:
        compat.swap_direct_parameters(module, local)
