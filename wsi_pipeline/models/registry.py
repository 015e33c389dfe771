"""A name -> factory registry, so CLI choices and configs come from one place.

Every lookup and listing first loads the users' plugins (:func:`wsi_pipeline.plugins.load_plugins`, once
per process), so a part a plugin package registers is found by every command and every worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from wsi_pipeline.plugins import load_plugins

__all__ = ["Registry"]

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Factories by name. ``@registry.register("name")`` adds one; ``registry.get(name)`` returns it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        if name not in self._items:
            load_plugins()
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}") from None

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        if name not in self._items:
            load_plugins()
        return name in self._items
