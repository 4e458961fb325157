"""The dry-run report's result: what it holds, and how it prints (:class:`PlanReport`)."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = [
    "BlockQuality",
    "Collective",
    "ParameterGroup",
    "PlanEntryRow",
    "PlanReport",
    "Problem",
]

FORWARD, BACKWARD = "forward", "backward"
# where the end-of-backward reduction of partial parameter gradients is reported
REPLICATED_PARAMETERS = "(replicated parameters)"
SEVERITIES = ("error", "warning", "note")
# the block of what is not in any repeated layers (the embedding, the head)
OUTSIDE = "(outside the blocks)"


# ------------------------------------------------------------------------------------------
# What the report holds
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterGroup:
    """Parameters with one name pattern, placement and shape (the layers of a wildcard key).

    Attributes:
        name: the plan key (or the module path, with layer numbers as ``*``) and the
            parameter name, e.g. ``"layers.*.attention.wq.weight"``.
        count: how many parameters the group holds.
        placement: ``"Shard(0)"``, ``"Replicate()"`` (a DTensor), or ``None`` for a parameter
            no style touches (a plain tensor, whole on every rank).
        global_shape: the shape of one parameter.
        local_shape: the shape of its largest shard (``torch.chunk`` convention).
        itemsize: bytes per element.
        adapter: a factor of PEFT's LoRA (``lora_A``, ``lora_B``) on a planned layer, laid
            out by that layer's style (:mod:`torch_tp.style.adapters`).
    """

    name: str
    count: int
    placement: str | None
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    itemsize: int
    adapter: bool = False

    @property
    def global_bytes(self) -> int:
        """Bytes of the whole group, unsharded."""
        return self.count * math.prod(self.global_shape) * self.itemsize

    @property
    def local_bytes(self) -> int:
        """Bytes of the whole group on the rank with the largest shards."""
        return self.count * math.prod(self.local_shape) * self.itemsize


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind, issued ``count`` times per step at one plan key.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        kind: the functional collective, as :class:`~torch.distributed.tensor.debug.CommDebugMode`
            names it: ``"all_reduce"``, ``"all_gather_into_tensor"``,
            ``"reduce_scatter_tensor"``, or ``"shard_dim_alltoall"`` (a shard moved to another
            dimension; on CPU, DTensor does that with ``"all_gather_into_tensor"``).
        where: the plan key whose style issues it, or ``"(replicated parameters)"`` for the
            one coalesced all-reduce of partial parameter gradients.
        count: how many per step.
        bytes: the size of one: the whole tensor reduced or gathered (an all-gather's output,
            a reduce-scatter's input), with DTensor's padding of uneven shards; for an
            all-to-all, the bytes this rank sends.
        mesh_dim: the name of the mesh dimension it runs over, for a report given the mesh's
            shape (``"tp"``, ``"ep"``); ``None`` for a report given a TP degree.
    """

    phase: str
    kind: str
    where: str
    count: int
    bytes: int
    mesh_dim: str | None = None


@dataclass(frozen=True)
class Problem:
    """Something in the plan that fails, is wasteful, or could not be predicted.

    Attributes:
        severity: ``"error"`` (the plan fails or computes something else), ``"warning"``
            (it works, unevenly) or ``"note"``.
        where: the plan key or module path.
        message: what is wrong and how to fix it.
    """

    severity: str
    where: str
    message: str


@dataclass
class BlockQuality:
    """What a plan splits in one block (the repeated layers, ``layers.*``, all of them).

    Attributes:
        block: the block's module path with layer numbers as ``*`` (``"model.layers.*"``), or
            ``"(outside the blocks)"``: the embedding, the head and anything else.
        linear_parameters: elements of the parameters that matrix products read.
        sharded_parameters: of those, the elements of the ones the plan shards.
        flops: the FLOPs of the block's matrix products in one forward, at the report's batch
            and sequence length, on one device.
        sharded_flops: of those, the FLOPs the ranks split among them.
        whole: each module computed whole on every rank (its matrix products split by no
            rank), with why.
    """

    block: str
    linear_parameters: int = 0
    sharded_parameters: int = 0
    flops: int = 0
    sharded_flops: int = 0
    whole: dict[str, str] = field(default_factory=dict)

    @property
    def parameter_fraction(self) -> float:
        """The fraction of the block's linear parameters the plan shards."""
        return self.sharded_parameters / self.linear_parameters if self.linear_parameters else 1.0

    @property
    def flop_fraction(self) -> float:
        """The fraction of the block's matmul FLOPs the ranks split."""
        return self.sharded_flops / self.flops if self.flops else 1.0


@dataclass(frozen=True)
class PlanEntryRow:
    """One key of the plan: its style (name or short form) and how many modules it matched."""

    key: str
    style: str
    modules: int


@dataclass
class PlanReport:
    """The result of :func:`plan_report`; ``str(report)`` is a table.

    Attributes:
        model: the model's class name.
        num_parameters: the number of parameters of the model.
        tp_degree: the TP degree: the size of the dimension the 1-D styles run on.
        batch_size: the batch size the collectives are sized for.
        seq_len: the sequence length the collectives are sized for.
        dtype: the parameters' floating-point dtype.
        plan: the plan's keys, styles and matched module counts.
        parameters: the parameters, grouped.
        collectives: the collectives of one step, grouped.
        problems: the problems found, errors first.
        quality: what the plan splits, per block: the fractions of its linear parameters
            and of its matmul FLOPs sharded, and the modules computed whole, with why.
        mesh_shape: the mesh's dimensions and sizes, for a report given them (``{"ep": 2,
            "tp": 2}``); ``None`` for a report given a TP degree.
        tokens_per_rank: under context parallelism (a style that splits the sequence over
            ``cp``), the tokens of each sequence one rank runs the model on (``seq_len /
            cp``), which the collectives are sized for; ``None`` otherwise.
        attention_activations: under context parallelism, the bytes the attention calls
            of one step save for backward on one rank (q, k, v, output and log-sum-exp of
            its tokens, its heads), and on one device running the same batch and sequence
            unsplit (``cp`` times as many, with a kernel that saves the log-sum-exp rather
            than the ``S x S`` probabilities); ``None`` otherwise.
    """

    model: str
    num_parameters: int
    tp_degree: int
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    plan: list[PlanEntryRow]
    parameters: list[ParameterGroup]
    collectives: list[Collective]
    problems: list[Problem] = field(default_factory=list)
    quality: list[BlockQuality] = field(default_factory=list)
    mesh_shape: dict[str, int] | None = None
    tokens_per_rank: int | None = None
    attention_activations: tuple[int, int] | None = None

    @property
    def per_rank_bytes(self) -> int:
        """Parameter bytes on the rank with the largest shards."""
        return sum(group.local_bytes for group in self.parameters)

    @property
    def unsharded_bytes(self) -> int:
        """Parameter bytes of the whole model."""
        return sum(group.global_bytes for group in self.parameters)

    @property
    def adapter_parameters(self) -> list[ParameterGroup]:
        """The groups of PEFT's LoRA factors that the plan's styles host (the trainable
        parameters of a LoRA fine-tuning)."""
        return [group for group in self.parameters if group.adapter]

    @property
    def errors(self) -> list[Problem]:
        """The problems of severity ``"error"``."""
        return [p for p in self.problems if p.severity == "error"]

    def counts(self, phase: str | None = None, mesh_dim: str | None = None) -> dict[str, int]:
        """Collectives per kind, in one phase (``"forward"``/``"backward"``) or in both, over
        one mesh dimension (by name, for a report given the mesh's shape) or over all."""
        counts: Counter[str] = Counter()
        for c in self.collectives:
            if (phase is None or c.phase == phase) and (mesh_dim is None or c.mesh_dim == mesh_dim):
                counts[c.kind] += c.count
        return dict(counts)

    def bytes(self, phase: str | None = None, mesh_dim: str | None = None) -> dict[str, int]:
        """Bytes per kind of collective, in one phase or in both, over one mesh dimension or
        over all."""
        total: Counter[str] = Counter()
        for c in self.collectives:
            if (phase is None or c.phase == phase) and (mesh_dim is None or c.mesh_dim == mesh_dim):
                total[c.kind] += c.count * c.bytes
        return dict(total)

    def __str__(self) -> str:
        # each section after the header opens with its own blank line, so that one left out
        # (the attention activations, outside context parallelism) leaves no gap behind
        return "\n".join(
            [
                self._header(),
                *self._plan_section(),
                *self._parameters_section(),
                *self._quality_section(),
                *self._attention_section(),
                *self._collectives_section(),
                *self._problems_section(),
            ]
        )

    def _header(self) -> str:
        """The first line: the model, its size, the degree or mesh, the batch and the dtype."""
        return (
            f"Plan report: {self.model}, {_count(self.num_parameters)} parameters, "
            f"{self._degree()}, batch {self.batch_size} x {self.seq_len} tokens"
            f"{' per tp group' if 'tp' in (self.mesh_shape or ()) else ''}"
            f"{self._split()}, "
            f"{str(self.dtype).removeprefix('torch.')}"
        )

    def _plan_section(self) -> list[str]:
        """The plan's keys, each with the modules it matched and its style."""
        return [
            "",
            "Plan",
            *format_table(
                ["key", "modules", "style"],
                [[row.key or '""', str(row.modules), row.style] for row in self.plan],
                right={1},
            ),
        ]

    def _parameters_section(self) -> list[str]:
        """The parameter groups, with their placements, shapes and bytes, and the totals."""
        rows = [
            [
                g.name,
                str(g.count),
                g.placement or "-",
                format_shape(g.global_shape),
                format_shape(g.local_shape),
                format_bytes(g.local_bytes),
                format_bytes(g.global_bytes),
            ]
            for g in self.parameters
        ]
        table = format_table(
            ["parameter", "count", "placement", "global", "per rank", "bytes/rank", "unsharded"],
            [*rows, *self._parameter_totals()],
            right={1, 5, 6},
        )
        return ["", "Parameters (per rank: the largest shard, torch.chunk convention)", *table]

    def _parameter_totals(self) -> list[list[str]]:
        """The parameter table's last rows: the total per rank, and the LoRA adapters' part
        of it when the plan's styles host any."""
        share = self.per_rank_bytes / self.unsharded_bytes if self.unsharded_bytes else 1.0
        rows = [
            [
                f"total per rank ({share:.1%} of unsharded)",
                str(sum(g.count for g in self.parameters)),
                "",
                "",
                "",
                format_bytes(self.per_rank_bytes),
                format_bytes(self.unsharded_bytes),
            ]
        ]
        adapters = self.adapter_parameters
        if adapters:  # the trainable part of a LoRA fine-tuning: what its optimizer holds
            rank, whole = (
                sum(g.local_bytes for g in adapters),
                sum(g.global_bytes for g in adapters),
            )
            rows.append(
                [
                    "of which LoRA adapters (hosted)",
                    str(sum(g.count for g in adapters)),
                    "",
                    "",
                    "",
                    format_bytes(rank),
                    format_bytes(whole),
                ]
            )
        return rows

    def _quality_section(self) -> list[str]:
        """What the plan splits per block, and each module it computes whole."""
        if not self.quality:
            return []
        rows = [
            [
                q.block,
                f"{q.parameter_fraction:.0%} of {_count(q.linear_parameters)}",
                f"{q.flop_fraction:.0%} of {_flops(q.flops)}",
            ]
            for q in self.quality
        ]
        lines = [
            "",
            "Plan quality (sharded: of the parameters matrix products read, and of their "
            "FLOPs in one forward; a block: all its layers)",
            *format_table(["block", "linear parameters", "matmul FLOPs"], rows, right=set()),
        ]
        whole = [(module, why) for q in self.quality for module, why in q.whole.items()]
        if whole:
            lines.append("  computed whole on every rank:")
            lines += [f"    {module}: {why}" for module, why in whole]
        return lines

    def _attention_section(self) -> list[str]:
        """The attention activations one rank saves for backward under context parallelism
        (nothing otherwise)."""
        if self.attention_activations is None:
            return []
        rank, whole = self.attention_activations
        return [
            "",
            f"Attention activations saved for backward: {format_bytes(rank)} per rank (q, k, v, "
            "output, log-sum-exp of its tokens); one device, unsplit: "
            f"{format_bytes(whole)} (with a kernel that saves the log-sum-exp; the math "
            "backend saves the S x S probabilities too). Other activations: 1/cp too",
        ]

    def _collectives_section(self) -> list[str]:
        """The collectives of one step, forward then backward, each pass with its totals."""
        # over which mesh dimension each runs, for a report given the mesh's shape
        over = [] if self.mesh_shape is None else ["over"]
        rows = [row for phase in (FORWARD, BACKWARD) for row in self._phase_rows(phase, over)]
        shift = len(over)
        return [
            "",
            f"Collectives per step (model forward and backward, batch {self.batch_size} x "
            f"{self.seq_len}{self._split()}; the loss is not included)",
            *format_table(
                ["pass", "collective", *over, "count", "bytes each", "bytes total", "from"],
                rows,
                right={2 + shift, 3 + shift, 4 + shift},
            ),
        ]

    def _phase_rows(self, phase: str, over: list[str]) -> list[list[str]]:
        """The collectives table's rows of one pass: a row per collective, then a total per
        mesh dimension (for a report given the mesh's shape) and the pass's total."""
        mine = [c for c in self.collectives if c.phase == phase]
        rows = [
            [
                phase,
                c.kind,
                *([str(c.mesh_dim)] if over else []),
                str(c.count),
                format_bytes(c.bytes),
                format_bytes(c.count * c.bytes),
                c.where or '""',
            ]
            for c in mine
        ]
        for dim in self.mesh_shape or ():  # a total per dimension
            on_dim = [c for c in mine if c.mesh_dim == dim]
            count = sum(c.count for c in on_dim)
            total = sum(c.count * c.bytes for c in on_dim)
            rows.append([phase, "total", dim, str(count), "", format_bytes(total), ""])
        count = sum(c.count for c in mine)
        total = sum(c.count * c.bytes for c in mine)
        rows.append(
            [phase, "total", *(["all"] if over else []), str(count), "", format_bytes(total), ""]
        )
        return rows

    def _problems_section(self) -> list[str]:
        """The problems, those repeated per layer collapsed into one line each."""
        lines = ["", "Problems"]
        if not self.problems:
            lines.append("  none found")
        for severity, where, message in _collapsed(self.problems):
            lines.append(f"  {severity:<8} {where or '(root)'}: {message}")
        return lines

    def _split(self) -> str:
        """``, 8 per rank``: the tokens one rank runs under context parallelism."""
        return "" if self.tokens_per_rank is None else f", {self.tokens_per_rank} per rank"

    def _degree(self) -> str:
        """``TP degree 2``, or ``mesh ep 2 x tp 2 (4 ranks)``."""
        if self.mesh_shape is None:
            return f"TP degree {self.tp_degree}"
        shape = " x ".join(f"{dim} {size}" for dim, size in self.mesh_shape.items())
        return f"mesh {shape} ({math.prod(self.mesh_shape.values())} ranks)"


# a layer number in a module path: ``model.layers.3.self_attn`` (a whole path segment of digits)
_LAYER_NUMBER = re.compile(r"(?<=[A-Za-z_]\.)\d+\b")
_SLOT = "\0"  # where a collapsed layer number goes in a template


def _collapsed(problems: list[Problem]) -> list[tuple[str, str, str]]:
    """The problems as ``(severity, where, message)`` lines, those that differ only in the
    layer number of the module paths they name (one problem per repeated layer) collapsed
    into one, at the first one's place: the numbers as ``{0..31}`` (or ``{0,2,5}``) and the
    layers counted, ``(32 layers)``."""
    layers: dict[tuple[str, str, str], list[int]] = {}
    order: list[tuple[str, str, str]] = []
    for p in problems:
        numbers = set(_LAYER_NUMBER.findall(f"{p.where}\n{p.message}"))
        if len(numbers) != 1:  # no layer, or several: a line of its own
            order.append((p.severity, p.where, p.message))
            layers[order[-1]] = []
            continue
        template = (
            p.severity,
            _LAYER_NUMBER.sub(_SLOT, p.where),
            _LAYER_NUMBER.sub(_SLOT, p.message),
        )
        if template not in layers:
            order.append(template)
            layers[template] = []
        layers[template].append(int(numbers.pop()))
    lines = []
    for severity, where, message in order:
        found = sorted(set(layers[(severity, where, message)]))
        if len(found) <= 1:
            span = str(found[0]) if found else _SLOT
        elif found == list(range(found[0], found[-1] + 1)):
            span = f"{{{found[0]}..{found[-1]}}}"
        else:
            span = "{" + ",".join(str(n) for n in found) + "}"
        where, message = where.replace(_SLOT, span), message.replace(_SLOT, span)
        if len(found) > 1:
            message = f"{message} ({len(found)} layers)"
        lines.append((severity, where, message))
    return lines


def format_table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return ("  " + "  ".join(cells)).rstrip()

    return [line(header), *(line(row) for row in rows)]


def format_shape(shape: tuple[int, ...]) -> str:
    return " x ".join(str(s) for s in shape) if shape else "scalar"


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _flops(n: int) -> str:
    for unit, scale in (("TFLOP", 10**12), ("GFLOP", 10**9), ("MFLOP", 10**6), ("KFLOP", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP"
