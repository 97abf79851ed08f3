"""pipeline runs name the server session running them (abandoned when it is gone); events of
kind unselected; runs.progress for work that is not a train step (the warm-up)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30

A pipeline keeps one connection open while it runs and records that backend's pid and start
time. A `running` row whose backend no longer exists (the process was killed, its machine
lost) is marked `abandoned` by the next pipeline run or `pipeline history`.
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

OLD_STATUSES = "('running', 'succeeded', 'failed', 'dry_run')"
NEW_STATUSES = "('running', 'succeeded', 'failed', 'dry_run', 'abandoned')"
OLD_KINDS = "('dropped', 'changed', 'added', 'scored', 'quarantined', 'retired', 'held')"
NEW_KINDS = ("('dropped', 'changed', 'added', 'scored', 'quarantined', 'retired', 'held', "
             "'unselected')")


def _check(table: str, name: str, column: str, values: str) -> None:
    op.drop_constraint(name, table, type_="check")
    op.create_check_constraint(name, table, f"{column} IN {values}")


def upgrade() -> None:
    op.add_column("pipeline_runs", sa.Column("backend_pid", sa.Integer()))
    op.add_column("pipeline_runs", sa.Column("backend_started_at", sa.DateTime(timezone=True)))
    _check("pipeline_runs", "pipeline_runs_status_valid", "status", NEW_STATUSES)
    _check("operator_events", "operator_events_kind_valid", "kind", NEW_KINDS)
    op.create_index("pipeline_runs_running", "pipeline_runs", ["id"],
                    postgresql_where=sa.text("status = 'running'"))
    op.add_column("runs", sa.Column("progress", JSONB(), nullable=False,
                                    server_default=sa.text("'{}'::jsonb")))


def downgrade() -> None:
    op.drop_column("runs", "progress")
    op.drop_index("pipeline_runs_running", table_name="pipeline_runs")
    op.execute("UPDATE pipeline_runs SET status = 'failed' WHERE status = 'abandoned'")
    op.execute("DELETE FROM operator_events WHERE kind = 'unselected'")
    _check("operator_events", "operator_events_kind_valid", "kind", OLD_KINDS)
    _check("pipeline_runs", "pipeline_runs_status_valid", "status", OLD_STATUSES)
    op.drop_column("pipeline_runs", "backend_started_at")
    op.drop_column("pipeline_runs", "backend_pid")
