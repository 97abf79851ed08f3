"""The layout's rules, checked on the import graph and the `ast` of every module, and the counts
that say how far the code is from them.

    python -m tools.layout          # a table of the counts; exit 1 where a rule is broken

Layers, lowest first: a module imports only from its own layer or below. Explorer, trainer and
pipeline share a layer and never import each other; only `reservoir.store` itself (its
`__init__`: the `Store` objects and record types) is the door to the store.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass

from tools.imports import Graph, read

LAYERS = [  # (layer, module prefixes), lowest first
    ("base", ["reservoir.errors", "reservoir.yamlfile", "reservoir.registry", "reservoir.chat",
              "reservoir.devices", "reservoir.models", "reservoir.http", "reservoir.plan",
              "reservoir.sqlcheck", "reservoir.logs", "reservoir"]),
    ("config", ["reservoir.config"]),
    ("plan of a config", ["reservoir.plan.stages", "reservoir.plan.weights"]),
    ("store", ["reservoir.store", "reservoir.migrations"]),
    ("roles", ["reservoir.explorer", "reservoir.trainer", "reservoir.pipeline",
               "reservoir.operators", "reservoir.tracking", "reservoir.metrics"]),
    ("runs", ["reservoir.prepare", "reservoir.servers", "reservoir.colocated",
              "reservoir.export", "reservoir.monitor", "reservoir.report", "reservoir.demo",
              "reservoir.agent"]),
    ("pool", ["reservoir.pool"]),
    ("cli", ["reservoir.cli", "reservoir.cli_common", "reservoir.cli_db", "reservoir.cli_output",
             "reservoir.cli_pipelines", "reservoir.cli_runs", "reservoir.cli_metrics",
             "reservoir.__main__"]),
]
ROLES = ("reservoir.explorer", "reservoir.trainer", "reservoir.pipeline")
STORE = "reservoir.store"
SQL_LIBRARIES = ("sqlalchemy", "psycopg2", "psycopg", "asyncpg", "sqlite3")
SQL_CALLS = {"execute", "executemany", "exec_driver_sql", "text", "copy_expert", "mogrify",
             "read_sql", "read_sql_query", "to_sql"}
SQL_TEXT = re.compile(
    r"^\s*(select\s.+|insert\s+into\s|update\s+\S+\s+set\s|delete\s+from\s|with\s+\w+\s+as\s*\(|"
    r"(create|alter|drop)\s+(table|view|index|function|trigger|role|schema|database)\s|"
    r"(grant|revoke)\s.+\s(on|to|from)\s|truncate\s|copy\s+\S+\s+(from|to)\s|"
    r"(begin|start)\s+transaction|(commit|rollback|vacuum)\s*;|(un)?listen\s+\w+\s*;?\s*$|"
    r"notify\s+\w+\s*[,;]|lock\s+table\s)",
    re.IGNORECASE | re.DOTALL)
# SQL that never reaches the store: a custom expectation is tried on a SQLite copy of a batch;
# a URL is read with libpq's own parser (no connection).
NOT_THE_STORE = {("reservoir.pipeline.validate", "sqlite3"), ("reservoir.pipeline.validate", "text"),
                 ("reservoir.pipeline.validate", "execute"),
                 ("reservoir.pipeline.validate", "to_sql"),
                 ("reservoir.pipeline.validate", "SELECT COUNT(*) FROM ("),
                 ("reservoir.plan.urls", "psycopg2")}
CORE_BUILDERS = {"select", "insert", "update", "delete"}
TRANSACTIONS = {"begin", "connect", "begin_nested", "transaction", "acquire"}
EXPERIENCE_TABLES = ("experience_state", "experiences")
STATUS_CHANGE = re.compile(  # a row's birth (the writer, a pipeline's children) is no change
    r"update\s+(public\.)?(experience_state|experiences)\b[^;]*?\bset\b[^;]*?\bstatus\b",
    re.IGNORECASE | re.DOTALL)


def layer_of(module: str) -> int:
    best = max((prefix for _, prefixes in LAYERS for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return next(i for i, (_, prefixes) in enumerate(LAYERS) if best in prefixes)


def _family(module: str) -> str:
    return next((role for role in ROLES if module == role or module.startswith(role + ".")), "")


def _inside_store(module: str) -> bool:
    return module == STORE or module.startswith((STORE + ".", "reservoir.migrations"))


def store_door(graph: Graph) -> list[str]:
    """Imports of a store submodule from outside the store."""
    return [f"{a}:{line} imports {b}" for a, edges in graph.edges.items() if not _inside_store(a)
            for b, line in edges if b.startswith(STORE + ".")]


def roles_apart(graph: Graph) -> list[str]:
    """Imports between explorer, trainer and pipeline (in either direction)."""
    return [f"{a}:{line} imports {b}" for a, edges in graph.edges.items()
            for b, line in edges if _family(a) and _family(b) and _family(a) != _family(b)]


def upward(graph: Graph) -> list[str]:
    """Imports of a module of a higher layer."""
    return [f"{a}:{line} imports {b} ({LAYERS[layer_of(b)][0]} above {LAYERS[layer_of(a)][0]})"
            for a, edges in graph.edges.items() for b, line in edges
            if layer_of(b) > layer_of(a)]


def circles(graph: Graph) -> list[list[str]]:
    """Modules that import each other, directly or round a longer loop (Tarjan's strongly
    connected components of more than one module); a package importing its own submodules
    (its `__init__` re-exporting them) is not a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def targets(module: str) -> list[str]:
        return [b for b, _ in graph.edges.get(module, ())
                if not (graph.is_package(module) and b.startswith(module + "."))]

    def visit(module: str) -> None:  # recursion depth: the longest import chain (~20)
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in targets(module):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph.files:
        if module not in index:
            visit(module)
    return found


def sql_outside_store(graph: Graph) -> list[str]:
    """SQL outside the store: a SQL library imported, a call that runs or builds SQL text, or a
    string that is SQL (any case, any verb)."""
    found = []
    for module, tree in graph.trees.items():
        if _inside_store(module):
            continue
        for node in ast.walk(tree):
            what = _sql_in(node)
            if what and (module, what) not in NOT_THE_STORE:
                found.append(f"{module}:{node.lineno} {_describe(node)}")
    return found


def _sql_in(node: ast.AST) -> str | None:
    if isinstance(node, ast.Import | ast.ImportFrom):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""]
        return next((name.split(".")[0] for name in names
                     if name.split(".")[0] in SQL_LIBRARIES), None)
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else \
            node.func.id if isinstance(node.func, ast.Name) else ""
        return name if name in SQL_CALLS else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
            SQL_TEXT.match(node.value):
        return node.value
    return None


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"holds SQL text {node.value[:40]!r}"
    if isinstance(node, ast.Call):
        return f"calls {ast.unparse(node.func)}()"
    return f"imports {ast.unparse(node)[:60]!r}"


def transaction_openers(graph: Graph) -> dict[str, list[int]]:
    """Modules outside the store that open a connection or transaction themselves, with the
    lines where they do."""
    opened: dict[str, list[int]] = {}
    for module, tree in graph.trees.items():
        if _inside_store(module):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in TRANSACTIONS and \
                    re.search(r"engine|conn|session|pool", ast.unparse(node.func.value), re.IGNORECASE):
                opened.setdefault(module, []).append(node.lineno)
    return opened


def status_changers(graph: Graph) -> dict[str, list[int]]:
    """Modules that change an experience's status: SQL text that updates `status` of
    experience_state (or the experiences view), or a SQLAlchemy update of those tables whose
    values name `status` (directly or through a dict that may hold it)."""
    changed: dict[str, list[int]] = {}
    for module, tree in graph.trees.items():
        if module.startswith("reservoir.migrations"):  # history: store/sql/schema.sql is now
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    STATUS_CHANGE.search(node.value) or _sqlalchemy_status_change(node):
                changed.setdefault(module, []).append(node.lineno)
    return changed


def _sqlalchemy_status_change(node: ast.AST) -> bool:
    """`update(<experience table>)...values(status=...)` (or `.values(**a_dict)`, which may
    hold it), or `insert(<experience table>)`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr == "values" and any(k.arg in ("status", None) for k in node.keywords):
        return _on_experiences(node.func.value, "update")
    return False


def _on_experiences(chain: ast.AST, verb: str) -> bool:
    """Whether a chain of calls (`update(t).where(...)`) starts with verb(<experience table>)."""
    while isinstance(chain, ast.Call | ast.Attribute):
        if isinstance(chain, ast.Call) and isinstance(chain.func, ast.Name) and \
                chain.func.id == verb and chain.args:
            table = ast.unparse(chain.args[0])
            return any(name in table for name in EXPERIENCE_TABLES) or table in ("state", "e")
        chain = chain.func if isinstance(chain, ast.Call) else chain.value
    return False


def mixed_sql_styles(graph: Graph) -> list[str]:
    """Store modules that write SQL both ways: as text (`sqlalchemy.text`) and built with
    SQLAlchemy Core (`select`, `insert`, `update`, `delete` imported from sqlalchemy). A module
    keeps one style, so a reader learns one way to read its statements."""
    mixed = []
    for module, tree in graph.trees.items():
        if not _inside_store(module):
            continue
        called = _sqlalchemy_calls(tree)
        if "text" in called and called & CORE_BUILDERS:
            mixed.append(f"{module} (text and {', '.join(sorted(called & CORE_BUILDERS))})")
    return mixed


def _sqlalchemy_calls(tree: ast.AST) -> set[str]:
    """The sqlalchemy functions a module calls, by their own names (`from sqlalchemy import
    text as t; t(...)` is `text`; `sa.select(...)` is `select`)."""
    names, modules = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            names.update({alias.asname or alias.name: alias.name for alias in node.names})
        elif isinstance(node, ast.Import):
            modules.update(alias.asname or alias.name for alias in node.names
                           if alias.name.startswith("sqlalchemy"))
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in names:
            called.add(names[node.func.id])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in modules:
            called.add(node.func.attr)
    return called


@dataclass
class Counts:
    store_door: list[str]
    roles_apart: list[str]
    sql_outside_store: list[str]
    upward: list[str]
    circles: list[list[str]]
    status_changers: dict[str, list[int]]
    transaction_openers: dict[str, list[int]]
    mixed_sql_styles: list[str]


def measure(graph: Graph | None = None) -> Counts:
    graph = graph or read()
    return Counts(store_door(graph), roles_apart(graph), sql_outside_store(graph),
                  upward(graph), circles(graph), status_changers(graph),
                  transaction_openers(graph), mixed_sql_styles(graph))


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    counts = measure()
    table = Table("measure (from the import graph and the ast)", "count", "goal", "where")
    rows = [("imports of a store submodule from outside the store", counts.store_door, 0),
            ("imports between explorer, trainer and pipeline", counts.roles_apart, 0),
            ("SQL outside the store", counts.sql_outside_store, 0),
            ("imports that run back up the layers", counts.upward, 0),
            ("circles of imports", counts.circles, 0),
            ("modules that change an experience's status", counts.status_changers, 1),
            ("modules outside the store that open a transaction", counts.transaction_openers, 0),
            ("store modules that write SQL both as text and with Core", counts.mixed_sql_styles,
             0)]
    for label, found, goal in rows:
        where = ", ".join(sorted(found)) if isinstance(found, dict) else \
            "; ".join(" <-> ".join(c) if isinstance(c, list) else c for c in found[:4]) + \
            (" ..." if len(found) > 4 else "")
        table.add_row(label, str(len(found)), str(goal), where)
    Console(width=200).print(table)
    return 0 if all(len(found) <= goal for _, found, goal in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
