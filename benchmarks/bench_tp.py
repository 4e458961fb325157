"""Benchmark tensor-parallel training steps: torch_tp vs upstream vs a hand-written baseline.

One invocation spawns the ranks itself (default 2, CPU/gloo; or run it under ``torchrun``) and
prints, for each model size, one table row per variant of the reference Llama:

* ``single``: one process, no tensor parallelism (the same model, the same thread count as
  one rank);
* ``megatron`` / ``megatron+sp``: the hand-written Megatron-style baseline of
  ``benchmarks/megatron.py`` (plain tensors, explicit autograd collectives), the reference
  every ratio is taken against;
* ``torch_tp`` / ``torch_tp+sp``: ``torch_tp.parallelize_module`` with
  ``torch_tp.plans.llama.llama_plan``;
* ``upstream-linear`` / ``upstream-linear+sp``: ``torch.distributed.tensor.parallel`` with the
  per-Linear plan most examples show (torchtitan's plan for ``+sp``);
* ``upstream-optimal`` / ``upstream-optimal+sp``: the plan of ``llama_plan`` built from the
  upstream classes (one ``PrepareModuleInput(use_local_output=False)`` per attention and per
  feed-forward, so q/k/v share one input-gradient reduction).

A step is forward, cross-entropy loss and backward (no optimizer step). Each row gives the
median time per step, its ratio to the baseline with the same sequence-parallel setting, the
loss difference from the single-device loss, and the collectives of one step (counted on a
separate, untimed step). After the tables come the time of ``parallelize_module`` on a meta
model with Llama-70B shapes (torch_tp beside upstream) and the activation memory saved for
backward in the transformer blocks.

Example::

    $ python benchmarks/bench_tp.py                      # everything, ~3 minutes on 2 cores
    $ python benchmarks/bench_tp.py --sizes tiny --only 'megatron*,torch_tp*'
    $ torchrun --nproc-per-node 2 benchmarks/bench_tp.py --markdown
    $ python -m torch_tp bench --sizes small --by-module
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Benchmark the working tree's torch_tp (and find megatron.py beside this file) even when
# torch_tp is not installed or another copy is.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import parallel as upstream
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan

__all__ = [
    "SIZES",
    "VARIANTS",
    "CollectiveCounter",
    "Record",
    "Size",
    "Variant",
    "build_variant",
    "main",
    "saved_activation_bytes",
    "upstream_linear_plan",
    "upstream_optimal_plan",
]


# ---------------------------------------------------------------------------------------------
# What is measured


@dataclass(frozen=True)
class Size:
    """A model size and the batch it is run on."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    batch: int
    seq: int
    vocab: int = 1024

    def config(self) -> LlamaConfig:
        """The reference model's config for this size."""
        return LlamaConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab,
            max_seq_len=self.seq,
        )

    def describe(self) -> str:
        c = self.config()
        return (
            f"dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads / {c.kv_heads} kv heads, "
            f"ffn {c.ffn_hidden_dim}, vocab {c.vocab_size}; batch {self.batch} x seq {self.seq}"
        )


SIZES: dict[str, Size] = {
    "tiny": Size("tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, batch=1, seq=8),
    "small": Size("small", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, batch=4, seq=128),
}


@dataclass(frozen=True)
class Variant:
    """One way of running the model: a library (or none) and a sequence-parallel setting."""

    library: str  # "single", "megatron", "torch_tp", "upstream-linear", "upstream-optimal"
    sequence_parallel: bool = False

    @property
    def name(self) -> str:
        return self.library + ("+sp" if self.sequence_parallel else "")

    @property
    def baseline(self) -> Variant:
        """The Megatron-style variant this one is compared with."""
        return Variant("megatron", self.sequence_parallel)


_LIBRARIES = ("megatron", "torch_tp", "upstream-linear", "upstream-optimal")
VARIANTS: list[Variant] = [
    Variant("single"),
    *(Variant(lib, sp) for sp in (False, True) for lib in _LIBRARIES),
]


def upstream_linear_plan(sequence_parallel: bool) -> dict[str, upstream.ParallelStyle]:
    """The per-Linear plan of most upstream examples; torchtitan's plan with ``sequence_parallel``.

    Without sequence parallelism every column-parallel Linear annotates its own local input,
    so q, k and v (and w1, w3) each all-reduce their input gradient separately.
    """
    if not sequence_parallel:
        return {
            "tok_embeddings": upstream.RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attention.wq": upstream.ColwiseParallel(),
            "layers.*.attention.wk": upstream.ColwiseParallel(),
            "layers.*.attention.wv": upstream.ColwiseParallel(),
            "layers.*.attention.wo": upstream.RowwiseParallel(),
            "layers.*.feed_forward.w1": upstream.ColwiseParallel(),
            "layers.*.feed_forward.w2": upstream.RowwiseParallel(),
            "layers.*.feed_forward.w3": upstream.ColwiseParallel(),
            "output": upstream.ColwiseParallel(output_layouts=Replicate()),
        }
    return {
        "tok_embeddings": upstream.RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1)
        ),
        "layers.*.attention_norm": upstream.SequenceParallel(),
        "layers.*.attention": upstream.PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.wq": upstream.ColwiseParallel(),
        "layers.*.attention.wk": upstream.ColwiseParallel(),
        "layers.*.attention.wv": upstream.ColwiseParallel(),
        "layers.*.attention.wo": upstream.RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": upstream.SequenceParallel(),
        "layers.*.feed_forward": upstream.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w1": upstream.ColwiseParallel(),
        "layers.*.feed_forward.w2": upstream.RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": upstream.ColwiseParallel(),
        "norm": upstream.SequenceParallel(),
        "output": upstream.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def upstream_optimal_plan(sequence_parallel: bool) -> dict[str, upstream.ParallelStyle]:
    """``torch_tp.plans.llama.llama_plan`` written with the upstream classes."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, upstream.ParallelStyle] = {
        "tok_embeddings": upstream.RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream
        ),
        "layers.*.attention": upstream.PrepareModuleInput(
            input_layouts=(stream, None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=False,
        ),
        "layers.*.attention.wq": upstream.ColwiseParallel(),
        "layers.*.attention.wk": upstream.ColwiseParallel(),
        "layers.*.attention.wv": upstream.ColwiseParallel(),
        "layers.*.attention.wo": upstream.RowwiseParallel(output_layouts=stream),
        "layers.*.feed_forward": upstream.PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "layers.*.feed_forward.w1": upstream.ColwiseParallel(),
        "layers.*.feed_forward.w2": upstream.RowwiseParallel(output_layouts=stream),
        "layers.*.feed_forward.w3": upstream.ColwiseParallel(),
        "output": upstream.ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan.update(
            {
                "layers.*.attention_norm": upstream.SequenceParallel(use_local_output=True),
                "layers.*.attention_dropout": upstream.SequenceParallel(use_local_output=True),
                "layers.*.ffn_norm": upstream.SequenceParallel(use_local_output=True),
                "layers.*.ffn_dropout": upstream.SequenceParallel(use_local_output=True),
                "norm": upstream.SequenceParallel(use_local_output=True),
            }
        )
    return plan


def build_variant(
    variant: Variant, reference: Llama, mesh: DeviceMesh
) -> tuple[nn.Module, Callable[[], None] | None]:
    """A copy of ``reference`` run as ``variant``, and what to call after each backward."""
    sp = variant.sequence_parallel
    if variant.library == "megatron":
        model = megatron.MegatronLlama(reference, mesh.get_group(), sequence_parallel=sp)
        return model, model.reduce_norm_grads
    model = copy.deepcopy(reference)
    if variant.library == "torch_tp":
        torch_tp.parallelize_module(model, mesh, llama_plan(sequence_parallel=sp))
    elif variant.library == "upstream-linear":
        upstream.parallelize_module(model, mesh, upstream_linear_plan(sp))
    elif variant.library == "upstream-optimal":
        upstream.parallelize_module(model, mesh, upstream_optimal_plan(sp))
    elif variant.library != "single":
        raise ValueError(f"unknown variant {variant.name!r}")
    return model, None


# ---------------------------------------------------------------------------------------------
# Counting collectives


# kind -> the ops that perform it: the c10d ops are what eager torch.distributed calls dispatch
# to, the _c10d_functional ones are the functional collectives DTensor issues
_COLLECTIVES = {
    "all_reduce": "c10d.allreduce_ c10d.allreduce_coalesced_ _c10d_functional.all_reduce "
    "_c10d_functional.all_reduce_ _c10d_functional.all_reduce_coalesced "
    "_c10d_functional.all_reduce_coalesced_",
    "all_gather": "c10d._allgather_base_ c10d.allgather_ c10d.allgather_coalesced_ "
    "c10d.allgather_into_tensor_coalesced_ _c10d_functional.all_gather_into_tensor "
    "_c10d_functional.all_gather_into_tensor_coalesced "
    "_c10d_functional_autograd.all_gather_into_tensor",
    "reduce_scatter": "c10d._reduce_scatter_base_ c10d.reduce_scatter_ "
    "c10d.reduce_scatter_tensor_coalesced_ _c10d_functional.reduce_scatter_tensor "
    "_c10d_functional.reduce_scatter_tensor_coalesced "
    "_c10d_functional_autograd.reduce_scatter_tensor",
    "all_to_all": "c10d.alltoall_ c10d.alltoall_base_ _c10d_functional.all_to_all_single "
    "_c10d_functional_autograd.all_to_all_single",
    "broadcast": "c10d.broadcast_ _c10d_functional.broadcast",
    "scatter": "c10d.scatter_",
    "gather": "c10d.gather_",
    "reduce": "c10d.reduce_",
}


def _op(qualified_name: str) -> Any:
    """``torch.ops.<namespace>.<name>``, or ``None`` if this build of torch lacks it."""
    namespace, _, name = qualified_name.partition(".")
    return getattr(getattr(torch.ops, namespace), name, None)


# op overload packet -> kind
_KINDS: dict[Any, str] = {
    packet: kind
    for kind, names in _COLLECTIVES.items()
    for packet in map(_op, names.split())
    if packet is not None
}
_KIND_ORDER = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _tensor_bytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    )


@dataclass(frozen=True)
class Record:
    """One collective call: its kind, its size, the pass and the module that issued it.

    :attr:`CollectiveCounter.dtensor_ops` uses it too, for one op DTensor dispatched: the
    op's name as ``kind`` and ``nbytes`` 0.
    """

    kind: str
    nbytes: int
    backward: bool
    module: str


class CollectiveCounter(TorchDispatchMode):
    """Record every collective issued while active, whoever issues it.

    A dispatch mode sees the ops below autograd and below DTensor: the c10d ops that eager
    ``torch.distributed`` calls dispatch to (``c10d.allreduce_``, ``c10d._allgather_base_``,
    ...) and the functional collectives DTensor uses (``_c10d_functional.all_reduce``, ...),
    so hand-written and DTensor code are counted the same way. A call's size is its full
    buffer, as nccl-tests counts it: the tensor of an all-reduce, the gathered output of an
    all-gather, the input of a reduce-scatter (the largest tensor argument or result).
    Calls are attributed to the innermost module running (forward) or whose gradient is
    being computed (backward), as :class:`ModTracker` sees it. The ops that go through
    DTensor's dispatch are recorded too (:attr:`dtensor_ops`): they are where DTensor spends
    its per-op time.

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> with CollectiveCounter() as counter:
        ...     F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        >>> counter.summary()  # the Megatron-style baseline, 4 layers, batch 1 x seq 8
        {'all_reduce': (18, 36864), 'all_gather': (1, 32768)}
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Record] = []
        # every op DTensor dispatched (sharding propagation, the per-op cost of DTensor), as
        # a Record of the op's name; plain-tensor ops and collectives are not in it
        self.dtensor_ops: list[Record] = []
        # (module, in backward) for each module whose forward, or whose backward, is running,
        # in the order they started: the last one of the current pass is where a collective
        # happens (ModTracker's own set of modules has no order)
        self._active: list[tuple[str, bool]] = []
        # backward exits seen before their entry: a module returning its input unchanged
        # (dropout with p=0) has one tensor for both, and its exit hook fires first
        self._early_exits: dict[str, int] = defaultdict(int)
        self._seen_backward = False
        self._tracker = ModTracker()
        self._tracker.register_user_hooks(
            self._enter_forward, self._exit_forward, self._enter_backward, self._exit_backward
        )

    def __enter__(self) -> CollectiveCounter:
        self._active.clear()
        self._early_exits.clear()
        self._seen_backward = False
        self._tracker.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._tracker.__exit__(*exc)

    def _name(self, module: nn.Module) -> str:
        return self._tracker.get_known_fqn(module) or type(module).__name__

    def _enter_forward(self, module: nn.Module, *args: Any) -> None:
        self._active.append((self._name(module), False))

    def _exit_forward(self, module: nn.Module, *args: Any) -> None:
        self._remove((self._name(module), False))

    def _enter_backward(self, module: nn.Module, *args: Any) -> None:
        name = self._name(module)
        self._seen_backward = True
        if self._early_exits[name]:
            self._early_exits[name] -= 1
        else:
            self._active.append((name, True))

    def _exit_backward(self, module: nn.Module, *args: Any) -> None:
        entry = (self._name(module), True)
        if not self._remove(entry):
            self._early_exits[entry[0]] += 1

    def _remove(self, entry: tuple[str, bool]) -> bool:
        for i in range(len(self._active) - 1, -1, -1):
            if self._active[i] == entry:
                del self._active[i]
                return True
        return False

    def _module(self, backward: bool) -> str:
        for name, in_backward in reversed(self._active):
            if in_backward == backward:
                # drop the root's class name: "Llama.layers.0.attention" -> "layers.0.attention"
                return name.partition(".")[2] or "(root)"
        return "(after backward)" if self._seen_backward else "-"

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t is not torch.Tensor and hasattr(t, "__tensor_flatten__") for t in types):
            # a DTensor op: let DTensor run it first, so that the collectives of any
            # redistribution it needs come back through this mode (running it here would
            # run it with this mode switched off)
            if any(issubclass(t, DTensor) for t in types):
                backward = torch._C._current_graph_task_id() != -1
                name = str(getattr(func, "_overloadpacket", func))
                self.dtensor_ops.append(Record(name, 0, backward, self._module(backward)))
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _KINDS.get(getattr(func, "_overloadpacket", None))
        if kind is not None:
            sizes = [_tensor_bytes(a) for a in (*args, *kwargs.values(), out)]
            backward = torch._C._current_graph_task_id() != -1
            self.records.append(Record(kind, max(sizes), backward, self._module(backward)))
        return out

    def summary(self) -> dict[str, tuple[int, int]]:
        """``{kind: (calls, bytes)}``, in a fixed order of kinds."""
        return summarize(self.records)


def summarize(records: Sequence[Record]) -> dict[str, tuple[int, int]]:
    """``{kind: (calls, bytes)}`` of ``records``, in a fixed order of kinds."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        totals[r.kind][0] += 1
        totals[r.kind][1] += r.nbytes
    order = {k: i for i, k in enumerate(_KIND_ORDER)}
    kinds = sorted(totals, key=lambda k: (order.get(k, len(order)), k))
    return {k: (totals[k][0], totals[k][1]) for k in kinds}


# ---------------------------------------------------------------------------------------------
# Timing training steps


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, DTensor) or logits.shape[:2] != targets.shape:
        raise TypeError(
            f"expected full plain logits, found {type(logits).__name__} {tuple(logits.shape)}"
        )
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _make_step(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    after_backward: Callable[[], None] | None,
) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = _lm_loss(model(inputs), targets)
        loss.backward()
        if after_backward is not None:
            after_backward()
        return loss.detach()

    return step


@contextmanager
def _no_gc() -> Iterator[None]:
    """Keep the cyclic garbage collector from pausing inside a timed region."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _max_over_ranks(values: list[float]) -> list[float]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [max(column) for column in zip(*gathered, strict=True)]


def _partial_grads(model: nn.Module) -> int:
    """How many gradients are left as unreduced partial sums after backward."""
    return sum(
        1
        for p in model.parameters()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )


@dataclass
class Result:
    """What one variant measured at one size (the times are the max over ranks)."""

    variant: Variant
    times: list[float] = field(default_factory=list)
    loss_diff: float = 0.0
    records: list[Record] = field(default_factory=list)
    dtensor_ops: list[Record] = field(default_factory=list)
    partial_grads: int = 0

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.times)

    @property
    def min_ms(self) -> float:
        return 1000 * min(self.times)


@dataclass
class _Bench:
    """A variant's model, ready to step, and what it measured."""

    model: nn.Module
    step: Callable[[], torch.Tensor]
    here: bool  # whether this rank runs it (the single-device model runs on rank 0 only)
    result: Result


def _prepare(
    variant: Variant,
    reference: Llama,
    mesh: DeviceMesh,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    ref_loss: torch.Tensor,
    warmup: int,
) -> _Bench:
    """Build ``variant``, check its loss against the single-device one, warm it up."""
    result = Result(variant)
    here = variant.library != "single" or dist.get_rank() == 0
    if not here:
        return _Bench(nn.Module(), lambda: torch.zeros(()), False, result)
    model, after_backward = build_variant(variant, reference, mesh)
    step = _make_step(model, inputs, targets, after_backward)
    loss = step()
    model.zero_grad(set_to_none=True)
    if variant.library == "megatron":  # the baseline must be right to be a fair baseline
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    result.loss_diff = (loss - ref_loss).abs().item()
    for _ in range(warmup):
        step()
        model.zero_grad(set_to_none=True)
    return _Bench(model, step, True, result)


def bench_size(
    size: Size, variants: Sequence[Variant], mesh: DeviceMesh, args: argparse.Namespace
) -> list[Result]:
    """Run every variant at ``size`` on every rank; the results are complete on rank 0.

    The timed steps are interleaved, one step of each variant per round, so that a change in
    the machine's load during the run is shared by all variants instead of hitting one.
    """
    reference, inputs, targets = _reference(size, args.seed)
    with torch.no_grad():
        ref_loss = _lm_loss(reference(inputs), targets)
    benches = [
        _prepare(v, reference, mesh, inputs, targets, ref_loss, args.warmup) for v in variants
    ]
    times: list[list[float]] = [[] for _ in benches]
    with _no_gc():
        for _ in range(args.steps):
            for bench, elapsed in zip(benches, times, strict=True):
                dist.barrier()
                if not bench.here:
                    elapsed.append(0.0)  # the max over ranks is rank 0's time
                    continue
                start = time.perf_counter()
                bench.step()
                elapsed.append(time.perf_counter() - start)
                bench.model.zero_grad(set_to_none=True)  # outside the timed region
    for bench, elapsed in zip(benches, times, strict=True):
        bench.result.times = _max_over_ranks(elapsed)
        if bench.here:  # the collectives of one more step, untimed: counting adds overhead
            with CollectiveCounter() as counter:
                bench.step()
            bench.result.records = counter.records
            bench.result.dtensor_ops = counter.dtensor_ops
            bench.result.partial_grads = _partial_grads(bench.model)
    return [bench.result for bench in benches]


def _reference(size: Size, seed: int) -> tuple[Llama, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)  # same seed on every rank: the same weights and tokens everywhere
    reference = Llama(size.config())
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq + 1))
    return reference, tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------------------------------------
# Activation memory


def _storages(t: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``(address, bytes)`` of the storages holding ``t``'s data.

    Tensor subclasses that wrap others (DTensor, the functional collectives' async wrapper)
    have no storage of their own: look through them to the plain tensors inside.
    """
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    storage = t.untyped_storage()
    yield storage.data_ptr(), storage.nbytes()


def saved_activation_bytes(
    model: nn.Module, blocks: Sequence[nn.Module], inputs: torch.Tensor
) -> tuple[int, dict[str, int]]:
    """Bytes this rank saves for backward inside ``blocks`` during ``model(inputs)``.

    Every tensor autograd saves while one of ``blocks`` runs its forward is counted once per
    storage (views of one buffer count once, the whole buffer counts); parameters and
    buffers are not activations and are left out. Returns the total and a breakdown by the
    innermost module that saved each storage.
    """
    exclude = {ptr for t in (*model.parameters(), *model.buffers()) for ptr, _ in _storages(t)}
    seen: dict[int, int] = {}
    by_module: dict[str, int] = defaultdict(int)
    keep: list[torch.Tensor] = []  # keeps storages alive, so addresses stay unique
    depth = [0]
    tracker = ModTracker()

    def enter(module: nn.Module, inputs: Any) -> None:
        depth[0] += 1

    def leave(module: nn.Module, inputs: Any, output: Any) -> None:
        depth[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not depth[0]:
            return t
        for ptr, nbytes in _storages(t):
            if nbytes and ptr not in exclude and ptr not in seen:
                seen[ptr] = nbytes
                keep.append(t)
                parents = [p for p in tracker.parents if p != "Global"]
                module = max(parents, key=lambda n: (n.count("."), n)) if parents else "-"
                by_module[_layer_glob(module.partition(".")[2])] += nbytes
        return t

    handles = [b.register_forward_pre_hook(enter) for b in blocks]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(inputs)
    finally:
        for h in handles:
            h.remove()
    del out
    return sum(seen.values()), dict(by_module)


def _layer_glob(path: str) -> str:
    """``layers.3.attention`` -> ``layers.*.attention``: sum a breakdown over the layers."""
    head, dot, rest = path.partition(".")
    if head == "layers" and dot:
        return "layers.*." + rest.partition(".")[2] if "." in rest else "layers.*"
    return path


@dataclass
class MemoryRow:
    """Saved activation bytes of one variant (max over ranks)."""

    variant: Variant
    nbytes: int
    by_module: dict[str, int]


def bench_memory(
    size: Size, variants: Sequence[Variant], mesh: DeviceMesh, seed: int
) -> list[MemoryRow]:
    """Saved-for-backward bytes in the blocks of each variant, per rank, at ``size``."""
    reference, inputs, _ = _reference(size, seed)
    rows = []
    for variant in variants:
        model, _ = build_variant(variant, reference, mesh)
        nbytes, by_module = saved_activation_bytes(model, list(model.layers), inputs)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (nbytes, by_module))
        worst = max(gathered, key=lambda item: item[0])
        rows.append(MemoryRow(variant, worst[0], worst[1]))
    return rows


# ---------------------------------------------------------------------------------------------
# parallelize_module on a meta model with Llama-70B shapes


def llama70b_config(n_layers: int) -> LlamaConfig:
    """Llama-3-70B's shapes (hidden 8192, ffn 28672, 64 heads, 8 kv heads, vocab 128256)."""
    return LlamaConfig(
        dim=8192,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        hidden_dim=28672,
        max_seq_len=8192,
    )


def _parallelize(library: str, model: nn.Module, mesh: DeviceMesh) -> None:
    if library == "torch_tp":
        torch_tp.parallelize_module(model, mesh, llama_plan(sequence_parallel=True))
    else:
        upstream.parallelize_module(model, mesh, upstream_optimal_plan(True))


def _meta_model(n_layers: int) -> Llama:
    with torch.device("meta"):
        return Llama(llama70b_config(n_layers))


@dataclass
class ParallelizeTiming:
    """``parallelize_module`` seconds per library and layer count, and what was checked."""

    # (library, layers) -> the seconds of each call (max over ranks)
    seconds: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)


def _check_meta_result(model: Llama, mesh: DeviceMesh) -> str:
    """Describe whether a parallelized meta model has the expected sharded meta DTensors."""
    wq, w2 = model.layers[0].attention.wq.weight, model.layers[0].feed_forward.w2.weight
    n = mesh.size()
    ok = (
        isinstance(wq, DTensor)
        and isinstance(w2, DTensor)
        and wq.device.type == "meta"
        and wq.to_local().shape == (8192 // n, 8192)
        and w2.to_local().shape == (8192, 28672 // n)
    )
    return "ok" if ok else f"unexpected: wq {type(wq).__name__} {getattr(wq, 'placements', '')}"


def bench_parallelize(
    mesh: DeviceMesh, layer_counts: Sequence[int], repeats: int
) -> ParallelizeTiming:
    """Time ``parallelize_module`` on meta models, torch_tp and upstream, with the same plan.

    A first call on a one-layer model per library pays the lazy imports and is not timed; it
    also runs under :class:`CollectiveCounter` to show whether ``src_data_rank=0`` (the
    default of both) communicates meta tensors, and its result is checked.
    """
    timing = ParallelizeTiming()
    for library in ("torch_tp", "upstream"):
        model = _meta_model(1)
        with CollectiveCounter() as counter:
            _parallelize(library, model, mesh)
        timing.collectives[library] = len(counter.records)
        timing.checks[library] = _check_meta_result(model, mesh)
    for n_layers in layer_counts:
        for library in ("torch_tp", "upstream"):
            times = []
            for _ in range(repeats):
                model = _meta_model(n_layers)
                with _no_gc():
                    dist.barrier()
                    start = time.perf_counter()
                    _parallelize(library, model, mesh)
                    times.append(time.perf_counter() - start)
                del model
            timing.seconds[library, n_layers] = _max_over_ranks(times)
    return timing


# ---------------------------------------------------------------------------------------------
# Printing


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _fmt_collectives(records: Sequence[Record]) -> str:
    summary = summarize(records)
    if not summary:
        return "none"
    return ", ".join(f"{k}×{c} ({_fmt_bytes(b)})" for k, (c, b) in summary.items())


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |"]
        lines.append("|" + "|".join("---" for _ in headers) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row).rstrip() for row in rows]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.1f} at start"
    except OSError:
        return "load average unknown"


def _header(args: argparse.Namespace, world_size: int) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    lines = [
        f"machine: {_cpu_model()}, {cores} cores ({_load()}); torch {torch.__version__}; "
        f"backend {dist.get_backend()} (CPU), {world_size} ranks, {threads} thread(s) per rank; "
        f"the single-device run is one process with {threads} thread(s)",
        f"step = forward + cross-entropy loss + backward, no optimizer step; {args.warmup} "
        f"warm-up steps, then {args.steps} rounds of one timed step per variant (interleaved), "
        "each step started after a barrier and timed as the max over ranks",
        "ms/step = median (min) over the rounds; vs megatron = median over the Megatron-style "
        "baseline's with the same sequence-parallel setting (single: over megatron without SP)",
        "loss diff = |loss - single-device loss| on the same batch; DTensor ops = ops per step "
        "that went through DTensor's dispatch (sharding propagation: DTensor's per-op cost)",
        "collectives per step: counted on one extra untimed step by a TorchDispatchMode that "
        "sees both torch.distributed's c10d ops and DTensor's functional collectives; bytes = "
        "full buffer per call (all-reduce: the tensor; all-gather: the gathered output; "
        "reduce-scatter: the input), summed over the calls",
    ]
    title = f"torch_tp {torch_tp.__version__} benchmark: tensor parallel over {world_size} ranks"
    if args.markdown:
        return f"## {title}\n\n" + "\n".join(f"- {line}" for line in lines)
    return title + "\n" + "\n".join(lines)


def _section(title: str, description: str, body: str, markdown: bool) -> str:
    """A titled table: a Markdown heading and paragraph, or one plain line above it."""
    if markdown:
        return f"### {title}\n\n{description}\n\n{body}"
    return f"{title}: {description}\n\n{body}"


def _listing(lines: Sequence[str], markdown: bool) -> str:
    """Preformatted lines (a code block in Markdown)."""
    text = "\n".join(lines)
    return f"```text\n{text}\n```" if markdown else text


def _size_report(size: Size, results: Sequence[Result], markdown: bool) -> str:
    by_variant = {r.variant: r for r in results}
    rows = []
    for r in results:
        base = by_variant.get(r.variant.baseline)
        ratio = f"{r.median_ms / base.median_ms:.2f}" if base is not None else "-"
        collectives = _fmt_collectives(r.records)
        if r.partial_grads:
            collectives += (
                f"; {r.partial_grads} grads left Partial (DTensor all-reduces each one when "
                "the optimizer reads it: not counted here)"
            )
        timing = f"{r.median_ms:.2f} ({r.min_ms:.2f})"
        loss_diff, ops = f"{r.loss_diff:.1e}", str(len(r.dtensor_ops))
        rows.append([r.variant.name, timing, ratio, loss_diff, ops, collectives])
    headers = ["variant", "ms/step", "vs megatron", "loss diff", "DTensor ops"]
    headers.append("collectives per step")
    return _section(size.name, size.describe(), _table(headers, rows, markdown), markdown)


def _by_module_report(results: Sequence[Result], markdown: bool) -> str:
    lines = ["collectives per step by pass and module (kind×count, bytes):"]
    for r in results:
        groups: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for rec in r.records:
            key = ("bwd" if rec.backward else "fwd", rec.module, rec.kind)
            groups[key][0] += 1
            groups[key][1] += rec.nbytes
        lines.append(f"  {r.variant.name}:")
        if not groups:
            lines.append("    none")
        for (phase, module, kind), (count, nbytes) in groups.items():
            lines.append(f"    {phase}  {module:<28} {kind}×{count}  {nbytes} B")
    lines.append("")
    lines.append("DTensor ops per step by pass and module (summed over the layers):")
    for r in results:
        if not r.dtensor_ops:
            continue
        ops: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for rec in r.dtensor_ops:
            ops["bwd" if rec.backward else "fwd", _layer_glob(rec.module)][rec.kind] += 1
        lines.append(f"  {r.variant.name}: {len(r.dtensor_ops)}")
        for (phase, module), counts in ops.items():
            listed = ", ".join(f"{op.removeprefix('aten.')}×{n}" for op, n in counts.items())
            lines.append(f"    {phase}  {module:<28} {listed}")
    return _listing(lines, markdown)


def _memory_report(
    size: Size, rows: Sequence[MemoryRow], world_size: int, markdown: bool, by_module: bool
) -> str:
    single = next((r for r in rows if r.variant.library == "single"), None)
    target = 1.1 / world_size
    table_rows = []
    for r in rows:
        ratio = r.nbytes / single.nbytes if single else float("nan")
        meets = ""
        if r.variant.sequence_parallel and single:
            meets = "yes" if ratio <= target else "no"
        table_rows.append([r.variant.name, _fmt_bytes(r.nbytes), f"{ratio:.3f}", meets])
    headers = ["variant", "saved/rank", "vs single", f"≤ {target:.3f} (1/TP + 10%)"]
    description = (
        f"{size.name} ({size.describe()}); bytes saved for backward in the transformer blocks "
        "per rank (unique storages, no parameters; max over ranks)"
    )
    text = _section(
        "activation memory", description, _table(headers, table_rows, markdown), markdown
    )
    if by_module:
        lines = ["saved bytes by module (summed over the layers):"]
        for r in rows:
            lines.append(f"  {r.variant.name}:")
            for module, nbytes in sorted(r.by_module.items(), key=lambda kv: -kv[1]):
                lines.append(f"    {module:<36} {_fmt_bytes(nbytes)}")
        text += "\n\n" + _listing(lines, markdown)
    return text


def _ms_median_min(seconds: Sequence[float]) -> str:
    return f"{1000 * statistics.median(seconds):.0f} ({1000 * min(seconds):.0f})"


def _parallelize_report(
    timing: ParallelizeTiming, layer_counts: Sequence[int], repeats: int, markdown: bool
) -> str:
    rows = []
    for n in layer_counts:
        ours, theirs = timing.seconds["torch_tp", n], timing.seconds["upstream", n]
        ratio = min(ours) / min(theirs)
        rows.append([str(n), _ms_median_min(ours), _ms_median_min(theirs), f"{ratio:.2f}"])
    headers = ["layers", "torch_tp ms", "upstream ms", "torch_tp / upstream (min)"]
    description = (
        "a meta-device Llama with 70B shapes (dim 8192, ffn 28672, 64 heads / 8 kv heads, "
        "vocab 128256), the llama_plan(sequence_parallel=True) plan in each library; median "
        f"(min) of {repeats} calls, each the max over ranks, after one untimed warm-up call "
        "per library"
    )
    notes = [
        f"src_data_rank=0 (the default) in both: collectives issued on meta tensors: "
        f"torch_tp {timing.collectives['torch_tp']}, upstream {timing.collectives['upstream']} "
        "(distribute_tensor only takes the local chunk of a meta tensor)",
        f"result on meta (sharded meta DTensors of the right local shape): torch_tp "
        f"{timing.checks['torch_tp']}, upstream {timing.checks['upstream']}",
    ]
    body = _table(headers, rows, markdown) + "\n\n"
    body += "\n".join(f"- {note}" for note in notes) if markdown else "\n".join(notes)
    return _section("parallelize_module", description, body, markdown)


# ---------------------------------------------------------------------------------------------
# Running on every rank


def _select(only: str | None) -> list[Variant]:
    if not only:
        return list(VARIANTS)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [v for v in VARIANTS if any(fnmatch.fnmatchcase(v.name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(v.name for v in VARIANTS)
        raise ValueError(f"--only {only!r} matches no variant; the variants are: {names}")
    return chosen


def _run(args: argparse.Namespace) -> None:
    """The benchmark, on one rank of an initialized process group; rank 0 prints."""
    # deprecation notices of torch APIs the libraries call would interleave with the tables
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*deprecated.*")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    variants = _select(args.only)

    def emit(report: Callable[..., str], *report_args: Any) -> None:
        if rank == 0:  # only rank 0 holds complete results
            print(report(*report_args) + "\n", flush=True)

    emit(_header, args, world_size)
    for name in args.sizes:
        results = bench_size(SIZES[name], variants, mesh, args)
        emit(_size_report, SIZES[name], results, args.markdown)
        if args.by_module:
            emit(_by_module_report, results, args.markdown)
    if args.memory_size != "none":
        size = SIZES[args.memory_size]
        chosen = [Variant("single")] + [v for v in variants if v.library != "single"]
        rows = bench_memory(size, chosen, mesh, args.seed)
        emit(_memory_report, size, rows, world_size, args.markdown, args.by_module)
    if not args.skip_parallelize_timing:
        layers, repeats = args.parallelize_layers, args.parallelize_repeats
        timing = bench_parallelize(mesh, layers, repeats)
        emit(_parallelize_report, timing, layers, repeats, args.markdown)


def _set_threads(local_world_size: int) -> None:
    if "OMP_NUM_THREADS" not in os.environ:  # an explicit setting (torchrun's too) wins
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def _spawned_rank(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    spawned_rank(rank, _run, world_size, store_path, args)


def spawned_rank(
    rank: int,
    run: Callable[[argparse.Namespace], None],
    world_size: int,
    store_path: str,
    args: argparse.Namespace,
) -> None:
    """One rank spawned by a benchmark's ``main``: a gloo group over a file store, ``run(args)``
    in it, and an exit that skips the interpreter's teardown of torch (the benchmarks beside
    this one spawn their ranks with it too)."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    _set_threads(world_size)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown of torch: in about one run in five it aborted
    # a spawned rank ("terminate called without an active exception", SIGABRT) after every
    # table was printed, even with only the Megatron-style baseline run. Errors above still
    # propagate (and exit non-zero) as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun_rank(args: argparse.Namespace) -> None:
    torchrun_rank(_run, args)


def torchrun_rank(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """One rank under torchrun (or a caller's process group): ``run(args)`` in it."""
    _set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    try:
        run(args)
    finally:
        if own_group:
            dist.destroy_process_group()


def _sizes(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sizes must be among {', '.join(SIZES)}, found {text!r}")
    return names


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, found {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, found {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(
        prog="bench_tp.py",
        description="Time tensor-parallel training steps of the reference Llama: torch_tp, "
        "upstream torch.distributed.tensor.parallel and a hand-written Megatron-style "
        "baseline, with and without sequence parallelism.",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=list(SIZES),
        help="comma-separated model sizes to time steps at, or none (default: tiny,small)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps (default: %(default)s)")
    p.add_argument(
        "--only",
        help="comma-separated variant names or globs, e.g. 'megatron*,torch_tp+sp'; variants: "
        + ", ".join(v.name for v in VARIANTS),
    )
    p.add_argument(
        "--skip-parallelize-timing",
        action="store_true",
        help="skip timing parallelize_module on meta models with Llama-70B shapes",
    )
    p.add_argument(
        "--parallelize-layers",
        type=_ints,
        default=[10, 20, 40, 80],
        help="layer counts of the meta models (default: 10,20,40,80)",
    )
    p.add_argument(
        "--parallelize-repeats",
        type=int,
        default=5,
        help="timed parallelize_module calls per library and layer count (default: 5)",
    )
    p.add_argument(
        "--memory-size",
        choices=[*SIZES, "none"],
        default="small",
        help="size at which to measure saved activations, or none (default: %(default)s)",
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument(
        "--by-module",
        action="store_true",
        help="also list each variant's collectives and saved activations by module",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="ranks to spawn when not launched by torchrun (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and tokens (default: 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, spawn the ranks (unless under torchrun) and run; return the status."""
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.parallelize_repeats < 1:
        print(
            "error: --steps and --parallelize-repeats must be >= 1, --warmup >= 0",
            file=sys.stderr,
        )
        return 2
    try:
        _select(args.only)  # fail on a bad filter before spawning anything
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if _launched_by_torchrun():
        _torchrun_rank(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _spawned_rank,
            args=(args.world_size, os.path.join(tmp, "store"), args),
            nprocs=args.world_size,
            start_method="spawn",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
