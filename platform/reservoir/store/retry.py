"""Riding out a database restart: which errors mean "the server is gone for now", and waiting
them out with backoff.

Workers (trainer, explorers, pipeline workers, schedulers) wrap each unit of their work in a
`Patience`: an outage (connection refused or dropped, the server shutting down or starting up)
is retried every 0.5 s to 5 s, with one line when it starts and one when it ends, for up to
`store.outage_patience_s`; past that, or for any other error, it raises. Each unit must be safe
to run again (see each worker's notes: a lost commit is checked, not repeated).
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, TypeVar

from reservoir.errors import ReservoirError, StoreError

T = TypeVar("T")
# SQLSTATE classes 08 (connection exception) and 57P (operator intervention: shutdown, crash
# shutdown, cannot connect now, database dropped), as psycopg2 and asyncpg report them
OUTAGE_CODES = ("08", "57P")
OUTAGE_NAMES = ("ConnectionDoesNotExistError", "ConnectionFailureError", "CannotConnectNowError",
                "ConnectionRejectionError", "AdminShutdownError", "CrashShutdownError",
                "InterfaceError", "OperationalError")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        orig = getattr(exc, "orig", None)
        yield from ([orig] if orig is not None else [])
        exc = exc.__cause__ or exc.__context__


def is_outage(exc: BaseException) -> bool:
    """Whether exc (or what it wraps) says the server cannot be reached right now."""
    for item in _chain(exc):
        code = getattr(item, "pgcode", None) or getattr(item, "sqlstate", None)
        if code and str(code).startswith(OUTAGE_CODES):
            return True
        if isinstance(item, (ConnectionError, TimeoutError)):
            return True
        if isinstance(item, OSError) and _while_connecting(item):
            return True  # e.g. the Unix socket file is gone while the server restarts
        name, module = type(item).__name__, type(item).__module__
        if module.startswith(("psycopg2", "asyncpg")) and name in OUTAGE_NAMES:
            if name != "InterfaceError" or "closed" in str(item) or "connection" in str(item):
                return True
        if getattr(item, "connection_invalidated", False):
            return True
    return False


def _while_connecting(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return any(frame.name in ("sock_connect", "create_unix_connection", "create_connection")
               or frame.filename.endswith("connect_utils.py") for frame in frames)


def describe_outage(exc: BaseException) -> str:
    for item in _chain(exc):
        text = " ".join(str(item).split())
        if text:
            return text[:200]
    return type(exc).__name__


class Resumption:
    """How a worker of a run waits while the run is failed: it says so once, says when the
    trainer resumed (`train --resume`), and past `seconds` stops with a ReservoirError."""

    def __init__(self, run: str, seconds: float, *, say: Callable[[str], None] = print) -> None:
        self.run, self.seconds, self.say = run, seconds, say
        self.since: float | None = None

    def check(self, failed: bool) -> None:
        """Call it each round with whether the run is failed now."""
        if not failed:
            if self.since is not None:
                self.say(f"run {self.run!r}: its trainer resumed; carrying on")
            self.since = None
            return
        if self.since is None:
            self.since = time.monotonic()
            self.say(f"run {self.run!r} failed: waiting up to {self.seconds:g} s for its "
                     "trainer to resume (`reservoir train CONFIG --resume`)")
        elif time.monotonic() - self.since > self.seconds:
            raise ReservoirError(f"run {self.run!r} failed and its trainer did not resume "
                                 f"within {self.seconds:g} s (run.resume_wait_s); start this "
                                 "again with the trainer's --resume")


class Patience:
    """Call a function again while the store is out, up to `seconds` of outage."""

    def __init__(self, seconds: float = 120.0, *, say: Callable[[str], None] = print) -> None:
        self.seconds, self.say = seconds, say

    def __call__(self, work: Callable[[], T], what: str, *,
                 before_retry: Callable[[], object] | None = None) -> T:
        """work(), again after each outage; `before_retry` first undoes what a lost attempt
        may have left (a claim, a lease) and is retried with it."""
        began, delay = None, 0.5
        while True:
            try:
                if began is not None and before_retry is not None:
                    before_retry()
                result = work()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                now = time.monotonic()
                if began is None:
                    began = now
                    self.say(f"{what}: the store is unreachable ({describe_outage(exc)}); "
                             f"retrying for up to {self.seconds:g} s")
                if now - began > self.seconds:
                    raise StoreError(f"{what}: the store has been unreachable for "
                                     f"{self.seconds:g} s ({describe_outage(exc)}); start "
                                     "again when it is back (nothing is lost)") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if began is not None:
                self.say(f"{what}: the store is back after {time.monotonic() - began:.1f} s")
            return result
