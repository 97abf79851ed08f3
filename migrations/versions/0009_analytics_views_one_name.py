"""analytics views: one name per thing; views of tasks, policy versions, schedules and
preferences; run_steps keeps step 0 and the held-out evaluations

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30

Naming rule (README, glossary): an entity's id is `<entity>_id` in every view; a view's own
entity's attributes have bare names (an experience's `prompt`, `response`, `status`); columns
about another entity carry its name (`task_prompt` in lineage); a policy version number is
`policy_version` for the policy that generated an experience and `<role>_version` otherwise
(`trainer_version`, `published_version`, `latest_version`); a train step number is `step`.
"""

import importlib

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

OLD_VIEWS = ("reviews", "validations", "operator_events", "pipeline_runs", "runs", "lineage",
             "run_steps", "experience_tokens", "experiences")
NEW_VIEWS = OLD_VIEWS + ("tasks", "policy_versions", "schedules", "preferences")

VIEWS = """
CREATE VIEW analytics.experiences AS
SELECT e.id AS experience_id, r.name AS run, e.task_id, e.group_id, e.group_row,
       e.policy_version, e.status, e.reward, e.shaped_reward, e.reward_components, e.priority,
       e.times_sampled, e.prompt_len, e.response_len, e.prompt_text AS prompt,
       e.response_text AS response, e.metadata, e.parent_id, e.leased_until,
       used.step AS last_step, e.created_at
FROM public.experiences e
JOIN public.runs r ON r.id = e.run_id
LEFT JOIN LATERAL (
  SELECT max(ts.step) AS step
  FROM public.batch_items bi JOIN public.train_steps ts ON ts.id = bi.train_step_id
  WHERE bi.experience_id = e.id
) used ON true;
COMMENT ON VIEW analytics.experiences IS
  'One row per experience: texts, reward as written and shaped, token lengths, status, the '
  'policy version that generated it, and the last train step that used it.';

CREATE VIEW analytics.experience_tokens AS
SELECT e.id AS experience_id, r.name AS run, analytics.int32s(e.prompt_ids) AS prompt_ids,
       analytics.int32s(e.response_ids) AS response_ids, analytics.float32s(e.logprobs) AS logprobs,
       analytics.uint8s(e.action_mask) AS action_mask
FROM public.experiences e JOIN public.runs r ON r.id = e.run_id;
COMMENT ON VIEW analytics.experience_tokens IS
  'Decoded token ids, logprobs and action mask of each experience (filter by experience_id: '
  'decoding is slow).';

CREATE VIEW analytics.run_steps AS
SELECT r.name AS run, ts.step, ts.policy_version AS trainer_version, ts.loss, ts.n_experiences,
       avg(e.reward)::float8 AS reward_mean, stddev_pop(e.reward) AS reward_std,
       min(e.reward) AS reward_min, max(e.reward) AS reward_max,
       avg(coalesce(e.shaped_reward, e.reward))::float8 AS shaped_reward_mean,
       avg(e.response_len)::float8 AS response_len_mean,
       avg(ts.policy_version - e.policy_version)::float8 AS staleness_mean,
       max(ts.policy_version - e.policy_version) AS staleness_max,
       (ts.metrics ->> 'eval/accuracy')::float8 AS eval_accuracy,
       ts.metrics, ts.created_at
FROM public.train_steps ts
JOIN public.runs r ON r.id = ts.run_id
LEFT JOIN public.batch_items bi ON bi.train_step_id = ts.id
LEFT JOIN public.experiences e ON e.id = bi.experience_id
GROUP BY r.name, ts.id;
COMMENT ON VIEW analytics.run_steps IS
  'Per run and train step (step 0 and evaluations included): the batch''s rewards, length and '
  'staleness, the loss, held-out accuracy where measured, all metrics.';

CREATE VIEW analytics.lineage AS
SELECT e.id AS experience_id, r.name AS run, e.task_id, t.prompt AS task_prompt,
       t.answer AS task_answer, e.group_id, e.policy_version, e.status, e.reward,
       e.shaped_reward, e.parent_id, ts.step, bi.policy_version AS trainer_version, bi.weight,
       ts.created_at AS trained_at, pv.version AS published_version,
       pv.location AS published_location
FROM public.experiences e
JOIN public.runs r ON r.id = e.run_id
LEFT JOIN public.tasks t ON t.id = e.task_id
LEFT JOIN public.batch_items bi ON bi.experience_id = e.id
LEFT JOIN public.train_steps ts ON ts.id = bi.train_step_id
LEFT JOIN LATERAL (
  SELECT p.version, p.location FROM public.policy_versions p
  WHERE p.run_id = ts.run_id AND p.train_step >= ts.step
  ORDER BY p.version LIMIT 1
) pv ON true;
COMMENT ON VIEW analytics.lineage IS
  'task -> experience -> train step -> first published policy version containing that step.';

CREATE VIEW analytics.runs AS
SELECT r.name AS run, r.status, r.model, r.group_size, c.raw, c.ready, c.leased, c.consumed,
       c.quarantined, c.retired, c.held, r.rows_inserted, r.rows_sampled,
       (SELECT max(step) FROM public.train_steps WHERE run_id = r.id) AS last_step,
       (SELECT max(version) FROM public.policy_versions WHERE run_id = r.id) AS latest_version,
       r.progress, r.config, r.created_at, r.updated_at
FROM public.runs r
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
  'One row per run: status, experiences per status, flow counters, progress, config '
  '(passwords removed).';

CREATE VIEW analytics.tasks AS
SELECT t.id AS task_id, r.name AS run, t.split, t.prompt, t.answer, t.source, t.payload,
       t.difficulty, t.priority, t.times_explored, t.claimed_by, t.claimed_until, t.created_at
FROM public.tasks t JOIN public.runs r ON r.id = t.run_id;
COMMENT ON VIEW analytics.tasks IS
  'One row per task: split, prompt and answer, difficulty and priority, times explored, claim.';

CREATE VIEW analytics.policy_versions AS
SELECT r.name AS run, p.version AS policy_version, p.location, p.train_step AS step,
       p.created_at
FROM public.policy_versions p JOIN public.runs r ON r.id = p.run_id;
COMMENT ON VIEW analytics.policy_versions IS
  'Every published policy version: where its weights are and the train step it holds.';

CREATE VIEW analytics.pipeline_runs AS
SELECT p.id AS pipeline_run_id, p.pipeline, p.trigger, p.status, p.rows_in, p.rows_out,
       p.rows_dropped, p.duration_s, p.error, p.spec_hash, p.operators, s.name AS schedule,
       p.started_at, p.finished_at
FROM public.pipeline_runs p LEFT JOIN public.schedules s ON s.id = p.schedule_id;
COMMENT ON VIEW analytics.pipeline_runs IS
  'Every pipeline execution: status, rows in / out / dropped, per-operator counts, error.';

CREATE VIEW analytics.operator_events AS
SELECT o.id AS event_id, p.pipeline, o.pipeline_run_id, r.name AS run, o.experience_id,
       o.task_id, o.operator, o.kind, o.reason, o.stats, o.created_at
FROM public.operator_events o
JOIN public.pipeline_runs p ON p.id = o.pipeline_run_id
LEFT JOIN public.experiences e ON e.id = o.experience_id
LEFT JOIN public.runs r ON r.id = e.run_id;
COMMENT ON VIEW analytics.operator_events IS
  'Every decision a pipeline stored about a row: which operator, what kind, why, its stats.';

CREATE VIEW analytics.validations AS
SELECT v.id AS validation_id, p.pipeline, v.pipeline_run_id, v.expectation, v.kwargs,
       v.success, v.element_count, v.unexpected_count, v.sample, v.on_failure, v.created_at
FROM public.validations v JOIN public.pipeline_runs p ON p.id = v.pipeline_run_id;
COMMENT ON VIEW analytics.validations IS 'Every great-expectations result of a pipeline run.';

CREATE VIEW analytics.reviews AS
SELECT v.id AS review_id, v.experience_id, r.name AS run, e.prompt_text AS prompt,
       e.response_text AS response, e.reward, e.shaped_reward, v.reason, v.status, v.verdict,
       v.label, v.reviewer, v.created_at, v.labelled_at
FROM public.reviews v JOIN public.experiences e ON e.id = v.experience_id
JOIN public.runs r ON r.id = e.run_id;
COMMENT ON VIEW analytics.reviews IS
  'Rows held for a person: the experience, why it was held, the verdict and who gave it.';

CREATE VIEW analytics.schedules AS
SELECT s.id AS schedule_id, s.name AS schedule, s.pipeline_file, s.cron, s.enabled,
       s.last_run_at, s.next_run_at, s.missed_runs, s.created_at
FROM public.schedules s;
COMMENT ON VIEW analytics.schedules IS 'Cron-scheduled pipelines: last and next run, missed runs.';

CREATE VIEW analytics.preferences AS
SELECT f.id AS preference_id, r.name AS run, f.task_id,
       f.chosen_id AS chosen_experience_id, f.rejected_id AS rejected_experience_id,
       chosen.response_text AS chosen_response, rejected.response_text AS rejected_response,
       f.source, f.created_at
FROM public.preferences f
JOIN public.experiences chosen ON chosen.id = f.chosen_id
JOIN public.experiences rejected ON rejected.id = f.rejected_id
JOIN public.runs r ON r.id = chosen.run_id;
COMMENT ON VIEW analytics.preferences IS
  'Chosen / rejected response pairs (for DPO): the two experiences and where the pair came from.';

GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader;
"""


def _drop(views) -> None:
    for view in views:
        op.execute(f"DROP VIEW IF EXISTS analytics.{view}")


def upgrade() -> None:
    _drop(OLD_VIEWS)
    op.execute(VIEWS)


def downgrade() -> None:
    _drop(NEW_VIEWS)
    versions = "reservoir.migrations.versions."
    op.execute(importlib.import_module(versions + "0002_analytics_views").VIEWS)
    op.execute(importlib.import_module(versions + "0005_pipelines").VIEWS)
    op.execute("GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader")
