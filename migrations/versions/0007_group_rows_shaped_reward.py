"""experiences: group_row (each row's place in its group, unique) and shaped_reward

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30

`(group_id, group_row)` is unique, so a group is written once: a second write with the same
group id collides on row 0 and nothing of it is written. The index replaces
experiences_group (group_id, id) for group lookups.

`reward` stays as the reward function wrote it; operators that shape rewards write
`shaped_reward`, which the trainer uses where it is set.
"""

from alembic import op
import sqlalchemy as sa

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("experiences", sa.Column("group_row", sa.SmallInteger()))
    op.execute("""
        UPDATE experiences e SET group_row = n.row
        FROM (SELECT id, row_number() OVER (PARTITION BY group_id ORDER BY id) - 1 AS row
              FROM experiences) n
        WHERE n.id = e.id""")
    op.alter_column("experiences", "group_row", nullable=False)
    op.create_index("experiences_group_row", "experiences", ["group_id", "group_row"],
                    unique=True)
    op.drop_index("experiences_group", table_name="experiences")
    op.create_check_constraint("experiences_group_row_valid", "experiences", "group_row >= 0")
    op.add_column("experiences", sa.Column("shaped_reward", sa.Float()))


def downgrade() -> None:
    op.drop_column("experiences", "shaped_reward")
    op.create_index("experiences_group", "experiences", ["group_id", "id"])
    op.drop_index("experiences_group_row", table_name="experiences")
    op.drop_column("experiences", "group_row")
