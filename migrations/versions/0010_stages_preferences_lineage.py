"""stages, leased preference pairs, run lineage

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

- `train_steps.stage`: the name of the stage a step belongs to (a run's `stages:`).
- `preferences` become a leasable pool like experiences: the run they belong to, a margin,
  status (ready, leased, consumed, retired), lease token and expiry, times sampled; a pair is
  stored once. `batch_pairs` is the ledger of the pairs a step trained on.
- `runs.parent_run_id` / `runs.parent_step`: a run branched with `--from RUN@STEP`.
- Views: run_steps gains stage and the share of zero-variance groups; preferences gain the
  pool's columns; runs gain the parent.
"""

import importlib

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import UUID

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

PAIR_STATUSES = ("ready", "leased", "consumed", "retired")
CHANGED_VIEWS = ("run_steps", "preferences", "runs")

VIEWS = """
CREATE VIEW analytics.run_steps AS
SELECT r.name AS run, ts.step, ts.stage, ts.policy_version AS trainer_version, ts.loss,
       ts.n_experiences,
       avg(e.reward)::float8 AS reward_mean, stddev_pop(e.reward) AS reward_std,
       min(e.reward) AS reward_min, max(e.reward) AS reward_max,
       avg(coalesce(e.shaped_reward, e.reward))::float8 AS shaped_reward_mean,
       avg(e.response_len)::float8 AS response_len_mean,
       avg(ts.policy_version - e.policy_version)::float8 AS staleness_mean,
       max(ts.policy_version - e.policy_version) AS staleness_max,
       (ts.metrics ->> 'advantage/zero_variance_groups')::float8 AS zero_variance_share,
       (ts.metrics ->> 'eval/accuracy')::float8 AS eval_accuracy,
       ts.metrics, ts.created_at
FROM public.train_steps ts
JOIN public.runs r ON r.id = ts.run_id
LEFT JOIN public.batch_items bi ON bi.train_step_id = ts.id
LEFT JOIN public.experiences e ON e.id = bi.experience_id
GROUP BY r.name, ts.id;
COMMENT ON VIEW analytics.run_steps IS
  'Per run and train step (step 0 and evaluations included): its stage, the batch''s rewards, '
  'length and staleness, the share of groups with no reward variance, the loss, held-out '
  'accuracy where measured, all metrics.';

CREATE VIEW analytics.preferences AS
SELECT f.id AS preference_id, r.name AS run, f.task_id, f.status, f.margin, f.times_sampled,
       f.chosen_id AS chosen_experience_id, f.rejected_id AS rejected_experience_id,
       chosen.response_text AS chosen_response, rejected.response_text AS rejected_response,
       chosen.reward AS chosen_reward, rejected.reward AS rejected_reward,
       f.source, f.created_at
FROM public.preferences f
JOIN public.experiences chosen ON chosen.id = f.chosen_id
JOIN public.experiences rejected ON rejected.id = f.rejected_id
JOIN public.runs r ON r.id = f.run_id;
COMMENT ON VIEW analytics.preferences IS
  'Chosen / rejected response pairs (for DPO): the two experiences, their rewards and margin, '
  'where the pair came from, and its status in the run''s pool.';

CREATE VIEW analytics.runs AS
SELECT r.name AS run, r.status, r.model, r.group_size, c.raw, c.ready, c.leased, c.consumed,
       c.quarantined, c.retired, c.held, r.rows_inserted, r.rows_sampled,
       (SELECT max(step) FROM public.train_steps WHERE run_id = r.id) AS last_step,
       (SELECT max(version) FROM public.policy_versions WHERE run_id = r.id) AS latest_version,
       parent.name AS parent_run, r.parent_step,
       r.progress, r.config, r.created_at, r.updated_at
FROM public.runs r
LEFT JOIN public.runs parent ON parent.id = r.parent_run_id
LEFT JOIN LATERAL (
  SELECT count(*) FILTER (WHERE status = 'raw') AS raw,
         count(*) FILTER (WHERE status = 'ready') AS ready,
         count(*) FILTER (WHERE status = 'leased') AS leased,
         count(*) FILTER (WHERE status = 'consumed') AS consumed,
         count(*) FILTER (WHERE status = 'quarantined') AS quarantined,
         count(*) FILTER (WHERE status = 'retired') AS retired,
         count(*) FILTER (WHERE status = 'held') AS held
  FROM public.experiences WHERE run_id = r.id
) c ON true;
COMMENT ON VIEW analytics.runs IS
  'One row per run: status, experiences per status, flow counters, the run it branched from, '
  'progress, config (passwords removed).';

GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader;
"""


def _drop() -> None:
    for view in CHANGED_VIEWS:
        op.execute(f"DROP VIEW IF EXISTS analytics.{view}")


def upgrade() -> None:
    _drop()
    op.add_column("train_steps", sa.Column("stage", sa.Text()))
    op.add_column("runs", sa.Column("parent_run_id", sa.BigInteger(),
                                    sa.ForeignKey("runs.id", ondelete="SET NULL")))
    op.add_column("runs", sa.Column("parent_step", sa.Integer()))
    op.add_column("preferences", sa.Column("run_id", sa.BigInteger(),
                                           sa.ForeignKey("runs.id", ondelete="CASCADE")))
    op.execute("UPDATE preferences f SET run_id = e.run_id FROM experiences e "
               "WHERE e.id = f.chosen_id")
    op.alter_column("preferences", "run_id", nullable=False)
    op.add_column("preferences", sa.Column("margin", sa.Float()))
    op.add_column("preferences", sa.Column("status", sa.Text(), nullable=False,
                                           server_default="ready"))
    op.add_column("preferences", sa.Column("times_sampled", sa.Integer(), nullable=False,
                                           server_default="0"))
    op.add_column("preferences", sa.Column("lease_token", UUID(as_uuid=True)))
    op.add_column("preferences", sa.Column("leased_until", sa.DateTime(timezone=True)))
    op.create_check_constraint("preferences_status_valid", "preferences",
                               f"status IN {PAIR_STATUSES}")
    op.create_check_constraint("preferences_lease_iff_leased", "preferences",
                               "(status = 'leased') = (lease_token IS NOT NULL)")
    op.create_check_constraint("preferences_two_responses", "preferences",
                               "chosen_id <> rejected_id")
    op.create_unique_constraint("preferences_pair", "preferences", ["chosen_id", "rejected_id"])
    op.create_index("preferences_ready", "preferences", ["run_id", "id"],
                    postgresql_where=sa.text("status = 'ready'"))
    op.create_index("preferences_lease_token", "preferences", ["lease_token"],
                    postgresql_where=sa.text("lease_token IS NOT NULL"))
    op.create_table(
        "batch_pairs",
        sa.Column("train_step_id", sa.BigInteger(),
                  sa.ForeignKey("train_steps.id", ondelete="CASCADE"), nullable=False),
        sa.Column("preference_id", sa.BigInteger(),
                  sa.ForeignKey("preferences.id", ondelete="CASCADE"), nullable=False),
        sa.PrimaryKeyConstraint("train_step_id", "preference_id", name="batch_pairs_pkey"),
    )
    op.create_index("batch_pairs_preference", "batch_pairs", ["preference_id"])
    op.execute(VIEWS)


def downgrade() -> None:
    _drop()
    op.drop_table("batch_pairs")
    op.drop_index("preferences_lease_token", table_name="preferences")
    op.drop_index("preferences_ready", table_name="preferences")
    op.drop_constraint("preferences_pair", "preferences")
    for name in ("preferences_two_responses", "preferences_lease_iff_leased",
                 "preferences_status_valid"):
        op.drop_constraint(name, "preferences")
    for column in ("leased_until", "lease_token", "times_sampled", "status", "margin", "run_id"):
        op.drop_column("preferences", column)
    op.drop_column("runs", "parent_step")
    op.drop_column("runs", "parent_run_id")
    op.drop_column("train_steps", "stage")
    views = importlib.import_module("reservoir.migrations.versions.0009_analytics_views_one_name")
    for statement in views.VIEWS.split("\n\n"):
        if any(f"VIEW analytics.{view} AS" in statement for view in CHANGED_VIEWS):
            op.execute(statement)
    op.execute("GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader")
