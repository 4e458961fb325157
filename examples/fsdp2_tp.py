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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan


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

    # the same seed on every rank: replicated regions (and initialization) agree
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
    model.init_weights(buffer_device=torch.device(device))

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
