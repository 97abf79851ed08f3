"""no login signals another session from SQL: pg_terminate_backend and pg_cancel_backend taken
from PUBLIC

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-03

Any login may end or cancel the sessions of its own role. So the reader could end other
readers' sessions, and SQL the owner ran (a `reservoir sql --write`, a pipeline's `where`)
the trainers' and explorers', which log in as the owner. Reservoir calls neither function.
The functions are the bootstrap superuser's: only a superuser takes them from PUBLIC (for any
other role PostgreSQL only warns), which `roles.bootstrap` does before the first upgrade. A
store upgraded by its owner alone stops here with the statement a superuser runs once.
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

SIGNALS = "pg_terminate_backend(integer, bigint), pg_cancel_backend(integer)"

UPGRADE = f"""
DO $$ BEGIN
  IF has_function_privilege('reservoir_reader', 'pg_cancel_backend(integer)', 'EXECUTE')
     OR has_function_privilege('reservoir_reader', 'pg_terminate_backend(integer, bigint)',
                               'EXECUTE') THEN
    BEGIN  -- a role with no right on them is refused outright: the check below says so
      REVOKE EXECUTE ON FUNCTION {SIGNALS} FROM PUBLIC;
    EXCEPTION WHEN insufficient_privilege THEN NULL;
    END;
  END IF;
  IF has_function_privilege('reservoir_reader', 'pg_cancel_backend(integer)', 'EXECUTE')
     OR has_function_privilege('reservoir_reader', 'pg_terminate_backend(integer, bigint)',
                               'EXECUTE')
     OR (has_function_privilege('pg_terminate_backend(integer, bigint)', 'EXECUTE')
         AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)) THEN
    RAISE EXCEPTION 'logins of this store could still end each other''s sessions: '
      'this role may not take pg_terminate_backend from PUBLIC. Have a superuser run once: '
      'REVOKE EXECUTE ON FUNCTION {SIGNALS} FROM PUBLIC; then run `reservoir db upgrade` '
      'again (or run `reservoir db upgrade` once with a superuser''s URL: it makes the roles '
      'and their rights, then upgrades as reservoir_owner)';
  END IF;
END $$;
"""

DOWNGRADE = f"""
DO $$ BEGIN
  GRANT EXECUTE ON FUNCTION {SIGNALS} TO PUBLIC;
EXCEPTION WHEN insufficient_privilege THEN NULL;
END $$;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
