"""Database URLs, read with libpq's own rules and written back in one form every driver reads
alike; no secret in anything shown or stored.

libpq's parser (psycopg2's `parse_dsn`) decides what is the password: `postgresql://u:p@h/db`,
`?password=` and `?sslpassword=`, a space or a percent-encoded `/` or `@` in it. `canonical`
writes the parsed URL back with every part percent-encoded, so SQLAlchemy, asyncpg and libpq
split it the same way; `redact` and `scrub` write it back without its secrets. Nothing here
imports SQLAlchemy, so the quick commands stay quick.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import quote

DB_URL_ENV = "RESERVOIR_DB_URL"
DEFAULT_DATA_DIR = ".reservoir/pg"  # the embedded server's data, under the working directory
OWNER_ROLE = "reservoir_owner"
OWNER_PASSWORD_ENV = "RESERVOIR_OWNER_PASSWORD"
READER_ROLE = "reservoir_reader"
READER_URL_ENV = "RESERVOIR_READER_URL"
READER_PASSWORD_ENV = "RESERVOIR_READER_PASSWORD"
SECRET_KEYS = ("password", "sslpassword")
UNREADABLE = "<a database URL libpq cannot read>"
# In free text (a driver's message): from a URL's user info or a secret option to the end of
# the line's last '@' or the option's value; more than the secret when in doubt, never less.
_SECRET_IN_TEXT = (re.compile(r"(?P<head>postgres(?:ql)?(?:\+\w+)?://[^\s:/@?]*:)[^\n]*@"),
                   re.compile(r"(?P<head>(?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&]*)",
                              re.IGNORECASE))


class UrlError(ValueError):
    """Not a URL libpq can read; the message never repeats the URL (it may hold a secret)."""


def parse(url: str) -> dict[str, str]:
    """The URL's connection options as libpq reads them (user, password, host, dbname ...)."""
    from psycopg2 import ProgrammingError
    from psycopg2.extensions import parse_dsn

    if not isinstance(url, str) or not url.startswith(("postgresql://", "postgres://")) \
            or "\x00" in url:
        raise UrlError("not a PostgreSQL URL (postgresql://user@host:5432/database)")
    try:
        return parse_dsn(url)
    except ProgrammingError:
        raise UrlError("not a PostgreSQL URL libpq can read (percent-encode a '/', '@', ':' or "
                       "'?' in a user name or password)") from None


def render(options: dict[str, str], *, secrets: str = "keep") -> str:
    """A URL of libpq options: the password in the user info and the rest percent-encoded;
    `secrets` "keep" them, "hide" them as ***, or "drop" them."""
    options = dict(options)
    password = options.pop("password", None)
    user, host = options.pop("user", None), options.pop("host", None)
    port, database = options.pop("port", None), options.pop("dbname", None)
    login = quote(user, safe="") if user else ""
    if password is not None and secrets != "drop":
        login += ":" + ("***" if secrets == "hide" else quote(password, safe=""))
    if secrets != "keep":
        options = {key: ("***" if secrets == "hide" else None) if key in SECRET_KEYS else value
                   for key, value in options.items()}
    netloc = f"{login}@" if login else ""
    if host and "," not in host and not host.startswith("/"):
        netloc += f"[{host}]" if ":" in host else quote(host, safe="")
        if port and "," not in port:
            netloc += f":{port}"
            port = None
        host = None
    query = {"host": host, "port": port, **options}
    tail = "&".join(f"{quote(key, safe='')}={value if value == '***' else quote(value, safe='')}"
                    for key, value in query.items() if value is not None)
    return f"postgresql://{netloc}/{quote(database or '', safe='')}" + (f"?{tail}" if tail else "")


def canonical(url: str) -> str:
    """The same URL written so that every driver reads it as libpq does."""
    return render(parse(url))


def redact(url: str) -> str:
    """The URL with its secrets shown as ***: safe to print or log."""
    try:
        return render(parse(url), secrets="hide")
    except UrlError:
        return UNREADABLE


def redact_text(text: str) -> str:
    """Free text (an error message) with anything that may be a URL's secret shown as ***."""
    for pattern in _SECRET_IN_TEXT:
        text = pattern.sub(lambda m: m.group("head") + "***" + ("@" if "://" in m.group("head")
                                                                else ""), text)
    return text


def scrub(value: Any) -> Any:
    """A JSON-like value with the secrets of every database URL in it removed: what a stored
    config or pipeline spec may hold. A string that only looks like one loses what could be."""
    if isinstance(value, str):
        if not value.startswith(("postgresql://", "postgres://")):
            return value
        try:
            return render(parse(value), secrets="drop")
        except UrlError:
            return redact_text(value)
    if isinstance(value, dict):
        return {key: scrub(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(item) for item in value]
    return value


def server_key(url: str) -> str:
    """The server and database a URL reaches, as host:port/database: no login, no secret (how
    run_servers names a server, and how rows from several servers are labelled)."""
    options = parse(url)
    host = options.get("host") or "localhost"
    return f"{host}:{options.get('port') or 5432}/{options.get('dbname') or options.get('user')}"


def with_user(url: str, user: str, password: str | None = None) -> str:
    """The same server, database and options as `url`, logged in as `user`."""
    options = {key: value for key, value in parse(url).items() if key not in SECRET_KEYS}
    options["user"] = user
    if password:
        options["password"] = password
    return render(options)


def from_env(name: str = DB_URL_ENV) -> str | None:
    """The URL in an environment variable, canonical; None when unset or empty."""
    from reservoir.errors import ConfigError

    value = os.environ.get(name)
    try:
        return canonical(value) if value else None
    except UrlError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def with_database(url: str, database: str) -> str:
    """The same server, login and options as `url`, in another database."""
    return render({**parse(url), "dbname": database})


def reader_url(store_url: str, configured: str | None = None) -> str:
    """The reader's own login: `configured` (store.reader_url) or RESERVOIR_READER_URL, else
    the store's server and database as reservoir_reader, with RESERVOIR_READER_PASSWORD."""
    explicit = configured or from_env(READER_URL_ENV)
    if explicit:
        return explicit
    return with_user(store_url, READER_ROLE, os.environ.get(READER_PASSWORD_ENV) or None)


def user_of(url: str) -> str | None:
    try:
        return parse(url).get("user")
    except UrlError:
        return None
