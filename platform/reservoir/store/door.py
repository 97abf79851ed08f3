"""The store's one door for a family of tables: a `Door` is built on the store's engine, and
each of its methods runs one function of the family's module in a transaction of its own:
`reading` on a connection that commits nothing, `writing` in a transaction that commits whole
or not at all. Callers outside the store reach a family as `store.runs`, `store.tasks`, ...
and never hold a connection."""

from __future__ import annotations

import functools
from typing import Any, Callable

from sqlalchemy import Engine


class Door:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine


def reading(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function(conn, ...)` as a method that reads on a connection of its own."""
    @functools.wraps(function)
    def method(self: Door, *args, **kwargs):
        with self.engine.connect() as conn:
            return function(conn, *args, **kwargs)
    return method


def writing(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function(conn, ...)` as a method whose changes commit together, or none do."""
    @functools.wraps(function)
    def method(self: Door, *args, **kwargs):
        with self.engine.begin() as conn:
            return function(conn, *args, **kwargs)
    return method
