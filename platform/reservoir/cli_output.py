"""How results look: tables that fit the terminal, CSV and JSON whose cells hold JSON.

A table keeps its columns left to right while they fit the console's width (80 columns when
the output is not a terminal), shortens long cells with an ellipsis, and names the columns it
left out; `--wide` shows every column in full. CSV and table cells show JSON values (dicts,
lists, decoded arrays) as JSON, NULL as an empty CSV field, timestamps to the second.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import json
import sys
import uuid
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

CELL_CAP = 40  # characters a table cell shows before its ellipsis (not with --wide)
FORMATS = ("table", "csv", "json")


def cell(value: Any, *, null: str = "NULL") -> str:
    """The text of one value in a table or CSV cell."""
    if value is None:
        return null
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=_plain)
    if isinstance(value, dt.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\x" + bytes(value).hex()
    return str(value)


def _plain(value: Any) -> Any:
    """JSON for values json does not know (timestamps, decimals, uuids, bytes)."""
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\x" + bytes(value).hex()
    return str(value)


class CsvSink:
    """CSV on stdout as the rows stream in: the header once, then each batch."""

    def __init__(self) -> None:
        self.writer, self.started = csv.writer(sys.stdout), False

    def __call__(self, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if not self.started:
            self.writer.writerow(columns)
            self.started = True
        self.writer.writerows([[cell(v, null="") for v in row] for row in rows])


def write_rows(console: Console, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
               fmt: str = "table", title: str | None = None, wide: bool = False) -> None:
    if fmt == "csv":
        CsvSink()(columns, rows)
    elif fmt == "json":
        records = [dict(zip(columns, row)) for row in rows]
        sys.stdout.write(json.dumps(records, default=_plain, ensure_ascii=False, indent=2) + "\n")
    else:
        print_table(console, columns, rows, title=title, wide=wide)


def print_table(console: Console, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                title: str | None = None, wide: bool = False) -> None:
    texts = [[cell(v) for v in row] for row in rows]
    natural = [max([len(name)] + [len(row[i]) for row in texts]) for i, name in enumerate(columns)]
    if wide:
        shown = list(range(len(columns)))
        console = Console(width=max(console.width, sum(w + 3 for w in natural) + 1),
                          force_terminal=console.is_terminal, no_color=console.no_color)
    else:
        shown = _fitting(natural, console.width)
    table = Table(title=title, title_justify="left")
    for i in shown:
        table.add_column(columns[i], no_wrap=not wide, overflow="fold" if wide else "ellipsis",
                         max_width=None if wide else CELL_CAP)
    for row in texts:
        table.add_row(*[row[i] for i in shown])
    hidden = [name for i, name in enumerate(columns) if i not in shown]
    if hidden:
        table.caption = (f"{len(hidden)} more column{'s' if len(hidden) > 1 else ''}: "
                         f"{', '.join(hidden)} (--wide or --format csv shows "
                         f"{'them' if len(hidden) > 1 else 'it'})")
        table.caption_justify = "left"
    console.print(table)


def _fitting(natural: list[int], width: int) -> list[int]:
    """Column indexes, left to right, whose capped widths fit in `width` (at least one)."""
    used, shown = 1, []
    for i, w in enumerate(natural):
        need = min(w, CELL_CAP) + 3
        if shown and used + need > width:
            break
        shown.append(i)
        used += need
    return shown


def print_record(console: Console, record: dict[str, Any], *, title: str,
                 wide: bool = False, skip: Sequence[str] = ()) -> None:
    """One row as a two-column table of field and value."""
    table = Table(title=title, show_header=False, title_justify="left")
    value_width = None if wide else max(20, console.width - max(map(len, record)) - 7)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(no_wrap=not wide, overflow="fold" if wide else "ellipsis",
                     max_width=value_width)
    for name, value in record.items():
        if name not in skip or wide:
            table.add_row(name, cell(value))
    console.print(table)
