"""Pipeline stages from one model, for ``torch.distributed.pipelining``'s schedules.

:func:`split_model` cuts an unmodified model into stage modules along its repeated blocks:
the embedding on the first stage, the final norm and head on the last, the blocks balanced
by parameter count (or split where the caller says). A stage module holds the model's own
submodules under their own names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``),
so a tensor-parallel plan written for the whole model applies to it as it is, and its state
dict keys are the whole model's: checkpoints move between pipeline layouts.
:func:`pipeline_stages` picks this rank's stages, applies the tensor-parallel plan to each on
the tensor-parallel mesh, and wraps them in :class:`~torch.distributed.pipelining.PipelineStage`,
which is what the schedules (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
...) take. No schedule is written here.

Supported models (this first version): :class:`torch_tp.models.Llama` and its
mixture-of-experts variant, without sequence parallelism inside a stage.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["pipeline_stages", "split_model"]


class _LlamaStage(nn.Module):
    """A contiguous part of a :class:`torch_tp.models.Llama`: the embedding if it is the
    first stage, blocks ``[start, stop)``, the final norm and output projection if it is the
    last. Its submodules are the model's own, under the model's names."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config  # for plans that read the model's sizes (AttentionHeads)
        self.first, self.last = first, last
        if first:
            self.tok_embeddings = model.tok_embeddings
        # the blocks keep their indices as names: "layers.3" here is "layers.3" in the model
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, stop)})
        if last:
            self.norm = model.norm
            self.output = model.output
        # the rotary table, shared with the model (not a parameter, not saved)
        self.register_buffer("rope_cache", model.rope_cache, persistent=False)
        # with sequence parallelism the stages pass each other sequence shards: the rotary
        # table is sliced for the whole sequence
        self.sequence_shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the first stage takes token ids (bsz, seqlen); the others the hidden states
        seqlen = x.shape[1] if self.first else x.shape[1] * self.sequence_shards
        rope = self.rope_cache[:seqlen]
        h = self.tok_embeddings(x) if self.first else x
        for layer in self.layers.values():
            h = layer(h, rope)
        if not self.last:
            return h
        logits = self.output(self.norm(h))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _blocks(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    required = ("tok_embeddings", "norm", "output", "rope_cache")
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(model, n) for n in required):
        raise NotImplementedError(
            f"split_model supports torch_tp.models.Llama and its variants (tok_embeddings, a "
            f"ModuleList of blocks in layers, norm, output), found {type(model).__qualname__}"
        )
    return layers


def _balanced_split(blocks: Sequence[nn.Module], num_stages: int) -> list[int]:
    """Block indices where stages 1.. start, so that the stages' parameter counts are as
    even as contiguous runs allow (greedy on the running total)."""
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    total = sum(sizes)
    bounds, running, stage = [], 0, 1
    for i, size in enumerate(sizes):
        # start a new stage once this one has its share, leaving a block for each stage after
        remaining_blocks = len(sizes) - i
        remaining_stages = num_stages - stage
        if stage < num_stages and (
            running >= total * stage / num_stages or remaining_blocks == remaining_stages
        ):
            bounds.append(i)
            stage += 1
        running += size
    return bounds


def split_model(
    model: nn.Module, num_stages: int, *, split: Sequence[int] | None = None
) -> list[nn.Module]:
    """Cut ``model`` into ``num_stages`` stage modules along its blocks.

    Args:
        model: a :class:`torch_tp.models.Llama` (or a variant), not parallelized yet.
        num_stages: how many stages.
        split: the block index where each stage after the first starts (``num_stages - 1``
            increasing indices); default: balanced by parameter count.

    Returns:
        The stage modules, first to last. They share the model's submodules (nothing is
        copied); each stage's ``forward`` takes what the previous one returns (the first
        takes token ids, the last returns logits).

    Raises:
        ValueError: ``num_stages`` is not positive, exceeds the number of blocks, or
            ``split`` leaves a stage without blocks or is not increasing.
        NotImplementedError: the model's blocks cannot be found.
    """
    blocks = _blocks(model)
    n = len(blocks)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, found {num_stages!r}")
    if num_stages > n:
        raise ValueError(
            f"{num_stages} stages need at least one block each, and the model has {n} blocks"
        )
    if split is None:
        bounds = _balanced_split(blocks, num_stages)
    else:
        bounds = list(split)
        edges = [0, *bounds, n]
        if len(bounds) != num_stages - 1 or any(
            a >= b for a, b in zip(edges, edges[1:], strict=False)
        ):
            raise ValueError(
                f"split must give the first block of each stage after the first: "
                f"{num_stages - 1} increasing indices in (0, {n}), leaving every stage a "
                f"block, found {list(split)!r}"
            )
    edges = [0, *bounds, n]
    return [
        _LlamaStage(model, edges[s], edges[s + 1], first=s == 0, last=s == num_stages - 1)
        for s in range(num_stages)
    ]


def _plan_for_stage(plan: Mapping[str, Any], stage: nn.Module) -> dict[str, Any]:
    """The entries of a whole-model plan that name something on this stage: keys whose
    first segment names a module the stage does not hold (the embedding, the head) are left
    to the stages that hold it."""
    children = dict(stage.named_children())
    return {key: style for key, style in plan.items() if key == "" or key.split(".")[0] in children}


def pipeline_stages(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    stages_per_rank: int = 1,
    split: Sequence[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
    plan: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False,
    device: torch.device | None = None,
) -> list[Any]:
    """This rank's pipeline stages of ``model``, tensor-parallel inside, ready for a schedule.

    The model is cut into ``pp_mesh.size() * stages_per_rank`` stages (:func:`split_model`);
    pipeline rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` (the looped layout the
    interleaved schedules expect). With ``tp_mesh`` and ``plan``, each of this rank's stages
    is parallelized with the entries of ``plan`` that name something on it
    (:func:`torch_tp.parallelize_module`).

    Args:
        model: the whole model, the same on every rank (for example built on the meta device
            and materialized after, or after the same seed).
        pp_mesh: the 1-D pipeline-parallel mesh (``mesh["pp"]``).
        stages_per_rank: stages on each rank: 1 for ``ScheduleGPipe``/``Schedule1F1B``, 2 or
            more for ``ScheduleInterleaved1F1B``/``ScheduleLoopedBFS``.
        split: where stages start, as for :func:`split_model`.
        tp_mesh: the 1-D tensor-parallel mesh (``mesh["tp"]``), or ``None``.
        plan: the tensor-parallel plan of the whole model (e.g.
            :func:`torch_tp.plans.llama.llama_plan`); needs ``tp_mesh``.
        sequence_parallel: the plan shards the activations between blocks on the sequence
            (``llama_plan(sequence_parallel=True)``): stages then pass each other this
            rank's sequence shard. Default: ``False``.
        device: where the stages compute; default: the mesh's device.

    Returns:
        A list of :class:`torch.distributed.pipelining.PipelineStage`, one per stage of this
        rank: pass ``stages[0]`` to a single-stage schedule, the list to a multi-stage one.

    Raises:
        ValueError: a bad split or sizes (see :func:`split_model`), a plan without a mesh, or
            a mesh that is not 1-D.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("pp", "tp"))
        >>> stages = pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=llama_plan())
        >>> schedule = Schedule1F1B(stages[0], n_microbatches=8, loss_fn=loss_fn)
        >>> schedule.step(tokens, target=targets)  # on the first and last stages
    """
    from torch.distributed.pipelining import PipelineStage

    from torch_tp.core.api import parallelize_module

    for name, mesh in (("pp_mesh", pp_mesh), ("tp_mesh", tp_mesh)):
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"{name} must be a 1-D mesh, found dims {mesh.mesh_dim_names}")
    if plan is not None and tp_mesh is None:
        raise ValueError("a tensor-parallel plan needs tp_mesh to apply it on")
    if sequence_parallel and plan is None:
        raise ValueError("sequence_parallel describes the plan: pass the plan and tp_mesh")
    if (
        isinstance(stages_per_rank, bool)
        or not isinstance(stages_per_rank, int)
        or stages_per_rank < 1
    ):
        raise ValueError(f"stages_per_rank must be a positive int, found {stages_per_rank!r}")
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * stages_per_rank
    stage_modules = split_model(model, num_stages, split=split)
    if device is None:
        device = (
            torch.device(pp_mesh.device_type, torch.cuda.current_device())
            if (pp_mesh.device_type == "cuda")
            else torch.device(pp_mesh.device_type)
        )
    stages = []
    for index in range(rank, num_stages, pp):
        module = stage_modules[index]
        if sequence_parallel:
            module.sequence_shards = tp_mesh.size()
        if plan is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a key that matches nothing here is a bug
                parallelize_module(module, tp_mesh, _plan_for_stage(plan, module))
        stages.append(PipelineStage(module, index, num_stages, device, group=pp_mesh.get_group()))
    return stages
