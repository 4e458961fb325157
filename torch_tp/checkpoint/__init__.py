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
and every writer publishes through one other, :mod:`torch_tp.checkpoint._publishing`: a save
publishes atomically (a crash leaves the previous or the new checkpoint), one save of a
checkpoint at a time, and a load completes or changes nothing. Errors are
:class:`CheckpointError`, raised on every rank. DCP pickles its metadata and the
optimizer's hyperparameters (load only DCP checkpoints your own jobs wrote); nothing else
here unpickles a file.

The guide says the rest: failures, concurrent saves and trust in "Full state dicts" and
"Distributed checkpoints"; packed parameters, expert parallelism and PEFT adapters in
"Packed parameters, experts and adapters" (``docs/two_d_and_checkpoints.md``); Hugging
Face directories in "Hugging Face checkpoints in and out" (``docs/transformers.md``).
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
