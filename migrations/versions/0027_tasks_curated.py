"""tasks are curated like experiences: a status, a parent, metadata, and claim orders by index

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-06

A task pipeline retires a task (never claimed again, never deleted), rewrites it (a task no
explorer has claimed or explored is updated; another gets a new version, a child task, and
the old one retires) or adds an augmented child (`parent_id`, `metadata.augmented_from`).
Explorers claim active tasks in one of three orders (`explorer.task_order`), each served by an
index on active tasks: least explored, priority, and the difficulty band.
"""

from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
ALTER TABLE tasks
    ADD COLUMN status text NOT NULL DEFAULT 'active',
    ADD COLUMN parent_id bigint REFERENCES tasks (id) ON DELETE SET NULL,
    ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT tasks_status_valid CHECK (status IN ('active', 'retired')),
    ADD CONSTRAINT tasks_difficulty_range
        CHECK (difficulty IS NULL OR (difficulty >= 0 AND difficulty <= 1)),
    ADD CONSTRAINT tasks_priority_finite
        CHECK (priority <> 'NaN' AND priority > '-Infinity' AND priority < 'Infinity')""")
    op.execute("DROP INDEX tasks_claim_order")
    op.execute("CREATE INDEX tasks_claim_order ON tasks (run_id, split, times_explored, id) "
               "WHERE status = 'active'")
    op.execute("CREATE INDEX tasks_claim_priority ON tasks "
               "(run_id, split, priority DESC, times_explored, id) WHERE status = 'active'")
    op.execute("CREATE INDEX tasks_claim_difficulty ON tasks "
               "(run_id, split, difficulty, times_explored, id) WHERE status = 'active'")
    op.execute("CREATE INDEX tasks_parent ON tasks (parent_id) WHERE parent_id IS NOT NULL")
    op.execute("COMMENT ON COLUMN tasks.status IS 'active (explorers claim it) or retired (a "
               "task pipeline dropped or replaced it: never claimed again, never deleted).'")
    op.execute("COMMENT ON COLUMN tasks.difficulty IS '1 - the pass rate of its experiences "
               "(task_difficulty_mapper), in [0, 1]; NULL while unmeasured.'")
    op.execute("""
CREATE OR REPLACE VIEW analytics.tasks AS
SELECT t.id AS task_id, r.name AS run, t.split, t.prompt, t.answer, t.source, t.payload,
       t.difficulty, t.priority, t.times_explored, t.claimed_by, t.claimed_until, t.created_at,
       t.status, t.parent_id, t.metadata
FROM public.tasks t JOIN public.runs r ON r.id = t.run_id""")
    op.execute("COMMENT ON VIEW analytics.tasks IS 'One row per task: split, prompt and answer, "
               "difficulty and priority, times explored, claim, status and the task it was "
               "made from.'")
    op.execute("""
CREATE OR REPLACE VIEW analytics.operator_events AS
SELECT o.id AS event_id, p.pipeline, o.pipeline_run_id, r.name AS run, o.experience_id,
       o.task_id, o.operator, o.kind, o.reason, o.stats, o.created_at
FROM public.operator_events o
JOIN public.pipeline_runs p ON p.id = o.pipeline_run_id
LEFT JOIN public.tasks t ON t.id = o.task_id AND o.experience_id IS NULL
LEFT JOIN public.runs r ON r.id = coalesce(o.run_id, t.run_id)""")


def downgrade() -> None:
    op.execute("""
CREATE OR REPLACE VIEW analytics.operator_events AS
SELECT o.id AS event_id, p.pipeline, o.pipeline_run_id, r.name AS run, o.experience_id,
       o.task_id, o.operator, o.kind, o.reason, o.stats, o.created_at
FROM public.operator_events o
JOIN public.pipeline_runs p ON p.id = o.pipeline_run_id
LEFT JOIN public.experiences e ON e.id = o.experience_id
LEFT JOIN public.runs r ON r.id = e.run_id""")
    op.execute("DROP VIEW analytics.tasks")
    op.execute("""
CREATE VIEW analytics.tasks AS
SELECT t.id AS task_id, r.name AS run, t.split, t.prompt, t.answer, t.source, t.payload,
       t.difficulty, t.priority, t.times_explored, t.claimed_by, t.claimed_until, t.created_at
FROM public.tasks t JOIN public.runs r ON r.id = t.run_id""")
    op.execute("GRANT SELECT ON analytics.tasks TO reservoir_reader")
    op.execute("DROP INDEX tasks_parent, tasks_claim_difficulty, tasks_claim_priority, "
               "tasks_claim_order")
    op.execute("CREATE INDEX tasks_claim_order ON tasks (run_id, split, times_explored, id)")
    op.execute("ALTER TABLE tasks DROP COLUMN metadata, DROP COLUMN parent_id, "
               "DROP COLUMN status, DROP CONSTRAINT tasks_difficulty_range, "
               "DROP CONSTRAINT tasks_priority_finite")
