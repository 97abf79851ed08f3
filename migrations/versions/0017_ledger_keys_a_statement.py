"""the ledger's keys checked once a statement, not once a row

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02

A step commit writes one ledger row per experience, and each row's two foreign keys (to
train_steps and to the run's state partition) ran a query of their own: 512 checks, ~2 ms of a
~5 ms commit of 256 rows. Here the keys become statement triggers with transition tables, one
query per table for all of a statement's rows, keeping what the keys held:

- `batch_items_keys`, after an INSERT or UPDATE on batch_items or one of its partitions: every
  new row names a train step and an experience of its run, or the statement fails
  (foreign_key_violation) and writes nothing.
- `batch_items_unlink`, after a DELETE on train_steps, experience_state or a state partition:
  the ledger rows of what went go with it (the keys' ON DELETE CASCADE). It first takes a lock
  on the ledger that waits for ledger writes in flight (SHARE ROW EXCLUSIVE), so a step that
  was committing when its experience was deleted loses its row, and a later one finds the
  experience gone.
- `ledger_ids_kept`, after an UPDATE that sets id or run_id of experience_state (or a state
  partition) or id of train_steps: refused, as the keys refused changing an id a ledger row
  names (nothing in Reservoir changes one; the `experiences` view refuses it already).

Statement triggers fire only on the table a statement names: the parents and every partition
have them, and `experience_partitions_add` gives a new run's partitions theirs. Under REPEATABLE
READ or SERIALIZABLE a ledger insert also locks what it names (FOR KEY SHARE), as a key check
does, so a delete its snapshot cannot see fails it instead of leaving a dangling row.
"""

import importlib

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_0016 = importlib.import_module("reservoir.migrations.versions.0016_group_ids_a_statement")

FUNCTIONS = """
CREATE FUNCTION batch_items_keys() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
    missing bigint;
    locking boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    SELECT a.train_step_id INTO missing FROM added a
    WHERE NOT EXISTS (SELECT FROM train_steps t WHERE t.id = a.train_step_id) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'batch_items: train step % is not in train_steps', missing
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'batch_items_train_step';
    END IF;
    IF locking THEN
        PERFORM FROM train_steps t WHERE t.id IN (SELECT train_step_id FROM added)
        FOR KEY SHARE;
    END IF;
    FOR run IN SELECT DISTINCT a.run_id FROM added a LOOP
        EXECUTE format('SELECT a.experience_id FROM added a WHERE a.run_id = $1 AND NOT EXISTS '
                       '(SELECT FROM %I s WHERE s.run_id = $1 AND s.id = a.experience_id) '
                       'LIMIT 1', 'experience_state_r' || run) INTO missing USING run;
        IF missing IS NOT NULL THEN
            RAISE EXCEPTION 'batch_items: experience % of run % is not in experience_state',
                missing, run
                USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'batch_items_experience';
        END IF;
        IF locking THEN
            EXECUTE format('SELECT FROM %I s WHERE s.run_id = $1 AND s.id IN (SELECT '
                           'experience_id FROM added WHERE run_id = $1) FOR KEY SHARE',
                           'experience_state_r' || run) USING run;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION batch_items_keys() IS
  'The ledger''s keys: every batch_items row a statement wrote names a train step and an '
  'experience of its run.';

CREATE FUNCTION batch_items_unlink() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run bigint;
BEGIN
    IF TG_TABLE_NAME = 'train_steps' THEN
        LOCK TABLE batch_items IN SHARE ROW EXCLUSIVE MODE;
        DELETE FROM batch_items b USING removed r WHERE b.train_step_id = r.id;
        RETURN NULL;
    END IF;
    FOR run IN SELECT DISTINCT r.run_id FROM removed r LOOP
        CONTINUE WHEN to_regclass(format('%I', 'batch_items_r' || run)) IS NULL;
        EXECUTE format('LOCK TABLE %I IN SHARE ROW EXCLUSIVE MODE', 'batch_items_r' || run);
        EXECUTE format('DELETE FROM %I b USING removed r WHERE r.run_id = $1 '
                       'AND b.experience_id = r.id', 'batch_items_r' || run) USING run;
    END LOOP;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION batch_items_unlink() IS
  'The ledger rows of deleted experiences or train steps go with them.';

CREATE FUNCTION ledger_ids_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: an id the ledger names does not change (UPDATE of %)', TG_TABLE_NAME,
        TG_ARGV[0] USING ERRCODE = 'check_violation';
END $$;
"""
# Each trigger, by the parent it is on; the parent's partitions get the same.
TRIGGERS = {
    "batch_items": [
        "CREATE TRIGGER batch_items_keys AFTER INSERT ON {table} REFERENCING NEW TABLE AS added "
        "FOR EACH STATEMENT EXECUTE FUNCTION batch_items_keys()",
        "CREATE TRIGGER batch_items_keys_update AFTER UPDATE ON {table} REFERENCING NEW TABLE "
        "AS added FOR EACH STATEMENT EXECUTE FUNCTION batch_items_keys()",
    ],
    "experience_state": [
        "CREATE TRIGGER batch_items_unlink AFTER DELETE ON {table} REFERENCING OLD TABLE AS "
        "removed FOR EACH STATEMENT EXECUTE FUNCTION batch_items_unlink()",
        "CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id, run_id ON {table} FOR EACH "
        "STATEMENT EXECUTE FUNCTION ledger_ids_kept('id, run_id')",
    ],
}
STEP_TRIGGERS = """
CREATE TRIGGER batch_items_unlink AFTER DELETE ON train_steps REFERENCING OLD TABLE AS removed
    FOR EACH STATEMENT EXECUTE FUNCTION batch_items_unlink();
CREATE TRIGGER ledger_ids_kept AFTER UPDATE OF id ON train_steps
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_ids_kept('id');
"""


def _per_partition(parent: str, triggers: list[str]) -> str:
    """PL/pgSQL that gives the run's new partition of `parent` these triggers."""
    return "".join(
        f"""
            IF part.parent = '{parent}' THEN
                EXECUTE format('{trigger.format(table="%I").replace("'", "''")}',
                               part.parent || '_r' || run);
            END IF;""" for trigger in triggers)


# experience_partitions_add as 0016 left it, its ledger partition without 0014's key and each
# new partition with this revision's triggers.
_LEDGER_KEY = "(3, 'batch_items', 'experience_id_fkey', '(run_id, experience_id)', 'experience_state')"
_LAST = """            END IF;
        END IF;
    END LOOP;"""
_NEW_TRIGGERS = "".join(_per_partition(parent, TRIGGERS[parent])
                        for parent in ("experience_state", "batch_items"))
PARTITIONS = (_0016.PARTITIONS
              .replace(_LEDGER_KEY, "(3, 'batch_items', NULL, NULL, NULL)")
              .replace(_LAST, "            END IF;" + _NEW_TRIGGERS + "\n        END IF;\n    END LOOP;")
              .replace("each with its foreign key to the run''s partition it names",
                       "the state partition''s key to the data partition, and their triggers"))
assert PARTITIONS.count("CREATE TRIGGER") == 5 and _LEDGER_KEY not in PARTITIONS, \
    "0016's experience_partitions_add changed"


def _partitions(parent: str) -> list[str]:
    """The partitions of `parent` there are (an archived run has none)."""
    return op.get_bind().exec_driver_sql(
        "SELECT inhrelid::regclass::text FROM pg_inherits "
        f"WHERE inhparent = '{parent}'::regclass ORDER BY 1").scalars().all()


def _ledger_keys() -> list[tuple[str, str]]:
    """(table, key) of the ledger's foreign keys declared on the parent or a partition alone."""
    return op.get_bind().exec_driver_sql("""
        SELECT conrelid::regclass::text, conname FROM pg_constraint
        WHERE contype = 'f' AND conparentid = 0
          AND conrelid IN (SELECT 'batch_items'::regclass UNION ALL
                           SELECT inhrelid FROM pg_inherits
                           WHERE inhparent = 'batch_items'::regclass)
        ORDER BY 1, 2""").all()


def upgrade() -> None:
    for table, key in _ledger_keys():
        op.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{key}"')
    op.execute(FUNCTIONS)
    op.execute(STEP_TRIGGERS)
    for parent, triggers in TRIGGERS.items():
        for table in [parent] + _partitions(parent):
            for trigger in triggers:
                op.execute(trigger.format(table=table))
    op.execute(PARTITIONS)


def _name(trigger: str) -> str:
    return trigger.split()[2]


def downgrade() -> None:
    op.execute(_0016.PARTITIONS)
    for parent, triggers in TRIGGERS.items():
        for table in [parent] + _partitions(parent):
            for trigger in triggers:
                op.execute(f"DROP TRIGGER {_name(trigger)} ON {table}")
    op.execute("DROP TRIGGER batch_items_unlink ON train_steps; "
               "DROP TRIGGER ledger_ids_kept ON train_steps; "
               "DROP FUNCTION batch_items_keys(); DROP FUNCTION batch_items_unlink(); "
               "DROP FUNCTION ledger_ids_kept();")
    op.execute("ALTER TABLE batch_items ADD CONSTRAINT batch_items_train_step_id_fkey1 "
               "FOREIGN KEY (train_step_id) REFERENCES train_steps (id) ON DELETE CASCADE")
    for table in _partitions("batch_items"):
        run = table.rsplit("_r", 1)[1]
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_experience_id_fkey "
                   f"FOREIGN KEY (run_id, experience_id) REFERENCES experience_state_r{run} "
                   "(run_id, id) ON DELETE CASCADE")
