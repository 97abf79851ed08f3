"""Alembic environment: runs on the connection that `reservoir.store.migrate` hands over.

Migrations run under a transaction-level advisory lock, so two processes that both find an empty
database on first use upgrade it once, one after the other. Any login can take an advisory lock
(the reader too), and a reader's open transaction holds the tables it read, so every wait is
bounded: past LOCK_WAIT the upgrade fails, nothing of it applied, naming who held what.
"""

from alembic import context
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from reservoir.errors import StoreError
from reservoir.store import locks
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


def _waited(exc: OperationalError, what: str, **held) -> StoreError | None:
    if getattr(exc.orig, "pgcode", None) != "55P03":  # lock_not_available
        return None
    return StoreError(f"the schema was not changed: the upgrade waited {LOCK_WAIT} for {what}, "
                      f"{locks.holders(connection.engine, **held)}; try again when it ends")


with context.begin_transaction():
    connection.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'"))
    try:
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        context.run_migrations()
    except OperationalError as exc:
        error = (_waited(exc, "the migration lock", advisory_key=MIGRATION_LOCK)
                 if "pg_advisory_xact_lock" in str(exc.statement)
                 else _waited(exc, "a lock on the store's tables", every_table=True))
        if error is None:
            raise
        raise error from None
