"""Benchmark peak memory per rank of meta-device initialisation: meta, parallelize,
``torch_tp.materialize``, ``load_pretrained``.

Each rank builds the model on the meta device, parallelizes it (tensor parallelism, the
model's plan), materializes its shards (:func:`torch_tp.materialize`) and loads a
``save_pretrained``-style directory (:func:`torch_tp.checkpoint.load_pretrained`), reading
only its slices. The table gives, per model, the checkpoint's size, this rank's shards
(parameters and buffers), the largest single tensor of the model, and the increase of the
process's peak resident memory over the whole route (Linux's ``VmHWM``, reset just before;
the largest over the ranks). The target: at most this rank's shards plus the largest single
tensor plus a constant (``--constant``, MiB). The ranks are this machine's processes
(``torch_tp.testing.run_distributed``, gloo on CPU; NCCL with a GPU per rank, where the
resident memory measured is the host's).

Example::

    $ python benchmarks/bench_meta_init.py             # ~300 MB models; ~1 minute on 2 cores
    $ python benchmarks/bench_meta_init.py --quick     # tiny: a smoke test
    $ python benchmarks/bench_meta_init.py --models llama --markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp.checkpoint import load_pretrained
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402

MODELS = ("llama", "hf-llama")
_MIB = 2**20


@dataclass(frozen=True)
class Row:
    model: str
    ranks: int
    checkpoint_mib: float
    shard_mib: float  # the largest over the ranks
    largest_mib: float
    peak_mib: float  # the largest over the ranks; nan where VmHWM cannot be reset
    seconds: float  # rank 0's, for the whole route

    @property
    def bound_mib(self) -> float:
        return self.shard_mib + self.largest_mib


def _config(model: str, args: argparse.Namespace):
    if model == "llama":
        return LlamaConfig(
            dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
            vocab_size=args.vocab, hidden_dim=args.hidden, max_seq_len=64,
        )  # fmt: skip
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        vocab_size=args.vocab, tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip


def _build(model: str, config):
    if model == "llama":
        return Llama(config)
    import transformers

    return transformers.AutoModelForCausalLM.from_config(config)


def _plan(model: str, module):
    if model == "llama":
        return llama_plan()
    from torch_tp.plans.hf import plan_for

    return plan_for(module)


def _rss() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def _reset_peak() -> float | None:
    """Reset VmHWM to the current resident size (Linux); ``None`` where it cannot be."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _rss()["VmRSS"]


def _route(model: str, config, directory: str) -> tuple[float, float, float]:
    """On every rank: (this rank's shard MiB, peak RSS increase MiB, seconds)."""
    mesh = init_device_mesh(device_type(), (torch.distributed.get_world_size(),))
    base = _reset_peak()
    start = time.perf_counter()
    with torch.device("meta"):
        module = _build(model, config)
    torch_tp.parallelize_module(module, mesh, _plan(model, module))
    torch_tp.materialize(module)
    load_pretrained(module, directory)
    seconds = time.perf_counter() - start
    peak = float("nan") if base is None else _rss()["VmHWM"] - base
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    shard = sum(t.numel() * t.element_size() for t in local) / _MIB
    return shard, peak, seconds


def _measure(model: str, args: argparse.Namespace) -> Row:
    """The route for one model, in this process's ranks."""
    from safetensors.torch import save_file

    config = _config(model, args)
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        whole = _build(model, config)
        state = {k: v.contiguous() for k, v in whole.state_dict().items()}
        save_file(state, os.path.join(directory, "model.safetensors"))
        size = os.path.getsize(os.path.join(directory, "model.safetensors")) / _MIB
        largest = max(v.numel() * v.element_size() for v in state.values()) / _MIB
        del whole, state
        results = run_distributed(_route, args.tp, model, config, directory, timeout=900)
    return Row(
        model=model,
        ranks=args.tp,
        checkpoint_mib=size,
        shard_mib=max(r[0] for r in results),
        largest_mib=largest,
        peak_mib=max(r[1] for r in results),
        seconds=results[0][2],
    )


def bench(args: argparse.Namespace) -> list[Row]:
    """One row per model, each measured in fresh processes (as a job starts): how much of
    the freed memory the C allocator keeps resident depends on what the process did
    before, which a second model measured in the same ranks would inherit."""
    rows = []
    for model in args.models:
        child = [sys.executable, __file__, "--one", *args.argv, "--models", model]
        proc = subprocess.run(child, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"measuring {model} failed:\n{proc.stderr[-3000:]}")
        rows.append(Row(**json.loads(proc.stdout.strip().splitlines()[-1])))
    return rows


def table(rows: list[Row], args: argparse.Namespace, markdown: bool = False) -> str:
    header = [
        "model",
        "tp",
        "checkpoint MiB",
        "shards/rank MiB",
        "largest tensor MiB",
        "peak RSS increase/rank MiB",
        "peak - (shards + largest) MiB",
        f"within +{args.constant} MiB",
        "seconds",
    ]
    body = [
        [
            r.model,
            str(r.ranks),
            f"{r.checkpoint_mib:.1f}",
            f"{r.shard_mib:.1f}",
            f"{r.largest_mib:.1f}",
            f"{r.peak_mib:.1f}",
            f"{r.peak_mib - r.bound_mib:+.1f}",
            "yes" if r.peak_mib <= r.bound_mib + args.constant else "NO",
            f"{r.seconds:.2f}",
        ]
        for r in rows
    ]
    title = (
        f"meta -> parallelize -> materialize -> load_pretrained; dim {args.dim}, {args.layers} "
        f"layers, hidden {args.hidden}, vocab {args.vocab}, float32; peak over the route"
    )
    return render(title, header, body, markdown)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--constant", type=int, default=16, help="MiB allowed beyond the bound")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--one"]
    if args.quick:
        args.dim, args.layers, args.heads, args.hidden, args.vocab = 32, 2, 4, 64, 64
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    if args.one:  # a child of bench(): one model, its row as JSON
        (model,) = args.models
        text = json.dumps(dataclasses.asdict(_measure(model, args)))
        print(text)
        return text
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
