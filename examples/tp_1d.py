"""Tensor parallelism on one dimension: the reference Llama on every rank of the job.

Every rank holds a slice of each layer (``llama_plan``: Megatron's column/row split, with
sequence parallelism between the blocks) and sees the same batch. Run it with::

    torchrun --nproc-per-node 2 examples/tp_1d.py            # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/tp_1d.py --steps 20 --dim 256

The script is the same on CPU and on CUDA: the device is CUDA when there is a GPU per rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        device = "cuda"
        torch.cuda.set_device(local_rank)
    else:
        device = "cpu"
    # init_device_mesh starts the process group: NCCL for CUDA, gloo for CPU
    mesh = init_device_mesh(device, (int(os.environ.get("WORLD_SIZE", 1)),))
    rank = dist.get_rank()

    # the same seed everywhere: every rank builds the same model and draws the same batch
    torch_tp.random.manual_seed(0, mesh)
    config = LlamaConfig(
        dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq, dropout=0.1
    )
    model = Llama(config).to(device)
    torch_tp.parallelize_module(model, mesh, llama_plan(sequence_parallel=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norm = torch_tp.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
