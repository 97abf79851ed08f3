"""Rules of the code and of the views that a reader of the docs relies on: SQL lives in
`reservoir.store` (issue 8: the monitor, the report, the demo and the operators wrote their
own), and the analytics views name each thing one way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from reservoir.store.inspect import run_sql

ROOT = Path(__file__).resolve().parent.parent
SQL_BUILDERS = {"select", "insert", "update", "delete", "text", "func", "case", "and_", "or_",
                "literal", "literal_column", "bindparam", "exists", "union", "cast"}
SQL_TEXT = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP)\s", re.S)


def outside_the_store() -> list[Path]:
    files = list((ROOT / "platform" / "reservoir").rglob("*.py")) + list(
        (ROOT / "operators").rglob("*.py"))
    store = ROOT / "platform" / "reservoir" / "store"
    return [path for path in files if store not in path.parents]


# SQL that never reaches the store: custom expectations are tried on a SQLite copy of a batch.
NOT_THE_STORE = {("validate.py", "SELECT COUNT(*) FROM (")}


@pytest.mark.parametrize("path", outside_the_store(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sql_outside_the_store(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            built = {alias.name for alias in node.names} & SQL_BUILDERS
            assert not built, f"{path.name}:{node.lineno} imports {built}: use a store function"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and (path.name, node.value) not in NOT_THE_STORE:
            assert not SQL_TEXT.match(node.value), f"{path.name}:{node.lineno} holds SQL text"
        if isinstance(node, ast.Attribute) and node.attr in ("exec_driver_sql",):
            assert False, f"{path.name}:{node.lineno} runs SQL of its own"


SYNONYMS = {"prompt_text": "prompt", "response_text": "response", "id": "<entity>_id",
            "generated_by_version": "policy_version", "trained_version": "trainer_version",
            "consumed_step": "last_step", "train_step": "step", "version": "policy_version",
            "name": "run / pipeline / schedule"}


def test_views_name_each_thing_one_way(store):
    found = run_sql(store.url, """
        SELECT table_name, column_name, data_type FROM information_schema.columns
        WHERE table_schema = 'analytics' ORDER BY table_name, ordinal_position""").rows
    types: dict[str, set[str]] = {}
    for view, column, data_type in found:
        assert column not in SYNONYMS, f"analytics.{view}.{column}: call it {SYNONYMS[column]}"
        types.setdefault(column, set()).add(data_type)
    mixed = {column: kinds for column, kinds in types.items() if len(kinds) > 1}
    assert not mixed, f"one name, several types: {mixed}"
    ids = {column for _, column, _ in found if column.endswith("_id")}
    assert {"experience_id", "task_id", "group_id"} <= ids
