"""explorer_rounds: each explorer round a run's groups came from, and analytics.explorer_rounds

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-06

An explorer writes a row for every round it explores, in the transaction that writes the
round's groups (so a round is a row exactly when its groups are): the worker, the policy
version, how many groups, experiences and response tokens, the seconds generation took, and
the seconds of the in-place weight update the round waited for (none when it loaded nothing).
Trackers log explorer rollouts/s and update seconds per train step from it; people read it
through analytics.explorer_rounds.
"""

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

TABLE = """
CREATE TABLE explorer_rounds (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    worker text NOT NULL,
    policy_version integer NOT NULL,
    groups integer NOT NULL,
    experiences integer NOT NULL,
    response_tokens bigint NOT NULL,
    generate_s double precision NOT NULL,
    update_s double precision,
    finished_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT explorer_rounds_counts_valid
        CHECK (groups > 0 AND experiences >= groups AND response_tokens >= 0),
    CONSTRAINT explorer_rounds_seconds_valid
        CHECK (generate_s >= 0 AND (update_s IS NULL OR update_s >= 0))
);
CREATE INDEX explorer_rounds_run ON explorer_rounds (run_id, finished_at);
COMMENT ON TABLE explorer_rounds IS
  'Each explorer round a run''s groups came from: worker, policy version, groups, experiences, response tokens, generation seconds and the in-place weight update it waited for.';
"""

VIEW = """
CREATE VIEW analytics.explorer_rounds AS
SELECT x.id AS explorer_round_id, r.name AS run, x.worker, x.policy_version, x.groups,
       x.experiences, x.response_tokens, x.generate_s, x.update_s, x.finished_at
FROM public.explorer_rounds x JOIN public.runs r ON r.id = x.run_id;
COMMENT ON VIEW analytics.explorer_rounds IS
  'Each explorer round: its run, worker, policy version, groups, experiences, response tokens, generation seconds and in-place update seconds.';
GRANT SELECT ON analytics.explorer_rounds TO reservoir_reader;
"""


def upgrade() -> None:
    op.execute(TABLE)
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW analytics.explorer_rounds")
    op.execute("DROP TABLE explorer_rounds")
