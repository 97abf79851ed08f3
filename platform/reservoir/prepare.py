"""Before either side of a run starts: the config's paths made absolute, the model folder
checked, and the run with its tasks created once, however many processes race to do it (the
run's unique name decides: the one whose insert succeeds loads the tasks in the same
transaction; the others wait for it and find the run)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from reservoir.config import ReservoirConfig
from reservoir.explorer.tasks import TaskShape, read_task_file
from reservoir.plan.tasks import GENERATORS
from reservoir.store import Store
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
        rows = read_task_file(tasks.file, TaskShape(
            tuple(tasks.columns.items()), tasks.answer_pattern, tasks.system_prompt,
            tasks.prompt_template))
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
        store.runs.set_status(run_id, "running")
        return run_id
    served = config.serve is not None  # a served run's groups are episodes of any size
    return store.ensure_run(config.run.name, group_size=None if served else config.explorer.n,
                            model=str(config.model.path), config=config.model_dump(mode="json"),
                            vocab_size=vocab_size(config), branch=config.branch,
                            task_rows=lambda: task_rows(config))
