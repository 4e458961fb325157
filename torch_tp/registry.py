"""The style registry: every style class that declares a contract, by class name and by plan
name.

Style classes register themselves when they are defined (``ParallelStyle.__init_subclass__``);
the plan names (``"colwise"``), the plain-data form of plans (``{"style": "ColwiseParallel"}``)
and ``torch_tp.plan.from_dict`` look them up here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from torch_tp.contract import StyleContract

if TYPE_CHECKING:
    from torch_tp.style import ParallelStyle

__all__ = ["STYLE_REGISTRY", "StyleRegistry"]


class StyleRegistry:
    """Every style class that declares a contract, by class name and by plan name.

    Style classes register themselves when they are defined (see
    :meth:`ParallelStyle.__init_subclass__ <torch_tp.ParallelStyle>`); :data:`STYLE_REGISTRY`
    is the one instance. Defining a class again under the same module and name (a module
    reloaded) replaces it; another class claiming a registered class name or plan name is
    an error.
    """

    def __init__(self) -> None:
        self._classes: dict[str, type[ParallelStyle]] = {}
        self._names: dict[str, tuple[type[ParallelStyle], Mapping[str, Any]]] = {}

    def register(self, cls: type[ParallelStyle]) -> None:
        """Register ``cls`` under its class name and its contract's plan names."""
        contract = cls.contract
        if not isinstance(contract, StyleContract):
            raise TypeError(
                f"{cls.__qualname__}.contract must be a torch_tp.contract.StyleContract, found "
                f"{type(contract).__name__}"
            )
        previous = self._classes.get(cls.__name__)
        if previous is not None and not _same_definition(previous, cls):
            raise ValueError(
                f"a style class named {cls.__name__!r} is registered already "
                f"({previous.__module__}.{previous.__qualname__}); style classes are written "
                "in plans by their name, which must be unique: rename the class"
            )
        for name in contract.names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"{cls.__qualname__}: a plan name must be a non-empty str")
            owner = self._names.get(name)
            if owner is not None and not _same_definition(owner[0], cls):
                raise ValueError(
                    f"{cls.__qualname__}: the plan name {name!r} already stands for "
                    f"{owner[0].__qualname__}; choose another name"
                )
        if previous is not None:
            self._names = {k: v for k, v in self._names.items() if v[0] is not previous}
        self._classes[cls.__name__] = cls
        for name, arguments in contract.names.items():
            self._names[name] = (cls, MappingProxyType(dict(arguments)))

    def style(self, name: str) -> ParallelStyle | None:
        """A new style object for the plan name ``name`` (``None`` if no style has it)."""
        found = self._names.get(name)
        return None if found is None else found[0](**found[1])

    def name_of(self, style: object) -> str | None:
        """The first plan name whose style equals ``style``, or ``None``."""
        for name, (cls, _) in self._names.items():
            if type(style) is cls and self.style(name) == style:
                return name
        return None

    def cls(self, class_name: str) -> type[ParallelStyle] | None:
        """The registered style class called ``class_name``."""
        return self._classes.get(class_name)

    def names(self) -> list[str]:
        """Every plan name, in registration order."""
        return list(self._names)

    def classes(self) -> list[type[ParallelStyle]]:
        """Every registered class, in registration order."""
        return list(self._classes.values())


def _same_definition(a: type, b: type) -> bool:
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


#: Every style class with a contract: the built-in ones and any a user defines.
STYLE_REGISTRY = StyleRegistry()
