"""Benchmark pipeline schedules: step time and memory at pp=2 against pp=1, the same TP.

Every row trains the reference Llama on the same global batch with AdamW, tensor-parallel
inside (``tp`` ranks, the Llama plan):

* ``pp=1``: no pipeline, ``tp`` ranks, one forward and backward of the whole batch;
* ``gpipe``, ``1f1b``: two stages (``2 * tp`` ranks) by ``torch_tp.pipeline`` and
  ``torch.distributed.pipelining``'s ``ScheduleGPipe`` / ``Schedule1F1B``, ``m``
  micro-batches;
* ``interleaved``: four stages, two per pipeline rank, ``ScheduleInterleaved1F1B``.

Each row gives the median time per step (after warm-up; rank 0's clock, every rank in step),
the schedule's theoretical bubble ``(p - 1) / (v m + p - 1)``, the peak bytes of activations
saved for the backward that are alive at once on a rank (measured with
``torch.autograd.graph.saved_tensors_hooks``; the largest rank), and the parameter, gradient
and optimizer-state bytes on a rank (the largest). The ranks are this machine's processes
(``torch_tp.testing.run_distributed``, gloo on CPU; NCCL with a GPU per rank).

Example::

    $ python benchmarks/bench_pipeline.py              # ~1 minute on 2 cores
    $ python benchmarks/bench_pipeline.py --quick      # tiny, 2 steps: a smoke test
    $ python benchmarks/bench_pipeline.py --markdown
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import parallelize_module
from torch_tp.models import Llama, LlamaConfig
from torch_tp.pipeline import build_schedule, pipeline_stages
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

# variant: (schedule class, stages per rank), None for no pipeline
VARIANTS = {
    "pp=1": None,
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
}


@dataclass(frozen=True)
class Row:
    variant: str
    ranks: int
    median_ms: float
    bubble: float
    saved_bytes: int
    state_bytes: int


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _LiveSaved:
    """Bytes of the tensors saved for the backward that are alive, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta":
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _bench(variant: str, tp: int, config: dict, batch: int, seq: int, m: int, steps: int):
    """One variant, on every rank: (median ms, peak saved bytes, state bytes) of this rank."""
    spec = VARIANTS[variant]
    device = device_type()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**config, max_seq_len=seq)).to(device)
    if spec is None:
        mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, llama_plan())
        params = list(model.parameters())

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            _loss(model(tokens), targets).backward()

    else:
        schedule_name, per_rank = spec
        pp = dist.get_world_size() // tp
        mesh = init_device_mesh(device, (pp, tp), mesh_dim_names=("pp", "tp"))
        stages = pipeline_stages(
            model, mesh["pp"], stages_per_rank=per_rank, tp_mesh=mesh["tp"], plan=llama_plan()
        )
        schedule = build_schedule(
            stages, schedule_name, n_microbatches=m, batch_size=batch, loss_fn=_loss
        )
        params = [p for stage in stages for p in stage.submod.parameters()]

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            schedule.step(tokens, target=targets)

    optimizer = torch.optim.AdamW(params, lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    times, saved = [], _LiveSaved()
    for i in range(steps + 2):  # two warm-up steps
        tokens = torch.randint(0, config["vocab_size"], (batch, seq + 1), generator=generator)
        tokens = tokens.to(device)
        dist.barrier()
        start = time.perf_counter()
        with saved_tensors_hooks(saved.pack, lambda t: t):
            step(tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    state = sum(_local_bytes(p) for p in params)  # parameters
    state += sum(_local_bytes(p) for p in params)  # gradients (freed to None here)
    state += sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values() if t.ndim)
    return statistics.median(times), saved.peak, state


def bench(args: argparse.Namespace) -> list[Row]:
    config = {
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": args.vocab,
    }
    rows = []
    for variant in args.variants:
        spec = VARIANTS[variant]
        ranks = args.tp if spec is None else 2 * args.tp
        results = run_distributed(
            _bench,
            ranks,
            variant,
            args.tp,
            config,
            args.batch,
            args.seq,
            args.microbatches,
            args.steps,
        )
        p, v = (1, 1) if spec is None else (2, spec[1])
        bubble = (p - 1) / (v * args.microbatches + p - 1)
        rows.append(
            Row(
                variant=variant,
                ranks=ranks,
                median_ms=results[0][0],
                bubble=bubble,
                saved_bytes=max(r[1] for r in results),
                state_bytes=max(r[2] for r in results),
            )
        )
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: list[Row], args: argparse.Namespace, markdown: bool = False) -> str:
    base = next((r.median_ms for r in rows if r.variant == "pp=1"), None)
    header = [
        "variant",
        "ranks",
        "step ms (median)",
        "vs pp=1",
        "bubble (theory)",
        "peak saved activations/rank MiB",
        "params+grads+AdamW/rank MiB",
    ]
    body = [
        [
            r.variant,
            str(r.ranks),
            f"{r.median_ms:.1f}",
            f"{r.median_ms / base:.2f}x" if base else "-",
            f"{r.bubble:.1%}",
            _mib(r.saved_bytes),
            _mib(r.state_bytes),
        ]
        for r in rows
    ]
    title = (
        f"Llama dim {args.dim}, {args.layers} layers, vocab {args.vocab}; global batch "
        f"{args.batch} x {args.seq} tokens, {args.microbatches} micro-batches; tp={args.tp}; "
        f"median of {args.steps} steps"
    )
    return render(title, header, body, markdown)


def render(title: str, header: list[str], body: list[list[str]], markdown: bool) -> str:
    """A titled table: markdown, or plain columns two spaces apart."""
    if markdown:
        lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.vocab, args.seq, args.steps = 32, 4, 64, 8, 2
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
