"""pipelines: pipeline_runs, operator_events, validations, schedules, reviews, preferences

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

Every pipeline execution is a pipeline_runs row; every decision an operator makes about a row
is an operator_events row; great-expectations results are validations rows. Experiences gain
the status `held` (waiting for a human review). Views in `analytics` show them to readers.
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

OLD_STATUSES = "('raw', 'ready', 'leased', 'consumed', 'quarantined', 'retired')"
NEW_STATUSES = "('raw', 'ready', 'leased', 'consumed', 'quarantined', 'retired', 'held')"

VIEWS = """
CREATE VIEW analytics.pipeline_runs AS
SELECT p.id, p.pipeline, p.trigger, p.status, p.rows_in, p.rows_out, p.rows_dropped,
       p.duration_s, p.error, p.spec_hash, p.operators, p.started_at, p.finished_at
FROM public.pipeline_runs p;

CREATE VIEW analytics.operator_events AS
SELECT o.id, p.pipeline, o.pipeline_run_id, r.name AS run, o.experience_id, o.task_id,
       o.operator, o.kind, o.reason, o.stats, o.created_at
FROM public.operator_events o
JOIN public.pipeline_runs p ON p.id = o.pipeline_run_id
LEFT JOIN public.experiences e ON e.id = o.experience_id
LEFT JOIN public.runs r ON r.id = e.run_id;

CREATE VIEW analytics.validations AS
SELECT v.id, p.pipeline, v.pipeline_run_id, v.expectation, v.kwargs, v.success,
       v.element_count, v.unexpected_count, v.sample, v.on_failure, v.created_at
FROM public.validations v JOIN public.pipeline_runs p ON p.id = v.pipeline_run_id;

CREATE VIEW analytics.reviews AS
SELECT v.id, v.experience_id, r.name AS run, e.prompt_text, e.response_text, e.reward,
       v.reason, v.status, v.verdict, v.label, v.reviewer, v.created_at, v.labelled_at
FROM public.reviews v JOIN public.experiences e ON e.id = v.experience_id
JOIN public.runs r ON r.id = e.run_id;

GRANT SELECT ON analytics.pipeline_runs, analytics.operator_events, analytics.validations,
                analytics.reviews TO reservoir_reader;
"""


def _id() -> sa.Column:
    return sa.Column("id", sa.BigInteger(), primary_key=True)


def _now(name: str = "created_at") -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.text("now()"),
                     nullable=False)


def upgrade() -> None:
    op.drop_constraint("experiences_status_valid", "experiences", type_="check")
    op.create_check_constraint("experiences_status_valid", "experiences",
                               f"status IN {NEW_STATUSES}")
    op.create_table(
        "schedules", _id(),
        sa.Column("name", sa.Text(), nullable=False, unique=True),
        sa.Column("pipeline_file", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=False),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("last_run_at", sa.DateTime(timezone=True)),
        sa.Column("next_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("missed_runs", sa.Integer(), server_default="0", nullable=False),
        _now())
    op.create_table(
        "pipeline_runs", _id(),
        sa.Column("pipeline", sa.Text(), nullable=False),
        sa.Column("source_file", sa.Text()),
        sa.Column("spec", JSONB(), nullable=False),
        sa.Column("spec_hash", sa.Text(), nullable=False),
        sa.Column("run_ids", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("trigger", sa.Text(), server_default="cli", nullable=False),
        sa.Column("status", sa.Text(), server_default="running", nullable=False),
        sa.Column("rows_in", sa.Integer()),
        sa.Column("rows_out", sa.Integer()),
        sa.Column("rows_dropped", sa.Integer()),
        sa.Column("operators", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("duration_s", sa.Float()),
        sa.Column("error", sa.Text()),
        sa.Column("schedule_id", sa.BigInteger(),
                  sa.ForeignKey("schedules.id", ondelete="SET NULL")),
        _now("started_at"),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint("status IN ('running', 'succeeded', 'failed', 'dry_run')",
                           name="pipeline_runs_status_valid"))
    op.create_index("pipeline_runs_pipeline", "pipeline_runs", ["pipeline", "started_at"])
    op.create_table(
        "operator_events", _id(),
        sa.Column("pipeline_run_id", sa.BigInteger(),
                  sa.ForeignKey("pipeline_runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("experience_id", sa.BigInteger(),
                  sa.ForeignKey("experiences.id", ondelete="CASCADE")),
        sa.Column("task_id", sa.BigInteger(), sa.ForeignKey("tasks.id", ondelete="CASCADE")),
        sa.Column("operator", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("stats", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        _now(),
        sa.CheckConstraint("kind IN ('dropped', 'changed', 'added', 'scored', 'quarantined', "
                           "'retired', 'held')", name="operator_events_kind_valid"))
    op.create_index("operator_events_run", "operator_events", ["pipeline_run_id"])
    op.create_index("operator_events_experience", "operator_events", ["experience_id"])
    op.create_table(
        "validations", _id(),
        sa.Column("pipeline_run_id", sa.BigInteger(),
                  sa.ForeignKey("pipeline_runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("expectation", sa.Text(), nullable=False),
        sa.Column("kwargs", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("success", sa.Boolean(), nullable=False),
        sa.Column("element_count", sa.Integer()),
        sa.Column("unexpected_count", sa.Integer()),
        sa.Column("sample", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("on_failure", sa.Text(), nullable=False),
        _now())
    op.create_index("validations_run", "validations", ["pipeline_run_id"])
    op.create_table(
        "reviews", _id(),
        sa.Column("experience_id", sa.BigInteger(),
                  sa.ForeignKey("experiences.id", ondelete="CASCADE"), nullable=False,
                  unique=True),
        sa.Column("pipeline_run_id", sa.BigInteger(),
                  sa.ForeignKey("pipeline_runs.id", ondelete="SET NULL")),
        sa.Column("reason", sa.Text()),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("verdict", sa.Text()),
        sa.Column("label", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("reviewer", sa.Text()),
        _now(),
        sa.Column("labelled_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint("status IN ('pending', 'labelled')", name="reviews_status_valid"),
        sa.CheckConstraint("verdict IS NULL OR verdict IN ('accept', 'reject')",
                           name="reviews_verdict_valid"))
    op.create_table(
        "preferences", _id(),
        sa.Column("task_id", sa.BigInteger(), sa.ForeignKey("tasks.id", ondelete="CASCADE")),
        sa.Column("chosen_id", sa.BigInteger(),
                  sa.ForeignKey("experiences.id", ondelete="CASCADE"), nullable=False),
        sa.Column("rejected_id", sa.BigInteger(),
                  sa.ForeignKey("experiences.id", ondelete="CASCADE"), nullable=False),
        sa.Column("source", sa.Text()),
        _now())
    op.execute(VIEWS)


def downgrade() -> None:
    for view in ("reviews", "validations", "operator_events", "pipeline_runs"):
        op.execute(f"DROP VIEW analytics.{view}")
    for table in ("preferences", "reviews", "validations", "operator_events", "pipeline_runs",
                  "schedules"):
        op.drop_table(table)
    op.execute("UPDATE experiences SET status = 'raw' WHERE status = 'held'")
    op.drop_constraint("experiences_status_valid", "experiences", type_="check")
    op.create_check_constraint("experiences_status_valid", "experiences",
                               f"status IN {OLD_STATUSES}")
