"""Hostile SQL, hundreds of strings: user SQL (as the store's user without --write, and as the
reader even with --write) and pipeline `where` clauses. Whatever each one does, afterwards the
database is exactly as before, and nothing the reader ran gave back a base table's data."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path

import psycopg2
import pytest

from reservoir.errors import ReservoirError
from reservoir.store import direct, usersql
from reservoir.store.inspect import run_sql
from reservoir.plan.urls import READER_ROLE, with_user
from reservoir.store.source import Source, select_rows
from tests.commands import scalar
from tests.factories import fill

SECRET = "secret-8d1a"  # only in public.t, a base table no view shows
MARKER = Path(f"/tmp/reservoir-fuzz-{uuid.uuid4().hex}")  # a program the server ran would make it

LEADERS = ["", "SELECT 1", "COMMIT", "ROLLBACK", "END", "BEGIN", "ABORT", "SAVEPOINT s",
           "SET TRANSACTION READ WRITE", "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
           "RESET ROLE", "SET ROLE postgres", "SELECT 1 /* */", "SELECT ';'", "SELECT $$;$$",
           "SELECT 1 --"]
PAYLOADS = [
    "DROP TABLE t", "CREATE TABLE public.probe(x int)", "DELETE FROM experiences",
    "UPDATE experiences SET status = 'ready'", "INSERT INTO runs (name) VALUES ('evil')",
    "TRUNCATE batch_items", "SELECT lo_from_bytea(0, 'x')", "SELECT lo_create(0)",
    "SELECT setval('experience_data_id_seq', 1)", "CREATE TEMP TABLE tt(x int)",
    "SELECT pg_notify('reservoir_policy', '1:9')",
    "SELECT set_config('role', session_user, false), (SELECT x FROM public.t)",
    "SELECT query_to_xml('SELECT x FROM public.t', true, false, '')",
    "SELECT * FROM public.t", "TABLE public.t", "COPY public.t TO STDOUT",
    "COPY (SELECT 1) TO PROGRAM 'true'", "DO $$ BEGIN DELETE FROM public.t; END $$",
    "CREATE FUNCTION public.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "ALTER TABLE runs ADD COLUMN z int", "GRANT ALL ON public.t TO PUBLIC",
    "WITH gone AS (DELETE FROM experiences RETURNING 1) SELECT count(*) FROM gone",
    "SELECT * INTO public.probe FROM runs", "EXPLAIN ANALYZE DELETE FROM public.t",
    "SELECT query_to_xml('DELETE FROM public.t RETURNING x', true, false, '')",
    "PREPARE p AS DELETE FROM public.t", "LOCK TABLE runs",
    "CREATE SCHEMA evil", "SELECT nextval('runs_id_seq')",
    # issue 28: what only a superuser or a signalling login could do
    f"COPY (SELECT 1) TO PROGRAM 'touch {MARKER}'", "SELECT pg_read_file('PG_VERSION')",
    "SELECT count(*) FROM pg_ls_dir('.')", "SELECT lo_import('/etc/hostname')",
    "SELECT pg_reload_conf()", "ALTER SYSTEM SET work_mem = '1MB'",
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
    "SELECT set_config('standard_conforming_strings', 'off', false)",
]
# issue 28: text the server reads otherwise than a careless scanner (a -- comment ends at a
# carriage return, identifiers take non-ASCII characters and $, E'' takes backslashes)
TRICKS = ["--\r{} /*\nselect */", "SELECT 1 --\r; {}", "/* /* */ */ {}",
          "SELECT E'\\'' ; {} --'", "SELECT 1 AS ×$a$; {} --$a$", "SELECT 'a'\n'b' ; {}"]
STATEMENTS = ([f"{leader}; {payload}" if leader else payload
               for leader, payload in itertools.product(LEADERS, PAYLOADS)]
              + [trick.format(payload) for trick, payload in itertools.product(TRICKS, PAYLOADS)])

WHERE_BASES = [
    "true); DROP TABLE t; SELECT * FROM experiences WHERE (true", "false) OR (true",
    "true) OR (status = 'consumed'", "true) UNION SELECT id FROM experiences WHERE (true",
    "1 = 1) --", "true --", "true /*", "true */", "'a' = 'a') OR ('a' = 'a'",
    "$$ ) OR true $$ = ''", "E'\\'' = '' ) OR (true", '")" IS NULL', "true;",
    "lo_from_bytea(0, 'x') > 0", "setval('experience_data_id_seq', 1) > 0",
    "set_config('default_transaction_read_only', 'off', false) IS NOT NULL",
    "pg_sleep(5) IS NULL", "(SELECT count(*) FROM (DELETE FROM t RETURNING 1) d) > 0",
    "id IN (SELECT id FROM experiences)", "(SELECT lo_create(0)) > 0",
    "nextval('runs_id_seq') > 0", "query_to_xml('DELETE FROM t RETURNING 1', true, false, '') IS NOT NULL",
    "true) ORDER BY id; DELETE FROM t; SELECT 1 WHERE (true", "status = 'consumed'",
    "run_id <> 0", ":x = 1", "reward >= :floor) OR (true", "(((true)))", ")(", "",
    "pg_notify('reservoir_policy', '1:9') IS NULL", "true) AND false UNION ALL SELECT 1 WHERE (true",
]
WHERE_WRAPS = ["{}", "({})", " {} ", "{}\n", "/* c */ {}", "NOT NOT ({})", "({}) OR false"]
WHERES = [wrap.format(base) for base, wrap in itertools.product(WHERE_BASES, WHERE_WRAPS)]


def fingerprint(url: str) -> str:
    """Every base table's rows, the schemas, roles, large objects and functions, hashed."""
    return scalar(url, """
        SELECT md5(concat_ws('|',
          (SELECT string_agg(r::text, ',' ORDER BY r.id) FROM runs r),
          (SELECT string_agg(concat_ws(':', id, status, reward, times_sampled), ',' ORDER BY id)
             FROM experiences),
          (SELECT string_agg(b::text, ',' ORDER BY b) FROM batch_items b),
          (SELECT string_agg(x, ',' ORDER BY x) FROM public.t),
          (SELECT string_agg(relname, ',' ORDER BY relname) FROM pg_class
             WHERE relnamespace IN (SELECT oid FROM pg_namespace
                                    WHERE nspname NOT LIKE 'pg_toast%')),
          (SELECT string_agg(nspname, ',' ORDER BY nspname) FROM pg_namespace),
          (SELECT string_agg(rolname, ',' ORDER BY rolname) FROM pg_roles),
          (SELECT count(*) FROM pg_largeobject_metadata),
          (SELECT string_agg(proname, ',' ORDER BY proname) FROM pg_proc
             WHERE pronamespace = 'public'::regnamespace),
          (SELECT last_value FROM runs_id_seq), (SELECT last_value FROM experience_data_id_seq)))""")


@pytest.fixture
def loaded(store, cli):
    store.create_run("r", group_size=4)
    store.create_run("other", group_size=4)
    fill(store, "r", 6)
    fill(store, "other", 2, start_seed=100)
    store.commit_step(store.lease("r", groups=2), step=1, policy_version=0)
    cli("sql", "--write", "CREATE TABLE public.t (x text)")
    cli("sql", "--write", f"INSERT INTO public.t VALUES ('{SECRET}')")
    return store


def owner_reads(url: str, statement: str):
    """One statement read-only as the store's owner: how a pipeline's `where` runs."""
    async def run():
        async with direct.connect(url) as conn:
            return await usersql.run(conn, statement, timeout_s=2)

    return asyncio.run(run())


@pytest.mark.slow
def test_hundreds_of_hostile_statements_change_nothing_and_leak_nothing(loaded):
    url, before = loaded.url, fingerprint(loaded.url)
    reader = with_user(url, READER_ROLE)
    worker, other_reader = psycopg2.connect(url), psycopg2.connect(reader)  # must live on
    assert len(STATEMENTS) >= 200
    refused = 0
    for statement in STATEMENTS:
        for who, attempt in (("owner", lambda: owner_reads(url, statement)),
                             ("reader", lambda: run_sql(url, statement, timeout_s=2)),
                             ("reader", lambda: run_sql(reader, statement, write=True,
                                                        timeout_s=2))):
            try:
                result = attempt()
            except ReservoirError:
                refused += 1
                continue
            if who == "reader":
                assert SECRET not in repr(result.rows), (statement, result.rows)
    assert fingerprint(url) == before
    assert not MARKER.exists()
    for survivor in (worker, other_reader):
        with survivor.cursor() as cur:
            cur.execute("SELECT 1")
        survivor.close()
    assert scalar(url, "SELECT to_regclass('public.probe') IS NULL")
    assert refused > 2 * len(STATEMENTS)  # as the reader, all but a few plain SELECTs fail


@pytest.mark.slow
def test_hundreds_of_hostile_where_clauses_select_only_their_run_and_statuses(loaded):
    url, before = loaded.url, fingerprint(loaded.url)
    run_id = scalar(url, "SELECT id FROM runs WHERE name = 'r'")
    ready = {row for row in scalar(url, "SELECT array_agg(id) FROM experiences "
                                        "WHERE run_id = (SELECT id FROM runs WHERE name = 'r') "
                                        "AND status = 'ready'")}
    assert len(WHERES) >= 200
    for where in WHERES:
        source = Source(run_ids=[run_id], statuses=["ready"], where=where,
                        params={"x": "1); DROP TABLE t; --", "floor": 0}, timeout_s=0.5)
        try:
            rows = select_rows(url, source)
        except ReservoirError:
            continue
        assert {row["id"] for row in rows} <= ready, where
    assert fingerprint(url) == before


# -- issue 28: the scanner reads text as the server does ------------------------------------

ATOMS = ["true", "x = 1", "'(' = '('", "E'\\\\'(' <> ''", "$a$)$a$ <> ''", "$$--$$ <> ''",
         '"x" = 1', "x = 1 -- c\n", "x = 1 --\r", "/* ) */ true", "/* /* ) */ */ true",
         "U&'\\0041' = 'A'", "'a'\n'b' = 'ab'", "B'01' <> B'10'", "X'1F' <> X'1E'",
         "(x = 1)", "'x' || 'y' = 'xy'", "x = 1 /* -- */", "'--' = '--'", "'$a$' <> ''",
         "E'\\\\\\\\' = E'\\\\\\\\'", "x ×$a$", "é = 1", "1 = 1 --\r\n", "'it''s' <> ''"]
TAILS = [" ) OR (true", "\n) OR (true", "\r) OR (true", " /* ) */ OR true"]


def scanner_refuses(text: str) -> bool:
    """Whether the scanner finds a ')' that closes a parenthesis the text did not open."""
    try:
        usersql.check_expression(text, "where")
    except usersql.UserSQLError as exc:
        return "closes a parenthesis" in str(exc)
    return False


def test_the_scanner_reads_a_where_as_the_server_does(loaded):
    """For texts made of tricky pieces (a -- comment ended by a carriage return, E'' strings,
    dollar quotes, a name with a non-ASCII letter before a $, continued strings, nested
    comments), each followed by a ') OR (true' that is code to PostgreSQL or not: the scanner
    refuses the text exactly when the server, given it inside `WHERE false AND (...)`, escapes
    the parenthesis (returns the row). On main `--\\r` and `×$a$` disagreed."""
    import random

    rng = random.Random(28)
    texts = [" AND ".join(rng.sample(ATOMS, rng.randint(1, 3))) + tail
             for _ in range(150) for tail in [rng.choice(TAILS)]]
    texts += [atom + tail for atom in ATOMS for tail in TAILS]

    async def compare():
        compared, disagreements = 0, []
        async with direct.connect(with_user(loaded.url, READER_ROLE)) as conn:
            for text in texts:
                try:
                    async with conn.transaction(readonly=True):
                        escaped = await conn.fetchval(
                            f"SELECT count(*) FROM (VALUES (1)) v(x) WHERE false AND (\n{text}\n)")
                except Exception:
                    continue  # not SQL the server reads: nothing to compare
                compared += 1
                if scanner_refuses(text) != bool(escaped):
                    disagreements.append(text)
        return compared, disagreements

    compared, disagreements = asyncio.run(compare())
    assert compared >= 150 and disagreements == [], (compared, disagreements[:5])
