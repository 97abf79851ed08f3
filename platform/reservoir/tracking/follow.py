"""Trackers as views of the store: each follows a run's committed steps, in order, once.

While a trainer runs, `follow` starts a process of its own, at nice 10 (the tracker libraries'
work never shares the trainer's interpreter: MLflow's file store alone cost the training step
~10 % from a thread beside it), that every `tracking.interval_s` reads the steps committed since
each tracker's last one (store.ledger.steps_after) and logs them with the series the store holds
about each step's window (tracking.series: explorer rates, pipeline counts, samples at
evaluations), all but the newest step, whose evaluation may still be added to it; then it
records how far it got (store.trackers): a run resumed after a crash, or `reservoir runs track`
later, continues the same tracker run and logs no step twice (one process at a time logs a run:
store.trackers.following). When the trainer ends, the process logs what is left, gives each
tracker the run's report (its plots) as artifacts, closes them and exits; when the trainer is
killed, it exits at once. A tracker that fails (a server down, a full disk) is one warning and
is dropped; the run goes on. The process's lines (its warnings) reach the trainer's log
through a pipe, as the trainer's own.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator

from reservoir.errors import ReservoirError, StoreError
from reservoir.logs import LOGGER, event_of, replay as say_again, warn
from reservoir.plan.urls import redact_text
from reservoir.tracking.series import StepSeries, step_series
from reservoir.tracking.trackers import STEP_KEY, configured

Report = Callable[..., object]  # write_report(store, run, folder): reservoir.report's

BATCH = 500  # steps read per query
FOLLOWER_SECTIONS = ("run", "store", "sampler", "tracking")  # of the config, for the follower


def _scalars(loss, metrics) -> dict[str, float]:
    """A step's numbers: its loss and every finite numeric metric."""
    values = {"loss": loss} if loss is not None else {}
    values.update({key: value for key, value in (metrics or {}).items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)})
    return {key: float(value) for key, value in values.items() if math.isfinite(value)}


class _Following:
    """The trackers of one run and where each has got to."""

    def __init__(self, store, run: str, trackers: list) -> None:
        self.store, self.run, self.run_id = store, run, store.run_id(run)
        self.live: list = []
        self.last: dict[str, int] = {}
        try:
            params = _params(store.runs.config_of(run))
        except StoreError:  # a run made without a config (from Python)
            params = {}
        for tracker in trackers:
            self._guard(tracker, lambda t=tracker: self._start(t, params))

    def _start(self, tracker, params: dict) -> None:
        state = self.store.trackers.state_of(self.run_id, tracker.kind, tracker.destination)
        external_id = tracker.start(self.run, params, state.external_id)
        last = max(state.last_step, tracker.last_logged())  # killed between log and record
        self.store.trackers.save_state(self.run_id, tracker.kind, tracker.destination,
                                       external_id, last)
        self.live.append((tracker, external_id))
        self.last[tracker.kind] = last

    def catch_up(self, hold_newest: bool = False) -> int:
        """Log every committed step each tracker has not logged; returns how many. With
        `hold_newest` (while the trainer runs) the newest step waits for the next one: its
        held-out evaluation is merged into it after it commits."""
        logged, read, series = 0, {}, {}  # by the step they follow: read once for all trackers

        def steps_after(step: int) -> list[tuple]:
            if step not in read:
                read[step] = self.store.ledger.steps_after(self.run_id, step, BATCH)
                if hold_newest and len(read[step]) < BATCH:
                    read[step] = read[step][:-1]
            return read[step]

        def series_after(step: int) -> StepSeries:
            if step not in series:
                series[step] = step_series(self.store, self.run_id, read[step])
            return series[step]

        for tracker, external_id in list(self.live):
            while True:
                after = self.last[tracker.kind]
                steps = steps_after(after)
                if not steps or not self._guard(tracker, lambda: self._log(
                        tracker, steps, series_after(after))):
                    break
                self.last[tracker.kind] = steps[-1][0]
                logged += len(steps)
                self.store.trackers.save_state(self.run_id, tracker.kind, tracker.destination,
                                               external_id, steps[-1][0])
        return logged

    @staticmethod
    def _log(tracker, steps, series: StepSeries) -> None:
        for step, stage, loss, metrics, _ in steps:
            tracker.log(step, {**_scalars(loss, metrics), **series.scalars.get(step, {}),
                               STEP_KEY: float(step)}, stage, series.samples.get(step))
        tracker.flush()  # before the store records them as logged

    def attach(self, report: Report | None) -> None:
        """The run's report (its plots, index.html) as each tracker's artifacts."""
        if report is None or not self.live:
            return
        with tempfile.TemporaryDirectory(prefix="reservoir-report-") as folder:
            try:
                report(self.store, self.run, Path(folder))
            except Exception as exc:  # a report that fails never fails the run
                warn("trackers", f"the run's report was not made for the trackers: "
                                 f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
                return
            for tracker, _ in list(self.live):
                self._guard(tracker, lambda t=tracker: t.artifacts(Path(folder)))

    def close(self) -> None:
        for tracker, _ in self.live:
            self._guard(tracker, tracker.close)
        self.live = []

    def _guard(self, tracker, action) -> bool:
        """Run a tracker's action; on failure warn once and drop the tracker."""
        try:
            action()
            return True
        except Exception as exc:  # a tracker's failure never stops the run
            hint = " (pip install 'reservoir[tracking]')" if isinstance(exc, ImportError) else ""
            warn("trackers", f"tracker {tracker.kind} ({tracker.destination}) failed and is "
                             f"dropped for this run: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]}{hint}")
            self.live = [(t, i) for t, i in self.live if t is not tracker]
            return False


def _params(config: dict, prefix: str = "") -> dict[str, str]:
    """The run's config (passwords already removed in the store) as flat parameters."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_params(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


@contextlib.contextmanager
def follow(config, store, report: Report | None = None) -> Iterator[None]:
    """While the block runs, the config's trackers follow its run from a process of their own;
    at its end they log what is left, take `report`'s plots as artifacts and close. Nothing
    happens without `tracking:`. `store` is the caller's (the process opens its own);
    `report` is a module-level function, which the process imports by its name."""
    if not configured(config.tracking):
        yield
        return
    process = subprocess.Popen(
        [sys.executable, "-c", "from reservoir.tracking.follow import follower; follower()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    dumped = config.model_dump(mode="json")  # what the follower needs: no model, no torch
    orders = {"config": {key: dumped[key] for key in FOLLOWER_SECTIONS}, "parent": os.getpid(),
              "report": f"{report.__module__}:{report.__qualname__}" if report else None}
    with contextlib.suppress(OSError):  # a follower dead at its start never stops the run
        process.stdin.write(json.dumps(orders).encode() + b"\n")
        process.stdin.flush()
    lines = threading.Thread(target=_say_lines, args=(process.stdout,), name="tracker-lines",
                             daemon=True)
    lines.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            process.stdin.write(b"stop\n")
            process.stdin.close()
        process.wait()
        lines.join(timeout=5)


def _say_lines(stream) -> None:
    """The follower's log lines (JSON, one a line), said here as they come, until it ends."""
    for line in stream:
        with contextlib.suppress(ValueError):
            say_again([json.loads(line)])


class _ToParent(logging.Handler):
    """The follower's lines as JSON on its stdout, which its trainer reads (_say_lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):
            sys.stdout.write(json.dumps(event_of(record)) + "\n")
            sys.stdout.flush()


def follower() -> None:
    """The trackers' process (`follow` starts it; nice 10: a view never takes the run's CPU):
    its orders on stdin, then follow the run until the trainer says stop. When the trainer is
    gone (killed) it stops at once: the resumed run, or `reservoir runs track`, logs the rest."""
    os.nice(10)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's, which says stop
    logging.getLogger(LOGGER).handlers = [_ToParent()]
    orders = json.loads(sys.stdin.buffer.readline())
    try:
        _follow_orders(orders)
    except Exception as exc:  # the store unreachable at the start, a broken install: one line
        cause = " ".join(str(exc).split()) or type(exc).__name__
        warn("trackers", f"the trackers stopped (the run goes on): {redact_text(cause)}")


def _follow_orders(orders: dict) -> None:
    from reservoir.config import ReservoirConfig
    from reservoir.store import Store

    config = ReservoirConfig.model_validate(orders["config"])
    with Store.open(config, quiet=True) as store, \
            store.trackers.following(store.run_id(config.run.name)):
        following = _Following(store, config.run.name, configured(config.tracking))
        try:
            if not _until_stop(following, orders["parent"], config.tracking.interval_s):
                return
            following.catch_up()
            if orders["report"]:
                module, name = orders["report"].split(":")
                following.attach(getattr(importlib.import_module(module), name))
        finally:
            following.close()


def _until_stop(following: _Following, parent: int, interval_s: float) -> bool:
    """Catch up every `interval_s` until `stop` on stdin (True) or the trainer is gone: its
    end of the pipe closed (False)."""
    while os.getppid() == parent:
        if select.select([sys.stdin], [], [], interval_s)[0]:
            return sys.stdin.buffer.readline().strip() == b"stop"
        following.catch_up(hold_newest=True)
    return False


def replay(store, run: str, trackers: list, report: Report | None = None) -> int:
    """Log a run's committed steps (those each tracker has not logged yet) and its report, and
    close; returns how many steps were logged (`reservoir runs track`); ReservoirError if every
    tracker failed (each said why). Waits while the run's own trackers are logging it."""
    with store.trackers.following(store.run_id(run)):
        return _replay(store, run, trackers, report)


def _replay(store, run: str, trackers: list, report: Report | None) -> int:
    following = _Following(store, run, trackers)
    try:
        logged = following.catch_up()
        if trackers and not following.live:
            raise ReservoirError(f"run {run!r}: no tracker could log it (see the warnings)")
        following.attach(report)
        return logged
    finally:
        following.close()
