"""The archive folder's format: `manifest.json`, and how each PostgreSQL type is stored in
the Parquet files beside it (bytea as binary, JSON and UUIDs as their text, timestamps in UTC).
Files are written under a temporary name, fsynced, then renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from reservoir.errors import StoreError

MANIFEST = "manifest.json"
FORMAT = 1
ARROW = {"bigint": pa.int64(), "integer": pa.int32(), "smallint": pa.int16(),
         "double precision": pa.float64(), "real": pa.float32(), "boolean": pa.bool_(),
         "text": pa.string(), "bytea": pa.binary(), "json": pa.string(),
         "jsonb": pa.string(), "uuid": pa.string(),
         "timestamp with time zone": pa.timestamp("us", tz="UTC")}


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # PostgreSQL's name for it (format_type)
    derived: bool = False


@dataclass(frozen=True)
class TableFile:
    """One archived table: its file in the archive, rows, the file's sha256, its columns."""

    file: str
    rows: int
    sha256: str
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class Manifest:
    """What an archive holds (`manifest.json`); `directory` is where it was read or written."""

    run: str
    run_id: int
    revision: str | None
    created_at: str
    tables: dict[str, TableFile]
    links_lost: dict[str, int] = field(default_factory=dict)
    run_fields: dict = field(default_factory=dict)  # group_size, model, vocab_size of the run
    directory: Path = Path(".")

    def rows(self) -> dict[str, int]:
        return {name: table.rows for name, table in self.tables.items()}

    def to_json(self) -> str:
        body = {"format": FORMAT, **asdict(self)}
        del body["directory"]
        for table in body["tables"].values():
            table["columns"] = [{"name": c["name"], "type": c["type"]} for c in table["columns"]]
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def read(cls, directory: Path, names: tuple[str, ...]) -> "Manifest":
        """The manifest in `directory`; its tables must be `names`, in that order."""
        path = directory / MANIFEST
        if not path.is_file():
            raise StoreError(f"{directory}: no {MANIFEST}: not an archive of `reservoir runs "
                             "archive`; nothing was restored")
        try:
            body = json.loads(path.read_text())
            if body.pop("format") != FORMAT:
                raise ValueError(f"format is not {FORMAT}")
            tables = {name: TableFile(t["file"], int(t["rows"]), t["sha256"],
                                      tuple(Column(c["name"], c["type"]) for c in t["columns"]))
                      for name, t in body.pop("tables").items()}
            if tuple(tables) != names:
                raise ValueError(f"tables are not {', '.join(names)}")
            for name, table in tables.items():  # the folder's own files, never a path
                if table.file != f"{name}.parquet":
                    raise ValueError(f"{name}'s file is {table.file[:80]!r}, not {name}.parquet")
            _check_run_fields(body.get("run_fields", {}))
            return cls(**body, tables=tables, directory=directory)
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            raise StoreError(f"{path}: not a valid archive manifest ({exc}); nothing was "
                             "restored") from None


RUN_FIELDS = {"group_size": int, "vocab_size": int, "model": str}


def _check_run_fields(fields: dict) -> None:
    """What a restore may make a run with: a positive group size and vocabulary, a model path
    of text."""
    for name, value in fields.items():
        kind = RUN_FIELDS.get(name)
        if kind is None or not (value is None or (type(value) is kind and (
                kind is str and "\x00" not in value and len(value) <= 4096
                or kind is int and 0 < value < 2**31))):
            raise ValueError(f"run_fields.{name} = {value!r:.80}")


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create(path: Path):
    """A new file opened for writing: never one that exists, never through a link (a link or
    a file at `path` is an OSError naming it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o644), "wb")


def write_durably(path: Path, data: bytes) -> None:
    """Write a file under a temporary name (created, not reused), fsync it, then rename it
    into place."""
    partial = path.with_name(path.name + ".partial")
    with create(partial) as file:
        file.write(data)
    fsync(partial)
    os.replace(partial, path)
    fsync(path.parent)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
