"""Sequence parallelism for transformers' decoder models: :func:`with_sequence_parallel` turns
the tensor-parallel plan of a Llama-like model (its own ``_tp_plan`` or torch_tp's ready plan)
into the sequence-parallel one (:func:`torch_tp.plans.hf.plan_for`'s
``sequence_parallel=True``).

transformers' models compute the positions (``position_ids``) and the causal mask from the
embedding output's length. So under sequence parallelism the residual stream between blocks
is a DTensor sharded on the sequence (``Shard(1)``), whose shape is the whole sequence's: the
model's own code computes what it computes on one device, and every tensor-parallel style
reads the DTensor's layout. Per decoder layer:

* ``input_layernorm`` runs on this rank's sequence shard and hands the attention the whole
  sequence, gathered once (``SequenceParallel(output_layouts=Replicate())``); q, k and v
  read it, and their partial input gradients are reduce-scattered back once;
* the attention's row-parallel output projection reduce-scatters onto the sequence
  (``output_layouts=Shard(1)``, a DTensor added to the residual stream);
* ``post_attention_layernorm`` runs on the shard and hands it on sharded;
* the MLP, dense or mixture-of-experts, is one region
  (:class:`~torch_tp.PrepareModuleInputOutput`): its input gathered (its gradient
  reduce-scattered back), everything in it computed on the whole sequence with partial
  results (row-parallel projections and tensor-parallel experts with
  ``output_layouts=Partial()``), and its output reduce-scattered onto the sequence. The
  router sees every token; its gradient is a partial sum (summed over the ranks), but for
  the load-balancing loss's, which is whole on every rank (the output transformers records
  as ``router_logits``). A per-token gate of a shared expert (``Linear(dim, 1)``) is
  replicated with its gradient summed; a shared expert the plan leaves whole (a gated MLP,
  Qwen2-MoE's) is made tensor-parallel, its output a partial sum.

The embedding reduce-scatters its partial lookups onto the sequence; the final norm hands
the whole sequence on to ``lm_head`` (a base model returns it as a plain tensor).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_tp.contract import Boundary, Layout
from torch_tp.plan import resolve_plan
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["with_sequence_parallel"]

# a decoder layer's children, in the order its forward uses them
_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_NORMS = ("RMSNorm", "LayerNorm")


def with_sequence_parallel(
    model: nn.Module, plan: Mapping[str, Any], sequence_parallel: bool
) -> dict[str, Any]:
    """``plan``, the tensor-parallel plan of the transformers decoder ``model``, made
    sequence-parallel when ``sequence_parallel`` is true; ``plan`` as it is otherwise.

    Raises:
        ValueError: ``sequence_parallel`` is not a bool; or ``model`` is not laid out as the
            sequence-parallel plan expects (an embedding ``embed_tokens``, decoder layers of
            ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and ``mlp``, a
            final ``norm``), or ``plan`` leaves a part of it unplanned that computes on the
            sequence (the message names the module and what was expected).
    """
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be a bool, found {sequence_parallel!r}")
    if not sequence_parallel:
        return dict(plan)
    base, prefix = _base_model(model)
    layers = _check_layout(model, base, prefix)
    styles = {key: _style(value) for key, value in plan.items()}
    entries = resolve_plan(model, styles, strict=False)
    planned = {entry.path: entry.style for entry in entries}
    # a module each key matched (the keys that match none name parameters: kept as they are)
    modules = {entry.key: entry.module for entry in reversed(entries)}
    out: dict[str, Any] = {}
    for key, value in plan.items():
        style = styles[key]
        if key in modules:
            style = _sequence_entry(key, style, modules[key], prefix)
        out[key] = value if style is styles[key] else style  # plan names kept where unchanged
    embed = f"{prefix}embed_tokens"
    embedding = (planned[embed], model.get_submodule(embed)) if embed in planned else None
    if embedding is None or not (_leaves_partial_sum(*embedding) or _reads_whole_input(*embedding)):
        raise _refused(model, embed, "a row- or column-parallel embedding in the plan")
    layer_keys = f"{prefix}layers.*"
    # an attention computing part of its work whole (a latent attention's unplanned down
    # projections) reads the gathered sequence as a plain tensor: its column-parallel layers
    # then each reduce their input gradient (an all-reduce each, not one reduce-scatter)
    attentions = {
        f"{prefix}layers.{i}.self_attn": layer.self_attn for i, layer in enumerate(layers)
    }
    whole = [_unplanned(path, a, _within(path, planned)) for path, a in attentions.items()]
    out[f"{layer_keys}.input_layernorm"] = SequenceParallel(
        output_layouts=Replicate(), use_local_output=any(whole)
    )
    out[f"{layer_keys}.post_attention_layernorm"] = SequenceParallel()
    out[f"{layer_keys}.mlp"] = PrepareModuleInputOutput(
        input_layouts=Shard(1),
        desired_input_layouts=Replicate(),
        use_local_input=True,
        partial_input_gradients=True,
        output_layouts=Partial(),
        desired_output_layouts=Shard(1),
        use_local_output=False,
    )
    lm_head = "lm_head" in planned and _reads_whole_input(
        planned["lm_head"], model.get_submodule("lm_head")
    )
    # gathered for lm_head (its partial input gradient reduce-scattered back); a base model
    # hands the whole sequence on as a plain tensor
    out[f"{prefix}norm"] = SequenceParallel(
        output_layouts=Replicate(), use_local_output=not lm_head
    )
    routers = _router_outputs(model)
    for index, layer in enumerate(layers):
        attention, mlp = f"{prefix}layers.{index}.self_attn", f"{prefix}layers.{index}.mlp"
        _check_attention(model, attention, _within(attention, planned))
        entries = _mlp_entries(
            model, mlp, layer.mlp, _within(mlp, planned), f"{layer_keys}.mlp", routers
        )
        out.update(entries)
    return out


def _within(path: str, planned: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``planned`` (module paths) at ``path`` or below it."""
    return {p: s for p, s in planned.items() if p == path or p.startswith(f"{path}.")}


def _base_model(model: nn.Module) -> tuple[nn.Module, str]:
    for name in (getattr(model, "base_model_prefix", None), "model"):
        base = getattr(model, name, None) if name else None
        if isinstance(base, nn.Module):
            return base, f"{name}."
    return model, ""


def _refused(model: nn.Module, path: str, expected: str) -> ValueError:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return ValueError(
        f"sequence_parallel=True for {type(model).__qualname__} (model_type {model_type!r}): "
        f"'{path}': expected {expected}. torch_tp's sequence-parallel plan covers decoder "
        "models laid out as Llama's (embed_tokens, layers of input_layernorm, self_attn, "
        "post_attention_layernorm and mlp, a final norm); use the plan without "
        "sequence parallelism for this model"
    )


def _check_layout(model: nn.Module, base: nn.Module, prefix: str) -> list[nn.Module]:
    """The decoder layers of ``base``, once the model is found laid out as expected."""
    expected = {"embed_tokens": "an nn.Embedding", "norm": "a norm", "layers": "nn.ModuleList"}
    kinds = {"embed_tokens": nn.Embedding, "layers": nn.ModuleList}
    for name, what in expected.items():
        child = getattr(base, name, None)
        if not isinstance(child, kinds.get(name, nn.Module)) or (
            name == "norm" and not _is_norm(child)
        ):
            raise _refused(model, f"{prefix}{name}", f"{what}, found {_kind(child)}")
    _refuse_other_parameters(model, base, prefix, set(expected))
    for index, layer in enumerate(base.layers):
        path = f"{prefix}layers.{index}"
        for name in _LAYER:
            child = getattr(layer, name, None)
            if not isinstance(child, nn.Module) or ("norm" in name and not _is_norm(child)):
                what = (
                    "a norm (*RMSNorm, *LayerNorm, its parameters its own)"
                    if "norm" in name
                    else "a module"
                )
                raise _refused(model, f"{path}.{name}", f"{what}, found {_kind(child)}")
        _refuse_other_parameters(model, layer, f"{path}.", set(_LAYER))
    return list(base.layers)


def _is_norm(module: nn.Module) -> bool:
    """A norm SequenceParallel takes: a stock one, or one named so whose parameters are all
    its own (a gated norm holding a Linear in a submodule is no norm to it)."""
    if any("." in name for name, _ in module.named_parameters()):
        return False
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(_NORMS)


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _refuse_other_parameters(
    model: nn.Module, module: nn.Module, prefix: str, known: set[str]
) -> None:
    """A parameter outside the known children would compute on the sharded stream unplanned."""
    for name, _ in module.named_parameters():
        if name.split(".")[0] not in known:
            raise _refused(
                model,
                f"{prefix}{name}",
                "no parameter beside the known parts (it would compute on a sequence shard "
                "no style plans)",
            )


def _style(value: Any) -> Any:
    """A plan value as a style object (plan names looked up); anything else as it is."""
    if isinstance(value, str):
        style = STYLE_REGISTRY.style(value)
        return value if style is None else style
    return value


def _with(style: ParallelStyle, **changes: Any) -> ParallelStyle:
    """A copy of ``style`` with some constructor arguments changed."""
    return type(style)(**{**style.contract.arguments(style), **changes})


def _sequence_entry(key: str, style: Any, module: nn.Module, prefix: str) -> Any:
    """One entry of the tensor-parallel plan, as the sequence-parallel plan has it (``module``:
    one the key matches)."""
    inner = key[len(prefix) :].split(".") if key.startswith(prefix) else key.split(".")
    if key == f"{prefix}embed_tokens":
        # the partial lookups reduce-scattered onto the sequence: the stream's DTensor
        return _with(style, output_layouts=Shard(1), use_local_output=False)
    if len(inner) >= 4 and inner[0] == "layers":
        if inner[2] == "self_attn" and _leaves_partial_sum(style, module):
            # the attention's output projection: reduce-scattered onto the sequence
            return _with(style, output_layouts=Shard(1), use_local_output=False)
        if inner[2] == "mlp" and _leaves_partial_sum(style, module):
            # inside the MLP's region: partial sums, reduce-scattered once at its end
            local = {"use_local_output": True} if _takes(style, "use_local_output") else {}
            return _with(style, output_layouts=Partial(), **local)
    return style


def _takes(style: Any, argument: str) -> bool:
    """Whether ``style``'s constructor takes ``argument``."""
    return argument in inspect.signature(type(style)).parameters


def _first(boundary: Any) -> Layout | None:
    return boundary.args[0] if isinstance(boundary, Boundary) and boundary.args else None


def _leaves_partial_sum(style: Any, module: nn.Module) -> bool:
    """Whether ``style``, by its contract, computes ``module``'s output as a partial sum that
    it reduces into the layout its ``output_layouts`` argument names (a row-parallel layer,
    tensor-parallel experts): the output the sequence-parallel plan reduce-scatters onto the
    sequence, or leaves partial inside the MLP's region."""
    contract = getattr(style, "contract", None)
    if contract is None or not _takes(style, "output_layouts"):
        return False
    output = _first(contract.outputs(style, module))
    return output is not None and isinstance(output.given, Partial)


def _reads_whole_input(style: Any, module: nn.Module) -> bool:
    """Whether ``style``, by its contract, computes with ``module``'s whole input, its input
    gradient a partial sum (a column-parallel layer), and takes its output layout as an
    argument: a reader that may take the sequence-sharded stream and gather it itself."""
    contract = getattr(style, "contract", None)
    if contract is None or not _takes(style, "output_layouts"):
        return False
    first = _first(contract.inputs(style, module))
    return first is not None and first.to == Replicate() and isinstance(first.grad, Partial)


def _unplanned(path: str, module: nn.Module, planned: Mapping[str, Any]) -> list[str]:
    """The submodules of ``module`` with parameters of their own that no entry of ``planned``
    (module paths) covers, itself or an ancestor."""
    found = []
    for name, sub in module.named_modules():
        full = f"{path}.{name}" if name else path
        if any(True for _ in sub.parameters(recurse=False)) and not any(
            full == p or full.startswith(f"{p}.") for p in planned
        ):
            found.append(full)
    return found


def _check_attention(model: nn.Module, path: str, planned: Mapping[str, Any]) -> None:
    """The attention reads the gathered sequence and must hand its output back sharded:
    through one row-parallel output projection."""
    rowwise = [
        p
        for p, s in planned.items()
        if p.startswith(f"{path}.") and _leaves_partial_sum(s, model.get_submodule(p))
    ]
    if len(rowwise) != 1:
        raise _refused(
            model,
            path,
            f"one row-parallel output projection planned in the attention, found {len(rowwise)}"
            f"{' (' + ', '.join(rowwise) + ')' if rowwise else ''}",
        )


def _mlp_entries(
    model: nn.Module,
    path: str,
    mlp: nn.Module,
    planned: Mapping[str, Any],
    keys: str,
    routers: Mapping[type, int],
) -> dict[str, ParallelStyle]:
    """The entries the MLP's region adds: the router, and the per-token gates of shared
    experts, replicated with their gradients summed; a gated MLP the plan leaves whole (a
    shared expert: ``gate_proj``, ``up_proj``, ``down_proj``) made tensor-parallel, its
    output a partial sum; anything else with parameters must be planned already."""
    added: dict[str, ParallelStyle] = {}
    covered = list(planned)  # module paths whose parameters are accounted for, and below
    for name, sub in mlp.named_modules():
        full = f"{path}.{name}"
        if not name or any(full == p or full.startswith(f"{p}.") for p in covered):
            continue  # planned, or inside a planned module (the experts' own)
        if _is_gated_mlp(sub):
            # computed whole on every rank, its output would be counted once per rank: split
            # as the dense MLPs are, its output left a partial sum
            added[f"{keys}.{name}.gate_proj"] = ColwiseParallel()
            added[f"{keys}.{name}.up_proj"] = ColwiseParallel()
            added[f"{keys}.{name}.down_proj"] = RowwiseParallel(output_layouts=Partial())
            covered.append(full)
            continue
        if not any(True for _ in sub.parameters(recurse=False)):
            continue
        recorded = routers.get(type(sub))
        if recorded is not None:
            # the router sees every token; its output ``recorded`` feeds the load-balancing
            # loss, whose gradient is whole on every rank; its routing weights' is partial
            style = ReplicateParallel(sum_gradients=True, whole_gradient_outputs=(recorded,))
        elif isinstance(sub, nn.Linear) and sub.out_features == 1:
            # a per-token gate of a shared expert: it scales the expert's partial output
            style = ReplicateParallel(sum_gradients=True)
        else:
            raise _refused(
                model,
                full,
                "every module with parameters inside the MLP planned (its output a partial "
                "sum, summed once at the MLP's end), a router, or a per-token gate; found "
                f"{type(sub).__name__} unplanned",
            )
        added[f"{keys}.{name}"] = style
    if not any(p.startswith(f"{path}.") for p in planned):
        raise _refused(model, path, "a tensor-parallel MLP in the plan, found none")
    for name, sub in mlp.named_modules():
        full = f"{path}.{name}"
        if (
            full in planned
            and _leaves_partial_sum(planned[full], sub)
            and getattr(sub, "bias", None) is not None
        ):
            # its output is a partial sum, to which a bias would be added once per rank
            raise _refused(
                model,
                full,
                "row-parallel layers without a bias inside the MLP (its output a partial sum, "
                "summed once at the MLP's end), found a bias",
            )
    return added


def _is_gated_mlp(module: nn.Module) -> bool:
    """Llama's MLP: Linear ``gate_proj``, ``up_proj`` and ``down_proj``, no other parameters."""
    parts = ("gate_proj", "up_proj", "down_proj")
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in parts):
        return False
    return all(name.split(".")[0] in parts for name, _ in module.named_parameters())


def _router_outputs(model: nn.Module) -> dict[type, int]:
    """The router classes of a transformers MoE model, and the index of the output it
    records as ``router_logits`` (the load-balancing loss's input)."""
    found: dict[type, int] = {}
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits") if isinstance(recorders, Mapping) else None
    target = getattr(recorder, "target_class", None)
    if isinstance(target, type):
        found[target] = int(getattr(recorder, "index", 0) or 0)
    return found
