"""SQL a person typed: read as PostgreSQL reads it, bound, and run as exactly one statement.

`reservoir sql` and a pipeline's `source.where` hand their text to this module, and nothing
else does. The guarantees come from the server, not from inspecting the text:

- the statement goes through the extended protocol (asyncpg prepares it), which refuses a
  second statement: `COMMIT; DROP TABLE t` is an error, not two commands;
- values are bound parameters: `:name` in the text becomes `$n` (PostgreSQL's `::type` cast
  idiom, `:x::int`, works), and the value is converted to the type the server infers;
- unless writes are asked for, it runs in a READ ONLY transaction that is always rolled back,
  so nothing it did survives (large objects, notifications and session settings included) and
  only the kinds of statement that read (SELECT, WITH, VALUES, TABLE, SHOW, EXPLAIN) are taken;
- a statement timeout bounds it.

The scanner below is a friendly early error, not the guard: it reads the text with
PostgreSQL's own lexical rules (scan.l: comments end at a carriage return too, identifiers take
any non-ASCII character and `$`, nested block comments, E'' and continued strings, dollar tags,
backslashes by standard_conforming_strings) to find `:name` placeholders, parentheses and the
first keyword; the tests compare its reading with the server's.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import uuid
from dataclasses import dataclass
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

from reservoir.errors import UserSQLError
from reservoir.sqltext import bind_names, check_expression, first_keyword

READ_KINDS = ("select", "with", "values", "table", "show", "explain")
# The statement timeout, and whether the login holds rights no user SQL may run with.
TIMEOUT_AND_LOGIN = """
SELECT set_config('statement_timeout', $1, true), current_user::text, r.rolsuper OR EXISTS (
         SELECT FROM unnest(ARRAY['pg_execute_server_program', 'pg_read_server_files',
                                  'pg_write_server_files', 'pg_signal_backend']) granted
         WHERE pg_has_role(current_user, granted, 'MEMBER'))
FROM pg_roles r WHERE r.rolname = current_user
"""
DEFAULT_TIMEOUT_S = 30.0
# -- parameter values, converted to the types the server inferred -----------------------------

def _boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "t", "yes", "y", "on", "1"):
        return True
    if lowered in ("false", "f", "no", "n", "off", "0"):
        return False
    raise ValueError("not a boolean (true or false)")


def _timestamp(aware: bool):
    def parse(value: str) -> dt.datetime:
        parsed = dt.datetime.fromisoformat(value.strip())
        if aware and parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        return parsed
    return parse


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        json.loads(value)  # must be JSON text already
        return value
    return json.dumps(value, allow_nan=False)


CONVERTERS = {
    "int2": int, "int4": int, "int8": int, "oid": int,
    "float4": float, "float8": float, "numeric": decimal.Decimal,
    "bool": _boolean, "uuid": uuid.UUID, "date": dt.date.fromisoformat,
    "timestamp": _timestamp(False), "timestamptz": _timestamp(True),
    "text": str, "varchar": str, "bpchar": str, "name": str, "unknown": str,
    "json": _json_text, "jsonb": _json_text,
}
NUMBERS = {int: (int,), float: (int, float), decimal.Decimal: (int, float)}
PLAIN_NAMES = {"int2": "integer", "int4": "integer", "int8": "integer", "oid": "integer",
               "float4": "number", "float8": "number", "numeric": "number", "bool": "boolean",
               "uuid": "UUID", "date": "ISO date", "timestamp": "ISO date and time",
               "timestamptz": "ISO date and time", "json": "JSON text", "jsonb": "JSON text"}


def convert(name: str, value: Any, type_name: str, kind: str) -> Any:
    """A value of the Python type asyncpg encodes for `type_name`; UserSQLError otherwise.

    Text (from `-p name=value`) is parsed; typed values (from a pipeline's YAML params) must
    already fit: an integer for a float is fine, a float or a boolean for an integer is not."""
    if value is None:
        return None
    try:
        if kind == "array":
            items = json.loads(value) if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise ValueError("not a list (write it as JSON, e.g. [1, 2])")
            element = type_name.removesuffix("[]").removeprefix("_")
            return [convert(name, item, element, "scalar") for item in items]
        converter = CONVERTERS.get(type_name)
        if converter is None:
            raise ValueError(f"no conversion to {type_name}; cast it in the SQL, e.g. "
                             f":{name}::text::{type_name}")
        if isinstance(value, str) or converter is _json_text:
            try:
                return converter(value)
            except (ValueError, TypeError, ArithmeticError):
                raise ValueError(f"not a valid {PLAIN_NAMES.get(type_name, type_name)}") from None
        if isinstance(value, bool):
            if converter is _boolean:
                return value
        elif type(value) in NUMBERS.get(converter, ()):
            return converter(value)
        raise ValueError(f"a {type(value).__name__} where {type_name} is needed")
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise UserSQLError(f"parameter :{name} = {value!r}: {exc} (the statement needs "
                           f"{type_name}); nothing was run") from None


@dataclass(frozen=True)
class Result:
    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]]
    status: str  # the server's command tag, e.g. "SELECT 3" or "UPDATE 5"
    more: int = 0  # rows the statement gave past `max_rows`, counted and not kept

    @property
    def rowcount(self) -> int:
        tail = self.status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else len(self.rows)


@asynccontextmanager
async def transaction(conn, *, write: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                      isolation: str = "read_committed") -> AsyncIterator[None]:
    """A transaction for user SQL on an asyncpg connection: READ ONLY and always rolled back
    unless `write`; every statement in it is cut off after `timeout_s`."""
    tx = conn.transaction(readonly=not write, isolation=isolation)
    await tx.start()
    try:
        if write:  # explicit: a login whose default is read-only (the reader) meets its privileges
            await conn.execute("SET TRANSACTION READ WRITE")
        _, user, privileged = await conn.fetchrow(TIMEOUT_AND_LOGIN,
                                               str(max(1, int(timeout_s * 1000))))
        if privileged:
            raise UserSQLError(f"the login {user} is a superuser or may run programs, read or "
                               "write the server's files or signal other sessions: SQL a "
                               "person wrote never runs as it (log in as the store's owner or "
                               "the reader); nothing was run")
        yield
    except BaseException:
        await tx.rollback()
        raise
    if write:
        await tx.commit()
    else:
        await tx.rollback()


Sink = Callable[[list[str], list[tuple]], None]  # (columns, a batch of rows) as they come
STREAM_BATCH = 1000  # rows a cursor fetches at a time


async def fetch(conn, sql: str, values: dict[str, Any] | None = None, *, write: bool = False,
                template: str = "{sql}", fixed: Sequence[Any] = (), max_rows: int | None = None,
                sink: Sink | None = None) -> Result:
    """Prepare and run one statement inside `transaction`. With a `template` (trusted SQL
    whose `{sql}` the user's text fills), `fixed` are the values of the template's own
    $1..$k, and the user's :names are numbered after them. With `max_rows` or a `sink`, rows
    stream through a cursor: the first `max_rows` are kept and the rest only counted, or every
    batch goes to the sink (never all of them in memory)."""
    first = len(fixed) + 1
    standard = conn.get_settings().standard_conforming_strings == "on"
    if template != "{sql}":  # read with the server's own setting, whatever a check said before
        check_expression(sql, "the expression", standard_strings=standard)
    bound = bind_names(sql, first=first, standard_strings=standard)
    kind = (first_keyword(sql, standard_strings=standard) if template == "{sql}"
            else template.split(None, 1)[0].lower())
    sql = template.format(sql=bound.sql)
    values = values or {}
    missing = [name for name in bound.names if name not in values]
    if missing:
        raise UserSQLError(f"the statement uses :{missing[0]} but no value was given "
                           f"(-p {missing[0]}=VALUE); nothing was run")
    if not kind:
        raise UserSQLError("the statement is empty; nothing was run")
    if kind == "copy":
        raise UserSQLError("COPY is not run here: --format csv exports a query's rows")
    if not write and kind not in READ_KINDS:
        raise UserSQLError(f"{kind.upper()} is not a query: without --write only "
                           f"{', '.join(k.upper() for k in READ_KINDS)} run")
    import asyncpg

    try:
        statement = await conn.prepare(sql)
        parameters = statement.get_parameters()[len(fixed):]
        args = [convert(name, values[name], parameter.name, parameter.kind)
                for name, parameter in zip(bound.names, parameters)]
        attributes = statement.get_attributes()
        columns = [a.name for a in attributes]
        if attributes and (max_rows is not None or sink is not None):
            rows, more = await _stream(statement, [*fixed, *args], columns, max_rows, sink)
            status = f"SELECT {len(rows) + more}"
        else:
            rows = [tuple(record) for record in await statement.fetch(*fixed, *args)]
            status, more = statement.get_statusmsg(), 0
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise UserSQLError(f"SQL failed: {_named(describe(exc), bound.names, first)}; "
                           "nothing was changed") from None
    return Result(columns, [a.type.name for a in attributes], rows, status, more)


async def _stream(statement, args: list, columns: list[str], max_rows: int | None,
                  sink: Sink | None) -> tuple[list[tuple], int]:
    """(rows kept, rows past max_rows or handed to the sink) of a statement's cursor."""
    kept: list[tuple] = []
    batch: list[tuple] = []
    passed = 0
    async for record in statement.cursor(*args, prefetch=STREAM_BATCH):
        if sink is None and (max_rows is None or len(kept) < max_rows):
            kept.append(tuple(record))
            continue
        passed += 1
        if sink is not None:
            batch.append(tuple(record))
            if len(batch) == STREAM_BATCH:
                sink(columns, batch)
                batch = []
    if sink is not None:
        sink(columns, batch)
    return kept, passed


async def run(conn, sql: str, values: dict[str, Any] | None = None, *, write: bool = False,
              timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int | None = None,
              sink: Sink | None = None) -> Result:
    """One statement in its own transaction (see the module's rules and `fetch`)."""
    async with transaction(conn, write=write, timeout_s=timeout_s):
        return await fetch(conn, sql, values, write=write, max_rows=max_rows, sink=sink)


def _named(message: str, names: Sequence[str], first: int) -> str:
    """Server messages say $2 where the person wrote :name."""
    return re.sub(r"\$(\d+)", lambda m: (f":{names[int(m.group(1)) - first]}"
                                         if 0 <= int(m.group(1)) - first < len(names)
                                         else m.group(0)), message)


def describe(exc: BaseException) -> str:
    """One line for a server error: its message, and the hint PostgreSQL gave."""
    text = str(exc).strip()
    message = text.splitlines()[0] if text else type(exc).__name__
    hint = getattr(exc, "hint", None)
    return f"{message} (hint: {hint})" if hint else message
