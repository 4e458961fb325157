"""Checkpoints of tensor-parallel and 2-D (FSDP2 + TP) models.

Three kinds, for three jobs, one module each:

* **Full state dicts** (:mod:`torch_tp.checkpoint.full`) are ordinary ``{name: tensor}`` dicts
  with the names and values of the single-device model: to export weights, to share them, to
  start a TP job from a single-device checkpoint. :func:`full_state_dict` gathers one
  parameter at a time; :func:`load_full_state_dict` loads from memory or from a
  ``safetensors`` file (read by :mod:`torch_tp.checkpoint.safetensors`), each rank reading
  only its own slices.
* **Distributed checkpoints** (:mod:`torch_tp.checkpoint.dcp`, on
  :mod:`torch.distributed.checkpoint`) save each rank's shards in parallel, with the
  optimizer and the RNG streams, and load them on any other layout: :func:`save`,
  :func:`load`, :func:`latest_step`.
* **Hugging Face directories** (:mod:`torch_tp.checkpoint.hf`): :func:`load_pretrained` reads
  every layout transformers reads, through transformers' own conversion
  (:mod:`torch_tp.checkpoint._hf_conversion`); :func:`save_pretrained` writes what
  transformers writes.

All of them stage and agree through one private module, :mod:`torch_tp.checkpoint._staging`,
and every writer publishes through one other, :mod:`torch_tp.checkpoint._publishing`.

Failures: a save writes a new directory and publishes it with an atomic rename once every
rank is done, so a crash at any point leaves the previous or the new checkpoint loadable
(every writer, DCP and Hugging Face directories, publishes through one routine). A save
first claims its target (a claim file created exclusively and locked while the save lasts),
so a second save of the same checkpoint while the first runs raises :class:`CheckpointError`
on every rank, naming the writer that holds it, having written nothing; each save stages in
a directory of its own, and a claim is broken only once its writer is gone. A save that
fails (a full disk while writing any file, say) raises :class:`CheckpointError` on every
rank naming the file, removes its own staging directory and leaves the previous checkpoint
in place.
Every load checks the whole checkpoint against the model, reads into staging buffers and
copies into the model (and optimizer) only once every rank has read everything, so a load
completes or changes nothing. Errors are :class:`CheckpointError` (an ``Exception``, unlike
DCP's ``CheckpointException``), raised on every rank, naming the files and keys at fault.

Trust: a full state dict is read from ``safetensors`` (no code, only tensors) or from
tensors you pass in; nothing here unpickles a file for it. DCP directories are a different
matter: DCP pickles its metadata and the optimizer's hyperparameters, so load only DCP
checkpoints your own jobs wrote.

Packed parameters (:class:`~torch_tp.PackedColwiseParallel`,
:class:`~torch_tp.PackedRowwiseParallel`, and :class:`~torch_tp.TensorParallelExperts`'
``gate_up_proj``) are DTensors with DTensor's strided-shard placement: each rank holds its
slice of each of the packed parts (of every expert's gate rows and of its up rows), not one
block. Every function here handles them exactly, on a 1-D tensor-parallel mesh and under
FSDP2 where FSDP2 shards another dim than the packed one (tensor-parallel experts: FSDP2
splits the experts, dim 0, the packed dim is 1; a packed row-parallel weight). Where FSDP2
shards the packed dim too (a packed column-parallel weight or bias: both dim 0) the
placements do not say what each rank holds, so every function here refuses it with
``NotImplementedError`` rather than read or write wrong values.

PEFT's LoRA adapters hosted by a style (:mod:`torch_tp.style.adapters`) give their full
tensors in ``model.state_dict()`` (what PEFT saves) and their DTensor parameters in
``state_dict(keep_vars=True)``. Every function here reads the latter for its checks and
targets: a load copies into each rank's slices, :func:`full_state_dict` and
:func:`save_pretrained` gather them one at a time as any other DTensor, and no check
gathers before the ranks agree. DCP saves them through ``model.state_dict()``: each rank
holds the whole (small) adapter for the save, written once, loadable on any layout.

Expert parallelism (:class:`~torch_tp.ExpertParallel`) places every stacked expert parameter
as ``Shard(0)``, whole experts per rank: one block of the whole tensor, like any other
shard. A safetensors load reads only this rank's experts (or, for tensor-parallel experts,
one slice per part, each over every expert this rank holds).
"""

from torch_tp.checkpoint._staging import CheckpointError
from torch_tp.checkpoint.dcp import latest_step, load, save
from torch_tp.checkpoint.full import full_state_dict, load_full_state_dict
from torch_tp.checkpoint.hf import load_pretrained, save_pretrained

__all__ = [
    "CheckpointError",
    "full_state_dict",
    "latest_step",
    "load",
    "load_full_state_dict",
    "load_pretrained",
    "save",
    "save_pretrained",
]
