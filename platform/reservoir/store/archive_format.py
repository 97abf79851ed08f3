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
            return cls(**body, tables=tables, directory=directory)
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            raise StoreError(f"{path}: not a valid archive manifest ({exc}); nothing was "
                             "restored") from None


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write a file under a temporary name, fsync it, then rename it into place."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    fsync(partial)
    os.replace(partial, path)
    fsync(path.parent)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
