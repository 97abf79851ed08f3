"""`reservoir pipeline`, `reservoir schedule` and `reservoir review`: data pipelines."""

from __future__ import annotations

import json
import os
from getpass import getuser
from pathlib import Path
from typing import Optional

import typer

from reservoir.cli_common import ConfigOption, WideOption, _config, _open, console, plural
from reservoir.errors import ReservoirError

pipeline_app = typer.Typer(help="Data pipelines: operator YAML run against the store.",
                           no_args_is_help=True)
schedule_app = typer.Typer(help="Cron-scheduled pipelines.", no_args_is_help=True)
review_app = typer.Typer(help="Rows held for human review, and pairs people choose.",
                         no_args_is_help=True)
ReviewerOption = typer.Option(None, help="Who decided (default: your login name).")
REVIEW_TOKEN_ENV = "RESERVOIR_REVIEW_TOKEN"


@pipeline_app.command("check")
def pipeline_check(file: Path = typer.Argument(..., help="Pipeline YAML.")) -> None:
    """Validate the YAML, every operator and its arguments, and the expectations; run nothing."""
    from reservoir.pipeline.check import check_file

    spec, steps = check_file(file)
    console.print(f"{file}: pipeline {spec.name!r} is valid: {plural(len(steps), 'operator')} "
                  f"({', '.join(step.name for step in steps) or 'none'}), "
                  f"{plural(len(spec.validate_.expectations), 'expectation')}")


@pipeline_app.command("run")
def pipeline_run(file: Path = typer.Argument(..., help="Pipeline YAML."),
                 run: Optional[list[str]] = typer.Option(None, "--run",
                                                         help="Run(s) whose rows to process."),
                 dry_run: bool = typer.Option(False, help="Show what would change; change nothing."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Run a pipeline once: select, operators, validation, one transaction of changes."""
    from reservoir.pipeline.check import check_file
    from reservoir.pipeline.report import show_result
    from reservoir.pipeline.runner import run_pipeline

    spec, _ = check_file(file)
    if spec.mode == "stream" and not dry_run:
        _stream(file, run, config)
        return
    with _open(config, migrate=True) as store, console.status("running pipeline") as status:
        result = run_pipeline(store, spec, runs=run or None, dry_run=dry_run,
                              source_file=str(file),
                              progress=lambda message: status.update(message))
    show_result(console, spec, result)


def _stream(file: Path, runs: Optional[list[str]], config: Optional[Path]) -> None:
    from reservoir.pipeline.stream import PipelineWorker

    worker = PipelineWorker(_config(config), file, runs or None)
    console.print(f"streaming {file}: raw rows are processed as they arrive (Ctrl-C stops)")
    try:
        stats = worker.run()
    except KeyboardInterrupt:
        return
    console.print(f"pipeline {stats.pipeline!r}: {stats.passes} passes, {stats.rows_in} rows "
                  f"in, {stats.rows_out} passed; its runs have ended")


@pipeline_app.command("ops")
def pipeline_ops(match: Optional[str] = typer.Argument(None, help="Only names containing this.")
                 ) -> None:
    """Operators a pipeline can use (Data-Juicer's and Reservoir's) with their arguments."""
    from reservoir.pipeline.report import operators_table

    console.print(operators_table(match))


@pipeline_app.command("history")
def pipeline_history(pipeline: Optional[str] = typer.Argument(None, help="Pipeline name."),
                     limit: int = typer.Option(20, min=1, max=100_000, help="How many runs."),
                     wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Recent pipeline runs: status (abandoned if its process died), rows in / out / dropped,
    duration, error."""
    from reservoir.cli_output import print_table
    from reservoir.store import HISTORY_COLUMNS

    with _open(config) as store:
        found = store.pipelines.history(pipeline, limit)
    print_table(console, HISTORY_COLUMNS, [[row[c] for c in HISTORY_COLUMNS] for row in found],
                title="pipeline runs, newest first", wide=wide)


@schedule_app.command("add")
def schedule_add(file: Path = typer.Argument(..., help="Pipeline YAML (mode: once)."),
                 cron: Optional[str] = typer.Option(
                     None, "--cron", help="Cron expression, e.g. '*/10 * * * *' (default: the "
                                          "file's schedule key)."),
                 name: Optional[str] = typer.Option(None, help="Default: the pipeline's name."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Schedule a pipeline (checked first); `schedule serve` runs it when due."""
    from reservoir.pipeline.schedule import add_schedule

    with _open(config, migrate=True) as store:
        schedule_id, cron = add_schedule(store, file, cron, name)
    console.print(f"schedule {schedule_id}: {file} at '{cron}'", highlight=False)


@schedule_app.command("list")
def schedule_list(wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Schedules: pipeline file, cron, next and last run, missed runs."""
    from reservoir.cli_output import print_table

    columns = ("schedule", "cron", "next_run_at", "last_run_at", "missed_runs", "enabled",
               "pipeline_file")
    with _open(config) as store:
        found = store.schedules.listed()
    print_table(console, columns, [[row[c] for c in columns] for row in found],
                title="schedules", wide=wide)


@schedule_app.command("remove")
def schedule_remove(name: str, config: Optional[Path] = ConfigOption) -> None:
    """Remove a schedule (its past pipeline runs stay)."""
    with _open(config) as store:
        if not store.schedules.remove(name):
            raise ReservoirError(f"no schedule named {name!r} (see `reservoir schedule list`)")
    console.print(f"schedule {name!r} removed")


@schedule_app.command("serve")
def schedule_serve(poll: float = typer.Option(10.0, help="Seconds between checks."),
                   once: bool = typer.Option(False, help="Run what is due now, then exit."),
                   config: Optional[Path] = ConfigOption) -> None:
    """Run due pipelines (any number of schedulers may serve one store)."""
    from reservoir.pipeline.schedule import serve

    patience = _config(config).store.outage_patience_s
    with _open(config, migrate=True) as store:
        try:
            serve(store, console, poll_s=poll, once=once, patience_s=patience)
        except KeyboardInterrupt:
            console.print("scheduler stopped")


@review_app.command("list")
def review_list(run: Optional[str] = typer.Option(None, help="Only this run's rows."),
                limit: int = typer.Option(20, min=1, max=100_000, help="How many."),
                wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Pending reviews: the held row's prompt, response, reward and why it was held."""
    from reservoir.cli_output import print_table

    columns = ("review_id", "experience_id", "run", "reward", "reason", "response", "prompt")
    with _open(config) as store:
        found = store.reviews.pending(run, limit)
    print_table(console, columns, [[row[c] for c in columns] for row in found],
                title="pending reviews", wide=wide)


@review_app.command("label")
def review_label(review_id: int,
                 verdict: str = typer.Option(..., help="accept (row becomes ready) or reject "
                                                        "(quarantined)."),
                 reviewer: Optional[str] = ReviewerOption,
                 label: Optional[str] = typer.Option(None, help="Extra labels as a JSON object."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Label a held row; it leaves `held` in the same transaction (and review_actions logs
    it)."""
    try:
        values = json.loads(label) if label else {}
    except json.JSONDecodeError as exc:
        raise ReservoirError(f"--label: not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ReservoirError(f"--label: a JSON object of name: value, not {label!r}")
    with _open(config) as store:
        status = store.reviews.label(review_id, verdict=verdict, reviewer=reviewer or getuser(),
                                     values=values)
    console.print(f"review {review_id}: {verdict}; the row is now {status}")


@review_app.command("serve")
def review_serve(run: Optional[str] = typer.Option(None, help="Only this run's rows."),
                 host: str = typer.Option("127.0.0.1", help="Address to bind (elsewhere than "
                                          "loopback, reading needs the login too)."),
                 port: int = typer.Option(8766, min=1, max=65_535),
                 config: Optional[Path] = ConfigOption) -> None:
    """A page to review held rows (accept, reject, label) and pick the better of two responses
    (DPO pairs); writing needs the token RESERVOIR_REVIEW_TOKEN (else one made now)."""
    from reservoir.http import check_free, is_loopback, run_app, url_of
    from reservoir.pipeline.review_page import Reviewing, create_app, review_token

    given = os.environ.get(REVIEW_TOKEN_ENV)
    token = review_token(given, REVIEW_TOKEN_ENV)
    check_free(host, port, "--host/--port")
    with _open(config) as store:
        app = create_app(Reviewing(store, token, run=run, open_reading=is_loopback(host)),
                         host, port)
        url = url_of(host, port)
        where = f"the token in {REVIEW_TOKEN_ENV}" if given else "this server's token, below"
        console.print(f"review page at {url}/ ; log in at {url}/login with {where}; Ctrl-C "
                      "stops", markup=False, highlight=False, soft_wrap=True)
        if not given:
            console.print(token, markup=False, highlight=False)
        run_app(app, host, port)


@review_app.command("prefer")
def review_prefer(chosen_id: int = typer.Argument(..., help="The better response's experience."),
                  rejected_id: int = typer.Argument(..., help="The worse one's (same task and run)."),
                  reviewer: Optional[str] = ReviewerOption,
                  config: Optional[Path] = ConfigOption) -> None:
    """Record that a person prefers one response to another: a DPO pair (source
    review:REVIEWER), logged in review_actions."""
    with _open(config) as store:
        added = store.reviews.prefer(chosen_id, rejected_id, reviewer=reviewer or getuser())
    console.print(f"experience {chosen_id} preferred over {rejected_id}: "
                  f"{'pair added' if added else 'the pair was already stored'}")
