"""LoRA fine-tuning under tensor parallelism: PEFT's adapters on a torch_tp model.

A transformers Llama (tiny and random here, built from a config: nothing is downloaded) is
split over the ranks with torch_tp's ready plan, PEFT's ``get_peft_model`` adds LoRA
adapters to every projection, and a few AdamW steps train the adapters alone, the base
frozen. The adapter is saved as PEFT saves it (``save_pretrained`` on every rank, which
gathers the adapter's full tensors, rank 0 writing the files), and loaded back on one
device, where it gives the logits the parallel model gives. Run it with::

    torchrun --nproc-per-node 2 examples/lora_finetune.py                 # CPU (gloo) or GPUs
    torchrun --nproc-per-node 2 examples/lora_finetune.py --peft-first --steps 20

By default the model is parallelized first and PEFT wraps it afterwards; ``--peft-first``
runs ``get_peft_model`` first and parallelizes the wrapped model: the same result. The
adapter's layout on the ranks is in docs/adapters.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig

import torch_tp
from torch_tp.plans.hf import plan_for

# PEFT 0.21 reads `model.is_gradient_checkpointing`, which transformers 5.23 deprecates with a
# FutureWarning on every get_peft_model; it concerns the two libraries only, not this job.
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """The model to fine-tune: the same random weights on every rank (seed 0)."""
    config = LlamaConfig(
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device)


def lora_config() -> LoraConfig:
    """LoRA of rank 8 on every projection of every decoder layer, with dropout."""
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=TARGETS)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default=None, help="adapter directory (default: a temp dir)")
    parser.add_argument("--peft-first", action="store_true", help="get_peft_model, then TP")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        device = "cuda"
        torch.cuda.set_device(local_rank)
    else:
        device = "cpu"
    # init_device_mesh starts the process group: NCCL for CUDA, gloo for CPU
    mesh = init_device_mesh(device, (int(os.environ.get("WORLD_SIZE", 1)),))
    rank = dist.get_rank()

    lora = lora_config()
    model = base_model(args, device)
    if args.peft_first:
        model = get_peft_model(model, lora)
        # the plan is the transformers model's; its keys (q_proj, ...) now name PEFT's
        # wrappers, whose base layers the styles split and whose adapters they lay out
        base = model.get_base_model()
        torch_tp.parallelize_module(base, mesh, plan_for(base))
    else:
        torch_tp.parallelize_module(model, mesh, plan_for(model))
        # PEFT wraps the parallelized layers; torch_tp lays out each adapter as it is added
        model = get_peft_model(model, lora)
    if rank == 0:
        model.print_trainable_parameters()

    # the same seed everywhere: every rank draws the same batch and the same dropout masks
    torch_tp.random.manual_seed(1, mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    vocab = model.config.vocab_size
    model.train()
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq), device=device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch_tp.clip_grad_norm_(trainable, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}, grad norm {norm.item():.3f}")

    # Save as PEFT does: every rank calls it (the adapter's state dict gathers its full
    # tensors over the ranks), rank 0 writes adapter_model.safetensors and its config.
    out = args.out
    if out is None:  # one temporary directory, chosen by rank 0
        holder = [tempfile.mkdtemp(prefix="torch_tp_lora_") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        out = holder[0]
    model.save_pretrained(out, is_main_process=rank == 0)
    dist.barrier()

    # The saved adapter on one device gives the parallel model's logits.
    model.eval()
    tokens = torch.randint(0, vocab, (2, args.seq), device=device)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if rank == 0:
        single = PeftModel.from_pretrained(base_model(args, device), out).eval()
        with torch.no_grad():
            expected = single(input_ids=tokens).logits
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        print(f"saved the adapter to {out}; loaded on one device, it gives the same logits")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
