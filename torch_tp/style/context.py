"""Context parallelism: a sequence split over the ranks of a ``cp`` mesh dimension.

:class:`ContextParallel` makes the attention inside a module exact over the whole sequence
while each rank holds ``1 / cp`` of its tokens: every ``F.scaled_dot_product_attention`` call
its module's forward makes becomes a ring of key/value blocks over the ``cp`` ranks
(:func:`torch_tp._ring.ring_attention`), the causal mask taken from the tokens' true
positions. Everything else in the model computes token by token and needs no change: the
model is given this rank's tokens (:func:`shard_sequence`) and their positions
(:func:`sequence_positions`, for rotary embeddings), and returns this rank's outputs.

Parameters are not touched: each rank's gradient of each parameter is its tokens' part, to be
summed over ``cp`` as over data parallelism (FSDP2 over ``cp``, or over ``dp x cp``
flattened, as torchtitan does).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from torch_tp import _ring, runtime
from torch_tp import _torch_compat as compat
from torch_tp.contract import StyleContract, Transfer
from torch_tp.style.base import ParallelStyle, plan_root, style_at

__all__ = ["ContextParallel", "sequence_positions", "shard_sequence", "unshard_sequence"]

_ROTATIONS = ("p2p", "allgather")


def _layout(load_balance: bool) -> _ring.Layout:
    return "load_balanced" if load_balance else "contiguous"


def _cp_group(mesh: DeviceMesh, what: str) -> Any:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"{what} takes the 1-D context-parallel mesh (mesh['cp']), found "
            f"{mesh if not isinstance(mesh, DeviceMesh) else f'a {mesh.ndim}-D mesh'}"
        )
    return mesh.get_group()


def shard_sequence(
    tensor: torch.Tensor, mesh: DeviceMesh, *, dim: int = 1, load_balance: bool = True
) -> torch.Tensor:
    """This rank's part of a whole sequence, as :class:`ContextParallel` expects it.

    Every rank of ``mesh`` holds the same whole tensor (token ids, labels, a position table);
    each keeps its tokens, with no communication. With ``load_balance`` the sequence is cut in
    ``2 * cp`` chunks and rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``, so that under a
    causal mask every rank attends as much; otherwise rank ``r`` keeps the ``r``-th of ``cp``.

    Args:
        tensor (:class:`torch.Tensor`): the whole tensor, the same on every rank.
        mesh (:class:`DeviceMesh`): the 1-D context-parallel mesh.

    Keyword Args:
        dim (int, optional): the sequence dimension. Default: ``1``.
        load_balance (bool, optional): the layout. Default: ``True``.

    Returns:
        This rank's ``1 / cp`` of ``tensor`` along ``dim``.

    Raises:
        ValueError: the sequence length is not divisible by ``2 * cp`` (``cp`` without
            ``load_balance``), or ``mesh`` is not 1-D.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> tokens = shard_sequence(tokens, mesh["cp"])
        >>> positions = sequence_positions(seq_len, mesh["cp"])
        >>> logits = model(tokens, positions=positions)  # this rank's tokens' logits
    """
    group = _cp_group(mesh, "shard_sequence")
    return _ring.shard_sequence(tensor, dim, group, _layout(load_balance))


def unshard_sequence(
    tensor: torch.Tensor, mesh: DeviceMesh, *, dim: int = 1, load_balance: bool = True
) -> torch.Tensor:
    """The whole sequence from every rank's part (one all-gather), in sequence order: the
    inverse of :func:`shard_sequence`, differentiable.

    Args:
        tensor (:class:`torch.Tensor`): this rank's part.
        mesh (:class:`DeviceMesh`): the 1-D context-parallel mesh.

    Keyword Args:
        dim (int, optional): the sequence dimension. Default: ``1``.
        load_balance (bool, optional): the layout the parts are in. Default: ``True``.

    Returns:
        The whole tensor, on every rank.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> logits = unshard_sequence(model(tokens, positions=positions), mesh["cp"])
    """
    group = _cp_group(mesh, "unshard_sequence")
    return _ring.unshard_sequence(tensor, dim, group, _layout(load_balance))


def sequence_positions(
    seq_len: int, mesh: DeviceMesh, *, load_balance: bool = True, device: Any = None
) -> torch.Tensor:
    """The positions in the whole sequence of the tokens :func:`shard_sequence` keeps on this
    rank, in their order: for rotary embeddings (``position_ids``).

    Args:
        seq_len (int): the length of the whole sequence.
        mesh (:class:`DeviceMesh`): the 1-D context-parallel mesh.

    Keyword Args:
        load_balance (bool, optional): the layout. Default: ``True``.
        device (optional): where the positions go. Default: the CPU.

    Returns:
        An int64 tensor of ``seq_len // cp`` positions.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> sequence_positions(8, mesh["cp"])  # on rank 0 of cp=2
        tensor([0, 1, 6, 7])
    """
    group = _cp_group(mesh, "sequence_positions")
    rank, cp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return _ring.sequence_positions(seq_len, cp, rank, _layout(load_balance), device=device)


# set on a model whose inputs a ContextParallel style checks before each forward
_INPUTS_CHECKED = "_torch_tp_context_parallel_inputs"


def _hf_attention_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' attention modules in ``module`` (itself included): those that choose
    their attention function by ``config._attn_implementation``."""
    return [
        (path, sub)
        for path, sub in module.named_modules()
        if hasattr(sub, "is_causal")
        and isinstance(getattr(getattr(sub, "config", None), "_attn_implementation", None), str)
    ]


# the layer types (config.layer_types) whose attention is full causal attention ("attention":
# the legacy name transformers remaps)
_FULL_ATTENTION = ("full_attention", "attention")


def _local_attention(attention: nn.Module) -> str | None:
    """What makes a transformers attention module attend to less than every earlier token
    (a sliding window, chunks, another kind of layer), and where it was found; ``None`` for
    full causal attention.

    transformers keeps windows in three places, and each family reads its own: the layer's
    type (``config.layer_types[layer_idx]``: Gemma 2/3, Cohere 2, GPT-OSS, Qwen 2/3 (from
    ``use_sliding_window`` and ``max_window_layers``), OLMo 3, Llama 4's chunks, ...), the
    module's own ``sliding_window`` (set per layer, ``None`` on full layers; Exaone 4 keeps
    the config's on every layer and says which slide by ``is_sliding``), or only the config's
    ``sliding_window``, which the model reads for every layer's mask (Mistral, Mixtral, Phi-3,
    Starcoder 2, MiniMax, ...; their attention modules have no ``sliding_window``)."""
    config = attention.config
    window = getattr(config, "sliding_window", None)
    layer = getattr(attention, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(layer, int) and isinstance(types, (list, tuple)) and 0 <= layer < len(types):
        kind = types[layer]
        if kind not in _FULL_ATTENTION:
            if kind == "chunked_attention":
                size = getattr(config, "attention_chunk_size", None)
                what = f"chunks of {size} tokens" if size is not None else "chunks"
            elif "sliding" in str(kind):
                what = f"a sliding window of {window} tokens" if window else "a sliding window"
            else:
                what = "attention other than full causal attention"
            return f"{what} (config.layer_types[{layer}] = {kind!r})"
    if hasattr(attention, "sliding_window"):
        own = attention.sliding_window
        if own is not None and getattr(attention, "is_sliding", True) is not False:
            return f"a sliding window of {own} tokens (its sliding_window)"
        return None
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        return (
            f"a sliding window of {window} tokens (config.sliding_window, which "
            "the model reads for every layer's mask)"
        )
    return None


def _check_orthogonal(module: nn.Module, mesh: DeviceMesh) -> None:
    """The cp mesh must be a dimension of its own: a parameter of ``module`` already
    distributed (tensor parallelism) over ranks of the cp mesh would mix the two splits."""
    cp_ranks = set(mesh.mesh.flatten().tolist())
    for name, param in module.named_parameters():
        other = getattr(param, "device_mesh", None)
        if other is None:
            continue
        shared = cp_ranks & set(other.mesh.flatten().tolist())
        if len(shared) > 1:
            raise ValueError(
                f"the cp mesh (dims {mesh.mesh_dim_names}, ranks {sorted(cp_ranks)}) shares "
                f"ranks {sorted(shared)} with the mesh that {name!r} is distributed over (dims "
                f"{other.mesh_dim_names}): "
                "context parallelism needs a mesh dimension of its own, e.g. mesh['cp'] and "
                "mesh['tp'] of a mesh with mesh_dim_names=('cp', 'tp')"
            )


def _with_sdpa(config: Any) -> Any:
    """A shallow copy of a transformers config whose attention implementation is 'sdpa'."""
    config = copy.copy(config)
    config._attn_implementation_internal = "sdpa"
    return config


def _check_inputs(
    root: nn.Module, args: tuple, kwargs: dict, *, group: Any, layout: _ring.Layout
) -> None:
    """Refuse, on every rank of ``group``, a forward whose inputs the ring cannot follow: a
    length the layout cannot split (or that differs between ranks), an ``attention_mask`` that
    masks any token (padding: the ring applies the causal mask of the positions alone), or
    ``position_ids`` that are not this rank's tokens' true positions
    (:func:`sequence_positions`). One all-reduce of four numbers per forward."""
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    rank, cp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    padding = mask is not None and (mask.ndim != 2 or not bool(mask.bool().all()))
    length = tokens.shape[1] if tokens is not None and tokens.ndim >= 2 else 0
    wrong = positions is None or tokens is None
    if not wrong:
        try:
            expected = _ring.sequence_positions(length * cp, cp, rank, layout)
        except ValueError:
            wrong = True  # (the length's own error below)
        else:
            wrong = positions.shape[-1] != length or not bool(
                (positions.reshape(-1, length).cpu() == expected).all()
            )
    # the longest and (negated) the shortest length: equal when every rank has the same
    flags = torch.tensor([padding, wrong, length, -length], dtype=torch.int64)
    flags = flags.to(runtime.flag_device(group))
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    padding, wrong, longest, shortest = flags.tolist()
    shortest = -shortest
    name = f"{type(root).__name__} under ContextParallel"
    if tokens is not None and longest != shortest:
        raise ValueError(
            f"{name}: the ranks of cp hold sequences of {shortest} to {longest} tokens; every "
            "rank must hold its part of the same sequences (shard_sequence)"
        )
    if tokens is not None:
        try:
            _ring._chunks(longest * cp, cp, layout)
        except ValueError as err:
            raise ValueError(
                f"{name}: {longest} tokens per rank, {err} (each rank's part, "
                "torch_tp.shard_sequence(tokens, mesh['cp']), of a whole sequence of such a "
                "length)"
            ) from None
    if padding:
        raise ValueError(
            f"{name}: an attention_mask that masks tokens "
            "(padding) is not supported on a split sequence; the ring applies the causal mask "
            "of the tokens' positions alone. Pack sequences without padding, or pass no "
            "attention_mask (or one of all ones)"
        )
    if wrong:
        raise ValueError(
            f"{name}: position_ids must be the positions "
            "of this rank's tokens in the whole sequence, "
            "position_ids=torch_tp.sequence_positions(seq_len, mesh['cp'])[None] (for the "
            "rotary embeddings; without them each rank would count its tokens from 0)"
        )


def _causal_pattern(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (boolean, or additive: 0 where attended) lets each token attend to
    itself and every earlier token of its run of consecutive positions, and to nothing else:
    what transformers builds for a causal model on this rank's tokens (one run, or a run per
    chunk of positions it takes for packed sequences)."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.ndim != 4 or allowed.shape[-1] != allowed.shape[-2]:
        return False
    n = allowed.shape[-1]
    rows = allowed.flatten(0, 1)
    index = torch.arange(n, device=rows.device)
    # a run starts at a token that does not see the one before it
    starts = torch.ones(rows.shape[0], n, dtype=torch.bool, device=rows.device)
    starts[:, 1:] = ~rows[:, index[1:], index[:-1]]
    run = starts.cumsum(-1)
    causal = index[:, None] >= index[None, :]
    return torch.equal(rows, causal & (run[:, :, None] == run[:, None, :]))


# the verdict on the last mask seen (every layer of a forward gets the same mask object): a
# weak reference to it, its version, and whether it is causal
_VERDICT: list[tuple[weakref.ref, int, bool]] = []


def _causal(mask: torch.Tensor) -> bool:
    """:func:`_causal_pattern`, computed once per mask object (and version)."""
    if _VERDICT:
        seen, version, verdict = _VERDICT[0]
        if seen() is mask and version == compat.version(mask):
            return verdict
    verdict = _causal_pattern(mask)
    _VERDICT[:] = [(weakref.ref(mask), compat.version(mask), verdict)]
    return verdict


class _RingMode(TorchFunctionMode):
    """Turns the ``F.scaled_dot_product_attention`` calls of one module's forward into ring
    attention over the ``cp`` group."""

    def __init__(
        self, style: ContextParallel, module: nn.Module, group: Any, causal_masks: bool
    ) -> None:
        super().__init__()
        self.style, self.module, self.group = style, module, group
        self.causal_masks = causal_masks
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self.style._attend(self.module, self.group, self.causal_masks, *args, **kwargs)


class ContextParallel(ParallelStyle):
    """Attention exact over a sequence split over the ranks of a context-parallel mesh.

    Applied to a module that computes attention with ``F.scaled_dot_product_attention``
    (an attention module, or a block around one), on a 1-D ``cp`` mesh. Each rank's forward
    gets this rank's part of the sequence (:func:`shard_sequence`) and returns this rank's
    part of the output; each attention call inside it attends this rank's queries to the
    whole sequence's keys and values, which come by around the ring of ``cp`` ranks one block
    at a time (``rotation="p2p"``, point-to-point, the next block sent while this one is
    computed) or all at once (``"allgather"``). The blocks are merged by the online-softmax
    rule, and the backward goes around the ring again. The causal mask is that of the tokens'
    positions in the whole sequence; with ``load_balance`` (the default) every rank holds a
    chunk from the head of the sequence and one from its tail, so that every rank does the
    same work under it.

    What the module computes besides attention sees only this rank's tokens: rotary
    embeddings must be given the tokens' true positions (:func:`sequence_positions`).
    Parameters are left as they are (replicated over ``cp``): their gradients on each rank are
    its tokens' part, summed over ``cp`` as over data parallelism (FSDP2 over ``cp`` or ``dp x
    cp``). Tensor parallelism composes: a tensor-parallel attention computes its local heads'
    ring.

    Supported attention calls: ``is_causal=True`` or full (bidirectional) attention without
    a mask, any ``scale``, grouped-query attention (``enable_gqa`` or fewer key/value heads).
    An ``attn_mask`` and ``dropout_p > 0`` are refused, naming the module. Every rank must call
    the module with the same shapes.

    Keyword Args:
        rotation (str, optional): ``"p2p"`` or ``"allgather"``. Default: ``"p2p"``.
        load_balance (bool, optional): the layout of the sequence over the ranks (it must be
            the one :func:`shard_sequence` used). Default: ``True``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("cp",))
        >>> parallelize_module(model, mesh, {"layers.*.attention": ContextParallel()})
        >>> tokens = shard_sequence(tokens, mesh)
        >>> logits = model(tokens, positions=sequence_positions(seq_len, mesh))
    """

    contract = StyleContract(
        names={"context_parallel": {}},
        arguments=lambda s: {"rotation": s.rotation, "load_balance": s.load_balance},
        # on the mesh's "cp" dimension
        mesh_dims=("cp",),
    )

    # for the dry-run report: the model's sequence split over "cp", and the ring's transfers
    # of each attention call
    def _sequence_chunks(self, cp: int) -> int:
        """The equal chunks the whole model's sequence is cut in over ``cp`` ranks."""
        return 2 * cp if self.load_balance else cp

    def _attention_transfers(
        self, module: nn.Module, query: Any, key: Any, value: Any, kwargs: dict, cp: int
    ) -> Sequence[Transfer]:
        """The transfers of one ``F.scaled_dot_product_attention`` call inside ``module``."""
        return self._ring_transfers(key, cp)

    def __init__(self, *, rotation: str = "p2p", load_balance: bool = True) -> None:
        super().__init__()
        if rotation not in _ROTATIONS:
            raise ValueError(f"rotation must be one of {_ROTATIONS}, found {rotation!r}")
        if not isinstance(load_balance, bool):
            raise TypeError(f"load_balance must be a bool, found {load_balance!r}")
        self.rotation = rotation
        self.load_balance = load_balance

    def _ring_transfers(self, key: torch.Tensor, cp: int) -> list[Transfer]:
        """The transfers of one ring attention call over ``cp`` ranks, for the dry-run report,
        from this rank's keys (``(..., heads_kv, S / cp, head_dim)``; values alike): one
        ``"send_recv"`` per point-to-point send (bytes sent), or the all-gathers (bytes
        gathered) and the reduce-scatter (bytes reduced), sized by
        :func:`torch_tp._ring.ring_volume`."""
        *batch, heads_kv, tokens, head_dim = key.shape
        volume = _ring.ring_volume(
            math.prod(batch), heads_kv, tokens * cp, head_dim, key.element_size(), cp,
            self.rotation,
        )  # fmt: skip
        if cp == 1:
            return []
        # this rank's packed keys and values: in the forward with its verdict (one element)
        block = volume["forward_bytes"] // (cp - 1)
        kv = block - key.element_size()
        if self.rotation == "p2p":  # the gradients of each block come home in cp sends
            acc = (volume["backward_bytes"] - (cp - 1) * kv) // cp
            return [
                *[Transfer("forward", "send_recv", block)] * (cp - 1),
                *[Transfer("backward", "send_recv", kv)] * (cp - 1),
                *[Transfer("backward", "send_recv", acc)] * cp,
            ]
        acc = volume["backward_bytes"] // (cp - 1) - kv
        return [
            Transfer("forward", "all_gather_into_tensor", cp * block),
            Transfer("backward", "all_gather_into_tensor", cp * kv),
            Transfer("backward", "reduce_scatter_tensor", cp * acc),
        ]

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"ContextParallel takes a 1-D mesh (mesh['cp']), found a {device_mesh.ndim}-D mesh"
            )
        _check_orthogonal(module, device_mesh)
        for path, attention in _hf_attention_modules(module):
            where = f"the attention module {path!r}" if path else "the attention module"
            dropout = getattr(attention, "attention_dropout", 0.0)
            if isinstance(dropout, (int, float)) and dropout > 0:
                raise NotImplementedError(
                    f"{where} drops attention weights out (attention_dropout={dropout}); "
                    "ContextParallel computes each query's softmax over blocks that never "
                    "meet whole, and does not follow dropout inside attention (set "
                    "attention_dropout=0)"
                )
            implementation = attention.config._attn_implementation
            if implementation not in ("eager", "sdpa"):
                raise NotImplementedError(
                    f"{where} computes attention with transformers' {implementation!r} "
                    "implementation; ContextParallel follows 'eager' and 'sdpa' (load the "
                    "model with attn_implementation='sdpa')"
                )
            local = _local_attention(attention)
            if local is not None:
                raise ValueError(
                    f"{where} attends within {local}; ContextParallel computes full causal "
                    "attention over the whole sequence, so the window would be silently "
                    "dropped. Build the model without it (sliding_window=None, or "
                    "use_sliding_window=False where the config has it) if no sequence is "
                    "longer than the window (the same attention then), or do not split the "
                    "sequence (no ContextParallel, no cp_degree)"
                )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        attentions = [attention for _, attention in _hf_attention_modules(module)]
        for attention in attentions:
            # transformers' eager attention is matmuls and a softmax, which no hook sees: the
            # same attention by F.scaled_dot_product_attention ('sdpa'), for this module only
            if attention.config._attn_implementation == "eager":
                attention.config = _with_sdpa(attention.config)
        # the masks transformers builds for a causal model are laid out for this rank's tokens
        # (causal over them, or over its chunks taken for packed sequences): the ring applies
        # the causal mask of the true positions instead, the model's inputs checked to carry
        # no padding (see _check_inputs)
        causal_masks = any(getattr(a, "is_causal", False) for a in attentions)
        root = plan_root()
        if attentions and root is not None:
            self._check_inputs_of(root, group)
        modes: list[_RingMode] = []

        def enter(mod: nn.Module, args: Any) -> None:
            mode = _RingMode(self, mod, group, causal_masks)
            mode.__enter__()
            modes.append(mode)

        def leave(mod: nn.Module, args: Any, output: Any) -> None:
            mode = modes.pop()
            mode.__exit__(None, None, None)
            # (called with no output when the forward raised: that error stands)
            if mode.calls == 0 and output is not None:
                raise NotImplementedError(
                    f"{style_at(self, mod)}: the forward made no F.scaled_dot_product_attention "
                    "call, so its attention saw this rank's tokens only; ContextParallel "
                    "follows attention computed by F.scaled_dot_product_attention"
                )

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module

    def _check_inputs_of(self, root: nn.Module, group: Any) -> None:
        """Check, before each forward of a transformers model, that its inputs are what the
        ring can follow: no padding, and each token's true position (agreed over cp)."""
        if getattr(root, _INPUTS_CHECKED, False):
            return
        try:
            parameters = inspect.signature(root.forward).parameters
        except (TypeError, ValueError):
            return
        if "attention_mask" not in parameters or "position_ids" not in parameters:
            return
        layout = _layout(self.load_balance)
        root.register_forward_pre_hook(
            functools.partial(_check_inputs, group=group, layout=layout), with_kwargs=True
        )
        setattr(root, _INPUTS_CHECKED, True)

    def _attend(
        self,
        module: nn.Module,
        group: Any,
        causal_masks: bool,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """Ring attention in place of one ``F.scaled_dot_product_attention`` call.

        What depends on this rank's own data (a mask, dropout) is judged here and the verdict
        travels with this rank's first key/value block (``refused``): a call refused on one
        rank raises the same error on every rank, and no peer waits in the ring."""
        error: Exception | None = None
        if attn_mask is not None and causal_masks:
            # a causal transformers model's own mask, laid out for this rank's tokens (its
            # inputs were checked to hold no padding): the ring's causal mask takes its place,
            # if it is causal (over its tokens, or over each run of consecutive positions): a
            # mask function of the model's own is refused
            if not _causal(attn_mask):
                error = NotImplementedError(
                    f"{style_at(self, module)}: the model builds an attention mask other than "
                    "the causal one (a mask function of its own: bidirectional spans, windows, "
                    "...), which cannot be followed over a split sequence; ContextParallel "
                    "follows causal attention"
                )
            attn_mask, is_causal = None, True
        if attn_mask is not None:
            error = NotImplementedError(
                f"{style_at(self, module)}: an attention mask (attn_mask) cannot be followed "
                "over a split sequence: it is laid out for this rank's tokens; pass "
                "is_causal=True (causal) or no mask (full attention)"
            )
        elif dropout_p:
            error = NotImplementedError(
                f"{style_at(self, module)}: dropout inside attention (dropout_p={dropout_p}) is "
                "not supported under context parallelism"
            )
        if query.shape[-3] != key.shape[-3] and not enable_gqa:
            raise ValueError(
                f"{style_at(self, module)}: {query.shape[-3]} query heads and "
                f"{key.shape[-3]} key heads without enable_gqa=True"
            )
        cp = torch.distributed.get_world_size(group)
        try:  # the same shapes on every rank: every rank raises alike, before any message
            _ring._chunks(query.shape[-2] * cp, cp, _layout(self.load_balance))
        except ValueError as err:
            raise ValueError(f"{style_at(self, module)}: {err}") from None
        try:
            return _ring.ring_attention(
                query,
                key,
                value,
                group=group,
                is_causal=is_causal,
                layout=_layout(self.load_balance),
                rotation=self.rotation,
                scale=scale,
                refused=error is not None,
            )
        except _ring.RingRefused:  # every rank: the messages gathered (the error path only)
            runtime.raise_agreed(error, [group])
            raise  # (raise_agreed raises)
