"""``python -m torch_tp demo``: train a tiny Llama twice, tensor-parallel and on one device.

Both copies start from the same weights, see the same batches and use the same optimizer, so
their losses must agree step by step up to float rounding. The demo prints both losses as it
goes and exits non-zero if they drift apart: it is a tutorial and an end-to-end check at once.

How it runs:

* ``python -m torch_tp demo`` spawns ``--world-size`` ranks itself (default 2) that meet through
  a ``FileStore`` in a temporary directory, so no port has to be free.
* ``torchrun --nproc-per-node 2 -m torch_tp demo`` uses the environment torchrun sets up.
* Ranks use CUDA with NCCL when every rank can have its own visible GPU, else CPU with gloo.

Every rank trains both copies (the single-device copy is cheap), so every rank can check the
result and all ranks exit with the same status; only rank 0 prints.

Example::

    $ python -m torch_tp demo --steps 10
    $ torchrun --nproc-per-node 2 -m torch_tp demo --no-sequence-parallel
    $ python -m torch_tp demo --moe          # a mixture of experts, experts split over ranks
    $ python -m torch_tp demo --moe tp       # every expert sharded over the ranks instead
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp.models import Llama, LlamaConfig, MoEConfig, MoELlama
from torch_tp.plans.llama import llama_plan
from torch_tp.plans.moe import moe_llama_plan

__all__ = ["SuccessorTask", "configure_parser", "losses_agree", "main"]

# Allowed loss difference between the two runs is rtol * |loss| + _LOSS_ATOL: the absolute part
# only matters once the loss is near zero, where a relative bound alone becomes meaningless.
_LOSS_ATOL = 1e-6


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` options to ``parser`` and make :func:`main` its handler."""
    parser.add_argument(
        "--steps", type=int, default=30, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also shard norms and residuals along the sequence",
    )
    parser.add_argument(
        "--moe",
        nargs="?",
        const="ep",
        choices=("ep", "tp"),
        default=None,
        help="train a mixture-of-experts Llama instead: experts split over the ranks (ep, "
        "the default of --moe) or each expert sharded over them (tp)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for weights and data (default: %(default)s)"
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="ranks to spawn when not launched by torchrun (default: %(default)s)",
    )
    parser.add_argument(
        "--layers", type=int, default=2, help="transformer blocks (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences per step (default: %(default)s)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)"
    )
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="largest relative loss difference accepted (default: %(default)s)",
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the demo with parsed ``args``; return the process exit status."""
    torchrun = _launched_by_torchrun()
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    # Refuse bad sizes here, before any process or process group exists, with one message.
    problem = _check_args(args, world_size)
    if problem is not None:
        if not torchrun or int(os.environ["RANK"]) == 0:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    return _run_torchrun_rank(args) if torchrun else _spawn_ranks(args)


# ---------------------------------------------------------------------------------------------
# Launching


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _device_type(local_world_size: int) -> str:
    # One GPU per rank or none at all: sharing a GPU between NCCL ranks is not supported.
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "cuda"
    return "cpu"


def _init_rank(device_type: str, local_rank: int) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # an explicit setting (torchrun's too) wins
        # Ranks share the machine's cores; letting each use all of them only thrashes.
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def _run_torchrun_rank(args: argparse.Namespace) -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = _device_type(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    _init_rank(device_type, local_rank)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    try:
        return 0 if _run(args, device_type) else 1
    finally:
        if own_group:
            dist.destroy_process_group()


def _spawn_ranks(args: argparse.Namespace) -> int:
    world_size = args.world_size
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="torch_tp_demo_") as tmp:
        store_path = os.path.join(tmp, "store")
        try:
            mp.start_processes(
                _spawned_rank,
                args=(world_size, store_path, args, results),
                nprocs=world_size,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            # The message already holds the failing rank's traceback.
            print(f"error: a rank failed:\n{str(exc).strip()}", file=sys.stderr)
            return 1
        except mp.ProcessExitedException as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    statuses = [results.get() for _ in range(world_size)]
    return 0 if all(statuses) else 1


def _spawned_rank(
    rank: int,
    world_size: int,
    store_path: str,
    args: argparse.Namespace,
    results: mp.SimpleQueue,
) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    if sys.platform.startswith("linux"):
        # Every rank is on this machine: keep gloo off interfaces whose names may not resolve.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device_type = _device_type(world_size)
    _init_rank(device_type, rank)
    store = dist.FileStore(store_path, world_size)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        results.put(_run(args, device_type))  # a SimpleQueue: written before put() returns
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown of torch: on torch 2.15 it now and then aborted
    # a rank after the demo had finished ("terminate called without an active exception",
    # SIGABRT), failing the command, as it did benchmarks/bench_tp.py's ranks. An error above
    # still propagates, and fails the command, as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# The synthetic task


class SuccessorTask:
    """Sequences that follow a fixed random successor table over a few symbols.

    Each sequence starts at a random symbol and then always steps to that symbol's successor,
    so after its first token every next token is determined: a model can drive the loss
    towards zero, and quickly, by learning the table. Symbols are spread over the whole
    vocabulary so that every vocabulary shard is involved.

    Args:
        vocab_size: Size of the model's vocabulary.
        n_symbols: Number of distinct tokens that appear.
        seed: Fixes the table and the batches; equal seeds give equal data on every rank.
    """

    def __init__(self, vocab_size: int, n_symbols: int = 64, seed: int = 0) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self.symbols = torch.randperm(vocab_size, generator=self._gen)[:n_symbols]
        # successor[i] is the index (into symbols) of the symbol following symbols[i].
        self.successor = torch.randperm(n_symbols, generator=self._gen)

    def batch(self, batch_size: int, length: int) -> torch.Tensor:
        """Return the next ``(batch_size, length)`` batch of token ids (on CPU)."""
        idx = torch.empty(batch_size, length, dtype=torch.long)
        idx[:, 0] = torch.randint(len(self.symbols), (batch_size,), generator=self._gen)
        for t in range(1, length):
            idx[:, t] = self.successor[idx[:, t - 1]]
        return self.symbols[idx]


# ---------------------------------------------------------------------------------------------
# Training both copies


def _demo_config(args: argparse.Namespace) -> LlamaConfig:
    # 8 query heads over 4 kv heads: grouped-query attention, and head counts that split over
    # 1, 2 or 4 ranks. The vocabulary (1001) splits evenly over none of them, on purpose.
    sizes = {
        "dim": 64,
        "n_layers": args.layers,
        "n_heads": 8,
        "n_kv_heads": 4,
        "vocab_size": 1001,
        "max_seq_len": max(64, args.seq_len),
    }
    if args.moe is None:
        return LlamaConfig(**sizes)
    # 8 experts (whole experts on 1, 2, 4 or 8 ranks), 2 per token, with a shared expert
    return MoEConfig(
        **sizes, n_experts=8, top_k=2, expert_hidden_dim=64, shared_expert_hidden_dim=64
    )


def _aux_loss_exact(args: argparse.Namespace) -> bool:
    """Whether each rank's routers see every token, so that the load-balancing loss is the
    single-device one (with expert parallelism on a sequence shard it is the shard's)."""
    return args.moe is not None and not (args.moe == "ep" and args.sequence_parallel)


def _check_args(args: argparse.Namespace, world_size: int) -> str | None:
    """Return why the demo cannot run with ``args`` on ``world_size`` ranks, or ``None``."""
    if world_size < 1:
        return f"the world size must be at least 1, found {world_size}"
    for name in ("steps", "batch_size", "seq_len", "layers"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, found {getattr(args, name)}"
    config = _demo_config(args)
    sizes = [
        ("n_heads", config.n_heads),
        ("n_kv_heads", config.kv_heads),
        ("the feed-forward hidden dim", config.ffn_hidden_dim),
    ]
    if args.moe == "ep":
        sizes = sizes[:2] + [("the number of experts", config.n_experts)]
    elif args.moe == "tp":
        sizes = sizes[:2] + [
            ("the experts' hidden dim", config.expert_hidden_dim),
            ("the shared expert's hidden dim", config.shared_expert_hidden_dim),
        ]
    if args.sequence_parallel:
        sizes.append(("--seq-len", args.seq_len))
    bad = [f"{name} ({size})" for name, size in sizes if size % world_size != 0]
    if bad:
        return (
            f"the demo model cannot be split over {world_size} ranks: "
            f"{', '.join(bad)} not divisible by {world_size}"
        )
    return None


def losses_agree(tp_losses: list[float], ref_losses: list[float], rtol: float) -> bool:
    """Whether every tensor-parallel loss is within ``rtol`` (relative) of the reference one.

    A non-finite loss on either side never agrees. Near zero loss a relative bound alone is
    meaningless, so a tiny absolute slack is added.
    """
    if len(tp_losses) != len(ref_losses):
        return False
    return all(
        math.isfinite(tp) and math.isfinite(ref) and abs(tp - ref) <= rtol * abs(ref) + _LOSS_ATOL
        for tp, ref in zip(tp_losses, ref_losses, strict=True)
    )


def _local_numel(model: nn.Module) -> int:
    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )


def _max_param_diff(tp_model: nn.Module, ref_model: nn.Module) -> float:
    # full_tensor() is a collective: every rank walks the parameters in the same order.
    ref_params = dict(ref_model.named_parameters())
    worst = 0.0
    for name, param in tp_model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        worst = max(worst, (full.detach() - ref_params[name].detach()).abs().max().item())
    return worst


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class _History:
    tp: list[float] = field(default_factory=list)
    ref: list[float] = field(default_factory=list)
    tp_seconds: float = 0.0
    ref_seconds: float = 0.0

    @property
    def diffs(self) -> list[float]:
        return [abs(a - b) for a, b in zip(self.tp, self.ref, strict=True)]


def _timed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    aux_loss: bool,
) -> tuple[float, float]:
    start = time.perf_counter()
    logits = model(inputs)
    # The default plan hands back replicated logits as a plain tensor of full shape; anything
    # else means the plan (or a style) broke its output contract, which a loss would hide.
    if isinstance(logits, DTensor) or logits.shape[:2] != targets.shape:
        raise TypeError(
            "expected plain full-shape logits from the model, found "
            f"{type(logits).__name__} of shape {tuple(logits.shape)}"
        )
    loss = _lm_loss(logits, targets)
    if aux_loss:
        loss = loss + model.aux_loss()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()  # also waits for the device, so the timing is honest
    return value, time.perf_counter() - start


def _run(args: argparse.Namespace, device_type: str) -> bool:
    """Train both copies on this rank; return whether their losses agreed."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    config = _demo_config(args)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("tp",))

    # Same seed everywhere, so every rank's reference is identical; parallelize_module also
    # takes each shard from rank 0's full tensor (src_data_rank=0).
    torch.manual_seed(args.seed)
    if args.moe is None:
        ref_model = Llama(config).to(device)
        plan = llama_plan(sequence_parallel=args.sequence_parallel)
    else:
        ref_model = MoELlama(config).to(device)
        plan = moe_llama_plan(
            experts=args.moe, shared_expert=True, sequence_parallel=args.sequence_parallel
        )
    aux_loss = _aux_loss_exact(args)
    tp_model = copy.deepcopy(ref_model)  # before parallelizing: parallelize_module is in place
    torch_tp.parallelize_module(tp_model, mesh, plan)

    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=args.lr)
    tp_opt = torch.optim.AdamW(tp_model.parameters(), lr=args.lr)
    task = SuccessorTask(config.vocab_size, seed=args.seed)
    reporter = _Reporter(args.steps, sys.stdout) if rank == 0 else None
    if reporter is not None:
        reporter.header(config, args, mesh, _local_numel(ref_model), _local_numel(tp_model))

    history = _History()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        # One extra token: inputs are the first seq_len tokens, targets the next ones.
        tokens = task.batch(args.batch_size, args.seq_len + 1).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        tp_loss, tp_time = _timed_step(tp_model, tp_opt, inputs, targets, aux_loss)
        ref_loss, ref_time = _timed_step(ref_model, ref_opt, inputs, targets, aux_loss)
        history.tp.append(tp_loss)
        history.ref.append(ref_loss)
        history.tp_seconds += tp_time
        history.ref_seconds += ref_time
        if reporter is not None:
            reporter.step(step, tp_loss, ref_loss)
    elapsed = time.perf_counter() - start

    ok = losses_agree(history.tp, history.ref, args.rtol)
    param_diff = _max_param_diff(tp_model, ref_model)
    if reporter is not None:
        reporter.summary(history, param_diff, elapsed, ok, args.rtol)
    return ok


# ---------------------------------------------------------------------------------------------
# Printing (rank 0 only)


class _Reporter:
    """Prints one row per step; on a terminal the row is redrawn in place (``\\r``) and kept
    only every tenth of the run, so the screen shows a live progress bar and a short history."""

    _BAR_WIDTH = 24

    def __init__(self, steps: int, out: TextIO) -> None:
        self.steps = steps
        self.out = out
        self.live = out.isatty()
        self.keep_every = max(1, steps // 10)

    def _print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def header(
        self,
        config: LlamaConfig,
        args: argparse.Namespace,
        mesh: DeviceMesh,
        total_params: int,
        local_params: int,
    ) -> None:
        world_size = mesh.size()
        backend = dist.get_backend()
        sp = "on" if args.sequence_parallel else "off"
        kind = "Llama" if args.moe is None else "mixture-of-experts Llama"
        self._print(
            f"torch_tp demo: {kind} with {config.n_layers} layers, dim {config.dim}, "
            f"{config.n_heads} heads / {config.kv_heads} kv heads, vocab {config.vocab_size}; "
            f"{total_params:,} parameters"
        )
        self._print(
            f"tensor parallel over {world_size} {mesh.device_type} ranks ({backend}), "
            f"sequence parallel {sp}; rank 0 holds {local_params:,} parameters "
            f"({local_params / total_params:.0%})"
        )
        if args.moe is not None:
            how = (
                "whole experts split over the ranks"
                if args.moe == "ep"
                else "every expert sharded over the ranks"
            )
            routed = " (tokens dispatched by all-to-all)" if args.moe == "ep" and sp == "on" else ""
            aux = (
                "with the load-balancing loss"
                if _aux_loss_exact(args)
                else "without the load-balancing loss (each rank routes its own sequence "
                "shard, so its load-balancing loss is the shard's, not the batch's)"
            )
            self._print(
                f"{config.n_experts} experts, top {config.top_k} per token, and a shared expert: "
                f"{how}{routed}; trained {aux}"
            )
        self._print(
            f"task: learn a fixed successor table; batch {args.batch_size} x {args.seq_len} "
            f"tokens, AdamW lr {args.lr:g}, {self.steps} steps, seed {args.seed}"
        )
        self._print()

    def step(self, step: int, tp_loss: float, ref_loss: float) -> None:
        filled = round(self._BAR_WIDTH * step / self.steps)
        bar = "#" * filled + "." * (self._BAR_WIDTH - filled)
        width = len(str(self.steps))
        row = (
            f"step {step:>{width}}/{self.steps} [{bar}] "
            f"loss tp {tp_loss:.6f}  single {ref_loss:.6f}  |diff| {abs(tp_loss - ref_loss):.2e}"
        )
        if not self.live:
            self._print(row)
            return
        # \r and erase-to-end-of-line redraw the row; a newline keeps it on screen.
        keep = step % self.keep_every == 0 or step == self.steps
        self.out.write("\r\033[K" + row + ("\n" if keep else ""))
        self.out.flush()

    def summary(
        self, history: _History, param_diff: float, elapsed: float, ok: bool, rtol: float
    ) -> None:
        diffs = history.diffs
        worst = max(diffs) if diffs else 0.0
        self._print()
        if history.ref:
            self._print(f"single-device loss {history.ref[0]:.4f} -> {history.ref[-1]:.4f}")
            self._print(
                f"max |loss diff| {worst:.2e} (tolerance {rtol:g} relative), "
                f"max |param diff| after training {param_diff:.2e}"
            )
        self._print(
            f"time {elapsed:.2f} s: tensor-parallel steps {history.tp_seconds:.2f} s, "
            f"single-device steps {history.ref_seconds:.2f} s"
        )
        if ok:
            self._print("OK: tensor-parallel training matches single-device training")
        else:
            self._print("FAILED: tensor-parallel and single-device losses diverged")
