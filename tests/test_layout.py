"""Rules of the code and of the views that a reader of the docs relies on: the layout's rules
read from the import graph and the ast (tools/layout.py; issue 31: string matching let
`sa.text('select 1')`, lowercase SQL and `cur.execute('update ...')` through), each shown to
fail on a planted violation, and the analytics views name each thing one way."""

from __future__ import annotations

import pytest

from reservoir.store.inspect import run_sql

from tools import imports, layout

# A small package with the real layers, clean: each case below plants one violation in it.
CLEAN = {
    "__init__.py": "",
    "errors.py": "",
    "config.py": "from reservoir.errors import *\n",
    "store/__init__.py": "",
    "store/runs.py": "from reservoir.config import *\nSQL = 'UPDATE experience_state SET status = 1'\n",
    "store/ledger.py": "def commit(engine):\n    with engine.begin() as conn:\n        pass\n",
    "explorer/__init__.py": "",
    "explorer/worker.py": "from reservoir.store import Store\nfrom reservoir.config import *\n",
    "explorer/policy.py": "from reservoir.explorer import worker\n",
    "trainer/__init__.py": "",
    "trainer/step.py": "from reservoir.store import Store\n",
    "pool.py": "from reservoir.explorer import worker\nfrom reservoir.trainer import step\n",
}
PLANTED = {  # rule (a space or two to tell cases apart) -> (file, code that breaks it)
    "store_door": ("explorer/worker.py", "from reservoir.store.runs import SQL\n"),
    "roles_apart": ("trainer/step.py", "def f():\n    from reservoir.explorer import policy\n"),
    "sql_outside_store": ("trainer/step.py", "import sqlalchemy as sa\nQ = sa.text('select 1')\n"),
    "sql_outside_store ": ("pool.py", "def f(cur):\n    cur.execute('update runs set a = 1')\n"),
    "sql_outside_store  ": ("pool.py", "Q = 'delete from experiences where id = 1'\n"),
    "upward": ("store/runs.py", "from reservoir.trainer import step\n"),
    "circles": ("explorer/worker.py", "from reservoir.explorer import policy\n"),
    "transaction_openers": ("pool.py", "def f(store):\n    with store.engine.connect() as c:\n"
                            "        pass\n"),
    "status_changers": ("store/ledger.py", 'Q = """update experience_state\n set status = 2"""\n'),
    "mixed_sql_styles": ("store/ledger.py", "from sqlalchemy import text, select as s\n"
                         "A = text('SELECT 1')\nB = s(1)\n"),
    "mixed_sql_styles ": ("store/runs.py", "import sqlalchemy as sa\n"
                          "A = sa.text('SELECT 1')\nB = sa.update(1)\n"),
}


def measured(tmp_path, planted: tuple[str, str] | None = None) -> layout.Counts:
    for name, code in CLEAN.items():
        path = tmp_path / "reservoir" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code + (planted[1] if planted and planted[0] == name else ""))
    return layout.measure(imports.read({"reservoir": tmp_path / "reservoir"}))


def broken(counts: layout.Counts) -> dict[str, int]:
    found = {rule: len(getattr(counts, rule)) for rule in
             ("store_door", "roles_apart", "sql_outside_store", "upward", "circles",
              "transaction_openers", "mixed_sql_styles")}
    return {**found, "status_changers": len(counts.status_changers) - 1}  # one owner may


def test_the_clean_package_breaks_no_rule(tmp_path):
    assert set(broken(measured(tmp_path)).values()) == {0}


@pytest.mark.parametrize("rule", PLANTED)
def test_each_rule_finds_a_planted_violation(tmp_path, rule):
    found = broken(measured(tmp_path, PLANTED[rule]))
    assert {name for name, n in found.items() if n} == {rule.strip()}, found


def test_the_code_keeps_its_layout():
    """Nothing outside the store imports a store submodule, holds SQL or opens a transaction;
    explorer, trainer and pipeline never import each other; no import climbs the layers or
    closes a circle; one module changes an experience's status; each store module writes its
    SQL one way (python -m tools.layout)."""
    counts = layout.measure()
    assert counts.store_door == [] and counts.sql_outside_store == []
    assert counts.roles_apart == [] and counts.upward == [] and counts.circles == []
    assert counts.transaction_openers == {}
    assert len(counts.status_changers) <= 1, sorted(counts.status_changers)
    assert counts.mixed_sql_styles == []


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
