"""Benchmark a transformers model's training step at TP=2: torch_tp against transformers' own TP.

For transformers' Llama and Mixtral (a mixture of experts), the same tiny random model (one
checkpoint, saved once) is trained one step at a time at TP=2 on this machine's processes:

* ``torch_tp``: ``parallelize_module(model, mesh, plan_for(model))`` (torch_tp's ready plan
  for Llama, the model's own ``tp_plan`` for Mixtral);
* ``transformers``: ``from_pretrained(..., distributed_config={"tp_size": 2})``, transformers'
  own tensor parallelism (it needs ``accelerate``); where it does not run here, the row says
  so with its error.

A step is forward, cross-entropy loss, backward and an AdamW step. Each row gives the median
time per step (after warm-up), the collectives of one step by kind (``CommDebugMode``), and
the loss's difference from the same model on one device.

Example::

    $ python benchmarks/bench_transformers.py            # ~1 minute on 2 cores
    $ python benchmarks/bench_transformers.py --quick    # 2 steps: a smoke test
    $ python benchmarks/bench_transformers.py --markdown
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402

FAMILIES = ("llama", "mixtral")
LIBRARIES = ("torch_tp", "transformers")


@dataclass(frozen=True)
class Row:
    family: str
    library: str
    median_ms: float | None
    collectives: str
    loss_diff: float | None
    error: str = ""


def _config(family: str, args: argparse.Namespace):
    import transformers

    common = {
        "vocab_size": args.vocab,
        "hidden_size": args.dim,
        "intermediate_size": 2 * args.dim,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_full(logits).flatten(0, 1).float(), targets.flatten())


def _rank(family: str, library: str, checkpoint: str, args: argparse.Namespace):
    """One row, on every rank: (median ms, collectives, loss) or the error's first line."""
    import transformers

    from torch_tp import parallelize_module
    from torch_tp.plans.hf import plan_for

    warnings.simplefilter("ignore")
    try:
        if library == "transformers":
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint,
                dtype=torch.float32,
                attn_implementation="eager",
                distributed_config={"tp_size": dist.get_world_size()},
            )
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.float32, attn_implementation="eager"
            )
            mesh = torch.distributed.device_mesh.init_device_mesh(
                device_type(), (dist.get_world_size(),)
            )
            parallelize_module(model, mesh, plan_for(model))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(
            0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)
        )
        times, first_loss, counts = [], None, {}
        for i in range(args.steps + 1):  # one warm-up step, counted for collectives
            dist.barrier()
            start = time.perf_counter()
            with CommDebugMode() as comm:
                loss = _loss(model(input_ids=tokens[:, :-1]).logits, tokens[:, 1:])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            if i == 0:
                first_loss = _full(loss).item()
                counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
            else:
                times.append((time.perf_counter() - start) * 1e3)
        text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        return statistics.median(times), text, first_loss, ""
    except Exception as error:  # noqa: BLE001 - reported in the table
        lines = str(error).strip().splitlines()
        return None, "", None, f"{type(error).__name__}: {lines[0] if lines else ''}"[:160]


def bench(args: argparse.Namespace) -> list[Row]:
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            torch.manual_seed(0)
            single = transformers.AutoModelForCausalLM.from_config(
                _config(family, args), attn_implementation="eager"
            )
            checkpoint = str(Path(root) / family)
            single.save_pretrained(checkpoint)
            tokens = torch.randint(
                0,
                args.vocab,
                (args.batch, args.seq + 1),
                generator=torch.Generator().manual_seed(1),
            )
            reference = _loss(single(input_ids=tokens[:, :-1]).logits, tokens[:, 1:]).item()
            for library in LIBRARIES:
                results = run_distributed(_rank, args.tp, family, library, checkpoint, args)
                median, collectives, loss, error = results[0]
                errors = {r[3] for r in results if r[3]}
                rows.append(
                    Row(
                        family=family,
                        library=library,
                        median_ms=median,
                        collectives=collectives,
                        loss_diff=None if loss is None else abs(loss - reference),
                        error="; ".join(sorted(errors)),
                    )
                )
    return rows


def table(rows: list[Row], args: argparse.Namespace, markdown: bool = False) -> str:
    header = ["model", "TP by", "step ms (median)", "collectives per step", "loss vs 1 device"]
    body = [
        [
            r.family,
            r.library,
            f"{r.median_ms:.1f}" if r.median_ms is not None else "-",
            r.collectives if not r.error else f"does not run: {r.error}",
            f"{r.loss_diff:.1e}" if r.loss_diff is not None else "-",
        ]
        for r in rows
    ]
    title = (
        f"TP={args.tp}; hidden {args.dim}, {args.layers} layers, vocab {args.vocab}; batch "
        f"{args.batch} x {args.seq} tokens; median of {args.steps} steps"
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.vocab, args.seq, args.steps = 32, 2, 64, 8, 2
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
