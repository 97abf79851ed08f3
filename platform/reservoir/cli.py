"""The `reservoir` command."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from reservoir.cli_common import (ConfigOption, WideOption, _config, _open, console,
                                  external_error, fail, target)
from reservoir.cli_db import db_app
from reservoir.cli_metrics import metrics_app
from reservoir.cli_pipelines import pipeline_app, review_app, schedule_app
from reservoir.cli_runs import runs_app
from reservoir.errors import ConfigError, ReservoirError

MAX_ROWS = 10_000  # rows `reservoir sql` shows as a table or JSON unless --max-rows says
app = typer.Typer(help="Reservoir: reinforcement fine-tuning around a PostgreSQL experience store.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
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
app.add_typer(runs_app, name="runs")
app.add_typer(metrics_app, name="metrics")


def main() -> None:
    """Every failure a user can cause ends in one plain line on stderr and exit code 1."""
    try:
        app()
    except ReservoirError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:
        message = external_error(exc)
        if message is None:
            raise
        fail(message)


@app.command("sql")
def sql(statement: str = typer.Argument(..., help="One SQL statement; :name binds a --param."),
        fmt: str = typer.Option("table", "--format", "-f", help="table, csv or json."),
        param: list[str] = typer.Option([], "--param", "-p", help="name=value, bound as :name."),
        write: bool = typer.Option(False, help="Run as the store's owner and allow writes "
                                               "(default: as the reader, read-only)."),
        timeout: Optional[float] = typer.Option(None, help="Statement timeout in seconds "
                                                           "(default: store.query_timeout_s)."),
        max_rows: Optional[int] = typer.Option(None, "--max-rows", min=0, help="Rows shown "
                                               f"(default {MAX_ROWS:,} for table and json; "
                                               "csv streams every row unless given)."),
        run: Optional[str] = typer.Option(None, "--run", help="With store.urls: on this "
                                          "run's server."),
        every: bool = typer.Option(False, "--all", help="With store.urls: on every server, "
                                   "each row labelled by its server (a read)."),
        wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """Run one SQL statement against the store and print the result."""
    from reservoir.cli_output import FORMATS, CsvSink, write_rows
    from reservoir.store import run_sql

    if fmt not in FORMATS:
        raise ReservoirError(f"--format {fmt!r}: choose table, csv or json")
    if timeout is not None and not 0 < timeout <= 86_400:
        raise ReservoirError(f"--timeout {timeout}: give seconds in (0, 86400]")
    if every and (write or run):
        raise ReservoirError("--all reads every server: --write and --run work on one")
    if every:
        _sql_everywhere(statement, _params(param), timeout, max_rows, fmt, wide, config)
        return
    where = target(config, run)
    streamed = fmt == "csv" and max_rows is None
    result = run_sql(where.url, statement, params=_params(param), write=write,
                     reader_url=where.reader_url, timeout_s=timeout or where.timeout_s,
                     max_rows=None if streamed else MAX_ROWS if max_rows is None else max_rows,
                     sink=CsvSink() if streamed else None)
    if not result.columns:
        console.print(result.status, highlight=False)
    elif not streamed:
        write_rows(console, result.columns, result.rows, fmt=fmt, wide=wide)
    if result.more and not streamed:
        _say_more(result.more, max_rows, "")


def _sql_everywhere(statement: str, params: dict[str, str], timeout: Optional[float],
                    max_rows: Optional[int], fmt: str, wide: bool,
                    config: Optional[Path]) -> None:
    """`sql --all`: the read on each server in turn, its rows labelled by the server (rows of
    a server that cannot be reached are missing, said in one line, and the exit code is 1)."""
    from reservoir.cli_common import every_target, over_servers
    from reservoir.cli_output import write_rows
    from reservoir.store import run_sql

    limit, targets = MAX_ROWS if max_rows is None else max_rows, every_target(config)
    done, missing = over_servers(targets, lambda where: run_sql(
        where.url, statement, params=params, reader_url=where.reader_url,
        timeout_s=timeout or where.timeout_s, max_rows=limit))
    columns, rows, more = None, [], 0
    for server, result in done:
        if columns is not None and list(result.columns) != columns:
            raise ReservoirError(f"--all: server {server} answered with other columns "
                                 f"({', '.join(result.columns)}): are its schemas the same "
                                 "revision? (`reservoir db status`)")
        columns, more = list(result.columns), more + result.more
        rows += [[server, *row] if server else list(row) for row in result.rows]
    if columns is not None:
        labelled = targets[0][0] is not None
        write_rows(console, (["server"] if labelled else []) + columns, rows, fmt=fmt, wide=wide)
    if more:
        _say_more(more, max_rows, " a server" if targets[0][0] else "")
    if missing:
        fail(f"--all: {', '.join(missing)} could not be reached: their rows are missing")


def _say_more(more: int, max_rows: Optional[int], each: str) -> None:
    shown = MAX_ROWS if max_rows is None else max_rows
    sys.stderr.write(f"{more:,} more rows not shown (--max-rows {shown}{each}); "
                     "--format csv streams them all\n")


def _params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ReservoirError(f"--param {item!r}: write it as name=value")
        params[name] = value
    return params


@inspect_app.command("run")
def inspect_run(name: str, steps: int = typer.Option(10, min=1, max=10_000,
                                                     help="How many recent steps to show."),
                wide: bool = WideOption, config: Optional[Path] = ConfigOption) -> None:
    """A run's status, experiences per status, and its recent train steps."""
    from reservoir.cli_output import print_record, print_table
    from reservoir.store import run_summary

    where = target(config, name)
    summary, recent = run_summary(where.url, name, last_steps=steps,
                                  reader_url=where.reader_url, timeout_s=where.timeout_s)
    print_record(console, dict(zip(summary.columns, summary.rows[0])), title=f"run {name}",
                 wide=wide, skip=("config",))
    print_table(console, recent.columns, recent.rows, title="recent train steps", wide=wide)


@inspect_app.command("experience")
def inspect_experience(experience_id: int, wide: bool = WideOption,
                       run: Optional[str] = typer.Option(
                           None, "--run", help="With store.urls: the experience's run (ids "
                           "are a server's own)."),
                       config: Optional[Path] = ConfigOption) -> None:
    """One experience and its lineage: task -> experience -> train step -> policy version."""
    from reservoir.cli_output import print_record, print_table
    from reservoir.store import experience_detail

    where = target(config, run)
    row, lineage = experience_detail(where.url, experience_id, reader_url=where.reader_url,
                                     timeout_s=where.timeout_s)
    print_record(console, dict(zip(row.columns, row.rows[0])),
                 title=f"experience {experience_id}", wide=wide)
    print_table(console, lineage.columns, lineage.rows, title="lineage", wide=wide)


@model_app.command("tiny")
def model_tiny(out_dir: Path = typer.Argument(..., help="Folder to write the model into."),
               seed: int = typer.Option(0, help="Seed of the random weights."),
               layers: int = typer.Option(2, min=1, max=8, help="Transformer layers."),
               heads: int = typer.Option(2, min=1, max=64, help="Attention heads of 64 "
                                         "dimensions each (hidden size = 64 x heads).")) -> None:
    """Build a small Qwen2 (head_dim 64) with a character tokenizer and save it locally."""
    from reservoir.models import TinySpec, build_tiny_model

    spec = TinySpec(layers=layers, hidden_size=64 * heads, heads=heads,
                    intermediate_size=3 * 64 * heads)
    path = build_tiny_model(out_dir, seed=seed, spec=spec)
    console.print(f"tiny Qwen2 ({layers} layers, hidden size {spec.hidden_size}, seed {seed}) "
                  f"saved to {path}")


@model_app.command("export")
def model_export(
        source: str = typer.Argument(..., help="RUN or RUN@STEP (unset step: its last "
                                     "checkpoint)."),
        out_dir: Path = typer.Argument(..., help="New folder to write the model into."),
        adapter: bool = typer.Option(False, "--adapter", help="A LoRA run's adapters as a "
                                     "peft adapter folder instead of merged weights."),
        config: Optional[Path] = ConfigOption) -> None:
    """Write a run's checkpoint as a Hugging Face folder (safetensors, config, tokenizer,
    generation config) that transformers and vLLM load."""
    from reservoir.config import checked_checkpoint, parse_config
    from reservoir.export import export
    from reservoir.plan.weights import find_checkpoint

    run, step = checked_checkpoint(source, "RUN@STEP")
    with _open(config, run=run) as store:
        stored = store.runs.config_of(run)
    stored = parse_config({key: value for key, value in stored.items() if key != "store"},
                          source=f"run {run!r}'s stored config")
    checkpoint = find_checkpoint(Path(stored.trainer.checkpoint_dir) / run, step, source)
    path = export(stored, checkpoint, out_dir, adapter=adapter)
    kind = "adapters" if adapter else "model"
    console.print(f"{checkpoint.name} of run {run!r} exported as a Hugging Face {kind} folder: "
                  f"{path}")


def _end_run(summary) -> None:
    """The run's summary line; exit code 130 when it was stopped by Ctrl-C."""
    from reservoir.logs import say

    curve = ", ".join(f"{step if isinstance(step, str) else f'step {step}'}: {accuracy:.2f}"
                      for step, accuracy in summary.accuracy)
    say("reservoir", f"run {summary.run!r}: {summary.steps} steps, policy version "
                     f"{summary.version}; held-out accuracy {curve}")
    if summary.stopped:
        sys.exit(130)


LogFormatOption = typer.Option("text", "--log-format", case_sensitive=False,
                               help="Log lines as text (with the live table) or as JSON "
                               "objects, one a line (no live table): text | json.")
LogFileOption = typer.Option(None, "--log-file", help="Also write every log line to this "
                             "file (whole lines, no colour), as --log-format says.")


@contextmanager
def _logged(log_format: str, log_file: Optional[Path]) -> Iterator[bool]:
    """The run's log lines on the console and in --log-file; yields whether the live table
    shows."""
    from reservoir.logs import LogOptions, output

    if log_format.lower() not in ("text", "json"):
        raise ConfigError(f"--log-format: {log_format!r} is not text or json")
    options = LogOptions(log_format.lower(), log_file)
    with output(console, options):
        yield options.format == "text"


ResumeOption = typer.Option(False, help="Continue from the last checkpoint.")
FromOption = typer.Option(None, "--from", help="RUN@STEP: a new run that starts from that "
                          "run's weights at that step, with its tasks and experiences.")


def _branched(config, source: Optional[str]):
    """The config with run.branch_from set from --from (checked as the config's own key)."""
    if source is None:
        return config
    from reservoir.config import parse_config
    raw = config.model_dump(mode="json")
    raw["run"]["branch_from"] = source
    return parse_config(raw, source="--from")


@app.command("run")
def run_command(config: Path = typer.Argument(..., help="Run config YAML."),
                resume: bool = ResumeOption, source: Optional[str] = FromOption,
                log_format: str = LogFormatOption, log_file: Optional[Path] = LogFileOption
                ) -> None:
    """Run RFT: a trainer and explorer workers (Ray) meeting in the store, shown live."""
    from reservoir import pool

    with _logged(log_format, log_file) as view:
        _end_run(pool.run(_branched(_config(config), source), resume=resume, console=console,
                          view=view))


@app.command("explore")
def explore_command(config: Path = typer.Argument(..., help="Run config YAML."),
                    workers: Optional[int] = typer.Option(
                        None, help="Explorer workers (default: explorer.workers)."),
                    log_format: str = LogFormatOption,
                    log_file: Optional[Path] = LogFileOption) -> None:
    """Explorers only: claim tasks, write groups, follow published policies until the run ends."""
    from reservoir import pool
    from reservoir.logs import say

    loaded = _config(config)
    if workers is not None:
        loaded = loaded.model_copy(update={
            "explorer": loaded.explorer.model_copy(update={"workers": workers})})
    with _logged(log_format, log_file) as view:
        for stats in pool.explore(loaded, console=console, view=view):
            say("reservoir", stats.line())


@app.command("train")
def train_command(config: Path = typer.Argument(..., help="Run config YAML."),
                  resume: bool = ResumeOption, source: Optional[str] = FromOption,
                  log_format: str = LogFormatOption, log_file: Optional[Path] = LogFileOption
                  ) -> None:
    """The trainer only: lease, train, commit, publish; explorers run elsewhere."""
    from reservoir import pool

    with _logged(log_format, log_file) as view:
        _end_run(pool.train(_branched(_config(config), source), resume=resume,
                            console=console, view=view))


@app.command("serve")
def serve_command(config: Path = typer.Argument(..., help="Run config YAML with a serve: section."),
                  host: Optional[str] = typer.Option(None, help="Address to bind (default: "
                                                     "serve.host, 127.0.0.1)."),
                  port: Optional[int] = typer.Option(None, min=1, max=65_535,
                                                     help="Port (default: serve.port).")) -> None:
    """An OpenAI-compatible endpoint on the run's latest policy: every call is recorded, and an
    episode whose reward is reported (POST /v1/feedback) becomes training data."""
    from reservoir import pool
    from reservoir.config import parse_config

    loaded = _config(config)
    if loaded.serve is None:
        raise ReservoirError(f"{config}: serve: the config has no serve section; add `serve: "
                             "{}` (a served run's groups are episodes of any size)")
    if host is not None or port is not None:
        raw = loaded.model_dump(mode="json")
        raw["serve"].update({k: v for k, v in (("host", host), ("port", port)) if v is not None})
        loaded = parse_config(raw, source="--host/--port")
    pool.serve(loaded, console=console)


@app.command("report")
def report_command(run: str = typer.Argument(..., help="Run name."),
                   out: Path = typer.Option(Path("report"), "--out", "-o", help="Folder."),
                   config: Optional[Path] = ConfigOption) -> None:
    """PNG plots (reward, accuracy, length, staleness) and an HTML page for a run."""
    from reservoir.report import write_report

    with _open(config, run=run) as store:
        page = write_report(store, run, out)
    console.print(f"report for run {run!r}: {page}")


@tasks_app.command("load")
def tasks_load(file: Path = typer.Argument(..., help="JSONL, Parquet or CSV with a prompt "
                                           "column, a folder of them, or a datasets folder."),
               run: str = typer.Option(..., "--run", help="Run to load into (created if new)."),
               seed: int = typer.Option(0, help="Seed of the shuffle."),
               in_order: bool = typer.Option(False, "--in-order",
                                             help="Keep the file's order (a curriculum)."),
               column: list[str] = typer.Option([], "--column", help="OURS=THEIRS: the data "
                                                "set's column for prompt, answer, split, "
                                                "source, reward or messages (repeatable)."),
               answer_pattern: Optional[str] = typer.Option(
                   None, help="Regular expression taking the answer out of the answer "
                   "column (GSM8K: '#### (.+)')."),
               prompt_template: Optional[str] = typer.Option(
                   None, help="The prompt as a format string over the row's columns."),
               system_prompt: Optional[str] = typer.Option(
                   None, help="A system message every task's conversation starts with."),
               config: Optional[Path] = ConfigOption) -> None:
    """Load tasks from a file into a run, all or nothing, shuffled as a run's task file is
    (explorers claim tasks in id order)."""
    import random

    from pydantic import ValidationError

    from reservoir.config import TasksConfig, checked_run_name, describe_errors
    from reservoir.explorer.tasks import TaskShape, read_task_file

    checked_run_name(run, "--run")
    pairs = [item.split("=", 1) for item in column]
    bad = next((item for item, pair in zip(column, pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ConfigError(f"--column {bad!r}: write OURS=THEIRS, e.g. --column prompt=question")
    try:
        shape = TasksConfig.model_validate({
            "columns": dict(pairs), "answer_pattern": answer_pattern,
            "prompt_template": prompt_template, "system_prompt": system_prompt,
            "generate": None})
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, "tasks load options", TasksConfig)) from None
    rows = read_task_file(file, TaskShape(tuple(shape.columns.items()), shape.answer_pattern,
                                          shape.system_prompt, shape.prompt_template))
    if not in_order:
        random.Random(seed).shuffle(rows)
    with _open(config, migrate=True, run=run, create=True) as store:
        run_id = store.create_run(run, exist_ok=True)
        ids = store.tasks.add_tasks(run_id, rows)
    splits = {split: sum(row["split"] == split for row in rows) for split in {r["split"] for r in rows}}
    console.print(f"loaded {len(ids)} tasks from {file} into run {run!r} "
                  f"({', '.join(f'{n} {s}' for s, n in sorted(splits.items()))})")


@tasks_app.command("generate")
def tasks_generate(kind: str = typer.Argument(
                       ..., help="addition, reverse, sort, calculator or guess_number."),
                   n: int = typer.Argument(..., min=1, help="How many tasks."),
                   out: Path = typer.Option(..., "--out", "-o", help="JSONL file to write."),
                   seed: int = 0, test_fraction: float = typer.Option(0.1, min=0.0, max=1.0)) -> None:
    """Generate CPU example tasks (held-out split included) into a JSONL file."""
    from reservoir.explorer.tasks import write_task_file
    from reservoir.plan.tasks import GENERATORS

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
    from reservoir.cli_output import print_table
    from reservoir.config import checked_run_name
    from reservoir.demo import run_demo

    checked_run_name(run, "--run")
    if steps * groups_per_step > groups:
        raise ReservoirError(f"--steps {steps} x --groups-per-step {groups_per_step} needs "
                             f"{steps * groups_per_step} groups, --groups is {groups}")
    from reservoir.store import DEMO_RUNS, DEMO_STEPS, DEMO_TRAINED, run_sql

    with _open(config, migrate=True, run=run, create=True) as store:
        run_demo(store, run=run, n_groups=groups, group_size=group_size, steps=steps,
                 groups_per_step=groups_per_step, seed=seed, console=console,
                 raw_groups=raw_groups)
        url = store.url
    for query in (DEMO_RUNS, DEMO_STEPS):  # the queries a newcomer runs next
        console.print(f"\n$ reservoir sql {query!r} -p run={run}", highlight=False, markup=False,
                      soft_wrap=True)
        result = run_sql(url, query, params={"run": run})
        print_table(console, result.columns, result.rows)
    trained = run_sql(url, DEMO_TRAINED, params={"run": run}).rows[0][0]
    console.print(f"\nthen: reservoir inspect run {run}   reservoir inspect experience {trained}",
                  highlight=False, markup=False)

