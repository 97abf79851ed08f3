"""Many rows bound as one array per column and unnested into a relation in the statement.

A statement that changes or adds a few hundred rows binds each column's values as one array
and reads them back with `unnest(...) AS alias (column, ...)`: one round trip, one plan, however
many rows. `unnested("v", id=BigInteger, status=Text)` is that relation; it binds `ids` and
`new_<name>` for each other column (a bound name must not be a column of the table a statement
writes), and `bound(...)` builds the matching values.
"""

from __future__ import annotations

from typing import Any, Sequence

from sqlalchemy import bindparam, column, func
from sqlalchemy.dialects.postgresql import ARRAY


def param(name: str) -> str:
    return "ids" if name == "id" else f"new_{name}"


def unnested(alias: str, **types):
    """The relation `unnest(:ids, :new_a, ...) AS alias (id, a, ...)` of typed columns."""
    arrays = [bindparam(param(name), type_=ARRAY(type_)) for name, type_ in types.items()]
    return (func.unnest(*arrays)
            .table_valued(*(column(name, type_) for name, type_ in types.items()))
            .render_derived(alias))


def bound(**values: Sequence[Any]) -> dict[str, list[Any]]:
    """The parameters of an unnested relation: one list per column, of equal lengths."""
    return {param(name): list(column_values) for name, column_values in values.items()}
