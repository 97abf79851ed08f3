"""The `reservoir` command."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from reservoir.cli_common import ConfigOption, _config, _open, console
from reservoir.cli_pipelines import pipeline_app, review_app, schedule_app
from reservoir.config import load_config
from reservoir.errors import ReservoirError
from reservoir.store import migrate, server
from reservoir.store import engine as engines
from reservoir.store.inspect import QueryResult, experience_detail, run_sql, run_summary

app = typer.Typer(help="Reservoir: reinforcement fine-tuning around a PostgreSQL experience store.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
db_app = typer.Typer(help="The experience store's database: schema and embedded server.",
                     no_args_is_help=True)
inspect_app = typer.Typer(help="Look at runs and experiences.", no_args_is_help=True)
demo_app = typer.Typer(help="Runnable demonstrations.", no_args_is_help=True)
model_app = typer.Typer(help="Local models (nothing is downloaded).", no_args_is_help=True)
tasks_app = typer.Typer(help="Tasks: load them into a run, or generate CPU examples.",
                        no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(inspect_app, name="inspect")
app.add_typer(demo_app, name="demo")
app.add_typer(model_app, name="model")
app.add_typer(tasks_app, name="tasks")
app.add_typer(pipeline_app, name="pipeline")
app.add_typer(schedule_app, name="schedule")
app.add_typer(review_app, name="review")

errors = Console(stderr=True)


def main() -> None:
    try:
        app()
    except ReservoirError as exc:
        errors.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)


def print_result(result: QueryResult, fmt: str = "table", title: str | None = None) -> None:
    if not result.columns:
        console.print(f"{result.rowcount} rows affected")
    elif fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(result.columns)
        writer.writerows(result.rows)
    elif fmt == "json":
        records = [dict(zip(result.columns, row)) for row in result.rows]
        sys.stdout.write(json.dumps(records, default=str, indent=2) + "\n")
    else:
        table = Table(title=title, show_lines=False)
        for column in result.columns:
            table.add_column(column, overflow="fold")
        for row in result.rows:
            table.add_row(*["NULL" if v is None else str(v) for v in row])
        console.print(table)


@db_app.command("upgrade")
def db_upgrade(config: Optional[Path] = ConfigOption,
               revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Upgrade the schema (idempotent)."""
    url = engines.resolve_url(_config(config).store)
    engine = engines.sync_engine(url)
    before = migrate.current_revision(engine)
    migrate.upgrade(engine, revision)
    after = migrate.current_revision(engine)
    change = "already at" if before == after else f"upgraded from {before or 'empty'} to"
    console.print(f"{engines.redact(url)}: {change} revision {after}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="Target revision, e.g. -1 or 0001."),
                 config: Optional[Path] = ConfigOption) -> None:
    """Downgrade the schema (drops what later revisions added)."""
    url = engines.resolve_url(_config(config).store)
    engine = engines.sync_engine(url)
    migrate.downgrade(engine, revision)
    console.print(f"{engines.redact(url)}: now at revision {migrate.current_revision(engine)}")


@db_app.command("status")
def db_status(config: Optional[Path] = ConfigOption) -> None:
    """Where the store is, and whether its schema is current."""
    cfg = _config(config)
    url = engines.resolve_url(cfg.store)
    engine = engines.sync_engine(url)
    current, head = migrate.current_revision(engine), migrate.head_revision()
    table = Table(show_header=False)
    table.add_row("url", engines.redact(url))
    embedded = cfg.store.resolved_url() is None
    table.add_row("server", f"embedded ({cfg.store.data_dir})" if embedded else "configured URL")
    table.add_row("revision", f"{current or 'empty'} (code expects {head})")
    table.add_row("schema", "up to date" if current == head else "run `reservoir db upgrade`")
    console.print(table)


@db_app.command("url")
def db_url(config: Optional[Path] = ConfigOption,
           show_password: bool = typer.Option(False, help="Print the password too.")) -> None:
    """Print the store's URL (starting the embedded server if needed)."""
    url = engines.resolve_url(_config(config).store)
    print(url if show_password else engines.redact(url))


@db_app.command("start")
def db_start(config: Optional[Path] = ConfigOption) -> None:
    """Start the embedded server (a no-op when it runs)."""
    cfg = _config(config)
    if cfg.store.resolved_url():
        raise ReservoirError("a server URL is configured: there is no embedded server to start")
    console.print(f"embedded PostgreSQL running: {server.start(cfg.store.data_dir)}")


@db_app.command("stop")
def db_stop(config: Optional[Path] = ConfigOption) -> None:
    """Stop the embedded server."""
    data_dir = _config(config).store.data_dir
    stopped = server.stop(data_dir)
    console.print(f"embedded PostgreSQL in {data_dir} " + ("stopped" if stopped else "was not running"))


@app.command("sql")
def sql(statement: str = typer.Argument(..., help="One SQL statement; :name binds a --param."),
        fmt: str = typer.Option("table", "--format", "-f", help="table, csv or json."),
        param: list[str] = typer.Option([], "--param", "-p", help="name=value, bound as :name."),
        write: bool = typer.Option(False, help="Allow writes (default: read-only transaction)."),
        as_reader: bool = typer.Option(False, "--as-reader",
                                       help="Run as reservoir_reader (views only)."),
        config: Optional[Path] = ConfigOption) -> None:
    """Run SQL against the store and print the result."""
    if fmt not in ("table", "csv", "json"):
        raise ReservoirError(f"--format {fmt!r}: choose table, csv or json")
    params = {}
    for item in param:
        name, sep, value = item.partition("=")
        if not sep:
            raise ReservoirError(f"--param {item!r}: write it as name=value")
        params[name] = value
    with _open(config) as store:
        print_result(run_sql(store.engine, statement, params=params, write=write,
                             as_reader=as_reader), fmt)


@inspect_app.command("run")
def inspect_run(name: str, steps: int = typer.Option(10, help="How many recent steps to show."),
                config: Optional[Path] = ConfigOption) -> None:
    """A run's status, experiences per status, and its recent train steps."""
    with _open(config) as store:
        summary, recent = run_summary(store.engine, name, last_steps=steps)
    columns = [c for c in summary.columns if c != "config"]
    row = dict(zip(summary.columns, summary.rows[0]))
    table = Table(title=f"run {name}", show_header=False)
    for column in columns:
        table.add_row(column, str(row[column]))
    console.print(table)
    print_result(recent, title="recent train steps")


@inspect_app.command("experience")
def inspect_experience(experience_id: int, config: Optional[Path] = ConfigOption) -> None:
    """One experience and its lineage: task -> experience -> train step -> policy version."""
    with _open(config) as store:
        row, lineage = experience_detail(store.engine, experience_id)
    record = dict(zip(row.columns, row.rows[0]))
    table = Table(title=f"experience {experience_id}", show_header=False)
    for column, value in record.items():
        table.add_row(column, str(value))
    console.print(table)
    print_result(lineage, title="lineage")


@model_app.command("tiny")
def model_tiny(out_dir: Path = typer.Argument(..., help="Folder to write the model into."),
               seed: int = typer.Option(0, help="Seed of the random weights."),
               layers: int = typer.Option(2, min=1, max=8, help="Transformer layers.")) -> None:
    """Build a small Qwen2 (head_dim 64) with a character tokenizer and save it locally."""
    from reservoir.models import TinySpec, build_tiny_model

    path = build_tiny_model(out_dir, seed=seed, spec=TinySpec(layers=layers))
    console.print(f"tiny Qwen2 ({layers} layers, seed {seed}) saved to {path}")


def _end_run(summary) -> None:
    """The run's summary line; exit code 130 when it was stopped by Ctrl-C."""
    curve = ", ".join(f"{step if isinstance(step, str) else f'step {step}'}: {accuracy:.2f}"
                      for step, accuracy in summary.accuracy)
    console.print(f"run {summary.run!r}: {summary.steps} steps, policy version "
                  f"{summary.version}; held-out accuracy {curve}")
    if summary.stopped:
        sys.exit(130)


ResumeOption = typer.Option(False, help="Continue from the last checkpoint.")


@app.command("run")
def run_command(config: Path = typer.Argument(..., help="Run config YAML."),
                resume: bool = ResumeOption) -> None:
    """Run RFT: a trainer and explorer workers (Ray) meeting in the store, shown live."""
    from reservoir import pool

    _end_run(pool.run(load_config(config), resume=resume, console=console))


@app.command("explore")
def explore_command(config: Path = typer.Argument(..., help="Run config YAML."),
                    workers: Optional[int] = typer.Option(
                        None, help="Explorer workers (default: explorer.workers).")) -> None:
    """Explorers only: claim tasks, write groups, follow published policies until the run ends."""
    from reservoir import pool

    loaded = load_config(config)
    if workers is not None:
        loaded = loaded.model_copy(update={
            "explorer": loaded.explorer.model_copy(update={"workers": workers})})
    for stats in pool.explore(loaded, console=console):
        console.print(f"{stats.worker}: {stats.groups} groups, "
                      f"{stats.versions_loaded} policy versions loaded")


@app.command("train")
def train_command(config: Path = typer.Argument(..., help="Run config YAML."),
                  resume: bool = ResumeOption) -> None:
    """The trainer only: lease, train, commit, publish; explorers run elsewhere."""
    from reservoir import pool

    _end_run(pool.train(load_config(config), resume=resume, console=console))


@app.command("report")
def report_command(run: str = typer.Argument(..., help="Run name."),
                   out: Path = typer.Option(Path("report"), "--out", "-o", help="Folder."),
                   config: Optional[Path] = ConfigOption) -> None:
    """PNG plots (reward, accuracy, length, staleness) and an HTML page for a run."""
    from reservoir.report import write_report

    with _open(config) as store:
        page = write_report(store.engine, run, out)
    console.print(f"report for run {run!r}: {page}")


@tasks_app.command("load")
def tasks_load(file: Path = typer.Argument(..., help="JSONL, Parquet or CSV with a prompt column."),
               run: str = typer.Option(..., "--run", help="Run to load into (created if new)."),
               config: Optional[Path] = ConfigOption) -> None:
    """Load tasks from a file into a run, all or nothing."""
    from reservoir.explorer.tasks import read_task_file
    from reservoir.store.tasks import add_tasks

    rows = read_task_file(file)
    with _open(config) as store:
        run_id = store.create_run(run, exist_ok=True)
        with store.engine.begin() as conn:
            ids = add_tasks(conn, run_id, rows)
    splits = {split: sum(row["split"] == split for row in rows) for split in {r["split"] for r in rows}}
    console.print(f"loaded {len(ids)} tasks from {file} into run {run!r} "
                  f"({', '.join(f'{n} {s}' for s, n in sorted(splits.items()))})")


@tasks_app.command("generate")
def tasks_generate(kind: str = typer.Argument(..., help="addition, reverse or sort."),
                   n: int = typer.Argument(..., min=1, help="How many tasks."),
                   out: Path = typer.Option(..., "--out", "-o", help="JSONL file to write."),
                   seed: int = 0, test_fraction: float = typer.Option(0.1, min=0.0, max=1.0)) -> None:
    """Generate CPU example tasks (held-out split included) into a JSONL file."""
    from reservoir.explorer.tasks import GENERATORS, write_task_file

    if kind not in GENERATORS:
        raise ReservoirError(f"unknown task kind {kind!r}; valid: {', '.join(GENERATORS)}")
    write_task_file(GENERATORS[kind](n, seed=seed, test_fraction=test_fraction), out)
    console.print(f"wrote {n} {kind} tasks to {out}")


@demo_app.command("store")
def demo_store(run: str = typer.Option("quickstart", help="Run name (replaced if it exists)."),
               groups: int = typer.Option(2000, min=1), group_size: int = typer.Option(8, min=1),
               steps: int = typer.Option(5, min=1), groups_per_step: int = typer.Option(32, min=1),
               raw_groups: int = typer.Option(0, min=0, help="Also write this many raw groups "
                                                             "(for pipelines)."),
               seed: int = 0, config: Optional[Path] = ConfigOption) -> None:
    """Store quickstart: write synthetic groups, train a few steps, show what to query."""
    from reservoir.demo import run_demo

    with _open(config) as store:
        run_demo(store, run=run, n_groups=groups, group_size=group_size, steps=steps,
                 groups_per_step=groups_per_step, seed=seed, console=console,
                 raw_groups=raw_groups)
        console.print("\nTry: [bold]reservoir sql \"SELECT run, ready, consumed, last_step FROM "
                      "analytics.runs\"[/]")
        print_result(run_sql(store.engine,
                             "SELECT run, ready, leased, consumed, last_step, latest_version "
                             "FROM analytics.runs WHERE run = :run", params={"run": run}))
        console.print("[bold]reservoir sql \"SELECT step, reward_mean, response_len_mean FROM "
                      "analytics.run_steps WHERE run = 'quickstart'\"[/]")
        print_result(run_sql(store.engine,
                             "SELECT step, n_experiences, round(reward_mean::numeric, 3) AS "
                             "reward_mean, response_len_mean FROM analytics.run_steps "
                             "WHERE run = :run ORDER BY step", params={"run": run}))
        trained = run_sql(store.engine, "SELECT min(experience_id) FROM analytics.lineage "
                          "WHERE run = :run AND train_step IS NOT NULL", params={"run": run})
        console.print(f"[bold]reservoir inspect run {run}[/]   "
                      f"[bold]reservoir inspect experience {trained.rows[0][0]}[/]")
