"""where each experiment tracker that follows a run has got to

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-06

A tracker (TensorBoard, MLflow, W&B) follows a run's committed steps from the store. Its row
holds the tracker's own run id (an MLflow run, a W&B run) and the last step it logged, written
after each step reached it: a resumed run, or `reservoir runs track`, continues the same tracker
run and logs no step twice.
"""

from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE TABLE run_trackers (
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    tracker text NOT NULL,
    destination text NOT NULL,
    external_id text,
    last_step integer NOT NULL DEFAULT -1,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, tracker, destination),
    CONSTRAINT run_trackers_tracker_valid CHECK (tracker IN ('tensorboard', 'mlflow', 'wandb'))
)""")
    op.execute("COMMENT ON TABLE run_trackers IS 'Each experiment tracker following a run: its "
               "own run id and the last step it logged (a resumed run logs no step twice).'")


def downgrade() -> None:
    op.execute("DROP TABLE run_trackers")
