"""Attention: :class:`MLAKVAProjParallel` (multi-head latent attention's joint key/value
down-projection), :class:`LocalParamsParallel` (a module's own parameters, such as attention
sinks, sharded and used as local tensors) and :class:`AttentionHeads` (an attention module's
heads checked to split evenly over the ranks, and its sizes made per-rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from torch_tp import runtime
from torch_tp.contract import StyleContract
from torch_tp.style.base import (
    REPR_LIMIT,
    ParallelStyle,
    check_direct_placements,
    check_not_distributed,
    check_placements_argument,
    distribute_and_wrap,
    plan_root,
    run_on_local_parameters,
    short_repr,
)

__all__ = ["MLAKVAProjParallel", "LocalParamsParallel", "AttentionHeads"]


class MLAKVAProjParallel(ParallelStyle):
    """Multi-head latent attention's joint key/value down-projection, replicated, with the
    gradient of its rotary part summed over the ranks.

    DeepSeek-V2/V3-style attention projects each token to ``[kv_lora_rank +
    qk_rope_head_dim]`` with ``kv_a_proj_with_mqa``, a plain Linear every rank keeps whole.
    The first part goes through a norm into ``kv_b_proj`` (column-parallel: its input
    gradient is reduced there); the last ``rope_dim`` columns, the rotary key shared by every
    head, go straight into attention, where each rank computes with its own heads only. Their
    gradient is therefore a partial sum on each rank: this style sums it (one all-reduce in
    the backward), so that the projection's weight gets the whole gradient. This is
    transformers' ``mla_kv_a_proj``.

    Args:
        rope_dim (int, optional): the width of the rotary part (``qk_rope_head_dim``).
            Default: ``None``: under :func:`parallelize_module`, the ``qk_rope_head_dim``
            attribute of the attention module holding the projection, else the model's
            config (its text config where it has one); or the module's own ``config``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        ...     "model.layers.*.self_attn.kv_b_proj": "colwise",
        ... }
    """

    contract = StyleContract(
        names={"mla_kv_a_proj": {}},
        arguments=lambda s: {"rope_dim": s.rope_dim},
        modules=(nn.Linear,),
        parameters=lambda s, m: {
            name: Replicate() for name, _ in m.named_parameters(recurse=False)
        },
        caveat=lambda s, m: (
            "the rotary part of its output has its gradient all-reduced in the backward (not "
            "predicted)"
        ),
    )

    def __init__(self, rope_dim: int | None = None) -> None:
        super().__init__()
        if rope_dim is not None and (
            not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim < 1
        ):
            raise ValueError(
                f"rope_dim must be a positive int or None, found {short_repr(rope_dim)}"
            )
        self.rope_dim = rope_dim

    def _rope_dim(self, module: nn.Module) -> int:
        if self.rope_dim is not None:
            return self.rope_dim
        # the attention module holding the projection knows its own width (per layer, where
        # layers differ); else the module's or the model's config
        root = plan_root()
        parent = next(
            (m for m in (root.modules() if root is not None else ()) if module in m.children()),
            None,
        )
        holders = [parent, getattr(module, "config", None)]
        root_config = getattr(root, "config", None)
        if root_config is not None:
            text = getattr(root_config, "get_text_config", None)
            holders += [text() if callable(text) else None, root_config]
        for holder in holders:
            try:
                value = getattr(holder, "qk_rope_head_dim", None)
            except Exception:  # a config with per-layer sizes refuses a global read
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        raise ValueError(
            "cannot find the rotary width: no qk_rope_head_dim in the module's or the model's "
            "config; pass it, MLAKVAProjParallel(rope_dim=...)"
        )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        rope = self._rope_dim(module)
        if rope >= module.out_features:
            raise ValueError(
                f"the rotary width {rope} leaves nothing of the {module.out_features} output "
                "features for the latent part"
            )
        check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        rope = self._rope_dim(module)
        return distribute_and_wrap(
            self, module, device_mesh, self.contract.parameters(self, module), rope
        )

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        rope: int,
        *inputs: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        out = run_on_local_parameters(module, rt, False, own_forward, *inputs, **kwargs)
        latent, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
        # read by every rank's own heads: its gradient is a partial sum
        (rotary,) = rt.enter_replicated_many((rotary,))
        return torch.cat([latent, rotary], dim=-1)


class LocalParamsParallel(ParallelStyle):
    """A module's own parameters sharded as the plan's parameter entries say, and its
    forward run on this rank's shards as local tensors.

    For a bare parameter that has no module of its own to carry a style: attention sinks,
    one learned logit per head (``self_attn.sinks`` ``[n_heads]``). transformers' plans write
    ``"layers.*.self_attn.sinks": "colwise"`` (shard it with the heads) next to
    ``"layers.*.self_attn": "local_params"``; the attention then computes with its own heads'
    sinks, as its column-parallel projections give it its own heads. Each rank's gradient of
    such a shard is whole (only its heads use it). A direct parameter without an entry is
    refused: replicated, it would see only this rank's heads, and its gradient would be a
    part of the whole. This is transformers' ``local_params``.

    Args:
        placements (Mapping[str, Placement], optional): each direct parameter's placement.
            Default: ``None``, taken from the plan's parameter entries under the module.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "layers.*.self_attn.sinks": "colwise",  # Shard(0): each rank its heads'
        ...     "layers.*.self_attn": "local_params",
        ...     "layers.*.self_attn.q_proj": "colwise",
        ... }
    """

    contract = StyleContract(
        # "local": transformers 4.x's name for the same thing (Llama 4's experts inside a
        # "gather" region, next to "local_packed_rowwise"/"local_colwise" entries for their
        # stacked weights). transformers also divided the parameters no entry shards by the
        # TP degree, changing the model's values; here they are refused, as for local_params
        names={"local_params": {}, "local": {}},
        arguments=lambda s: {"placements": s.placements},
        parameters=lambda s, m: dict(s.placements or {}),
        local_forward=lambda s, m: True,
        partial_sum=lambda s: "either",
    )

    def _with_parameter_entries(self, placements: Mapping[str, Placement]) -> LocalParamsParallel:
        """The style the plan's parameter entries under its module make of it
        (``"self_attn.sinks": "colwise"`` next to ``"self_attn": "local_params"``)."""
        return type(self)({**(self.placements or {}), **placements})

    def __init__(self, placements: Mapping[str, Placement] | None = None) -> None:
        super().__init__()
        self.placements = check_placements_argument(placements)

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        placements = self.placements or {}
        params = dict(module.named_parameters(recurse=False))
        unplaced = sorted(set(params) - set(placements))
        if unplaced:
            raise ValueError(
                f"local_params computes with this rank's shards of the module's parameters, "
                f"and no placement is given for {unplaced}: add a plan entry for each (e.g. "
                f"'<module>.{unplaced[0]}': 'colwise' to shard it with the heads)"
            )
        check_direct_placements(module, placements, device_mesh)
        check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        return distribute_and_wrap(self, module, device_mesh, dict(self.placements or {}))

    def _forward(
        self, module: nn.Module, rt: runtime.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        return run_on_local_parameters(module, rt, False, own_forward, *inputs, **kwargs)


class AttentionHeads(ParallelStyle):
    """Check that an attention module's heads split evenly, and make its sizes per-rank.

    Column-parallel q/k/v projections give each rank whole heads only when the numbers of
    query and key/value heads divide by the TP degree; otherwise the model fails mid-forward
    (or worse, computes with half heads). This style goes on the attention module itself,
    next to the styles of its projections, and refuses such a plan before anything changes.
    It owns no parameters and moves no data.

    Some attention modules read their sizes from attributes in ``forward`` (GPT-2 splits its
    fused projection by ``split_size``): the attributes named in ``divide`` are divided by
    the TP degree, so that the module sees this rank's share.

    Args:
        num_heads (int or str): the number of query heads, or the dotted attribute of the
            module holding it (``"num_heads"``, ``"config.num_attention_heads"``).
        num_kv_heads (int or str, optional): the number of key/value heads (grouped-query
            attention), likewise. Default: ``None`` (as many as query heads).

    Keyword Args:
        divide (Sequence[str], optional): integer attributes of the module itself to divide
            by the TP degree. Default: ``()``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "model.layers.*.self_attn": AttentionHeads(
        ...         "config.num_attention_heads", "config.num_key_value_heads"
        ...     ),
        ...     "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        ...     # ...
        ... }
    """

    contract = StyleContract(
        arguments=lambda s: {
            "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "divide": s.divide,
        },
        # what _apply sets: each rank sees its share of the divided sizes
    )

    def _rank_attributes(self, module: nn.Module, degree: int) -> dict[str, Any]:
        """The attributes ``_apply`` sets on ``module`` over ``degree`` ranks (the shape check
        runs the module as one rank sees it, with these)."""
        return {name: getattr(module, name) // degree for name in self.divide}

    def __init__(
        self,
        num_heads: int | str,
        num_kv_heads: int | str | None = None,
        *,
        divide: tuple[str, ...] | list[str] = (),
    ) -> None:
        super().__init__()
        for what, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value is None or isinstance(value, str) and _is_attribute_path(value):
                continue
            if isinstance(value, str):
                raise ValueError(
                    f"{what} must be an int or the dotted name of a public attribute of the "
                    f"module ('num_heads', 'config.num_attention_heads'), found "
                    f"{short_repr(value)}"
                )
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"{what} must be an int or an attribute name, found "
                    f"{type(value).__name__} {short_repr(value)}"
                )
            if value < 1:
                raise ValueError(f"{what} must be a positive int, found {value}")
        if isinstance(divide, str) or not isinstance(divide, (tuple, list)):
            raise TypeError(
                f"divide must be a tuple or list of attribute names, found "
                f"{type(divide).__name__} {short_repr(divide)}"
            )
        for name in divide:
            if not isinstance(name, str) or not _is_attribute_path(name) or "." in name:
                raise ValueError(
                    f"divide names public attributes of the module itself, found "
                    f"{short_repr(name)} (a shared object such as the config must not be "
                    "changed per module)"
                )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.divide = tuple(divide)

    def _count(self, module: nn.Module, value: int | str | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        found = module
        for part in value.split("."):
            if not hasattr(found, part):
                raise ValueError(
                    f"{type(module).__name__} has no attribute {value!r} (found no {part!r})"
                )
            found = getattr(found, part)
        if not isinstance(found, int) or isinstance(found, bool):
            raise ValueError(f"attribute {value!r} is a {type(found).__name__}, not an int")
        return found

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        n = device_mesh.size()
        heads = self._count(module, self.num_heads)
        kv_heads = self._count(module, self.num_kv_heads)
        for what, count in (("query heads", heads), ("key/value heads", kv_heads)):
            if count is not None and count % n:
                # the TP degrees worth naming (a count from a plan file may be huge)
                divisors = [d for d in range(1, min(count, 1024) + 1) if count % d == 0]
                raise ValueError(
                    f"{count} {what} do not split over {n} ranks: each rank must hold whole "
                    f"heads. Use a TP degree that divides {count} ({', '.join(map(str, divisors))})"
                )
        for name in self.divide:
            value = self._count(module, name)
            if value % n:
                raise ValueError(f"attribute {name!r} = {value} does not divide by the {n} ranks")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # the divided sizes (the shape check reads them too)
        for name, value in self._rank_attributes(module, device_mesh.size()).items():
            setattr(module, name, value)
        return module


def _is_attribute_path(text: str) -> bool:
    """``text`` is a dotted path of public attributes (``config.num_attention_heads``): not
    one that reaches into private or special ones (``forward.__globals__``)."""
    return len(text) <= REPR_LIMIT and all(
        part.isidentifier() and not part.startswith("_") for part in text.split(".")
    )
