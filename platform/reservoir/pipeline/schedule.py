"""Cron-scheduled pipelines: `reservoir schedule add | list | remove | serve`.

`serve` runs every due pipeline once per due time. Any number of schedulers may serve the same
store: a scheduler locks the schedule's row (skipping rows another one holds), re-reads under
that lock that it is still due, runs the pipeline and advances the next due time before it lets
go, so no two schedulers run it for the same due time. If a
scheduler was down past several due times, the pipeline runs once and the missed times are
reported (and counted in `schedules.missed_runs`), not run one after another.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

from croniter import croniter
from rich.console import Console

from reservoir.errors import ConfigError, ReservoirError
from reservoir.pipeline.check import check_file
from reservoir.pipeline.runner import run_pipeline
from reservoir.pipeline.spec import check_cron, load_pipeline
from reservoir.store import Patience, Store

MAX_MISSED_COUNTED = 10_000


def next_time(cron: str, after: datetime) -> datetime:
    return croniter(cron, after).get_next(datetime)


def missed_times(cron: str, due: datetime, now: datetime) -> int:
    """Due times after `due` (the one being run) that have already passed."""
    times, count = croniter(cron, due), 0
    while count < MAX_MISSED_COUNTED and times.get_next(datetime) <= now:
        count += 1
    return count


def add_schedule(store: Store, file: Path, cron: str | None = None,
                 name: str | None = None) -> int:
    """Check the pipeline and the cron expression (given, else the file's `schedule`), then
    schedule it; its first run is the next due time. Returns (schedule id, the cron used)."""
    spec, _ = check_file(file)
    cron = cron or spec.schedule
    if cron is None:
        raise ConfigError(f"{file}: no schedule: give --cron or a `schedule:` key in the file")
    try:
        check_cron(cron)
    except ValueError as exc:
        raise ConfigError(f"--cron: {exc}") from None
    if spec.mode == "stream":
        raise ConfigError(f"{file}: mode is stream, which runs continuously; schedule a "
                          "pipeline with mode: once")
    if not spec.source.runs:
        raise ConfigError(f"{file}: source.runs: a scheduled pipeline names the runs it reads "
                          "(runs: [NAME, ...]) or says runs: all; nothing was scheduled")
    schedule_id = store.schedules.add(name=name or spec.name,
                                      pipeline_file=str(Path(file).resolve()), cron=cron,
                                      next_run_at=next_time(cron, datetime.now(timezone.utc)))
    return schedule_id, cron


def run_due(store: Store, console: Console) -> list[int]:
    """Run every due schedule this scheduler can lock; the ids of the schedules it ran."""
    candidates = store.schedules.due()
    ran = []
    for schedule in candidates:
        with store.schedules.held_if_due(schedule["id"]) as held:
            if held is None:
                continue  # run by another scheduler, or no longer due
            _run_one(store, held, console)
            ran.append(schedule["id"])
    return ran


def _run_one(store: Store, held, console: Console) -> None:
    schedule, now = held.schedule, datetime.now(timezone.utc)
    missed = missed_times(schedule["cron"], schedule["next_run_at"], now)
    if missed:
        console.print(f"[yellow]schedule {schedule['name']!r}: {missed} due times were missed "
                      "(no scheduler was serving); running it once now[/]")
    try:
        spec = load_pipeline(schedule["pipeline_file"])
        result = run_pipeline(store, spec, trigger="schedule", schedule_id=schedule["id"],
                              source_file=schedule["pipeline_file"])
        console.print(f"schedule {schedule['name']!r}: pipeline run {result.pipeline_run_id}, "
                      f"{result.rows_in} rows in, {result.rows_out} out")
    except ReservoirError as exc:  # recorded in its pipeline_runs row; the schedule goes on
        console.print(f"[red]schedule {schedule['name']!r} failed:[/] {exc}")
    held.advance(next_run_at=next_time(schedule["cron"], now), missed=missed)


def serve(store: Store, console: Console, *, poll_s: float = 10.0, once: bool = False,
          patience_s: float = 120.0, what: str = "scheduler") -> None:
    """Run due pipelines until interrupted (or one pass with once); a pass lost to a store
    restart is run again (a schedule advances only with its run, under its row lock). `what`
    names the scheduler in its lines."""
    patience = Patience(patience_s, say=lambda line: console.print(line, markup=False))
    while True:
        patience(lambda: run_due(store, console), what)
        if once:
            return
        time.sleep(poll_s)
