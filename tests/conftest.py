"""Test fixtures: a real PostgreSQL, one template database built from the migrations, and a
fresh copy of it per test (CREATE DATABASE ... TEMPLATE), as procrastinate does.

By default the embedded server (started in a temporary directory for the session);
RESERVOIR_TEST_DB_URL selects a server, e.g. postgresql://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import psycopg2
import pytest
from sqlalchemy.engine import make_url

from reservoir.config import SamplerConfig
from reservoir.store import Store, migrate, server
from reservoir.store.engine import sync_engine
from tests.commands import reservoir

TEST_URL_ENV = "RESERVOIR_TEST_DB_URL"


def _database_url(admin_url: str, database: str) -> str:
    return make_url(admin_url).set(database=database).render_as_string(hide_password=False)


def _admin(admin_url: str, *statements: str) -> None:
    conn = psycopg2.connect(make_url(admin_url).set(drivername="postgresql")
                            .render_as_string(hide_password=False))
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


@pytest.fixture(scope="session")
def admin_url():
    """URL of a database on the test server from which databases can be created.

    The embedded server's data lives in its own temporary directory, not under pytest's
    basetemp, which another pytest session's clean-up may delete while this one runs.
    """
    url = os.environ.get(TEST_URL_ENV)
    if url:
        yield url
        return
    root = Path(tempfile.mkdtemp(prefix="reservoir-test-pg-"))
    try:
        yield _database_url(server.start(root / "pg"), "postgres")
    finally:
        server.stop(root / "pg")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(admin_url):
    name = f"reservoir_tpl_{uuid.uuid4().hex[:8]}"
    _admin(admin_url, f'CREATE DATABASE "{name}"')
    engine = sync_engine(_database_url(admin_url, name))
    migrate.upgrade(engine)
    engine.dispose()
    yield name
    _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def new_database(admin_url):
    """A factory of empty or template-copied databases, dropped after the test."""
    created: list[str] = []

    def make(template: str | None = None) -> str:
        name = f"reservoir_t_{uuid.uuid4().hex[:10]}"
        suffix = f' TEMPLATE "{template}"' if template else ""
        _admin(admin_url, f'CREATE DATABASE "{name}"{suffix}')
        if template:  # a copy does not inherit the database privileges migration 0006 set
            _admin(admin_url, f'REVOKE TEMPORARY ON DATABASE "{name}" FROM PUBLIC')
        created.append(name)
        return _database_url(admin_url, name)

    yield make
    for name in created:
        _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_url(new_database, template_db) -> str:
    """A fresh database at the schema's head revision."""
    return new_database(template_db)


@pytest.fixture
def make_store(db_url):
    """Stores on this test's database, each with its own flow-control settings."""
    opened: list[Store] = []

    def make(**flow) -> Store:
        store = Store(db_url, SamplerConfig(**{"wait_timeout_s": 5.0, **flow}))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store) -> Store:
    return make_store()


@pytest.fixture
def cli(db_url, tmp_path):
    """`reservoir ...` on a fresh database at head; fails the test on a non-zero exit."""

    def run(*args: str) -> str:
        result = reservoir(*args, url=db_url, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return result.stdout

    run.url = db_url
    run.raw = lambda *args: reservoir(*args, url=db_url, cwd=tmp_path)
    return run
