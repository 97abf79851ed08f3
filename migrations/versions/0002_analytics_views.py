"""analytics schema: binary decoders, readable views, and the reservoir_reader role

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Views run with their owner's rights, so reservoir_reader reads experiences through them without
any privilege on the base tables. The role is cluster-wide: downgrade revokes its access to this
database and drops the role, unless another database on the server still grants it something.
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

DECODERS = """
CREATE FUNCTION analytics.uint32_at(b bytea, i integer) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT get_byte(b, 4 * i)::bigint
       + get_byte(b, 4 * i + 1)::bigint * 256
       + get_byte(b, 4 * i + 2)::bigint * 65536
       + get_byte(b, 4 * i + 3)::bigint * 16777216
$$;
COMMENT ON FUNCTION analytics.uint32_at IS 'The i-th little-endian uint32 of a bytea (0-based).';

CREATE FUNCTION analytics.float32_from_bits(bits bigint) RETURNS real
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT CASE
    WHEN e = 255 AND m = 0 THEN (CASE WHEN s = 1 THEN '-Infinity' ELSE 'Infinity' END)::real
    WHEN e = 255 THEN 'NaN'::real
    WHEN e = 0 THEN ((1 - 2 * s)::float8 * m * (2.0::float8 ^ -149))::real
    ELSE ((1 - 2 * s)::float8 * (1 + m / 8388608.0::float8) * (2.0::float8 ^ (e - 127)))::real
  END
  FROM (SELECT (bits >> 31) & 1 AS s, (bits >> 23) & 255 AS e, bits & 8388607 AS m) AS parts
$$;
COMMENT ON FUNCTION analytics.float32_from_bits IS 'IEEE-754 binary32 value of a 32-bit pattern.';

CREATE FUNCTION analytics.int32s(b bytea) RETURNS integer[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(
           (u - CASE WHEN u >= 2147483648 THEN 4294967296 ELSE 0 END)::integer ORDER BY i),
         '{}')
  FROM generate_series(0, length(b) / 4 - 1) AS i,
       LATERAL analytics.uint32_at(b, i) AS u
$$;
COMMENT ON FUNCTION analytics.int32s IS 'Decode token ids (int32 little-endian bytea) to integer[].';

CREATE FUNCTION analytics.float32s(b bytea) RETURNS real[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(analytics.float32_from_bits(analytics.uint32_at(b, i)) ORDER BY i), '{}')
  FROM generate_series(0, length(b) / 4 - 1) AS i
$$;
COMMENT ON FUNCTION analytics.float32s IS 'Decode logprobs (float32 little-endian bytea) to real[].';

CREATE FUNCTION analytics.uint8s(b bytea) RETURNS smallint[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(get_byte(b, i)::smallint ORDER BY i), '{}')
  FROM generate_series(0, length(b) - 1) AS i
$$;
COMMENT ON FUNCTION analytics.uint8s IS 'Decode an action mask (one byte per response token).';
"""

VIEWS = """
CREATE VIEW analytics.experiences AS
SELECT e.id, r.name AS run, e.task_id, e.group_id, e.policy_version, e.status, e.reward,
       e.reward_components, e.priority, e.times_sampled, e.prompt_len, e.response_len,
       e.prompt_text AS prompt, e.response_text AS response, e.metadata, e.parent_id,
       e.leased_until, used.step AS consumed_step, e.created_at
FROM experiences e
JOIN runs r ON r.id = e.run_id
LEFT JOIN LATERAL (
  SELECT max(ts.step) AS step
  FROM batch_items bi JOIN train_steps ts ON ts.id = bi.train_step_id
  WHERE bi.experience_id = e.id
) used ON true;
COMMENT ON VIEW analytics.experiences IS
  'One row per experience: text, reward, lengths in tokens, status, generating policy version, '
  'and the last train step that used it.';

CREATE VIEW analytics.experience_tokens AS
SELECT e.id, r.name AS run, analytics.int32s(e.prompt_ids) AS prompt_ids,
       analytics.int32s(e.response_ids) AS response_ids, analytics.float32s(e.logprobs) AS logprobs,
       analytics.uint8s(e.action_mask) AS action_mask
FROM experiences e JOIN runs r ON r.id = e.run_id;
COMMENT ON VIEW analytics.experience_tokens IS
  'Decoded token ids, logprobs and action mask of each experience (filter by id: decoding is slow).';

CREATE VIEW analytics.run_steps AS
SELECT r.name AS run, ts.step, ts.policy_version, ts.loss, ts.n_experiences,
       avg(e.reward)::float8 AS reward_mean, stddev_pop(e.reward) AS reward_std,
       min(e.reward) AS reward_min, max(e.reward) AS reward_max,
       avg(e.response_len)::float8 AS response_len_mean,
       avg(ts.policy_version - e.policy_version)::float8 AS staleness_mean,
       max(ts.policy_version - e.policy_version) AS staleness_max,
       ts.metrics, ts.created_at
FROM train_steps ts
JOIN runs r ON r.id = ts.run_id
JOIN batch_items bi ON bi.train_step_id = ts.id
JOIN experiences e ON e.id = bi.experience_id
GROUP BY r.name, ts.id;
COMMENT ON VIEW analytics.run_steps IS
  'Per run and train step: reward and response length of the batch, its staleness, loss, metrics.';

CREATE VIEW analytics.lineage AS
SELECT e.id AS experience_id, r.name AS run, e.task_id, t.prompt AS task_prompt,
       t.answer AS task_answer, e.group_id, e.policy_version AS generated_by_version,
       e.status, e.reward, e.parent_id, ts.step AS train_step, bi.policy_version AS trained_version,
       bi.weight AS train_weight, ts.created_at AS trained_at,
       pv.version AS published_version, pv.location AS published_location
FROM experiences e
JOIN runs r ON r.id = e.run_id
LEFT JOIN tasks t ON t.id = e.task_id
LEFT JOIN batch_items bi ON bi.experience_id = e.id
LEFT JOIN train_steps ts ON ts.id = bi.train_step_id
LEFT JOIN LATERAL (
  SELECT p.version, p.location FROM policy_versions p
  WHERE p.run_id = ts.run_id AND p.train_step >= ts.step
  ORDER BY p.version LIMIT 1
) pv ON true;
COMMENT ON VIEW analytics.lineage IS
  'task -> experience -> train step -> first published policy version containing that step.';

CREATE VIEW analytics.runs AS
SELECT r.name AS run, r.status, r.model, r.group_size, c.raw, c.ready, c.leased, c.consumed,
       c.quarantined, c.retired, r.rows_inserted, r.rows_sampled,
       (SELECT max(step) FROM train_steps WHERE run_id = r.id) AS last_step,
       (SELECT max(version) FROM policy_versions WHERE run_id = r.id) AS latest_version,
       r.config, r.created_at, r.updated_at
FROM runs r
LEFT JOIN LATERAL (
  SELECT count(*) FILTER (WHERE status = 'raw') AS raw,
         count(*) FILTER (WHERE status = 'ready') AS ready,
         count(*) FILTER (WHERE status = 'leased') AS leased,
         count(*) FILTER (WHERE status = 'consumed') AS consumed,
         count(*) FILTER (WHERE status = 'quarantined') AS quarantined,
         count(*) FILTER (WHERE status = 'retired') AS retired
  FROM experiences WHERE run_id = r.id
) c ON true;
COMMENT ON VIEW analytics.runs IS 'One row per run: status, experiences per status, flow counters.';
"""

READER = """
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'reservoir_reader') THEN
    CREATE ROLE reservoir_reader NOLOGIN;
  END IF;
END
$$;
GRANT USAGE ON SCHEMA analytics TO reservoir_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader;
"""

DROP_READER = """
DO $$
BEGIN
  DROP ROLE IF EXISTS reservoir_reader;
EXCEPTION WHEN dependent_objects_still_exist THEN
  RAISE NOTICE 'reservoir_reader kept: another database grants it privileges';
WHEN insufficient_privilege THEN
  RAISE NOTICE 'reservoir_reader kept: the superuser made it, and only a superuser drops it';
END
$$;
"""


def upgrade() -> None:
    op.execute("CREATE SCHEMA analytics")
    op.execute(DECODERS)
    op.execute(VIEWS)
    op.execute(READER)


def downgrade() -> None:
    op.execute("REVOKE ALL ON ALL TABLES IN SCHEMA analytics FROM reservoir_reader")
    op.execute("REVOKE ALL ON SCHEMA analytics FROM reservoir_reader")
    op.execute("DROP SCHEMA analytics CASCADE")
    op.execute(DROP_READER)
