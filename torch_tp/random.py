"""Random numbers under tensor parallelism: the RNG tracker and sequence-parallel dropout.

A tensor-parallel job draws random numbers from two streams:

* The **default stream**, the default generator of the mesh's device type
  (``torch.default_generator`` on CPU, the current device's generator on CUDA). It is seeded
  identically on every rank, so a random op on a replicated activation (a dropout outside the
  plan, or after a ``RowwiseParallel`` that returns ``Replicate()``) draws the same mask on
  every rank, the mask a single-device run draws from the same seed.
* The **tensor-parallel stream**, a separate generator seeded differently on each rank of the
  tensor-parallel group (and identically on ranks that hold the same shard, e.g. the same
  ``tp`` coordinate of a ``("dp", "tp")`` mesh). Random ops inside
  ``with get_rng_tracker().fork():`` draw from it: use it for a dropout on a sharded
  activation whose shards must get independent masks (Megatron's "model-parallel RNG").

Sequence-parallel dropout (:func:`sequence_parallel_dropout`) is neither: it draws the full
mask from the default stream, exactly as the single-device dropout would, and keeps this
rank's slice, so a sequence-parallel model trains bit for bit like the single-device one.

The seeds: :func:`manual_seed` with ``seed`` seeds the default stream with ``seed`` and the
tensor-parallel stream of TP rank ``r`` with ``seed + 2718 + r`` (modulo ``2**64``).
:func:`torch_tp.parallelize_module` installs a tracker when none is, seeded the same way
from the seed the default generator was last seeded with (``torch.initial_seed()`` on CPU),
without reseeding the default generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_tp import _torch_compat as compat
from torch_tp.runtime import chunk_range, raise_agreed

__all__ = [
    "TensorParallelRNGTracker",
    "checkpoint_contexts",
    "fork",
    "get_rng_tracker",
    "manual_seed",
    "sequence_parallel_dropout",
    "set_rng_tracker",
]

# The tensor-parallel stream of TP rank r is seeded with seed + _TP_SEED_OFFSET + r. Any offset
# works as long as it keeps the stream apart from the default one; Megatron's is 2718.
_TP_SEED_OFFSET = 2718
_SEED_MODULUS = 2**64

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


class TensorParallelRNGTracker:
    """The tensor-parallel random stream of this rank, and the switch to draw from it.

    The tracker owns a :class:`torch.Generator` of the mesh's device type, seeded with
    ``seed + 2718 + tp_rank`` (modulo ``2**64``). Inside :meth:`fork` that generator's state
    stands in for the default generator's, so every random op draws from the
    tensor-parallel stream; on exit both streams continue where they were. Building a
    tracker does not touch the default generator; :func:`manual_seed` seeds both and installs
    the tracker, and :func:`torch_tp.parallelize_module` installs one when none is.

    Args:
        device_mesh (:class:`DeviceMesh`): the tensor-parallel mesh (1-D), or an N-D mesh
            with a dimension named ``"tp"``.
        seed (int): the base seed; this rank's stream is seeded with
            ``seed + 2718 + tp_rank``.

    Attributes:
        device_type (str): the mesh's device type (``"cpu"``, ``"cuda"``, ...).
        tp_rank (int): this rank's coordinate on the tensor-parallel dimension (under
            ``LocalTensorMode``, a :class:`torch.SymInt` with one value per simulated rank).
        seed (int): the base seed.
        generator (:class:`torch.Generator`): the tensor-parallel stream; outside
            :meth:`fork` it may also be passed to random ops directly
            (``torch.rand(..., generator=tracker.generator)``).

    Raises:
        TypeError: ``device_mesh`` is not a :class:`DeviceMesh` or ``seed`` not an int.
        ValueError: an N-D mesh has no ``"tp"`` dimension, or this rank is not in the mesh.

    .. note:: Built under ``torch.distributed._local_tensor.LocalTensorMode`` (one process
        simulating every rank, as PyTorch's own distributed tests do), the tracker keeps one
        stream per simulated rank, seeded as on a real rank, and :meth:`fork` switches every
        simulated rank to its own stream; use it inside that mode only. There
        :attr:`generator` is not the stream, and :meth:`state_dict` and
        :meth:`load_state_dict` are not supported.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> tracker = torch_tp.random.manual_seed(0, tp_mesh)
        >>> h = column_parallel_linear(x)  # each rank holds different columns
        >>> with tracker.fork():  # so each rank draws its own mask
        ...     h = F.dropout(h, 0.1, training=True)
    """

    def __init__(self, device_mesh: DeviceMesh, seed: int) -> None:
        _check_seed(seed)
        tp_mesh = _tp_mesh(device_mesh)
        self.device_type: str = tp_mesh.device_type
        self.tp_rank: int = tp_mesh.get_local_rank()
        self.tp_size: int = tp_mesh.size()
        self.seed: int = seed
        self.generator = torch.Generator(device=self.device_type)
        # Under LocalTensorMode the rank is a SymInt, one value per simulated rank: each
        # simulated rank gets its own stream, kept here as generator states by global rank
        self._simulated: dict[int, Tensor] | None = None
        if isinstance(self.tp_rank, int):
            self.generator.manual_seed(self._rank_seed(self.tp_rank))
        else:
            mode = _simulation(self.device_type)
            self._simulated = {
                rank: self.generator.manual_seed(self._rank_seed(tp_rank)).get_state()
                for rank, tp_rank in _by_simulated_rank(self.tp_rank, mode.ranks).items()
            }
        # which TP group this stream belongs to, to tell a stale tracker from a fitting one
        self._group = _group_of(tp_mesh)
        # the mesh as given (N-D, or the TP mesh): the layout a saved state of this tracker
        # belongs to, which torch_tp.checkpoint.load compares before it restores one
        self._mesh = device_mesh
        self._depth = 0  # fork() nesting: only the outermost fork swaps states
        self._installed_by_user = False

    def _rank_seed(self, tp_rank: int) -> int:
        return (self.seed + _TP_SEED_OFFSET + tp_rank) % _SEED_MODULUS

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device_type={self.device_type!r}, tp_rank={self.tp_rank}, "
            f"seed={self.seed})"
        )

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from the tensor-parallel stream inside the ``with`` block.

        The default generator of the mesh's device type takes the tensor-parallel stream's
        state on entry; on exit the tensor-parallel stream keeps the state it reached and the
        default generator gets back exactly the state it had, as if the block had drawn
        nothing. A nested ``fork()`` is a no-op (the stream is already in use). Only the
        mesh's device type is forked: on a CUDA mesh, CPU random ops still use the CPU
        default generator.

        Example::
            >>> # xdoctest: +SKIP("distributed")
            >>> with torch_tp.random.get_rng_tracker().fork():
            ...     local_heads = F.dropout(local_heads, 0.1, training=True)
        """
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        if self._simulated is not None:
            with self._fork_simulated():
                yield
            return
        default = _default_generator(self.device_type)
        outer = default.get_state()
        default.set_state(self.generator.get_state())
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self.generator.set_state(default.get_state())
            default.set_state(outer)

    @contextlib.contextmanager
    def _fork_simulated(self) -> Iterator[None]:
        """:meth:`fork` under LocalTensorMode: the same swap, on every simulated rank."""
        states = compat.per_rank_rng_states(_simulation(self.device_type))
        outer = {rank: states[rank] for rank in self._simulated}
        for rank, state in self._simulated.items():
            states[rank] = (state, *states[rank][1:])
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for rank, state in outer.items():
                self._simulated[rank] = states[rank][0]
                states[rank] = state

    def state_dict(self) -> dict[str, Any]:
        """Both streams of this rank, to save with a checkpoint.

        The tensor-parallel stream differs between TP ranks, so save one state dict per rank
        (e.g. ``torch.save(tracker.state_dict(), f"rng_{rank}.pt")``).

        Returns:
            A dict with the base ``seed``, ``tp_rank``, ``device_type`` and the two generator
            states, ``tp_state`` and ``default_state`` (CPU byte tensors).

        Raises:
            RuntimeError: called inside :meth:`fork`, where the default generator holds the
                tensor-parallel stream.

        Example::
            >>> # xdoctest: +SKIP("distributed")
            >>> state = torch_tp.random.get_rng_tracker().state_dict()
            >>> torch.save(state, f"rng_{dist.get_rank()}.pt")
        """
        self._check_not_forked("state_dict")
        self._check_not_simulated("state_dict")
        return {
            "seed": self.seed,
            "tp_rank": self.tp_rank,
            "device_type": self.device_type,
            "tp_state": self.generator.get_state(),
            "default_state": _default_generator(self.device_type).get_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore both streams from :meth:`state_dict`; the next draws repeat the saved ones.

        Args:
            state_dict (dict): what :meth:`state_dict` returned on this TP rank.

        Raises:
            KeyError: a key is missing.
            ValueError: the state was saved on another TP rank or device type.
            RuntimeError: called inside :meth:`fork`.

        Example::
            >>> # xdoctest: +SKIP("distributed")
            >>> tracker = torch_tp.random.manual_seed(0, tp_mesh)
            >>> tracker.load_state_dict(torch.load(f"rng_{dist.get_rank()}.pt"))
        """
        self._check_not_forked("load_state_dict")
        self._check_not_simulated("load_state_dict")
        for key, mine in (("device_type", self.device_type), ("tp_rank", self.tp_rank)):
            if state_dict[key] != mine:
                raise ValueError(
                    f"the RNG state was saved with {key}={state_dict[key]!r}, this tracker "
                    f"has {key}={mine!r}: load each rank's own state"
                )
        self.generator.set_state(state_dict["tp_state"])
        _default_generator(self.device_type).set_state(state_dict["default_state"])
        self.seed = state_dict["seed"]

    def _live_state(self) -> Tensor | dict[int, Tensor]:
        """The tensor-parallel stream's current state (inside a fork it is the default's);
        under LocalTensorMode, the states by simulated rank."""
        if self._simulated is not None:
            if not self._depth:
                return dict(self._simulated)
            states = compat.per_rank_rng_states(_simulation(self.device_type))
            return {rank: states[rank][0] for rank in self._simulated}
        if self._depth:
            return _default_generator(self.device_type).get_state()
        return self.generator.get_state()

    def _stream_state(self) -> Tensor | dict[int, Tensor]:
        if self._simulated is not None:
            return dict(self._simulated)
        return self.generator.get_state()

    def _set_stream_state(self, state: Tensor | dict[int, Tensor]) -> None:
        if self._simulated is not None:
            self._simulated = dict(state)
        else:
            self.generator.set_state(state)

    def _fits(self, tp_mesh: DeviceMesh, seed: int) -> bool:
        return self._group == _group_of(tp_mesh) and self.seed == seed

    def _check_not_forked(self, what: str) -> None:
        if self._depth:
            raise RuntimeError(f"{type(self).__name__}.{what}() cannot be called inside fork()")

    def _check_not_simulated(self, what: str) -> None:
        if self._simulated is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.{what}() is not supported for a tracker built under "
                "LocalTensorMode (one stream per simulated rank)"
            )


_tracker: TensorParallelRNGTracker | None = None


def get_rng_tracker() -> TensorParallelRNGTracker | None:
    """The active tensor-parallel RNG tracker, or ``None`` when none is installed.

    :func:`manual_seed` and :func:`torch_tp.parallelize_module` install one. Code that must
    also run without tensor parallelism can use :func:`fork`, which is a no-op then.

    Returns:
        The active :class:`TensorParallelRNGTracker`, or ``None``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> torch_tp.random.manual_seed(0, tp_mesh)
        >>> torch_tp.random.get_rng_tracker()
        TensorParallelRNGTracker(device_type='cuda', tp_rank=3, seed=0)
    """
    return _tracker


def set_rng_tracker(
    tracker: TensorParallelRNGTracker | None,
) -> TensorParallelRNGTracker | None:
    """Install ``tracker`` as the active one (``None`` uninstalls); return the previous one.

    A tracker installed this way counts as chosen by the user:
    :func:`torch_tp.parallelize_module` keeps it.

    Args:
        tracker (TensorParallelRNGTracker, optional): the tracker to install, or ``None``.

    Returns:
        The tracker that was active before, or ``None``.

    Raises:
        TypeError: ``tracker`` is neither a tracker nor ``None``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> previous = torch_tp.random.set_rng_tracker(None)  # back to a clean slate
    """
    global _tracker
    if tracker is not None and not isinstance(tracker, TensorParallelRNGTracker):
        raise TypeError(f"expected a TensorParallelRNGTracker or None, found {type(tracker)}")
    previous, _tracker = _tracker, tracker
    if tracker is not None:
        tracker._installed_by_user = True
    return previous


def manual_seed(seed: int, device_mesh: DeviceMesh) -> TensorParallelRNGTracker:
    """Seed both random streams of a tensor-parallel job and install the tracker.

    The default generator of the mesh's device type is seeded with ``seed``
    (:func:`torch.manual_seed` on CPU, the current device's generator on CUDA), and the
    tensor-parallel stream of TP rank ``r`` with ``seed + 2718 + r`` (modulo ``2**64``).
    Call it on every rank. The ranks of a tensor-parallel group must pass the same ``seed``
    (this is checked with one all-gather): the replicated regions rely on their default
    streams being identical. Ranks of different data-parallel replicas may pass different
    seeds (e.g. ``seed + dp_rank``) to draw different masks.

    Args:
        seed (int): the seed, in ``[-2**63, 2**64)`` as for :func:`torch.manual_seed`.
        device_mesh (:class:`DeviceMesh`): the tensor-parallel mesh (1-D), or an N-D mesh
            with a dimension named ``"tp"``.

    Returns:
        The installed :class:`TensorParallelRNGTracker`.

    Raises:
        TypeError: ``seed`` is not an int or ``device_mesh`` not a :class:`DeviceMesh`.
        ValueError: the ranks of the tensor-parallel group passed different seeds, an N-D
            mesh has no ``"tp"`` dimension, or this rank is not in the mesh.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> torch_tp.random.manual_seed(1234, mesh)  # before building the model
        >>> model = parallelize_module(Llama(config), mesh["tp"], llama_plan())
    """
    _check_same_seed(seed, _tp_mesh(device_mesh))
    tracker = TensorParallelRNGTracker(device_mesh, seed)
    if tracker.device_type == "cpu":
        torch.manual_seed(seed)
    else:
        _default_generator(tracker.device_type).manual_seed(seed)
    set_rng_tracker(tracker)
    return tracker


def fork() -> AbstractContextManager[None]:
    """The active tracker's :meth:`~TensorParallelRNGTracker.fork`, or a no-op without one.

    For model code that runs both with tensor parallelism and on a single device.

    Returns:
        A context manager.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> with torch_tp.random.fork():
        ...     local_heads = F.dropout(local_heads, 0.1, training=self.training)
    """
    tracker = _tracker
    return contextlib.nullcontext() if tracker is None else tracker.fork()


def checkpoint_contexts(
    context_fn: ContextFn | None = None,
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """Context managers that make activation checkpointing replay the tensor-parallel stream.

    :func:`torch.utils.checkpoint.checkpoint` restores the default generators before it
    recomputes a region, so replicated and sequence-parallel dropouts repeat their masks.
    It knows nothing of the tensor-parallel stream: without help, a ``fork()`` region would
    draw new masks during recomputation and the gradients would be wrong. Pass this function
    as ``context_fn`` (non-reentrant checkpointing only): the forward context records the
    tensor-parallel stream's state when the region starts, the recompute context replays
    from it and afterwards puts the stream back where it was, so the next steps draw exactly
    what they would without checkpointing.

    Args:
        context_fn (Callable, optional): another ``context_fn`` to combine with (e.g.
            selective checkpointing's); its contexts are entered inside these. Bind it with
            :func:`functools.partial`. Default: none.

    Returns:
        ``(forward_context, recompute_context)``; without an active tracker, those of
        ``context_fn`` (or two no-op contexts).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch.utils.checkpoint import checkpoint
        >>> out = checkpoint(
        ...     block, x, use_reentrant=False, context_fn=torch_tp.random.checkpoint_contexts
        ... )

    .. note:: Under ``torch.compile`` checkpointing accepts only ``TorchDispatchMode``
        contexts, which these are not; compile the blocks inside the checkpoint instead.
    """
    if context_fn is None:
        inner_forward, inner_recompute = contextlib.nullcontext(), contextlib.nullcontext()
    else:
        inner_forward, inner_recompute = context_fn()
    tracker = _tracker
    if tracker is None:
        return inner_forward, inner_recompute
    recorded: list[Tensor | dict[int, Tensor]] = []
    return (
        _record_stream(tracker, recorded, inner_forward),
        _replay_stream(tracker, recorded, inner_recompute),
    )


@contextlib.contextmanager
def _record_stream(
    tracker: TensorParallelRNGTracker,
    recorded: list[Tensor | dict[int, Tensor]],
    inner: AbstractContextManager,
) -> Iterator[None]:
    recorded[:] = [tracker._live_state()]
    with inner:
        yield


@contextlib.contextmanager
def _replay_stream(
    tracker: TensorParallelRNGTracker,
    recorded: list[Tensor | dict[int, Tensor]],
    inner: AbstractContextManager,
) -> Iterator[None]:
    current = tracker._stream_state()
    tracker._set_stream_state(recorded[0])
    try:
        with inner:
            yield
    finally:
        tracker._set_stream_state(current)


def sequence_parallel_dropout(
    input: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    device_mesh: DeviceMesh | None = None,
    sequence_dim: int = 1,
    global_shape: Sequence[int] | None = None,
) -> Tensor:
    """Dropout on a sequence shard that equals the single-device dropout's slice, bit for bit.

    The full mask is drawn from the default generator with exactly the call and the shape
    the single-device :func:`torch.nn.functional.dropout` uses (every rank of the
    tensor-parallel group holds the same default state, so every rank draws the same full
    mask and consumes the stream as the single-device model does); each rank keeps the
    slice of its shard (the :func:`torch.chunk` layout of DTensor's ``Shard``) and multiplies
    it into its local input. Forward and backward then equal the slice of the single-device
    results bit for bit, on CPU as on CUDA. The full mask is transient; only the local slice
    is kept for the backward.

    The input is either a :class:`DTensor` on a 1-D mesh, sharded on the sequence dimension
    (``Shard(d)``; ``Replicate()`` and ``Partial()`` get the full mask) and returned as one
    with the same layout, or this rank's local shard, with ``device_mesh`` and
    ``sequence_dim`` (and ``global_shape`` when shards are uneven).

    Args:
        input (Tensor): the sequence-sharded activation.
        p (float, optional): the probability of an element being zeroed. Default: 0.5.
        training (bool, optional): apply dropout if ``True``; otherwise return ``input``.
            Default: ``True``.
        inplace (bool, optional): multiply a local ``input`` in place (a DTensor input is
            never modified). Default: ``False``.

    Keyword Args:
        device_mesh (:class:`DeviceMesh`, optional): the tensor-parallel mesh of a local
            ``input`` (1-D, or N-D with a ``"tp"`` dimension). Ignored for a DTensor.
        sequence_dim (int, optional): the sharded dimension of a local ``input``. Default: 1.
        global_shape (Sequence[int], optional): the shape of the full activation, for a local
            ``input``. Default: ``input``'s shape with ``sequence_dim`` times the mesh size.

    Returns:
        The local result for a local ``input``, a DTensor with ``input``'s layout for a
        DTensor.

    Raises:
        ValueError: ``p`` is not in ``[0, 1]``, no ``device_mesh`` for a local input, or the
            local shape does not fit ``global_shape`` on this rank.
        NotImplementedError: a DTensor on an N-D mesh or with another placement.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> torch.manual_seed(0)  # or torch_tp.random.manual_seed(0, tp_mesh)
        >>> # this rank's (batch, seq / tp, dim) shard of a (batch, seq, dim) activation
        >>> y = sequence_parallel_dropout(x_local, 0.1, device_mesh=tp_mesh, sequence_dim=1)

    .. note:: The single-device mask follows the memory order of the full activation; this
        function assumes it is contiguous (as the output of a Linear is).
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if isinstance(input, DTensor):
        return _dropout_dtensor(input, p)
    if device_mesh is None:
        raise ValueError("a local input needs the device_mesh it is sharded over")
    mesh = _tp_mesh(device_mesh)
    dim = sequence_dim + input.ndim if sequence_dim < 0 else sequence_dim
    if not 0 <= dim < input.ndim:
        raise ValueError(f"sequence_dim {sequence_dim} is out of range for a {input.ndim}-D input")
    if global_shape is None:
        full = list(input.shape)
        full[dim] *= mesh.size()
    else:
        full = list(global_shape)
    return _dropout_shard(input, p, full, dim, mesh.get_local_rank(), mesh.size(), inplace)


def _dropout_dtensor(input: DTensor, p: float) -> DTensor:
    mesh, (placement,) = input.device_mesh, input.placements
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"sequence_parallel_dropout takes a DTensor on a 1-D mesh, found a {mesh.ndim}-D "
            f"mesh with placements {input.placements}"
        )
    local = input.to_local()
    if type(placement) is Shard:
        rank, size, dim = mesh.get_local_rank(), mesh.size(), placement.dim % input.ndim
        out = _dropout_shard(local, p, list(input.shape), dim, rank, size, False)
    elif isinstance(placement, (Replicate, Partial)):
        # every rank holds the whole tensor (or a summand of it, and dropout is linear)
        out = _dropout_shard(local, p, list(input.shape), 0, 0, 1, False)
    else:
        raise NotImplementedError(
            f"sequence_parallel_dropout supports Shard, Replicate and Partial, found {placement}"
        )
    return DTensor.from_local(
        out, mesh, input.placements, run_check=False, shape=input.shape, stride=input.stride()
    )


def _dropout_shard(
    local: Tensor, p: float, full_shape: list[int], dim: int, rank: int, size: int, inplace: bool
) -> Tensor:
    start, stop = chunk_range(full_shape[dim], size, rank)
    expected = [*full_shape[:dim], stop - start, *full_shape[dim + 1 :]]
    if list(local.shape) != expected:
        raise ValueError(
            f"the local input of shape {list(local.shape)} is not shard {rank} of {size} of a "
            f"{full_shape} tensor on dim {dim}, which has shape {expected}"
        )
    # Dropout on ones, with the single-device call itself: the same kernel, shape, dtype and
    # device draw the same mask from the same generator state, consuming the same amount of
    # it, and 1 * scale is exact, so the result is the single-device noise bit for bit (on
    # CPU: bernoulli_(1 - p), then div_(1 - p)).
    ones = torch.ones(full_shape, dtype=local.dtype, device=local.device)
    noise = F.dropout(ones, p, training=True, inplace=True)
    # a copy, so the backward keeps only this rank's slice alive, not the full mask
    noise = noise.narrow(dim, start, stop - start).clone()
    return local.mul_(noise) if inplace else local * noise


def _ensure_tracker(device_mesh: DeviceMesh) -> TensorParallelRNGTracker | None:
    """Install a tracker for ``device_mesh`` unless a fitting one is active; return the active one.

    :func:`torch_tp.parallelize_module` calls it. A tracker the user installed
    (:func:`manual_seed`, :func:`set_rng_tracker`) is always kept. Otherwise the
    tensor-parallel stream is derived from the seed the default generator was last seeded
    with, so ``torch.manual_seed(s)`` followed by ``parallelize_module`` gives the same
    tensor-parallel stream as ``torch_tp.random.manual_seed(s, mesh)``. The default generator
    itself is never reseeded: single-device parity depends on the user's seed. An installed
    tracker is kept while it fits (same group, same seed), so parallelizing a second model
    continues the stream rather than restarting it. A rank outside the mesh gets nothing.
    """
    global _tracker
    if device_mesh.get_coordinate() is None:
        return _tracker
    tp_mesh = _tp_mesh(device_mesh)
    seed = _default_generator(tp_mesh.device_type).initial_seed()
    tracker = _tracker
    if tracker is not None and (tracker._installed_by_user or tracker._fits(tp_mesh, seed)):
        return tracker
    _tracker = TensorParallelRNGTracker(tp_mesh, seed)
    return _tracker


def _tp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, found {type(device_mesh)}")
    if device_mesh.ndim != 1:
        names = device_mesh.mesh_dim_names or ()
        if "tp" not in names:
            raise ValueError(
                f"expected the tensor-parallel mesh (1-D) or a mesh with a dimension named "
                f"'tp', found a {device_mesh.ndim}-D mesh with dims {names or None}"
            )
        device_mesh = device_mesh["tp"]
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the mesh {device_mesh}")
    return device_mesh


def _group_of(tp_mesh: DeviceMesh) -> tuple[str, tuple[int, ...]]:
    """The device type and global ranks of a tensor-parallel group, to tell one from another.

    Read with inference mode off: inside ``torch.inference_mode()`` (a model parallelized for
    inference, as upstream's ``test_mlp_inference`` does) the mesh tensor of a mesh built
    outside it is recomputed as a view, which a LocalTensor (a mesh built under
    ``LocalTensorMode``) cannot be inside inference mode. The result is plain ints either way.
    """
    with torch.inference_mode(False):
        return tp_mesh.device_type, tuple(tp_mesh.mesh.flatten().tolist())


def _default_generator(device_type: str) -> torch.Generator:
    """The generator that random ops on ``device_type`` use when given none."""
    if device_type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device_type)
    compat.lazy_init(module)  # default_generators fills in lazily
    generators = getattr(module, "default_generators", ())
    if not generators:
        raise NotImplementedError(f"no default generator found for device type {device_type!r}")
    return generators[module.current_device()]


# LocalTensorMode (torch.distributed._local_tensor, private torch API) simulates every rank in
# one process: the three functions below are the only places that reach into it.


def _simulation(device_type: str) -> Any:
    """The enabled LocalTensorMode, for a tracker built under it.

    Raises:
        RuntimeError: no LocalTensorMode is enabled (the tracker was built under one).
        NotImplementedError: the mode keeps no per-rank random states (under a fake tensor
            mode), or ``device_type`` is not CPU.
    """
    mode = compat.enabled_local_tensor_mode()
    if mode is None:
        raise RuntimeError(
            "this tracker was built under LocalTensorMode (its rank is per simulated rank): "
            "use it inside that mode only"
        )
    if device_type != "cpu" or not compat.per_rank_rng_states(mode):
        raise NotImplementedError(
            f"the RNG tracker supports LocalTensorMode on CPU meshes with per-rank random "
            f"states only, found a {device_type!r} mesh"
        )
    return mode


def _by_simulated_rank(value: Any, ranks: frozenset[int]) -> dict[int, int]:
    """An int that LocalTensorMode made per simulated rank (a SymInt), by global rank."""
    node = value.node
    per_rank = compat.per_rank_ints(node)  # LocalIntNode; a ConstantIntNode has one value
    if per_rank is None:
        return dict.fromkeys(ranks, node.maybe_as_int())
    return {rank: per_rank[rank] for rank in ranks}


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, found {type(seed).__name__}")
    if not -(2**63) <= seed < _SEED_MODULUS:
        raise ValueError(f"seed must be in [-2**63, 2**64), found {seed}")


def _check_same_seed(seed: int, tp_mesh: DeviceMesh) -> None:
    """Raise on every rank unless every rank of the TP group passed the same valid seed.

    A seed one rank refuses (not an int, out of range) is agreed like a differing one, in
    the same all-gather: the rank's verdict travels with its seed, so no rank raises alone
    while the others wait in the gather."""
    try:
        _check_seed(seed)
        error = None
    except (TypeError, ValueError) as err:
        error = err
    if tp_mesh.size() == 1:
        if error is not None:
            raise error
        return
    as_int64 = 0
    if error is None:
        as_int64 = seed % _SEED_MODULUS
        as_int64 -= _SEED_MODULUS if as_int64 >= 2**63 else 0  # int64 holds the bits
    mine = torch.tensor([error is None, as_int64], dtype=torch.int64, device=tp_mesh.device_type)
    seeds = [torch.empty_like(mine) for _ in range(tp_mesh.size())]
    dist.all_gather(seeds, mine, group=tp_mesh.get_group())
    if not all(bool(s[0]) for s in seeds):
        raise_agreed(error, [tp_mesh.get_group()])
    found = [int(s[1].item()) % _SEED_MODULUS for s in seeds]
    if len(set(found)) != 1:
        raise ValueError(
            "the ranks of a tensor-parallel group must seed with the same value, found "
            f"seeds {found} (by TP rank): replicated activations would diverge"
        )
