"""The GPU acceptance check: the checks whose result can differ on CUDA, in one command.

Run ``python -m torch_tp.testing.gpu_check`` on a machine with one or more GPUs. Every check
runs its ranks through :func:`torch_tp.testing.run_distributed`, which gives each rank its own
GPU and NCCL when there are at least as many GPUs as ranks, and gloo otherwise (NCCL refuses
two ranks on one GPU); either way the ranks compute on CUDA tensors, each on GPU
``rank % device_count``. Each check compares against one device (the same GPU) and the
command prints one table, ``check | result | time | detail``, and exits 1 if any check
failed. ``--dry-run`` runs the same checks on CPU with gloo at tiny sizes (the plumbing, in
seconds); ``--only NAME`` runs only the named checks.

Example::

    $ python -m torch_tp.testing.gpu_check --only rng_tracker
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
import torch_tp.random as tp_random
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import RankError, check_parity, run_distributed

__all__ = ["CHECKS", "main"]

# the model and batch of each device type: tiny on CPU (the dry run), somewhat larger on CUDA
_CONFIG = {
    "cuda": {"dim": 128, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 64},
    "cpu": {"max_seq_len": 16},
}
_BATCH = {"cuda": (4, 64), "cpu": (4, 8)}
# float32 tolerances (CUDA's kernels reorder reductions more than CPU's); bfloat16 is compared
# by relative 2-norm error instead, since single elements of a bf16 gradient may be far off
_TOL = {"cuda": {"rtol": 1e-3, "atol": 1e-5}, "cpu": {"rtol": 1e-4, "atol": 1e-6}}
_BF16_REL = 5e-2


# --------------------------------------------------------------------------------- rank helpers


def _setup(device_type: str) -> torch.device:
    """Select this rank's device (GPU ``rank % device_count``) and start without a tracker."""
    tp_random.set_rng_tracker(None)  # the worker processes are shared between checks
    if device_type != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _where() -> str:
    backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    return f"{dist.get_world_size()} ranks, {backend}"


def _llama(device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0, **config):
    """The reference Llama (norm weights drawn from U(0.5, 1.5)), the same on every rank."""
    torch.manual_seed(seed)
    model = Llama(tiny_config(**{**_CONFIG[device.type], **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.to(device=device, dtype=dtype)


def _batch(device: torch.device, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    shape = _BATCH[device.type]
    tokens, targets = (torch.randint(0, 1001, shape, generator=gen) for _ in range(2))
    return tokens.to(device), targets.to(device)


def _loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, bf16: bool = False) -> None:
    """float32: elementwise at the device's tolerance; ``bf16``: relative 2-norm error."""
    actual, expected = _full(actual).detach(), expected.detach()
    if not bf16:
        tol = _TOL[expected.device.type]
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")
        return
    error = (actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)
    if error > _BF16_REL:
        raise AssertionError(f"{what}: relative error {error:.2e} > {_BF16_REL:g}")


def _compare_grads(
    model: nn.Module, reference: nn.Module, reduce: DeviceMesh | None = None, bf16: bool = False
) -> None:
    named = list(reference.named_parameters())
    if [n for n, _ in model.named_parameters()] != [n for n, _ in named]:
        raise AssertionError("the parallel model's parameter names differ from one device's")
    for (name, ref), param in zip(named, model.parameters(), strict=True):
        grad = param.grad
        if reduce is not None:  # each rank's part of the gradient: sum them
            grad = grad.clone()
            dist.all_reduce(grad, group=reduce.get_group())
        _close(grad, ref.grad, f"gradient of {name}", bf16)


# --------------------------------------------------------------------------------- the checks


def _llama_tp(device_type: str, sequence_parallel: bool) -> str:
    """TP over every rank: logits, loss, gradients and parameters after two SGD steps."""
    device = _setup(device_type)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    tokens, targets = _batch(device)
    check_parity(
        _llama(device),
        mesh,
        llama_plan(sequence_parallel=sequence_parallel),
        (tokens,),
        loss_fn=lambda logits: _loss(logits, targets),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5),
        steps=2,
        **_TOL[device_type],
    )
    return _where()


def _llama_dp_tp(device_type: str, dp: int, tp: int, dtype_name: str) -> str:
    """TP on mesh["tp"] with sequence parallelism, FSDP2 on mesh["dp"] if dp > 1, in
    ``dtype_name``: each dp rank's logits, the global loss and every gradient."""
    device = _setup(device_type)
    reference = _llama(device, getattr(torch, dtype_name))
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan(sequence_parallel=True))
    if dp > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    tokens, targets = _batch(device)
    ref_logits = reference(tokens)
    ref_loss = _loss(ref_logits, targets)
    ref_loss.backward()
    size = tokens.shape[0] // dp
    mine = slice(mesh["dp"].get_local_rank() * size, (mesh["dp"].get_local_rank() + 1) * size)
    logits = model(tokens[mine])
    loss = _loss(logits, targets[mine])
    loss.backward()
    bf16 = dtype_name == "bfloat16"
    _close(logits, ref_logits[mine], "logits", bf16)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    _close(total / dp, ref_loss, "loss", bf16)
    _compare_grads(model, reference, bf16=bf16)
    return f"{_where()}, {dtype_name}"


def _rng_tracker(device_type: str) -> str:
    """Masks outside a fork region are the same on every rank (and one device's with the same
    seed), masks inside differ by rank, a sequence-parallel mask is one device's slice."""
    device = _setup(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device_type, (world,))
    state = torch.cuda.get_rng_state if device.type == "cuda" else torch.get_rng_state
    ones = torch.ones(4096, device=device)
    try:
        tracker = tp_random.manual_seed(7, mesh)
        replicated = F.dropout(ones, 0.5)
        before = state()
        with tracker.fork():
            forked = F.dropout(ones, 0.5)
        if not torch.equal(state(), before):
            raise AssertionError("fork() consumed the default stream")
        gathered = [torch.empty(2, ones.numel(), device=device) for _ in range(world)]
        dist.all_gather(gathered, torch.stack([replicated, forked]))
        for r in range(world):
            if not torch.equal(gathered[r][0], replicated):
                raise AssertionError(f"replicated dropout masks differ on ranks {rank} and {r}")
            if r != rank and torch.equal(gathered[r][1], forked):
                raise AssertionError(f"forked dropout masks are equal on ranks {rank} and {r}")
        torch.manual_seed(7)  # the documented seeds: 7, and 7 + 2718 + rank for the TP stream
        if not torch.equal(F.dropout(ones, 0.5), replicated):
            raise AssertionError("the replicated mask is not one device's with the same seed")
        torch.manual_seed(7 + 2718 + rank)
        if not torch.equal(F.dropout(ones, 0.5), forked):
            raise AssertionError("the forked mask is not drawn with seed 7 + 2718 + tp rank")
        shape = (2, 4 * world, 8)
        torch.manual_seed(1)
        expected = F.dropout(torch.ones(shape, device=device), 0.5).chunk(world, dim=1)[rank]
        torch.manual_seed(1)
        local = torch.ones(expected.shape, device=device)
        out = tp_random.sequence_parallel_dropout(
            local, 0.5, device_mesh=mesh, sequence_dim=1, global_shape=shape
        )
        if not torch.equal(out, expected):
            raise AssertionError("sequence_parallel_dropout is not one device's mask's slice")
    finally:
        tp_random.set_rng_tracker(None)
    return _where()


def _ring_attention(device_type: str, rotation: str, load_balance: bool) -> str:
    """ContextParallel on every attention over a cp mesh of every rank, against one device's
    ``F.scaled_dot_product_attention``: logits, loss and gradients (summed over cp)."""
    device = _setup(device_type)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    reference = _llama(device)
    model = copy.deepcopy(reference)
    style = torch_tp.ContextParallel(rotation=rotation, load_balance=load_balance)
    torch_tp.parallelize_module(model, mesh, {"layers.*.attention": style})
    tokens, targets = _batch(device)
    ref_logits = reference(tokens)
    ref_loss = _loss(ref_logits, targets)
    ref_loss.backward()
    seq, lb = tokens.shape[1], {"load_balance": load_balance}
    positions = torch_tp.sequence_positions(seq, mesh, device=device, **lb)
    logits = model(torch_tp.shard_sequence(tokens, mesh, **lb), positions=positions)
    _close(torch_tp.unshard_sequence(logits.detach(), mesh, **lb), ref_logits, "logits")
    local_targets = torch_tp.shard_sequence(targets, mesh, **lb)
    loss = _loss(logits, local_targets, "sum") / targets.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    _close(total, ref_loss, "loss")
    _compare_grads(model, reference, reduce=mesh)
    return f"{_where()}, {rotation}"


def _compile(device_type: str, backend: str) -> str:
    """The TP Llama (sequence parallel) under ``torch.compile(fullgraph=True)`` against the
    eager model on one device: the logits and every gradient of two steps."""
    device = _setup(device_type)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    reference = _llama(device, n_layers=1)
    model = copy.deepcopy(reference)
    torch_tp.parallelize_module(model, mesh, llama_plan(sequence_parallel=True))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for step in range(2):
        tokens, targets = _batch(device, step)
        ref_logits = reference(tokens)
        _loss(ref_logits, targets).backward()
        logits = compiled(tokens)
        _loss(logits, targets).backward()
        _close(logits, ref_logits, f"step {step}: logits")
        _compare_grads(model, reference)
        for net in (model, reference):
            net.zero_grad()
    return f"{_where()}, {backend}"


def _checkpoint(device_type: str, directory: str) -> str:
    """DCP save and load (model, AdamW state, RNG) into a model of another seed, then
    ``full_state_dict`` and ``load_full_state_dict``: equal state and the same next loss."""
    device = _setup(device_type)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = torch_tp.parallelize_module(_llama(device, seed=seed), mesh, llama_plan())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)

    def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> torch.Tensor:
        tokens, targets = _batch(device, step)
        loss = _loss(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    def same_state(model: nn.Module, expected: dict[str, torch.Tensor], what: str) -> None:
        actual = torch_tp.checkpoint.full_state_dict(model)
        if list(actual) != list(expected):
            raise AssertionError(f"{what}: the state dict's names differ from the saved ones")
        for name, value in expected.items():
            torch.testing.assert_close(
                actual[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{what} {n}: {m}"
            )

    model, optim = build(0)
    train_step(model, optim, 0)
    torch_tp.checkpoint.save(directory, model, optim, step=1)
    # cloned: on CPU, full_state_dict's replicated tensors are the live parameters
    saved = {k: v.clone() for k, v in torch_tp.checkpoint.full_state_dict(model).items()}
    next_loss = train_step(model, optim, 1)
    loaded, loaded_optim = build(1)
    if torch_tp.checkpoint.load(directory, loaded, loaded_optim) != 1:
        raise AssertionError("checkpoint.load did not return the saved step 1")
    same_state(loaded, saved, "after checkpoint.load:")
    _close(train_step(loaded, loaded_optim, 1), next_loss, "the loss after the loaded step")
    fresh, _ = build(2)
    torch_tp.checkpoint.load_full_state_dict(fresh, saved)
    same_state(fresh, saved, "after load_full_state_dict:")
    return _where()


# --------------------------------------------------------------------------------- the table


def _never(device_type: str) -> str | None:
    return None


def _no_triton(device_type: str) -> str | None:
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "triton is not installed (inductor needs it for CUDA)"
    return None


class _Check(NamedTuple):
    """One row: ``fn(*args(device_type, scratch_dir))`` on ``world_size`` ranks, unless
    ``skip(device_type)`` gives a reason not to."""

    world_size: int
    fn: Callable[..., str]
    args: Callable[[str, str], tuple]
    skip: Callable[[str], str | None] = _never


def _backend(device_type: str) -> str:
    return "inductor" if device_type == "cuda" else "aot_eager"


CHECKS: dict[str, _Check] = {
    "llama_tp2": _Check(2, _llama_tp, lambda d, _: (d, False)),
    "llama_tp2_sp": _Check(2, _llama_tp, lambda d, _: (d, True)),
    "fsdp2_tp2": _Check(4, _llama_dp_tp, lambda d, _: (d, 2, 2, "float32")),
    "llama_tp2_bf16": _Check(2, _llama_dp_tp, lambda d, _: (d, 1, 2, "bfloat16")),
    "rng_tracker": _Check(2, _rng_tracker, lambda d, _: (d,)),
    "ring_attention_p2p": _Check(2, _ring_attention, lambda d, _: (d, "p2p", True)),
    "ring_attention_allgather": _Check(2, _ring_attention, lambda d, _: (d, "allgather", False)),
    "compile": _Check(2, _compile, lambda d, _: (d, _backend(d)), _no_triton),
    "checkpoint": _Check(2, _checkpoint, lambda d, w: (d, os.path.join(w, "ckpt"))),
}
"""The checks, in the table's order, by name (what ``--only`` takes)."""


def _last_line(exc: BaseException) -> str:
    """The failure's exception (a rank's, for a :class:`RankError`): its first line and, for
    a message of several lines (``assert_close``'s), its last one, shortened."""
    if isinstance(exc, RankError):
        lines = exc.traceback.rstrip().splitlines()
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        lines = lines[frames[-1] + 1 :] if frames else lines
    else:
        lines = "".join(traceback.format_exception_only(type(exc), exc)).splitlines()
    lines = [line for line in lines if line.strip() and not line[0].isspace()] or [repr(exc)]
    ends = (lines[0], lines[-1])
    first, last = (line if len(line) <= 120 else line[:117] + "..." for line in ends)
    return first if len(lines) == 1 else f"{first} ... {last}"


def _run_one(name: str, device_type: str, workdir: str) -> tuple[str, str]:
    world_size, fn, make_args, skip = CHECKS[name]
    reason = skip(device_type)
    if reason is not None:
        return "SKIP", reason
    try:
        timeout = 300.0 if name == "compile" else 120.0  # a hang, not a slow GPU
        results = run_distributed(fn, world_size, *make_args(device_type, workdir), timeout=timeout)
    except Exception as exc:
        return "FAIL", _last_line(exc)
    return "PASS", f"{results[0]}, {device_type} tensors"


def _table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    header = ("check", "result", "time", "detail")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]  # fmt: skip
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks, print the table, return the exit code (1 if any check failed).

    Args:
        argv: the command-line arguments (default: ``sys.argv[1:]``).

    Example::

        >>> from torch_tp.testing.gpu_check import main
        >>> main(["--dry-run", "--only", "rng_tracker"])  # doctest: +SKIP
        check       | result | time  | detail
        ...
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m torch_tp.testing.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="run the checks on CPU with gloo, tiny sizes"
    )
    parser.add_argument(
        "--only", action="append", choices=list(CHECKS), metavar="NAME",
        help=f"run only this check (repeatable): one of {', '.join(CHECKS)}",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        device_type = "cpu"
    elif torch.cuda.is_available():
        device_type = "cuda"
    else:
        print("gpu_check: no CUDA device was found; nothing was checked (--dry-run runs the "
              "checks' plumbing on CPU)")  # fmt: skip
        return 0
    # inductor compiles in the rank's own process (the ranks are daemonic: no worker pool)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    selected = args.only or list(CHECKS)
    rows, start = [], time.monotonic()
    workdir = tempfile.mkdtemp(prefix="torch_tp_gpu_check_")
    try:
        for name in CHECKS:
            if name not in selected:
                rows.append((name, "SKIP", "", "not selected (--only)"))
                continue
            began = time.monotonic()
            result, detail = _run_one(name, device_type, workdir)
            rows.append((name, result, f"{time.monotonic() - began:.1f} s", detail))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if device_type == "cuda":
        gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        where = f"CUDA: {gpus}"
    else:
        where = "dry run: CPU tensors, gloo, tiny sizes"
    print(f"torch_tp GPU acceptance check ({where}; torch {torch.__version__})")
    print(_table(rows))
    failed = sum(row[1] == "FAIL" for row in rows)
    print(f"{failed} failed, total {time.monotonic() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":  # python -m: the ranks import the checks by the module's name
    sys.exit(main())
