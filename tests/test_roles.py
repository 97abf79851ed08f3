"""The store's logins (issue 28): on the embedded default the superuser only makes the roles and
the database; Reservoir's work and the SQL people write run as reservoir_owner or as the reader.

Always the embedded server in a data directory of its own, whatever RESERVOIR_TEST_DB_URL says.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import psycopg2

import pytest
from reservoir.store import server
from reservoir.plan.urls import OWNER_ROLE, READER_ROLE
from tests.commands import RESERVOIR, execute


def embedded(embedded_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`reservoir ...` on the embedded default of `embedded_dir` (no URL configured)."""
    config = embedded_dir.parent / "store.yaml"
    config.write_text(f"store: {{data_dir: {embedded_dir}}}\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("RESERVOIR_")}
    return subprocess.run([str(RESERVOIR), *args, "-c", str(config)], env=env, cwd=embedded_dir.parent,
                          capture_output=True, text=True, timeout=180)


def logins(embedded_dir: Path) -> list[tuple[str, str]]:
    """(user, database) of every connection the server authorized, from its log."""
    text = (embedded_dir / "log").read_text(errors="replace")
    return re.findall(r"connection authorized: user=(\S+) database=(\S+)", text)


@pytest.mark.slow
@pytest.mark.process
def test_no_session_of_the_embedded_default_but_role_making_is_a_superuser(embedded_dir):
    url = server.start(embedded_dir)
    assert f"//{OWNER_ROLE}@" in url
    execute(server.admin_url(embedded_dir), "ALTER SYSTEM SET log_connections = 'on'",
            "SELECT pg_reload_conf()")
    before = len(logins(embedded_dir))
    steps = [("demo", "store", "--groups", "8", "--group-size", "2", "--steps", "1",
              "--groups-per-step", "2", "--raw-groups", "2"),
             ("sql", "SELECT rolsuper FROM pg_roles WHERE rolname = current_user", "-f", "csv"),
             ("sql", "--write", "SELECT rolsuper FROM pg_roles WHERE rolname = current_user",
              "-f", "csv"),
             ("inspect", "run", "quickstart"), ("db", "upgrade"), ("db", "status")]
    for args in steps:
        result = embedded(embedded_dir, *args)
        assert result.returncode == 0, (args, result.stderr)
        if args[0] == "sql":
            assert result.stdout.splitlines()[1:] == ["False"], result.stdout
    sessions = logins(embedded_dir)[before:]
    assert {user for user, _ in sessions} == {OWNER_ROLE, READER_ROLE}, sessions
    conn = psycopg2.connect(server.admin_url(embedded_dir))
    with conn.cursor() as cur:
        cur.execute("SELECT rolname FROM pg_roles WHERE rolname IN (%s, %s) AND (rolsuper OR "
                    "rolcreaterole OR rolcreatedb OR rolreplication OR rolbypassrls)",
                    (OWNER_ROLE, READER_ROLE))
        assert cur.fetchall() == []
        cur.execute("SELECT count(*) FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member "
                    "WHERE r.rolname IN (%s, %s)", (OWNER_ROLE, READER_ROLE))
        assert cur.fetchone()[0] == 0
    conn.close()


def test_a_store_an_older_reservoir_made_is_handed_to_the_owner(embedded_dir):
    """Before issue 28 the embedded store's objects were the superuser's: at the next start
    they pass to reservoir_owner, and the store works on."""
    server.start(embedded_dir)
    admin = server.admin_url(embedded_dir).replace("/postgres?", "/reservoir?")
    execute(admin, "CREATE SCHEMA analytics", "CREATE TABLE runs (id bigint PRIMARY KEY)",
            "CREATE VIEW analytics.runs AS SELECT id FROM runs",
            "CREATE FUNCTION public.f() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    (embedded_dir / server.ROLES_MADE).unlink()  # as an older Reservoir left it
    url = server.start(embedded_dir)
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class "
                    "WHERE relname IN ('runs') UNION SELECT pg_get_userbyid(nspowner) "
                    "FROM pg_namespace WHERE nspname = 'analytics' UNION SELECT "
                    "pg_get_userbyid(proowner) FROM pg_proc WHERE proname = 'f'")
        assert cur.fetchall() == [(OWNER_ROLE,)]
        cur.execute("ALTER TABLE runs ADD COLUMN name text")  # the owner's to change
    conn.close()
