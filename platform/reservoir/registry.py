"""Named registries (algorithm pieces, reward functions): duplicates and unknown names are errors."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from reservoir.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A name -> function table, filled by decorator, e.g. `@ADVANTAGES.register("grpo")`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(function: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"(by {self._entries[name].__qualname__})")
            self._entries[name] = function
            return function

        return add

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: "
                              f"{', '.join(sorted(self._entries))}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)
