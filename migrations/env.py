"""Alembic environment: runs on the connection that `reservoir.store.migrate` hands over.

Migrations run under a transaction-level advisory lock, so two processes that both find an empty
database on first use upgrade it once, one after the other. Any login can take an advisory lock
(the reader too), so the wait for it is bounded: past LOCK_WAIT the upgrade fails and says so.
"""

from alembic import context
from sqlalchemy import text

from reservoir.store.schema import metadata

MIGRATION_LOCK = 7_246_120_001
LOCK_WAIT = "60s"

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    transaction_per_migration=False,
    compare_server_default=True,
)
with context.begin_transaction():
    connection.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'"))
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
    connection.execute(text("SET LOCAL lock_timeout = 0"))
    context.run_migrations()
