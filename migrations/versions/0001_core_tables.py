"""core tables: runs, tasks, experiences, policy versions, train steps, batch items

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 04:58:35.302957
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('config', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('model', sa.Text(), nullable=True),
    sa.Column('status', sa.Text(), server_default='created', nullable=False),
    sa.Column('group_size', sa.Integer(), nullable=True),
    sa.Column('rows_inserted', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('rows_sampled', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("status IN ('created', 'running', 'stopped', 'finished', 'failed')", name='runs_status_valid'),
    sa.CheckConstraint('group_size IS NULL OR group_size > 0', name='runs_group_size_positive'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('policy_versions',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('location', sa.Text(), nullable=True),
    sa.Column('train_step', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'version', name='policy_versions_run_version')
    )
    op.create_table('tasks',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('answer', sa.Text(), nullable=True),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('source', sa.Text(), nullable=True),
    sa.Column('split', sa.Text(), server_default='train', nullable=False),
    sa.Column('difficulty', sa.Float(), nullable=True),
    sa.Column('priority', sa.Float(), server_default='0', nullable=False),
    sa.Column('times_explored', sa.Integer(), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('tasks_run_split', 'tasks', ['run_id', 'split'], unique=False)
    op.create_table('train_steps',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('metrics', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('n_experiences', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'step', name='train_steps_run_step')
    )
    op.create_table('experiences',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('task_id', sa.BigInteger(), nullable=True),
    sa.Column('group_id', sa.UUID(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('prompt_text', sa.Text(), nullable=False),
    sa.Column('response_text', sa.Text(), nullable=False),
    sa.Column('prompt_ids', sa.LargeBinary(), nullable=False),
    sa.Column('response_ids', sa.LargeBinary(), nullable=False),
    sa.Column('logprobs', sa.LargeBinary(), nullable=True),
    sa.Column('action_mask', sa.LargeBinary(), nullable=True),
    sa.Column('reward', sa.Float(), nullable=False),
    sa.Column('reward_components', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('status', sa.Text(), server_default='ready', nullable=False),
    sa.Column('priority', sa.Float(), server_default='0', nullable=False),
    sa.Column('times_sampled', sa.Integer(), server_default='0', nullable=False),
    sa.Column('lease_token', sa.UUID(), nullable=True),
    sa.Column('leased_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('parent_id', sa.BigInteger(), nullable=True),
    sa.Column('prompt_len', sa.Integer(), sa.Computed('length(prompt_ids) / 4', persisted=True), nullable=True),
    sa.Column('response_len', sa.Integer(), sa.Computed('length(response_ids) / 4', persisted=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("(status = 'leased') = (lease_token IS NOT NULL)", name='experiences_lease_iff_leased'),
    sa.CheckConstraint("status IN ('raw', 'ready', 'leased', 'consumed', 'quarantined', 'retired')", name='experiences_status_valid'),
    sa.ForeignKeyConstraint(['parent_id'], ['experiences.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('experiences_group', 'experiences', ['group_id', 'id'], unique=False)
    op.create_index('experiences_leased', 'experiences', ['leased_until'], unique=False, postgresql_where=sa.text("status = 'leased'"))
    op.create_index('experiences_ready', 'experiences', ['run_id', 'created_at', 'id'], unique=False, postgresql_where=sa.text("status = 'ready'"))
    op.create_index('experiences_ready_priority', 'experiences', ['run_id', sa.literal_column('priority DESC'), 'id'], unique=False, postgresql_where=sa.text("status = 'ready'"))
    op.create_index('experiences_run_status', 'experiences', ['run_id', 'status'], unique=False)
    op.create_index('experiences_task', 'experiences', ['task_id'], unique=False)
    op.create_table('batch_items',
    sa.Column('train_step_id', sa.BigInteger(), nullable=False),
    sa.Column('experience_id', sa.BigInteger(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('weight', sa.Float(), server_default='1', nullable=False),
    sa.ForeignKeyConstraint(['experience_id'], ['experiences.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['train_step_id'], ['train_steps.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('train_step_id', 'experience_id', name='batch_items_pkey')
    )
    op.create_index('batch_items_experience', 'batch_items', ['experience_id'], unique=False)
    # Token ids and logprobs are incompressible: store them out of line without trying to compress,
    # which keeps the row small for status updates and makes COPY faster.
    for column in ("prompt_ids", "response_ids", "logprobs", "action_mask"):
        op.execute(f"ALTER TABLE experiences ALTER COLUMN {column} SET STORAGE EXTERNAL")


def downgrade() -> None:
    for table in ("batch_items", "experiences", "train_steps", "tasks", "policy_versions", "runs"):
        op.drop_table(table)
