"""a run knows its model's vocabulary, and the writer refuses token ids past it

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-03

A token id of 2**31 - 1 was written and crashed a trainer with an IndexError in its embedding
long after. A run made from a model records the model's `vocab_size` (its embedding's rows);
the writer refuses ids at or past it. Runs made without a model (a task load, a store demo)
have none until a run, train or serve command gives them one.
"""

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE runs ADD COLUMN vocab_size integer")
    op.execute("ALTER TABLE runs ADD CONSTRAINT runs_vocab_size_positive "
               "CHECK (vocab_size IS NULL OR vocab_size > 0)")


def downgrade() -> None:
    op.execute("ALTER TABLE runs DROP COLUMN vocab_size")
