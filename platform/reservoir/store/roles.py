"""The store's logins: the owner Reservoir works as, the reader people read as.

A superuser only creates them (`bootstrap`: the embedded server's at its first start, a
configured server's when its URL logs in as one) and the rights below; nothing else Reservoir
does runs as a superuser. The owner owns the schema and is given no right beyond its
database: no superuser, no CREATEROLE (on PostgreSQL 15 and older it could grant itself
pg_execute_server_program), no membership in any role. The reader logs in as itself, reads
the analytics views and nothing else. In every Reservoir database, PUBLIC loses what a login
could harm others with: temporary tables, creating in schema public, large objects, and
pg_terminate_backend / pg_cancel_backend (any login may signal its own role's sessions, so a
reader could end other readers' sessions, an owner's SQL the workers').

Passwords are sent as SCRAM-SHA-256 verifiers computed here, so a password itself never
reaches the server, its logs or pg_stat_activity.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import time

from reservoir.errors import StoreError
from reservoir.plan import urls
from reservoir.plan.urls import OWNER_ROLE, READER_ROLE

ITERATIONS = 4096  # PostgreSQL's default scram_iterations
_VERIFIER = re.compile(r"SCRAM-SHA-256\$\d+:[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+:[A-Za-z0-9+/=]+")
NO_PRIVILEGES = "NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
READER_SETTINGS = ("default_transaction_read_only=on", "statement_timeout=30s",
                   "idle_in_transaction_session_timeout=60s")
# Functions PUBLIC may not execute in a Reservoir database (see the module's docstring).
REVOKED_FUNCTIONS = ("lo_create(oid)", "lo_creat(integer)", "lo_from_bytea(oid, bytea)",
                     "pg_terminate_backend(integer, bigint)", "pg_cancel_backend(integer)")
SCHEMAS = ("public", "analytics")  # whatever Reservoir's migrations create lives in these

SERVER_ROLES = f"""
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{OWNER_ROLE}') THEN
    CREATE ROLE {OWNER_ROLE} LOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
    CREATE ROLE {READER_ROLE} LOGIN;
  END IF;
END $$;
ALTER ROLE {OWNER_ROLE} WITH LOGIN INHERIT {NO_PRIVILEGES};
ALTER ROLE {READER_ROLE} WITH LOGIN NOINHERIT CONNECTION LIMIT 32 {NO_PRIVILEGES};
{''.join(f"ALTER ROLE {READER_ROLE} SET {name} = '{value}';"
         for name, value in (setting.split('=') for setting in READER_SETTINGS))}
DO $$ DECLARE granted record; BEGIN
  FOR granted IN SELECT m.roleid::regrole AS role, m.member::regrole AS member,
                        m.grantor::regrole AS grantor
                 FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member
                 WHERE r.rolname IN ('{OWNER_ROLE}', '{READER_ROLE}') LOOP
    EXECUTE format('REVOKE %s FROM %s GRANTED BY %s', granted.role, granted.member,
                   granted.grantor);
  END LOOP;
END $$;
"""

DATABASE_RIGHTS = """
REVOKE TEMPORARY ON DATABASE {database} FROM PUBLIC;
GRANT CONNECT, CREATE ON DATABASE {database} TO {owner};
"""

_IN_SCHEMAS = f"(SELECT oid FROM pg_namespace WHERE nspname IN {SCHEMAS})"
# Objects a superuser made in Reservoir's schemas (a store upgraded before the owner existed)
# pass to the owner. Sequences of a column and array types follow their table or type.
ADOPTABLE = f"""
SELECT format('ALTER %s %s OWNER TO {OWNER_ROLE}', CASE c.relkind WHEN 'v' THEN 'VIEW'
              WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
              c.oid::regclass)
FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
WHERE r.rolsuper AND c.relnamespace IN {_IN_SCHEMAS} AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
  AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                  AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
UNION ALL
SELECT format('ALTER ROUTINE %s OWNER TO {OWNER_ROLE}', p.oid::regprocedure)
FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner
WHERE r.rolsuper AND p.pronamespace IN {_IN_SCHEMAS}
UNION ALL
SELECT format('ALTER TYPE %s OWNER TO {OWNER_ROLE}', t.oid::regtype)
FROM pg_type t JOIN pg_roles r ON r.oid = t.typowner
WHERE r.rolsuper AND t.typnamespace IN {_IN_SCHEMAS} AND t.typtype IN ('e', 'd', 'r')
UNION ALL
SELECT format('ALTER SCHEMA %I OWNER TO {OWNER_ROLE}', n.nspname)
FROM pg_namespace n JOIN pg_roles r ON r.oid = n.nspowner
WHERE r.rolsuper AND n.nspname <> 'public' AND n.oid IN {_IN_SCHEMAS}
"""

IN_DATABASE = f"""
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO {OWNER_ROLE};
REVOKE EXECUTE ON FUNCTION {', '.join(REVOKED_FUNCTIONS)} FROM PUBLIC;
DO $$ DECLARE statement text; BEGIN
  FOR statement IN {ADOPTABLE} LOOP
    EXECUTE statement;
  END LOOP;
END $$;
"""

# Whether everything above is in place already (then bootstrap changes nothing).
IN_PLACE = f"""
SELECT (SELECT count(*) = 2 FROM pg_roles WHERE rolname IN ('{OWNER_ROLE}', '{READER_ROLE}')
          AND rolcanlogin AND NOT (rolsuper OR rolcreatedb OR rolcreaterole OR rolreplication
                                   OR rolbypassrls))
   AND (SELECT NOT rolinherit AND rolconnlimit = 32 FROM pg_roles
        WHERE rolname = '{READER_ROLE}')
   AND (SELECT coalesce(setconfig @> ARRAY{list(READER_SETTINGS)}, false) FROM pg_db_role_setting
        WHERE setrole = '{READER_ROLE}'::regrole AND setdatabase = 0)
   AND NOT EXISTS (SELECT FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member
                   WHERE r.rolname IN ('{OWNER_ROLE}', '{READER_ROLE}'))
   AND has_database_privilege('{OWNER_ROLE}', current_database(), 'CREATE')
   AND NOT has_database_privilege('{READER_ROLE}', current_database(), 'TEMPORARY')
   AND has_schema_privilege('{OWNER_ROLE}', 'public', 'CREATE')
   AND NOT has_schema_privilege('{READER_ROLE}', 'public', 'CREATE')
   AND NOT (SELECT bool_or(has_function_privilege(role, function, 'EXECUTE'))
            FROM unnest(ARRAY['{OWNER_ROLE}', '{READER_ROLE}']) role,
                 unnest(ARRAY{list(REVOKED_FUNCTIONS)}) function)
   AND NOT EXISTS ({ADOPTABLE})
"""
IS_SUPERUSER = "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
RETRIES = 3  # two first users bootstrapping at once: the second sees the first's roles


def scram_verifier(password: str, *, salt: bytes | None = None,
                   iterations: int = ITERATIONS) -> str:
    """`SCRAM-SHA-256$iterations:salt$StoredKey:ServerKey` as PostgreSQL stores it (RFC 5802)."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    encode = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return (f"SCRAM-SHA-256${iterations}:{encode(salt)}$"
            f"{encode(hashlib.sha256(client_key).digest())}:{encode(server_key)}")


def set_password(conn, role: str, password: str) -> None:
    """ALTER ROLE ... PASSWORD with the verifier (a psycopg2 connection of a role that may)."""
    verifier = scram_verifier(password)
    if role not in (OWNER_ROLE, READER_ROLE) or not _VERIFIER.fullmatch(verifier):
        raise ValueError("unexpected role or SCRAM verifier shape")  # only these reach the SQL
    with conn.cursor() as cur:
        cur.execute(f"ALTER ROLE {role} PASSWORD '{verifier}'")


def connect(url: str):
    """A psycopg2 connection (autocommit); StoreError in one line, no secret in it."""
    import psycopg2

    try:
        conn = psycopg2.connect(urls.canonical(url), connect_timeout=10)
    except (psycopg2.Error, urls.UrlError) as exc:
        message = urls.redact_text(str(exc).strip().splitlines()[0] if str(exc).strip()
                                   else type(exc).__name__)
        raise StoreError(f"cannot connect to {urls.redact(url)}: {message}") from None
    conn.autocommit = True
    return conn


def is_superuser(conn) -> bool:
    with conn.cursor() as cur:
        cur.execute(IS_SUPERUSER)
        return bool(cur.fetchone()[0])


def bootstrap(admin_url: str, *, database: str | None = None, embedded: bool = False) -> bool:
    """As the superuser of `admin_url`: the owner and reader roles, and their rights in
    `database` (default: the URL's), made where missing (with `embedded`, the database too,
    owned by the owner). True when anything had to be done."""
    import psycopg2

    database = database or urls.parse(admin_url).get("dbname")
    conn = connect(admin_url)
    try:
        if not is_superuser(conn):
            raise StoreError(f"{urls.redact(admin_url)}: only a superuser creates Reservoir's "
                             "roles; nothing was changed")
        if embedded:
            _create_database(conn, database)
    finally:
        conn.close()
    conn = connect(urls.with_database(admin_url, database))
    try:
        for attempt in range(RETRIES):
            try:
                return _bootstrap(conn, database, embedded=embedded)
            except (psycopg2.errors.DuplicateObject, psycopg2.errors.InternalError):
                if attempt == RETRIES - 1:  # "tuple concurrently updated": another first user
                    raise
                time.sleep(0.2)
    finally:
        conn.close()
    return False


def _create_database(conn, database: str) -> None:
    from psycopg2 import errors, sql

    with conn.cursor() as cur:
        cur.execute(SERVER_ROLES)
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
        if cur.fetchone() is None:
            try:
                cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(database), sql.Identifier(OWNER_ROLE)))
            except errors.DuplicateDatabase:
                pass
        # Only superusers connect to the server's own databases: the reader cannot go
        # round its database's rights from there.
        cur.execute("REVOKE CONNECT ON DATABASE postgres, template1 FROM PUBLIC")


def _bootstrap(conn, database: str, *, embedded: bool) -> bool:
    """What `bootstrap` does in the database, in one transaction (one simple query)."""
    from psycopg2 import sql

    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_roles WHERE rolname IN (%s, %s)",
                    (OWNER_ROLE, READER_ROLE))
        if cur.fetchone()[0] == 2:
            cur.execute(IN_PLACE)
            if cur.fetchone()[0]:
                return False
        rights = sql.SQL(DATABASE_RIGHTS).format(database=sql.Identifier(database),
                                                 owner=sql.Identifier(OWNER_ROLE))
        cur.execute(sql.SQL("{}{}{}").format(sql.SQL(SERVER_ROLES), rights, sql.SQL(IN_DATABASE)))
        password = os.environ.get(urls.OWNER_PASSWORD_ENV)
        if password and not embedded:
            set_password(conn, OWNER_ROLE, password)
    return True


def working_url(url: str) -> str:
    """The login Reservoir works as on a configured server: the URL's own, unless that is a
    superuser; then the roles are bootstrapped and the owner logs in to the same server and
    database (with RESERVOIR_OWNER_PASSWORD where the server asks for one)."""
    conn = connect(url)
    try:
        if not is_superuser(conn):
            return url
    finally:
        conn.close()
    bootstrap(url)
    return urls.with_user(url, OWNER_ROLE, os.environ.get(urls.OWNER_PASSWORD_ENV) or None)
