"""Plans for models PEFT has wrapped: the transformers model inside a ``PeftModel``, and its
layers seen through PEFT's tuner layers.

``get_peft_model(model)`` returns a ``PeftModel`` holding ``model`` at ``base_model.model``
(LoRA's ``LoraModel`` in between) and replaces each targeted layer ``q_proj`` by a tuner
layer holding it as ``q_proj.base_layer``. A plan written for ``model`` keeps naming
``q_proj`` (the styles host the adapters on the base layer, see
:mod:`torch_tp.style.adapters`); the planners here plan the model PEFT wraps and put its
path in front of every key. torch_tp never imports PEFT: a ``PeftModel`` or a tuner layer
can only exist once PEFT has been imported.
"""

from __future__ import annotations

import sys

from torch import nn

from torch_tp import _torch_compat as compat

__all__: list[str] = []


def wrapped_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the model a ``PeftModel`` wraps (``"base_model.model"``, the
    transformers model), or ``None`` for any other module."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    inner = model.get_base_model()
    path = next(path for path, module in model.named_modules() if module is inner)
    return path, inner


def prefixed(plan: dict, path: str) -> dict:
    """``plan`` (keys relative to the module at ``path``) with keys relative to the root."""
    return {(f"{path}.{key}" if key else path): style for key, style in plan.items()}


def _tuner_layer(module: nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


def without_tuner_layers(model: nn.Module) -> nn.Module:
    """A view of ``model`` in which each PEFT tuner layer is its base layer: the modules on
    the way to a tuner layer are shallow copies (their own child dicts, the same parameters
    and attributes), everything else is ``model``'s own, and nothing of ``model`` changes.
    ``model`` itself when it holds no tuner layer.

    A plan inferred from the structure (:func:`torch_tp.plans.auto`) reads this view: it
    sees ``q_proj`` as the ``nn.Linear`` PEFT wraps, not as a parent of three Linear layers
    (the base and the adapter's two factors), so the keys it writes name the wrapper's path,
    which the styles resolve to the base layer."""
    if "peft" not in sys.modules or not any(_tuner_layer(m) for m in model.modules()):
        return model

    def view(module: nn.Module) -> nn.Module:
        if _tuner_layer(module):
            return view(module.get_base_layer())
        if not any(_tuner_layer(m) for m in module.modules()):
            return module
        children = compat.direct_children(module)
        return compat.copy_with_children(
            module, {name: None if c is None else view(c) for name, c in children.items()}
        )

    return view(model)
