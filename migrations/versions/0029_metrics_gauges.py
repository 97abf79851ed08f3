"""what a metrics scrape reads: analytics.run_gauges, pipeline_gauges, schedule_gauges

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-06

`reservoir metrics serve` reads the store once per Prometheus scrape, as the reader. These views
answer from indexes: per run the rows waiting (raw, ready, leased, held, quarantined: never the
consumed ones), the oldest waiting row's age, the flow counters, the last step and version, and
every step's lease-wait and commit seconds binned for a histogram; per pipeline its last run
(a skip scan over pipeline_runs' (pipeline, started_at) index) and last success; per schedule its
last success (a new partial index).
"""

from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

INDEX = """
CREATE INDEX pipeline_runs_schedule_success ON pipeline_runs (schedule_id, finished_at)
    WHERE status = 'succeeded';"""

VIEWS = """
CREATE VIEW analytics.run_gauges AS
SELECT r.name AS run, r.status, r.rows_inserted AS rows_written, r.rows_sampled,
       coalesce(rest.raw, 0) AS raw, coalesce(rest.ready, 0) AS ready,
       (SELECT count(*) FROM public.experience_state e
        WHERE e.run_id = r.id AND e.status = 'leased') AS leased,
       coalesce(rest.held, 0) AS held, coalesce(rest.quarantined, 0) AS quarantined,
       extract(epoch FROM now() - rest.oldest_ready_at)::float8 AS oldest_ready_age_s,
       extract(epoch FROM now() - rest.oldest_raw_at)::float8 AS oldest_raw_age_s,
       last.step AS last_step, extract(epoch FROM now() - last.created_at)::float8
         AS last_step_age_s,
       (last.metrics ->> 'staleness_mean')::float8 AS staleness_mean,
       (SELECT max(p.version) FROM public.policy_versions p WHERE p.run_id = r.id)
         AS latest_version,
       bounds.latency_bounds, latency.lease_bins AS lease_wait_bins,
       latency.lease_sum AS lease_wait_sum, latency.commit_bins, latency.commit_sum,
       r.updated_at
FROM public.runs r
CROSS JOIN (SELECT '{0.001,0.0025,0.005,0.01,0.025,0.05,0.1,0.25,0.5,1,2.5,5,10,30,60}'::float8[]
                   AS latency_bounds) bounds
LEFT JOIN LATERAL (
  SELECT count(*) FILTER (WHERE e.status = 'raw') AS raw,
         count(*) FILTER (WHERE e.status = 'ready') AS ready,
         count(*) FILTER (WHERE e.status = 'held') AS held,
         count(*) FILTER (WHERE e.status = 'quarantined') AS quarantined,
         min(e.created_at) FILTER (WHERE e.status = 'ready') AS oldest_ready_at,
         min(e.created_at) FILTER (WHERE e.status = 'raw') AS oldest_raw_at
  FROM public.experience_state e
  WHERE e.run_id = r.id AND e.status IN ('raw', 'ready', 'held', 'quarantined')
) rest ON true
LEFT JOIN LATERAL (
  SELECT ts.step, ts.created_at, ts.metrics FROM public.train_steps ts
  WHERE ts.run_id = r.id ORDER BY ts.step DESC LIMIT 1
) last ON true
LEFT JOIN LATERAL (
  SELECT jsonb_object_agg(bin, n) FILTER (WHERE key = 'wait_s') AS lease_bins,
         sum(total) FILTER (WHERE key = 'wait_s') AS lease_sum,
         jsonb_object_agg(bin, n) FILTER (WHERE key = 'commit_s') AS commit_bins,
         sum(total) FILTER (WHERE key = 'commit_s') AS commit_sum
  FROM (SELECT timed.key, width_bucket(timed.x, bounds.latency_bounds) AS bin, count(*) AS n,
               sum(timed.x) AS total
        FROM public.train_steps ts
        CROSS JOIN LATERAL (VALUES ('wait_s', (ts.metrics ->> 'wait_s')::float8),
                                   ('commit_s', (ts.metrics ->> 'commit_s')::float8))
          AS timed (key, x)
        WHERE ts.run_id = r.id AND timed.x IS NOT NULL
        GROUP BY 1, 2) binned
) latency ON true;
COMMENT ON VIEW analytics.run_gauges IS
  'Per run, what a metrics scrape reads cheaply: rows waiting by status and the oldest ready '
  'and raw row''s age, the flow counters, the last step and its staleness, the latest version, '
  'and the lease-wait and commit seconds of every step binned by latency_bounds '
  '(width_bucket: bin i holds latency_bounds[i] <= x < latency_bounds[i+1]).';

CREATE VIEW analytics.pipeline_gauges AS
WITH RECURSIVE names AS (
  (SELECT p.pipeline FROM public.pipeline_runs p ORDER BY p.pipeline LIMIT 1)
  UNION ALL
  SELECT (SELECT p.pipeline FROM public.pipeline_runs p WHERE p.pipeline > names.pipeline
          ORDER BY p.pipeline LIMIT 1)
  FROM names WHERE names.pipeline IS NOT NULL
)
SELECT names.pipeline, last.status AS last_status, last.trigger AS last_trigger,
       last.started_at AS last_started_at, last.finished_at AS last_finished_at,
       extract(epoch FROM now() - coalesce(last.finished_at, last.started_at))::float8
         AS last_run_age_s,
       success.finished_at AS last_success_at
FROM names
CROSS JOIN LATERAL (
  SELECT p.status, p.trigger, p.started_at, p.finished_at FROM public.pipeline_runs p
  WHERE p.pipeline = names.pipeline ORDER BY p.started_at DESC LIMIT 1
) last
LEFT JOIN LATERAL (
  SELECT p.finished_at FROM public.pipeline_runs p
  WHERE p.pipeline = names.pipeline AND p.status = 'succeeded'
  ORDER BY p.started_at DESC LIMIT 1
) success ON true
WHERE names.pipeline IS NOT NULL;
COMMENT ON VIEW analytics.pipeline_gauges IS
  'Per pipeline name, its last run (status, trigger, when, how long ago) and its last success.';

CREATE VIEW analytics.schedule_gauges AS
SELECT s.name AS schedule, s.pipeline_file, s.enabled, s.last_run_at, s.next_run_at,
       s.missed_runs,
       (SELECT max(p.finished_at) FROM public.pipeline_runs p
        WHERE p.schedule_id = s.id AND p.status = 'succeeded') AS last_success_at
FROM public.schedules s;
COMMENT ON VIEW analytics.schedule_gauges IS
  'Per schedule, its last run, next run, missed runs and last success.';
"""

GRANTS = ("GRANT SELECT ON analytics.run_gauges, analytics.pipeline_gauges, "
          "analytics.schedule_gauges TO reservoir_reader")


def upgrade() -> None:
    op.execute(INDEX)
    op.execute(VIEWS)
    op.execute(GRANTS)


def downgrade() -> None:
    op.execute("DROP VIEW analytics.schedule_gauges, analytics.pipeline_gauges, "
               "analytics.run_gauges")
    op.execute("DROP INDEX pipeline_runs_schedule_success")
