"""the archives a run was moved into: a restore writes only into the run it was made from

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-03

An archive's manifest names its run; one re-sealed to name another run put the archive's rows
and their ledger into that run. Archiving a run now records the SHA-256 of the manifest it
wrote; a restore into an existing run needs an archive of that run with that very manifest,
not restored yet (into a store without the run, the restore makes the run itself).
"""

from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE TABLE run_archives (
    id bigserial PRIMARY KEY,
    run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    manifest_sha256 bytea NOT NULL CHECK (octet_length(manifest_sha256) = 32),
    experiences bigint NOT NULL CHECK (experiences >= 0),
    archived_at timestamptz NOT NULL DEFAULT now(),
    restored_at timestamptz,
    CONSTRAINT run_archives_manifest UNIQUE (run_id, manifest_sha256)
)""")
    op.execute("COMMENT ON TABLE run_archives IS 'Each archive of a run (the SHA-256 of its "
               "manifest.json) and when it was restored.'")


def downgrade() -> None:
    op.execute("DROP TABLE run_archives")
