"""`reservoir runs`: list runs, archive a run's experiences to Parquet and restore them, and
apply a config's retention settings."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from reservoir.cli_common import (ConfigOption, WideOption, _config, _open, check_complete,
                                  console, fail, gathered)

runs_app = typer.Typer(help="Runs: list them, archive and restore their experiences, retention.",
                       no_args_is_help=True)


@contextmanager
def _progress() -> Iterator:
    """A Rich progress bar per table while rows move (on a terminal); yields the callback to
    pass on."""
    from rich.progress import Progress

    with Progress(console=console, transient=True, disable=not console.is_terminal) as bars:
        tasks: dict[str, int] = {}

        def show(table: str, done: int, total: int) -> None:
            if done == 0 or table not in tasks:
                tasks[table] = bars.add_task(table, total=total)
            bars.update(tasks[table], completed=done)

        yield show


def _counts(manifest) -> str:
    return ", ".join(f"{rows} {table}" for table, rows in manifest.rows().items())


@runs_app.command("list")
def runs_list(wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Every run: status, experiences in the store, last change."""
    from reservoir.cli_output import print_table

    found = gathered(config, lambda store: store.runs.listing())
    columns = found.columns(["run", "status", "experiences", "updated_at"])
    print_table(console, columns, [[row[c] for c in columns] for row in found.rows], wide=wide)
    check_complete(found)


@runs_app.command("track")
def runs_track(run: str = typer.Argument(..., help="Run name."),
               to: str = typer.Option(..., "--to", help="tensorboard, mlflow or wandb."),
               where: str = typer.Argument(..., help="tensorboard: the log folder; mlflow: the "
                                           "tracking URI; wandb: the project (offline files "
                                           "in ./wandb)."),
               experiment: str = typer.Option("reservoir", help="MLflow experiment."),
               config: Optional[Path] = ConfigOption) -> None:
    """Log a run's committed steps from the store into a tracker (the steps it has not logged
    yet: live tracking of the same run continues where this ends, and the reverse)."""
    from pydantic import ValidationError

    from reservoir.config import TrackingConfig, describe_errors
    from reservoir.report import write_report
    from reservoir.tracking import replay
    from reservoir.tracking.trackers import configured

    settings = {"tensorboard": {"dir": where}, "mlflow": {"tracking_uri": where,
                                                          "experiment": experiment},
                "wandb": {"project": where}}
    if to not in settings:
        fail(f"--to {to!r}: a tracker is tensorboard, mlflow or wandb")
    try:
        tracking = TrackingConfig.model_validate({to: settings[to]})
    except ValidationError as exc:
        fail(describe_errors(exc, "runs track", TrackingConfig))
    with _open(config, run=run) as store:
        logged = replay(store, run, configured(tracking), report=write_report)
    console.print(f"run {run!r}: {logged} steps logged to {to} ({where})", highlight=False,
                  markup=False)


@runs_app.command("archive")
def runs_archive(run: str = typer.Argument(..., help="Run name."),
                 out: Path = typer.Option(..., "--out", "-o", help="Folder to write (new, or "
                                          "one without an archive)."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Move a run's experiences and the rows that hang off them into Parquet files."""
    from reservoir.store import archive_run

    with _open(config, run=run) as store, _progress() as show:
        manifest = archive_run(store, run, out, progress=show)
    console.print(f"archived run {run!r} to {out}: {_counts(manifest)}; those rows left the "
                  "store", highlight=False, markup=False)


@runs_app.command("restore")
def runs_restore(folder: Path = typer.Argument(..., help="An archive folder."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Put an archived run's rows back into the store, with their ids (all or nothing)."""
    from reservoir.store import archived_run, restore_run

    run = archived_run(folder)  # with store.urls, restored on its run's server
    with _open(config, run=run, create=True) as store, _progress() as show:
        manifest = restore_run(store, folder, progress=show)
    console.print(f"restored run {manifest.run!r} from {folder}: {_counts(manifest)}",
                  highlight=False, markup=False)


@runs_app.command("retention")
def runs_retention(config: Optional[Path] = typer.Argument(
        None, help="Config YAML whose store.retention applies (default: none).")) -> None:
    """Apply store.retention: retire old ready/raw rows of ended runs, archive idle ones."""
    from reservoir.store import apply_retention

    retention = _config(config).store.retention
    if retention.archive_after_days is None and retention.retire_after_days is None:
        console.print("store.retention sets neither archive_after_days nor retire_after_days: "
                      "nothing to do", highlight=False, markup=False)
        return
    with _progress() as show:
        summaries = gathered(config, lambda store: [
            {"summary": apply_retention(store, retention, progress=show)}])
    failed = []
    for row in summaries.rows:
        failed += _said_retention(row["summary"], retention, row.get("server"))
    for line in failed[:-1]:
        console.print(f"error: {line}", style="red", highlight=False, markup=False)
    if failed:
        fail(failed[-1])
    check_complete(summaries)


def _said_retention(summary, retention, server: str | None) -> list[str]:
    """What retention did on the store (or on one of store.urls' servers); what failed."""
    if server is not None:
        console.print(f"server {server}:", highlight=False, markup=False)
    if retention.retire_after_days is not None:
        console.print(f"retired {summary.retired} ready or raw rows of ended runs",
                      highlight=False, markup=False)
    for manifest in summary.archived:
        console.print(f"archived run {manifest.run!r} to {manifest.directory}: "
                      f"{_counts(manifest)}", highlight=False, markup=False)
    return [f"server {server}: {line}" if server else line for line in summary.failed]
