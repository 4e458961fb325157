"""Token mixers ``auto()`` cannot split (state spaces, linear attention, convolutions).

:func:`mixer_reason` says why a child of a block is such a mixer (a convolution inside,
parameters of its own, a class named for Mamba, linear attention, a delta rule, ...);
:mod:`torch_tp.plans.auto.blocks` leaves it whole on every rank and the
:class:`~torch_tp.plans.auto.ReplicatedModulesWarning` names it.
"""

from __future__ import annotations

import re

from torch import nn

__all__: list[str] = []


# a token mixer that is not softmax attention, by the words of its class name
_MIXER_WORDS = ("mamba", "ssm", "lightning", "delta", "conv", "recurren", "rwkv", "retention")


_CONVOLUTIONS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def has_conv(module: nn.Module) -> bool:
    return any(isinstance(m, _CONVOLUTIONS) for m in module.modules())


def mixer_reason(unit: nn.Module) -> str | None:
    """Why auto() leaves this child of a block replicated, or ``None``: a convolution inside,
    parameters of its own (a state space's ``A_log``, ``D``, ``dt_bias``; not attention
    sinks), or a class named for a mixer other than softmax attention."""
    if has_conv(unit):
        return "a convolution inside"
    own = [name for name, _ in unit.named_parameters(recurse=False)]
    if own and own != ["sinks"]:
        return f"parameters of its own: {', '.join(own)}"
    words = [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", type(unit).__name__)]
    linear_attention = "linear attention" in " ".join(words)
    if linear_attention or any(w.startswith(_MIXER_WORDS) for w in words):
        return f"{type(unit).__name__}, by its name a mixer other than softmax attention"
    return None
