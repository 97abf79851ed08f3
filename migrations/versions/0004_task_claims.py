"""task claims: an explorer holds a task until its group is written or the claim expires

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

`claim_token` / `claimed_by` / `claimed_until` mark a task an explorer worker is exploring.
Writing the group clears the claim and counts the task as explored once more; a worker that
dies leaves a claim that expires, and the task is claimed again.
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import UUID

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("claim_token", UUID(as_uuid=True)))
    op.add_column("tasks", sa.Column("claimed_by", sa.Text()))
    op.add_column("tasks", sa.Column("claimed_until", sa.DateTime(timezone=True)))
    op.create_index("tasks_claim_order", "tasks", ["run_id", "split", "times_explored", "id"])
    op.create_index("tasks_claimed", "tasks", ["run_id", "claimed_until"],
                    postgresql_where=sa.text("claim_token IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("tasks_claimed", table_name="tasks")
    op.drop_index("tasks_claim_order", table_name="tasks")
    op.drop_column("tasks", "claimed_until")
    op.drop_column("tasks", "claimed_by")
    op.drop_column("tasks", "claim_token")
