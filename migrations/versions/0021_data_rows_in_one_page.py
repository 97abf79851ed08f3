"""a run's data rows keep their arrays in the row, up to a page

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03

PostgreSQL moves a row's largest values to the table's TOAST relation once the row passes
~2 KB (compressing them first where it can). An experience of 256 prompt and 256 response
tokens is ~3.6 KB: two of its arrays went out of line, each a chunk in the TOAST heap and an
entry in its index when written, and an index probe and a heap fetch each when a lease returned
the row. The data row is written once and never rewritten (a lease and a commit rewrite the
narrow state row), so a data partition keeps rows up to a page (`toast_tuple_target = 8160`)
whole: only a row past that sends its largest values out of line. Writes and leases of such
rows touch one heap page a row (bench/store.py; a one-table queue, whose every lease rewrites
the whole row, is slower inline).

A partitioned table takes no such storage parameter, so `experience_partitions_add` sets it on
each new run's data partition, and this migration on the partitions there are; rows stored
before keep their out-of-line values until they are written again.
"""

import importlib

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_0017 = importlib.import_module("reservoir.migrations.versions.0017_ledger_keys_a_statement")
_0020 = importlib.import_module("reservoir.migrations.versions.0020_group_index_on_the_data_row")

ROW_IN_ONE_PAGE = "toast_tuple_target = 8160"  # the most PostgreSQL takes: a page less headers
_DATA_TRIGGER = "            IF part.parent = 'experience_data' THEN\n"
assert _0020.PARTITIONS.count(_DATA_TRIGGER) == 1, "0020's experience_partitions_add changed"
PARTITIONS = _0020.PARTITIONS.replace(_DATA_TRIGGER, _DATA_TRIGGER + f"""\
                EXECUTE format('ALTER TABLE %I SET ({ROW_IN_ONE_PAGE})', part.parent || '_r' || run);
""")


def upgrade() -> None:
    op.execute(PARTITIONS)
    for table in _0017._partitions("experience_data"):
        op.execute(f"ALTER TABLE {table} SET ({ROW_IN_ONE_PAGE})")


def downgrade() -> None:
    op.execute(_0020.PARTITIONS)
    for table in _0017._partitions("experience_data"):
        op.execute(f"ALTER TABLE {table} RESET (toast_tuple_target)")
