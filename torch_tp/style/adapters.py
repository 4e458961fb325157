"""PEFT's LoRA adapters on a tensor-parallel layer.

PEFT adapts a layer by wrapping it: ``q_proj`` becomes a ``peft.tuners.lora.Linear`` that
holds the original layer as ``base_layer`` and, per adapter, a ``lora_A`` and a ``lora_B``
(two plain ``nn.Linear``), adding ``lora_B(lora_A(dropout(x))) * scaling`` to the base
layer's output. A plan's key for ``q_proj`` keeps working on the wrapped model: the style
applies to the base layer and hosts the adapter, laid out to match it.

* Column-parallel base (:class:`~torch_tp.ColwiseParallel`): ``lora_A`` whole, ``lora_B``
  sharded on its output features like the base weight. No collective: each rank adds its
  columns of the adapter's output to its columns of the base's. ``lora_A``'s gradient is a
  partial sum on each rank (each sees its columns' share), summed with the other partial
  gradients in the one all-reduce at the end of backward.
* Row-parallel base (:class:`~torch_tp.RowwiseParallel`): ``lora_A`` sharded on its input
  features like the base weight, ``lora_B`` whole. ``lora_A``'s partial output (``r``
  features) rides in the base layer's own reduction, concatenated to the base's partial
  sum: no extra collective, forward or backward.

The packed styles host the same way (``lora_B``, or ``lora_A``, strided like the fused
weight). With ``lora_dropout`` a row-parallel adapter draws the mask of the whole input,
exactly as one device does, and keeps its slice: the masks are one device's on either side.

Adapters are found whichever order came first. ``get_peft_model`` before
:func:`~torch_tp.parallelize_module`: the plan resolves ``q_proj`` to the wrapper and the
style hosts its adapters when it is applied. After: PEFT registers its wrapper in place of
the parallelized layer, and a module-registration hook (torch's public
``register_module_module_registration_hook``) hosts the adapters there, before the first
forward and before any optimizer sees them; an adapter added later to a hosted layer
(``add_adapter``, ``load_adapter``) is laid out as PEFT registers it.

A hosted adapter's state-dict entries are its full tensors (gathered over the mesh), which
is what PEFT saves and loads; so every rank must take the state dict together. Loading
accepts full tensors (each rank keeps its slice) or DTensors. ``state_dict(keep_vars=True)``
gives the adapters' DTensor parameters themselves, which :mod:`torch_tp.checkpoint` loads
into.

LoRA on the stacked expert weights of a mixture-of-experts layer (PEFT's
``target_parameters=``, a ``ParamWrapper``) is hosted by
:class:`~torch_tp.TensorParallelExperts`: :mod:`torch_tp.style.expert_adapters`.

Only PEFT's LoRA on ``nn.Linear``, transformers' ``Conv1D`` and stacked experts is hosted;
other tuners, LoRA variants (DoRA, ...) and mixed-adapter batches are refused by name.
torch_tp never imports PEFT: a wrapper can only exist once PEFT has been imported.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from torch_tp import _state_dict, runtime
from torch_tp import _torch_compat as compat
from torch_tp.style.base import MODULE_PATH_ATTR, distribute_parameters

__all__: list[str] = []

# set on a PEFT wrapper whose adapters a style hosts: (style, base layer, runtime)
_HOSTED = "_torch_tp_hosted"
# set on a hosted wrapper's lora_A / lora_B dicts: (wrapper, "A" or "B")
_ADAPTER_DICT = "_torch_tp_adapter_dict"
# set on a layer a style was applied to that can host adapters: (style, runtime)
_HOST_RUNTIME = "_torch_tp_host_runtime"


class Lora(NamedTuple):
    """One active adapter of a hosted layer, as its forward reads it."""

    A: nn.Linear
    B: nn.Linear
    dropout: nn.Module
    scaling: float


# ------------------------------------------------------------------------------------------
# Recognizing PEFT's layers (without importing PEFT)
# ------------------------------------------------------------------------------------------


def tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of PEFT's tuner layers (a wrapper around a base layer)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


def _lora_linear_class() -> type | None:
    layer = sys.modules.get("peft.tuners.lora.layer")
    return None if layer is None else layer.Linear


def _param_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's LoRA on a parameter (``ParamWrapper``,
    ``target_parameters=``), hosted by :mod:`torch_tp.style.expert_adapters`."""
    cls = getattr(sys.modules.get("peft.tuners.lora.layer"), "ParamWrapper", None)
    return cls is not None and isinstance(module, cls)


def _tuner_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def base_of(module: nn.Module) -> nn.Module:
    """The layer a PEFT tuner layer wraps (through nested wrappers)."""
    return module.get_base_layer()


def host_of(
    path: str, module: nn.Module, root: nn.Module
) -> tuple[str, nn.Module, nn.Module | None]:
    """``(path, module, wrapper)`` for a module a plan names: a PEFT wrapper becomes its base
    layer (``path.base_layer``) and the wrapper whose adapters the style hosts; a base layer
    named directly finds its wrapper; anything else is itself, with no wrapper."""
    if tuner_layer(module):
        # nested wrappers (LoRA on several parameters of one module): the innermost's base
        inner, base_path = module, path
        while tuner_layer(inner):
            inner, base_path = inner.base_layer, f"{base_path}.base_layer".lstrip(".")
        return base_path, inner, module
    parent_path, _, name = path.rpartition(".")
    if name == "base_layer":
        parent = root.get_submodule(parent_path)
        if tuner_layer(parent):
            return path, module, parent
    return path, module, None


def adapter_modules(wrapper: nn.Module) -> list[nn.Module]:
    """The modules of ``wrapper`` that are not its base layer (its adapters)."""
    base = base_of(wrapper)
    inside = {id(m) for m in base.modules()}
    return [m for m in wrapper.modules() if m is not wrapper and id(m) not in inside]


# ------------------------------------------------------------------------------------------
# Checking (nothing changes)
# ------------------------------------------------------------------------------------------

_SUPPORTED = (
    "torch_tp hosts PEFT's LoRA (peft.tuners.lora.Linear) on nn.Linear and transformers' "
    "Conv1D under ColwiseParallel, RowwiseParallel and their packed variants, and LoRA on "
    "stacked expert weights (target_parameters=) under TensorParallelExperts"
)


def check(style: Any, wrapper: nn.Module, base: nn.Module) -> None:
    """Raise unless ``style`` can host the adapters of ``wrapper`` on ``base``: PEFT's LoRA on
    a layer the style computes itself, with no LoRA variant. ``NotImplementedError`` for what
    is not supported, ``ValueError`` for adapters already distributed.

    The messages name the tuner (PEFT's layer class) and what is supported; the caller
    prefixes the module's path and the style."""
    lora = _lora_linear_class()
    tuner = _tuner_name(wrapper)
    supported = _SUPPORTED
    leave_out = "leave this module out of the adapter config's target_modules, or out of the plan"
    if _param_wrapper(wrapper):  # LoRA on a parameter (target_parameters=): its own checks
        if not getattr(style, "_hosts_parameter_adapters", False):
            raise NotImplementedError(
                f"PEFT wraps this module in {tuner} (LoRA on its parameter "
                f"{wrapper.parameter_name!r}, target_parameters=), which {type(style).__name__} "
                "cannot host: torch_tp hosts LoRA on the stacked expert weights under "
                "TensorParallelExperts; leave the parameter out of the adapter config's "
                "target_parameters, or use TensorParallelExperts for this module"
            )
        style._check_adapters(wrapper, base)
        return
    if getattr(style, "_host_adapters", None) is None:
        raise NotImplementedError(
            f"PEFT wraps this layer in {tuner}, whose adapters {type(style).__name__} cannot "
            f"host: {supported}; {leave_out}"
        )
    if lora is None or not isinstance(wrapper, lora) or type(wrapper).forward is not lora.forward:
        # what the adapter is, in the user's terms: another tuner, or LoRA on another layer
        if tuner.startswith("peft.tuners.lora."):
            kind = (
                f"LoRA on {type(base).__qualname__} ({tuner}), whose factors are not two "
                "nn.Linear on the layer's input and output features"
            )
            if isinstance(base, nn.Embedding):
                kind += (
                    ": its lora_embedding_A is looked up by token id like the embedding's "
                    "weight, which this style splits over the vocabulary"
                )
        else:
            kind = f"the tuner {tuner}, not LoRA"
        raise NotImplementedError(
            f"PEFT wraps this layer in {kind}; {supported}. To train it, {leave_out}"
        )
    if tuner_layer(base):
        raise NotImplementedError(
            f"the base layer of {tuner} is itself a PEFT layer ({_tuner_name(base)}): nested "
            f"tuners are not supported; {supported}"
        )
    variants = sorted(getattr(wrapper, "lora_variant", {}) or {})
    if variants:
        kinds = sorted({type(v).__name__ for v in wrapper.lora_variant.values()})
        raise NotImplementedError(
            f"{tuner}: adapter(s) {variants} use a LoRA variant ({', '.join(kinds)}: "
            "use_dora=True, ...), which torch_tp does not host: the variant's own forward "
            "reads the whole weight (DoRA: its norm over the input features). Plain LoRA "
            "and rsLoRA (use_rslora=True) are supported"
        )
    for name in wrapper.lora_A:
        dropout = wrapper.lora_dropout[name]
        if type(dropout) not in (nn.Dropout, nn.Identity):
            raise NotImplementedError(
                f"{tuner}: adapter {name!r}: lora_dropout is a {type(dropout).__name__}; "
                "nn.Dropout or nn.Identity is supported"
            )
        for part in (wrapper.lora_A[name], wrapper.lora_B[name]):
            if type(part) is not nn.Linear:
                raise NotImplementedError(
                    f"{tuner}: adapter {name!r}: {type(part).__name__} in lora_A/lora_B; "
                    "PEFT's plain nn.Linear factors are supported"
                )
            for pname, param in part.named_parameters(recurse=False):
                if isinstance(param, DTensor):
                    raise ValueError(
                        f"{tuner}: adapter {name!r}: {pname!r} is already a DTensor with "
                        f"placements {param.placements}: the adapter was parallelized before"
                    )
    style._check_adapters(wrapper, base)


# ------------------------------------------------------------------------------------------
# Hosting
# ------------------------------------------------------------------------------------------


def remember(base: nn.Module, style: Any, rt: runtime.DTensorRuntime) -> None:
    """Record on a styled layer the style and runtime that host its adapters, if PEFT wraps
    it later."""
    setattr(base, _HOST_RUNTIME, (style, rt))


def remembered(base: nn.Module) -> tuple[Any, runtime.DTensorRuntime] | None:
    """``(style, runtime)`` recorded on ``base`` by :func:`remember`, or ``None``."""
    return getattr(base, _HOST_RUNTIME, None)


def host(style: Any, wrapper: nn.Module, base: nn.Module, rt: runtime.DTensorRuntime) -> None:
    """Lay out ``wrapper``'s adapters as ``style`` says and run its forward on local tensors
    (``style`` has been applied to ``base``, and :func:`check` passed)."""
    placements = style._adapter_placements(base)
    local = _sized_to_shard(wrapper, base)
    for name in list(wrapper.lora_A):
        A, B = wrapper.lora_A[name], wrapper.lora_B[name]
        layouts = list(placements)
        if local:
            layouts[0] = _adopt_shards(A, rt, placements[0], (base.in_features, A.out_features))
            layouts[1] = _adopt_shards(B, rt, placements[1], (B.in_features, base.out_features))
        distribute_parameters(A, rt, layouts[0], style.src_data_rank)
        distribute_parameters(B, rt, layouts[1], style.src_data_rank)
    if local:  # the adapters PEFT adds to this layer later are sized as one device's
        wrapper.in_features, wrapper.out_features = base.in_features, base.out_features
    mark_hosted(wrapper, style, base, rt)
    wrapper.forward = functools.partial(_forward, style, wrapper, base, rt)


def hosting(wrapper: nn.Module) -> tuple | None:
    """``(style, base, runtime)`` hosting ``wrapper``'s adapters, or ``None``."""
    return vars(wrapper).get(_HOSTED)


def mark_hosted(
    wrapper: nn.Module, style: Any, base: nn.Module, rt: runtime.DTensorRuntime
) -> None:
    """Record that ``style`` hosts ``wrapper``'s adapters (on ``base``): its state dict gives
    and takes full adapter tensors, and an adapter PEFT adds to it later is laid out as it
    is registered (:func:`_on_registration`)."""
    if hosting(wrapper) is None:
        wrapper.register_state_dict_post_hook(_full_adapter_entries)
        wrapper.register_load_state_dict_pre_hook(_sliced_adapter_entries)
    # vars(), not setattr: PEFT's layers answer unknown names from their inner module
    vars(wrapper)[_HOSTED] = (style, base, rt)
    vars(wrapper.lora_A)[_ADAPTER_DICT] = (wrapper, 0)
    vars(wrapper.lora_B)[_ADAPTER_DICT] = (wrapper, 1)


def _sized_to_shard(wrapper: nn.Module, base: nn.Module) -> bool:
    """Whether PEFT sized ``wrapper``'s factors to this rank's shard of ``base``: PEFT reads
    an ``nn.Linear``'s features from its local weight when the weight is a DTensor on a mesh
    with a dimension not named ``"fsdp"`` (a mesh named ``("dp", "tp")``: transformers' own
    tensor parallelism, where the layer computes on its shard)."""
    return isinstance(base, nn.Linear) and (wrapper.in_features, wrapper.out_features) != (
        base.in_features,
        base.out_features,
    )


def _adopt_shards(
    part: nn.Linear,
    rt: runtime.DTensorRuntime,
    layout: dict[str, Placement],
    features: tuple[int, int],
) -> dict[str, Placement]:
    """Make each parameter of the factor ``part`` that ``layout`` shards (sized to this
    rank's shard) this rank's shard of a DTensor of one device's size, ``features`` (in, out)
    of the factor: its own values, no communication, as PEFT lays out the factors it sized
    so under transformers' tensor parallelism. Returns the placements left to distribute."""
    rest = {}
    for pname, placement in layout.items():
        param = getattr(part, pname)
        if param is None or not isinstance(placement, Shard):
            rest[pname] = placement
            continue
        shape = torch.Size((features[1], features[0]) if pname == "weight" else (features[1],))
        dtensor = DTensor.from_local(
            param.detach(), rt.mesh, (placement,), run_check=False, shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )  # fmt: skip
        part.register_parameter(pname, nn.Parameter(dtensor, requires_grad=param.requires_grad))
    part.in_features, part.out_features = features
    return rest


def _where(wrapper: nn.Module, base: nn.Module) -> str:
    path = getattr(base, MODULE_PATH_ATTR, None)
    path = path.removesuffix(".base_layer") if path else None
    return f"the LoRA layer {path!r}" if path else "a LoRA layer"


def _forward(
    style: Any,
    wrapper: nn.Module,
    base: nn.Module,
    rt: runtime.DTensorRuntime,
    x: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """PEFT's LoRA forward, with the base layer's style computing base and adapters on local
    tensors in one pass."""
    if kwargs.get("adapter_names") is not None:
        raise NotImplementedError(
            f"{_where(wrapper, base)}: a batch mixing adapters (adapter_names=) is not "
            "supported under tensor parallelism; set_adapter() one adapter for the batch"
        )
    kwargs.pop("adapter_names", None)
    if args or kwargs:
        raise TypeError(
            f"{_where(wrapper, base)}: the forward takes one input; found {len(args)} more "
            f"positional and the keyword arguments {sorted(kwargs)}"
        )
    if wrapper.disable_adapters:
        if wrapper.merged:
            wrapper.unmerge()
        return base(x)
    if wrapper.merged:
        return base(x)
    active = []
    for name in wrapper.active_adapters:
        if name not in wrapper.lora_A:
            continue
        if name in wrapper.lora_variant:
            raise NotImplementedError(
                f"{_where(wrapper, base)}: adapter {name!r} uses a LoRA variant "
                f"({type(wrapper.lora_variant[name]).__name__}), which torch_tp does not host"
            )
        A, B = wrapper.lora_A[name], wrapper.lora_B[name]
        if not isinstance(A.weight, DTensor):
            raise RuntimeError(
                f"{_where(wrapper, base)}: adapter {name!r} was added without torch_tp laying "
                "it out (its lora_A is not a DTensor); add adapters through PEFT's API "
                "(get_peft_model, add_adapter, load_adapter)"
            )
        active.append(Lora(A, B, wrapper.lora_dropout[name], wrapper.scaling[name]))
    if not active:
        return base(x)
    return style._linear(base, rt, style._boundaries(base), x, active)


# ------------------------------------------------------------------------------------------
# The adapters' computation, for the styles
# ------------------------------------------------------------------------------------------


def _cast(x: torch.Tensor, A: nn.Linear) -> torch.Tensor:
    # as PEFT does (cast_input_dtype): the adapter computes in its own dtype
    dtype = A.weight.dtype
    return x if x.dtype == dtype else x.to(dtype)


def column_terms(
    adapters: list[Lora], x: torch.Tensor, y: torch.Tensor, rt: runtime.DTensorRuntime
) -> torch.Tensor:
    """``y`` (this rank's output columns of a column-parallel base) plus each adapter's
    columns: ``lora_B_r(lora_A(dropout(x)))`` on the whole input ``x``.

    ``lora_A`` is whole; each rank's gradient for it covers its own columns: a partial sum,
    summed at the end of backward."""
    dtype = y.dtype
    for lora in adapters:
        A = rt.local_parameter(lora.A, "weight", partial=True)
        B = rt.local_parameter(lora.B, "weight")
        bias = rt.local_parameter(lora.B, "bias")
        y = y + F.linear(F.linear(lora.dropout(_cast(x, lora.A)), A), B, bias) * lora.scaling
    return y.to(dtype)


def row_inputs(
    adapters: list[Lora],
    x: torch.Tensor,
    rt: runtime.DTensorRuntime,
    shard: Placement,
    features: int,
) -> list[torch.Tensor]:
    """Each adapter's ``lora_A_r(dropout(x_r))`` on this rank's input features ``x`` (of
    ``features`` in all, split as ``shard``): partial sums, to be reduced with the base's."""
    out = []
    for lora in adapters:
        xa = _cast(x, lora.A)
        dropout = lora.dropout
        if type(dropout) is nn.Dropout and dropout.training and dropout.p > 0:
            # one device's mask over the whole input, of which this rank keeps its slice:
            # the same draw from the same generator as one device's, so the same mask
            whole = torch.ones((*xa.shape[:-1], features), dtype=xa.dtype, device=xa.device)
            xa = xa * rt.enter_sharded(dropout(whole), Replicate(), shard)
        else:
            xa = dropout(xa)
        out.append(F.linear(xa, rt.local_parameter(lora.A, "weight")))
    return out


def row_terms(
    adapters: list[Lora],
    inner: list[torch.Tensor],
    y: torch.Tensor,
    rt: runtime.DTensorRuntime,
    partial: bool,
) -> torch.Tensor:
    """``y`` plus each adapter's ``lora_B(u)``, with ``u`` its reduced ``inner`` value. With
    ``partial`` the output is a shard of the tokens (sequence parallelism), so each rank's
    gradient for the whole ``lora_B`` is a partial sum."""
    dtype = y.dtype
    for lora, u in zip(adapters, inner, strict=True):
        B = rt.local_parameter(lora.B, "weight", partial=partial)
        bias = rt.local_parameter(lora.B, "bias", partial=partial)
        if isinstance(u, DTensor):
            # use_local_output=False: the reduction gave DTensors. The term is computed on
            # the local values all the same: a DTensor lora_B would leave its gradient a
            # partial sum for a tensor hook to sum, and PEFT's module.to() after hosting
            # drops tensor hooks (local_parameter needs none)
            term = F.linear(u.to_local(), B, bias) * lora.scaling
            y = y + DTensor.from_local(
                term, u.device_mesh, u.placements, shape=y.shape, stride=y.stride()
            )
        else:
            y = y + F.linear(u, B, bias) * lora.scaling
    return y.to(dtype)


def reduce_with(
    partial: torch.Tensor, inner: list[torch.Tensor], reduce
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Reduce ``partial`` and the adapters' ``inner`` partial sums in one collective:
    concatenated on the features, reduced by ``reduce``, split again."""
    sizes = [partial.shape[-1], *(u.shape[-1] for u in inner)]
    reduced = reduce(torch.cat([partial, *inner], dim=-1))
    y, *us = reduced.split(sizes, dim=-1)
    return y, us


# ------------------------------------------------------------------------------------------
# State dicts: full adapter tensors, as PEFT saves and loads them
# ------------------------------------------------------------------------------------------


def _adapter_parameters(wrapper: nn.Module, prefix: str):
    for which in ("lora_A", "lora_B"):
        for name, part in getattr(wrapper, which).items():
            for pname, param in part.named_parameters(recurse=False):
                yield f"{prefix}{which}.{name}.{pname}", param


def _full_adapter_entries(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """A state-dict post-hook: a hosted adapter's entries become its full tensors, which is
    what PEFT saves (``get_peft_model_state_dict`` reads ``state_dict()``), so every rank
    must take the state dict together (an all-gather per sharded factor).

    ``state_dict(keep_vars=True)`` asks for the model's own tensors, to load into them
    (torch_tp.checkpoint) or to mark them (transformers): there an entry is the parameter
    itself, a DTensor like every other parallelized parameter, and is left so (a gathered
    copy would take a load's values and drop them)."""
    for key, param in _adapter_parameters(module, prefix):
        value = state_dict.get(key)
        if isinstance(value, DTensor) and value is not param:
            state_dict[key] = value.full_tensor()


def _sliced_adapter_entries(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """A load pre-hook: a full tensor for a hosted adapter's DTensor parameter becomes this
    rank's slice of it (:func:`torch_tp._state_dict.lay_out_entries`: each rank holds the
    whole value, no communication)."""
    _state_dict.lay_out_entries(state_dict, prefix, _adapter_parameters(module, prefix=""))


# ------------------------------------------------------------------------------------------
# Adapters PEFT adds after the plan was applied
# ------------------------------------------------------------------------------------------


# set on the lora_A dict of a PEFT layer being built around a parallelized layer:
# (the layer,) (its LoRA variants are known when its first factor is registered)
_BUILDING = "_torch_tp_building"


def _check_wrapping(style: Any, wrapper: nn.Module, base: nn.Module) -> None:
    """:func:`check` for a PEFT layer wrapping a layer ``style`` was applied to, its errors
    naming the layer and the style."""
    try:
        check(style, wrapper, base)
    except (NotImplementedError, ValueError) as err:
        raise type(err)(
            f"{_where(wrapper, base)} wraps a layer parallelized with {type(style).__name__}: {err}"
        ) from err


def _refuse_unhostable(parent: nn.Module, name: str, submodule: nn.Module) -> None:
    """Refuse a PEFT layer being built around a layer torch_tp parallelized that cannot host
    it, by name and before PEFT's own set-up meets the layer's DTensors (DoRA's weight norm,
    ``modules_to_save``'s deep copy): a tuner wrapping a layer whose style hosts no adapters
    (an embedding), PEFT's copy of a planned layer (``modules_to_save``), and a LoRA layer
    :func:`check` refuses (a variant), as its first factor is registered."""
    # vars(), not getattr: PEFT's wrappers answer unknown names from their inner module,
    # which recurses while they are being built
    building = vars(parent).get(_BUILDING)
    if building is not None:  # a factor of a LoRA layer being built: its variants are known
        (builder,) = building
        if hosting(builder) is None:
            base = base_of(builder)
            _check_wrapping(remembered(base)[0], builder, base)
        return
    path = getattr(submodule, MODULE_PATH_ATTR, None)
    copies = getattr(sys.modules.get("peft.utils.other"), "AuxiliaryTrainingWrapper", None)
    if path is not None and copies is not None and isinstance(parent, copies):
        raise NotImplementedError(
            f"PEFT's {type(parent).__qualname__} (modules_to_save, trainable_token_indices) "
            f"wraps {path!r}, a layer torch_tp parallelized: a trainable copy of a "
            "parallelized layer is not supported; leave it out of modules_to_save, or out of "
            "the plan"
        )
    if not tuner_layer(parent) or hosting(parent) is not None:
        return
    hosts = remembered(submodule) is not None
    if name == "base_layer" and path is not None and not hosts:
        raise NotImplementedError(
            f"PEFT wraps {path!r}, a layer torch_tp parallelized with a style that hosts no "
            f"adapters, in {_tuner_name(parent)}: {_SUPPORTED}; leave this module out of "
            "the adapter config's target_modules (target_parameters), or out of the plan"
        )
    base = compat.direct_children(parent).get("base_layer")
    if name == "lora_A" and remembered(base) is not None:
        setattr(submodule, _BUILDING, (parent,))  # a tuple: not registered as a submodule


def _on_registration(parent: nn.Module, name: str, submodule: nn.Module) -> None:
    """torch's module-registration hook: host the adapters of a PEFT wrapper registered in
    place of a parallelized layer, or lay out an adapter added to a hosted one."""
    if "peft" not in sys.modules:
        return None
    _refuse_unhostable(parent, name, submodule)
    owner = vars(parent).get(_ADAPTER_DICT)  # not getattr: see _refuse_unhostable
    if owner is not None:
        wrapper, which = owner
        style, base, rt = hosting(wrapper)
        if _param_wrapper(wrapper):  # placed like the one parameter it adapts
            placements = style._adapter_placements(base, wrapper)[which]
        else:
            placements = style._adapter_placements(base)[which]
        if any(isinstance(p, DTensor) for p in submodule.parameters(recurse=False)):
            return None
        distribute_parameters(submodule, rt, placements, style.src_data_rank)
        return None
    if not tuner_layer(submodule) or hosting(submodule) is not None:
        return None
    base = base_of(submodule)
    found = remembered(base)
    if found is None:
        return None
    style, rt = found
    _check_wrapping(style, submodule, base)
    style._host_adapters(submodule, base, rt.mesh)
    return None


_INSTALLED: list[Any] = []


def install() -> None:
    """Register :func:`_on_registration` with torch, once per process."""
    if not _INSTALLED:
        from torch.nn.modules.module import register_module_module_registration_hook

        _INSTALLED.append(register_module_module_registration_hook(_on_registration))
