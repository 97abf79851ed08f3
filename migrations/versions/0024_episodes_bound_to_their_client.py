"""a served episode is bound to the client that opened it

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-03

`reservoir serve` named an episode by whatever the client sent (X-Episode-Id or `user`), so
any client could add calls to, or report the reward of, another's episode. The first call of
an episode now returns a secret (X-Episode-Secret); the episode keeps its SHA-256, and a call
or a report naming the episode is taken only with the secret. Episodes opened before this
revision have none and stay open to any client until they are reported.
"""

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE episodes ADD COLUMN secret_sha256 bytea")
    op.execute("ALTER TABLE episodes ADD CONSTRAINT episodes_secret_sha256_length "
               "CHECK (octet_length(secret_sha256) = 32)")


def downgrade() -> None:
    op.execute("ALTER TABLE episodes DROP COLUMN secret_sha256")
