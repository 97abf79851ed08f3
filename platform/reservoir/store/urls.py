"""Database URLs without secrets: redacted for display, scrubbed before they are stored, and
the reader's URL derived from the store's.

Plain string work with urllib (no SQLAlchemy), so the quick commands stay quick.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

DB_URL_ENV = "RESERVOIR_DB_URL"
DEFAULT_DATA_DIR = ".reservoir/pg"  # the embedded server's data, under the working directory
READER_ROLE = "reservoir_reader"
READER_URL_ENV = "RESERVOIR_READER_URL"
READER_PASSWORD_ENV = "RESERVOIR_READER_PASSWORD"
# scheme://user:password@host : the password part of any URL inside a longer text
_PASSWORD_IN_URL = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<secret>[^@\s/]*)@")


def redact(url: str) -> str:
    """The URL with its password shown as ***: safe to print or log."""
    return _PASSWORD_IN_URL.sub(lambda m: m.group("head") + "***@", url)


def scrub(value: Any) -> Any:
    """A JSON-like value with every password in a URL removed (user:password@ -> user@):
    what a stored config or pipeline spec may hold."""
    if isinstance(value, str):
        return _PASSWORD_IN_URL.sub(lambda m: m.group("head")[:-1] + "@", value)
    if isinstance(value, dict):
        return {key: scrub(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(item) for item in value]
    return value


def with_user(url: str, user: str, password: str | None = None) -> str:
    """The same server and database as `url`, logged in as `user`."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    login = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    return urlunsplit(parts._replace(netloc=f"{login}@{host}"))


def reader_url(store_url: str, configured: str | None = None) -> str:
    """The reader's own login: `configured` (store.reader_url) or RESERVOIR_READER_URL, else
    the store's server and database as reservoir_reader, with RESERVOIR_READER_PASSWORD."""
    explicit = configured or os.environ.get(READER_URL_ENV)
    if explicit:
        return explicit
    return with_user(store_url, READER_ROLE, os.environ.get(READER_PASSWORD_ENV) or None)


def user_of(url: str) -> str | None:
    login = urlsplit(url).netloc.rpartition("@")[0]
    return login.partition(":")[0] or None
