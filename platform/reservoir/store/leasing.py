"""A lease, whatever it leases: the state machine experiences and preference pairs share.

A leasable table has `id`, `status`, `times_sampled`, `lease_token` and `leased_until`. A lease
takes rows (status `leased`, a token, an expiry), and they leave it one of three ways: given
back (released, or reclaimed once their expiry passed, by the next lease call), or consumed by
the step that trained them (times_sampled + 1, in the ledger's commit statement). The
experience lifecycle (lifecycle.py) and the pair pool (preferences.py) build their statements
from these; the status a row goes back to is theirs to say, and so are which rows a lease picks.

Bound at execution: :token (the lease's uuid) and, for a lease taken, :lease_for (an interval).
"""

from __future__ import annotations

from sqlalchemy import Interval, Table, bindparam, func, literal_column, null, select, update
from sqlalchemy.dialects.postgresql import UUID

TOKEN = bindparam("token", type_=UUID(as_uuid=True))
# Statuses are written into the SQL (partial indexes on status serve a plan that sees them).
LEASED = literal_column("'leased'")


def any_of(query):
    """`= ANY(ARRAY(query))`: one index scan of each partition for all the picked rows (a join
    to picked rows of a partitioned table gets a hash join over a seq scan)."""
    return func.any(func.array(query.scalar_subquery()))


def taken(table: Table, *where):
    """Update: rows matching `where` become leased under :token until now() + :lease_for."""
    return update(table).where(*where).values(
        status=LEASED, lease_token=TOKEN,
        leased_until=func.now() + bindparam("lease_for", type_=Interval))


def given_back(table: Table, where, back):
    """Update: rows matching `where` leave their lease and take status `back` (a value or an
    expression of the row)."""
    return update(table).where(where).values(status=back, lease_token=null(), leased_until=null())


def of_token(table: Table):
    """The rows a lease holds: its token."""
    return table.c.lease_token == TOKEN


def expired(table: Table, *where, limit: int):
    """Rows whose lease expired, oldest expiry first, up to `limit`, skipping rows another
    transaction holds (two lease calls reclaim different rows, never wait on each other).

    Ordering by leased_until steers the planner to a partial index on leased rows, so the check
    costs one index probe however many rows are leased and not yet expired.
    """
    return table.c.id == any_of(
        select(table.c.id)
        .where(table.c.status == LEASED, table.c.leased_until < func.now(), *where)
        .order_by(table.c.leased_until).limit(limit).with_for_update(skip_locked=True))


def consumed(table: Table, *where):
    """Update: the rows matching `where` that :token holds are consumed (trained once more)
    and leave their lease: the change a ledger commit makes."""
    return update(table).where(*where, of_token(table)).values(
        status=literal_column("'consumed'"), times_sampled=table.c.times_sampled + 1,
        lease_token=null(), leased_until=null())
