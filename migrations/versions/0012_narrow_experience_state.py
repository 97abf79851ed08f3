"""experiences: a narrow state row beside the wide data row, and a view of both

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

A lease and a step commit used to rewrite the whole ~2 KB experience row (and every index entry
of it) twice. Now:

- `experience_data` (the old table, renamed): what is written once: texts, token ids, logprobs,
  mask, rewards, metadata, parent.
- `experience_state`: what the sampler, the ledger and pipelines change and what leases order
  and filter by: group, policy version, status, priority, times sampled, lease, created_at
  (~100 bytes a row), with the partial indexes that serve leases.
- `experiences`: a view of both under the old column names, in the old order. Inserts,
  updates and deletes through it go to the right table (INSTEAD OF triggers); an update that
  changes a row's state applies only if the state is still what the statement read, else it
  fails with a serialization error (SQLSTATE 40001), so a pipeline's update can never overwrite
  a lease taken meanwhile. The hot paths (writer, sampler, ledger) use the tables directly.

The ledger's foreign key (batch_items.experience_id) now names `experience_state`: the key
check locks the referenced row, and the step's own UPDATE already holds the narrow one, so a
commit no longer marks the wide data rows it trains on.

Existing rows move: their state is copied into `experience_state`; the moved columns are dropped
from `experience_data` (their bytes stay in old tuples until those are rewritten). Analytics
views are recreated unchanged on the view.
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

EXPERIENCE_STATUSES = ("raw", "ready", "leased", "consumed", "quarantined", "retired", "held")
STATE = ("group_id", "group_row", "policy_version", "status", "priority", "times_sampled",
         "lease_token", "leased_until", "created_at")
DATA = ("task_id", "prompt_text", "response_text", "prompt_ids", "response_ids", "logprobs",
        "action_mask", "reward", "shaped_reward", "reward_components", "metadata", "parent_id")
ORDER = ("id", "run_id", "task_id", "group_id", "group_row", "policy_version", "prompt_text",
         "response_text", "prompt_ids", "response_ids", "logprobs", "action_mask", "reward",
         "shaped_reward", "reward_components", "metadata", "status", "priority", "times_sampled",
         "lease_token", "leased_until", "parent_id", "prompt_len", "response_len", "created_at")


# The state's columns after id and run_id, as CREATE TABLE declares them.
STATE_COLUMNS = """group_id uuid NOT NULL, group_row smallint NOT NULL,
    policy_version integer NOT NULL, status text NOT NULL DEFAULT 'ready',
    priority float8 NOT NULL DEFAULT 0, times_sampled integer NOT NULL DEFAULT 0,
    lease_token uuid, leased_until timestamptz, created_at timestamptz NOT NULL DEFAULT now()"""


def _lease_indexes(table: str) -> str:
    """The indexes that serve leases, on the table that holds the state (named after it)."""
    return f"""
CREATE INDEX {table}_ready ON {table} (run_id, created_at, id) WHERE status = 'ready';
CREATE INDEX {table}_ready_priority ON {table} (run_id, priority DESC, id)
    WHERE status = 'ready';
CREATE INDEX {table}_leased ON {table} (leased_until) WHERE status = 'leased';
CREATE UNIQUE INDEX {table}_group_row ON {table} (group_id, group_row);
CREATE INDEX {table}_run_status ON {table} (run_id, status);
CREATE INDEX {table}_lease_token ON {table} (lease_token) WHERE lease_token IS NOT NULL;
"""


def _state_checks(table: str) -> list[str]:
    """The state's CHECK constraints (named after the table that holds them)."""
    return [f"CONSTRAINT {table}_status_valid CHECK (status IN {EXPERIENCE_STATUSES})",
            f"CONSTRAINT {table}_lease_iff_leased "
            "CHECK ((status = 'leased') = (lease_token IS NOT NULL))",
            f"CONSTRAINT {table}_group_row_valid CHECK (group_row >= 0)"]


def _columns(prefix: str, names) -> str:
    return ", ".join(f"{prefix}{name}" for name in names)


def _view() -> str:
    source = {name: "s" if name in STATE else "d" for name in ORDER}
    source["id"] = source["run_id"] = "s"
    columns = ", ".join(f"{source[name]}.{name}" for name in ORDER)
    return f"""
CREATE VIEW experiences AS
SELECT {columns}
FROM experience_state s LEFT JOIN experience_data d ON d.id = s.id;
COMMENT ON VIEW experiences IS
  'Every experience: its data (experience_data) and state (experience_state) under one name.';
ALTER VIEW experiences ALTER COLUMN id SET DEFAULT nextval('experience_data_id_seq');
ALTER VIEW experiences ALTER COLUMN status SET DEFAULT 'ready';
ALTER VIEW experiences ALTER COLUMN priority SET DEFAULT 0;
ALTER VIEW experiences ALTER COLUMN times_sampled SET DEFAULT 0;
ALTER VIEW experiences ALTER COLUMN reward_components SET DEFAULT '{{}}'::jsonb;
ALTER VIEW experiences ALTER COLUMN metadata SET DEFAULT '{{}}'::jsonb;
ALTER VIEW experiences ALTER COLUMN created_at SET DEFAULT now();
"""


def _triggers() -> str:
    data, state = ("id", "run_id") + DATA, ("id", "run_id") + STATE
    same_state = f"({_columns('s.', STATE)}) IS NOT DISTINCT FROM ({_columns('OLD.', STATE)})"
    return f"""
CREATE FUNCTION experiences_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO experience_data ({_columns('', data)}) VALUES ({_columns('NEW.', data)})
    RETURNING prompt_len, response_len INTO NEW.prompt_len, NEW.response_len;
    INSERT INTO experience_state ({_columns('', state)}) VALUES ({_columns('NEW.', state)});
    RETURN NEW;
END $$;

CREATE FUNCTION experiences_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id IS DISTINCT FROM OLD.id OR NEW.run_id IS DISTINCT FROM OLD.run_id THEN
        RAISE EXCEPTION 'experiences: an experience keeps its id and run'
            USING ERRCODE = 'check_violation';
    END IF;
    IF ({_columns('NEW.', STATE)}) IS DISTINCT FROM ({_columns('OLD.', STATE)}) THEN
        UPDATE experience_state s SET ({_columns('', STATE)}) = ({_columns('NEW.', STATE)})
        WHERE s.id = OLD.id AND {same_state};
        IF NOT FOUND THEN
            RAISE EXCEPTION 'experience % changed while this statement updated it', OLD.id
                USING ERRCODE = 'serialization_failure';
        END IF;
    END IF;
    IF ({_columns('NEW.', DATA)}) IS DISTINCT FROM ({_columns('OLD.', DATA)}) THEN
        UPDATE experience_data SET ({_columns('', DATA)}) = ({_columns('NEW.', DATA)})
        WHERE id = OLD.id RETURNING prompt_len, response_len
        INTO NEW.prompt_len, NEW.response_len;
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION experiences_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM experience_data WHERE id = OLD.id;
    RETURN OLD;
END $$;

CREATE TRIGGER experiences_insert INSTEAD OF INSERT ON experiences
    FOR EACH ROW EXECUTE FUNCTION experiences_insert();
CREATE TRIGGER experiences_update INSTEAD OF UPDATE ON experiences
    FOR EACH ROW EXECUTE FUNCTION experiences_update();
CREATE TRIGGER experiences_delete INSTEAD OF DELETE ON experiences
    FOR EACH ROW EXECUTE FUNCTION experiences_delete();
"""


def _save_analytics_views() -> list[tuple[str, str, str | None]]:
    """(name, definition, comment) of every analytics view, then drop them all."""
    rows = op.get_bind().exec_driver_sql("""
        SELECT c.relname, pg_get_viewdef(c.oid), obj_description(c.oid, 'pg_class')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'analytics' AND c.relkind = 'v' ORDER BY c.oid""").all()
    for name, _, _ in rows:
        op.execute(f'DROP VIEW IF EXISTS analytics."{name}" CASCADE')
    return [tuple(row) for row in rows]


def _restore_analytics_views(saved) -> None:
    """Create the saved views again (a view may read another: retry until all exist)."""
    bind, pending = op.get_bind(), list(saved)
    while pending:
        failed = []
        for name, definition, comment in pending:
            savepoint = bind.begin_nested()
            try:
                bind.exec_driver_sql(f'CREATE VIEW analytics."{name}" AS {definition}')
                savepoint.commit()
            except Exception:
                savepoint.rollback()
                failed.append((name, definition, comment))
                continue
            if comment is not None:
                bind.exec_driver_sql(f'COMMENT ON VIEW analytics."{name}" IS %(c)s', {"c": comment})
        if len(failed) == len(pending):
            raise RuntimeError(f"analytics views could not be recreated: {[f[0] for f in failed]}")
        pending = failed
    op.execute("GRANT SELECT ON ALL TABLES IN SCHEMA analytics TO reservoir_reader")


def _ledger_names(table: str) -> None:
    op.execute(f"""
        ALTER TABLE batch_items DROP CONSTRAINT batch_items_experience_id_fkey,
            ADD CONSTRAINT batch_items_experience_id_fkey FOREIGN KEY (experience_id)
            REFERENCES {table} (id) ON DELETE CASCADE""")


def upgrade() -> None:
    saved = _save_analytics_views()
    op.execute("""
        ALTER TABLE experiences RENAME TO experience_data;
        ALTER SEQUENCE experiences_id_seq RENAME TO experience_data_id_seq;
        ALTER INDEX experiences_pkey RENAME TO experience_data_pkey;
        ALTER INDEX experiences_task RENAME TO experience_data_task;
        ALTER INDEX experiences_parent RENAME TO experience_data_parent;
        CREATE INDEX experience_data_run ON experience_data (run_id);""")
    op.execute(f"""
        CREATE TABLE experience_state (
            id bigint PRIMARY KEY REFERENCES experience_data (id) ON DELETE CASCADE,
            run_id bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            {STATE_COLUMNS},
            {", ".join(_state_checks("experience_state"))}
        );
        INSERT INTO experience_state (id, run_id, {_columns('', STATE)})
        SELECT id, run_id, {_columns('', STATE)} FROM experience_data;""")
    op.execute(_lease_indexes("experience_state"))
    _ledger_names("experience_state")
    op.execute("ALTER TABLE experience_data " + ", ".join(f"DROP COLUMN {name}" for name in STATE))
    op.execute(_view())
    op.execute(_triggers())
    _restore_analytics_views(saved)


def downgrade() -> None:
    saved = _save_analytics_views()
    op.execute("""
        DROP VIEW experiences;
        DROP FUNCTION experiences_insert(), experiences_update(), experiences_delete();
        ALTER TABLE experience_data
            ADD COLUMN group_id uuid, ADD COLUMN group_row smallint,
            ADD COLUMN policy_version integer, ADD COLUMN status text DEFAULT 'ready',
            ADD COLUMN priority float8 DEFAULT 0, ADD COLUMN times_sampled integer DEFAULT 0,
            ADD COLUMN lease_token uuid, ADD COLUMN leased_until timestamptz,
            ADD COLUMN created_at timestamptz DEFAULT now();""")
    op.execute(f"""
        UPDATE experience_data d SET ({_columns('', STATE)}) = ({_columns('s.', STATE)})
        FROM experience_state s WHERE s.id = d.id;
        DROP INDEX experience_data_run;""")
    _ledger_names("experience_data")
    op.execute(f"""
        DROP TABLE experience_state;
        ALTER INDEX experience_data_pkey RENAME TO experiences_pkey;
        ALTER INDEX experience_data_task RENAME TO experiences_task;
        ALTER INDEX experience_data_parent RENAME TO experiences_parent;
        ALTER SEQUENCE experience_data_id_seq RENAME TO experiences_id_seq;
        ALTER TABLE experience_data RENAME TO experiences;
        ALTER TABLE experiences
            ALTER COLUMN group_id SET NOT NULL, ALTER COLUMN group_row SET NOT NULL,
            ALTER COLUMN policy_version SET NOT NULL, ALTER COLUMN status SET NOT NULL,
            ALTER COLUMN priority SET NOT NULL, ALTER COLUMN times_sampled SET NOT NULL,
            ALTER COLUMN created_at SET NOT NULL,
            {", ".join("ADD " + check for check in _state_checks("experiences"))};""")
    op.execute(_lease_indexes("experiences"))
    _restore_analytics_views(saved)
