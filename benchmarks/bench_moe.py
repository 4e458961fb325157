"""Benchmark mixture-of-experts training steps: torch_tp's experts styles vs transformers'.

One invocation spawns the ranks itself (default 2, CPU/gloo; or run it under ``torchrun``) and
prints, for each model size, one table row per variant of two models of the same shapes:

* the reference MoE Llama, ``torch_tp.models.MoELlama``: ``single`` (one process), and
  ``torch_tp.parallelize_module`` with ``torch_tp.plans.moe.moe_llama_plan``: ``tp``
  (tensor-parallel experts), ``tp+sp``, ``ep`` (expert parallelism; every rank has every
  token, so no dispatch) and ``ep+sp`` (each rank routes its sequence shard and the tokens go
  to their experts' ranks by all-to-all);
* transformers' ``MixtralForCausalLM`` loaded from a tiny random checkpoint: ``hf-single``,
  ``hf/torch_tp-tp`` (torch_tp with the model's own ``tp_plan``), ``hf/torch_tp-tp+sp``
  (with ``torch_tp.plans.hf.plan_for(model, sequence_parallel=True)``), ``hf/torch_tp-ep``
  (with its ``ep_plan``, see :func:`mixtral_plan`), and transformers' own
  ``from_pretrained(..., distributed_config=...)``: ``hf-tp`` (``tp_size=2``: its
  ``moe_tp_experts`` plan) and ``hf-ep`` / ``hf-ep-allreduce`` (``tp_size=2, ep_size=2``: its
  ``ep_dispatch_experts`` plan with ``ep_implementation="all_to_all"`` / ``"all_reduce"``).
  transformers needs ``accelerate`` for that; without it the rows say so.

At 4 ranks or more (``--world-size 4``, or ``torchrun --nproc-per-node 4``) the rows above run
over all the ranks on one dimension (``ep`` and ``ep+sp`` are EP of degree 4, ``hf-ep``
``tp_size=ep_size=4``; a size whose key/value heads do not split over the ranks runs with as
many as query heads, see :func:`fitted`), and rows on a 2-D ``("ep", "tp")`` mesh of
``(--ep, ranks / --ep)`` (default (2, 2)) follow:

* ``etp``, ``etp+sp``: the reference MoE Llama as test/test_moe_etp.py builds it, without
  FSDP2: ``moe_llama_plan(experts="tp", sequence_parallel=...)`` but for its experts on
  ``mesh["tp"]``, the experts ``ExpertTensorParallel`` on the 2-D mesh (whole experts over
  ``ep``, each one's matrices over ``tp``; under SP with ``output_layouts=Partial()``, the
  block reduce-scattering);
* ``hf/torch_tp-etp``: the Mixtral's own ``tp_plan`` but for the experts on ``mesh["tp"]``,
  its experts ``"ep_tp_experts"`` on the 2-D mesh; ``hf/torch_tp-etp+sp``: the same from
  ``plan_for(model, sequence_parallel=True)``, its experts ``ExpertTensorParallel`` with the
  plan's ``TensorParallelExperts``' ``output_layouts`` (``Partial()``) as ``etp+sp``'s;
* ``hf-ep-fsdp``: transformers' own EP with data parallelism, ``distributed_config={"tp_size":
  ranks / ep, "fsdp_size": ep, "ep_size": ranks, "ep_implementation": "all_to_all"}`` (its
  dense (fsdp, tp) mesh is laid out as the (ep, tp) one). transformers 5.23 has no experts
  split over both EP and TP (its experts are never tensor-parallel; ``ep_size`` must be a
  multiple of ``tp_size``): this and ``hf-ep`` are its nearest layouts.

The 2-D rows are data-parallel over ``ep``: the global batch is the other rows', each ``ep``
rank trains on its slice (its first loss, averaged over them, is compared with one device's).
Without FSDP2, their gradients are made the whole batch's as a DDP-like scheme would: the
experts' (which the combine all-to-all sums over the ``ep`` ranks' tokens) divided by the
``ep`` degree by a hook, every other gradient averaged over ``ep`` by one all-reduce of all of
them flattened (:func:`sync_dense_gradients`; it is in the step's time and in the ``other
collectives`` column). ``hf-ep-fsdp`` gets the same from transformers' FSDP2.

A step is forward, cross-entropy loss, backward and an AdamW step. Each row gives the median
time per step, the loss difference from the same model on one device, the collectives of one
step inside the MoE layers, forward and backward, checked against the minimum the issue asks
for, the other collectives, and memory per rank (see ``--help`` and benchmarks/README.md).

Example::

    $ python benchmarks/bench_moe.py                    # tiny and small, ~2 minutes on 2 cores
    $ python benchmarks/bench_moe.py --quick            # tiny, 2 steps: a smoke test
    $ python benchmarks/bench_moe.py --world-size 4     # and the (ep, tp) rows, (2, 2)
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
from torch_tp import ExpertTensorParallel
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.plans.hf import expert_parallel_plan, plan_for
from torch_tp.plans.moe import moe_llama_plan

__all__ = [
    "SIZES",
    "VARIANTS",
    "VARIANTS_2D",
    "MoECounter",
    "Size",
    "Variant",
    "build_variant",
    "expected_moe",
    "fitted",
    "is_minimum",
    "main",
    "mixtral_plan",
    "split_records",
    "sync_dense_gradients",
    "variants_for",
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
    minimum: str | None = None  # "tp", "tp+sp", "ep-replicated", "ep-dispatch", "etp", "etp+sp"
    # "1d": every rank of the run on one dimension; "ep,tp": the 2-D mesh of the 4-rank mode
    # (torch_tp), or transformers' (fsdp, tp) x (efsdp, ep) meshes with fsdp_size=2; both
    # data-parallel over their first dimension (each of its ranks its own part of the batch)
    mesh: str = "1d"

    @property
    def two_d(self) -> bool:
        return self.mesh == "ep,tp"


VARIANTS: list[Variant] = [
    Variant("single", "moe_llama", "single"),
    Variant("tp", "moe_llama", "torch_tp", "tp", minimum="tp"),
    Variant("tp+sp", "moe_llama", "torch_tp", "tp", True, minimum="tp+sp"),
    Variant("ep", "moe_llama", "torch_tp", "ep", minimum="ep-replicated"),
    Variant("ep+sp", "moe_llama", "torch_tp", "ep", True, minimum="ep-dispatch"),
    Variant("hf-single", "mixtral", "single"),
    Variant("hf/torch_tp-tp", "mixtral", "torch_tp", "tp", minimum="tp"),
    Variant("hf/torch_tp-tp+sp", "mixtral", "torch_tp", "tp", True, minimum="tp+sp"),
    Variant("hf/torch_tp-ep", "mixtral", "torch_tp", "ep", minimum="ep-replicated"),
    Variant("hf-tp", "mixtral", "transformers", "tp", minimum="tp"),
    Variant("hf-ep", "mixtral", "transformers", "ep", False, "all_to_all", "ep-dispatch"),
    Variant(
        "hf-ep-allreduce", "mixtral", "transformers", "ep", False, "all_reduce", "ep-replicated"
    ),
]

# The 4-rank mode's rows (any world size of 4 or more divisible by --ep): a 2-D mesh
VARIANTS_2D: list[Variant] = [
    Variant("etp", "moe_llama", "torch_tp", "etp", minimum="etp", mesh="ep,tp"),
    Variant("etp+sp", "moe_llama", "torch_tp", "etp", True, minimum="etp+sp", mesh="ep,tp"),
    Variant("hf/torch_tp-etp", "mixtral", "torch_tp", "etp", minimum="etp", mesh="ep,tp"),
    Variant(
        "hf/torch_tp-etp+sp", "mixtral", "torch_tp", "etp", True, minimum="etp+sp", mesh="ep,tp"
    ),
    Variant(
        "hf-ep-fsdp", "mixtral", "transformers", "ep", False, "all_to_all", "ep-dispatch", "ep,tp"
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
    * ``etp``: experts over ``(ep, tp)`` (``ExpertTensorParallel``), each ``ep`` rank with its
      own tokens: the dispatch and combine all-to-alls over ``ep`` and one all-reduce over
      ``tp`` of the experts' partial outputs, each way (the counts all-to-all, and the check
      that the ``tp`` ranks agree on the expert ids, apart).
    * ``etp+sp``: the same with the block's tokens sequence-sharded over ``tp``: the
      all-reduce becomes the block's all-gather and reduce-scatter, each way.
    """
    n = n_layers
    if minimum in ("etp", "etp+sp"):
        tp, _ = expected_moe("tp+sp" if minimum == "etp+sp" else "tp", n)
        both = {**tp, "all_to_all": 2 * n}
        return both, dict(both)
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


def _load_mixtral(checkpoint: str, variant: Variant, ep: int = 1) -> nn.Module:
    from transformers import MixtralForCausalLM

    kwargs: dict[str, Any] = {}
    if variant.library == "transformers":
        world = dist.get_world_size()
        config: dict[str, Any] = {"tp_size": world}
        if variant.two_d:
            # its dense mesh (fsdp, tp) is laid out as the (ep, tp) mesh: FSDP2 over ep data
            # ranks, attention tensor-parallel over tp, whole experts over all the ranks
            config = {"tp_size": world // ep, "fsdp_size": ep}
        if variant.experts == "ep":
            config.update(ep_size=world, ep_implementation=variant.ep_implementation)
        kwargs["distributed_config"] = config
    return MixtralForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **kwargs)


_MOE_LLAMA_EXPERTS = "layers.*.feed_forward.experts"
_MIXTRAL_EXPERTS = "model.layers.*.mlp.experts"


def build_variant(
    variant: Variant, models: _Models, mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None
) -> nn.Module:
    """``variant``'s model, parallelized (raises what its library raises).

    ``mesh``: the 1-D mesh of every rank; ``ep_tp_mesh``: the ``("ep", "tp")`` mesh of the
    2-D variants (``variant.two_d``). For torch_tp's 2-D variants the experts' gradient
    hooks divide by the ``ep`` degree (see :func:`sync_dense_gradients` for the rest)."""
    if variant.two_d and ep_tp_mesh is None:
        raise ValueError(f"variant {variant.name!r} needs the ('ep', 'tp') mesh")
    if variant.model == "moe_llama":
        model = MoELlama(models.moe_llama.config)
        model.load_state_dict(models.moe_llama.state_dict())
        if variant.library == "torch_tp" and variant.two_d:
            _parallelize_ep_tp(model, variant, ep_tp_mesh)
        elif variant.library == "torch_tp":
            plan = moe_llama_plan(
                experts=variant.experts, sequence_parallel=variant.sequence_parallel
            )
            torch_tp.parallelize_module(model, mesh, plan)
        return model
    if models.checkpoint is None:
        raise RuntimeError("transformers is not installed")
    ep = ep_tp_mesh["ep"].size() if variant.two_d else 1
    model = _load_mixtral(models.checkpoint, variant, ep)
    if variant.library == "torch_tp" and variant.two_d:
        _parallelize_ep_tp(model, variant, ep_tp_mesh)
    elif variant.library == "torch_tp":
        plan = mixtral_plan(model, variant.experts, variant.sequence_parallel)
        torch_tp.parallelize_module(model, mesh, plan)
    return model


def _parallelize_ep_tp(model: nn.Module, variant: Variant, mesh: DeviceMesh) -> None:
    """Dense layers, routers (and shared experts) tensor-parallel on ``mesh["tp"]``, the
    experts ``ExpertTensorParallel`` on the 2-D mesh (as test/test_moe_etp.py does, without
    FSDP2); the experts' gradients, which the combine all-to-all sums over the ``ep`` ranks'
    tokens, divided by the ``ep`` degree as the dense ones are averaged."""
    sp = variant.sequence_parallel
    if variant.model == "moe_llama":
        shared = model.config.shared_expert_hidden_dim is not None
        plan: dict[str, Any] = moe_llama_plan(
            experts="tp", shared_expert=shared, sequence_parallel=sp
        )
        experts_path = _MOE_LLAMA_EXPERTS
    else:
        plan, experts_path = mixtral_plan(model, "tp", sp), _MIXTRAL_EXPERTS
    tp_experts = plan.pop(experts_path)
    if isinstance(tp_experts, str):  # the Mixtral's own plan of names: its 2-D counterpart
        experts: Any = "ep_tp_experts"
    else:
        # where the block reduces the experts' output (under SP, or beside a shared expert)
        # they leave it a partial sum, as the plan's tensor-parallel experts say
        experts = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
    # the Mixtral's plans' entries for the experts' parameters (gate_up_proj, down_proj) go
    # with the experts
    plan = {k: v for k, v in plan.items() if ".experts" not in k}
    torch_tp.parallelize_module(model, mesh["tp"], plan)
    torch_tp.parallelize_module(model, mesh, {experts_path: experts})
    ep = mesh["ep"].size()
    for name, p in model.named_parameters():
        if _is_expert(name):
            p.register_hook(lambda grad: grad / ep)


def sync_dense_gradients(model: nn.Module, group: dist.ProcessGroup, size: int) -> None:
    """Average the gradients of every parameter but the experts' over ``group`` (the ``ep``
    ranks, which are data-parallel for them): one all-reduce of all of them flattened into one
    buffer, as DDP's one bucket would (each rank's local shard; the same layout on every
    ``ep`` rank)."""
    grads = [
        _local(p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None and not _is_expert(name)
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    for g, new in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(new.view_as(g))


def mixtral_plan(
    model: nn.Module, experts: str | None, sequence_parallel: bool = False
) -> dict[str, Any]:
    """The model's own plan of style names for torch_tp: its ``tp_plan``, or for ``"ep"`` its
    ``tp_plan`` with the experts' entries replaced by its ``ep_plan``'s
    (:func:`torch_tp.plans.hf.expert_parallel_plan`: ``ep_dispatch_experts`` is torch_tp's
    ``ExpertParallel(input_layouts=Replicate())``, ``grouped_gemm`` its ``Shard(0)``).

    With ``sequence_parallel`` (tensor-parallel experts only):
    ``torch_tp.plans.hf.plan_for(model, sequence_parallel=True)``, the residual stream
    sharded on the sequence, each MLP one region that gathers it once and reduce-scatters its
    output (its experts ``TensorParallelExperts(output_layouts=Partial())``)."""
    if sequence_parallel:
        if experts == "ep":
            raise ValueError("the Mixtral's expert-parallel plan has no sequence parallelism")
        return plan_for(model, sequence_parallel=True)
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
    inputs: torch.Tensor | None = None  # this rank's part of the batch
    targets: torch.Tensor | None = None


def _error_everywhere(message: str | None) -> str | None:
    """The first rank's error, if any rank failed (so that every rank skips the variant)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return next((m for m in gathered if m), None)


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= 240 else text[:237] + "..."


def _micro_batch(
    variant: Variant, models: _Models, ep_tp_mesh: DeviceMesh | None
) -> tuple[torch.Tensor, torch.Tensor, DeviceMesh | None]:
    """This rank's inputs and targets, and the mesh of the ranks that split the batch (the
    2-D variants' ``ep`` dimension, data-parallel: the same global batch as the other rows,
    each ``ep`` rank its slice of it) or ``None`` (every rank the whole batch)."""
    if not variant.two_d or ep_tp_mesh is None:
        return models.inputs, models.targets, None
    data = ep_tp_mesh["ep"]
    n, rank = data.size(), data.get_local_rank()
    batch = models.inputs.shape[0]
    if batch % n:
        raise ValueError(f"a batch of {batch} does not split over the {n} ep ranks")
    mine = slice(rank * batch // n, (rank + 1) * batch // n)
    return models.inputs[mine], models.targets[mine], data


def _prepare(
    variant: Variant,
    models: _Models,
    mesh: DeviceMesh,
    args: argparse.Namespace,
    ep_tp_mesh: DeviceMesh | None = None,
):
    result = Result(variant)
    here = variant.library != "single" or dist.get_rank() == 0
    bench = _Bench(variant, here, result=result)
    error = None
    if here:
        try:
            torch.manual_seed(args.seed)
            model = build_variant(variant, models, mesh, ep_tp_mesh)
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            inputs, targets, data = _micro_batch(variant, models, ep_tp_mesh)
            # torch_tp's 2-D rows average the dense gradients over ep themselves;
            # transformers' FSDP2 does in its backward
            sync = data is not None and variant.library == "torch_tp"

            def step() -> torch.Tensor:
                loss = _loss(_logits(model, variant, inputs), targets)
                loss.backward()
                if sync:
                    sync_dense_gradients(model, data.get_group(), data.size())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            with torch.no_grad():
                # the first loss, compared below with the one-device model's: the mean of
                # the micro-batches' (of equal sizes) where the ranks split the batch
                first = _loss(_logits(model, variant, inputs), targets)
                if data is not None:
                    dist.all_reduce(first, group=data.get_group())
                    first /= data.size()
                result.loss_diff = first.item()
            bench.step, bench.model, bench.optimizer = step, model, optimizer
            bench.inputs, bench.targets = inputs, targets
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
    size: Size,
    variants: Sequence[Variant],
    mesh: DeviceMesh,
    args: argparse.Namespace,
    ep_tp_mesh: DeviceMesh | None = None,
) -> list[Result]:
    """Run every variant at ``size``; the results are complete on rank 0."""
    models = _make_models(size, args.seed, any(v.model == "mixtral" for v in variants))
    try:
        benches = [_prepare(v, models, mesh, args, ep_tp_mesh) for v in variants]
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
                logits = _logits(bench.model, bench.variant, bench.inputs)
                _loss(logits, bench.targets).backward()
                mem = measure_memory(bench.model, bench.optimizer)
                bench.optimizer.zero_grad(set_to_none=True)
                mem.saved_activations = _saved_activations(bench.model, bench.variant, bench)
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


def _saved_activations(model: nn.Module, variant: Variant, bench: _Bench) -> int:
    """Bytes autograd saves for backward inside the blocks during one forward (of this
    rank's part of the batch)."""
    if variant.model == "mixtral":
        model = _HFLogits(model)  # called as model(inputs) -> logits, as the MoE Llama
    nbytes, _ = bench_tp.saved_activation_bytes(model, _blocks(model, variant), bench.inputs)
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


def variants_for(world_size: int, ep: int) -> list[Variant]:
    """The rows a run of ``world_size`` ranks has: the 1-D ones, and from 4 ranks on, where
    ``ep`` divides them, the 2-D ones (on ``(ep, world_size // ep)``)."""
    return list(VARIANTS) + (VARIANTS_2D if _two_d(world_size, ep) else [])


def _two_d(world_size: int, ep: int) -> bool:
    return world_size >= 4 and ep >= 1 and world_size % ep == 0


def _select(only: str | None, world_size: int = 2, ep: int = 2) -> list[Variant]:
    available = variants_for(world_size, ep)
    if not only:
        return available
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [v for v in available if any(fnmatch.fnmatchcase(v.name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(v.name for v in available)
        later = ", ".join(v.name for v in VARIANTS_2D)
        if not _two_d(world_size, ep):
            names += f" (and at 4 ranks or more, --ep dividing them: {later})"
        raise ValueError(f"--only {only!r} matches no variant; the variants are: {names}")
    return chosen


def fitted(size: Size, world_size: int) -> Size:
    """``size`` with as many key/value heads as query heads where its own do not split over
    ``world_size`` ranks (the 1-D rows shard attention's heads over every rank: tiny's 2 kv
    heads at 4 ranks), so that every row of one table runs the same model."""
    if size.n_kv_heads % world_size == 0 or size.n_heads % world_size:
        return size
    return dataclasses.replace(size, n_kv_heads=size.n_heads)


def _run(args: argparse.Namespace) -> None:
    """The benchmark on one rank of an initialized process group; rank 0 prints."""
    with warnings.catch_warnings():  # transformers' and torch's notices between the tables
        warnings.simplefilter("ignore")
        _run_quietly(args)


def _run_quietly(args: argparse.Namespace) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    variants = _select(args.only, world_size, args.ep)
    ep_tp_mesh = None
    if any(v.two_d for v in variants):
        shape = (args.ep, world_size // args.ep)
        ep_tp_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("ep", "tp"))
    if rank == 0:
        print(_header(args, world_size) + "\n", flush=True)
    for name in args.sizes:
        size = fitted(SIZES[name], world_size)
        results = bench_size(size, variants, mesh, args, ep_tp_mesh)
        if rank == 0:
            print(_size_report(size, results, args.markdown) + "\n", flush=True)
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
        description="Time mixture-of-experts training steps at 2 ranks (or more; at 4 and "
        "more also on an (ep, tp) mesh): torch_tp's tensor-parallel experts and expert "
        "parallelism on the reference MoE Llama, against one device and against "
        "transformers' own TP/EP on a Mixtral of the same shapes.",
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
        + ", ".join(v.name for v in VARIANTS)
        + "; at 4 ranks or more also "
        + ", ".join(v.name for v in VARIANTS_2D),
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
    p.add_argument(
        "--ep",
        type=int,
        default=2,
        help="at 4 ranks or more, the expert-parallel degree of the 2-D rows' (ep, tp) mesh, "
        "tp being the ranks / ep (default: %(default)s)",
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
    world_size = int(os.environ["WORLD_SIZE"]) if bench_tp._launched_by_torchrun() else None
    try:
        ranks = world_size or args.world_size
        if args.ep < 1 or (ranks >= 4 and ranks % args.ep):
            raise ValueError(f"--ep {args.ep} does not divide the {ranks} ranks")
        _select(args.only, ranks, args.ep)
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
