"""Named registries (algorithm pieces, reward functions, workflows): duplicates and unknown names
are errors.

A registry with an entry-point `group` also holds what installed packages declare there, e.g.

    [project.entry-points."reservoir.rewards"]
    char_overlap = "my_package.rewards:char_overlap"

Names are read from the packages' metadata without importing them; an entry is imported the
first time it is looked up, so a config can be checked without loading every plugin.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Generic, TypeVar

from reservoir.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A name -> function table, filled by decorator, e.g. `@ADVANTAGES.register("grpo")`,
    by `register_lazy` (a "module:attribute" imported on first use) and by entry points."""

    def __init__(self, kind: str, group: str | None = None) -> None:
        self.kind, self.group = kind, group
        self._entries: dict[str, F | str | EntryPoint] = {}
        self._plugins_read = group is None

    def register(self, name: str) -> Callable[[F], F]:
        def add(function: F) -> F:
            self._add(name, function)
            return function

        return add

    def register_lazy(self, name: str, target: str) -> None:
        """`target` ("package.module:attribute") is imported when `name` is first looked up."""
        self._add(name, target)

    def _add(self, name: str, entry) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered "
                             f"(by {_origin(self._entries[name])})")
        self._entries[name] = entry

    def _read_plugins(self) -> None:
        """The entry points of installed packages, once; a name taken twice is an error."""
        if self._plugins_read:
            return
        self._plugins_read = True
        for point in entry_points(group=self.group):
            if point.name in self._entries:
                raise ConfigError(f"{self.kind} {point.name!r} of entry point group "
                                  f"{self.group!r} ({point.value}) is already registered (by "
                                  f"{_origin(self._entries[point.name])}); rename one")
            self._entries[point.name] = point

    def get(self, name: str) -> F:
        self._read_plugins()
        try:
            entry = self._entries[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: "
                              f"{', '.join(sorted(self._entries))}") from None
        if isinstance(entry, (str, EntryPoint)):
            entry = self._entries[name] = self._load(name, entry)
        return entry

    def _load(self, name: str, entry: str | EntryPoint) -> F:
        try:
            if isinstance(entry, EntryPoint):
                return entry.load()
            module, _, attribute = entry.partition(":")
            return getattr(importlib.import_module(module), attribute)
        except Exception as exc:  # a plugin's own failure, named with its entry point
            raise ConfigError(f"{self.kind} {name!r} ({_origin(entry)}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc

    def names(self) -> list[str]:
        self._read_plugins()
        return sorted(self._entries)


def _origin(entry) -> str:
    if isinstance(entry, EntryPoint):
        return f"entry point {entry.value} of {entry.dist.name if entry.dist else 'a package'}"
    return entry if isinstance(entry, str) else entry.__qualname__
