"""a lease and a step commit write fewer index entries

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02

A lease rewrites each row's state (ready -> leased) and the step commit rewrites it again
(leased -> consumed). Neither rewrite can be in place (HOT): each changes `status`, which the
partial indexes' predicates read, so every index whose predicate the new version meets gets an
entry: five a row for a lease, three for a commit, ~4 us each here. Two of them served no one on
that path:

- `experience_state_run_status (run_id, status)` took an entry on every rewrite. What reads
  rows by status reads those at rest (raw, ready, held, quarantined, retired: pipelines, run
  counts, retention); leased rows have `experience_state_leased` and consumed rows are read in
  bulk. It becomes `experience_state_at_rest`, the same columns WHERE status is neither leased
  nor consumed, so a lease and a commit add nothing to it.
- `experience_state_lease_token` took an entry on every lease. The statements that find a
  lease's rows (commit, release, renew, set aside, join) now name their ids too, and the
  primary key finds them.

And the ledger's key check (0017) looked up the train step once a row, 256 probes of one id a
commit; it now checks each distinct step once.
"""

import importlib

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_0017 = importlib.import_module("reservoir.migrations.versions.0017_ledger_keys_a_statement")

AT_REST = "status NOT IN ('leased', 'consumed')"
STEP_CHECK_PER_ROW = """    SELECT a.train_step_id INTO missing FROM added a
    WHERE NOT EXISTS (SELECT FROM train_steps t WHERE t.id = a.train_step_id) LIMIT 1;"""
STEP_CHECK_PER_STEP = """    SELECT a.train_step_id INTO missing FROM (SELECT DISTINCT train_step_id FROM added) a
    WHERE NOT EXISTS (SELECT FROM train_steps t WHERE t.id = a.train_step_id) LIMIT 1;"""
_KEYS = _0017.FUNCTIONS[:_0017.FUNCTIONS.index("CREATE FUNCTION batch_items_unlink")]
assert STEP_CHECK_PER_ROW in _KEYS, "0017's batch_items_keys changed"


def _keys_function(step_check: str) -> str:
    return (_KEYS.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
            .replace(STEP_CHECK_PER_ROW, step_check))


def upgrade() -> None:
    op.execute("DROP INDEX experience_state_run_status")
    op.execute(f"CREATE INDEX experience_state_at_rest ON experience_state (run_id, status) "
               f"WHERE {AT_REST}")
    op.execute("DROP INDEX experience_state_lease_token")
    op.execute(_keys_function(STEP_CHECK_PER_STEP))


def downgrade() -> None:
    op.execute(_keys_function(STEP_CHECK_PER_ROW))
    op.execute("CREATE INDEX experience_state_lease_token ON experience_state (lease_token) "
               "WHERE lease_token IS NOT NULL")
    op.execute("DROP INDEX experience_state_at_rest")
    op.execute("CREATE INDEX experience_state_run_status ON experience_state (run_id, status)")
