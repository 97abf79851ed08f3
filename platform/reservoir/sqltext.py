"""A person's SQL text read as PostgreSQL reads it, without a database: a lexer after the
server's scan.l (comments end at a carriage return too, identifiers take any non-ASCII character
and `$`, nested block comments, E'' and continued strings, dollar tags, backslashes by
standard_conforming_strings). It finds `:name` placeholders, parentheses and the first keyword
for `reservoir.store.usersql` and checks a config's one-expression filters; it is a friendly
early error, not the guard (the server is: see usersql), and tests compare it with the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Iterator

from reservoir.errors import UserSQLError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_WORD = re.compile(r"[A-Za-z_]+")
# scan.l's classes; every non-ASCII character is a letter to PostgreSQL (bytes \200-\377)
_LETTER = r"A-Za-z_\x80-\U0010ffff"
_DOLLAR_TAG = re.compile(rf"\$([{_LETTER}][{_LETTER}0-9]*)?\$")
_IDENTIFIER = re.compile(rf"[{_LETTER}][{_LETTER}0-9$]*")
_NUMBER = re.compile(r"0[xXoObB][0-9A-Fa-f_]+|(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)([eE][-+]?\d[\d_]*)?")
_SPACE = " \t\n\r\f\v"
# a string continues in the same kind after whitespace holding a newline (and -- comments)
_CONTINUATION = re.compile(r"[ \t\f\v]*[\n\r](?:[ \t\n\r\f\v]+|--[^\n\r]*[\n\r])*'")



@dataclass(frozen=True)
class Segment:
    kind: str  # code | string | ident | comment | param
    text: str


def scan(sql: str, *, standard_strings: bool = True) -> Iterator[Segment]:
    """Split SQL into code, string literals, quoted identifiers, comments and :name params, as
    PostgreSQL's lexer does (`standard_strings`: the server's standard_conforming_strings)."""
    i, n, code_start = 0, len(sql), 0
    while i < n:
        end, kind = _token(sql, i, standard_strings)
        if kind == "code":
            i = end
            continue
        if code_start < i:
            yield Segment("code", sql[code_start:i])
        yield Segment(kind, sql[i:end] if kind != "param" else sql[i + 1:end])
        i = code_start = end
    if code_start < n:
        yield Segment("code", sql[code_start:])


def _token(sql: str, i: int, standard_strings: bool) -> tuple[int, str]:
    """(end, kind) of the token at i: a comment, string, quoted identifier, :name or code."""
    char, two = sql[i], sql[i:i + 2]
    if two == "--":
        return _line_end(sql, i), "comment"
    if two == "/*":
        return _block_comment_end(sql, i), "comment"
    if char == "'":
        return _string_end(sql, i, backslashes=not standard_strings), "string"
    if char == '"':
        return _quoted_end(sql, i), "ident"
    if char in "eE" and sql.startswith("'", i + 1):
        return _string_end(sql, i + 1, backslashes=True), "string"
    if char in "bBxX" and sql.startswith("'", i + 1):
        return _string_end(sql, i + 1, backslashes=False, doubled=False), "string"
    if char in "nN" and sql.startswith("'", i + 1):
        return _string_end(sql, i + 1, backslashes=not standard_strings), "string"
    if char in "uU" and sql.startswith("&'", i + 1):
        return _string_end(sql, i + 2, backslashes=False), "string"
    if char in "uU" and sql.startswith('&"', i + 1):
        return _quoted_end(sql, i + 2), "ident"
    if char == "$":
        return _dollar(sql, i)
    if char == ":":
        if two in ("::", ":="):
            return i + 2, "code"
        name = _IDENT.match(sql, i + 1)
        return (name.end(), "param") if name else (i + 1, "code")
    identifier = _IDENTIFIER.match(sql, i)
    if identifier:
        return identifier.end(), "code"
    number = _NUMBER.match(sql, i)
    if number:
        if _IDENTIFIER.match(sql, number.end()):  # PostgreSQL 15+: "trailing junk"; 14 splits
            raise UserSQLError(f"a number runs into a name at {sql[i:number.end() + 1]!r}: "
                               "put a space between them; nothing was run")
        return number.end(), "code"
    return i + 1, "code"


def _dollar(sql: str, i: int) -> tuple[int, str]:
    """A dollar-quoted string (up to the next copy of its tag), else a lone `$`."""
    if i + 1 < len(sql) and sql[i + 1].isdigit():
        raise UserSQLError("positional parameters ($1) are not taken: write :name and "
                           "pass the value with -p name=value (or the pipeline's params)")
    tag = _DOLLAR_TAG.match(sql, i)
    if not tag:
        return i + 1, "code"
    close = sql.find(tag.group(0), tag.end())
    if close < 0:
        raise UserSQLError(f"unterminated dollar-quoted string {tag.group(0)}...: "
                           "nothing was run")
    return close + len(tag.group(0)), "string"


def _line_end(sql: str, i: int) -> int:
    """Where a -- comment ends: at a newline or a carriage return."""
    ends = [at for at in (sql.find("\n", i), sql.find("\r", i)) if at >= 0]
    return min(ends) if ends else len(sql)


def _string_end(sql: str, i: int, *, backslashes: bool, doubled: bool = True) -> int:
    """The end of the quoted string at i, and of any string continuing it (same kind)."""
    j = i + 1
    while j < len(sql):
        if backslashes and sql[j] == "\\":
            j += 2
            continue
        if sql[j] == "'":
            if doubled and sql.startswith("''", j):
                j += 2
                continue
            more = _CONTINUATION.match(sql, j + 1)
            if not more:
                return j + 1
            j = more.end()
            continue
        j += 1
    raise UserSQLError("unterminated string literal: nothing was run")


def _quoted_end(sql: str, i: int) -> int:
    j = i + 1
    while True:
        j = sql.find('"', j)
        if j < 0:
            raise UserSQLError("unterminated quoted identifier: nothing was run")
        if sql.startswith('""', j):
            j += 2
            continue
        return j + 1


def _block_comment_end(sql: str, i: int) -> int:
    depth, j = 0, i
    while j < len(sql):
        if sql.startswith("/*", j):
            depth, j = depth + 1, j + 2
        elif sql.startswith("*/", j):
            depth, j = depth - 1, j + 2
            if depth == 0:
                return j
        else:
            j += 1
    raise UserSQLError("unterminated /* comment: nothing was run")


@dataclass(frozen=True)
class Bound:
    """SQL with `$n` placeholders and the parameter names they stand for, in order."""

    sql: str
    names: tuple[str, ...]


def bind_names(sql: str, *, first: int = 1, standard_strings: bool = True) -> Bound:
    """Replace each :name with $n (the same name, the same n); `first` numbers the first one."""
    parts, names = [], []
    for segment in scan(sql, standard_strings=standard_strings):
        if segment.kind != "param":
            parts.append(segment.text)
            continue
        if segment.text not in names:
            names.append(segment.text)
        parts.append(f"${first + names.index(segment.text)}")
    return Bound("".join(parts), tuple(names))


def first_keyword(sql: str, *, standard_strings: bool = True) -> str:
    """The statement's first word (lower case), past comments and opening parentheses."""
    for segment in scan(sql, standard_strings=standard_strings):
        if segment.kind == "comment":
            continue
        if segment.kind != "code":
            return ""
        stripped = segment.text.lstrip(_SPACE + "(")
        if stripped:
            word = _WORD.match(stripped)
            return word.group(0).lower() if word else ""
    return ""


def check_expression(sql: str, what: str, *, standard_strings: bool = True) -> None:
    """One expression: parentheses balanced (never closing one it did not open), no `;`."""
    depth = 0
    for segment in scan(sql, standard_strings=standard_strings):
        if segment.kind != "code":
            continue
        if ";" in segment.text:
            raise UserSQLError(f"{what}: ';' ends a statement; write one boolean expression")
        for char in segment.text:
            depth += (char == "(") - (char == ")")
            if depth < 0:
                raise UserSQLError(f"{what}: a ')' closes a parenthesis the expression did not "
                                   "open; write one boolean expression")
    if depth:
        raise UserSQLError(f"{what}: {depth} parenthesis left open")
    if not sql.strip():
        raise UserSQLError(f"{what} is empty")
