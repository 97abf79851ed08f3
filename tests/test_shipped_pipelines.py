"""Every pipeline in pipelines/ is valid and runs on a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from reservoir.pipeline.runner import run_pipeline
from reservoir.pipeline.spec import load_pipeline
from reservoir.store.tasks import add_tasks
from tests.factories import make_group

SHIPPED = sorted((Path(__file__).parents[1] / "pipelines").glob("*.yaml"))


def test_the_seven_pipelines_are_shipped():
    assert {p.stem for p in SHIPPED} == {"clean", "dedup", "drop_zero_variance", "prioritise",
                                         "validate", "curriculum", "tasks_clean"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_pipeline_runs(path, store):
    run_id = store.create_run("r", group_size=4)
    with store.engine.begin() as conn:  # tasks, for pipelines that read them
        add_tasks(conn, run_id, [{"prompt": f"Reverse the word: w{i}"} for i in range(3)])
    store.write_groups([make_group("r", seed=i, rewards=[1, 1, 1, 1] if i == 0 else None)
                        for i in range(4)], status="raw")
    store.write_groups([make_group("r", seed=9)])  # ready rows, for pipelines that read them
    spec = load_pipeline(path)
    assert path.read_text().startswith("# " + path.stem + ":"), "documented at its top"
    result = run_pipeline(store, spec, runs=["r"])
    assert result.rows_in > 0
    with store.engine.connect() as conn:
        status = conn.execute(text("SELECT status FROM pipeline_runs")).scalar()
    assert status == "succeeded"
