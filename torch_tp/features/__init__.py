"""The features: what training a parallelized model needs beside the core, built on it.

* :mod:`~torch_tp.features.loss`: loss parallelism (cross-entropy on vocabulary shards);
* :mod:`~torch_tp.features.checkpoint`: checkpoints (full state dicts, safetensors, DCP);
* :mod:`~torch_tp.features.clip`: :func:`~torch_tp.clip_grad_norm_` over every mesh dimension.

They import the core, never the tools (:mod:`torch_tp.tools`).
"""
