"""A run's log lines: one event a line, with its time and the worker that said it.

Workers say what happens through `say(worker, message)` (the `reservoir.run` logger of Python's
logging). Where the lines go is the driver's (`reservoir run`, `train`, `explore`, with
`output`): the terminal, above the live view, as `HH:MM:SS worker: message`, and with
`--log-file` a file of whole lines (ISO time, level, worker, message), never wrapped and
without colour. `--log-format json` makes every line a JSON object (`time`, `level`, `worker`,
`message`) for log shippers, on the terminal (the live view is then left out) and in the file.
Libraries' warnings in the driver (Ray's own) become lines the same way, their worker the
library (`ray`).

A worker in a Ray actor sends its lines to the driver through a relay actor (`Relay`), not
through Ray's echo of its output (`ray.init(log_to_driver=False)`): inside `relayed`, what the
worker's Python writes to stdout and stderr (its prints, library warnings) becomes lines of the
same logger, so nothing reaches the terminal with Ray's `(TrainerWorker pid=...)` prefix, ANSI
colours or 80-column wrapping. What is written below Python (a C library on its file
descriptors, the trainer's follower ranks) stays in Ray's log files
(`/tmp/ray/session_latest/logs`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from rich.console import Console

LOGGER = "reservoir.run"
MAX_HELD = 10_000  # lines a relay holds for the driver; past it the oldest go


@dataclass(frozen=True)
class LogOptions:
    """`--log-format` and `--log-file` of the commands that run workers."""

    format: Literal["text", "json"] = "text"
    file: Path | None = None


def say(worker: str, message: str, level: int = logging.INFO) -> None:
    """One line of a worker's (several lines of one message stay one event)."""
    logging.getLogger(LOGGER).log(level, message.rstrip("\n"), extra={"worker": worker})


def warn(worker: str, message: str) -> None:
    say(worker, message, logging.WARNING)


def _time(record: logging.LogRecord) -> str:
    moment = dt.datetime.fromtimestamp(record.created, dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _worker(record: logging.LogRecord) -> str:
    """Who said it: the worker, else the library whose logger it was (`ray`)."""
    named = getattr(record, "worker", None)
    return named or ("reservoir" if record.name == LOGGER else record.name.split(".")[0])


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"time": _time(record), "level": record.levelname.lower(),
                           "worker": _worker(record), "message": record.getMessage()},
                          ensure_ascii=False)


class FileLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{_time(record)} {record.levelname.lower()} {_worker(record)}: " \
               f"{record.getMessage()}"


class TerminalLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        moment = dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        message = record.getMessage()
        if record.levelno >= logging.WARNING and not message.lower().startswith(
                ("warning", "error")):
            message = f"warning: {message}"
        return f"{moment} {_worker(record)}: {message}"


class _ToConsole(logging.Handler):
    """Lines on the Rich console (above a live view), never wrapped."""

    def __init__(self, console: Console, formatter: logging.Formatter, plain: bool) -> None:
        super().__init__()
        self.console, self.plain = console, plain
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        style = None if self.plain or record.levelno < logging.WARNING else "yellow"
        self.console.print(self.format(record), markup=False, highlight=False,
                           soft_wrap=True, style=style)


class _ToStderr(logging.Handler):
    """Where lines go outside `output` and `relayed` (a worker started from Python, a
    stream pipeline run from `reservoir pipelines run`): this process's stderr, as it is now."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(TerminalLines().format(record) + "\n")
        sys.stderr.flush()


def _default() -> None:
    logger = logging.getLogger(LOGGER)
    logger.handlers, logger.propagate = [_ToStderr()], False
    logger.setLevel(logging.INFO)


_default()


@contextlib.contextmanager
def output(console: Console, options: LogOptions = LogOptions()) -> Iterator[None]:
    """While the block runs, the run's lines go to the console and `options.file`."""
    logger = logging.getLogger(LOGGER)
    as_json = options.format == "json"
    handlers: list[logging.Handler] = [_ToConsole(console, JsonLines() if as_json
                                                  else TerminalLines(), plain=as_json)]
    if options.file is not None:
        options.file.parent.mkdir(parents=True, exist_ok=True)
        written = logging.FileHandler(options.file, encoding="utf-8")
        written.setFormatter(JsonLines() if as_json else FileLines())
        handlers.append(written)
    # Libraries' warnings in the driver (Ray's: ray.init clears the `ray` logger's handlers)
    # reach the root logger, and become lines of ours there.
    root, ray = logging.getLogger(), logging.getLogger("ray")
    previous = logger.handlers, root.handlers, ray.propagate
    logger.handlers, root.handlers, ray.propagate = handlers, list(handlers), True
    try:
        yield
    finally:
        logger.handlers, root.handlers, ray.propagate = previous
        for handler in handlers:
            handler.close()


def replay(events: list[dict]) -> None:
    """Lines a relay brought from the workers, with the time each was said, in its order
    (one worker's threads send theirs apart)."""
    logger = logging.getLogger(LOGGER)
    for event in sorted(events, key=lambda event: event["created"]):
        logger.handle(logging.makeLogRecord(event))


class Relay:
    """A Ray actor holding workers' lines until the driver takes them."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def put(self, events: list[dict]) -> None:
        self.events.extend(events)
        del self.events[:-MAX_HELD]

    def take(self) -> list[dict]:
        taken, self.events = self.events, []
        return taken


def event_of(record: logging.LogRecord) -> dict:
    """A line as a JSON-able event another process says again (`replay`)."""
    return {"name": record.name, "msg": record.getMessage(), "levelno": record.levelno,
            "levelname": record.levelname, "created": record.created,
            "worker": _worker(record)}


class _ToRelay(logging.Handler):
    def __init__(self, relay) -> None:
        super().__init__()
        self.relay = relay

    def emit(self, record: logging.LogRecord) -> None:
        self.relay.put.remote([event_of(record)])  # Ray keeps one caller's calls in order


class _Lines(io.TextIOBase):
    """A text stream whose every whole line is said by `worker` (a worker's stdout/stderr)."""

    def __init__(self, worker: str, level: int) -> None:
        self.worker, self.level, self.partial = worker, level, ""
        self.inside = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if getattr(self.inside, "busy", False):  # the logging machinery itself complaining
            sys.__stderr__.write(text)
            return len(text)
        self.partial += text
        *lines, self.partial = self.partial.split("\n")
        self.inside.busy = True
        try:
            for line in lines:
                if line.strip():
                    say(self.worker, line, self.level)
        finally:
            self.inside.busy = False
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def relayed(relay: str | None, worker: str) -> Iterator[None]:
    """In a Ray actor: the worker's lines, and what it prints, go to the driver by the relay
    actor of that name (a name, not a handle: Ray keeps an actor handle given to a restartable
    actor's constructor in its object store, and says so on the driver's stderr). None: this
    process's own handlers, as in `reservoir train`. Its first line says which Ray node it runs
    on (the id `ray status` and the dashboard show, and its address)."""
    if relay is None:
        yield
        return
    import ray

    logger = logging.getLogger(LOGGER)
    previous, logger.handlers = logger.handlers, [_ToRelay(ray.get_actor(relay))]
    say(worker, f"on Ray node {ray.get_runtime_context().get_node_id()} "
                f"({ray.util.get_node_ip_address()})")
    try:
        with contextlib.redirect_stdout(_Lines(worker, logging.INFO)), \
                contextlib.redirect_stderr(_Lines(worker, logging.WARNING)):
            yield
    finally:
        logger.handlers = previous
