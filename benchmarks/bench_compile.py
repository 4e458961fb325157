"""Benchmark what tensor parallelism adds to ``torch.compile``: guards, graphs, recompiles.

For the reference Llama (``torch_tp.models.Llama``, ``llama_plan()``) and a tiny random
transformers Llama (``plan_for``), on one device and under torch_tp at TP=2 (this machine's
processes, gloo on CPU), the table gives:

* ``guards``: the guards Dynamo installs for the model's forward (``torch._dynamo.explain``),
  and the kinds TP adds most of;
* ``graphs`` / ``breaks``: the graphs it compiles and the graph breaks between them;
* ``recompiles over steps``: graphs compiled after the first of ``--steps`` training steps
  (forward, loss, backward, SGD) on new data of the same shapes: the target is 0;
* ``recompiles over decode``: for the transformers Llama, graphs compiled after the first of
  ``--decode`` greedy decode steps with a static key-value cache (``StaticCache``), one
  position after another: the target is 0.

Example::

    $ python benchmarks/bench_compile.py              # ~1 minute on 2 cores
    $ python benchmarks/bench_compile.py --markdown
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch._dynamo
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import parallelize_module
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402

MODELS = ("llama", "hf-llama")


def _model(name: str, args: argparse.Namespace) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    if name == "llama":
        config = LlamaConfig(
            dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, vocab_size=args.vocab
        )
        return Llama(config), llama_plan()
    import transformers

    from torch_tp.plans.hf import plan_for

    config = transformers.LlamaConfig(
        hidden_size=args.dim, intermediate_size=2 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab, pad_token_id=0,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return model, plan_for(model)


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


class _Counting:
    """A Dynamo backend that counts the graphs it is given and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def _decode_recompiles(model: nn.Module, args: argparse.Namespace) -> int:
    """Graphs compiled after the first of ``args.decode`` greedy steps with a static cache."""
    from transformers import StaticCache

    ids = torch.randint(1, args.vocab, (1, 4), generator=torch.Generator().manual_seed(2))
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + args.decode)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        backend = _Counting()
        step = torch.compile(model, backend=backend, fullgraph=True)
        token = out.logits[:, -1:].argmax(-1)
        first = None
        for i in range(args.decode):
            position = torch.tensor([ids.shape[1] + i])
            out = step(token, past_key_values=cache, cache_position=position, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            first = backend.graphs if first is None else first
    return backend.graphs - first


def _rank(name: str, tp: bool, args: argparse.Namespace) -> dict:
    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    model, plan = _model(name, args)
    if tp:
        mesh = init_device_mesh(device_type(), (torch.distributed.get_world_size(),))
        parallelize_module(model, mesh, plan)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=gen)
    explained = torch._dynamo.explain(model)(ids)
    kinds = Counter(guard.create_fn_name() for guard in explained.out_guards)
    torch._dynamo.reset()
    backend = _Counting()
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first = None
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (2, args.seq + 1), generator=gen)
        logits = _logits(compiled(tokens[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        first = backend.graphs if first is None else first
    torch._dynamo.reset()
    decode = _decode_recompiles(model.eval(), args) if name == "hf-llama" else None
    return {
        "guards": len(explained.out_guards),
        "kinds": kinds,
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "step_recompiles": backend.graphs - first,
        "decode_recompiles": decode,
    }


def bench(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for name in args.models:
        one = run_distributed(_rank, args.tp, name, False, args)[0]
        ours = run_distributed(_rank, args.tp, name, True, args)[0]
        added = ours["kinds"] - one["kinds"]
        for label, r in (("one device", one), (f"torch_tp TP={args.tp}", ours)):
            most = ", ".join(f"{k} +{v}" for k, v in added.most_common(4))
            rows.append(
                [
                    name,
                    label,
                    str(r["guards"]),
                    "-" if r is one else f"+{r['guards'] - one['guards']} ({most})",
                    f"{r['graphs']} / {r['breaks']}",
                    str(r["step_recompiles"]),
                    "-" if r["decode_recompiles"] is None else str(r["decode_recompiles"]),
                ]
            )
    return rows


def table(rows: list[list[str]], args: argparse.Namespace, markdown: bool = False) -> str:
    header = [
        "model",
        "run",
        "guards",
        "added by TP (most)",
        "graphs / breaks",
        "recompiles over steps",
        "recompiles over decode",
    ]
    title = (
        f"torch.compile; hidden {args.dim}, {args.layers} layers, vocab {args.vocab}; batch 2 x "
        f"{args.seq}; {args.steps} training steps, {args.decode} decode positions"
    )
    return render(title, header, rows, markdown)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--markdown", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
