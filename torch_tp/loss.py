"""Cross-entropy on logits sharded on the vocabulary, without gathering them.

The last linear layer of a language model is column-parallel: each rank computes the logits of
its slice of the vocabulary. Gathering them for the loss would move ``tokens x vocab`` values
and hold the whole ``tokens x vocab`` tensor on every rank. The loss needs far less: per token,
the global max (for stability), the global sum of exponentials, the logit of the target class
(which lives on one rank) and, for label smoothing, the sum of all logits. Each is a local
reduction over the rank's slice followed by an all-reduce of one number per token. The
gradient, ``softmax - smoothed one-hot``, is then computed on each slice locally: the backward
needs no communication at all.

Two entry points share that computation:

- :func:`loss_parallel`, a drop-in for ``torch.distributed.tensor.parallel.loss_parallel``:
  inside it, :func:`torch.nn.functional.cross_entropy` (and :class:`torch.nn.CrossEntropyLoss`)
  on a :class:`DTensor` sharded on the class dimension runs the computation above. It catches
  exactly that call with a :class:`~torch.overrides.TorchFunctionMode`; every other call,
  including ``log_softmax`` on any tensor, runs as it would outside the context.
- :func:`vocab_parallel_cross_entropy`, a function on local shards for code that keeps local
  tensors (Megatron's ``vocab_parallel_cross_entropy``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from torch_tp import _torch_compat as compat
from torch_tp.runtime import chunk_range, raise_agreed
from torch_tp.runtime.boundaries import contiguous_stride

__all__ = ["loss_parallel", "vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")

# A process group as the functional collectives take it: one dimension of a mesh.
_Group = tuple[DeviceMesh, int]


# ------------------------------------------------------------------------------------------
# The computation, on local tensors
# ------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``(tokens, local classes)`` logits split across ``group``.

    Forward: two all-reduces of size ``tokens`` (the max, with one number more: whether any
    rank's inputs failed their checks; then the sums of exponentials, the target logits and,
    with label smoothing, the logits). Backward: none. ``error`` is what this rank's checks
    found: the first all-reduce agrees it over ``group`` (and one all-reduce of that number
    over each of ``agree_groups``: the other dimensions of the logits' mesh), and every rank
    raises the same error before the target is used. The result is the
    loss of every token (0 for ignored ones) in the compute dtype (float32 at least), the same
    on every rank of ``group``.

    For a token with target ``t``, smoothing ``eps``, class weights ``w`` (all ones when not
    given, ``W`` their sum) over ``V`` classes and ``p = softmax(x)``:

    ``loss = (1 - eps) * w[t] * (lse - x[t]) + eps / V * (W * lse - sum_j w[j] * x[j])``

    ``dloss/dx[j] = p[j] * ((1 - eps) * w[t] + eps * W / V) - (1 - eps) * w[t] * [j == t]
    - eps / V * w[j]``
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        target: Tensor,
        group: _Group,
        vocab_start: int,
        vocab_size: int,
        weight: Tensor | None,
        ignore_index: int,
        label_smoothing: float,
        error: Exception | None,
        agree_groups: Sequence[_Group],
    ) -> Tensor:
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(compute_dtype)
        num_tokens, num_local = x.shape
        eps = label_smoothing

        # 1. The global max of each token's logits. It only shifts the exponentials, so no
        # gradient flows through it. A rank with no classes (a vocabulary smaller than the
        # mesh) contributes -inf. One number more carries this rank's verdict (1 if its checks
        # failed): a rank that raised alone would leave the others waiting in the next
        # all-reduce. Reading it back is free on CPU, one host sync on an accelerator.
        if num_local > 0:
            local_max = x.amax(dim=1)
        else:
            local_max = x.new_full((num_tokens,), -math.inf)
        verdict = local_max.new_full((1,), 0.0 if error is None else 1.0)
        reduced = compat.functional_collectives.all_reduce(
            torch.cat([local_max, verdict]), "max", group
        )
        shift, flag = reduced[:-1], reduced[-1:]
        if torch.compiler.is_compiling():
            # a branch on data would break the graph: the checks found on the host raise
            # when traced
            if error is not None:
                raise error
        else:
            for other in agree_groups:
                flag = compat.functional_collectives.all_reduce(flag, "max", other)
            if flag.item():
                groups = [mesh.get_group(dim) for mesh, dim in (group, *agree_groups)]
                raise_agreed(error, groups)

        valid = target != ignore_index
        local_target = target - vocab_start
        in_shard = valid & (local_target >= 0) & (local_target < num_local)
        local_target = torch.where(in_shard, local_target, 0)
        # The weight of each token's class; the weight vector is replicated, so no rank needs
        # to own the class to look it up.
        target_weight = local_weight = None
        if weight is not None:
            weight = weight.to(compute_dtype)
            target_weight = weight[torch.where(valid, target, 0)]
            local_weight = weight[vocab_start : vocab_start + num_local]

        # 2. One all-reduce of the per-token sums: exponentials, target logit, smoothing term.
        shifted = x - shift.unsqueeze(1)
        if num_local > 0:
            target_logit = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1)
        else:
            target_logit = shifted.new_zeros(num_tokens)
        sums = [torch.zeros_like(target_logit), torch.where(in_shard, target_logit, 0.0)]
        if eps > 0:
            weighted = shifted if local_weight is None else shifted * local_weight
            sums.append(weighted.sum(dim=1))
        sums[0] = shifted.exp_().sum(dim=1)  # in place: ``shifted`` is not needed any more
        del shifted
        totals = compat.functional_collectives.all_reduce(torch.stack(sums, dim=1), "sum", group)

        # Every term is relative to the shift: log Z = lse - max, x[t] - max, sum (x - max).
        log_z = totals[:, 0].log()
        nll = log_z - totals[:, 1]
        loss = (1 - eps) * nll if target_weight is None else (1 - eps) * target_weight * nll
        weight_sum = None
        if eps > 0:
            weight_sum = None if weight is None else weight.sum()
            total_weight = vocab_size if weight_sum is None else weight_sum
            loss = loss + eps / vocab_size * (total_weight * log_z - totals[:, 2])
        loss = torch.where(valid, loss, 0.0)

        ctx.save_for_backward(
            logits, shift + log_z, local_target, in_shard, valid, target_weight, local_weight
        )
        ctx.weight_sum = weight_sum  # a 0-d tensor computed here, not an input: no version check
        ctx.vocab_size = vocab_size
        ctx.label_smoothing = eps
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        logits, lse, local_target, in_shard, valid, target_weight, local_weight = ctx.saved_tensors
        eps, vocab_size = ctx.label_smoothing, ctx.vocab_size
        # ``where``, not a product: the gradient of a mean over no tokens is inf, and an
        # ignored token must still get 0.
        g = torch.where(valid, grad.to(lse.dtype), 0.0)

        grad_logits = (logits.to(lse.dtype) - lse.unsqueeze(1)).exp_()  # the softmax
        if target_weight is None:
            grad_logits.mul_(g.unsqueeze(1))
            if eps > 0:
                grad_logits.sub_(g.unsqueeze(1), alpha=eps / vocab_size)
            target_coef = (1 - eps) * g
        else:
            target_coef = (1 - eps) * target_weight * g
            if eps > 0:
                scale = target_coef + g * (eps / vocab_size) * ctx.weight_sum
                grad_logits.mul_(scale.unsqueeze(1))
                grad_logits.sub_((eps / vocab_size) * g.unsqueeze(1) * local_weight.unsqueeze(0))
            else:
                grad_logits.mul_(target_coef.unsqueeze(1))
        if grad_logits.shape[1] > 0:
            # minus the (smoothed, weighted) one-hot, on the rank that owns the target class
            rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
            grad_logits.index_put_(
                (rows, local_target), -torch.where(in_shard, target_coef, 0.0), accumulate=True
            )
        return grad_logits.to(logits.dtype), None, None, None, None, None, None, None, None, None


def _check_options(reduction: str, label_smoothing: float) -> None:
    # the exception types and messages of F.cross_entropy
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")


def _check_class_indices(target: Tensor) -> Exception | None:
    if target.is_floating_point() or target.is_complex():
        return NotImplementedError(
            "vocabulary-parallel cross-entropy takes class indices as targets (an integer "
            f"tensor); found a {target.dtype} target (class probabilities are not supported)"
        )


def _check_bounds(target: Tensor, vocab_size: int, ignore_index: int) -> Exception | None:
    # On an accelerator this check would wait for the device for the target's values, so it
    # is done where it is free (like the device-side assert of CUDA's nll_loss, it is a bug
    # check, not a feature).
    if target.device.type == "cpu":
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
        if bad.any():
            return IndexError(f"Target {int(target[bad][0])} is out of bounds.")
    return None


def _check_weight(weight: Tensor | None, vocab_size: int) -> Exception | None:
    if weight is None:
        return None
    if weight.shape != (vocab_size,):
        return RuntimeError(
            f"weight tensor should be defined either for all {vocab_size} classes or no "
            f"classes but got weight tensor of shape: {list(weight.shape)}"
        )
    if weight.requires_grad and torch.is_grad_enabled():
        return NotImplementedError(
            "vocabulary-parallel cross-entropy does not compute a gradient for the class "
            "weights; pass weight.detach()"
        )
    return None


def _cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: _Group,
    vocab_start: int,
    vocab_size: int,
    *,
    weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    out_shape: Sequence[int],
    mean_groups: Sequence[_Group] = (),
    error: Exception | None = None,
    agree_groups: Sequence[_Group] = (),
) -> Tensor:
    """The loss of ``(tokens, local classes)`` logits, reduced.

    ``mean_groups`` are the mesh dimensions the tokens are split over (data parallel): the
    number of tokens a mean divides by is summed over them, so that the sum over those ranks
    of the local results is the global mean. ``error`` is what this rank's checks of its
    inputs found (``target`` need not fit ``logits`` then); it is agreed over ``group`` and
    ``agree_groups`` before the target is used, and raised on every rank if any has one.
    """
    if error is None:
        error = _check_bounds(target, vocab_size, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(
        logits,
        target,
        group,
        vocab_start,
        vocab_size,
        weight,
        ignore_index,
        label_smoothing,
        error,
        agree_groups,
    )
    if reduction == "none":
        return loss.reshape(out_shape).to(logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        valid = target != ignore_index
        if weight is None:
            count = valid.sum().to(total.dtype)
        else:
            count = torch.where(valid, weight[torch.where(valid, target, 0)], 0).sum()
            count = count.to(total.dtype)
        for mean_group in mean_groups:
            count = compat.functional_collectives.all_reduce(count, "sum", mean_group)
        total = total / count
    return total.to(logits.dtype)


# ------------------------------------------------------------------------------------------
# The function on local shards
# ------------------------------------------------------------------------------------------


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    target: Tensor,
    device_mesh: DeviceMesh,
    *,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
) -> Tensor:
    """Cross-entropy of logits whose last dimension (the vocabulary) is split across ranks.

    The value and gradient of ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(),
    ...)`` on the gathered logits, without gathering them: two all-reduces of one to three
    numbers per token forward, none backward. For code that keeps local tensors (the output of
    ``ColwiseParallel()``, ``Shard(-1)``); with DTensor logits use :func:`loss_parallel`. Call
    it on every rank of ``device_mesh`` with the same ``target``: the result is the same on
    every rank, and each rank's ``local_logits`` receives its slice of the gradient. How the
    vocabulary is split: the guide's "With local tensors" (``docs/loss_parallel.md``).

    Args:
        local_logits: this rank's logits, ``(..., V_local)``: the vocabulary is the *last*
            dimension (unlike ``F.cross_entropy``'s ``(N, C, d1, ...)``).
        target: class indices, the shape of ``local_logits`` without its last dimension,
            the same on every rank.
        device_mesh: the one-dimensional mesh the vocabulary is split over (for an N-D mesh,
            pass its tensor-parallel dimension, e.g. ``mesh["tp"]``).

    Keyword Args:
        weight (Tensor, optional): a weight for each of the ``V`` classes (the full vector,
            the same on every rank), as in ``F.cross_entropy``. No gradient flows to it.
        ignore_index (int): a target value that contributes neither to the loss nor to the
            mean's denominator. Default: ``-100``.
        reduction (str): ``"mean"`` (over the non-ignored tokens, weighted by their class
            weights), ``"sum"`` or ``"none"`` (the loss of every token, shaped like
            ``target``). Default: ``"mean"``.
        label_smoothing (float): in ``[0, 1]``; the target is ``(1 - s) * one_hot + s / V``,
            as in ``F.cross_entropy``. Default: ``0.0``.
        vocab_size (int, optional): the full vocabulary size ``V``: the shards are then
            :func:`torch.chunk`'s split (checked), with no extra collective. Default: found by
            all-gathering the local sizes (any contiguous split in rank order).

    Returns:
        The loss as a plain tensor of ``local_logits``' dtype (a scalar, or shaped like
        ``target`` for ``reduction="none"``), computed in float32 at least.

    Raises:
        ValueError: ``device_mesh`` is not 1-D, ``target`` has the wrong shape, the local
            vocabulary size does not match ``vocab_size``, or ``reduction`` is unknown.
        RuntimeError: ``label_smoothing`` is outside ``[0, 1]`` or ``weight`` is not of shape
            ``(V,)`` (``F.cross_entropy``'s exception type for both).
        TypeError: ``local_logits`` is a DTensor.
        NotImplementedError: ``target`` holds class probabilities, or ``weight`` requires a
            gradient.
        IndexError: a CPU ``target`` holds a class outside ``[0, V)`` other than
            ``ignore_index`` (not checked on accelerators: that would wait for the device).

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import vocab_parallel_cross_entropy
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # the output projection as a column-parallel layer with local outputs
        >>> model = parallelize_module(model, tp_mesh, {"output": ColwiseParallel()})
        >>> local_logits = model(tokens)  # (batch, seq, vocab / 8) on every rank
        >>> loss = vocab_parallel_cross_entropy(
        ...     local_logits, labels, tp_mesh, vocab_size=32000, label_smoothing=0.1
        ... )
        >>> loss.backward()
    """
    if isinstance(local_logits, DTensor):
        raise TypeError(
            "vocab_parallel_cross_entropy takes this rank's local logits as a plain tensor; "
            "found a DTensor (call F.cross_entropy on it inside torch_tp.loss_parallel())"
        )
    if device_mesh.ndim != 1:
        raise ValueError(
            "expected the one-dimensional mesh the vocabulary is split over, found a "
            f"{device_mesh.ndim}-D mesh {device_mesh} (pass its tensor-parallel dimension, "
            'e.g. mesh["tp"])'
        )
    _check_options(reduction, label_smoothing)
    if local_logits.ndim < 1:
        raise ValueError("expected local_logits with a class dimension, found a 0-d tensor")
    # What this rank's own inputs show is not raised here: a rank that raised alone would
    # leave the others waiting in the first all-reduce. It is agreed there (one number more).
    error = _check_class_indices(target)
    if error is None and target.shape != local_logits.shape[:-1]:
        error = ValueError(
            "expected target of shape local_logits.shape[:-1] = "
            f"{tuple(local_logits.shape[:-1])}, found {tuple(target.shape)}"
        )
    num_local = local_logits.shape[-1]
    rank, num_ranks = device_mesh.get_local_rank(), device_mesh.size()
    if vocab_size is None:
        local_size = torch.tensor([num_local], device=local_logits.device)
        sizes = compat.functional_collectives.all_gather_single(local_size, 0, device_mesh).tolist()
        vocab_start, vocab_size = _sizes_before(sizes, rank), sum(sizes)
    else:
        vocab_start, vocab_stop = chunk_range(vocab_size, num_ranks, rank)
        if error is None and vocab_stop - vocab_start != num_local:
            error = ValueError(
                f"with vocab_size={vocab_size} over {num_ranks} ranks, rank {rank} should hold "
                f"{vocab_stop - vocab_start} classes (torch.chunk's split), found local logits "
                f"with {num_local} (shape {tuple(local_logits.shape)})"
            )
    error = error or _check_weight(weight, vocab_size)
    num_tokens = math.prod(local_logits.shape[:-1])
    return _cross_entropy(
        local_logits.reshape(num_tokens, num_local),
        target.reshape(-1) if error is None else target,
        (device_mesh, 0),
        vocab_start,
        vocab_size,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        out_shape=target.shape,
        error=error,
    )


# ------------------------------------------------------------------------------------------
# F.cross_entropy on a DTensor sharded on the classes
# ------------------------------------------------------------------------------------------


def _sizes_before(sizes: list[int], rank: int) -> int:
    """``sum(sizes[:rank])``, also for a rank that is a SymInt with one value per simulated
    rank (under LocalTensorMode), which cannot index a list."""
    if isinstance(rank, int):
        return sum(sizes[:rank])
    # sizes[i] counts where i < rank: min(max(rank - i, 0), 1) is 1 there, 0 elsewhere
    return sum(torch.sym_min(torch.sym_max(rank - i, 0), 1) * size for i, size in enumerate(sizes))


def _class_dim(input: DTensor) -> int:
    # F.cross_entropy's convention: (C,), (N, C) or (N, C, d1, ..., dk)
    return 1 if input.ndim >= 2 else 0


def _class_mesh_dims(input: DTensor) -> list[int]:
    class_dim = _class_dim(input)
    return [i for i, p in enumerate(input.placements) if p.is_shard(class_dim)]


def _replicated_local(value: Tensor, mesh: DeviceMesh, what: str) -> Tensor:
    if not isinstance(value, DTensor):
        return value
    if value.device_mesh != mesh or any(not p.is_replicate() for p in value.placements):
        raise RuntimeError(
            f"loss_parallel(): expected {what} replicated on the logits' mesh {mesh}, found a "
            f"DTensor with placements {value.placements} on {value.device_mesh}"
        )
    return value.to_local()


def _dtensor_cross_entropy(
    input: DTensor,
    target: Tensor,
    weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> DTensor:
    """``F.cross_entropy`` on ``input`` sharded on its class dimension, on local shards."""
    _check_options(reduction, label_smoothing)
    mesh, placements = input.device_mesh, input.placements
    class_dim = _class_dim(input)
    (tp_dim, *others) = _class_mesh_dims(input)
    if others or type(placements[tp_dim]) is not Shard:
        raise ValueError(
            f"loss_parallel() expects the class dimension ({class_dim}) of the logits sharded "
            f"(Shard({class_dim})) on exactly one mesh dimension, found placements {placements}"
        )
    # The other mesh dimensions may split the tokens (data parallel) or repeat them.
    target_placements: list[Placement] = []
    for i, p in enumerate(placements):
        if i == tp_dim or p.is_replicate():
            target_placements.append(Replicate())
        elif type(p) is Shard:
            # the target has no class dimension: the dimensions after it move down by one
            target_placements.append(Shard(p.dim - 1 if p.dim > class_dim else p.dim))
        else:
            raise ValueError(
                f"loss_parallel() expects the logits' mesh dimensions other than the class "
                f"one to be Shard or Replicate, found {p} on mesh dimension {i} (placements "
                f"{placements})"
            )
    batch_dims = [i for i, p in enumerate(target_placements) if p.is_shard()]

    if isinstance(target, DTensor):
        if target.device_mesh != mesh or tuple(target.placements) != tuple(target_placements):
            raise RuntimeError(
                f"loss_parallel(): expected the target with placements "
                f"{tuple(target_placements)} on {mesh} (those of logits {placements} without "
                f"the class dimension), found {target.placements} on {target.device_mesh}"
            )
        local_target = target.to_local()
    elif batch_dims:
        raise ValueError(
            f"loss_parallel(): the logits {placements} are split on the tokens too, so the "
            f"target must be a DTensor with placements {tuple(target_placements)}; found a "
            "plain tensor (wrap it with DTensor.from_local or distribute_tensor)"
        )
    else:
        local_target = target
    weight = _replicated_local(weight, mesh, "the class weights") if weight is not None else None

    vocab_size = input.shape[class_dim]
    local_input = input.to_local()  # differentiable: the gradient is the local shard's
    expected = local_input.shape[:class_dim] + local_input.shape[class_dim + 1 :]
    # What this rank's local target and weight show is agreed over the whole mesh of the
    # logits (every rank of the step calls this) before anything is raised: in the first
    # all-reduce, and one all-reduce of one number over each other mesh dimension
    error = _check_class_indices(local_target)
    if error is None and local_target.shape != expected:
        error = ValueError(
            f"loss_parallel(): expected a target of (local) shape {tuple(expected)} for logits "
            f"of shape {tuple(input.shape)} (local {tuple(local_input.shape)}), found "
            f"{tuple(local_target.shape)}"
        )
    error = error or _check_weight(weight, vocab_size)
    vocab_start, _ = chunk_range(vocab_size, mesh.size(tp_dim), mesh.get_local_rank(tp_dim))
    num_local = local_input.shape[class_dim]
    loss = _cross_entropy(
        local_input.movedim(class_dim, -1).reshape(math.prod(expected), num_local),
        local_target.reshape(-1) if error is None else local_target,
        (mesh, tp_dim),
        vocab_start,
        vocab_size,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        out_shape=local_target.shape,
        mean_groups=[(mesh, i) for i in batch_dims],
        error=error,
        agree_groups=[(mesh, i) for i in range(mesh.ndim) if i != tp_dim],
    )
    if reduction == "none":
        out_placements: Sequence[Placement] = target_placements
        shape = input.shape[:class_dim] + input.shape[class_dim + 1 :]
    else:
        # each rank summed its own tokens: a partial sum over the mesh dimensions that split
        # them, complete on the others
        out_placements = [Partial() if p.is_shard() else Replicate() for p in target_placements]
        shape = torch.Size()
    return DTensor.from_local(
        loss,
        mesh,
        out_placements,
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )


def _check_unsharded_classes(input: DTensor, target: Any, weight: Any) -> None:
    """Refuse, in ``loss_parallel``'s terms, logits not sharded on the classes that DTensor's
    own ``cross_entropy`` could not compute either.

    Such logits are not taken over: ``F.cross_entropy`` runs on them as outside the context,
    which works when the target (and weight) are DTensors too. With a plain tensor DTensor
    raises its generic "mixed torch.Tensor and DTensor" error (it replicates one-element
    tensors only), or a shape error when ``(batch, seq, vocab)`` logits are passed as they
    are; upstream's ``loss_parallel`` raises ``ValueError`` for any such logits. So: the
    same ``ValueError`` type, saying which layout was expected and which was found.
    """
    plain = [
        name
        for name, value in (("target", target), ("weight", weight))
        if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.numel() != 1
    ]
    if not plain:
        return
    class_dim = _class_dim(input)
    hint = ""
    if input.ndim > 2 and any(p.is_shard(input.ndim - 1) for p in input.placements):
        hint = (
            " (batch, seq, vocab) logits sharded on the vocabulary are passed as "
            "logits.flatten(0, 1) with labels.flatten(), or as logits.transpose(1, 2): "
            "F.cross_entropy's class dimension is 1."
        )
    raise ValueError(
        "loss_parallel(): expected logits sharded on the class dimension, "
        f"Shard({class_dim}) on one mesh dimension (dimension {class_dim} of logits of shape "
        f"{tuple(input.shape)}, as ColwiseParallel(output_layouts=Shard(-1), "
        "use_local_output=False) gives (tokens, vocab) logits); found a DTensor with "
        f"placements {tuple(input.placements)} on {input.device_mesh}.{hint} Logits not "
        "sharded on the classes are left to DTensor's own cross_entropy, which cannot mix "
        f"them with a plain-tensor {' and '.join(plain)} (pass it as a DTensor to compute the "
        "loss that way, without loss parallelism)"
    )


_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)


class _LossParallelMode(TorchFunctionMode):
    """Routes ``F.cross_entropy`` on class-sharded DTensor logits to the parallel loss.

    A :class:`TorchFunctionMode` sees every call of a torch function made while it is
    active, before any dispatch; this one acts on one function with one kind of input and
    hands every other call back unchanged (while a mode's ``__torch_function__`` runs, the
    mode is off, so ``func(*args, **kwargs)`` is the ordinary call).
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        input = args[0] if args else kwargs.get("input")
        # bind the arguments only for the one call this mode looks into
        if func is F.cross_entropy and isinstance(input, DTensor):
            bound = _CROSS_ENTROPY_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if not _class_mesh_dims(input):
                _check_unsharded_classes(input, a["target"], a["weight"])
                return func(*args, **kwargs)
            reduction = a["reduction"]
            if a["size_average"] is not None or a["reduce"] is not None:
                # F.cross_entropy's deprecated arguments, mapped as it maps them
                reduction = compat.legacy_reduction(a["size_average"], a["reduce"], False)
            return _dtensor_cross_entropy(
                input,
                a["target"],
                a["weight"],
                a["ignore_index"],
                reduction,
                a["label_smoothing"],
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross-entropy on logits sharded on the class dimension without gathering them.

    A drop-in for ``torch.distributed.tensor.parallel.loss_parallel``. Inside the context,
    :func:`torch.nn.functional.cross_entropy` (and so :class:`torch.nn.CrossEntropyLoss`) on
    a :class:`DTensor` whose class dimension is sharded, as ``ColwiseParallel(
    output_layouts=Shard(-1), use_local_output=False)`` produces it, costs two all-reduces of
    one to three numbers per token and a backward with no communication, instead of
    gathering ``tokens x vocabulary`` logits. Every other call runs as it does outside the
    context. Language-model logits ``(batch, seq, vocab)`` are passed as
    ``logits.flatten(0, 1)`` with ``labels.flatten()``, exactly as without tensor
    parallelism. The loss is a :class:`DTensor`; ``loss.backward()`` may be called inside the
    context or after it.

    The arguments of ``F.cross_entropy`` it takes (``label_smoothing`` included), the
    layouts of logits and target (on N-D meshes too), the loss's placements and what differs
    from upstream are in the guide's "Options" and "Differences from upstream"
    (``docs/loss_parallel.md``).

    Returns:
        A context manager (it yields nothing).

    Raises:
        ValueError: inside the context, ``F.cross_entropy`` on logits sharded on the
            classes with a layout or target it cannot take, or on a DTensor not sharded on
            its class dimension with a plain-tensor ``target`` or ``weight`` (which DTensor
            cannot mix with it: the message names the layout expected and the one found).

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> import torch.nn.functional as F
        >>> from torch_tp import loss_parallel, parallelize_module
        >>> from torch_tp.plans.llama import llama_plan
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> model = parallelize_module(model, tp_mesh, llama_plan(loss_parallel=True))
        >>> logits = model(tokens)  # DTensor (batch, seq, vocab), Shard(-1)
        >>> with loss_parallel():
        ...     loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        ...     loss.backward()
    """
    with _LossParallelMode():
        yield
