"""the group's id and row number move to the data row, with their unique index

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03

A lease and a step commit rewrite each row's state, and a rewrite that changes `status` cannot
be in place (HOT): every index takes an entry for the new version. The group's unique index
(group_id, group_row, run_id) took one on both rewrites, the dearest of them: its keys are
random uuid4s, so each of a batch's 256 entries lands on a leaf page of its own
(bench/state_layout.py: ~1 ms of a lease and ~0.9 ms of a commit of 256 rows). The group's id
and row number are written once and never change, so they move to the write-once data row with
the index (covering the id, so a group's rows are found without reading the data rows); a lease
of whole groups reads them there and then the state row by id (bench/state_layout.py: its lease
+ commit 0.97 of the time it took with the index on the state row).

The view `experiences` keeps its columns, now reading the group's from the data row, and its
triggers write them there; the statement trigger that records each new group id
(experience_groups_add, 0016) moves to the data table and its partitions, and
`experience_partitions_add` gives a new run's data partition that trigger.
"""

import importlib

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_0013 = importlib.import_module("reservoir.migrations.versions.0013_partition_experiences_by_run")
_0016 = importlib.import_module("reservoir.migrations.versions.0016_group_ids_a_statement")
_0017 = importlib.import_module("reservoir.migrations.versions.0017_ledger_keys_a_statement")

GROUP = ("group_id", "group_row")
STATE = tuple(name for name in _0013.STATE if name not in GROUP)
DATA = _0013.DATA + GROUP
_GROUPS_TRIGGER = "THEN\n                EXECUTE format('CREATE TRIGGER experience_groups_add"
_ON_STATE = f"IF part.parent = 'experience_state' {_GROUPS_TRIGGER}"
_ON_DATA = f"IF part.parent = 'experience_data' {_GROUPS_TRIGGER}"
assert _0017.PARTITIONS.count(_ON_STATE) == 1, "0017's experience_partitions_add changed"
PARTITIONS = _0017.PARTITIONS.replace(_ON_STATE, _ON_DATA)
_VIEW_TRIGGERS = "\nCREATE TRIGGER experiences_insert"


def _functions(state: tuple[str, ...], data: tuple[str, ...]) -> str:
    """The view's trigger functions for this split (the triggers themselves stay)."""
    text = _0013._triggers(state, data)
    return text[:text.index(_VIEW_TRIGGERS)]


def _view(state: tuple[str, ...]) -> str:
    """The view with the same columns in the same order, each read from the table that holds it
    (its dependent views stay)."""
    return _0013._view(state).replace("CREATE VIEW", "CREATE OR REPLACE VIEW", 1)


def _move_groups_trigger(source: str, target: str) -> None:
    """experience_groups_add off `source` and its partitions, onto `target` and its."""
    for table in [source] + _0017._partitions(source):
        op.execute(f"DROP TRIGGER experience_groups_add ON {table}")
    for table in [target] + _0017._partitions(target):
        op.execute(_0016.TRIGGER.format(table=table))


def _add_group_columns(table: str, source: str) -> None:
    """The group's columns on `table`, copied from `source` row by row, checked and indexed."""
    op.execute(f"ALTER TABLE {table} ADD COLUMN group_id uuid, ADD COLUMN group_row smallint")
    op.execute(f"UPDATE {table} t SET group_id = o.group_id, group_row = o.group_row "
               f"FROM {source} o WHERE o.run_id = t.run_id AND o.id = t.id")
    op.execute(f"ALTER TABLE {table} ALTER COLUMN group_id SET NOT NULL, "
               f"ALTER COLUMN group_row SET NOT NULL, "
               f"ADD CONSTRAINT {table}_group_row_valid CHECK (group_row >= 0)")


def upgrade() -> None:
    _add_group_columns("experience_data", "experience_state")
    op.execute("CREATE UNIQUE INDEX experience_data_group_row ON experience_data "
               "(group_id, group_row, run_id) INCLUDE (id)")
    op.execute(_view(STATE))
    op.execute(_functions(STATE, DATA))
    _move_groups_trigger("experience_state", "experience_data")
    op.execute(PARTITIONS)
    op.execute("ALTER TABLE experience_state DROP COLUMN group_id, DROP COLUMN group_row")


def downgrade() -> None:
    _add_group_columns("experience_state", "experience_data")
    op.execute("CREATE UNIQUE INDEX experience_state_group_row ON experience_state "
               "(group_id, group_row, run_id)")
    op.execute(_view(_0013.STATE))
    op.execute(_functions(_0013.STATE, _0013.DATA))
    _move_groups_trigger("experience_data", "experience_state")
    op.execute(_0017.PARTITIONS)
    op.execute("ALTER TABLE experience_data DROP COLUMN group_id, DROP COLUMN group_row")
