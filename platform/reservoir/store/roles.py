"""The reader's login: its password, set as a SCRAM-SHA-256 verifier computed here, so the
password itself never reaches the server, its logs or pg_stat_activity."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re

from sqlalchemy import Engine

from reservoir.store.urls import READER_ROLE

ITERATIONS = 4096  # PostgreSQL's default scram_iterations
_VERIFIER = re.compile(r"SCRAM-SHA-256\$\d+:[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+:[A-Za-z0-9+/=]+")


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


def set_reader_password(engine: Engine, password: str) -> None:
    verifier = scram_verifier(password)
    if not _VERIFIER.fullmatch(verifier):  # only base64, digits and separators reach the SQL
        raise ValueError("unexpected SCRAM verifier shape")
    with engine.begin() as conn:  # driver SQL: text() would read ':ServerKey' as a parameter
        conn.exec_driver_sql(f"ALTER ROLE {READER_ROLE} PASSWORD '{verifier}'")
