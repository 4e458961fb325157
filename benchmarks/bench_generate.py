"""Benchmark greedy decoding at TP=2: prefill and per-token latency, four ways, same run.

One tiny random transformers Llama (saved once, loaded by every row) generates greedily with
its key-value cache, on this machine's processes (gloo on CPU):

* ``one device``: the whole model, each rank by itself (as many threads as one rank);
* ``torch_tp``: ``parallelize_module(model, mesh, plan_for(model))``;
* ``megatron``: the same layout written by hand as Megatron-LM writes it: each rank's plain
  local shards (q, k, v, gate, up and the head by rows, o and down by columns, the embedding
  by vocabulary) and explicit ``all_reduce`` / ``all_gather`` calls, nothing checked;
* ``transformers``: ``from_pretrained(..., distributed_config={"tp_size": 2})``,
  transformers' own tensor parallelism (``tp_plan`` auto).

Per batch size, rounds run the rows interleaved (each ``generate`` after a barrier, timed as
the max over ranks): ``prefill`` is a ``generate`` of one new token, ``per token`` the extra
time of ``--new-tokens`` over one, divided by the extra tokens. ``collectives per token``
counts the collectives of one decoded token's forward (``CommDebugMode``);
``predicted`` is the dry-run report's forward collectives for one token
(:func:`torch_tp.report.plan_report` at ``seq_len=1``). ``tokens`` says whether the row's
tokens equal one device's.

Example::

    $ python benchmarks/bench_generate.py              # ~1 minute on 2 cores
    $ python benchmarks/bench_generate.py --quick      # tiny: a smoke test
    $ python benchmarks/bench_generate.py --markdown
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402

ROWS = ("one device", "torch_tp", "megatron", "transformers")


# ------------------------------------------------------------------------------------------
# The hand-written baseline: Megatron-LM's layout on plain local shards
# ------------------------------------------------------------------------------------------


def _keep_rows(linear: nn.Linear, rank: int, n: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach().chunk(n, 0)[rank].clone())
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, rank: int, n: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach().chunk(n, 1)[rank].clone())
    linear.in_features = linear.weight.shape[1]


def _all_reduce_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


def _all_gather_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(output) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, output.contiguous())
    return torch.cat(parts, dim=-1)


class _VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary; ids outside them look up zeros; one all-reduce."""

    def __init__(self, embedding: nn.Embedding, rank: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(embedding.weight.detach().chunk(n, 0)[rank].clone())
        self.start = rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out)
        return out


def megatron_llama(model: nn.Module) -> nn.Module:
    """``model`` (a transformers Llama) split in place as Megatron-LM splits it, over every
    rank of the default group. Its attention views heads with ``-1``, so each rank's
    projections hold its own heads with no attribute changed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep_rows(linear, rank, n)
        for linear in (attn.o_proj, mlp.down_proj):
            _keep_columns(linear, rank, n)
            linear.register_forward_hook(_all_reduce_output)
    model.model.embed_tokens = _VocabParallelEmbedding(model.model.embed_tokens, rank, n)
    _keep_rows(model.lm_head, rank, n)
    model.lm_head.register_forward_hook(_all_gather_output)
    return model


# ------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------


def _load(row: str, checkpoint: str) -> nn.Module:
    import transformers

    from torch_tp import parallelize_module
    from torch_tp.plans.hf import plan_for

    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    if row == "transformers":
        kwargs["distributed_config"] = {"tp_size": dist.get_world_size()}
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).eval()
    if row == "torch_tp":
        mesh = torch.distributed.device_mesh.init_device_mesh(
            device_type(), (dist.get_world_size(),)
        )
        parallelize_module(model, mesh, plan_for(model))
    elif row == "megatron":
        megatron_llama(model)
    model.generation_config.eos_token_id = None  # every row makes every token
    return model


def _generate(model: nn.Module, prompt: torch.Tensor, tokens: int, alone: bool):
    """(seconds, max over ranks, and the output ids) of one greedy generate."""
    if not alone:
        dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=0,
        )
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # outside the timing: every row alike
    return elapsed.item(), out


def _collectives(model: nn.Module, prompt: torch.Tensor) -> Counter:
    """The collectives of one decoded token: a forward of one id per row after the prompt's,
    with the prompt's cache. (``CommDebugMode`` around ``generate`` itself fails in its
    module tracker, on one device too.)"""
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        with CommDebugMode() as comm:
            model(prompt[:, -1:], past_key_values=cache, use_cache=True)
    return Counter({str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()})


def _rank(checkpoint: str, args: argparse.Namespace) -> list[dict]:
    warnings.simplefilter("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    models, errors = {}, {}
    for row in ROWS:
        try:
            models[row] = _load(row, checkpoint)
        except Exception as error:  # noqa: BLE001 - reported in the table
            lines = str(error).strip().splitlines()
            errors[row] = f"{type(error).__name__}: {lines[0] if lines else ''}"[:160]
    results = []
    for batch in args.batch:
        prompt = torch.randint(
            1, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch)
        )
        expected = models["one device"].generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=0,
        )
        runs: dict[str, dict[str, list[float]]] = {r: {"one": [], "many": []} for r in models}
        same = dict.fromkeys(models, True)
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for row, model in models.items():
                one, _ = _generate(model, prompt, 1, row == "one device")
                many, out = _generate(model, prompt, args.new_tokens, row == "one device")
                same[row] &= torch.equal(out, expected)
                if round_:
                    runs[row]["one"].append(one)
                    runs[row]["many"].append(many)
        extra = args.new_tokens - 1
        for row in ROWS:
            if row not in models:
                results.append({"row": row, "batch": batch, "error": errors[row]})
                continue
            model = models[row]
            counts = _collectives(model, prompt)
            one, many = runs[row]["one"], runs[row]["many"]
            results.append(
                {
                    "row": row,
                    "batch": batch,
                    "prefill_ms": statistics.median(one) * 1e3,
                    "token_ms": statistics.median(m - o for m, o in zip(many, one, strict=True))
                    * 1e3
                    / extra,
                    "collectives": dict(counts),
                    "same": same[row],
                }
            )
    return results


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


def _config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def predicted(args: argparse.Namespace, batch: int) -> int:
    """The dry-run report's forward collectives for one decoded token of ``batch`` rows."""
    import transformers

    from torch_tp.plans.hf import plan_for
    from torch_tp.report import plan_report

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _config(args), attn_implementation="eager"
        )
    report = plan_report(model, plan_for(model), args.tp, batch_size=batch, seq_len=1)
    return sum(c.count for c in report.collectives if c.phase == "forward")


def bench(args: argparse.Namespace) -> list[dict]:
    import transformers

    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(args), attn_implementation="eager"
        )
        model.save_pretrained(root)
        rows = run_distributed(_rank, args.tp, root, args)[0]
    for row in rows:
        row["predicted"] = predicted(args, row["batch"]) if row["row"] == "torch_tp" else None
    return rows


def table(rows: list[dict], args: argparse.Namespace, markdown: bool = False) -> str:
    header = [
        "batch",
        "TP by",
        "prefill ms",
        "per token ms",
        "vs megatron",
        "collectives per token",
        "predicted",
        "tokens",
    ]
    megatron = {r["batch"]: r.get("token_ms") for r in rows if r["row"] == "megatron"}
    body = []
    for r in rows:
        if "error" in r:
            body.append([str(r["batch"]), r["row"], "-", "-", "-", f"does not run: {r['error']}"])
            body[-1] += ["-", "-"]
            continue
        base = megatron.get(r["batch"])
        collectives = ", ".join(f"{k} {v:g}" for k, v in sorted(r["collectives"].items()))
        body.append(
            [
                str(r["batch"]),
                r["row"],
                f"{r['prefill_ms']:.1f}",
                f"{r['token_ms']:.2f}",
                f"{r['token_ms'] / base:.2f}x" if base else "-",
                collectives or "none",
                "-" if r["predicted"] is None else str(r["predicted"]),
                "equal" if r["same"] else "DIFFER",
            ]
        )
    title = (
        f"TP={args.tp}; greedy generate, KV cache; hidden {args.dim}, {args.layers} layers, "
        f"vocab {args.vocab}; prompt {args.prompt}, {args.new_tokens} new tokens; median of "
        f"{args.rounds} interleaved rounds"
    )
    return render(title, header, body, markdown)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.vocab, args.prompt = 32, 2, 64, 4
        args.new_tokens, args.rounds, args.batch = 3, 1, [1]
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
