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

Supported models: :class:`torch_tp.models.Llama` and its mixture-of-experts variant (with
sequence parallelism inside the stages or without), and transformers' decoder models that
declare a ``base_model_pp_plan`` (the embedding, the blocks, the final norm: Llama, Mistral,
Qwen2/3, their MoE variants, ...). A transformers stage runs the base model's own
``forward`` over its blocks (the attention masks, sliding windows, rotary embeddings and
position ids are made there, as in the whole model) and hands the next stage the hidden
states, and the attention mask and position ids when the first stage was given them.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from torch_tp import _torch_compat as compat
from torch_tp.style.context import ContextParallel, sequence_positions

__all__ = ["CheckedSchedule", "build_schedule", "pipeline_stages", "split_model"]


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
        # with context parallelism (the cp mesh), each rank holds its part of each sequence:
        # the rotary table is read at those tokens' positions in the whole sequence
        self.context_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _dropout_of(self, x):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # the first stage takes token ids (bsz, seqlen); the others the hidden states
        seqlen = x.shape[1] if self.first else x.shape[1] * self.sequence_shards
        if self.context_mesh is None:
            rope = self.rope_cache[:seqlen]
        else:
            cp = self.context_mesh.size()
            positions = sequence_positions(seqlen * cp, self.context_mesh, device=x.device)
            rope = self.rope_cache[positions]
        h = self.tok_embeddings(x) if self.first else x
        for layer in self.layers.values():
            h = layer(h, rope)
        if not self.last:
            return h
        logits = self.output(self.norm(h))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


class _Skipped(nn.Identity):
    """Stands in, on a stage, for a module of the model that another stage runs (the final
    norm on a stage before the last, an embedding dropout after the first): it passes its
    input on, holds nothing, and no plan entry applies to it."""


def _view(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module``: the same class and attributes, and the same children,
    parameters and buffers, in containers of its own (replacing a child of the copy leaves
    ``module`` as it was)."""
    view = type(module).__new__(type(module))
    view.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if isinstance(value, dict):  # _modules, _parameters, _buffers, the hook dicts, ...
            view.__dict__[name] = type(value)(value)
        elif isinstance(value, set):  # _non_persistent_buffers_set
            view.__dict__[name] = set(value)
    return view


class _DecoderStage(nn.Module):
    """A contiguous part of a transformers decoder model, laid out by its
    ``base_model_pp_plan``: the modules before the blocks if it is the first stage, blocks
    ``[start, stop)``, the modules after them and the head (``_pp_plan``) if it is the last.

    It holds a view of the base model under the model's prefix (the same class, sharing
    every module it keeps) whose blocks are this stage's, under their indices in the model,
    and whose config says so (``num_hidden_layers``, ``layer_types``); the modules of other
    stages are :class:`_Skipped`. Its ``forward`` is the base model's own, entered with
    ``inputs_embeds`` after the first stage, so that every stage makes the causal mask, the
    rotary embeddings and the position ids the whole model makes."""

    def __init__(
        self,
        model: nn.Module,
        layout: _DecoderLayout,
        start: int,
        stop: int,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self._prefix = layout.prefix
        base = getattr(model, layout.prefix)
        view = _view(base)
        config = copy.copy(base.config)  # a shallow copy: only these fields differ
        config.num_hidden_layers = stop - start
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, (list, tuple)):
            config.layer_types = list(layer_types[start:stop])
        config.use_cache = False
        view.config = config
        blocks = nn.ModuleList()
        for i in range(start, stop):  # named by their index in the model: "layers.3"
            blocks.add_module(str(i), layout.blocks[i])
        setattr(view, layout.blocks_name, blocks)
        for name in layout.before if not first else ():
            setattr(view, name, _Skipped())
        for name in layout.after if not last else ():
            setattr(view, name, _Skipped())
        setattr(self, layout.prefix, view)
        for name in layout.heads if last else ():
            setattr(self, name, getattr(model, name))
        # The last stage runs the causal LM's own forward (what it does around the head:
        # scaling the hidden states, soft-capping or scaling the logits, casting them) on a
        # view holding this stage's modules; not a submodule: its modules are this stage's
        self._causal_lm: nn.Module | None = None
        if last:
            causal = _view(model)
            setattr(causal, layout.prefix, view)
            object.__setattr__(self, "_causal_lm", causal)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        with _dropout_of(self, x):
            return self._forward(x, attention_mask, position_ids)

    def _forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # the first stage takes token ids, the others the hidden states and whatever else the
        # first stage was given (a padding mask, position ids) to hand on
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        inputs.update(attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        if self._causal_lm is not None:
            return self._causal_lm(**inputs).logits
        hidden = getattr(self, self._prefix)(**inputs).last_hidden_state
        if position_ids is not None:
            if attention_mask is None:
                attention_mask = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
            return hidden, attention_mask, position_ids
        return hidden if attention_mask is None else (hidden, attention_mask)


# transformers architectures whose hidden states between blocks are not what a stage can
# hand on as ``inputs_embeds``, by model_type (found by test/test_pipeline.py, which splits
# every causal LM of the installed transformers that declares a base_model_pp_plan)
_NOT_REPRODUCED = "its stages, run one after the other, do not give the whole model's logits"
_NOT_SPLITTABLE = {
    "deepseek_v4": "its blocks take the token ids too, and carry hyper-connection streams",
    "gemma3n_text": "its blocks take per-layer inputs made from the token ids",
    "gemma4_text": "its blocks take per-layer inputs made from the token ids",
    "hy_v4": _NOT_REPRODUCED,
    "longcat_flash": _NOT_REPRODUCED,
}


class _DecoderLayout:
    """Where a transformers decoder's parts are, read from its ``base_model_pp_plan``."""

    def __init__(self, model: nn.Module) -> None:
        kind = type(model).__qualname__
        model_type = model.config.model_type
        if model_type in _NOT_SPLITTABLE:
            raise NotImplementedError(
                f"split_model cannot cut {kind} (model_type {model_type!r}) into pipeline "
                f"stages: {_NOT_SPLITTABLE[model_type]}"
            )
        self.prefix = getattr(model, "base_model_prefix", "") or "model"
        base = getattr(model, self.prefix, None)
        pp_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
        if not isinstance(base, nn.Module) or not pp_plan:
            raise NotImplementedError(
                f"split_model supports torch_tp.models.Llama and transformers causal LMs whose "
                f"config declares a base_model_pp_plan; {kind} "
                + ("declares none" if isinstance(base, nn.Module) else "has no base model")
            )
        names = list(pp_plan)
        lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
        missing = [n for n in names if not isinstance(getattr(base, n, None), nn.Module)]
        if missing or len(lists) != 1:
            raise NotImplementedError(
                f"split_model expects {kind}'s base_model_pp_plan {names} to name its modules, "
                f"one of them the ModuleList of blocks; "
                + (f"{missing} name no module" if missing else f"found ModuleLists {lists}")
            )
        self.blocks_name = lists[0]
        self.blocks: nn.ModuleList = getattr(base, self.blocks_name)
        index = names.index(self.blocks_name)
        self.before, self.after = names[:index], names[index + 1 :]
        heads = getattr(model, "_pp_plan", None) or {}
        self.heads = [n for n in heads if isinstance(getattr(model, n, None), nn.Module)]
        if not self.heads:
            raise NotImplementedError(
                f"split_model expects {kind} to be a causal LM with its head in _pp_plan "
                f"(e.g. lm_head); found {dict(heads)!r}"
            )
        tied = {id(p) for n in self.before for p in getattr(base, n).parameters()} & {
            id(p) for n in self.heads for p in getattr(model, n).parameters()
        }
        self.tied = bool(tied)


def _layout(model: nn.Module) -> _DecoderLayout | None:
    """``None`` for a :class:`torch_tp.models.Llama` (or variant); the layout of a
    transformers decoder; else raises."""
    layers = getattr(model, "layers", None)
    required = ("tok_embeddings", "norm", "output", "rope_cache")
    if isinstance(layers, nn.ModuleList) and all(hasattr(model, n) for n in required):
        return None
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        raise NotImplementedError(
            f"split_model supports torch_tp.models.Llama and its variants (tok_embeddings, a "
            f"ModuleList of blocks in layers, norm, output) and transformers causal LMs that "
            f"declare a base_model_pp_plan; found {type(model).__qualname__}"
        )
    return _DecoderLayout(model)


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
    layout = _layout(model)
    blocks = model.layers if layout is None else layout.blocks
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
    if layout is not None and layout.tied and num_stages > 1:
        raise NotImplementedError(
            f"{type(model).__qualname__} ties its input embedding to its output head "
            "(tie_word_embeddings): they would be on different stages, whose gradients "
            "nothing sums. Untie them (config.tie_word_embeddings=False) to pipeline it"
        )
    edges = [0, *bounds, n]
    return [
        (
            _LlamaStage(model, edges[s], edges[s + 1], s == 0, s == num_stages - 1)
            if layout is None
            else _DecoderStage(model, layout, edges[s], edges[s + 1], s == 0, s == num_stages - 1)
        )
        for s in range(num_stages)
    ]


def _plan_for_stage(plan: Mapping[str, Any], stage: nn.Module) -> dict[str, Any]:
    """The entries of a whole-model plan that name something on this stage: keys that name
    only modules (or parameters) other stages hold, the embedding or the head, are left to
    those stages."""
    from torch_tp.plan import key_matches_any

    skipped = {name for name, m in stage.named_modules() if isinstance(m, _Skipped)}
    paths = [n.split(".") for n, _ in stage.named_modules() if n and n not in skipped]
    paths += [n.split(".") for n, _ in stage.named_parameters()]
    return {key: style for key, style in plan.items() if key_matches_any(key, paths)}


def pipeline_stages(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    stages_per_rank: int = 1,
    split: Sequence[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
    plan: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False,
    exact_dropout: bool = False,
    device: torch.device | None = None,
    cp_mesh: DeviceMesh | None = None,
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
        exact_dropout: draw every dropout mask of the model's default random stream as the
            single-device model draws it for the whole batch, and keep the micro-batch's
            rows, so that training matches one device bit for bit (see
            :class:`_ExactDropout`; needs :func:`build_schedule`). It costs, per step and
            rank, drawing the whole model's masks once more. Default: ``False``.
        device: where the stages compute; default: the mesh's device.
        cp_mesh: the 1-D context-parallel mesh (``mesh["cp"]``), or ``None``. Each rank's
            stages then take its part of each sequence (:func:`torch_tp.shard_sequence`, the
            same on every pipeline rank), their blocks' attention is a ring over ``cp``
            (:class:`torch_tp.ContextParallel`) and their rotary embeddings are read at the
            tokens' true positions. The parameters' gradients are each rank's tokens' part:
            reduce them over ``cp`` as over data parallelism. :class:`torch_tp.models.Llama`
            only.

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

    from torch_tp.api import parallelize_module

    for name, mesh in (("pp_mesh", pp_mesh), ("tp_mesh", tp_mesh), ("cp_mesh", cp_mesh)):
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(
                f"{name} must be a 1-D mesh (e.g. mesh[{name[:2]!r}]), found a mesh with "
                f"dims {mesh.mesh_dim_names}"
            )
    if tp_mesh is not None:
        _check_orthogonal(pp_mesh, tp_mesh)
    if cp_mesh is not None:
        _check_orthogonal(pp_mesh, cp_mesh, "cp_mesh")
        if tp_mesh is not None:
            _check_orthogonal(cp_mesh, tp_mesh, "tp_mesh", "cp_mesh")
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
    if plan is not None:
        _check_plan_names_something(plan, stage_modules)
    if cp_mesh is not None and not isinstance(stage_modules[0], _LlamaStage):
        raise NotImplementedError(
            "cp_mesh inside pipeline stages supports torch_tp.models.Llama only; "
            f"{type(model).__qualname__}'s stages make their position ids from the length "
            "of the hidden states they receive"
        )
    dropout = None
    if exact_dropout and sequence_parallel:
        raise NotImplementedError(
            "exact_dropout with sequence_parallel: sequence-parallel dropout draws its masks "
            "itself, in the stages' order"
        )
    if exact_dropout:
        dropout = _ExactDropout(model, num_stages, split, range(rank, num_stages, pp), device)
    stages = []
    for index in range(rank, num_stages, pp):
        module = stage_modules[index]
        if sequence_parallel:
            if not isinstance(module, _LlamaStage):
                raise NotImplementedError(
                    "sequence_parallel inside pipeline stages supports torch_tp.models.Llama "
                    f"only; {type(model).__qualname__}'s forward makes its position ids and "
                    "masks from the length of the hidden states a stage receives"
                )
            module.sequence_shards = tp_mesh.size()
        if plan is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a key that matches nothing here is a bug
                parallelize_module(module, tp_mesh, _plan_for_stage(plan, module))
        if cp_mesh is not None:
            module.context_mesh = cp_mesh
            parallelize_module(module, cp_mesh, {"layers.*": ContextParallel()})
        if dropout is not None:  # plain attributes, not submodules
            module.__dict__.update(_exact_dropout=dropout, _stage_index=index)
        stage_class = PipelineStage if dropout is None else _chunked_stage_class()
        stages.append(stage_class(module, index, num_stages, device, group=pp_mesh.get_group()))
    return stages


def _check_orthogonal(
    pp_mesh: DeviceMesh, tp_mesh: DeviceMesh, name: str = "tp_mesh", first: str = "pp_mesh"
) -> None:
    """Two meshes (the pipeline's and the tensor-parallel one, by default) must be two
    different dimensions of one mesh: this rank is the only rank they share."""
    pp_ranks = set(pp_mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    if len(pp_ranks & tp_ranks) != 1:
        raise ValueError(
            f"{first} (dims {pp_mesh.mesh_dim_names}, ranks {sorted(pp_ranks)}) and {name} "
            f"(dims {tp_mesh.mesh_dim_names}, ranks {sorted(tp_ranks)}) must be two different "
            f"dimensions of one mesh, e.g. mesh[{first[:2]!r}] and mesh[{name[:2]!r}] of a mesh "
            f"with mesh_dim_names=('pp', 'dp', 'tp'); they share ranks "
            f"{sorted(pp_ranks & tp_ranks)}"
        )


def _check_plan_names_something(plan: Mapping[str, Any], stage_modules: list[nn.Module]) -> None:
    """Every key of the whole model's plan must name something on some stage (a typo would
    otherwise be left out on every stage, silently)."""
    named = {key for stage in stage_modules for key in _plan_for_stage(plan, stage)}
    unused = [key for key in plan if key not in named]
    if unused:
        children = sorted({n for stage in stage_modules for n, _ in stage.named_children()})
        raise ValueError(
            f"plan keys {unused} name no module or parameter of any pipeline stage (the "
            f"stages hold the model's modules under the model's names, from {children})"
        )


_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS")


class CheckedSchedule:
    """A ``torch.distributed.pipelining`` schedule whose every step checks its inputs on every
    rank of the step (pp x dp x tp) before any rank starts it (see :func:`build_schedule`).

    Attributes:
        schedule: the ``torch.distributed.pipelining`` schedule it runs.
        batch_size (int): the batch size every step takes (the micro-batches are
            ``batch_size // n_microbatches`` samples each).
    """

    def __init__(
        self,
        schedule: Any,
        stages: Sequence[Any],
        batch_size: int,
        n_microbatches: int,
        step_group: Any = None,
    ) -> None:
        self.schedule = schedule
        self.batch_size = batch_size
        self._first = any(stage.is_first for stage in stages)
        self._last = any(stage.is_last for stage in stages)
        self._group = stages[0].group  # the pipeline's: the first stage's input shape
        # every rank that runs the step: the input check is agreed over all of them
        self._step_group = dist.group.WORLD if step_group is None else step_group
        self._stages = [stage.submod for stage in stages]
        self._n_microbatches = n_microbatches
        dropouts = {id(d): d for st in stages if (d := _dropout_attr(st.submod)) is not None}
        self._dropout: _ExactDropout | None = next(iter(dropouts.values()), None)

    def step(
        self,
        *args: Any,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step of the schedule: forward and backward of every micro-batch.

        The same call works on every pipeline rank: pass the batch's inputs and ``target`` on
        every rank, or only where they are used (the inputs on the rank of the first stage,
        ``target`` and ``losses`` on the rank of the last); each rank hands the schedule
        what its stages take.

        Args:
            *args: the first stage's positional inputs (e.g. token ids), whole batch.
            target: what ``loss_fn`` compares the last stage's output with, whole batch.
            losses: a list that receives each micro-batch's loss, on the last stage's rank.
            **kwargs: the first stage's keyword inputs (e.g. ``attention_mask``).

        Returns:
            What the schedule's ``step`` returns (the merged output on the last stage's
            rank).

        Raises:
            ValueError: on every rank of the step (``step_group``: the pipeline, data- and
                tensor-parallel ranks), before any of them starts the schedule, when on any
                rank the first stage's inputs or the target do not have ``batch_size``
                samples in dimension 0, or the first stage's rank has no input or the last
                stage's no target. The message names each rank that found a problem and
                what it found; it is the same on every rank.
        """
        problem = ""
        if self._first:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if not tensors:
                problem = "the first stage's rank got no input tensor"
            for t in tensors:
                if t.dim() == 0 or t.shape[0] != self.batch_size:
                    problem = (
                        f"the first stage's input has shape {tuple(t.shape)}, expected "
                        f"{self.batch_size} samples in dimension 0"
                    )
        if self._last and not problem:
            if target is None:
                problem = "the last stage's rank got no target"
            elif target.dim() == 0 or target.shape[0] != self.batch_size:
                problem = (
                    f"the target has shape {tuple(target.shape)}, expected {self.batch_size} "
                    "samples in dimension 0"
                )
        if self._dropout is not None and not problem:
            problem = self._dropout.refusal(self._stages)
        _agree_on(problem, self._step_group)
        if self._dropout is not None:  # the first stage's input shape, on every rank
            shapes: list[Any] = [None] * dist.get_world_size(self._group)
            shape = tuple(args[0].shape) if self._first and args else None
            dist.all_gather_object(shapes, shape, group=self._group)
            shape = next(s for s in shapes if s is not None)
            self._dropout.begin_step(shape, self._n_microbatches)
        step_args = args if self._first else ()
        step_kwargs = dict(kwargs) if self._first else {}
        if self._last:
            step_kwargs.update(target=target, losses=losses)
        return self.schedule.step(*step_args, **step_kwargs)

    def __repr__(self) -> str:
        return f"CheckedSchedule({type(self.schedule).__name__}, batch_size={self.batch_size})"


def _agree_on(problem: str, group: Any) -> None:
    """Raise on every rank of ``group`` if any has a problem (one all-reduce of one number;
    the messages are gathered only when one is). ``group`` is every rank of the step: a
    tensor- or data-parallel peer of a rank that raised would otherwise start the schedule
    and wait in its first collective for that rank."""
    backend = dist.get_backend(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    flag = torch.tensor([1 if problem else 0], device=device)
    dist.all_reduce(flag, group=group)
    if not flag.item():
        return
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, problem, group=group)
    ranks = dist.get_process_group_ranks(group)
    found = "; ".join(f"rank {r}: {m}" for r, m in zip(ranks, messages, strict=True) if m)
    raise ValueError(
        f"the pipeline step's inputs are wrong, so none of the {len(ranks)} ranks of the step "
        f"started it: {found}"
    )


def build_schedule(
    stages: Sequence[Any],
    schedule: str | type,
    *,
    n_microbatches: int,
    batch_size: int,
    loss_fn: Any = None,
    step_group: dist.ProcessGroup | None = None,
    **schedule_kwargs: Any,
) -> CheckedSchedule:
    """A ``torch.distributed.pipelining`` schedule over this rank's stages, its inputs checked.

    torch splits a batch that the micro-batches do not divide into micro-batches of
    different sizes, which the stages' buffers (sized by the first micro-batch) do not fit:
    a rank fails in the middle of the schedule while the others wait in a receive. This
    builds the schedule after checking its sizes, and checks every step's inputs on every
    rank of the step before any of them starts it: the check is agreed over ``step_group``
    (by default the whole world: every pipeline, data- and tensor-parallel rank), so that one
    rank's bad batch is the same error on all of them, not a tensor-parallel peer waiting
    in the schedule for a rank that raised.

    Args:
        stages: this rank's stages, as :func:`pipeline_stages` returns them.
        schedule: a schedule class of ``torch.distributed.pipelining`` or its name
            (``"ScheduleGPipe"``, ``"Schedule1F1B"``, ``"ScheduleInterleaved1F1B"``,
            ``"ScheduleLoopedBFS"``, ...).

    Keyword Args:
        n_microbatches (int): micro-batches per step.
        batch_size (int): samples per step (of this data-parallel replica); a multiple of
            ``n_microbatches``.
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, for training.
        step_group: the process group of every rank that runs each step together (pp x dp
            x tp: all the ranks of the mesh the stages were built on); the step's input
            check is agreed over it, in one all-reduce of one number per step. Default: the
            default process group (the world), right whenever every process runs the
            pipeline. Pass the group of the whole mesh when the pipeline runs on only some
            of the world's ranks. It must hold the ranks of the stages' pipeline group.
        **schedule_kwargs: passed on to the schedule (e.g. ``scale_grads``).

    Returns:
        A :class:`CheckedSchedule`: call its ``step`` as the schedule's.

    Raises:
        ValueError: ``batch_size`` not a positive multiple of ``n_microbatches``, fewer
            micro-batches than stages on a single-stage-per-rank schedule, several stages
            for a schedule that takes one, an unknown schedule name, or a ``step_group``
            without the pipeline group's ranks. Every rank raises the same error: all of it
            depends on arguments every rank gets.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> stages = pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=llama_plan())
        >>> schedule = build_schedule(
        ...     stages, "Schedule1F1B", n_microbatches=8, batch_size=32, loss_fn=loss_fn
        ... )
        >>> schedule.step(tokens, target=targets)  # the same call on every rank
    """
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if isinstance(schedule, str):
        schedule_class = getattr(pipelining, schedule, None)
        if not isinstance(schedule_class, type) or not schedule.startswith("Schedule"):
            raise ValueError(
                f"unknown schedule {schedule!r}: expected a torch.distributed.pipelining "
                f"schedule class or its name, e.g. {', '.join(_SCHEDULES)}"
            )
    else:
        schedule_class = schedule
    stages = list(stages)
    if not stages:
        raise ValueError("build_schedule needs this rank's stages; got none")
    for name, value in (("n_microbatches", n_microbatches), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, found {value!r}")
    if batch_size % n_microbatches:
        raise ValueError(
            f"batch_size {batch_size} is not a multiple of n_microbatches {n_microbatches}: "
            f"the micro-batches would differ in size, and the stages' buffers are sized for "
            f"one of {batch_size // n_microbatches or 1} samples"
        )
    single = issubclass(schedule_class, PipelineScheduleSingle)
    if single and len(stages) != 1:
        raise ValueError(
            f"{schedule_class.__name__} runs one stage per rank, and this rank has "
            f"{len(stages)}: use a multi-stage schedule (e.g. ScheduleInterleaved1F1B), or "
            "pipeline_stages(..., stages_per_rank=1)"
        )
    num_stages = stages[0].num_stages
    if single and n_microbatches < num_stages:
        raise ValueError(
            f"{schedule_class.__name__} needs at least as many micro-batches as stages: "
            f"n_microbatches {n_microbatches} < {num_stages} stages"
        )
    group = dist.group.WORLD if step_group is None else step_group
    outside = set(dist.get_process_group_ranks(stages[0].group)) - set(
        dist.get_process_group_ranks(group)
    )
    if outside:
        raise ValueError(
            f"step_group must hold every rank of the stages' pipeline group: ranks "
            f"{sorted(outside)} are not in it (pass the group of the whole mesh the stages "
            "were built on, or leave step_group out for the world)"
        )
    built = schedule_class(
        stages[0] if single else stages,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        **schedule_kwargs,
    )
    return CheckedSchedule(built, stages, batch_size, n_microbatches, group)


# --------------------------------------------------------------------------- exact dropout


def _dropout_attr(module: nn.Module) -> _ExactDropout | None:
    return module.__dict__.get("_exact_dropout")


def _dropout_of(stage: nn.Module, x: torch.Tensor) -> Any:
    """The context a stage's forward of ``x`` runs in: its rank's exact dropout, or nothing
    (also for the schedule's shape inference, on meta tensors)."""
    dropout = _dropout_attr(stage)
    if dropout is None or x.device.type == "meta":
        return contextlib.nullcontext()
    return dropout.drawing(stage)


class _Recorder(TorchFunctionMode):
    """Records the dropouts that draw random numbers (training, ``p > 0``) of a meta run."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[tuple[int, ...], torch.dtype, float]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training = _dropout_args(args, kwargs)
            if training and p > 0:
                self.sites.append((tuple(x.shape), x.dtype, p))
            return x
        return func(*args, **kwargs)


def _dropout_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, float, bool]:
    names = ("input", "p", "training", "inplace")
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    if bound.get("inplace"):
        raise NotImplementedError("exact_dropout does not support in-place dropout")
    return bound["input"], float(bound.get("p", 0.5)), bool(bound.get("training", True))


class _ExactDropout(TorchFunctionMode):
    """Dropout masks in pipeline stages equal to those of the single-device model.

    The single-device model draws each dropout's mask for the whole batch from the default
    generator, one dropout after another through the model. A stage runs only some of the
    dropouts, a micro-batch at a time, in another order. So at the start of each step this
    rank replays the single-device draws for the whole model: from the generator's state
    (the same on every rank and as on one device, as in 1-D), it draws every dropout's
    whole-batch mask in the model's order, keeping the generator's state before each
    dropout of its own stages, and leaves the generator where the single-device model
    leaves it. The ``c``-th dropout call of a stage's micro-batch ``k`` (which the stage
    learns from the schedule's ``forward_one_chunk``) is then dropout ``c`` of its own: its
    mask is drawn again for the whole batch from the state kept, and micro-batch ``k``'s
    rows are used. Activation checkpointing is refused (every rank raises before the step):
    the backward recomputes the blocks last to first.

    The dropouts are found by running the model's stages, on the meta device, for the
    step's input shape. Only ``F.dropout`` on the default stream is redrawn: under
    ``torch_tp.random.fork()`` (the tensor-parallel stream) dropout is left as it is; a
    dropout whose input is not the whole model's activation apart from the batch (a
    head-sharded one) is refused, as is an in-place one. torch's metadata inference (one
    forward on the first step, for shapes only) draws nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        num_stages: int,
        split: Sequence[int] | None,
        own: Sequence[int],
        device: torch.device,
    ) -> None:
        super().__init__()
        # the model's structure on the meta device, for finding its dropouts
        memo: dict[int, Any] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (
                nn.Parameter(meta, tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else meta
            )
        self._meta_stages = split_model(copy.deepcopy(model, memo), num_stages, split=split)
        self._own = list(own)
        self._device = device
        self._input_shape: tuple[int, ...] | None = None
        self._sites: list[list[tuple[tuple[int, ...], torch.dtype, float]]] = []
        self._states: dict[tuple[int, int], torch.Tensor] = {}
        self._calls: dict[tuple[int, int], int] = {}
        self._begun = False
        self._micro = 0
        self._stage: int | None = None
        self._chunk: int | None = None

    def _find_sites(self, shape: tuple[int, ...]) -> None:
        out: Any = torch.zeros(shape, dtype=torch.long, device="meta")
        if isinstance(self._meta_stages[0], _DecoderStage):  # (see the dry-run report)
            out = (out, torch.ones(shape, dtype=torch.long, device="meta"))
        self._sites = []
        for stage in self._meta_stages:
            recorder = _Recorder()
            try:
                with recorder, torch.no_grad():
                    out = stage(*out) if isinstance(out, tuple) else stage(out)
            except Exception as error:
                raise NotImplementedError(
                    f"exact_dropout finds the model's dropouts by running it on the meta "
                    f"device, which failed: {type(error).__name__}: {error}"
                ) from error
            self._sites.append(recorder.sites)
        self._input_shape = shape

    def refusal(self, stages: Sequence[nn.Module]) -> str:
        """Why this rank's stages cannot draw exact masks, or ``""``: a block whose forward
        the backward recomputes (activation checkpointing) recomputes its dropouts in
        another order than the forward's, blocks last to first."""
        for stage in stages:
            for name, module in stage.named_modules():
                if compat.recomputed_in_backward(module):
                    return (
                        f"exact_dropout cannot redraw the masks of {name!r}, whose forward the "
                        "backward recomputes (activation checkpointing): pass "
                        "exact_dropout=False or leave the blocks unchecked"
                    )
        return ""

    def begin_step(self, input_shape: tuple[int, ...], n_microbatches: int) -> None:
        """Replay the step's whole-batch draws (see the class docstring)."""
        from torch_tp.random import _default_generator

        if input_shape != self._input_shape:
            self._find_sites(input_shape)
        generator = _default_generator(self._device.type)
        self._states = {}
        for index, sites in enumerate(self._sites):
            for j, (shape, dtype, p) in enumerate(sites):
                if index in self._own:
                    self._states[index, j] = generator.get_state()
                F.dropout(torch.ones(shape, dtype=dtype, device=self._device), p, training=True)
        self._calls = {}
        self._begun = True
        self._micro = input_shape[0] // n_microbatches

    @contextlib.contextmanager
    def drawing(self, stage: nn.Module) -> Iterator[None]:
        if not self._begun:
            raise RuntimeError(
                "exact_dropout needs each step to begin with the whole batch's draws: run the "
                "stages with build_schedule's schedule"
            )
        self._stage = stage.__dict__["_stage_index"]
        self._chunk = stage.__dict__.get("_chunk")
        try:
            with self:
                yield
        finally:
            self._stage = self._chunk = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.dropout or self._stage is None:
            return func(*args, **kwargs)
        x, p, training = _dropout_args(args, kwargs)
        from torch_tp.random import _default_generator, get_rng_tracker

        tracker = get_rng_tracker()
        if not training or p == 0 or (tracker is not None and tracker._depth):
            return func(*args, **kwargs)  # no draw, or the tensor-parallel stream's
        if compat.current_graph_task_id() != -1:  # not found by refusal() before
            raise NotImplementedError(
                "exact_dropout cannot redraw a dropout that the backward recomputes"
            )
        if self._chunk is None:
            # a forward outside the schedule's micro-batches: torch's metadata inference on
            # the first step, which only reads shapes; it must not draw
            return x.clone()
        sites = self._sites[self._stage]
        key = (self._stage, self._chunk)
        j = self._calls.get(key, 0)  # the j-th dropout of this micro-batch
        self._calls[key] = j + 1
        if j >= len(sites):
            raise RuntimeError(
                f"exact_dropout: stage {self._stage} drew more dropouts for micro-batch "
                f"{self._chunk} than its {len(sites)} of the meta run"
            )
        shape, dtype, site_p = sites[j]
        if tuple(x.shape[1:]) != shape[1:] or x.shape[0] != self._micro or p != site_p:
            raise NotImplementedError(
                f"exact_dropout: dropout {j} of stage {self._stage} has input shape "
                f"{tuple(x.shape)} and p={p}, the whole model's is {shape} and p={site_p} "
                f"(with micro-batches of {self._micro}): a dropout on a sharded activation "
                "has no single-device mask to match"
            )
        generator = _default_generator(self._device.type)
        saved = generator.get_state()
        generator.set_state(self._states[self._stage, j])
        noise = F.dropout(torch.ones(shape, dtype=dtype, device=x.device), p, training=True)
        generator.set_state(saved)
        rows = slice(self._chunk * self._micro, (self._chunk + 1) * self._micro)
        return x * noise[rows]


_CHUNKED_STAGE: type | None = None


def _chunked_stage_class() -> type:
    """A :class:`~torch.distributed.pipelining.PipelineStage` that tells its module which
    micro-batch its forward computes, for :class:`_ExactDropout`."""
    global _CHUNKED_STAGE
    if _CHUNKED_STAGE is None:
        from torch.distributed.pipelining import PipelineStage

        class _ChunkedStage(PipelineStage):
            def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                with _chunk(self.submod, fwd_chunk_id):
                    return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        _CHUNKED_STAGE = _ChunkedStage
    return _CHUNKED_STAGE


@contextlib.contextmanager
def _chunk(module: nn.Module, chunk_id: int) -> Iterator[None]:
    module.__dict__["_chunk"] = chunk_id
    try:
        yield
    finally:
        module.__dict__["_chunk"] = None
