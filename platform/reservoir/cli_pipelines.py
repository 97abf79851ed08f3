"""`reservoir pipeline`, `reservoir schedule` and `reservoir review`: data pipelines."""

from __future__ import annotations

import json
import os
import sys
from getpass import getuser
from pathlib import Path
from typing import Optional

import typer

from reservoir.cli_common import (ConfigOption, Gathered, WideOption, _config, _open,
                                  check_complete, console, gathered, plural)
from reservoir.errors import ReservoirError

pipeline_app = typer.Typer(help="Data pipelines: operator YAML run against the store.",
                           no_args_is_help=True)
schedule_app = typer.Typer(help="Cron-scheduled pipelines.", no_args_is_help=True)
review_app = typer.Typer(help="Rows held for human review, and pairs people choose.",
                         no_args_is_help=True)
ReviewerOption = typer.Option(None, help="Who decided (default: your login name).")
RunServerOption = typer.Option(None, "--run", help="With store.urls: the run whose server holds "
                               "the row (ids are a server's own).")
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
    from reservoir.store import Store

    spec, _ = check_file(file)
    if spec.mode == "stream" and not dry_run:
        _stream(file, run, config)
        return
    for server, on_server, runs in _by_server(spec, run or None, config):
        if server is not None:
            console.print(f"server {server}:", highlight=False, markup=False)
        with Store.open(on_server, migrate=True) as store, \
                console.status("running pipeline") as status:
            result = run_pipeline(store, spec, runs=runs, dry_run=dry_run, source_file=str(file),
                                  progress=lambda message: status.update(message))
        show_result(console, spec, result)


def _by_server(spec, given: Optional[list[str]], config: Optional[Path]):
    """(server, config on it, runs) for each server the pipeline's runs live on: the store
    alone without store.urls; every server for `runs: all`. Each server's changes commit
    whole; with several servers a failing one stops the rest (those before it committed)."""
    from reservoir.plan.urls import server_key
    from reservoir.servers import every_server, routed_each

    loaded = _config(config)
    if not loaded.store.urls:
        return [(None, loaded, given)]
    runs = spec.runs_to_read(given)
    if not runs:  # runs: all
        return [(server, on_server, None) for server, on_server in every_server(loaded)]
    grouped: dict[str, tuple] = {}
    for name, on_server in zip(runs, routed_each(loaded, runs)):
        url = on_server.store.url
        grouped.setdefault(url, (server_key(url), on_server, []))[2].append(name)
    return list(grouped.values())


def _stream(file: Path, runs: Optional[list[str]], config: Optional[Path]) -> None:
    from reservoir.pipeline.stream import PipelineWorker

    from reservoir.pipeline.check import check_file

    spec, _ = check_file(file)
    servers = _by_server(spec, runs or None, config)
    if len(servers) > 1:
        raise ReservoirError(f"{file}: its runs live on {len(servers)} servers of store.urls: "
                             "stream it once per server (--run NAME ...)")
    _, on_server, runs = servers[0]
    worker = PipelineWorker(on_server, file, runs or None)
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

    found = gathered(config, lambda store: store.pipelines.history(pipeline, limit))
    columns = found.columns(list(HISTORY_COLUMNS))
    print_table(console, columns, [[row[c] for c in columns] for row in found.rows],
                title="pipeline runs, newest first", wide=wide)
    check_complete(found)


@schedule_app.command("add")
def schedule_add(file: Path = typer.Argument(..., help="Pipeline YAML (mode: once)."),
                 cron: Optional[str] = typer.Option(
                     None, "--cron", help="Cron expression, e.g. '*/10 * * * *' (default: the "
                                          "file's schedule key)."),
                 name: Optional[str] = typer.Option(None, help="Default: the pipeline's name."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Schedule a pipeline (checked first); `schedule serve` runs it when due."""
    from reservoir.pipeline.check import check_file
    from reservoir.pipeline.schedule import add_schedule
    from reservoir.store import Store

    servers = _by_server(check_file(file)[0], None, config)
    if len(servers) > 1 and servers[0][2] is not None:
        raise ReservoirError(f"{file}: its runs live on {len(servers)} servers of store.urls: "
                             "schedule a pipeline file per server")
    for server, on_server, _ in servers:  # runs: all is scheduled on every server
        with Store.open(on_server, migrate=True) as store:
            schedule_id, cron = add_schedule(store, file, cron, name)
        where = f" on server {server}" if server else ""
        console.print(f"schedule {schedule_id}{where}: {file} at '{cron}'", highlight=False)


@schedule_app.command("list")
def schedule_list(wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Schedules: pipeline file, cron, next and last run, missed runs."""
    from reservoir.cli_output import print_table

    columns = ("schedule", "cron", "next_run_at", "last_run_at", "missed_runs", "enabled",
               "pipeline_file")
    found = gathered(config, lambda store: store.schedules.listed())
    columns = found.columns(list(columns))
    print_table(console, columns, [[row[c] for c in columns] for row in found.rows],
                title="schedules", wide=wide)
    check_complete(found)


@schedule_app.command("remove")
def schedule_remove(name: str, config: Optional[Path] = ConfigOption) -> None:
    """Remove a schedule (its past pipeline runs stay)."""
    removed = gathered(config, lambda store: [{"removed": store.schedules.remove(name)}])
    check_complete(removed)
    if not any(row["removed"] for row in removed.rows):
        raise ReservoirError(f"no schedule named {name!r} (see `reservoir schedule list`)")
    servers = [row["server"] for row in removed.rows if row["removed"] and "server" in row]
    console.print(f"schedule {name!r} removed" + (f" on {', '.join(servers)}" if servers else ""),
                  highlight=False, markup=False)


@schedule_app.command("serve")
def schedule_serve(poll: float = typer.Option(10.0, help="Seconds between checks."),
                   once: bool = typer.Option(False, help="Run what is due now, then exit."),
                   config: Optional[Path] = ConfigOption) -> None:
    """Run due pipelines (any number of schedulers may serve one store)."""
    from reservoir.servers import every_server

    servers = every_server(_config(config))
    if len(servers) == 1:
        try:
            _serve_schedules(*servers[0], poll, once)
        except KeyboardInterrupt:
            console.print("scheduler stopped")
        return
    _serve_every_server(servers, poll, once)


def _serve_schedules(server: Optional[str], config, poll: float, once: bool) -> None:
    from reservoir.pipeline.schedule import serve
    from reservoir.store import Store

    with Store.open(config, migrate=True) as store:
        serve(store, console, poll_s=poll, once=once, what=f"scheduler on {server}" if server
              else "scheduler", patience_s=config.store.outage_patience_s)


def _serve_every_server(servers: list, poll: float, once: bool) -> None:
    """store.urls: a scheduler thread for each server; a server out past its patience stops
    its own thread with one line, the others go on."""
    import threading

    from reservoir.cli_common import fail, unreachable

    failed: dict[str, str] = {}

    def serving(server: str, config) -> None:
        try:
            _serve_schedules(server, config, poll, once)
        except Exception as exc:  # said below, once the other servers' schedulers are done
            failed[server] = unreachable(exc) or f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"error: server {server}: {failed[server]}\n")

    threads = [threading.Thread(target=serving, args=pair, daemon=True,
                                name=f"schedules on {pair[0]}") for pair in servers]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():  # a join with a timeout lets Ctrl-C through
                thread.join(0.5)
    except KeyboardInterrupt:
        console.print("scheduler stopped")
        return
    if failed:
        fail(f"the schedulers of {', '.join(failed)} stopped (said above)")


@review_app.command("list")
def review_list(run: Optional[str] = typer.Option(None, help="Only this run's rows."),
                limit: int = typer.Option(20, min=1, max=100_000, help="How many."),
                wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Pending reviews: the held row's prompt, response, reward and why it was held."""
    from reservoir.cli_output import print_table

    columns = ("review_id", "experience_id", "run", "reward", "reason", "response", "prompt")
    if run is not None:
        with _open(config, run=run) as store:
            found = Gathered(store.reviews.pending(run, limit), False, True)
    else:
        found = gathered(config, lambda store: store.reviews.pending(run, limit))
    columns = found.columns(list(columns))
    print_table(console, columns, [[row[c] for c in columns] for row in found.rows],
                title="pending reviews", wide=wide)
    check_complete(found)


@review_app.command("label")
def review_label(review_id: int,
                 verdict: str = typer.Option(..., help="accept (row becomes ready) or reject "
                                                        "(quarantined)."),
                 reviewer: Optional[str] = ReviewerOption,
                 label: Optional[str] = typer.Option(None, help="Extra labels as a JSON object."),
                 run: Optional[str] = RunServerOption,
                 config: Optional[Path] = ConfigOption) -> None:
    """Label a held row; it leaves `held` in the same transaction (and review_actions logs
    it)."""
    try:
        values = json.loads(label) if label else {}
    except json.JSONDecodeError as exc:
        raise ReservoirError(f"--label: not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ReservoirError(f"--label: a JSON object of name: value, not {label!r}")
    with _open(config, run=run) as store:
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
    with _open(config, run=run) as store:
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
                  run: Optional[str] = RunServerOption,
                  config: Optional[Path] = ConfigOption) -> None:
    """Record that a person prefers one response to another: a DPO pair (source
    review:REVIEWER), logged in review_actions."""
    with _open(config, run=run) as store:
        added = store.reviews.prefer(chosen_id, rejected_id, reviewer=reviewer or getuser())
    console.print(f"experience {chosen_id} preferred over {rejected_id}: "
                  f"{'pair added' if added else 'the pair was already stored'}")
