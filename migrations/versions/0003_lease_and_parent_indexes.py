"""index lease tokens (commit, release, renew) and parent ids (deletes, lineage)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

Without them, commit_step scanned the whole experiences table to find a lease's rows, and
deleting experiences checked the self-referencing parent_id foreign key by a full scan per row.
"""

from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("experiences_lease_token", "experiences", ["lease_token"],
                    postgresql_where=sa.text("lease_token IS NOT NULL"))
    op.create_index("experiences_parent", "experiences", ["parent_id"],
                    postgresql_where=sa.text("parent_id IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("experiences_parent", table_name="experiences")
    op.drop_index("experiences_lease_token", table_name="experiences")
