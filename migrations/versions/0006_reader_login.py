"""reader: reservoir_reader becomes a login role that can read the views and write nothing

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30

The reader connects as itself (never a role switch on a privileged session). It already has
SELECT on the analytics views and nothing on the base tables; this revision takes away what
every role gets through PUBLIC and could write with: temporary tables in this database,
creating objects in the public schema (PostgreSQL 14 still grants it), and creating large
objects (lo_create, lo_creat, lo_from_bytea, which even a READ ONLY transaction allows). The
role's defaults bound its sessions: read-only transactions, a statement timeout, an idle-in-
transaction timeout, a connection limit.

Stored run configs lose the passwords in their URLs (the reader can read runs.config).

Note: CREATE DATABASE ... TEMPLATE does not copy a database's own privileges (TEMP), only
its contents; a copy needs `REVOKE TEMP ON DATABASE <copy> FROM PUBLIC` again.
"""

import json
import re

from alembic import op
import sqlalchemy as sa

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

LARGE_OBJECT_CREATORS = "lo_create(oid), lo_creat(integer), lo_from_bytea(oid, bytea)"
PASSWORD_IN_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):[^@\s/]*@")

# A reader that `reservoir.store.roles.bootstrap` made (the superuser, before this owner's
# first upgrade) is in this shape already: then nothing here needs CREATEROLE.
UPGRADE = f"""
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'reservoir_reader' AND rolcanlogin
                 AND NOT rolinherit AND rolconnlimit = 32)
     OR NOT coalesce((SELECT setconfig @> ARRAY['default_transaction_read_only=on',
                             'statement_timeout=30s', 'idle_in_transaction_session_timeout=60s']
                      FROM pg_db_role_setting WHERE setdatabase = 0
                      AND setrole = 'reservoir_reader'::regrole), false) THEN
    ALTER ROLE reservoir_reader WITH LOGIN NOINHERIT CONNECTION LIMIT 32;
    ALTER ROLE reservoir_reader SET default_transaction_read_only = on;
    ALTER ROLE reservoir_reader SET statement_timeout = '30s';
    ALTER ROLE reservoir_reader SET idle_in_transaction_session_timeout = '60s';
  END IF;
END $$;
DO $$ BEGIN  -- each only while the reader has it: a role without it may not revoke it at all
  IF has_database_privilege('reservoir_reader', current_database(), 'TEMPORARY') THEN
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
  END IF;
  IF has_schema_privilege('reservoir_reader', 'public', 'CREATE') THEN
    REVOKE CREATE ON SCHEMA public FROM PUBLIC;
  END IF;
  IF has_function_privilege('reservoir_reader', 'lo_from_bytea(oid, bytea)', 'EXECUTE') THEN
    BEGIN  -- a role with no right on them is refused outright: CHECK below says what to do
      REVOKE EXECUTE ON FUNCTION {LARGE_OBJECT_CREATORS} FROM PUBLIC;
    EXCEPTION WHEN insufficient_privilege THEN NULL;
    END;
  END IF;
END $$;
"""

# A role that does not own the large-object functions (any role but a superuser) gets only a
# warning from REVOKE: check what the reader can do, and stop with the fix if it can write.
CHECK = f"""
DO $$ BEGIN
  IF has_function_privilege('reservoir_reader', 'lo_from_bytea(oid, bytea)', 'EXECUTE')
     OR has_database_privilege('reservoir_reader', current_database(), 'TEMPORARY')
     OR has_schema_privilege('reservoir_reader', 'public', 'CREATE') THEN
    RAISE EXCEPTION 'reservoir_reader could still write (large objects, temporary tables or '
      'the public schema): this role may not revoke that from PUBLIC. Have a superuser run '
      'once: REVOKE EXECUTE ON FUNCTION {LARGE_OBJECT_CREATORS} FROM PUBLIC; REVOKE '
      'TEMPORARY ON DATABASE % FROM PUBLIC; REVOKE CREATE ON SCHEMA public FROM PUBLIC; then '
      'run `reservoir db upgrade` again', current_database();
  END IF;
END $$;
"""

# The role is the cluster's, shared by every Reservoir database on the server: downgrading one
# database gives back this database's privileges and leaves the login as it is (revision 0002's
# downgrade drops the role once no database uses it).
# What this role may give back: the superuser's own revokes (`roles.bootstrap`) stay.
DOWNGRADE = f"""
DO $$ BEGIN
  GRANT EXECUTE ON FUNCTION {LARGE_OBJECT_CREATORS} TO PUBLIC;
EXCEPTION WHEN insufficient_privilege THEN NULL;
END $$;
DO $$ BEGIN
  EXECUTE format('GRANT TEMPORARY ON DATABASE %I TO PUBLIC', current_database());
  IF current_setting('server_version_num')::int < 150000 THEN
    GRANT CREATE ON SCHEMA public TO PUBLIC;
  END IF;
EXCEPTION WHEN insufficient_privilege THEN NULL;
END $$;
"""


def _scrub(value):
    if isinstance(value, str):
        return PASSWORD_IN_URL.sub(r"\1@", value)
    if isinstance(value, dict):
        return {key: _scrub(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_scrub(item) for item in value]
    return value


def upgrade() -> None:
    op.execute(UPGRADE)
    op.execute(CHECK)
    conn = op.get_bind()
    for run_id, config in conn.execute(sa.text("SELECT id, config FROM runs")).all():
        clean = _scrub(config)
        if clean != config:
            conn.execute(sa.text("UPDATE runs SET config = CAST(:config AS jsonb) WHERE id = :id"),
                         {"config": json.dumps(clean), "id": run_id})


def downgrade() -> None:
    op.execute(DOWNGRADE)
