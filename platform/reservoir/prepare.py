"""Before either side of a run starts: the config's paths made absolute, the model folder
checked, and the run with its tasks created once, however many processes race to do it (the
run's unique name decides: the one whose insert succeeds loads the tasks in the same
transaction; the others wait for it and find the run)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from reservoir.config import ReservoirConfig
from reservoir.errors import ConfigError
from reservoir.explorer.tasks import GENERATORS, read_task_file
from reservoir.store import Store
from reservoir.store.ledger import has_step
from reservoir.store.runs import insert_run, run_id_of, set_parent, set_status, set_vocab_size
from reservoir.store.tasks import add_tasks, copy_tasks
from reservoir.plan.stages import total_steps


def absolute(config: ReservoirConfig) -> ReservoirConfig:
    """The config with every path absolute, so workers in other folders read the same files."""
    def section(name: str, **paths):
        return getattr(config, name).model_copy(update={
            key: Path(value).resolve() for key, value in paths.items() if value is not None})
    return config.model_copy(update={
        "model": section("model", path=config.model.path),
        "tasks": section("tasks", file=config.tasks.file),
        "trainer": section("trainer", checkpoint_dir=config.trainer.checkpoint_dir),
        "store": section("store", data_dir=config.store.data_dir),
        "pipelines": tuple(Path(path).resolve() for path in config.pipelines),
    })


def vocab_size(config: ReservoirConfig) -> int | None:
    """The model's vocabulary (its config.json's vocab_size, the embedding's rows): the writer
    refuses token ids at or past it. None when the folder does not say."""
    try:
        found = json.loads((Path(config.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = found.get("vocab_size", (found.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def task_rows(config: ReservoirConfig) -> list[dict]:
    """The run's tasks. A file's rows are shuffled by a generator seeded with run.seed:
    explorers claim tasks in id order (least explored first) and the warm-up reads the first
    ones, so a file written in a systematic order (0+0, 0+1, ...) would otherwise give every
    batch neighbouring, correlated tasks and the warm-up one corner of them."""
    tasks = config.tasks
    if tasks.file is not None:
        rows = read_task_file(tasks.file)
        random.Random(config.run.seed).shuffle(rows)
        return rows
    if tasks.generate is not None:
        return GENERATORS[tasks.generate](tasks.count, seed=config.run.seed,
                                          test_fraction=tasks.test_fraction)
    return []  # a served run: its agents bring the tasks


def ensure_run(store: Store, config: ReservoirConfig, *, resume: bool = False) -> int:
    """The run's id; the first caller creates it and loads its tasks, in one transaction.

    With resume, the run must have a checkpoint, and it is marked running again before its
    workers start: explorers leave a run they see stopped, failed or finished."""
    if resume:
        store.runs.check_resumable(config.run.name, total_steps(config))
        run_id = ensure_run(store, config)
        with store.engine.begin() as conn:
            set_status(conn, run_id, "running")
        return run_id
    vocabulary = vocab_size(config)
    with store.engine.begin() as conn:
        served = config.serve is not None  # a served run's groups are episodes of any size
        run_id = insert_run(conn, config.run.name,
                            group_size=None if served else config.explorer.n,
                            model=str(config.model.path), config=config.model_dump(mode="json"),
                            vocab_size=vocabulary)
        if run_id is None:  # it exists (another process may have created it a moment ago)
            run_id = run_id_of(conn, config.run.name)
            if vocabulary is not None:  # made without a model (tasks load), or another model
                set_vocab_size(conn, run_id, vocabulary)
            return run_id
        if config.branch is not None:
            _branch(conn, config, run_id)
        else:
            add_tasks(conn, run_id, task_rows(config))
        return run_id


def _branch(conn, config: ReservoirConfig, run_id: int) -> None:
    """A branched run's lineage and its parent's tasks (how often each was explored too)."""
    name, step = config.branch
    parent = run_id_of(conn, name)
    if parent is None:
        raise ConfigError(f"--from {name}@{step}: there is no run {name!r}")
    if not has_step(conn, parent, step):
        raise ConfigError(f"--from {name}@{step}: run {name!r} has not committed step {step}")
    set_parent(conn, run_id, parent, step)
    copy_tasks(conn, parent, run_id)
