"""a step commit is one statement that consumes its whole lease or nothing

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02

A step commit checked, in its transaction, that it consumed every row of its lease (a lease
that expired and was reclaimed holds fewer) and rolled back if not: BEGIN, the statement, the
check, COMMIT. `lease_consumed(consumed, leased, token)` makes the check part of the statement:
it raises (SQLSTATE RS001, Reservoir's) when the counts differ, so the statement commits alone,
whole or not at all, with no BEGIN and COMMIT round trips around it.
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

LEASE_LOST = "RS001"
FUNCTION = f"""
CREATE FUNCTION lease_consumed(consumed bigint, leased bigint, token uuid) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF consumed <> leased THEN
        RAISE EXCEPTION 'lease % holds % of its % rows (it expired and was reclaimed)',
            token, consumed, leased USING ERRCODE = '{LEASE_LOST}';
    END IF;
    RETURN consumed;
END $$;
COMMENT ON FUNCTION lease_consumed(bigint, bigint, uuid) IS
  'A step commit''s check that it consumed all its lease''s rows: raises {LEASE_LOST} if not.';
"""


def upgrade() -> None:
    op.execute(FUNCTION)


def downgrade() -> None:
    op.execute("DROP FUNCTION lease_consumed(bigint, bigint, uuid)")
