"""Full state dicts: ordinary ``{name: tensor}`` dicts with the names and values of the
single-device model. :func:`full_state_dict` gathers one parameter at a time;
:func:`load_full_state_dict` loads from memory or from a ``safetensors`` file, each rank
reading only its own slices.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torch_tp._buffers import put_buffers, stale_buffers
from torch_tp._torch_compat import IncompatibleKeys
from torch_tp.checkpoint._staging import (
    CheckpointError,
    agree,
    agree_identity,
    check_keys,
    coordination_group,
    copy_staged,
    first_line,
    full_tensor,
    global_rank,
    is_distributed,
    load_failed,
    local_pieces,
    meta_error,
    model_tensors,
    raise_if_error,
    refuse_nested_packed,
    run_coordinated,
    single_device_name,
    stage_local,
)
from torch_tp.checkpoint.safetensors import StateDictSource

__all__ = ["full_state_dict", "load_full_state_dict"]

# ------------------------------------------------------------------------------------------
# Full state dicts
# ------------------------------------------------------------------------------------------


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = True
) -> dict[str, Tensor]:
    """Gather the state of a TP or 2-D model into an ordinary, single-device state dict.

    The names are those of the single-device model (what ``model.state_dict()`` would give
    before parallelization) and the values are whole tensors. Parameters are gathered one
    at a time (an all-gather each): a rank holds at most one gathered tensor beyond what it
    returns, so a rank that returns nothing (``rank0_only``) never holds more than one whole
    parameter (the all-gather stages it through a second buffer of its size). Must be
    called on every rank.

    Args:
        model (:class:`nn.Module`): the model, parallelized by
            :func:`torch_tp.parallelize_module` and possibly sharded by FSDP2 on top.

    Keyword Args:
        rank0_only (bool, optional): return the full dict on global rank 0 only and an
            empty dict elsewhere. Default: ``False`` (every rank gets it).
        cpu_offload (bool, optional): move every gathered tensor to the CPU as soon as it is
            gathered. Default: ``True``.

    Returns:
        ``{name: tensor}`` with plain (not DTensor) tensors, or ``{}`` on ranks other than 0
        with ``rank0_only``.

    Raises:
        NotImplementedError: a packed parameter whose packed dim FSDP2 shards too (see the
            module docstring); raised on every rank before anything is gathered.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> state = torch_tp.checkpoint.full_state_dict(model, rank0_only=True)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(state, "model.safetensors")
    """
    keep = not rank0_only or global_rank() == 0
    out: dict[str, Tensor] = {}
    state = model_tensors(model)  # hosted adapters' DTensors too: gathered one at a time
    refuse_nested_packed(state)
    # agreed before any gather (it must be called on every rank): one rank's model on the
    # meta device fails every rank alike
    error = meta_error(model, "full_state_dict")
    if is_distributed() and any(isinstance(t, DTensor) for t in state.values()):
        agree(error, lambda cause: f"full_state_dict failed: {cause}")
    else:
        raise_if_error(error)
    for name, value in state.items():
        if isinstance(value, DTensor):
            value = full_tensor(value)  # a collective: every rank, in the same order
        if not keep:
            continue
        if isinstance(value, Tensor):
            value = value.detach()
            if cpu_offload:
                value = value.cpu()
        out[single_device_name(name)] = value
    return out


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Tensor] | str | os.PathLike | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> IncompatibleKeys:
    """Load a full (single-device) state dict into a TP or 2-D model, all or nothing.

    Each rank copies only its own slice of each tensor into its shard, from a
    ``safetensors`` file (every rank reads only its slices), from a dict every rank holds
    (sliced locally), or from a dict rank 0 alone holds (``broadcast_from_rank0``). Names,
    global shapes and dtypes are checked first, every rank stages its slices, and the model
    changes only once every rank has read everything: any failure raises on every rank and
    leaves the model bit-identical. Values are converted to each parameter's dtype, with
    one warning per call naming the keys a conversion may change. The model may have been
    built on the meta device and given memory by :func:`torch_tp.materialize`. A model
    holding DTensors must be loaded on every rank, each given the same state dict (the
    ranks compare a fingerprint of it). See the guide's "Full state dicts" and "Meta-device
    initialisation, then a checkpoint" (``docs/two_d_and_checkpoints.md``).

    Args:
        model (:class:`nn.Module`): the parallelized model (and possibly FSDP2-sharded).
        state_dict (Mapping[str, Tensor] or str or os.PathLike or None): the full state
            dict, or the path of a ``.safetensors`` file; ``None`` on ranks other than 0 with
            ``broadcast_from_rank0``.

    Keyword Args:
        strict (bool, optional): raise for missing and unexpected keys, as
            :meth:`nn.Module.load_state_dict` does. Default: ``True``.
        broadcast_from_rank0 (bool, optional): only global rank 0 holds ``state_dict``
            (in memory, or a file only rank 0 can read); it sends one tensor at a time.
            Default: ``False``.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``, as
        :meth:`nn.Module.load_state_dict` returns.

    Raises:
        CheckpointError: missing or unexpected keys (with ``strict``), shape mismatches,
            dtypes that cannot be read or converted, a file that is not a readable
            ``safetensors`` file, or a read that failed; the message names the file and
            every offending key, or the ranks were given different state dicts. It derives
            from ``RuntimeError``.
        TypeError: ``state_dict`` is neither a mapping nor a path, or holds non-tensors.
        FileNotFoundError: ``state_dict`` is a path with no file.
        NotImplementedError: a parameter whose local shard is not one block of the whole
            tensor (e.g. ``Partial``), or a packed parameter whose packed dim FSDP2 shards
            too (other packed parameters load exactly, one block per part).
        ValueError: the model has tensors on the meta device, or non-persistent buffers
            left uninitialised by ``to_empty`` that cannot be computed again (named; on
            every rank). Those that can be (rotary tables) are computed again, as
            :func:`torch_tp.materialize` does, with a warning.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch.device("meta"):
        ...     model = Llama(config)
        >>> parallelize_module(model, mesh["tp"], llama_plan())
        >>> torch_tp.materialize(model)
        >>> torch_tp.checkpoint.load_full_state_dict(model, "llama.safetensors")
    """
    # the model's own tensors, hosted adapters' DTensors included: what the load copies into
    targets = {single_device_name(k): v for k, v in model_tensors(model).items()}
    refuse_nested_packed(targets)  # on every rank, before any communication
    if broadcast_from_rank0:
        result, staged, buffers = _stage_broadcast(model, targets, state_dict, strict)
    else:
        result, staged, buffers, error, identity = None, {}, [], None, ""
        agreed = is_distributed() and any(isinstance(t, DTensor) for t in targets.values())
        try:
            raise_if_error(meta_error(model, "load_full_state_dict"))  # before reading anything
            buffers = stale_buffers(model, "load_full_state_dict")  # to_empty()'s garbage
            source = StateDictSource(state_dict)
            result = check_keys(model, targets, source, strict)
            if agreed:
                identity = source.identity()
            staged = stage_local(source, targets, result)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
        if agreed:
            agree(error, load_failed("loading a full state dict"))
            # every rank slices the same tensors: a different file or dict on some rank
            # would load a mixture of two models
            agree_identity(identity, source.description)
        elif error is not None:
            raise error
    copy_staged(targets, staged)
    put_buffers(buffers)
    return result


def _stage_broadcast(
    model: nn.Module,
    targets: dict[str, Tensor],
    state_dict: Mapping[str, Tensor] | str | os.PathLike | None,
    strict: bool,
) -> tuple[IncompatibleKeys, dict[str, Tensor], list[tuple[Tensor, Tensor]]]:
    rank = global_rank()
    what = "loading a full state dict broadcast from rank 0"
    # rank 0 opens and checks the source; every rank checks its model; every rank then
    # raises the same error, or none does (one small collective)
    error, verdict, buffers = None, None, []
    try:
        raise_if_error(meta_error(model, "load_full_state_dict"))
        buffers = stale_buffers(model, "load_full_state_dict")  # on every rank: its own model
        if rank == 0:
            source = StateDictSource(state_dict)
            verdict = tuple(check_keys(model, targets, source, strict))
    except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = exc
    # the broadcasts below follow each rank's own names: they must be the same everywhere
    layout = hashlib.sha256(
        repr([(k, tuple(v.shape), str(v.dtype)) for k, v in targets.items()]).encode()
    ).hexdigest()
    values = agree(error, load_failed(what), value=(layout, verdict))
    differ = [r for r, (other, _) in enumerate(values) if other != values[0][0]]
    if differ:
        raise CheckpointError(
            load_failed(what)(
                f"the model's names, shapes or dtypes on rank(s) {differ} differ from rank 0's"
            )
        )
    result = IncompatibleKeys(*values[0][1])
    present = set(targets) - set(result.missing_keys)
    # Rank 0 reads and broadcasts one whole tensor at a time. A read that fails on rank 0
    # must not leave the others waiting in a broadcast: rank 0 keeps the protocol going
    # (broadcasting empty buffers) and the failure is agreed on at the end.
    error: Exception | None = None
    staged: dict[str, Tensor] = {}
    for name, target in targets.items():
        if name not in present:
            continue
        local = target.to_local() if isinstance(target, DTensor) else target
        full = None
        if rank == 0 and error is None:
            try:
                full = source.read(name).to(device=local.device, dtype=local.dtype)
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = CheckpointError(
                    f"could not read {name!r} from {source.description}: {first_line(exc)}. "
                    "The model is unchanged."
                )
        if full is None:
            full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
        if is_distributed():
            # one whole tensor at a time
            # gloo moves CPU tensors
            group = coordination_group() if full.device.type == "cpu" else None
            run_coordinated(dist.broadcast, full, src=0, group=group, failed=load_failed(what))
        buffer = torch.empty_like(local)
        if isinstance(target, DTensor):
            for whole, mine in local_pieces(name, target):
                buffer[mine].copy_(full[whole])
        else:
            buffer.copy_(full)
        staged[name] = buffer
        del full
    if is_distributed():
        agree(error, load_failed(what))
    elif error is not None:
        raise error
    return result, staged, buffers
