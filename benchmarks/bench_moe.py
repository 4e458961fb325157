"""Benchmark mixture-of-experts training steps: torch_tp's experts styles vs transformers'.

One invocation spawns the ranks itself (default 2, CPU/gloo; or run it under ``torchrun``) and
prints, for each model size, one table row per variant of two models of the same shapes:

* the reference MoE Llama, ``torch_tp.models.MoELlama``: ``single`` (one process), and
  ``torch_tp.parallelize_module`` with ``torch_tp.plans.moe.moe_llama_plan``: ``tp``
  (tensor-parallel experts), ``tp+sp``, ``ep`` (expert parallelism; every rank has every
  token, so no dispatch) and ``ep+sp`` (each rank routes its sequence shard and the tokens go
  to their experts' ranks by all-to-all);
* transformers' ``MixtralForCausalLM`` loaded from a tiny random checkpoint: ``hf-single``,
  ``hf/torch_tp-tp`` (torch_tp with the model's own ``tp_plan``), ``hf/torch_tp-ep`` (with
  its ``ep_plan``, see :func:`mixtral_plan`), and transformers' own
  ``from_pretrained(..., distributed_config=...)``: ``hf-tp`` (``tp_size=2``: its
  ``moe_tp_experts`` plan) and ``hf-ep`` / ``hf-ep-allreduce`` (``tp_size=2, ep_size=2``: its
  ``ep_dispatch_experts`` plan with ``ep_implementation="all_to_all"`` / ``"all_reduce"``).
  transformers needs ``accelerate`` for that; without it the rows say so.

A step is forward, cross-entropy loss, backward and an AdamW step. Each row gives the median
time per step, the loss difference from the same model on one device, the collectives of one
step inside the MoE layers, forward and backward, checked against the minimum the issue asks
for, the other collectives, and memory per rank (see ``--help`` and benchmarks/README.md).

Example::

    $ python benchmarks/bench_moe.py                    # tiny and small, ~2 minutes on 2 cores
    $ python benchmarks/bench_moe.py --quick            # tiny, 2 steps: a smoke test
    $ python benchmarks/bench_moe.py --only 'single,tp*,ep*' --markdown
    $ torchrun --nproc-per-node 2 benchmarks/bench_moe.py --sizes tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
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
from bench_tp import CollectiveCounter, Record, summarize
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import torch_tp
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.plans.hf import expert_parallel_plan
from torch_tp.plans.moe import moe_llama_plan

__all__ = [
    "SIZES",
    "VARIANTS",
    "MoECounter",
    "Size",
    "Variant",
    "expected_moe",
    "is_minimum",
    "main",
    "mixtral_plan",
    "split_records",
]


# ---------------------------------------------------------------------------------------------
# What is measured


@dataclass(frozen=True)
class Size:
    """Shapes shared by the MoE Llama and the Mixtral, and the batch they run on."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_experts: int
    top_k: int
    expert_hidden: int
    batch: int
    seq: int
    vocab: int = 1024

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab,
            max_seq_len=self.seq,
            n_experts=self.n_experts,
            top_k=self.top_k,
            expert_hidden_dim=self.expert_hidden,
        )

    def mixtral_config(self) -> Any:
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=self.vocab,
            hidden_size=self.dim,
            intermediate_size=self.expert_hidden,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            num_local_experts=self.n_experts,
            num_experts_per_tok=self.top_k,
            max_position_embeddings=max(64, self.seq),
            tie_word_embeddings=False,
            attn_implementation="eager",
        )

    def describe(self) -> str:
        return (
            f"dim {self.dim}, {self.n_layers} layers, {self.n_heads} heads / {self.n_kv_heads} "
            f"kv heads, {self.n_experts} experts (top {self.top_k}, hidden {self.expert_hidden}), "
            f"vocab {self.vocab}; batch {self.batch} x seq {self.seq}"
        )


SIZES: dict[str, Size] = {
    "tiny": Size("tiny", 64, 2, 4, 2, n_experts=4, top_k=2, expert_hidden=64, batch=2, seq=16),
    "small": Size("small", 256, 4, 8, 4, n_experts=8, top_k=2, expert_hidden=512, batch=4, seq=128),
}


@dataclass(frozen=True)
class Variant:
    """One model run one way.

    ``minimum``: the layout whose minimal MoE-layer collectives the row is checked against
    (see :func:`expected_moe`); ``None`` for one device.
    """

    name: str
    model: str  # "moe_llama" or "mixtral"
    library: str  # "single", "torch_tp", "transformers"
    experts: str | None = None  # "tp", "ep"
    sequence_parallel: bool = False
    ep_implementation: str | None = None  # transformers' EP only
    minimum: str | None = None  # "tp", "tp+sp", "ep-replicated", "ep-dispatch"


VARIANTS: list[Variant] = [
    Variant("single", "moe_llama", "single"),
    Variant("tp", "moe_llama", "torch_tp", "tp", minimum="tp"),
    Variant("tp+sp", "moe_llama", "torch_tp", "tp", True, minimum="tp+sp"),
    Variant("ep", "moe_llama", "torch_tp", "ep", minimum="ep-replicated"),
    Variant("ep+sp", "moe_llama", "torch_tp", "ep", True, minimum="ep-dispatch"),
    Variant("hf-single", "mixtral", "single"),
    Variant("hf/torch_tp-tp", "mixtral", "torch_tp", "tp", minimum="tp"),
    Variant("hf/torch_tp-ep", "mixtral", "torch_tp", "ep", minimum="ep-replicated"),
    Variant("hf-tp", "mixtral", "transformers", "tp", minimum="tp"),
    Variant("hf-ep", "mixtral", "transformers", "ep", False, "all_to_all", "ep-dispatch"),
    Variant(
        "hf-ep-allreduce", "mixtral", "transformers", "ep", False, "all_reduce", "ep-replicated"
    ),
]


def expected_moe(minimum: str, n_layers: int) -> tuple[dict[str, int], dict[str, int]]:
    """The fewest collectives (kind -> calls) the MoE layers can issue, forward and backward.

    * ``tp``: tensor-parallel experts on replicated tokens: the partial outputs summed in one
      all-reduce forward, the tokens' (and routing weights') partial gradients in one
      all-reduce backward, per MoE layer.
    * ``tp+sp``: the same with the block's tokens sequence-sharded: the sequence gathered
      before the layer and the partial outputs reduce-scattered back after it (one
      all-gather and one reduce-scatter each way).
    * ``ep-replicated``: whole experts per rank, every rank holding every token: as ``tp``.
    * ``ep-dispatch``: whole experts per rank, each rank with its own tokens: two all-to-alls
      forward (dispatch, combine) and two backward. The small all-to-all of the token counts
      per expert that precedes the dispatch is reported on its own, not counted here.
    """
    n = n_layers
    if minimum in ("tp", "ep-replicated"):
        return {"all_reduce": n}, {"all_reduce": n}
    if minimum == "tp+sp":
        both = {"all_gather": n, "reduce_scatter": n}
        return both, dict(both)
    if minimum == "ep-dispatch":
        return {"all_to_all": 2 * n}, {"all_to_all": 2 * n}
    raise ValueError(f"unknown minimum {minimum!r}")


# ---------------------------------------------------------------------------------------------
# Counting collectives


_COUNTS = "all_to_all(counts)"
# an all-reduce of one or two integers: a check of the routing agreed over the ranks before
# the tokens move (expert ids out of range on any rank), not data of the layer
_FLAGS = "all_reduce(check)"


class MoECounter(CollectiveCounter):
    """``bench_tp.CollectiveCounter`` (c10d and functional collectives, by module and pass),
    with all-to-alls of integer tensors (the per-expert token counts exchanged before a
    dispatch) recorded under their own kind, ``all_to_all(counts)``, and all-reduces of one
    or two integers (checks agreed over the ranks) under ``all_reduce(check)``.

    The collectives of an MoE layer's output hooks (a plan's ``PrepareModuleOutput`` on the
    block: the reduce-scatter of its partial output, and that one's backward, the all-gather
    of the output's gradient) run after the module tracker has left the layer (its global
    hooks run before the module's own): they are attributed to the layer here, by hooks put
    around the layer's own output hooks."""

    def __enter__(self) -> MoECounter:
        super().__enter__()
        self._hooked: dict[int, list[Any]] = {}
        # after the tracker's own global pre-hook, which names the module
        self._pre_hook = nn.modules.module.register_module_forward_pre_hook(self._hook_layer)
        return self

    def __exit__(self, *exc: object) -> None:
        self._pre_hook.remove()
        for handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        super().__exit__(*exc)

    def _hook_layer(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._hooked:
            return
        name = self._name(module)
        if name.split(".")[-1] not in ("feed_forward", "mlp"):
            return
        # hooks registered now take part in this very call: one before the layer's own
        # output hooks, one after them
        self._hooked[id(module)] = [
            module.register_forward_hook(partial(self._outputs_begin, name), prepend=True),
            module.register_forward_hook(partial(self._outputs_end, name)),
        ]

    def _outputs_begin(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self._active.append((name, False))
        self._computed = output

    def _outputs_end(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self._remove((name, False))
        computed, self._computed = self._computed, None
        moved = isinstance(output, torch.Tensor) and output is not computed
        if moved and isinstance(computed, torch.Tensor) and computed.requires_grad:
            # backward: the layer's from the gradient of what its output hooks returned to
            # that of what it computed (then the tracker's own entry takes over)
            output.register_hook(lambda grad: self._active.append((name, True)))
            computed.register_hook(lambda grad: self._remove((name, True)) and None)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        before = len(self.records)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.records) > before and self.records[-1].kind == "all_to_all":
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors and not tensors[0].dtype.is_floating_point:
                self.records[-1] = dataclasses.replace(self.records[-1], kind=_COUNTS)
        elif len(self.records) > before and self.records[-1].kind == "all_reduce":
            # c10d's allreduce_ takes a list of tensors
            tensors = [
                t
                for a in args
                for t in (a if isinstance(a, (list, tuple)) else [a])
                if isinstance(t, torch.Tensor)
            ]
            if tensors and not tensors[0].dtype.is_floating_point and tensors[0].numel() <= 2:
                self.records[-1] = dataclasses.replace(self.records[-1], kind=_FLAGS)
        return out


def _in_moe_layer(record: Record) -> bool:
    # the MoE feed-forward of a block: MoELlama's "layers.N.feed_forward...", Mixtral's
    # "model.layers.N.mlp..."
    parts = record.module.split(".")
    return any(p in ("feed_forward", "mlp") for p in parts)


# ---------------------------------------------------------------------------------------------
# Building the variants


@dataclass
class _Models:
    """What every variant of one size starts from (the same on every rank)."""

    moe_llama: MoELlama
    checkpoint: str | None  # a saved tiny Mixtral, shared by the ranks
    inputs: torch.Tensor
    targets: torch.Tensor


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, DTensor):
        raise TypeError("expected full plain logits, found a DTensor")
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _logits(model: nn.Module, variant: Variant, inputs: torch.Tensor) -> torch.Tensor:
    if variant.model == "mixtral":
        return model(input_ids=inputs).logits
    return model(inputs)


def _load_mixtral(checkpoint: str, variant: Variant) -> nn.Module:
    from transformers import MixtralForCausalLM

    kwargs: dict[str, Any] = {}
    if variant.library == "transformers":
        world = dist.get_world_size()
        config: dict[str, Any] = {"tp_size": world}
        if variant.experts == "ep":
            config.update(ep_size=world, ep_implementation=variant.ep_implementation)
        kwargs["distributed_config"] = config
    return MixtralForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **kwargs)


def build_variant(variant: Variant, models: _Models, mesh: DeviceMesh) -> nn.Module:
    """``variant``'s model, parallelized (raises what its library raises)."""
    if variant.model == "moe_llama":
        model = MoELlama(models.moe_llama.config)
        model.load_state_dict(models.moe_llama.state_dict())
        if variant.library == "torch_tp":
            plan = moe_llama_plan(
                experts=variant.experts, sequence_parallel=variant.sequence_parallel
            )
            torch_tp.parallelize_module(model, mesh, plan)
        return model
    if models.checkpoint is None:
        raise RuntimeError("transformers is not installed")
    model = _load_mixtral(models.checkpoint, variant)
    if variant.library == "torch_tp":
        torch_tp.parallelize_module(model, mesh, mixtral_plan(model, variant.experts))
    return model


def mixtral_plan(model: nn.Module, experts: str | None) -> dict[str, Any]:
    """The model's own plan of style names for torch_tp: its ``tp_plan``, or for ``"ep"`` its
    ``tp_plan`` with the experts' entries replaced by its ``ep_plan``'s
    (:func:`torch_tp.plans.hf.expert_parallel_plan`: ``ep_dispatch_experts`` is torch_tp's
    ``ExpertParallel(input_layouts=Replicate())``, ``grouped_gemm`` its ``Shard(0)``)."""
    if experts != "ep":
        return dict(model.tp_plan)
    return expert_parallel_plan(model)


def _blocks(model: nn.Module, variant: Variant) -> list[nn.Module]:
    if isinstance(model, _HFLogits):
        model = model.inner
    return list(model.model.layers if variant.model == "mixtral" else model.layers)


# ---------------------------------------------------------------------------------------------
# Memory


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Memory:
    """Bytes per rank (this rank's shards only)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    expert_params: int = 0
    expert_params_total: int = 0  # the full (global) size of the experts' parameters
    saved_activations: int = 0

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


def _max_memory(per_rank: Sequence[Memory]) -> Memory:
    """The max over ranks of every field."""
    names = [f.name for f in dataclasses.fields(Memory)]
    return Memory(*(max(getattr(m, name) for m in per_rank) for name in names))


def _is_expert(name: str) -> bool:
    return ".experts." in name


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Memory:
    """Parameters, gradients and AdamW state on this rank, after a step."""
    mem = Memory()
    for name, p in model.named_parameters():
        local = _local(p)
        mem.params += _nbytes(local)
        if p.grad is not None:
            mem.grads += _nbytes(_local(p.grad))
        if _is_expert(name):
            mem.expert_params += _nbytes(local)
            mem.expert_params_total += p.numel() * p.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                mem.optimizer += _nbytes(_local(value))
    return mem


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass
class Result:
    """What one variant measured at one size (times: max over ranks)."""

    variant: Variant
    error: str | None = None
    times: list[float] = field(default_factory=list)
    loss_diff: float | None = None
    records: list[Record] = field(default_factory=list)
    comm_debug_total: int = 0
    comm_debug_counts: dict[str, int] = field(default_factory=dict)
    memory: Memory = field(default_factory=Memory)

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.times)

    @property
    def min_ms(self) -> float:
        return 1000 * min(self.times)


@dataclass
class _Bench:
    variant: Variant
    here: bool
    step: Callable[[], torch.Tensor] = lambda: torch.zeros(())
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    result: Result | None = None


def _error_everywhere(message: str | None) -> str | None:
    """The first rank's error, if any rank failed (so that every rank skips the variant)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return next((m for m in gathered if m), None)


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= 240 else text[:237] + "..."


def _prepare(variant: Variant, models: _Models, mesh: DeviceMesh, args: argparse.Namespace):
    result = Result(variant)
    here = variant.library != "single" or dist.get_rank() == 0
    bench = _Bench(variant, here, result=result)
    error = None
    if here:
        try:
            torch.manual_seed(args.seed)
            model = build_variant(variant, models, mesh)
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step() -> torch.Tensor:
                loss = _loss(_logits(model, variant, models.inputs), models.targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            with torch.no_grad():
                result.loss_diff = _loss(
                    _logits(model, variant, models.inputs), models.targets
                ).item()  # the first loss, compared below with the one-device model's
            bench.step, bench.model, bench.optimizer = step, model, optimizer
            for _ in range(args.warmup):
                step()
        except Exception as exc:  # a library that does not run here: report it in its row
            if os.environ.get("BENCH_MOE_TRACEBACK"):
                traceback.print_exc()
            error = _short_error(exc)
    result.error = _error_everywhere(error)
    if result.error:
        bench.here = False
    return bench


def _losses_on_rank0(benches: Sequence[_Bench]) -> None:
    """Turn each first loss into |loss - one-device loss of the same model| (rank 0's)."""
    reference = {
        b.variant.model: b.result.loss_diff
        for b in benches
        if b.variant.library == "single" and b.result.loss_diff is not None
    }
    for b in benches:
        base = reference.get(b.variant.model)
        if b.result.loss_diff is not None and base is not None:
            b.result.loss_diff = abs(b.result.loss_diff - base)
        else:
            b.result.loss_diff = None


def bench_size(
    size: Size, variants: Sequence[Variant], mesh: DeviceMesh, args: argparse.Namespace
) -> list[Result]:
    """Run every variant at ``size``; the results are complete on rank 0."""
    models = _make_models(size, args.seed, any(v.model == "mixtral" for v in variants))
    try:
        benches = [_prepare(v, models, mesh, args) for v in variants]
        _losses_on_rank0(benches)
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
        for bench, elapsed in zip(benches, times, strict=True):
            result = bench.result
            if result.error:
                continue
            result.times = bench_tp._max_over_ranks(elapsed)
            mem = Memory()
            if bench.here:
                with MoECounter() as counter:
                    bench.step()
                result.records = counter.records
                with CommDebugMode() as comm:
                    bench.step()
                result.comm_debug_total = comm.get_total_counts()
                result.comm_debug_counts = {
                    str(op): n for op, n in comm.get_comm_counts().items() if n
                }
                # the state after a step (gradients kept: zero_grad runs in the step, so
                # take one more backward), and the activations one forward saves
                loss = _loss(_logits(bench.model, bench.variant, models.inputs), models.targets)
                loss.backward()
                mem = measure_memory(bench.model, bench.optimizer)
                bench.optimizer.zero_grad(set_to_none=True)
                mem.saved_activations = _saved_activations(bench.model, bench.variant, models)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mem)
            result.memory = _max_memory(gathered)
    finally:
        dist.barrier()
        if dist.get_rank() == 0 and models.checkpoint is not None:
            shutil.rmtree(Path(models.checkpoint).parent, ignore_errors=True)
    return [b.result for b in benches]


class _HFLogits(nn.Module):
    """Mixtral's forward as ``model(input_ids) -> logits``, for the activation counter."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=inputs).logits


def _saved_activations(model: nn.Module, variant: Variant, models: _Models) -> int:
    """Bytes autograd saves for backward inside the blocks during one forward."""
    if variant.model == "mixtral":
        model = _HFLogits(model)  # called as model(inputs) -> logits, as the MoE Llama
    nbytes, _ = bench_tp.saved_activation_bytes(model, _blocks(model, variant), models.inputs)
    return nbytes


def _make_models(size: Size, seed: int, mixtral: bool) -> _Models:
    torch.manual_seed(seed)  # the same weights and tokens on every rank
    moe_llama = MoELlama(size.moe_config())
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq + 1))
    checkpoint = None
    if mixtral:
        try:
            from transformers import MixtralForCausalLM
        except ImportError:
            MixtralForCausalLM = None  # noqa: N806
        if MixtralForCausalLM is not None:
            # one checkpoint on disk, written by rank 0, that every variant loads
            paths: list[Any] = [None]
            if dist.get_rank() == 0:
                torch.manual_seed(seed)
                paths[0] = os.path.join(tempfile.mkdtemp(prefix="bench_moe_"), "mixtral")
                MixtralForCausalLM(size.mixtral_config()).save_pretrained(paths[0])
            dist.broadcast_object_list(paths, src=0)
            checkpoint = paths[0]
    return _Models(moe_llama, checkpoint, tokens[:, :-1], tokens[:, 1:])


# ---------------------------------------------------------------------------------------------
# Reports


def _fmt(counts: dict[str, tuple[int, int]]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k}×{c} ({bench_tp._fmt_bytes(b)})" for k, (c, b) in counts.items())


def split_records(records: Sequence[Record]) -> dict[str, dict[str, tuple[int, int]]]:
    """The MoE layers' collectives forward and backward (the counts all-to-alls and the
    agreed checks apart), and every other collective of the step."""
    apart = (_COUNTS, _FLAGS)
    moe = [r for r in records if _in_moe_layer(r) and r.kind not in apart]
    return {
        "fwd": summarize([r for r in moe if not r.backward]),
        "bwd": summarize([r for r in moe if r.backward]),
        "counts": summarize([r for r in records if r.kind == _COUNTS]),
        "checks": summarize([r for r in records if r.kind == _FLAGS]),
        "other": summarize([r for r in records if not _in_moe_layer(r) and r.kind not in apart]),
    }


def is_minimum(variant: Variant, records: Sequence[Record], n_layers: int) -> str:
    """``yes`` when the MoE layers issue exactly the minimal collectives, else ``no``."""
    if variant.minimum is None:
        return "-" if not records else "no"
    split = split_records(records)
    fwd, bwd = expected_moe(variant.minimum, n_layers)
    got_fwd = {k: c for k, (c, _) in split["fwd"].items()}
    got_bwd = {k: c for k, (c, _) in split["bwd"].items()}
    return "yes" if (got_fwd, got_bwd) == (fwd, bwd) else "no"


def _minimum_text(variant: Variant, n_layers: int) -> str:
    if variant.minimum is None:
        return "none"
    fwd, bwd = expected_moe(variant.minimum, n_layers)
    show = ", ".join
    return f"fwd {show(f'{k}×{c}' for k, c in fwd.items())} / " + (
        f"bwd {show(f'{k}×{c}' for k, c in bwd.items())}"
    )


def _time_row(r: Result, size: Size) -> list[str]:
    v = r.variant
    if r.error:
        return [v.name, "fails", "-", "-", "-", "-", "-", _minimum_text(v, size.n_layers), "-"]
    split = split_records(r.records)
    agree = "yes" if r.comm_debug_total == len(r.records) else f"no ({r.comm_debug_total})"
    return [
        v.name,
        f"{r.median_ms:.1f} ({r.min_ms:.1f})",
        "-" if r.loss_diff is None else f"{r.loss_diff:.1e}",
        _fmt(split["fwd"]),
        _fmt(split["bwd"]),
        _fmt(split["counts"]),
        _fmt(split["other"]),
        _minimum_text(v, size.n_layers),
        is_minimum(v, r.records, size.n_layers) + f"; CommDebugMode {agree}",
    ]


def _memory_row(r: Result) -> list[str]:
    v, m = r.variant, r.memory
    if r.error:
        return [v.name, "-", "-", "-", "-", "-"]
    fmt = bench_tp._fmt_bytes
    share = m.expert_params / m.expert_params_total if m.expert_params_total else float("nan")
    return [
        v.name,
        fmt(m.params),
        fmt(m.state),
        f"{fmt(m.expert_params)} of {fmt(m.expert_params_total)} ({share:.3f})",
        fmt(m.saved_activations),
        fmt(m.state + m.saved_activations),
    ]


def _by_module_report(results: Sequence[Result], markdown: bool) -> str:
    lines = ["collectives of one step by pass and module (kind×count, bytes):"]
    for r in results:
        if r.error:
            continue
        groups: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for rec in r.records:
            key = ("bwd" if rec.backward else "fwd", rec.module, rec.kind)
            groups[key][0] += 1
            groups[key][1] += rec.nbytes
        lines.append(f"  {r.variant.name}:")
        if not groups:
            lines.append("    none")
        for (phase, module, kind), (count, nbytes) in groups.items():
            lines.append(f"    {phase}  {module:<36} {kind}×{count}  {nbytes} B")
        listed = ", ".join(f"{op}×{n}" for op, n in r.comm_debug_counts.items()) or "none"
        lines.append(f"    CommDebugMode (another step): {listed}")
    return bench_tp._listing(lines, markdown)


def _size_report(size: Size, results: Sequence[Result], markdown: bool) -> str:
    table = bench_tp._table
    time_headers = [
        "variant",
        "ms/step",
        "loss diff",
        "MoE layers fwd",
        "MoE layers bwd",
        "counts all-to-all",
        "other collectives",
        "minimum (MoE layers)",
        "minimum?",
    ]
    mem_headers = [
        "variant",
        "params/rank",
        "params+grads+AdamW/rank",
        "expert params/rank (share)",
        "saved activations/rank",
        "state + activations",
    ]
    body = table(time_headers, [_time_row(r, size) for r in results], markdown)
    body += "\n\n" + table(mem_headers, [_memory_row(r) for r in results], markdown)
    errors = [f"{r.variant.name}: {r.error}" for r in results if r.error]
    if errors:
        body += "\n\n" + "\n".join(("- " if markdown else "") + e for e in errors)
    return bench_tp._section(size.name, size.describe(), body, markdown)


def _header(args: argparse.Namespace, world_size: int) -> str:
    try:
        import transformers

        hf = f"transformers {transformers.__version__}"
    except ImportError:
        hf = "transformers not installed"
    try:
        import accelerate

        hf += f", accelerate {accelerate.__version__}"
    except ImportError:
        hf += ", accelerate not installed"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"machine: {bench_tp._cpu_model()}, {cores} cores ({bench_tp._load()}); torch "
        f"{torch.__version__}; {hf}; backend {dist.get_backend()} (CPU), {world_size} ranks, "
        f"{torch.get_num_threads()} thread(s) per rank (one-device rows: rank 0 alone)",
        f"step = forward + cross-entropy loss + backward + AdamW step; {args.warmup} warm-up "
        f"steps, then {args.steps} rounds of one timed step per variant (interleaved), each "
        "started after a barrier and timed as the max over ranks; ms/step = median (min)",
        "loss diff = |first loss - the same model's one-device loss| (same weights and batch)",
        "collectives: one extra untimed step, counted by a TorchDispatchMode (c10d ops and "
        "functional collectives) by the module running them; 'MoE layers' = inside a block's "
        "feed_forward / mlp; the per-expert token counts all-to-all (integer tensor) apart; "
        "bytes = full buffer per call; CommDebugMode's total count on another step beside it",
        "memory per rank (max over ranks), this rank's shards only: parameters; parameters + "
        "gradients + AdamW state after a step; expert parameters (share of the full experts: "
        f"1/{world_size} expected when sharded); bytes autograd saves for backward in the "
        "blocks (unique storages); not the allocator's or the process's peak",
    ]
    title = f"torch_tp {torch_tp.__version__} MoE benchmark: {world_size} ranks"
    if args.markdown:
        return f"## {title}\n\n" + "\n".join(f"- {line}" for line in lines)
    return title + "\n" + "\n".join(lines)


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
    """The benchmark on one rank of an initialized process group; rank 0 prints."""
    with warnings.catch_warnings():  # transformers' and torch's notices between the tables
        warnings.simplefilter("ignore")
        _run_quietly(args)


def _run_quietly(args: argparse.Namespace) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    variants = _select(args.only)
    if rank == 0:
        print(_header(args, world_size) + "\n", flush=True)
    for name in args.sizes:
        results = bench_size(SIZES[name], variants, mesh, args)
        if rank == 0:
            print(_size_report(SIZES[name], results, args.markdown) + "\n", flush=True)
            if args.by_module:
                print(_by_module_report(results, args.markdown) + "\n", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    peaks: list[Any] = [None] * world_size
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        listed = ", ".join(f"{p:.0f} MiB" for p in peaks)
        print(f"process max RSS per rank over the whole run (all variants): {listed}", flush=True)


def _spawned_rank(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # transformers' distributed loading reads the torchrun variables
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size)):
        os.environ[name] = str(value)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    bench_tp._set_threads(world_size)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        _run(args)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as bench_tp: skip the interpreter's teardown of torch in spawned ranks


def _torchrun_rank(args: argparse.Namespace) -> None:
    bench_tp._set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    try:
        _run(args)
    finally:
        if own_group:
            dist.destroy_process_group()


def _sizes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sizes must be among {', '.join(SIZES)}, found {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(
        prog="bench_moe.py",
        description="Time mixture-of-experts training steps at 2 ranks: torch_tp's "
        "tensor-parallel experts and expert parallelism on the reference MoE Llama, against "
        "one device and against transformers' own TP/EP on a Mixtral of the same shapes.",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=list(SIZES),
        help="comma-separated model sizes (default: tiny,small)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (default: %(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: --sizes tiny --steps 2 --warmup 1",
    )
    p.add_argument(
        "--only",
        help="comma-separated variant names or globs, e.g. 'single,ep*'; variants: "
        + ", ".join(v.name for v in VARIANTS),
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument(
        "--by-module", action="store_true", help="also list each variant's collectives by module"
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
    if args.quick:
        args.sizes, args.steps, args.warmup = ["tiny"], 2, 1
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    try:
        _select(args.only)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if bench_tp._launched_by_torchrun():
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
