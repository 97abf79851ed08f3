"""an experience's keys checked once a statement, not once a row

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03

A write of 512 rows checked three foreign keys a row: each data row's run (runs), each state
row's data row (its run's partition, 0014) and each state row's run; each check a query of its
own that locks the row it finds. They took ~11 ms of the ~32 ms the server spent on the
write's COPYs (COPY of the same 512 rows into a run's partitions with and without the keys).
As the ledger's keys did (0017), they become statement triggers with transition tables, one
query a run for all of a statement's rows, keeping what the keys held:

- `experience_keys`, after an INSERT on experience_data, experience_state or one of their
  partitions: every data row's run is in runs (locked FOR KEY SHARE, as the key's check locked
  it, so the run cannot go before the rows commit), every state row has its data row in its
  run's data partition, or the statement fails (foreign_key_violation) and writes nothing.
  Under REPEATABLE READ or SERIALIZABLE the data rows are locked too, as 0017's ledger check
  does.
- `experience_state_unlink`, after a DELETE on experience_data or a data partition: the state
  rows of the deleted data rows go with them (the key's ON DELETE CASCADE), after a lock on the
  run's state partition that waits for state writes in flight (SHARE ROW EXCLUSIVE).
- `experiences_unlink`, after a DELETE on runs: the deleted runs' experiences go (the keys'
  ON DELETE CASCADE; Reservoir itself drops a run's partitions before its row).
- `experience_data_truncate`, before a TRUNCATE of experience_data or a data partition: refused
  while the state rows it would orphan are there (the key refused any such truncate).
- `ledger_ids_kept` (0017's), after an UPDATE of a data row's id or run_id, or of a run's id:
  refused, as the keys refused changing an id a row named (the ledger names both; nothing in
  Reservoir changes one).

A state row's key to its run goes without a trigger of its own: its data row is of its run, and
names the run. Statement triggers fire only on the table a statement names, so the parents and
every partition have them, and `experience_partitions_add` gives a new run's partitions theirs
(its state partition no longer gets 0014's key).
"""

import importlib

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

_0017 = importlib.import_module("reservoir.migrations.versions.0017_ledger_keys_a_statement")
_0021 = importlib.import_module("reservoir.migrations.versions.0021_data_rows_in_one_page")

FUNCTIONS = """
CREATE FUNCTION experience_keys() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
    missing bigint;
    locking boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    FOR run IN SELECT DISTINCT a.run_id FROM added a LOOP
        IF TG_TABLE_NAME LIKE 'experience_data%' THEN
            PERFORM FROM runs r WHERE r.id = run FOR KEY SHARE;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'experience_data: run % is not in runs', run
                    USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'experience_data_run';
            END IF;
            CONTINUE;
        END IF;
        EXECUTE format('SELECT a.id FROM added a WHERE a.run_id = $1 AND NOT EXISTS '
                       '(SELECT FROM %I d WHERE d.run_id = $1 AND d.id = a.id) LIMIT 1',
                       'experience_data_r' || run) INTO missing USING run;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'experience_state: experience % of run % is not in experience_data',
                missing, run
                USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'experience_state_data';
        END IF;
        IF locking THEN
            EXECUTE format('SELECT FROM %I d WHERE d.run_id = $1 AND d.id IN (SELECT id '
                           'FROM added WHERE run_id = $1) FOR KEY SHARE',
                           'experience_data_r' || run) USING run;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experience_keys() IS
  'An experience''s keys: every data row a statement wrote names a run, every state row its '
  'data row.';

CREATE FUNCTION experience_state_unlink() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
BEGIN
    FOR run IN SELECT DISTINCT r.run_id FROM removed r LOOP
        CONTINUE WHEN to_regclass(format('%I', 'experience_state_r' || run)) IS NULL;
        EXECUTE format('LOCK TABLE %I IN SHARE ROW EXCLUSIVE MODE', 'experience_state_r' || run);
        EXECUTE format('DELETE FROM %I s USING removed r WHERE r.run_id = $1 AND s.id = r.id',
                       'experience_state_r' || run) USING run;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experience_state_unlink() IS
  'The state rows of deleted data rows go with them.';

CREATE FUNCTION experiences_unlink() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
BEGIN
    FOR run IN SELECT r.id FROM removed r LOOP
        CONTINUE WHEN to_regclass(format('%I', 'experience_data_r' || run)) IS NULL;
        EXECUTE format('DELETE FROM %I', 'experience_data_r' || run);
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experiences_unlink() IS
  'The experiences of deleted runs go with them.';

CREATE FUNCTION experience_data_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    state text := replace(TG_TABLE_NAME, 'experience_data', 'experience_state');
    held boolean;
BEGIN
    EXECUTE format('SELECT EXISTS (SELECT FROM %I)', state) INTO held;
    IF held THEN
        RAISE EXCEPTION '%: TRUNCATE would leave the rows of % without their data rows; DELETE '
            'the rows (their state rows go with them) or drop the run''s partitions', TG_TABLE_NAME,
            state USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION experience_data_truncate() IS
  'A data table is truncated only when its state rows are gone.';
"""
# Each trigger, by the parent it is on; the parent's partitions get the same.
TRIGGERS = {
    "experience_data": [
        "CREATE TRIGGER experience_keys AFTER INSERT ON {table} REFERENCING NEW TABLE AS added "
        "FOR EACH STATEMENT EXECUTE FUNCTION experience_keys()",
        "CREATE TRIGGER experience_state_unlink AFTER DELETE ON {table} REFERENCING OLD TABLE "
        "AS removed FOR EACH STATEMENT EXECUTE FUNCTION experience_state_unlink()",
        "CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id, run_id ON {table} FOR EACH "
        "STATEMENT EXECUTE FUNCTION ledger_ids_kept('id, run_id')",
        "CREATE TRIGGER experience_data_truncate BEFORE TRUNCATE ON {table} FOR EACH STATEMENT "
        "EXECUTE FUNCTION experience_data_truncate()",
    ],
    "experience_state": [
        "CREATE TRIGGER experience_keys AFTER INSERT ON {table} REFERENCING NEW TABLE AS added "
        "FOR EACH STATEMENT EXECUTE FUNCTION experience_keys()",
    ],
}
RUN_TRIGGERS = """
CREATE TRIGGER experiences_unlink AFTER DELETE ON runs REFERENCING OLD TABLE AS removed
    FOR EACH STATEMENT EXECUTE FUNCTION experiences_unlink();
CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id ON runs
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept('id');
"""
RUN_KEYS = {"experience_data": "experience_data_run_id_fkey",
            "experience_state": "experience_state_run_id_fkey1"}

# experience_partitions_add as 0021 left it, its state partition without 0014's key and each
# new partition with this revision's triggers.
_STATE_KEY = "(2, 'experience_state', 'data', '(run_id, id)', 'experience_data')"
_LAST = _0017._LAST
_NEW_TRIGGERS = "".join(_0017._per_partition(parent, triggers)
                        for parent, triggers in TRIGGERS.items())
assert _0021.PARTITIONS.count(_STATE_KEY) == 1 and _0021.PARTITIONS.count(_LAST) == 1, \
    "0021's experience_partitions_add changed"
PARTITIONS = (_0021.PARTITIONS
              .replace(_STATE_KEY, "(2, 'experience_state', NULL, NULL, NULL)")
              .replace(_LAST, "            END IF;" + _NEW_TRIGGERS + "\n        END IF;\n    END LOOP;")
              .replace("the state partition''s key to the data partition, and their triggers",
                       "and their triggers"))


def _state_keys() -> list[tuple[str, str]]:
    """(state partition, its key to the run's data partition) of the partitions there are."""
    return op.get_bind().exec_driver_sql("""
        SELECT conrelid::regclass::text, conname FROM pg_constraint
        WHERE contype = 'f' AND conparentid = 0 AND conname ~ '^experience_state_r[0-9]+_data$'
        ORDER BY 1""").all()


def upgrade() -> None:
    for parent, key in RUN_KEYS.items():
        op.execute(f"ALTER TABLE {parent} DROP CONSTRAINT {key}")
    for table, key in _state_keys():
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {key}")
    op.execute(FUNCTIONS)
    op.execute(RUN_TRIGGERS)
    for parent, triggers in TRIGGERS.items():
        for table in [parent] + _0017._partitions(parent):
            for trigger in triggers:
                op.execute(trigger.format(table=table))
    op.execute(PARTITIONS)


def downgrade() -> None:
    op.execute(_0021.PARTITIONS)
    for parent, triggers in TRIGGERS.items():
        for table in [parent] + _0017._partitions(parent):
            for trigger in triggers:
                op.execute(f"DROP TRIGGER {_0017._name(trigger)} ON {table}")
    op.execute("DROP TRIGGER experiences_unlink ON runs; DROP TRIGGER ledger_ids_kept ON runs; "
               "DROP FUNCTION experience_keys(); DROP FUNCTION experience_state_unlink(); "
               "DROP FUNCTION experiences_unlink(); DROP FUNCTION experience_data_truncate();")
    for parent, key in RUN_KEYS.items():
        op.execute(f"ALTER TABLE {parent} ADD CONSTRAINT {key} FOREIGN KEY (run_id) "
                   "REFERENCES runs (id) ON DELETE CASCADE")
    for table in _0017._partitions("experience_state"):
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_data FOREIGN KEY (run_id, id) "
                   f"REFERENCES experience_data_{table.rsplit('_', 1)[1]} (run_id, id) "
                   "ON DELETE CASCADE")
