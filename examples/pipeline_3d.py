"""3-D parallelism: pipeline stages, FSDP2 and tensor parallelism on a ``(pp, dp, tp)`` mesh.

The recipe, in this order:

1. build the model, the same on every rank (same seed);
2. ``torch_tp.pipeline.pipeline_stages``: cut it into ``pp`` stages along its blocks and keep
   this rank's, tensor-parallel inside over ``mesh["tp"]`` (the Llama plan, sequence
   parallelism optional);
3. ``fully_shard`` each block of the stage, then the stage, over ``mesh["dp"]``;
4. ``torch_tp.pipeline.build_schedule``: one of ``torch.distributed.pipelining``'s schedules,
   with the micro-batch sizes checked;
5. each step: the same ``schedule.step(tokens, target=targets)`` call on every rank, then
   ``torch_tp.clip_grad_norm_`` over all three dimensions and an AdamW step;
6. a DCP checkpoint of every rank's stage (``torch_tp.checkpoint.save``): one checkpoint of
   the whole model, under the model's names, that loads on any other layout.

Each data-parallel replica trains on its slice of the global batch. Run it with::

    torchrun --nproc-per-node 8 examples/pipeline_3d.py                  # pp=2, dp=2, tp=2
    torchrun --nproc-per-node 8 examples/pipeline_3d.py --schedule gpipe --sequence-parallel

On CPU it uses gloo, with a GPU per rank NCCL; nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp.checkpoint import save
from torch_tp.models import Llama, LlamaConfig
from torch_tp.pipeline import build_schedule, pipeline_stages
from torch_tp.plans.llama import llama_plan

# FSDP2 warns when a module it wraps returns a view ("... returned a view tensor ... wrong
# gradients"): an in-place op on that output would skip FSDP2's pre-backward hook. The last
# stage's logits are a view because a tensor-parallel output leaves its DTensor through
# ``to_local()``, which returns a view of the local tensor (as with upstream's styles). The
# schedule and the loss use the logits out of place only, so the warning does not apply.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def global_batch(step: int, size: int, seq: int, vocab: int) -> torch.Tensor:
    """The step's ``(size, seq + 1)`` token ids, the same on every rank (and for a
    single-device run of the same job)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (size, seq + 1), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4, help="per step and dp rank")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--checkpoint-dir", default=None, help="save a DCP checkpoint here")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        device = "cuda"
        torch.cuda.set_device(local_rank)
    else:
        device = "cpu"
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size % (args.pp * args.tp):
        raise SystemExit(f"the world size {world_size} does not divide by --pp x --tp")
    dp = world_size // (args.pp * args.tp)
    mesh = init_device_mesh(device, (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    # the same seed on every rank: the same model everywhere, replicated regions agree
    torch_tp.random.manual_seed(0, mesh)
    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    model = Llama(config).to(device)
    stages = pipeline_stages(
        model,
        mesh["pp"],
        tp_mesh=mesh["tp"],
        plan=llama_plan(sequence_parallel=args.sequence_parallel),
        sequence_parallel=args.sequence_parallel,
    )
    stage = stages[0].submod  # this rank's part of the model, under the model's names
    for block in stage.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    schedule = build_schedule(
        stages,
        SCHEDULES[args.schedule],
        n_microbatches=args.microbatches,
        batch_size=args.batch,
        loss_fn=loss_fn,
    )

    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
    mine = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
    for step in range(args.steps):
        tokens = global_batch(step, dp * args.batch, args.seq, config.vocab_size)[mine]
        tokens = tokens.to(device)
        losses: list[torch.Tensor] = []
        schedule.step(tokens[:, :-1], target=tokens[:, 1:], losses=losses)
        norm = torch_tp.clip_grad_norm_(stage.parameters(), max_norm=1.0, pp_mesh=mesh["pp"])
        optimizer.step()
        optimizer.zero_grad()
        if stages[0].is_last:  # the mean over the micro-batches, then over dp
            loss = torch.stack(losses).mean().detach()
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            if dp_rank == 0 and mesh["tp"].get_local_rank() == 0:
                print(
                    f"[pp={args.pp}, dp={dp}, tp={args.tp}] step {step}: "
                    f"loss {loss.item() / dp:.6f}, grad norm {norm.item():.4f}",
                    flush=True,
                )

    if args.checkpoint_dir is not None:
        save(args.checkpoint_dir, stage, step=args.steps)
        if dist.get_rank() == 0:
            print(f"saved {args.checkpoint_dir}/step-{args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
