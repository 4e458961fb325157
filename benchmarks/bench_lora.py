"""Benchmark a LoRA fine-tuning step at TP=2: torch_tp against one device and transformers' TP.

One tiny random transformers Llama (saved once to a temporary directory) gets the same PEFT
LoRA adapter (rank 8 on q, k, v, o, gate, up and down; ``lora_B`` initialized non-zero, so
that every adapter gradient is) in every row:

* ``one device``: the PEFT model, unparallelized, on each rank by itself;
* ``torch_tp``: ``parallelize_module(model, mesh, plan_for(model))``, then ``get_peft_model``;
* ``transformers``: ``from_pretrained(..., distributed_config={"tp_size": 2})``, transformers'
  own tensor parallelism, then ``get_peft_model``; where that does not run, the row says why;
* ``torch_tp full FT``: torch_tp without adapters, every parameter trained (for scale).

A step is forward, the model's cross-entropy loss, backward and an AdamW step on the trained
parameters. After the warm-up steps the rows take turns, one timed step each per round (so
load changes on a shared machine hit them alike); each step starts after a barrier and is
timed as the max over ranks. Each row gives the median (and the minimum) time per step, the
collectives of one step (``CommDebugMode``), the trained parameters' bytes per rank, and the
largest difference of its losses from one device's over all steps (the same weights, batch
and adapter initialization).

Example::

    $ python benchmarks/bench_lora.py               # ~1 minute on 2 cores
    $ python benchmarks/bench_lora.py --quick       # tiny sizes, 2 rounds: a smoke test
    $ python benchmarks/bench_lora.py --markdown
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402
from bench_transformers import _config, _full  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("one device", "torch_tp", "transformers", "torch_tp full FT")


@dataclass
class Row:
    variant: str
    times_ms: list[float] = field(default_factory=list)
    collectives: str = ""
    trained_bytes: int | None = None
    losses: list[float] = field(default_factory=list)
    error: str = ""


def _error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:160]


def _build(variant: str, checkpoint: str, mesh) -> torch.nn.Module:
    """The model of ``variant`` on this rank, its trained parameters requiring gradients."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from torch_tp import parallelize_module
    from torch_tp.plans.hf import plan_for

    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    if variant == "transformers":
        kwargs["distributed_config"] = {"tp_size": mesh.size()}
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    if variant.startswith("torch_tp"):
        parallelize_module(model, mesh, plan_for(model))
    if variant == "torch_tp full FT":
        return model.train()
    torch.manual_seed(1)  # the same adapter initialization in every row
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(model, lora).train()


def _agree(failed: bool) -> bool:
    """Whether any rank failed (so that every rank drops the row together)."""
    flag = torch.tensor([float(failed)], device=device_type())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rank(checkpoint: str, args: argparse.Namespace) -> list[Row]:
    """On every rank: build every row's model, warm up, count one step's collectives, then
    the interleaved timed rounds."""
    import transformers

    warnings.simplefilter("ignore")  # PEFT's and transformers' deprecations, per model
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" per model and rank
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(max(1, cores // dist.get_world_size()))
    mesh = torch.distributed.device_mesh.init_device_mesh(device_type(), (dist.get_world_size(),))
    tokens = torch.randint(
        0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(2)
    ).to(device_type())
    rows, live = [], {}
    for variant in args.variants:
        row = Row(variant)
        rows.append(row)
        try:
            model = _build(variant, checkpoint, mesh)
        except Exception as error:  # noqa: BLE001 - reported in the table
            row.error = _error(error)
        if _agree(bool(row.error)):
            row.error = row.error or "failed on another rank"
            continue
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-3)
        row.trained_bytes = sum(
            (p.to_local() if isinstance(p, DTensor) else p).nbytes for p in trained
        )
        live[variant] = (model, optimizer, row)

    def step(variant: str) -> None:
        model, optimizer, row = live[variant]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        row.losses.append(_full(loss).item())

    def attempt(variant: str, counted: bool = False) -> None:
        """One step, or the row dropped on every rank with its error."""
        row = live[variant][2]
        try:
            if counted:
                with CommDebugMode() as comm:
                    step(variant)
                counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
                row.collectives = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v)
                row.collectives = row.collectives or "none"
            else:
                step(variant)
        except Exception as error:  # noqa: BLE001 - reported in the table
            row.error = _error(error)
        if _agree(bool(row.error)):
            row.error = row.error or "failed on another rank"
            del live[variant]

    for _ in range(args.warmup):
        for variant in list(live):
            attempt(variant)
    for variant in list(live):
        attempt(variant, counted=True)
    for _ in range(args.steps):
        for variant in list(live):
            dist.barrier()
            start = time.perf_counter()
            attempt(variant)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if variant in live:
                live[variant][2].times_ms.append(elapsed.item() * 1e3)
    return rows


def bench(args: argparse.Namespace) -> list[Row]:
    import transformers

    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config("llama", args))
        model.save_pretrained(root)
        return run_distributed(_rank, args.tp, root, args)[0]


def table(rows: list[Row], args: argparse.Namespace, markdown: bool = False) -> str:
    header = [
        "variant",
        "step ms (median, min)",
        "collectives per step",
        "trained bytes per rank",
        "loss vs 1 device",
    ]
    single = next((r for r in rows if r.variant == "one device" and not r.error), None)
    body = []
    for r in rows:
        if r.error:
            body.append([r.variant, "-", f"does not run: {r.error}", "-", "-"])
            continue
        if single is None or r.variant == "torch_tp full FT":
            diff = "-"  # full fine-tuning trains other parameters: other losses after step 1
        else:
            diff = f"{max(abs(a - b) for a, b in zip(r.losses, single.losses, strict=True)):.1e}"
        ms = f"{statistics.median(r.times_ms):.1f} ({min(r.times_ms):.1f})" if r.times_ms else "-"
        kib = f"{r.trained_bytes / 1024:.1f} KiB"
        body.append([r.variant, ms, r.collectives, kib, diff])
    title = (
        f"TP={args.tp}; LoRA r=8 on q,k,v,o,gate,up,down; hidden {args.dim}, {args.layers} "
        f"layers, vocab {args.vocab}; batch {args.batch} x {args.seq} tokens; {args.warmup} "
        f"warm-up steps, {args.steps} interleaved rounds"
    )
    return render(title, header, body, markdown)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.vocab, args.seq = 32, 2, 64, 8
        args.batch, args.warmup, args.steps = 2, 1, 2
    args.variants = [v.strip() for v in args.only.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
