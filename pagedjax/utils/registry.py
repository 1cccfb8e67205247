"""Classes by name, as a command-line flag names them (--tool-call-parser, --reasoning-parser):
vLLM's `register_module` decorator, and an error that lists the known names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

C = TypeVar("C", bound=type)


class Registry(Generic[C]):
    def __init__(self, what: str) -> None:
        self.what = what  # "tool call parser": how errors name an entry
        self.entries: dict[str, C] = {}

    def register_module(self, name: str) -> Callable[[C], C]:
        def register(cls: C) -> C:
            self.entries[name] = cls
            return cls

        return register

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> C:
        if name not in self.entries:
            raise ValueError(f"{self.what} {name!r} is not known; choose one of "
                             f"{self.names()}.")
        return self.entries[name]
