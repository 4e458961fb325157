"""2-D parallelism: FSDP2 across data-parallel replicas, tensor parallelism within each.

The mesh is ``(dp, tp)``. The recipe, in this order:

1. build the model on the meta device (no memory for the full model anywhere);
2. tensor parallelism on ``mesh["tp"]`` (``parallelize_module`` with the Llama plan);
3. activation checkpointing per block (optional), replaying the TP random stream;
4. ``fully_shard`` each block, then the root, on ``mesh["dp"]``;
5. allocate the local shards (``to_empty``) and initialize them.

Each dp rank trains on its own data; gradients are averaged over dp by FSDP2 and summed
within the TP group by the styles. Run it with::

    torchrun --nproc-per-node 4 examples/fsdp2_tp.py --tp 2     # dp = 4 / 2 = 2
    torchrun --nproc-per-node 8 examples/fsdp2_tp.py --tp 4 --checkpointing

On CPU it uses gloo, with a GPU per rank NCCL; nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan

# FSDP2 warns when a module it wraps returns a view ("... returned a view tensor ... wrong
# gradients"): an in-place op on that output (``logits += bias``) would skip FSDP2's
# pre-backward hook. The logits are a view because a tensor-parallel output leaves its DTensor
# through ``to_local()``, which returns a view of the local tensor (as with upstream's styles).
# Nothing here changes the logits in place, so the warning does not apply.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per dp rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        device = "cuda"
        torch.cuda.set_device(local_rank)
    else:
        device = "cpu"
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size % args.tp:
        raise SystemExit(f"the world size {world_size} does not divide by --tp {args.tp}")
    mesh = init_device_mesh(device, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    # the same seed on every rank: replicated regions agree
    torch_tp.random.manual_seed(0, mesh)
    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    with torch.device("meta"):
        model = Llama(config)
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan(sequence_parallel=True))
    for block in model.layers:
        if args.checkpointing:
            checkpoint(block, context_fn=torch_tp.random.checkpoint_contexts)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device=device)
    init_weights(model, device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # different data per dp rank, the same within a TP group
    data = torch.Generator(device="cpu").manual_seed(1000 + dp_rank)
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=data)
        tokens = tokens.to(device)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norm = torch_tp.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # for printing only
        if dist.get_rank() == 0:
            print(
                f"step {step}: loss {loss.item() / mesh['dp'].size():.4f}, "
                f"grad norm {norm.item():.3f}"
            )

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
