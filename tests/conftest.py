"""Test fixtures: a real PostgreSQL, one template database built from the migrations, and a
fresh copy of it per test (CREATE DATABASE ... TEMPLATE), as procrastinate does.

By default the embedded server (started in a temporary directory for the session);
RESERVOIR_TEST_DB_URL selects a server, e.g. postgresql://postgres@127.0.0.1:5432/test. Either
way the tests meet the store as a deployment does: the superuser (`admin_url`) only makes the
roles and the databases, and every database URL a test gets logs in as reservoir_owner.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from reservoir.config import SamplerConfig
from reservoir.plan import urls
from reservoir.store import Store, migrate, roles, server
from reservoir.store.engine import sync_engine
from tests.commands import execute, reservoir

TEST_URL_ENV = "RESERVOIR_TEST_DB_URL"


def _database_url(admin_url: str, database: str) -> str:
    return make_url(admin_url).set(database=database).render_as_string(hide_password=False)


def owner_url(admin_url: str, database: str) -> str:
    """The owner's login to a database of the test server."""
    return urls.with_user(_database_url(admin_url, database), urls.OWNER_ROLE)


@pytest.fixture
def embedded_dir():
    """A data directory of its own for an embedded server, stopped and removed afterwards;
    outside pytest's basetemp: as root the server runs as user pgserver, which loses access
    when another pytest session resets that folder to mode 0700."""
    root = Path(tempfile.mkdtemp(prefix="reservoir-embedded-"))
    try:
        yield root / "pg"
    finally:
        server.stop(root / "pg")
        shutil.rmtree(root, ignore_errors=True)


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
        server.start(root / "pg")
        yield server.admin_url(root / "pg")
    finally:
        server.stop(root / "pg")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(admin_url):
    name = f"reservoir_tpl_{uuid.uuid4().hex[:8]}"
    execute(admin_url, f'CREATE DATABASE "{name}"')
    roles.bootstrap(_database_url(admin_url, name))
    engine = sync_engine(owner_url(admin_url, name))
    migrate.upgrade(engine)
    engine.dispose()
    yield name
    execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def new_database(admin_url):
    """A factory of empty or template-copied databases, dropped after the test: the owner's
    URL of each."""
    created: list[str] = []

    def make(template: str | None = None) -> str:
        name = f"reservoir_t_{uuid.uuid4().hex[:10]}"
        created.append(name)
        if not template:
            execute(admin_url, f'CREATE DATABASE "{name}"')
            roles.bootstrap(_database_url(admin_url, name))
            return owner_url(admin_url, name)
        # A copy keeps the template's objects and their rights, not the database's own.
        execute(admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"',
               f'REVOKE TEMPORARY ON DATABASE "{name}" FROM PUBLIC',
               f'GRANT CONNECT, CREATE ON DATABASE "{name}" TO {urls.OWNER_ROLE}')
        return owner_url(admin_url, name)

    yield make
    for name in created:
        execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def as_admin(admin_url):
    """The superuser's login to the database of a test's URL (for what no owner may do)."""
    return lambda url: _database_url(admin_url, make_url(url).database)


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
