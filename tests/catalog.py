"""A database's catalog as sorted lines, one aspect at a time, so that two databases compare as
a diff that names each object that differs.

`snapshot(conn)` reads every object of the schemas a database's users made (all but
PostgreSQL's own and pg_toast), except Alembic's bookkeeping (alembic_version). Each line
starts with the object's qualified name; a definition (a function's, a view's) takes one line
per line of text. What the lines hold does not depend on creation order or history: columns
by their order among the live ones (a dropped column leaves a gap in attnum), lists of
privileges and options sorted. Text comes from the server's own deparsers (pg_get_*def), so
compare two databases of one server: another major version may print the same object
differently.
"""

from __future__ import annotations

import difflib

OURS = "n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%'"
IGNORED = "('public.alembic_version', 'public.alembic_version_pkc')"


def _sorted(array: str) -> str:
    """An array (of aclitem, of option=value) as sorted text: the same rights or options read
    the same however they were granted or set."""
    return f"(SELECT array_agg(x::text ORDER BY x::text) FROM unnest({array}) x)"


ASPECTS = {
    "schemas": f"""
        SELECT n.nspname, pg_get_userbyid(n.nspowner) AS owner, {_sorted('n.nspacl')} AS acl,
               obj_description(n.oid, 'pg_namespace') AS comment
        FROM pg_namespace n WHERE {OURS}""",
    "relations": f"""
        SELECT n.nspname || '.' || c.relname AS name, c.relkind AS kind,
               pg_get_userbyid(c.relowner) AS owner, {_sorted('c.relacl')} AS acl,
               {_sorted('c.reloptions')} AS options, c.relpersistence AS persistence,
               am.amname AS access_method, t.spcname AS tablespace,
               pg_get_partkeydef(c.oid) AS partition_key,
               pg_get_expr(c.relpartbound, c.oid) AS partition_of,
               c.relrowsecurity AS row_security, c.relforcerowsecurity AS forced,
               c.relreplident AS replica_identity, obj_description(c.oid, 'pg_class') AS comment
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_am am ON am.oid = c.relam
        LEFT JOIN pg_tablespace t ON t.oid = c.reltablespace
        WHERE {OURS} AND n.nspname || '.' || c.relname NOT IN {IGNORED}""",
    # Some builds add a `pg_attver=<n>` option to every column, a counter of when it was made:
    # left out.
    "columns": f"""
        SELECT n.nspname || '.' || c.relname || '.' || a.attname AS name,
               rank() OVER (PARTITION BY c.oid ORDER BY a.attnum) AS position,
               format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull AS not_null,
               pg_get_expr(d.adbin, d.adrelid) AS default, a.attgenerated AS generated,
               a.attidentity AS identity, co.collname AS collation, a.attstorage AS storage,
               a.attcompression AS compression, a.attstattarget AS statistics,
               (SELECT array_agg(o ORDER BY o) FROM unnest(a.attoptions) o
                WHERE o NOT LIKE 'pg\\_attver=%') AS options,
               {_sorted('a.attacl')} AS acl, col_description(c.oid, a.attnum) AS comment
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE {OURS} AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
          AND n.nspname || '.' || c.relname NOT IN {IGNORED}""",
    # PostgreSQL 18 lists NOT NULL as constraints, each named after a name free when it was
    # made (`<table>_<column>_not_null1` where history held the plain one): named by its
    # definition here.
    "constraints": f"""
        SELECT n.nspname || '.' || c.relname || '.'
               || CASE k.contype WHEN 'n' THEN pg_get_constraintdef(k.oid) ELSE k.conname END
               AS name, k.contype AS type,
               pg_get_constraintdef(k.oid) AS definition, k.condeferrable AS deferrable,
               k.condeferred AS deferred, k.convalidated AS validated, k.conislocal AS local,
               k.coninhcount AS inherited, obj_description(k.oid, 'pg_constraint') AS comment
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE {OURS} AND n.nspname || '.' || c.relname NOT IN {IGNORED}""",
    "indexes": f"""
        SELECT n.nspname || '.' || c.relname AS name, pg_get_indexdef(i.indexrelid) AS definition,
               i.indisvalid AS valid, i.indisclustered AS clustered,
               i.indisreplident AS replica_identity
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE {OURS} AND n.nspname || '.' || c.relname NOT IN {IGNORED}""",
    "sequences": f"""
        SELECT n.nspname || '.' || c.relname AS name, format_type(s.seqtypid, NULL) AS type,
               s.seqstart AS start, s.seqincrement AS increment, s.seqmin AS min,
               s.seqmax AS max, s.seqcache AS cache, s.seqcycle AS cycle,
               (SELECT d.refobjid::regclass || '.' || a.attname FROM pg_depend d
                JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
                WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                  AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i'))
               AS owned_by
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {OURS}""",
    "functions": f"""
        SELECT n.nspname || '.' || p.proname || '(' || pg_get_function_identity_arguments(p.oid)
               || ')' AS name, p.prokind AS kind, pg_get_userbyid(p.proowner) AS owner,
               {_sorted('p.proacl')} AS acl, obj_description(p.oid, 'pg_proc') AS comment,
               CASE WHEN p.prokind <> 'a' THEN pg_get_functiondef(p.oid) END AS definition
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE {OURS}""",
    "triggers": f"""
        SELECT n.nspname || '.' || c.relname || '.' || t.tgname AS name,
               pg_get_triggerdef(t.oid) AS definition, t.tgenabled AS enabled,
               obj_description(t.oid, 'pg_trigger') AS comment
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {OURS} AND NOT t.tgisinternal""",
    "views": f"""
        SELECT n.nspname || '.' || c.relname AS name, pg_get_viewdef(c.oid) AS definition
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE {OURS} AND c.relkind IN ('v', 'm')""",
    "rules": f"""
        SELECT r.schemaname || '.' || r.tablename || '.' || r.rulename AS name, r.definition
        FROM pg_rules r JOIN pg_namespace n ON n.nspname = r.schemaname WHERE {OURS}""",
    "policies": f"""
        SELECT p.schemaname || '.' || p.tablename || '.' || p.policyname AS name, p.permissive,
               p.roles, p.cmd, p.qual, p.with_check
        FROM pg_policies p JOIN pg_namespace n ON n.nspname = p.schemaname WHERE {OURS}""",
    "types": f"""
        SELECT n.nspname || '.' || t.typname AS name, t.typtype AS type,
               pg_get_userbyid(t.typowner) AS owner, {_sorted('t.typacl')} AS acl,
               format_type(t.typbasetype, t.typtypmod) AS base, t.typnotnull AS not_null,
               t.typdefault AS default,
               (SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder) FROM pg_enum e
                WHERE e.enumtypid = t.oid) AS labels,
               (SELECT array_agg(pg_get_constraintdef(k.oid) ORDER BY k.conname)
                FROM pg_constraint k WHERE k.contypid = t.oid) AS checks
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE {OURS} AND t.typtype IN ('e', 'd', 'r', 'm')""",
    "statistics": f"""
        SELECT n.nspname || '.' || s.stxname AS name, pg_get_statisticsobjdef(s.oid) AS definition
        FROM pg_statistic_ext s JOIN pg_namespace n ON n.oid = s.stxnamespace WHERE {OURS}""",
    "default_privileges": f"""
        SELECT pg_get_userbyid(d.defaclrole) || ' in ' || coalesce(n.nspname, 'every schema')
               || ' on ' || d.defaclobjtype::text AS name, {_sorted('d.defaclacl')} AS acl
        FROM pg_default_acl d LEFT JOIN pg_namespace n ON n.oid = d.defaclnamespace""",
    "extensions": """
        SELECT e.extname, n.nspname AS schema, pg_get_userbyid(e.extowner) AS owner
        FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace""",
}


def snapshot(conn) -> dict[str, list[str]]:
    """Every aspect's lines (a psycopg2 connection; read in its current transaction)."""
    with conn.cursor() as cur:
        return {aspect: _lines(cur, sql) for aspect, sql in ASPECTS.items()}


def _lines(cur, sql: str) -> list[str]:
    """One line per row, `name: field=value, ...`, sorted; a multi-line field follows its row
    as `name: field | line`, one line of it each."""
    cur.execute(sql)
    fields = [column.name for column in cur.description[1:]]
    lines = []
    for name, *values in sorted(cur.fetchall(), key=lambda row: [str(value) for value in row]):
        row = dict(zip(fields, values))
        texts = {field: value for field, value in row.items()
                 if isinstance(value, str) and "\n" in value}
        lines.append(f"{name}: " + ", ".join(f"{field}={value}" for field, value in row.items()
                                             if field not in texts))
        lines += [f"{name}: {field} | {line}" for field, text in texts.items()
                  for line in text.splitlines()]
    return lines


def differences(expected: dict[str, list[str]], actual: dict[str, list[str]],
                labels: tuple[str, str] = ("expected", "actual")) -> list[str]:
    """A unified diff per aspect (no context lines); empty when the catalogs agree."""
    return [line for aspect in expected for line in difflib.unified_diff(
        expected[aspect], actual[aspect], f"{aspect} ({labels[0]})", f"{aspect} ({labels[1]})",
        lineterm="", n=0)]


def changed_lines(diff: list[str]) -> list[str]:
    """The lines of a diff that were taken out or put in (not its headers)."""
    return [line for line in diff
            if line[:1] in "-+" and not line.startswith(("---", "+++"))]
