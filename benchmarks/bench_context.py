"""Benchmark context parallelism: memory, bytes and time of the ring attention (issue 28).

One invocation spawns the ranks itself (default 2, CPU/gloo; or run it under ``torchrun``) and
trains the reference Llama (``torch_tp.models.Llama``) on one long sequence, one row per way:

* ``single``: one process (rank 0) on the whole sequence, with the SDPA backend torch picks
  (on CPU: its flash-attention kernel, which saves the log-sum-exp, not the probabilities);
* ``single math``: the same with the math backend forced (``sdpa_kernel(SDPBackend.MATH)``),
  which saves the ``S x S`` attention probabilities: the textbook one-device cost;
* ``cp=N p2p``, ``cp=N allgather``: :class:`torch_tp.ContextParallel` on every
  ``layers.*.attention`` over a ``cp`` mesh of ``N`` ranks, each rank a load-balanced part of
  the sequence (``shard_sequence``, ``sequence_positions``), FSDP2 over ``cp`` summing the
  parameters' gradients (as test/test_context_parallel.py does), key/value blocks passed
  point to point or all-gathered;
* ``cp=N contiguous``: ``p2p`` with ``load_balance=False`` (rank ``r`` the ``r``-th chunk):
  under the causal mask the last rank computes ``N`` blocks, the first one; the step waits for
  the slowest.

``N`` is 2 and every power of two up to the number of ranks that divides it (``--world-size
4``: also ``cp=4``); where ``N`` is smaller than the ranks, the mesh is ``(ranks / N, N)`` and
every ``cp`` group trains the same sequence.

A step is forward, cross-entropy loss, backward and an AdamW step. Each row gives the step
time (median, min, max over the timed steps; each step the max over ranks); the first loss's
difference from ``single``'s on the same tokens and weights (the ``cp`` ranks' losses, each
the mean over its tokens, averaged); the bytes and messages every rank sends inside the ring
per step, counted at ``torch_tp._ring``'s calls of ``dist.batch_isend_irecv`` (the bytes of
each ``isend``), ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` (``cp - 1``
shards per rank, as a ring algorithm sends), against :func:`torch_tp._ring.ring_volume` summed
over the attention calls of the step; FSDP2's own collectives apart; and the bytes autograd
saves for backward in one forward, inside the attention modules and in the whole model
(unique storages, parameters left out), against the goal of the issue: at most ``1 / cp`` of
one device's attention activations plus one key/value block in flight.

Example::

    $ python benchmarks/bench_context.py                  # seq 2048, ~1-2 minutes on 2 cores
    $ python benchmarks/bench_context.py --quick          # tiny, 2 steps: a smoke test
    $ python benchmarks/bench_context.py --world-size 4   # and the cp=4 rows
    $ torchrun --nproc-per-node 2 benchmarks/bench_context.py --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Benchmark the working tree's torch_tp (and find bench_tp.py beside this file).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_tp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from bench_tp import CollectiveCounter
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp
from torch_tp import ContextParallel, _ring, sequence_positions, shard_sequence
from torch_tp.models import Llama, LlamaConfig

__all__ = [
    "SIZES",
    "Result",
    "RingCounter",
    "Size",
    "Traffic",
    "Variant",
    "bench_size",
    "expected_ring",
    "goal",
    "main",
    "matches",
    "report",
    "saved_bytes",
    "variants_for",
]


# ---------------------------------------------------------------------------------------------
# What is measured


@dataclass(frozen=True)
class Size:
    """The reference Llama's shapes and the sequence it trains on."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    batch: int
    seq: int
    vocab: int = 1024

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab,
            max_seq_len=self.seq,
        )

    def describe(self) -> str:
        return (
            f"dim {self.dim}, {self.n_layers} layers, {self.n_heads} heads / {self.n_kv_heads} "
            f"kv heads (head dim {self.dim // self.n_heads}), vocab {self.vocab}; batch "
            f"{self.batch} x seq {self.seq}, float32"
        )


SIZES: dict[str, Size] = {
    "tiny": Size("tiny", 64, 2, 4, 2, batch=1, seq=64, vocab=256),
    "long": Size("long", 256, 2, 8, 2, batch=1, seq=2048),
}


@dataclass(frozen=True)
class Variant:
    """One row: one device (``cp == 1``) or ContextParallel over ``cp`` ranks."""

    name: str
    cp: int = 1
    rotation: str = "p2p"
    load_balance: bool = True
    math: bool = False  # one device with the math SDPA backend forced


def variants_for(world_size: int) -> list[Variant]:
    """The rows a run of ``world_size`` ranks has: one device, then each ``cp`` degree (2, 4,
    ... dividing ``world_size``) with both rotations and the contiguous layout."""
    rows = [Variant("single"), Variant("single math", math=True)]
    cp = 2
    while cp <= world_size:
        if world_size % cp == 0:
            rows += [
                Variant(f"cp={cp} p2p", cp, "p2p"),
                Variant(f"cp={cp} allgather", cp, "allgather"),
                Variant(f"cp={cp} contiguous", cp, "p2p", load_balance=False),
            ]
        cp *= 2
    return rows


def _select(only: str | None, world_size: int) -> list[Variant]:
    available = variants_for(world_size)
    if not only:
        return available
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [v for v in available if any(fnmatch.fnmatchcase(v.name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(v.name for v in available)
        raise ValueError(f"--only {only!r} matches no variant; at {world_size} ranks: {names}")
    if chosen[0].name != "single":  # the loss differences and memory ratios need it
        chosen.insert(0, available[0])
    return chosen


# ---------------------------------------------------------------------------------------------
# Counting the ring's bytes


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Traffic:
    """What one rank sent inside the ring, by pass."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_messages: int = 0
    backward_messages: int = 0

    def add(self, nbytes: int, messages: int = 1) -> None:
        if _in_backward():
            self.backward_bytes += nbytes
            self.backward_messages += messages
        else:
            self.forward_bytes += nbytes
            self.forward_messages += messages

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes

    @property
    def messages(self) -> int:
        return self.forward_messages + self.backward_messages


def expected_ring(calls: Sequence[dict[str, Any]]) -> Traffic:
    """:func:`torch_tp._ring.ring_volume` summed over the recorded attention calls."""
    total = Traffic()
    for c in calls:
        v = _ring.ring_volume(
            c["batch"], c["heads_kv"], c["seq_len"], c["head_dim"], c["dtype_bytes"], c["cp"],
            c["rotation"],
        )  # fmt: skip
        total.forward_bytes += v["forward_bytes"]
        total.backward_bytes += v["backward_bytes"]
        total.forward_messages += v["forward_messages"]
        total.backward_messages += v["backward_messages"]
    return total


class RingCounter:
    """Count what ``torch_tp._ring`` sends, and the attention calls it serves, while active.

    ``torch_tp._ring``'s module attribute ``dist`` is replaced by a namespace that forwards
    everything to ``torch.distributed`` but counts, per rank and pass: each ``isend`` of a
    ``batch_isend_irecv`` (its tensor's bytes, one message), each ``all_gather_single`` and
    ``reduce_scatter_single`` (one message, ``cp - 1`` shards: what a ring algorithm sends).
    ``ring_attention`` is wrapped to record each call's shapes (:attr:`calls`), for
    :func:`expected_ring`. While a counted call runs, :attr:`busy` is set: the collectives it
    issues are the ring's, not FSDP2's (see :class:`_OtherCollectives`).

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> with RingCounter() as ring:
        ...     step()
        >>> ring.traffic.total_bytes == expected_ring(ring.calls).total_bytes
        True
    """

    def __init__(self) -> None:
        self.traffic = Traffic()
        self.calls: list[dict[str, Any]] = []
        self.busy = False

    def __enter__(self) -> RingCounter:
        real = dist
        counter = self

        def batch_isend_irecv(ops: list[Any]) -> Any:
            for op in ops:
                if op.op is real.isend:
                    counter.traffic.add(_nbytes(op.tensor))
            with counter._busy():
                return real.batch_isend_irecv(ops)

        def all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
            shards = real.get_world_size(kwargs.get("group")) - 1
            counter.traffic.add(shards * _nbytes(input))
            with counter._busy():
                return real.all_gather_single(output, input, **kwargs)

        def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
            shards = real.get_world_size(kwargs.get("group")) - 1
            counter.traffic.add(shards * _nbytes(output))
            with counter._busy():
                return real.reduce_scatter_single(output, input, **kwargs)

        class _Dist(types.SimpleNamespace):
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        self._saved = (_ring.dist, _ring.ring_attention)
        ring_attention = _ring.ring_attention

        def recorded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any):
            cp = real.get_world_size(kw.get("group"))
            self.calls.append(
                {
                    "batch": key.shape[0],
                    "heads_kv": key.shape[1],
                    "seq_len": key.shape[2] * cp,
                    "head_dim": key.shape[3],
                    "dtype_bytes": key.element_size(),
                    "cp": cp,
                    "rotation": kw.get("rotation", "p2p"),
                    "query_heads": query.shape[1],
                }
            )
            return ring_attention(query, key, value, **kw)

        _ring.dist = _Dist(
            batch_isend_irecv=batch_isend_irecv,
            all_gather_single=all_gather_single,
            reduce_scatter_single=reduce_scatter_single,
        )
        _ring.ring_attention = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        _ring.dist, _ring.ring_attention = self._saved

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


class _OtherCollectives(CollectiveCounter):
    """``bench_tp.CollectiveCounter`` without the ring's own collectives (those issued while
    ``ring.busy``): what is left in a cp row is FSDP2's (parameter all-gathers, gradient
    reduce-scatters)."""

    def __init__(self, ring: RingCounter) -> None:
        super().__init__()
        self.ring = ring

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.ring.busy:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---------------------------------------------------------------------------------------------
# Memory saved for backward


def saved_bytes(
    model: nn.Module, inner: Sequence[nn.Module], forward: Callable[[], Any]
) -> tuple[int, int]:
    """Bytes autograd saves for backward during ``forward()``: inside the modules ``inner``
    (the attention modules), and in the whole forward.

    Every saved tensor is counted once per storage (views of one buffer count once, the whole
    buffer counts). Parameters are not activations: the storages of every module's parameters
    as its forward starts (FSDP2's unsharded ones included) and of the buffers are left out.
    """
    exclude = {p for b in model.buffers() for p, _ in bench_tp._storages(b)}
    seen_inner: dict[int, int] = {}
    seen_all: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keeps storages alive, so addresses stay unique
    depth = [0]

    def params(module: nn.Module, args: Any) -> None:
        for p in module.parameters(recurse=False):
            exclude.update(ptr for ptr, _ in bench_tp._storages(p))

    def enter(module: nn.Module, args: Any) -> None:
        depth[0] += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        for ptr, nbytes in bench_tp._storages(t):
            if not nbytes or ptr in exclude:
                continue
            keep.append(t)
            seen_all.setdefault(ptr, nbytes)
            if depth[0]:
                seen_inner.setdefault(ptr, nbytes)
        return t

    handles = [nn.modules.module.register_module_forward_pre_hook(params)]
    handles += [m.register_forward_pre_hook(enter) for m in inner]
    handles += [m.register_forward_hook(leave) for m in inner]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        for h in handles:
            h.remove()
    del out
    keep.clear()
    return sum(seen_inner.values()), sum(seen_all.values())


class _SdpaOps(TorchDispatchMode):
    """The names of the scaled-dot-product-attention kernels dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(getattr(func, "_overloadpacket", func))
        if "scaled_dot_product" in name:
            self.names.add(name.removeprefix("aten."))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# Running the variants


@dataclass
class Result:
    """What one variant measured (times: max over ranks; bytes: max over ranks)."""

    variant: Variant
    times: list[float] = field(default_factory=list)
    loss: float | None = None
    loss_diff: float | None = None
    traffic: Traffic = field(default_factory=Traffic)
    expected: Traffic = field(default_factory=Traffic)
    attention_calls: int = 0
    ring_heads: str = ""
    other: str = "none"
    attention_saved: int = 0
    model_saved: int = 0
    block_bytes: int = 0  # one key/value block of one call, as it travels
    kernels: str = ""


@dataclass
class _Bench:
    variant: Variant
    here: bool
    step: Callable[[], torch.Tensor]
    forward: Callable[[], torch.Tensor]
    model: nn.Module | None
    group: Any = None


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _prepare(
    variant: Variant,
    reference: Llama,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    meshes: dict[int, DeviceMesh],
    args: argparse.Namespace,
) -> tuple[_Bench, Result]:
    result = Result(variant)
    here = variant.cp > 1 or dist.get_rank() == 0
    if not here:
        nothing = lambda: torch.zeros(())  # noqa: E731
        return _Bench(variant, False, nothing, nothing, None), result
    model = Llama(reference.config)
    model.load_state_dict(reference.state_dict())
    group = None
    if variant.cp > 1:
        mesh = meshes[variant.cp]
        style = ContextParallel(rotation=variant.rotation, load_balance=variant.load_balance)
        torch_tp.parallelize_module(model, mesh, {"layers.*.attention": style})
        for layer in model.layers:  # the parameters' gradients summed (averaged) over cp
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        lb = variant.load_balance
        inputs = shard_sequence(tokens, mesh, load_balance=lb)
        labels = shard_sequence(targets, mesh, load_balance=lb)
        positions = sequence_positions(tokens.shape[1], mesh, load_balance=lb)
        group = mesh.get_group()

        def forward() -> torch.Tensor:
            return model(inputs, positions=positions)
    else:
        labels = targets

        def forward() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.MATH) if variant.math else contextlib.nullcontext():
                return model(tokens)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        loss = _loss(forward(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    with torch.no_grad():
        first = _loss(forward(), labels)
        if group is not None:  # each rank's mean over its tokens (equal counts): average
            dist.all_reduce(first, group=group)
            first /= variant.cp
    result.loss = first.item()
    bench = _Bench(variant, True, step, forward, model, group)
    for _ in range(args.warmup):
        step()
    return bench, result


def _measure(bench: _Bench, result: Result, size: Size) -> None:
    """One more step with the counters on, and one forward with the saved-tensor hooks."""
    if not bench.here:
        return
    with RingCounter() as ring, _OtherCollectives(ring) as other:
        bench.step()
    result.traffic, result.expected = ring.traffic, expected_ring(ring.calls)
    result.attention_calls = len(ring.calls)
    if ring.calls:
        c = ring.calls[0]
        result.ring_heads = f"{c['query_heads']} q / {c['heads_kv']} kv"
        result.block_bytes = (
            c["batch"] * c["heads_kv"] * (c["seq_len"] // c["cp"]) * 2 * c["head_dim"]
        ) * c["dtype_bytes"]
    result.other = bench_tp._fmt_collectives(other.records)
    model = bench.model
    attention = [layer.attention for layer in model.layers]
    with _SdpaOps() as kernels:
        result.attention_saved, result.model_saved = saved_bytes(model, attention, bench.forward)
    result.kernels = ", ".join(sorted(kernels.names)) or "math (decomposed into matmul, softmax)"


def _gather_max(result: Result) -> Result:
    """Every rank's result; the max over ranks of the bytes, rank 0's (or the first rank
    that ran the row's) for the rest."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    ran = [r for r in gathered if r.attention_saved or r.model_saved] or gathered
    first = ran[0]
    for name in ("attention_saved", "model_saved", "block_bytes"):
        setattr(first, name, max(getattr(r, name) for r in ran))
    first.traffic = max((r.traffic for r in ran), key=lambda t: (t.total_bytes, t.messages))
    return first


def bench_size(
    size: Size, variants: Sequence[Variant], meshes: dict[int, DeviceMesh], args: argparse.Namespace
) -> list[Result]:
    """Run every variant at ``size``; the results are complete on rank 0."""
    torch.manual_seed(args.seed)  # the same weights and tokens on every rank
    reference = Llama(size.config())
    data = torch.randint(0, size.vocab, (size.batch, size.seq + 1))
    tokens, targets = data[:, :-1], data[:, 1:]
    prepared = [_prepare(v, reference, tokens, targets, meshes, args) for v in variants]
    benches = [b for b, _ in prepared]
    results = [r for _, r in prepared]
    times: list[list[float]] = [[] for _ in benches]
    with bench_tp._no_gc():
        for _ in range(args.steps):
            for bench, elapsed in zip(benches, times, strict=True):
                dist.barrier()
                if not bench.here:
                    elapsed.append(0.0)
                    continue
                start = time.perf_counter()
                bench.step()
                elapsed.append(time.perf_counter() - start)
    out = []
    for bench, result, elapsed in zip(benches, results, times, strict=True):
        result.times = bench_tp._max_over_ranks(elapsed)
        _measure(bench, result, size)
        out.append(_gather_max(result))
    base = out[0].loss
    for r in out:
        r.loss_diff = None if r.loss is None or base is None else abs(r.loss - base)
    return out


# ---------------------------------------------------------------------------------------------
# Reports


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 0.1 else f"{1000 * seconds:.1f}"


def _traffic(t: Traffic) -> str:
    fmt = bench_tp._fmt_bytes
    return (
        f"{fmt(t.forward_bytes)} + {fmt(t.backward_bytes)} "
        f"({t.forward_messages} + {t.backward_messages} msgs)"
    )


def matches(r: Result) -> str:
    """``yes`` when the counted ring traffic is the theoretical one (bytes and messages, both
    passes), ``-`` for one device."""
    if r.variant.cp == 1:
        return "-"
    t, e = r.traffic, r.expected
    same = (t.forward_bytes, t.backward_bytes, t.forward_messages, t.backward_messages) == (
        e.forward_bytes,
        e.backward_bytes,
        e.forward_messages,
        e.backward_messages,
    )
    return "yes" if same and r.attention_calls else "no"


def goal(r: Result, single: Result) -> tuple[int, str]:
    """The issue's goal for a cp row's attention activations per rank: one device's / cp
    plus one key/value block in flight; whether it is met."""
    if r.variant.cp == 1:
        return 0, "-"
    bound = single.attention_saved // r.variant.cp + r.block_bytes
    return bound, "yes" if r.attention_saved <= bound else "no"


def _time_row(r: Result, single: Result) -> list[str]:
    v = r.variant
    median = statistics.median(r.times)
    speed = statistics.median(single.times) / median if median else float("nan")
    ring = "-" if v.cp == 1 else _traffic(r.traffic)
    theory = "-" if v.cp == 1 else _traffic(r.expected)
    return [
        v.name,
        f"{_ms(median)} ({_ms(min(r.times))}-{_ms(max(r.times))})",
        f"{speed:.2f}x",
        "-" if r.loss_diff is None else f"{r.loss_diff:.1e}",
        ring,
        theory,
        matches(r),
        r.other if v.cp > 1 else "-",
    ]


def _memory_row(r: Result, single: Result, math: Result | None) -> list[str]:
    fmt = bench_tp._fmt_bytes
    bound, met = goal(r, single)

    def ratio(a: int, b: int) -> str:
        return f"{a / b:.3f}" if b else "-"

    return [
        r.variant.name,
        fmt(r.attention_saved),
        ratio(r.attention_saved, single.attention_saved),
        ratio(r.attention_saved, math.attention_saved) if math else "-",
        "-" if r.variant.cp == 1 else f"{fmt(bound)}: {met}",
        fmt(r.model_saved),
        ratio(r.model_saved, single.model_saved),
    ]


def report(size: Size, results: Sequence[Result], markdown: bool) -> str:
    """The tables of one size (rank 0's ``results``; the first is ``single``)."""
    single = results[0]
    math = next((r for r in results if r.variant.math), None)
    time_headers = [
        "variant",
        "ms/step median (min-max)",
        "vs single",
        "loss diff",
        "ring bytes sent/rank fwd + bwd",
        "ring_volume (theory)",
        "match",
        "FSDP2 collectives (full buffers)",
    ]
    mem_headers = [
        "variant",
        "attention saved/rank",
        "÷ single",
        "÷ single math",
        "goal ≤ single/cp + 1 block: met",
        "whole forward saved/rank",
        "÷ single",
    ]
    body = bench_tp._table(time_headers, [_time_row(r, single) for r in results], markdown)
    body += "\n\n" + bench_tp._table(
        mem_headers, [_memory_row(r, single, math) for r in results], markdown
    )
    cp_rows = [r for r in results if r.variant.cp > 1]
    notes = [f"single's first loss: {single.loss:.7f}; SDPA kernel: {single.kernels}"]
    if math:
        notes.append(f"single math's: {math.kernels}")
    if cp_rows:
        r = cp_rows[0]
        notes.append(
            f"attention calls per step per rank: {r.attention_calls} (ring shapes: "
            f"{r.ring_heads} heads reach F.scaled_dot_product_attention; one key/value block "
            f"of one call at {r.variant.name}: {bench_tp._fmt_bytes(r.block_bytes)})"
        )
        excess = ", ".join(
            f"{c.variant.name} "
            + bench_tp._fmt_bytes(c.attention_saved - single.attention_saved // c.variant.cp)
            for c in cp_rows
        )
        notes.append(f"attention saved/rank - single's / cp: {excess}")
    body += "\n\n" + "\n".join(("- " if markdown else "") + n for n in notes)
    return bench_tp._section(size.name, size.describe(), body, markdown)


def _header(args: argparse.Namespace, world_size: int) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"machine: {bench_tp._cpu_model()}, {cores} cores ({bench_tp._load()}); torch "
        f"{torch.__version__}; backend {dist.get_backend()} (CPU), {world_size} ranks, "
        f"{torch.get_num_threads()} thread(s) per rank (one-device rows: rank 0 alone)",
        f"step = forward + cross-entropy loss + backward + AdamW step; {args.warmup} warm-up "
        f"steps, then {args.steps} rounds of one timed step per variant (interleaved), each "
        "started after a barrier and timed as the max over ranks",
        "loss diff = |first loss - single's| (same weights and tokens; a cp row's loss is "
        "the mean of its ranks' means over their tokens)",
        "ring bytes: what one rank sends inside torch_tp._ring in one step (isend bytes; "
        "all-gather / reduce-scatter: cp - 1 shards), max over ranks; theory: "
        "torch_tp._ring.ring_volume summed over the step's attention calls; FSDP2's "
        "collectives (over cp) counted apart by a TorchDispatchMode",
        "saved: bytes autograd saves for backward in one forward (unique storages, "
        "parameters left out), inside layers.*.attention and in the whole model, max over "
        "ranks; not the allocator's peak",
    ]
    title = f"torch_tp {torch_tp.__version__} context-parallel benchmark: {world_size} ranks"
    if args.markdown:
        return f"## {title}\n\n" + "\n".join(f"- {line}" for line in lines)
    return title + "\n" + "\n".join(lines)


def _meshes(world_size: int, variants: Sequence[Variant]) -> dict[int, DeviceMesh]:
    """The 1-D ``cp`` mesh of each degree (of a ``(dp, cp)`` mesh below ``world_size``)."""
    meshes = {}
    for cp in sorted({v.cp for v in variants if v.cp > 1}):
        if cp == world_size:
            meshes[cp] = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        else:
            shape = (world_size // cp, cp)
            meshes[cp] = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp"))["cp"]
    return meshes


def _run(args: argparse.Namespace) -> None:
    """The benchmark on one rank of an initialized process group; rank 0 prints."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    variants = _select(args.only, world_size)
    meshes = _meshes(world_size, variants)
    if rank == 0:
        print(_header(args, world_size) + "\n", flush=True)
    for name in args.sizes:
        size = SIZES[name]
        results = bench_size(size, variants, meshes, args)
        if rank == 0:
            print(report(size, results, args.markdown) + "\n", flush=True)


def _sizes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sizes must be among {', '.join(SIZES)}, found {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(
        prog="bench_context.py",
        description="Context parallelism on the reference Llama: step time, loss against one "
        "device, ring bytes against theory, and activations saved for backward per rank.",
    )
    p.add_argument(
        "--sizes", type=_sizes, default=["long"], help="comma-separated sizes (default: long)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (default: %(default)s)")
    p.add_argument(
        "--quick", action="store_true", help="a smoke test: --sizes tiny --steps 2 --warmup 1"
    )
    p.add_argument(
        "--only",
        help="comma-separated variant names or globs, e.g. 'cp=2*' (single always runs); at 2 "
        "ranks: " + ", ".join(v.name for v in variants_for(2)),
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument(
        "--world-size",
        "--nproc",
        type=int,
        default=2,
        help="ranks to spawn when not launched by torchrun (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and tokens (default: 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, spawn the ranks (unless under torchrun) and run; return the status."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup = ["tiny"], 2, 1
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    torchrun = bench_tp._launched_by_torchrun()
    ranks = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    try:
        if ranks < 2:
            raise ValueError(f"context parallelism needs at least 2 ranks, found {ranks}")
        _select(args.only, ranks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if torchrun:
        bench_tp.torchrun_rank(_run, args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            bench_tp.spawned_rank,
            args=(_run, args.world_size, os.path.join(tmp, "store"), args),
            nprocs=args.world_size,
            start_method="spawn",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
