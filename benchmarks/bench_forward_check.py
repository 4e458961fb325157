"""Benchmark the first-forward shape check: what it costs once, and that steps do not pay.

``parallelize_module`` takes a meta copy of the model before applying the plan, and the
first call with each new input signature traces that call's input shapes through it, as one
device and as one rank (``check_forward=True``, the default). Per model, the table gives,
with the check on and off (rank 0's seconds, on the ranks of this machine:
``torch_tp.testing.run_distributed``, gloo on CPU):

* ``parallelize``: the ``parallelize_module`` call (on: the meta copy included);
* ``first forward``: the first forward (on: the trace included);
* ``step``: the median of the next ``--steps`` forwards and backwards (no check runs: the
  target is the same time on and off, within noise).

Example::

    $ python benchmarks/bench_forward_check.py             # ~1 minute on 2 cores
    $ python benchmarks/bench_forward_check.py --quick     # tiny: a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.device_mesh import init_device_mesh

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402

MODELS = ("llama", "hf-llama")


def _model(name: str, layers: int, dim: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    if name == "llama":
        config = LlamaConfig(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=512)
        return Llama(config), llama_plan()
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=512, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    from torch_tp.plans.hf import plan_for

    return model, plan_for(model)


def _timed(name: str, layers: int, dim: int, seq: int, steps: int, check: bool) -> list[float]:
    """On every rank: seconds of the parallelize call, the first forward, the median step."""
    mesh = init_device_mesh(device_type(), (2,))
    model, plan = _model(name, layers, dim)
    ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(0))

    def forward() -> torch.Tensor:
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits

    start = time.perf_counter()
    torch_tp.parallelize_module(model, mesh, plan, check_forward=check)
    parallelize = time.perf_counter() - start
    start = time.perf_counter()
    forward().float().mean().backward()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        forward().float().mean().backward()
        times.append(time.perf_counter() - start)
    return [parallelize, first, statistics.median(times)]


def bench(args: argparse.Namespace) -> list[list[str]]:
    body = []
    for name in args.models.split(","):
        for layers in args.layers:
            cells = {}
            for check in (True, False):
                cells[check] = run_distributed(
                    _timed, 2, name, layers, args.dim, args.seq, args.steps, check
                )[0]
            on, off = cells[True], cells[False]
            body.append(
                [name, str(layers)]
                + [f"{a:.3f} / {b:.3f}" for a, b in zip(on, off, strict=True)]
                + [f"{on[2] / off[2]:.2f}"]
            )
    return body


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.seq, args.steps = [1], 64, 8, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    header = ["model", "layers", "parallelize (on / off)", "first forward (on / off)"]
    header += ["step (on / off)", "step on/off"]
    title = f"the first-forward shape check, TP=2, seconds (rank 0; dim {args.dim}, seq {args.seq})"
    print(render(title, header, bench(args), args.markdown))


if __name__ == "__main__":
    main()
