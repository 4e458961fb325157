"""Ring attention: exact attention over a sequence split on a context-parallel (cp) group.

Each of the ``cp`` ranks of ``group`` holds ``S / cp`` of the sequence's tokens (queries, keys
and values alike). :func:`ring_attention` computes, for this rank's queries, the attention over
the whole sequence's keys and values: the key/value blocks of the other ranks come by, one per
step, each attended to with the causal mask of the true (global) positions, and the block
results are merged by the online-softmax rule (each block's output and log-sum-exp). The
backward recomputes each block's probabilities from the saved log-sum-exp, flash-attention
style, so nothing of another rank is saved. What users see (layouts, volumes, memory, what is
refused) is in the guide's "Context parallelism" (``docs/context_parallel.md``).

Layout (:func:`sequence_positions`): ``"contiguous"`` (rank ``r`` holds chunk ``r`` of ``cp``)
or ``"load_balanced"`` (chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``). Both keep each
rank's positions increasing, so a block's unmasked part is a suffix of the queries against a
prefix of the keys and the rest is skipped without compute (:func:`_block`, :func:`_mask`).

Rotation. ``"p2p"``: rank ``r`` sends to ``r + 1`` and receives from ``r - 1``
(``dist.batch_isend_irecv``), k and v packed in one buffer; the block of step ``i + 1`` is
posted before step ``i`` is computed, so one block is in flight beside the one in use. In the
backward the key/value blocks make the same trip again and their gradients (dk and dv packed,
in the accumulation dtype) travel with them, each rank adding its part, one hop more to come
home. ``"allgather"``: one all-gather of the packed (k, v) up front (overlapping the own
block's compute); the backward gathers again and returns the gradients by one reduce-scatter.
:func:`ring_volume` gives the messages and bytes of each; the report and the tests use it.

Agreement. A forward block carries one element more: its rank's verdict on its own call
(``refused``: the caller found it wrong, e.g. an attention mask the ring cannot follow on that
rank only). A rank that refused still sends and relays every block (so no peer waits in the
ring) but computes nothing; once the forward's blocks have gone round, every rank has seen
every rank's verdict and all raise :class:`RingRefused` together. No collective of its own:
one element per forward message, and one read of the ``cp`` verdicts on the host per call.

Precision: the math runs in float32 for half and bfloat16 inputs (float64 for float64);
blocks travel in the input dtype. Grouped-query attention is computed without repeating k
and v: the queries of a key/value head are one matrix of ``G * S`` rows (``G = Hq / Hkv``).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "Layout",
    "RingRefused",
    "Rotation",
    "ring_attention",
    "ring_volume",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]

Layout = Literal["load_balanced", "contiguous"]
Rotation = Literal["p2p", "allgather"]
_LAYOUTS = ("load_balanced", "contiguous")
_ROTATIONS = ("p2p", "allgather")


class RingRefused(Exception):
    """Raised by :func:`ring_attention` on every rank of the group when some rank's caller
    refused its call (``refused=True``), once the forward's blocks have gone round.

    Attributes:
        ranks: the ranks (in the group) that refused, in increasing order.
    """

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"ring attention refused by the caller on group rank(s) {ranks}")
        self.ranks = ranks


# --------------------------------------------------------------------------- the layout


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, found {value!r}")


def _chunks(seq_len: int, cp: int, layout: str) -> int:
    """The number of equal chunks the sequence is cut in; raises if it does not divide."""
    _check_choice("layout", layout, _LAYOUTS)
    if cp < 1:
        raise ValueError(f"the context-parallel degree must be at least 1, found {cp}")
    n = 2 * cp if layout == "load_balanced" else cp
    if seq_len % n:
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split over cp={cp} with the {layout!r} "
            f"layout: its length must be divisible by {n}"
            + (" (2 * cp: a head and a tail chunk per rank)" if n == 2 * cp else "")
            + f", {seq_len} % {n} = {seq_len % n}"
        )
    return n


def sequence_positions(
    seq_len: int,
    cp: int,
    rank: int,
    layout: Layout = "load_balanced",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global positions of the tokens rank ``rank`` of ``cp`` holds, in its order.

    ``"load_balanced"``: the sequence is cut in ``2 * cp`` equal chunks; rank ``r`` holds chunk
    ``r`` then chunk ``2 * cp - 1 - r`` (so causal work is even). ``"contiguous"``: rank ``r``
    holds the ``r``-th of ``cp`` equal chunks. The positions increase in both.

    Args:
        seq_len: the length of the whole sequence.
        cp: the context-parallel degree.
        rank: the rank in the cp group.
        layout: ``"load_balanced"`` or ``"contiguous"``.
        device: where the result lives (default: the CPU).

    Returns:
        An int64 tensor of ``seq_len // cp`` positions.

    Raises:
        ValueError: ``seq_len`` is not divisible by ``2 * cp`` (load-balanced) or ``cp``
            (contiguous), or ``rank`` is not in ``[0, cp)``.

    Example::

        >>> sequence_positions(8, 2, 0)
        tensor([0, 1, 6, 7])
        >>> sequence_positions(8, 2, 1, "contiguous")
        tensor([4, 5, 6, 7])
    """
    n = _chunks(seq_len, cp, layout)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}) for cp={cp}, found {rank}")
    size = seq_len // n
    starts = (rank, 2 * cp - 1 - rank) if layout == "load_balanced" else (rank,)
    return torch.cat(
        [torch.arange(s * size, (s + 1) * size, dtype=torch.int64, device=device) for s in starts]
    )


def _group_rank_size(group: ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(
    tensor: torch.Tensor, dim: int, group: ProcessGroup | None, layout: Layout = "load_balanced"
) -> torch.Tensor:
    """This rank's part, along ``dim``, of a tensor every rank of ``group`` holds whole.

    No communication: the layout's chunks, cut out and concatenated (a contiguous result).
    Differentiable as the slicing it is (the gradient of the whole is this rank's part,
    zeros elsewhere).

    Args:
        tensor: the whole tensor, the same on every rank.
        dim: the sequence dimension.
        group: the cp process group.
        layout: ``"load_balanced"`` or ``"contiguous"`` (see :func:`sequence_positions`).

    Raises:
        ValueError: the length along ``dim`` does not divide as the layout needs.

    Example::

        >>> local = shard_sequence(hidden, 1, cp_group)  # doctest: +SKIP
    """
    rank, cp = _group_rank_size(group)
    dim = dim % tensor.dim()
    seq_len = tensor.shape[dim]
    size = seq_len // _chunks(seq_len, cp, layout)
    if layout == "contiguous":
        return tensor.narrow(dim, rank * size, size).contiguous()
    head = tensor.narrow(dim, rank * size, size)
    tail = tensor.narrow(dim, (2 * cp - 1 - rank) * size, size)
    return torch.cat([head, tail], dim=dim)


def unshard_sequence(
    tensor: torch.Tensor, dim: int, group: ProcessGroup | None, layout: Layout = "load_balanced"
) -> torch.Tensor:
    """The whole tensor along ``dim`` from every rank's part (one all-gather, then the chunks
    put in sequence order).

    Differentiable: the backward returns this rank's part of the gradient of the whole (the
    whole's gradient is taken to be the same on every rank, as when every rank computes the
    same loss from it).

    Args:
        tensor: this rank's part, in the layout's order.
        dim: the sequence dimension.
        group: the cp process group.
        layout: ``"load_balanced"`` or ``"contiguous"``.

    Raises:
        ValueError: ``"load_balanced"`` and an odd local length.

    Example::

        >>> whole = unshard_sequence(shard_sequence(hidden, 1, cp_group), 1, cp_group)
        >>> # doctest: +SKIP
    """
    _check_choice("layout", layout, _LAYOUTS)
    return _Unshard.apply(tensor, dim % tensor.dim(), group, layout)


def _unshard(tensor: torch.Tensor, dim: int, group: ProcessGroup | None, layout: str):
    _, cp = _group_rank_size(group)
    local = tensor.shape[dim]
    _chunks(local * cp, cp, layout)  # an odd local length cannot be load-balanced
    if cp == 1:
        return tensor.contiguous()
    x = tensor.movedim(dim, 0).contiguous()
    out = x.new_empty((cp * local, *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    if layout == "load_balanced":
        # rank r's part is (chunk r, chunk 2cp-1-r): the heads in rank order, then the
        # tails in reverse rank order
        parts = out.view(cp, 2, local // 2, *x.shape[1:])
        out = torch.cat([parts[:, 0].flatten(0, 1), parts[:, 1].flip(0).flatten(0, 1)])
    return out.movedim(0, dim).contiguous()


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, layout):
        ctx.dim, ctx.group, ctx.layout = dim, group, layout
        return _unshard(tensor, dim, group, layout)

    @staticmethod
    def backward(ctx, grad):
        return shard_sequence(grad, ctx.dim, ctx.group, ctx.layout), None, None, None


# --------------------------------------------------------------------------- volume


def ring_volume(
    batch: int,
    heads_kv: int,
    seq_len: int,
    head_dim: int,
    dtype_bytes: int,
    cp: int,
    rotation: Rotation = "p2p",
) -> dict[str, int]:
    """Bytes and messages one rank sends in one :func:`ring_attention` call (forward and
    backward), for keys and values of ``head_dim`` each.

    A message is one ``isend`` (``"p2p"``, with as many ``irecv``) or one collective
    (``"allgather"``); a collective's bytes are those a ring algorithm sends per rank
    (``cp - 1`` shards). Gradients travel in the accumulation dtype (``max(dtype_bytes, 4)``);
    a forward block carries one element more, its rank's verdict (see the module's
    "Agreement").

    Args:
        batch: the batch size.
        heads_kv: the number of key/value heads.
        seq_len: the length of the whole sequence (``seq_len / cp`` per rank).
        head_dim: the head dimension of keys and values.
        dtype_bytes: bytes per element of the keys and values.
        cp: the context-parallel degree.
        rotation: ``"p2p"`` or ``"allgather"``.

    Returns:
        ``forward_bytes``, ``backward_bytes``, ``forward_messages``, ``backward_messages`` and
        ``messages`` (their sum).

    Example::

        >>> ring_volume(1, 8, 4096, 128, 2, 4, "p2p")["forward_bytes"]
        12582918
    """
    _check_choice("rotation", rotation, _ROTATIONS)
    _chunks(seq_len, cp, "contiguous")
    elements = batch * heads_kv * (seq_len // cp) * 2 * head_dim
    kv, acc = elements * dtype_bytes, elements * max(dtype_bytes, 4)
    if cp == 1:
        forward_bytes = backward_bytes = forward_messages = backward_messages = 0
    elif rotation == "p2p":
        forward_bytes, backward_bytes = (cp - 1) * (kv + dtype_bytes), (cp - 1) * kv + cp * acc
        forward_messages, backward_messages = cp - 1, 2 * cp - 1
    else:
        forward_bytes, backward_bytes = (cp - 1) * (kv + dtype_bytes), (cp - 1) * (kv + acc)
        forward_messages, backward_messages = 1, 2
    return {
        "forward_bytes": forward_bytes,
        "backward_bytes": backward_bytes,
        "forward_messages": forward_messages,
        "backward_messages": backward_messages,
        "messages": forward_messages + backward_messages,
    }


# --------------------------------------------------------------------------- blocks


@functools.lru_cache(maxsize=1024)
def _block(
    seq_len: int, cp: int, rank: int, owner: int, layout: str, is_causal: bool
) -> tuple[int, int, bool] | None:
    """Which part of the block (this rank's queries, ``owner``'s keys) is unmasked:
    ``(q_start, k_stop, masked)``: the queries from ``q_start`` against the keys before
    ``k_stop``, with a mask inside if ``masked``; None if nothing is (no compute).

    Positions increase within each rank, so the queries that see any of the keys are a
    suffix (from the first at or after the first key) and the keys any query sees a prefix
    (up to the last query); inside, all is visible if the first such query comes at or
    after the last such key."""
    local = seq_len // cp
    if not is_causal:
        return 0, local, False
    q = sequence_positions(seq_len, cp, rank, layout)
    k = sequence_positions(seq_len, cp, owner, layout)
    q_start = int(torch.searchsorted(q, k[0]))
    k_stop = int(torch.searchsorted(k, q[-1], right=True))
    if q_start == local or k_stop == 0:
        return None
    return q_start, k_stop, bool(q[q_start] < k[k_stop - 1])


def _mask(seq_len, cp, rank, owner, layout, q_start, k_stop, device) -> torch.Tensor:
    """The causal mask of a block's unmasked part: True where a query sees a key."""
    q = sequence_positions(seq_len, cp, rank, layout, device)[q_start:]
    k = sequence_positions(seq_len, cp, owner, layout, device)[:k_stop]
    return q[:, None] >= k[None, :]


class _Shapes:
    """The sizes of one call: batch, key/value heads, queries per key/value head (``G``),
    local length, head dims of q/k (``D``) and v (``Dv``)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.b, hq, self.s, self.d = q.shape
        self.hkv, self.dv = k.shape[1], v.shape[-1]
        self.g = hq // self.hkv
        self.nk = self.b * self.hkv * self.s * self.d
        self.nv = self.b * self.hkv * self.s * self.dv

    def kv(self, buf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v out of a packed buffer, in ``dtype``."""
        k = buf[: self.nk].view(self.b, self.hkv, self.s, self.d)
        v = buf[self.nk : self.nk + self.nv].view(self.b, self.hkv, self.s, self.dv)
        return k.to(dtype), v.to(dtype)

    def pack(
        self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, verdict: bool | None = None
    ) -> torch.Tensor:
        """k and v in one buffer; with ``verdict``, one element more (1: refused) at its end."""
        buf = k.new_empty(self.nk + self.nv + (verdict is not None), dtype=dtype)
        buf[: self.nk].view(k.shape).copy_(k)
        buf[self.nk : self.nk + self.nv].view(v.shape).copy_(v)
        if verdict is not None:
            buf[-1] = float(verdict)
        return buf

    def grouped(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B, Hq, S, X]`` as ``[B, Hkv, G, S, X]`` in ``dtype`` (a view where it can be)."""
        return t.to(dtype).view(self.b, self.hkv, self.g, self.s, t.shape[-1])

    def rows(self, t: torch.Tensor, start: int) -> torch.Tensor:
        """The rows from ``start`` of a ``[B, Hkv, G, S, X]`` tensor as one matrix per
        key/value head, ``[B, Hkv, G * (S - start), X]``."""
        t = t[..., start:, :]
        return t.reshape(self.b, self.hkv, -1, t.shape[-1])


def _scores(sh, q_rows, k, scale, mask):
    scores = torch.matmul(q_rows, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        view = scores.view(sh.b, sh.hkv, sh.g, -1, scores.shape[-1])
        view.masked_fill_(~mask, float("-inf"))
    return scores


class _Context:
    """What a forward or backward needs to walk the blocks of one call."""

    def __init__(self, q, k, v, group, is_causal, layout, scale) -> None:
        self.sh = _Shapes(q, k, v)
        self.group, self.is_causal, self.layout, self.scale = group, is_causal, layout, scale
        self.rank, self.cp = _group_rank_size(group)
        self.seq_len = self.sh.s * self.cp
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.device = q.device

    def block(self, owner: int):
        """``(q_start, k_stop, mask)`` of ``owner``'s block, or None to skip it."""
        found = _block(self.seq_len, self.cp, self.rank, owner, self.layout, self.is_causal)
        if found is None:
            return None
        q_start, k_stop, masked = found
        mask = None
        if masked:
            args = (self.seq_len, self.cp, self.rank, owner, self.layout, q_start, k_stop)
            mask = _mask(*args, self.device)
        return q_start, k_stop, mask

    def peers(self) -> tuple[int, int]:
        return (self.rank + 1) % self.cp, (self.rank - 1) % self.cp


def _exchange(ctx: _Context, sends: list[torch.Tensor], recvs: list[torch.Tensor]):
    """Post sends to the next rank and receives from the previous one; the requests."""
    nxt, prev = ctx.peers()
    ops = [
        dist.P2POp(dist.isend, t, group=ctx.group, group_peer=nxt, tag=i)
        for i, t in enumerate(sends)
    ] + [
        dist.P2POp(dist.irecv, t, group=ctx.group, group_peer=prev, tag=i)
        for i, t in enumerate(recvs)
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests) -> None:
    for request in requests:
        request.wait()


# --------------------------------------------------------------------------- forward


def _forward_block(ctx, q5, buf, owner, out, lse) -> None:
    """Attend the queries to ``owner``'s block (packed in ``buf``), merged into ``out`` and
    ``lse`` (``[B, Hkv, G, S, Dv]`` and ``[B, Hkv, G, S]``, updated in place)."""
    block = ctx.block(owner)
    if block is None:
        return
    q_start, k_stop, mask = block
    sh = ctx.sh
    k, v = sh.kv(buf, ctx.dtype)
    scores = _scores(sh, sh.rows(q5, q_start), k[:, :, :k_stop], ctx.scale, mask)
    block_lse = torch.logsumexp(scores, dim=-1)
    block_out = torch.matmul(scores.sub_(block_lse.unsqueeze(-1)).exp_(), v[:, :, :k_stop])
    block_lse = block_lse.view(sh.b, sh.hkv, sh.g, -1)
    block_out = block_out.view(sh.b, sh.hkv, sh.g, -1, sh.dv)
    old_out, old_lse = out[..., q_start:, :], lse[..., q_start:]
    new_lse = torch.logaddexp(old_lse, block_lse)
    # online softmax: both parts rescaled to the merged normalizer (an empty old part has
    # lse = -inf, weight 0)
    old_out.mul_(torch.exp(old_lse - new_lse).unsqueeze(-1))
    old_out.add_(block_out.mul_(torch.exp(block_lse - new_lse).unsqueeze(-1)))
    old_lse.copy_(new_lse)


def _forward(ctx: _Context, q, k, v, rotation, refused: bool):
    """The output and log-sum-exp, and the ranks that refused (by the verdicts the blocks
    carry; a rank that refused computes nothing, but sends and relays as any)."""
    sh = ctx.sh
    q5 = sh.grouped(q, ctx.dtype)
    out = q5.new_zeros(sh.b, sh.hkv, sh.g, sh.s, sh.dv)
    lse = q5.new_full((sh.b, sh.hkv, sh.g, sh.s), float("-inf"))
    local = sh.pack(k, v, k.dtype, verdict=refused)
    # of the owners in ring order: this rank, rank - 1, ... (copies: the buffers are reused)
    verdicts = [local[-1:].clone()]
    compute = functools.partial(_forward_block, ctx, q5) if not refused else lambda *a: None
    if rotation == "allgather" and ctx.cp > 1:
        blocks = local.new_empty(ctx.cp * local.numel())
        request = dist.all_gather_single(blocks, local, group=ctx.group, async_op=True)
        blocks = blocks.view(ctx.cp, local.numel())
        compute(local, ctx.rank, out, lse)
        request.wait()
        for step in range(1, ctx.cp):
            owner = (ctx.rank - step) % ctx.cp
            verdicts.append(blocks[owner, -1:])
            compute(blocks[owner], owner, out, lse)
    else:
        buffers = [local, torch.empty_like(local) if ctx.cp > 1 else None]
        for step in range(ctx.cp):
            current, incoming = buffers[step % 2], buffers[(step + 1) % 2]
            if step:  # (the buffer is received into again two steps on)
                verdicts.append(current[-1:].clone())
            last = step == ctx.cp - 1
            requests = [] if last else _exchange(ctx, [current], [incoming])
            compute(current, (ctx.rank - step) % ctx.cp, out, lse)
            _wait(requests)
    found = torch.cat(verdicts).tolist()
    ranks = sorted((ctx.rank - step) % ctx.cp for step, flag in enumerate(found) if flag)
    return out, lse, ranks


# --------------------------------------------------------------------------- backward


def _backward_block(ctx, q5, do5, delta, lse, buf, owner, dq, dkv) -> None:
    """Add this block's part to ``dq`` (``[B, Hkv, G, S, D]``) and to the packed gradient
    ``dkv`` of ``owner``'s keys and values."""
    block = ctx.block(owner)
    if block is None:
        return
    q_start, k_stop, mask = block
    sh = ctx.sh
    k, v = sh.kv(buf, ctx.dtype)
    k, v = k[:, :, :k_stop], v[:, :, :k_stop]
    q_rows, do_rows = sh.rows(q5, q_start), sh.rows(do5, q_start)
    lse_rows = lse[..., q_start:].reshape(sh.b, sh.hkv, -1, 1)
    delta_rows = delta[..., q_start:].reshape(sh.b, sh.hkv, -1, 1)
    # the probabilities again, from the saved normalizer (masked entries exp(-inf) = 0)
    p = _scores(sh, q_rows, k, ctx.scale, mask).sub_(lse_rows).exp_()
    dk, dv = sh.kv(dkv, ctx.dtype)
    dv[:, :, :k_stop].add_(torch.matmul(p.transpose(-1, -2), do_rows))
    # dS = P * (dP - rowsum(dO * O)), the softmax's backward without P's full Jacobian
    ds = p.mul_(torch.matmul(do_rows, v.transpose(-1, -2)).sub_(delta_rows)).mul_(ctx.scale)
    dq_rows = torch.matmul(ds, k).view(sh.b, sh.hkv, sh.g, -1, sh.d)
    dq[..., q_start:, :].add_(dq_rows)
    dk[:, :, :k_stop].add_(torch.matmul(ds.transpose(-1, -2), q_rows))


def _backward(ctx: _Context, q, k, v, out, lse, grad, rotation):
    sh = ctx.sh
    q5 = sh.grouped(q, ctx.dtype)
    do5 = sh.grouped(grad, ctx.dtype)
    delta = (do5 * sh.grouped(out, ctx.dtype)).sum(dim=-1)
    dq = q5.new_zeros(q5.shape)
    local = sh.pack(k, v, k.dtype)
    args = (ctx, q5, do5, delta, lse)
    if ctx.cp == 1:
        dkv = local.new_zeros(local.numel(), dtype=ctx.dtype)
        _backward_block(*args, local, ctx.rank, dq, dkv)
    elif rotation == "allgather":
        blocks = local.new_empty(ctx.cp * local.numel())
        request = dist.all_gather_single(blocks, local, group=ctx.group, async_op=True)
        blocks = blocks.view(ctx.cp, local.numel())
        grads = local.new_zeros(ctx.cp, local.numel(), dtype=ctx.dtype)
        _backward_block(*args, local, ctx.rank, dq, grads[ctx.rank])
        request.wait()
        for step in range(1, ctx.cp):
            owner = (ctx.rank - step) % ctx.cp
            _backward_block(*args, blocks[owner], owner, dq, grads[owner])
        dkv = grads.new_empty(local.numel())
        dist.reduce_scatter_single(dkv, grads.flatten(), group=ctx.group)
    else:
        dkv = _backward_ring(ctx, args, local, dq)
    dk, dv = sh.kv(dkv, ctx.dtype)
    return (
        dq.view(q.shape).to(q.dtype),
        dk.to(k.dtype).view(k.shape),
        dv.to(v.dtype).view(v.shape),
    )


def _backward_ring(ctx: _Context, args, local: torch.Tensor, dq: torch.Tensor) -> torch.Tensor:
    """The p2p backward: at step ``i`` the rank holds the block of rank ``r - i`` and the
    gradient that block gathered on the ranks before; it posts the next block and the
    gradient of the previous step's block (complete for this rank), adds its own part to
    the current block's, and after the last step sends that home (one hop on)."""
    kv = [local, torch.empty_like(local)]
    # this rank's part of the current block's gradient; the parts of the ranks before, as
    # they arrive (two buffers, one receiving while the other is sent on); what is sent on
    part = local.new_empty(local.numel(), dtype=ctx.dtype)
    arrived = [torch.empty_like(part), torch.empty_like(part)]
    sent = None
    for step in range(ctx.cp):
        current, incoming = kv[step % 2], kv[(step + 1) % 2]
        sends, recvs = [], []
        if step < ctx.cp - 1:
            sends, recvs = [current], [incoming]
        if step > 0:
            sends.append(sent)
            recvs.append(arrived[step % 2])
        requests = _exchange(ctx, sends, recvs)
        part.zero_()
        _backward_block(*args, current, (ctx.rank - step) % ctx.cp, dq, part)
        _wait(requests)
        if step > 0:
            sent = arrived[step % 2].add_(part)
        else:
            sent = part.clone()
    home = torch.empty_like(part)
    _wait(_exchange(ctx, [sent], [home]))
    return home


# --------------------------------------------------------------------------- the Function


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, layout, rotation, scale, refused):
        walk = _Context(q, k, v, group, is_causal, layout, scale)
        out, lse, refusing = _forward(walk, q, k, v, rotation, refused)
        if refusing:
            raise RingRefused(refusing)
        out = out.view(q.shape[:-1] + (v.shape[-1],))
        # returned as a [B, Hq, S, Dv] view of a [B, S, Hq, Dv] tensor, as SDPA's kernels
        # return it: the (batch, tokens, heads * Dv) a model reshapes it into for its output
        # projection is then a view, not a copy (nor a second tensor saved for backward)
        b, h, s, dv = out.shape
        result = out.new_empty((b, s, h, dv), dtype=q.dtype).transpose(1, 2)
        result.copy_(out)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.walk, ctx.rotation = walk, rotation
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.walk, q, k, v, out, lse, grad, ctx.rotation)
        return dq, dk, dv, None, None, None, None, None, None


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    found = ", ".join(
        f"{name} {tuple(t.shape)} {t.dtype} on {t.device}"
        for name, t in (("query", query), ("key", key), ("value", value))
    )
    where = f"ring_attention: found {found}"
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        raise TypeError("ring_attention: query, key and value must be tensors")
    if any(t.dim() != 4 for t in (query, key, value)):
        raise ValueError(f"{where}; expected 4-D [batch, heads, local sequence, head dim]")
    if not (query.dtype == key.dtype == value.dtype) or not query.is_floating_point():
        raise ValueError(f"{where}; expected one floating-point dtype for all three")
    if not (query.device == key.device == value.device):
        raise ValueError(f"{where}; expected one device for all three")
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError(f"{where}; expected one batch size")
    if not (query.shape[2] == key.shape[2] == value.shape[2]):
        raise ValueError(f"{where}; expected one local sequence length")
    if key.shape[1] != value.shape[1] or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{where}; expected key and value with the same number of heads, dividing the "
            f"query's ({query.shape[1]} % {key.shape[1]} must be 0)"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{where}; expected query and key with the same head dim")


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: ProcessGroup | None,
    is_causal: bool = True,
    layout: Layout = "load_balanced",
    rotation: Rotation = "p2p",
    scale: float | None = None,
    refused: bool = False,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence's keys and values.

    The same as ``F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
    enable_gqa=True)`` on the whole sequence, for this rank's query positions in the layout's
    order. Every rank of ``group`` calls it with tensors of the same shapes.

    Args:
        query: ``[B, Hq, S / cp, D]``, this rank's part of the sequence (any strides).
        key: ``[B, Hkv, S / cp, D]``, ``Hq`` a multiple of ``Hkv`` (grouped-query attention,
            computed without repeating keys and values).
        value: ``[B, Hkv, S / cp, Dv]``.
        group: the cp process group (None: the default group; size 1: plain attention, no
            communication).
        is_causal: the causal mask of the global positions.
        layout: how the sequence is split, ``"load_balanced"`` or ``"contiguous"``.
        rotation: ``"p2p"`` (a ring of blocks) or ``"allgather"`` (one all-gather).
        scale: the scores' factor, default ``1 / sqrt(D)``.
        refused: this rank's caller found its call wrong (a condition of this rank's own
            data): the blocks go round all the same, and every rank raises
            :class:`RingRefused` (the ring's "Agreement"; q, k and v must still have the
            shapes of every other rank's).

    Returns:
        ``[B, Hq, S / cp, Dv]`` in the query's dtype, differentiable in all three inputs.

    Raises:
        ValueError: shapes, dtypes or devices that disagree, ``Hq % Hkv != 0``, an unknown
            layout or rotation, a local length the layout cannot hold (odd, load-balanced).
        RingRefused: on every rank, when a rank's call was ``refused``.

    Example::

        >>> # on every rank of cp_group, q/k/v this rank's part (shard_sequence)
        >>> out = ring_attention(q, k, v, group=cp_group)  # doctest: +SKIP
    """
    _check(query, key, value)
    _check_choice("layout", layout, _LAYOUTS)
    _check_choice("rotation", rotation, _ROTATIONS)
    _, cp = _group_rank_size(group)
    _chunks(query.shape[2] * cp, cp, layout)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _RingAttention.apply(
        query, key, value, group, bool(is_causal), layout, rotation, float(scale), bool(refused)
    )
