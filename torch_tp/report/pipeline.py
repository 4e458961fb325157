"""The dry-run report for pipelines: stages, memory, bubble and traffic, before anything runs.

:func:`pipeline_report` cuts a model built on the meta device into the stages
:func:`torch_tp.pipeline.split_model` would make, runs them one after the other on meta
tensors for one micro-batch, and reports per stage its modules, parameter bytes per rank
(with a tensor-parallel plan, what :func:`torch_tp.report.plan_report` says each rank holds),
the bytes its forward saves for the backward per micro-batch and at the schedule's peak, and
what it sends to the next stage; for the schedule, its bubble fraction and the point-to-point
bytes of one step; and the problems: sizes the schedule refuses, stages badly unbalanced.
No process group is needed and nothing is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import Shard
from torch.overrides import TorchFunctionMode

from torch_tp._torch_compat import tree_leaves
from torch_tp.report.render import Problem, format_bytes, format_table

__all__ = ["PipelineReport", "StageRow", "pipeline_report"]

# schedules this report knows: stages per rank they run, and how many micro-batches' saved
# activations a stage holds at its peak
_SINGLE = ("ScheduleGPipe", "Schedule1F1B")
_MULTI = ("ScheduleInterleaved1F1B",)
# stages whose parameters (or activations) differ by more than this factor are unbalanced
_IMBALANCE = 1.25


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage.

    Attributes:
        index: the stage's index, first to last.
        rank: the pipeline rank that runs it (``index % pp_degree``).
        modules: the model's modules it holds, e.g. ``"tok_embeddings, layers.0-1"``.
        parameters: its parameter count.
        parameter_bytes: its parameter bytes on one rank of its tensor-parallel group (the
            largest shard).
        activation_bytes: the bytes its forward saves for the backward, one micro-batch,
            before tensor parallelism divides them (an upper bound per rank).
        in_flight: micro-batches whose saved bytes it holds at the schedule's peak.
        output_bytes: what it exchanges with the next stage per micro-batch, per rank: its
            output forward and the output's gradient back (with sequence parallelism, this
            rank's sequence shard; a transformers decoder's padding mask, forward only);
            0 for the last stage.
    """

    index: int
    rank: int
    modules: str
    parameters: int
    parameter_bytes: int
    activation_bytes: int
    in_flight: int
    output_bytes: int

    @property
    def peak_activation_bytes(self) -> int:
        """Saved activation bytes at the schedule's peak."""
        return self.activation_bytes * self.in_flight


@dataclass
class PipelineReport:
    """What :func:`pipeline_report` found; ``print(report)`` shows it as tables.

    Attributes:
        model: the model's class name.
        schedule: the schedule's class name.
        pp_degree, stages_per_rank, tp_degree: the layout.
        n_microbatches, micro_batch, seq_len: the step's sizes.
        stages: one :class:`StageRow` per stage.
        bubble: the schedule's idle fraction, ``(p - 1) / (v * m + p - 1)``.
        p2p_bytes: point-to-point bytes one step sends, over every boundary between stages
            (activations forward, their gradients backward), per tensor-parallel rank.
        problems: errors (the schedule or the sizes would fail), warnings (it would run
            badly) and notes.
    """

    model: str
    schedule: str
    pp_degree: int
    stages_per_rank: int
    tp_degree: int
    n_microbatches: int
    micro_batch: int
    seq_len: int
    stages: list[StageRow]
    bubble: float
    p2p_bytes: int
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        """The problems of severity ``"error"``."""
        return [p for p in self.problems if p.severity == "error"]

    def rank_bytes(self, rank: int) -> tuple[int, int]:
        """Parameter bytes and peak saved activation bytes of pipeline rank ``rank``."""
        mine = [s for s in self.stages if s.rank == rank]
        return sum(s.parameter_bytes for s in mine), sum(s.peak_activation_bytes for s in mine)

    def __str__(self) -> str:
        lines = [
            f"Pipeline report: {self.model}, {self.schedule}, pp {self.pp_degree} x "
            f"{self.stages_per_rank} stage(s) per rank, TP degree {self.tp_degree}, "
            f"{self.n_microbatches} micro-batches of {self.micro_batch} x {self.seq_len} tokens",
            "",
            "Stages",
        ]
        lines += format_table(
            [
                "stage",
                "rank",
                "modules",
                "parameters/rank",
                "saved/micro-batch",
                "in flight",
                "peak saved",
                "p2p/micro-batch",
            ],
            [
                [
                    str(s.index),
                    str(s.rank),
                    s.modules,
                    format_bytes(s.parameter_bytes),
                    format_bytes(s.activation_bytes),
                    str(s.in_flight),
                    format_bytes(s.peak_activation_bytes),
                    format_bytes(s.output_bytes) if s.output_bytes else "-",
                ]
                for s in self.stages
            ],
            right={0, 1, 3, 4, 5, 6, 7},
        )
        lines += [
            "",
            f"Bubble: {self.bubble:.1%} of the step idle",
            f"Point-to-point: {format_bytes(self.p2p_bytes)} per step",
            "",
            "Problems" if self.problems else "Problems: none",
        ]
        lines += [f"  {p.severity}: {p.where}: {p.message}" for p in self.problems]
        return "\n".join(lines)


class _FusedAttentionSaves(torch.autograd.Function):
    """On the meta device: attention that saves for backward what a fused kernel saves (q, k,
    v as given, the output and each query's log-sum-exp), whatever kernel meta dispatch would
    pick (grouped-query attention decomposes into the math path there, whose ``S x S``
    probabilities no fused kernel keeps)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedAttention(TorchFunctionMode):
    """Meta-device ``F.scaled_dot_product_attention`` calls as :class:`_FusedAttentionSaves`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            q, k, v = args[:3]
            return _FusedAttentionSaves.apply(q, k, v)
        return func(*args, **kwargs)


def pipeline_report(
    model: nn.Module,
    *,
    pp_degree: int,
    n_microbatches: int,
    batch_size: int,
    seq_len: int,
    schedule: str = "Schedule1F1B",
    stages_per_rank: int = 1,
    split: list[int] | None = None,
    tp_degree: int = 1,
    plan: Any = None,
    sequence_parallel: bool = False,
) -> PipelineReport:
    """Report what a pipeline of ``model`` would hold, idle and send, without running it.

    Args:
        model (:class:`nn.Module`): the whole model on the meta device (a
            :class:`torch_tp.models.Llama` or a transformers decoder, as
            :func:`torch_tp.pipeline.split_model` takes).

    Keyword Args:
        pp_degree (int): pipeline ranks.
        n_microbatches (int): micro-batches per step.
        batch_size (int): samples per step (of one data-parallel replica).
        seq_len (int): tokens per sample.
        schedule (str): ``"ScheduleGPipe"``, ``"Schedule1F1B"`` or
            ``"ScheduleInterleaved1F1B"``. Default: ``"Schedule1F1B"``.
        stages_per_rank (int): 1, or more for the interleaved schedule. Default: 1.
        split: where stages start, as for :func:`~torch_tp.pipeline.split_model`.
        tp_degree (int): tensor-parallel ranks inside each stage. Default: 1.
        plan: the whole model's tensor-parallel plan (with ``tp_degree`` > 1).
        sequence_parallel (bool): the plan shards the activations between stages on the
            sequence. Default: ``False``.

    Returns:
        A :class:`PipelineReport`.

    Raises:
        ValueError: the model is not on the meta device, a size is not a positive int, or
            the schedule is not one of those above.

    Example::
        >>> # xdoctest: +SKIP("prints a table")
        >>> with torch.device("meta"):
        ...     model = Llama(LlamaConfig(n_layers=8))
        >>> print(pipeline_report(model, pp_degree=4, n_microbatches=8, batch_size=16,
        ...                       seq_len=2048, tp_degree=2, plan=llama_plan()))
    """
    from torch_tp.pipeline import split_model

    _check_arguments(
        model,
        schedule,
        pp_degree=pp_degree,
        n_microbatches=n_microbatches,
        batch_size=batch_size,
        seq_len=seq_len,
        stages_per_rank=stages_per_rank,
        tp_degree=tp_degree,
    )
    p, v, m = pp_degree, stages_per_rank, n_microbatches
    problems = _size_problems(
        schedule, p, v, m, batch_size, seq_len, tp_degree, sequence_parallel=sequence_parallel
    )
    micro = max(1, batch_size // m)
    stage_modules = split_model(model, p * v, split=split)
    rows, stage_problems = _stage_rows(
        stage_modules,
        schedule,
        p,
        v,
        m,
        micro,
        seq_len,
        tp_degree,
        plan=plan,
        sequence_parallel=sequence_parallel,
    )
    problems += stage_problems

    bubble = (p - 1) / (v * m + p - 1)
    # every boundary, every micro-batch: the activation forward, its gradient backward
    p2p = sum(row.output_bytes * m for row in rows)
    problems += _imbalance_problems(rows)
    # The bubble is only worth a warning when nothing worse is wrong, so this check comes
    # after every other problem is known.
    problems += _bubble_problems(schedule, bubble, m, problems)
    return PipelineReport(
        model=type(model).__name__,
        schedule=schedule,
        pp_degree=p,
        stages_per_rank=v,
        tp_degree=tp_degree,
        n_microbatches=m,
        micro_batch=micro,
        seq_len=seq_len,
        stages=rows,
        bubble=bubble,
        p2p_bytes=p2p,
        problems=problems,
    )


def _check_arguments(
    model: nn.Module,
    schedule: str,
    *,
    pp_degree: int,
    n_microbatches: int,
    batch_size: int,
    seq_len: int,
    stages_per_rank: int,
    tp_degree: int,
) -> None:
    """Raise :class:`ValueError` for a size that is not a positive int, an unknown schedule
    or a model that is not on the meta device, in that order."""
    for name, value in (
        ("pp_degree", pp_degree),
        ("n_microbatches", n_microbatches),
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("stages_per_rank", stages_per_rank),
        ("tp_degree", tp_degree),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, found {value!r}")
    if schedule not in (*_SINGLE, *_MULTI):
        raise ValueError(
            f"pipeline_report knows the schedules {', '.join((*_SINGLE, *_MULTI))}; "
            f"found {schedule!r}"
        )
    real = [
        n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"
    ]
    if real:
        raise ValueError(
            f"pipeline_report takes a model on the meta device; {real[0]!r} is not. Build it "
            'under `with torch.device("meta"):`'
        )


def _size_problems(
    schedule: str,
    p: int,
    v: int,
    m: int,
    batch_size: int,
    seq_len: int,
    tp_degree: int,
    *,
    sequence_parallel: bool,
) -> list[Problem]:
    """The sizes the schedule refuses: stages per rank, micro-batches, batch and sequence."""
    problems: list[Problem] = []
    if schedule in _SINGLE and v != 1:
        problems.append(Problem("error", schedule, f"runs one stage per rank, not {v}"))
    if schedule in _MULTI and v < 2:
        problems.append(Problem("warning", schedule, "with one stage per rank it is 1F1B"))
    if batch_size % m:
        problems.append(
            Problem(
                "error",
                "batch",
                f"batch_size {batch_size} is not a multiple of n_microbatches {m}: the "
                "micro-batches would differ in size",
            )
        )
    if schedule in _SINGLE and m < p:
        problems.append(
            Problem("error", schedule, f"needs at least {p} micro-batches (one per stage), got {m}")
        )
    if schedule in _MULTI:
        rounds = max(1, m // p)
        if m % rounds:
            problems.append(
                Problem(
                    "error",
                    schedule,
                    f"needs a number of micro-batches that is a multiple of {rounds} "
                    f"(max(1, {m} // {p})), got {m}",
                )
            )
    if sequence_parallel and seq_len % tp_degree:
        problems.append(
            Problem(
                "error",
                "sequence",
                f"seq_len {seq_len} does not divide by the TP degree {tp_degree} (sequence "
                "parallelism shards it)",
            )
        )
    return problems


def _stage_rows(
    stage_modules: list[nn.Module],
    schedule: str,
    p: int,
    v: int,
    m: int,
    micro: int,
    seq_len: int,
    tp_degree: int,
    *,
    plan: Any,
    sequence_parallel: bool,
) -> tuple[list[StageRow], list[Problem]]:
    """Run the stages one after the other on meta tensors for one micro-batch: a row per
    stage, and the problems the stages' tensor-parallel plans have."""
    out: Any = _first_inputs(stage_modules[0], micro, seq_len)
    rows: list[StageRow] = []
    problems: list[Problem] = []
    for index, stage in enumerate(stage_modules):
        stage_input = out
        out, saved = _run_stage(stage, stage_input)
        sent = 0
        if index < len(stage_modules) - 1:
            sent = _sent_bytes(out, tp_degree, sequence_parallel=sequence_parallel)
        parameter_bytes, plan_problems = _stage_parameter_bytes(
            stage,
            index,
            stage_input,
            micro,
            seq_len,
            tp_degree,
            plan=plan,
            sequence_parallel=sequence_parallel,
        )
        problems += plan_problems
        rank = index % p
        rows.append(
            StageRow(
                index=index,
                rank=rank,
                modules=_describe(stage),
                parameters=sum(q.numel() for q in {id(q): q for q in stage.parameters()}.values()),
                parameter_bytes=parameter_bytes,
                activation_bytes=saved,
                in_flight=_in_flight(schedule, p, v, m, rank),
                output_bytes=sent,
            )
        )
        out = out.detach() if isinstance(out, torch.Tensor) else out
    return rows, problems


def _run_stage(stage: nn.Module, stage_input: Any) -> tuple[Any, int]:
    """Run one stage forward on meta tensors: its output, and the bytes it saves for the
    backward."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(tensor, nn.Parameter):  # weights are counted as parameters
            saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.enable_grad(), saved_tensors_hooks(pack, lambda t: t), _FusedAttention():
        out = stage(*stage_input) if isinstance(stage_input, tuple) else stage(stage_input)
    return out, saved


def _sent_bytes(out: Any, tp_degree: int, *, sequence_parallel: bool) -> int:
    """The bytes a stage exchanges with the next per micro-batch, per rank."""
    sent = 0
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            shard = tp_degree if sequence_parallel and t.is_floating_point() else 1
            # an activation is sent forward and its gradient back; a mask forward
            both_ways = 2 if t.is_floating_point() else 1
            sent += both_ways * t.numel() * t.element_size() // shard
    return sent


def _stage_parameter_bytes(
    stage: nn.Module,
    index: int,
    stage_input: Any,
    micro: int,
    seq_len: int,
    tp_degree: int,
    *,
    plan: Any,
    sequence_parallel: bool,
) -> tuple[int, list[Problem]]:
    """A stage's parameter bytes on one rank, and its plan's problems (other than notes)."""
    from torch_tp.pipeline import _plan_for_stage
    from torch_tp.report.plan import plan_report

    stage_plan = _plan_for_stage(plan, stage) if plan is not None else {}
    if plan is not None and tp_degree > 1:
        inputs = stage_input if isinstance(stage_input, tuple) else (stage_input,)
        stage_report = plan_report(
            stage,
            stage_plan,
            tp_degree,
            batch_size=micro,
            seq_len=seq_len,
            example_inputs=lambda b, s, inputs=inputs: inputs,
            # after the first stage, under sequence parallelism: this rank's shard
            input_layout=Shard(1) if sequence_parallel and index else None,
        )
        problems = [
            Problem(q.severity, f"stage {index}: {q.where}", q.message)
            for q in stage_report.problems
            if q.severity != "note"
        ]
        return stage_report.per_rank_bytes, problems
    parameter_bytes = sum(
        t.numel() * t.element_size() for t in {id(q): q for q in stage.parameters()}.values()
    )
    return parameter_bytes, []


def _imbalance_problems(rows: list[StageRow]) -> list[Problem]:
    """Warnings for stages whose parameters or saved activations differ too much."""
    problems: list[Problem] = []
    for what, values in (
        ("parameters", [r.parameters for r in rows]),
        ("saved activations", [r.activation_bytes for r in rows]),
    ):
        low, high = min(values), max(values)
        if low and high / low > _IMBALANCE:
            problems.append(
                Problem(
                    "warning",
                    "stages",
                    f"unbalanced {what}: stage {values.index(high)} holds {high / low:.2f}x "
                    f"stage {values.index(low)}'s; the pipeline runs at the pace of the "
                    "largest (pass split= to move blocks)",
                )
            )
    return problems


def _bubble_problems(
    schedule: str, bubble: float, m: int, problems: list[Problem]
) -> list[Problem]:
    """A warning for a large bubble, unless ``problems`` already holds an error."""
    if bubble > 0.25 and not any(q.severity == "error" for q in problems):
        return [
            Problem(
                "warning",
                schedule,
                f"the bubble is {bubble:.0%} of the step: more micro-batches ({m} now) or "
                "more stages per rank would shrink it",
            )
        ]
    return []


def _first_inputs(stage: nn.Module, micro: int, seq_len: int) -> Any:
    """The first stage's meta inputs: token ids, and for a transformers decoder a padding
    mask too (its mask functions read the position ids' values when given none)."""
    from torch_tp.pipeline import _DecoderStage

    ids = torch.zeros(micro, seq_len, dtype=torch.long, device="meta")
    if isinstance(stage, _DecoderStage):
        return ids, torch.ones(micro, seq_len, dtype=torch.long, device="meta")
    return ids


def _in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """Micro-batches whose saved activations a stage holds at the schedule's peak: all of
    them in GPipe; in 1F1B those its rank runs forward before its first backward,
    ``p - rank``; in interleaved 1F1B the warm-up of its rank, ``2 (p - rank - 1) + (v - 1)
    p + 1`` forwards over its ``v`` stages, spread evenly."""
    if schedule == "ScheduleGPipe":
        return m
    if schedule == "Schedule1F1B":
        return min(m, p - rank)
    warmup = min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
    return max(1, math.ceil(warmup / v))


def _describe(stage: nn.Module) -> str:
    """The model's modules a stage holds, with runs of blocks as ``layers.0-3``."""
    names: list[str] = []
    for name, child in stage.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)) and len(child):
            keys = [key for key, _ in child.named_children()]
            names.append(f"{name}.{keys[0]}-{keys[-1]}" if len(keys) > 1 else f"{name}.{keys[0]}")
        elif any(True for _ in child.parameters()) or list(child.children()):
            names.append(_describe_view(name, child))
    return ", ".join(n for n in names if n)


def _describe_view(name: str, module: nn.Module) -> str:
    """A transformers stage's view of the base model: its blocks and other modules."""
    from torch_tp.pipeline import _Skipped

    parts = []
    for child_name, child in module.named_children():
        if isinstance(child, _Skipped):
            continue
        if isinstance(child, nn.ModuleList):
            keys = [key for key, _ in child.named_children()]
            if keys:
                parts.append(f"{name}.{child_name}.{keys[0]}-{keys[-1]}")
        elif any(True for _ in child.parameters()):
            parts.append(f"{name}.{child_name}")
    return ", ".join(parts) if parts else name
