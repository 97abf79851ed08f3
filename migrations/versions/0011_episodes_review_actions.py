"""served episodes and their calls, and the log of every review action

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

- `episodes`: an episode of an agent served by `reservoir serve` (the client's id, unique per
  run), open until its reward is reported; then its calls are written as one group of
  experiences (`group_id`) and it is `reported`.
- `episode_calls`: each response of each chat completion of an open episode (token ids,
  logprobs, the policy version and temperature that made it); they move into `experiences`
  when the episode is reported.
- `review_actions`: who did what to which review, experience or preference, when, and from
  where (the review page or the CLI).
- Views: analytics.episodes, analytics.episode_calls, analytics.review_actions.
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

EPISODE_STATUSES = ("open", "reported")
REVIEW_ACTIONS = ("accept", "reject", "label", "prefer")
NEW_VIEWS = ("episodes", "episode_calls", "review_actions")

VIEWS = """
CREATE VIEW analytics.episodes AS
SELECT p.key AS episode, r.name AS run, p.status, p.reward,
       CASE WHEN p.status = 'open'
            THEN (SELECT count(*) FROM public.episode_calls c WHERE c.episode_id = p.id)
            ELSE (SELECT count(*) FROM public.experiences e WHERE e.group_id = p.group_id)
       END AS responses,
       p.group_id, p.created_at, p.reported_at
FROM public.episodes p JOIN public.runs r ON r.id = p.run_id;
COMMENT ON VIEW analytics.episodes IS
  'Episodes of served agents: open (calls recorded, no reward yet) or reported (written as '
  'the experiences of group_id).';

CREATE VIEW analytics.episode_calls AS
SELECT p.key AS episode, r.name AS run, c.call_id, c.choice, c.policy_version, c.temperature,
       c.prompt_text AS prompt, c.response_text AS response, c.finish_reason,
       length(c.prompt_ids) / 4 AS prompt_len, length(c.response_ids) / 4 AS response_len,
       c.created_at
FROM public.episode_calls c
JOIN public.episodes p ON p.id = c.episode_id
JOIN public.runs r ON r.id = p.run_id;
COMMENT ON VIEW analytics.episode_calls IS
  'Responses of open episodes, awaiting their reward (reported ones are experiences).';

CREATE VIEW analytics.review_actions AS
SELECT a.id AS review_action_id, a.reviewer, a.action, a.source, a.review_id,
       a.experience_id, a.preference_id, a.detail, a.created_at
FROM public.review_actions a;
COMMENT ON VIEW analytics.review_actions IS
  'Every action of a person on a review or a pair: who, what, on which rows, when, from where.';

GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader;
"""


def upgrade() -> None:
    op.create_table(
        "episodes",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("run_id", sa.BigInteger(), sa.ForeignKey("runs.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False, server_default="open"),
        sa.Column("reward", sa.Float()),
        sa.Column("group_id", UUID(as_uuid=True)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("reported_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(f"status IN {EPISODE_STATUSES}", name="episodes_status_valid"),
        sa.CheckConstraint("(status = 'reported') = (reported_at IS NOT NULL)",
                           name="episodes_reported_iff_time"),
        sa.UniqueConstraint("run_id", "key", name="episodes_run_key"),
    )
    op.create_table(
        "episode_calls",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("episode_id", sa.BigInteger(),
                  sa.ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False),
        sa.Column("call_id", sa.Text(), nullable=False),
        sa.Column("choice", sa.SmallInteger(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=False),
        sa.Column("response_text", sa.Text(), nullable=False),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=False),
        sa.Column("response_ids", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("finish_reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("choice >= 0", name="episode_calls_choice_valid"),
    )
    op.create_index("episode_calls_episode", "episode_calls", ["episode_id", "id"])
    op.create_table(
        "review_actions",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("reviewer", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("review_id", sa.BigInteger(),
                  sa.ForeignKey("reviews.id", ondelete="SET NULL")),
        sa.Column("experience_id", sa.BigInteger(),
                  sa.ForeignKey("experiences.id", ondelete="SET NULL")),
        sa.Column("preference_id", sa.BigInteger(),
                  sa.ForeignKey("preferences.id", ondelete="SET NULL")),
        sa.Column("detail", JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint(f"action IN {REVIEW_ACTIONS}", name="review_actions_action_valid"),
    )
    op.create_index("review_actions_reviewer", "review_actions", ["reviewer", "created_at"])
    op.execute(VIEWS)


def downgrade() -> None:
    for view in NEW_VIEWS:
        op.execute(f"DROP VIEW IF EXISTS analytics.{view}")
    op.drop_table("review_actions")
    op.drop_table("episode_calls")
    op.drop_table("episodes")
