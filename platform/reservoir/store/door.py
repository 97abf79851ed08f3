"""The store's one door for a family of tables: a `Door` is built on the store's engine, and
each of its methods runs one function of the family's module on a connection of its own:
`reading` in autocommit (each statement its own snapshot, as in a read committed transaction,
without its BEGIN and ROLLBACK round trips), `writing` in a transaction that commits whole or
not at all. Callers outside the store reach a family as `store.runs`, `store.tasks`, ... and
never hold a connection."""

from __future__ import annotations

import functools
from typing import Any, Callable

from sqlalchemy import Engine


class Door:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine


def reading(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function(conn, ...)` as a method that reads on a connection of its own (autocommit:
    a function given to it only reads)."""
    @functools.wraps(function)
    def method(self: Door, *args, **kwargs):
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            return function(conn, *args, **kwargs)
    return method


def writing(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function(conn, ...)` as a method whose changes commit together, or none do."""
    @functools.wraps(function)
    def method(self: Door, *args, **kwargs):
        with self.engine.begin() as conn:
            return function(conn, *args, **kwargs)
    return method
