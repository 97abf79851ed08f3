"""The store's tables, declared once with SQLAlchemy Core.

Migrations in `reservoir.migrations` create them; a test checks that a database built from the
migrations matches these declarations. Binary columns use the layout in `codec`.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Computed,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = MetaData()

RUN_STATUSES = ("created", "running", "stopped", "finished", "failed")
EXPERIENCE_STATUSES = ("raw", "ready", "leased", "consumed", "quarantined", "retired", "held")
PIPELINE_STATUSES = ("running", "succeeded", "failed", "dry_run", "abandoned")
EVENT_KINDS = ("dropped", "changed", "added", "scored", "quarantined", "retired", "held",
               "unselected")
REVIEW_STATUSES = ("pending", "labelled")
PAIR_STATUSES = ("ready", "leased", "consumed", "retired")


def _experience_key(columns: tuple[str, str], name: str, ondelete: str = "CASCADE",
                    use_alter: bool = False) -> ForeignKeyConstraint:
    """A reference to an experience: (its run, its id), the key of the partitioned state."""
    return ForeignKeyConstraint(list(columns), ["experience_state.run_id", "experience_state.id"],
                                name=name, ondelete=ondelete, use_alter=use_alter)


def _now() -> Column:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


runs = Table(
    "runs",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("config", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("model", Text),
    Column("status", Text, nullable=False, server_default="created"),
    Column("group_size", Integer),
    Column("rows_inserted", BigInteger, nullable=False, server_default="0"),
    Column("rows_sampled", BigInteger, nullable=False, server_default="0"),
    Column("progress", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("parent_run_id", BigInteger, ForeignKey("runs.id", ondelete="SET NULL")),
    Column("parent_step", Integer),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("vocab_size", Integer),  # the model's: the writer refuses token ids at or past it
    CheckConstraint(f"status IN {RUN_STATUSES}", name="runs_status_valid"),
    CheckConstraint("group_size IS NULL OR group_size > 0", name="runs_group_size_positive"),
    CheckConstraint("vocab_size IS NULL OR vocab_size > 0", name="runs_vocab_size_positive"),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("prompt", Text, nullable=False),
    Column("answer", Text),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("source", Text),
    Column("split", Text, nullable=False, server_default="train"),
    Column("difficulty", Float, comment="1 - the pass rate of its experiences "
           "(task_difficulty_mapper), in [0, 1]; NULL while unmeasured."),
    Column("priority", Float, nullable=False, server_default="0"),
    Column("times_explored", Integer, nullable=False, server_default="0"),
    Column("claim_token", UUID(as_uuid=True)),
    Column("claimed_by", Text),
    Column("claimed_until", DateTime(timezone=True)),
    _now(),
    Column("status", Text, nullable=False, server_default="active",
           comment="active (explorers claim it) or retired (a task pipeline dropped or replaced "
                   "it: never claimed again, never deleted)."),
    Column("parent_id", BigInteger, ForeignKey("tasks.id", ondelete="SET NULL")),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Index("tasks_run_split", "run_id", "split"),
    Index("tasks_claim_order", "run_id", "split", "times_explored", "id",
          postgresql_where=text("status = 'active'")),
    Index("tasks_claim_priority", "run_id", "split", text("priority DESC"), "times_explored",
          "id", postgresql_where=text("status = 'active'")),
    Index("tasks_claim_difficulty", "run_id", "split", "difficulty", "times_explored", "id",
          postgresql_where=text("status = 'active'")),
    Index("tasks_claimed", "run_id", "claimed_until",
          postgresql_where=text("claim_token IS NOT NULL")),
    Index("tasks_parent", "parent_id", postgresql_where=text("parent_id IS NOT NULL")),
)

policy_versions = Table(
    "policy_versions",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("version", Integer, nullable=False),
    Column("location", Text),
    Column("train_step", Integer),
    _now(),
    UniqueConstraint("run_id", "version", name="policy_versions_run_version"),
)

# An experience is two rows. `experience_data` holds what is written once (texts, token ids,
# logprobs, mask, rewards, the group's id and row number: ~2 KB); `experience_state` holds what
# a lease and a step commit change (status, lease, times sampled) and what the sampler orders
# and filters by (~80 bytes), so a lease and a commit rewrite only the narrow row. The view `experiences` joins the two under the
# old column names; inserts, updates and deletes through it go to the right table (triggers of
# migrations 0012 and 0013), and an update of a row's state through it fails if the state
# changed since the statement read it. Both tables are partitioned by run (one partition of each
# per run, created with the run by a trigger on `runs`): an experience's key is (run_id, id), and
# every row that names an experience names its run.
experience_data = Table(
    "experience_data",
    metadata,
    Column("id", BigInteger, nullable=False),  # default: experience_data_id_seq
    # names a run; deleting the run deletes the row: a statement trigger (experience_keys,
    # experiences_unlink: migration 0022), not a foreign key, which ran a query for every row
    Column("run_id", BigInteger, nullable=False),
    Column("task_id", BigInteger, ForeignKey("tasks.id", ondelete="SET NULL")),
    Column("prompt_text", Text, nullable=False),
    Column("response_text", Text, nullable=False),
    Column("prompt_ids", LargeBinary, nullable=False),
    Column("response_ids", LargeBinary, nullable=False),
    Column("logprobs", LargeBinary),
    Column("action_mask", LargeBinary),
    Column("reward", Float, nullable=False),
    Column("shaped_reward", Float),
    Column("reward_components", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("parent_id", BigInteger),
    Column("parent_run_id", BigInteger),  # a parent may be of another run
    Column("prompt_len", Integer, Computed("length(prompt_ids) / 4", persisted=True)),
    Column("response_len", Integer, Computed("length(response_ids) / 4", persisted=True)),
    Column("group_id", UUID(as_uuid=True), nullable=False),
    Column("group_row", SmallInteger, nullable=False),
    PrimaryKeyConstraint("id", "run_id", name="experience_data_pkey"),
    CheckConstraint("(parent_id IS NULL) = (parent_run_id IS NULL)",
                    name="experience_data_parent_both"),
    CheckConstraint("group_row >= 0", name="experience_data_group_row_valid"),
    _experience_key(("parent_run_id", "parent_id"), "experience_data_parent_id_fkey", "SET NULL",
                    use_alter=True),  # the state names the data: a cycle
    # a group's rows, by the group (migration 0020: on the write-once data row, so the state
    # row's rewrites by a lease and a step commit add no entry to it); covering the id, so a
    # group's rows are found without reading the data rows
    Index("experience_data_group_row", "group_id", "group_row", "run_id", unique=True,
          postgresql_include=["id"]),
    Index("experience_data_task", "task_id"),
    Index("experience_data_parent", "parent_run_id", "parent_id",
          postgresql_where=text("parent_id IS NOT NULL")),
    postgresql_partition_by="LIST (run_id)",
)

experience_state = Table(
    "experience_state",
    metadata,
    Column("id", BigInteger, nullable=False),
    Column("run_id", BigInteger, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("status", Text, nullable=False, server_default="ready"),
    Column("priority", Float, nullable=False, server_default="0"),
    Column("times_sampled", Integer, nullable=False, server_default="0"),
    Column("lease_token", UUID(as_uuid=True)),
    Column("leased_until", DateTime(timezone=True)),
    _now(),
    CheckConstraint(f"status IN {EXPERIENCE_STATUSES}", name="experience_state_status_valid"),
    CheckConstraint(
        "(status = 'leased') = (lease_token IS NOT NULL)", name="experience_state_lease_iff_leased"
    ),
    PrimaryKeyConstraint("id", "run_id", name="experience_state_pkey"),
    # A state row names its data row (and through it the run), and goes when it goes: statement
    # triggers (experience_keys, experience_state_unlink: migration 0022) that check a
    # statement's rows against the run's data partition in one query, not foreign keys.
    Index("experience_state_ready", "run_id", "created_at", "id",
          postgresql_where=text("status = 'ready'")),
    Index(
        "experience_state_ready_priority",
        "run_id",
        text("priority DESC"),
        "id",
        postgresql_where=text("status = 'ready'"),
    ),
    Index("experience_state_leased", "leased_until", postgresql_where=text("status = 'leased'")),
    # rows at rest by status (pipelines, counts, retention); a lease and a step commit add no
    # entry to it (migration 0019), nor to any index of the lease token (they find rows by id)
    Index("experience_state_at_rest", "run_id", "status",
          postgresql_where=text("status NOT IN ('leased', 'consumed')")),
    postgresql_partition_by="LIST (run_id)",
)

# Every group's id, with its run (migration 0015): a group id names one group of one run. A
# statement trigger on experience_state and on each run's state partition (0016) adds the ids
# of the groups whose row 0 a statement inserted, however they come.
experience_groups = Table(
    "experience_groups",
    metadata,
    Column("group_id", UUID(as_uuid=True), primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Index("experience_groups_run", "run_id"),
    comment="Every group id, with its run: a group id names one group of one run.",
)

# The view: every column of an experience under one name, in this order (declared here for
# queries, not created by `metadata`: migration 0012 creates it).
EXPERIENCE_COLUMNS = ("id", "run_id", "task_id", "group_id", "group_row", "policy_version",
                      "prompt_text", "response_text", "prompt_ids", "response_ids", "logprobs",
                      "action_mask", "reward", "shaped_reward", "reward_components", "metadata",
                      "status", "priority", "times_sampled", "lease_token", "leased_until",
                      "parent_id", "prompt_len", "response_len", "created_at", "parent_run_id")


def _view_column(name: str) -> Column:
    """The view's column, typed as in the table that holds it (id and run_id: both do)."""
    table = experience_state if name in experience_state.c else experience_data
    return Column(name, table.c[name].type)


experiences = Table("experiences", MetaData(),
                    *(_view_column(name) for name in EXPERIENCE_COLUMNS))

train_steps = Table(
    "train_steps",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("loss", Float),
    Column("metrics", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("n_experiences", Integer, nullable=False),
    Column("stage", Text),
    _now(),
    UniqueConstraint("run_id", "step", name="train_steps_run_step"),
)

# The ledger. Its keys (a row names a train step, and an experience of its run; deleting either
# deletes the row) are statement triggers, one query a statement for all its rows
# (batch_items_keys, batch_items_unlink: migration 0017), not foreign keys, which ran a query
# for every row of a step commit.
batch_items = Table(
    "batch_items",
    metadata,
    Column("train_step_id", BigInteger, nullable=False),
    Column("experience_id", BigInteger, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("weight", Float, nullable=False, server_default="1"),
    Column("run_id", BigInteger, nullable=False),  # the experience's
    PrimaryKeyConstraint("train_step_id", "experience_id", "run_id", name="batch_items_pkey"),
    # Partitioned by the experience's run like the experiences (migration 0014).
    Index("batch_items_experience", "experience_id"),
    postgresql_partition_by="LIST (run_id)",
)

pipeline_runs = Table(
    "pipeline_runs",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("pipeline", Text, nullable=False),
    Column("source_file", Text),
    Column("spec", JSONB, nullable=False),
    Column("spec_hash", Text, nullable=False),
    Column("run_ids", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("trigger", Text, nullable=False, server_default="cli"),
    Column("status", Text, nullable=False, server_default="running"),
    Column("rows_in", Integer),
    Column("rows_out", Integer),
    Column("rows_dropped", Integer),
    Column("operators", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("duration_s", Float),
    Column("error", Text),
    Column("schedule_id", BigInteger, ForeignKey("schedules.id", ondelete="SET NULL")),
    Column("backend_pid", Integer),
    Column("backend_started_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True)),
    CheckConstraint(f"status IN {PIPELINE_STATUSES}", name="pipeline_runs_status_valid"),
    Index("pipeline_runs_pipeline", "pipeline", "started_at"),
    Index("pipeline_runs_running", "id", postgresql_where=text("status = 'running'")),
    Index("pipeline_runs_schedule_success", "schedule_id", "finished_at",
          postgresql_where=text("status = 'succeeded'")),
)

operator_events = Table(
    "operator_events",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("pipeline_run_id", BigInteger, ForeignKey("pipeline_runs.id", ondelete="CASCADE"),
           nullable=False),
    Column("experience_id", BigInteger),
    Column("task_id", BigInteger, ForeignKey("tasks.id", ondelete="CASCADE")),
    Column("operator", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("reason", Text),
    Column("stats", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _now(),
    Column("run_id", BigInteger),  # the experience's
    CheckConstraint(f"kind IN {EVENT_KINDS}", name="operator_events_kind_valid"),
    CheckConstraint("(experience_id IS NULL) = (run_id IS NULL)",
                    name="operator_events_experience_run"),
    _experience_key(("run_id", "experience_id"), "operator_events_experience_id_fkey"),
    Index("operator_events_run", "pipeline_run_id"),
    Index("operator_events_experience", "experience_id"),
)

validations = Table(
    "validations",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("pipeline_run_id", BigInteger, ForeignKey("pipeline_runs.id", ondelete="CASCADE"),
           nullable=False),
    Column("expectation", Text, nullable=False),
    Column("kwargs", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("success", Boolean, nullable=False),
    Column("element_count", Integer),
    Column("unexpected_count", Integer),
    Column("sample", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("on_failure", Text, nullable=False),
    _now(),
    Index("validations_run", "pipeline_run_id"),
)

schedules = Table(
    "schedules",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("pipeline_file", Text, nullable=False),
    Column("cron", Text, nullable=False),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("last_run_at", DateTime(timezone=True)),
    Column("next_run_at", DateTime(timezone=True), nullable=False),
    Column("missed_runs", Integer, nullable=False, server_default="0"),
    _now(),
)

reviews = Table(
    "reviews",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("experience_id", BigInteger, nullable=False, unique=True),
    Column("pipeline_run_id", BigInteger, ForeignKey("pipeline_runs.id", ondelete="SET NULL")),
    Column("reason", Text),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("verdict", Text),
    Column("label", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("reviewer", Text),
    _now(),
    Column("labelled_at", DateTime(timezone=True)),
    Column("run_id", BigInteger, nullable=False),  # the experience's
    CheckConstraint(f"status IN {REVIEW_STATUSES}", name="reviews_status_valid"),
    _experience_key(("run_id", "experience_id"), "reviews_experience_id_fkey"),
    CheckConstraint("verdict IS NULL OR verdict IN ('accept', 'reject')",
                    name="reviews_verdict_valid"),
)

preferences = Table(
    "preferences",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("task_id", BigInteger, ForeignKey("tasks.id", ondelete="CASCADE")),
    Column("chosen_id", BigInteger, nullable=False),  # both of the pair's run
    Column("rejected_id", BigInteger, nullable=False),
    Column("source", Text),
    _now(),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("margin", Float),
    Column("status", Text, nullable=False, server_default="ready"),
    Column("times_sampled", Integer, nullable=False, server_default="0"),
    Column("lease_token", UUID(as_uuid=True)),
    Column("leased_until", DateTime(timezone=True)),
    CheckConstraint(f"status IN {PAIR_STATUSES}", name="preferences_status_valid"),
    CheckConstraint("(status = 'leased') = (lease_token IS NOT NULL)",
                    name="preferences_lease_iff_leased"),
    CheckConstraint("chosen_id <> rejected_id", name="preferences_two_responses"),
    _experience_key(("run_id", "chosen_id"), "preferences_chosen_id_fkey"),
    _experience_key(("run_id", "rejected_id"), "preferences_rejected_id_fkey"),
    UniqueConstraint("chosen_id", "rejected_id", name="preferences_pair"),
    Index("preferences_ready", "run_id", "id", postgresql_where=text("status = 'ready'")),
    Index("preferences_lease_token", "lease_token",
          postgresql_where=text("lease_token IS NOT NULL")),
)

batch_pairs = Table(
    "batch_pairs",
    metadata,
    Column("train_step_id", BigInteger, ForeignKey("train_steps.id", ondelete="CASCADE"),
           nullable=False),
    Column("preference_id", BigInteger, ForeignKey("preferences.id", ondelete="CASCADE"),
           nullable=False),
    PrimaryKeyConstraint("train_step_id", "preference_id", name="batch_pairs_pkey"),
    Index("batch_pairs_preference", "preference_id"),
)

EPISODE_STATUSES = ("open", "reported")
REVIEW_ACTIONS = ("accept", "reject", "label", "prefer")

run_archives = Table(
    "run_archives",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("manifest_sha256", LargeBinary, nullable=False),
    Column("experiences", BigInteger, nullable=False),
    Column("archived_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("restored_at", DateTime(timezone=True)),
    CheckConstraint("octet_length(manifest_sha256) = 32",
                    name="run_archives_manifest_sha256_check"),
    CheckConstraint("experiences >= 0", name="run_archives_experiences_check"),
    UniqueConstraint("run_id", "manifest_sha256", name="run_archives_manifest"),
    comment="Each archive of a run (the SHA-256 of its manifest.json) and when it was restored.",
)

run_trackers = Table(
    "run_trackers",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("tracker", Text, primary_key=True),
    Column("destination", Text, primary_key=True),
    Column("external_id", Text),
    Column("last_step", Integer, nullable=False, server_default="-1"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("tracker IN ('tensorboard', 'mlflow', 'wandb')",
                    name="run_trackers_tracker_valid"),
    comment="Each experiment tracker following a run: its own run id and the last step it "
            "logged (a resumed run logs no step twice).",
)

explorer_rounds = Table(
    "explorer_rounds",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("worker", Text, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("groups", Integer, nullable=False),
    Column("experiences", Integer, nullable=False),
    Column("response_tokens", BigInteger, nullable=False),
    Column("generate_s", Float, nullable=False),
    Column("update_s", Float),
    Column("finished_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("groups > 0 AND experiences >= groups AND response_tokens >= 0",
                    name="explorer_rounds_counts_valid"),
    CheckConstraint("generate_s >= 0 AND (update_s IS NULL OR update_s >= 0)",
                    name="explorer_rounds_seconds_valid"),
    Index("explorer_rounds_run", "run_id", "finished_at"),
    comment="Each explorer round a run's groups came from: worker, policy version, groups, "
            "experiences, response tokens, generation seconds and the in-place weight update "
            "it waited for.",
)

run_servers = Table(
    "run_servers",
    metadata,
    Column("run_name", Text, primary_key=True),
    Column("server", Text, nullable=False),
    Column("demand", Float, nullable=False),
    Column("placed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("demand >= 0 AND demand < 'Infinity'", name="run_servers_demand_valid"),
    Index("run_servers_server", "server"),
    comment="Which server each run lives on when store.urls names several (read on the "
            "first): host:port/database, the demand the run declared, when it was placed.",
)

episodes = Table(
    "episodes",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("key", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="open"),
    Column("reward", Float),
    Column("group_id", UUID(as_uuid=True)),
    _now(),
    Column("reported_at", DateTime(timezone=True)),
    Column("secret_sha256", LargeBinary),  # of the secret its first call returned
    CheckConstraint(f"status IN {EPISODE_STATUSES}", name="episodes_status_valid"),
    CheckConstraint("octet_length(secret_sha256) = 32", name="episodes_secret_sha256_length"),
    CheckConstraint("(status = 'reported') = (reported_at IS NOT NULL)",
                    name="episodes_reported_iff_time"),
    UniqueConstraint("run_id", "key", name="episodes_run_key"),
)

episode_calls = Table(
    "episode_calls",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("episode_id", BigInteger, ForeignKey("episodes.id", ondelete="CASCADE"),
           nullable=False),
    Column("call_id", Text, nullable=False),
    Column("choice", SmallInteger, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("temperature", Float, nullable=False),
    Column("prompt_text", Text, nullable=False),
    Column("response_text", Text, nullable=False),
    Column("prompt_ids", LargeBinary, nullable=False),
    Column("response_ids", LargeBinary, nullable=False),
    Column("logprobs", LargeBinary, nullable=False),
    Column("finish_reason", Text, nullable=False),
    _now(),
    CheckConstraint("choice >= 0", name="episode_calls_choice_valid"),
    Index("episode_calls_episode", "episode_id", "id"),
)

review_actions = Table(
    "review_actions",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("reviewer", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("review_id", BigInteger, ForeignKey("reviews.id", ondelete="SET NULL")),
    Column("experience_id", BigInteger),
    Column("preference_id", BigInteger, ForeignKey("preferences.id", ondelete="SET NULL")),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _now(),
    Column("run_id", BigInteger),  # the experience's
    CheckConstraint("(experience_id IS NULL) = (run_id IS NULL)",
                    name="review_actions_experience_run"),
    _experience_key(("run_id", "experience_id"), "review_actions_experience_id_fkey", "SET NULL"),
    CheckConstraint(f"action IN {REVIEW_ACTIONS}", name="review_actions_action_valid"),
    Index("review_actions_reviewer", "reviewer", "created_at"),
)
