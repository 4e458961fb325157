"""Checkpoints across layouts: save on a (dp, tp) mesh, resume on tensor parallelism alone.

1. Train the reference Llama with FSDP2 + TP on a ``(dp, tp)`` mesh for a few steps and
   save a distributed checkpoint (model, optimizer, RNG streams) with
   ``torch_tp.checkpoint.save``; also export the weights as one ``safetensors`` file.
2. Build the model again on another layout (TP over every rank, no FSDP), load the
   distributed checkpoint into it with ``torch_tp.checkpoint.load`` and continue training.
3. Load the exported ``safetensors`` file into a third model, each rank reading only its
   slices, and check that it holds the same weights.

Run it with (``--dir`` must be a directory every rank can read and write)::

    torchrun --nproc-per-node 4 examples/checkpoint_round_trip.py --dir /tmp/ckpt

CPU ranks use gloo and GPUs NCCL; the script is the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp import checkpoint
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan

# FSDP2 warns when a module it wraps returns a view ("... returned a view tensor ... wrong
# gradients"): an in-place op on that output (``logits += bias``) would skip FSDP2's
# pre-backward hook. The logits are a view because a tensor-parallel output leaves its DTensor
# through ``to_local()``, which returns a view of the local tensor (as with upstream's styles).
# Nothing here changes the logits in place, so the warning does not apply.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")


class _QuietGatherWarning(logging.Filter):
    """Drops DTensor's "2 sequential all_gather operations will be performed ... non-ascending"
    warning. ``full_state_dict`` gathers each weight whole, and a weight sharded by FSDP2 over
    TP (``(_StridedShard(0), Shard(0))``) is gathered over ``tp`` first, then over ``dp``:
    two all-gathers in that order, which DTensor cannot merge into one and says so. All-gathers
    only copy, so the order changes no value; an export is not on the training step's path."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("sequential all_gather" in message and "non-ascending" in message)


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_QuietGatherWarning())


def init_weights(model: Llama, device: str) -> None:
    """``model.init_weights()`` after ``to_empty``, with shards of their own on CPU.

    On a GPU, a random op on a DTensor fills each shard from its own part of one random
    stream that all ranks share (DTensor's offset-based RNG tracker). On CPU, DTensor has no
    such generator (and warns "DTensor random operators may not have complete support on
    cpu device mesh"): each rank fills its shard from its own default generator, which
    ``torch_tp.random.manual_seed`` seeded alike on every rank, so the shards would repeat
    each other. There the weights are drawn with a seed of the rank's own (every randomly
    initialized Llama weight is sharded over every mesh dimension here), and the shared
    generator state is restored afterwards.
    """
    if device != "cpu":
        model.init_weights(buffer_device=torch.device(device))
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        torch.manual_seed(1 + dist.get_rank())
        model.init_weights(buffer_device=torch.device(device))


def build(config: LlamaConfig, mesh, device: str) -> Llama:
    """The model on ``mesh``: TP on ``mesh["tp"]``, FSDP2 on ``mesh["dp"]`` if it is > 1.

    Sequence parallelism only with FSDP2: without it, ``to_empty`` on a meta model whose
    norms are sequence-parallel fails in torch_tp 0.1 (the norm weights cannot be swapped
    while torch_tp holds weak references to them). A checkpoint does not care: it holds
    the same weights either way.
    """
    with torch.device("meta"):
        model = Llama(config)
    sequence_parallel = mesh["dp"].size() > 1
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan(sequence_parallel=sequence_parallel))
    if mesh["dp"].size() > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device=device)
    init_weights(model, device)
    return model


def train(model, optimizer, mesh, steps: range, batch: int, seq: int, device: str) -> None:
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    for step in steps:
        # one global batch per step, split between the dp ranks: any layout sees the same
        data = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=data)
        tokens = tokens[dp_rank * batch // dp_size : (dp_rank + 1) * batch // dp_size].to(device)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch_tp.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        if dist.get_rank() == 0:
            layout = f"dp={dp_size}, tp={mesh['tp'].size()}"
            print(f"[{layout}] step {step}: loss {loss.item() / dp_size:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size while saving")
    parser.add_argument("--steps", type=int, default=3, help="steps before and after saving")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        device = "cuda"
        torch.cuda.set_device(local_rank)
    else:
        device = "cpu"
    world = int(os.environ.get("WORLD_SIZE", 1))
    save_mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    load_mesh = init_device_mesh(device, (1, world), mesh_dim_names=("dp", "tp"))
    # n_kv_heads = n_heads = world: whole heads on every rank of the tp=world layout
    config = LlamaConfig(dim=args.dim, n_layers=2, n_heads=world, max_seq_len=args.seq)
    root = args.dir
    if root is None:  # one temporary directory, chosen by rank 0
        holder = [tempfile.mkdtemp(prefix="torch_tp_ckpt_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        root = holder[0]

    # 1. train on (dp, tp), save, export
    torch_tp.random.manual_seed(0, save_mesh)
    model = build(config, save_mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer, save_mesh, range(args.steps), args.batch, args.seq, device)
    path = checkpoint.save(os.path.join(root, "dcp"), model, optimizer, step=args.steps)
    weights = checkpoint.full_state_dict(model, rank0_only=True)  # one tensor at a time
    exported = os.path.join(root, "model.safetensors")
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(weights, exported)
        print(f"saved {path} and {exported}")
    dist.barrier()
    del model, optimizer, weights

    # 2. resume on tp=world; the RNG streams belong to the old layout, so keep the new ones
    torch_tp.random.manual_seed(0, load_mesh)
    model = build(config, load_mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = checkpoint.load(os.path.join(root, "dcp"), model, optimizer, rng=False)
    train(model, optimizer, load_mesh, range(step, step + args.steps), args.batch, args.seq, device)

    # 3. the exported weights, loaded slice by slice, are those the checkpoint held
    reloaded = build(config, load_mesh, device)
    checkpoint.load_full_state_dict(reloaded, exported)
    fresh = build(config, load_mesh, device)
    checkpoint.load(os.path.join(root, "dcp"), fresh, rng=False)
    full = checkpoint.full_state_dict(fresh)
    for name, value in checkpoint.full_state_dict(reloaded).items():
        if not torch.equal(value, full[name]):
            raise SystemExit(f"{name} differs between the safetensors export and the checkpoint")
    if dist.get_rank() == 0:
        print("round trip OK: the exported weights equal the checkpoint's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
